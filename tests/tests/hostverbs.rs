//! Verbs through the backend's `hostverbs` wrappers, on the test device (see `vrdma_tests`):
//! the loopback host under plain `cargo test`, rxe0 in the VM harness.

use std::sync::Arc;

use vrdma_backend::hostverbs::{
    loopback, qp_attr_mask as mask, AnonymousMemory, GidType, MemoryRegion, Payload, PinnedMemory,
    QpAttr, QpState, RecvWr, SendOp, SendWr, Sge, WorkCompletion, LINK_LAYER_ETHERNET, PORT_ACTIVE,
};
use vrdma_guest::spec::ring::wc_status;
use vrdma_tests::{
    connected_rc_pair, open_test_device, test_device_name, wait_for_completions, FULL_ACCESS, PORT,
};

/// An IOVA far from any address the buffers really have, as a guest VA would be.
const TARGET_IOVA: u64 = 0x0000_7f00_dead_0000;

fn registered(
    pd: &Arc<vrdma_backend::hostverbs::ProtectionDomain>,
    len: usize,
    iova: u64,
) -> (Arc<AnonymousMemory>, MemoryRegion) {
    let memory = Arc::new(AnonymousMemory::new(len).expect("map buffer"));
    let mr = pd
        .reg_mr(memory.clone() as Arc<dyn PinnedMemory>, iova, FULL_ACCESS)
        .expect("register MR");
    (memory, mr)
}

#[test]
fn queries_device_port_and_roce_v2_ipv4_gid() {
    let context = open_test_device();
    let device = context.query_device().expect("query device");
    assert!(device.max_qp > 0 && device.max_cqe > 0 && device.max_mr_size > 0);
    assert!(device.phys_port_cnt >= 1);

    let port = context.query_port(PORT).expect("query port");
    assert_eq!(port.state, PORT_ACTIVE);
    assert_eq!(port.link_layer, LINK_LAYER_ETHERNET);
    assert!(port.gid_tbl_len > 0);

    let (index, gid) = context
        .find_roce_v2_ipv4_gid(PORT)
        .expect("RoCEv2 IPv4 GID");
    let (again, gid_type) = context.query_gid(PORT, index).expect("query GID");
    assert_eq!((again, gid_type), (gid, GidType::RoceV2));
    let expected = std::env::var("VRDMA_TEST_IPV4").unwrap_or_else(|_| {
        let loopback = loopback::is_loopback(&test_device_name());
        if loopback {
            "127.0.0.1"
        } else {
            "192.168.77.1"
        }
        .into()
    });
    assert_eq!(gid.ipv4().unwrap().to_string(), expected, "GID {gid}");
    assert!(
        context.query_gid(PORT, port.gid_tbl_len).is_err(),
        "index past the table"
    );
}

#[test]
fn rc_pair_reaches_rts_and_reports_peer() {
    let context = open_test_device();
    let (a, b) = connected_rc_pair(&context);
    let attr = a.qp.query().expect("query QP");
    assert_eq!(attr.qp_state, QpState::Rts);
    assert_eq!(attr.dest_qp_num, b.qp.qp_num());
    assert!(attr.ah_attr.is_global);
    assert!(a.qp.caps().max_send_wr >= 32 && a.qp.caps().max_inline_data >= 64);
}

#[test]
fn rc_send_recv_moves_bytes_and_immediate_data() {
    let context = open_test_device();
    let (a, b) = connected_rc_pair(&context);
    let (src, src_mr) = registered(&a.pd, 8192, 0x10_0000);
    let (dst, dst_mr) = registered(&b.pd, 8192, 0x20_0000);
    let message: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
    src.write(100, &message).unwrap();

    let recv_sge = [Sge {
        addr: dst_mr.iova(),
        length: 8192,
        lkey: dst_mr.lkey(),
    }];
    b.qp.post_recv(&[RecvWr {
        wr_id: 7,
        sges: &recv_sge,
    }])
    .expect("post recv");
    let send_sge = [Sge {
        addr: src_mr.iova() + 100,
        length: 5000,
        lkey: src_mr.lkey(),
    }];
    a.qp.post_send(&[SendWr::new(
        9,
        SendOp::SendWithImm { imm: 0xfeed_beef },
        Payload::Sges(&send_sge),
    )])
    .expect("post send");

    let sent = wait_for_completions(&a.cq, 1);
    assert!(sent[0].is_success(), "{:?}", sent[0]);
    assert_eq!(sent[0].wr_id(), 9);
    let received = wait_for_completions(&b.cq, 1);
    assert!(received[0].is_success(), "{:?}", received[0]);
    assert_eq!((received[0].wr_id(), received[0].byte_len()), (7, 5000));
    assert_eq!(received[0].imm_data(), Some(0xfeed_beef));
    assert_eq!(received[0].qp_num(), b.qp.qp_num());

    let mut landed = vec![0u8; 5000];
    dst.read(0, &mut landed).unwrap();
    assert_eq!(landed, message);
}

#[test]
fn inline_send_copies_payload_at_post_time() {
    let context = open_test_device();
    let (a, b) = connected_rc_pair(&context);
    let (dst, dst_mr) = registered(&b.pd, 4096, 0x30_0000);
    let recv_sge = [Sge {
        addr: dst_mr.iova(),
        length: 4096,
        lkey: dst_mr.lkey(),
    }];
    b.qp.post_recv(&[RecvWr {
        wr_id: 1,
        sges: &recv_sge,
    }])
    .unwrap();
    let mut payload = *b"inline payload, 32 bytes long!!!";
    a.qp.post_send(&[SendWr::new(2, SendOp::Send, Payload::Inline(&payload))])
        .expect("post inline send");
    payload.fill(0); // the provider copied it when posting
    assert!(wait_for_completions(&a.cq, 1)[0].is_success());
    let got = wait_for_completions(&b.cq, 1);
    assert_eq!(got[0].byte_len(), 32);
    let mut landed = [0u8; 32];
    dst.read(0, &mut landed).unwrap();
    assert_eq!(&landed, b"inline payload, 32 bytes long!!!");
}

#[test]
fn rdma_write_to_an_explicit_iova_lands_at_the_matching_host_offset() {
    let context = open_test_device();
    let (a, b) = connected_rc_pair(&context);
    let (src, src_mr) = registered(&a.pd, 4096, 0x40_0000);
    let (dst, dst_mr) = registered(&b.pd, 3 * 4096, TARGET_IOVA);
    assert_eq!(dst_mr.iova(), TARGET_IOVA);
    assert_ne!(dst.as_ptr() as u64, TARGET_IOVA);
    let pattern: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
    src.write(0, &pattern).unwrap();

    let sge = [Sge {
        addr: src_mr.iova(),
        length: 1000,
        lkey: src_mr.lkey(),
    }];
    a.qp.post_send(&[SendWr::new(
        11,
        SendOp::RdmaWrite {
            remote_addr: TARGET_IOVA + 4096 + 16,
            rkey: dst_mr.rkey(),
        },
        Payload::Sges(&sge),
    )])
    .unwrap();
    let done = wait_for_completions(&a.cq, 1);
    assert!(done[0].is_success(), "{:?}", done[0]);

    let mut landed = vec![0u8; 1000];
    dst.read(4096 + 16, &mut landed).unwrap();
    assert_eq!(landed, pattern);
    let mut before = [0xffu8; 16];
    dst.read(4096, &mut before).unwrap();
    assert_eq!(
        before, [0u8; 16],
        "bytes before the target offset stay untouched"
    );

    // Reading it back with RDMA READ goes through the same translation.
    src.write(0, &[0u8; 1000]).unwrap();
    a.qp.post_send(&[SendWr::new(
        12,
        SendOp::RdmaRead {
            remote_addr: TARGET_IOVA + 4096 + 16,
            rkey: dst_mr.rkey(),
        },
        Payload::Sges(&sge),
    )])
    .unwrap();
    assert!(wait_for_completions(&a.cq, 1)[0].is_success());
    let mut read_back = vec![0u8; 1000];
    src.read(0, &mut read_back).unwrap();
    assert_eq!(read_back, pattern);
}

#[test]
fn rdma_write_past_the_end_of_an_mr_completes_with_remote_access_error() {
    let context = open_test_device();
    let (a, b) = connected_rc_pair(&context);
    let (_src, src_mr) = registered(&a.pd, 4096, 0x50_0000);
    let (_dst, dst_mr) = registered(&b.pd, 4096, TARGET_IOVA);
    let sge = [Sge {
        addr: src_mr.iova(),
        length: 64,
        lkey: src_mr.lkey(),
    }];
    a.qp.post_send(&[SendWr::new(
        13,
        SendOp::RdmaWrite {
            remote_addr: TARGET_IOVA + 4096 - 32,
            rkey: dst_mr.rkey(),
        },
        Payload::Sges(&sge),
    )])
    .unwrap();
    let done = wait_for_completions(&a.cq, 1);
    const IBV_WC_REM_ACCESS_ERR: u32 = 10;
    assert_eq!(done[0].status(), IBV_WC_REM_ACCESS_ERR, "{:?}", done[0]);
    assert_eq!(a.qp.query().unwrap().qp_state, QpState::Err);
}

// The error semantics the loopback host must share with rxe: each test below runs on both.

#[test]
fn a_send_that_finds_no_receive_waits_for_one_and_arrives() {
    let context = open_test_device();
    let (a, b) = connected_rc_pair(&context);
    let (src, src_mr) = registered(&a.pd, 4096, 0x50_0000);
    let (dst, dst_mr) = registered(&b.pd, 4096, 0x60_0000);
    src.write(0, b"sent before its receive").unwrap();
    let send_sge = [Sge {
        addr: src_mr.iova(),
        length: 23,
        lkey: src_mr.lkey(),
    }];
    a.qp.post_send(&[SendWr::new(1, SendOp::Send, Payload::Sges(&send_sge))])
        .unwrap();
    // rnr_retry 7: the sender retries for as long as it takes.
    std::thread::sleep(std::time::Duration::from_millis(100));
    let mut none = [WorkCompletion::default()];
    assert_eq!(a.cq.poll(&mut none).unwrap(), 0, "{none:?}");
    let recv_sge = [Sge {
        addr: dst_mr.iova(),
        length: 4096,
        lkey: dst_mr.lkey(),
    }];
    b.qp.post_recv(&[RecvWr {
        wr_id: 2,
        sges: &recv_sge,
    }])
    .unwrap();
    assert!(wait_for_completions(&a.cq, 1)[0].is_success());
    let received = wait_for_completions(&b.cq, 1);
    assert!(received[0].is_success(), "{:?}", received[0]);
    let mut landed = [0u8; 23];
    dst.read(0, &mut landed).unwrap();
    assert_eq!(&landed, b"sent before its receive");
}

#[test]
fn a_key_of_another_pd_fails_locally_and_flushes_what_follows() {
    let context = open_test_device();
    let (a, b) = connected_rc_pair(&context);
    let (_, own) = registered(&a.pd, 4096, 0x70_0000);
    let (_, foreign) = registered(&b.pd, 4096, 0x70_0000);
    let (_, target) = registered(&b.pd, 4096, 0x80_0000);
    let write = SendOp::RdmaWrite {
        remote_addr: target.iova(),
        rkey: target.rkey(),
    };
    let sge = |mr: &MemoryRegion| Sge {
        addr: mr.iova(),
        length: 64,
        lkey: mr.lkey(),
    };
    let (bad, good) = ([sge(&foreign)], [sge(&own)]);
    a.qp.post_send(&[
        SendWr::new(1, write, Payload::Sges(&bad)),
        SendWr::new(2, write, Payload::Sges(&good)),
    ])
    .unwrap();
    let done = wait_for_completions(&a.cq, 2);
    let statuses: Vec<_> = done.iter().map(|wc| (wc.wr_id(), wc.status())).collect();
    let (prot, flush) = (
        wc_status::LOC_PROT_ERR.into(),
        wc_status::WR_FLUSH_ERR.into(),
    );
    // The verbs specification (and the loopback) report LOC_PROT_ERR for the bad key; the
    // test guest's rxe reports the request itself flushed too.
    assert!(
        statuses == [(1, prot), (2, flush)] || statuses == [(1, flush), (2, flush)],
        "{statuses:?}"
    );
    assert_eq!(a.qp.query().unwrap().qp_state, QpState::Err);
}

#[test]
fn a_transition_without_its_required_attributes_is_refused() {
    let context = open_test_device();
    let a = vrdma_tests::RcEndpoint::new(&context);
    let to_rtr = QpAttr {
        qp_state: QpState::Rtr,
        ..Default::default()
    };
    // RESET -> RTR skips INIT; INIT -> RTR needs the path, the peer and the PSN.
    let refused = a.qp.modify(&to_rtr, mask::STATE).unwrap_err();
    assert_eq!(refused.errno(), Some(libc::EINVAL), "{refused}");
    let init = QpAttr {
        qp_state: QpState::Init,
        port_num: PORT,
        qp_access_flags: FULL_ACCESS,
        ..Default::default()
    };
    let init_mask = mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS;
    a.qp.modify(&init, init_mask).unwrap();
    let refused = a.qp.modify(&to_rtr, mask::STATE).unwrap_err();
    assert_eq!(refused.errno(), Some(libc::EINVAL), "{refused}");
    assert_eq!(a.qp.query().unwrap().qp_state, QpState::Init);
}
