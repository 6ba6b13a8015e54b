//! Data path structures in guest memory: WQEs, CQEs, doorbell records, notification state and
//! events (SPEC.md §7-§8).

use crate::{wire_struct, Le16, Le32, Le64};

/// Size of one CQE in bytes.
pub const CQE_SIZE: usize = 32;
/// A CQ ring's stride (log2): CQE `i` lies at `(i % depth) << CQE_SHIFT`.
pub const CQE_SHIFT: u8 = 5;
const _: () = assert!(CQE_SIZE == 1 << CQE_SHIFT);
/// Smallest and largest SQ WQE stride (log2).
pub const MIN_SQ_WQE_SHIFT: u8 = 6;
/// Smallest RQ/SRQ WQE stride (log2).
pub const MIN_RQ_WQE_SHIFT: u8 = 4;
pub const MAX_WQE_SHIFT: u8 = 12;

/// Send WQE opcodes; ibverbs values (SPEC.md §7.2).
pub mod wr_opcode {
    pub const RDMA_WRITE: u8 = 0;
    pub const RDMA_WRITE_WITH_IMM: u8 = 1;
    pub const SEND: u8 = 2;
    pub const SEND_WITH_IMM: u8 = 3;
    pub const RDMA_READ: u8 = 4;
    pub const ATOMIC_CMP_AND_SWP: u8 = 5;
    pub const ATOMIC_FETCH_AND_ADD: u8 = 6;
}

/// Send WQE flags (SPEC.md §7.2).
pub mod wqe_flags {
    /// Produce a CQE for this WQE even if the QP was created without `sq_sig_all`.
    pub const SIGNALED: u8 = 1 << 0;
    pub const SOLICITED: u8 = 1 << 1;
    /// The payload follows the header as `inline_len` bytes instead of SGEs.
    pub const INLINE: u8 = 1 << 2;
    pub const FENCE: u8 = 1 << 3;
    pub const ALL: u8 = SIGNALED | SOLICITED | INLINE | FENCE;
}

/// Header of a send WQE (SPEC.md §7.2); followed in its slot by `num_sge` [`Sge`]s or by
/// `inline_len` bytes of inline payload.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendWqe {
    /// Returned untouched in the CQE.
    pub wr_id: Le64,
    /// A [`wr_opcode`] value.
    pub opcode: u8,
    /// [`wqe_flags`].
    pub flags: u8,
    /// SGEs after the header; at most the QP's `max_send_sge`. Zero when INLINE.
    pub num_sge: u8,
    pub reserved0: u8,
    /// Immediate data for *_WITH_IMM, as a host value; sent in network order.
    pub imm_data: Le32,
    /// RDMA and atomic: the remote address (a peer's IOVA).
    pub remote_addr: Le64,
    /// RDMA and atomic: the remote key.
    pub rkey: Le32,
    /// With INLINE: payload bytes after the header; at most the QP's `max_inline_data`.
    pub inline_len: Le32,
    /// ATOMIC_CMP_AND_SWP: compare value; ATOMIC_FETCH_AND_ADD: the addend.
    pub compare_add: Le64,
    /// ATOMIC_CMP_AND_SWP: the swap value.
    pub swap: Le64,
    /// UD: the address handle.
    pub ah: Le32,
    /// UD: destination QP number (24 bits).
    pub remote_qpn: Le32,
    /// UD: destination Q_Key.
    pub remote_qkey: Le32,
    pub reserved1: Le32,
}

/// Header of a receive WQE, in an RQ or SRQ slot (SPEC.md §7.3); followed by `num_sge` SGEs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecvWqe {
    pub wr_id: Le64,
    /// At most the queue's `max_recv_sge` (or SRQ `max_sge`).
    pub num_sge: Le32,
    pub reserved: Le32,
}

/// A scatter/gather entry (SPEC.md §7.4): `length` bytes at guest VA `addr` of MR `lkey`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sge {
    pub addr: Le64,
    pub length: Le32,
    pub lkey: Le32,
}

/// Completion opcodes; ibverbs values (SPEC.md §7.5).
pub mod wc_opcode {
    pub const SEND: u8 = 0;
    pub const RDMA_WRITE: u8 = 1;
    pub const RDMA_READ: u8 = 2;
    pub const COMP_SWAP: u8 = 3;
    pub const FETCH_ADD: u8 = 4;
    pub const RECV: u8 = 128;
    pub const RECV_RDMA_WITH_IMM: u8 = 129;
}

/// CQE status values the device itself reports; ibverbs values (SPEC.md §7.5).
pub mod wc_status {
    pub const SUCCESS: u8 = 0;
    /// The device refused a malformed WQE.
    pub const LOC_QP_OP_ERR: u8 = 2;
    /// The device refused an SGE: unknown lkey, another PD, or outside its MR.
    pub const LOC_PROT_ERR: u8 = 4;
    /// A WQE flushed from a QP in the error state.
    pub const WR_FLUSH_ERR: u8 = 5;
}

/// CQE flags (SPEC.md §7.5).
pub mod wc_flags {
    /// A GRH precedes the payload in the receive buffer (UD).
    pub const GRH: u8 = 1 << 0;
    /// `imm_data` is valid.
    pub const WITH_IMM: u8 = 1 << 1;
}

/// A completion queue entry (SPEC.md §7.5). `owner` is written last.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cqe {
    pub wr_id: Le64,
    /// The QP the completed WQE belongs to.
    pub qp_num: Le32,
    pub byte_len: Le32,
    /// With [`wc_flags::WITH_IMM`]: the immediate data, as a host value.
    pub imm_data: Le32,
    /// UD receive: the sender's QP number.
    pub src_qp: Le32,
    /// ibv_wc_status value; 0 = success.
    pub status: u8,
    /// A [`wc_opcode`] value.
    pub opcode: u8,
    /// [`wc_flags`].
    pub wc_flags: u8,
    pub sl: u8,
    pub pkey_index: Le16,
    pub reserved: u8,
    /// Bit 0: the phase bit. The CQE at index `i` of a ring of `n` entries is valid when
    /// `owner & 1 == ((i / n) & 1) ^ 1` — the first lap writes 1, the second 0, and so on.
    pub owner: u8,
}

/// Doorbell record of a QP (SPEC.md §8.1). Indexes are free-running 32-bit counters; the slot
/// of index `i` is `i & (depth - 1)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpDoorbell {
    /// Driver: one past the last SQ WQE written.
    pub sq_producer: Le32,
    /// Driver: one past the last RQ WQE written.
    pub rq_producer: Le32,
    /// Device: one past the last SQ WQE consumed (its slot may be reused).
    pub sq_consumer: Le32,
    /// Device: one past the last RQ WQE consumed.
    pub rq_consumer: Le32,
}

/// Doorbell record of a CQ (SPEC.md §8.2).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CqDoorbell {
    /// Driver: one past the last CQE it has consumed.
    pub consumer_index: Le32,
    /// Driver: arm request, `(sequence << 2) | mode`; mode 1 = next completion,
    /// 2 = next solicited completion. A new request has a sequence different from `arm_served`.
    pub arm: Le32,
    /// Device: the sequence of the last arm request it has served with an event.
    pub arm_served: Le32,
    pub reserved: Le32,
}

/// Doorbell record of an SRQ (SPEC.md §8.3).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SrqDoorbell {
    /// Driver: one past the last WQE written.
    pub producer: Le32,
    /// Device: one past the last WQE consumed.
    pub consumer: Le32,
    pub reserved: [Le32; 2],
}

/// `NotifyState::flags` bit: the device's poller for this queue is about to sleep; the driver
/// must kick the notification queue after its next doorbell update.
pub const NOTIFY_NEED_WAKEUP: u32 = 1 << 0;

/// Per notification queue state shared with the device (SPEC.md §8.5), one cache line each.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NotifyState {
    /// Device-written [`NOTIFY_NEED_WAKEUP`].
    pub flags: Le32,
    /// Device-written: number of kicks the device has received on this queue.
    pub kicks: Le32,
    pub reserved: [Le32; 14],
}

/// Kinds of [`Event`] (SPEC.md §8.4).
pub mod event_kind {
    /// An armed CQ received a completion; `handle` is the CQ.
    pub const CQ_COMPLETION: u16 = 1;
    /// A CQ could not be written (ring overflow or bad memory); `handle` is the CQ.
    pub const CQ_ERROR: u16 = 2;
    /// A QP entered the error state on its own; `handle` is the QP.
    pub const QP_FATAL: u16 = 3;
    /// An SRQ fell below its limit; `handle` is the SRQ.
    pub const SRQ_LIMIT_REACHED: u16 = 4;
    /// The device hit an unrecoverable error; it must be reset.
    pub const DEVICE_FATAL: u16 = 5;
    /// The port became active; `handle` is the port number.
    pub const PORT_ACTIVE: u16 = 6;
    /// The port left the active state (link down); `handle` is the port number.
    pub const PORT_ERROR: u16 = 7;
    /// The device stopped taking WQEs from an SRQ (a malformed WQE, an unusable ring); every
    /// QP receiving from it fails too; `handle` is the SRQ.
    pub const SRQ_ERROR: u16 = 8;
    /// Connection-manager events are queued on an id that had none (SPEC.md §13.4); `handle`
    /// is the CM id.
    pub const CM_EVENT: u16 = 9;

    /// The constant's name, or `None` for a kind this specification does not define.
    pub fn name(kind: u16) -> Option<&'static str> {
        Some(match kind {
            CQ_COMPLETION => "CQ_COMPLETION",
            CQ_ERROR => "CQ_ERROR",
            QP_FATAL => "QP_FATAL",
            SRQ_LIMIT_REACHED => "SRQ_LIMIT_REACHED",
            DEVICE_FATAL => "DEVICE_FATAL",
            PORT_ACTIVE => "PORT_ACTIVE",
            PORT_ERROR => "PORT_ERROR",
            SRQ_ERROR => "SRQ_ERROR",
            CM_EVENT => "CM_EVENT",
            _ => return None,
        })
    }

    /// One more than the largest kind defined.
    pub const KINDS: usize = CM_EVENT as usize + 1;
}

/// An entry the device writes into a buffer of the event queue (SPEC.md §8.4).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Event {
    /// An [`event_kind`] value.
    pub kind: Le16,
    pub reserved: Le16,
    pub handle: Le32,
}

wire_struct!(
    SendWqe = 64,
    RecvWqe = 16,
    Sge = 16,
    Cqe = CQE_SIZE,
    QpDoorbell = 16,
    CqDoorbell = 16,
    SrqDoorbell = 16,
    NotifyState = 64,
    Event = 8,
);

/// True when the CQE at free-running index `index` of a ring of `depth` entries (a power of
/// two) holds a completion the driver has not consumed yet, given its `owner` byte.
pub fn cqe_is_valid(owner: u8, index: u32, depth: u32) -> bool {
    owner & 1 == cqe_owner_for(index, depth)
}

/// The `owner` byte the device writes into the CQE at free-running index `index`.
pub fn cqe_owner_for(index: u32, depth: u32) -> u8 {
    debug_assert!(depth.is_power_of_two());
    // 1 on even laps of the ring (index / depth), 0 on odd ones; depth is a power of two.
    u8::from(index & depth == 0)
}

/// The `owner` byte a driver resizing a CQ (SPEC.md §5.7.1) writes into slot `slot` of the
/// new ring of `depth` CQEs, its consumer index being `consumer`: that of the index before
/// `consumer`, within one lap, that lands in the slot, as if the CQ had always had the new
/// depth and every CQE before `consumer` had been written. So the slot reads as new only
/// once the device writes it.
pub fn resized_cq_owner(slot: u32, consumer: u32, depth: u32) -> u8 {
    debug_assert!(depth.is_power_of_two() && slot < depth);
    let lap_start = consumer.wrapping_sub(depth);
    let index = lap_start.wrapping_add(slot.wrapping_sub(lap_start) & (depth - 1));
    cqe_owner_for(index, depth)
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::offset_of;

    #[test]
    fn a_resized_rings_slots_read_as_new_only_once_written() {
        for depth in [2u32, 8, 64] {
            for consumer in [0u32, 1, 5, 63, 64, 1000, u32::MAX - 3, u32::MAX] {
                for slot in 0..depth {
                    let owner = resized_cq_owner(slot, consumer, depth);
                    // The next index the driver reads in this slot: at or after `consumer`.
                    let next = consumer.wrapping_add(slot.wrapping_sub(consumer) & (depth - 1));
                    assert_eq!(next & (depth - 1), slot);
                    assert!(
                        !cqe_is_valid(owner, next, depth),
                        "depth {depth}, consumer {consumer}, slot {slot}"
                    );
                    // Once the device writes the CQE of that index, it is.
                    assert!(cqe_is_valid(cqe_owner_for(next, depth), next, depth));
                }
            }
        }
    }

    #[test]
    fn owner_is_the_last_byte_of_a_cqe() {
        assert_eq!(offset_of!(Cqe, owner), CQE_SIZE - 1);
    }

    #[test]
    fn phase_bit_alternates_per_lap_and_a_zeroed_ring_is_empty() {
        let depth = 4;
        for index in 0..depth {
            assert!(
                !cqe_is_valid(0, index, depth),
                "zeroed ring must read as empty"
            );
            assert!(cqe_is_valid(cqe_owner_for(index, depth), index, depth));
        }
        for index in depth..2 * depth {
            // An entry left over from the first lap is stale in the second.
            assert!(!cqe_is_valid(
                cqe_owner_for(index - depth, depth),
                index,
                depth
            ));
            assert!(cqe_is_valid(cqe_owner_for(index, depth), index, depth));
        }
    }

    #[test]
    fn phase_bit_survives_index_wraparound() {
        let depth = 1 << 8;
        let last = u32::MAX;
        let first_after_wrap = last.wrapping_add(1);
        assert_ne!(
            cqe_owner_for(last, depth),
            cqe_owner_for(first_after_wrap, depth)
        );
    }
}
