//! The data path (SPEC.md §7-§8): poller threads read WQEs from rings in guest memory, post
//! them to the host QPs in batches, poll the host CQs and write CQEs into guest CQ rings.
//!
//! Every access to guest memory goes through the current vhost-user memory snapshot with
//! bounds-checked copies and atomics (`vm-memory`), so a hostile or vanishing ring can make a
//! QP fail but never make the backend touch memory it does not own. WQEs are copied out of the
//! ring before they are validated. Payload is never copied: SGEs name guest memory registered
//! at the guest's addresses (inline data is part of the WQE itself).

mod doorbells;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fake;
mod guest_access;
pub mod host;
mod poller;
mod pool;
mod queues;
mod rate;
#[cfg(test)]
mod tests;
pub mod wqe;

pub use pool::PollerPool;
pub use queues::{CqData, GuestRing, QpData, SrqData};

/// Why [`DataPath::resize_cq`] left a CQ as it was.
#[derive(Debug, thiserror::Error)]
pub enum ResizeCqError<E> {
    #[error("the CQ holds {held} completions, more than a ring of {depth}")]
    HoldsMore { held: u32, depth: u32 },
    #[error("the CQ's ring, record or consumer index is unusable, or the CQ failed")]
    Unusable,
    #[error("the host CQ cannot be resized: {0}")]
    Host(E),
}
pub use rate::{RateDebt, RateLimits};

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_spec::codec::ring_pending;
use vrdma_spec::ctrl::PORT_NUM;
use vrdma_spec::ring::{event_kind, Event, SrqDoorbell};
use vrdma_spec::{Le16, Le32};

use crate::hostverbs::{self, AddressHandle, AsyncEvent, CompletionChannel, Context};
use crate::log_budget::LogBudget;
pub use doorbells::{AreaInUse, NoBit};
use doorbells::{DoorbellAreas, DoorbellBit};
use wqe::MrRange;

type Memory = GuestMemoryMmap;

/// WQEs taken from one ring in one go, and CQEs moved per CQ per pass.
const BATCH: u32 = 16;
/// The longest a poller sleeps while a queue waits on something no kick announces (room the
/// driver makes in a full CQ by polling it); an idle poller sleeps until woken.
const SLEEP_LIMIT_MS: i32 = 100;

/// Completion statuses counted one by one (ibv_wc_status has 24).
const STATUS_SLOTS: usize = 32;
/// The longest [`DataPath::flush_receives`] waits for the receives the guest published
/// (SPEC.md §5.11, §13.3).
const RECEIVE_FLUSH_LIMIT: std::time::Duration = std::time::Duration::from_millis(100);

/// The nonzero counters of `counters`, by index.
fn counted(counters: &[AtomicU64]) -> impl Iterator<Item = (usize, u64)> + '_ {
    counters
        .iter()
        .map(|count| count.load(Ordering::Relaxed))
        .enumerate()
        .filter(|&(_, count)| count != 0)
}

/// Where events for the guest go (the event virtqueue); `deliver` is false when the guest
/// has no buffer posted.
pub trait EventSink: Send + Sync {
    fn deliver(&self, event: &Event) -> bool;
}

/// A queue the guest rings through the doorbell bitmap.
#[derive(Clone)]
enum Rung {
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

    fn retire(&self) {
        match self {
            Rung::Qp(qp) => qp.retire(),
            Rung::Srq(srq) => srq.retire(),
        }
    }
}

#[derive(Default)]
struct ShardObjects {
    /// QPs and SRQs by doorbell bit, looked up for every queue a pass visits.
    queues: HashMap<DoorbellBit, Rung, BuildHasherDefault<KeyHasher>>,
    /// Their doorbell bits by handle.
    bits: HashMap<u32, DoorbellBit>,
    /// The bitmap words holding their bits (area, byte offset in its bitmap), with how many
    /// each: a pass reads only these.
    words: BTreeMap<(u32, u64), u32>,
    cqs: Vec<Arc<CqData>>,
}

impl ShardObjects {
    fn insert(&mut self, bit: DoorbellBit, rung: Rung) {
        self.bits.insert(rung.handle(), bit);
        self.queues.insert(bit, rung);
        *self.words.entry(bit.word()).or_default() += 1;
    }

    /// Takes out the queue with `handle`, with its bit.
    fn remove(&mut self, handle: u32) -> Option<(DoorbellBit, Rung)> {
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

    fn remove_cq(&mut self, handle: u32) -> Option<Arc<CqData>> {
        let at = self.cqs.iter().position(|cq| cq.handle == handle)?;
        Some(self.cqs.swap_remove(at))
    }

    /// Takes out every object, retired: no pass touches their rings again.
    fn clear(&mut self) {
        for rung in self.queues.values() {
            rung.retire();
        }
        for cq in &self.cqs {
            cq.retire();
        }
        *self = ShardObjects::default();
    }
}

/// Where a doorbell area's notification states and bitmap are (SPEC.md §8.5, §8.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotifyArea {
    /// GPA of the `NotifyState` records.
    pub states: u64,
    /// GPA of the doorbell bitmap.
    pub doorbell_bitmap: u64,
}

/// Hashes the host's MR keys for the lookup every SGE makes, and doorbell bits for the one
/// every visit makes: one multiply per word instead of SipHash. The host chooses the keys and
/// the backend the bits, and a guest holds a bounded number of them, so there is nothing for
/// a guest to flood.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u32(b.into());
        }
    }
    fn write_u16(&mut self, bits: u16) {
        self.write_u32(bits.into());
    }
    fn write_u32(&mut self, key: u32) {
        // The table indexes by the low bits: fold the well-mixed high half into them.
        let mixed = (self.0 ^ u64::from(key)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = mixed ^ (mixed >> 32);
    }
}

/// The guest's MRs by host lkey, and a count of the changes made to them: a poller keeps the
/// last MR it looked up, across passes, while the count stays the same.
#[derive(Default)]
struct MrTable {
    ranges: HashMap<u32, MrRange, BuildHasherDefault<KeyHasher>>,
    changes: u64,
}

impl MrTable {
    fn get(&self, lkey: u32) -> Option<MrRange> {
        self.ranges.get(&lkey).copied()
    }

    fn insert(&mut self, lkey: u32, range: MrRange) {
        self.ranges.insert(lkey, range);
        self.changes += 1;
    }

    fn remove(&mut self, lkey: u32) {
        self.ranges.remove(&lkey);
        self.changes += 1;
    }

    fn clear(&mut self) {
        self.ranges.clear();
        self.changes += 1;
    }
}

/// A connection's queues as the pool thread serving it sees them: one per connection.
struct Shard {
    // Taken by the poller whenever a queue is rung: a lock without poisoning checks.
    objects: parking_lot::Mutex<ShardObjects>,
    /// Changes (under the `objects` lock) with every change of `objects`: the poller copies
    /// the CQ list when it does, and otherwise takes no lock for it.
    objects_version: AtomicU64,
    wake: EventFd,
    /// Host completion events of the connection's CQs; `None` in unit tests, which drive
    /// passes by hand.
    channel: Option<Arc<CompletionChannel>>,
}

impl Shard {
    fn new(wake: EventFd, channel: Option<Arc<CompletionChannel>>) -> Shard {
        Shard {
            objects: parking_lot::Mutex::default(),
            objects_version: AtomicU64::new(0),
            wake,
            channel,
        }
    }

    /// Changes the queue table, and its version.
    fn change_objects<T>(&self, change: impl FnOnce(&mut ShardObjects) -> T) -> T {
        let mut objects = self.objects.lock();
        let changed = change(&mut objects);
        self.objects_version.fetch_add(1, Ordering::Release);
        changed
    }
}

/// The events kept for delivery, locked; on unlock, whether any are left is published for
/// the passes that look without locking.
struct PendingEvents<'a> {
    events: std::sync::MutexGuard<'a, VecDeque<Event>>,
    flag: &'a AtomicBool,
}

impl std::ops::Deref for PendingEvents<'_> {
    type Target = VecDeque<Event>;
    fn deref(&self) -> &Self::Target {
        &self.events
    }
}

impl std::ops::DerefMut for PendingEvents<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.events
    }
}

impl Drop for PendingEvents<'_> {
    fn drop(&mut self) {
        self.flag.store(!self.events.is_empty(), Ordering::Release);
    }
}

/// Counters reported when a connection ends (and in tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub wqes: u64,
    /// Payload bytes of the send WQEs among them (SGE lengths, or inline data).
    pub bytes: u64,
    pub completions: u64,
    pub kicks: u64,
    /// WQEs the device refused (completed in error without reaching the host).
    pub refused: u64,
    /// Times the driver's kicks kept bringing no work and it was no longer asked for them
    /// for a while (SPEC.md §8.5).
    pub storms: u64,
}

struct Shared {
    mem: RwLock<Option<GuestMemoryAtomic<Memory>>>,
    /// Changes with every memory table accepted: the poller keeps its snapshot until it does.
    mem_version: AtomicU64,
    // Read on every visit: locks without poisoning, whose fast paths are a few instructions.
    mrs: parking_lot::RwLock<MrTable>,
    ahs: parking_lot::RwLock<HashMap<u32, (u32, Arc<AddressHandle>)>>,
    shard: Shard,
    num_notify_queues: u32,
    /// Changed by the control path through [`Shared::change_areas`].
    doorbell_areas: Mutex<DoorbellAreas>,
    /// Changes after every change of `doorbell_areas`: a poller keeps where the bitmap words
    /// it looks at are until it (or the queue table's version) does.
    areas_version: AtomicU64,
    /// The SRQ each QP that receives through one takes its receives from, by QP number.
    srq_receivers: RwLock<HashMap<u32, Arc<SrqData>>>,
    /// `srq_receivers` is not empty: receive completions need counting.
    any_srq_receivers: AtomicBool,
    /// Bits of the doorbell bitmap of area 0 (SET_NOTIFY_AREA's).
    doorbell_bits: u32,
    sink: Mutex<Option<Arc<dyn EventSink>>>,
    pending_events: Mutex<VecDeque<Event>>,
    /// `pending_events` is not empty (changed under its lock): a pass looks at this only.
    events_pending: AtomicBool,
    kicks: Vec<AtomicU64>,
    wqes: AtomicU64,
    bytes: AtomicU64,
    completions: AtomicU64,
    /// Completions written in error, by ibv_wc_status (the last slot counts any larger).
    completion_errors: [AtomicU64; STATUS_SLOTS],
    /// Events raised for the guest (delivered or kept), by kind.
    events: [AtomicU64; event_kind::KINDS],
    refused: AtomicU64,
    /// The guest's rate limits, and their buckets (the pool thread's, but for a connection's
    /// start and end, which hand them on: [`RateDebt`]).
    rate_limits: rate::SharedLimits,
    rate_gate: parking_lot::Mutex<rate::RateGate>,
    storms: AtomicU64,
    /// Tells the host event thread to end.
    stop: AtomicBool,
    /// The connection's share of the log (also its control path's and event queue's).
    log: LogBudget,
    /// The poller serving the connection asked for kicks (NEED_WAKEUP is set).
    asleep: AtomicBool,
}

/// The data path of one connection: its shard, which a thread of the backend's poller pool
/// serves, and the thread that forwards the host context's asynchronous events.
pub struct DataPath {
    shared: Arc<Shared>,
    pool: Arc<PollerPool>,
    /// The pool thread serving the connection.
    pool_thread: usize,
    host_events: Option<JoinHandle<()>>,
    stop_host_events: EventFd,
}

impl DataPath {
    /// The data path of a connection with `num_notify_queues` notification queues and a
    /// doorbell bitmap of `doorbell_bits`, served by one thread of `pool`, and a thread that
    /// forwards `context`'s asynchronous events about its objects and `host_port`.
    pub fn new(
        context: &Arc<Context>,
        pool: &Arc<PollerPool>,
        (num_notify_queues, doorbell_bits): (u32, u32),
        host_port: u8,
    ) -> hostverbs::Result<DataPath> {
        let os_error = |call| move |source| hostverbs::Error::Verbs { call, source };
        // One shard, so one pool thread, per connection: connections, not queues, are spread
        // over the pool. A QP's consumer index must be published before its completions
        // reach the guest (SPEC.md §8.1), and the CQ they land on may be any of the
        // connection's: a thread that posts a batch and stores the index first, and only
        // then polls the CQs, gives that order; two threads would race for it.
        let shard = Shard::new(
            EventFd::new(EFD_NONBLOCK).map_err(os_error("eventfd"))?,
            Some(context.create_comp_channel()?),
        );
        let shared = Arc::new(Shared::new(shard, num_notify_queues, doorbell_bits));
        let epoll = Epoll::new().map_err(os_error("epoll_create"))?;
        let stop_host_events = EventFd::new(EFD_NONBLOCK).map_err(os_error("eventfd"))?;
        for (fd, id) in [(stop_host_events.as_raw_fd(), 0), (context.async_fd(), 1)] {
            epoll
                .ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, id))
                .map_err(os_error("epoll_ctl"))?;
        }
        let (events_shared, context) = (Arc::clone(&shared), Arc::clone(context));
        let host_events = std::thread::Builder::new()
            .name("vrdma-host-events".into())
            .spawn(move || forward_host_events(&context, &events_shared, &epoll, host_port))
            .map_err(os_error("spawn the host event thread"))?;
        let pool_thread = pool.attach(&shared);
        Ok(DataPath {
            shared,
            pool: Arc::clone(pool),
            pool_thread,
            host_events: Some(host_events),
            stop_host_events,
        })
    }

    /// The notification queue a new object with `handle` is kicked through.
    pub fn notify_queue_for(&self, handle: u32) -> u32 {
        handle % self.shared.num_notify_queues
    }

    /// The completion channel the connection's CQs are created on.
    pub fn completion_channel(&self) -> Option<&Arc<CompletionChannel>> {
        self.shared.shard.channel.as_ref()
    }

    /// The connection's log budget: every line a guest can make the backend log draws on it.
    pub fn log_budget(&self) -> &LogBudget {
        &self.shared.log
    }

    pub fn set_memory(&self, mem: GuestMemoryAtomic<Memory>) {
        *self.shared.mem.write().unwrap_or_else(|e| e.into_inner()) = Some(mem);
        self.shared.mem_version.fetch_add(1, Ordering::Release);
    }

    pub fn set_event_sink(&self, sink: Arc<dyn EventSink>) {
        *self.shared.sink.lock().unwrap_or_else(|e| e.into_inner()) = Some(sink);
    }

    /// A way for another thread of the connection (the connection manager's) to raise
    /// events for the guest.
    pub fn event_raiser(&self) -> EventRaiser {
        EventRaiser(Arc::clone(&self.shared))
    }

    /// The notify area the guest set (SPEC.md §8.5), if any since the last reset.
    pub fn notify_area(&self) -> Option<NotifyArea> {
        self.shared.areas().get(0).map(|area| area.place)
    }

    /// Sets the notify area (area 0); `None` forgets it and every other doorbell area.
    pub fn set_notify_area(&self, area: Option<NotifyArea>) {
        let bits = self.shared.doorbell_bits;
        self.shared.change_areas(|areas| match area {
            Some(place) => areas.set_first(place, bits),
            None => areas.clear(),
        });
        // A sleeping poller publishes NEED_WAKEUP in the new area before it sleeps again:
        // until then the driver would not know to kick.
        let _ = self.shared.shard.wake.write(1);
    }

    /// Adds a doorbell area of `bits` bits (SPEC.md §8.6); its number, or `None` when the
    /// connection has as many as it may.
    pub fn add_doorbell_area(&self, place: NotifyArea, bits: u32) -> Option<u32> {
        let added = self.shared.change_areas(|areas| areas.add(place, bits));
        // As for the first area: a sleeping poller asks for kicks in it too.
        let _ = self.shared.shard.wake.write(1);
        added
    }

    pub fn remove_doorbell_area(&self, area: u32) -> Result<(), AreaInUse> {
        self.shared.change_areas(|areas| areas.remove(area))
    }

    /// A kick on notification queue `queue`; false if no poller was asleep to be woken (the
    /// driver kicked without being asked to, SPEC.md §8.5).
    pub fn kick(&self, queue: u32) -> bool {
        self.shared.kick(queue)
    }

    /// The QP numbered `qp_num` takes its receives from `srq`: its receive completions count
    /// towards the SRQ's limit.
    pub fn receive_through(&self, qp_num: u32, srq: Arc<SrqData>) {
        self.update_receivers(|receivers| {
            receivers.insert(qp_num, srq);
        });
    }

    pub fn forget_receiver(&self, qp_num: u32) {
        self.update_receivers(|receivers| {
            receivers.remove(&qp_num);
        });
    }

    fn update_receivers(&self, change: impl FnOnce(&mut HashMap<u32, Arc<SrqData>>)) {
        let mut receivers = self
            .shared
            .srq_receivers
            .write()
            .unwrap_or_else(|e| e.into_inner());
        change(&mut receivers);
        self.shared
            .any_srq_receivers
            .store(!receivers.is_empty(), Ordering::Release);
    }

    /// Arms `srq`'s limit (SPEC.md §5.13): SRQ_LIMIT_REACHED when fewer than `limit` of its
    /// WQEs are left, now or later; 0 disarms.
    pub fn arm_srq_limit(&self, srq: &SrqData, limit: u32) {
        srq.limit.store(limit, Ordering::Release);
        if let Some(mem) = self
            .shared
            .mem
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            self.shared.check_srq_limit(&mem.memory(), srq);
        }
    }

    /// Waits, at most `RECEIVE_FLUSH_LIMIT`, until every receive the guest published on
    /// `qp`'s RQ before this call is on the host QP: the pool thread posts them, woken here.
    /// A connection manager's message must not overtake them (SPEC.md §13.3): a UD peer's
    /// first datagram would find no receive, where native posting would have put it there
    /// already. Nor may the error state (§5.11): the host flushes only the receives it holds
    /// (rxe takes later ones without a word), so one taken after it would never complete. A
    /// guest that publishes receives without ringing their doorbell costs itself the wait.
    pub fn flush_receives(&self, qp: &QpData) {
        if qp.rq.is_none() {
            return;
        }
        let published = {
            let mem = self.shared.mem.read().unwrap_or_else(|e| e.into_inner());
            let Some(mem) = mem.as_ref() else { return };
            let at = qp.doorbell + vrdma_spec::ring::QpDoorbell::RQ_PRODUCER;
            match guest_access::load::<u32>(&mem.memory(), at, Ordering::Acquire) {
                Ok(published) => published,
                Err(_) => return,
            }
        };
        let _ = self.shared.shard.wake.write(1);
        let deadline = std::time::Instant::now() + RECEIVE_FLUSH_LIMIT;
        loop {
            let progress = &qp.progress.lock().progress;
            if progress.failed || ring_pending(published, progress.rq_consumer) == 0 {
                return;
            }
            if std::time::Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }

    /// Tells the guest the device needs a reset (SPEC.md §8.4).
    pub fn device_fatal(&self) {
        self.shared.post_event(event_kind::DEVICE_FATAL, 0);
        let _ = self.shared.shard.wake.write(1);
    }

    /// The guest posted event buffers: let a poller retry undelivered events.
    pub fn events_available(&self) {
        let _ = self.shared.shard.wake.write(1);
    }

    pub fn add_cq(&self, cq: Arc<CqData>) {
        let shard = &self.shared.shard;
        shard.change_objects(|objects| objects.cqs.push(cq));
        let _ = shard.wake.write(1);
    }

    /// Before RESIZE_CQ counts the completions `cq` holds (SPEC.md §5.7.1): waits, at most
    /// `RECEIVE_FLUSH_LIMIT`, until the pool thread has posted to the host every send WQE
    /// the guest published before this call on `senders` (the QPs whose sends complete
    /// there), and has moved into the ring the host completions it has room for. With native
    /// verbs a completion is in the CQ soon after its post; here it would otherwise still be
    /// on its way. A CQ of unsignaled sends, whose count of WQEs on the host never returns to
    /// zero, costs the whole wait.
    pub fn settle_cq(&self, cq: &CqData, senders: &[Arc<QpData>]) {
        let published: Vec<(&Arc<QpData>, u32)> = {
            let mem = self.shared.mem.read().unwrap_or_else(|e| e.into_inner());
            let Some(mem) = mem.as_ref() else { return };
            let mem = mem.memory();
            senders
                .iter()
                .filter_map(|qp| {
                    let at = qp.doorbell + vrdma_spec::ring::QpDoorbell::SQ_PRODUCER;
                    let producer = guest_access::load::<u32>(&mem, at, Ordering::Acquire).ok()?;
                    Some((qp, producer))
                })
                .collect()
        };
        let _ = self.shared.shard.wake.write(1);
        let deadline = std::time::Instant::now() + RECEIVE_FLUSH_LIMIT;
        loop {
            let sent = published.iter().all(|(qp, producer)| {
                let progress = &qp.progress.lock().progress;
                progress.failed || ring_pending(*producer, progress.sq_consumer) == 0
            });
            let moved = !cq.may_have_completions() || cq.progress.lock().progress.room == 0;
            if (sent && moved) || std::time::Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }

    /// Moves `cq` to `ring` (RESIZE_CQ, SPEC.md §5.7.1); see `Shared::resize_cq`.
    pub fn resize_cq<E>(
        &self,
        cq: &CqData,
        ring: GuestRing,
        resize_host: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), ResizeCqError<E>> {
        self.shared.resize_cq(cq, ring, resize_host)
    }

    /// Takes the CQ out of its poller; once this returns, no pass writes to its ring.
    pub fn remove_cq(&self, handle: u32) {
        let shard = &self.shared.shard;
        let removed = shard.change_objects(|objects| objects.remove_cq(handle));
        if let Some(cq) = removed {
            cq.retire();
            // The poller holds its own list of the connection's CQs until its next pass: a
            // sleeping one would keep the host CQ alive until the connection's next work.
            let _ = shard.wake.write(1);
        }
    }

    /// Serves the QP whenever its doorbell bit in `area` is rung; the bit.
    pub fn add_qp(&self, qp: Arc<QpData>, area: u32) -> Result<u16, NoBit> {
        self.add_rung(Rung::Qp(qp), area)
    }

    /// Takes the QP out of its poller and frees its doorbell bit; once this returns, no pass
    /// reads its rings or doorbell record.
    pub fn remove_qp(&self, handle: u32) {
        self.remove_rung(handle);
    }

    /// As [`DataPath::add_qp`], for an SRQ.
    pub fn add_srq(&self, srq: Arc<SrqData>, area: u32) -> Result<u16, NoBit> {
        self.add_rung(Rung::Srq(srq), area)
    }

    pub fn remove_srq(&self, handle: u32) {
        self.remove_rung(handle);
    }

    fn add_rung(&self, rung: Rung, area: u32) -> Result<u16, NoBit> {
        let bit = self.shared.areas().alloc(area)?;
        self.shared
            .shard
            .change_objects(|objects| objects.insert(bit, rung));
        Ok(bit.bit)
    }

    fn remove_rung(&self, handle: u32) {
        let shard = &self.shared.shard;
        let removed = shard.change_objects(|objects| objects.remove(handle));
        if let Some((bit, rung)) = removed {
            rung.retire();
            self.shared.areas().free(bit);
        }
    }

    pub fn add_mr(&self, lkey: u32, range: MrRange) {
        self.shared.mrs.write().insert(lkey, range);
    }

    pub fn remove_mr(&self, lkey: u32) {
        self.shared.mrs.write().remove(lkey);
    }

    pub fn add_ah(&self, handle: u32, pd: u32, ah: Arc<AddressHandle>) {
        self.shared.ahs.write().insert(handle, (pd, ah));
    }

    pub fn remove_ah(&self, handle: u32) {
        self.shared.ahs.write().remove(&handle);
    }

    /// Forgets every object (device reset).
    pub fn clear(&self) {
        self.shared.shard.change_objects(ShardObjects::clear);
        self.shared.mrs.write().clear();
        self.shared.ahs.write().clear();
        self.shared.take_pending_events().clear();
        self.update_receivers(HashMap::clear);
        self.set_notify_area(None);
    }

    /// Limits the guest's sends to these rates from the next pass on.
    pub fn set_rate_limits(&self, limits: RateLimits) {
        self.shared.rate_limits.set(limits);
        // A poller asleep behind a limit looks again now.
        let _ = self.shared.shard.wake.write(1);
    }

    pub fn rate_limits(&self) -> RateLimits {
        self.shared.rate_limits.get()
    }

    /// Starts from the buckets `debt` holds: what the guest's last connection left them.
    pub fn take_rate_debt(&self, debt: &RateDebt) {
        *self.shared.rate_gate.lock() = debt.take();
    }

    /// Leaves the buckets to `debt`, for the guest's next connection.
    pub fn leave_rate_debt(&self, debt: &RateDebt) {
        debt.leave(self.shared.rate_gate.lock().clone());
    }

    /// Completions written in error so far, by status (those of none left out).
    pub fn completion_errors(&self) -> BTreeMap<u8, u64> {
        counted(&self.shared.completion_errors)
            .map(|(status, count)| (status as u8, count))
            .collect()
    }

    /// Events raised for the guest so far, by kind (those of none left out).
    pub fn events_raised(&self) -> BTreeMap<u16, u64> {
        counted(&self.shared.events)
            .map(|(kind, count)| (kind as u16, count))
            .collect()
    }

    pub fn stats(&self) -> Stats {
        Stats {
            wqes: self.shared.wqes.load(Ordering::Relaxed),
            bytes: self.shared.bytes.load(Ordering::Relaxed),
            completions: self.shared.completions.load(Ordering::Relaxed),
            refused: self.shared.refused.load(Ordering::Relaxed),
            storms: self.shared.storms.load(Ordering::Relaxed),
            kicks: self
                .shared
                .kicks
                .iter()
                .map(|k| k.load(Ordering::Relaxed))
                .sum(),
        }
    }
}

impl Drop for DataPath {
    fn drop(&mut self) {
        self.pool.detach(self.pool_thread, &self.shared);
        self.shared.stop.store(true, Ordering::Release);
        let _ = self.stop_host_events.write(1);
        if let Some(thread) = self.host_events.take() {
            let _ = thread.join();
        }
    }
}

impl Shared {
    /// Moves `cq` to `ring` (RESIZE_CQ, SPEC.md §5.7.1), no pass writing to it meanwhile:
    /// checks that the ring holds no more CQEs than `ring`'s depth (and that the driver's
    /// consumer index is one it could have), then lets `resize_host` resize the host CQ,
    /// then copies the CQEs the driver has not consumed to their indexes in `ring`, each with
    /// its lap's owner bit for the new depth. Nothing changes unless all of it succeeds.
    pub(super) fn resize_cq<E>(
        &self,
        cq: &CqData,
        ring: GuestRing,
        resize_host: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), ResizeCqError<E>> {
        let mem = self.mem.read().unwrap_or_else(|e| e.into_inner());
        let mem = mem
            .as_ref()
            .ok_or(ResizeCqError::Unusable)?
            .memory()
            .into_inner();
        let mut visit = cq.progress.lock();
        let queues::Visited { progress, resolved } = &mut *visit;
        if progress.failed {
            return Err(ResizeCqError::Unusable);
        }
        let old = resolved.through(&mem, || cq.spans(&progress.ring));
        let consumer = old
            .load(
                queues::RECORD,
                vrdma_spec::ring::CqDoorbell::CONSUMER_INDEX,
                Ordering::Acquire,
            )
            .ok_or(ResizeCqError::Unusable)?;
        let held = ring_pending(progress.producer, consumer);
        if held > progress.ring.depth {
            return Err(ResizeCqError::Unusable);
        }
        if held > ring.depth {
            return Err(ResizeCqError::HoldsMore {
                held,
                depth: ring.depth,
            });
        }
        let mut unconsumed = Vec::with_capacity(held as usize);
        let read = guest_access::Slots::new(&progress.ring, old.from(queues::FIRST_PAGE)).take(
            consumer,
            held,
            |slot| {
                use wqe::Slot;
                slot.field::<vrdma_spec::ring::Cqe>(0)
                    .map(|cqe| unconsumed.push(cqe))
                    .is_some()
            },
        );
        if read != held {
            return Err(ResizeCqError::Unusable);
        }
        let mut fresh = guest_access::Resolved::default();
        let new = fresh.through(&mem, || cq.spans(&ring));
        let slots = guest_access::Slots::new(&ring, new.from(queues::FIRST_PAGE));
        // Every slot the copy writes must be there before the host CQ changes.
        if (0..held).any(|n| slots.slot(consumer.wrapping_add(n)).is_none()) {
            return Err(ResizeCqError::Unusable);
        }
        resize_host().map_err(ResizeCqError::Host)?;
        let depth = ring.depth;
        let written = slots.publish(consumer, held, |n, at| {
            poller::cqe_words(&vrdma_spec::ring::Cqe {
                owner: vrdma_spec::ring::cqe_owner_for(at, depth),
                ..unconsumed[n as usize]
            })
        });
        debug_assert_eq!(written, held, "every slot was checked above");
        progress.ring = ring;
        progress.room = depth - held;
        // The spans changed: resolved again at the next visit.
        *resolved = guest_access::Resolved::default();
        Ok(())
    }

    fn areas(&self) -> std::sync::MutexGuard<'_, DoorbellAreas> {
        self.doorbell_areas
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the doorbell areas, then their version.
    fn change_areas<T>(&self, change: impl FnOnce(&mut DoorbellAreas) -> T) -> T {
        let changed = change(&mut self.areas());
        self.areas_version.fetch_add(1, Ordering::Release);
        changed
    }

    fn new(shard: Shard, num_notify_queues: u32, doorbell_bits: u32) -> Shared {
        Shared {
            doorbell_bits,
            mem: RwLock::new(None),
            mem_version: AtomicU64::new(0),
            mrs: parking_lot::RwLock::default(),
            ahs: parking_lot::RwLock::default(),
            shard,
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
    fn kick(&self, queue: u32) -> bool {
        let Some(count) = self.kicks.get(queue as usize) else {
            return false;
        };
        count.fetch_add(1, Ordering::Relaxed);
        let asked_for = self.asleep.load(Ordering::SeqCst);
        if asked_for {
            let _ = self.shard.wake.write(1);
        }
        asked_for
    }

    /// Delivers an event, or keeps it (once per kind and object) for the pollers to deliver
    /// when the guest posts event buffers.
    fn post_event(&self, kind: u16, handle: u32) {
        if let Some(count) = self.events.get(usize::from(kind)) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        let event = Event {
            kind: Le16::from(kind),
            reserved: Le16::from(0),
            handle: Le32::from(handle),
        };
        let sink = self.sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if sink.is_some_and(|s| s.deliver(&event)) {
            return;
        }
        let mut pending = self.take_pending_events();
        if !pending.contains(&event) {
            pending.push_back(event);
        }
    }

    /// The events kept for the pollers to deliver; `events_pending` follows what the guard
    /// leaves.
    fn take_pending_events(&self) -> PendingEvents<'_> {
        PendingEvents {
            events: self
                .pending_events
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
            flag: &self.events_pending,
        }
    }

    /// Raises SRQ_LIMIT_REACHED once when fewer WQEs than the armed limit are left in the
    /// SRQ: those the guest posted, less the receives that took one.
    fn check_srq_limit(&self, mem: &Memory, srq: &SrqData) {
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
            let _ = self.shard.wake.write(1);
        }
    }

    /// Receive completions of these QPs were taken: count them against their SRQs, if any.
    #[inline]
    fn received_on(&self, mem: &Memory, qp_nums: impl Iterator<Item = u32>) {
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
    fn receivers_of(&self, srq: &SrqData) -> Vec<Arc<QpData>> {
        let qp_nums: Vec<u32> = self
            .srq_receivers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, receives_from)| std::ptr::eq(Arc::as_ptr(receives_from), srq))
            .map(|(&qp_num, _)| qp_num)
            .collect();
        let objects = self.shard.objects.lock();
        objects
            .queues
            .values()
            .filter_map(|rung| match rung {
                Rung::Qp(qp) if qp_nums.contains(&qp.qp.qp_num()) => Some(Arc::clone(qp)),
                _ => None,
            })
            .collect()
    }

    /// The guest handle of the first object `pick` finds in any shard.
    fn find_handle(&self, pick: impl Fn(&ShardObjects) -> Option<u32>) -> Option<u32> {
        pick(&self.shard.objects.lock())
    }

    /// Turns a host asynchronous event into the guest's event (SPEC.md §8.4), if it concerns
    /// one of this connection's objects or its port.
    fn forward_host_event(&self, event: AsyncEvent, host_port: u8) {
        let found = |kind, handle: Option<u32>| handle.map(|handle| (kind, handle));
        let guest_event = match event {
            AsyncEvent::QpFailed(qp_num) => found(
                event_kind::QP_FATAL,
                self.find_handle(|o| {
                    o.queues.values().find_map(|rung| match rung {
                        Rung::Qp(qp) if qp.qp.qp_num() == qp_num => Some(qp.handle),
                        _ => None,
                    })
                }),
            ),
            AsyncEvent::CqError(id) => found(
                event_kind::CQ_ERROR,
                self.find_handle(|o| o.cqs.iter().find(|c| c.host.id() == id).map(|c| c.handle)),
            ),
            AsyncEvent::SrqLimitReached(id) => found(
                event_kind::SRQ_LIMIT_REACHED,
                self.find_handle(|o| {
                    o.queues.values().find_map(|rung| match rung {
                        Rung::Srq(srq) if srq.srq.id() == id => Some(srq.handle),
                        _ => None,
                    })
                }),
            ),
            AsyncEvent::PortActive(port) if port == host_port => {
                Some((event_kind::PORT_ACTIVE, u32::from(PORT_NUM)))
            }
            AsyncEvent::PortError(port) if port == host_port => {
                Some((event_kind::PORT_ERROR, u32::from(PORT_NUM)))
            }
            AsyncEvent::DeviceFatal => Some((event_kind::DEVICE_FATAL, 0)),
            _ => None,
        };
        match guest_event {
            Some((kind, handle)) => {
                self.log
                    .info(|| format!("host event {event:?}: guest event {kind} for {handle:#x}"));
                self.post_event(kind, handle);
                // A sleeping poller delivers what the event queue had no buffer for.
                let _ = self.shard.wake.write(1);
            }
            None => log::debug!("host event {event:?} not forwarded"),
        }
    }
}

/// Raises events for the guest of one connection (SPEC.md §8.4), from any thread.
#[derive(Clone)]
pub struct EventRaiser(Arc<Shared>);

impl EventRaiser {
    pub fn raise(&self, kind: u16, handle: u32) {
        self.0.post_event(kind, handle);
        // A sleeping poller delivers what the event queue had no buffer for.
        let _ = self.0.shard.wake.write(1);
    }

    /// The connection's log budget.
    pub fn log_budget(&self) -> &LogBudget {
        &self.0.log
    }
}

/// The body of the host event thread: forwards `context`'s events until told to stop.
fn forward_host_events(context: &Context, shared: &Shared, epoll: &Epoll, host_port: u8) {
    let mut ready = [EpollEvent::default(); 2];
    while !shared.stop.load(Ordering::Acquire) {
        if let Err(e) = epoll.wait(-1, &mut ready) {
            if e.kind() != std::io::ErrorKind::Interrupted {
                log::error!("host event thread: epoll_wait: {e}");
                return;
            }
        }
        while context.take_async_event(|event| shared.forward_host_event(event, host_port)) {}
    }
}
