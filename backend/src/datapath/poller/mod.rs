//! A pool thread's work on one connection: each pass visits the rung rings, moves WQEs to the
//! host in batches and completions back; before the thread sleeps it asks for kicks and arms
//! the CQs (SPEC.md §8.5).
//!
//! Split by job: `pass.rs` takes a pass's steps and gets the thread ready to sleep, `scan.rs`
//! reads the doorbell bitmap, `sends.rs` takes send WQEs to the host, `receives.rs` receive
//! WQEs (of RQs and SRQs), `completions.rs` writes CQEs, `failures.rs` refuses WQEs and fails
//! queues. The `process_*` functions, where callgrind counts a WQE's instructions
//! (tests/callgrind-wqe.sh, which finds them as `Poller::process_*`), stay here, beside the
//! type.

mod completions;
mod failures;
mod pass;
mod receives;
mod scan;
mod sends;

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_spec::codec::{ring_pending, MAX_SEND_INLINE, MAX_SEND_SGE};
use vrdma_spec::ring::SrqDoorbell;

use super::doorbells::DoorbellBit;
use super::guest_access::{Mapped, Slots};
use super::mr_table::MrTable;
use super::queue_table::ServedQueues;
use super::queues::{CqData, QpData, QpProgress, SrqData, Visited, FIRST_PAGE, RECORD};
use super::shared::Shared;
use super::wqe::MrRange;
use super::{Memory, BATCH};
use crate::hostverbs::{SendBatch, Sge, WorkCompletion};
pub(super) use completions::cqe_words;
use pass::Planned;
use scan::DoorbellScan;

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
    /// The connection's CQs as of the queue table's `table_version`.
    cqs: Vec<Arc<CqData>>,
    table_version: u64,
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

/// No lkey: [`LastMr::key`] when it names none.
const NO_LKEY: u64 = u64::MAX;

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
            table_version: u64::MAX,
            last_mr: LastMr::default(),
            scan: DoorbellScan::default(),
            throttled: false,
        }
    }

    pub(super) fn queues(&self) -> &ServedQueues {
        &self.shared.queues
    }

    /// The connection this poller serves.
    pub(super) fn shared(&self) -> &Arc<Shared> {
        &self.shared
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
            #[expect(
                clippy::cast_possible_truncation,
                reason = "posted counts the WQEs of one batch, at most BATCH (16)"
            )]
            let posted_u32 = posted as u32;
            progress.consumer = progress.consumer.wrapping_add(posted_u32);
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

    // Out of line: tests/bench-guest.sh counts the instructions spent in the process_*
    // functions per WQE.
    #[inline(never)]
    fn process_cq(&mut self, mem: &Arc<Memory>, cq: &CqData) -> bool {
        cq.may_have_completions() && self.poll_cq(mem, cq)
    }

    fn post_event(&self, kind: u16, handle: u32) {
        self.shared.post_event(kind, handle);
    }
}
