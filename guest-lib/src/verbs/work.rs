//! Work requests and completions of the data path (SPEC.md §7), as the verbs API shows them.

use vrdma_spec::ring::{wc_flags, Cqe};

use crate::verbs::AddressHandle;

pub use vrdma_spec::verbs::{Payload, RecvWr, Sge};

/// What a send work request does.
pub use vrdma_spec::codec::SendOp;

/// Destination of a UD send.
#[derive(Clone, Copy, Debug)]
pub struct UdDest<'a> {
    pub ah: &'a AddressHandle,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// A send work request.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    pub wr_id: u64,
    pub op: SendOp,
    pub payload: Payload<'a>,
    /// Produce a completion (always true in effect on a QP built with `sq_sig_all`).
    pub signaled: bool,
    pub solicited: bool,
    pub fence: bool,
    /// Required on UD QPs.
    pub ud: Option<UdDest<'a>>,
}

impl<'a> SendWr<'a> {
    /// A signaled request with no other flags.
    pub fn new(wr_id: u64, op: SendOp, payload: Payload<'a>) -> Self {
        SendWr {
            wr_id,
            op,
            payload,
            signaled: true,
            solicited: false,
            fence: false,
            ud: None,
        }
    }
}

/// `ibv_wc_status` values.
pub mod wc_status {
    pub const SUCCESS: u8 = 0;
    pub const LOC_QP_OP_ERR: u8 = 2;
    pub const LOC_PROT_ERR: u8 = 4;
    pub const WR_FLUSH_ERR: u8 = 5;
    pub const REM_ACCESS_ERR: u8 = 10;
    pub const RETRY_EXC_ERR: u8 = 12;
    pub const RNR_RETRY_EXC_ERR: u8 = 13;
}

pub use vrdma_spec::ring::wc_opcode;

/// A completion.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkCompletion {
    pub wr_id: u64,
    /// A [`wc_status`] value.
    pub status: u8,
    /// A [`wc_opcode`] value.
    pub opcode: u8,
    pub byte_len: u32,
    pub imm_data: Option<u32>,
    pub qp_num: u32,
    pub src_qp: u32,
    /// A GRH precedes the payload (UD receives).
    pub grh: bool,
}

impl WorkCompletion {
    pub fn is_success(&self) -> bool {
        self.status == wc_status::SUCCESS
    }
}

impl From<&Cqe> for WorkCompletion {
    fn from(c: &Cqe) -> Self {
        WorkCompletion {
            wr_id: c.wr_id.to_native(),
            status: c.status,
            opcode: c.opcode,
            byte_len: c.byte_len.to_native(),
            imm_data: (c.wc_flags & wc_flags::WITH_IMM != 0).then(|| c.imm_data.to_native()),
            qp_num: c.qp_num.to_native(),
            src_qp: c.src_qp.to_native(),
            grh: c.wc_flags & wc_flags::GRH != 0,
        }
    }
}

/// Something the device tells the driver through the event queue (SPEC.md §8.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceEvent {
    /// An armed CQ (its handle) received a completion.
    CqCompletion(u32),
    /// A CQ (its handle) overran or its ring became unusable.
    CqError(u32),
    /// A QP (its handle) entered the error state on its own.
    QpFatal(u32),
    SrqLimitReached(u32),
    /// An SRQ (its handle) takes no more WQEs: one was malformed, or its ring unusable; the
    /// QPs receiving from it failed too (each with its own [`DeviceEvent::QpFatal`]).
    SrqError(u32),
    /// The device must be reset: every object is gone.
    DeviceFatal,
    /// The port (its number) became active.
    PortActive(u8),
    /// The port left the active state.
    PortError(u8),
    /// Connection-manager events wait on a CM id (its handle): [`crate::CmId::get_event`].
    CmEvent(u32),
    Unknown {
        kind: u16,
        handle: u32,
    },
}
