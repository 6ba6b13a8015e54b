//! The data path over plain guest memory and a fake host: what a poller pass does with the
//! rings, doorbell records and notify area a driver laid out (SPEC.md §7-§8).

use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic};
use vrdma_spec::codec::ArmRequest;
use vrdma_spec::ring::{
    event_kind, wc_status, CqDoorbell, NotifyState, QpDoorbell, CQE_SHIFT, NOTIFY_NEED_WAKEUP,
};

use super::doorbells::DoorbellBit;
use super::queue_table::Rung;
use super::*;

use super::fake::*;

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
    rig.qp_data.progress.lock().progress.sq_consumer = start;
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
fn rings_of_scattered_pages_are_served_as_rings_of_one_run_are() {
    // An 8 KiB SQ and an 8 KiB CQ, each with its two pages in reverse order.
    let mut rig = Rig::with_scattered_rings(256);
    // Across the SQ's wrap (slots 60-63 then 0-27), so through both its pages.
    rig.qp_data.progress.lock().progress.sq_consumer = 60;
    rig.producer = 60;
    for wr_id in 0..32 {
        rig.write_send(wr_id, LKEY);
    }
    rig.ring_sq();
    while rig.poller.pass() {}
    assert_eq!(rig.sent(), (0..32).collect::<Vec<_>>());
    assert_eq!(rig.load(QP_DOORBELL + QpDoorbell::SQ_CONSUMER), 92);
    // CQEs 120-135: the end of the CQ's first page and the start of its second.
    rig.complete(0..136);
    while rig.poller.pass() {}
    for index in [0, 127, 128, 135] {
        let cqe = rig.cqe(index);
        assert_eq!((cqe.wr_id.to_native(), cqe.owner), (u64::from(index), 1));
    }
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
fn an_mr_deregistered_between_passes_is_not_used_again() {
    let mut rig = Rig::new(64);
    rig.write_send(1, LKEY);
    rig.ring_sq();
    rig.poller.pass();
    assert_eq!(rig.sent(), vec![1]);
    rig.shared.mrs.write().remove(LKEY);
    rig.write_send(2, LKEY);
    rig.ring_sq();
    rig.poller.pass();
    assert_eq!(rig.sent(), vec![1], "refused, not posted");
    assert_eq!(rig.cqe(0).status, wc_status::LOC_PROT_ERR);
}

#[test]
fn a_cq_is_polled_only_while_a_completion_can_be_on_it() {
    let mut rig = Rig::new(64);
    let polls = |rig: &Rig| rig.cq.polls.load(Ordering::Relaxed);
    rig.poller.pass();
    assert_eq!(polls(&rig), 0, "nothing posted, nothing to poll");
    rig.write_send(1, LKEY);
    rig.ring_sq();
    rig.poller.pass();
    rig.poller.pass();
    assert_eq!(polls(&rig), 2, "posted: polled until it completes");
    rig.cq.ready.lock().unwrap().push_back(1);
    assert!(rig.poller.pass());
    assert_eq!(rig.cqe(0).wr_id.to_native(), 1);
    rig.poller.pass();
    assert_eq!(polls(&rig), 3, "completed: no more polls");
    // A QP whose receives come from an SRQ: its receive CQ is polled whatever was posted.
    let (qp, cq) = (&rig.qp_data, &rig.qp_data.send_cq);
    let rings = (qp.sq.clone(), None);
    let host = Arc::clone(&qp.qp);
    QpData::new(2, host, qp.rules, rings, 0, Arc::clone(cq), Arc::clone(cq));
    rig.poller.pass();
    assert_eq!(polls(&rig), 4);
}

#[test]
fn completions_carry_the_phase_bit_of_their_lap_and_wait_while_the_ring_is_full() {
    let mut rig = Rig::new(4);
    rig.complete(0..10);
    assert!(rig.poller.pass());
    assert!(
        !rig.poller.pass(),
        "the ring is full: the rest waits in the host CQ"
    );
    assert_eq!(rig.cq.ready.lock().unwrap().len(), 6);
    assert!(
        rig.poller.waits_on_driver(),
        "the driver makes room with no kick: a sleeping poller must look again on its own"
    );
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
    assert!(
        !rig.poller.waits_on_driver(),
        "all moved: nothing to look for"
    );
}

#[test]
fn the_consumer_index_is_read_when_the_known_room_runs_out_and_a_bogus_one_breaks_the_cq() {
    let mut rig = Rig::new(64);
    rig.complete(0..72);
    assert!(rig.poller.pass(), "room read: 64 free; 16 written");
    // A consumer index the guest never reached: while the device knows of room for a batch
    // it does not look again, and once it looks the CQ breaks.
    rig.store(CQ_DOORBELL + CqDoorbell::CONSUMER_INDEX, 1000);
    for known_free in [48, 32, 16] {
        assert!(
            rig.poller.pass(),
            "{known_free} known free: 16 more written"
        );
    }
    assert!(rig.events().is_empty());
    assert!(!rig.poller.pass(), "none known free: read, and refused");
    assert_eq!(rig.events(), vec![(event_kind::CQ_ERROR, CQ_HANDLE)]);
    assert_eq!(rig.cq.ready.lock().unwrap().len(), 8);
}

#[test]
fn an_armed_cq_raises_one_event_per_arm_request() {
    let mut rig = Rig::new(16);
    let arm = |sequence| ArmRequest {
        sequence,
        solicited_only: false,
    };
    rig.store(CQ_DOORBELL + CqDoorbell::ARM, arm(1).encode());
    rig.complete([1]);
    rig.poller.pass();
    rig.complete([2]);
    rig.poller.pass();
    assert_eq!(rig.events(), vec![(event_kind::CQ_COMPLETION, CQ_HANDLE)]);
    assert_eq!(rig.load(CQ_DOORBELL + CqDoorbell::ARM_SERVED), 1);
    rig.store(CQ_DOORBELL + CqDoorbell::ARM, arm(2).encode());
    rig.complete([3]);
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

/// SPEC.md §8.6: a queue created in an added doorbell area is rung through that area's
/// bitmap (a bit of the same number in another area's is not its), and a poller going to
/// sleep asks for kicks in every area.
#[test]
fn a_queue_in_an_added_doorbell_area_is_rung_there_and_every_area_asks_for_kicks() {
    const STATES: u64 = 0x43000;
    const BITMAP: u64 = 0x44000;
    let mut rig = Rig::new(4);
    let place = NotifyArea {
        states: STATES,
        doorbell_bitmap: BITMAP,
    };
    let area = rig
        .shared
        .change_areas(|areas| areas.add(place, 64))
        .unwrap();
    let in_area = DoorbellBit { area, bit: 0 };
    rig.shared.queues.change_table(|objects| {
        let (_, qp) = objects.remove(QP_HANDLE).unwrap();
        objects.insert(in_area, qp);
    });
    rig.write_receive(0, 100);
    rig.store(QP_DOORBELL + QpDoorbell::RQ_PRODUCER, 1);
    rig.set_doorbell_bit(QP_BIT);
    assert!(
        !rig.poller.pass(),
        "bit 0 of the first area is no longer the QP's"
    );
    rig.set_doorbell_bit(in_area);
    assert!(rig.poller.pass());
    assert_eq!(*rig.qp.receives.lock().unwrap(), vec![100]);
    rig.poller.set_need_wakeup(true);
    for states in [NOTIFY_AREA, STATES] {
        assert_eq!(rig.load(states + NotifyState::FLAGS), NOTIFY_NEED_WAKEUP);
    }
    rig.poller.set_need_wakeup(false);
    assert_eq!(rig.load(STATES + NotifyState::FLAGS), 0);
}

/// SPEC.md §8.5: SET_NOTIFY_AREA again moves the doorbell bitmap, and the next look reads the
/// new one, though no queue changed (a poller keeps where the words it reads are).
#[test]
fn a_notify_area_set_again_is_where_the_next_look_reads_the_doorbells() {
    const MOVED_BITMAP: u64 = 0x45000;
    let mut rig = Rig::new(4);
    rig.write_receive(0, 100);
    rig.store(QP_DOORBELL + QpDoorbell::RQ_PRODUCER, 1);
    rig.set_doorbell_bit(QP_BIT);
    assert!(rig.poller.pass());
    let moved = NotifyArea {
        states: NOTIFY_AREA,
        doorbell_bitmap: MOVED_BITMAP,
    };
    rig.shared
        .change_areas(|areas| areas.set_first(moved, DOORBELL_BITS));
    rig.write_receive(1, 101);
    rig.store(QP_DOORBELL + QpDoorbell::RQ_PRODUCER, 2);
    // Rung where the bitmap was: nobody reads it now.
    rig.store(DOORBELL_BITMAP, 1);
    assert!(!rig.poller.pass());
    assert_eq!(rig.load(DOORBELL_BITMAP), 1);
    rig.set_doorbell_bit(QP_BIT);
    assert!(rig.poller.pass());
    assert_eq!(*rig.qp.receives.lock().unwrap(), vec![100, 101]);
    assert_eq!(rig.load(MOVED_BITMAP), 0, "the bit was taken");
}

#[test]
fn receives_reach_the_host_queue_pair() {
    let mut rig = Rig::new(4);
    for index in 0..3 {
        rig.write_receive(index, u64::from(index) + 100);
    }
    rig.store(QP_DOORBELL + QpDoorbell::RQ_PRODUCER, 3);
    rig.set_doorbell_bit(QP_BIT);
    assert!(rig.poller.pass());
    assert_eq!(*rig.qp.receives.lock().unwrap(), vec![100, 101, 102]);
    assert_eq!(rig.load(QP_DOORBELL + QpDoorbell::RQ_CONSUMER), 3);
    assert!(!rig.poller.pass());
}

/// SPEC.md §8.5: a receive made available before a send is on the host QP before the send
/// is posted, as `ibv_post_recv` followed by `ibv_post_send` leaves a native QP. (Sends first,
/// a UD message to this QP's own receive would be dropped.)
#[test]
fn receives_reach_the_host_before_the_sends_of_the_same_pass() {
    let mut rig = Rig::new(4);
    rig.write_receive(0, 100);
    rig.store(QP_DOORBELL + QpDoorbell::RQ_PRODUCER, 1);
    rig.write_send(7, LKEY);
    rig.ring_sq();
    assert!(rig.poller.pass());
    let posted = rig.qp.posted_at.lock().unwrap().clone();
    let posts: Vec<(&str, u64)> = posted
        .iter()
        .map(|&(kind, wr_id, _)| (kind, wr_id))
        .collect();
    assert_eq!(posts, [("recv", 100), ("send", 7)]);
    assert!(posted[0].2 < posted[1].2, "posted in that order");
}

#[test]
fn a_pass_visits_only_the_queues_whose_doorbell_bits_are_set() {
    let mut rig = Rig::new(64);
    // 500 QPs whose doorbell records are outside guest memory: any visit would fail them.
    let idle = Arc::new(FakeQp::default());
    let objects = rig.qp_data.clone();
    for bit in 1..=500u16 {
        let qp = QpData::new(
            0x1000 + u32::from(bit),
            FakeQp::host(&idle),
            objects.rules,
            (objects.sq.clone(), None),
            0xf000_0000,
            Arc::clone(&objects.send_cq),
            Arc::clone(&objects.recv_cq),
        );
        rig.shared
            .queues
            .table
            .lock()
            .insert(DoorbellBit { area: 0, bit }, Rung::Qp(Arc::new(qp)));
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
    rig.set_doorbell_bit(DoorbellBit { area: 0, bit: 321 });
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
    rig.complete(0..4);
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
    rig.complete([1]);
    assert!(rig.poller.pass());
    rig.poller.arm_cqs();
    assert_eq!(rig.cq.arms.load(Ordering::Relaxed), 2);
}

#[test]
fn the_control_path_waits_for_the_visit_of_the_queue_it_removes_not_for_a_pass() {
    let mut rig = Rig::new(64);
    rig.write_send(1, LKEY);
    rig.ring_sq();
    let (shared, qp, qp_data) = (
        Arc::clone(&rig.shared),
        Arc::clone(&rig.qp),
        Arc::clone(&rig.qp_data),
    );
    let gate = qp.gate.lock().unwrap();
    let pass = std::thread::spawn(move || {
        rig.poller.pass();
        rig
    });
    while qp.posts.load(Ordering::SeqCst) == 0 {
        std::thread::yield_now();
    }
    // The pass is stopped inside the QP's visit: the queue table is free all the same.
    let removed = shared
        .queues
        .table
        .lock()
        .remove(QP_HANDLE)
        .map(|(bit, _)| bit);
    assert_eq!(removed, Some(QP_BIT));
    // Retiring the QP waits for that visit, and only for it.
    let retired = Arc::new(AtomicBool::new(false));
    let retiring = {
        let retired = Arc::clone(&retired);
        std::thread::spawn(move || {
            qp_data.retire();
            retired.store(true, Ordering::SeqCst);
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(
        !retired.load(Ordering::SeqCst),
        "the visit is still going on"
    );
    drop(gate);
    retiring.join().unwrap();
    let mut rig = pass.join().unwrap();
    assert_eq!(rig.sent(), vec![1], "the visit under way finished");
    // A retired QP is left alone, even by a pass that took it from the table before it was
    // removed (as here, where it is put back).
    let retired_qp = Rung::Qp(Arc::clone(&rig.qp_data));
    shared.queues.table.lock().insert(QP_BIT, retired_qp);
    rig.write_send(2, LKEY);
    rig.ring_sq();
    rig.set_doorbell_bit(QP_BIT);
    rig.poller.pass();
    assert_eq!(rig.sent(), vec![1]);
}

/// Waits up to 10 s for `done`.
fn eventually(what: &str, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn one_pool_thread_serves_every_connection_attached_sleeps_until_kicked_and_lets_go_on_detach() {
    let (mut one, mut two) = (Rig::new(64), Rig::new(64));
    let pool = PollerPool::start(1, std::time::Duration::ZERO, &[]).unwrap();
    let thread = pool.attach(&one.shared);
    assert_eq!(pool.attach(&two.shared), thread, "one thread to serve both");
    eventually("both connections asked for kicks", || {
        one.asks_for_kicks() && two.asks_for_kicks()
    });
    for (rig, wr_id) in [(&mut one, 1), (&mut two, 2)] {
        rig.write_send(wr_id, LKEY);
        rig.ring_sq();
        rig.shared.kick(0);
        eventually("the kicked connection is served", || {
            rig.sent() == vec![wr_id]
        });
    }
    pool.detach(thread, &one.shared);
    one.write_send(3, LKEY);
    one.ring_sq();
    one.shared.kick(0);
    two.write_send(4, LKEY);
    two.ring_sq();
    two.shared.kick(0);
    eventually("the connection still attached is served", || {
        two.sent() == vec![2, 4]
    });
    assert_eq!(one.sent(), vec![1], "a detached connection is left alone");
}

/// Finding: rdma-core's UD cases lost a datagram now and then under load (a receive that
/// never completed; rxe counted the packet dropped). A pass took the rung queues' receives,
/// then read each SQ's producer index when it came to the sends: a send posted meanwhile went
/// out, ahead of the receive posted just before it. Sends are now bounded by the producer
/// index read before the pass's second look at the bitmap (SPEC.md §8.5).
///
/// A driver posts a receive on one connection, then a send on another, over and over, under
/// a real pool thread that sleeps and is kicked; each receive reaches the host before the
/// send posted after it, however the poller's passes, sleeps and wake-ups fall between them.
#[test]
fn a_receive_posted_before_a_send_on_another_connection_reaches_the_host_first() {
    let (receiver, mut sender) = (Rig::new(64), Rig::new(64));
    let pool = PollerPool::start(1, std::time::Duration::ZERO, &[]).unwrap();
    pool.attach(&receiver.shared);
    pool.attach(&sender.shared);
    let ring = |rig: &Rig| {
        rig.set_doorbell_bit(QP_BIT);
        fence(Ordering::SeqCst);
        if rig.asks_for_kicks() {
            rig.shared.kick(0);
        }
    };
    const ROUNDS: u64 = 3000;
    for wr_id in 0..ROUNDS {
        eventually("room in the 16-deep RQ", || {
            wr_id - u64::from(receiver.load(QP_DOORBELL + QpDoorbell::RQ_CONSUMER)) < 16
        });
        eventually("room in the SQ", || {
            wr_id - u64::from(sender.load(QP_DOORBELL + QpDoorbell::SQ_CONSUMER))
                < u64::from(SQ_DEPTH)
        });
        receiver.write_receive(wr_id as u32, wr_id);
        receiver.store(QP_DOORBELL + QpDoorbell::RQ_PRODUCER, wr_id as u32 + 1);
        ring(&receiver);
        sender.write_send(wr_id, LKEY);
        sender.store(QP_DOORBELL + QpDoorbell::SQ_PRODUCER, sender.producer);
        ring(&sender);
        // Now and then the driver waits, so that the poller falls asleep between rounds.
        if wr_id % 7 == 0 {
            eventually("the send is posted", || {
                sender.sent().last() == Some(&wr_id)
            });
        }
    }
    eventually("every send is posted", || {
        sender.sent().len() == ROUNDS as usize
    });
    let posted_at = |rig: &Rig, kind: &str| -> Vec<u64> {
        let posted = rig.qp.posted_at.lock().unwrap();
        let mut at = vec![0; ROUNDS as usize];
        for &(_, wr_id, when) in posted.iter().filter(|(k, _, _)| *k == kind) {
            at[wr_id as usize] = when;
        }
        at
    };
    let (received, sent) = (posted_at(&receiver, "recv"), posted_at(&sender, "send"));
    let late: Vec<u64> = (0..ROUNDS)
        .filter(|&i| received[i as usize] >= sent[i as usize])
        .collect();
    assert!(
        late.is_empty(),
        "receives posted after their send: {late:?}"
    );
}

/// A kick the vring worker passes on late (after the poller, awake for the work it
/// announced, went back to sleep) wakes the poller for nothing. Past 20 such kicks in a
/// second an honest driver was taken for a storming one: its doorbells were looked at every
/// 50 ms, and its receives no longer went before other connections' sends. A wake-up that
/// finds nothing is only held against a driver whose previous wake-up found nothing either.
#[test]
fn late_kicks_of_a_driver_that_brings_work_never_have_it_taken_for_a_storming_one() {
    let mut rig = Rig::new(64);
    let pool = PollerPool::start(1, std::time::Duration::ZERO, &[]).unwrap();
    pool.attach(&rig.shared);
    for wr_id in 1..=60 {
        eventually("the poller asks for a kick", || rig.asks_for_kicks());
        rig.write_send(wr_id, LKEY);
        rig.ring_sq();
        // Asked for, unless the poller's last look before sleeping took the WQE first (then
        // it is awake and the kick wakes nobody).
        rig.shared.kick(0);
        eventually("the kicked WQE is served", || {
            rig.sent().last() == Some(&wr_id)
        });
        // The same kick once more, as a late one lands: after the work it announced.
        eventually("the poller asks for a kick", || rig.asks_for_kicks());
        assert!(rig.shared.kick(0), "late kick {wr_id} wakes the poller");
    }
    eventually("the poller asks for a kick", || rig.asks_for_kicks());
    assert_eq!(
        rig.shared.storms.load(Ordering::Relaxed),
        0,
        "the driver was taken for a storming one"
    );
}

/// Finding: a driver that set all its doorbell bits and kicked in a loop had the poller wake,
/// pass and sleep as fast as it could (the backend went from 1% to 134% CPU and another
/// guest's latency doubled). Now a connection whose kicks keep bringing nothing is no longer
/// asked for kicks for a while (its kicks wake nobody) and is looked at on a timer instead;
/// the other connections are asked for and served as ever.
#[test]
fn a_driver_kicking_without_work_is_no_longer_asked_for_kicks_and_is_still_served() {
    let (mut stormer, mut quiet) = (Rig::new(64), Rig::new(64));
    let pool = PollerPool::start(1, std::time::Duration::ZERO, &[]).unwrap();
    pool.attach(&stormer.shared);
    pool.attach(&quiet.shared);
    eventually("both connections asked for kicks", || {
        stormer.asks_for_kicks() && quiet.asks_for_kicks()
    });
    // Kick whenever asked, with nothing rung: every wake-up is wasted. Kicks that land before
    // the poller wakes make one wake-up; keep on until it stops asking.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut unasked = 0;
    while unasked < 100 {
        assert!(
            std::time::Instant::now() < deadline,
            "the storming driver is still asked for kicks"
        );
        stormer.set_doorbell_bit(QP_BIT);
        if stormer.shared.kick(0) {
            unasked = 0;
        } else {
            unasked += 1;
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
    eventually("the quiet driver is still asked for kicks", || {
        quiet.asks_for_kicks()
    });
    assert!(!stormer.asks_for_kicks());
    assert!(
        !stormer.shared.kick(0),
        "a kick nobody asked for wakes nobody"
    );
    // Its doorbells are still served, without a kick.
    stormer.write_send(1, LKEY);
    stormer.ring_sq();
    eventually("the storming driver's WQE is served", || {
        stormer.sent() == vec![1]
    });
    // The quiet driver is served on its kick.
    quiet.write_send(2, LKEY);
    quiet.ring_sq();
    assert!(
        quiet.shared.kick(0),
        "the quiet driver was asked for its kick"
    );
    eventually("the quiet driver is served", || quiet.sent() == vec![2]);
}

/// A poller keeps its memory snapshot from pass to pass (taking one costs locks and
/// reference counts), until the connection accepts a new memory table or the poller sleeps.
#[test]
fn passes_use_the_memory_table_accepted_last_and_a_sleeping_poller_holds_none() {
    let mut rig = Rig::new(4);
    assert!(!rig.poller.pass());
    // A new table over other pages, with everything the old one held, and a receive rung.
    let size = 1 << 20;
    let fresh = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size)]).unwrap();
    let mut contents = vec![0u8; size];
    rig.mem.read_slice(&mut contents, GuestAddress(0)).unwrap();
    fresh.write_slice(&contents, GuestAddress(0)).unwrap();
    rig.mem = fresh.clone();
    rig.write_receive(0, 100);
    rig.store(QP_DOORBELL + QpDoorbell::RQ_PRODUCER, 1);
    rig.set_doorbell_bit(QP_BIT);
    *rig.shared.mem.write().unwrap() = Some(GuestMemoryAtomic::new(fresh));
    assert!(
        !rig.poller.pass(),
        "a table not yet accepted is not the one passes use"
    );
    rig.shared.mem_version.fetch_add(1, Ordering::Release);
    assert!(
        rig.poller.pass(),
        "an accepted table is used by the next pass"
    );
    assert_eq!(*rig.qp.receives.lock().unwrap(), vec![100]);
    let current = || {
        let mem = rig.shared.mem.read().unwrap();
        mem.as_ref().unwrap().memory().into_inner()
    };
    let held = Arc::strong_count(&current());
    rig.poller.let_go_of_memory();
    assert_eq!(Arc::strong_count(&current()), held - 1);
}

/// A guest over its rate limit keeps its WQEs in its ring (none refused, none lost): a pass
/// takes what the limit allows and the poller is told how long to wait for the rest; the
/// bytes of what went are counted.
#[test]
fn sends_over_the_rate_limit_wait_in_the_ring() {
    let mut rig = Rig::new(64);
    // A bucket holds a hundredth of a second's rate: 3 WQEs at 300 a second.
    rig.shared.rate_limits.set(RateLimits {
        wqes_per_second: 300,
        bytes_per_second: 0,
    });
    for wr_id in 0..10 {
        rig.write_send(wr_id, LKEY);
    }
    rig.ring_sq();
    assert!(rig.poller.pass());
    assert_eq!(rig.sent(), [0, 1, 2]);
    assert!(!rig.poller.pass(), "the limit holds the rest back");
    assert_eq!(rig.sent().len(), 3);
    let wait = rig.poller.throttled_for().expect("held back by the limit");
    assert!(wait > std::time::Duration::ZERO && wait <= std::time::Duration::from_millis(4));
    assert!(rig.poller.waits_on_driver(), "the queue is looked at again");
    assert_eq!(rig.load(QP_DOORBELL + QpDoorbell::SQ_CONSUMER), 3);
    // Lifted, the rest go in the next pass, unrung.
    rig.shared.rate_limits.set(RateLimits::default());
    assert!(rig.poller.pass());
    assert_eq!(rig.sent(), (0..10).collect::<Vec<_>>());
    assert_eq!(rig.poller.throttled_for(), None);
    assert_eq!(rig.shared.bytes.load(Ordering::Relaxed), 10 * 8);
}

/// Finding: under a byte limit a visit took a whole batch (16 WQEs) whenever any byte was
/// left, so a guest moved up to 16 WQEs past its limit per queue and pass. Now the WQE that
/// reaches the limit is the visit's last.
#[test]
fn a_byte_limit_stops_a_visit_at_the_wqe_that_reaches_it() {
    let mut rig = Rig::new(64);
    // A bucket holds a hundredth of a second's rate: 10 bytes at 1,000 a second, and each
    // send carries 8.
    rig.shared.rate_limits.set(RateLimits {
        wqes_per_second: 0,
        bytes_per_second: 1000,
    });
    for wr_id in 0..10 {
        rig.write_send(wr_id, LKEY);
    }
    rig.ring_sq();
    assert!(rig.poller.pass());
    assert_eq!(rig.sent(), [0, 1]);
    assert!(
        !rig.poller.pass(),
        "16 bytes went where 10 were allowed: in debt"
    );
    assert!(rig.poller.throttled_for().is_some());
}

/// Finding: a guest's buckets were its connection's, so a guest that went into debt (or
/// over its limit) and connected again started afresh. Its next connection now takes what
/// the last one left.
#[test]
fn a_guest_that_reconnects_owes_what_its_last_connection_owed() {
    let limits = RateLimits {
        wqes_per_second: 0,
        bytes_per_second: 1000,
    };
    let debt = super::RateDebt::default();
    let mut first = Rig::new(64);
    first.shared.rate_limits.set(limits);
    // 16 bytes where 10 were allowed: 6 owed, for 6 ms.
    for wr_id in 0..2 {
        first.write_send(wr_id, LKEY);
    }
    first.ring_sq();
    assert!(first.poller.pass());
    assert_eq!(first.sent(), [0, 1]);
    debt.leave(first.shared.rate_gate.lock().clone());
    drop(first);

    let mut next = Rig::new(64);
    next.shared.rate_limits.set(limits);
    *next.shared.rate_gate.lock() = debt.take();
    next.write_send(2, LKEY);
    next.ring_sq();
    assert!(
        !next.poller.pass(),
        "the debt carried over holds the send back"
    );
    assert!(next.sent().is_empty());
}

/// RESIZE_CQ (SPEC.md §5.7.1): the CQEs the driver has not consumed move to their indexes in
/// the new ring with the new depth's owner bits, later ones follow them there, and a resize
/// the CQ cannot take (too shallow, or refused by the host) changes nothing.
#[test]
fn a_resized_cq_keeps_its_unconsumed_cqes_at_their_indexes_in_the_new_ring() {
    const NEW_RING: u64 = 0x60000;
    let mut rig = Rig::new(8);
    rig.complete(0..6);
    assert!(rig.poller.pass());
    rig.store(CQ_DOORBELL + CqDoorbell::CONSUMER_INDEX, 2);
    let cq = Arc::clone(&rig.qp_data.send_cq);
    let new_ring = |depth: u32| {
        let pages = (0..(u64::from(depth) << CQE_SHIFT).div_ceil(PAGE))
            .map(|page| NEW_RING + page * PAGE)
            .collect();
        GuestRing::new(pages, 12, CQE_SHIFT, depth)
    };
    let host_resized = std::cell::Cell::new(0);
    let resize_host = || {
        host_resized.set(host_resized.get() + 1);
        Ok::<(), ()>(())
    };
    let too_shallow = rig.shared.resize_cq(&cq, new_ring(2), resize_host);
    assert!(
        matches!(
            too_shallow,
            Err(ResizeCqError::HoldsMore { held: 4, depth: 2 })
        ),
        "{too_shallow:?}"
    );
    let refused = rig.shared.resize_cq(&cq, new_ring(16), || Err("no"));
    assert!(matches!(refused, Err(ResizeCqError::Host("no"))));
    assert_eq!((host_resized.get(), cq.depth()), (0, 8), "nothing changed");

    // The driver laid out the new ring (every slot reads as consumed), then asked.
    for slot in 0..16u32 {
        let owner = vrdma_spec::ring::resized_cq_owner(slot, 2, 16);
        rig.mem
            .write_obj(
                owner,
                GuestAddress(NEW_RING + (u64::from(slot) << CQE_SHIFT) + 31),
            )
            .unwrap();
    }
    rig.shared
        .resize_cq(&cq, new_ring(16), resize_host)
        .unwrap();
    assert_eq!((host_resized.get(), cq.depth()), (1, 16));
    let new_cqe = |index: u32| -> vrdma_spec::ring::Cqe {
        let at = NEW_RING + (u64::from(index % 16) << CQE_SHIFT);
        rig.mem.read_obj(GuestAddress(at)).unwrap()
    };
    let valid = |index: u32| vrdma_spec::ring::cqe_is_valid(new_cqe(index).owner, index, 16);
    for index in 2..6 {
        assert!(valid(index), "CQE {index} kept");
        assert_eq!(new_cqe(index).wr_id.to_native(), u64::from(index));
    }
    assert!(!valid(6), "nothing new past the producer");
    // Completions go on in the new ring, 12 more than the old one held.
    rig.complete(6..18);
    while rig.poller.pass() {}
    for index in 6..18 {
        assert!(valid(index), "CQE {index} in the new ring");
        assert_eq!(new_cqe(index).wr_id.to_native(), u64::from(index));
    }
    assert!(rig.events().is_empty(), "{:?}", rig.events());
}
