//! The data path over plain guest memory and a fake host: what a poller pass does with the
//! rings, doorbell records and notify area a driver laid out (SPEC.md §7-§8).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_spec::codec::{
    doorbell_word, ring_slot, sge_offset, ArmRequest, SendHeader, SendOp, UdAddress, WqePayload,
    SEND_WQE_HEADER,
};
use vrdma_spec::ring::{
    event_kind, wc_status, CqDoorbell, Cqe, Event, NotifyState, QpDoorbell, SendWqe,
    Sge as WireSge, CQE_SIZE, NOTIFY_NEED_WAKEUP,
};
use vrdma_spec::ByteValued;

use super::host::{HostCompletionQueue, HostQueuePair};
use super::poller::Poller;
use super::wqe::{MrRange, QpRules};
use super::*;
use crate::hostverbs::{self, ObjectId, RecvWr, SendWr, WorkCompletion};

const PAGE: u64 = 4096;
const SQ_RING: u64 = 0x10000;
const SQ_DEPTH: u32 = 64;
const SQ_SHIFT: u8 = 7;
const RQ_RING: u64 = 0x20000;
const CQ_RING: u64 = 0x30000;
const QP_DOORBELL: u64 = 0x40000;
const CQ_DOORBELL: u64 = 0x40100;
const NOTIFY_AREA: u64 = 0x41000;
const DOORBELL_BITMAP: u64 = 0x42000;
const DOORBELL_BITS: u32 = 1024;
const QP_BIT: u16 = 0;
const MR_START: u64 = 0x80000;
const LKEY: u32 = 0x100;
const PD: u32 = 1;
const QP_HANDLE: u32 = 0x21;
const CQ_HANDLE: u32 = 0x22;
const QP_NUM: u32 = 0x11;

/// A host QP that records what it is given and takes at most `room` sends per post.
struct FakeQp {
    sends: Mutex<Vec<(u64, SendOp)>>,
    receives: Mutex<Vec<u64>>,
    room: AtomicUsize,
    failed: AtomicBool,
}

impl HostQueuePair for FakeQp {
    fn qp_num(&self) -> u32 {
        QP_NUM
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> hostverbs::Result<()> {
        let room = self.room.load(Ordering::Relaxed);
        let taken = wrs.len().min(room);
        self.room.fetch_sub(taken, Ordering::Relaxed);
        let mut sends = self.sends.lock().unwrap();
        sends.extend(wrs[..taken].iter().map(|wr| (wr.wr_id, wr.op)));
        if taken < wrs.len() {
            return Err(hostverbs::Error::Post {
                call: "fake post_send",
                posted: taken,
                source: std::io::Error::from_raw_os_error(libc::ENOMEM),
            });
        }
        Ok(())
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> hostverbs::Result<()> {
        self.receives
            .lock()
            .unwrap()
            .extend(wrs.iter().map(|wr| wr.wr_id));
        Ok(())
    }

    fn set_error(&self) -> hostverbs::Result<()> {
        self.failed.store(true, Ordering::Relaxed);
        Ok(())
    }
}

/// A host CQ that hands out the completions a test queued, and counts its arm requests.
#[derive(Default)]
struct FakeCq {
    ready: Mutex<VecDeque<u64>>,
    arms: AtomicUsize,
}

impl HostCompletionQueue for FakeCq {
    fn id(&self) -> ObjectId {
        1
    }

    fn poll(&self, out: &mut [WorkCompletion]) -> hostverbs::Result<usize> {
        let mut ready = self.ready.lock().unwrap();
        let n = out.len().min(ready.len());
        for slot in &mut out[..n] {
            let wr_id = ready.pop_front().unwrap();
            *slot = WorkCompletion::for_test(wr_id, 0, 1, 8, QP_NUM);
        }
        Ok(n)
    }

    fn arm(&self) -> hostverbs::Result<()> {
        self.arms.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[derive(Default)]
struct FakeEventQueue {
    events: Mutex<Vec<(u16, u32)>>,
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
struct Rig {
    mem: GuestMemoryMmap,
    shared: Arc<Shared>,
    poller: Poller,
    qp: Arc<FakeQp>,
    cq: Arc<FakeCq>,
    qp_data: Arc<QpData>,
    events: Arc<FakeEventQueue>,
    cq_depth: u32,
    /// The driver's SQ producer index.
    producer: u32,
}

impl Rig {
    fn new(cq_depth: u32) -> Rig {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let shard = Shard {
            objects: Mutex::default(),
            wake: EventFd::new(EFD_NONBLOCK).unwrap(),
            channel: None,
        };
        let shared = Arc::new(Shared::new(vec![shard], 1, DOORBELL_BITS, Duration::ZERO));
        *shared.mem.write().unwrap() = Some(GuestMemoryAtomic::new(mem.clone()));
        *shared.notify_area.lock().unwrap() = Some(NotifyArea {
            states: NOTIFY_AREA,
            doorbell_bitmap: DOORBELL_BITMAP,
        });
        let events = Arc::new(FakeEventQueue::default());
        *shared.sink.lock().unwrap() = Some(Arc::clone(&events) as _);
        shared.mrs.write().unwrap().insert(
            LKEY,
            MrRange {
                pd: PD,
                start: MR_START,
                len: 0x10000,
            },
        );
        let pages = |base: u64, bytes: u64| (0..bytes.div_ceil(PAGE)).map(move |i| base + i * PAGE);
        let cq = Arc::new(FakeCq::default());
        let cq_ring = GuestRing::new(
            pages(CQ_RING, u64::from(cq_depth) * 32).collect(),
            12,
            5,
            cq_depth,
        );
        let cq_data = Arc::new(CqData::new(
            CQ_HANDLE,
            Arc::clone(&cq) as _,
            cq_ring,
            CQ_DOORBELL,
        ));
        let qp = Arc::new(FakeQp {
            sends: Mutex::default(),
            receives: Mutex::default(),
            room: AtomicUsize::new(usize::MAX),
            failed: AtomicBool::new(false),
        });
        let rules = QpRules {
            pd: PD,
            ud: false,
            atomics: true,
            max_send_sge: 2,
            max_recv_sge: 2,
            max_inline: 64,
            sq_stride: 1 << SQ_SHIFT,
            rq_stride: 64,
        };
        let sq = GuestRing::new(
            pages(SQ_RING, u64::from(SQ_DEPTH) << SQ_SHIFT).collect(),
            12,
            SQ_SHIFT,
            SQ_DEPTH,
        );
        let rq = GuestRing::new(pages(RQ_RING, 16 * 64).collect(), 12, 6, 16);
        let qp_data = Arc::new(QpData::new(
            QP_HANDLE,
            Arc::clone(&qp) as _,
            0,
            rules,
            (sq, Some(rq)),
            QP_DOORBELL,
            Arc::clone(&cq_data),
            Arc::clone(&cq_data),
        ));
        {
            let mut objects = shared.shards[0].objects.lock().unwrap();
            objects.insert(QP_BIT, Rung::Qp(Arc::clone(&qp_data)));
            objects.cqs.push(cq_data);
        }
        Rig {
            mem,
            shared: Arc::clone(&shared),
            poller: Poller::new(shared, 0),
            qp,
            cq,
            qp_data,
            events,
            cq_depth,
            producer: 0,
        }
    }

    /// Writes an RDMA WRITE of 8 bytes from `lkey` into the next SQ slot, as a driver would.
    fn write_send(&mut self, wr_id: u64, lkey: u32) {
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
        let slot = SQ_RING + (u64::from(ring_slot(self.producer, SQ_DEPTH)) << SQ_SHIFT);
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

    /// Publishes the SQ producer index and sets the QP's doorbell bit, as a driver does.
    fn ring_sq(&self) {
        self.store(QP_DOORBELL + QpDoorbell::SQ_PRODUCER, self.producer);
        self.set_doorbell_bit(QP_BIT);
    }

    fn set_doorbell_bit(&self, bit: u16) {
        let (offset, mask) = doorbell_word(bit);
        let at = GuestAddress(DOORBELL_BITMAP + offset);
        let word: u64 = self.mem.read_obj(at).unwrap();
        self.mem.write_obj(word | mask, at).unwrap();
    }

    fn store(&self, gpa: u64, value: u32) {
        self.mem.write_obj(value, GuestAddress(gpa)).unwrap();
    }

    fn load(&self, gpa: u64) -> u32 {
        self.mem.read_obj(GuestAddress(gpa)).unwrap()
    }

    fn sent(&self) -> Vec<u64> {
        self.qp.sends.lock().unwrap().iter().map(|s| s.0).collect()
    }

    fn cqe(&self, index: u32) -> Cqe {
        let slot = CQ_RING + u64::from(ring_slot(index, self.cq_depth)) * CQE_SIZE as u64;
        self.mem.read_obj(GuestAddress(slot)).unwrap()
    }

    fn events(&self) -> Vec<(u16, u32)> {
        self.events.events.lock().unwrap().clone()
    }
}

#[test]
fn sends_reach_the_host_in_batches_of_16_and_free_their_slots() {
    let mut rig = Rig::new(64);
    for wr_id in 0..40 {
        rig.write_send(wr_id, LKEY);
    }
    rig.ring_sq();
    for posted in [16, 32, 40] {
        assert!(rig.poller.pass());
        assert_eq!(rig.sent(), (0..posted).collect::<Vec<_>>());
        assert_eq!(
            rig.load(QP_DOORBELL + QpDoorbell::SQ_CONSUMER),
            posted as u32
        );
    }
    assert!(!rig.poller.pass(), "nothing left: an idle pass");
}

#[test]
fn what_the_host_does_not_take_stays_in_the_ring_for_the_next_pass() {
    let mut rig = Rig::new(64);
    rig.qp.room.store(3, Ordering::Relaxed);
    for wr_id in 0..5 {
        rig.write_send(wr_id, LKEY);
    }
    rig.ring_sq();
    assert!(rig.poller.pass());
    assert_eq!(rig.load(QP_DOORBELL + QpDoorbell::SQ_CONSUMER), 3);
    rig.qp.room.store(usize::MAX, Ordering::Relaxed);
    assert!(rig.poller.pass());
    assert_eq!(rig.sent(), vec![0, 1, 2, 3, 4]);
    assert_eq!(rig.load(QP_DOORBELL + QpDoorbell::SQ_CONSUMER), 5);
}

#[test]
fn ring_indexes_wrap_at_two_to_the_32() {
    let mut rig = Rig::new(64);
    let start = u32::MAX - 3;
    rig.qp_data.progress.lock().unwrap().sq_consumer = start;
    rig.producer = start;
    for wr_id in 0..8 {
        rig.write_send(wr_id, LKEY);
    }
    rig.ring_sq();
    assert_eq!(rig.producer, 4, "the producer wrapped");
    assert!(rig.poller.pass());
    assert_eq!(rig.sent(), (0..8).collect::<Vec<_>>());
    assert_eq!(rig.load(QP_DOORBELL + QpDoorbell::SQ_CONSUMER), 4);
}

#[test]
fn a_refused_wqe_completes_in_error_fails_the_qp_and_raises_qp_fatal() {
    let mut rig = Rig::new(64);
    rig.write_send(1, LKEY);
    rig.write_send(2, 0xbad);
    rig.write_send(3, LKEY);
    rig.ring_sq();
    assert!(rig.poller.pass());
    assert_eq!(
        rig.sent(),
        vec![1],
        "the WQEs before the refused one are posted"
    );
    assert!(
        rig.qp.failed.load(Ordering::Relaxed),
        "the host QP is in error"
    );
    let cqe = rig.cqe(0);
    assert_eq!(
        (
            cqe.wr_id.to_native(),
            cqe.status,
            cqe.qp_num.to_native(),
            cqe.owner
        ),
        (2, wc_status::LOC_PROT_ERR, QP_NUM, 1)
    );
    assert_eq!(rig.events(), vec![(event_kind::QP_FATAL, QP_HANDLE)]);
    assert_eq!(rig.load(QP_DOORBELL + QpDoorbell::SQ_CONSUMER), 2);
}

#[test]
fn completions_carry_the_phase_bit_of_their_lap_and_wait_while_the_ring_is_full() {
    let mut rig = Rig::new(4);
    rig.cq.ready.lock().unwrap().extend(0..10);
    assert!(rig.poller.pass());
    assert!(
        !rig.poller.pass(),
        "the ring is full: the rest waits in the host CQ"
    );
    assert_eq!(rig.cq.ready.lock().unwrap().len(), 6);
    let mut consumed = 0;
    for (lap_owner, count) in [(1, 4), (0, 4), (1, 2)] {
        for index in consumed..consumed + count {
            let cqe = rig.cqe(index);
            assert_eq!(
                (cqe.wr_id.to_native(), cqe.owner),
                (u64::from(index), lap_owner)
            );
        }
        consumed += count;
        rig.store(CQ_DOORBELL + CqDoorbell::CONSUMER_INDEX, consumed);
        rig.poller.pass();
    }
    assert!(rig.cq.ready.lock().unwrap().is_empty());
}

#[test]
fn an_armed_cq_raises_one_event_per_arm_request() {
    let mut rig = Rig::new(16);
    let arm = |sequence| ArmRequest {
        sequence,
        solicited_only: false,
    };
    rig.store(CQ_DOORBELL + CqDoorbell::ARM, arm(1).encode());
    rig.cq.ready.lock().unwrap().push_back(1);
    rig.poller.pass();
    rig.cq.ready.lock().unwrap().push_back(2);
    rig.poller.pass();
    assert_eq!(rig.events(), vec![(event_kind::CQ_COMPLETION, CQ_HANDLE)]);
    assert_eq!(rig.load(CQ_DOORBELL + CqDoorbell::ARM_SERVED), 1);
    rig.store(CQ_DOORBELL + CqDoorbell::ARM, arm(2).encode());
    rig.cq.ready.lock().unwrap().push_back(3);
    rig.poller.pass();
    assert_eq!(rig.events().len(), 2, "a new request, a new event");
}

#[test]
fn need_wakeup_is_set_before_the_poller_sleeps_and_cleared_when_it_wakes() {
    let rig = Rig::new(4);
    let flags = NOTIFY_AREA + NotifyState::FLAGS;
    rig.poller.set_need_wakeup(true);
    assert_eq!(rig.load(flags), NOTIFY_NEED_WAKEUP);
    rig.poller.set_need_wakeup(false);
    assert_eq!(rig.load(flags), 0);
}

#[test]
fn receives_reach_the_host_queue_pair() {
    let mut rig = Rig::new(4);
    for wr_id in 0..3u64 {
        let slot = RQ_RING + wr_id * 64;
        let sge = WireSge::encode(MR_START, 64, LKEY);
        rig.mem
            .write_slice(sge.as_slice(), GuestAddress(slot + 16))
            .unwrap();
        let wqe = vrdma_spec::ring::RecvWqe::encode(wr_id + 100, 1);
        rig.mem
            .write_slice(wqe.as_slice(), GuestAddress(slot))
            .unwrap();
    }
    rig.store(QP_DOORBELL + QpDoorbell::RQ_PRODUCER, 3);
    rig.set_doorbell_bit(QP_BIT);
    assert!(rig.poller.pass());
    assert_eq!(*rig.qp.receives.lock().unwrap(), vec![100, 101, 102]);
    assert_eq!(rig.load(QP_DOORBELL + QpDoorbell::RQ_CONSUMER), 3);
    assert!(!rig.poller.pass());
}

#[test]
fn a_pass_visits_only_the_queues_whose_doorbell_bits_are_set() {
    let mut rig = Rig::new(64);
    // 500 QPs whose doorbell records are outside guest memory: any visit would fail them.
    let idle = Arc::new(FakeQp {
        sends: Mutex::default(),
        receives: Mutex::default(),
        room: AtomicUsize::new(usize::MAX),
        failed: AtomicBool::new(false),
    });
    let objects = rig.qp_data.clone();
    for bit in 1..=500u16 {
        let qp = QpData::new(
            0x1000 + u32::from(bit),
            Arc::clone(&idle) as _,
            0,
            objects.rules,
            (objects.sq.clone(), None),
            0xf000_0000,
            Arc::clone(&objects.send_cq),
            Arc::clone(&objects.recv_cq),
        );
        rig.shared.shards[0]
            .objects
            .lock()
            .unwrap()
            .insert(bit, Rung::Qp(Arc::new(qp)));
    }
    rig.write_send(7, LKEY);
    rig.ring_sq();
    assert!(rig.poller.pass());
    assert_eq!(rig.sent(), vec![7]);
    assert!(
        !idle.failed.load(Ordering::Relaxed),
        "no idle QP was visited"
    );
    assert!(!rig.poller.pass(), "the bit was taken: nothing to visit");
    // Ringing one of them makes the next pass visit it, and only it.
    rig.set_doorbell_bit(321);
    assert!(rig.poller.pass());
    assert!(
        idle.failed.load(Ordering::Relaxed),
        "the rung QP was visited"
    );
    assert_eq!(
        rig.events(),
        vec![(event_kind::QP_FATAL, 0x1000 + 321)],
        "and no other"
    );
}

#[test]
fn a_queue_with_wqes_left_is_visited_again_without_a_new_doorbell() {
    let mut rig = Rig::new(64);
    for wr_id in 0..20 {
        rig.write_send(wr_id, LKEY);
    }
    rig.ring_sq();
    assert!(rig.poller.pass());
    assert_eq!(rig.sent().len(), 16);
    assert!(rig.poller.pass(), "the rest of the ring, with no bit set");
    assert_eq!(rig.sent().len(), 20);
    assert!(!rig.poller.pass());
}

#[test]
fn a_refused_wqe_waits_for_room_in_its_cq_and_the_qp_fails_once() {
    let mut rig = Rig::new(4);
    rig.cq.ready.lock().unwrap().extend(0..4);
    rig.poller.pass();
    rig.write_send(10, 0xbad);
    rig.write_send(11, 0xbad);
    rig.ring_sq();
    assert!(!rig.poller.pass(), "the CQ is full: nothing can move");
    assert_eq!(rig.load(QP_DOORBELL + QpDoorbell::SQ_CONSUMER), 0);
    assert!(rig.events().is_empty());
    // The guest polls two CQEs: both refused WQEs complete, the QP fails once.
    rig.store(CQ_DOORBELL + CqDoorbell::CONSUMER_INDEX, 2);
    assert!(rig.poller.pass());
    assert!(rig.poller.pass());
    assert_eq!(rig.load(QP_DOORBELL + QpDoorbell::SQ_CONSUMER), 2);
    assert_eq!(
        (rig.cqe(4).wr_id.to_native(), rig.cqe(5).wr_id.to_native()),
        (10, 11)
    );
    assert_eq!(rig.events(), vec![(event_kind::QP_FATAL, QP_HANDLE)]);
    assert_eq!(rig.shared.refused.load(Ordering::Relaxed), 2, "counted");
}

#[test]
fn an_idle_cq_is_armed_once_not_before_every_sleep() {
    let mut rig = Rig::new(4);
    for _ in 0..3 {
        rig.poller.arm_cqs();
        assert!(!rig.poller.pass());
    }
    assert_eq!(rig.cq.arms.load(Ordering::Relaxed), 1);
    // A completion may have fired the event: the next sleep arms the CQ again.
    rig.cq.ready.lock().unwrap().push_back(1);
    assert!(rig.poller.pass());
    rig.poller.arm_cqs();
    assert_eq!(rig.cq.arms.load(Ordering::Relaxed), 2);
}
