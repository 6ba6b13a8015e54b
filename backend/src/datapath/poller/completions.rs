//! Completions: host CQs polled and their completions written as CQEs into the guest's CQ
//! rings, each with its lap's owner bit, and the guest's arm requests served (SPEC.md §8.2).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_spec::codec::{ring_pending, ArmRequest};
use vrdma_spec::ring::{cqe_owner_for, event_kind, CqDoorbell, Cqe, CQE_SIZE};
use vrdma_spec::{ByteValued, Le16, Le32, Le64};

use super::super::guest_access::{Mapped, Slots};
use super::super::queues::{CqData, CqProgress, Visited, FIRST_PAGE, RECORD};
use super::super::{Memory, BATCH};
use super::Poller;
use crate::hostverbs::WorkCompletion;

/// A CQE as the words it is written with; its owner byte is in the last (see
/// [`Slots::publish`]).
pub(in crate::datapath) fn cqe_words(cqe: &Cqe) -> [u64; CQE_SIZE / 8] {
    const _: () = assert!(std::mem::offset_of!(Cqe, owner) >= CQE_SIZE - 8);
    let mut words = [0u64; CQE_SIZE / 8];
    for (word, bytes) in words.iter_mut().zip(cqe.as_slice().chunks_exact(8)) {
        *word = u64::from_ne_bytes(bytes.try_into().expect("8 bytes"));
    }
    words
}

impl Poller {
    /// Free CQE slots, at least `wanted` if there are as many; `None` if the CQ is broken. The
    /// guest's consumer index is read only when fewer than `wanted` are known to be free.
    // Always inlined: called from failures.rs too, it stopped being inlined into `poll_cq`
    // when the poller was split into files (24 instructions more per CQ poll under callgrind).
    #[inline(always)]
    pub(super) fn cq_room(
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
    pub(super) fn write_cqes(
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

    // Out of line: a visit that need not poll costs a check, not this function's frame.
    #[inline(never)]
    pub(super) fn poll_cq(&mut self, mem: &Arc<Memory>, cq: &CqData) -> bool {
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
        #[expect(
            clippy::cast_possible_truncation,
            reason = "n is at most want, at most BATCH (16)"
        )]
        let moved = self.write_cqes(mapped, cq, progress, n as u32, |index| {
            let wc = &wcs[index];
            Cqe {
                wr_id: Le64::from(wc.wr_id()),
                qp_num: Le32::from(wc.qp_num()),
                byte_len: Le32::from(wc.byte_len()),
                imm_data: Le32::from(wc.imm_data().unwrap_or(0)),
                src_qp: Le32::from(wc.src_qp()),
                status: wc_byte(wc.status()),
                opcode: wc_byte(wc.opcode()),
                wc_flags: wc_byte(wc.wc_flags()),
                sl: wc.sl(),
                pkey_index: Le16::from(wc.pkey_index()),
                reserved: 0,
                owner: 0,
            }
        });
        for wc in &self.wcs[..moved as usize] {
            if wc.status() != 0 {
                self.count_completion_error(wc_byte(wc.status()));
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

    pub(super) fn count_completion_error(&self, status: u8) {
        let counts = &self.shared.completion_errors;
        counts[usize::from(status).min(counts.len() - 1)].fetch_add(1, Ordering::Relaxed);
    }
}

/// A work completion's status, opcode or flags as the CQE's byte holds them.
#[expect(
    clippy::cast_possible_truncation,
    reason = "verbs' values fit a byte: ibv_wc_status is below 32, ibv_wc_opcode at most 138, \
              ibv_wc_flags' bits below 128"
)]
#[inline]
fn wc_byte(value: u32) -> u8 {
    value as u8
}
