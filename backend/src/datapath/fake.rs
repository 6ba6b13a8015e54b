//! A fake host under one poller, over plain guest memory: the rig the data path's unit tests
//! and its fuzz target drive. One QP (SQ and RQ) and its CQ, laid out as a driver would, with
//! host queues that record what they are given.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use vm_memory::{
    Bytes, GuestAddress, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap, VolatileMemory,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_spec::codec::{
    doorbell_word, ring_slot, sge_offset, SendHeader, SendOp, UdAddress, WqePayload,
    SEND_WQE_HEADER,
};
use vrdma_spec::ring::{
    Cqe, Event, NotifyState, QpDoorbell, SendWqe, Sge as WireSge, CQE_SHIFT, NOTIFY_NEED_WAKEUP,
};
use vrdma_spec::ByteValued;

use super::doorbells::DoorbellBit;
use super::poller::Poller;
use super::queue_table::{Rung, ServedQueues};
use super::shared::Shared;
use super::wqe::{MrRange, QpRules};
use super::*;
use crate::hostverbs::seam::{HostCq, HostQp};
use crate::hostverbs::{
    self, CompletionQueue, ObjectId, QpAttr, QpState, QpType, QueuePair, RecvWr, SendBatch,
    WorkCompletion,
};

pub const PAGE: u64 = 4096;
pub const SQ_RING: u64 = 0x10000;
pub const SQ_DEPTH: u32 = 64;
pub const SQ_SHIFT: u8 = 7;
pub const RQ_RING: u64 = 0x20000;
pub const CQ_RING: u64 = 0x30000;
pub const QP_DOORBELL: u64 = 0x40000;
pub const CQ_DOORBELL: u64 = 0x40100;
pub const NOTIFY_AREA: u64 = 0x41000;
pub const DOORBELL_BITMAP: u64 = 0x42000;
pub const DOORBELL_BITS: u32 = 1024;
pub const QP_BIT: DoorbellBit = DoorbellBit { area: 0, bit: 0 };
pub const MR_START: u64 = 0x80000;
pub const LKEY: u32 = 0x100;
pub const PD: u32 = 1;
pub const QP_HANDLE: u32 = 0x21;
pub const CQ_HANDLE: u32 = 0x22;
pub const QP_NUM: u32 = 0x11;

/// A host QP that records what it is given and takes at most `room` sends per post.
pub struct FakeQp {
    pub sends: Mutex<Vec<u64>>,
    pub receives: Mutex<Vec<u64>>,
    pub room: AtomicUsize,
    pub failed: AtomicBool,
    /// A post of sends waits while a test holds this: a pass stopped in the middle.
    pub gate: Mutex<()>,
    /// Posts of sends begun.
    pub posts: AtomicUsize,
    /// Each WQE posted ("send" or "recv", its wr_id) with its post's place in
    /// [`POST_CLOCK`], which orders posts to different QPs too.
    pub posted_at: Mutex<Vec<(&'static str, u64, u64)>>,
}

/// Counts the posts to every fake QP of the process.
pub static POST_CLOCK: AtomicU64 = AtomicU64::new(0);

impl FakeQp {
    /// The QP the data path posts to, over this fake.
    pub fn host(fake: &Arc<FakeQp>) -> Arc<QueuePair> {
        Arc::new(QueuePair::over_fake(Box::new(Arc::clone(fake)), QpType::Rc))
    }

    fn record(&self, kind: &'static str, wr_ids: impl Iterator<Item = u64>) {
        let now = POST_CLOCK.fetch_add(1, Ordering::SeqCst);
        let mut posted = self.posted_at.lock().unwrap();
        posted.extend(wr_ids.map(|wr_id| (kind, wr_id, now)));
    }
}

impl Default for FakeQp {
    /// A QP with room for any number of sends.
    fn default() -> Self {
        FakeQp {
            sends: Mutex::default(),
            receives: Mutex::default(),
            room: AtomicUsize::new(usize::MAX),
            failed: AtomicBool::new(false),
            gate: Mutex::default(),
            posts: AtomicUsize::new(0),
            posted_at: Mutex::default(),
        }
    }
}

impl HostQp for Arc<FakeQp> {
    fn qp_num(&self) -> u32 {
        QP_NUM
    }

    /// Only the move to the error state, which the data path makes, is taken.
    fn modify(&self, attr: &QpAttr, _mask: u32) -> hostverbs::Result<()> {
        match attr.qp_state {
            QpState::Err => {
                self.failed.store(true, Ordering::Relaxed);
                Ok(())
            }
            _ => Err(hostverbs::Error::InvalidArgument(
                "a fake QP only fails".into(),
            )),
        }
    }

    fn query(&self) -> hostverbs::Result<QpAttr> {
        Err(hostverbs::Error::InvalidArgument(
            "a fake QP is not queried".into(),
        ))
    }

    fn post_send(&self, batch: &mut SendBatch) -> hostverbs::Result<()> {
        self.posts.fetch_add(1, Ordering::SeqCst);
        drop(self.gate.lock().unwrap());
        let room = self.room.load(Ordering::Relaxed);
        let taken = batch.len().min(room);
        self.room.fetch_sub(taken, Ordering::Relaxed);
        self.record("send", batch.wr_ids().take(taken));
        let mut sends = self.sends.lock().unwrap();
        sends.extend(batch.wr_ids().take(taken));
        if taken < batch.len() {
            return Err(hostverbs::Error::Post {
                call: "fake post_send",
                posted: taken,
                source: std::io::Error::from_raw_os_error(libc::ENOMEM),
            });
        }
        Ok(())
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> hostverbs::Result<()> {
        self.record("recv", wrs.iter().map(|wr| wr.wr_id));
        self.receives
            .lock()
            .unwrap()
            .extend(wrs.iter().map(|wr| wr.wr_id));
        Ok(())
    }
}

/// A host CQ that hands out the completions a test queued, and counts its polls and arm
/// requests.
#[derive(Default)]
pub struct FakeCq {
    pub ready: Mutex<VecDeque<u64>>,
    pub arms: AtomicUsize,
    pub polls: AtomicUsize,
}

impl FakeCq {
    /// The CQ the data path polls, over this fake.
    pub fn host(fake: &Arc<FakeCq>) -> Arc<CompletionQueue> {
        Arc::new(CompletionQueue::over_fake(Box::new(Arc::clone(fake))))
    }
}

impl HostCq for Arc<FakeCq> {
    fn id(&self) -> ObjectId {
        1
    }

    fn poll(&self, out: &mut [WorkCompletion]) -> hostverbs::Result<usize> {
        self.polls.fetch_add(1, Ordering::Relaxed);
        let mut ready = self.ready.lock().unwrap();
        let n = out.len().min(ready.len());
        for slot in &mut out[..n] {
            let wr_id = ready.pop_front().unwrap();
            *slot = WorkCompletion::for_test(wr_id, 0, 1, 8, QP_NUM);
        }
        Ok(n)
    }

    fn req_notify(&self, _solicited_only: bool) -> hostverbs::Result<()> {
        self.arms.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn resize(&self, _depth: u32) -> hostverbs::Result<()> {
        Err(hostverbs::Error::InvalidArgument(
            "a fake CQ is not resized".into(),
        ))
    }

    fn depth(&self) -> u32 {
        u32::MAX
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[derive(Default)]
pub struct FakeEventQueue {
    pub events: Mutex<Vec<(u16, u32)>>,
}

impl EventSink for FakeEventQueue {
    fn deliver(&self, event: &Event) -> bool {
        let kind = event.kind.to_native();
        self.events
            .lock()
            .unwrap()
            .push((kind, event.handle.to_native()));
        true
    }
}

/// One QP and its CQ in 1 MiB of guest memory, served by one poller driven by hand.
pub struct Rig {
    pub mem: GuestMemoryMmap,
    #[cfg_attr(not(test), allow(dead_code))] // the unit tests look inside
    pub(super) shared: Arc<Shared>,
    pub(super) poller: Poller,
    pub qp: Arc<FakeQp>,
    pub cq: Arc<FakeCq>,
    pub(super) qp_data: Arc<QpData>,
    pub events: Arc<FakeEventQueue>,
    pub cq_depth: u32,
    /// The driver's SQ producer index.
    pub producer: u32,
    /// The rings' pages, in ring order.
    sq_pages: Vec<u64>,
    cq_pages: Vec<u64>,
}

/// Where slot `index` of a ring over `pages` (4 KiB each) is in guest memory.
fn slot_address(pages: &[u64], index: u32, depth: u32, stride_shift: u8) -> u64 {
    let offset = u64::from(ring_slot(index, depth)) << stride_shift;
    pages[(offset / PAGE) as usize] + offset % PAGE
}

impl Rig {
    /// Completes the WQEs `wr_ids` on the host CQ, as the host would those it was given.
    pub fn complete(&self, wr_ids: impl IntoIterator<Item = u64>) {
        let mut ready = self.cq.ready.lock().unwrap();
        let before = ready.len();
        ready.extend(wr_ids);
        self.qp_data.send_cq.expect(ready.len() - before);
    }

    /// A rig whose CQ has `cq_depth` entries (a power of two).
    pub fn new(cq_depth: u32) -> Rig {
        Rig::with_pages(cq_depth, false)
    }

    /// A rig as [`Rig::new`] whose rings have their pages in reverse order, so that none is
    /// one run of memory.
    pub fn with_scattered_rings(cq_depth: u32) -> Rig {
        Rig::with_pages(cq_depth, true)
    }

    fn with_pages(cq_depth: u32, scattered: bool) -> Rig {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let queues = ServedQueues::new(EventFd::new(EFD_NONBLOCK).unwrap(), None);
        let shared = Arc::new(Shared::new(queues, 1, DOORBELL_BITS));
        *shared.mem.write().unwrap() = Some(GuestMemoryAtomic::new(mem.clone()));
        shared.change_areas(|areas| {
            areas.set_first(
                NotifyArea {
                    states: NOTIFY_AREA,
                    doorbell_bitmap: DOORBELL_BITMAP,
                },
                DOORBELL_BITS,
            )
        });
        let events = Arc::new(FakeEventQueue::default());
        *shared.sink.lock().unwrap() = Some(Arc::clone(&events) as _);
        shared.mrs.write().insert(
            LKEY,
            MrRange {
                pd: PD,
                start: MR_START,
                len: 0x10000,
            },
        );
        let pages = |base: u64, bytes: u64| {
            let mut pages: Vec<u64> = (0..bytes.div_ceil(PAGE)).map(|i| base + i * PAGE).collect();
            if scattered {
                pages.reverse();
            }
            pages
        };
        let cq = Arc::new(FakeCq::default());
        let cq_pages = pages(CQ_RING, u64::from(cq_depth) << CQE_SHIFT);
        let cq_ring = GuestRing::new(cq_pages.clone(), 12, CQE_SHIFT, cq_depth);
        let cq_data = Arc::new(CqData::new(
            CQ_HANDLE,
            FakeCq::host(&cq),
            cq_ring,
            CQ_DOORBELL,
        ));
        let qp = Arc::new(FakeQp::default());
        let rules = QpRules {
            pd: PD,
            ud: false,
            reliable: true,
            atomics: true,
            max_send_sge: 2,
            max_recv_sge: 2,
            max_inline: 64,
            sq_stride: 1 << SQ_SHIFT,
            rq_stride: 64,
        };
        let sq_pages = pages(SQ_RING, u64::from(SQ_DEPTH) << SQ_SHIFT);
        let sq = GuestRing::new(sq_pages.clone(), 12, SQ_SHIFT, SQ_DEPTH);
        let rq = GuestRing::new(pages(RQ_RING, 16 * 64), 12, 6, 16);
        let qp_data = Arc::new(QpData::new(
            QP_HANDLE,
            FakeQp::host(&qp),
            rules,
            (sq, Some(rq)),
            QP_DOORBELL,
            Arc::clone(&cq_data),
            Arc::clone(&cq_data),
        ));
        shared.queues.change_table(|objects| {
            objects.insert(QP_BIT, Rung::Qp(Arc::clone(&qp_data)));
            objects.cqs.push(cq_data);
        });
        Rig {
            mem,
            shared: Arc::clone(&shared),
            poller: Poller::new(shared),
            qp,
            cq,
            qp_data,
            events,
            cq_depth,
            producer: 0,
            sq_pages,
            cq_pages,
        }
    }

    /// Writes an RDMA WRITE of 8 bytes from `lkey` into the next SQ slot, as a driver would.
    pub fn write_send(&mut self, wr_id: u64, lkey: u32) {
        let header = SendHeader {
            wr_id,
            op: SendOp::RdmaWrite {
                remote_addr: 0x1000,
                rkey: 7,
            },
            signaled: true,
            solicited: false,
            fence: false,
            payload: WqePayload::Sges(1),
            ud: UdAddress::default(),
        };
        let slot = slot_address(&self.sq_pages, self.producer, SQ_DEPTH, SQ_SHIFT);
        let sge = WireSge::encode(MR_START, 8, lkey);
        self.mem
            .write_slice(
                sge.as_slice(),
                GuestAddress(slot + sge_offset(SEND_WQE_HEADER, 0) as u64),
            )
            .unwrap();
        self.mem
            .write_slice(SendWqe::encode(&header).as_slice(), GuestAddress(slot))
            .unwrap();
        self.producer = self.producer.wrapping_add(1);
    }

    /// Writes a receive WQE of one 64-byte SGE into RQ slot `index` (the RQ is 16 deep), as a
    /// driver would; [`Rig::store`] its producer index to publish it.
    pub fn write_receive(&self, index: u32, wr_id: u64) {
        let slot = RQ_RING + u64::from(index % 16) * 64;
        let sge = WireSge::encode(MR_START, 64, LKEY);
        self.mem
            .write_slice(sge.as_slice(), GuestAddress(slot + 16))
            .unwrap();
        let wqe = vrdma_spec::ring::RecvWqe::encode(wr_id, 1);
        self.mem
            .write_slice(wqe.as_slice(), GuestAddress(slot))
            .unwrap();
    }

    /// Publishes the SQ producer index and sets the QP's doorbell bit, as a driver does.
    pub fn ring_sq(&self) {
        self.store(QP_DOORBELL + QpDoorbell::SQ_PRODUCER, self.producer);
        self.set_doorbell_bit(QP_BIT);
    }

    /// Sets a doorbell bit in its area's bitmap as a driver does: an atomic OR, with release
    /// semantics.
    pub fn set_doorbell_bit(&self, bit: DoorbellBit) {
        let (offset, mask) = doorbell_word(bit.bit);
        let area = self.shared.areas().get(bit.area).unwrap().place;
        let bitmap = self
            .mem
            .get_slice(GuestAddress(area.doorbell_bitmap + offset), 8)
            .unwrap();
        let word = bitmap.get_atomic_ref::<AtomicU64>(0).unwrap();
        word.fetch_or(mask, Ordering::Release);
    }

    /// Whether the connection's poller asks for kicks (NEED_WAKEUP is set: it sleeps).
    pub fn asks_for_kicks(&self) -> bool {
        self.load(NOTIFY_AREA + NotifyState::FLAGS) == NOTIFY_NEED_WAKEUP
    }

    pub fn store(&self, gpa: u64, value: u32) {
        self.mem.write_obj(value, GuestAddress(gpa)).unwrap();
    }

    pub fn load(&self, gpa: u64) -> u32 {
        self.mem.read_obj(GuestAddress(gpa)).unwrap()
    }

    pub fn sent(&self) -> Vec<u64> {
        self.qp.sends.lock().unwrap().clone()
    }

    pub fn cqe(&self, index: u32) -> Cqe {
        let slot = slot_address(&self.cq_pages, index, self.cq_depth, CQE_SHIFT);
        self.mem.read_obj(GuestAddress(slot)).unwrap()
    }

    pub fn events(&self) -> Vec<(u16, u32)> {
        self.events.events.lock().unwrap().clone()
    }

    /// One poller pass; true if it did work.
    pub fn pass(&mut self) -> bool {
        self.poller.pass()
    }
}
