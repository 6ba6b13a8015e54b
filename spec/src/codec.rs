//! The data path's rules (SPEC.md §7-§8), written once: the driver encodes WQEs, picks slot
//! sizes, arms CQs and finds doorbell fields with these functions, and the device decodes
//! and checks with the same ones.

use core::mem::{offset_of, size_of};

use crate::ring::{
    wc_opcode, wqe_flags, wr_opcode, CqDoorbell, NotifyState, QpDoorbell, RecvWqe, SendWqe, Sge,
    SrqDoorbell, MAX_WQE_SHIFT, MIN_RQ_WQE_SHIFT, MIN_SQ_WQE_SHIFT,
};
use crate::{Le32, Le64};

/// Bytes of a send WQE header (§7.2); SGEs or inline data follow it in the slot.
pub const SEND_WQE_HEADER: usize = size_of::<SendWqe>();
/// Bytes of a receive WQE header (§7.3).
pub const RECV_WQE_HEADER: usize = size_of::<RecvWqe>();
/// Bytes of one scatter/gather entry (§7.4).
pub const SGE_SIZE: usize = size_of::<Sge>();

// ---- rings (§7.1) -------------------------------------------------------------------------

/// The slot of free-running index `index` in a ring of `depth` (a power of two) slots.
pub fn ring_slot(index: u32, depth: u32) -> u32 {
    debug_assert!(depth.is_power_of_two());
    index & (depth - 1)
}

/// Entries written and not yet consumed, across the 2^32 wrap.
pub fn ring_pending(producer: u32, consumer: u32) -> u32 {
    producer.wrapping_sub(consumer)
}

/// Bytes a send slot needs for `max_sge` SGEs or `max_inline` inline bytes (§7.2).
pub fn send_slot_bytes(max_sge: u32, max_inline: u32) -> u64 {
    SEND_WQE_HEADER as u64 + (SGE_SIZE as u64 * u64::from(max_sge)).max(u64::from(max_inline))
}

/// Bytes a receive slot needs for `max_sge` SGEs (§7.3).
pub fn recv_slot_bytes(max_sge: u32) -> u64 {
    RECV_WQE_HEADER as u64 + SGE_SIZE as u64 * u64::from(max_sge)
}

/// Inline bytes a send WQE can carry in the largest slot.
#[expect(
    clippy::cast_possible_truncation,
    reason = "SEND_WQE_HEADER is the size of the send WQE header, asserted at compile time (tens of bytes)"
)]
pub const MAX_SEND_INLINE: u32 = (1 << MAX_WQE_SHIFT) - SEND_WQE_HEADER as u32;
/// SGEs a send WQE can carry in the largest slot.
#[expect(
    clippy::cast_possible_truncation,
    reason = "SGE_SIZE is the size of the wire SGE, asserted at compile time (16 bytes)"
)]
pub const MAX_SEND_SGE: u32 = MAX_SEND_INLINE / SGE_SIZE as u32;

/// The smallest allowed stride (log2) of at least `bytes`; `None` above the largest.
fn wqe_shift(bytes: u64, min_shift: u8) -> Option<u8> {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "trailing_zeros of a u64 is at most 64"
    )]
    let shift = (bytes.max(1).next_power_of_two().trailing_zeros() as u8).max(min_shift);
    (shift <= MAX_WQE_SHIFT).then_some(shift)
}

/// The SQ stride (log2) a driver picks for `max_sge` SGEs and `max_inline` inline bytes.
pub fn send_wqe_shift(max_sge: u32, max_inline: u32) -> Option<u8> {
    wqe_shift(send_slot_bytes(max_sge, max_inline), MIN_SQ_WQE_SHIFT)
}

/// The RQ/SRQ stride (log2) a driver picks for `max_sge` SGEs.
pub fn recv_wqe_shift(max_sge: u32) -> Option<u8> {
    wqe_shift(recv_slot_bytes(max_sge), MIN_RQ_WQE_SHIFT)
}

// ---- send WQEs (§7.2) ---------------------------------------------------------------------

/// What a send WQE does, with its operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    Send,
    SendWithImm {
        imm: u32,
    },
    RdmaWrite {
        remote_addr: u64,
        rkey: u32,
    },
    RdmaWriteWithImm {
        remote_addr: u64,
        rkey: u32,
        imm: u32,
    },
    RdmaRead {
        remote_addr: u64,
        rkey: u32,
    },
    CompareAndSwap {
        remote_addr: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    },
    FetchAndAdd {
        remote_addr: u64,
        rkey: u32,
        add: u64,
    },
}

/// A send WQE's operation without its operands: what its opcode names (§7.2).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOpcode {
    RdmaWrite = wr_opcode::RDMA_WRITE,
    RdmaWriteWithImm = wr_opcode::RDMA_WRITE_WITH_IMM,
    Send = wr_opcode::SEND,
    SendWithImm = wr_opcode::SEND_WITH_IMM,
    RdmaRead = wr_opcode::RDMA_READ,
    CompareAndSwap = wr_opcode::ATOMIC_CMP_AND_SWP,
    FetchAndAdd = wr_opcode::ATOMIC_FETCH_AND_ADD,
}

impl SendOpcode {
    /// The operation a [`wr_opcode`] value names.
    pub const fn from_wire(opcode: u8) -> Option<SendOpcode> {
        Some(match opcode {
            wr_opcode::RDMA_WRITE => SendOpcode::RdmaWrite,
            wr_opcode::RDMA_WRITE_WITH_IMM => SendOpcode::RdmaWriteWithImm,
            wr_opcode::SEND => SendOpcode::Send,
            wr_opcode::SEND_WITH_IMM => SendOpcode::SendWithImm,
            wr_opcode::RDMA_READ => SendOpcode::RdmaRead,
            wr_opcode::ATOMIC_CMP_AND_SWP => SendOpcode::CompareAndSwap,
            wr_opcode::ATOMIC_FETCH_AND_ADD => SendOpcode::FetchAndAdd,
            _ => return None,
        })
    }

    /// The CQE opcode (§7.5) of this operation's completion.
    pub fn completion_opcode(self) -> u8 {
        match self {
            SendOpcode::Send | SendOpcode::SendWithImm => wc_opcode::SEND,
            SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm => wc_opcode::RDMA_WRITE,
            SendOpcode::RdmaRead => wc_opcode::RDMA_READ,
            SendOpcode::CompareAndSwap => wc_opcode::COMP_SWAP,
            SendOpcode::FetchAndAdd => wc_opcode::FETCH_ADD,
        }
    }

    pub const fn is_atomic(self) -> bool {
        matches!(self, SendOpcode::CompareAndSwap | SendOpcode::FetchAndAdd)
    }

    /// RDMA READ and the atomics: operations that need a reliable connection (RC), which an
    /// unreliable one (UC) cannot carry.
    pub const fn needs_reliable(self) -> bool {
        matches!(self, SendOpcode::RdmaRead) || self.is_atomic()
    }

    /// SEND and SEND_WITH_IMM: the only operations of a UD QP.
    pub fn is_send(self) -> bool {
        matches!(self, SendOpcode::Send | SendOpcode::SendWithImm)
    }

    /// Operations that may carry their payload inline.
    pub fn may_be_inline(self) -> bool {
        matches!(
            self,
            SendOpcode::Send
                | SendOpcode::SendWithImm
                | SendOpcode::RdmaWrite
                | SendOpcode::RdmaWriteWithImm
        )
    }
}

impl SendOp {
    pub fn opcode(&self) -> SendOpcode {
        match self {
            SendOp::Send => SendOpcode::Send,
            SendOp::SendWithImm { .. } => SendOpcode::SendWithImm,
            SendOp::RdmaWrite { .. } => SendOpcode::RdmaWrite,
            SendOp::RdmaWriteWithImm { .. } => SendOpcode::RdmaWriteWithImm,
            SendOp::RdmaRead { .. } => SendOpcode::RdmaRead,
            SendOp::CompareAndSwap { .. } => SendOpcode::CompareAndSwap,
            SendOp::FetchAndAdd { .. } => SendOpcode::FetchAndAdd,
        }
    }

    /// The CQE opcode (§7.5) of this operation's completion.
    pub fn completion_opcode(&self) -> u8 {
        self.opcode().completion_opcode()
    }

    pub fn is_atomic(&self) -> bool {
        self.opcode().is_atomic()
    }

    /// SEND and SEND_WITH_IMM: the only operations of a UD QP.
    pub fn is_send(&self) -> bool {
        self.opcode().is_send()
    }

    /// Operations that may carry their payload inline.
    pub fn may_be_inline(&self) -> bool {
        self.opcode().may_be_inline()
    }
}

/// A send operation's operands, flat: those the operation does not use are zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendOperands {
    /// *_WITH_IMM: the immediate data, as a host value.
    pub imm: u32,
    /// RDMA and atomics: the remote address and key.
    pub remote_addr: u64,
    pub rkey: u32,
    /// ATOMIC_CMP_AND_SWP: the compare value; ATOMIC_FETCH_AND_ADD: the addend.
    pub compare_add: u64,
    /// ATOMIC_CMP_AND_SWP: the swap value.
    pub swap: u64,
}

impl SendOp {
    pub fn operands(&self) -> SendOperands {
        let remote = |remote_addr, rkey| SendOperands {
            remote_addr,
            rkey,
            ..Default::default()
        };
        match *self {
            SendOp::Send => SendOperands::default(),
            SendOp::SendWithImm { imm } => SendOperands {
                imm,
                ..Default::default()
            },
            SendOp::RdmaWrite { remote_addr, rkey } | SendOp::RdmaRead { remote_addr, rkey } => {
                remote(remote_addr, rkey)
            }
            SendOp::RdmaWriteWithImm {
                remote_addr,
                rkey,
                imm,
            } => SendOperands {
                imm,
                ..remote(remote_addr, rkey)
            },
            SendOp::CompareAndSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            } => SendOperands {
                compare_add: compare,
                swap,
                ..remote(remote_addr, rkey)
            },
            SendOp::FetchAndAdd {
                remote_addr,
                rkey,
                add,
            } => SendOperands {
                compare_add: add,
                ..remote(remote_addr, rkey)
            },
        }
    }

    /// The operation `opcode` names, with the operands it uses from `operands`.
    pub fn from_parts(opcode: SendOpcode, operands: &SendOperands) -> SendOp {
        let SendOperands {
            imm,
            remote_addr,
            rkey,
            compare_add,
            swap,
        } = *operands;
        match opcode {
            SendOpcode::Send => SendOp::Send,
            SendOpcode::SendWithImm => SendOp::SendWithImm { imm },
            SendOpcode::RdmaWrite => SendOp::RdmaWrite { remote_addr, rkey },
            SendOpcode::RdmaWriteWithImm => SendOp::RdmaWriteWithImm {
                remote_addr,
                rkey,
                imm,
            },
            SendOpcode::RdmaRead => SendOp::RdmaRead { remote_addr, rkey },
            SendOpcode::CompareAndSwap => SendOp::CompareAndSwap {
                remote_addr,
                rkey,
                compare: compare_add,
                swap,
            },
            SendOpcode::FetchAndAdd => SendOp::FetchAndAdd {
                remote_addr,
                rkey,
                add: compare_add,
            },
        }
    }
}

/// Where a send WQE's payload is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WqePayload {
    /// That many SGEs follow the header.
    Sges(u8),
    /// That many bytes follow the header (INLINE).
    Inline(u32),
}

/// A UD send's destination, as the WQE carries it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UdAddress {
    pub ah: u32,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// A send WQE header, field by field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendHeader {
    pub wr_id: u64,
    pub op: SendOp,
    pub signaled: bool,
    pub solicited: bool,
    pub fence: bool,
    pub payload: WqePayload,
    /// All zero on an RC QP.
    pub ud: UdAddress,
}

/// A well-formed send WQE header's operation and payload (§7.2): a device takes the
/// operands straight from the header's fields, as the operation names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendForm {
    pub opcode: SendOpcode,
    pub payload: WqePayload,
}

/// Why a send WQE header is not a well-formed one (§7.2), before any QP's limits apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WqeFormatError {
    #[error("unknown WQE opcode {0}")]
    UnknownOpcode(u8),
    #[error("unknown WQE flags {0:#x}")]
    UnknownFlags(u8),
    #[error("INLINE with {0} SGEs")]
    InlineWithSges(u8),
}

impl SendWqe {
    /// The header the driver writes for `header`.
    pub fn encode(header: &SendHeader) -> SendWqe {
        let mut wqe = SendWqe {
            wr_id: Le64::from(header.wr_id),
            ..Default::default()
        };
        let operands = header.op.operands();
        wqe.imm_data = Le32::from(operands.imm);
        wqe.remote_addr = Le64::from(operands.remote_addr);
        wqe.rkey = Le32::from(operands.rkey);
        wqe.compare_add = Le64::from(operands.compare_add);
        wqe.swap = Le64::from(operands.swap);
        wqe.opcode = header.op.opcode() as u8;
        for (set, flag) in [
            (header.signaled, wqe_flags::SIGNALED),
            (header.solicited, wqe_flags::SOLICITED),
            (header.fence, wqe_flags::FENCE),
        ] {
            if set {
                wqe.flags |= flag;
            }
        }
        match header.payload {
            WqePayload::Sges(count) => wqe.num_sge = count,
            WqePayload::Inline(len) => {
                wqe.flags |= wqe_flags::INLINE;
                wqe.inline_len = Le32::from(len);
            }
        }
        wqe.ah = Le32::from(header.ud.ah);
        wqe.remote_qpn = Le32::from(header.ud.remote_qpn);
        wqe.remote_qkey = Le32::from(header.ud.remote_qkey);
        wqe
    }

    /// Checks the header's form: a known opcode and flags, and INLINE without SGEs.
    // Inlined into the device's loop over a batch of WQEs.
    #[inline(always)]
    pub fn form(&self) -> Result<SendForm, WqeFormatError> {
        let flags = self.flags;
        if flags & !wqe_flags::ALL != 0 {
            return Err(WqeFormatError::UnknownFlags(flags));
        }
        let opcode =
            SendOpcode::from_wire(self.opcode).ok_or(WqeFormatError::UnknownOpcode(self.opcode))?;
        let payload = if flags & wqe_flags::INLINE != 0 {
            if self.num_sge != 0 {
                return Err(WqeFormatError::InlineWithSges(self.num_sge));
            }
            WqePayload::Inline(self.inline_len.to_native())
        } else {
            WqePayload::Sges(self.num_sge)
        };
        Ok(SendForm { opcode, payload })
    }

    /// The operands as the header carries them, whichever the operation uses.
    pub fn operands(&self) -> SendOperands {
        SendOperands {
            imm: self.imm_data.to_native(),
            remote_addr: self.remote_addr.to_native(),
            rkey: self.rkey.to_native(),
            compare_add: self.compare_add.to_native(),
            swap: self.swap.to_native(),
        }
    }

    pub fn signaled(&self) -> bool {
        self.flags & wqe_flags::SIGNALED != 0
    }

    pub fn solicited(&self) -> bool {
        self.flags & wqe_flags::SOLICITED != 0
    }

    pub fn fence(&self) -> bool {
        self.flags & wqe_flags::FENCE != 0
    }

    /// The header a device reads. Fields an operation does not use are ignored.
    pub fn decode(&self) -> Result<SendHeader, WqeFormatError> {
        let SendForm { opcode, payload } = self.form()?;
        let op = SendOp::from_parts(opcode, &self.operands());
        Ok(SendHeader {
            wr_id: self.wr_id.to_native(),
            op,
            signaled: self.signaled(),
            solicited: self.solicited(),
            fence: self.fence(),
            payload,
            ud: UdAddress {
                ah: self.ah.to_native(),
                remote_qpn: self.remote_qpn.to_native(),
                remote_qkey: self.remote_qkey.to_native(),
            },
        })
    }
}

// ---- receive WQEs and SGEs (§7.3, §7.4) ---------------------------------------------------

impl RecvWqe {
    pub fn encode(wr_id: u64, num_sge: u32) -> RecvWqe {
        RecvWqe {
            wr_id: Le64::from(wr_id),
            num_sge: Le32::from(num_sge),
            reserved: Le32::from(0),
        }
    }
}

impl Sge {
    pub fn encode(addr: u64, length: u32, lkey: u32) -> Sge {
        Sge {
            addr: Le64::from(addr),
            length: Le32::from(length),
            lkey: Le32::from(lkey),
        }
    }
}

/// Where SGE `index` of a WQE starts in its slot, after a header of `header` bytes.
pub fn sge_offset(header: usize, index: usize) -> usize {
    header + SGE_SIZE * index
}

// ---- doorbell records and notification state (§8) ----------------------------------------

/// Byte offsets of the fields of a doorbell record or notification state, for atomic access.
impl QpDoorbell {
    pub const SQ_PRODUCER: u64 = offset_of!(QpDoorbell, sq_producer) as u64;
    pub const RQ_PRODUCER: u64 = offset_of!(QpDoorbell, rq_producer) as u64;
    pub const SQ_CONSUMER: u64 = offset_of!(QpDoorbell, sq_consumer) as u64;
    pub const RQ_CONSUMER: u64 = offset_of!(QpDoorbell, rq_consumer) as u64;
}

impl CqDoorbell {
    pub const CONSUMER_INDEX: u64 = offset_of!(CqDoorbell, consumer_index) as u64;
    pub const ARM: u64 = offset_of!(CqDoorbell, arm) as u64;
    pub const ARM_SERVED: u64 = offset_of!(CqDoorbell, arm_served) as u64;
}

impl SrqDoorbell {
    pub const PRODUCER: u64 = offset_of!(SrqDoorbell, producer) as u64;
    pub const CONSUMER: u64 = offset_of!(SrqDoorbell, consumer) as u64;
}

impl NotifyState {
    pub const FLAGS: u64 = offset_of!(NotifyState, flags) as u64;
    pub const KICKS: u64 = offset_of!(NotifyState, kicks) as u64;
}

/// Where notification queue `queue`'s state is in the notify area (§8.5).
pub fn notify_state_offset(queue: u32) -> u64 {
    u64::from(queue) * std::mem::size_of::<NotifyState>() as u64
}

/// Bytes of the notify area of a device with `num_notify_queues` (§8.5).
pub fn notify_area_bytes(num_notify_queues: u32) -> u64 {
    notify_state_offset(num_notify_queues)
}

/// Bits of the doorbell bitmap (§8.5): one per QP and SRQ the device allows, in whole
/// 64-bit words.
pub fn doorbell_bitmap_bits(max_qp: u32, max_srq: u32) -> u32 {
    (max_qp.saturating_add(max_srq))
        .div_ceil(64)
        .saturating_mul(64)
}

/// Bytes of the doorbell bitmap.
pub fn doorbell_bitmap_bytes(max_qp: u32, max_srq: u32) -> u64 {
    u64::from(doorbell_bitmap_bits(max_qp, max_srq)) / 8
}

/// Where doorbell bit `bit` is: the byte offset of its 64-bit word in the bitmap, and its mask.
pub fn doorbell_word(bit: u16) -> (u64, u64) {
    (u64::from(bit / 64) * 8, 1 << (bit % 64))
}

/// Most bits a doorbell bitmap has: bit numbers are 16 bits wide.
pub const MAX_DOORBELL_BITS: u32 = 1 << 16;

/// Most doorbell areas ADD_DOORBELL_AREA adds to a device (§8.6), numbered from 1.
pub const MAX_DOORBELL_AREAS: u32 = 1024;

/// An arm request of a CQ (§8.2): the event fires at the next completion, or the next
/// solicited one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArmRequest {
    /// 30 bits; a request is outstanding while it differs from `arm_served`.
    pub sequence: u32,
    pub solicited_only: bool,
}

const ARM_MODE_ANY: u32 = 1;
const ARM_MODE_SOLICITED: u32 = 2;
const ARM_SEQUENCE_MASK: u32 = (1 << 30) - 1;

impl ArmRequest {
    /// The `arm` word the driver stores.
    pub fn encode(&self) -> u32 {
        let mode = if self.solicited_only {
            ARM_MODE_SOLICITED
        } else {
            ARM_MODE_ANY
        };
        ((self.sequence & ARM_SEQUENCE_MASK) << 2) | mode
    }

    /// The request in an `arm` word, if it holds one.
    pub fn decode(arm: u32) -> Option<ArmRequest> {
        let solicited_only = match arm & 3 {
            ARM_MODE_ANY => false,
            ARM_MODE_SOLICITED => true,
            _ => return None,
        };
        Some(ArmRequest {
            sequence: arm >> 2,
            solicited_only,
        })
    }

    /// True while the device has not served this request (`arm_served` is what it stored).
    pub fn is_outstanding(&self, arm_served: u32) -> bool {
        self.sequence != arm_served
    }
}

/// Proptest strategies over the codec's types, for property tests of either side.
#[cfg(any(test, feature = "testing"))]
pub mod strategies {
    use super::{SendHeader, SendOp, UdAddress, WqePayload};
    use proptest::prelude::*;

    /// Send WQE headers of any operation, flags and wr_id, with payloads from `payload` and
    /// UD addresses from `ud`.
    pub fn send_header(
        payload: impl Strategy<Value = WqePayload>,
        ud: impl Strategy<Value = UdAddress>,
    ) -> impl Strategy<Value = SendHeader> {
        (any::<u64>(), send_op(), any::<[bool; 3]>(), payload, ud).prop_map(
            |(wr_id, op, [signaled, solicited, fence], payload, ud)| SendHeader {
                wr_id,
                op,
                signaled,
                solicited,
                fence,
                payload,
                ud,
            },
        )
    }

    /// Any send operation, operands included.
    pub fn send_op() -> impl Strategy<Value = SendOp> {
        let addr = any::<u64>();
        let key = any::<u32>();
        prop_oneof![
            Just(SendOp::Send),
            any::<u32>().prop_map(|imm| SendOp::SendWithImm { imm }),
            (addr, key).prop_map(|(remote_addr, rkey)| SendOp::RdmaWrite { remote_addr, rkey }),
            (addr, key, any::<u32>()).prop_map(|(remote_addr, rkey, imm)| {
                SendOp::RdmaWriteWithImm {
                    remote_addr,
                    rkey,
                    imm,
                }
            }),
            (addr, key).prop_map(|(remote_addr, rkey)| SendOp::RdmaRead { remote_addr, rkey }),
            (addr, key, any::<u64>(), any::<u64>()).prop_map(
                |(remote_addr, rkey, compare, swap)| {
                    SendOp::CompareAndSwap {
                        remote_addr,
                        rkey,
                        compare,
                        swap,
                    }
                }
            ),
            (addr, key, any::<u64>()).prop_map(|(remote_addr, rkey, add)| SendOp::FetchAndAdd {
                remote_addr,
                rkey,
                add
            }),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::strategies;
    use super::*;
    use proptest::prelude::*;

    fn send_header() -> impl Strategy<Value = SendHeader> {
        let payload = prop_oneof![
            any::<u8>().prop_map(WqePayload::Sges),
            any::<u32>().prop_map(WqePayload::Inline),
        ];
        let ud =
            (any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(ah, remote_qpn, remote_qkey)| {
                UdAddress {
                    ah,
                    remote_qpn,
                    remote_qkey,
                }
            });
        strategies::send_header(payload, ud)
    }

    #[test]
    fn send_opcodes_are_their_wire_values() {
        let known: Vec<_> = (0..=u8::MAX).filter_map(SendOpcode::from_wire).collect();
        assert_eq!(known.len(), 7);
        for opcode in known {
            assert_eq!(SendOpcode::from_wire(opcode as u8), Some(opcode));
        }
    }

    proptest! {
        #[test]
        fn what_the_driver_encodes_the_device_decodes(header in send_header()) {
            prop_assert_eq!(SendWqe::encode(&header).decode(), Ok(header));
        }

        #[test]
        fn decoding_never_accepts_an_unknown_opcode_or_flag(
            header in send_header(), opcode in 7u8.., flag in 4u32..8,
        ) {
            let mut wqe = SendWqe::encode(&header);
            wqe.opcode = opcode;
            prop_assert_eq!(wqe.decode(), Err(WqeFormatError::UnknownOpcode(opcode)));
            let mut wqe = SendWqe::encode(&header);
            wqe.flags |= 1 << flag;
            prop_assert_eq!(wqe.decode(), Err(WqeFormatError::UnknownFlags(wqe.flags)));
        }

        #[test]
        fn ring_indexes_wrap_at_two_to_the_32(
            consumer in any::<u32>(), written in 0u32..=1024, depth_shift in 0u32..=10,
        ) {
            let depth = 1u32 << depth_shift;
            let written = written.min(depth);
            let producer = consumer.wrapping_add(written);
            prop_assert_eq!(ring_pending(producer, consumer), written);
            // Consecutive indexes take consecutive slots, across the wrap too.
            let slots: Vec<u32> = (0..written).map(|i| ring_slot(consumer.wrapping_add(i), depth)).collect();
            for pair in slots.windows(2) {
                prop_assert_eq!(pair[1], (pair[0] + 1) % depth);
            }
        }

        #[test]
        fn arm_requests_round_trip(sequence in 0u32..(1 << 30), solicited_only in any::<bool>()) {
            let request = ArmRequest { sequence, solicited_only };
            prop_assert_eq!(ArmRequest::decode(request.encode()), Some(request));
            prop_assert!(!request.is_outstanding(sequence));
        }

        #[test]
        fn a_driver_sized_slot_holds_its_sges_and_inline_data(max_sge in 0u32..=252, max_inline in 0u32..=4032) {
            let shift = send_wqe_shift(max_sge, max_inline).expect("fits the largest stride");
            prop_assert!(send_slot_bytes(max_sge, max_inline) <= 1 << shift);
            prop_assert!(shift == MIN_SQ_WQE_SHIFT || send_slot_bytes(max_sge, max_inline) > 1 << (shift - 1));
        }
    }

    #[test]
    fn slot_sizes_follow_the_spec() {
        assert_eq!(send_wqe_shift(0, 0), Some(6));
        assert_eq!(send_wqe_shift(1, 0), Some(7));
        assert_eq!(send_wqe_shift(4, 64), Some(7));
        assert_eq!(send_wqe_shift(252, 0), Some(12));
        assert_eq!(send_wqe_shift(253, 0), None);
        assert_eq!(send_wqe_shift(0, 4032), Some(12));
        assert_eq!(recv_wqe_shift(0), Some(4));
        assert_eq!(recv_wqe_shift(1), Some(5));
        assert_eq!(recv_wqe_shift(255), Some(12));
        assert_eq!(recv_wqe_shift(256), None);
    }

    #[test]
    fn doorbell_bits_are_whole_words_and_each_bit_has_its_own_mask() {
        assert_eq!(doorbell_bitmap_bits(16384, 1024), 17408);
        assert_eq!(doorbell_bitmap_bits(1, 0), 64);
        assert_eq!(doorbell_bitmap_bytes(100, 28), 16);
        assert_eq!(doorbell_word(0), (0, 1));
        assert_eq!(doorbell_word(63), (0, 1 << 63));
        assert_eq!(doorbell_word(64), (8, 1));
        assert_eq!(doorbell_word(u16::MAX), (1023 * 8, 1 << 63));
    }

    #[test]
    fn an_empty_arm_word_is_no_request() {
        assert_eq!(ArmRequest::decode(0), None);
        assert_eq!(ArmRequest::decode(3 | (5 << 2)), None);
    }

    #[test]
    fn doorbell_offsets_are_the_specs() {
        assert_eq!(
            [
                QpDoorbell::SQ_PRODUCER,
                QpDoorbell::RQ_PRODUCER,
                QpDoorbell::SQ_CONSUMER,
                QpDoorbell::RQ_CONSUMER
            ],
            [0, 4, 8, 12]
        );
        assert_eq!(
            [
                CqDoorbell::CONSUMER_INDEX,
                CqDoorbell::ARM,
                CqDoorbell::ARM_SERVED
            ],
            [0, 4, 8]
        );
        assert_eq!([SrqDoorbell::PRODUCER, SrqDoorbell::CONSUMER], [0, 4]);
        assert_eq!([NotifyState::FLAGS, NotifyState::KICKS], [0, 4]);
    }
}
