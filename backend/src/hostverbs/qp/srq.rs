//! Shared receive queues.
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::*;

use super::super::loopback;
use super::super::ObjectId;
use super::super::{last_error, verbs_object_is_thread_safe, ProtectionDomain, Raw, Result};
use super::posting::post_recv_chains;
use super::RecvWr;

/// A host shared receive queue.
pub struct SharedReceiveQueue {
    pub(super) raw: Raw<ibv_srq, loopback::Handle>,
    _pd: Arc<ProtectionDomain>,
}

verbs_object_is_thread_safe!(SharedReceiveQueue);

impl ProtectionDomain {
    pub fn create_srq(
        self: &Arc<Self>,
        max_wr: u32,
        max_sge: u32,
    ) -> Result<Arc<SharedReceiveQueue>> {
        let pd = match &self.raw {
            Raw::Verbs(pd) => pd.as_ptr(),
            Raw::Loopback(pd) => {
                let srq = pd.device.create_srq(pd.id, max_wr, max_sge)?;
                return Ok(Arc::new(SharedReceiveQueue {
                    raw: Raw::Loopback(pd.with_id(srq)),
                    _pd: Arc::clone(self),
                }));
            }
        };
        // SAFETY: all-zero is a valid ibv_srq_init_attr (a null context and integers).
        let mut attr: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        attr.attr.max_wr = max_wr;
        attr.attr.max_sge = max_sge;
        // SAFETY: the PD is alive (kept alive by the SRQ) and `attr` is valid.
        let raw = NonNull::new(unsafe { ibv_create_srq(pd, &mut attr) })
            .ok_or_else(|| last_error("ibv_create_srq"))?;
        let raw = Raw::Verbs(raw);
        Ok(Arc::new(SharedReceiveQueue {
            raw,
            _pd: Arc::clone(self),
        }))
    }
}

impl SharedReceiveQueue {
    /// What names this SRQ in an [`AsyncEvent`](crate::hostverbs::AsyncEvent).
    pub fn id(&self) -> ObjectId {
        match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr() as ObjectId,
            Raw::Loopback(srq) => srq.id as ObjectId,
        }
    }

    /// Posts receive work requests in order, chained in batches.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        let srq = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr(),
            Raw::Loopback(id) => return id.device.srq_post_recv(id.id, wrs),
        };
        post_recv_chains("ibv_post_srq_recv", wrs, |first, bad| {
            // SAFETY: the SRQ is alive; the chain and its SGE slices live for the call.
            unsafe { ibv_post_srq_recv(srq, first, bad) }
        })
    }
}

impl Drop for SharedReceiveQueue {
    fn drop(&mut self) {
        let raw = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr(),
            Raw::Loopback(id) => return id.device.destroy_srq(id.id),
        };
        // SAFETY: QPs using the SRQ hold an Arc of it, so none is left.
        if unsafe { ibv_destroy_srq(raw) } != 0 {
            log::error!("ibv_destroy_srq failed");
        }
    }
}
