//! Control-path timings (native rxe against vrdma) and the scaling run, for the benchmark.
//!
//! usage: ctl-bench SOCKET BACKEND_PID
//!
//! Sizes: VRDMA_BENCH_QPS (16384), VRDMA_BENCH_GUESTS (64), VRDMA_BENCH_MR_MIB (1024); the test
//! suite's smoke run makes them small.
//!
//! Prints markdown tables: QP create -> RTS and 1 GiB reg/dereg over 2 MiB and over 4 KiB
//! pages, natively through the backend's host verbs layer and through vrdma (guest-lib over
//! the backend at SOCKET); then 16,384 QPs in one guest and 64 concurrent guests, with the
//! backend's memory (from /proc/BACKEND_PID). The 2 MiB rows need 2 MiB huge pages reserved
//! for the guest's memory (half VRDMA_BENCH_MR_MIB of them, and some).

use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_backend::hostverbs::{AnonymousMemory, PinnedMemory, QpCaps, QpInit, QpType};
use vrdma_guest::{access, Device, DirectOptions, QueuePair};
use vrdma_tests::{connect_guest_qp, open_test_device, RcEndpoint, FULL_ACCESS, PORT};

const QPS_TIMED: u32 = 100;

fn size_from_env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

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
    let device = Device::attach(socket).expect("attach");
    let pd = device.alloc_pd().unwrap();
    let cq = device.create_cq(64).unwrap();
    let before = memory();
    let start = Instant::now();
    let first_count = QPS_TIMED.min(scale_qps);
    // The last QPS_TIMED, created while the guest already holds nearly all the others.
    let last_from = scale_qps - first_count;
    let mut before_last = Duration::ZERO;
    // How long each run of QPS_TIMED creations took, in order: the first is the cost at 100
    // QPs; the median and the slowest of all tell a cost that grows with the QPs held apart
    // from a moment the machine was busy.
    let mut windows = Vec::new();
    let mut window_start = start;
    let qps: Vec<QueuePair> = (0..scale_qps)
        .map(|i| {
            if i == last_from {
                before_last = start.elapsed();
            }
            let qp = QueuePair::builder(vrdma_guest::QpType::Rc, &cq)
                .max_send_wr(1)
                .max_recv_wr(1)
                .build(&pd)
                .unwrap_or_else(|e| panic!("QP {i}: {e}"));
            if (i + 1) % first_count == 0 {
                windows.push(window_start.elapsed());
                window_start = Instant::now();
            }
            qp
        })
        .collect();
    let created = start.elapsed();
    let first_created = windows[0];
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
    println!(
        "| CREATE_QP, the first {first_count} QPs of a guest | {:.1} us per QP |",
        per(first_created, first_count)
    );
    println!(
        "| {scale_qps} QPs in one guest: CREATE_QP | {:.1} us per QP ({:.2}x the first {first_count}) |",
        per(created, scale_qps),
        per(created, scale_qps) / per(first_created, first_count)
    );
    let mut sorted = windows.clone();
    sorted.sort_unstable();
    let median = sorted[sorted.len() / 2];
    println!(
        "| {scale_qps} QPs in one guest: CREATE_QP, the median of its {} runs of {first_count} | {:.1} us per QP ({:.2}x the first {first_count}; the slowest run {:.1} us per QP) |",
        windows.len(),
        per(median, first_count),
        per(median, first_count) / per(first_created, first_count),
        per(sorted[sorted.len() - 1], first_count)
    );
    let last_created = created - before_last;
    println!(
        "| {scale_qps} QPs in one guest: CREATE_QP of the last {first_count} | {:.1} us per QP ({:.2}x the first {first_count}) |",
        per(last_created, first_count),
        per(last_created, first_count) / per(first_created, first_count)
    );
    let native_first = per(native.first, first_count);
    println!(
        "| {scale_qps} QPs created natively (the host's verbs, no guest): CREATE_QP | {:.1} us per QP ({:.2}x the first {first_count}, {native_first:.1} us per QP) |",
        per(native.all, scale_qps),
        per(native.all, scale_qps) / native_first
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
    let context = open_test_device();
    let (gid_index, gid) = context.find_roce_v2_ipv4_gid(PORT).unwrap();
    let pd = context.alloc_pd().unwrap();
    let cq = context.create_cq(64, None).unwrap();
    let init = smallest_rc_qp();
    let start = Instant::now();
    let endpoints: Vec<RcEndpoint> = (0..QPS_TIMED)
        .map(|_| {
            let qp = pd.create_qp(&cq, &cq, &init).unwrap();
            let endpoint = RcEndpoint {
                pd: Arc::clone(&pd),
                cq: Arc::clone(&cq),
                qp,
            };
            endpoint.connect(gid_index as u8, gid, endpoint.qp.qp_num(), 0);
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

/// An RC QP of one WR and one SGE each way, as the scaling guests create.
fn smallest_rc_qp() -> QpInit<'static> {
    QpInit {
        qp_type: QpType::Rc,
        caps: QpCaps {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        srq: None,
        sq_sig_all: false,
    }
}

/// What `count` QPs created through the host verbs layer, as the backend creates them, cost.
struct NativeScale {
    /// The growth of this process's heap (RssAnon, KiB) per QP: the host provider's share.
    heap: f64,
    /// How long the first QPS_TIMED took to create.
    first: Duration,
    /// How long all of them took.
    all: Duration,
}

fn native_scale(count: u32) -> NativeScale {
    let context = open_test_device();
    let pd = context.alloc_pd().unwrap();
    let cq = context.create_cq(64, None).unwrap();
    let init = smallest_rc_qp();
    let pid = std::process::id().to_string();
    let before = Resident::of(&pid);
    let start = Instant::now();
    let mut first = Duration::ZERO;
    let qps: Vec<_> = (0..count)
        .map(|i| {
            let qp = pd
                .create_qp(&cq, &cq, &init)
                .unwrap_or_else(|e| panic!("native QP {i}: {e}"));
            if i + 1 == QPS_TIMED.min(count) {
                first = start.elapsed();
            }
            qp
        })
        .collect();
    let all = start.elapsed();
    let heap = Resident::of(&pid).per_object_since(&before, count).anon;
    drop(qps);
    NativeScale { heap, first, all }
}

/// vrdma: QP create -> RTS through guest-lib and the backend, per QP.
fn vrdma_qp_setup(socket: &str) -> Duration {
    let device = Device::attach(socket).unwrap();
    let (gid_index, gid) = device.gid().unwrap();
    let pd = device.alloc_pd().unwrap();
    let cq = device.create_cq(64).unwrap();
    let start = Instant::now();
    let qps: Vec<QueuePair> = (0..QPS_TIMED)
        .map(|_| {
            let qp = QueuePair::builder(vrdma_guest::QpType::Rc, &cq)
                .max_send_wr(1)
                .max_recv_wr(1)
                .build(&pd)
                .unwrap();
            connect_guest_qp(&qp, gid_index as u8, gid, qp.qp_num()).unwrap();
            qp
        })
        .collect();
    let elapsed = start.elapsed();
    drop(qps);
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
