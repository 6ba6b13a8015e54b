//! Connection management for guests (SPEC.md §13) on rxe: a guest with its own address
//! (`--guest-ip`) connects through the device's CM commands to rdma-core's unmodified
//! `rdma_server`, and accepts `rdma_client`, both native programs on the host's address; and
//! a guest cannot bind, listen or connect from an address that is not its own. Runs inside
//! the VM harness, where rxe0 sits on `va` with the host's address 192.168.77.1/24 and
//! `rdma_ucm` is loaded.

use std::net::SocketAddrV4;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vrdma_guest::cm::{event, port_space};
use vrdma_guest::{
    access, wc_opcode, CmEvent, CmId, CompletionQueue, ConnParam, Device, DeviceEvent,
    MemoryRegion, Payload, QpState, QpType, QueuePair, RecvWr, SendOp, SendWr, Sge, SharedBuffer,
    Status,
};
use vrdma_tests::{
    host_resource_counts, spawn_backend_process, wait_for_guest_completions, wait_for_host_counts,
    BackendProcess,
};

const HOST: &str = "192.168.77.1";
/// rdma_server and rdma_client exchange messages of this many bytes.
const MESSAGE: u32 = 16;
const WAIT: Duration = Duration::from_secs(20);

fn socket(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("vrdma-cm-{name}-{}.sock", std::process::id()))
}

/// A backend serving one guest at `address` (/24), under its seccomp filter.
fn backend(name: &str, address: &str) -> (BackendProcess, std::path::PathBuf) {
    let socket = socket(name);
    let backend = spawn_backend_process(&socket, &["--guest-ip", &format!("{address}/24")]);
    (backend, socket)
}

fn open(socket: &std::path::Path) -> Device {
    Device::open(socket.to_str().unwrap()).expect("open the device")
}

/// The next CM event of `id`, waiting for the device to announce one.
fn next_event(device: &Device, id: &CmId) -> CmEvent {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(event) = id.get_event().expect("CM_GET_EVENT") {
            return event;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no CM event on id {:#x}", id.handle());
        match device.wait_event(left).expect("wait for a device event") {
            Some(DeviceEvent::CmEvent(handle)) if handle == id.handle() => {}
            _ => {}
        }
    }
}

fn expect_event(device: &Device, id: &CmId, wanted: u32) -> CmEvent {
    let got = next_event(device, id);
    assert_eq!(
        got.event,
        wanted,
        "{} (status {}) where {} was due",
        got.name(),
        got.status,
        event::name(wanted)
    );
    got
}

/// An RC QP with one CQ and a buffer of two messages: receive at 0, send from MESSAGE.
struct Endpoint {
    cq: CompletionQueue,
    qp: QueuePair,
    buffer: SharedBuffer,
    mr: MemoryRegion,
}

impl Endpoint {
    fn new(device: &Device) -> Endpoint {
        let pd = device.alloc_pd().unwrap();
        let buffer = device.alloc_buffer(4096).unwrap();
        let mr = pd.reg_mr(&buffer, access::LOCAL_WRITE).unwrap();
        let cq = device.create_cq(16).unwrap();
        let qp = QueuePair::builder(QpType::Rc, &cq)
            .max_inline_data(MESSAGE)
            .build(&pd)
            .unwrap();
        Endpoint { cq, qp, buffer, mr }
    }

    fn sge(&self, offset: u64) -> Sge {
        Sge {
            addr: self.mr.addr() + offset,
            length: MESSAGE,
            lkey: self.mr.lkey(),
        }
    }

    fn post_recv(&self) {
        self.qp
            .post_recv(&[RecvWr {
                wr_id: 1,
                sges: &[self.sge(0)],
            }])
            .unwrap();
    }

    fn send(&self, message: &[u8]) {
        self.buffer.write(u64::from(MESSAGE), message).unwrap();
        self.qp
            .post_send(&[SendWr::new(
                2,
                SendOp::Send,
                Payload::Sges(&[self.sge(u64::from(MESSAGE))]),
            )])
            .unwrap();
    }

    /// The send's and the receive's completions, in either order: the peer answers as soon
    /// as it has the guest's message, maybe before the guest's send completes.
    fn wait_both(&self) {
        let mut done = wait_for_guest_completions(&self.cq, 2);
        assert!(done.iter().all(|c| c.is_success()), "{done:?}");
        done.sort_by_key(|c| c.opcode);
        let opcodes: Vec<u8> = done.iter().map(|c| c.opcode).collect();
        assert_eq!(opcodes, [wc_opcode::SEND, wc_opcode::RECV], "{done:?}");
    }

    fn wait(&self, opcode: u8) {
        let done = wait_for_guest_completions(&self.cq, 1);
        assert!(done[0].is_success(), "{:?}", done[0]);
        assert_eq!(done[0].opcode, opcode, "{:?}", done[0]);
    }
}

fn param() -> ConnParam {
    ConnParam {
        responder_resources: 1,
        initiator_depth: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        ..ConnParam::default()
    }
}

fn native(program: &str, args: &[&str]) -> Child {
    Command::new(program)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start {program}: {e}"))
}

/// Waits for a native program and checks it succeeded.
fn finished(program: Child, name: &str) {
    let output = program
        .wait_with_output()
        .expect("wait for the native program");
    assert!(
        output.status.success(),
        "{name}: {}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Connects `endpoint`'s QP to `server`, trying again while nobody listens there yet (a
/// native server prints nothing when it starts listening, and rdma_cm ports are not TCP
/// ports one could wait for): such a try ends REJECTED or UNREACHABLE.
fn connect_with_retries(device: &Device, endpoint: &Endpoint, server: SocketAddrV4) -> CmId {
    let deadline = Instant::now() + WAIT;
    loop {
        let id = request(device, endpoint, server);
        let answer = next_event(device, &id);
        if answer.event == event::CONNECT_RESPONSE {
            return id;
        }
        assert!(
            matches!(answer.event, event::REJECTED | event::UNREACHABLE)
                && Instant::now() < deadline,
            "{} (status {}) where CONNECT_RESPONSE was due",
            answer.name(),
            answer.status
        );
        // Nobody listened yet: the QP goes back to RESET for the next try.
        drop(id);
        endpoint
            .qp
            .modify(
                &vrdma_guest::QpAttr {
                    qp_state: QpState::Reset,
                    ..Default::default()
                },
                vrdma_guest::qp_attr_mask::STATE,
            )
            .unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
#[ignore = "needs rdma_rxe and rdma_ucm: run by tests/run-all.sh inside the VM harness"]
fn a_guest_connects_to_rdma_server_and_accepts_rdma_client() {
    let (backend, socket) = backend("native", "192.168.77.61");
    let baseline = host_resource_counts();
    let device = open(&socket);
    // The guest connects to the native server, as rdma_client would.
    {
        let server = native("rdma_server", &["-p", "7471"]);
        let endpoint = Endpoint::new(&device);
        let id = connect_with_retries(&device, &endpoint, format!("{HOST}:7471").parse().unwrap());
        id.move_qp(&endpoint.qp, QpState::Rtr).expect("RTR");
        id.move_qp(&endpoint.qp, QpState::Rts).expect("RTS");
        id.establish().expect("CM_ESTABLISH");
        let info = id.query().unwrap();
        assert_eq!(
            info.src.to_ipv4().map(|a| *a.ip()),
            Some("192.168.77.61".parse().unwrap())
        );
        assert_eq!(info.dst.to_ipv4().map(|a| a.port()), Some(7471));
        endpoint.send(b"guest to server.");
        endpoint.wait_both();
        expect_event(&device, &id, event::DISCONNECTED);
        // The answer the peer waits for (librdmacm programs disconnect in turn).
        id.disconnect().expect("answer the peer's disconnect");
        finished(server, "rdma_server");
    }
    // The native client connects to the guest, which listens on its own address.
    {
        let listener = device.create_cm_id(port_space::TCP).unwrap();
        listener
            .bind("0.0.0.0:7472".parse().unwrap())
            .expect("bind the guest's own address");
        listener.listen(4).unwrap();
        let client = native("rdma_client", &["-s", "192.168.77.61", "-p", "7472"]);
        let request = expect_event(&device, &listener, event::CONNECT_REQUEST);
        let id = request.new_id.expect("the request's id");
        let endpoint = Endpoint::new(&device);
        id.move_qp(&endpoint.qp, QpState::Init).expect("INIT");
        endpoint.post_recv();
        id.move_qp(&endpoint.qp, QpState::Rtr).expect("RTR");
        id.move_qp(&endpoint.qp, QpState::Rts).expect("RTS");
        id.accept(&endpoint.qp, &param()).expect("CM_ACCEPT");
        expect_event(&device, &id, event::ESTABLISHED);
        endpoint.wait(wc_opcode::RECV);
        endpoint.send(b"guest to client.");
        endpoint.wait(wc_opcode::SEND);
        expect_event(&device, &id, event::DISCONNECTED);
        id.disconnect().expect("answer the peer's disconnect");
        finished(client, "rdma_client");
    }
    // Once the guest goes, nothing of its is left on the host (the backend's librdmacm
    // opened the device contexts it keeps before the guest came).
    drop(device);
    wait_for_host_counts(&baseline);
    drop(backend);
}

#[test]
#[ignore = "needs rdma_rxe and rdma_ucm: run by tests/run-all.sh inside the VM harness"]
fn a_guest_binds_and_resolves_only_from_its_own_address() {
    let (_backend, socket) = backend("own", "192.168.77.62");
    let device = open(&socket);
    let id = device.create_cm_id(port_space::TCP).unwrap();
    let foreign = id
        .bind(format!("{HOST}:7473").parse().unwrap())
        .expect_err("binding the host's address");
    assert_eq!(foreign.status(), Some(Status::InvalidArgument));
    let foreign_source = id
        .resolve_addr(
            Some(format!("{HOST}:0").parse().unwrap()),
            format!("{HOST}:7473").parse().unwrap(),
            Duration::from_secs(1),
        )
        .expect_err("resolving from the host's address");
    assert_eq!(foreign_source.status(), Some(Status::InvalidArgument));
    let udp_qp_type = device.create_cm_id(0x0002).expect_err("an IB port space");
    assert_eq!(udp_qp_type.status(), Some(Status::InvalidArgument));
    // Its own address is fine.
    id.bind("192.168.77.62:7473".parse().unwrap())
        .expect("binding its own address");
    assert_eq!(
        id.query().unwrap().src.to_ipv4(),
        Some("192.168.77.62:7473".parse().unwrap())
    );
}

/// A guest's listening id on its own address, port `port`, with `backlog`.
fn listen(device: &Device, port: u16, backlog: u32) -> CmId {
    let listener = device.create_cm_id(port_space::TCP).unwrap();
    listener
        .bind(SocketAddrV4::new(std::net::Ipv4Addr::UNSPECIFIED, port))
        .unwrap();
    listener.listen(backlog).unwrap();
    listener
}

/// Resolves `server` and sends a connection request from `endpoint`'s QP (a receive posted
/// first); the answer is the id's next event.
fn request(device: &Device, endpoint: &Endpoint, server: SocketAddrV4) -> CmId {
    let id = device.create_cm_id(port_space::TCP).unwrap();
    id.resolve_addr(None, server, Duration::from_secs(2))
        .unwrap();
    expect_event(device, &id, event::ADDR_RESOLVED);
    id.resolve_route(Duration::from_secs(2)).unwrap();
    expect_event(device, &id, event::ROUTE_RESOLVED);
    id.move_qp(&endpoint.qp, QpState::Init)
        .expect("the CM's INIT attributes");
    endpoint.post_recv();
    id.connect(&endpoint.qp, &param()).expect("CM_CONNECT");
    id
}

#[test]
#[ignore = "needs rdma_rxe and rdma_ucm: run by tests/run-all.sh inside the VM harness"]
fn guests_on_one_port_get_only_their_own_requests_and_a_flood_past_the_backlog_is_rejected() {
    let (_a_backend, a_socket) = backend("a", "192.168.77.63");
    let (_b_backend, b_socket) = backend("b", "192.168.77.64");
    let (_c_backend, c_socket) = backend("c", "192.168.77.65");
    let (a, b, c) = (open(&a_socket), open(&b_socket), open(&c_socket));
    let a_listener = listen(&a, 7480, 2);
    let b_listener = listen(&b, 7480, 2);
    // C connects to A, vrdma to vrdma on one host: only A hears of it.
    let c_endpoint = Endpoint::new(&c);
    let c_id = request(&c, &c_endpoint, "192.168.77.63:7480".parse().unwrap());
    let asked = expect_event(&a, &a_listener, event::CONNECT_REQUEST);
    let a_id = asked.new_id.expect("the request's id");
    let a_endpoint = Endpoint::new(&a);
    a_id.move_qp(&a_endpoint.qp, QpState::Init).unwrap();
    a_endpoint.post_recv();
    a_id.move_qp(&a_endpoint.qp, QpState::Rtr).unwrap();
    a_id.move_qp(&a_endpoint.qp, QpState::Rts).unwrap();
    a_id.accept(&a_endpoint.qp, &param()).unwrap();
    expect_event(&c, &c_id, event::CONNECT_RESPONSE);
    c_id.move_qp(&c_endpoint.qp, QpState::Rtr).unwrap();
    c_id.move_qp(&c_endpoint.qp, QpState::Rts).unwrap();
    c_id.establish().unwrap();
    expect_event(&a, &a_id, event::ESTABLISHED);
    c_endpoint.send(b"from c, to a....");
    c_endpoint.wait(wc_opcode::SEND);
    a_endpoint.wait(wc_opcode::RECV);
    let mut got = [0u8; MESSAGE as usize];
    a_endpoint.buffer.read(0, &mut got).unwrap();
    assert_eq!(&got, b"from c, to a....");
    assert!(
        b_listener.get_event().unwrap().is_none(),
        "B heard of a request addressed to A"
    );
    // Disconnecting from either side is seen on the other.
    c_id.disconnect().unwrap();
    expect_event(&a, &a_id, event::DISCONNECTED);
    a_id.disconnect().unwrap();
    expect_event(&c, &c_id, event::DISCONNECTED);
    // A flood at B, which takes none of its requests: its backlog of 2 waits, the rest are
    // rejected by the device, and B holds no more ids than that.
    let flood: Vec<(Endpoint, CmId)> = (0..5)
        .map(|_| {
            let endpoint = Endpoint::new(&c);
            let id = request(&c, &endpoint, "192.168.77.64:7480".parse().unwrap());
            (endpoint, id)
        })
        .collect();
    // Past the backlog: rejected at once.
    let mut answers: Vec<Option<CmEvent>> = flood.iter().map(|_| None).collect();
    let rejected = |answers: &[Option<CmEvent>]| {
        answers
            .iter()
            .filter(|a| a.as_ref().is_some_and(|a| a.event == event::REJECTED))
            .count()
    };
    let deadline = Instant::now() + WAIT;
    while rejected(&answers) < 3 {
        assert!(Instant::now() < deadline, "{answers:?}");
        for ((_, id), answer) in flood.iter().zip(answers.iter_mut()) {
            if answer.is_none() {
                *answer = id.get_event().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // The backlog's requests wait for B: it takes them now, and rejects them.
    let queued: Vec<CmEvent> = std::iter::from_fn(|| b_listener.get_event().unwrap()).collect();
    assert!(
        queued.len() == 2 && queued.iter().all(|e| e.event == event::CONNECT_REQUEST),
        "{queued:?}"
    );
    for request in &queued {
        request.new_id.as_ref().unwrap().reject(b"no").unwrap();
    }
    for ((_, id), answer) in flood.iter().zip(answers.iter_mut()) {
        if answer.is_none() {
            *answer = Some(next_event(&c, id));
        }
    }
    assert_eq!(rejected(&answers), 5, "{answers:?}");
}
