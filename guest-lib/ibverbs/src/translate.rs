//! libibverbs structures to and from guest-lib's, field by field. Pure and unit-tested; the C
//! edge calls these once it holds plain references.

use std::os::raw::c_int;

use rdma_sys::ibv_rate;
use rdma_sys::{ibv_qp_attr, ibv_qp_type, ibv_send_wr, ibv_wc, ibv_wr_opcode};
use vrdma_guest::{QpAttr, QpCaps, QpType, SendOp, WorkCompletion};

/// `enum ibv_send_flags` bits this library reads.
pub mod send_flags {
    pub const FENCE: u32 = 1 << 0;
    pub const SIGNALED: u32 = 1 << 1;
    pub const SOLICITED: u32 = 1 << 2;
    pub const INLINE: u32 = 1 << 3;
}

/// Each `enum ibv_rate` with its multiple of 2.5 Gb/s (where the IB spec gives one, else
/// -1) and its data rate in Mb/s.
const RATES: [(ibv_rate::Type, c_int, c_int); 23] = [
    (ibv_rate::IBV_RATE_2_5_GBPS, 1, 2500),
    (ibv_rate::IBV_RATE_5_GBPS, 2, 5000),
    (ibv_rate::IBV_RATE_10_GBPS, 4, 10000),
    (ibv_rate::IBV_RATE_20_GBPS, 8, 20000),
    (ibv_rate::IBV_RATE_30_GBPS, 12, 30000),
    (ibv_rate::IBV_RATE_40_GBPS, 16, 40000),
    (ibv_rate::IBV_RATE_60_GBPS, 24, 60000),
    (ibv_rate::IBV_RATE_80_GBPS, 32, 80000),
    (ibv_rate::IBV_RATE_120_GBPS, 48, 120000),
    (ibv_rate::IBV_RATE_14_GBPS, -1, 14062),
    (ibv_rate::IBV_RATE_56_GBPS, -1, 56250),
    (ibv_rate::IBV_RATE_112_GBPS, -1, 112500),
    (ibv_rate::IBV_RATE_168_GBPS, -1, 168750),
    (ibv_rate::IBV_RATE_25_GBPS, -1, 25781),
    (ibv_rate::IBV_RATE_100_GBPS, -1, 103125),
    (ibv_rate::IBV_RATE_200_GBPS, -1, 206250),
    (ibv_rate::IBV_RATE_300_GBPS, -1, 309375),
    (ibv_rate::IBV_RATE_28_GBPS, 11, 28125),
    (ibv_rate::IBV_RATE_50_GBPS, 20, 53125),
    (ibv_rate::IBV_RATE_400_GBPS, 160, 425000),
    (ibv_rate::IBV_RATE_600_GBPS, 240, 637500),
    (ibv_rate::IBV_RATE_800_GBPS, 320, 850000),
    (ibv_rate::IBV_RATE_1200_GBPS, 480, 1275000),
];

/// `ibv_rate_to_mult`: -1 for rates with no multiple.
pub fn rate_to_mult(rate: ibv_rate::Type) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.1)
}

/// `mult_to_ibv_rate`: IBV_RATE_MAX for multiples no rate has.
pub fn mult_to_rate(mult: c_int) -> ibv_rate::Type {
    RATES
        .iter()
        .find(|r| r.1 == mult && mult > 0)
        .map_or(ibv_rate::IBV_RATE_MAX, |r| r.0)
}

/// `ibv_rate_to_mbps`: -1 for unknown rates.
pub fn rate_to_mbps(rate: ibv_rate::Type) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.2)
}

/// `mbps_to_ibv_rate`: IBV_RATE_MAX for data rates no rate has.
pub fn mbps_to_rate(mbps: c_int) -> ibv_rate::Type {
    RATES
        .iter()
        .find(|r| r.2 == mbps)
        .map_or(ibv_rate::IBV_RATE_MAX, |r| r.0)
}

/// `enum ibv_wc_flags` bits this library sets.
const WC_GRH: u32 = 1 << 0;
const WC_WITH_IMM: u32 = 1 << 1;

pub fn qp_type(value: ibv_qp_type::Type) -> Option<QpType> {
    match value {
        ibv_qp_type::IBV_QPT_RC => Some(QpType::Rc),
        ibv_qp_type::IBV_QPT_UC => Some(QpType::Uc),
        ibv_qp_type::IBV_QPT_UD => Some(QpType::Ud),
        _ => None,
    }
}

/// Fills `out` from a QP's attributes and capabilities, as `ibv_query_qp` reports them.
pub fn fill_qp_attr(out: &mut ibv_qp_attr, attr: &QpAttr, caps: &QpCaps) {
    *out = ibv_qp_attr {
        cur_qp_state: attr.qp_state as u32,
        cap: caps.into(),
        ..attr.into()
    };
}

/// The operation of a send work request; `Err(EINVAL)` for opcodes vrdma does not carry.
pub fn send_op(wr: &ibv_send_wr) -> Result<SendOp, c_int> {
    // SAFETY: these unions hold plain integers and pointers; the opcode says which member
    // the program filled, and reading another one only gives other integers.
    let (rdma, atomic, imm) = unsafe {
        (
            wr.wr.rdma,
            wr.wr.atomic,
            u32::from_be(wr.imm_data_invalidated_rkey_union.imm_data),
        )
    };
    Ok(match wr.opcode {
        ibv_wr_opcode::IBV_WR_SEND => SendOp::Send,
        ibv_wr_opcode::IBV_WR_SEND_WITH_IMM => SendOp::SendWithImm { imm },
        ibv_wr_opcode::IBV_WR_RDMA_WRITE => SendOp::RdmaWrite {
            remote_addr: rdma.remote_addr,
            rkey: rdma.rkey,
        },
        ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM => SendOp::RdmaWriteWithImm {
            remote_addr: rdma.remote_addr,
            rkey: rdma.rkey,
            imm,
        },
        ibv_wr_opcode::IBV_WR_RDMA_READ => SendOp::RdmaRead {
            remote_addr: rdma.remote_addr,
            rkey: rdma.rkey,
        },
        ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP => SendOp::CompareAndSwap {
            remote_addr: atomic.remote_addr,
            rkey: atomic.rkey,
            compare: atomic.compare_add,
            swap: atomic.swap,
        },
        ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD => SendOp::FetchAndAdd {
            remote_addr: atomic.remote_addr,
            rkey: atomic.rkey,
            add: atomic.compare_add,
        },
        _ => return Err(libc::EINVAL),
    })
}

/// The `ibv_create_cq_ex` completion fields served: those of `struct ibv_wc`.
pub const SERVED_CQ_EX_WC_FLAGS: u64 = {
    use rdma_sys::ibv_create_cq_wc_flags as f;
    (f::IBV_WC_EX_WITH_BYTE_LEN.0
        | f::IBV_WC_EX_WITH_IMM.0
        | f::IBV_WC_EX_WITH_QP_NUM.0
        | f::IBV_WC_EX_WITH_SRC_QP.0
        | f::IBV_WC_EX_WITH_SLID.0
        | f::IBV_WC_EX_WITH_SL.0
        | f::IBV_WC_EX_WITH_DLID_PATH_BITS.0) as u64
};
/// `IBV_CQ_INIT_ATTR_MASK_FLAGS`: creation flags (single-threaded, ignore overrun) are hints
/// vrdma may ignore.
pub const CQ_INIT_ATTR_MASK_FLAGS: u32 =
    rdma_sys::ibv_cq_init_attr_mask::IBV_CQ_INIT_ATTR_MASK_FLAGS.0;

/// A completion as `struct ibv_wc`. vrdma's status and opcode numbers are libibverbs'.
pub fn wc(from: &WorkCompletion) -> ibv_wc {
    let mut flags = 0;
    if from.grh {
        flags |= WC_GRH;
    }
    if from.imm_data.is_some() {
        flags |= WC_WITH_IMM;
    }
    ibv_wc {
        wr_id: from.wr_id,
        status: from.status.into(),
        opcode: from.opcode.into(),
        vendor_err: 0,
        byte_len: from.byte_len,
        imm_data_invalidated_rkey_union: rdma_sys::imm_data_invalidated_rkey_union_t {
            imm_data: from.imm_data.unwrap_or(0).to_be(),
        },
        qp_num: from.qp_num,
        src_qp: from.src_qp,
        wc_flags: flags,
        pkey_index: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
    }
}

/// The address vector back to the sender of a received datagram, from its 40-byte GRH
/// (`ibv_init_ah_from_wc`). On RoCEv2 over IPv4 the GRH's first 20 bytes are zero and the
/// datagram's IPv4 header follows (as the kernel and rxe lay it out): the sender is then its
/// IPv4 source address. The source is the device's one GID (index 0), the hop limit 0xff.
pub(crate) fn ah_from_grh(grh: &[u8; 40], sl: u8, port_num: u8) -> vrdma_guest::AhAttr {
    let ipv4 = &grh[20..];
    let is_ipv4 = grh[..20] == [0; 20] && ipv4[0] == 0x45;
    let (dgid, traffic_class, flow_label) = if is_ipv4 {
        let source = std::net::Ipv4Addr::new(ipv4[12], ipv4[13], ipv4[14], ipv4[15]);
        (vrdma_guest::Gid::from(source), ipv4[1], 0)
    } else {
        let word = u32::from_be_bytes([grh[0], grh[1], grh[2], grh[3]]);
        let mut sgid = [0; 16];
        sgid.copy_from_slice(&grh[8..24]);
        (vrdma_guest::Gid(sgid), (word >> 20) as u8, word & 0xf_ffff)
    };
    vrdma_guest::AhAttr {
        dgid,
        flow_label,
        sgid_index: 0,
        hop_limit: 0xff,
        traffic_class,
        is_global: true,
        dlid: 0,
        sl,
        port_num,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_guest::QpState;

    fn zeroed<T>() -> T {
        // SAFETY: only used for the plain C structures below, valid as all-zero bytes.
        unsafe { std::mem::zeroed() }
    }

    #[test]
    fn a_queried_qp_reports_its_state_as_current_and_its_capabilities() {
        let attr = QpAttr {
            qp_state: QpState::Rts,
            dest_qp_num: 0x123,
            ..Default::default()
        };
        let caps = QpCaps {
            max_send_wr: 64,
            max_inline_data: 128,
            ..Default::default()
        };
        let mut back: ibv_qp_attr = zeroed();
        fill_qp_attr(&mut back, &attr, &caps);
        assert_eq!((back.qp_state, back.cur_qp_state), (3, 3));
        assert_eq!(back.dest_qp_num, 0x123);
        assert_eq!((back.cap.max_send_wr, back.cap.max_inline_data), (64, 128));
    }

    #[test]
    fn send_opcodes_and_immediates_translate() {
        let mut wr: ibv_send_wr = zeroed();
        wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
        wr.wr.rdma = rdma_sys::rdma_t {
            remote_addr: 0x1000,
            rkey: 9,
        };
        wr.imm_data_invalidated_rkey_union.imm_data = 0x0102_0304u32.to_be();
        assert_eq!(
            send_op(&wr),
            Ok(SendOp::RdmaWriteWithImm {
                remote_addr: 0x1000,
                rkey: 9,
                imm: 0x0102_0304
            })
        );
        wr.opcode = ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
        wr.wr.atomic = rdma_sys::atomic_t {
            remote_addr: 0x2000,
            compare_add: 5,
            swap: 0,
            rkey: 3,
        };
        assert_eq!(
            send_op(&wr),
            Ok(SendOp::FetchAndAdd {
                remote_addr: 0x2000,
                rkey: 3,
                add: 5
            })
        );
        wr.opcode = ibv_wr_opcode::IBV_WR_LOCAL_INV;
        assert_eq!(send_op(&wr), Err(libc::EINVAL));
    }

    #[test]
    fn completions_carry_flags_and_network_order_immediates() {
        let done = WorkCompletion {
            wr_id: 42,
            status: 0,
            opcode: 129,
            byte_len: 8,
            imm_data: Some(0x0a0b_0c0d),
            qp_num: 5,
            src_qp: 6,
            grh: true,
        };
        let out = wc(&done);
        assert_eq!((out.wr_id, out.opcode, out.byte_len), (42, 129, 8));
        assert_eq!(out.wc_flags, WC_GRH | WC_WITH_IMM);
        // SAFETY: the member just written.
        let imm = unsafe { out.imm_data_invalidated_rkey_union.imm_data };
        assert_eq!(u32::from_be(imm), 0x0a0b_0c0d);
    }

    #[test]
    fn rates_convert_both_ways_and_unknowns_are_refused() {
        assert_eq!(rate_to_mult(ibv_rate::IBV_RATE_10_GBPS), 4);
        assert_eq!(mult_to_rate(4), ibv_rate::IBV_RATE_10_GBPS);
        assert_eq!(rate_to_mult(ibv_rate::IBV_RATE_25_GBPS), -1);
        assert_eq!(mult_to_rate(-1), ibv_rate::IBV_RATE_MAX);
        assert_eq!(mult_to_rate(3), ibv_rate::IBV_RATE_MAX);
        assert_eq!(rate_to_mbps(ibv_rate::IBV_RATE_100_GBPS), 103125);
        assert_eq!(mbps_to_rate(103125), ibv_rate::IBV_RATE_100_GBPS);
        assert_eq!(rate_to_mbps(ibv_rate::IBV_RATE_MAX), -1);
        assert_eq!(mbps_to_rate(1), ibv_rate::IBV_RATE_MAX);
    }

    #[test]
    fn sge_layouts_match_so_sge_arrays_are_used_in_place() {
        assert_eq!(
            std::alloc::Layout::new::<rdma_sys::ibv_sge>(),
            std::alloc::Layout::new::<vrdma_guest::Sge>()
        );
        assert_eq!(std::mem::offset_of!(rdma_sys::ibv_sge, lkey), 12);
        assert_eq!(std::mem::offset_of!(vrdma_guest::Sge, lkey), 12);
    }

    #[test]
    fn an_ibv_cq_ex_begins_with_an_ibv_cq_so_one_object_serves_both_apis() {
        use rdma_sys::{ibv_cq, ibv_cq_ex};
        use std::mem::offset_of;
        let pairs = [
            (offset_of!(ibv_cq, context), offset_of!(ibv_cq_ex, context)),
            (offset_of!(ibv_cq, channel), offset_of!(ibv_cq_ex, channel)),
            (
                offset_of!(ibv_cq, cq_context),
                offset_of!(ibv_cq_ex, cq_context),
            ),
            (offset_of!(ibv_cq, handle), offset_of!(ibv_cq_ex, handle)),
            (offset_of!(ibv_cq, cqe), offset_of!(ibv_cq_ex, cqe)),
            (offset_of!(ibv_cq, mutex), offset_of!(ibv_cq_ex, mutex)),
            (offset_of!(ibv_cq, cond), offset_of!(ibv_cq_ex, cond)),
            (
                offset_of!(ibv_cq, comp_events_completed),
                offset_of!(ibv_cq_ex, comp_events_completed),
            ),
            (
                offset_of!(ibv_cq, async_events_completed),
                offset_of!(ibv_cq_ex, async_events_completed),
            ),
        ];
        for (cq, cq_ex) in pairs {
            assert_eq!(cq, cq_ex);
        }
    }

    #[test]
    fn a_datagrams_grh_names_its_sender() {
        // RoCEv2 over IPv4: 20 zero bytes, then the IPv4 header (source 192.0.2.9, TOS 0x10).
        let mut grh = [0u8; 40];
        grh[20] = 0x45;
        grh[21] = 0x10;
        grh[32..36].copy_from_slice(&[192, 0, 2, 9]);
        let ah = ah_from_grh(&grh, 0, 1);
        assert_eq!(
            ah.dgid,
            vrdma_guest::Gid::from(std::net::Ipv4Addr::new(192, 0, 2, 9))
        );
        assert_eq!(
            (ah.traffic_class, ah.sgid_index, ah.hop_limit, ah.is_global),
            (0x10, 0, 0xff, true)
        );
        // A GRH proper: version 6, traffic class 0x22, flow 0x12345, source GID at 8..24.
        let mut grh = [0u8; 40];
        grh[..4].copy_from_slice(&(6u32 << 28 | 0x22 << 20 | 0x12345).to_be_bytes());
        grh[8..24].copy_from_slice(&[0xfe; 16]);
        let ah = ah_from_grh(&grh, 3, 1);
        assert_eq!(
            (ah.dgid, ah.traffic_class, ah.flow_label, ah.sl),
            (vrdma_guest::Gid([0xfe; 16]), 0x22, 0x12345, 3)
        );
    }
}
