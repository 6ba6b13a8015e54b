//! The guest service (`vrdmad`) sharing one device among programs: several programs at once
//! over one backend connection, each isolated from the others as uverbs isolates processes
//! (objects, memory, keys), everything of a program gone when it goes, unprivileged programs,
//! and a service restart under running programs. On the test device (see `vrdma_tests`): the
//! service attaches to a backend as a process on a host would; inside a VM it owns the PCI
//! device instead (tests/pci-e2e.sh).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use vrdma_guest::spec::ctrl::{CreateCqRequest, HandleRequest, Opcode, RegMrRequest, Status};
use vrdma_guest::spec::mem::{PageList, PageListForm};
use vrdma_guest::spec::{Le16, Le32, Le64};
use vrdma_guest::{
    access, wc_status, Device, DeviceEvent, Error, Payload, QpState, QpType, QueuePair, SendOp,
    SendWr, Sge,
};
use vrdma_tests::target_writer::{TargetLines, TargetWriter, CHUNK_LEN};
use vrdma_tests::{
    connect_to_itself, control_request, cpu_time, host_resource_counts, response_status,
    start_backend, vrdma_library_dir, vrdma_run_script, wait_for_guest_completions,
    wait_for_host_counts, wait_until_listening, CProgram, ServiceProcess, TestBackend,
    UnprivilegedCopies, WritingGuest,
};

const PAGE: u64 = 4096;

fn handle_request(handle: u32) -> HandleRequest {
    HandleRequest {
        handle: Le32::from(handle),
        reserved: Le32::from(0),
    }
}

/// Sends `request` raw and returns its status.
fn status_of(device: &Device, request: &[u8]) -> u16 {
    response_status(&device.raw_control(request, 64).unwrap())
}

fn guest_endpoint(mode: &str, target: &str, count: u32) -> Command {
    guest_endpoint_at(
        Path::new(env!("CARGO_BIN_EXE_guest-endpoint")),
        mode,
        target,
        count,
    )
}

/// As [`guest_endpoint`], the binary at `program` (a copy another user may run).
fn guest_endpoint_at(program: &Path, mode: &str, target: &str, count: u32) -> Command {
    let mut command = Command::new(program);
    command
        .args([mode, target, &count.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    command
}

fn line(reader: &mut BufReader<ChildStdout>) -> String {
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    line.trim().to_string()
}

/// Runs a ping and a pong guest-endpoint, each made by `command`, for `round_trips`
/// checked round trips against each other; both must finish them.
fn ping_pong(round_trips: u32, command: impl Fn(&str) -> Command) {
    let spawn = |mode: &str| command(mode).spawn().expect("start guest-endpoint");
    let (mut ping, mut pong): (Child, Child) = (spawn("ping"), spawn("pong"));
    let mut ping_out = BufReader::new(ping.stdout.take().unwrap());
    let mut pong_out = BufReader::new(pong.stdout.take().unwrap());
    let (ping_addr, pong_addr) = (line(&mut ping_out), line(&mut pong_out));
    let mut ping_in = ping.stdin.take().unwrap();
    let mut pong_in = pong.stdin.take().unwrap();
    writeln!(ping_in, "{pong_addr}").unwrap();
    writeln!(pong_in, "{ping_addr}").unwrap();
    for out in [&mut ping_out, &mut pong_out] {
        assert_eq!(line(out), format!("state={:?}", QpState::Rts));
    }
    for out in [&mut ping_out, &mut pong_out] {
        let done = line(out);
        assert!(done.starts_with(&format!("done {round_trips} ")), "{done}");
    }
    drop((ping_in, pong_in));
    assert!(ping.wait().unwrap().success() && pong.wait().unwrap().success());
}

/// A program that zeroes every doorbell bit and notify state it can reach, over and over,
/// reaches only its own doorbell area (SPEC.md §8.6): two other programs make their round
/// trips as ever. (When every program shared the service's one area, it took their
/// doorbells and their kicks' flag: their WQEs waited for a ring that never came.)
#[test]
fn a_program_zeroing_every_doorbell_it_can_reach_delays_no_other() {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    use vrdma_guest::service::protocol::{self, Kind, Welcome};
    let backend = start_backend();
    let mut service = ServiceProcess::start(&backend.socket, &[]);
    // The meddler speaks the service's protocol itself and maps what its WELCOME hands it.
    let stream = std::os::unix::net::UnixStream::connect(&service.socket).unwrap();
    protocol::send(&stream, Kind::Hello, &protocol::VERSION.to_le_bytes(), &[]).unwrap();
    let mut welcome = protocol::recv(&stream, protocol::MAX_SERVICE_PAYLOAD)
        .unwrap()
        .unwrap();
    assert_eq!(welcome.kind, Kind::Welcome);
    let terms = Welcome::decode(&welcome.payload).unwrap();
    let doorbells = std::sync::Arc::new(
        vrdma_guest::shm::Region::from_file(welcome.files.remove(0), terms.notify_len).unwrap(),
    );
    let everything = doorbells.view(0, terms.notify_len).unwrap();
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Relaxed) {
                for offset in (0..terms.notify_len).step_by(8) {
                    everything.atomic_u64(offset).unwrap().store(0, Relaxed);
                }
            }
        });
        // Stops the meddler however the round trips end: the scope waits for it.
        struct Stop<'a>(&'a AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Relaxed);
            }
        }
        let _stop = Stop(&stop);
        let target = service.target();
        ping_pong(2_000, |mode| guest_endpoint(mode, &target, 2_000));
    });
    // Each program had an area of its own, removed when it went.
    let log = service.wait_for_log("both programs gone", |log| {
        log.matches(" gone: ").count() == 2
    });
    let areas: std::collections::HashSet<&str> = log
        .lines()
        .filter_map(|line| line.split("rings through doorbell area ").nth(1))
        .collect();
    assert_eq!(areas.len(), 3, "{log}");
    assert!(!log.contains("removing its doorbell area"), "{log}");
}

#[test]
fn two_programs_make_checked_round_trips_over_one_device_the_service_shares() {
    let backend = start_backend();
    let mut service = ServiceProcess::start(&backend.socket, &[]);
    let target = service.target();
    ping_pong(10_000, |mode| guest_endpoint(mode, &target, 10_000));
    // Both went through the service's one connection and, exiting, destroyed what they
    // created themselves.
    service.wait_for_log("both programs' summaries", |log| {
        log.matches("gone: 0 objects destroyed").count() == 2
    });
}

#[test]
fn a_program_naming_another_programs_objects_or_memory_is_refused() {
    let backend = start_backend();
    let mut service = ServiceProcess::start(&backend.socket, &[]);
    let victim = WritingGuest::open(&service.target());
    victim.buffer.write(0, b"the victim's secret").unwrap();
    let attacker = Device::open(&service.target()).unwrap();
    let bad_handle = Status::BadHandle as u16;
    // Every kind of object the victim holds, named by the attacker (SPEC.md §5.3.1: another
    // instance's handle is unknown).
    for (opcode, handle) in [
        (Opcode::QueryQp, victim.qp.handle()),
        (Opcode::DestroyQp, victim.qp.handle()),
        (Opcode::DeregMr, victim.mr.handle()),
        (Opcode::DestroyCq, victim.cq.handle()),
    ] {
        let request = control_request(opcode as u16, &handle_request(handle));
        assert_eq!(status_of(&attacker, &request), bad_handle, "{opcode:?}");
    }
    // Registering the victim's pages (a list in the attacker's memory naming them), or
    // putting a CQ's doorbell record in them, is naming memory not its own (SPEC.md §6).
    let pd = attacker.alloc_pd().unwrap();
    let list = attacker.alloc_buffer(PAGE).unwrap();
    list.write(0, &victim.buffer.device_addr().unwrap().to_le_bytes())
        .unwrap();
    let page_list = PageList {
        addr: Le64::from(list.device_addr().unwrap()),
        npages: Le32::from(1),
        page_shift: 12,
        form: PageListForm::Direct as u8,
        reserved: Le16::from(0),
    };
    let reg_mr = RegMrRequest {
        pd: Le32::from(pd.handle()),
        access: Le32::from(access::LOCAL_WRITE),
        virt_addr: Le64::from(0x7000_0000),
        length: Le64::from(PAGE),
        pages: page_list,
    };
    let bad_address = Status::BadAddress as u16;
    let request = control_request(Opcode::RegMr as u16, &reg_mr);
    assert_eq!(status_of(&attacker, &request), bad_address, "REG_MR");
    let ring = attacker.alloc_buffer(PAGE).unwrap();
    list.write(0, &ring.device_addr().unwrap().to_le_bytes())
        .unwrap();
    let create_cq = CreateCqRequest {
        cqe: Le32::from(16),
        flags: Le32::from(0),
        ring: page_list,
        doorbell: Le64::from(victim.buffer.device_addr().unwrap()),
    };
    let request = control_request(Opcode::CreateCq as u16, &create_cq);
    assert_eq!(status_of(&attacker, &request), bad_address, "CREATE_CQ");
    // The notify area is the service's alone.
    let notify = vrdma_guest::spec::ctrl::SetNotifyAreaRequest::default();
    let request = control_request(Opcode::SetNotifyArea as u16, &notify);
    assert_eq!(
        status_of(&attacker, &request),
        Status::InvalidArgument as u16
    );

    // The victim's keys in the attacker's WQEs: the host refuses them as a NIC does, and
    // nothing of the victim's memory moves.
    let cq = attacker.create_cq(16).unwrap();
    let qp = QueuePair::builder(QpType::Rc, &cq).build(&pd).unwrap();
    connect_to_itself(&attacker, &qp).unwrap();
    let own = attacker.alloc_buffer(PAGE).unwrap();
    let own_mr = pd
        .reg_mr(&own, access::LOCAL_WRITE | access::REMOTE_WRITE)
        .unwrap();
    let steal = Sge {
        addr: victim.buffer.addr(),
        length: 19,
        lkey: victim.mr.lkey(),
    };
    let write = SendOp::RdmaWrite {
        remote_addr: own.addr(),
        rkey: own_mr.rkey(),
    };
    qp.post_send(&[SendWr::new(1, write, Payload::Sges(&[steal]))])
        .unwrap();
    let done = wait_for_guest_completions(&cq, 1);
    assert_eq!(done[0].status, wc_status::LOC_PROT_ERR, "{:?}", done[0]);
    let mut landed = [0u8; 19];
    own.read(0, &mut landed).unwrap();
    assert_eq!(landed, [0u8; 19], "nothing of the victim's memory was read");

    victim.still_served(7);
    let log = service.wait_for_log("the refusals", |log| log.contains("(refusal 7)"));
    assert!(
        log.contains("names Qp") && log.contains("not its memory"),
        "{log}"
    );
}

#[test]
fn a_killed_program_leaves_nothing_on_the_device_and_the_others_keep_running() {
    let backend = start_backend();
    let mut service = ServiceProcess::start(&backend.socket, &[]);
    let survivor = WritingGuest::open(&service.target());
    let baseline = host_resource_counts();
    let mut doomed = guest_endpoint("hold", &service.target(), 0)
        .spawn()
        .expect("start guest-endpoint");
    let mut out = BufReader::new(doomed.stdout.take().unwrap());
    assert_eq!(line(&mut out), "ready");
    assert_ne!(
        host_resource_counts(),
        baseline,
        "its objects are on the host"
    );
    survivor.still_served(1);
    doomed.kill().unwrap();
    doomed.wait().unwrap();
    wait_for_host_counts(&baseline);
    service.wait_for_log("its summary", |log| {
        // Its PD, CQ, MR and QP.
        log.contains("gone: 4 objects destroyed")
    });
    survivor.still_served(2);
    // A new program is served beside the survivor.
    WritingGuest::open(&service.target()).still_served(3);
}

/// A `guest-endpoint target`'s pipes, as the lines that drive it.
struct PipedTarget {
    stdin: std::process::ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl TargetLines for PipedTarget {
    fn send(&mut self, text: &str) {
        writeln!(self.stdin, "{text}").expect("write to the target");
    }

    fn receive(&mut self) -> String {
        line(&mut self.stdout)
    }
}

/// SPEC.md §12, on a host (the service attached to a backend socket; inside a VM,
/// tests/pci-e2e.sh part leaver): a program that punches holes in, truncates and unmaps all
/// the memory it shared, and exits, while a peer RDMA-WRITEs into its buffer, ends only
/// itself: the peer's WRITEs fail once the service destroyed what it held, everything of it
/// leaves the host, the backend and the service go on, and another program keeps working.
#[test]
fn a_program_that_punches_truncates_and_unmaps_its_memory_and_exits_ends_only_itself() {
    let backend = start_backend();
    let mut service = ServiceProcess::start(&backend.socket, &[]);
    let survivor = WritingGuest::open(&service.target());
    let baseline = host_resource_counts();
    let mut leaver = guest_endpoint("target", &service.target(), 4 << 20)
        .spawn()
        .expect("start guest-endpoint");
    let mut lines = PipedTarget {
        stdin: leaver.stdin.take().unwrap(),
        stdout: BufReader::new(leaver.stdout.take().unwrap()),
    };
    let writer = TargetWriter::connect(&service.target(), &mut lines);
    assert_eq!(
        writer.round(&mut lines, 0),
        0,
        "checked writes before it left"
    );
    lines.send("leave");
    assert_eq!(lines.receive(), "punched");
    // Its objects stand: WRITEs into the memory it punched land (in what the backend maps).
    for seed in 0..64 {
        let done = writer.write(seed * u64::from(CHUNK_LEN) % writer.length, seed);
        assert!(done.is_success(), "WRITE into punched memory: {done:?}");
    }
    lines.send("exit");
    assert!(leaver.wait().unwrap().success(), "it exits as it chose to");
    service.wait_for_log("the leaver's summary", |log| log.contains("program 2 gone"));
    // Its buffer is no longer a target: a WRITE after the service destroyed its QP and MR
    // does not land. The loopback host fails it at once; a NIC retries first, for as long as
    // the QP's retry budget says, which may be longer than this waits.
    if let Some(done) = writer.write_within(0, u64::MAX, Duration::from_secs(5)) {
        assert_ne!(
            done.status,
            wc_status::SUCCESS,
            "a WRITE into the buffer it left"
        );
    }
    survivor.still_served(1);
    WritingGuest::open(&service.target()).still_served(2);
    drop(writer);
    wait_for_host_counts(&baseline);
}

/// Tests that start programs as another user run as root, as CI runs them.
fn require_root() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        panic!("this test starts programs as another user: run it as root");
    }
}

/// A backend, the service over it for group `nogroup`, and a copy of guest-endpoint that
/// user `nobody` may run: where tests of unprivileged programs start.
struct ServedToNobody {
    // Dropped in this order: the service before its backend.
    service: ServiceProcess,
    _backend: TestBackend,
    endpoint: PathBuf,
    _copies: UnprivilegedCopies,
}

impl ServedToNobody {
    fn start() -> ServedToNobody {
        require_root();
        let backend = start_backend();
        let service = ServiceProcess::start(&backend.socket, &["--group", "nogroup"]);
        let copies = UnprivilegedCopies::new();
        let endpoint = copies.copy(Path::new(env!("CARGO_BIN_EXE_guest-endpoint")));
        ServedToNobody {
            service,
            _backend: backend,
            endpoint,
            _copies: copies,
        }
    }
}

/// A command that runs as user `nobody` in group `nogroup` (65534) and no other (std drops
/// root's supplementary groups with its user).
fn as_nobody(mut command: Command) -> Command {
    command.uid(65534).gid(65534);
    command
}

#[test]
fn unprivileged_programs_use_rdma_through_the_service_and_others_cannot_reach_it() {
    let served = ServedToNobody::start();
    let (target, endpoint) = (served.service.target(), &served.endpoint);
    // Members of the socket's group: served, with no capability.
    ping_pong(100, |mode| {
        as_nobody(guest_endpoint_at(endpoint, mode, &target, 100))
    });
    // Others: refused by the socket itself, with the reason.
    let refused = as_nobody(guest_endpoint_at(endpoint, "rc", &target, 0))
        .gid(65533)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("Permission denied"), "{stderr}");
}

#[test]
fn a_service_restart_fails_its_programs_cleanly_and_serves_the_next_at_once() {
    let backend = start_backend();
    let mut service = ServiceProcess::start(&backend.socket, &[]);
    let program = WritingGuest::open(&service.target());
    program.still_served(1);
    service.child.kill().unwrap();
    service.child.wait().unwrap();
    // The program learns it, from its next request, its event wait, its polls and posts;
    // nothing hangs.
    match program.device.alloc_pd() {
        Err(Error::Disconnected) => {}
        other => panic!("a request after the service went: {:?}", other.map(|_| ())),
    }
    match program.device.wait_event(Duration::from_secs(5)) {
        Err(Error::Disconnected) | Ok(Some(DeviceEvent::DeviceFatal)) => {}
        other => panic!("an event wait after the service went: {other:?}"),
    }
    let mut completions = [Default::default(); 4];
    assert!(matches!(
        program.cq.poll(&mut completions),
        Err(Error::Disconnected)
    ));
    assert!(matches!(
        program.post_write(b"after"),
        Err(Error::Disconnected)
    ));
    drop(program);
    // A new instance takes the device (the backend reaped the old connection's objects).
    let service = ServiceProcess::start(&backend.socket, &[]);
    WritingGuest::open(&service.target()).still_served(2);
}

#[test]
fn started_as_its_systemd_unit_would_the_service_says_ready_once_programs_can_connect() {
    let backend = start_backend();
    let notify = std::env::temp_dir().join(format!("vrdmad-notify-{}", std::process::id()));
    let _ = std::fs::remove_file(&notify);
    let systemd = std::os::unix::net::UnixDatagram::bind(&notify).unwrap();
    systemd
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let socket = notify.with_extension("sock");
    let mut service = Command::new(vrdma_tests::workspace_binary("vrdmad"))
        .arg("--device")
        .arg(&backend.socket)
        .arg("--socket")
        .arg(&socket)
        .env("NOTIFY_SOCKET", &notify)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut ready = [0u8; 64];
    let len = systemd.recv(&mut ready).expect("READY=1 within 10 s");
    assert_eq!(&ready[..len], b"READY=1");
    WritingGuest::open(&format!("service:{}", socket.display())).still_served(1);
    service.kill().unwrap();
    service.wait().unwrap();
    let _ = std::fs::remove_file(&notify);
}

#[test]
fn a_program_holds_its_users_share_of_the_device_and_is_told_so() {
    let backend = start_backend();
    let service = ServiceProcess::start(&backend.socket, &["--share", "64"]);
    let whole = Device::attach(&backend.socket)
        .unwrap()
        .query_device()
        .unwrap();
    let program = Device::open(&service.target()).unwrap();
    let shown = program.query_device().unwrap();
    let share = shown.max_pd.to_native();
    assert_eq!(share, whole.max_pd.to_native().div_ceil(64));
    assert_eq!(program.config().max_pd.to_native(), share);
    let pds: Vec<_> = (0..share).map(|_| program.alloc_pd().unwrap()).collect();
    let refused = program.alloc_pd().err().expect("one past its share");
    assert_eq!(refused.status(), Some(Status::NoResources), "{refused}");
    // Another program of the same user shares the same share: nothing left for it.
    let sibling = Device::open(&service.target()).unwrap();
    let refused = sibling.alloc_pd().err().expect("its user's share is taken");
    assert_eq!(refused.status(), Some(Status::NoResources), "{refused}");
    drop(pds);
    program.alloc_pd().expect("room again");
    sibling.alloc_pd().expect("room for the sibling too");
}

/// `guest-endpoint hold` as user nobody, from `endpoint` (a copy nobody may run), until it
/// says `ready` (it holds a PD, CQ, MR and QP of its own then): the program, and its output.
fn nobody_holding(endpoint: &Path, target: &str) -> (Child, BufReader<ChildStdout>) {
    let mut holder = as_nobody(guest_endpoint_at(endpoint, "hold", target, 0))
        .stderr(Stdio::piped())
        .spawn()
        .expect("start guest-endpoint as nobody");
    let mut out = BufReader::new(holder.stdout.take().unwrap());
    let said = line(&mut out);
    if said != "ready" {
        let _ = holder.kill();
        let mut stderr = String::new();
        let _ = std::io::Read::read_to_string(&mut holder.stderr.take().unwrap(), &mut stderr);
        panic!("nobody's program was not served: {said:?} {stderr}");
    }
    (holder, out)
}

/// One user opening connections that never say HELLO, past the service's limit of programs,
/// and then four programs taking PDs until refused, leaves another user served with its
/// share: connections count against their user's share (--max-programs-per-user, by default
/// --max-programs / --share), and a user's programs hold one share together. (Before, 300
/// silent connections of one process took every place, "serves 256 programs at most", and
/// four programs of one process took all of the device's PDs.)
#[test]
fn one_users_silent_connections_and_many_programs_leave_other_users_their_share() {
    let served = ServedToNobody::start();
    let (service, target, endpoint) = (&served.service, served.service.target(), &served.endpoint);
    let silent: Vec<_> = (0..300)
        .map(|_| std::os::unix::net::UnixStream::connect(&service.socket).unwrap())
        .collect();
    let (mut holder, _out) = nobody_holding(endpoint, &target);
    // The silent ones go, and with them their user's places.
    drop(silent);
    let programs: Vec<Device> = (0..4).map(|_| open_once_served(&target)).collect();
    let share = programs[0].query_device().unwrap().max_pd.to_native();
    let mut pds = Vec::new();
    for program in &programs {
        while let Ok(pd) = program.alloc_pd() {
            pds.push(pd);
        }
    }
    assert_eq!(pds.len(), share as usize, "four programs, one user's share");
    // Another user's program is served with a share of its own (it takes a PD).
    let (mut second, _out) = nobody_holding(endpoint, &target);
    for program in [&mut holder, &mut second] {
        program.kill().unwrap();
        program.wait().unwrap();
    }
}

/// A connection that says nothing is closed after the handshake time (--hello-timeout).
#[test]
fn a_connection_that_says_no_hello_is_closed_after_the_handshake_time() {
    let backend = start_backend();
    let mut service = ServiceProcess::start(&backend.socket, &["--hello-timeout", "1"]);
    let silent = std::os::unix::net::UnixStream::connect(&service.socket).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let started = std::time::Instant::now();
    use vrdma_guest::service::protocol::{self, Kind};
    let said = protocol::recv(&silent, protocol::MAX_SERVICE_PAYLOAD).expect("closed, not left");
    let waited = started.elapsed();
    match said {
        Some(frame) if frame.kind == Kind::Failed => {
            let why = String::from_utf8_lossy(&frame.payload);
            assert!(why.contains("no HELLO"), "{why}");
            assert!(protocol::recv(&silent, protocol::MAX_SERVICE_PAYLOAD)
                .unwrap()
                .is_none());
        }
        other => panic!("expected FAILED and the end, got {other:?}"),
    }
    assert!(waited < Duration::from_secs(5), "closed after {waited:?}");
    service.wait_for_log("the closing", |log| log.contains("said no HELLO"));
    // Its place is free: a program is served.
    WritingGuest::open(&service.target()).still_served(1);
}

/// The memory regions a backend takes from one connection (its --max-memory-regions, 256
/// by default, which it states in the configuration space) are bounded for the service's
/// programs, in all and per program: programs saying HELLO (each a doorbell area, a region)
/// and one program sharing memfd after memfd are refused before the limit, and the shared
/// connection, every other program's device, stays. (Before, about 252 of either made the
/// backend end the connection: every program lost the device.)
#[test]
fn programs_past_the_backends_memory_regions_are_refused_and_the_connection_stays() {
    // The backend and some 250 programs share this process: descriptors for all of them.
    vrdma_backend::hostverbs::raise_open_file_limit().unwrap();
    let backend = start_backend();
    // --share 1: one user may take everything, so the totals are what refuse.
    let service = ServiceProcess::start(&backend.socket, &["--share", "1"]);
    let target = service.target();
    let victim = WritingGuest::open(&target);
    victim.still_served(1);
    // Programs saying HELLO until refused.
    let mut hellos = Vec::new();
    let refused = loop {
        match Device::open(&target) {
            Ok(device) => hellos.push(device),
            Err(e) => break e,
        }
        assert!(hellos.len() < 300, "never refused");
    };
    println!("{} programs served, then: {refused}", hellos.len());
    assert!(refused.to_string().contains("memory regions"), "{refused}");
    assert!(hellos.len() > 200, "refused early: {}", hellos.len());
    victim.still_served(2);
    drop(hellos);
    // One program sharing memory, a page at a time, each a memfd of its own (as
    // ibv_reg_mr of malloc'd memory does), until refused.
    let sharer = open_once_served(&target);
    let pd = sharer.alloc_pd().unwrap();
    let mut pages = Vec::new();
    let mut mrs = Vec::new();
    let refused = loop {
        // SAFETY: a new private anonymous page, unmapped when the test ends.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(page, libc::MAP_FAILED);
        pages.push(page);
        let addr = page as u64;
        // SAFETY: the page is this test's and stays mapped while registered.
        match unsafe { pd.reg_user_mr(addr, PAGE, addr, access::LOCAL_WRITE) } {
            Ok(mr) => mrs.push(mr),
            Err(e) => break e,
        }
        assert!(mrs.len() < 300, "never refused");
    };
    println!("{} memfds shared, then: {refused}", mrs.len());
    assert!(matches!(refused, Error::OverLimit(_)), "{refused}");
    assert!(refused.to_string().contains("memory regions"), "{refused}");
    victim.still_served(3);
    // The refused program is still served too, within what it has.
    let cq = sharer.create_cq(16).unwrap();
    drop((mrs, cq, pd, sharer));
    for page in pages {
        // SAFETY: the test's own page, no longer registered.
        unsafe { libc::munmap(page, PAGE as usize) };
    }
    // A new program is served once they have gone.
    WritingGuest::on(open_once_served(&target)).still_served(4);
    victim.still_served(5);
}

/// Opens the device `target` names once the service serves another program: the programs
/// that left have given back their places (the service releases them as it notices).
fn open_once_served(target: &str) -> Device {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match Device::open(target) {
            Ok(device) => return device,
            Err(e) => assert!(std::time::Instant::now() < deadline, "never served: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `vrdma-run` and vrdma's library, copied where any user may run them.
struct VrdmaRun {
    run: std::path::PathBuf,
    library: std::path::PathBuf,
    _copies: UnprivilegedCopies,
}

impl VrdmaRun {
    fn new() -> VrdmaRun {
        let copies = UnprivilegedCopies::new();
        VrdmaRun {
            run: copies.copy(&vrdma_run_script()),
            library: copies.copy(&vrdma_library_dir()),
            _copies: copies,
        }
    }

    /// `program` (a tests/c/ program, built in the temporary folder, which any user may
    /// run) on vrdma0 through `vrdma-run --device target`, under a time limit.
    fn command(&self, program: &CProgram, target: &str) -> Command {
        let mut command = Command::new("timeout");
        command
            .arg("60")
            .arg(&self.run)
            .args(["--device", target, "--"])
            .arg(program.path())
            .env("VRDMA_IBVERBS_DIR", &self.library)
            .stdin(Stdio::null());
        command
    }
}

/// Holds the command's process to `bytes` of locked memory (RLIMIT_MEMLOCK, soft and hard).
fn with_memlock(mut command: Command, bytes: u64) -> Command {
    // SAFETY: the closure only calls setrlimit, which is async-signal-safe, between fork and
    // exec.
    unsafe {
        command.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            if libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command
}

/// reg_mr_limit's lines for `mib`, run by `command`.
fn registrations(mut command: Command, mib: &[&str]) -> String {
    let output = command.args(["vrdma0"]).args(mib).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// Memory the service locks for a program is charged to it as uverbs charges pinned pages:
/// against its process's RLIMIT_MEMLOCK unless it has CAP_IPC_LOCK (as root has), and
/// against its user's share of --max-locked-memory; past either, ibv_reg_mr fails with
/// ENOMEM. (Before, the service locked up to 1 GiB for any program of any user.)
#[test]
fn registering_past_rlimit_memlock_or_the_users_share_fails_with_enomem() {
    require_root();
    let backend = start_backend();
    // 256 MiB locked at most, 64 MiB for each user.
    let service = ServiceProcess::start(
        &backend.socket,
        &["--group", "nogroup", "--max-locked-memory", "268435456"],
    );
    let target = service.target();
    let vrdma_run = VrdmaRun::new();
    let program = CProgram::build("reg_mr_limit", &["-libverbs"]);
    let limited = |command: Command| with_memlock(command, 8 << 20);
    // An unprivileged process with the usual 8 MiB: 2 MiB fits, 16 more do not.
    let said = registrations(
        limited(as_nobody(vrdma_run.command(&program, &target))),
        &["2", "16", "1"],
    );
    assert_eq!(said, "2: ok\n16: errno 12\n1: ok\n", "as nobody");
    // Root (CAP_IPC_LOCK) is not held to its RLIMIT_MEMLOCK, but to its user's share.
    let said = registrations(
        limited(vrdma_run.command(&program, &target)),
        &["16", "32", "32"],
    );
    assert_eq!(said, "16: ok\n32: ok\n32: errno 12\n", "as root");
}

/// A child forked from a program that has the device open uses its parent's context: each
/// verb fails in the child with nothing sent, and the parent's device goes on, attached
/// directly to a backend and through the service. (Before, the child's requests went out on
/// the parent's connection: attached directly, the backend closed it; through the service,
/// both got garbled answers.)
#[test]
fn a_forked_child_using_its_parents_device_fails_and_the_parent_goes_on() {
    let backend = start_backend();
    let service = ServiceProcess::start(&backend.socket, &[]);
    let vrdma_run = VrdmaRun::new();
    let program = CProgram::build("fork_child", &["-libverbs"]);
    for target in [backend.socket.to_str().unwrap(), &service.target()] {
        let output = vrdma_run
            .command(&program, target)
            .args(["vrdma0", "0"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && stdout.contains("fork: ok"),
            "{target}: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert_eq!(stdout.matches("failed (errno").count(), 8, "{stdout}");
    }
    WritingGuest::open(&service.target()).still_served(1);
}

/// `ibv_rc_pingpong` through vrdma-run on `target`, for ever (`-n` past what it can do in a
/// test), `-e` for completion events instead of polling.
fn endless_pingpong(target: &str, port: u16, events: bool, server: Option<&str>) -> Command {
    let mut command = Command::new("timeout");
    command
        .args(["120", "stdbuf", "-oL"])
        .arg(vrdma_run_script())
        .args(["--device", target, "--"])
        .args(["ibv_rc_pingpong", "-d", "vrdma0", "-g", "0", "-s", "64"])
        .args(["-n", "1000000000", "-p", &port.to_string()])
        .args(if events { &["-e"][..] } else { &[][..] })
        .args(server)
        .env("VRDMA_IBVERBS_DIR", vrdma_library_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Reads `child`'s output until a line holds `text`; the rest stays to be read.
fn wait_for_output(child: &mut Child, text: &str) -> BufReader<ChildStdout> {
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut next = String::new();
        assert_ne!(out.read_line(&mut next).unwrap(), 0, "ended: {seen}");
        seen.push_str(&next);
        if next.contains(text) {
            return out;
        }
    }
}

/// SIGKILL of the service under four programs asleep in ibv_get_cq_event and four polling
/// ibv_poll_cq (four ibv_rc_pingpong pairs, two with -e, mid-stream): each sees the end of
/// its socket and fails (no completion can come), within seconds; none hangs, none reports
/// success. (Before, the waiting ones hung for ever and the polling ones polled on.)
#[test]
fn a_killed_service_ends_every_waiting_and_polling_program_with_an_error() {
    let backend = start_backend();
    let mut service = ServiceProcess::start(&backend.socket, &[]);
    let target = service.target();
    let mut programs = Vec::new();
    for (pair, events) in [true, true, false, false].into_iter().enumerate() {
        let port = 18640 + pair as u16 + 10 * (std::process::id() % 100) as u16;
        let mut server = endless_pingpong(&target, port, events, None)
            .spawn()
            .unwrap();
        let server_out = wait_for_output(&mut server, "local address");
        wait_until_listening(port);
        let mut client = endless_pingpong(&target, port, events, Some("127.0.0.1"))
            .spawn()
            .unwrap();
        let client_out = wait_for_output(&mut client, "remote address");
        programs.push((server, server_out, events));
        programs.push((client, client_out, events));
    }
    // All four pairs stream now.
    std::thread::sleep(Duration::from_secs(1));
    service.child.kill().unwrap();
    service.child.wait().unwrap();
    let killed = std::time::Instant::now();
    let mut slowest = Duration::ZERO;
    for (mut program, mut out, events) in programs {
        let deadline = killed + Duration::from_secs(20);
        let status = loop {
            if let Some(status) = program.try_wait().unwrap() {
                break Some(status);
            }
            if std::time::Instant::now() > deadline {
                let _ = program.kill();
                let _ = program.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        slowest = slowest.max(killed.elapsed());
        let mut said = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut said);
        let mut stderr = String::new();
        let _ = std::io::Read::read_to_string(&mut program.stderr.take().unwrap(), &mut stderr);
        let what = if events { "waiting" } else { "polling" };
        let status = status.unwrap_or_else(|| panic!("a {what} program hung: {said}{stderr}"));
        assert!(
            !status.success() && !said.contains(" iters in "),
            "a {what} program reported success ({status}): {said}{stderr}"
        );
    }
    println!("every program ended with an error within {slowest:?} of the kill");
    assert!(slowest < Duration::from_secs(10), "{slowest:?}");
}

#[test]
fn a_program_asleep_on_a_completion_event_and_its_service_spend_no_cpu_and_it_wakes() {
    let backend = start_backend();
    let service = ServiceProcess::start(&backend.socket, &[]);
    let mut sleeper = guest_endpoint("sleep", &service.target(), 0)
        .spawn()
        .expect("start guest-endpoint");
    let mut out = BufReader::new(sleeper.stdout.take().unwrap());
    assert_eq!(line(&mut out), "sleeping");
    let pids = [sleeper.id(), service.child.id()];
    let before = pids.map(cpu_time);
    std::thread::sleep(Duration::from_secs(10));
    let spent = [0, 1].map(|i| cpu_time(pids[i]) - before[i]);
    println!(
        "10 s asleep in a completion-event wait: the program spent {:?} of CPU, vrdmad {:?}",
        spent[0], spent[1]
    );
    // Under 1% of the interval each.
    assert!(
        spent.iter().all(|&cpu| cpu < Duration::from_millis(100)),
        "{spent:?}"
    );
    writeln!(sleeper.stdin.take().unwrap(), "go").unwrap();
    assert_eq!(line(&mut out), "woken");
    assert!(sleeper.wait().unwrap().success());
}

#[test]
fn programs_past_the_services_limit_are_refused_with_the_reason() {
    let backend = start_backend();
    let service = ServiceProcess::start(&backend.socket, &["--max-programs", "1"]);
    let first = Device::open(&service.target()).unwrap();
    let refused = Device::open(&service.target())
        .err()
        .expect("a second program");
    assert!(
        refused.to_string().contains("1 programs at most"),
        "{refused}"
    );
    drop(first);
    // Its place is free again once it has gone.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while Device::open(&service.target()).is_err() {
        assert!(std::time::Instant::now() < deadline, "never served again");
        std::thread::sleep(Duration::from_millis(50));
    }
}
