//! Send and receive WQEs as the backend reads them from a guest's rings: decoding
//! (vrdma-spec's codec) and validation against a QP's rules and the guest's MRs, and the
//! common send path against the general one.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_backend::datapath::wqe::{parse_common_send, parse_recv, parse_send, MrRange, QpRules};
use vrdma_backend::hostverbs::{Payload, SendFlags, Sge};
use vrdma_spec::ring::{MAX_WQE_SHIFT, MIN_RQ_WQE_SHIFT, MIN_SQ_WQE_SHIFT};

fuzz_target!(|input: &[u8]| {
    // The first bytes choose the QP's rules; the rest is one slot of its ring.
    let [flags, sges, inline, stride_shift, slot @ ..] = input else {
        return;
    };
    // Strides as CREATE_QP allows them (SPEC.md §7.1).
    let receive = flags & 4 != 0;
    let min_shift = if receive {
        MIN_RQ_WQE_SHIFT
    } else {
        MIN_SQ_WQE_SHIFT
    };
    let stride = 1usize << (min_shift + stride_shift % (MAX_WQE_SHIFT - min_shift + 1));
    let mut wqe = vec![0u8; stride];
    let len = slot.len().min(stride);
    wqe[..len].copy_from_slice(&slot[..len]);
    let rules = QpRules {
        pd: 7,
        ud: flags & 1 != 0,
        reliable: flags & 5 == 4,
        atomics: flags & 2 != 0,
        max_send_sge: u32::from(sges % 32),
        max_recv_sge: u32::from(sges / 8),
        max_inline: u32::from(*inline) * 16,
        sq_stride: stride,
        rq_stride: stride,
    };
    let lookup = |lkey: u32| {
        (!lkey.is_multiple_of(3)).then_some(MrRange {
            pd: if lkey.is_multiple_of(5) { 8 } else { 7 },
            start: u64::from(lkey) << 12,
            len: 1 << 20,
        })
    };
    let mut list = Vec::new();
    if !receive {
        let no_ahs = |_| None;
        let (mut sges, mut inline) = ([Sge::default(); 32], [0; 4096]);
        let parsed = parse_send(&wqe[..], &rules, &lookup, &no_ahs, &mut sges, &mut inline);
        // The common path takes only what parse_send takes, into the same request.
        if let Some(common) = parse_common_send(&wqe[..], &rules, &lookup) {
            if rules.takes_common_sends() {
                let wr = parsed
                    .as_ref()
                    .expect("parse_send takes what the common path takes");
                assert!(matches!(wr.payload, Payload::Sges(&[sge]) if sge == common.sge));
                assert!(!wr.opcode.is_atomic() && wr.ud.is_none());
                let flags = SendFlags::new(wr.signaled, wr.solicited, wr.fence);
                assert_eq!(
                    (wr.wr_id, wr.opcode, flags),
                    (common.wr_id, common.opcode, common.flags)
                );
                let (o, co) = (wr.operands, common.operands);
                assert_eq!(
                    (o.imm, o.remote_addr, o.rkey),
                    (co.imm, co.remote_addr, co.rkey)
                );
            }
        }
        if let Ok(wr) = parsed {
            match wr.payload {
                Payload::Sges(sges) => {
                    assert!(sges.len() <= rules.max_send_sge as usize);
                    list.extend_from_slice(sges);
                }
                Payload::Inline(data) => {
                    assert!(data.len() <= rules.max_inline as usize && data.len() < stride)
                }
            }
        }
    } else if let Ok((_, count)) = parse_recv(&wqe[..], &rules, &lookup, &mut list) {
        assert_eq!(list.len(), count);
        assert!(count <= rules.max_recv_sge as usize);
    }
    for sge in &list {
        let mr = lookup(sge.lkey).expect("an accepted SGE names an MR");
        assert!(sge.addr >= mr.start && sge.addr + u64::from(sge.length) <= mr.start + mr.len);
    }
});
