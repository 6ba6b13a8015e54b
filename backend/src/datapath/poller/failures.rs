//! What the guest got wrong: a refused WQE completed in error, and the QP or SRQ that fails
//! for it (SPEC.md §7.5, §8.4).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_spec::ring::{event_kind, Cqe};
use vrdma_spec::{Le32, Le64};

use super::super::queues::{CqData, QpData, SrqData, Visited};
use super::super::wqe::{Slot, WqeError};
use super::super::Memory;
use super::Poller;

/// The wr_id of a refused WQE (the first field of both kinds). The guest may have rewritten
/// the slot since it was parsed: what its error CQE then says is its own business.
pub(super) fn wr_id_of(slot: &impl Slot) -> u64 {
    slot.field::<Le64>(0).map_or(0, Le64::to_native)
}

pub(super) fn error_cqe(wr_id: u64, qp_num: u32, status: u8, opcode: u8) -> Cqe {
    Cqe {
        wr_id: Le64::from(wr_id),
        qp_num: Le32::from(qp_num),
        status,
        opcode,
        ..Default::default()
    }
}

impl Poller {
    /// Moves the QP to the error state after a WQE or record it cannot use: the host then
    /// flushes everything outstanding, as hardware would. Said (log line, QP_FATAL) once per
    /// QP, however often a guest repeats the mistake.
    pub(super) fn fail_qp(&self, qp: &QpData, in_error: &mut bool, reason: &dyn std::fmt::Display) {
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
    pub(super) fn fail_srq(&self, srq: &SrqData, reason: &str) {
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
    pub(super) fn refuse_wqe(
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
}
