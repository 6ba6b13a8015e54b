//! What a connection's control path, host event thread and pool thread share: `Shared`, its
//! memory snapshot, tables, doorbell areas, counters and SRQ receive counts.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use vm_memory::GuestMemoryAtomic;
use vrdma_spec::codec::ring_pending;
use vrdma_spec::ring::{event_kind, Event, SrqDoorbell};

use super::doorbells::DoorbellAreas;
use super::events::EventSink;
use super::mr_table::MrTable;
use super::queue_table::{Rung, ServedQueues};
use super::queues::{QpData, SrqData};
use super::{guest_access, rate, Memory};
use crate::hostverbs::AddressHandle;
use crate::log_budget::LogBudget;

/// Completion statuses counted one by one (ibv_wc_status has 24).
const STATUS_SLOTS: usize = 32;

pub(super) struct Shared {
    pub(super) mem: RwLock<Option<GuestMemoryAtomic<Memory>>>,
    /// Changes with every memory table accepted: the poller keeps its snapshot until it does.
    pub(super) mem_version: AtomicU64,
    // Read on every visit: locks without poisoning, whose fast paths are a few instructions.
    pub(super) mrs: parking_lot::RwLock<MrTable>,
    pub(super) ahs: parking_lot::RwLock<HashMap<u32, (u32, Arc<AddressHandle>)>>,
    pub(super) queues: ServedQueues,
    pub(super) num_notify_queues: u32,
    /// Changed by the control path through [`Shared::change_areas`].
    pub(super) doorbell_areas: Mutex<DoorbellAreas>,
    /// Changes after every change of `doorbell_areas`: a poller keeps where the bitmap words
    /// it looks at are until it (or the queue table's version) does.
    pub(super) areas_version: AtomicU64,
    /// The SRQ each QP that receives through one takes its receives from, by QP number.
    pub(super) srq_receivers: RwLock<HashMap<u32, Arc<SrqData>>>,
    /// `srq_receivers` is not empty: receive completions need counting.
    pub(super) any_srq_receivers: AtomicBool,
    /// Bits of the doorbell bitmap of area 0 (SET_NOTIFY_AREA's).
    pub(super) doorbell_bits: u32,
    pub(super) sink: Mutex<Option<Arc<dyn EventSink>>>,
    pub(super) pending_events: Mutex<VecDeque<Event>>,
    /// `pending_events` is not empty (changed under its lock): a pass looks at this only.
    pub(super) events_pending: AtomicBool,
    pub(super) kicks: Vec<AtomicU64>,
    pub(super) wqes: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) completions: AtomicU64,
    /// Completions written in error, by ibv_wc_status (the last slot counts any larger).
    pub(super) completion_errors: [AtomicU64; STATUS_SLOTS],
    /// Events raised for the guest (delivered or kept), by kind.
    pub(super) events: [AtomicU64; event_kind::KINDS],
    pub(super) refused: AtomicU64,
    /// The guest's rate limits, and their buckets (the pool thread's, but for a connection's
    /// start and end, which hand them on: [`RateDebt`]).
    pub(super) rate_limits: rate::SharedLimits,
    pub(super) rate_gate: parking_lot::Mutex<rate::RateGate>,
    pub(super) storms: AtomicU64,
    /// Tells the host event thread to end.
    pub(super) stop: AtomicBool,
    /// The connection's share of the log (also its control path's and event queue's).
    pub(super) log: LogBudget,
    /// The poller serving the connection asked for kicks (NEED_WAKEUP is set).
    pub(super) asleep: AtomicBool,
}

impl Shared {
    pub(super) fn areas(&self) -> std::sync::MutexGuard<'_, DoorbellAreas> {
        self.doorbell_areas
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the doorbell areas, then their version.
    pub(super) fn change_areas<T>(&self, change: impl FnOnce(&mut DoorbellAreas) -> T) -> T {
        let changed = change(&mut self.areas());
        self.areas_version.fetch_add(1, Ordering::Release);
        changed
    }

    pub(super) fn new(queues: ServedQueues, num_notify_queues: u32, doorbell_bits: u32) -> Shared {
        Shared {
            doorbell_bits,
            mem: RwLock::new(None),
            mem_version: AtomicU64::new(0),
            mrs: parking_lot::RwLock::default(),
            ahs: parking_lot::RwLock::default(),
            queues,
            num_notify_queues,
            doorbell_areas: Mutex::default(),
            areas_version: AtomicU64::new(0),
            srq_receivers: RwLock::default(),
            any_srq_receivers: AtomicBool::new(false),
            sink: Mutex::new(None),
            pending_events: Mutex::default(),
            events_pending: AtomicBool::new(false),
            kicks: (0..num_notify_queues).map(|_| AtomicU64::new(0)).collect(),
            wqes: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            completions: AtomicU64::new(0),
            completion_errors: Default::default(),
            events: Default::default(),
            refused: AtomicU64::new(0),
            rate_limits: rate::SharedLimits::default(),
            rate_gate: parking_lot::Mutex::default(),
            storms: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            log: LogBudget::default(),
            asleep: AtomicBool::new(false),
        }
    }

    /// Counts a kick, and wakes the poller if it asked for kicks (returning whether it did):
    /// one that did not is awake (and sees the doorbell bits the driver set before kicking)
    /// or is not listening to this driver (see the pool's storming connections).
    pub(super) fn kick(&self, queue: u32) -> bool {
        let Some(count) = self.kicks.get(queue as usize) else {
            return false;
        };
        count.fetch_add(1, Ordering::Relaxed);
        let asked_for = self.asleep.load(Ordering::SeqCst);
        if asked_for {
            let _ = self.queues.wake.write(1);
        }
        asked_for
    }

    /// Raises SRQ_LIMIT_REACHED once when fewer WQEs than the armed limit are left in the
    /// SRQ: those the guest posted, less the receives that took one.
    pub(super) fn check_srq_limit(&self, mem: &Memory, srq: &SrqData) {
        let limit = srq.limit.load(Ordering::Acquire);
        if limit == 0 {
            return;
        }
        let at = srq.doorbell + SrqDoorbell::PRODUCER;
        let Ok(posted) = guest_access::load::<u32>(mem, at, Ordering::Acquire) else {
            return;
        };
        let left = ring_pending(posted, srq.received.load(Ordering::Acquire));
        if left < limit && srq.limit.swap(0, Ordering::AcqRel) != 0 {
            self.post_event(event_kind::SRQ_LIMIT_REACHED, srq.handle);
            let _ = self.queues.wake.write(1);
        }
    }

    /// Receive completions of these QPs were taken: count them against their SRQs, if any.
    #[inline]
    pub(super) fn received_on(&self, mem: &Memory, qp_nums: impl Iterator<Item = u32>) {
        // No lock, and no look at the completions, on the path of connections without SRQs.
        if self.any_srq_receivers.load(Ordering::Acquire) {
            self.count_srq_receives(mem, qp_nums);
        }
    }

    #[inline(never)]
    fn count_srq_receives(&self, mem: &Memory, qp_nums: impl Iterator<Item = u32>) {
        let receivers = self.srq_receivers.read().unwrap_or_else(|e| e.into_inner());
        for qp_num in qp_nums {
            if let Some(srq) = receivers.get(&qp_num) {
                srq.received.fetch_add(1, Ordering::AcqRel);
                self.check_srq_limit(mem, srq);
            }
        }
    }

    /// The QPs that receive from `srq`.
    pub(super) fn receivers_of(&self, srq: &SrqData) -> Vec<Arc<QpData>> {
        let qp_nums: Vec<u32> = self
            .srq_receivers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, receives_from)| std::ptr::eq(Arc::as_ptr(receives_from), srq))
            .map(|(&qp_num, _)| qp_num)
            .collect();
        let objects = self.queues.table.lock();
        objects
            .queues
            .values()
            .filter_map(|rung| match rung {
                Rung::Qp(qp) if qp_nums.contains(&qp.qp.qp_num()) => Some(Arc::clone(qp)),
                _ => None,
            })
            .collect()
    }
}
