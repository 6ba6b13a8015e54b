//! Guests at their quotas, for the 64-guest stress test (tests/tests/quota_stress.rs).
//!
//! usage: quota-guests SOCKET N
//!
//! Attaches N guests to the backend at SOCKET (running with its default quotas), each taking
//! every quota to its limit and checking that the request past it is refused with
//! NO_RESOURCES; prints `ready`. On a line `check` on stdin, every guest does an RDMA WRITE
//! between two of its QPs and checks the bytes, then `served` is printed. When stdin closes
//! the process exits without destroying anything, as an exiting guest does: the backend
//! tears every guest down at once.

use std::io::BufRead;

use vrdma_backend::Quotas;
use vrdma_guest::{
    access, AddressHandle, CompletionQueue, Device, Error, MemoryRegion, Payload, ProtectionDomain,
    QpType, QueuePair, SendOp, SendWr, Sge, SharedBuffer, SharedReceiveQueue, Status,
};
use vrdma_tests::{connect_guest_qp, route_to, wait_for_guest_completions};

/// Each MR covers this much of one buffer, so that the MR count and registered-bytes quotas
/// fill together (256 MRs of 4 MiB are 1 GiB).
const MR_BYTES: u64 = 4 << 20;

/// Everything one guest holds, dropped children first.
struct Guest {
    _ahs: Vec<AddressHandle>,
    qps: Vec<QueuePair>,
    _srqs: Vec<SharedReceiveQueue>,
    mrs: Vec<MemoryRegion>,
    cqs: Vec<CompletionQueue>,
    _pds: Vec<ProtectionDomain>,
    buffer: SharedBuffer,
    device: Device,
}

/// Creates objects until the device refuses one, which must be for want of resources.
fn fill<T>(what: &str, mut create: impl FnMut() -> vrdma_guest::Result<T>) -> Vec<T> {
    let mut made = Vec::new();
    loop {
        match create() {
            Ok(object) => made.push(object),
            Err(e) => {
                assert_no_resources(&e, what);
                return made;
            }
        }
    }
}

/// Checks `result` is a refusal for want of resources.
fn assert_refused<T>(result: vrdma_guest::Result<T>, what: &str) {
    match result {
        Ok(_) => panic!("{what}: not refused"),
        Err(e) => assert_no_resources(&e, what),
    }
}

fn assert_no_resources(e: &Error, what: &str) {
    assert!(
        matches!(
            e,
            Error::Device {
                status: Status::NoResources,
                ..
            }
        ),
        "{what}: refused with {e:?}, not NO_RESOURCES"
    );
}

/// Connects to the backend and takes every quota to its limit.
fn guest_at_its_quotas(socket: &std::path::Path, quotas: &Quotas) -> Guest {
    let device = Device::attach(socket).expect("attach");
    let (gid_index, gid) = device.gid().unwrap();
    let pds = fill("PDs", || device.alloc_pd());
    assert_eq!(pds.len() as u32, quotas.max_pd);
    let pd = &pds[0];
    let mut cqs = vec![device.create_cq(4).unwrap()];
    let qps = fill("QPs", || {
        QueuePair::builder(QpType::Rc, &cqs[0])
            .max_send_wr(1)
            .max_recv_wr(1)
            .build(pd)
    });
    assert_eq!(qps.len() as u32, quotas.max_qp);
    let srqs = fill("SRQs", || pd.create_srq(2, 1));
    assert_eq!(srqs.len() as u32, quotas.max_srq);
    let route = route_to(gid_index, gid);
    let ahs = fill("AHs", || pd.create_ah(&route));
    assert_eq!(ahs.len() as u32, quotas.max_ah);

    // MRs: the count and the registered bytes reach their quotas together; then one MR
    // fewer leaves room in the count but not for twice the bytes.
    let buffer = device.alloc_buffer(2 * MR_BYTES).unwrap();
    let all = access::LOCAL_WRITE | access::REMOTE_WRITE;
    let mut mrs = fill("MRs", || pd.reg_mr_range(buffer.addr(), MR_BYTES, all));
    assert_eq!(mrs.len() as u32, quotas.max_mr);
    assert_eq!(mrs.len() as u64 * MR_BYTES, quotas.max_registered_bytes);
    mrs.pop();
    let too_much = pd.reg_mr_range(buffer.addr(), 2 * MR_BYTES, all);
    assert_refused(too_much, "an MR past the registered-bytes quota");
    mrs.push(pd.reg_mr_range(buffer.addr(), MR_BYTES, all).unwrap());

    // CQs: as deep as the ring quota lets each one be, until the count quota stops them:
    // from the depth at which the CQ quota's worth of CQs would fill the ring quota.
    let per_entry = vrdma_backend::limits::cq_quota_bytes(1);
    let fill_depth = quotas.max_ring_bytes / u64::from(quotas.max_cq) / per_entry;
    let mut depth = 1u32 << fill_depth.max(2).ilog2();
    while cqs.len() < quotas.max_cq as usize {
        match device.create_cq(depth) {
            Ok(cq) => cqs.push(cq),
            Err(e) if depth > 2 => {
                assert_no_resources(&e, "a CQ over the ring quota");
                depth /= 2;
            }
            Err(e) => panic!("the ring quota left no room for a CQ of 2: {e:?}"),
        }
    }
    assert_refused(device.create_cq(2), "a CQ past the CQ quota");
    let small = cqs.pop().unwrap();
    assert_refused(device.create_cq(1 << 14), "a CQ past the ring quota");
    drop(small);
    cqs.push(device.create_cq(2).unwrap());
    Guest {
        _ahs: ahs,
        qps,
        _srqs: srqs,
        mrs,
        cqs,
        _pds: pds,
        buffer,
        device,
    }
}

/// One RDMA WRITE between the guest's first two QPs, checked byte for byte.
fn write_between_own_qps(guest: &Guest, seed: u8) {
    let (a, b) = (&guest.qps[0], &guest.qps[1]);
    let (gid_index, gid) = guest.device.gid().unwrap();
    connect_guest_qp(a, gid_index as u8, gid, b.qp_num()).unwrap();
    connect_guest_qp(b, gid_index as u8, gid, a.qp_num()).unwrap();
    let message = [seed; 64];
    guest.buffer.write(0, &message).unwrap();
    let mr = &guest.mrs[0];
    a.post_send(&[SendWr::new(
        1,
        SendOp::RdmaWrite {
            remote_addr: guest.buffer.addr() + 4096,
            rkey: mr.rkey(),
        },
        Payload::Sges(&[Sge {
            addr: guest.buffer.addr(),
            length: message.len() as u32,
            lkey: mr.lkey(),
        }]),
    )])
    .unwrap();
    let done = wait_for_guest_completions(&guest.cqs[0], 1);
    assert!(done[0].is_success(), "{:?}", done[0]);
    let mut landed = [0u8; 64];
    guest.buffer.read(4096, &mut landed).unwrap();
    assert_eq!(landed, message);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, socket, count] = args.as_slice() else {
        eprintln!("usage: quota-guests SOCKET N");
        std::process::exit(2);
    };
    let count: usize = count.parse().expect("N is a number");
    vrdma_backend::hostverbs::raise_open_file_limit().expect("raise the open file limit");
    let quotas = Quotas::default();
    let socket = std::path::Path::new(socket);
    let guests: Vec<Guest> = (0..count)
        .map(|_| guest_at_its_quotas(socket, &quotas))
        .collect();
    println!("ready");
    for line in std::io::stdin().lock().lines() {
        if line.expect("read stdin") == "check" {
            for (i, guest) in guests.iter().enumerate() {
                write_between_own_qps(guest, i as u8 + 1);
            }
            println!("served");
        }
    }
    std::process::exit(0);
}
