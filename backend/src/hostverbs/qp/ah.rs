//! Address handles, which UD sends name.
use std::sync::Arc;

use super::super::seam::HostAh;
use super::super::{ProtectionDomain, Result};
use super::AhAttr;

/// A host address handle (UD destination).
pub struct AddressHandle {
    /// Dropped before the PD (fields drop in order), as the seam requires.
    host: Box<dyn HostAh>,
    pd: Arc<ProtectionDomain>,
}

impl std::fmt::Debug for AddressHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AddressHandle")
            .field(&self.host.handle())
            .finish()
    }
}

impl ProtectionDomain {
    pub fn create_ah(self: &Arc<Self>, attr: &AhAttr) -> Result<AddressHandle> {
        Ok(AddressHandle {
            host: self.host.create_ah(attr)?,
            pd: Arc::clone(self),
        })
    }
}

impl AddressHandle {
    /// What names the AH to its host in a send request ([`HostAh::handle`]).
    pub(in crate::hostverbs) fn handle(&self) -> usize {
        self.host.handle()
    }

    pub(super) fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }
}
