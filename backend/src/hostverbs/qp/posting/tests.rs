//! Unit tests of `qp::posting`.

use super::*;

fn sge(addr: u64) -> Sge {
    Sge {
        addr,
        length: 8,
        lkey: 3,
    }
}

#[test]
fn a_send_batch_holds_requests_in_the_hosts_layout_and_refuses_what_does_not_fit() {
    let mut batch = SendBatch::with_capacity(3, 3, 4);
    let sges = [sge(0x1000), sge(0x2000)];
    let write = SendOp::RdmaWrite {
        remote_addr: 0x9000,
        rkey: 5,
    };
    let fetch_add = SendOp::FetchAndAdd {
        remote_addr: 0x8000,
        rkey: 6,
        add: 7,
    };
    batch
        .push(&SendWr::new(1, write, Payload::Sges(&sges)))
        .unwrap();
    let mut inline = SendWr::new(2, SendOp::SendWithImm { imm: 9 }, Payload::Inline(b"abcd"));
    inline.signaled = false;
    batch.push(&inline).unwrap();
    let too_many = SendWr::new(3, fetch_add, Payload::Sges(&sges));
    assert!(batch.push(&too_many).is_err(), "one SGE left");
    let too_long = SendWr::new(3, SendOp::Send, Payload::Inline(b"e"));
    assert!(batch.push(&too_long).is_err(), "no inline byte left");
    batch
        .push(&SendWr::new(3, fetch_add, Payload::Sges(&sges[..1])))
        .unwrap();
    assert!(batch
        .push(&SendWr::new(4, SendOp::Send, Payload::Sges(&[])))
        .is_err());
    assert_eq!(batch.wr_ids().collect::<Vec<_>>(), vec![1, 2, 3]);
    let raw = &batch.wrs;
    let opcodes = raw.iter().map(|wr| wr.opcode).collect::<Vec<_>>();
    use ibv_wr_opcode::*;
    let expected = [
        IBV_WR_RDMA_WRITE,
        IBV_WR_SEND_WITH_IMM,
        IBV_WR_ATOMIC_FETCH_AND_ADD,
    ];
    assert_eq!(opcodes, expected);
    // SAFETY: the unions hold plain integers; `push` wrote these members.
    let (rdma, imm, atomic) = unsafe {
        (
            raw[0].wr.rdma,
            raw[1].imm_data_invalidated_rkey_union.imm_data,
            raw[2].wr.atomic,
        )
    };
    assert_eq!((rdma.remote_addr, rdma.rkey), (0x9000, 5));
    assert_eq!(u32::from_be(imm), 9);
    assert_eq!(
        (atomic.remote_addr, atomic.rkey, atomic.compare_add),
        (0x8000, 6, 7)
    );
    let list = |wr: &ibv_send_wr| {
        // SAFETY: the lists point into the batch's own SGEs, which `push` filled.
        unsafe { std::slice::from_raw_parts(wr.sg_list, wr.num_sge as usize).to_vec() }
    };
    let addrs = |wr| list(wr).iter().map(|s| s.addr).collect::<Vec<_>>();
    assert_eq!(addrs(&raw[0]), vec![0x1000, 0x2000]);
    assert_eq!(addrs(&raw[2]), vec![0x1000]);
    let inline_sge = list(&raw[1])[0];
    assert_eq!(inline_sge.addr, batch.inline.as_ptr() as u64);
    assert_eq!((inline_sge.length, &batch.inline[..]), (4, &b"abcd"[..]));
    let flags = |wr: &ibv_send_wr| wr.send_flags;
    assert_eq!(flags(&raw[0]), ibv_send_flags::IBV_SEND_SIGNALED.0);
    assert_eq!(flags(&raw[1]), ibv_send_flags::IBV_SEND_INLINE.0);
    batch.clear();
    assert!(batch.is_empty() && batch.wr_ids().next().is_none());
}

#[test]
fn a_one_sge_send_is_pushed_as_push_would_push_it() {
    let ops = [
        SendOp::Send,
        SendOp::SendWithImm { imm: 9 },
        SendOp::RdmaWrite {
            remote_addr: 0x9000,
            rkey: 5,
        },
        SendOp::RdmaWriteWithImm {
            remote_addr: 0x9000,
            rkey: 5,
            imm: 9,
        },
        SendOp::RdmaRead {
            remote_addr: 0x9000,
            rkey: 5,
        },
        SendOp::CompareAndSwap {
            remote_addr: 0x9000,
            rkey: 5,
            compare: 1,
            swap: 2,
        },
        SendOp::FetchAndAdd {
            remote_addr: 0x9000,
            rkey: 5,
            add: 3,
        },
    ];
    let sends = ops.iter().enumerate().map(|(index, op)| OneSgeSend {
        wr_id: index as u64,
        opcode: op.opcode(),
        flags: SendFlags::new(index % 2 == 0, index % 3 == 0, index % 4 == 0),
        operands: op.operands(),
        sge: sge(0x1000 * index as u64),
    });
    let sends: Vec<_> = sends.collect();
    let (mut pushed, mut one_sge) = (
        SendBatch::with_capacity(ops.len(), ops.len(), 0),
        SendBatch::with_capacity(ops.len(), ops.len(), 0),
    );
    for send in &sends {
        pushed.push(&send.as_send_wr()).unwrap();
        assert!(one_sge.push_one_sge(send));
    }
    assert!(!one_sge.push_one_sge(&sends[0]), "the batch is full");
    for (a, b) in pushed.wrs.iter().zip(&one_sge.wrs) {
        let fields = |wr: &ibv_send_wr| {
            // SAFETY: `sg_list` points at one SGE of its batch; the unions hold plain
            // integers, zero where the request wrote nothing.
            unsafe {
                (
                    (wr.wr_id, wr.opcode, wr.send_flags, wr.num_sge),
                    (*wr.sg_list).addr,
                    wr.imm_data_invalidated_rkey_union.imm_data,
                    wr.wr.atomic,
                )
            }
        };
        let (a, b) = (fields(a), fields(b));
        assert_eq!((a.0, a.1, a.2), (b.0, b.1, b.2));
        let atomic = |t: atomic_t| (t.remote_addr, t.compare_add, t.swap, t.rkey);
        assert_eq!(atomic(a.3), atomic(b.3));
    }
}

#[test]
fn a_payload_made_in_the_batchs_room_is_used_in_place_and_one_elsewhere_refused() {
    let mut batch = SendBatch::with_capacity(2, 2, 0);
    let sges = [sge(0x1000), sge(0x2000)];
    let send = SendOp::Send;
    let elsewhere = batch.push_with::<()>(|_, _| Ok(SendWr::new(1, send, Payload::Sges(&sges))));
    assert!(matches!(elsewhere, Err(PushError::Full)));
    let in_place = batch.push_with::<()>(|room, _| {
        room[..2].copy_from_slice(&sges);
        Ok(SendWr::new(2, send, Payload::Sges(&room[..2])))
    });
    assert!(in_place.is_ok());
    let wr = &batch.wrs[0];
    assert_eq!((wr.wr_id, wr.num_sge), (2, 2));
    assert_eq!(wr.sg_list, batch.sges.as_ptr().cast_mut().cast());
}
