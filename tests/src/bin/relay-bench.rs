//! What the relay itself costs on real cores: a backend on the loopback host (no NIC, no
//! emulation) in this process, its one poller thread on one core, the program on another,
//! each figure beside its floor measured in the same run on the same two cores.
//!
//! usage: relay-bench [PROGRAM_CPU POLLER_CPU]   (default: 0 1)
//!
//! Sizes: VRDMA_BENCH_ROUND_TRIPS (100000), VRDMA_BENCH_WQES (2000000); the test suite's
//! smoke run makes them small. Prints a markdown table.
//!
//! - Round trip: the program sends 8 bytes from one of its QPs to another and back (two
//!   WQEs through the poller, two receive CQEs back); the floors are a cache line passed
//!   between two threads on the same two cores and back, and the same messages' ring
//!   protocol transfers (WQEs, indexes, doorbell bits, CQEs) with no work around them.
//! - WQEs per second through the poller core: 8-byte RDMA WRITEs posted one and 16 per
//!   doorbell (a chain), the send queue kept full; the floor is a loop on the poller's core
//!   that only copies the same 8 bytes as often.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_guest::{
    access, CompletionQueue, Device, MemoryRegion, Payload, QpType, QueuePair, RecvWr, SendOp,
    SendWr, Sge, SharedBuffer, WorkCompletion,
};
use vrdma_tests::{connect_guest_qp, serve_in_background, size_from_env};

const MESSAGE: u32 = 8;
const SQ_DEPTH: u32 = 256;

/// Runs the calling thread on `cpu` only.
fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it; the call reads
    // it for its size and changes only this thread's affinity.
    let ok = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    };
    assert!(
        ok,
        "cannot run on CPU {cpu}: {}",
        std::io::Error::last_os_error()
    );
}

/// p50 and p99 of `samples`, in nanoseconds.
fn percentiles(samples: &mut [u64]) -> (u64, u64) {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    (at(0.50), at(0.99))
}

/// Round trips of a cache line between this thread (on `a`) and one on `b`, in ns each.
fn cache_line_round_trips(a: usize, b: usize, count: usize) -> Vec<u64> {
    let line = Arc::new(AtomicU64::new(0));
    let peer = Arc::clone(&line);
    let echo = std::thread::spawn(move || {
        pin_to(b);
        for i in 0..count as u64 {
            while peer.load(Ordering::Acquire) != 2 * i + 1 {
                std::hint::spin_loop();
            }
            peer.store(2 * i + 2, Ordering::Release);
        }
    });
    pin_to(a);
    let mut samples = Vec::with_capacity(count);
    for i in 0..count as u64 {
        let start = Instant::now();
        line.store(2 * i + 1, Ordering::Release);
        while line.load(Ordering::Acquire) != 2 * i + 2 {
            std::hint::spin_loop();
        }
        samples.push(start.elapsed().as_nanos() as u64);
    }
    echo.join().unwrap();
    samples
}

/// A cache line of its own.
#[repr(align(64))]
#[derive(Default)]
struct Line(AtomicU64);

/// One side of [`protocol_round_trips`]: the lines SPEC.md §8 puts apart for a QP, each
/// written by one side and read by the other.
#[derive(Default)]
struct RingLines {
    /// The QP's doorbell record: its SQ and RQ producer indexes.
    record_sq: Line,
    record_rq: Line,
    /// Its next SQ and RQ slots and the next CQE slot of its CQ.
    send_wqe: Line,
    receive_wqe: Line,
    cqe: Line,
}

/// The ring protocol's own cache-line transfers with nothing around them, in ns per round
/// trip: the same messages as [`Pair::round_trips`] (a receive posted, a send, on each side),
/// where the program writes each WQE, its producer index and its doorbell bit, and a thread
/// on `b` standing in for the poller takes the bits, reads the indexes and WQEs and writes
/// the receiver's CQE, which the program polls. No relay can move a message with fewer.
fn protocol_round_trips(a: usize, b: usize, count: usize) -> Vec<u64> {
    let sides: Arc<[RingLines; 2]> = Arc::default();
    let bitmap = Arc::new(Line::default());
    let (poller_sides, poller_bitmap) = (Arc::clone(&sides), Arc::clone(&bitmap));
    let messages = 2 * count as u64 + 2;
    let poller = std::thread::spawn(move || {
        pin_to(b);
        let mut seen = [(0u64, 0u64); 2];
        let mut delivered = 0;
        while delivered < messages {
            if poller_bitmap.0.load(Ordering::Relaxed) == 0 {
                std::hint::spin_loop();
                continue;
            }
            let mut rung = poller_bitmap.0.swap(0, Ordering::Acquire);
            while rung != 0 {
                let side = rung.trailing_zeros() as usize;
                rung &= rung - 1;
                let lines = &poller_sides[side];
                let receives = lines.record_rq.0.load(Ordering::Acquire);
                if receives != seen[side].1 {
                    std::hint::black_box(lines.receive_wqe.0.load(Ordering::Relaxed));
                    seen[side].1 = receives;
                }
                let sends = lines.record_sq.0.load(Ordering::Acquire);
                if sends != seen[side].0 {
                    let wqe = lines.send_wqe.0.load(Ordering::Relaxed);
                    poller_sides[1 - side].cqe.0.store(wqe, Ordering::Release);
                    seen[side].0 = sends;
                    delivered += 1;
                }
            }
        }
    });
    pin_to(a);
    let mut posted = [(0u64, 0u64); 2];
    let post = |side: usize, posted: &mut [(u64, u64); 2], send: bool| {
        let lines = &sides[side];
        let (wqe, record, count) = if send {
            (&lines.send_wqe, &lines.record_sq, &mut posted[side].0)
        } else {
            (&lines.receive_wqe, &lines.record_rq, &mut posted[side].1)
        };
        *count += 1;
        wqe.0.store(*count, Ordering::Relaxed);
        record.0.store(*count, Ordering::Release);
        bitmap.0.fetch_or(1 << side, Ordering::Release);
    };
    let wait = |side: usize, message: u64| {
        while sides[side].cqe.0.load(Ordering::Acquire) != message {
            std::hint::spin_loop();
        }
    };
    post(0, &mut posted, false);
    post(1, &mut posted, false);
    let mut samples = Vec::with_capacity(count + 1);
    for _ in 0..=count {
        let start = Instant::now();
        post(0, &mut posted, true);
        wait(1, posted[0].0);
        post(1, &mut posted, false);
        post(1, &mut posted, true);
        wait(0, posted[1].0);
        post(0, &mut posted, false);
        samples.push(start.elapsed().as_nanos() as u64);
    }
    poller.join().unwrap();
    samples.remove(0);
    samples
}

/// Copies of 8 bytes per second on `cpu`, through the same stride a WRITE's payload has in
/// the benchmark's buffers: what the loopback host's copy of one WQE's payload is at least.
fn copies_per_second(cpu: usize, count: u64) -> f64 {
    let worker = std::thread::spawn(move || {
        pin_to(cpu);
        let (from, mut to) = (vec![7u8; 4096], vec![0u8; 4096]);
        let start = Instant::now();
        for i in 0..count as usize {
            let at = (i * 64) % 4096;
            to[at..at + 8].copy_from_slice(std::hint::black_box(&from[at..at + 8]));
        }
        std::hint::black_box(&to);
        count as f64 / start.elapsed().as_secs_f64()
    });
    worker.join().unwrap()
}

/// Two RC QPs of one program connected to each other through the device, each with a CQ of
/// its own, and a buffer both have registered.
struct Pair {
    cqs: [CompletionQueue; 2],
    qps: [QueuePair; 2],
    mr: MemoryRegion,
    _buffer: SharedBuffer,
}

impl Pair {
    fn new(device: &Device) -> Pair {
        let pd = device.alloc_pd().unwrap();
        let cqs = [0, 1].map(|_| device.create_cq(4 * SQ_DEPTH).unwrap());
        let qps = [0, 1].map(|i| {
            QueuePair::builder(QpType::Rc, &cqs[i])
                .max_send_wr(SQ_DEPTH)
                .max_recv_wr(SQ_DEPTH)
                .max_inline_data(64)
                .build(&pd)
                .unwrap()
        });
        let (gid_index, gid) = device.gid().unwrap();
        let gid_index = gid_index as u8;
        connect_guest_qp(&qps[0], gid_index, gid, qps[1].qp_num()).unwrap();
        connect_guest_qp(&qps[1], gid_index, gid, qps[0].qp_num()).unwrap();
        let buffer = device.alloc_buffer(1 << 16).unwrap();
        let all = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
        let mr = pd.reg_mr(&buffer, all).unwrap();
        Pair {
            cqs,
            qps,
            mr,
            _buffer: buffer,
        }
    }

    fn sge(&self, offset: u64) -> Sge {
        Sge {
            addr: self.mr.addr() + offset,
            length: MESSAGE,
            lkey: self.mr.lkey(),
        }
    }

    fn post_receive(&self, side: usize) {
        let sge = [self.sge(4096 * side as u64)];
        let wr = RecvWr {
            wr_id: 0,
            sges: &sge,
        };
        self.qps[side].post_recv(&[wr]).unwrap();
    }

    /// Waits for the next completion on `side`'s CQ.
    fn next_completion(&self, side: usize) -> WorkCompletion {
        let mut wc = [WorkCompletion::default()];
        while self.cqs[side].poll(&mut wc).unwrap() == 0 {
            std::hint::spin_loop();
        }
        assert_eq!(wc[0].status, 0, "{:?}", wc[0]);
        wc[0]
    }

    /// One message from `from` to the other QP: an unsignaled 8-byte SEND, inline.
    fn send(&self, from: usize) {
        let payload = [0x5a; MESSAGE as usize];
        let mut wr = SendWr::new(1, SendOp::Send, Payload::Inline(&payload));
        wr.signaled = false;
        self.qps[from].post_send(&[wr]).unwrap();
    }

    /// Round trips, in ns each: 0 sends to 1, which answers once it has received.
    fn round_trips(&self, count: usize) -> Vec<u64> {
        self.post_receive(0);
        self.post_receive(1);
        let mut samples = Vec::with_capacity(count);
        for _ in 0..count {
            let start = Instant::now();
            self.send(0);
            self.next_completion(1);
            self.post_receive(1);
            self.send(1);
            self.next_completion(0);
            self.post_receive(0);
            samples.push(start.elapsed().as_nanos() as u64);
        }
        samples
    }

    /// 8-byte WRITEs per second from QP 0 into QP 1's memory, posted in chains of `chain`,
    /// the last of each signaled; at most half the send queue's chains in flight.
    fn writes_per_second(&self, count: u64, chain: u64) -> f64 {
        let write = SendOp::RdmaWrite {
            remote_addr: self.mr.addr() + 8192,
            rkey: self.mr.rkey(),
        };
        let source = [self.sge(0)];
        let in_flight_most = u64::from(SQ_DEPTH) / 2 / chain;
        let (mut posted, mut in_flight) = (0, 0);
        let start = Instant::now();
        while posted < count {
            while in_flight < in_flight_most && posted < count {
                let mut wrs = self.qps[0].send_chain().unwrap();
                for i in 0..chain {
                    let mut wr = SendWr::new(posted + i, write, Payload::Sges(&source));
                    wr.signaled = i + 1 == chain;
                    wrs.push(&wr).unwrap();
                }
                wrs.post().unwrap();
                posted += chain;
                in_flight += 1;
            }
            self.next_completion(0);
            in_flight -= 1;
        }
        for _ in 0..in_flight {
            self.next_completion(0);
        }
        posted as f64 / start.elapsed().as_secs_f64()
    }
}

fn start_loopback_backend(poller_cpu: usize) -> std::path::PathBuf {
    let socket = std::env::temp_dir().join(format!("vrdma-relay-{}.sock", std::process::id()));
    let config = vrdma_backend::Config {
        device: "loopback".into(),
        port: 1,
        gid_index: None,
        guest_ip: None,
        quotas: vrdma_backend::Quotas::default(),
        notify_queues: 1,
        poll_threads: 1,
        // The poller never sleeps during the runs: a sleeping poller measures wake-ups.
        poll_idle: Duration::from_secs(5),
        poll_cpus: vec![poller_cpu],
        seccomp: vrdma_backend::sandbox::SeccompMode::None,
        max_guests: 1,
        shared_gid: false,
        unsealed_memory: vrdma_backend::memory_regions::UnsealedFiles::Refuse,
        rate_limits: vrdma_backend::datapath::RateLimits::default(),
        socket_group: None,
        handshake_timeout: Duration::from_secs(10),
    };
    serve_in_background(config, socket).socket
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| {
            a.parse()
                .expect("usage: relay-bench [PROGRAM_CPU POLLER_CPU]")
        })
        .collect();
    let (program_cpu, poller_cpu) = match args.as_slice() {
        [] => (0, 1),
        &[a, b] => (a, b),
        _ => panic!("usage: relay-bench [PROGRAM_CPU POLLER_CPU]"),
    };
    let trips = size_from_env("VRDMA_BENCH_ROUND_TRIPS", 100_000) as usize;
    let wqes = size_from_env("VRDMA_BENCH_WQES", 2_000_000);

    let mut floor = cache_line_round_trips(program_cpu, poller_cpu, trips);
    let mut protocol = protocol_round_trips(program_cpu, poller_cpu, trips);
    let socket = start_loopback_backend(poller_cpu);
    pin_to(program_cpu);
    let device = Device::attach(&socket).expect("attach to the loopback backend");
    let pair = Pair::new(&device);
    pair.round_trips(trips / 10 + 1); // warm up
    let mut relay = pair.round_trips(trips);
    let ((floor_50, floor_99), (relay_50, relay_99)) =
        (percentiles(&mut floor), percentiles(&mut relay));
    let (protocol_50, protocol_99) = percentiles(&mut protocol);
    let one = pair.writes_per_second(wqes / 4, 1);
    let sixteen = pair.writes_per_second(wqes, 16);
    let copies = copies_per_second(poller_cpu, wqes * 4);

    println!("| on real cores (loopback host, CPUs {program_cpu} and {poller_cpu}) | vrdma | floor | vrdma / floor | goal |");
    println!("|---|---|---|---|---|");
    let ratio = |v: f64, f: f64| v / f;
    let round_trip = |what: &str, relay: u64, floor: u64, goal: &str| {
        println!(
            "| {what} | {:.2} us | {:.3} us | {:.1} | {goal} |",
            relay as f64 / 1e3,
            floor as f64 / 1e3,
            ratio(relay as f64, floor as f64)
        );
    };
    round_trip(
        "round trip, p50 (floor: a cache line between the two cores and back)",
        relay_50,
        floor_50,
        "<= 4",
    );
    round_trip("round trip, p99", relay_99, floor_99, "");
    round_trip(
        "round trip, p50, against the ring protocol's own transfers (floor: the same WQEs, indexes, doorbell bits and CQEs passed between the two cores, with no work)",
        relay_50,
        protocol_50,
        "",
    );
    round_trip(
        "round trip, p99, against the ring protocol's own transfers",
        relay_99,
        protocol_99,
        "",
    );
    println!(
        "| 8-byte WRITEs through the poller core, one per doorbell (floor: copying 8 bytes in a loop) | {:.2} M/s | {:.0} M/s | {:.3} | >= 3 M/s |",
        one / 1e6,
        copies / 1e6,
        ratio(one, copies)
    );
    println!(
        "| 8-byte WRITEs through the poller core, 16 per doorbell | {:.2} M/s | {:.0} M/s | {:.3} | >= 10 M/s |",
        sixteen / 1e6,
        copies / 1e6,
        ratio(sixteen, copies)
    );
}
