//! RC ping-pong between two QPs on one RDMA device through the backend's `hostverbs`, with
//! both buffers registered at IOVAs unrelated to their host addresses (as a guest's VAs will
//! be). Prints round-trip latency; the demo runs it beside native `ibv_rc_pingpong`.
//!
//! usage: `rc-pingpong [ITERATIONS] [SIZE]`

use std::sync::Arc;
use std::time::Instant;

use vrdma_backend::hostverbs::{
    AnonymousMemory, Payload, PinnedMemory, RecvWr, SendOp, SendWr, Sge,
};
use vrdma_tests::{connected_rc_pair, open_test_device, wait_for_completions, FULL_ACCESS};

fn main() {
    let mut args = std::env::args().skip(1);
    let iterations: usize = args
        .next()
        .map_or(1000, |a| a.parse().expect("ITERATIONS is a number"));
    let size: u32 = args
        .next()
        .map_or(64, |a| a.parse().expect("SIZE is a number"));
    assert!(
        iterations > 0 && size > 0 && size <= 1 << 20,
        "need ITERATIONS > 0 and 0 < SIZE <= 1 MiB"
    );

    let context = open_test_device();
    let (a, b) = connected_rc_pair(&context);
    let register = |pd, iova| {
        let memory = Arc::new(AnonymousMemory::new(size as usize).expect("map buffer"));
        let mr = vrdma_backend::hostverbs::ProtectionDomain::reg_mr(
            pd,
            memory.clone() as Arc<dyn PinnedMemory>,
            iova,
            FULL_ACCESS,
        )
        .expect("register MR");
        (memory, mr)
    };
    let (a_buf, a_mr) = register(&a.pd, 0x7f00_0000_0000);
    let (b_buf, b_mr) = register(&b.pd, 0x7e00_0000_0000);
    let a_sge = [Sge {
        addr: a_mr.iova(),
        length: size,
        lkey: a_mr.lkey(),
    }];
    let b_sge = [Sge {
        addr: b_mr.iova(),
        length: size,
        lkey: b_mr.lkey(),
    }];
    let send = |sges| SendWr::new(0, SendOp::Send, Payload::Sges(sges));

    let mut round_trips = Vec::with_capacity(iterations);
    for i in 0..iterations {
        let stamp = (i as u32).to_le_bytes();
        a_buf.write(0, &stamp).unwrap();
        b.qp.post_recv(&[RecvWr {
            wr_id: 1,
            sges: &b_sge,
        }])
        .unwrap();
        a.qp.post_recv(&[RecvWr {
            wr_id: 2,
            sges: &a_sge,
        }])
        .unwrap();
        let start = Instant::now();
        a.qp.post_send(&[send(&a_sge)]).unwrap();
        wait_for_completions(&b.cq, 1); // B's receive
        let mut got = [0u8; 4];
        b_buf.read(0, &mut got).unwrap();
        assert_eq!(got, stamp, "ping {i} carried the wrong bytes");
        b.qp.post_send(&[send(&b_sge)]).unwrap();
        wait_for_completions(&a.cq, 2); // A's send and A's receive
        round_trips.push(start.elapsed());
        wait_for_completions(&b.cq, 1); // B's send
    }
    round_trips.sort();
    let micros = |d: std::time::Duration| d.as_secs_f64() * 1e6;
    let mean = round_trips.iter().map(|d| micros(*d)).sum::<f64>() / iterations as f64;
    println!(
        "hostverbs RC ping-pong on {}: {iterations} round trips of {size} B, bytes verified",
        context.name()
    );
    println!(
        "  round trip: min {:.1} us, median {:.1} us, mean {mean:.1} us, p99 {:.1} us",
        micros(round_trips[0]),
        micros(round_trips[iterations / 2]),
        micros(round_trips[(iterations * 99 / 100).min(iterations - 1)]),
    );
}
