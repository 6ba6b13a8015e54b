//! A guest-lib program for the integration tests, run as its own process.
//!
//! usage: guest-endpoint rc SOCKET    attach, create PD/CQ/MR/RC QP, print
//!                                    `qpn=N gid=G rkey=K va=A`, read the peer's line, go to
//!                                    RTS, print `state=S`, then wait for stdin to close
//!        guest-endpoint hold SOCKET  attach, create PD/CQ/MR/QP, print `ready`, sleep

use std::io::BufRead;

use vrdma_guest::{access, Device, Gid, QpType, QueuePair};
use vrdma_tests::connect_guest_qp;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, mode, socket] = args.as_slice() else {
        eprintln!("usage: guest-endpoint rc|hold SOCKET");
        std::process::exit(2);
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
    match mode.as_str() {
        "hold" => {
            println!("ready");
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
        "rc" => {
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
