//! Control queue: request/response framing and every command (SPEC.md §5).

pub use crate::address::AhAttr;
use crate::cm;
use crate::mem::PageList;
use crate::{wire_struct, Le16, Le32, Le64};

/// Header of every control request, in the device-readable part of the chain (SPEC.md §5.1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestHeader {
    /// An [`Opcode`] value.
    pub opcode: Le16,
    /// Must be zero.
    pub flags: Le16,
    /// Bytes of command payload after this header; must equal the opcode's request size.
    pub length: Le32,
}

/// Header of every control response, in the device-writable part of the chain (SPEC.md §5.1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResponseHeader {
    /// A [`Status`] value.
    pub status: Le16,
    pub reserved: Le16,
    /// For [`Status::HostError`]: the host's errno. Otherwise zero.
    pub detail: Le32,
}

wire_struct!(RequestHeader = 8, ResponseHeader = 8);

macro_rules! wire_enum {
    ($(#[$meta:meta])* $name:ident: $repr:ty { $($(#[$vmeta:meta])* $variant:ident = $value:expr,)+ }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr($repr)]
        pub enum $name { $($(#[$vmeta])* $variant = $value,)+ }

        impl TryFrom<$repr> for $name {
            type Error = $repr;
            fn try_from(value: $repr) -> Result<Self, $repr> {
                match value {
                    $($value => Ok(Self::$variant),)+
                    other => Err(other),
                }
            }
        }
    };
}

wire_enum! {
    /// Control command opcodes (SPEC.md §5.3).
    Opcode: u16 {
        QueryDevice = 1,
        QueryPort = 2,
        QueryGid = 3,
        AllocPd = 4,
        DeallocPd = 5,
        CreateCq = 6,
        DestroyCq = 7,
        RegMr = 8,
        DeregMr = 9,
        CreateQp = 10,
        ModifyQp = 11,
        QueryQp = 12,
        DestroyQp = 13,
        CreateAh = 14,
        DestroyAh = 15,
        CreateSrq = 16,
        ModifySrq = 17,
        DestroySrq = 18,
        SetNotifyArea = 19,
        AddDoorbellArea = 20,
        DestroyDoorbellArea = 21,
        CmCreateId = 22,
        CmDestroyId = 23,
        CmBind = 24,
        CmResolveAddr = 25,
        CmResolveRoute = 26,
        CmListen = 27,
        CmConnect = 28,
        CmAccept = 29,
        CmReject = 30,
        CmDisconnect = 31,
        CmEstablish = 32,
        CmInitQpAttr = 33,
        CmQuery = 34,
        CmGetEvent = 35,
        ResizeCq = 36,
        Reset = 48,
    }
}

wire_enum! {
    /// Control response status codes (SPEC.md §5.2).
    Status: u16 {
        Ok = 0,
        /// Unknown opcode, or a feature that was not negotiated.
        Unsupported = 1,
        /// A buffer is shorter than the opcode needs, or `length` does not match it.
        BadLength = 2,
        /// A field fails its validation rule.
        InvalidArgument = 3,
        /// A handle is zero, unknown, of the wrong type, or destroyed.
        BadHandle = 4,
        /// A guest-physical address or range lies outside guest memory, overflows, or is misaligned.
        BadAddress = 5,
        /// A quota or a host resource is exhausted.
        NoResources = 6,
        /// The object is still in use by another object.
        Busy = 7,
        /// The host verbs call failed; `detail` holds its errno.
        HostError = 8,
        /// SET_NOTIFY_AREA has not come yet: the device is fresh, or was reset (its backend
        /// restarted), and holds none of the driver's earlier objects.
        NotReady = 9,
    }
}

/// A control request's bytes (SPEC.md §5.1): the header for `opcode` and `payload`, its
/// `length` the payload's. A payload longer than `u32::MAX` bytes gets the length `u32::MAX`,
/// which no request has: the device refuses it as a length mismatch instead of reading a
/// wrapped length.
pub fn request_bytes(opcode: u16, payload: &[u8]) -> Vec<u8> {
    let header = RequestHeader {
        opcode: Le16::from(opcode),
        flags: Le16::from(0),
        length: Le32::from(u32::try_from(payload.len()).unwrap_or(u32::MAX)),
    };
    [crate::ByteValued::as_slice(&header), payload].concat()
}

impl Opcode {
    /// Payload size of the request, in bytes: `RequestHeader::length` must equal it.
    pub const fn request_size(self) -> usize {
        use core::mem::size_of;
        match self {
            Self::QueryDevice | Self::AllocPd | Self::Reset => 0,
            Self::QueryPort => size_of::<QueryPortRequest>(),
            Self::QueryGid => size_of::<QueryGidRequest>(),
            Self::DeallocPd
            | Self::DestroyCq
            | Self::DeregMr
            | Self::QueryQp
            | Self::DestroyQp
            | Self::DestroyAh
            | Self::DestroySrq
            | Self::DestroyDoorbellArea
            | Self::CmDestroyId
            | Self::CmDisconnect
            | Self::CmEstablish
            | Self::CmQuery
            | Self::CmGetEvent => size_of::<HandleRequest>(),
            Self::CreateCq => size_of::<CreateCqRequest>(),
            Self::ResizeCq => size_of::<ResizeCqRequest>(),
            Self::RegMr => size_of::<RegMrRequest>(),
            Self::CreateQp => size_of::<CreateQpRequest>(),
            Self::ModifyQp => size_of::<ModifyQpRequest>(),
            Self::CreateAh => size_of::<CreateAhRequest>(),
            Self::CreateSrq => size_of::<CreateSrqRequest>(),
            Self::ModifySrq => size_of::<ModifySrqRequest>(),
            Self::SetNotifyArea => size_of::<SetNotifyAreaRequest>(),
            Self::AddDoorbellArea => size_of::<AddDoorbellAreaRequest>(),
            Self::CmCreateId => size_of::<cm::CmCreateIdRequest>(),
            Self::CmBind => size_of::<cm::CmBindRequest>(),
            Self::CmResolveAddr => size_of::<cm::CmResolveAddrRequest>(),
            Self::CmResolveRoute => size_of::<cm::CmResolveRouteRequest>(),
            Self::CmListen => size_of::<cm::CmListenRequest>(),
            Self::CmConnect | Self::CmAccept => size_of::<cm::CmConnectRequest>(),
            Self::CmReject => size_of::<cm::CmRejectRequest>(),
            Self::CmInitQpAttr => size_of::<cm::CmInitQpAttrRequest>(),
        }
    }

    /// Payload size of a successful response, in bytes.
    pub const fn response_size(self) -> usize {
        use core::mem::size_of;
        match self {
            Self::QueryDevice => size_of::<DeviceAttr>(),
            Self::QueryPort => size_of::<PortAttr>(),
            Self::QueryGid => size_of::<QueryGidResponse>(),
            Self::AllocPd
            | Self::CreateCq
            | Self::ResizeCq
            | Self::CreateAh
            | Self::AddDoorbellArea
            | Self::CmCreateId => size_of::<CreatedResponse>(),
            Self::CmInitQpAttr => size_of::<ModifyQpRequest>(),
            Self::CmBind | Self::CmQuery => size_of::<cm::CmIdInfo>(),
            Self::CmGetEvent => size_of::<cm::CmEvent>(),
            Self::RegMr => size_of::<RegMrResponse>(),
            Self::CreateQp => size_of::<CreateQpResponse>(),
            Self::QueryQp => size_of::<QpAttr>(),
            Self::CreateSrq => size_of::<CreateSrqResponse>(),
            Self::DeallocPd
            | Self::DestroyCq
            | Self::DeregMr
            | Self::ModifyQp
            | Self::DestroyQp
            | Self::DestroyAh
            | Self::ModifySrq
            | Self::DestroySrq
            | Self::SetNotifyArea
            | Self::DestroyDoorbellArea
            | Self::Reset
            | Self::CmDestroyId
            | Self::CmResolveAddr
            | Self::CmResolveRoute
            | Self::CmListen
            | Self::CmConnect
            | Self::CmAccept
            | Self::CmReject
            | Self::CmDisconnect
            | Self::CmEstablish => 0,
        }
    }
}

/// QUERY_DEVICE response (SPEC.md §5.4).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceAttr {
    pub node_guid: Le64,
    pub sys_image_guid: Le64,
    pub max_mr_size: Le64,
    pub page_size_cap: Le64,
    pub vendor_id: Le32,
    pub vendor_part_id: Le32,
    pub hw_ver: Le32,
    pub max_qp: Le32,
    pub max_qp_wr: Le32,
    pub device_cap_flags: Le32,
    pub max_sge: Le32,
    pub max_cq: Le32,
    pub max_cqe: Le32,
    pub max_mr: Le32,
    pub max_pd: Le32,
    pub max_qp_rd_atom: Le32,
    pub max_qp_init_rd_atom: Le32,
    pub max_ah: Le32,
    pub max_srq: Le32,
    pub max_srq_wr: Le32,
    pub max_srq_sge: Le32,
    /// 0 none, 1 atomic within this HCA, 2 global (ibv_atomic_cap).
    pub atomic_cap: Le32,
    pub max_inline_data: Le32,
    pub phys_port_cnt: Le32,
    pub reserved: [Le32; 4],
}

/// ibverbs' device capability flags (`ibv_device_cap_flags`) the device can report in
/// QUERY_DEVICE's `device_cap_flags` (SPEC.md §5.4): those it honours as the host does. It
/// reports the ones its host has.
pub mod device_cap {
    /// A UD send's AH must name the QP's port.
    pub const UD_AV_PORT_ENFORCE: u32 = 1 << 6;
    /// PORT_ACTIVE events are raised (§8.4).
    pub const PORT_ACTIVE_EVENT: u32 = 1 << 10;
    /// `sys_image_guid` is meaningful.
    pub const SYS_IMAGE_GUID: u32 = 1 << 11;
    /// RC responders send RNR NAKs.
    pub const RC_RNR_NAK_GEN: u32 = 1 << 12;
    /// Every flag the device may report.
    pub const HONOURED: u32 =
        UD_AV_PORT_ENFORCE | PORT_ACTIVE_EVENT | SYS_IMAGE_GUID | RC_RNR_NAK_GEN;
}

/// The device's only port (SPEC.md §5.5).
pub const PORT_NUM: u8 = 1;

/// The port's virtual lanes, as ibverbs' `max_vl_num` counts them (`IBV_VL_VL0`): one.
pub const PORT_MAX_VL_NUM: u8 = 1;

/// The guest's GID table has one entry, at this index: the GID the operator assigned to the
/// guest (SPEC.md §5.6). The host's own table and indexes stay hidden.
pub const GUEST_GID_INDEX: u8 = 0;
/// Entries in the guest's GID table (QUERY_PORT's `gid_tbl_len`).
pub const GUEST_GID_TABLE_LEN: u32 = 1;

/// QUERY_PORT request (SPEC.md §5.5).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueryPortRequest {
    /// Must be [`PORT_NUM`].
    pub port: u8,
    pub reserved: [u8; 7],
}

/// QUERY_PORT response (SPEC.md §5.5). Enumerations carry ibverbs values.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortAttr {
    /// ibv_port_state: 1 down, 2 init, 3 armed, 4 active.
    pub state: u8,
    /// ibv_mtu: 1 = 256 ... 5 = 4096.
    pub max_mtu: u8,
    pub active_mtu: u8,
    /// 1 InfiniBand, 2 Ethernet.
    pub link_layer: u8,
    pub phys_state: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub reserved0: u8,
    pub gid_tbl_len: Le32,
    pub port_cap_flags: Le32,
    pub max_msg_sz: Le32,
    pub pkey_tbl_len: Le16,
    pub lid: Le16,
    /// The GID table index the guest uses: always [`GUEST_GID_INDEX`].
    pub gid_index: Le32,
    pub reserved: Le32,
}

/// QUERY_GID request (SPEC.md §5.6).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueryGidRequest {
    /// Must be 1.
    pub port: u8,
    pub reserved: [u8; 3],
    /// Below the port's `gid_tbl_len`.
    pub index: Le32,
}

/// GID types (SPEC.md §5.6).
pub mod gid_type {
    pub const IB: u8 = 0;
    pub const ROCE_V1: u8 = 1;
    pub const ROCE_V2: u8 = 2;
}

/// QUERY_GID response (SPEC.md §5.6).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueryGidResponse {
    /// Network order, as on the wire.
    pub gid: [u8; 16],
    /// A [`gid_type`] value.
    pub gid_type: u8,
    pub reserved: [u8; 7],
}

/// Request of every command that names one object: DEALLOC_PD, DESTROY_CQ, DEREG_MR, QUERY_QP,
/// DESTROY_QP, DESTROY_AH, DESTROY_SRQ (SPEC.md §5.3).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HandleRequest {
    pub handle: Le32,
    pub reserved: Le32,
}

/// Response of ALLOC_PD, CREATE_CQ, CREATE_AH and ADD_DOORBELL_AREA (SPEC.md §5.3).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CreatedResponse {
    /// The new object's handle (ADD_DOORBELL_AREA: the area's number); never zero.
    pub handle: Le32,
    /// CREATE_CQ and RESIZE_CQ: the CQ depth granted (equals the request).
    /// ADD_DOORBELL_AREA: the area's bits (equal the request). Otherwise zero.
    pub value: Le32,
}

/// CREATE_CQ request (SPEC.md §5.7).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CreateCqRequest {
    /// Depth: a power of two, 2..=`max_cqe`.
    pub cqe: Le32,
    /// Must be zero.
    pub flags: Le32,
    /// Pages holding `cqe` CQEs of [`crate::ring::CQE_SIZE`] bytes, zeroed by the driver.
    pub ring: PageList,
    /// GPA of the CQ's [`crate::ring::CqDoorbell`]; 16-byte aligned.
    pub doorbell: Le64,
}

/// RESIZE_CQ request (SPEC.md §5.7.1): the CQ moves to a new ring of another depth.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResizeCqRequest {
    /// The CQ; its response's `handle` names it again.
    pub cq: Le32,
    /// The new depth: a power of two, 2..=`max_cqe`, at least the CQEs the ring holds.
    pub cqe: Le32,
    /// Pages holding `cqe` CQEs, prepared by the driver as §5.7.1 says
    /// ([`crate::ring::resized_cq_owner`]).
    pub ring: PageList,
}

/// Memory access flags of MRs and QPs; ibverbs values (SPEC.md §5.8).
pub mod access {
    pub const LOCAL_WRITE: u32 = 1 << 0;
    pub const REMOTE_WRITE: u32 = 1 << 1;
    pub const REMOTE_READ: u32 = 1 << 2;
    pub const REMOTE_ATOMIC: u32 = 1 << 3;
    /// Every flag this version accepts.
    pub const ALL: u32 = LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC;
}

/// REG_MR request (SPEC.md §5.8).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegMrRequest {
    pub pd: Le32,
    /// [`access`] flags.
    pub access: Le32,
    /// The guest virtual address the MR starts at; it becomes the host MR's IOVA.
    pub virt_addr: Le64,
    /// Bytes covered; nonzero, at most `max_mr_size`.
    pub length: Le64,
    /// The pages backing `[virt_addr & !(page_size - 1), virt_addr + length)`, in order.
    pub pages: PageList,
}

/// REG_MR response (SPEC.md §5.8).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegMrResponse {
    pub handle: Le32,
    pub lkey: Le32,
    pub rkey: Le32,
    pub reserved: Le32,
}

/// QP types; ibverbs values (SPEC.md §5.9).
pub mod qp_type {
    pub const RC: u8 = 2;
    /// Unreliable connected: SEND and RDMA WRITE (with immediates), no READ or atomics.
    pub const UC: u8 = 3;
    pub const UD: u8 = 4;
}

/// CREATE_QP request (SPEC.md §5.9).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CreateQpRequest {
    pub pd: Le32,
    pub send_cq: Le32,
    pub recv_cq: Le32,
    /// Zero for a QP with its own RQ; otherwise the SRQ it receives from.
    pub srq: Le32,
    /// A [`qp_type`] value.
    pub qp_type: u8,
    /// 1: every send WQE completes with a CQE, whatever its SIGNALED flag; else 0.
    pub sq_sig_all: u8,
    /// log2 of the SQ WQE stride: 6..=12, and large enough for `max_send_sge` / inline data.
    pub sq_wqe_shift: u8,
    /// log2 of the RQ WQE stride: 4..=12, large enough for `max_recv_sge`; 0 with an SRQ.
    pub rq_wqe_shift: u8,
    /// SQ depth: a power of two, 1..=`max_qp_wr`.
    pub max_send_wr: Le32,
    /// RQ depth: a power of two, 1..=`max_qp_wr`; 0 with an SRQ.
    pub max_recv_wr: Le32,
    pub max_send_sge: Le32,
    pub max_recv_sge: Le32,
    pub max_inline_data: Le32,
    /// The doorbell area (§8.6) holding the QP's doorbell bit: 0 for SET_NOTIFY_AREA's, else
    /// an area ADD_DOORBELL_AREA returned. Non-zero only with `DOORBELL_AREAS` negotiated.
    pub doorbell_area: Le32,
    pub reserved: Le32,
    /// Pages holding `max_send_wr` WQEs of `1 << sq_wqe_shift` bytes.
    pub sq_ring: PageList,
    /// Pages holding `max_recv_wr` WQEs of `1 << rq_wqe_shift` bytes; `npages` 0 with an SRQ.
    pub rq_ring: PageList,
    /// GPA of the QP's [`crate::ring::QpDoorbell`]; 16-byte aligned.
    pub doorbell: Le64,
}

/// CREATE_QP response (SPEC.md §5.9).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CreateQpResponse {
    pub handle: Le32,
    /// The QP number peers address; the host QP's number.
    pub qp_num: Le32,
    /// Index (from 0) of the notification queue that serves this QP's doorbells.
    pub notify_queue: Le16,
    /// The QP's bit in the doorbell bitmap (SPEC.md §8.5).
    pub doorbell_bit: Le16,
    pub max_send_wr: Le32,
    pub max_recv_wr: Le32,
    pub max_send_sge: Le32,
    pub max_recv_sge: Le32,
    pub max_inline_data: Le32,
}

/// QP states; ibverbs values (SPEC.md §5.11).
pub mod qp_state {
    pub const RESET: u8 = 0;
    pub const INIT: u8 = 1;
    pub const RTR: u8 = 2;
    pub const RTS: u8 = 3;
    pub const SQD: u8 = 4;
    pub const SQE: u8 = 5;
    pub const ERR: u8 = 6;
}

/// MODIFY_QP attribute mask bits; ibverbs values (SPEC.md §5.11).
pub mod qp_attr_mask {
    pub const STATE: u32 = 1 << 0;
    pub const CUR_STATE: u32 = 1 << 1;
    pub const ACCESS_FLAGS: u32 = 1 << 3;
    pub const PKEY_INDEX: u32 = 1 << 4;
    pub const PORT: u32 = 1 << 5;
    pub const QKEY: u32 = 1 << 6;
    pub const AV: u32 = 1 << 7;
    pub const PATH_MTU: u32 = 1 << 8;
    pub const TIMEOUT: u32 = 1 << 9;
    pub const RETRY_CNT: u32 = 1 << 10;
    pub const RNR_RETRY: u32 = 1 << 11;
    pub const RQ_PSN: u32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    pub const MIN_RNR_TIMER: u32 = 1 << 15;
    pub const SQ_PSN: u32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    pub const DEST_QPN: u32 = 1 << 20;
    /// Every bit this version accepts; any other bit is INVALID_ARGUMENT.
    pub const SUPPORTED: u32 = STATE
        | CUR_STATE
        | ACCESS_FLAGS
        | PKEY_INDEX
        | PORT
        | QKEY
        | AV
        | PATH_MTU
        | TIMEOUT
        | RETRY_CNT
        | RNR_RETRY
        | RQ_PSN
        | MAX_QP_RD_ATOMIC
        | MIN_RNR_TIMER
        | SQ_PSN
        | MAX_DEST_RD_ATOMIC
        | DEST_QPN;
}

/// QP attributes (SPEC.md §5.11): MODIFY_QP's input (fields selected by the mask) and
/// QUERY_QP's output (all fields).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpAttr {
    pub qp_state: u8,
    pub cur_qp_state: u8,
    /// ibv_mtu: 1..=5.
    pub path_mtu: u8,
    pub port_num: u8,
    /// [`access`] flags for remote operations on this QP.
    pub qp_access_flags: Le32,
    pub pkey_index: Le16,
    /// 0..=31.
    pub timeout: u8,
    /// 0..=7.
    pub retry_cnt: u8,
    /// 0..=7.
    pub rnr_retry: u8,
    /// 0..=31.
    pub min_rnr_timer: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub qkey: Le32,
    /// 24 bits.
    pub rq_psn: Le32,
    /// 24 bits.
    pub sq_psn: Le32,
    /// 24 bits.
    pub dest_qp_num: Le32,
    pub ah_attr: AhAttr,
}

/// MODIFY_QP request (SPEC.md §5.11).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModifyQpRequest {
    pub handle: Le32,
    /// [`qp_attr_mask`] bits selecting the fields of `attr` to apply.
    pub attr_mask: Le32,
    pub attr: QpAttr,
}

/// CREATE_AH request (SPEC.md §5.12).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CreateAhRequest {
    pub pd: Le32,
    pub reserved: Le32,
    pub attr: AhAttr,
}

/// CREATE_SRQ request (SPEC.md §5.13).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CreateSrqRequest {
    pub pd: Le32,
    /// Depth: a power of two, 1..=`max_srq_wr`.
    pub max_wr: Le32,
    /// 1..=`max_sge`.
    pub max_sge: Le32,
    /// Below `max_wr`; 0 = no limit event.
    pub srq_limit: Le32,
    /// log2 of the WQE stride: 4..=12, large enough for `max_sge`.
    pub wqe_shift: u8,
    pub reserved: [u8; 3],
    /// The doorbell area (§8.6) holding the SRQ's doorbell bit, as in [`CreateQpRequest`].
    pub doorbell_area: Le32,
    /// Pages holding `max_wr` receive WQEs.
    pub ring: PageList,
    /// GPA of the SRQ's [`crate::ring::SrqDoorbell`]; 16-byte aligned.
    pub doorbell: Le64,
}

/// CREATE_SRQ response (SPEC.md §5.13).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CreateSrqResponse {
    pub handle: Le32,
    pub max_wr: Le32,
    pub max_sge: Le32,
    /// Index (from 0) of the notification queue that serves this SRQ's doorbell.
    pub notify_queue: Le16,
    /// The SRQ's bit in the doorbell bitmap (SPEC.md §8.5).
    pub doorbell_bit: Le16,
}

/// MODIFY_SRQ's `attr_mask`: ibverbs' IBV_SRQ_LIMIT, the only attribute that changes.
pub const SRQ_ATTR_LIMIT: u32 = 1 << 1;

/// MODIFY_SRQ request (SPEC.md §5.13): only the limit can change (mask bit 1 << 1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModifySrqRequest {
    pub handle: Le32,
    /// Must be exactly [`SRQ_ATTR_LIMIT`].
    pub attr_mask: Le32,
    pub srq_limit: Le32,
    pub reserved: Le32,
}

/// SET_NOTIFY_AREA request (SPEC.md §8.5).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SetNotifyAreaRequest {
    /// GPA of `num_notify_queues` [`crate::ring::NotifyState`] records; 64-byte aligned,
    /// inside one 4 KiB page.
    pub addr: Le64,
    /// GPA of the doorbell bitmap: [`crate::codec::doorbell_bitmap_bytes`] zeroed bytes,
    /// 64-byte aligned, contiguous in guest-physical memory.
    pub doorbell_bitmap: Le64,
}

/// ADD_DOORBELL_AREA request (SPEC.md §8.6): a notify area and doorbell bitmap of their own
/// for the QPs and SRQs created in it. Answered with a [`CreatedResponse`] naming the area.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AddDoorbellAreaRequest {
    /// GPA of `num_notify_queues` [`crate::ring::NotifyState`] records, as SET_NOTIFY_AREA's.
    pub addr: Le64,
    /// GPA of the area's doorbell bitmap: `bits / 8` zeroed bytes, 64-byte aligned,
    /// contiguous in guest-physical memory.
    pub doorbell_bitmap: Le64,
    /// Doorbell bits of the area: a multiple of 64, from 64 to the device's bitmap's bits.
    pub bits: Le32,
    pub reserved: Le32,
}

wire_struct!(
    DeviceAttr = 128,
    QueryPortRequest = 8,
    PortAttr = 32,
    QueryGidRequest = 8,
    QueryGidResponse = 24,
    HandleRequest = 8,
    CreatedResponse = 8,
    CreateCqRequest = 32,
    RegMrRequest = 40,
    RegMrResponse = 16,
    CreateQpRequest = 88,
    CreateQpResponse = 32,
    QpAttr = 64,
    ModifyQpRequest = 72,
    CreateAhRequest = 40,
    CreateSrqRequest = 48,
    CreateSrqResponse = 16,
    ModifySrqRequest = 16,
    SetNotifyAreaRequest = 16,
    AddDoorbellAreaRequest = 24,
    ResizeCqRequest = 24,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcodes_round_trip_and_unknown_values_are_rejected() {
        for raw in (1..=36u16).chain([48]) {
            let op = Opcode::try_from(raw).unwrap();
            assert_eq!(op as u16, raw);
        }
        assert_eq!(Opcode::try_from(0), Err(0));
        assert_eq!(Opcode::try_from(37), Err(37));
        assert_eq!(Opcode::try_from(47), Err(47));
        assert_eq!(Opcode::try_from(u16::MAX), Err(u16::MAX));
    }

    #[test]
    fn every_request_and_response_size_is_a_multiple_of_eight() {
        for raw in (1..=36u16).chain([48]) {
            let op = Opcode::try_from(raw).unwrap();
            assert_eq!(op.request_size() % 8, 0, "{op:?}");
            assert_eq!(op.response_size() % 8, 0, "{op:?}");
        }
    }

    #[test]
    fn wire_structs_are_read_from_unaligned_bytes_and_short_input_is_refused() {
        let header = RequestHeader {
            opcode: Le16::from(4),
            flags: Le16::from(0),
            length: Le32::from(8),
        };
        let mut bytes = vec![0xffu8];
        bytes.extend_from_slice(crate::ByteValued::as_slice(&header));
        assert_eq!(crate::read_wire::<RequestHeader>(&bytes[1..]), Some(header));
        assert_eq!(crate::read_wire::<RequestHeader>(&bytes[1..8]), None);
    }

    #[test]
    fn status_values_are_stable() {
        assert_eq!(Status::try_from(8), Ok(Status::HostError));
        assert_eq!(Status::try_from(9), Ok(Status::NotReady));
        assert_eq!(Status::try_from(10), Err(10));
    }
}
