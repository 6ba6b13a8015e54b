//! `DataPath`, a connection's data path as its control path drives it: objects added and
//! removed, memory, doorbell areas, kicks, rate limits and counters.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_spec::codec::ring_pending;
use vrdma_spec::ring::event_kind;

use super::doorbells::{AreaInUse, NoBit, NotifyArea};
use super::events::{forward_host_events, EventRaiser, EventSink};
use super::queue_table::{QueueTable, Rung, ServedQueues};
use super::queues::{CqData, GuestRing, QpData, SrqData};
use super::resize_cq::ResizeCqError;
use super::shared::Shared;
use super::wqe::MrRange;
use super::{guest_access, Memory, PollerPool, RateDebt, RateLimits};
use crate::hostverbs::{self, AddressHandle, CompletionChannel, Context};
use crate::log_budget::LogBudget;

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

/// The data path of one connection: its queues, which a thread of the backend's poller pool
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
        // One table of queues, so one pool thread, per connection: connections, not queues, are spread
        // over the pool. A QP's consumer index must be published before its completions
        // reach the guest (SPEC.md §8.1), and the CQ they land on may be any of the
        // connection's: a thread that posts a batch and stores the index first, and only
        // then polls the CQs, gives that order; two threads would race for it.
        let queues = ServedQueues::new(
            EventFd::new(EFD_NONBLOCK).map_err(os_error("eventfd"))?,
            Some(context.create_comp_channel()?),
        );
        let shared = Arc::new(Shared::new(queues, num_notify_queues, doorbell_bits));
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
        self.shared.queues.channel.as_ref()
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
        let _ = self.shared.queues.wake.write(1);
    }

    /// Adds a doorbell area of `bits` bits (SPEC.md §8.6); its number, or `None` when the
    /// connection has as many as it may.
    pub fn add_doorbell_area(&self, place: NotifyArea, bits: u32) -> Option<u32> {
        let added = self.shared.change_areas(|areas| areas.add(place, bits));
        // As for the first area: a sleeping poller asks for kicks in it too.
        let _ = self.shared.queues.wake.write(1);
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
        let _ = self.shared.queues.wake.write(1);
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
        let _ = self.shared.queues.wake.write(1);
    }

    /// The guest posted event buffers: let a poller retry undelivered events.
    pub fn events_available(&self) {
        let _ = self.shared.queues.wake.write(1);
    }

    pub fn add_cq(&self, cq: Arc<CqData>) {
        let queues = &self.shared.queues;
        queues.change_table(|objects| objects.cqs.push(cq));
        let _ = queues.wake.write(1);
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
        let _ = self.shared.queues.wake.write(1);
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
        let queues = &self.shared.queues;
        let removed = queues.change_table(|objects| objects.remove_cq(handle));
        if let Some(cq) = removed {
            cq.retire();
            // The poller holds its own list of the connection's CQs until its next pass: a
            // sleeping one would keep the host CQ alive until the connection's next work.
            let _ = queues.wake.write(1);
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
            .queues
            .change_table(|objects| objects.insert(bit, rung));
        Ok(bit.bit)
    }

    fn remove_rung(&self, handle: u32) {
        let queues = &self.shared.queues;
        let removed = queues.change_table(|objects| objects.remove(handle));
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
        self.shared.queues.change_table(QueueTable::clear);
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
        let _ = self.shared.queues.wake.write(1);
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
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the counters are indexed by status, STATUS_SLOTS (32) of them"
    )]
    pub fn completion_errors(&self) -> BTreeMap<u8, u64> {
        counted(&self.shared.completion_errors)
            .map(|(status, count)| (status as u8, count))
            .collect()
    }

    /// Events raised for the guest so far, by kind (those of none left out).
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the counters are indexed by event kind, event_kind::KINDS (a handful) of them"
    )]
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
