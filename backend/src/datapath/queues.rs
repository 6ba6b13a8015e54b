//! The data-path half of each queue: where its ring and doorbell record are in guest memory,
//! what its WQEs may ask for, and how far the device has got.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use vrdma_spec::codec::ring_slot;
use vrdma_spec::ring::{CqDoorbell, QpDoorbell, SrqDoorbell};

use super::guest_access::Resolved;
use super::wqe::QpRules;
use crate::hostverbs::{CompletionQueue, QueuePair, SharedReceiveQueue};

/// A ring in guest memory: `depth` slots of `1 << stride_shift` bytes over guest pages.
#[derive(Clone, Debug)]
pub struct GuestRing {
    pub(super) pages: Vec<u64>,
    pub(super) page_shift: u8,
    pub(super) stride_shift: u8,
    pub(super) depth: u32,
    /// How many of its pages, back to back in this process, make the ring one run of memory:
    /// all of them if they cover it, and never (`usize::MAX`) if they do not.
    pub(super) run_pages: usize,
}

impl GuestRing {
    /// `pages` must cover `depth << stride_shift` bytes; slots never straddle pages because
    /// strides are powers of two no larger than a page.
    pub fn new(pages: Vec<u64>, page_shift: u8, stride_shift: u8, depth: u32) -> Self {
        debug_assert!(stride_shift <= page_shift && depth.is_power_of_two());
        let mut ring = GuestRing {
            run_pages: usize::MAX,
            pages,
            page_shift,
            stride_shift,
            depth,
        };
        if (ring.pages.len() as u64) << page_shift >= ring.bytes() {
            ring.run_pages = ring.pages.len();
        }
        ring
    }

    /// The page (index into `pages`) and the offset in it of slot `index`.
    pub(super) fn slot_position(&self, index: u32) -> (usize, usize) {
        let offset = (ring_slot(index, self.depth) as usize) << self.stride_shift;
        (
            offset >> self.page_shift,
            offset & ((1 << self.page_shift) - 1),
        )
    }

    /// Bytes of guest memory the ring spans.
    pub fn bytes(&self) -> u64 {
        u64::from(self.depth) << self.stride_shift
    }

    pub(super) fn stride(&self) -> usize {
        1 << self.stride_shift
    }

    fn page_spans(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.pages.iter().map(|&gpa| (gpa, 1 << self.page_shift))
    }
}

/// Among a queue's spans of guest memory (see [`Resolved`]), its doorbell record's; its
/// ring's pages follow (for a QP, the SQ's, then the RQ's).
pub(super) const RECORD: usize = 0;
/// A queue's first ring page among its spans.
pub(super) const FIRST_PAGE: usize = RECORD + 1;

/// A queue's doorbell record of `R` at `gpa`, then its rings' pages, as spans.
fn spans_of<'a, R>(
    gpa: u64,
    rings: impl Iterator<Item = &'a GuestRing> + 'a,
) -> impl Iterator<Item = (u64, usize)> + 'a {
    std::iter::once((gpa, size_of::<R>())).chain(rings.flat_map(GuestRing::page_spans))
}

/// What the pool thread serving a queue keeps of it between visits, under one lock: how far
/// it has got, and where the queue's spans of guest memory are.
pub(super) struct Visited<P> {
    pub(super) progress: P,
    pub(super) resolved: Resolved,
}

impl<P> Visited<P> {
    fn new(progress: P) -> Mutex<Self> {
        Mutex::new(Visited {
            progress,
            resolved: Resolved::default(),
        })
    }
}

pub(super) struct CqProgress {
    /// The CQ's ring: RESIZE_CQ moves the CQ to another (SPEC.md §5.7.1).
    pub(super) ring: GuestRing,
    pub(super) producer: u32,
    /// Free slots as of the consumer index last read, less the CQEs written since. The driver
    /// only ever frees more, so up to this many can be written without reading it again.
    pub(super) room: u32,
    /// The last arm request served, as stored in the doorbell record's `arm_served` (which
    /// the driver zeroes before CREATE_CQ and never writes).
    pub(super) arm_served: u32,
    /// The device writes no more CQEs: the ring or the consumer index became unusable, or
    /// the CQ was destroyed.
    pub(super) failed: bool,
}

/// The data-path half of a CQ.
pub struct CqData {
    pub handle: u32,
    pub host: Arc<CompletionQueue>,
    pub(super) doorbell: u64,
    pub(super) progress: Mutex<Visited<CqProgress>>,
    /// The host CQ is armed and has not completed anything since: arming it again before
    /// sleeping would only cost a system call.
    pub(super) armed: AtomicBool,
    /// WQEs posted to the host whose completions come here, less the completions taken: a
    /// completion comes only for a WQE counted before it was posted, so while this is zero
    /// the host CQ is empty and a visit need not poll it. A WQE that completes without a
    /// completion (an unsignaled send) keeps it above zero, and the CQ is polled as before.
    pending: AtomicU64,
    /// Completions come here that no count foresees (receives from an SRQ): always polled.
    uncounted: AtomicBool,
}

impl CqData {
    /// Counts `wqes` about to be posted whose completions come to this CQ.
    pub(super) fn expect(&self, wqes: usize) {
        // Before the post, and ordered with it: a visit that finds a completion of it on
        // the host CQ has counted it.
        self.pending.fetch_add(wqes as u64, Ordering::SeqCst);
    }

    /// Takes back the count of `wqes` that were counted, then not posted, or that completed.
    pub(super) fn settle(&self, wqes: usize) {
        self.pending.fetch_sub(wqes as u64, Ordering::SeqCst);
    }

    /// Whether the host CQ can hold a completion.
    pub(super) fn may_have_completions(&self) -> bool {
        self.pending.load(Ordering::SeqCst) != 0 || self.uncounted.load(Ordering::Relaxed)
    }

    /// After this, no pass writes to the CQ's ring or doorbell record again, which the guest
    /// may then reuse; waits only for a pass writing to it right now.
    pub(super) fn retire(&self) {
        self.progress.lock().progress.failed = true;
    }

    /// Bytes the ring quota counts for the CQ ([`crate::limits::cq_quota_bytes`]).
    pub fn ring_bytes(&self) -> u64 {
        crate::limits::cq_quota_bytes(self.depth())
    }

    /// The depth of the CQ's ring.
    pub fn depth(&self) -> u32 {
        self.progress.lock().progress.ring.depth
    }

    /// The CQ's doorbell record, then the pages of `ring` (its ring, under the progress
    /// lock), as spans.
    pub(super) fn spans<'a>(
        &'a self,
        ring: &'a GuestRing,
    ) -> impl Iterator<Item = (u64, usize)> + 'a {
        spans_of::<CqDoorbell>(self.doorbell, std::iter::once(ring))
    }

    pub fn new(handle: u32, host: Arc<CompletionQueue>, ring: GuestRing, doorbell: u64) -> Self {
        CqData {
            handle,
            host,
            doorbell,
            progress: Visited::new(CqProgress {
                ring,
                producer: 0,
                room: 0,
                arm_served: 0,
                failed: false,
            }),
            armed: AtomicBool::new(false),
            pending: AtomicU64::new(0),
            uncounted: AtomicBool::new(false),
        }
    }
}

pub(super) struct QpProgress {
    pub(super) sq_consumer: u32,
    pub(super) rq_consumer: u32,
    /// The device leaves the QP alone: its doorbell record or a ring became unreadable, or
    /// it was destroyed.
    pub(super) failed: bool,
    /// The device moved the QP to the error state (and said so).
    pub(super) in_error: bool,
}

/// The data-path half of a QP.
pub struct QpData {
    pub handle: u32,
    pub qp: Arc<QueuePair>,
    pub(super) rules: QpRules,
    /// `rules.takes_common_sends()`, decided once.
    pub(super) takes_common_sends: bool,
    pub(super) sq: GuestRing,
    /// None for a QP that receives from an SRQ.
    pub(super) rq: Option<GuestRing>,
    pub(super) doorbell: u64,
    pub(super) send_cq: Arc<CqData>,
    pub(super) recv_cq: Arc<CqData>,
    pub(super) progress: Mutex<Visited<QpProgress>>,
}

impl QpData {
    /// As [`CqData::retire`], for the QP's rings and doorbell record.
    pub(super) fn retire(&self) {
        self.progress.lock().progress.failed = true;
    }

    /// Bytes of the guest's rings, which the ring quota counts.
    pub fn ring_bytes(&self) -> u64 {
        self.sq.bytes() + self.rq.as_ref().map_or(0, GuestRing::bytes)
    }

    pub(super) fn spans(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        spans_of::<QpDoorbell>(self.doorbell, std::iter::once(&self.sq).chain(&self.rq))
    }

    /// The RQ's first page among the QP's spans.
    pub(super) fn rq_first_page(&self) -> usize {
        FIRST_PAGE + self.sq.pages.len()
    }

    pub fn new(
        handle: u32,
        qp: Arc<QueuePair>,
        rules: QpRules,
        (sq, rq): (GuestRing, Option<GuestRing>),
        doorbell: u64,
        send_cq: Arc<CqData>,
        recv_cq: Arc<CqData>,
    ) -> Self {
        if rq.is_none() {
            // Its receives, if any, come from an SRQ, which any QP on it may take them from.
            recv_cq.uncounted.store(true, Ordering::Relaxed);
        }
        QpData {
            handle,
            qp,
            takes_common_sends: rules.takes_common_sends(),
            rules,
            sq,
            rq,
            doorbell,
            send_cq,
            recv_cq,
            progress: Visited::new(QpProgress {
                sq_consumer: 0,
                rq_consumer: 0,
                failed: false,
                in_error: false,
            }),
        }
    }
}

pub(super) struct SrqProgress {
    pub(super) consumer: u32,
    /// The device takes no more WQEs from the SRQ: one was refused, or it was destroyed.
    pub(super) failed: bool,
}

/// The data-path half of an SRQ.
pub struct SrqData {
    pub handle: u32,
    pub srq: Arc<SharedReceiveQueue>,
    pub(super) rules: QpRules,
    pub(super) ring: GuestRing,
    pub(super) doorbell: u64,
    pub(super) progress: Mutex<Visited<SrqProgress>>,
    /// The armed limit (SPEC.md §5.13); 0 when disarmed.
    pub(super) limit: AtomicU32,
    /// Receive completions taken from the SRQ, free-running.
    pub(super) received: AtomicU32,
}

impl SrqData {
    /// As [`CqData::retire`], for the SRQ's ring and doorbell record.
    pub(super) fn retire(&self) {
        self.progress.lock().progress.failed = true;
    }

    pub(super) fn spans(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        spans_of::<SrqDoorbell>(self.doorbell, std::iter::once(&self.ring))
    }

    /// True once the device takes no more WQEs from the SRQ (SRQ_ERROR, SPEC.md §8.4).
    pub fn failed(&self) -> bool {
        self.progress.lock().progress.failed
    }

    /// WQEs the SRQ holds.
    pub fn depth(&self) -> u32 {
        self.ring.depth
    }

    /// Bytes of the guest's ring, which the ring quota counts.
    pub fn ring_bytes(&self) -> u64 {
        self.ring.bytes()
    }

    pub fn new(
        handle: u32,
        srq: Arc<SharedReceiveQueue>,
        rules: QpRules,
        ring: GuestRing,
        doorbell: u64,
    ) -> Self {
        let progress = Visited::new(SrqProgress {
            consumer: 0,
            failed: false,
        });
        SrqData {
            limit: AtomicU32::new(0),
            received: AtomicU32::new(0),
            handle,
            srq,
            rules,
            ring,
            doorbell,
            progress,
        }
    }
}
