//! Shared receive queues.
use std::sync::Arc;

use super::super::seam::HostSrq;
use super::super::{ObjectId, ProtectionDomain, Result};
use super::RecvWr;

/// A host shared receive queue.
pub struct SharedReceiveQueue {
    /// Dropped before the PD (fields drop in order), as the seam requires.
    host: Box<dyn HostSrq>,
    _pd: Arc<ProtectionDomain>,
}

impl ProtectionDomain {
    pub fn create_srq(
        self: &Arc<Self>,
        max_wr: u32,
        max_sge: u32,
    ) -> Result<Arc<SharedReceiveQueue>> {
        Ok(Arc::new(SharedReceiveQueue {
            host: self.host.create_srq(max_wr, max_sge)?,
            _pd: Arc::clone(self),
        }))
    }
}

impl SharedReceiveQueue {
    /// The host's SRQ, for a host call that names it.
    pub(in crate::hostverbs) fn host(&self) -> &dyn HostSrq {
        &*self.host
    }

    /// What names this SRQ in an [`AsyncEvent`](crate::hostverbs::AsyncEvent).
    pub fn id(&self) -> ObjectId {
        self.host.id()
    }

    /// Posts receive work requests in order.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.host.post_recv(wrs)
    }
}
