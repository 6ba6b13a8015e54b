//! libibverbs memory registration.

use std::ptr::NonNull;

use rdma_sys::*;

use super::{last_error, verbs_object_is_thread_safe};
use crate::hostverbs::seam::{HostMr, Registration};
use crate::hostverbs::{PinnedMemory, Result};

/// Registers `at` of `memory` in `pd`. The range was checked by the caller.
pub(super) fn register(
    pd: NonNull<ibv_pd>,
    memory: &dyn PinnedMemory,
    at: Registration,
) -> Result<Box<dyn HostMr>> {
    // SAFETY: the PD is alive; `at.offset..at.offset + at.len` is inside the memory (checked
    // by the caller, `ProtectionDomain::reg_mr_range` or `reg_mr_pinned`), mapped for the
    // duration of the call. Afterwards the MR either keeps the mapping (the wrapper holds it) or,
    // pinned, needs none.
    let raw = NonNull::new(unsafe {
        ibv_reg_mr_iova2(
            pd.as_ptr(),
            memory.as_ptr().add(at.offset).cast(),
            at.len,
            at.iova,
            at.access,
        )
    })
    .ok_or_else(|| last_error("ibv_reg_mr_iova2"))?;
    Ok(Box::new(Mr { raw }))
}

/// A libibverbs memory region.
struct Mr {
    raw: NonNull<ibv_mr>,
}

verbs_object_is_thread_safe!(Mr);

impl HostMr for Mr {
    fn lkey(&self) -> u32 {
        // SAFETY: the MR is alive; lkey is set at registration and never changes.
        unsafe { (*self.raw.as_ptr()).lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: the MR is alive; rkey is set at registration and never changes.
        unsafe { (*self.raw.as_ptr()).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered by `register` and deregistered once; a mapping the wrapper keeps
        // is dropped only after this.
        let ret = unsafe { ibv_dereg_mr(self.raw.as_ptr()) };
        if ret != 0 {
            log::error!("ibv_dereg_mr failed: {ret}");
        }
    }
}
