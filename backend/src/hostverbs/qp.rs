//! Queue pairs. Posting work requests is `posting.rs`'s; SRQs and AHs have files of their own.

mod ah;
mod posting;
mod srq;

use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::*;

use super::loopback;
use super::{
    check, last_error, other_host, verbs_object_is_thread_safe, CompletionQueue, Error,
    ProtectionDomain, Raw, Result,
};

pub use ah::AddressHandle;
pub use posting::{
    OneSgeSend, Payload, PushError, RecvWr, SendBatch, SendFlags, SendOp, SendWr, Sge, UdDest,
};
pub use srq::SharedReceiveQueue;
pub use vrdma_spec::ctrl::qp_attr_mask;
pub use vrdma_spec::verbs::{AhAttr, QpAttr, QpCaps, QpState, QpType};

/// What [`ProtectionDomain::create_qp`] needs besides the CQs.
#[derive(Clone, Copy)]
pub struct QpInit<'a> {
    pub qp_type: QpType,
    pub caps: QpCaps,
    /// Receive from this SRQ instead of an RQ of the QP's own.
    pub srq: Option<&'a Arc<SharedReceiveQueue>>,
    /// Every send WR completes with a CQE, whatever its `signaled`.
    pub sq_sig_all: bool,
}

/// A host queue pair.
pub struct QueuePair {
    raw: Raw<ibv_qp, loopback::Handle>,
    qp_type: QpType,
    caps: QpCaps,
    _pd: Arc<ProtectionDomain>,
    _send_cq: Arc<CompletionQueue>,
    _recv_cq: Arc<CompletionQueue>,
    _srq: Option<Arc<SharedReceiveQueue>>,
}

verbs_object_is_thread_safe!(QueuePair);

impl ProtectionDomain {
    pub fn create_qp(
        self: &Arc<Self>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        init: &QpInit<'_>,
    ) -> Result<QueuePair> {
        let (raw, caps) = match (&self.raw, &send_cq.raw, &recv_cq.raw) {
            (Raw::Verbs(pd), Raw::Verbs(send), Raw::Verbs(recv)) => {
                let srq = match init.srq.map(|srq| &srq.raw) {
                    None => std::ptr::null_mut(),
                    Some(Raw::Verbs(srq)) => srq.as_ptr(),
                    Some(Raw::Loopback(_)) => return Err(other_host("ibv_create_qp")),
                };
                let (raw, caps) =
                    create_verbs_qp(pd.as_ptr(), (send.as_ptr(), recv.as_ptr()), srq, init)?;
                (Raw::Verbs(raw), caps)
            }
            (Raw::Loopback(pd), Raw::Loopback(send), Raw::Loopback(recv)) => {
                let srq = match init.srq.map(|srq| &srq.raw) {
                    None => None,
                    Some(Raw::Loopback(srq)) => Some(srq.id),
                    Some(Raw::Verbs(_)) => return Err(other_host("ibv_create_qp")),
                };
                let setup = loopback::QpSetup {
                    qp_type: init.qp_type,
                    caps: init.caps,
                    srq,
                    sq_sig_all: init.sq_sig_all,
                };
                let (qpn, caps) = pd.device.create_qp(pd.id, (send, recv), setup)?;
                (Raw::Loopback(pd.with_id(qpn)), caps)
            }
            _ => return Err(other_host("ibv_create_qp")),
        };
        Ok(QueuePair {
            raw,
            qp_type: init.qp_type,
            caps,
            _pd: Arc::clone(self),
            _send_cq: Arc::clone(send_cq),
            _recv_cq: Arc::clone(recv_cq),
            _srq: init.srq.cloned(),
        })
    }
}

/// A libibverbs QP in `pd` over the CQs `send_cq` and `recv_cq` (and `srq`, or null), and the
/// caps the provider granted.
fn create_verbs_qp(
    pd: *mut ibv_pd,
    (send_cq, recv_cq): (*mut ibv_cq, *mut ibv_cq),
    srq: *mut ibv_srq,
    init: &QpInit<'_>,
) -> Result<(NonNull<ibv_qp>, QpCaps)> {
    // SAFETY: all-zero is a valid ibv_qp_init_attr (null pointers and integers).
    let mut attr: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    attr.send_cq = send_cq;
    attr.recv_cq = recv_cq;
    attr.qp_type = match init.qp_type {
        QpType::Rc => ibv_qp_type::IBV_QPT_RC,
        QpType::Uc => ibv_qp_type::IBV_QPT_UC,
        QpType::Ud => ibv_qp_type::IBV_QPT_UD,
    };
    attr.sq_sig_all = init.sq_sig_all.into();
    attr.srq = srq;
    attr.cap = (&init.caps).into();
    // SAFETY: PD and CQs (and the SRQ) are alive, and kept alive by the QP made of
    // them; `attr` is valid and the provider writes the granted caps back into it.
    let raw = NonNull::new(unsafe { ibv_create_qp(pd, &mut attr) })
        .ok_or_else(|| last_error("ibv_create_qp"))?;
    Ok((raw, (&attr.cap).into()))
}

impl QueuePair {
    pub fn qp_num(&self) -> u32 {
        match &self.raw {
            // SAFETY: the QP is alive; qp_num never changes after creation.
            Raw::Verbs(raw) => unsafe { (*raw.as_ptr()).qp_num },
            Raw::Loopback(qp) => qp.id,
        }
    }

    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }

    /// The queue sizes the provider granted.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// Applies the fields of `attr` selected by `mask` ([`qp_attr_mask`] bits).
    pub fn modify(&self, attr: &QpAttr, mask: u32) -> Result<()> {
        let qp = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr(),
            Raw::Loopback(qpn) => return qpn.device.modify_qp(qpn.id, attr, mask),
        };
        let mut raw = ibv_qp_attr::from(attr);
        // SAFETY: the QP is alive and `raw` is a valid attribute struct.
        check("ibv_modify_qp", unsafe {
            // The mask is a set of ibv_qp_attr_mask bits, which the C API takes as an int.
            ibv_modify_qp(qp, &mut raw, mask.cast_signed())
        })
    }

    pub fn query(&self) -> Result<QpAttr> {
        let qp = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr(),
            Raw::Loopback(qpn) => return qpn.device.query_qp(qpn.id),
        };
        // SAFETY: all-zero is valid for both structs (integers, null pointers, unions).
        let (mut raw, mut init): (ibv_qp_attr, ibv_qp_init_attr) =
            unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        let mask = qp_attr_mask::STATE
            | qp_attr_mask::CUR_STATE
            | qp_attr_mask::ACCESS_FLAGS
            | qp_attr_mask::PKEY_INDEX
            | qp_attr_mask::PORT
            | qp_attr_mask::QKEY
            | qp_attr_mask::AV
            | qp_attr_mask::PATH_MTU
            | qp_attr_mask::TIMEOUT
            | qp_attr_mask::RETRY_CNT
            | qp_attr_mask::RNR_RETRY
            | qp_attr_mask::RQ_PSN
            | qp_attr_mask::MAX_QP_RD_ATOMIC
            | qp_attr_mask::MIN_RNR_TIMER
            | qp_attr_mask::SQ_PSN
            | qp_attr_mask::MAX_DEST_RD_ATOMIC
            | qp_attr_mask::DEST_QPN;
        // SAFETY: the QP is alive; both out-pointers are valid.
        check("ibv_query_qp", unsafe {
            ibv_query_qp(qp, &mut raw, mask.cast_signed(), &mut init)
        })?;
        QpAttr::from_ibv(&raw, mask).map_err(|state| Error::Verbs {
            call: "ibv_query_qp",
            source: io::Error::other(format!(
                "the host reported QP state {state}, not one of ibverbs'"
            )),
        })
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        let raw = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr(),
            Raw::Loopback(qpn) => return qpn.device.destroy_qp(qpn.id),
        };
        // SAFETY: the QP was created by create_qp and is destroyed once; its PD and CQs are
        // still alive (their Arcs are dropped after this).
        let ret = unsafe { ibv_destroy_qp(raw) };
        if ret != 0 {
            log::error!("ibv_destroy_qp failed: {ret}");
        }
    }
}
