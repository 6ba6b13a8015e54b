//! Receive WQEs: read from a QP's RQ or an SRQ's ring, checked, posted to the host, and the
//! ring's consumer index published.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_spec::codec::ring_pending;
use vrdma_spec::ring::{wc_opcode, QpDoorbell};

use super::super::guest_access::{Mapped, Slots};
use super::super::queues::{QpData, QpProgress, RECORD};
use super::super::wqe::{self, QpRules, WqeError};
use super::super::{Memory, BATCH};
use super::failures::{error_cqe, wr_id_of};
use super::{mr_lookup, Poller, Visit};
use crate::hostverbs::{self, RecvWr};

impl Poller {
    /// Reads and validates up to a batch of receive WQEs from `ring` (between `consumer` and
    /// `producer`) into `self.recv`/`self.sges`; returns the first refused one, if any.
    pub(super) fn read_receives(
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
    pub(super) fn post_receives(
        &self,
        post: impl Fn(&[RecvWr<'_>]) -> hostverbs::Result<()>,
    ) -> usize {
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
    pub(super) fn take_receives(
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
        #[expect(
            clippy::cast_possible_truncation,
            reason = "posted counts the WQEs of one batch, at most BATCH (16)"
        )]
        let posted_u32 = posted as u32;
        progress.rq_consumer = progress.rq_consumer.wrapping_add(posted_u32);
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
}
