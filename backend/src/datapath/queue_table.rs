//! The table of a connection's queues, which the pool thread serving it reads: its QPs and
//! SRQs by doorbell bit, the bitmap words holding those bits, and its CQs.

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use super::doorbells::DoorbellBit;
use super::mr_table::KeyHasher;
use super::queues::{CqData, QpData, SrqData};
use crate::hostverbs::CompletionChannel;

/// A queue the guest rings through the doorbell bitmap.
#[derive(Clone)]
pub(super) enum Rung {
    Qp(Arc<QpData>),
    Srq(Arc<SrqData>),
}

impl Rung {
    fn handle(&self) -> u32 {
        match self {
            Rung::Qp(qp) => qp.handle,
            Rung::Srq(srq) => srq.handle,
        }
    }

    pub(super) fn retire(&self) {
        match self {
            Rung::Qp(qp) => qp.retire(),
            Rung::Srq(srq) => srq.retire(),
        }
    }
}

#[derive(Default)]
pub(super) struct QueueTable {
    /// QPs and SRQs by doorbell bit, looked up for every queue a pass visits.
    pub(super) queues: HashMap<DoorbellBit, Rung, BuildHasherDefault<KeyHasher>>,
    /// Their doorbell bits by handle.
    bits: HashMap<u32, DoorbellBit>,
    /// The bitmap words holding their bits (area, byte offset in its bitmap), with how many
    /// each: a pass reads only these.
    pub(super) words: BTreeMap<(u32, u64), u32>,
    pub(super) cqs: Vec<Arc<CqData>>,
}

impl QueueTable {
    pub(super) fn insert(&mut self, bit: DoorbellBit, rung: Rung) {
        self.bits.insert(rung.handle(), bit);
        self.queues.insert(bit, rung);
        *self.words.entry(bit.word()).or_default() += 1;
    }

    /// Takes out the queue with `handle`, with its bit.
    pub(super) fn remove(&mut self, handle: u32) -> Option<(DoorbellBit, Rung)> {
        let bit = self.bits.remove(&handle)?;
        let rung = self.queues.remove(&bit)?;
        let word = bit.word();
        if let Some(count) = self.words.get_mut(&word) {
            *count -= 1;
            if *count == 0 {
                self.words.remove(&word);
            }
        }
        Some((bit, rung))
    }

    pub(super) fn remove_cq(&mut self, handle: u32) -> Option<Arc<CqData>> {
        let at = self.cqs.iter().position(|cq| cq.handle == handle)?;
        Some(self.cqs.swap_remove(at))
    }

    /// Takes out every object, retired: no pass touches their rings again.
    pub(super) fn clear(&mut self) {
        for rung in self.queues.values() {
            rung.retire();
        }
        for cq in &self.cqs {
            cq.retire();
        }
        *self = QueueTable::default();
    }
}

/// A connection's queues as the pool thread serving it sees them: one per connection.
pub(super) struct ServedQueues {
    // Taken by the poller whenever a queue is rung: a lock without poisoning checks.
    pub(super) table: parking_lot::Mutex<QueueTable>,
    /// Changes (under the `objects` lock) with every change of `objects`: the poller copies
    /// the CQ list when it does, and otherwise takes no lock for it.
    pub(super) table_version: AtomicU64,
    pub(super) wake: EventFd,
    /// Host completion events of the connection's CQs; `None` in unit tests, which drive
    /// passes by hand.
    pub(super) channel: Option<Arc<CompletionChannel>>,
}

impl ServedQueues {
    pub(super) fn new(wake: EventFd, channel: Option<Arc<CompletionChannel>>) -> ServedQueues {
        ServedQueues {
            table: parking_lot::Mutex::default(),
            table_version: AtomicU64::new(0),
            wake,
            channel,
        }
    }

    /// Changes the queue table, and its version.
    pub(super) fn change_table<T>(&self, change: impl FnOnce(&mut QueueTable) -> T) -> T {
        let mut objects = self.table.lock();
        let changed = change(&mut objects);
        self.table_version.fetch_add(1, Ordering::Release);
        changed
    }
}
