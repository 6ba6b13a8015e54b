//! A pool thread's work on one connection: each pass visits the rung rings, moves WQEs to the
//! host in batches and completions back; before the thread sleeps it asks for kicks and arms
//! the CQs (SPEC.md §8.5).

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vm_memory::GuestAddressSpace;
use vrdma_spec::codec::{
    notify_state_offset, ring_pending, ArmRequest, MAX_SEND_INLINE, MAX_SEND_SGE,
};
use vrdma_spec::ring::{
    cqe_owner_for, event_kind, wc_opcode, CqDoorbell, Cqe, NotifyState, QpDoorbell, SrqDoorbell,
    CQE_SIZE, NOTIFY_NEED_WAKEUP,
};
use vrdma_spec::{ByteValued, Le16, Le32, Le64};

use super::doorbells::{DoorbellArea, DoorbellBit};
use super::guest_access::{store, Mapped, Resolved, Slots};
use super::queues::{CqData, CqProgress, QpData, QpProgress, SrqData, Visited, FIRST_PAGE, RECORD};
use super::rate::Allowance;
use super::wqe::{self, MrRange, QpRules, Slot, WqeError};
use super::{Memory, MrTable, Rung, Shard, Shared, BATCH};
use crate::hostverbs::{self, AddressHandle, PushError, RecvWr, SendBatch, Sge, WorkCompletion};

/// What visiting a queue did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Visit {
    /// Something moved (posted, refused, failed).
    worked: bool,
    /// WQEs are left in the ring (a full batch, or a host queue that took no more).
    more: bool,
}

impl Visit {
    const WORKED: Visit = Visit {
        worked: true,
        more: false,
    };
}

/// A queue a pass visits: its doorbell bit, which of its send WQEs the pass may take, and
/// whether its receive WQEs need a visit.
struct Planned {
    bit: DoorbellBit,
    rung: Rung,
    sends: Sends,
    /// False where the send bound found the RQ with nothing new (read after the SQ's
    /// producer index, so no receive posted before a send the bound lets through is missed):
    /// a receive posted since waits for the next pass, which its doorbell bit asks for.
    receives: bool,
}

/// Which send WQEs of a QP a pass may post (SPEC.md §8.5 "Receives before sends"). A send
/// visible when the SQ producer index is read was made available after every receive posted
/// before it, including their doorbell bits: the pass's second look at the bitmap, taken
/// after that read, finds those bits, and the pass posts their receives first. A send made
/// available after the read may follow a receive whose bit the second look missed: it waits
/// for the next pass.
#[derive(Clone, Copy)]
enum Sends {
    /// Those before this SQ producer index, read between the pass's two looks; `None`: the
    /// doorbell record was unreadable then (the visit fails the QP).
    Before(Option<u32>),
    /// None: the second look found the queue; its sends wait for the next pass.
    NextPass,
}

/// What a pool thread keeps for one connection it serves: the connection, its copy of the CQ
/// list and reusable scratch space (no allocation per WQE).
pub(super) struct Poller {
    shared: Arc<Shared>,
    /// The SGEs of a batch of receive WQEs.
    sges: Vec<Sge>,
    /// A batch of sends, built in place in the host's layout.
    batch: SendBatch,
    recv: Vec<(u64, usize)>,
    wcs: Vec<WorkCompletion>,
    /// The memory snapshot passes use, kept from pass to pass while the connection's memory
    /// table stays the one of `memory_version` (taking it is locks and reference counts),
    /// and let go of before the thread sleeps.
    memory: Option<Arc<Memory>>,
    memory_version: u64,
    /// A pass is under way: its first look took the snapshot.
    in_pass: bool,
    /// Doorbell bits this pass took so far, with those of the queues the last pass left
    /// WQEs in.
    rung: Vec<DoorbellBit>,
    /// The queues this pass visits.
    visits: Vec<Planned>,
    /// Doorbell bits of the queues the last pass left WQEs in.
    carried: Vec<DoorbellBit>,
    /// The last pass found a CQ's ring full with completions that may wait behind it in
    /// the host CQ: they move once the driver polls, which it announces with no kick.
    cq_full: bool,
    /// The connection's CQs as of the queue table's `objects_version`.
    cqs: Vec<Arc<CqData>>,
    objects_version: u64,
    last_mr: LastMr,
    scan: DoorbellScan,
    /// Whether a send visit found the guest's rate limits' buckets empty.
    throttled: bool,
}

/// The MR a poller found last, kept across passes while the MR table does not change (see
/// [`MrTable`]): the WQEs of a connection mostly name the same MR.
struct LastMr {
    /// The table's change count when it was found.
    changes: Cell<u64>,
    /// Its lkey, widened so that "none" is a value no lkey has: a hit is one comparison.
    key: Cell<u64>,
    // Field by field, each a word the compiler keeps as such.
    pd: Cell<u32>,
    start: Cell<u64>,
    len: Cell<u64>,
}

/// The doorbell bitmap words a look reads, kept from look to look, so that a look takes no
/// lock and looks nothing up: which words they are changes only with the queue table and the
/// doorbell areas, where they are in this process only with the memory snapshot.
#[derive(Default)]
struct DoorbellScan {
    /// The queue table's and the doorbell areas' versions the words are those of.
    versions: Option<(u64, u64)>,
    /// Each word's area and byte offset in that area's bitmap.
    words: Vec<(u32, u64)>,
    /// Each word's guest-physical address.
    places: Vec<u64>,
    resolved: Resolved,
}

impl DoorbellScan {
    /// Takes the bits rung in the connection's bitmap words into `bits`.
    fn take_rung_bits(&mut self, shared: &Shared, mem: &Arc<Memory>, bits: &mut Vec<DoorbellBit>) {
        let versions = (
            shared.shard.objects_version.load(Ordering::Acquire),
            shared.areas_version.load(Ordering::Acquire),
        );
        if self.versions != Some(versions) {
            self.refresh(shared);
        }
        let places = &self.places;
        let mapped = self
            .resolved
            .through(mem, || places.iter().map(|&gpa| (gpa, size_of::<u64>())));
        for (index, &(area, offset)) in self.words.iter().enumerate() {
            // A word the memory table no longer holds costs the guest its doorbells, never
            // the backend its safety.
            let Some(word) = mapped.word64(index) else {
                continue;
            };
            if word.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut rung = word.swap(0, Ordering::Acquire);
            while rung != 0 {
                let bit = rung.trailing_zeros();
                rung &= rung - 1;
                bits.push(DoorbellBit {
                    area,
                    bit: (offset * 8) as u16 + bit as u16,
                });
            }
        }
    }

    #[cold]
    fn refresh(&mut self, shared: &Shared) {
        let objects = shared.shard.objects.lock();
        // Read under the queue table's lock and before the areas': what is copied is these
        // versions' or later ones' (each changes after what it counts).
        let versions = (
            shared.shard.objects_version.load(Ordering::Acquire),
            shared.areas_version.load(Ordering::Acquire),
        );
        let areas = shared.areas();
        self.words.clear();
        self.places.clear();
        // The words come sorted by area: each area is looked up once.
        let mut current: Option<(u32, Option<&DoorbellArea>)> = None;
        for &(area, offset) in objects.words.keys() {
            if current.is_none_or(|(number, _)| number != area) {
                current = Some((area, areas.get(area)));
            }
            let Some((_, Some(found))) = current else {
                continue;
            };
            if offset + 8 > found.bitmap_bytes() as u64 {
                continue;
            }
            self.words.push((area, offset));
            self.places.push(found.place.doorbell_bitmap + offset);
        }
        self.versions = Some(versions);
        // The words changed: they are resolved again at the next look.
        self.resolved = Resolved::default();
    }
}

/// Looks lkeys up in `mrs` through `last`. The table cannot change while its read lock is
/// held, as it is for a batch.
fn mr_lookup<'a>(mrs: &'a MrTable, last: &'a LastMr) -> impl Fn(u32) -> Option<MrRange> + 'a {
    if last.changes.get() != mrs.changes {
        last.key.set(NO_LKEY);
        last.changes.set(mrs.changes);
    }
    move |lkey| {
        if last.key.get() != u64::from(lkey) {
            let range = mrs.get(lkey)?;
            last.key.set(u64::from(lkey));
            last.pd.set(range.pd);
            last.start.set(range.start);
            last.len.set(range.len);
        }
        Some(MrRange {
            pd: last.pd.get(),
            start: last.start.get(),
            len: last.len.get(),
        })
    }
}

/// The QP's SQ producer index as the driver published it (acquire: the WQEs before it, and
/// what the driver did before writing them, are visible), `None` if its doorbell record is
/// unreadable; and whether its RQ then holds WQEs the device has not taken (or cannot tell).
/// `(None, false)` if the QP failed.
fn send_bound(mem: &Arc<Memory>, qp: &QpData) -> (Option<u32>, bool) {
    with_live_qp(mem, qp, |mapped, progress| {
        let sends = mapped.load(RECORD, QpDoorbell::SQ_PRODUCER, Ordering::Acquire);
        let receives = qp.rq.is_some()
            && mapped
                .load(RECORD, QpDoorbell::RQ_PRODUCER, Ordering::Acquire)
                .is_none_or(|producer: u32| producer != progress.rq_consumer);
        (sends, receives)
    })
    .unwrap_or((None, false))
}

/// Runs `f` on the QP's mapped rings and record under its progress lock; `None` if the QP
/// failed.
#[inline(always)]
fn with_live_qp<T>(
    mem: &Arc<Memory>,
    qp: &QpData,
    f: impl FnOnce(Mapped<'_>, &mut QpProgress) -> T,
) -> Option<T> {
    let mut visit = qp.progress.lock();
    let Visited { progress, resolved } = &mut *visit;
    if progress.failed {
        return None;
    }
    let mapped = resolved.through(mem, || qp.spans());
    Some(f(mapped, progress))
}

/// No lkey: [`LastMr::key`] when it names none.
const NO_LKEY: u64 = u64::MAX;

/// Queues one pass visits at most for one connection (see `take_rung_queues`).
const MAX_VISITS_PER_PASS: usize = 64;

impl Default for LastMr {
    fn default() -> Self {
        LastMr {
            changes: Cell::new(0),
            key: Cell::new(NO_LKEY),
            pd: Cell::new(0),
            start: Cell::new(0),
            len: Cell::new(0),
        }
    }
}

/// The wr_id of a refused WQE (the first field of both kinds). The guest may have rewritten
/// the slot since it was parsed: what its error CQE then says is its own business.
fn wr_id_of(slot: &impl Slot) -> u64 {
    slot.field::<Le64>(0).map_or(0, Le64::to_native)
}

/// A CQE as the words it is written with; its owner byte is in the last (see
/// [`Slots::publish`]).
pub(super) fn cqe_words(cqe: &Cqe) -> [u64; CQE_SIZE / 8] {
    const _: () = assert!(std::mem::offset_of!(Cqe, owner) >= CQE_SIZE - 8);
    let mut words = [0u64; CQE_SIZE / 8];
    for (word, bytes) in words.iter_mut().zip(cqe.as_slice().chunks_exact(8)) {
        *word = u64::from_ne_bytes(bytes.try_into().expect("8 bytes"));
    }
    words
}

/// Checks the send WQE in `slot` straight into `batch`, its SGEs and inline payload in place:
/// every WQE the common path (`wqe::parse_common_send`) does not take. A refused one comes
/// back with its wr_id.
// Out of the loop, so that the common path's few values stay in registers; the slot is
// passed by value, so that the loop does not keep a copy of it in memory for this call.
#[inline(never)]
fn push_send<'h>(
    batch: &mut SendBatch,
    slot: impl Slot + Copy,
    qp: &QpData,
    mrs: &impl Fn(u32) -> Option<MrRange>,
    ahs: &impl Fn(u32) -> Option<(u32, &'h Arc<AddressHandle>)>,
) -> Result<(), (u64, WqeError)> {
    let pushed = batch.push_with(|sges, inline| {
        wqe::parse_send(&slot, &qp.rules, mrs, ahs, sges, inline).map_err(PushError::Made)
    });
    let error = match pushed {
        Ok(()) => return Ok(()),
        Err(PushError::Made(error)) => error,
        // Not with the room the batch has (see `Poller::new`).
        Err(PushError::Full) => {
            log::error!("QP {:#x}: the send batch is full", qp.handle);
            WqeError::Unpostable
        }
    };
    Err((wr_id_of(&slot), error))
}

fn error_cqe(wr_id: u64, qp_num: u32, status: u8, opcode: u8) -> Cqe {
    Cqe {
        wr_id: Le64::from(wr_id),
        qp_num: Le32::from(qp_num),
        status,
        opcode,
        ..Default::default()
    }
}

impl Poller {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Poller {
            shared,
            sges: Vec::with_capacity(BATCH as usize * 32),
            // Room for a batch of the largest WQEs: a WQE is never refused for the room left.
            batch: SendBatch::with_capacity(
                BATCH as usize,
                BATCH as usize * MAX_SEND_SGE as usize,
                BATCH as usize * MAX_SEND_INLINE as usize,
            ),
            recv: Vec::with_capacity(BATCH as usize),
            wcs: (0..BATCH).map(|_| WorkCompletion::default()).collect(),
            memory: None,
            memory_version: 0,
            in_pass: false,
            rung: Vec::new(),
            visits: Vec::new(),
            carried: Vec::new(),
            cq_full: false,
            cqs: Vec::new(),
            objects_version: u64::MAX,
            last_mr: LastMr::default(),
            scan: DoorbellScan::default(),
            throttled: false,
        }
    }

    pub(super) fn shard(&self) -> &Shard {
        &self.shared.shard
    }

    /// The connection this poller serves.
    pub(super) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The current memory snapshot.
    fn current_memory(&self) -> Option<Arc<Memory>> {
        self.shared
            .mem
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|m| m.memory().into_inner())
    }

    /// Takes the current memory snapshot, unless the one kept is still it.
    fn refresh_memory(&mut self) {
        let version = self.shared.mem_version.load(Ordering::Acquire);
        if self.memory.is_none() || version != self.memory_version {
            self.memory = self.current_memory();
            self.memory_version = version;
        }
    }

    /// Before the thread sleeps: no mapping of an old memory table stays alive for it.
    pub(super) fn let_go_of_memory(&mut self) {
        self.memory = None;
    }

    /// Before sleeping: asks the host for a completion event on every CQ of the connection
    /// that is not armed already (a CQ stays armed until a completion arrives on it).
    pub(super) fn arm_cqs(&self) {
        for cq in &self.cqs {
            if !cq.armed.swap(true, Ordering::Relaxed) && cq.host.arm().is_err() {
                cq.armed.store(false, Ordering::Relaxed);
            }
        }
    }

    /// Some queue has work left that it could not do (its CQ full, say), or events wait for
    /// buffers on the event queue: the driver makes room without a kick (and a stopped event
    /// queue starts again with none), so a sleeping poller must look again on its own.
    pub(super) fn waits_on_driver(&self) -> bool {
        !self.carried.is_empty()
            || self.cq_full
            || self.shared.events_pending.load(Ordering::Acquire)
    }

    /// How long the guest's rate limits hold its sends back, if a visit found them holding.
    pub(super) fn throttled_for(&self) -> Option<std::time::Duration> {
        let limits = self.shared.rate_limits.get();
        self.throttled
            .then(|| self.shared.rate_gate.lock().wait(limits))
    }

    /// Sets or clears NEED_WAKEUP in every doorbell area's notify states: whichever area a
    /// driver rings through, it learns there whether to kick (SPEC.md §8.5, §8.6).
    pub(super) fn set_need_wakeup(&self, sleeping: bool) {
        self.shared.asleep.store(sleeping, Ordering::SeqCst);
        let Some(mem) = self.current_memory() else {
            return;
        };
        let flags = if sleeping { NOTIFY_NEED_WAKEUP } else { 0 };
        for area in self.shared.areas().places() {
            for queue in 0..self.shared.num_notify_queues {
                let state = area.states + notify_state_offset(queue);
                let kicks = self.shared.kicks[queue as usize].load(Ordering::Relaxed) as u32;
                // A guest that unmapped its notify area only loses its wake-ups.
                let _ = store(&mem, flags, state + NotifyState::FLAGS, Ordering::SeqCst);
                let _ = store(&mem, kicks, state + NotifyState::KICKS, Ordering::Relaxed);
            }
        }
    }

    /// One look at the connection's rung rings and at its CQs; true if anything moved. The
    /// steps a pool thread takes over all its connections at once (see `PoolWorker::pass`).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(super) fn pass(&mut self) -> bool {
        if self.take_doorbells() {
            self.bound_sends();
            self.take_doorbells();
        }
        let received = self.take_receive_work();
        self.take_send_work() | received
    }

    /// A pass's first step: takes the doorbells rung since the last look. True if some queue
    /// has work. Taken twice when any has, with [`Poller::bound_sends`] between the looks: a
    /// receive made available before a send the pass posts is found by the second look,
    /// wherever its bit lies (SPEC.md §8.5).
    pub(super) fn take_doorbells(&mut self) -> bool {
        if !self.in_pass {
            self.refresh_memory();
            if self.memory.is_none() {
                return false;
            }
            self.in_pass = true;
            self.rung.append(&mut self.carried);
        }
        let Some(mem) = &self.memory else {
            return false;
        };
        self.scan.take_rung_bits(&self.shared, mem, &mut self.rung);
        !self.rung.is_empty()
    }

    /// Between a pass's two looks: the queues the first look found are planned, and each
    /// QP's send WQEs bounded by its SQ producer index as of now (see [`Sends`]).
    pub(super) fn bound_sends(&mut self) {
        if !self.in_pass {
            return;
        }
        self.plan_visits();
        let Some(mem) = &self.memory else { return };
        for planned in &mut self.visits {
            if let Rung::Qp(qp) = &planned.rung {
                let (sends, receives) = send_bound(mem, qp);
                planned.sends = Sends::Before(sends);
                planned.receives = receives;
            }
        }
    }

    /// The pass's next step: the rung queues' receive WQEs go to the host before any send
    /// WQE of this pass, so that a receive posted before a send is there when the send
    /// arrives (a UD or UC message finding no receive is dropped; an RC one waits an RNR
    /// timeout).
    pub(super) fn take_receive_work(&mut self) -> bool {
        if !self.in_pass {
            return false;
        }
        // Planned already by `bound_sends`, unless the second look found more; the CQ list
        // is copied again when the queue table changed.
        self.plan_visits();
        let Some(mem) = self.memory.take() else {
            return false;
        };
        let mut work = false;
        let visits = std::mem::take(&mut self.visits);
        for planned in visits.iter().filter(|planned| planned.receives) {
            let visit = match &planned.rung {
                Rung::Qp(qp) => self.process_qp_receives(&mem, qp),
                Rung::Srq(srq) => self.process_srq(&mem, srq),
            };
            work |= visit.worked;
            if visit.more {
                self.carried.push(planned.bit);
            }
        }
        self.visits = visits;
        self.memory = Some(mem);
        work
    }

    /// The pass's last step: the rung QPs' send WQEs, then the CQs; events owed.
    pub(super) fn take_send_work(&mut self) -> bool {
        if !std::mem::take(&mut self.in_pass) {
            return false;
        }
        let Some(mem) = self.memory.take() else {
            return false;
        };
        let mut work = self.deliver_pending_events();
        self.throttled = false;
        let mut visits = std::mem::take(&mut self.visits);
        // Each queue is let go of once visited: a queue the control path removed meanwhile
        // was retired under its progress lock, so the visit found it failed and left it.
        for planned in visits.drain(..) {
            let Rung::Qp(qp) = &planned.rung else {
                continue;
            };
            match planned.sends {
                Sends::Before(producer) => {
                    let visit = self.process_qp_sends(&mem, qp, producer);
                    work |= visit.worked;
                    if visit.more {
                        self.carried.push(planned.bit);
                    }
                }
                Sends::NextPass => self.carried.push(planned.bit),
            }
        }
        self.visits = visits;
        let cqs = std::mem::take(&mut self.cqs);
        self.cq_full = false;
        for cq in &cqs {
            work |= self.process_cq(&mem, cq);
        }
        self.cqs = cqs;
        self.memory = Some(mem);
        work
    }

    /// The queues to visit this pass: those whose doorbell bits were taken since the last
    /// plan (their sends for the next pass, unless [`Poller::bound_sends`] bounds them), and
    /// those the last pass left work in; and the connection's CQs, if they changed. The
    /// queue table's lock is held for this only, not through the pass, so the control path
    /// adding or removing a queue never waits for one.
    fn plan_visits(&mut self) {
        // Nothing to plan (most connections of a pass): no lock taken.
        let objects_version = self.shared.shard.objects_version.load(Ordering::Acquire);
        if self.rung.is_empty() && objects_version == self.objects_version {
            return;
        }
        let shared = Arc::clone(&self.shared);
        let objects = shared.shard.objects.lock();
        // Read under the lock: the list copied is this version's or a later one's.
        let objects_version = shared.shard.objects_version.load(Ordering::Acquire);
        if objects_version != self.objects_version {
            self.cqs.clone_from(&objects.cqs);
            self.objects_version = objects_version;
        }
        let mut bits = std::mem::take(&mut self.rung);
        if bits.len() > 1 {
            bits.sort_unstable();
            bits.dedup();
        }
        // A queue both looks found is visited once this pass, and again the next: what the
        // second look found of it may be sends past its bound.
        let planned = self.visits.len();
        if planned > 0 {
            let (visits, carried) = (&self.visits, &mut self.carried);
            bits.retain(|&bit| {
                let again = visits.iter().any(|p| p.bit == bit);
                if again {
                    carried.push(bit);
                }
                !again
            });
        }
        // Bits of queues destroyed since they were rung have no queue: they are dropped. At
        // most MAX_VISITS_PER_PASS queues are visited; the rest wait for the next pass, so a
        // driver ringing every doorbell it has holds up the poller's other connections no
        // longer than one that rings a few.
        let visited = bits.len().min(MAX_VISITS_PER_PASS.saturating_sub(planned));
        for &bit in &bits[..visited] {
            if let Some(rung) = objects.queues.get(&bit) {
                self.visits.push(Planned {
                    bit,
                    rung: rung.clone(),
                    sends: Sends::NextPass,
                    receives: true,
                });
            }
        }
        self.carried.extend_from_slice(&bits[visited..]);
        bits.clear();
        self.rung = bits;
    }

    /// Moves the QP to the error state after a WQE or record it cannot use: the host then
    /// flushes everything outstanding, as hardware would. Said (log line, QP_FATAL) once per
    /// QP, however often a guest repeats the mistake.
    fn fail_qp(&self, qp: &QpData, in_error: &mut bool, reason: &dyn std::fmt::Display) {
        if *in_error {
            log::debug!("QP {:#x}: {reason}", qp.handle);
            return;
        }
        *in_error = true;
        self.shared.log.warn(|| {
            format!(
                "QP {:#x}: {reason}; moving it to the error state",
                qp.handle
            )
        });
        if let Err(e) = qp.qp.set_error() {
            log::error!("QP {:#x}: cannot enter the error state: {e}", qp.handle);
        }
        self.post_event(event_kind::QP_FATAL, qp.handle);
    }

    /// Takes no more WQEs from `srq` and fails the QPs receiving from it, as a NIC's SRQ
    /// error does (SPEC.md §8.4): the driver learns of it from SRQ_ERROR, and each QP's
    /// receives in flight flush.
    fn fail_srq(&self, srq: &SrqData, reason: &str) {
        self.shared.log.warn(|| {
            format!(
                "SRQ {:#x}: {reason}; no more WQEs are taken from it",
                srq.handle
            )
        });
        self.post_event(event_kind::SRQ_ERROR, srq.handle);
        for qp in self.shared.receivers_of(srq) {
            let mut visit = qp.progress.lock();
            let in_error = &mut visit.progress.in_error;
            self.fail_qp(
                &qp,
                in_error,
                &format_args!("its SRQ {:#x} failed", srq.handle),
            );
        }
    }

    /// Completes a refused WQE with `cqe` on `cq` and fails the QP; false (the WQE stays in
    /// its ring) while the CQ has no room: a guest that never polls keeps its refused WQEs,
    /// the backend keeps nothing for it.
    fn refuse_wqe(
        &self,
        mem: &Arc<Memory>,
        qp: &QpData,
        in_error: &mut bool,
        cq: &CqData,
        (cqe, reason): (Cqe, &WqeError),
    ) -> bool {
        let mut visit = cq.progress.lock();
        let Visited { progress, resolved } = &mut *visit;
        let mapped = resolved.through(mem, || cq.spans(&progress.ring));
        if self.cq_room(mapped, cq, progress, 1).unwrap_or(0) == 0
            || self.write_cqes(mapped, cq, progress, 1, |_| cqe) == 0
        {
            return false;
        }
        drop(visit);
        self.shared.refused.fetch_add(1, Ordering::Relaxed);
        self.count_completion_error(cqe.status);
        self.fail_qp(qp, in_error, reason);
        true
    }

    fn count_completion_error(&self, status: u8) {
        let counts = &self.shared.completion_errors;
        counts[usize::from(status).min(counts.len() - 1)].fetch_add(1, Ordering::Relaxed);
    }

    /// Takes what the QP's RQ holds.
    // Out of line: tests/bench-guest.sh counts the instructions spent in the process_*
    // functions per WQE.
    #[inline(never)]
    fn process_qp_receives(&mut self, mem: &Arc<Memory>, qp: &QpData) -> Visit {
        self.visit_qp(mem, qp, Self::take_receives)
    }

    /// Takes what the QP's SQ holds before `producer` (`None`: its record was unreadable).
    #[inline(never)]
    fn process_qp_sends(&mut self, mem: &Arc<Memory>, qp: &QpData, producer: Option<u32>) -> Visit {
        self.visit_qp(mem, qp, |poller, mem, mapped, qp, progress| {
            poller.take_sends(mem, mapped, qp, progress, producer)
        })
    }

    /// Runs `take` on one of the QP's queues under its progress lock, unless the QP failed.
    #[inline(always)]
    fn visit_qp(
        &mut self,
        mem: &Arc<Memory>,
        qp: &QpData,
        take: impl FnOnce(&mut Self, &Arc<Memory>, Mapped<'_>, &QpData, &mut QpProgress) -> Visit,
    ) -> Visit {
        with_live_qp(mem, qp, |mapped, progress| {
            take(self, mem, mapped, qp, progress)
        })
        .unwrap_or_default()
    }

    #[inline(always)]
    fn take_sends(
        &mut self,
        mem: &Arc<Memory>,
        mapped: Mapped<'_>,
        qp: &QpData,
        progress: &mut QpProgress,
        producer: Option<u32>,
    ) -> Visit {
        let Some(producer) = producer else {
            progress.failed = true;
            self.fail_qp(qp, &mut progress.in_error, &"doorbell record unreadable");
            return Visit::WORKED;
        };
        let pending = ring_pending(producer, progress.sq_consumer);
        if pending == 0 {
            return Visit::default();
        }
        if pending > qp.sq.depth {
            progress.failed = true;
            self.fail_qp(
                qp,
                &mut progress.in_error,
                &format!(
                    "SQ producer {producer} runs {pending} ahead of a {}-deep ring",
                    qp.sq.depth
                ),
            );
            return Visit::WORKED;
        }
        let limits = self.shared.rate_limits.get();
        let allowed = if limits.is_unlimited() {
            Allowance::UNLIMITED
        } else {
            (self.shared.rate_gate.lock()).allowance(limits, std::time::Instant::now())
        };
        if allowed.wqes == 0 {
            // The WQEs wait in the ring for the limit: the queue is visited again.
            self.throttled = true;
            return Visit {
                worked: false,
                more: true,
            };
        }
        self.batch.clear();
        let mut refused: Option<(u64, WqeError)> = None;
        let mut bytes_allowed_taken = false;
        {
            let shared = &*self.shared;
            let mrs = shared.mrs.read();
            let mr_of = mr_lookup(&mrs, &self.last_mr);
            // Only UD sends name AHs.
            let ahs = qp.rules.ud.then(|| shared.ahs.read());
            let ah_of = |handle| {
                let (pd, ah) = ahs.as_ref()?.get(&handle)?;
                Some((*pd, ah))
            };
            let slots = Slots::new(&qp.sq, mapped.from(FIRST_PAGE));
            let send_batch = &mut self.batch;
            let batch = pending.min(BATCH).min(allowed.wqes);
            let common = qp.takes_common_sends;
            let byte_limited = allowed.bytes != u64::MAX;
            let taken = slots.take(progress.sq_consumer, batch, |slot| {
                // The WQE that reaches the byte limit is the visit's last (rate.rs).
                if byte_limited && send_batch.payload_bytes(send_batch.len()) >= allowed.bytes {
                    bytes_allowed_taken = true;
                    return false;
                }
                if common {
                    if let Some(wr) = wqe::parse_common_send(&slot, &qp.rules, &mr_of) {
                        if send_batch.push_one_sge(&wr) {
                            return true;
                        }
                    }
                }
                let pushed = push_send(send_batch, slot, qp, &mr_of, &ah_of);
                refused = pushed.err();
                refused.is_none()
            });
            if refused.is_none() && !bytes_allowed_taken && taken < batch {
                progress.failed = true;
                self.fail_qp(qp, &mut progress.in_error, &"SQ ring unreadable");
                return Visit::WORKED;
            }
        }
        let posted = self.post_sends(qp);
        let bytes = self.batch.payload_bytes(posted);
        self.shared.bytes.fetch_add(bytes, Ordering::Relaxed);
        if !limits.is_unlimited() {
            (self.shared.rate_gate.lock()).spend(limits, posted as u64, bytes);
        }
        progress.sq_consumer = progress.sq_consumer.wrapping_add(posted as u32);
        let all_posted = posted == self.batch.len();
        let mut refused_one = false;
        if let (true, Some((wr_id, error))) = (all_posted, refused) {
            // A refused send completes as a SEND, whatever its opcode said (SPEC.md §7.5).
            let cqe = error_cqe(wr_id, qp.qp.qp_num(), error.status(), wc_opcode::SEND);
            let refusal = (cqe, &error);
            refused_one = self.refuse_wqe(mem, qp, &mut progress.in_error, &qp.send_cq, refusal);
            if refused_one {
                progress.sq_consumer = progress.sq_consumer.wrapping_add(1);
            }
        }
        mapped.store(
            RECORD,
            progress.sq_consumer,
            QpDoorbell::SQ_CONSUMER,
            Ordering::Release,
        );
        self.shared.wqes.fetch_add(posted as u64, Ordering::Relaxed);
        Visit {
            worked: posted > 0 || refused_one,
            more: ring_pending(producer, progress.sq_consumer) > 0,
        }
    }

    /// Posts the batch; returns how many the host took (it refuses the rest when its queue
    /// is full; they stay in the guest ring for the next pass).
    fn post_sends(&mut self, qp: &QpData) -> usize {
        if self.batch.is_empty() {
            return 0;
        }
        qp.send_cq.expect(self.batch.len());
        let posted = match qp.qp.post_send(&mut self.batch) {
            Ok(()) => self.batch.len(),
            Err(hostverbs::Error::Post { posted, source, .. }) => {
                if source.raw_os_error() != Some(libc::ENOMEM) {
                    let handle = qp.handle;
                    self.shared
                        .log
                        .warn(|| format!("QP {handle:#x}: host refused a send: {source}"));
                }
                posted
            }
            Err(e) => {
                self.shared.log.warn(|| format!("QP {:#x}: {e}", qp.handle));
                0
            }
        };
        if posted < self.batch.len() {
            qp.send_cq.settle(self.batch.len() - posted);
        }
        posted
    }

    /// Reads and validates up to a batch of receive WQEs from `ring` (between `consumer` and
    /// `producer`) into `self.recv`/`self.sges`; returns the first refused one, if any.
    fn read_receives(
        &mut self,
        slots: Slots<'_>,
        rules: &QpRules,
        consumer: u32,
        pending: u32,
    ) -> Option<(u64, WqeError)> {
        self.sges.clear();
        self.recv.clear();
        let mrs = self.shared.mrs.read();
        let lookup = mr_lookup(&mrs, &self.last_mr);
        let (recv, sges) = (&mut self.recv, &mut self.sges);
        let batch = pending.min(BATCH);
        let mut refused = None;
        let taken = slots.take(consumer, batch, |slot| {
            match wqe::parse_recv(&slot, rules, &lookup, sges) {
                Ok(received) => recv.push(received),
                Err(error) => refused = Some((wr_id_of(&slot), error)),
            }
            refused.is_none()
        });
        refused.or((taken < batch).then_some((0, WqeError::RingUnreadable)))
    }

    /// Posts what `read_receives` collected with `post`; returns how many the host took.
    fn post_receives(&self, post: impl Fn(&[RecvWr<'_>]) -> hostverbs::Result<()>) -> usize {
        // A batch at most (read_receives takes no more), built on the stack.
        let mut wrs = [RecvWr::default(); BATCH as usize];
        let wrs = &mut wrs[..self.recv.len()];
        let mut at = 0;
        for (wr, &(wr_id, count)) in wrs.iter_mut().zip(&self.recv) {
            at += count;
            *wr = RecvWr {
                wr_id,
                sges: &self.sges[at - count..at],
            };
        }
        match post(wrs) {
            Ok(()) => wrs.len(),
            Err(hostverbs::Error::Post { posted, .. }) => posted,
            Err(_) => 0,
        }
    }

    #[inline(always)]
    fn take_receives(
        &mut self,
        mem: &Arc<Memory>,
        mapped: Mapped<'_>,
        qp: &QpData,
        progress: &mut QpProgress,
    ) -> Visit {
        let Some(rq) = &qp.rq else {
            return Visit::default();
        };
        if progress.failed {
            return Visit::default();
        }
        let Some(producer) = mapped.load(RECORD, QpDoorbell::RQ_PRODUCER, Ordering::Acquire) else {
            return Visit::default();
        };
        let pending = ring_pending(producer, progress.rq_consumer);
        if pending == 0 {
            return Visit::default();
        }
        if pending > rq.depth {
            progress.failed = true;
            let reason = format!(
                "RQ producer {producer} runs {pending} ahead of a {}-deep ring",
                rq.depth
            );
            self.fail_qp(qp, &mut progress.in_error, &reason);
            return Visit::WORKED;
        }
        let slots = Slots::new(rq, mapped.from(qp.rq_first_page()));
        let refused = self.read_receives(slots, &qp.rules, progress.rq_consumer, pending);
        qp.recv_cq.expect(self.recv.len());
        let posted = self.post_receives(|wrs| qp.qp.post_recv(wrs));
        if posted < self.recv.len() {
            qp.recv_cq.settle(self.recv.len() - posted);
        }
        progress.rq_consumer = progress.rq_consumer.wrapping_add(posted as u32);
        let mut refused_one = false;
        if let (true, Some((wr_id, error))) = (posted == self.recv.len(), refused) {
            let cqe = error_cqe(wr_id, qp.qp.qp_num(), error.status(), wc_opcode::RECV);
            let refusal = (cqe, &error);
            refused_one = self.refuse_wqe(mem, qp, &mut progress.in_error, &qp.recv_cq, refusal);
            if refused_one {
                progress.rq_consumer = progress.rq_consumer.wrapping_add(1);
            }
        }
        mapped.store(
            RECORD,
            progress.rq_consumer,
            QpDoorbell::RQ_CONSUMER,
            Ordering::Release,
        );
        self.shared.wqes.fetch_add(posted as u64, Ordering::Relaxed);
        Visit {
            worked: posted > 0 || refused_one,
            more: ring_pending(producer, progress.rq_consumer) > 0,
        }
    }

    // Out of line: tests/bench-guest.sh counts the instructions spent in the process_*
    // functions per WQE.
    #[inline(never)]
    fn process_srq(&mut self, mem: &Arc<Memory>, srq: &SrqData) -> Visit {
        let mut visit = srq.progress.lock();
        let Visited { progress, resolved } = &mut *visit;
        if progress.failed {
            return Visit::default();
        }
        let mapped = resolved.through(mem, || srq.spans());
        let Some(producer) = mapped.load(RECORD, SrqDoorbell::PRODUCER, Ordering::Acquire) else {
            return Visit::default();
        };
        let pending = ring_pending(producer, progress.consumer);
        if pending == 0 {
            return Visit::default();
        }
        // With the host SRQ full nothing moves: the SRQ is visited again (and the poller may
        // sleep meanwhile; receives completing there wake it through their CQ).
        let mut moved = false;
        let refused = if pending > srq.ring.depth {
            Some(format!(
                "SRQ producer {producer} runs {pending} ahead of a {}-deep ring",
                srq.ring.depth
            ))
        } else {
            let slots = Slots::new(&srq.ring, mapped.from(FIRST_PAGE));
            let refused = self.read_receives(slots, &srq.rules, progress.consumer, pending);
            let posted = self.post_receives(|wrs| srq.srq.post_recv(wrs));
            moved = posted > 0;
            progress.consumer = progress.consumer.wrapping_add(posted as u32);
            self.shared.wqes.fetch_add(posted as u64, Ordering::Relaxed);
            mapped.store(
                RECORD,
                progress.consumer,
                SrqDoorbell::CONSUMER,
                Ordering::Release,
            );
            refused.map(|(_, error)| error.to_string())
        };
        if let Some(reason) = refused {
            progress.failed = true;
            drop(visit);
            self.fail_srq(srq, &reason);
            return Visit::WORKED;
        }
        Visit {
            worked: moved,
            more: ring_pending(producer, progress.consumer) > 0,
        }
    }

    /// Free CQE slots, at least `wanted` if there are as many; `None` if the CQ is broken. The
    /// guest's consumer index is read only when fewer than `wanted` are known to be free.
    #[inline]
    fn cq_room(
        &self,
        mapped: Mapped<'_>,
        cq: &CqData,
        progress: &mut CqProgress,
        wanted: u32,
    ) -> Option<u32> {
        if progress.failed {
            return None;
        }
        if progress.room >= wanted {
            return Some(progress.room);
        }
        let consumer = mapped.load(RECORD, CqDoorbell::CONSUMER_INDEX, Ordering::Acquire);
        match consumer.map(|c| ring_pending(progress.producer, c)) {
            Some(used) if used <= progress.ring.depth => {
                progress.room = progress.ring.depth - used;
                Some(progress.room)
            }
            _ => {
                self.shared.log.warn(|| {
                    format!(
                        "CQ {:#x}: consumer index unreadable or inconsistent",
                        cq.handle
                    )
                });
                progress.failed = true;
                self.post_event(event_kind::CQ_ERROR, cq.handle);
                None
            }
        }
    }

    /// Writes `count` CQEs, the `index`th made by `cqe`, at the CQ's producer index, each with
    /// its lap's owner bit (written last); how many it wrote: fewer if the ring is no longer in
    /// guest memory, which breaks the CQ.
    #[inline(always)]
    fn write_cqes(
        &self,
        mapped: Mapped<'_>,
        cq: &CqData,
        progress: &mut CqProgress,
        count: u32,
        cqe: impl Fn(usize) -> Cqe,
    ) -> u32 {
        let (first, depth) = (progress.producer, progress.ring.depth);
        let written = Slots::new(&progress.ring, mapped.from(FIRST_PAGE)).publish(
            first,
            count,
            |index, at| {
                let owner = cqe_owner_for(at, depth);
                cqe_words(&Cqe {
                    owner,
                    ..cqe(index as usize)
                })
            },
        );
        progress.producer = progress.producer.wrapping_add(written);
        progress.room = progress.room.saturating_sub(written);
        if written < count {
            progress.failed = true;
            self.post_event(event_kind::CQ_ERROR, cq.handle);
        }
        written
    }

    // Out of line: tests/bench-guest.sh counts the instructions spent in the process_*
    // functions per WQE.
    #[inline(never)]
    fn process_cq(&mut self, mem: &Arc<Memory>, cq: &CqData) -> bool {
        cq.may_have_completions() && self.poll_cq(mem, cq)
    }

    // Out of line: a visit that need not poll costs a check, not this function's frame.
    #[inline(never)]
    fn poll_cq(&mut self, mem: &Arc<Memory>, cq: &CqData) -> bool {
        let mut visit = cq.progress.lock();
        let Visited { progress, resolved } = &mut *visit;
        let mapped = resolved.through(mem, || cq.spans(&progress.ring));
        let Some(room) = self.cq_room(mapped, cq, progress, BATCH) else {
            return false;
        };
        if room == 0 {
            self.cq_full = true;
            return false;
        }
        let want = room.min(BATCH) as usize;
        let n = match cq.host.poll(&mut self.wcs[..want]) {
            Ok(n) => n,
            Err(e) => {
                self.shared.log.warn(|| format!("CQ {:#x}: {e}", cq.handle));
                0
            }
        };
        if n == 0 {
            return false;
        }
        cq.settle(n);
        // The event of an armed CQ fires with its next completion: arm it again.
        cq.armed.store(false, Ordering::Relaxed);
        let wcs = &self.wcs[..n];
        let moved = self.write_cqes(mapped, cq, progress, n as u32, |index| {
            let wc = &wcs[index];
            Cqe {
                wr_id: Le64::from(wc.wr_id()),
                qp_num: Le32::from(wc.qp_num()),
                byte_len: Le32::from(wc.byte_len()),
                imm_data: Le32::from(wc.imm_data().unwrap_or(0)),
                src_qp: Le32::from(wc.src_qp()),
                status: wc.status() as u8,
                opcode: wc.opcode() as u8,
                wc_flags: wc.wc_flags() as u8,
                sl: wc.sl(),
                pkey_index: Le16::from(wc.pkey_index()),
                reserved: 0,
                owner: 0,
            }
        });
        for wc in &self.wcs[..moved as usize] {
            if wc.status() != 0 {
                self.count_completion_error(wc.status() as u8);
            }
        }
        let received = self.wcs[..moved as usize].iter().filter(|wc| wc.is_recv());
        self.shared
            .received_on(mem, received.map(WorkCompletion::qp_num));
        self.shared
            .completions
            .fetch_add(u64::from(moved), Ordering::Relaxed);
        if moved > 0 {
            self.serve_arm_request(mapped, cq, progress);
        }
        moved > 0
    }

    /// A new CQE was written: if the guest armed the CQ, tell it (SPEC.md §8.2).
    fn serve_arm_request(&self, record: Mapped<'_>, cq: &CqData, progress: &mut CqProgress) {
        // The CQE must be visible before the arm is read, or a guest arming meanwhile and
        // this poller each read the other's old value and the event is lost.
        std::sync::atomic::fence(Ordering::SeqCst);
        let Some(arm) = record.load(RECORD, CqDoorbell::ARM, Ordering::Acquire) else {
            return;
        };
        let Some(request) = ArmRequest::decode(arm) else {
            return;
        };
        // `arm_served` is the device's to write: its own copy is the one that counts.
        if request.is_outstanding(progress.arm_served) {
            record.store(
                RECORD,
                request.sequence,
                CqDoorbell::ARM_SERVED,
                Ordering::Release,
            );
            progress.arm_served = request.sequence;
            self.post_event(event_kind::CQ_COMPLETION, cq.handle);
        }
    }

    fn post_event(&self, kind: u16, handle: u32) {
        self.shared.post_event(kind, handle);
    }

    fn deliver_pending_events(&self) -> bool {
        if !self.shared.events_pending.load(Ordering::Acquire) {
            return false;
        }
        let mut pending = self.shared.take_pending_events();
        if pending.is_empty() {
            return false;
        }
        let Some(sink) = self
            .shared
            .sink
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        else {
            return false;
        };
        let before = pending.len();
        while let Some(event) = pending.front() {
            if !sink.deliver(event) {
                break;
            }
            pending.pop_front();
        }
        pending.len() < before
    }
}
