//! Address handles, which UD sends name.
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::*;

use super::super::loopback;
use super::super::{last_error, verbs_object_is_thread_safe, ProtectionDomain, Raw, Result};
use super::AhAttr;

/// A host address handle (UD destination).
pub struct AddressHandle {
    pub(super) raw: Raw<ibv_ah, loopback::Handle>,
    _pd: Arc<ProtectionDomain>,
}

verbs_object_is_thread_safe!(AddressHandle);

impl std::fmt::Debug for AddressHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let handle = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr() as usize,
            Raw::Loopback(ah) => ah.id as usize,
        };
        f.debug_tuple("AddressHandle").field(&handle).finish()
    }
}

impl ProtectionDomain {
    pub fn create_ah(self: &Arc<Self>, attr: &AhAttr) -> Result<AddressHandle> {
        let raw = match &self.raw {
            Raw::Verbs(pd) => {
                let mut raw_attr = ibv_ah_attr::from(attr);
                // SAFETY: the PD is alive and `raw_attr` is a valid address vector.
                let raw = NonNull::new(unsafe { ibv_create_ah(pd.as_ptr(), &mut raw_attr) })
                    .ok_or_else(|| last_error("ibv_create_ah"))?;
                Raw::Verbs(raw)
            }
            Raw::Loopback(pd) => Raw::Loopback(pd.with_id(pd.device.create_ah(pd.id, attr)?)),
        };
        Ok(AddressHandle {
            raw,
            _pd: Arc::clone(self),
        })
    }
}

impl AddressHandle {
    /// The loopback's handle of this AH, when it is the loopback's.
    pub(in crate::hostverbs) fn loopback_id(&self) -> Option<u32> {
        match &self.raw {
            Raw::Verbs(_) => None,
            Raw::Loopback(ah) => Some(ah.id),
        }
    }
}

impl Drop for AddressHandle {
    fn drop(&mut self) {
        let raw = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr(),
            Raw::Loopback(id) => return id.device.destroy_ah(id.id),
        };
        // SAFETY: created by create_ah, destroyed once; its PD is still alive.
        let ret = unsafe { ibv_destroy_ah(raw) };
        if ret != 0 {
            log::error!("ibv_destroy_ah failed: {ret}");
        }
    }
}
