//! Feature bits, virtqueue layout and configuration space (SPEC.md §2-§4).

use crate::{wire_struct, Le32, Le64};

/// Device feature bits (SPEC.md §2). Bits 0-23 are device specific.
pub mod features {
    /// Reliable-connected QPs. Always offered.
    pub const RC: u64 = 1 << 0;
    /// Unreliable-datagram QPs and address handles.
    pub const UD: u64 = 1 << 1;
    /// Shared receive queues.
    pub const SRQ: u64 = 1 << 2;
    /// 8-byte atomics (compare-and-swap, fetch-and-add).
    pub const ATOMIC: u64 = 1 << 3;
    /// Two-level page lists ([`crate::mem::PageListForm::Indirect`]).
    pub const INDIRECT_PAGE_LIST: u64 = 1 << 4;
    /// Doorbell areas besides SET_NOTIFY_AREA's (ADD_DOORBELL_AREA, SPEC.md §8.6), for a
    /// driver that shares the device among programs.
    pub const DOORBELL_AREAS: u64 = 1 << 5;
    /// Connection management on the driver's own address (CM_* commands, SPEC.md §13).
    pub const CM: u64 = 1 << 6;
    /// RESIZE_CQ: a CQ moves to a ring of another depth (SPEC.md §5.7.1).
    pub const RESIZE_CQ: u64 = 1 << 7;
    /// Unreliable-connected QPs (SEND and RDMA WRITE; no READ or atomics: SPEC.md §5.9).
    pub const UC: u64 = 1 << 8;
    /// The driver says when it resets (the RESET command, SPEC.md §9): a stop of the
    /// device's queues without it (the hypervisor pausing the VM, or moving it) keeps every
    /// object.
    pub const RESET_COMMAND: u64 = 1 << 16;
    /// VIRTIO_F_VERSION_1: mandatory, the device is modern-only.
    pub const VERSION_1: u64 = 1 << 32;
}

/// Index of the control virtqueue (SPEC.md §4).
pub const CONTROL_QUEUE: u16 = 0;
/// Index of the event virtqueue: device-to-driver CQ and async events (SPEC.md §4).
pub const EVENT_QUEUE: u16 = 1;
/// Index of the first notification virtqueue (SPEC.md §4, §8.5).
pub const FIRST_NOTIFY_QUEUE: u16 = 2;
/// Upper bound on `num_notify_queues`, so the device needs at most 2 + 64 virtqueues in all.
pub const MAX_NOTIFY_QUEUES: u32 = 64;

/// Device configuration space (SPEC.md §3): read-only, 128 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceConfig {
    /// [`crate::SPEC_VERSION`] of the layout the device implements.
    pub version: Le32,
    /// Number of notification virtqueues (1..=[`MAX_NOTIFY_QUEUES`]).
    pub num_notify_queues: Le32,
    pub max_qp: Le32,
    /// Maximum depth of one SQ or RQ.
    pub max_qp_wr: Le32,
    /// Maximum scatter/gather entries in one WQE.
    pub max_sge: Le32,
    pub max_cq: Le32,
    /// Maximum depth of one CQ.
    pub max_cqe: Le32,
    pub max_mr: Le32,
    pub max_pd: Le32,
    pub max_ah: Le32,
    pub max_srq: Le32,
    pub max_srq_wr: Le32,
    /// Maximum inline payload of one send WQE, in bytes.
    pub max_inline_data: Le32,
    pub max_qp_rd_atom: Le32,
    pub max_qp_init_rd_atom: Le32,
    /// Number of ports; always 1 in this version.
    pub phys_port_cnt: Le32,
    /// Largest length one REG_MR may cover, in bytes.
    pub max_mr_size: Le64,
    /// Bitmap of page sizes accepted in page lists: bit `n` set = `1 << n` bytes.
    pub page_size_cap: Le64,
    /// Memory regions a vhost-user front end may have in its memory table at once (SPEC.md
    /// §11 item 4); 0: not stated (the device then takes as many as `GET_MAX_MEM_SLOTS`
    /// says). A region past it ends the connection, so a driver adds none past it.
    pub max_memory_regions: Le32,
    pub reserved: [Le32; 11],
}

wire_struct!(DeviceConfig = 128);
