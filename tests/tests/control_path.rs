//! The control path end to end: guest-lib attached directly to the vhost-user backend, the
//! backend on the test device's host verbs (see `vrdma_tests`: a loopback device under plain
//! `cargo test`, rxe0 in the VM harness).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;

use vrdma_backend::hostverbs::{Payload, PinnedMemory, SendOp, SendWr, Sge};
use vrdma_guest::spec::ctrl::{HandleRequest, Opcode, RegMrRequest, RequestHeader};
use vrdma_guest::spec::mem::PageList;
use vrdma_guest::spec::{ByteValued, Le16, Le32, Le64};
use vrdma_guest::{
    access, qp_attr_mask as mask, AhAttr, Device, DirectOptions, Error, QpAttr, QpState, QpType,
    QueuePair, Status,
};
use vrdma_tests::{
    connect_guest_qp, control_request, host_gid_index, host_resource_counts, open_test_device,
    response_status, route_to, start_backend, wait_for_completions, wait_for_host_counts,
    RcEndpoint, FULL_ACCESS,
};

const GUEST_ENDPOINT: &str = env!("CARGO_BIN_EXE_guest-endpoint");

fn read_line(reader: &mut impl BufRead) -> String {
    let mut line = String::new();
    reader
        .read_line(&mut line)
        .expect("read from guest process");
    line.trim().to_string()
}

#[test]
fn two_guest_processes_on_their_own_connections_reach_rts() {
    let backend = start_backend();
    let baseline = host_resource_counts();
    let spawn = || {
        Command::new(GUEST_ENDPOINT)
            .args(["rc", backend.socket.to_str().unwrap()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start guest-endpoint")
    };
    let (mut a, mut b) = (spawn(), spawn());
    let mut a_out = BufReader::new(a.stdout.take().unwrap());
    let mut b_out = BufReader::new(b.stdout.take().unwrap());
    let (a_addr, b_addr) = (read_line(&mut a_out), read_line(&mut b_out));
    assert!(
        a_addr.starts_with("qpn=") && b_addr.starts_with("qpn="),
        "{a_addr} / {b_addr}"
    );
    assert_ne!(a_addr, b_addr);
    let mut a_in = a.stdin.take().unwrap();
    let mut b_in = b.stdin.take().unwrap();
    writeln!(a_in, "{b_addr}").unwrap();
    writeln!(b_in, "{a_addr}").unwrap();
    let rts = format!("state={:?}", QpState::Rts);
    assert_eq!(read_line(&mut a_out), rts);
    assert_eq!(read_line(&mut b_out), rts);
    drop((a_in, b_in)); // the endpoints exit when stdin closes
    assert!(a.wait().unwrap().success() && b.wait().unwrap().success());
    wait_for_host_counts(&baseline);
}

/// Connects a guest-lib QP and a native QP on the same device to each other.
fn connect_guest_to_native(device: &Device, guest: &QueuePair, native: &RcEndpoint) {
    let (gid_index, gid) = device.gid().expect("the guest's GID");
    connect_guest_qp(guest, gid_index as u8, gid, native.qp.qp_num()).expect("guest QP to RTS");
    // The guest's GID is the host's (no --guest-ip), at the host's own index.
    let native_index = host_gid_index(native.pd.context(), gid);
    native.connect(native_index, gid, guest.qp_num(), (0x1234, 0x1234));
}

/// A native peer RDMA-writes into a guest-lib MR at the guest's own address; the bytes must
/// appear in the guest's buffer (MTT translation and IOVA = guest VA, end to end).
fn native_peer_writes_into_guest_memory(options: DirectOptions, buffer_len: u64) {
    let backend = start_backend();
    let baseline = host_resource_counts();
    {
        let device = Device::attach_with(&backend.socket, options).expect("attach");
        let pd = device.alloc_pd().unwrap();
        let buffer = device.alloc_buffer(buffer_len).unwrap();
        let mr = pd
            .reg_mr(&buffer, access::LOCAL_WRITE | access::REMOTE_WRITE)
            .unwrap();
        assert_eq!(mr.addr(), buffer.addr());
        let cq = device.create_cq(16).unwrap();
        let guest_qp = QueuePair::builder(QpType::Rc, &cq).build(&pd).unwrap();

        let context = open_test_device();
        let native = RcEndpoint::new(&context);
        connect_guest_to_native(&device, &guest_qp, &native);
        assert_eq!(guest_qp.query().unwrap().qp_state, QpState::Rts);

        let source = Arc::new(vrdma_backend::hostverbs::AnonymousMemory::new(8192).unwrap());
        let source_mr = native
            .pd
            .reg_mr(
                source.clone() as Arc<dyn PinnedMemory>,
                0x9000_0000,
                FULL_ACCESS,
            )
            .unwrap();
        let message = b"written by a native peer at the guest's address";
        source.write(0, message).unwrap();
        let sge = [Sge {
            addr: source_mr.iova(),
            length: message.len() as u32,
            lkey: source_mr.lkey(),
        }];
        // Near the end of the buffer, so the write crosses into the last page the list names.
        let target = buffer.addr() + buffer_len - 4096 - 20;
        let write = SendOp::RdmaWrite {
            remote_addr: target,
            rkey: mr.rkey(),
        };
        native
            .qp
            .post_send(&[SendWr::new(1, write, Payload::Sges(&sge))])
            .unwrap();
        let done = wait_for_completions(&native.cq, 1);
        assert!(done[0].is_success(), "{:?}", done[0]);
        let mut landed = [0u8; 47];
        buffer.read(target - buffer.addr(), &mut landed).unwrap();
        assert_eq!(&landed, message);
    }
    wait_for_host_counts(&baseline);
}

#[test]
fn a_native_peer_writes_into_a_guest_mr_at_the_guest_address() {
    // 4 MiB of 4 KiB pages: 1024 pages, so REG_MR uses the indirect page list form.
    native_peer_writes_into_guest_memory(DirectOptions::default(), 4 << 20);
}

#[test]
fn a_guest_mr_over_huge_pages_works_the_same() {
    std::fs::write("/proc/sys/vm/nr_hugepages", "64")
        .expect("reserve huge pages (root in the test guest)");
    native_peer_writes_into_guest_memory(
        DirectOptions {
            huge_pages: true,
            ..Default::default()
        },
        8 << 20,
    );
}

fn handle_request(handle: u32) -> HandleRequest {
    HandleRequest {
        handle: Le32::from(handle),
        reserved: Le32::from(0),
    }
}

#[test]
fn malformed_requests_get_the_spec_status_and_leak_nothing() {
    let backend = start_backend();
    let baseline = host_resource_counts();
    {
        let device = Device::attach(&backend.socket).unwrap();
        let other = Device::attach(&backend.socket).unwrap();
        let pd = device.alloc_pd().unwrap();
        let cq = device.create_cq(16).unwrap();
        let buffer = device.alloc_buffer(8192).unwrap();
        let raw = |bytes: &[u8]| response_status(&device.raw_control(bytes, 64).unwrap());
        let pd_handle = handle_request(pd.handle());

        assert_eq!(
            raw(&control_request(0x77, &pd_handle)),
            Status::Unsupported as u16,
            "unknown opcode"
        );
        assert_eq!(
            raw(&control_request(Opcode::DeallocPd as u16, &pd_handle)[..10]),
            Status::BadLength as u16,
            "short request"
        );
        assert_eq!(
            raw(&[1, 0]),
            Status::BadLength as u16,
            "shorter than a header"
        );
        let mut wrong_length = control_request(Opcode::DeallocPd as u16, &pd_handle);
        wrong_length[4] = 4;
        assert_eq!(
            raw(&wrong_length),
            Status::BadLength as u16,
            "length field disagrees"
        );
        let mut flags = control_request(Opcode::DeallocPd as u16, &pd_handle);
        flags[2] = 1;
        assert_eq!(raw(&flags), Status::InvalidArgument as u16, "nonzero flags");
        assert!(
            device
                .raw_control(&control_request(Opcode::QueryDevice as u16, &pd_handle), 4)
                .unwrap()
                .is_empty(),
            "no room for a header"
        );
        assert_eq!(
            response_status(
                &device
                    .raw_control(&control_request(Opcode::QueryGid as u16, &pd_handle), 8)
                    .unwrap()
            ),
            Status::BadLength as u16,
            "no room for the response"
        );

        // REG_MR naming guest-physical pages outside guest memory, or overflowing.
        let list_page = device.alloc_buffer(4096).unwrap();
        let reg = |virt_addr: u64, length: u64, page: u64| {
            list_page.write(0, &page.to_le_bytes()).unwrap();
            let req = RegMrRequest {
                pd: Le32::from(pd.handle()),
                access: Le32::from(access::LOCAL_WRITE),
                virt_addr: Le64::from(virt_addr),
                length: Le64::from(length),
                pages: PageList {
                    addr: Le64::from(list_page.addr()),
                    npages: Le32::from(1),
                    page_shift: 12,
                    form: 0,
                    reserved: Le16::from(0),
                },
            };
            device
                .raw_control(&control_request(Opcode::RegMr as u16, &req), 64)
                .unwrap()
        };
        assert_eq!(
            response_status(&reg(buffer.addr(), 4096, 0x1000)),
            Status::BadAddress as u16,
            "GPA outside guest RAM"
        );
        assert_eq!(
            response_status(&reg(buffer.addr(), 4096, u64::MAX - 4095)),
            Status::BadAddress as u16,
            "GPA + page size overflows"
        );
        assert_eq!(
            response_status(&reg(u64::MAX - 100, 4096, buffer.addr())),
            Status::BadAddress as u16,
            "VA + length overflows"
        );
        assert_eq!(
            response_status(&reg(buffer.addr(), 4096, buffer.addr() + 8)),
            Status::BadAddress as u16,
            "misaligned page"
        );
        assert_eq!(
            response_status(&reg(buffer.addr(), 8192, buffer.addr())),
            Status::InvalidArgument as u16,
            "page count too small"
        );
        let registered = reg(buffer.addr(), 4096, buffer.addr());
        assert_eq!(
            response_status(&registered),
            Status::Ok as u16,
            "the well-formed one passes"
        );
        let mr_handle = handle_request(u32::from_le_bytes(registered[8..12].try_into().unwrap()));

        // Handles: wrong type, another connection's, destroyed twice.
        assert_eq!(
            raw(&control_request(
                Opcode::DeallocPd as u16,
                &handle_request(cq.handle())
            )),
            Status::BadHandle as u16,
            "CQ handle as a PD"
        );
        let foreign = response_status(
            &other
                .raw_control(
                    &control_request(Opcode::DestroyCq as u16, &handle_request(cq.handle())),
                    64,
                )
                .unwrap(),
        );
        assert_eq!(
            foreign,
            Status::BadHandle as u16,
            "another connection's handle"
        );
        assert_eq!(
            raw(&control_request(Opcode::DeallocPd as u16, &pd_handle)),
            Status::Busy as u16,
            "PD still has an MR"
        );
        let dereg = control_request(Opcode::DeregMr as u16, &mr_handle);
        assert_eq!(raw(&dereg), Status::Ok as u16);
        assert_eq!(raw(&dereg), Status::BadHandle as u16, "destroyed twice");

        // Memory the device cannot reach is refused before anything is sent.
        let private = vec![0u8; 4096];
        match pd.reg_mr_range(private.as_ptr() as u64, 4096, access::LOCAL_WRITE) {
            Err(Error::NotShared { .. }) => {}
            other => panic!("registering private memory: {other:?}"),
        }
        // The device still serves this connection.
        assert!(device.query_device().unwrap().max_qp.to_native() > 0);
    }
    wait_for_host_counts(&baseline);
}

#[test]
fn killing_a_guest_process_releases_every_host_object() {
    let backend = start_backend();
    let baseline = host_resource_counts();
    let mut guest = Command::new(GUEST_ENDPOINT)
        .args(["hold", backend.socket.to_str().unwrap()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(guest.stdout.take().unwrap());
    assert_eq!(read_line(&mut out), "ready");
    let held = host_resource_counts();
    for kind in ["pd", "cq", "qp", "mr"] {
        assert!(
            held[kind] > baseline[kind],
            "{kind}: {held:?} vs {baseline:?}"
        );
    }
    guest.kill().unwrap(); // SIGKILL
    guest.wait().unwrap();
    wait_for_host_counts(&baseline);
}

#[test]
fn shared_memory_grows_with_add_mem_reg_and_registers_like_the_first_region() {
    // More than the first shared region holds: guest-lib adds a region with ADD_MEM_REG.
    native_peer_writes_into_guest_memory(DirectOptions::default(), 40 << 20);
}

#[test]
fn ud_qps_and_address_handles() {
    let backend = start_backend();
    let baseline = host_resource_counts();
    {
        let device = Device::attach(&backend.socket).unwrap();
        let pd = device.alloc_pd().unwrap();
        let cq = device.create_cq(16).unwrap();
        let qp = QueuePair::builder(QpType::Ud, &cq).build(&pd).unwrap();
        let init = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qkey: 0x1111,
            ..Default::default()
        };
        qp.modify(
            &init,
            mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY,
        )
        .unwrap();
        qp.modify(
            &QpAttr {
                qp_state: QpState::Rtr,
                ..Default::default()
            },
            mask::STATE,
        )
        .unwrap();
        let rts = QpAttr {
            qp_state: QpState::Rts,
            sq_psn: 7,
            ..Default::default()
        };
        qp.modify(&rts, mask::STATE | mask::SQ_PSN).unwrap();
        let attr = qp.query().unwrap();
        assert_eq!((attr.qp_state, attr.qkey), (QpState::Rts, 0x1111));

        let (gid_index, gid) = device.gid().unwrap();
        let route = route_to(gid_index, gid);
        let ah = pd.create_ah(&route).expect("create AH");
        assert_ne!(ah.handle(), 0);
        // A guest may only source traffic from the GID assigned to it.
        let spoofed = AhAttr {
            sgid_index: (gid_index as u8).wrapping_add(1),
            ..route
        };
        let refused = pd.create_ah(&spoofed).expect_err("another GID as source");
        assert_eq!(refused.status(), Some(Status::InvalidArgument));
        // Privileged Q_Keys are refused.
        let privileged = QpAttr {
            qkey: 0x8000_0001,
            ..Default::default()
        };
        assert_eq!(
            qp.modify(&privileged, mask::QKEY).err().unwrap().status(),
            Some(Status::InvalidArgument)
        );
    }
    wait_for_host_counts(&baseline);
}

#[test]
fn a_device_not_yet_initialised_answers_not_ready() {
    use vrdma_guest::transport::Transport;
    let backend = start_backend();
    // The transport alone: attached, but SET_NOTIFY_AREA (SPEC.md §9 step 3) never sent.
    let transport =
        vrdma_guest::direct::DirectTransport::connect(&backend.socket, DirectOptions::default())
            .unwrap();
    let mut response = [0u8; 1024]; // room for any response
    let mut status = |bytes: &[u8]| {
        let written = transport.control(bytes, &mut response).unwrap();
        response_status(&response[..written])
    };
    let alloc_pd = [RequestHeader {
        opcode: Le16::from(Opcode::AllocPd as u16),
        flags: Le16::from(0),
        length: Le32::from(0),
    }
    .as_slice()]
    .concat();
    assert_eq!(status(&alloc_pd), Status::NotReady as u16);
    let destroy = control_request(Opcode::DeallocPd as u16, &handle_request(1));
    assert_eq!(status(&destroy), Status::NotReady as u16);
    let query = [RequestHeader {
        opcode: Le16::from(Opcode::QueryDevice as u16),
        flags: Le16::from(0),
        length: Le32::from(0),
    }
    .as_slice()]
    .concat();
    assert_eq!(status(&query), Status::Ok as u16, "queries need no set-up");
}

/// Doorbell areas (SPEC.md §8.6): one is added where its memory and size follow the rules,
/// the rest are refused with the spec's status, and an area goes only as the spec allows.
/// (That queues created in an area ring through it is what the guest service's tests show:
/// each of its programs has one.)
#[test]
fn doorbell_areas_are_added_where_the_rules_allow_and_refused_elsewhere() {
    use vrdma_guest::spec::ctrl::AddDoorbellAreaRequest;
    let backend = start_backend();
    let device = Device::attach(&backend.socket).unwrap();
    let memory = device.alloc_buffer(3 * 4096).unwrap();
    let (states, bitmap) = (memory.addr(), memory.addr() + 4096);
    let add = |states: u64, bitmap: u64, bits: u32| {
        let request = AddDoorbellAreaRequest {
            addr: Le64::from(states),
            doorbell_bitmap: Le64::from(bitmap),
            bits: Le32::from(bits),
            reserved: Le32::from(0),
        };
        device
            .raw_control(
                &control_request(Opcode::AddDoorbellArea as u16, &request),
                64,
            )
            .unwrap()
    };
    let destroy = |area: u32| {
        let request = control_request(Opcode::DestroyDoorbellArea as u16, &handle_request(area));
        response_status(&device.raw_control(&request, 64).unwrap())
    };
    let added = add(states, bitmap, 128);
    assert_eq!(response_status(&added), Status::Ok as u16);
    let area = u32::from_le_bytes(added[8..12].try_into().unwrap());
    let bits = u32::from_le_bytes(added[12..16].try_into().unwrap());
    assert!(area >= 1, "area {area}: 0 is SET_NOTIFY_AREA's");
    assert_eq!(bits, 128);
    let refused = [
        (add(states, bitmap, 0), Status::InvalidArgument, "no bits"),
        (
            add(states, bitmap, 96),
            Status::InvalidArgument,
            "not whole words",
        ),
        (
            add(states, bitmap, 1 << 20),
            Status::InvalidArgument,
            "more bits than the device's",
        ),
        (
            add(states + 8, bitmap, 64),
            Status::BadAddress,
            "states misaligned",
        ),
        (
            add(states, bitmap + 8, 64),
            Status::BadAddress,
            "bitmap misaligned",
        ),
        (
            add(states, 1 << 62, 64),
            Status::BadAddress,
            "bitmap outside guest memory",
        ),
        (
            add(4096 - 64 + (1 << 62), bitmap, 64),
            Status::BadAddress,
            "states outside guest memory",
        ),
    ];
    for (reply, status, what) in refused {
        assert_eq!(response_status(&reply), status as u16, "{what}");
    }
    assert_eq!(
        destroy(0),
        Status::BadHandle as u16,
        "area 0 goes only with a reset"
    );
    assert_eq!(
        destroy(area + 1000),
        Status::BadHandle as u16,
        "no such area"
    );
    assert_eq!(destroy(area), Status::Ok as u16);
    assert_eq!(destroy(area), Status::BadHandle as u16, "already gone");
}

/// A driver that says when it resets keeps its objects across a stop of the queues (a paused
/// VM, tests/pci-e2e.sh part paused), so RESET must still destroy them all: the host's objects
/// return to where they were, and the device wants SET_NOTIFY_AREA again (SPEC.md §9).
#[test]
fn reset_destroys_every_object_of_the_driver() {
    let backend = start_backend();
    let device = Device::attach(&backend.socket).unwrap();
    // The connection's own context (and the one ready for the next) stay.
    let baseline = host_resource_counts();
    let pd = device.alloc_pd().unwrap();
    let cq = device.create_cq(16).unwrap();
    let qp = QueuePair::builder(QpType::Rc, &cq).build(&pd).unwrap();
    let buffer = device.alloc_buffer(8192).unwrap();
    let mr = pd.reg_mr(&buffer, access::LOCAL_WRITE).unwrap();
    assert_ne!(
        host_resource_counts(),
        baseline,
        "the objects are on the host"
    );
    let reset = vrdma_guest::spec::ctrl::request_bytes(Opcode::Reset as u16, &[]);
    let answer = device.raw_control(&reset, 64).unwrap();
    assert_eq!(response_status(&answer), Status::Ok as u16);
    wait_for_host_counts(&baseline);
    // NOT_READY, which guest-lib reports as the device's reset.
    match device.alloc_pd() {
        Err(Error::DeviceReset) => {}
        other => panic!("a command after RESET: {:?}", other.err()),
    }
    drop((mr, qp, cq, pd));
}
