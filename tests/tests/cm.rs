//! Connection management for guests (SPEC.md §13): a guest with its own address
//! (`--guest-ip`) connects through the device's CM commands to other guests, and on rxe to
//! rdma-core's unmodified `rdma_server` and accepts `rdma_client`, both native programs on the
//! host's address; and a guest cannot bind, listen or connect from an address that is not its
//! own. The guest-to-guest tests run on the loopback host's connection manager under plain
//! `cargo test`, and on rxe inside the VM harness, where rxe0 sits on `va` with the host's
//! address 192.168.77.1/24 and `rdma_ucm` is loaded; the native programs' test only there.

use std::net::SocketAddrV4;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vrdma_backend::device::cm_state::{verdict, CmCommand, IdState, Verdict};
use vrdma_backend::hostverbs::loopback;
use vrdma_guest::cm::{event, port_space};
use vrdma_guest::spec::cm::{
    CmAddr, CmBindRequest, CmConnectRequest, CmInitQpAttrRequest, CmListenRequest, CmRejectRequest,
    CmResolveAddrRequest, CmResolveRouteRequest,
};
use vrdma_guest::spec::ctrl::HandleRequest;
use vrdma_guest::spec::Le32;
use vrdma_guest::{
    access, wc_opcode, CmEvent, CmId, CompletionQueue, ConnParam, Device, MemoryRegion, Payload,
    QpState, QpType, QueuePair, RecvWr, SendOp, SendWr, Sge, SharedBuffer, Status,
};
use vrdma_tests::{
    control_request, expect_cm_event, host_resource_counts, next_cm_event, response_status,
    spawn_backend_process, start_backend_for_guest, test_device_name, wait_for_guest_completions,
    wait_for_host_counts, BackendProcess,
};

const HOST: &str = "192.168.77.1";
/// rdma_server and rdma_client exchange messages of this many bytes.
const MESSAGE: u32 = 16;
const WAIT: Duration = Duration::from_secs(20);

fn socket(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("vrdma-cm-{name}-{}.sock", std::process::id()))
}

fn on_loopback() -> bool {
    loopback::is_loopback(&test_device_name())
}

/// The backend of a guest.
enum Backend {
    /// A backend process of its own, under its seccomp filter, as deployed (rxe).
    Process(BackendProcess),
    /// A backend thread of the test process on the test's loopback device: guests reach each
    /// other only through one loopback device, which is one process's.
    InProcess,
}

impl Backend {
    /// Whether it still serves. A backend thread that fails panics, and the guest's next
    /// command fails with it, so only a process is asked.
    fn lives(&mut self) -> bool {
        match self {
            Backend::Process(process) => process.try_wait().unwrap().is_none(),
            Backend::InProcess => true,
        }
    }
}

/// A backend serving one guest at `address` (/24).
fn backend(name: &str, address: &str) -> (Backend, std::path::PathBuf) {
    let address = format!("{address}/24");
    if on_loopback() {
        let served = start_backend_for_guest(&address);
        return (Backend::InProcess, served.socket);
    }
    let socket = socket(name);
    let backend = spawn_backend_process(&socket, &["--guest-ip", &address]);
    (Backend::Process(backend), socket)
}

/// Port `port` of an address nobody listens on: the host's on rxe; on loopback, where only
/// guests have addresses, the guest's own (`own`).
fn nobody_listens(own: &str, port: u16) -> SocketAddrV4 {
    let ip = if on_loopback() { own } else { HOST };
    SocketAddrV4::new(ip.parse().unwrap(), port)
}

fn open(socket: &std::path::Path) -> Device {
    Device::open(socket.to_str().unwrap()).expect("open the device")
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
        let answer = next_cm_event(device, &id);
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
#[ignore = "needs rdma_rxe and rdma_ucm (native rdma_server and rdma_client on the host's address): run by tests/run-all.sh inside the VM harness"]
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
        expect_cm_event(&device, &id, event::DISCONNECTED);
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
        let request = expect_cm_event(&device, &listener, event::CONNECT_REQUEST);
        let id = request.new_id.expect("the request's id");
        let endpoint = Endpoint::new(&device);
        id.move_qp(&endpoint.qp, QpState::Init).expect("INIT");
        endpoint.post_recv();
        id.move_qp(&endpoint.qp, QpState::Rtr).expect("RTR");
        id.move_qp(&endpoint.qp, QpState::Rts).expect("RTS");
        id.accept(&endpoint.qp, &param()).expect("CM_ACCEPT");
        expect_cm_event(&device, &id, event::ESTABLISHED);
        endpoint.wait(wc_opcode::RECV);
        endpoint.send(b"guest to client.");
        endpoint.wait(wc_opcode::SEND);
        expect_cm_event(&device, &id, event::DISCONNECTED);
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
    expect_cm_event(device, &id, event::ADDR_RESOLVED);
    id.resolve_route(Duration::from_secs(2)).unwrap();
    expect_cm_event(device, &id, event::ROUTE_RESOLVED);
    id.move_qp(&endpoint.qp, QpState::Init)
        .expect("the CM's INIT attributes");
    endpoint.post_recv();
    id.connect(&endpoint.qp, &param()).expect("CM_CONNECT");
    id
}

#[test]
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
    let asked = expect_cm_event(&a, &a_listener, event::CONNECT_REQUEST);
    let a_id = asked.new_id.expect("the request's id");
    let a_endpoint = Endpoint::new(&a);
    a_id.move_qp(&a_endpoint.qp, QpState::Init).unwrap();
    a_endpoint.post_recv();
    a_id.move_qp(&a_endpoint.qp, QpState::Rtr).unwrap();
    a_id.move_qp(&a_endpoint.qp, QpState::Rts).unwrap();
    a_id.accept(&a_endpoint.qp, &param()).unwrap();
    expect_cm_event(&c, &c_id, event::CONNECT_RESPONSE);
    c_id.move_qp(&c_endpoint.qp, QpState::Rtr).unwrap();
    c_id.move_qp(&c_endpoint.qp, QpState::Rts).unwrap();
    c_id.establish().unwrap();
    expect_cm_event(&a, &a_id, event::ESTABLISHED);
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
    expect_cm_event(&a, &a_id, event::DISCONNECTED);
    a_id.disconnect().unwrap();
    expect_cm_event(&c, &c_id, event::DISCONNECTED);
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
            *answer = Some(next_cm_event(&c, id));
        }
    }
    assert_eq!(rejected(&answers), 5, "{answers:?}");
}

// ---- Every CM command in every id state (backend/src/device/cm_state.rs) ----------------

/// A raw control request of `command` on the id `id`, with `qp` where the command names one:
/// well formed, so that only the id's state can refuse it.
fn cm_request(command: CmCommand, id: u32, qp: u32, peer: SocketAddrV4) -> Vec<u8> {
    let id = Le32::from(id);
    let opcode = command.opcode() as u16;
    let handle = HandleRequest {
        handle: id,
        reserved: Le32::from(0),
    };
    match command {
        CmCommand::DestroyId
        | CmCommand::Disconnect
        | CmCommand::Establish
        | CmCommand::Query
        | CmCommand::GetEvent => control_request(opcode, &handle),
        CmCommand::Bind => control_request(
            opcode,
            &CmBindRequest {
                id,
                addr: CmAddr::ipv4("0.0.0.0:0".parse().unwrap()),
            },
        ),
        CmCommand::ResolveAddr => control_request(
            opcode,
            &CmResolveAddrRequest {
                id,
                timeout_ms: Le32::from(2000),
                src: CmAddr::default(),
                dst: CmAddr::ipv4(peer),
            },
        ),
        CmCommand::ResolveRoute => control_request(
            opcode,
            &CmResolveRouteRequest {
                id,
                timeout_ms: Le32::from(2000),
            },
        ),
        CmCommand::Listen => control_request(
            opcode,
            &CmListenRequest {
                id,
                backlog: Le32::from(4),
            },
        ),
        CmCommand::Connect | CmCommand::Accept => control_request(
            opcode,
            &CmConnectRequest {
                id,
                qp: Le32::from(qp),
                param: param().to_wire().unwrap(),
            },
        ),
        CmCommand::Reject => control_request(
            opcode,
            &CmRejectRequest {
                id,
                ..CmRejectRequest::default()
            },
        ),
        CmCommand::InitQpAttr => control_request(
            opcode,
            &CmInitQpAttrRequest {
                id,
                qp_state: vrdma_guest::spec::ctrl::qp_state::INIT,
                reserved: [0; 3],
            },
        ),
    }
}

/// The status and detail of a raw response.
fn status_and_detail(response: &[u8]) -> (u16, u32) {
    let detail = u32::from_le_bytes(response[4..8].try_into().unwrap());
    (response_status(response), detail)
}

const STATE_REFUSAL: (u16, u32) = (Status::InvalidArgument as u16, libc::EINVAL as u32);
const DONE: (u16, u32) = (Status::Ok as u16, 0);

/// What the device answers `command` with on an id in `state`, by the table: a refusal
/// before the host (INVALID_ARGUMENT, detail EINVAL) or done. Where the host's connection
/// manager decides more than the device keeps (the QP attributes of a connection that ended),
/// its EINVAL is the same answer.
fn expected(state: IdState, command: CmCommand) -> &'static [(u16, u32)] {
    match verdict(state, command) {
        Verdict::Refused => &[STATE_REFUSAL],
        Verdict::Allowed { .. }
            if command == CmCommand::InitQpAttr
                && matches!(state, IdState::Disconnected | IdState::Failed) =>
        {
            &[DONE, STATE_REFUSAL]
        }
        Verdict::Allowed { .. } => &[DONE],
    }
}

/// The states an id brought to `state` may be in by the time a command comes: a route
/// resolves at once, and an address that does not answer ends in ADDR_ERROR (on loopback at
/// once), which leaves the id bound.
fn may_be_in(state: IdState) -> Vec<IdState> {
    match state {
        IdState::AddrQuery => vec![IdState::AddrQuery, IdState::Bound],
        IdState::RouteQuery => vec![IdState::RouteQuery, IdState::RouteResolved],
        state => vec![state],
    }
}

/// Whether `command` leaves an id in any of `states` where it was (or is refused), so that
/// one id can take it and the next command.
fn keeps_state(states: &[IdState], command: CmCommand) -> bool {
    command != CmCommand::DestroyId
        && states.iter().all(|&s| match verdict(s, command) {
            Verdict::Refused => true,
            Verdict::Allowed { next } => next == s,
        })
}

/// The guest under test (A) and its peer (P), each under a backend of its own, with P's two
/// listeners: one that accepts every request, one that never answers.
struct Matrix {
    a: Device,
    p: Device,
    accepting: CmId,
    holding: CmId,
    /// Connections P accepted, kept until the test ends.
    accepted: Vec<(CmId, Endpoint)>,
    /// A's endpoints that ids were connected with, kept until the test ends.
    kept: Vec<Endpoint>,
}

const A_ADDRESS: &str = "192.168.77.66";
const P_ADDRESS: &str = "192.168.77.67";
const ACCEPTING_PORT: u16 = 7601;
const HOLDING_PORT: u16 = 7602;
const CLOSED_PORT: u16 = 7603;
const A_LISTEN_PORT: u16 = 7604;
/// An address on rxe0's network that nobody answers ARP for.
const SILENT: &str = "192.168.77.250:7605";

fn peer(port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(P_ADDRESS.parse().unwrap(), port)
}

impl Matrix {
    /// A fresh id of A resolved to `to`, its address and then its route.
    fn resolved(&self, to: SocketAddrV4, route: bool) -> CmId {
        let id = self.a.create_cm_id(port_space::TCP).unwrap();
        id.resolve_addr(None, to, Duration::from_secs(2)).unwrap();
        expect_cm_event(&self.a, &id, event::ADDR_RESOLVED);
        if route {
            id.resolve_route(Duration::from_secs(2)).unwrap();
            expect_cm_event(&self.a, &id, event::ROUTE_RESOLVED);
        }
        id
    }

    /// A's id connecting to `to` from a QP of its own, moved to INIT as the CM says.
    fn connecting(&mut self, to: SocketAddrV4) -> CmId {
        let id = self.resolved(to, true);
        let endpoint = Endpoint::new(&self.a);
        id.move_qp(&endpoint.qp, QpState::Init).unwrap();
        id.connect(&endpoint.qp, &param()).unwrap();
        self.kept.push(endpoint);
        id
    }

    /// P takes the request waiting on its accepting listener and accepts it.
    fn p_accepts(&mut self) {
        let request = expect_cm_event(&self.p, &self.accepting, event::CONNECT_REQUEST);
        let id = request.new_id.expect("the request's id");
        let endpoint = Endpoint::new(&self.p);
        id.move_qp(&endpoint.qp, QpState::Init).unwrap();
        id.move_qp(&endpoint.qp, QpState::Rtr).unwrap();
        id.move_qp(&endpoint.qp, QpState::Rts).unwrap();
        id.accept(&endpoint.qp, &param()).unwrap();
        self.accepted.push((id, endpoint));
    }

    /// A fresh id of A in `state`, as a driver gets it there (`cm_state`'s paths).
    fn id_in(&mut self, state: IdState) -> CmId {
        let a = &self.a;
        match state {
            IdState::Idle => a.create_cm_id(port_space::TCP).unwrap(),
            IdState::Bound => {
                let id = a.create_cm_id(port_space::TCP).unwrap();
                id.bind("0.0.0.0:0".parse().unwrap()).unwrap();
                id
            }
            IdState::AddrQuery => {
                let id = a.create_cm_id(port_space::TCP).unwrap();
                id.resolve_addr(None, SILENT.parse().unwrap(), Duration::from_secs(20))
                    .unwrap();
                id
            }
            IdState::AddrResolved => self.resolved(peer(HOLDING_PORT), false),
            IdState::RouteQuery => {
                let id = self.resolved(peer(HOLDING_PORT), false);
                id.resolve_route(Duration::from_secs(2)).unwrap();
                id
            }
            IdState::RouteResolved => self.resolved(peer(HOLDING_PORT), true),
            IdState::Listening => {
                let id = a.create_cm_id(port_space::TCP).unwrap();
                id.bind("0.0.0.0:0".parse().unwrap()).unwrap();
                id.listen(4).unwrap();
                id
            }
            IdState::Connecting => self.connecting(peer(HOLDING_PORT)),
            IdState::ConnectResponse => {
                let id = self.connecting(peer(ACCEPTING_PORT));
                self.p_accepts();
                expect_cm_event(&self.a, &id, event::CONNECT_RESPONSE);
                id
            }
            IdState::Connected => {
                let id = self.id_in(IdState::ConnectResponse);
                let qp = &self.kept.last().unwrap().qp;
                id.move_qp(qp, QpState::Rtr).unwrap();
                id.move_qp(qp, QpState::Rts).unwrap();
                id.establish().unwrap();
                let (p_id, _) = self.accepted.last().unwrap();
                expect_cm_event(&self.p, p_id, event::ESTABLISHED);
                id
            }
            IdState::Disconnected => {
                let id = self.id_in(IdState::Connected);
                self.accepted.last().unwrap().0.disconnect().unwrap();
                expect_cm_event(&self.a, &id, event::DISCONNECTED);
                id
            }
            IdState::Failed => {
                let id = self.connecting(peer(CLOSED_PORT));
                expect_cm_event(&self.a, &id, event::REJECTED);
                id
            }
            IdState::Requested => {
                // P connects to a listener of A's, which takes the request.
                let listener = a.create_cm_id(port_space::TCP).unwrap();
                listener
                    .bind(SocketAddrV4::new(
                        std::net::Ipv4Addr::UNSPECIFIED,
                        A_LISTEN_PORT,
                    ))
                    .unwrap();
                listener.listen(4).unwrap();
                let p_id = self.p.create_cm_id(port_space::TCP).unwrap();
                let to = SocketAddrV4::new(A_ADDRESS.parse().unwrap(), A_LISTEN_PORT);
                p_id.resolve_addr(None, to, Duration::from_secs(2)).unwrap();
                expect_cm_event(&self.p, &p_id, event::ADDR_RESOLVED);
                p_id.resolve_route(Duration::from_secs(2)).unwrap();
                expect_cm_event(&self.p, &p_id, event::ROUTE_RESOLVED);
                let p_endpoint = Endpoint::new(&self.p);
                p_id.move_qp(&p_endpoint.qp, QpState::Init).unwrap();
                p_id.connect(&p_endpoint.qp, &param()).unwrap();
                let request = expect_cm_event(&self.a, &listener, event::CONNECT_REQUEST);
                self.accepted.push((p_id, p_endpoint));
                // The listener goes; the request's id is A's to keep.
                drop(listener);
                request.new_id.expect("the request's id")
            }
            IdState::Accepted => {
                let id = self.id_in(IdState::Requested);
                let endpoint = Endpoint::new(&self.a);
                id.move_qp(&endpoint.qp, QpState::Init).unwrap();
                id.move_qp(&endpoint.qp, QpState::Rtr).unwrap();
                id.move_qp(&endpoint.qp, QpState::Rts).unwrap();
                id.accept(&endpoint.qp, &param()).unwrap();
                // P hears CONNECT_RESPONSE and does not establish: A stays accepted.
                let (p_id, _) = self.accepted.last().unwrap();
                expect_cm_event(&self.p, p_id, event::CONNECT_RESPONSE);
                self.kept.push(endpoint);
                id
            }
        }
    }
}

/// Sends `command` on `id` and checks the answer is one of `allowed` and the backend lives.
fn check_command(m: &Matrix, states: &[IdState], id: &CmId, command: CmCommand) {
    let qp = match command {
        CmCommand::Connect | CmCommand::Accept => Some(Endpoint::new(&m.a)),
        _ => None,
    };
    let request = cm_request(
        command,
        id.handle(),
        qp.as_ref().map_or(0, |e| e.qp.handle()),
        peer(HOLDING_PORT),
    );
    let response = m
        .a
        .raw_control(&request, 8 + 320)
        .unwrap_or_else(|e| panic!("{command:?} in {states:?}: no answer, the backend died? {e}"));
    let got = status_and_detail(&response);
    let allowed: Vec<(u16, u32)> = states
        .iter()
        .flat_map(|&s| expected(s, command).iter().copied())
        .collect();
    assert!(
        allowed.contains(&got),
        "{command:?} on an id in {states:?}: (status, detail) {got:?}, the table says one of {allowed:?}"
    );
}

/// Every CM command on an id in every state the device keeps (backend/src/device/cm_state.rs),
/// reached as a driver reaches it, on rxe and on the loopback host: each is refused before the host's connection
/// manager (INVALID_ARGUMENT, detail EINVAL) where the table says so and carried out where it
/// does, and the backend lives through all of them. Before the table, CM_RESOLVE_ROUTE on a
/// fresh id reached librdmacm, which read the id's NULL device: the backend died of SIGSEGV.
/// A second guest on the same host is the peer. 3 to 6 s under TCG.
#[test]
fn every_cm_command_in_every_id_state_is_answered_as_the_table_says() {
    let started = Instant::now();
    let (mut a_backend, a_socket) = backend("matrix-a", A_ADDRESS);
    let (_p_backend, p_socket) = backend("matrix-p", P_ADDRESS);
    let (a, p) = (open(&a_socket), open(&p_socket));
    let accepting = listen(&p, ACCEPTING_PORT, 64);
    let holding = listen(&p, HOLDING_PORT, 64);
    let mut m = Matrix {
        a,
        p,
        accepting,
        holding,
        accepted: Vec::new(),
        kept: Vec::new(),
    };
    let mut covered = 0;
    for state in IdState::ALL {
        let states = may_be_in(state);
        // One id takes every command that leaves its state as it was; each other command
        // gets an id of its own in the state.
        let shared = m.id_in(state);
        for command in CmCommand::ALL {
            if command == CmCommand::DestroyId {
                continue;
            }
            if keeps_state(&states, command) {
                check_command(&m, &states, &shared, command);
            } else {
                let id = m.id_in(state);
                check_command(&m, &states, &id, command);
            }
            covered += 1;
        }
        check_command(&m, &states, &shared, CmCommand::DestroyId);
        covered += 1;
        assert!(a_backend.lives(), "the backend ended in {state:?}");
    }
    assert_eq!(covered, IdState::ALL.len() * CmCommand::ALL.len());
    assert!(m.holding.get_event().is_ok(), "the peer's backend lives");
    eprintln!(
        "{covered} command-state pairs in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// The crash, alone: CM_RESOLVE_ROUTE (and every command that needs an id's device)
/// on a fresh id is refused with INVALID_ARGUMENT and the backend serves on; CM_LISTEN on an
/// unbound id is refused (listening there would listen on every address of the host); private
/// data longer than the CM message holds is refused by the device (a field's rule: detail 0),
/// not passed to the host.
#[test]
fn commands_out_of_order_are_refused_before_the_host_and_the_backend_lives() {
    let (mut backend, socket) = backend("order", "192.168.77.68");
    let device = open(&socket);
    let refused_for_state = |e: vrdma_guest::Error| match e {
        vrdma_guest::Error::Device { status, detail, .. } => {
            assert_eq!(
                (status, detail),
                (Status::InvalidArgument, libc::EINVAL as u32)
            )
        }
        other => panic!("{other}"),
    };
    let fresh = device.create_cm_id(port_space::TCP).unwrap();
    refused_for_state(
        fresh
            .resolve_route(Duration::from_secs(1))
            .expect_err("CM_RESOLVE_ROUTE on a fresh id"),
    );
    refused_for_state(fresh.listen(1).expect_err("CM_LISTEN on an unbound id"));
    refused_for_state(fresh.establish().expect_err("CM_ESTABLISH on a fresh id"));
    refused_for_state(
        fresh
            .init_qp_attr(QpState::Init)
            .expect_err("CM_INIT_QP_ATTR on a fresh id"),
    );
    let endpoint = Endpoint::new(&device);
    refused_for_state(
        fresh
            .connect(&endpoint.qp, &param())
            .expect_err("CM_CONNECT on a fresh id"),
    );
    assert!(backend.lives(), "the backend died");
    // Still served: the id binds, and a connection goes as far as its private data lets it.
    fresh.bind("0.0.0.0:0".parse().unwrap()).unwrap();
    fresh.listen(1).expect("CM_LISTEN once bound");
    let id = device.create_cm_id(port_space::TCP).unwrap();
    id.resolve_addr(None, nobody_listens("192.168.77.68", 7606), WAIT)
        .unwrap();
    expect_cm_event(&device, &id, event::ADDR_RESOLVED);
    id.resolve_route(WAIT).unwrap();
    expect_cm_event(&device, &id, event::ROUTE_RESOLVED);
    id.move_qp(&endpoint.qp, QpState::Init).unwrap();
    let too_long = ConnParam {
        private_data: vec![7; vrdma_guest::spec::cm::private_data_limit::CONNECT_TCP + 1],
        ..param()
    };
    match id.connect(&endpoint.qp, &too_long) {
        Err(vrdma_guest::Error::Device { status, detail, .. }) => {
            assert_eq!(
                (status, detail),
                (Status::InvalidArgument, 0),
                "private data"
            )
        }
        other => panic!("57 bytes of private data in a REQ: {other:?}"),
    }
    // Refused, so nothing changed: the id still connects (nobody listens: REJECTED).
    id.connect(&endpoint.qp, &param()).unwrap();
    expect_cm_event(&device, &id, event::REJECTED);
    assert!(backend.lives(), "the backend died");
}
