//! Work queue entries read from a guest ring, checked against SPEC.md §7 and turned into host
//! work requests. Pure: the caller supplies the slot's bytes (see [`Slot`]) and the MR table.

use vrdma_spec::codec::{
    sge_offset, SendForm, SendOpcode, WqeFormatError, WqePayload, RECV_WQE_HEADER, SEND_WQE_HEADER,
};
use vrdma_spec::ring::{wc_status, wqe_flags, RecvWqe, SendWqe, Sge as WireSge};
use vrdma_spec::ByteValued;

use std::sync::Arc;

use crate::hostverbs::{AddressHandle, OneSgeSend, Payload, SendFlags, SendWr, Sge, UdDest};

/// Why a WQE was refused: one variant per rule (SPEC.md §7), each with the completion
/// status that reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WqeError {
    #[error(transparent)]
    Format(#[from] WqeFormatError),
    #[error("UD QPs only send")]
    UdNotSend,
    #[error("RDMA READ and atomics need an RC QP")]
    NeedsReliable,
    #[error("atomics were not negotiated")]
    AtomicsNotNegotiated,
    #[error("INLINE only with SEND or RDMA WRITE")]
    InlineOperation,
    #[error("inline payload of {0} bytes does not fit")]
    InlineTooLong(u32),
    #[error("{0} SGEs exceed the queue's limit")]
    TooManySges(usize),
    #[error("an atomic takes exactly one 8-byte SGE")]
    AtomicSge,
    #[error("atomic target {0:#x} is not 8-byte aligned")]
    AtomicAlignment(u64),
    #[error("remote QPN {0:#x} exceeds 24 bits")]
    RemoteQpn(u32),
    #[error("SGE {index}: lkey {lkey:#x} is not an MR of this guest")]
    UnknownLkey { index: usize, lkey: u32 },
    #[error("SGE {index}: lkey {lkey:#x} belongs to another PD")]
    OtherPd { index: usize, lkey: u32 },
    #[error("SGE {index}: {addr:#x}+{length:#x} outside its MR")]
    OutsideMr {
        index: usize,
        addr: u64,
        length: u32,
    },
    #[error("AH {0:#x} is not an AH of the QP's PD")]
    UnknownAh(u32),
    #[error("the ring is unreadable")]
    RingUnreadable,
    #[error("the host cannot take it")]
    Unpostable,
}

impl WqeError {
    /// The `ibv_wc_status` of the refused WQE's completion (SPEC.md §7.5).
    pub fn status(&self) -> u8 {
        match self {
            WqeError::UnknownLkey { .. }
            | WqeError::OtherPd { .. }
            | WqeError::OutsideMr { .. }
            | WqeError::UnknownAh(_) => wc_status::LOC_PROT_ERR,
            _ => wc_status::LOC_QP_OP_ERR,
        }
    }
}

/// A registered range an lkey names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrRange {
    pub pd: u32,
    pub start: u64,
    pub len: u64,
}

/// What a QP allows in its WQEs.
#[derive(Clone, Copy, Debug)]
pub struct QpRules {
    pub pd: u32,
    pub ud: bool,
    /// RC: RDMA READ and atomics are allowed (not on UC or UD).
    pub reliable: bool,
    pub atomics: bool,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline: u32,
    pub sq_stride: usize,
    pub rq_stride: usize,
}

/// The bytes of one ring slot, wherever they are: guest memory (the data path) or a copy
/// (tests, fuzzing). A parser reads each field once, so a guest rewriting its slot meanwhile
/// changes nothing about what was checked.
pub trait Slot {
    /// The wire struct at `offset`, read whole; `None` past the slot's end.
    fn field<T: ByteValued + Default>(&self, offset: usize) -> Option<T>;
    /// The wire struct at `offset` of which only the first `len` bytes (a multiple of 8) are
    /// read, the others left default: for a reader that uses only the fields up there. `None`
    /// past the slot's end, or if `len` is not such a part of a `T`.
    fn field_head<T: ByteValued + Default>(&self, offset: usize, len: usize) -> Option<T>;
    /// Fills `out` from `offset`; false past the slot's end.
    fn copy_bytes(&self, offset: usize, out: &mut [u8]) -> bool;
}

impl Slot for [u8] {
    fn field<T: ByteValued + Default>(&self, offset: usize) -> Option<T> {
        vrdma_spec::read_wire(self.get(offset..)?)
    }

    fn field_head<T: ByteValued + Default>(&self, offset: usize, len: usize) -> Option<T> {
        if len > size_of::<T>() || !len.is_multiple_of(8) {
            return None;
        }
        let mut value = T::default();
        value.as_mut_slice()[..len].copy_from_slice(self.get(offset..)?.get(..len)?);
        Some(value)
    }

    fn copy_bytes(&self, offset: usize, out: &mut [u8]) -> bool {
        let Some(bytes) = offset
            .checked_add(out.len())
            .and_then(|end| self.get(offset..end))
        else {
            return false;
        };
        out.copy_from_slice(bytes);
        true
    }
}

/// A wire struct from a slot. Callers check that the slot's stride holds what they read, so
/// a shorter slot is a ring that cannot be read, not a reason to panic.
#[inline(always)]
fn read<T: ByteValued + Default>(
    slot: &(impl Slot + ?Sized),
    offset: usize,
) -> Result<T, WqeError> {
    slot.field(offset).ok_or(WqeError::RingUnreadable)
}

/// Checks the SGEs from `offset` in `slot`, as many as `out` holds, against the MR table into
/// `out`.
// Inlined, as is parse_send, into the poller's loop: called per WQE, returning by value, they
// cost more in moving their results than in checking.
#[inline(always)]
fn check_sges(
    slot: &(impl Slot + ?Sized),
    offset: usize,
    rules: &QpRules,
    lookup: &impl Fn(u32) -> Option<MrRange>,
    out: &mut [Sge],
) -> Result<(), WqeError> {
    for (index, out) in out.iter_mut().enumerate() {
        *out = check_sge(slot, offset, index, rules, lookup)?;
    }
    Ok(())
}

/// Checks SGE `index` of those from `offset` in `slot` against the MR table.
#[inline(always)]
fn check_sge(
    slot: &(impl Slot + ?Sized),
    offset: usize,
    index: usize,
    rules: &QpRules,
    lookup: &impl Fn(u32) -> Option<MrRange>,
) -> Result<Sge, WqeError> {
    let sge: WireSge = read(slot, sge_offset(offset, index))?;
    let (addr, length, lkey) = (
        sge.addr.to_native(),
        sge.length.to_native(),
        sge.lkey.to_native(),
    );
    let mr = lookup(lkey).ok_or(WqeError::UnknownLkey { index, lkey })?;
    if mr.pd != rules.pd {
        return Err(WqeError::OtherPd { index, lkey });
    }
    let inside = addr >= mr.start
        && addr
            .checked_add(u64::from(length))
            .is_some_and(|end| end <= mr.start + mr.len);
    if !inside {
        return Err(WqeError::OutsideMr {
            index,
            addr,
            length,
        });
    }
    Ok(Sge { addr, length, lkey })
}

impl QpRules {
    /// Whether [`parse_common_send`] may take this QP's send WQEs: not UD (its sends name
    /// AHs), and slots that hold a header and an SGE.
    pub fn takes_common_sends(&self) -> bool {
        // RC only: the common form includes RDMA READ, which UC refuses.
        self.reliable
            && !self.ud
            && self.max_send_sge >= 1
            && sge_offset(SEND_WQE_HEADER, 1) <= self.sq_stride
    }
}

/// The flags a common send WQE may carry.
const COMMON_FLAGS: u8 = wqe_flags::SIGNALED | wqe_flags::SOLICITED | wqe_flags::FENCE;

/// The host's flags for each combination of a common send WQE's flags, looked up rather
/// than mapped bit by bit.
const COMMON_HOST_FLAGS: [SendFlags; COMMON_FLAGS as usize + 1] = {
    let mut flags = [SendFlags::new(false, false, false); COMMON_FLAGS as usize + 1];
    let mut wire = 0;
    while wire <= COMMON_FLAGS {
        flags[wire as usize] = SendFlags::new(
            wire & wqe_flags::SIGNALED != 0,
            wire & wqe_flags::SOLICITED != 0,
            wire & wqe_flags::FENCE != 0,
        );
        wire += 1;
    }
    flags
};

/// The operation of each wire opcode a common send WQE may have (none is an atomic), looked
/// up rather than matched.
const COMMON_OPCODES: [Option<SendOpcode>; 256] = {
    let mut opcodes = [None; 256];
    let mut wire = 0;
    while wire < opcodes.len() {
        #[expect(clippy::cast_possible_truncation, reason = "wire < opcodes.len(), 256")]
        let byte = wire as u8;
        opcodes[wire] = match SendOpcode::from_wire(byte) {
            Some(opcode) if !opcode.is_atomic() => Some(opcode),
            _ => None,
        };
        wire += 1;
    }
    opcodes
};

/// The part of a send WQE's header that holds every field a common send uses: what follows
/// is for atomics and UD.
const COMMON_HEAD: usize = std::mem::offset_of!(SendWqe, compare_add);
const _: () = {
    use std::mem::offset_of;
    assert!(COMMON_HEAD.is_multiple_of(8));
    let ends = [
        offset_of!(SendWqe, wr_id) + 8,
        offset_of!(SendWqe, opcode) + 1,
        offset_of!(SendWqe, flags) + 1,
        offset_of!(SendWqe, num_sge) + 1,
        offset_of!(SendWqe, imm_data) + 4,
        offset_of!(SendWqe, remote_addr) + 8,
        offset_of!(SendWqe, rkey) + 4,
    ];
    let mut field = 0;
    while field < ends.len() {
        assert!(ends[field] <= COMMON_HEAD);
        field += 1;
    }
};

/// The send WQE in `slot` if it has the common form, checked with the few steps a NIC's fast
/// path takes: not an atomic, not INLINE, one SGE. Its atomic operands are not read (they
/// are zero in the request, which does not use them). `None` for any other WQE, valid or not:
/// [`parse_send`] decides those. On a QP that [`QpRules::takes_common_sends`], what this
/// takes `parse_send` takes too, into the same request (a property test and the `wqe` fuzz
/// target check it); it only does less on the way.
#[inline(always)]
pub fn parse_common_send(
    slot: &(impl Slot + ?Sized),
    rules: &QpRules,
    mrs: &impl Fn(u32) -> Option<MrRange>,
) -> Option<OneSgeSend> {
    let wqe: SendWqe = slot.field_head(0, COMMON_HEAD)?;
    if wqe.flags & !COMMON_FLAGS != 0 || wqe.num_sge != 1 {
        return None;
    }
    let opcode = COMMON_OPCODES[usize::from(wqe.opcode)]?;
    let sge = check_sge(slot, SEND_WQE_HEADER, 0, rules, mrs).ok()?;
    Some(OneSgeSend {
        wr_id: wqe.wr_id.to_native(),
        opcode,
        flags: COMMON_HOST_FLAGS[usize::from(wqe.flags & COMMON_FLAGS)],
        operands: wqe.operands(),
        sge,
    })
}

/// Parses and validates the send WQE in `slot` (one SQ slot) into the host's request: its
/// SGEs go to the start of `sges`, its inline payload to the start of `inline`, a UD
/// destination is looked up with `ahs` (an AH's PD and the host AH).
#[inline(always)]
pub fn parse_send<'w, 'h: 'w>(
    slot: &(impl Slot + ?Sized),
    rules: &QpRules,
    mrs: &impl Fn(u32) -> Option<MrRange>,
    ahs: &impl Fn(u32) -> Option<(u32, &'h Arc<AddressHandle>)>,
    sges: &'w mut [Sge],
    inline: &'w mut [u8],
) -> Result<SendWr<'w>, WqeError> {
    let wqe: SendWqe = read(slot, 0)?;
    let SendForm { opcode, payload } = wqe.form()?;
    if rules.ud && !opcode.is_send() {
        return Err(WqeError::UdNotSend);
    }
    if !rules.reliable && opcode.needs_reliable() {
        return Err(WqeError::NeedsReliable);
    }
    if opcode.is_atomic() && !rules.atomics {
        return Err(WqeError::AtomicsNotNegotiated);
    }
    let remote_addr = wqe.remote_addr.to_native();
    let payload = match payload {
        WqePayload::Inline(wire_len) => {
            let len = wire_len as usize;
            if !opcode.may_be_inline() {
                return Err(WqeError::InlineOperation);
            }
            if len > rules.max_inline as usize
                || SEND_WQE_HEADER + len > rules.sq_stride
                || len > inline.len()
            {
                return Err(WqeError::InlineTooLong(wire_len));
            }
            let inline = &mut inline[..len];
            if !slot.copy_bytes(SEND_WQE_HEADER, inline) {
                return Err(WqeError::InlineTooLong(wire_len));
            }
            Payload::Inline(inline)
        }
        WqePayload::Sges(count) => {
            let count = usize::from(count);
            if count > rules.max_send_sge as usize
                || count > sges.len()
                || sge_offset(SEND_WQE_HEADER, count) > rules.sq_stride
            {
                return Err(WqeError::TooManySges(count));
            }
            let sges = &mut sges[..count];
            check_sges(slot, SEND_WQE_HEADER, rules, mrs, sges)?;
            if opcode.is_atomic() {
                if count != 1 || sges[0].length != 8 {
                    return Err(WqeError::AtomicSge);
                }
                if !remote_addr.is_multiple_of(8) {
                    return Err(WqeError::AtomicAlignment(remote_addr));
                }
            }
            Payload::Sges(sges)
        }
    };
    let ud = if rules.ud {
        let remote_qpn = wqe.remote_qpn.to_native();
        if remote_qpn >= 1 << 24 {
            return Err(WqeError::RemoteQpn(remote_qpn));
        }
        let handle = wqe.ah.to_native();
        let ah = match ahs(handle) {
            Some((pd, ah)) if pd == rules.pd => ah,
            _ => return Err(WqeError::UnknownAh(handle)),
        };
        Some(UdDest {
            ah,
            remote_qpn,
            remote_qkey: wqe.remote_qkey.to_native(),
        })
    } else {
        None
    };
    Ok(SendWr {
        wr_id: wqe.wr_id.to_native(),
        opcode,
        signaled: wqe.signaled(),
        solicited: wqe.solicited(),
        fence: wqe.fence(),
        operands: wqe.operands(),
        payload,
        ud,
    })
}

/// Parses and validates the receive WQE in `slot`; appends its SGEs; returns its wr_id.
pub fn parse_recv(
    slot: &(impl Slot + ?Sized),
    rules: &QpRules,
    lookup: &impl Fn(u32) -> Option<MrRange>,
    sges: &mut Vec<Sge>,
) -> Result<(u64, usize), WqeError> {
    let wqe: RecvWqe = read(slot, 0)?;
    let count = wqe.num_sge.to_native() as usize;
    if count > rules.max_recv_sge as usize || sge_offset(RECV_WQE_HEADER, count) > rules.rq_stride {
        return Err(WqeError::TooManySges(count));
    }
    let first = sges.len();
    sges.resize(first + count, Sge::default());
    if let Err(error) = check_sges(slot, RECV_WQE_HEADER, rules, lookup, &mut sges[first..]) {
        sges.truncate(first);
        return Err(error);
    }
    Ok((wqe.wr_id.to_native(), count))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use vrdma_spec::codec::strategies::send_header;
    use vrdma_spec::codec::{SendOperands, UdAddress};
    use vrdma_spec::ring::wr_opcode;
    use vrdma_spec::{Le32, Le64};

    const RULES: QpRules = QpRules {
        pd: 7,
        ud: false,
        reliable: true,
        atomics: true,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline: 64,
        sq_stride: 128,
        rq_stride: 64,
    };
    const MR: MrRange = MrRange {
        pd: 7,
        start: 0x1000,
        len: 0x1000,
    };

    fn lookup(lkey: u32) -> Option<MrRange> {
        match lkey {
            1 => Some(MR),
            2 => Some(MrRange { pd: 8, ..MR }),
            _ => None,
        }
    }

    fn slot(wqe: SendWqe, sges: &[(u64, u32, u32)]) -> Vec<u8> {
        let mut bytes = wqe.as_slice().to_vec();
        for &(addr, length, lkey) in sges {
            let sge = WireSge {
                addr: Le64::from(addr),
                length: Le32::from(length),
                lkey: Le32::from(lkey),
            };
            bytes.extend_from_slice(sge.as_slice());
        }
        bytes.resize(RULES.sq_stride, 0);
        bytes
    }

    fn write(num_sge: u8) -> SendWqe {
        SendWqe {
            wr_id: Le64::from(42),
            opcode: wr_opcode::RDMA_WRITE,
            flags: wqe_flags::SIGNALED,
            num_sge,
            remote_addr: Le64::from(0x9000),
            rkey: Le32::from(5),
            ..Default::default()
        }
    }

    /// What a parsed request says, owned.
    #[derive(Debug)]
    struct Parsed {
        wr_id: u64,
        opcode: SendOpcode,
        remote: (u64, u32),
        signaled: bool,
        fence: bool,
        /// The SGEs, or the length of the inline payload.
        payload: Result<Vec<Sge>, usize>,
    }

    fn send(bytes: &[u8], rules: &QpRules) -> Result<Parsed, WqeError> {
        let (mut sges, mut inline) = ([Sge::default(); 4], [0; 64]);
        let no_ahs = |_| None;
        let wr = parse_send(bytes, rules, &lookup, &no_ahs, &mut sges, &mut inline)?;
        Ok(Parsed {
            wr_id: wr.wr_id,
            opcode: wr.opcode,
            remote: (wr.operands.remote_addr, wr.operands.rkey),
            signaled: wr.signaled,
            fence: wr.fence,
            payload: match wr.payload {
                Payload::Sges(sges) => Ok(sges.to_vec()),
                Payload::Inline(data) => Err(data.len()),
            },
        })
    }

    #[test]
    fn a_valid_write_becomes_a_host_request() {
        let parsed = send(&slot(write(2), &[(0x1000, 16, 1), (0x1ff0, 16, 1)]), &RULES).unwrap();
        assert_eq!(
            (parsed.opcode, parsed.remote),
            (SendOpcode::RdmaWrite, (0x9000, 5))
        );
        assert!(parsed.signaled && !parsed.fence);
        let sge = |addr| Sge {
            addr,
            length: 16,
            lkey: 1,
        };
        let expected = Ok(vec![sge(0x1000), sge(0x1ff0)]);
        assert_eq!((parsed.wr_id, parsed.payload), (42, expected));
    }

    #[test]
    fn sges_outside_the_guests_mrs_are_protection_errors() {
        for sge in [
            (0x1000, 16, 9),
            (0x1000, 16, 2),
            (0xff0, 32, 1),
            (0x1ff8, 16, 1),
            (u64::MAX - 4, 16, 1),
        ] {
            let err = send(&slot(write(1), &[sge]), &RULES).unwrap_err();
            assert_eq!(err.status(), wc_status::LOC_PROT_ERR, "{sge:?}: {err}");
            let (addr, length, lkey) = sge;
            let expected = match lkey {
                9 => WqeError::UnknownLkey { index: 0, lkey },
                2 => WqeError::OtherPd { index: 0, lkey },
                _ => WqeError::OutsideMr {
                    index: 0,
                    addr,
                    length,
                },
            };
            assert_eq!(err, expected);
        }
    }

    #[test]
    fn malformed_wqes_are_local_qp_operation_errors() {
        let cases = [
            (
                SendWqe {
                    opcode: 9,
                    ..write(0)
                },
                WqeError::Format(WqeFormatError::UnknownOpcode(9)),
            ),
            (
                SendWqe {
                    flags: 0x80,
                    ..write(0)
                },
                WqeError::Format(WqeFormatError::UnknownFlags(0x80)),
            ),
            (write(3), WqeError::TooManySges(3)),
            (
                SendWqe {
                    flags: wqe_flags::INLINE,
                    inline_len: Le32::from(65),
                    ..write(0)
                },
                WqeError::InlineTooLong(65),
            ),
            (
                SendWqe {
                    opcode: wr_opcode::RDMA_READ,
                    flags: wqe_flags::INLINE,
                    ..write(0)
                },
                WqeError::InlineOperation,
            ),
            (
                SendWqe {
                    opcode: wr_opcode::ATOMIC_FETCH_AND_ADD,
                    ..write(0)
                },
                WqeError::AtomicSge,
            ),
        ];
        for (wqe, expected) in cases {
            let err = send(&slot(wqe, &[]), &RULES).unwrap_err();
            assert_eq!(err, expected);
            assert_eq!(err.status(), wc_status::LOC_QP_OP_ERR, "{err}");
        }
        let misaligned = SendWqe {
            opcode: wr_opcode::ATOMIC_CMP_AND_SWP,
            remote_addr: Le64::from(0x9004),
            ..write(1)
        };
        assert_eq!(
            send(&slot(misaligned, &[(0x1000, 8, 1)]), &RULES).unwrap_err(),
            WqeError::AtomicAlignment(0x9004)
        );
        let no_atomics = QpRules {
            atomics: false,
            ..RULES
        };
        let atomic = SendWqe {
            opcode: wr_opcode::ATOMIC_FETCH_AND_ADD,
            ..write(1)
        };
        assert_eq!(
            send(&slot(atomic, &[(0x1000, 8, 1)]), &no_atomics).unwrap_err(),
            WqeError::AtomicsNotNegotiated
        );
        let ud = QpRules { ud: true, ..RULES };
        assert_eq!(
            send(&slot(write(0), &[]), &ud).unwrap_err(),
            WqeError::UdNotSend
        );
        // UC: SEND and WRITE, no READ or atomics.
        let uc = QpRules {
            reliable: false,
            ..RULES
        };
        assert!(send(&slot(write(0), &[(0x1000, 8, 1)]), &uc).is_ok());
        let read = SendWqe {
            opcode: wr_opcode::RDMA_READ,
            ..write(1)
        };
        for wqe in [read, atomic] {
            assert_eq!(
                send(&slot(wqe, &[(0x1000, 8, 1)]), &uc).unwrap_err(),
                WqeError::NeedsReliable
            );
        }
        assert!(!uc.takes_common_sends(), "the common form includes READ");
    }

    #[test]
    fn a_slot_shorter_than_its_stride_is_unreadable_not_a_panic() {
        let whole = slot(write(1), &[(0x1000, 16, 1)]);
        assert!(send(&whole, &RULES).is_ok());
        let short = &whole[..SEND_WQE_HEADER + 8];
        assert_eq!(send(short, &RULES).unwrap_err(), WqeError::RingUnreadable);
        assert_eq!(
            send(&whole[..8], &RULES).unwrap_err(),
            WqeError::RingUnreadable
        );
        let mut sges = Vec::new();
        assert_eq!(
            parse_recv(&whole[..8], &RULES, &lookup, &mut sges).unwrap_err(),
            WqeError::RingUnreadable
        );
    }

    #[test]
    fn inline_sends_carry_their_length_and_no_sges() {
        let wqe = SendWqe {
            opcode: wr_opcode::SEND,
            flags: wqe_flags::INLINE,
            inline_len: Le32::from(64),
            ..write(0)
        };
        assert_eq!(send(&slot(wqe, &[]), &RULES).unwrap().payload, Err(64));
    }

    /// A send WQE as a driver, right or wrong, may write it: any operation, flags and payload
    /// form, one or two SGEs naming MRs of the QP's PD, of another, or none.
    fn any_send_slot() -> impl Strategy<Value = Vec<u8>> {
        let payload = prop_oneof![
            4 => (0u8..3).prop_map(WqePayload::Sges),
            1 => (0u32..80).prop_map(WqePayload::Inline),
        ];
        let sge = (
            0xf00u64..0x2100,
            0u32..0x300,
            prop_oneof![Just(1u32), 2u32..4],
        );
        let header = send_header(payload, Just(UdAddress::default()));
        (header, 0u8..3, prop::collection::vec(sge, 2)).prop_map(|(header, mangle, sges)| {
            let mut wqe = SendWqe::encode(&header);
            match mangle {
                1 => wqe.flags |= wqe_flags::INLINE,
                2 => wqe.flags |= wqe_flags::ALL + 1, // not a flag
                _ => {}
            }
            slot(wqe, &sges)
        })
    }

    proptest! {
        #[test]
        fn the_common_path_takes_only_what_parse_send_takes_into_the_same_request(
            bytes in any_send_slot(), ud: bool, reliable: bool, atomics: bool,
            max_send_sge in 0u32..3,
        ) {
            let rules = QpRules { ud, reliable, atomics, max_send_sge, ..RULES };
            let Some(common) = parse_common_send(&bytes[..], &rules, &lookup) else {
                return Ok(());
            };
            prop_assume!(rules.takes_common_sends());
            let (mut sges, mut inline) = ([Sge::default(); 4], [0; 64]);
            let no_ahs = |_| None;
            let wr = parse_send(&bytes[..], &rules, &lookup, &no_ahs, &mut sges, &mut inline);
            let wr = wr.expect("what the common path takes, parse_send takes");
            let Payload::Sges(&[sge]) = wr.payload else {
                panic!("one SGE, not {:?}", wr.payload);
            };
            prop_assert!(!wr.opcode.is_atomic() && wr.ud.is_none());
            let flags = SendFlags::new(wr.signaled, wr.solicited, wr.fence);
            let header = (wr.wr_id, wr.opcode, flags, sge);
            let operands = SendOperands { compare_add: 0, swap: 0, ..wr.operands };
            let common_header = (common.wr_id, common.opcode, common.flags, common.sge);
            prop_assert_eq!((header, operands), (common_header, common.operands));
        }
    }

    #[test]
    fn receive_wqes_are_bounded_by_the_queue() {
        let mut bytes = RecvWqe {
            wr_id: Le64::from(3),
            num_sge: Le32::from(1),
            reserved: Le32::from(0),
        }
        .as_slice()
        .to_vec();
        bytes.extend_from_slice(
            WireSge {
                addr: Le64::from(0x1000),
                length: Le32::from(64),
                lkey: Le32::from(1),
            }
            .as_slice(),
        );
        bytes.resize(RULES.rq_stride, 0);
        let mut sges = Vec::new();
        assert_eq!(
            parse_recv(&bytes[..], &RULES, &lookup, &mut sges).unwrap(),
            (3, 1)
        );
        bytes[8] = 3; // num_sge beyond max_recv_sge
        assert_eq!(
            parse_recv(&bytes[..], &RULES, &lookup, &mut sges).unwrap_err(),
            WqeError::TooManySges(3)
        );
    }
}
