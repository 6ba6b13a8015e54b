//! Why a control command failed, as types: one [`Refusal`] variant per rule of SPEC.md §5 a
//! request can break, so tests assert which rule fired and each guest's refusals are
//! counted by rule; and [`RefusalLog`], which counts them and keeps a guest that sends
//! nothing but bad requests from flooding the host's log.

use std::collections::BTreeMap;
use std::time::Instant;

use vrdma_spec::ctrl::{Opcode, Status};

use super::cm_state::{CmCommand, IdState};
use crate::hostverbs;
use crate::log_budget::LogBudget;
use crate::mtt::MttError;

/// A request that breaks a rule of the specification (the guest's doing), with the status
/// the guest sees.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    // Framing (§5.1).
    #[error("request shorter than its header")]
    ShortRequest,
    #[error("unknown opcode {0}")]
    UnknownOpcode(u16),
    #[error("{opcode:?}: length {length}, {present} bytes present, {expected} expected")]
    RequestLength {
        opcode: Opcode,
        length: usize,
        present: usize,
        expected: usize,
    },
    #[error("{opcode:?}: {room} bytes for a {needed}-byte response")]
    ResponseRoom {
        opcode: Opcode,
        room: usize,
        needed: usize,
    },
    #[error("control chain {head} is malformed: {reason}; nothing was written to it")]
    MalformedChain { head: u16, reason: String },
    #[error("{room} bytes of room cannot hold a response header; nothing was written")]
    NoResponseRoom { room: usize },
    #[error("SET_NOTIFY_AREA first: the device was reset or has just started")]
    NoNotifyArea,
    #[error("SET_NOTIFY_AREA was already issued since the last reset")]
    NotifyAreaSet,

    // Connection management (§13).
    #[error("address {0} is not the driver's own (nor 0.0.0.0)")]
    ForeignAddress(String),
    #[error("{0}: not an IPv4 address (family 2, bytes past the address zero)")]
    NotIpv4(&'static str),
    #[error("port space {0:#x} is neither TCP (0x106) nor UDP (0x111)")]
    PortSpace(u32),
    #[error("the id cannot {} while {} (SPEC.md §13.3)", command.action(), state.name())]
    CmState { state: IdState, command: CmCommand },
    #[error("{0}")]
    CmHost(String),
    #[error("{len} bytes of private data: the message to {command} holds at most {max}")]
    PrivateData {
        command: &'static str,
        len: usize,
        max: usize,
    },
    #[error("QP {qp:#x} is connected by another CM id")]
    QpOfAnotherId { qp: u32 },

    // Field rules.
    #[error("{field} {value:#x}: unknown or disallowed bits {bits:#x}")]
    UnknownBits {
        field: &'static str,
        value: u32,
        bits: u32,
    },
    #[error("reserved fields must be zero")]
    Reserved,
    #[error("{field} {value} is not 0 or 1")]
    NotBoolean { field: &'static str, value: u8 },
    #[error("{field} {value} is not a power of two in {min}..={max}")]
    NotPowerOfTwo {
        field: &'static str,
        value: u32,
        min: u32,
        max: u32,
    },
    #[error("{field} {value} outside {min}..={max}")]
    OutOfRange {
        field: &'static str,
        value: u64,
        min: u64,
        max: u64,
    },
    #[error("{0} was not negotiated")]
    NotNegotiated(&'static str),
    #[error("QP type {0} is not RC (2) or UD (4)")]
    QpType(u8),
    #[error("a QP on an SRQ has no RQ: its RQ fields must be 0")]
    RqOnSrqQp,
    #[error("{queue} slots of {slot} bytes cannot hold {needed}")]
    SlotTooSmall {
        queue: &'static str,
        slot: u64,
        needed: u64,
    },
    #[error("remote write or atomic access requires local write")]
    RemoteWithoutLocalWrite,
    #[error("SRQ limit {limit} is not below the SRQ's depth {depth}")]
    SrqLimit { limit: u32, depth: u32 },
    #[error("port {0} does not exist (only 1)")]
    NoSuchPort(u8),
    #[error("GID index {0} beyond the table (1 entry)")]
    GidIndex(u32),
    #[error("source GID index {0} is not the guest's GID (0)")]
    ForeignSourceGid(u8),
    #[error("an Ethernet (RoCE) port needs a global route (is_global 1)")]
    NoGlobalRoute,
    #[error("hop limit 0 with a global route")]
    ZeroHopLimit,
    #[error("QP state {0} does not exist")]
    NoSuchQpState(u32),
    #[error("P_Key index {0} beyond the table")]
    PkeyIndex(u16),
    #[error("Q_Keys with bit 31 set are privileged")]
    PrivilegedQkey,
    #[error("not a legal transition from the QP's state, or attributes missing for it: {0}")]
    QpTransition(String),
    #[error("the CQ holds {held} completions, more than a ring of {depth}")]
    CqHoldsMore { held: u32, depth: u32 },
    #[error("the CQ's ring, record or consumer index is unusable, or the CQ failed")]
    CqUnusable,
    #[error("the SRQ failed (SRQ_ERROR): it can only be destroyed")]
    SrqFailed,

    // Guest memory (§4, §6).
    #[error("{what} at {gpa:#x} is not {align}-byte aligned")]
    Misaligned {
        what: &'static str,
        gpa: u64,
        align: u64,
    },
    #[error("{0} overflows")]
    Overflow(&'static str),
    #[error("the range {addr:#x}+{len:#x} wraps around the address space")]
    AddressWraps { addr: u64, len: u64 },
    #[error("the notify area must lie inside one 4 KiB page")]
    NotifyAreaCrossesPage,
    #[error("the doorbell bitmap must be contiguous in guest-physical memory")]
    BitmapNotContiguous,
    #[error("a ring's pages must all be distinct")]
    RepeatedRingPage,
    #[error("QP {0:#x} is another guest's, connected to another QP")]
    ConnectedElsewhere(u32),
    #[error(transparent)]
    Pages(#[from] MttError),

    // Handles (§5.2).
    #[error("{handle:#x} is not a live {kind} handle")]
    BadHandle { kind: &'static str, handle: u32 },
    #[error("{kind} {handle:#x} is still used by {users} objects")]
    Busy {
        kind: &'static str,
        handle: u32,
        users: u32,
    },

    // Quotas.
    #[error("{kind} quota of {max} reached")]
    Quota { kind: &'static str, max: u32 },
    #[error("{bytes} more bytes of {kind} exceed the quota of {quota} ({used} in use)")]
    ByteQuota {
        kind: &'static str,
        bytes: u64,
        quota: u64,
        used: u64,
    },
    #[error("no doorbell bit is left for the notification queue")]
    NoDoorbellBit,
}

impl Refusal {
    /// The status the guest sees.
    pub fn status(&self) -> Status {
        use Refusal::*;
        match self {
            // The first two are never answered: there is nowhere to write the status.
            MalformedChain { .. }
            | NoResponseRoom { .. }
            | ShortRequest
            | RequestLength { .. }
            | ResponseRoom { .. } => Status::BadLength,
            UnknownOpcode(_) | NotNegotiated(_) => Status::Unsupported,
            NoNotifyArea => Status::NotReady,
            Misaligned { .. }
            | AddressWraps { .. }
            | NotifyAreaCrossesPage
            | BitmapNotContiguous => Status::BadAddress,
            Pages(e) => e.status(),
            BadHandle { .. } => Status::BadHandle,
            Busy { .. } => Status::Busy,
            Quota { .. } | ByteQuota { .. } | NoDoorbellBit => Status::NoResources,
            NotifyAreaSet
            | ForeignAddress(_)
            | NotIpv4(_)
            | PortSpace(_)
            | CmState { .. }
            | CmHost(_)
            | PrivateData { .. }
            | QpOfAnotherId { .. }
            | UnknownBits { .. }
            | Reserved
            | NotBoolean { .. }
            | NotPowerOfTwo { .. }
            | OutOfRange { .. }
            | QpType(_)
            | RqOnSrqQp
            | SlotTooSmall { .. }
            | RemoteWithoutLocalWrite
            | SrqLimit { .. }
            | NoSuchPort(_)
            | GidIndex(_)
            | ForeignSourceGid(_)
            | NoGlobalRoute
            | ZeroHopLimit
            | NoSuchQpState(_)
            | PkeyIndex(_)
            | PrivilegedQkey
            | QpTransition(_)
            | CqHoldsMore { .. }
            | CqUnusable
            | SrqFailed
            | Overflow(_)
            | RepeatedRingPage
            | ConnectedElsewhere(_) => Status::InvalidArgument,
        }
    }

    /// The response's `detail` (SPEC.md §5.1): EINVAL for a command the state of its object
    /// does not allow (a QP's transition, a CM id's command, as the device or the host's
    /// connection manager found), as a native device's call fails.
    pub fn detail(&self) -> u32 {
        match self {
            Refusal::QpTransition(_)
            | Refusal::CmState { .. }
            | Refusal::CmHost(_)
            | Refusal::CqHoldsMore { .. }
            | Refusal::SrqFailed => libc::EINVAL as u32,
            _ => 0,
        }
    }

    /// The rule's name, what refusals are counted under: the variant, and for rules about a
    /// named field or object, that name too.
    pub fn rule(&self) -> String {
        let debug = format!("{self:?}");
        let variant = debug
            .split(|c: char| !c.is_alphanumeric())
            .next()
            .unwrap_or_default();
        match self {
            Refusal::UnknownBits { field, .. }
            | Refusal::NotBoolean { field, .. }
            | Refusal::NotPowerOfTwo { field, .. }
            | Refusal::OutOfRange { field, .. } => format!("{variant}({field})"),
            Refusal::CmState { command, .. } => format!("{variant}({command:?})"),
            Refusal::NotNegotiated(what) | Refusal::Overflow(what) => {
                format!("{variant}({what})")
            }
            Refusal::BadHandle { kind, .. }
            | Refusal::Busy { kind, .. }
            | Refusal::Quota { kind, .. }
            | Refusal::ByteQuota { kind, .. } => format!("{variant}({kind})"),
            Refusal::Pages(e) => {
                let inner = format!("{e:?}");
                let inner = inner.split(|c: char| !c.is_alphanumeric()).next();
                format!("{variant}({})", inner.unwrap_or_default())
            }
            _ => variant.to_string(),
        }
    }
}

/// A control command that was not carried out: refused by a rule, or failed by the host.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// The host refused or failed what the device asked of it; `errno` is its reason.
    #[error("{message}")]
    Host {
        status: Status,
        errno: u32,
        message: String,
    },
}

impl CommandError {
    pub fn status(&self) -> Status {
        match self {
            CommandError::Refused(refusal) => refusal.status(),
            CommandError::Host { status, .. } => *status,
        }
    }

    pub fn detail(&self) -> u32 {
        match self {
            CommandError::Refused(refusal) => refusal.detail(),
            CommandError::Host { errno, .. } => *errno,
        }
    }

    /// The rule that refused the command; `None` when the host failed it.
    pub fn refusal(&self) -> Option<&Refusal> {
        match self {
            CommandError::Refused(refusal) => Some(refusal),
            CommandError::Host { .. } => None,
        }
    }
}

impl From<hostverbs::Error> for CommandError {
    fn from(e: hostverbs::Error) -> Self {
        let errno = e.errno().unwrap_or(libc::EIO);
        let status = if errno == libc::ENOMEM {
            Status::NoResources
        } else {
            Status::HostError
        };
        CommandError::Host {
            status,
            errno: errno.unsigned_abs(),
            message: e.to_string(),
        }
    }
}

impl From<MttError> for CommandError {
    fn from(e: MttError) -> Self {
        CommandError::Refused(Refusal::Pages(e))
    }
}

/// One connection's failed commands: counted by rule (host failures apart), and logged
/// within the connection's [`LogBudget`].
#[derive(Debug)]
pub struct RefusalLog {
    by_rule: BTreeMap<String, u64>,
    host_failures: u64,
    budget: LogBudget,
}

impl RefusalLog {
    /// A log drawing its lines from `budget` (the connection's).
    pub fn new(budget: LogBudget) -> Self {
        RefusalLog {
            by_rule: BTreeMap::new(),
            host_failures: 0,
            budget,
        }
    }

    /// Counts `error` and returns the line to log for it, unless this connection has
    /// logged its share for now (the next line logged says how many were left out).
    pub fn record(&mut self, error: &CommandError, now: Instant) -> Option<String> {
        match error.refusal() {
            Some(refusal) => *self.by_rule.entry(refusal.rule()).or_default() += 1,
            None => self.host_failures += 1,
        }
        self.budget.admit(
            || {
                let rule = error.refusal().map_or("host".into(), Refusal::rule);
                format!(
                    "control request refused ({:?}, {rule}): {error}",
                    error.status()
                )
            },
            now,
        )
    }

    /// Refusals so far, by rule.
    pub fn by_rule(&self) -> &BTreeMap<String, u64> {
        &self.by_rule
    }

    /// Commands the host failed so far.
    pub fn host_failures(&self) -> u64 {
        self.host_failures
    }

    /// One line for the connection's end: the counts by rule, or `None` if nothing failed.
    pub fn summary(&self) -> Option<String> {
        if self.by_rule.is_empty() && self.host_failures == 0 {
            return None;
        }
        let mut parts: Vec<String> = self
            .by_rule
            .iter()
            .map(|(rule, count)| format!("{rule} x{count}"))
            .collect();
        if self.host_failures > 0 {
            parts.push(format!("host failures x{}", self.host_failures));
        }
        Some(parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log_budget::{LINES_PER_WINDOW, WINDOW};

    fn quota() -> CommandError {
        Refusal::Quota { kind: "QP", max: 4 }.into()
    }

    #[test]
    fn rules_are_named_by_variant_and_subject() {
        assert_eq!(
            Refusal::OutOfRange {
                field: "timeout",
                value: 32,
                min: 0,
                max: 31
            }
            .rule(),
            "OutOfRange(timeout)"
        );
        assert_eq!(Refusal::Reserved.rule(), "Reserved");
        assert_eq!(Refusal::PkeyIndex(3).rule(), "PkeyIndex");
        assert_eq!(
            Refusal::Pages(MttError::PageCount {
                npages: 1,
                expected: 2
            })
            .rule(),
            "Pages(PageCount)"
        );
        assert_eq!(quota().refusal().unwrap().rule(), "Quota(QP)");
        assert_eq!(quota().status(), Status::NoResources);
    }

    #[test]
    fn refusals_are_counted_by_rule_and_logged_at_a_bounded_rate() {
        let mut log = RefusalLog::new(LogBudget::default());
        let start = Instant::now();
        let lines: Vec<_> = (0..25)
            .filter_map(|_| log.record(&quota(), start))
            .collect();
        assert_eq!(lines.len(), LINES_PER_WINDOW as usize);
        assert!(lines[0].contains("Quota(QP)"), "{}", lines[0]);
        let host = CommandError::Host {
            status: Status::HostError,
            errno: 5,
            message: "EIO".into(),
        };
        assert_eq!(log.record(&host, start + WINDOW / 2), None);
        // A new window: logged again, saying how many were left out.
        let next = log
            .record(&Refusal::Reserved.into(), start + WINDOW)
            .unwrap();
        assert!(next.contains("16 more not logged"), "{next}");
        assert_eq!(log.by_rule()["Quota(QP)"], 25);
        assert_eq!(log.by_rule()["Reserved"], 1);
        assert_eq!(log.host_failures(), 1);
        assert_eq!(
            log.summary().unwrap(),
            "Quota(QP) x25, Reserved x1, host failures x1"
        );
        assert_eq!(RefusalLog::new(LogBudget::default()).summary(), None);
    }
}
