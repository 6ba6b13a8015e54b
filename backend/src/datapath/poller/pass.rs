//! A pass's steps over one connection (the two looks at the doorbell bitmap, the receives
//! before the sends, the CQs and the events owed), and what a pool thread asks of the
//! connection before it sleeps: NEED_WAKEUP set, CQs armed, memory let go of (SPEC.md §8.5).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use vm_memory::GuestAddressSpace;
use vrdma_spec::codec::notify_state_offset;
use vrdma_spec::ring::{NotifyState, QpDoorbell, NOTIFY_NEED_WAKEUP};

use super::super::doorbells::DoorbellBit;
use super::super::guest_access::store;
use super::super::queue_table::Rung;
use super::super::queues::{QpData, RECORD};
use super::super::Memory;
use super::{with_live_qp, Poller};

/// A queue a pass visits: its doorbell bit, which of its send WQEs the pass may take, and
/// whether its receive WQEs need a visit.
pub(super) struct Planned {
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

/// Queues one pass visits at most for one connection (see `take_rung_queues`).
const MAX_VISITS_PER_PASS: usize = 64;

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

impl Poller {
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
    pub(in crate::datapath) fn let_go_of_memory(&mut self) {
        self.memory = None;
    }

    /// Before sleeping: asks the host for a completion event on every CQ of the connection
    /// that is not armed already (a CQ stays armed until a completion arrives on it).
    pub(in crate::datapath) fn arm_cqs(&self) {
        for cq in &self.cqs {
            if !cq.armed.swap(true, Ordering::Relaxed) && cq.host.req_notify(false).is_err() {
                cq.armed.store(false, Ordering::Relaxed);
            }
        }
    }

    /// Some queue has work left that it could not do (its CQ full, say), or events wait for
    /// buffers on the event queue: the driver makes room without a kick (and a stopped event
    /// queue starts again with none), so a sleeping poller must look again on its own.
    pub(in crate::datapath) fn waits_on_driver(&self) -> bool {
        !self.carried.is_empty()
            || self.cq_full
            || self.shared.events_pending.load(Ordering::Acquire)
    }

    /// How long the guest's rate limits hold its sends back, if a visit found them holding.
    pub(in crate::datapath) fn throttled_for(&self) -> Option<std::time::Duration> {
        let limits = self.shared.rate_limits.get();
        self.throttled
            .then(|| self.shared.rate_gate.lock().wait(limits))
    }

    /// Sets or clears NEED_WAKEUP in every doorbell area's notify states: whichever area a
    /// driver rings through, it learns there whether to kick (SPEC.md §8.5, §8.6).
    pub(in crate::datapath) fn set_need_wakeup(&self, sleeping: bool) {
        self.shared.asleep.store(sleeping, Ordering::SeqCst);
        let Some(mem) = self.current_memory() else {
            return;
        };
        let flags = if sleeping { NOTIFY_NEED_WAKEUP } else { 0 };
        for area in self.shared.areas().places() {
            for queue in 0..self.shared.num_notify_queues {
                let state = area.states + notify_state_offset(queue);
                #[expect(
                    clippy::cast_possible_truncation,
                    reason = "the notify state's kicks is a 32-bit wire counter that wraps: \
                              its low 32 bits are the count"
                )]
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
    pub(in crate::datapath) fn pass(&mut self) -> bool {
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
    pub(in crate::datapath) fn take_doorbells(&mut self) -> bool {
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
    pub(in crate::datapath) fn bound_sends(&mut self) {
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
    pub(in crate::datapath) fn take_receive_work(&mut self) -> bool {
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
    pub(in crate::datapath) fn take_send_work(&mut self) -> bool {
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
        let table_version = self.shared.queues.table_version.load(Ordering::Acquire);
        if self.rung.is_empty() && table_version == self.table_version {
            return;
        }
        let shared = Arc::clone(&self.shared);
        let objects = shared.queues.table.lock();
        // Read under the lock: the list copied is this version's or a later one's.
        let table_version = shared.queues.table_version.load(Ordering::Acquire);
        if table_version != self.table_version {
            self.cqs.clone_from(&objects.cqs);
            self.table_version = table_version;
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
