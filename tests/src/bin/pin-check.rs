//! Checks that memory given to the vrdma device of a VM stays where the device was told it is
//! (tests/pci-e2e.sh, part `pinned`; SPEC.md §12).
//!
//! usage: pin-check writer SOCKET TO_VM FROM_VM SECONDS
//!            outside the VM: a guest-lib program attached to the backend at SOCKET that, for
//!            SECONDS, RDMA-WRITEs patterns into the registered buffer of a `guest-endpoint
//!            target` in the VM (driven through the session files TO_VM and FROM_VM, see
//!            tests/pci-guest.sh) and has the target check each round where the program
//!            reads it; prints `done rounds=R mismatches=M` (exit 1 on a mismatch)
//!        pin-check leaver SOCKET TO_VM FROM_VM SECONDS
//!            outside the VM: as `writer`, one round; then tells the target to `leave` (punch
//!            holes in and truncate every memory it shared), WRITEs into the punched buffer
//!            for SECONDS, lets the target unmap it all and exit, and WRITEs on until one
//!            fails; prints `done mismatches=M writes-into-punched-memory=P
//!            writes-after-it-left=N ended=WHY`
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

use vrdma_tests::target_writer::{TargetLines, TargetWriter, CHUNK_LEN};

const PAGE: usize = 4096;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let ok = match words.as_slice() {
        ["writer", socket, to_vm, from_vm, seconds] => writer(
            socket,
            Session::new(to_vm, from_vm),
            Duration::from_secs(seconds.parse().expect("SECONDS")),
        ),
        ["leaver", socket, to_vm, from_vm, seconds] => leaver(
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
            eprintln!("usage: pin-check writer|leaver SOCKET TO_VM FROM_VM SECONDS | fragment MIB | sentinel SECONDS MIB");
            std::process::exit(2);
        }
    };
    std::process::exit(if ok { 0 } else { 1 });
}

/// A program in the VM, driven line by line through the files of its session (NAME.to-vm,
/// NAME.from-vm; its exit code lands in NAME.vm-rc).
struct Session {
    to_vm: PathBuf,
    from_vm: PathBuf,
    exit_code: PathBuf,
    read: usize,
}

impl TargetLines for Session {
    fn send(&mut self, line: &str) {
        Session::send(self, line)
    }

    fn receive(&mut self) -> String {
        Session::receive(self)
    }
}

impl Session {
    fn new(to_vm: &str, from_vm: &str) -> Session {
        let exit_code = match from_vm.strip_suffix(".from-vm") {
            Some(name) => PathBuf::from(format!("{name}.vm-rc")),
            None => panic!("{from_vm} is no session's NAME.from-vm"),
        };
        Session {
            to_vm: PathBuf::from(to_vm),
            from_vm: PathBuf::from(from_vm),
            exit_code,
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

    /// The program's next line (waiting for it: the VM is emulated, and its file shared), or
    /// a panic at once when the program has ended without printing it.
    fn receive(&mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(900);
        loop {
            // The exit code first: a line printed before the program ended is read after it.
            let ended = std::fs::read_to_string(&self.exit_code).ok();
            if let Some(line) = read_lines(&self.from_vm).get(self.read) {
                self.read += 1;
                return line.clone();
            }
            if let Some(code) = ended {
                panic!(
                    "the program in the VM ended (exit code {}) before its next line",
                    code.trim()
                );
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

fn writer(socket: &str, mut target: Session, seconds: Duration) -> bool {
    let writer = TargetWriter::connect(socket, &mut target);
    let (start, mut rounds, mut mismatches) = (Instant::now(), 0u64, 0u64);
    while start.elapsed() < seconds {
        mismatches += writer.round(&mut target, rounds);
        rounds += 1;
    }
    println!("done rounds={rounds} mismatches={mismatches}");
    mismatches == 0 && rounds > 0
}

/// A checked round into the target, then `leave`: the target punches holes in and truncates
/// all the memory it shared; for `seconds` WRITEs go into the buffer it punched (its objects
/// still stand: each must succeed, and lands where the device was told, not in a frame the
/// kernel gave back); then the target unmaps it all and exits, and WRITEs go on until one
/// fails (the service destroyed what the program held).
fn leaver(socket: &str, mut target: Session, seconds: Duration) -> bool {
    let writer = TargetWriter::connect(socket, &mut target);
    let mismatches = writer.round(&mut target, 0);
    target.send("leave");
    assert_eq!(target.receive(), "punched", "the target punched its memory");
    let (start, mut punched_writes) = (Instant::now(), 0u64);
    while start.elapsed() < seconds {
        let offset = punched_writes * u64::from(CHUNK_LEN) % writer.length;
        let done = writer.write(offset, punched_writes);
        assert!(done.is_success(), "WRITE into punched memory: {done:?}");
        punched_writes += 1;
    }
    target.send("exit");
    let mut writes = 0u64;
    let ended = loop {
        let offset = (writes * u64::from(CHUNK_LEN)) % writer.length;
        match writer.write_within(offset, writes, Duration::from_secs(5)) {
            Some(done) if done.is_success() => {}
            Some(done) => break format!("status {}", done.status),
            // A NIC still retrying a QP that is gone.
            None => break "no completion in 5 s".into(),
        }
        writes += 1;
        if writes == 100_000 {
            break "never".into();
        }
    };
    println!("done mismatches={mismatches} writes-into-punched-memory={punched_writes} writes-after-it-left={writes} ended={ended}");
    mismatches == 0 && ended != "never"
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
