//! A guest-lib program for the integration tests, run as its own process.
//!
//! DEVICE is a backend socket path, or `pci` inside a VM (see `Device::open`).
//!
//! usage: guest-endpoint rc DEVICE    attach, create PD/CQ/MR/RC QP, print
//!                                    `qpn=N gid=G rkey=K va=A`, read the peer's line, go to
//!                                    RTS, print `state=S`, then wait for stdin to close
//!        guest-endpoint hold DEVICE  attach, create PD/CQ/MR/QP, print `ready`, sleep
//!        guest-endpoint reopen DEVICE  as `hold`, then after a line on stdin (the device was
//!                                    reset meanwhile) print the `error: ...` the next command
//!                                    gets, open the device again, create a QP and print
//!                                    `reopened qpn=N`
//!        guest-endpoint ping DEVICE N  as `rc`, then N SEND/RECV round trips as the initiator:
//!                                    each message carries a checksum the peer verifies and
//!                                    echoes; prints `done N kicks=K longest_round_trip_us=L`.
//!                                    N = 0: round trips until a line on stdin (after the
//!                                    peer's)
//!        guest-endpoint pong DEVICE N  as `rc`, then echoes N messages, verifying each; N = 0:
//!                                    until the initiator's last message
//!        guest-endpoint target DEVICE BYTES  a passive peer with a BYTES-long registered
//!                                    buffer, driven line by line from stdin (see [`Target`])
//!        guest-endpoint sleep DEVICE as `hold`, the QP connected to itself, then prints
//!                                    `sleeping` and blocks in a wait for its armed CQ's
//!                                    completion event; a line on stdin makes another thread
//!                                    send the QP a message, whose completion wakes it: it
//!                                    checks the message and prints `woken`; if the wait
//!                                    fails (the device went), it prints `error: ...` and
//!                                    exits with 1

use std::io::BufRead;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vrdma_guest::{
    access, wc_opcode, CompletionQueue, Device, MemoryRegion, Payload, ProtectionDomain, QpType,
    QueuePair, RecvWr, SendOp, SendWr, Sge, SharedBuffer, SharedReceiveQueue,
};
use vrdma_tests::{
    check_message, connect_guest_qp, connect_to_itself, ping_message, test_pattern, ud_to_rts,
    wait_for_guest_completions, EndpointAddress, MESSAGE_LEN, RDMA_AREA,
};

/// Set once a line arrives on stdin (read by a thread of its own).
fn stop_on_a_line() -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    std::thread::spawn(move || {
        let _ = std::io::stdin().lock().read_line(&mut String::new());
        flag.store(true, Ordering::Relaxed);
    });
    stop
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (mode, socket, count) = match args.as_slice() {
        [_, mode, socket] => (mode.as_str(), socket, 0),
        [_, mode, socket, n] => (mode.as_str(), socket, n.parse().expect("N is a number")),
        _ => {
            eprintln!("usage: guest-endpoint rc|hold|reopen|ping|pong|target DEVICE [N]");
            std::process::exit(2);
        }
    };
    let device = Device::open(socket).expect("open the vrdma device");
    if mode == "target" {
        return Target::new(device, count).serve();
    }
    let pd = device.alloc_pd().expect("alloc PD");
    let buffer = device.alloc_buffer(1 << 16).expect("shared buffer");
    let mr = pd
        .reg_mr(
            &buffer,
            access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ,
        )
        .expect("register MR");
    let cq = device.create_cq(64).expect("create CQ");
    let qp = QueuePair::builder(QpType::Rc, &cq)
        .max_send_wr(32)
        .max_recv_wr(32)
        .build(&pd)
        .expect("create QP");
    match mode {
        "hold" => {
            println!("ready");
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
        "reopen" => {
            println!("ready");
            let mut line = String::new();
            std::io::stdin()
                .lock()
                .read_line(&mut line)
                .expect("go line");
            match device.alloc_pd() {
                Ok(_) => panic!("the device still works: it was not reset"),
                Err(e) => println!("error: {e}"),
            }
            // Everything of the old device goes first: dropping it resets the device.
            drop((qp, cq, mr, buffer, pd, device));
            let device = Device::open(socket).expect("open the device again");
            let pd = device.alloc_pd().expect("alloc PD");
            let cq = device.create_cq(64).expect("create CQ");
            let qp = QueuePair::builder(QpType::Rc, &cq)
                .build(&pd)
                .expect("create QP");
            println!("reopened qpn={}", qp.qp_num());
        }
        "sleep" => {
            // Blocked in a completion-event wait on an armed CQ; on a line on stdin another
            // thread sends the QP (connected to itself) a message, whose completion wakes it.
            connect_to_itself(&device, &qp).expect("connect the QP to itself");
            let endpoint = Endpoint::new(&qp, &cq, &buffer, &mr);
            endpoint.post_recv(0);
            cq.req_notify(false).expect("arm the CQ");
            println!("sleeping");
            std::thread::scope(|scope| {
                scope.spawn(|| {
                    let _ = std::io::stdin().lock().read_line(&mut String::new());
                    endpoint.send(0, &ping_message(0));
                });
                loop {
                    match device.wait_event(std::time::Duration::from_secs(3600)) {
                        Ok(Some(vrdma_guest::DeviceEvent::CqCompletion(handle)))
                            if handle == cq.handle() =>
                        {
                            break
                        }
                        Ok(_) => {}
                        // The device went (a service restart): said and ended here, since
                        // the scope would otherwise wait for the stdin reader forever.
                        Err(e) => {
                            println!("error: {e}");
                            std::process::exit(1)
                        }
                    }
                }
            });
            endpoint.receive(0);
            println!("woken");
        }
        "rc" | "ping" | "pong" => {
            let (gid_index, gid) = device.gid().expect("assigned GID");
            let address = EndpointAddress {
                qpn: qp.qp_num(),
                psn: vrdma_guest::random_psn(),
                gid,
                rkey: mr.rkey(),
                va: mr.addr(),
            };
            println!("{address}");
            let peer = EndpointAddress::read_peer();
            let far = vrdma_guest::RcPeer {
                qp_num: peer.qpn,
                gid: peer.gid,
                psn: peer.psn,
            };
            qp.connect_rc(gid_index as u8, address.psn, &far)
                .expect("connect to the peer");
            println!("state={:?}", qp.query().expect("query QP").qp_state);
            let endpoint = Endpoint::new(&qp, &cq, &buffer, &mr);
            let done = match mode {
                "ping" if count == 0 => endpoint.ping(u64::MAX, &peer, &stop_on_a_line()),
                "ping" => endpoint.ping(count, &peer, &AtomicBool::new(false)),
                "pong" => endpoint.pong(count),
                _ => 0,
            };
            if mode == "ping" {
                // The longest round trip: how long the peer stopped answering, at most.
                println!(
                    "done {done} kicks={} longest_round_trip_us={}",
                    device.kicks_sent(),
                    endpoint.longest_us.load(Ordering::Relaxed)
                );
            } else if mode == "pong" {
                println!("done {done} kicks={}", device.kicks_sent());
            }
            // Keep everything alive until the test closes stdin.
            let _ = std::io::stdin().lock().read_line(&mut String::new());
        }
        other => panic!("unknown mode {other}"),
    }
}

struct Endpoint<'a> {
    qp: &'a QueuePair,
    cq: &'a CompletionQueue,
    buffer: &'a SharedBuffer,
    lkey: u32,
    addr: u64,
    /// The longest round trip `ping` made, in microseconds.
    longest_us: std::sync::atomic::AtomicU64,
}

/// Where messages are sent from and received into.
const SEND_AT: u64 = 0;
const RECV_AT: u64 = 4096;

impl<'a> Endpoint<'a> {
    fn new(
        qp: &'a QueuePair,
        cq: &'a CompletionQueue,
        buffer: &'a SharedBuffer,
        mr: &MemoryRegion,
    ) -> Endpoint<'a> {
        Endpoint {
            qp,
            cq,
            buffer,
            lkey: mr.lkey(),
            addr: mr.addr(),
            longest_us: std::sync::atomic::AtomicU64::default(),
        }
    }

    fn sge(&self, offset: u64, length: usize) -> Sge {
        Sge {
            addr: self.addr + offset,
            length: length as u32,
            lkey: self.lkey,
        }
    }

    fn post_recv(&self, i: u64) {
        self.qp
            .post_recv(&[RecvWr {
                wr_id: i,
                sges: &[self.sge(RECV_AT, MESSAGE_LEN)],
            }])
            .expect("post receive");
    }

    fn send(&self, i: u64, message: &[u8]) {
        self.send_as(i, SendOp::Send, message)
    }

    fn send_as(&self, i: u64, op: SendOp, message: &[u8]) {
        self.buffer.write(SEND_AT, message).expect("write message");
        let sges = [self.sge(SEND_AT, message.len())];
        let wr = SendWr::new(i, op, Payload::Sges(&sges));
        self.qp.post_send(&[wr]).expect("post send");
    }

    /// Waits for the receive of message `i` (and any send completions); checks it. Also says
    /// whether it is the initiator's last message (which carries an immediate).
    fn receive(&self, i: u64) -> ([u8; MESSAGE_LEN], bool) {
        let last = loop {
            let done = wait_for_guest_completions(self.cq, 1)[0];
            assert!(done.is_success(), "message {i}: {done:?}");
            if done.opcode == wc_opcode::RECV {
                assert_eq!((done.wr_id, done.byte_len), (i, MESSAGE_LEN as u32));
                break done.imm_data.is_some();
            }
        };
        let mut message = [0u8; MESSAGE_LEN];
        self.buffer
            .read(RECV_AT, &mut message)
            .expect("read message");
        check_message(i, &message);
        (message, last)
    }

    /// One-sided operation `op` on the local range `offset..offset + len`; waits for it
    /// (past the completion of the last message sent, which may come after its echo).
    fn rdma(&self, wr_id: u64, op: SendOp, offset: u64, len: usize) {
        let sges = [self.sge(offset, len)];
        self.qp
            .post_send(&[SendWr::new(wr_id, op, Payload::Sges(&sges))])
            .expect("post RDMA");
        let done = loop {
            let done = wait_for_guest_completions(self.cq, 1)[0];
            if !(done.is_success() && done.opcode == wc_opcode::SEND) {
                break done;
            }
        };
        assert!(
            done.is_success() && done.wr_id == wr_id,
            "RDMA {wr_id}: {done:?}"
        );
    }

    /// `count` round trips as the initiator (fewer once `stop` is set); then an RDMA WRITE of
    /// the peer's RDMA area, read back with an RDMA READ and compared, and a last message (with
    /// an immediate) that tells the peer to check what was written. Returns the round trips.
    fn ping(&self, count: u64, peer: &EndpointAddress, stop: &AtomicBool) -> u64 {
        let mut count_done = 0;
        while count_done < count && !stop.load(Ordering::Relaxed) {
            let i = count_done;
            let start = std::time::Instant::now();
            self.post_recv(i);
            let message = ping_message(i);
            self.send(i, &message);
            let (echo, _) = self.receive(i);
            assert!(echo == message, "round trip {i}: the echo differs");
            let took = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.longest_us.fetch_max(took, Ordering::Relaxed);
            count_done += 1;
        }
        let count = count_done;
        let (at, len) = RDMA_AREA;
        let pattern = test_pattern(len, count);
        self.buffer.write(at, &pattern).expect("write pattern");
        let (remote_addr, rkey) = (peer.va + at, peer.rkey);
        self.rdma(1 << 32, SendOp::RdmaWrite { remote_addr, rkey }, at, len);
        let read_at = at + len as u64;
        self.rdma(
            1 << 33,
            SendOp::RdmaRead { remote_addr, rkey },
            read_at,
            len,
        );
        let mut read_back = vec![0u8; len];
        self.buffer
            .read(read_at, &mut read_back)
            .expect("read back");
        assert!(
            read_back == pattern,
            "RDMA READ returned other bytes than were written"
        );
        let last = SendOp::SendWithImm { imm: 1 };
        self.send_as(count, last, &ping_message(count));
        wait_for_guest_completions(self.cq, 1);
        count
    }

    /// Echoes `count` messages (0: until the initiator's last); then checks the initiator's
    /// RDMA WRITE. Returns the round trips.
    fn pong(&self, count: u64) -> u64 {
        self.post_recv(0);
        let mut i = 0;
        loop {
            let (message, last) = self.receive(i);
            if last || i == count && count != 0 {
                assert!(
                    count == 0 || i == count,
                    "the initiator stopped after {i} of {count}"
                );
                break;
            }
            self.post_recv(i + 1);
            self.send(i, &message);
            i += 1;
        }
        let count = i;
        // The initiator's last message: its RDMA WRITE is in place.
        let (at, len) = RDMA_AREA;
        let mut written = vec![0u8; len];
        self.buffer.read(at, &mut written).expect("read RDMA area");
        assert!(
            written == test_pattern(len, count),
            "the RDMA WRITE did not land intact"
        );
        count
    }
}

/// The passive side of the data-path tests: it owns one registered buffer (all remote access)
/// and creates, connects and feeds QPs on request, so that the test process and this one are
/// two guests on two backend connections. One command per stdin line, one reply line each
/// (`wait` replies with one line per completion):
///
/// | command                          | reply                                           |
/// |----------------------------------|-------------------------------------------------|
/// | (on start)                       | `gid_index=I gid=G rkey=K va=A len=L`           |
/// | `rc` / `srq-rc` / `ud QKEY`      | `qpn=N` (a new QP; `srq-rc` receives from the SRQ, `ud` is at RTS) |
/// | `connect QPN PEER_QPN`           | `ok` (RC QP `QPN` at RTS towards `PEER_QPN`)    |
/// | `fill OFFSET LEN SEED`           | `ok` (buffer bytes = `test_pattern(LEN, SEED)`) |
/// | `expect OFFSET LEN SEED`         | `ok` or `mismatch at OFFSET`                    |
/// | `u64 OFFSET`                     | `value=V`                                       |
/// | `recv QPN\|srq FIRST COUNT SLOT` | `ok` once COUNT receives, `wr_id` FIRST.., each SLOT bytes from offset 0, are with the device |
/// | `wait COUNT`                     | COUNT lines `wr_id=W qpn=Q src_qp=S len=L status=T grh=G` |
/// | `leave`                          | `punched`; after the next line the process is gone: see [`leave_every_shared_memory`] |
struct Target {
    device: Device,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    buffer: SharedBuffer,
    mr: MemoryRegion,
    srq: SharedReceiveQueue,
    qps: Vec<QueuePair>,
}

impl Target {
    fn new(device: Device, bytes: u64) -> Target {
        let pd = device.alloc_pd().expect("alloc PD");
        let buffer = device.alloc_buffer(bytes).expect("shared buffer");
        let all = access::LOCAL_WRITE
            | access::REMOTE_WRITE
            | access::REMOTE_READ
            | access::REMOTE_ATOMIC;
        let mr = pd.reg_mr(&buffer, all).expect("register MR");
        let cq = device.create_cq(1024).expect("create CQ");
        let srq = pd.create_srq(256, 1).expect("create SRQ");
        Target {
            device,
            pd,
            cq,
            buffer,
            mr,
            srq,
            qps: Vec::new(),
        }
    }

    fn serve(mut self) {
        let (gid_index, gid) = self.device.gid().expect("assigned GID");
        println!(
            "gid_index={gid_index} gid={} rkey={} va={:#x} len={}",
            std::net::Ipv6Addr::from(gid.0),
            self.mr.rkey(),
            self.mr.addr(),
            self.mr.len()
        );
        let mut lines = std::io::stdin().lock().lines();
        while let Some(line) = lines.next() {
            let line = line.expect("read a command");
            let words: Vec<&str> = line.split_whitespace().collect();
            let number = |i: usize| -> u64 {
                let word = words.get(i).unwrap_or_else(|| panic!("{line}: too short"));
                word.parse().unwrap_or_else(|_| panic!("{line}: {word}?"))
            };
            match words.first().copied() {
                Some("rc") => println!("qpn={}", self.create_qp(QpType::Rc, false).qp_num()),
                Some("srq-rc") => println!("qpn={}", self.create_qp(QpType::Rc, true).qp_num()),
                Some("ud") => {
                    let qp = self.create_qp(QpType::Ud, false);
                    ud_to_rts(qp, number(1) as u32).expect("UD QP to RTS");
                    println!("qpn={}", qp.qp_num());
                }
                Some("connect") => {
                    let (gid_index, gid) = self.device.gid().expect("assigned GID");
                    connect_guest_qp(self.qp(number(1)), gid_index as u8, gid, number(2) as u32)
                        .expect("connect");
                    println!("ok");
                }
                Some("fill") => {
                    let bytes = test_pattern(number(2) as usize, number(3));
                    self.buffer.write(number(1), &bytes).expect("fill");
                    println!("ok");
                }
                Some("expect") => {
                    let (offset, expected) =
                        (number(1), test_pattern(number(2) as usize, number(3)));
                    let mut actual = vec![0u8; expected.len()];
                    self.buffer.read(offset, &mut actual).expect("read buffer");
                    match actual.iter().zip(&expected).position(|(a, e)| a != e) {
                        None => println!("ok"),
                        Some(at) => println!("mismatch at {}", offset + at as u64),
                    }
                }
                Some("u64") => {
                    let mut value = [0u8; 8];
                    self.buffer
                        .read(number(1), &mut value)
                        .expect("read buffer");
                    println!("value={}", u64::from_le_bytes(value));
                }
                Some("recv") => {
                    let (first, count, slot) = (number(2), number(3), number(4));
                    for n in first..first + count {
                        let sges = [Sge {
                            addr: self.mr.addr() + (n - first) * slot,
                            length: slot as u32,
                            lkey: self.mr.lkey(),
                        }];
                        let wr = [RecvWr {
                            wr_id: n,
                            sges: &sges,
                        }];
                        match words[1] {
                            "srq" => self.srq.post_recv(&wr),
                            _ => self.qp(number(1)).post_recv(&wr),
                        }
                        .expect("post receive");
                    }
                    if words[1] != "srq" {
                        // UD drops what arrives before a receive: return once the device has
                        // taken them all.
                        while self.qp(number(1)).recv_backlog().expect("backlog") > 0 {
                            std::thread::yield_now();
                        }
                    }
                    println!("ok");
                }
                Some("wait") => {
                    for done in wait_for_guest_completions(&self.cq, number(1) as usize) {
                        println!(
                            "wr_id={} qpn={} src_qp={} len={} status={} grh={}",
                            done.wr_id,
                            done.qp_num,
                            done.src_qp,
                            done.byte_len,
                            done.status,
                            u8::from(done.grh)
                        );
                    }
                }
                Some("leave") => leave_every_shared_memory(|| {
                    let _ = lines.next();
                }),
                _ => panic!("unknown command: {line}"),
            }
        }
    }

    fn create_qp(&mut self, qp_type: QpType, on_srq: bool) -> &QueuePair {
        let mut builder = QueuePair::builder(qp_type, &self.cq)
            .max_send_wr(16)
            .max_recv_wr(256);
        if on_srq {
            builder = builder.srq(&self.srq);
        }
        let qp = builder.build(&self.pd).expect("create QP");
        self.qps.push(qp);
        self.qps.last().unwrap()
    }

    fn qp(&self, qpn: u64) -> &QueuePair {
        self.qps
            .iter()
            .find(|qp| u64::from(qp.qp_num()) == qpn)
            .unwrap_or_else(|| panic!("no QP {qpn} here"))
    }
}

/// What a program that means harm (or just ends badly) can do to the memory it shared with the
/// device (SPEC.md §12): punch holes in every memfd it mapped and truncate each; prints
/// `punched` and lives on (its objects too) until `next_line` returns, so that a peer can write
/// into the memory it punched meanwhile; then unmaps it all and exits without telling anyone.
fn leave_every_shared_memory(next_line: impl FnOnce()) -> ! {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    let shared: Vec<(usize, usize)> = maps
        .lines()
        .filter(|line| line.contains("/memfd:"))
        .filter_map(|line| {
            let (start, end) = line.split_whitespace().next()?.split_once('-')?;
            let start = usize::from_str_radix(start, 16).ok()?;
            Some((start, usize::from_str_radix(end, 16).ok()? - start))
        })
        .collect();
    for &(start, len) in &shared {
        // SAFETY: a mapping of this process (from its maps); removing its pages makes the
        // memory read as zeroes, which nothing of this process reads any more.
        unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_REMOVE) };
    }
    for fd in std::fs::read_dir("/proc/self/fd")
        .expect("read /proc/self/fd")
        .flatten()
    {
        let is_memfd = std::fs::read_link(fd.path())
            .is_ok_and(|target| target.to_string_lossy().starts_with("/memfd:"));
        if let (true, Ok(fd)) = (is_memfd, fd.file_name().to_string_lossy().parse::<i32>()) {
            // SAFETY: truncating a descriptor of this process; a sealed one refuses.
            unsafe { libc::ftruncate(fd, 0) };
        }
    }
    println!("punched");
    let _ = std::io::Write::flush(&mut std::io::stdout());
    next_line();
    for &(start, len) in &shared {
        // SAFETY: the process exits right after; no thread of it is told to touch this memory
        // again (one that does ends the process, which is what a crash would do too).
        unsafe { libc::munmap(start as *mut libc::c_void, len) };
    }
    // SAFETY: ends the process at once, running nothing of it (no destructor, no handler).
    unsafe { libc::_exit(0) }
}
