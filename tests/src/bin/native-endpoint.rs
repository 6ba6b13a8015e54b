//! A plain ibverbs program (the backend's `hostverbs` on the test device, no vrdma), speaking
//! the same line protocol as `guest-endpoint`: the native peer of a vrdma guest.
//!
//! usage: native-endpoint ping N   print `qpn=N gid=G rkey=K va=A`, read the peer's line, go
//!                                 to RTS, print `state=RTS`, make N checked SEND/RECV round
//!                                 trips, RDMA WRITE the peer's RDMA area and READ it back,
//!                                 send message N (so the peer checks the WRITE), print
//!                                 `done N`, then wait for stdin to close

use std::io::BufRead;
use std::sync::Arc;

use vrdma_backend::hostverbs::{
    AnonymousMemory, MemoryRegion, Payload, PinnedMemory, RecvWr, SendOp, SendWr, Sge,
};
use vrdma_tests::{
    check_message, open_test_device, ping_message, test_pattern, wait_for_completions,
    EndpointAddress, RcEndpoint, FULL_ACCESS, MESSAGE_LEN, PORT, RDMA_AREA,
};

const BUFFER: usize = 64 << 10;
const SEND_AT: u64 = 0;
const RECV_AT: u64 = 4096;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let count: u64 = match args.as_slice() {
        [_, mode, n] if mode == "ping" => n.parse().expect("N is a number"),
        _ => {
            eprintln!("usage: native-endpoint ping N");
            std::process::exit(2);
        }
    };
    let context = open_test_device();
    let (gid_index, gid) = context
        .find_roce_v2_ipv4_gid(PORT)
        .expect("the test device needs a RoCEv2 GID with an IPv4 address");
    let endpoint = RcEndpoint::new(&context);
    let memory = Arc::new(AnonymousMemory::new(BUFFER).expect("memory"));
    let mr = endpoint
        .pd
        .reg_mr(
            memory.clone() as Arc<dyn PinnedMemory>,
            0x5000_0000,
            FULL_ACCESS,
        )
        .expect("register MR");
    let address = EndpointAddress {
        qpn: endpoint.qp.qp_num(),
        psn: vrdma_guest::random_psn(),
        gid,
        rkey: mr.rkey(),
        va: mr.iova(),
    };
    println!("{address}");
    let peer = EndpointAddress::read_peer();
    endpoint.connect(gid_index as u8, peer.gid, peer.qpn, (address.psn, peer.psn));
    println!("state=RTS");

    let native = Native {
        endpoint: &endpoint,
        memory: &memory,
        mr: &mr,
    };
    for i in 0..count {
        native.post_recv(i);
        let message = ping_message(i);
        native.send(i, &message);
        let echo = native.receive(i);
        assert!(echo == message, "round trip {i}: the echo differs");
    }
    let (at, len) = RDMA_AREA;
    let pattern = test_pattern(len, count);
    memory.write(at as usize, &pattern).expect("write pattern");
    let (remote_addr, rkey) = (peer.va + at, peer.rkey);
    native.rdma(SendOp::RdmaWrite { remote_addr, rkey }, at, len);
    let read_at = at + len as u64;
    native.rdma(SendOp::RdmaRead { remote_addr, rkey }, read_at, len);
    let mut read_back = vec![0u8; len];
    memory
        .read(read_at as usize, &mut read_back)
        .expect("read back");
    assert!(
        read_back == pattern,
        "RDMA READ returned other bytes than were written"
    );
    native.send(count, &ping_message(count));
    wait_for_completions(&endpoint.cq, 1);
    println!("done {count}");
    let _ = std::io::stdin().lock().read_line(&mut String::new());
}

struct Native<'a> {
    endpoint: &'a RcEndpoint,
    memory: &'a AnonymousMemory,
    mr: &'a MemoryRegion,
}

impl Native<'_> {
    fn sge(&self, offset: u64, length: usize) -> Sge {
        Sge {
            addr: self.mr.iova() + offset,
            length: length as u32,
            lkey: self.mr.lkey(),
        }
    }

    fn post_recv(&self, i: u64) {
        let sges = [self.sge(RECV_AT, MESSAGE_LEN)];
        let wr = RecvWr {
            wr_id: i,
            sges: &sges,
        };
        self.endpoint.qp.post_recv(&[wr]).expect("post receive");
    }

    fn post(&self, wr_id: u64, op: SendOp, offset: u64, len: usize) {
        let sges = [self.sge(offset, len)];
        let wr = SendWr::new(wr_id, op, Payload::Sges(&sges));
        self.endpoint.qp.post_send(&[wr]).expect("post send");
    }

    fn send(&self, i: u64, message: &[u8]) {
        self.memory
            .write(SEND_AT as usize, message)
            .expect("write message");
        self.post(i, SendOp::Send, SEND_AT, message.len());
    }

    /// Waits for the receive of message `i` (and any send completions); checks it.
    fn receive(&self, i: u64) -> [u8; MESSAGE_LEN] {
        loop {
            let done = wait_for_completions(&self.endpoint.cq, 1).remove(0);
            assert!(done.is_success(), "message {i}: {done:?}");
            if done.is_recv() {
                assert_eq!((done.wr_id(), done.byte_len()), (i, MESSAGE_LEN as u32));
                break;
            }
        }
        let mut message = [0u8; MESSAGE_LEN];
        self.memory
            .read(RECV_AT as usize, &mut message)
            .expect("read message");
        check_message(i, &message);
        message
    }

    fn rdma(&self, op: SendOp, offset: u64, len: usize) {
        self.post(u64::MAX, op, offset, len);
        let done = wait_for_completions(&self.endpoint.cq, 1).remove(0);
        assert!(
            done.is_success() && done.wr_id() == u64::MAX,
            "RDMA: {done:?}"
        );
    }
}
