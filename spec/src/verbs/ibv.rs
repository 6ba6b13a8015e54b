//! The vocabulary to and from libibverbs' own structures (feature `ibverbs`): for the backend,
//! which hands them to the host's verbs, and for vrdma's libibverbs, which takes them from
//! programs. Field by field; nothing is checked but that states name states.

use rdma_sys::{ibv_ah_attr, ibv_gid, ibv_global_route, ibv_qp_attr, ibv_qp_cap, ibv_qp_state};

use super::{AhAttr, QpAttr, QpCaps, QpState};
use crate::ctrl::qp_attr_mask;
use crate::Gid;

// The vocabulary's values are libibverbs' own.
const _: () = {
    assert!(QpState::Reset as u32 == ibv_qp_state::IBV_QPS_RESET);
    assert!(QpState::Init as u32 == ibv_qp_state::IBV_QPS_INIT);
    assert!(QpState::Rtr as u32 == ibv_qp_state::IBV_QPS_RTR);
    assert!(QpState::Rts as u32 == ibv_qp_state::IBV_QPS_RTS);
    assert!(QpState::Sqd as u32 == ibv_qp_state::IBV_QPS_SQD);
    assert!(QpState::Sqe as u32 == ibv_qp_state::IBV_QPS_SQE);
    assert!(QpState::Err as u32 == ibv_qp_state::IBV_QPS_ERR);
    assert!(std::mem::size_of::<super::Sge>() == std::mem::size_of::<rdma_sys::ibv_sge>());
    assert!(
        std::mem::offset_of!(super::Sge, length) == std::mem::offset_of!(rdma_sys::ibv_sge, length)
    );
    assert!(
        std::mem::offset_of!(super::Sge, lkey) == std::mem::offset_of!(rdma_sys::ibv_sge, lkey)
    );
};

// The wire's mask bits are libibverbs' own (SPEC.md §5.11).
const _: () = {
    use rdma_sys::ibv_qp_attr_mask as m;
    assert!(qp_attr_mask::STATE == m::IBV_QP_STATE.0);
    assert!(qp_attr_mask::CUR_STATE == m::IBV_QP_CUR_STATE.0);
    assert!(qp_attr_mask::ACCESS_FLAGS == m::IBV_QP_ACCESS_FLAGS.0);
    assert!(qp_attr_mask::PKEY_INDEX == m::IBV_QP_PKEY_INDEX.0);
    assert!(qp_attr_mask::PORT == m::IBV_QP_PORT.0);
    assert!(qp_attr_mask::QKEY == m::IBV_QP_QKEY.0);
    assert!(qp_attr_mask::AV == m::IBV_QP_AV.0);
    assert!(qp_attr_mask::PATH_MTU == m::IBV_QP_PATH_MTU.0);
    assert!(qp_attr_mask::TIMEOUT == m::IBV_QP_TIMEOUT.0);
    assert!(qp_attr_mask::RETRY_CNT == m::IBV_QP_RETRY_CNT.0);
    assert!(qp_attr_mask::RNR_RETRY == m::IBV_QP_RNR_RETRY.0);
    assert!(qp_attr_mask::RQ_PSN == m::IBV_QP_RQ_PSN.0);
    assert!(qp_attr_mask::MAX_QP_RD_ATOMIC == m::IBV_QP_MAX_QP_RD_ATOMIC.0);
    assert!(qp_attr_mask::MIN_RNR_TIMER == m::IBV_QP_MIN_RNR_TIMER.0);
    assert!(qp_attr_mask::SQ_PSN == m::IBV_QP_SQ_PSN.0);
    assert!(qp_attr_mask::MAX_DEST_RD_ATOMIC == m::IBV_QP_MAX_DEST_RD_ATOMIC.0);
    assert!(qp_attr_mask::DEST_QPN == m::IBV_QP_DEST_QPN.0);
};

/// `AF_INET` as a socket address's family field holds it.
#[expect(
    clippy::cast_possible_truncation,
    reason = "AF_INET is 2, a sa_family_t (u16) holds it"
)]
const AF_INET_FAMILY: libc::sa_family_t = libc::AF_INET as libc::sa_family_t;

/// An IPv4 address and port as the sockets API (and librdmacm) holds them.
pub fn sockaddr_in(address: std::net::SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: AF_INET_FAMILY,
        sin_port: address.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*address.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// The IPv4 address and port in `sin`, if its family is IPv4.
pub fn from_sockaddr_in(sin: &libc::sockaddr_in) -> Option<std::net::SocketAddrV4> {
    (sin.sin_family == AF_INET_FAMILY).then(|| {
        std::net::SocketAddrV4::new(
            u32::from_be(sin.sin_addr.s_addr).into(),
            u16::from_be(sin.sin_port),
        )
    })
}

impl From<&QpCaps> for ibv_qp_cap {
    fn from(c: &QpCaps) -> Self {
        ibv_qp_cap {
            max_send_wr: c.max_send_wr,
            max_recv_wr: c.max_recv_wr,
            max_send_sge: c.max_send_sge,
            max_recv_sge: c.max_recv_sge,
            max_inline_data: c.max_inline_data,
        }
    }
}

impl From<&ibv_qp_cap> for QpCaps {
    fn from(c: &ibv_qp_cap) -> Self {
        QpCaps {
            max_send_wr: c.max_send_wr,
            max_recv_wr: c.max_recv_wr,
            max_send_sge: c.max_send_sge,
            max_recv_sge: c.max_recv_sge,
            max_inline_data: c.max_inline_data,
        }
    }
}

impl From<&AhAttr> for ibv_ah_attr {
    fn from(a: &AhAttr) -> Self {
        ibv_ah_attr {
            grh: ibv_global_route {
                dgid: ibv_gid { raw: a.dgid.0 },
                flow_label: a.flow_label,
                sgid_index: a.sgid_index,
                hop_limit: a.hop_limit,
                traffic_class: a.traffic_class,
            },
            dlid: a.dlid,
            sl: a.sl,
            src_path_bits: 0,
            static_rate: 0,
            is_global: a.is_global.into(),
            port_num: a.port_num,
        }
    }
}

impl From<&ibv_ah_attr> for AhAttr {
    fn from(a: &ibv_ah_attr) -> Self {
        AhAttr {
            // SAFETY: ibv_gid is a union of byte and integer arrays of the same 16 bytes;
            // every bit pattern is a valid byte array.
            dgid: Gid(unsafe { a.grh.dgid.raw }),
            flow_label: a.grh.flow_label,
            sgid_index: a.grh.sgid_index,
            hop_limit: a.grh.hop_limit,
            traffic_class: a.grh.traffic_class,
            is_global: a.is_global != 0,
            dlid: a.dlid,
            sl: a.sl,
            port_num: a.port_num,
        }
    }
}

impl From<&QpAttr> for ibv_qp_attr {
    /// Every field but the capabilities, which a QP's attributes do not carry.
    fn from(a: &QpAttr) -> Self {
        // SAFETY: all-zero is a valid ibv_qp_attr (integers, enums as integers, GID unions).
        let mut raw: ibv_qp_attr = unsafe { std::mem::zeroed() };
        raw.qp_state = a.qp_state as u32;
        raw.cur_qp_state = a.cur_qp_state as u32;
        raw.path_mtu = a.path_mtu.into();
        raw.qkey = a.qkey;
        raw.rq_psn = a.rq_psn;
        raw.sq_psn = a.sq_psn;
        raw.dest_qp_num = a.dest_qp_num;
        raw.qp_access_flags = a.qp_access_flags;
        raw.ah_attr = (&a.ah_attr).into();
        raw.pkey_index = a.pkey_index;
        raw.max_rd_atomic = a.max_rd_atomic;
        raw.max_dest_rd_atomic = a.max_dest_rd_atomic;
        raw.min_rnr_timer = a.min_rnr_timer;
        raw.port_num = a.port_num;
        raw.timeout = a.timeout;
        raw.retry_cnt = a.retry_cnt;
        raw.rnr_retry = a.rnr_retry;
        raw
    }
}

impl QpAttr {
    /// The attributes of `raw` that `mask` names ([`qp_attr_mask`] bits): the states only if
    /// named (a program need not fill what it does not name), the other fields as they are.
    /// `Err` with the value of a named state that names none.
    pub fn from_ibv(raw: &ibv_qp_attr, mask: u32) -> Result<QpAttr, u32> {
        let state = |bit: u32, value: u32| match mask & bit {
            0 => Ok(QpState::Reset),
            _ => QpState::try_from(value),
        };
        Ok(QpAttr {
            qp_state: state(qp_attr_mask::STATE, raw.qp_state)?,
            cur_qp_state: state(qp_attr_mask::CUR_STATE, raw.cur_qp_state)?,
            // An ibv_mtu (1 to 5) in a wider enum: a larger value stays invalid.
            path_mtu: u8::try_from(raw.path_mtu).unwrap_or(u8::MAX),
            qkey: raw.qkey,
            rq_psn: raw.rq_psn,
            sq_psn: raw.sq_psn,
            dest_qp_num: raw.dest_qp_num,
            qp_access_flags: raw.qp_access_flags,
            ah_attr: (&raw.ah_attr).into(),
            pkey_index: raw.pkey_index,
            max_rd_atomic: raw.max_rd_atomic,
            max_dest_rd_atomic: raw.max_dest_rd_atomic,
            min_rnr_timer: raw.min_rnr_timer,
            port_num: raw.port_num,
            timeout: raw.timeout,
            retry_cnt: raw.retry_cnt,
            rnr_retry: raw.rnr_retry,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qp_attributes_go_to_libibverbs_and_back() {
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut raw: ibv_qp_attr = unsafe { std::mem::zeroed() };
        raw.qp_state = 3;
        raw.cur_qp_state = 99; // not named by the mask: not read
        raw.path_mtu = 3;
        raw.dest_qp_num = 0x123;
        raw.rq_psn = 0xabcdef;
        raw.min_rnr_timer = 12;
        raw.ah_attr.is_global = 1;
        raw.ah_attr.grh.dgid = ibv_gid { raw: [7; 16] };
        let attr = QpAttr::from_ibv(&raw, qp_attr_mask::STATE).unwrap();
        assert_eq!(
            (attr.qp_state, attr.dest_qp_num, attr.rq_psn, attr.path_mtu),
            (QpState::Rts, 0x123, 0xabcdef, 3)
        );
        assert_eq!(attr.ah_attr.dgid, Gid([7; 16]));
        let back = ibv_qp_attr::from(&attr);
        assert_eq!((back.qp_state, back.min_rnr_timer), (3, 12));
        assert_eq!(AhAttr::from(&back.ah_attr), attr.ah_attr);
        raw.qp_state = 7;
        assert_eq!(QpAttr::from_ibv(&raw, qp_attr_mask::STATE), Err(7));
    }

    #[test]
    fn ipv4_addresses_go_to_sockaddr_in_and_back() {
        let address = "192.0.2.1:7471".parse().unwrap();
        let sin = sockaddr_in(address);
        assert_eq!(sin.sin_port, 7471u16.to_be());
        assert_eq!(from_sockaddr_in(&sin), Some(address));
        let other = libc::sockaddr_in {
            sin_family: libc::AF_INET6 as libc::sa_family_t,
            ..sin
        };
        assert_eq!(from_sockaddr_in(&other), None);
    }
}
