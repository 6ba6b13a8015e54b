//! The verbs vocabulary both sides speak: scatter/gather entries, receive requests, QP
//! types, states, sizes, address vectors and attributes, with ibverbs' values. guest-lib
//! hands them to programs and the backend to the host's verbs; their wire forms
//! ([`ctrl::AhAttr`], [`ctrl::QpAttr`]) convert from and to them here, once.

#[cfg(feature = "ibverbs")]
pub mod ibv;

use crate::ctrl::{self, qp_state};
use crate::{Gid, Le16, Le32};

/// A scatter/gather entry: `length` bytes at `addr` of the MR whose lkey is `lkey`.
/// `#[repr(C)]` with the layout of libibverbs' `struct ibv_sge`, so that an array of them is
/// one of those (a C program's, or the host's).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// Where a send's bytes come from.
#[derive(Clone, Copy, Debug)]
pub enum Payload<'a> {
    /// Gathered from registered memory.
    Sges(&'a [Sge]),
    /// Carried in the request itself (at most the QP's `max_inline_data` bytes).
    Inline(&'a [u8]),
}

/// A receive work request.
#[derive(Clone, Copy, Debug, Default)]
pub struct RecvWr<'a> {
    pub wr_id: u64,
    pub sges: &'a [Sge],
}

/// QP transports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpType {
    Rc,
    /// Unreliable connected: SEND and RDMA WRITE, no READ or atomics.
    Uc,
    Ud,
}

impl QpType {
    /// RC and UC: connected to one peer QP.
    pub fn is_connected(self) -> bool {
        matches!(self, QpType::Rc | QpType::Uc)
    }
}

/// QP states, with ibverbs' values (those of [`qp_state`] on the wire).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum QpState {
    #[default]
    Reset = qp_state::RESET,
    Init = qp_state::INIT,
    Rtr = qp_state::RTR,
    Rts = qp_state::RTS,
    Sqd = qp_state::SQD,
    Sqe = qp_state::SQE,
    Err = qp_state::ERR,
}

impl QpState {
    const ALL: [QpState; 7] = [
        QpState::Reset,
        QpState::Init,
        QpState::Rtr,
        QpState::Rts,
        QpState::Sqd,
        QpState::Sqe,
        QpState::Err,
    ];
}

impl TryFrom<u32> for QpState {
    /// The value, which names no state.
    type Error = u32;
    fn try_from(value: u32) -> Result<Self, u32> {
        QpState::ALL
            .into_iter()
            .find(|s| *s as u32 == value)
            .ok_or(value)
    }
}

/// A QP's queue sizes: what was asked for at creation, or what the QP was made with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpCaps {
    pub max_send_wr: u32,
    /// 0 when the QP receives through an SRQ.
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// An address vector: the RC path of a QP, the UD destination of an AH.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AhAttr {
    pub dgid: Gid,
    /// 20 bits.
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub is_global: bool,
    pub dlid: u16,
    pub sl: u8,
    pub port_num: u8,
}

/// QP attributes: the input of a modify (the fields its attribute mask names,
/// [`ctrl::qp_attr_mask`]) and the output of a query.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpAttr {
    pub qp_state: QpState,
    pub cur_qp_state: QpState,
    /// `ibv_mtu`: 1 = 256 ... 5 = 4096 bytes.
    pub path_mtu: u8,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    /// [`ctrl::access`] flags for remote operations on this QP.
    pub qp_access_flags: u32,
    pub ah_attr: AhAttr,
    pub pkey_index: u16,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
}

impl From<&AhAttr> for ctrl::AhAttr {
    fn from(a: &AhAttr) -> Self {
        ctrl::AhAttr {
            dgid: a.dgid.0,
            flow_label: Le32::from(a.flow_label),
            dlid: Le16::from(a.dlid),
            sgid_index: a.sgid_index,
            hop_limit: a.hop_limit,
            traffic_class: a.traffic_class,
            sl: a.sl,
            is_global: a.is_global.into(),
            port_num: a.port_num,
            reserved: Le32::from(0),
        }
    }
}

impl From<&ctrl::AhAttr> for AhAttr {
    /// Field by field, unchecked (the device checks what a guest sends: SPEC.md §5.10).
    fn from(a: &ctrl::AhAttr) -> Self {
        AhAttr {
            dgid: Gid(a.dgid),
            flow_label: a.flow_label.to_native(),
            sgid_index: a.sgid_index,
            hop_limit: a.hop_limit,
            traffic_class: a.traffic_class,
            is_global: a.is_global != 0,
            dlid: a.dlid.to_native(),
            sl: a.sl,
            port_num: a.port_num,
        }
    }
}

impl From<&QpAttr> for ctrl::QpAttr {
    fn from(a: &QpAttr) -> Self {
        ctrl::QpAttr {
            qp_state: a.qp_state as u8,
            cur_qp_state: a.cur_qp_state as u8,
            path_mtu: a.path_mtu,
            port_num: a.port_num,
            qp_access_flags: Le32::from(a.qp_access_flags),
            pkey_index: Le16::from(a.pkey_index),
            timeout: a.timeout,
            retry_cnt: a.retry_cnt,
            rnr_retry: a.rnr_retry,
            min_rnr_timer: a.min_rnr_timer,
            max_rd_atomic: a.max_rd_atomic,
            max_dest_rd_atomic: a.max_dest_rd_atomic,
            qkey: Le32::from(a.qkey),
            rq_psn: Le32::from(a.rq_psn),
            sq_psn: Le32::from(a.sq_psn),
            dest_qp_num: Le32::from(a.dest_qp_num),
            ah_attr: (&a.ah_attr).into(),
        }
    }
}

impl TryFrom<&ctrl::QpAttr> for QpAttr {
    /// A state value that names no state.
    type Error = u32;
    /// Field by field; only the states are checked (the device checks the rest of what a
    /// guest sends: SPEC.md §5.11).
    fn try_from(w: &ctrl::QpAttr) -> Result<Self, u32> {
        Ok(QpAttr {
            qp_state: QpState::try_from(u32::from(w.qp_state))?,
            cur_qp_state: QpState::try_from(u32::from(w.cur_qp_state))?,
            path_mtu: w.path_mtu,
            qkey: w.qkey.to_native(),
            rq_psn: w.rq_psn.to_native(),
            sq_psn: w.sq_psn.to_native(),
            dest_qp_num: w.dest_qp_num.to_native(),
            qp_access_flags: w.qp_access_flags.to_native(),
            ah_attr: (&w.ah_attr).into(),
            pkey_index: w.pkey_index.to_native(),
            max_rd_atomic: w.max_rd_atomic,
            max_dest_rd_atomic: w.max_dest_rd_atomic,
            min_rnr_timer: w.min_rnr_timer,
            port_num: w.port_num,
            timeout: w.timeout,
            retry_cnt: w.retry_cnt,
            rnr_retry: w.rnr_retry,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qp_attributes_survive_their_wire_form() {
        let attr = QpAttr {
            qp_state: QpState::Rts,
            cur_qp_state: QpState::Rtr,
            path_mtu: 5,
            qkey: 0x1111_1111,
            rq_psn: 0x12_3456,
            sq_psn: 0x65_4321,
            dest_qp_num: 0x11,
            qp_access_flags: 7,
            ah_attr: AhAttr {
                dgid: Gid([9; 16]),
                flow_label: 0xf_ffff,
                sgid_index: 1,
                hop_limit: 64,
                traffic_class: 3,
                is_global: true,
                dlid: 0,
                sl: 2,
                port_num: 1,
            },
            pkey_index: 0,
            max_rd_atomic: 4,
            max_dest_rd_atomic: 8,
            min_rnr_timer: 12,
            port_num: 1,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 6,
        };
        let wire = ctrl::QpAttr::from(&attr);
        assert_eq!(QpAttr::try_from(&wire), Ok(attr));
        let bad = ctrl::QpAttr {
            qp_state: 7,
            ..wire
        };
        assert_eq!(QpAttr::try_from(&bad), Err(7));
    }
}
