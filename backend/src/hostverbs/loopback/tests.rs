//! The loopback's semantics that the integration tests (which also run on rxe) cannot reach:
//! RNR and transport retries, UD delivery and Q_Keys, solicited-only arming, CQ overrun.

use std::sync::Arc;
use std::time::Duration;

use super::super::{
    qp_attr_mask as mask, AddressHandle, AhAttr, AnonymousMemory, AsyncEvent, CompletionChannel,
    CompletionQueue, Context, MemoryRegion, Payload, PinnedMemory, ProtectionDomain, QpAttr,
    QpCaps, QpInit, QpState, QpType, QueuePair, RecvWr, SendOp, SendWr, Sge, WorkCompletion,
};
use super::*;

const ALL_ACCESS: u32 = 1 | 2 | 4 | 8;

/// A context of a loopback device of the test's own.
fn open(test: &str) -> Arc<Context> {
    Context::open(&format!("{NAME}-unit-{test}")).unwrap()
}

fn qp(pd: &Arc<ProtectionDomain>, cq: &Arc<CompletionQueue>, qp_type: QpType) -> QueuePair {
    let caps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline_data: 64,
    };
    let init = QpInit {
        qp_type,
        caps,
        srq: None,
        sq_sig_all: true,
    };
    pd.create_qp(cq, cq, &init).unwrap()
}

/// Walks `qp` to RTS towards `dest` (ignored for UD), with `rnr_retry`, retransmitting
/// unanswered requests 3 times after 4.096 us * 2^4 (65 us).
fn to_rts(qp: &QueuePair, dest: u32, rnr_retry: u8) {
    to_init(qp);
    to_rtr(qp, dest);
    let ud = qp.qp_type() == QpType::Ud;
    let rts = QpAttr {
        qp_state: QpState::Rts,
        rnr_retry,
        timeout: 4,
        retry_cnt: 3,
        ..Default::default()
    };
    let rts_mask = if ud {
        mask::STATE | mask::SQ_PSN
    } else {
        mask::STATE
            | mask::SQ_PSN
            | mask::TIMEOUT
            | mask::RETRY_CNT
            | mask::RNR_RETRY
            | mask::MAX_QP_RD_ATOMIC
    };
    qp.modify(&rts, rts_mask).unwrap();
}

fn to_init(qp: &QueuePair) {
    let ud = qp.qp_type() == QpType::Ud;
    let init = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qp_access_flags: ALL_ACCESS,
        qkey: 0x1111,
        ..Default::default()
    };
    let third = if ud { mask::QKEY } else { mask::ACCESS_FLAGS };
    qp.modify(&init, mask::STATE | mask::PKEY_INDEX | mask::PORT | third)
        .unwrap();
}

fn to_rtr(qp: &QueuePair, dest: u32) {
    let ud = qp.qp_type() == QpType::Ud;
    let rtr = QpAttr {
        qp_state: QpState::Rtr,
        path_mtu: MTU_4096 as u8,
        dest_qp_num: dest,
        min_rnr_timer: 1, // 10 us
        ah_attr: AhAttr {
            dgid: gid(),
            is_global: true,
            port_num: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    let rtr_mask = if ud {
        mask::STATE
    } else {
        mask::STATE
            | mask::AV
            | mask::PATH_MTU
            | mask::DEST_QPN
            | mask::RQ_PSN
            | mask::MAX_DEST_RD_ATOMIC
            | mask::MIN_RNR_TIMER
    };
    qp.modify(&rtr, rtr_mask).unwrap();
}

fn registered(pd: &Arc<ProtectionDomain>, iova: u64) -> (Arc<AnonymousMemory>, MemoryRegion) {
    let memory = Arc::new(AnonymousMemory::new(4096).unwrap());
    let mr = pd
        .reg_mr(
            Arc::clone(&memory) as Arc<dyn PinnedMemory>,
            iova,
            ALL_ACCESS,
        )
        .unwrap();
    (memory, mr)
}

fn poll(cq: &CompletionQueue, count: usize) -> Vec<WorkCompletion> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut done = Vec::new();
    while done.len() < count {
        let mut batch = [WorkCompletion::default()];
        if cq.poll(&mut batch).unwrap() == 1 {
            done.push(std::mem::take(&mut batch[0]));
        }
        assert!(std::time::Instant::now() < deadline, "{done:?}");
    }
    done
}

fn sge(mr: &MemoryRegion, length: u32) -> Sge {
    Sge {
        addr: mr.iova(),
        length,
        lkey: mr.lkey(),
    }
}

/// Posts two sends on `a` (at RTS): the first fails with `status` once its retries run out
/// (soon: the clock thread keeps their time), the second is flushed, and `a` is in error.
fn two_sends_end_with(a: &QueuePair, cq: &CompletionQueue, mr: &MemoryRegion, status: u32) {
    let payload = [sge(mr, 8)];
    let send = |id| SendWr::new(id, SendOp::Send, Payload::Sges(&payload));
    a.post_send(&[send(1), send(2)]).unwrap();
    let done = poll(cq, 2);
    let statuses: Vec<_> = done.iter().map(|wc| (wc.wr_id(), wc.status())).collect();
    let flush = ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
    assert_eq!(statuses, [(1, status), (2, flush)]);
    assert_eq!(a.query().unwrap().qp_state, QpState::Err);
}

#[test]
fn a_send_whose_rnr_retries_run_out_fails_and_flushes_the_rest() {
    let context = open("rnr");
    let pd = context.alloc_pd().unwrap();
    let cq = context.create_cq(64, None).unwrap();
    let (a, b) = (qp(&pd, &cq, QpType::Rc), qp(&pd, &cq, QpType::Rc));
    // Three tries of b's 10 us RNR timer.
    to_rts(&a, b.qp_num(), 2);
    to_rts(&b, a.qp_num(), 2);
    let (_memory, mr) = registered(&pd, 0x1000);
    two_sends_end_with(&a, &cq, &mr, ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR);
}

#[test]
fn a_send_to_a_peer_not_yet_receiving_waits_for_it_as_a_nic_retransmits() {
    let context = open("peer-late");
    let pd = context.alloc_pd().unwrap();
    let cq = context.create_cq(64, None).unwrap();
    let (a, b) = (qp(&pd, &cq, QpType::Rc), qp(&pd, &cq, QpType::Rc));
    // The peer's program is slower: a sends while b is still in INIT.
    to_rts(&a, b.qp_num(), 7);
    to_init(&b);
    let (_memory, mr) = registered(&pd, 0x1000);
    let receives = [sge(&mr, 64)];
    b.post_recv(&[RecvWr {
        wr_id: 9,
        sges: &receives,
    }])
    .unwrap();
    let payload = [sge(&mr, 8)];
    a.post_send(&[SendWr::new(1, SendOp::Send, Payload::Sges(&payload))])
        .unwrap();
    let mut none = [WorkCompletion::default()];
    assert_eq!(cq.poll(&mut none).unwrap(), 0, "{none:?}");
    to_rtr(&b, a.qp_num());
    let done = poll(&cq, 2);
    assert!(done.iter().all(|wc| wc.status() == 0), "{done:?}");
}

#[test]
fn a_send_to_a_peer_that_never_receives_fails_when_its_retries_run_out() {
    let context = open("peer-absent");
    let pd = context.alloc_pd().unwrap();
    let cq = context.create_cq(64, None).unwrap();
    let a = qp(&pd, &cq, QpType::Rc);
    // Four tries of 65 us each, towards a QP that does not exist.
    to_rts(&a, 0xdead, 7);
    let (_memory, mr) = registered(&pd, 0x1000);
    two_sends_end_with(&a, &cq, &mr, ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
}

#[test]
fn a_ud_datagram_arrives_behind_a_grh_only_with_the_right_qkey() {
    let context = open("ud");
    let pd = context.alloc_pd().unwrap();
    let cq = context.create_cq(64, None).unwrap();
    let (a, b) = (qp(&pd, &cq, QpType::Ud), qp(&pd, &cq, QpType::Ud));
    to_rts(&a, 0, 0);
    to_rts(&b, 0, 0);
    let (memory, mr) = registered(&pd, 0x1000);
    memory.write(0, b"datagram").unwrap();
    let receive = Sge {
        addr: mr.iova() + 1024,
        length: 1024,
        lkey: mr.lkey(),
    };
    let receives = [receive];
    b.post_recv(&[RecvWr {
        wr_id: 7,
        sges: &receives,
    }])
    .unwrap();
    let ah: Arc<AddressHandle> = Arc::new(
        pd.create_ah(&AhAttr {
            dgid: gid(),
            is_global: true,
            port_num: 1,
            ..Default::default()
        })
        .unwrap(),
    );
    let payload = [sge(&mr, 8)];
    let mut wr = SendWr::new(1, SendOp::Send, Payload::Sges(&payload));
    for (id, qkey) in [(1, 0x2222), (2, 0x1111)] {
        wr.wr_id = id;
        wr.ud = Some(super::super::UdDest {
            ah: &ah,
            remote_qpn: b.qp_num(),
            remote_qkey: qkey,
        });
        a.post_send(&[wr]).unwrap();
    }
    // Both sends complete; only the second, with b's Q_Key, is received.
    let done = poll(&cq, 3);
    let received: Vec<_> = done.iter().filter(|wc| wc.is_recv()).collect();
    assert_eq!(received.len(), 1, "{done:?}");
    assert_eq!(received[0].byte_len(), 8 + GRH_LEN as u32);
    assert_eq!(received[0].src_qp(), a.qp_num());
    let mut landed = [0u8; 8];
    memory.read(1024 + GRH_LEN, &mut landed).unwrap();
    assert_eq!(&landed, b"datagram");
}

#[test]
fn a_cq_armed_for_solicited_completions_ignores_the_others() {
    let context = open("solicited");
    let pd = context.alloc_pd().unwrap();
    let channel: Arc<CompletionChannel> = context.create_comp_channel().unwrap();
    let cq = context.create_cq(64, Some(&channel)).unwrap();
    let (a, b) = (qp(&pd, &cq, QpType::Rc), qp(&pd, &cq, QpType::Rc));
    to_rts(&a, b.qp_num(), 7);
    to_rts(&b, a.qp_num(), 7);
    let (_memory, mr) = registered(&pd, 0x1000);
    let receives = [sge(&mr, 64)];
    let recv = |id| RecvWr {
        wr_id: id,
        sges: &receives,
    };
    b.post_recv(&[recv(1), recv(2)]).unwrap();
    let payload = [sge(&mr, 8)];
    cq.req_notify(true).unwrap();
    let mut wr = SendWr::new(1, SendOp::Send, Payload::Sges(&payload));
    a.post_send(&[wr]).unwrap();
    poll(&cq, 2);
    assert_eq!(channel.drain(), 0, "an unsolicited receive fires nothing");
    wr.solicited = true;
    a.post_send(&[wr]).unwrap();
    poll(&cq, 2);
    assert_eq!(channel.drain(), 1, "the solicited one fires the event");
}

#[test]
fn a_full_cq_overruns_with_one_cq_error_event() {
    let context = open("overrun");
    let pd = context.alloc_pd().unwrap();
    let cq = context.create_cq(2, None).unwrap();
    let a = qp(&pd, &cq, QpType::Rc);
    to_rts(&a, a.qp_num(), 7);
    let (_memory, mr) = registered(&pd, 0x1000);
    let payload = [sge(&mr, 8)];
    let write = SendOp::RdmaWrite {
        remote_addr: mr.iova() + 64,
        rkey: mr.rkey(),
    };
    let wrs: Vec<_> = (0..4)
        .map(|id| SendWr::new(id, write, Payload::Sges(&payload)))
        .collect();
    a.post_send(&wrs).unwrap();
    let mut events = Vec::new();
    while context.take_async_event(|event| events.push(event)) {}
    assert_eq!(events, [AsyncEvent::CqError(cq.id())]);
    assert_eq!(poll(&cq, 2).len(), 2);
}

#[test]
fn a_zero_length_rdma_write_or_read_needs_no_rkey_a_longer_one_does() {
    let context = open("zero-length");
    let pd = context.alloc_pd().unwrap();
    let cq = context.create_cq(16, None).unwrap();
    let a = qp(&pd, &cq, QpType::Rc);
    to_rts(&a, a.qp_num(), 7);
    let (_memory, mr) = registered(&pd, 0x1000);
    let nowhere = SendOp::RdmaWrite {
        remote_addr: 0,
        rkey: 0,
    };
    let read_nowhere = SendOp::RdmaRead {
        remote_addr: 0,
        rkey: 0,
    };
    let payload = [sge(&mr, 8)];
    a.post_send(&[
        SendWr::new(1, nowhere, Payload::Sges(&[])),
        SendWr::new(2, read_nowhere, Payload::Sges(&[])),
        SendWr::new(3, nowhere, Payload::Sges(&payload)),
    ])
    .unwrap();
    let statuses: Vec<_> = poll(&cq, 3)
        .iter()
        .map(|wc| (wc.wr_id(), wc.status()))
        .collect();
    let ok = ibv_wc_status::IBV_WC_SUCCESS;
    assert_eq!(
        statuses,
        [(1, ok), (2, ok), (3, ibv_wc_status::IBV_WC_REM_ACCESS_ERR)]
    );
}
