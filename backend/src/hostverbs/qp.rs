//! Queue pairs. Posting work requests is `posting.rs`'s; SRQs and AHs have files of their own.

mod ah;
mod posting;
mod srq;

use std::sync::Arc;

use super::seam::{HostQp, QpQueues};
use super::{CompletionQueue, ProtectionDomain, Result};

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

impl QpInit<'static> {
    /// An RC QP of one WR and one SGE each way, with `max_inline_data`.
    pub fn smallest_rc(max_inline_data: u32) -> Self {
        QpInit {
            qp_type: QpType::Rc,
            caps: QpCaps {
                max_send_wr: 1,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data,
            },
            srq: None,
            sq_sig_all: false,
        }
    }
}

/// A host queue pair.
pub struct QueuePair {
    /// Dropped before what it was made of (fields drop in order), as the seam requires.
    host: Box<dyn HostQp>,
    qp_type: QpType,
    caps: QpCaps,
    /// None for a unit test's fake.
    made_of: Option<QpParts>,
}

/// What a QP was made of, kept alive while it lives.
struct QpParts {
    pd: Arc<ProtectionDomain>,
    _send_cq: Arc<CompletionQueue>,
    _recv_cq: Arc<CompletionQueue>,
    _srq: Option<Arc<SharedReceiveQueue>>,
}

impl ProtectionDomain {
    pub fn create_qp(
        self: &Arc<Self>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        init: &QpInit<'_>,
    ) -> Result<QueuePair> {
        let queues = QpQueues {
            send_cq: send_cq.host(),
            recv_cq: recv_cq.host(),
            srq: init.srq.map(|srq| srq.host()),
        };
        let (host, caps) = self.host.create_qp(queues, init)?;
        Ok(QueuePair {
            host,
            qp_type: init.qp_type,
            caps,
            made_of: Some(QpParts {
                pd: Arc::clone(self),
                _send_cq: Arc::clone(send_cq),
                _recv_cq: Arc::clone(recv_cq),
                _srq: init.srq.cloned(),
            }),
        })
    }
}

impl QueuePair {
    /// A QP over a fake host of a unit test, made of nothing.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn over_fake(host: Box<dyn HostQp>, qp_type: QpType) -> QueuePair {
        QueuePair {
            host,
            qp_type,
            caps: QpCaps::default(),
            made_of: None,
        }
    }

    pub fn qp_num(&self) -> u32 {
        self.host.qp_num()
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
        self.host.modify(attr, mask)
    }

    /// Moves the QP to the error state: the host flushes what is outstanding.
    pub fn set_error(&self) -> Result<()> {
        let attr = QpAttr {
            qp_state: QpState::Err,
            ..Default::default()
        };
        self.modify(&attr, qp_attr_mask::STATE)
    }

    pub fn query(&self) -> Result<QpAttr> {
        self.host.query()
    }

    /// Whether `ah` was made on this QP's host device, so that a send may name it.
    fn same_device(&self, ah: &AddressHandle) -> bool {
        match &self.made_of {
            Some(parts) => Arc::ptr_eq(parts.pd.context(), ah.pd().context()),
            // A fake takes what it is given.
            None => true,
        }
    }
}
