//! What guest-lib encodes into a ring slot, the backend decodes into the same request
//! (SPEC.md §7.2-§7.4): both sides take their layout from `vrdma_spec::codec`, and this checks
//! the two ends of it against each other over random work requests. Needs no RDMA.

use proptest::prelude::*;
use vrdma_backend::datapath::wqe::{parse_recv, parse_send, MrRange, QpRules};
use vrdma_backend::hostverbs::{Payload as HostPayload, Sge as HostSge};
use vrdma_guest::verbs::{encode_recv, encode_send, QpType, SendShape};
use vrdma_guest::{Payload, RecvWr, SendOp, SendWr, Sge};
use vrdma_spec::codec::{recv_wqe_shift, send_wqe_shift, strategies};

const PD: u32 = 3;
const MAX_SGE: u32 = 4;
const MAX_INLINE: u32 = 64;

fn rules() -> QpRules {
    QpRules {
        pd: PD,
        ud: false,
        reliable: true,
        atomics: true,
        max_send_sge: MAX_SGE,
        max_recv_sge: MAX_SGE,
        max_inline: MAX_INLINE,
        sq_stride: 1 << send_wqe_shift(MAX_SGE, MAX_INLINE).unwrap(),
        rq_stride: 1 << recv_wqe_shift(MAX_SGE).unwrap(),
    }
}

/// Every lkey names an MR of the QP's PD covering the whole address space.
fn lookup(_lkey: u32) -> Option<MrRange> {
    Some(MrRange {
        pd: PD,
        start: 0,
        len: u64::MAX,
    })
}

fn sge() -> impl Strategy<Value = Sge> {
    (0u64..1 << 48, any::<u32>(), any::<u32>()).prop_map(|(addr, length, lkey)| Sge {
        addr,
        length: length % (1 << 20),
        lkey,
    })
}

/// A send request the device accepts on an RC QP with atomics: atomics with one 8-byte SGE
/// and an aligned target, inline payloads only where allowed.
fn send_request() -> impl Strategy<Value = (SendOp, Vec<Sge>, Option<Vec<u8>>)> {
    let sges = proptest::collection::vec(sge(), 1..=MAX_SGE as usize);
    let inline = proptest::option::of(proptest::collection::vec(
        any::<u8>(),
        0..=MAX_INLINE as usize,
    ));
    (strategies::send_op(), sges, inline).prop_map(|(op, mut sges, inline)| match op {
        SendOp::CompareAndSwap {
            remote_addr,
            rkey,
            compare,
            swap,
        } => {
            let op = SendOp::CompareAndSwap {
                remote_addr: remote_addr & !7,
                rkey,
                compare,
                swap,
            };
            (
                op,
                vec![Sge {
                    length: 8,
                    ..sges[0]
                }],
                None,
            )
        }
        SendOp::FetchAndAdd {
            remote_addr,
            rkey,
            add,
        } => {
            let op = SendOp::FetchAndAdd {
                remote_addr: remote_addr & !7,
                rkey,
                add,
            };
            (
                op,
                vec![Sge {
                    length: 8,
                    ..sges[0]
                }],
                None,
            )
        }
        op if inline.is_some() && op.may_be_inline() => (op, Vec::new(), inline),
        op => {
            // Also requests with no SGE at all.
            if sges.len() == MAX_SGE as usize {
                sges.clear();
            }
            (op, sges, None)
        }
    })
}

fn host_sges(sges: &[Sge]) -> Vec<HostSge> {
    sges.iter()
        .map(|s| HostSge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        })
        .collect()
}

proptest! {
    #[test]
    fn a_send_request_guest_lib_encodes_is_the_request_the_backend_posts(
        wr_id in any::<u64>(),
        (op, sges, inline) in send_request(),
        [signaled, solicited, fence] in any::<[bool; 3]>(),
    ) {
        let payload = match &inline {
            Some(data) => Payload::Inline(data),
            None => Payload::Sges(&sges),
        };
        let wr = SendWr { wr_id, op, payload, signaled, solicited, fence, ud: None };
        let shape = SendShape { qp_type: QpType::Rc, max_send_sge: MAX_SGE, max_inline_data: MAX_INLINE };
        let mut slot = vec![0xa5u8; rules().sq_stride];
        encode_send(&wr, &shape, |at, bytes| {
            slot[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
            Ok(())
        }).unwrap();

        let mut parsed_sges = [HostSge::default(); MAX_SGE as usize];
        let mut parsed_inline = [0; MAX_INLINE as usize];
        let no_ahs = |_| None;
        let request = parse_send(
            &slot[..], &rules(), &lookup, &no_ahs, &mut parsed_sges, &mut parsed_inline,
        ).unwrap();
        prop_assert_eq!(request.wr_id, wr_id);
        prop_assert_eq!((request.opcode, request.operands), (op.opcode(), op.operands()));
        prop_assert_eq!((request.signaled, request.solicited, request.fence), (signaled, solicited, fence));
        prop_assert!(request.ud.is_none());
        match (inline, request.payload) {
            (Some(data), HostPayload::Inline(parsed)) => prop_assert_eq!(parsed, &data[..]),
            (None, HostPayload::Sges(parsed)) => prop_assert_eq!(parsed, &host_sges(&sges)[..]),
            (sent, parsed) => prop_assert!(false, "sent {:?}, parsed {:?}", sent, parsed),
        }
    }

    #[test]
    fn a_receive_request_guest_lib_encodes_is_the_request_the_backend_posts(
        wr_id in any::<u64>(),
        sges in proptest::collection::vec(sge(), 0..=MAX_SGE as usize),
    ) {
        let mut slot = vec![0x5au8; rules().rq_stride];
        encode_recv(&RecvWr { wr_id, sges: &sges }, MAX_SGE, |at, bytes| {
            slot[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
            Ok(())
        }).unwrap();
        let mut parsed_sges = Vec::new();
        let parsed = parse_recv(&slot[..], &rules(), &lookup, &mut parsed_sges).unwrap();
        prop_assert_eq!(parsed, (wr_id, sges.len()));
        prop_assert_eq!(parsed_sges, host_sges(&sges));
    }
}
