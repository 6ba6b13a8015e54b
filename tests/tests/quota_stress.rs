//! 64 guests, each holding everything its default quotas allow, against one backend process on
//! rxe: the backend's memory and mapping count stay within the bounds docs/operating.md states,
//! every request past a quota is refused with NO_RESOURCES by the rule for it, and every guest
//! is still served. Runs inside the VM harness.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vrdma_backend::{limits, Quotas};
use vrdma_guest::{Device, Error};
use vrdma_tests::{
    host_resource_counts, spawn_backend_process, wait_for_backend_log, wait_for_host_counts_within,
};

const GUESTS: usize = 64;
/// Processes the guests live in (32 each): the guest side works in parallel.
const PROCESSES: usize = 2;

/// docs/operating.md's bound on the backend's mappings: the host provider maps two queue
/// buffers per QP and one per CQ or SRQ; a guest connection adds a few more (its threads, its
/// memory table).
fn mapping_bound(quotas: &Quotas, guests: usize) -> usize {
    let per_guest = 2 * quotas.max_qp + quotas.max_cq + quotas.max_srq + 16;
    2_000 + guests * per_guest as usize
}

/// docs/operating.md's bound on the memory the backend itself holds (RssAnon + RssFile, KiB):
/// its heap (< 2 MiB per guest) and the host provider's queue buffers, which rxe makes up to
/// ten times the guest's ring bytes.
fn own_memory_bound_kib(quotas: &Quotas, guests: usize) -> u64 {
    let per_guest = 10 * quotas.max_ring_bytes + (2 << 20);
    ((64 << 20) + guests as u64 * per_guest) >> 10
}

/// docs/operating.md's bound on the guest memory mapped in the backend (RssShmem, KiB): rings
/// and registered pages, which are the guests' memory, shared and counted here again.
fn guest_memory_bound_kib(quotas: &Quotas, guests: usize) -> u64 {
    (guests as u64 * (quotas.max_ring_bytes + quotas.max_registered_bytes)) >> 10
}

/// `/proc/PID/status` fields in KiB (VmRSS, RssAnon, RssFile, RssShmem).
fn memory_kib(pid: u32) -> BTreeMap<String, u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("backend status")
        .lines()
        .filter(|l| l.starts_with("VmRSS") || l.starts_with("Rss"))
        .filter_map(|l| {
            let (name, value) = l.split_once(':')?;
            Some((
                name.to_string(),
                value.split_whitespace().next()?.parse().ok()?,
            ))
        })
        .collect()
}

/// docs/operating.md's bound on the backend's threads: four per guest connection, the poller
/// pool and a few of its own.
fn thread_bound(guests: usize) -> usize {
    16 + 4 * guests
}

fn thread_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("backend tasks")
        .count()
}

fn descriptor_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("backend descriptors")
        .count()
}

fn mapping_count(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .expect("backend maps")
        .lines()
        .count()
}

#[test]
#[ignore = "needs rdma_rxe: run by tests/run-all.sh inside the VM harness"]
fn sixty_four_guests_at_every_quota_stay_within_the_documented_bounds() {
    let quotas = Quotas::default();
    let socket =
        std::env::temp_dir().join(format!("vrdma-quota-stress-{}.sock", std::process::id()));
    // 64 guests on one backend share its GID: one trust domain, as the operator declares.
    let mut backend = spawn_backend_process(&socket, &["--shared-gid"]);
    let pid = backend.id();
    let host_baseline = host_resource_counts();
    let (idle_rss, idle_maps) = (memory_kib(pid)["VmRSS"], mapping_count(pid));

    let start = Instant::now();
    let mut holders: Vec<_> = (0..PROCESSES)
        .map(|_| {
            Command::new(env!("CARGO_BIN_EXE_quota-guests"))
                .arg(&socket)
                .arg((GUESTS / PROCESSES).to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("start quota-guests")
        })
        .collect();
    let mut outputs: Vec<_> = holders
        .iter_mut()
        .map(|h| BufReader::new(h.stdout.take().unwrap()).lines())
        .collect();
    let mut next_line = |i: usize| -> String {
        outputs[i]
            .next()
            .unwrap_or_else(|| panic!("quota-guests {i} ended early"))
            .unwrap()
    };
    for i in 0..PROCESSES {
        assert_eq!(next_line(i), "ready");
    }
    let memory = memory_kib(pid);
    let maps = mapping_count(pid);
    println!(
        "{GUESTS} guests at their quotas in {:.0} s; backend: {maps} mappings ({idle_maps} idle), \
         memory {memory:?} KiB ({idle_rss} KiB RSS idle)",
        start.elapsed().as_secs_f64()
    );
    let bound = mapping_bound(&quotas, GUESTS);
    assert!(maps <= bound, "{maps} mappings, bound {bound}");
    let own = memory["RssAnon"] + memory["RssFile"];
    let bound = own_memory_bound_kib(&quotas, GUESTS);
    assert!(
        own <= bound,
        "backend's own memory {own} KiB, bound {bound} KiB"
    );
    let bound = guest_memory_bound_kib(&quotas, GUESTS);
    assert!(
        memory["RssShmem"] <= bound,
        "guest memory mapped {} KiB, bound {bound} KiB",
        memory["RssShmem"]
    );

    let threads = thread_count(pid);
    let bound = thread_bound(GUESTS);
    assert!(threads <= bound, "{threads} threads, bound {bound}");
    let descriptors = descriptor_count(pid) as u64;
    let bound = GUESTS as u64 * limits::descriptors_per_guest(1, &quotas)
        + limits::DESCRIPTORS_OF_THE_BACKEND;
    assert!(
        descriptors <= bound,
        "{descriptors} descriptors, bound {bound}"
    );
    println!("backend: {threads} threads, {descriptors} descriptors");

    // A 65th guest is one past --guests: refused, told so, and once its connection has
    // closed (it was accepted as a successor, SPEC.md §11.1, and refused as it started a
    // device of its own) nothing has grown.
    match Device::attach(&socket) {
        Err(Error::Refused) => {}
        Err(e) => panic!("the 65th guest was refused with an unclear error: {e}"),
        Ok(_) => panic!("the 65th guest was served, past the backend's totals"),
    }
    wait_for_backend_log(&socket, "`was refused`", |log| {
        log.contains("a front end connected and was refused: 64 guests are connected")
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while thread_count(pid) != threads && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(thread_count(pid), threads, "the refused guest left threads");

    // Every guest is still served.
    for holder in &mut holders {
        writeln!(holder.stdin.as_mut().unwrap(), "check").unwrap();
    }
    for i in 0..PROCESSES {
        assert_eq!(next_line(i), "served");
    }
    assert!(backend.try_wait().unwrap().is_none(), "the backend exited");

    // The guests exit; the backend tears them down and is back where it started.
    let start = Instant::now();
    for mut holder in holders {
        drop(holder.stdin.take());
        assert!(holder.wait().unwrap().success());
    }
    wait_for_host_counts_within(&host_baseline, Duration::from_secs(300));
    println!("torn down in {:.0} s", start.elapsed().as_secs_f64());

    // Each connection's end logs its refusals by rule: every quota's rule fired in each.
    let rules = [
        "Quota(PD)",
        "Quota(QP)",
        "Quota(SRQ)",
        "Quota(AH)",
        "Quota(MR)",
        "Quota(CQ)",
        "ByteQuota(rings)",
        "ByteQuota(registered memory)",
    ];
    // A connection logs them after its objects are released, so they may trail the counts.
    let is_summary = |line: &&str| line.contains("failed control requests:");
    let log = wait_for_backend_log(&socket, &format!("{GUESTS} refusal summaries"), |log| {
        log.lines().filter(is_summary).count() >= GUESTS
    });
    let summaries: Vec<&str> = log.lines().filter(is_summary).collect();
    assert_eq!(summaries.len(), GUESTS, "{log}");
    for summary in summaries {
        for rule in rules {
            assert!(summary.contains(rule), "no {rule} in: {summary}");
        }
    }
    // With the others gone, a new guest is served.
    let next = Device::attach(&socket).expect("a guest after the others left");
    next.alloc_pd().expect("served");
    drop(next);
    backend.kill().unwrap();
    backend.wait().unwrap();
}
