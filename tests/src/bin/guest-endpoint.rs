//! A guest-lib program for the integration tests, run as its own process.
//!
//! usage: guest-endpoint rc SOCKET    attach, create PD/CQ/MR/RC QP, print
//!                                    `qpn=N gid=G rkey=K va=A`, read the peer's line, go to
//!                                    RTS, print `state=S`, then wait for stdin to close
//!        guest-endpoint hold SOCKET  attach, create PD/CQ/MR/QP, print `ready`, sleep
//!        guest-endpoint ping SOCKET N  as `rc`, then N SEND/RECV round trips as the initiator:
//!                                    each message carries a checksum the peer verifies and
//!                                    echoes; prints `done N kicks=K`
//!        guest-endpoint pong SOCKET N  as `rc`, then echoes N messages, verifying each

use std::io::BufRead;

use vrdma_guest::{
    access, wc_opcode, Device, Gid, Payload, QpType, QueuePair, RecvWr, SendOp, SendWr, Sge,
};
use vrdma_tests::{connect_guest_qp, wait_for_guest_completions};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (mode, socket, count) = match args.as_slice() {
        [_, mode, socket] => (mode.as_str(), socket, 0),
        [_, mode, socket, n] => (mode.as_str(), socket, n.parse().expect("N is a number")),
        _ => {
            eprintln!("usage: guest-endpoint rc|hold|ping|pong SOCKET [N]");
            std::process::exit(2);
        }
    };
    let device = Device::attach(socket).expect("attach to the backend");
    let pd = device.alloc_pd().expect("alloc PD");
    let buffer = device.alloc_buffer(1 << 16).expect("shared buffer");
    let mr = pd
        .reg_mr(&buffer, access::LOCAL_WRITE | access::REMOTE_WRITE)
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
        "rc" | "ping" | "pong" => {
            let (gid_index, gid) = device.gid().expect("assigned GID");
            println!(
                "qpn={} gid={} rkey={} va={:#x}",
                qp.qp_num(),
                std::net::Ipv6Addr::from(gid.0),
                mr.rkey(),
                mr.addr()
            );
            let mut line = String::new();
            std::io::stdin()
                .lock()
                .read_line(&mut line)
                .expect("peer line");
            let peer = parse_peer(&line);
            let (peer_qpn, peer_gid) = (peer.qpn, peer.gid);
            connect_guest_qp(&qp, gid_index as u8, peer_gid, peer_qpn)
                .expect("connect to the peer");
            println!("state={}", qp.query().expect("query QP").qp_state);
            let endpoint = Endpoint {
                qp: &qp,
                cq: &cq,
                buffer: &buffer,
                lkey: mr.lkey(),
                addr: mr.addr(),
            };
            match mode {
                "ping" => endpoint.ping(count),
                "pong" => endpoint.pong(count),
                _ => {}
            }
            if mode != "rc" {
                println!("done {count} kicks={}", device.kicks_sent());
            }
            // Keep everything alive until the test closes stdin.
            let _ = std::io::stdin().lock().read_line(&mut line);
        }
        other => panic!("unknown mode {other}"),
    }
}

/// What a peer publishes: enough to connect to it and to address its memory.
struct Peer {
    qpn: u32,
    gid: Gid,
    /// The peer's MR, for one-sided operations (the data path's tests use them).
    _rkey: u32,
    _va: u64,
}

fn parse_peer(line: &str) -> Peer {
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("peer line without {name}: {line}"))
    };
    let gid: std::net::Ipv6Addr = field("gid").parse().expect("peer gid");
    Peer {
        qpn: field("qpn").parse().expect("peer qpn"),
        gid: Gid(gid.octets()),
        _rkey: field("rkey").parse().expect("peer rkey"),
        _va: u64::from_str_radix(field("va").trim_start_matches("0x"), 16).expect("peer va"),
    }
}

const MESSAGE: usize = 512;

struct Endpoint<'a> {
    qp: &'a QueuePair,
    cq: &'a vrdma_guest::CompletionQueue,
    buffer: &'a vrdma_guest::SharedBuffer,
    lkey: u32,
    addr: u64,
}

/// FNV-1a, enough to catch a byte that went astray.
fn checksum(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

impl Endpoint<'_> {
    fn sge(&self, offset: u64) -> Sge {
        Sge {
            addr: self.addr + offset,
            length: MESSAGE as u32,
            lkey: self.lkey,
        }
    }

    fn post_recv(&self, i: u64) {
        self.qp
            .post_recv(&[RecvWr {
                wr_id: i,
                sges: &[self.sge(4096)],
            }])
            .expect("post receive");
    }

    fn send(&self, i: u64, offset: u64) {
        let sges = [self.sge(offset)];
        let wr = SendWr::new(i, SendOp::Send, Payload::Sges(&sges));
        self.qp.post_send(&[wr]).expect("post send");
    }

    /// Waits for the receive of message `i` (and any send completions); checks its checksum.
    fn receive(&self, i: u64) -> [u8; MESSAGE] {
        loop {
            let done = wait_for_guest_completions(self.cq, 1)[0];
            assert!(done.is_success(), "message {i}: {done:?}");
            if done.opcode == wc_opcode::RECV {
                assert_eq!((done.wr_id, done.byte_len), (i, MESSAGE as u32));
                break;
            }
        }
        let mut message = [0u8; MESSAGE];
        self.buffer.read(4096, &mut message).expect("read message");
        let sum = u32::from_le_bytes(message[MESSAGE - 4..].try_into().unwrap());
        assert_eq!(
            checksum(&message[..MESSAGE - 4]),
            sum,
            "message {i}: checksum"
        );
        assert_eq!(message[..8], i.to_le_bytes(), "message {i}: sequence");
        message
    }

    fn ping(&self, count: u64) {
        let mut message = [0u8; MESSAGE];
        for i in 0..count {
            self.post_recv(i);
            message[..8].copy_from_slice(&i.to_le_bytes());
            for (j, byte) in message[8..MESSAGE - 4].iter_mut().enumerate() {
                *byte = (i as usize).wrapping_mul(131).wrapping_add(j) as u8;
            }
            let sum = checksum(&message[..MESSAGE - 4]);
            message[MESSAGE - 4..].copy_from_slice(&sum.to_le_bytes());
            self.buffer.write(0, &message).expect("write message");
            self.send(i, 0);
            let echo = self.receive(i);
            assert!(echo == message, "round trip {i}: the echo differs");
        }
    }

    fn pong(&self, count: u64) {
        self.post_recv(0);
        for i in 0..count {
            let message = self.receive(i);
            if i + 1 < count {
                self.post_recv(i + 1);
            }
            self.buffer.write(0, &message).expect("write echo");
            self.send(i, 0);
        }
        // The last echo's send completion.
        wait_for_guest_completions(self.cq, 1);
    }
}
