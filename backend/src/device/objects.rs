//! Per-connection object tables: guest handles to host objects, with type, ownership and
//! reference checks (SPEC.md §5.3.1).

use std::collections::HashMap;
use std::sync::Arc;

use super::{CommandError, Refusal};
use crate::datapath::{CqData, QpData, SrqData};
use crate::hostverbs::{
    AddressHandle, CompletionQueue, MemoryRegion, ProtectionDomain, QueuePair, SharedReceiveQueue,
};

/// A guest-visible handle: never 0, unique across all object types of one connection.
pub type Handle = u32;

pub struct PdEntry {
    pub pd: Arc<ProtectionDomain>,
    /// MRs, QPs and AHs created in this PD.
    pub users: u32,
}

pub struct CqEntry {
    pub host: Arc<CompletionQueue>,
    pub data: Arc<CqData>,
    /// QPs that complete into this CQ.
    pub users: u32,
}

pub struct MrEntry {
    pub mr: MemoryRegion,
    pub pd: Handle,
    /// Bytes registered (the registered-memory quota's measure).
    pub len: u64,
}

pub struct QpEntry {
    pub host: Arc<QueuePair>,
    pub data: Arc<QpData>,
    pub pd: Handle,
    pub send_cq: Handle,
    pub recv_cq: Handle,
    pub srq: Option<Handle>,
}

pub struct SrqEntry {
    pub host: Arc<SharedReceiveQueue>,
    pub data: Arc<SrqData>,
    pub pd: Handle,
    /// QPs that receive from this SRQ.
    pub users: u32,
}

pub struct AhEntry {
    pub ah: Arc<AddressHandle>,
    pub pd: Handle,
}

/// Every object one connection holds. Dropping it destroys them all, children first.
#[derive(Default)]
pub struct Objects {
    last_handle: Handle,
    /// Bytes of the guest rings of all CQs, QPs and SRQs (the ring quota's measure).
    pub ring_bytes: u64,
    /// Bytes registered by all MRs (the registered-memory quota's measure).
    pub registered_bytes: u64,
    // Field order is drop order: children before the objects they use.
    pub qps: HashMap<Handle, QpEntry>,
    pub ahs: HashMap<Handle, AhEntry>,
    pub srqs: HashMap<Handle, SrqEntry>,
    pub mrs: HashMap<Handle, MrEntry>,
    pub cqs: HashMap<Handle, CqEntry>,
    pub pds: HashMap<Handle, PdEntry>,
    /// CM ids, by the key the connection manager knows them by.
    pub cm_ids: HashMap<Handle, u64>,
}

fn bad_handle(kind: &'static str, handle: Handle) -> CommandError {
    Refusal::BadHandle { kind, handle }.into()
}

fn busy(kind: &'static str, handle: Handle, users: u32) -> CommandError {
    Refusal::Busy {
        kind,
        handle,
        users,
    }
    .into()
}

impl Objects {
    /// Empty tables whose handles start at a random value, so that handles of one connection
    /// are unlikely to name anything in another (each connection checks its own tables anyway).
    pub fn new() -> Self {
        use std::hash::BuildHasher;
        let start = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
        #[expect(
            clippy::cast_possible_truncation,
            reason = "any 32 bits of a random hash are a random start"
        )]
        let start = start as u32;
        Objects {
            last_handle: start,
            ..Default::default()
        }
    }

    /// A fresh handle. Handles count up from 1 and wrap, skipping 0 and live values, so a
    /// destroyed handle is not reused until the counter comes round again.
    pub fn new_handle(&mut self) -> Handle {
        loop {
            self.last_handle = self.last_handle.wrapping_add(1);
            let h = self.last_handle;
            if h != 0 && !self.is_live(h) {
                return h;
            }
        }
    }

    fn is_live(&self, h: Handle) -> bool {
        self.pds.contains_key(&h)
            || self.cqs.contains_key(&h)
            || self.mrs.contains_key(&h)
            || self.qps.contains_key(&h)
            || self.ahs.contains_key(&h)
            || self.srqs.contains_key(&h)
            || self.cm_ids.contains_key(&h)
    }

    pub fn pd(&self, h: Handle) -> Result<&PdEntry, CommandError> {
        self.pds.get(&h).ok_or_else(|| bad_handle("PD", h))
    }

    pub fn cq(&self, h: Handle) -> Result<&CqEntry, CommandError> {
        self.cqs.get(&h).ok_or_else(|| bad_handle("CQ", h))
    }

    pub fn qp(&self, h: Handle) -> Result<&QpEntry, CommandError> {
        self.qps.get(&h).ok_or_else(|| bad_handle("QP", h))
    }

    pub fn srq(&self, h: Handle) -> Result<&SrqEntry, CommandError> {
        self.srqs.get(&h).ok_or_else(|| bad_handle("SRQ", h))
    }

    /// Inserts an SRQ under a handle from [`Objects::new_handle`].
    pub fn insert_srq(&mut self, h: Handle, entry: SrqEntry) {
        self.use_pd(entry.pd, 1);
        self.ring_bytes += entry.data.ring_bytes();
        self.srqs.insert(h, entry);
    }

    pub fn remove_srq(&mut self, h: Handle) -> Result<(), CommandError> {
        let users = self.srq(h)?.users;
        if users > 0 {
            return Err(busy("SRQ", h, users));
        }
        if let Some(entry) = self.srqs.remove(&h) {
            self.use_pd(entry.pd, -1);
            self.ring_bytes -= entry.data.ring_bytes();
        }
        Ok(())
    }

    fn use_srq(&mut self, h: Option<Handle>, delta: i32) {
        if let Some(srq) = h.and_then(|h| self.srqs.get_mut(&h)) {
            srq.users = srq.users.saturating_add_signed(delta);
        }
    }

    pub fn insert_pd(&mut self, pd: Arc<ProtectionDomain>) -> Handle {
        let h = self.new_handle();
        self.pds.insert(h, PdEntry { pd, users: 0 });
        h
    }

    pub fn remove_pd(&mut self, h: Handle) -> Result<(), CommandError> {
        let users = self.pd(h)?.users;
        if users > 0 {
            return Err(busy("PD", h, users));
        }
        self.pds.remove(&h);
        Ok(())
    }

    /// Inserts a CQ under a handle from [`Objects::new_handle`].
    pub fn insert_cq(&mut self, h: Handle, entry: CqEntry) {
        self.ring_bytes += entry.data.ring_bytes();
        self.cqs.insert(h, entry);
    }

    pub fn remove_cq(&mut self, h: Handle) -> Result<(), CommandError> {
        let users = self.cq(h)?.users;
        if users > 0 {
            return Err(busy("CQ", h, users));
        }
        if let Some(entry) = self.cqs.remove(&h) {
            self.ring_bytes -= entry.data.ring_bytes();
        }
        Ok(())
    }

    fn use_pd(&mut self, h: Handle, delta: i32) {
        if let Some(pd) = self.pds.get_mut(&h) {
            pd.users = pd.users.saturating_add_signed(delta);
        }
    }

    fn use_cq(&mut self, h: Handle, delta: i32) {
        if let Some(cq) = self.cqs.get_mut(&h) {
            cq.users = cq.users.saturating_add_signed(delta);
        }
    }

    pub fn insert_mr(&mut self, entry: MrEntry) -> Handle {
        self.use_pd(entry.pd, 1);
        self.registered_bytes += entry.len;
        let h = self.new_handle();
        self.mrs.insert(h, entry);
        h
    }

    pub fn remove_mr(&mut self, h: Handle) -> Result<MrEntry, CommandError> {
        let entry = self.mrs.remove(&h).ok_or_else(|| bad_handle("MR", h))?;
        self.use_pd(entry.pd, -1);
        self.registered_bytes -= entry.len;
        Ok(entry)
    }

    /// Inserts a QP under a handle from [`Objects::new_handle`].
    pub fn insert_qp(&mut self, h: Handle, entry: QpEntry) {
        self.use_pd(entry.pd, 1);
        self.use_cq(entry.send_cq, 1);
        self.use_cq(entry.recv_cq, 1);
        self.use_srq(entry.srq, 1);
        self.ring_bytes += entry.data.ring_bytes();
        self.qps.insert(h, entry);
    }

    pub fn remove_qp(&mut self, h: Handle) -> Result<(), CommandError> {
        let entry = self.qps.remove(&h).ok_or_else(|| bad_handle("QP", h))?;
        self.use_pd(entry.pd, -1);
        self.use_cq(entry.send_cq, -1);
        self.use_cq(entry.recv_cq, -1);
        self.use_srq(entry.srq, -1);
        self.ring_bytes -= entry.data.ring_bytes();
        Ok(())
    }

    pub fn insert_ah(&mut self, entry: AhEntry) -> Handle {
        self.use_pd(entry.pd, 1);
        let h = self.new_handle();
        self.ahs.insert(h, entry);
        h
    }

    pub fn remove_ah(&mut self, h: Handle) -> Result<(), CommandError> {
        let entry = self.ahs.remove(&h).ok_or_else(|| bad_handle("AH", h))?;
        self.use_pd(entry.pd, -1);
        Ok(())
    }

    /// Objects held, of all kinds.
    pub fn count(&self) -> usize {
        self.pds.len()
            + self.cqs.len()
            + self.mrs.len()
            + self.qps.len()
            + self.ahs.len()
            + self.srqs.len()
            + self.cm_ids.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_never_zero_and_skip_live_values_after_wrapping() {
        let mut objects = Objects {
            last_handle: u32::MAX - 1,
            ..Default::default()
        };
        assert_eq!(objects.new_handle(), u32::MAX);
        assert_eq!(objects.new_handle(), 1, "0 is skipped on wrap");
    }

    #[test]
    fn unknown_handles_are_bad_handles() {
        let mut objects = Objects::default();
        let refusal = |e: CommandError| e.refusal().cloned();
        let bad = |kind, handle| Some(Refusal::BadHandle { kind, handle });
        assert_eq!(refusal(objects.pd(7).err().unwrap()), bad("PD", 7));
        assert_eq!(refusal(objects.remove_mr(0).err().unwrap()), bad("MR", 0));
        assert_eq!(refusal(objects.remove_qp(1).err().unwrap()), bad("QP", 1));
    }
}
