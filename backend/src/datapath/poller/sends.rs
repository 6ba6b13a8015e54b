//! Send WQEs: taken from a QP's SQ straight into the host's batch (within the guest's rate
//! limits), posted, and the SQ's consumer index published.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_spec::codec::ring_pending;
use vrdma_spec::ring::{wc_opcode, QpDoorbell};

use super::super::guest_access::{Mapped, Slots};
use super::super::queues::{QpData, QpProgress, FIRST_PAGE, RECORD};
use super::super::rate::Allowance;
use super::super::wqe::{self, MrRange, Slot, WqeError};
use super::super::{Memory, BATCH};
use super::failures::{error_cqe, wr_id_of};
use super::{mr_lookup, Poller, Visit};
use crate::hostverbs::{self, AddressHandle, PushError, SendBatch};

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

impl Poller {
    #[inline(always)]
    pub(super) fn take_sends(
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
        #[expect(
            clippy::cast_possible_truncation,
            reason = "posted counts the WQEs of one batch, at most BATCH (16)"
        )]
        let posted_u32 = posted as u32;
        progress.sq_consumer = progress.sq_consumer.wrapping_add(posted_u32);
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
        let posted = match self.batch.post(&qp.qp) {
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
}
