//! Control-path timings (native rxe against vrdma) and the scaling run, for the benchmark.
//!
//! usage: ctl-bench SOCKET BACKEND_PID
//!
//! Sizes: VRDMA_BENCH_QPS (16384), VRDMA_BENCH_GUESTS (64), VRDMA_BENCH_MR_MIB (1024); the test
//! suite's smoke run makes them small.
//!
//! Prints markdown tables: QP create -> RTS and 1 GiB reg/dereg over 2 MiB and over 4 KiB
//! pages, natively through the backend's host verbs layer and through vrdma (guest-lib over
//! the backend at SOCKET); then 16,384 QPs in one guest (timed against fresh guests at the
//! same moments, see `Scale`) and 64 concurrent guests, with the backend's memory (from
//! /proc/BACKEND_PID). The 2 MiB rows need 2 MiB huge pages reserved for the guest's memory
//! (half VRDMA_BENCH_MR_MIB of them, and some).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_backend::hostverbs::{self, AnonymousMemory, PinnedMemory, QpInit};
use vrdma_guest::{access, CompletionQueue, Device, DirectOptions, ProtectionDomain, QueuePair};
use vrdma_tests::{
    connect_guest_qp, open_test_device, size_from_env, RcEndpoint, FULL_ACCESS, PORT,
};

const QPS_TIMED: u32 = 100;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, socket, pid] = args.as_slice() else {
        eprintln!("usage: ctl-bench SOCKET BACKEND_PID");
        std::process::exit(2);
    };
    // 64 guests in this process need more descriptors than the default soft limit.
    vrdma_backend::hostverbs::raise_open_file_limit().expect("raise the open file limit");
    let memory = || Resident::of(pid);
    let per = |d: Duration, n: u32| d.as_secs_f64() * 1e6 / f64::from(n);
    let scale_qps = size_from_env("VRDMA_BENCH_QPS", 16_384) as u32;
    let scale_guests = size_from_env("VRDMA_BENCH_GUESTS", 64) as usize;
    let mr_bytes = size_from_env("VRDMA_BENCH_MR_MIB", 1024) << 20;
    let mr_label = format!("{} MiB", mr_bytes >> 20);

    let native_qp = native_qp_setup();
    let vrdma_qp = vrdma_qp_setup(socket);
    println!("| control path | native rxe | vrdma | vrdma / native |");
    println!("|---|---|---|---|");
    let row = |what: &str, unit: &str, n: f64, v: f64| {
        println!("| {what} | {n:.1} {unit} | {v:.1} {unit} | {:.2} |", v / n);
    };
    row(
        "QP create -> RTS (per QP, 100 QPs)",
        "us",
        per(native_qp, QPS_TIMED),
        per(vrdma_qp, QPS_TIMED),
    );
    for pages in [PageSize::Huge, PageSize::Base] {
        let native = native_registration(mr_bytes, pages);
        let vrdma = vrdma_registration(socket, mr_bytes, pages);
        let what = [
            format!("reg_mr {mr_label}, {}", pages.label()),
            format!("dereg_mr {mr_label}, {}", pages.label()),
            format!(
                "reg_mr {mr_label} again, {} (now in the backend's page tables)",
                pages.label()
            ),
        ];
        for ((what, native), vrdma) in what.iter().zip(native).zip(vrdma) {
            row(
                what,
                "ms",
                native.as_secs_f64() * 1e3,
                vrdma.as_secs_f64() * 1e3,
            );
        }
    }

    // What the host provider's library allocates per QP in the process that creates it:
    // the backend pays it as native does.
    let native = native_scale(scale_qps);
    let provider_heap = native.heap;

    // 16,384 QPs in one guest.
    let attach = || SmallQps::attach(socket);
    let first = cost_in_fresh_guests(attach);
    let guest = attach();
    let before = memory();
    let (qps, scale) = create_at_scale(scale_qps, &guest, attach);
    let qp_memory = memory().per_object_since(&before, scale_qps);
    let start = Instant::now();
    drop(qps);
    let destroyed = start.elapsed();

    // 64 concurrent guests, each on its own connection.
    let before = memory();
    let start = Instant::now();
    let small = DirectOptions {
        region_size: 4 << 20,
        ..Default::default()
    };
    let guests: Vec<Device> = (0..scale_guests)
        .map(|i| Device::attach_with(socket, small).unwrap_or_else(|e| panic!("guest {i}: {e}")))
        .collect();
    let attached = start.elapsed();
    // Connections are served after the attach returns; give the backend a moment to settle.
    std::thread::sleep(Duration::from_millis(500));
    let guest_memory = memory()
        .per_object_since(&before, scale_guests as u32)
        .total;
    for guest in &guests {
        guest.query_device().expect("every guest is served");
    }
    drop(guests);

    println!();
    println!("| scaling | result |");
    println!("|---|---|");
    let between = scale.between_count;
    println!(
        "| CREATE_QP at 100 QPs: a fresh guest's first {QPS_TIMED}, the median of {RUNS} guests | {:.1} us per QP |",
        per(first, QPS_TIMED)
    );
    println!(
        "| CREATE_QP at {scale_qps} QPs: one guest's QPs {} to {scale_qps} in runs of {QPS_TIMED}, the median run | {:.1} us per QP ({:.2}x the cost at 100) |",
        between + 1,
        per(scale.last, QPS_TIMED),
        scale.growth_from(first)
    );
    println!(
        "| CREATE_QP at 100 QPs at the same moments: a fresh guest's first {QPS_TIMED} beside each of those runs, one QP there, one here, the median (the machine's speed cancels out; the backend holds the other guest's QPs) | {:.1} us per QP (the cost at {scale_qps} is {:.2}x this) |",
        per(scale.beside, QPS_TIMED),
        scale.growth_beside()
    );
    println!(
        "| CREATE_QP of that guest's QPs 1 to {between} in runs of {QPS_TIMED} | {:.1} us per QP ({:.2}x the cost at 100); the median run {:.1} us per QP, the slowest {:.1} us per QP |",
        per(scale.between, between),
        per(scale.between, between) / per(first, QPS_TIMED),
        per(scale.median_run(), QPS_TIMED),
        per(scale.slowest_run(), QPS_TIMED),
    );
    println!(
        "| the same natively (the host's verbs, no guest; fresh contexts for fresh guests): CREATE_QP at 100 QPs; at {scale_qps} QPs; at 100 QPs at the same moments | {:.1} us per QP; {:.1} us per QP ({:.2}x); {:.1} us per QP ({:.2}x) |",
        per(native.first, QPS_TIMED),
        per(native.scale.last, QPS_TIMED),
        native.scale.growth_from(native.first),
        per(native.scale.beside, QPS_TIMED),
        native.scale.growth_beside()
    );
    println!(
        "| {scale_qps} QPs in one guest: DESTROY_QP | {:.1} us per QP |",
        per(destroyed, scale_qps)
    );
    println!(
        "| backend heap per QP (RssAnon) | {:.2} KiB |",
        qp_memory.anon
    );
    println!(
        "| host provider's heap per QP (RssAnon of {scale_qps} QPs created natively) | {provider_heap:.2} KiB |"
    );
    println!(
        "| backend's own memory per QP (its heap less the provider's) | {:.2} KiB |",
        qp_memory.anon - provider_heap
    );
    println!(
        "| host provider's queue buffers per QP (RssFile; native pays them too) | {:.1} KiB |",
        qp_memory.file
    );
    println!(
        "| guest ring pages per QP mapped in the backend (RssShmem; the guest's memory) | {:.1} KiB |",
        qp_memory.shmem
    );
    println!(
        "| {scale_guests} concurrent guests: attach | {:.1} ms per guest |",
        attached.as_secs_f64() * 1e3 / scale_guests as f64
    );
    println!("| backend memory per guest connection | {guest_memory:.0} KiB |");
}

/// Resident memory of the backend by kind, in KiB.
#[derive(Clone, Copy, Debug, Default)]
struct Resident {
    total: f64,
    anon: f64,
    file: f64,
    shmem: f64,
}

impl Resident {
    fn of(pid: &str) -> Resident {
        let status =
            std::fs::read_to_string(format!("/proc/{pid}/status")).expect("backend status");
        let field = |name: &str| -> f64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
        };
        Resident {
            total: field("VmRSS"),
            anon: field("RssAnon"),
            file: field("RssFile"),
            shmem: field("RssShmem"),
        }
    }

    /// The growth since `before`, per each of `count` objects.
    fn per_object_since(&self, before: &Resident, count: u32) -> Resident {
        let n = f64::from(count);
        Resident {
            total: (self.total - before.total) / n,
            anon: (self.anon - before.anon) / n,
            file: (self.file - before.file) / n,
            shmem: (self.shmem - before.shmem) / n,
        }
    }
}

/// The pages behind the memory registered: the registration's cost is per page.
#[derive(Clone, Copy)]
enum PageSize {
    /// 2 MiB: transparent huge pages natively; hugetlb pages for the guest's memory, as
    /// vhost-user deployments back guest RAM (the host must have them reserved).
    Huge,
    /// 4 KiB on both sides.
    Base,
}

impl PageSize {
    fn label(self) -> &'static str {
        match self {
            PageSize::Huge => "2 MiB pages",
            PageSize::Base => "4 KiB pages",
        }
    }
}

/// Native: QP create -> RTS through host verbs, per QP.
fn native_qp_setup() -> Duration {
    let qps = NativeQps::open();
    let (gid_index, gid) = qps.pd.context().find_roce_v2_ipv4_gid(PORT).unwrap();
    let start = Instant::now();
    let endpoints: Vec<RcEndpoint> = (0..QPS_TIMED as usize)
        .map(|i| {
            let endpoint = RcEndpoint {
                pd: Arc::clone(&qps.pd),
                cq: Arc::clone(&qps.cq),
                qp: qps.create(i),
            };
            endpoint.connect(gid_index as u8, gid, endpoint.qp.qp_num(), (0, 0));
            endpoint
        })
        .collect();
    let elapsed = start.elapsed();
    drop(endpoints);
    elapsed
}

/// Native: reg_mr, dereg and reg_mr again of `mr_bytes` of anonymous memory in `pages`,
/// touched first as a program's buffer is.
fn native_registration(mr_bytes: u64, pages: PageSize) -> [Duration; 3] {
    let context = open_test_device();
    let pd = context.alloc_pd().unwrap();
    let memory = Arc::new(AnonymousMemory::new(mr_bytes as usize).unwrap());
    memory
        .advise_huge_pages(matches!(pages, PageSize::Huge))
        .unwrap();
    for page in (0..mr_bytes as usize).step_by(4096) {
        memory.write(page, &[1]).unwrap();
    }
    let memory = memory as Arc<dyn PinnedMemory>;
    reg_dereg_reg(|| {
        pd.reg_mr(Arc::clone(&memory), 0x10_0000_0000, FULL_ACCESS)
            .unwrap()
    })
}

/// Times `register`, dropping what it registered (deregistration), and `register` again.
fn reg_dereg_reg<T>(register: impl Fn() -> T) -> [Duration; 3] {
    let start = Instant::now();
    let mr = register();
    let reg = start.elapsed();
    let start = Instant::now();
    drop(mr);
    let dereg = start.elapsed();
    let start = Instant::now();
    let mr = register();
    let again = start.elapsed();
    drop(mr);
    [reg, dereg, again]
}

/// What `count` QPs created through the host verbs layer, as the backend creates them, cost.
struct NativeScale {
    /// The growth of this process's heap (RssAnon, KiB) per QP: the host provider's share.
    heap: f64,
    /// The cost at 100 QPs (see [`cost_in_fresh_guests`]).
    first: Duration,
    scale: Scale,
}

fn native_scale(count: u32) -> NativeScale {
    let first = cost_in_fresh_guests(NativeQps::open);
    let context = NativeQps::open();
    let pid = std::process::id().to_string();
    let before = Resident::of(&pid);
    let (held, scale) = create_at_scale(count, &context, NativeQps::open);
    let heap = Resident::of(&pid).per_object_since(&before, count).anon;
    drop(held);
    NativeScale { heap, first, scale }
}

/// A context of the host's verbs creating the smallest RC QPs on one CQ, as [`SmallQps`]
/// does through the backend.
struct NativeQps {
    pd: Arc<hostverbs::ProtectionDomain>,
    cq: Arc<hostverbs::CompletionQueue>,
    init: QpInit<'static>,
}

impl NativeQps {
    fn open() -> Self {
        let context = open_test_device();
        NativeQps {
            pd: context.alloc_pd().unwrap(),
            cq: context.create_cq(64, None).unwrap(),
            init: QpInit::smallest_rc(0),
        }
    }
}

impl QpMaker for NativeQps {
    type Qp = hostverbs::QueuePair;

    fn create(&self, i: usize) -> hostverbs::QueuePair {
        self.pd
            .create_qp(&self.cq, &self.cq, &self.init)
            .unwrap_or_else(|e| panic!("native QP {i}: {e}"))
    }
}

/// How many runs of [`QPS_TIMED`] creations make each median of [`Scale`].
const RUNS: usize = 9;

/// See [`settle`].
const SETTLE: Duration = Duration::from_millis(300);

/// How long creating objects took, in runs of [`QPS_TIMED`]. On this machine one run swings
/// by a third from one second to the next, as much as the growth being measured; so the cost
/// at the full count is also set against a fresh guest's, QP for QP at the same moments.
struct Scale {
    /// The whole runs of the scaling run before its last ones, in order, and the time all
    /// those objects took.
    runs: Vec<Duration>,
    between: Duration,
    /// How many objects those runs created.
    between_count: u32,
    /// The median of the scaling run's last runs, up to the full count.
    last: Duration,
    /// The median of runs in fresh guests, each interleaved with one of those last runs:
    /// one object here, one there.
    beside: Duration,
}

impl Scale {
    /// The cost at the full count, against `first`, the cost at 100 measured before.
    fn growth_from(&self, first: Duration) -> f64 {
        self.last.as_secs_f64() / first.as_secs_f64()
    }

    /// The cost at the full count, against the cost at 100 at the same moments.
    fn growth_beside(&self) -> f64 {
        self.last.as_secs_f64() / self.beside.as_secs_f64()
    }

    fn median_run(&self) -> Duration {
        median(self.runs.clone())
    }

    fn slowest_run(&self) -> Duration {
        self.runs.iter().copied().max().unwrap_or_default()
    }
}

fn median(mut runs: Vec<Duration>) -> Duration {
    runs.sort_unstable();
    runs[runs.len() / 2]
}

/// What creates the scaling run's QPs: a guest, or natively a context.
trait QpMaker {
    type Qp;
    fn create(&self, index: usize) -> Self::Qp;
}

/// Creates objects `indexes` with `maker`: them, and the time that took.
fn create_timed<M: QpMaker>(maker: &M, indexes: Range<usize>) -> (Vec<M::Qp>, Duration) {
    let mut took = Duration::ZERO;
    let made = indexes
        .map(|i| {
            let start = Instant::now();
            let qp = maker.create(i);
            took += start.elapsed();
            qp
        })
        .collect();
    (made, took)
}

/// A pause after each fresh guest, so that its teardown (the backend's, after the guest has
/// gone) is not timed in what follows.
fn settle() {
    std::thread::sleep(SETTLE);
}

/// The cost at 100 objects: the median of [`RUNS`] fresh guests (or contexts) from `open`,
/// each creating its first [`QPS_TIMED`].
fn cost_in_fresh_guests<M: QpMaker>(open: impl Fn() -> M) -> Duration {
    median(
        (0..RUNS)
            .map(|_| {
                let fresh = open();
                let (held, took) = create_timed(&fresh, 0..QPS_TIMED as usize);
                drop(held);
                drop(fresh);
                settle();
                took
            })
            .collect(),
    )
}

/// Creates `count` objects (at least twice [`QPS_TIMED`]) with `guest`, timed as [`Scale`]
/// says, with fresh guests from `open` beside it at the end. Returns the objects, all held.
fn create_at_scale<M: QpMaker>(count: u32, guest: &M, open: impl Fn() -> M) -> (Vec<M::Qp>, Scale) {
    let (count, run) = (count as usize, QPS_TIMED as usize);
    assert!(
        count >= 2 * run,
        "a scaling run needs at least {} objects",
        2 * run
    );
    // Fewer last runs when the count is small (the test suite's smoke run).
    let last_from = count - run * RUNS.min(count / run / 2);
    let mut held = Vec::with_capacity(count);
    let (mut runs, mut between) = (Vec::new(), Duration::ZERO);
    while held.len() < last_from {
        let size = run.min(last_from - held.len());
        let (made, took) = create_timed(guest, held.len()..held.len() + size);
        held.extend(made);
        between += took;
        // A shorter run at the end is in the sum, not among the runs compared.
        if size == run {
            runs.push(took);
        }
    }
    let (mut last, mut beside) = (Vec::new(), Vec::new());
    while held.len() < count {
        let fresh = open();
        let mut fresh_held = Vec::with_capacity(run);
        let (mut here, mut there) = (Duration::ZERO, Duration::ZERO);
        for i in 0..run {
            let (made, took) = create_timed(guest, held.len()..held.len() + 1);
            held.extend(made);
            here += took;
            let (made, took) = create_timed(&fresh, i..i + 1);
            fresh_held.extend(made);
            there += took;
        }
        last.push(here);
        beside.push(there);
        drop(fresh_held);
        drop(fresh);
        settle();
    }
    let scale = Scale {
        between,
        runs,
        between_count: last_from as u32,
        last: median(last),
        beside: median(beside),
    };
    (held, scale)
}

/// A guest creating the smallest RC QPs, on one CQ (the scaling run's, and those timed to
/// RTS).
struct SmallQps {
    // Dropped in this order, the device last.
    pd: ProtectionDomain,
    cq: CompletionQueue,
    device: Device,
}

impl SmallQps {
    fn attach(socket: &str) -> Self {
        let device = Device::attach(socket).expect("attach");
        SmallQps {
            pd: device.alloc_pd().unwrap(),
            cq: device.create_cq(64).unwrap(),
            device,
        }
    }
}

impl QpMaker for SmallQps {
    type Qp = QueuePair;

    fn create(&self, i: usize) -> QueuePair {
        QueuePair::builder(vrdma_guest::QpType::Rc, &self.cq)
            .max_send_wr(1)
            .max_recv_wr(1)
            .build(&self.pd)
            .unwrap_or_else(|e| panic!("QP {i}: {e}"))
    }
}

/// vrdma: QP create -> RTS through guest-lib and the backend, per QP.
fn vrdma_qp_setup(socket: &str) -> Duration {
    let qps = SmallQps::attach(socket);
    let (gid_index, gid) = qps.device.gid().unwrap();
    let start = Instant::now();
    let connected: Vec<QueuePair> = (0..QPS_TIMED as usize)
        .map(|i| {
            let qp = qps.create(i);
            connect_guest_qp(&qp, gid_index as u8, gid, qp.qp_num()).unwrap();
            qp
        })
        .collect();
    let elapsed = start.elapsed();
    drop(connected);
    elapsed
}

/// vrdma: the registrations of [`native_registration`] over guest memory in `pages`, on a
/// connection of their own.
fn vrdma_registration(socket: &str, mr_bytes: u64, pages: PageSize) -> [Duration; 3] {
    let options = DirectOptions {
        huge_pages: matches!(pages, PageSize::Huge),
        ..Default::default()
    };
    let device = Device::attach_with(socket, options).unwrap_or_else(|e| {
        panic!(
            "attach with {}: {e} (are huge pages reserved?)",
            pages.label()
        )
    });
    let pd = device.alloc_pd().unwrap();
    let buffer = device.alloc_buffer(mr_bytes).unwrap();
    for page in (0..mr_bytes).step_by(4096) {
        buffer.write(page, &[1]).unwrap(); // fault it in, as guest RAM already is
    }
    let all = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
    reg_dereg_reg(|| pd.reg_mr(&buffer, all).unwrap())
}
