//! Checks that memory given to the vrdma device of a VM stays where the device was told it is
//! (tests/pci-e2e.sh, part `pinned`; SPEC.md §12).
//!
//! usage: pin-check writer SOCKET TO_VM FROM_VM SECONDS
//!            outside the VM: a guest-lib program attached to the backend at SOCKET that, for
//!            SECONDS, RDMA-WRITEs patterns into the registered buffer of a `guest-endpoint
//!            target` in the VM (driven through the session files TO_VM and FROM_VM, see
//!            tests/pci-guest.sh) and has the target check each round where the program
//!            reads it; prints `done rounds=R mismatches=M` (exit 1 on a mismatch)
//!        pin-check fragment MIB
//!            in the VM: fragments memory (MIB of 4 KiB pages, every other one freed) so that
//!            compaction has work, prints `fragmented`, and holds the rest until killed
//!        pin-check sentinel SECONDS MIB
//!            in the VM: for SECONDS, takes MIB of fresh memory again and again, fills it
//!            with a pattern of its own and checks it a moment later: a device writing into
//!            a frame the kernel had given back would show here; prints
//!            `sentinel rounds=R corrupted=C` (exit 1 if C > 0)

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vrdma_guest::{access, Device, Payload, QpType, QueuePair, SendOp, SendWr, Sge};
use vrdma_tests::{connect_guest_qp, line_field, test_pattern, wait_for_guest_completions};

const PAGE: usize = 4096;
/// Chunks written and checked each round, spread over the target's buffer.
const CHUNKS: u64 = 32;
const CHUNK_LEN: u32 = 64 << 10;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let ok = match words.as_slice() {
        ["writer", socket, to_vm, from_vm, seconds] => writer(
            socket,
            Session::new(to_vm, from_vm),
            Duration::from_secs(seconds.parse().expect("SECONDS")),
        ),
        ["fragment", mib] => fragment(mib.parse().expect("MIB")),
        ["sentinel", seconds, mib] => sentinel(
            Duration::from_secs(seconds.parse().expect("SECONDS")),
            mib.parse().expect("MIB"),
        ),
        _ => {
            eprintln!("usage: pin-check writer SOCKET TO_VM FROM_VM SECONDS | fragment MIB | sentinel SECONDS MIB");
            std::process::exit(2);
        }
    };
    std::process::exit(if ok { 0 } else { 1 });
}

/// A program in the VM, driven line by line through the files of its session.
struct Session {
    to_vm: PathBuf,
    from_vm: PathBuf,
    read: usize,
}

impl Session {
    fn new(to_vm: &str, from_vm: &str) -> Session {
        Session {
            to_vm: PathBuf::from(to_vm),
            from_vm: PathBuf::from(from_vm),
            read: 0,
        }
    }

    fn send(&self, line: &str) {
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.to_vm)
            .expect("open the session's input");
        writeln!(file, "{line}").expect("write to the session");
    }

    /// The program's next line (waiting for it: the VM is emulated, and its file shared).
    fn receive(&mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(900);
        loop {
            let lines = read_lines(&self.from_vm);
            if let Some(line) = lines.get(self.read) {
                self.read += 1;
                return line.clone();
            }
            assert!(Instant::now() < deadline, "no line from the VM");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn read_lines(path: &Path) -> Vec<String> {
    match std::fs::File::open(path) {
        Ok(file) => std::io::BufReader::new(file)
            .lines()
            .map_while(Result::ok)
            .collect(),
        Err(_) => Vec::new(),
    }
}

fn field(line: &str, name: &str) -> u64 {
    let value = line_field(line, name).unwrap_or_else(|| panic!("no {name} in {line}"));
    let (digits, radix) = match value.strip_prefix("0x") {
        Some(hex) => (hex, 16),
        None => (value, 10),
    };
    u64::from_str_radix(digits, radix).unwrap_or_else(|_| panic!("{name} in {line}"))
}

fn writer(socket: &str, mut target: Session, seconds: Duration) -> bool {
    let hello = target.receive();
    let (rkey, va) = (field(&hello, "rkey") as u32, field(&hello, "va"));
    let device = Device::open(socket).expect("attach to the backend");
    let pd = device.alloc_pd().expect("alloc PD");
    let cq = device.create_cq(64).expect("create CQ");
    let qp = QueuePair::builder(QpType::Rc, &cq)
        .max_send_wr(64)
        .build(&pd)
        .expect("create QP");
    let source = device
        .alloc_buffer(u64::from(CHUNK_LEN))
        .expect("source buffer");
    let mr = pd.reg_mr(&source, access::LOCAL_WRITE).expect("register");
    target.send("rc");
    let theirs = field(&target.receive(), "qpn") as u32;
    target.send(&format!("connect {theirs} {}", qp.qp_num()));
    assert_eq!(target.receive(), "ok", "the target connected");
    let (gid_index, gid) = device.gid().expect("GID");
    connect_guest_qp(&qp, gid_index as u8, gid, theirs).expect("connect");

    // Each round's chunks lie one chunk further into their stretch of the target's buffer
    // than the last round's: over the rounds every page is written and checked.
    let length = field(&hello, "len");
    let stride = length / CHUNKS;
    let at = |round: u64, chunk: u64| chunk * stride + round * u64::from(CHUNK_LEN) % stride;
    let (start, mut rounds, mut mismatches) = (Instant::now(), 0u64, 0u64);
    while start.elapsed() < seconds {
        for chunk in 0..CHUNKS {
            let seed = rounds * CHUNKS + chunk;
            source
                .write(0, &test_pattern(CHUNK_LEN as usize, seed))
                .expect("fill the source");
            let write = SendOp::RdmaWrite {
                remote_addr: va + at(rounds, chunk),
                rkey,
            };
            let sge = [Sge {
                addr: source.addr(),
                length: CHUNK_LEN,
                lkey: mr.lkey(),
            }];
            qp.post_send(&[SendWr::new(seed, write, Payload::Sges(&sge))])
                .expect("post the WRITE");
            let done = wait_for_guest_completions(&cq, 1);
            assert!(done[0].is_success(), "WRITE {seed}: {:?}", done[0]);
        }
        for chunk in 0..CHUNKS {
            let seed = rounds * CHUNKS + chunk;
            target.send(&format!("expect {} {CHUNK_LEN} {seed}", at(rounds, chunk)));
        }
        for chunk in 0..CHUNKS {
            let answer = target.receive();
            if answer != "ok" {
                mismatches += 1;
                println!("round {rounds} chunk {chunk}: {answer}");
            }
        }
        rounds += 1;
    }
    println!("done rounds={rounds} mismatches={mismatches}");
    mismatches == 0 && rounds > 0
}

fn fragment(mib: usize) -> bool {
    let len = mib << 20;
    // SAFETY: a new private anonymous mapping; the result is checked.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    let base = base.cast::<u8>();
    for page in (0..len).step_by(PAGE) {
        // SAFETY: inside the mapping made above.
        unsafe { base.add(page).write_volatile(1) };
    }
    for page in (0..len).step_by(2 * PAGE) {
        // SAFETY: one page of the mapping, which nothing uses any more.
        unsafe { libc::munmap(base.add(page).cast(), PAGE) };
    }
    println!("fragmented");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn sentinel(seconds: Duration, mib: usize) -> bool {
    let len = mib << 20;
    let (start, mut rounds, mut corrupted) = (Instant::now(), 0u64, 0u64);
    while start.elapsed() < seconds {
        let mut memory = vec![0u64; len / 8];
        let mark = |i: usize| (i as u64) ^ rounds.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for (i, word) in memory.iter_mut().enumerate() {
            *word = mark(i);
        }
        std::thread::sleep(Duration::from_millis(200));
        let wrong = memory
            .iter()
            .enumerate()
            .filter(|&(i, &word)| std::hint::black_box(word) != mark(i))
            .count();
        if wrong > 0 {
            println!("round {rounds}: {wrong} words changed under the sentinel");
            corrupted += wrong as u64;
        }
        rounds += 1;
    }
    println!("sentinel rounds={rounds} corrupted={corrupted}");
    corrupted == 0
}
