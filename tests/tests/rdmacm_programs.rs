//! rdma-core's unmodified rdma_cm programs (`rdma_server`/`rdma_client`, `rping`, `ucmatose`,
//! `udaddy`) and perftest's rdma_cm mode (`-R`) on vrdma,
//! through `vrdma-run` and vrdma's `librdmacm.so.1`: against native programs on rxe0 both
//! ways, and vrdma to vrdma between two guests of one host. Each guest has an address of its
//! own (`--guest-ip`); the native end uses the host's, 192.168.77.1. Runs inside the VM
//! harness, where `rdma_ucm` is loaded; the programs from guest to guest also under plain
//! `cargo test`, on the loopback host's connection manager.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use vrdma_backend::hostverbs::loopback;
use vrdma_tests::{
    child_pids, host_resource_counts, spawn_backend_process, start_backend_for_guest,
    test_device_name, vrdma_library_dir as library_dir, vrdma_run_script, wait_until_listening,
    BackendProcess, CProgram, ServiceProcess,
};

const HOST: &str = "192.168.77.1";

/// A guest: its backend (with `address` its own) and socket.
struct Guest {
    /// `None` for a backend thread of this process ([`loopback_guest`]).
    _backend: Option<BackendProcess>,
    socket: PathBuf,
    address: &'static str,
}

fn guest(name: &str, address: &'static str) -> Guest {
    let socket =
        std::env::temp_dir().join(format!("vrdma-rdmacm-{name}-{}.sock", std::process::id()));
    let backend = spawn_backend_process(&socket, &["--guest-ip", &format!("{address}/24")]);
    Guest {
        _backend: Some(backend),
        socket,
        address,
    }
}

fn on_loopback() -> bool {
    loopback::is_loopback(&test_device_name())
}

/// A guest served by a backend thread of this process on the test's loopback device: the
/// guests of one loopback device meet through its connection manager, and a loopback device
/// is one process's.
fn loopback_guest(address: &'static str) -> Guest {
    let served = start_backend_for_guest(&format!("{address}/24"));
    Guest {
        _backend: None,
        socket: served.socket,
        address,
    }
}

/// Where a program runs: natively on rxe0, on a guest's vrdma0 through `vrdma-run`, or on
/// it through the guest service that shares it (its target).
#[derive(Clone, Copy)]
enum On<'a> {
    Native,
    Vrdma(&'a Guest),
    Service(&'a Guest, &'a str),
}

impl On<'_> {
    fn address(&self) -> &str {
        match self {
            On::Native => HOST,
            On::Vrdma(guest) | On::Service(guest, _) => guest.address,
        }
    }

    fn command(&self, program: &[&str]) -> Command {
        let mut command = Command::new("timeout");
        command.arg("60");
        let device = match self {
            On::Native => None,
            On::Vrdma(guest) => Some(path(&guest.socket)),
            On::Service(_, target) => Some(*target),
        };
        if let Some(device) = device {
            command
                .arg(vrdma_run_script())
                .args(["--device", device, "--"])
                .env("VRDMA_IBVERBS_DIR", library_dir());
        }
        command.args(program);
        command
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Whether an rdma_cm id on rxe0 (a native program's or a backend's), or on the test's
/// loopback device, listens on `port`.
fn cm_listening(port: u16) -> bool {
    if on_loopback() {
        return loopback::Device::named(&test_device_name())
            .connection_manager()
            .listening(port);
    }
    let listed = Command::new("rdma")
        .args(["resource", "show", "cm_id"])
        .output()
        .expect("run rdma");
    String::from_utf8_lossy(&listed.stdout)
        .lines()
        .any(|l| l.contains("state LISTEN") && l.contains(&format!(":{port} ")))
}

/// Runs `server` on one side and, once it listens on `port`, `client` on the other (rdma_cm
/// ports are not TCP ports: `rdma resource` tells). Both must exit 0; returns the client's
/// output.
fn pair(server_on: On, server: &[&str], client_on: On, client: &[&str], port: u16) -> String {
    let server_process: Child = server_on
        .command(server)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the server");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cm_listening(port) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let client_output = client_on.command(client).output().expect("run the client");
    let server_output = server_process
        .wait_with_output()
        .expect("wait for the server");
    assert!(
        client_output.status.success() && server_output.status.success(),
        "{client:?}: {}\n{}\n{server:?}: {}\n{}",
        client_output.status,
        text(&client_output),
        server_output.status,
        text(&server_output)
    );
    text(&client_output)
}

/// rdma_server and rdma_client (synchronous endpoints, `rdma_getaddrinfo`, `rdma_get_request`,
/// inline sends) from `server_on` to `client_on`.
fn rdma_server_client(server_on: On, client_on: On, port: u16) {
    let port = port.to_string();
    let bind = server_on.address().to_string();
    let output = pair(
        server_on,
        &["rdma_server", "-s", &bind, "-p", &port],
        client_on,
        &["rdma_client", "-s", &bind, "-p", &port],
        port.parse().unwrap(),
    );
    assert!(output.contains("rdma_client: end 0"), "{output}");
}

/// rping (an event channel and a thread of its own, RDMA READ and WRITE of the peer's
/// buffers, `-v` data checked by the program) from `server_on` to `client_on`.
fn rping(server_on: On, client_on: On, port: u16) {
    let port = port.to_string();
    let address = server_on.address().to_string();
    let output = pair(
        server_on,
        &["rping", "-s", "-a", &address, "-p", &port, "-C", "100"],
        client_on,
        &[
            "rping", "-c", "-a", &address, "-p", &port, "-C", "100", "-v",
        ],
        port.parse().unwrap(),
    );
    assert_eq!(output.matches("ping data:").count(), 100, "{output}");
}

#[test]
#[ignore = "needs rdma_rxe and rdma_ucm: run by tests/run-all.sh inside the VM harness"]
fn rdma_server_and_rdma_client_run_unmodified_on_vrdma() {
    let a = guest("server-a", "192.168.77.71");
    let b = guest("server-b", "192.168.77.72");
    rdma_server_client(On::Native, On::Vrdma(&a), 7501);
    rdma_server_client(On::Vrdma(&a), On::Native, 7502);
    rdma_server_client(On::Vrdma(&a), On::Vrdma(&b), 7503);
}

#[test]
#[ignore = "needs rdma_rxe and rdma_ucm: run by tests/run-all.sh inside the VM harness"]
fn rping_runs_unmodified_on_vrdma() {
    let a = guest("rping-a", "192.168.77.73");
    let b = guest("rping-b", "192.168.77.74");
    rping(On::Native, On::Vrdma(&a), 7511);
    rping(On::Vrdma(&a), On::Native, 7512);
    rping(On::Vrdma(&a), On::Vrdma(&b), 7513);
}

/// ucmatose: several connections at once from one event channel, 10 messages each way.
fn ucmatose(server_on: On, client_on: On, port: u16) {
    let port = port.to_string();
    let address = server_on.address().to_string();
    let common = ["-p", port.as_str(), "-c", "4", "-C", "10"];
    let server: Vec<&str> = ["ucmatose", "-b", &address]
        .iter()
        .copied()
        .chain(common)
        .collect();
    let client: Vec<&str> = ["ucmatose", "-s", &address]
        .iter()
        .copied()
        .chain(common)
        .collect();
    let output = pair(
        server_on,
        &server,
        client_on,
        &client,
        port.parse().unwrap(),
    );
    assert!(output.contains("return status 0"), "{output}");
}

/// udaddy's port, which it does not let be chosen.
const UDADDY_PORT: u16 = 7174;

/// udaddy: UD QPs, their peers' address vectors from the connection manager (the client's)
/// and from the datagrams' GRH (the server's replies). Its port is fixed.
fn udaddy(server_on: On, client_on: On) {
    let address = server_on.address().to_string();
    let output = pair(
        server_on,
        &["udaddy", "-b", &address],
        client_on,
        &["udaddy", "-s", &address],
        UDADDY_PORT,
    );
    assert!(output.contains("return status 0"), "{output}");
}

#[test]
#[ignore = "needs rdma_rxe and rdma_ucm: run by tests/run-all.sh inside the VM harness"]
fn ucmatose_and_udaddy_run_unmodified_on_vrdma() {
    let a = guest("cmatose-a", "192.168.77.75");
    let b = guest("cmatose-b", "192.168.77.76");
    ucmatose(On::Native, On::Vrdma(&a), 7521);
    ucmatose(On::Vrdma(&a), On::Native, 7522);
    ucmatose(On::Vrdma(&a), On::Vrdma(&b), 7523);
    udaddy(On::Native, On::Vrdma(&a));
    udaddy(On::Vrdma(&a), On::Native);
    udaddy(On::Vrdma(&a), On::Vrdma(&b));
}

/// rping, ucmatose and udaddy from guest to guest on the loopback host, under plain `cargo
/// test`: RC connections with RDMA READ and WRITE, several connections on one event channel,
/// and UD with the peer's address vector from the connection manager.
#[test]
fn rping_ucmatose_and_udaddy_run_guest_to_guest_on_the_loopback_host() {
    assert!(
        on_loopback(),
        "a test of the loopback host, not of {} (ucmatose_and_udaddy_run_unmodified_on_vrdma and rping_runs_unmodified_on_vrdma cover it)",
        test_device_name()
    );
    let a = loopback_guest("192.168.77.81");
    let b = loopback_guest("192.168.77.82");
    rping(On::Vrdma(&a), On::Vrdma(&b), 7531);
    ucmatose(On::Vrdma(&a), On::Vrdma(&b), 7532);
    udaddy(On::Vrdma(&a), On::Vrdma(&b));
}

/// rdma_server and rdma_client, a program that moves its own QP (`rdma_establish` at
/// CONNECT_RESPONSE), rping between two programs sharing one guest's device through the guest
/// service, and perftest's rdma_cm mode, from guest to guest on the loopback host under plain
/// `cargo test`.
#[test]
fn synchronous_endpoints_own_qps_the_guest_service_and_perftest_connect_on_the_loopback_host() {
    assert!(
        on_loopback(),
        "a test of the loopback host, not of {} (the rxe tests of each cover it)",
        test_device_name()
    );
    let a = loopback_guest("192.168.77.83");
    let b = loopback_guest("192.168.77.84");
    rdma_server_client(On::Vrdma(&a), On::Vrdma(&b), 7541);
    let program = CProgram::build("cm_own_qp", &["-lrdmacm", "-libverbs"]);
    let output = pair(
        On::Vrdma(&a),
        &[program.path(), "server", a.address, "7542"],
        On::Vrdma(&b),
        &[program.path(), "client", a.address, "7542"],
        7542,
    );
    assert!(output.contains("cm_own_qp: ok"), "{output}");
    let service = ServiceProcess::start(&a.socket, &[]);
    let target = service.target();
    let through = On::Service(&a, &target);
    rping(through, through, 7543);
    rping(through, On::Vrdma(&b), 7544);
    for (test, port) in [
        ("ib_write_lat", 7545),
        ("ib_send_bw", 7546),
        ("ib_read_bw", 7547),
    ] {
        perftest(test, On::Vrdma(&a), On::Vrdma(&b), port);
    }
}

/// A perftest test in rdma_cm mode (`-R`), 100 iterations.
fn perftest(test: &str, server_on: On, client_on: On, port: u16) -> String {
    let port = port.to_string();
    let address = server_on.address().to_string();
    let output = pair(
        server_on,
        &[test, "-R", "-n", "100", "-p", &port],
        client_on,
        &[test, "-R", "-n", "100", "-p", &port, &address],
        port.parse().unwrap(),
    );
    assert!(
        output
            .lines()
            .any(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit())),
        "{test}: no result row in {output}"
    );
    output
}

#[test]
#[ignore = "needs rdma_rxe and rdma_ucm: run by tests/run-all.sh inside the VM harness"]
fn perftest_connects_with_rdma_cm_on_vrdma() {
    let a = guest("perftest-a", "192.168.77.77");
    let b = guest("perftest-b", "192.168.77.78");
    let mut port = 7530;
    // perftest's client makes its test connection as soon as the parameters are exchanged
    // over a first one, and fails (and crashes) when the server has not listened again by
    // then: vrdma's librdmacm keeps a destroyed listener listening for the server's next
    // bind to take over (docs/programs.md), as its create_id, bind and listen are slower than
    // native.
    for test in ["ib_write_lat", "ib_send_bw", "ib_read_bw"] {
        for (server, client) in [
            (On::Native, On::Vrdma(&a)),
            (On::Vrdma(&a), On::Native),
            (On::Vrdma(&a), On::Vrdma(&b)),
        ] {
            perftest(test, server, client, port);
            port += 1;
        }
    }
}

/// libfabric's verbs provider, the way Intel MPI, DAOS and others reach verbs:
/// `fi_pingpong -p verbs -e msg` from `server_on` to `client_on`, 20 round trips of 4 KiB whose
/// payloads the program checks (`-c`). Its MSG endpoints connect through rdma_cm: the provider
/// finds the device of each address of the machine by binding it, binds `localhost` to find
/// the server's source address, and hands rdma_getaddrinfo the addresses in its hints (no
/// node, no service). Before vrdma took a loopback address for the guest's own and
/// rdma_getaddrinfo took the hints' addresses, every run with a vrdma server ended in
/// `fi_getinfo` -61 (`rdma_bind_addr: Invalid argument`). The two exchange their endpoint
/// names over TCP on `control_port`.
fn fi_pingpong(server_on: On, client_on: On, control_port: u16) {
    let port = control_port.to_string();
    let common = [
        "fi_pingpong",
        "-p",
        "verbs",
        "-e",
        "msg",
        "-I",
        "20",
        "-S",
        "4096",
        "-c",
    ];
    let server: Vec<&str> = common.iter().copied().chain(["-B", &port]).collect();
    let client: Vec<&str> = common
        .iter()
        .copied()
        .chain(["-P", &port, server_on.address()])
        .collect();
    let server_process = server_on
        .command(&server)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the server");
    assert!(
        wait_until_listening(control_port),
        "fi_pingpong's server never listened on {port}"
    );
    let client_output = client_on.command(&client).output().expect("run the client");
    let server_output = server_process
        .wait_with_output()
        .expect("wait for the server");
    let (client_text, server_text) = (text(&client_output), text(&server_output));
    assert!(
        client_output.status.success() && server_output.status.success(),
        "client {client:?}: {}\n{client_text}\nserver {server:?}: {}\n{server_text}",
        client_output.status,
        server_output.status,
    );
    for output in [&client_text, &server_text] {
        assert!(
            output
                .lines()
                .any(|l| l.starts_with("4k") && l.contains("=20")),
            "no result row of 20 checked round trips in {output}"
        );
    }
}

/// fi_pingpong over libfabric's verbs provider (MSG endpoints) between vrdma and native
/// both ways, and between two guests. About 30 s under TCG, most of it libfabric
/// starting its providers.
#[test]
#[ignore = "needs rdma_rxe and rdma_ucm: run by tests/run-all.sh inside the VM harness"]
fn libfabric_verbs_msg_endpoints_run_on_vrdma() {
    let a = guest("fabric-a", "192.168.77.83");
    let b = guest("fabric-b", "192.168.77.84");
    fi_pingpong(On::Vrdma(&a), On::Native, 7571);
    fi_pingpong(On::Native, On::Vrdma(&a), 7572);
    fi_pingpong(On::Vrdma(&a), On::Vrdma(&b), 7573);
}

/// A program probing rdma_cm by trial (tests/c/cm_probe.c: a port space not served, ids on
/// a device without connection management, an unserved function) gets its errnos and, as
/// from the system's librdmacm, no line on standard error: libfabric tries every address of
/// the machine and port space at start. `VRDMA_DEBUG=1` brings the reasons back, once each.
/// The program also checks rdma_getaddrinfo as libfabric uses it (the hints' addresses, a
/// passive "localhost", results the program frees its own memory into). The backend offers no
/// connection management (no `--guest-ip`), so this runs on the loopback host too.
#[test]
fn a_program_probing_rdma_cm_gets_errnos_and_no_words_unless_it_asks() {
    let program = CProgram::build("cm_probe", &["-lrdmacm", "-libverbs"]);
    let socket =
        std::env::temp_dir().join(format!("vrdma-rdmacm-probe-{}.sock", std::process::id()));
    let _backend = spawn_backend_process(&socket, &[]);
    let run = |debug: Option<&str>| {
        let mut command = Command::new(vrdma_run_script());
        command
            .args(["--device", path(&socket), "--", program.path()])
            .env("VRDMA_IBVERBS_DIR", library_dir())
            .env_remove("VRDMA_DEBUG");
        if let Some(value) = debug {
            command.env("VRDMA_DEBUG", value);
        }
        let output = command.output().expect("run cm_probe");
        assert!(
            output.status.success() && text(&output).contains("cm_probe: ok"),
            "{}\n{}",
            output.status,
            text(&output)
        );
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let quiet = run(None);
    assert!(
        !quiet.lines().any(|l| l.starts_with("vrdma:")),
        "refused tries said something:\n{quiet}"
    );
    assert_eq!(run(Some("0")), quiet, "VRDMA_DEBUG=0 asks for nothing");
    let told = run(Some("1"));
    for reason in [
        "rdma_create_id: only RDMA_PS_TCP and RDMA_PS_UDP are served",
        "rdma_create_id failed",
        "rdma_join_multicast is not served",
    ] {
        assert_eq!(
            told.matches(reason).count(),
            1,
            "{reason:?} once with VRDMA_DEBUG=1:\n{told}"
        );
    }
}

/// A program that makes its QP itself and moves it with `rdma_init_qp_attr`, naming it by
/// `conn_param.qp_num` (tests/c/cm_own_qp.c): the client completes the connection at
/// CONNECT_RESPONSE with `rdma_establish`; a message each way on the QP.
#[test]
#[ignore = "needs rdma_rxe and rdma_ucm: run by tests/run-all.sh inside the VM harness"]
fn a_program_that_moves_its_own_qp_connects_through_rdma_cm() {
    let program = CProgram::build("cm_own_qp", &["-lrdmacm", "-libverbs"]);
    let a = guest("own-qp", "192.168.77.81");
    for (server_on, client_on, port) in [
        (On::Native, On::Vrdma(&a), "7551"),
        (On::Vrdma(&a), On::Native, "7552"),
    ] {
        let address = server_on.address().to_string();
        let output = pair(
            server_on,
            &[program.path(), "server", &address, port],
            client_on,
            &[program.path(), "client", &address, port],
            port.parse().unwrap(),
        );
        assert!(output.contains("cm_own_qp: ok"), "{output}");
    }
}

/// A server that destroys its listener and listens again on the same port (as perftest -R
/// does) takes the request that came in between; one that came with no listener following
/// is refused, not left waiting (tests/c/cm_relisten.c). A native client: a native server
/// would refuse the request in between at once.
#[test]
#[ignore = "needs rdma_rxe and rdma_ucm: run by tests/run-all.sh inside the VM harness"]
fn a_listener_destroyed_and_made_again_takes_the_request_that_came_in_between() {
    let program = CProgram::build("cm_relisten", &["-lrdmacm", "-libverbs"]);
    let a = guest("relisten", "192.168.77.82");
    let output = pair(
        On::Vrdma(&a),
        &[program.path(), "server", a.address, "7553"],
        On::Native,
        &[program.path(), "client", a.address, "7553"],
        7553,
    );
    assert!(output.contains("cm_relisten: ok"), "{output}");
}

#[test]
#[ignore = "needs rdma_rxe and rdma_ucm: run by tests/run-all.sh inside the VM harness"]
fn a_guest_killed_mid_connection_leaves_nothing_and_its_peer_sees_the_disconnect() {
    let a = guest("killed", "192.168.77.79");
    let counts = || {
        let all = host_resource_counts();
        (all.get("cm_id").copied(), all.get("qp").copied())
    };
    let baseline = counts();
    // rping without a count runs until its peer goes.
    let mut server = On::Vrdma(&a)
        .command(&["rping", "-s", "-a", a.address, "-p", "7541"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the vrdma server");
    let deadline = Instant::now() + Duration::from_secs(30);
    let client = loop {
        let mut client = On::Native
            .command(&["rping", "-c", "-a", a.address, "-p", "7541"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the native client");
        std::thread::sleep(Duration::from_secs(2));
        // Still running: connected (a refused client exits at once).
        if client.try_wait().expect("poll the client").is_none() {
            break client;
        }
        assert!(Instant::now() < deadline, "the client never connected");
    };
    // The program under vrdma-run, and whatever it runs, killed.
    let killed = Command::new("pkill")
        .args(["-KILL", "-f", "^rping -s -a 192.168.77.79"])
        .status()
        .expect("run pkill");
    assert!(killed.success(), "no vrdma rping to kill");
    let _ = server.wait();
    // The peer hears of it and stops (its `timeout` would say 124).
    let output = client.wait_with_output().expect("wait for the client");
    assert_ne!(
        output.status.code(),
        Some(124),
        "the native peer never saw the disconnect"
    );
    // The backend destroyed the guest's cm id and QP with its connection.
    let deadline = Instant::now() + Duration::from_secs(20);
    while counts() != baseline {
        assert!(
            Instant::now() < deadline,
            "host cm ids and QPs: {:?} before, {:?} now",
            baseline,
            counts()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The process `parent` started that runs `program` (`timeout` runs `vrdma-run`, which
/// execs the program).
fn child_running(parent: u32, program: &str) -> Option<i32> {
    child_pids(parent).into_iter().find_map(|pid| {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
        (comm.trim() == program)
            .then(|| i32::try_from(pid).ok())
            .flatten()
    })
}

/// On the loopback host: a guest's rping killed mid-connection leaves no cm id or QP on the
/// device (its connection's ids go with it), and the other guest's rping, its peer, hears the
/// disconnect and ends.
#[test]
fn a_guest_killed_mid_connection_on_the_loopback_host_leaves_nothing_and_its_peer_sees_it() {
    assert!(
        on_loopback(),
        "a test of the loopback host, not of {} (a_guest_killed_mid_connection_leaves_nothing_and_its_peer_sees_the_disconnect covers it)",
        test_device_name()
    );
    let a = loopback_guest("192.168.77.85");
    let b = loopback_guest("192.168.77.86");
    let counts = || {
        let all = host_resource_counts();
        (all.get("cm_id").copied(), all.get("qp").copied())
    };
    let baseline = counts();
    // rping without a count runs until its peer goes.
    let mut server = On::Vrdma(&a)
        .command(&["rping", "-s", "-a", a.address, "-p", "7549"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the server");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cm_listening(7549) {
        assert!(Instant::now() < deadline, "the server never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut client = On::Vrdma(&b)
        .command(&["rping", "-c", "-a", a.address, "-p", "7549"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the client");
    // Connected: the server's listener and the connection's two ids.
    while counts().0 < baseline.0.map(|ids| ids + 3) {
        assert!(Instant::now() < deadline, "never connected: {:?}", counts());
        assert!(client.try_wait().unwrap().is_none(), "the client ended");
        std::thread::sleep(Duration::from_millis(50));
    }
    let rping = child_running(server.id(), "rping").expect("the server's rping");
    // SAFETY: a plain kill(2) of the process this test started.
    assert_eq!(unsafe { libc::kill(rping, libc::SIGKILL) }, 0);
    let _ = server.wait();
    // The peer hears of it and stops (its `timeout` would say 124).
    let output = client.wait_with_output().expect("wait for the client");
    assert_ne!(
        output.status.code(),
        Some(124),
        "the peer never saw the disconnect"
    );
    while counts() != baseline {
        assert!(
            Instant::now() < deadline,
            "cm ids and QPs: {baseline:?} before, {:?} now",
            counts()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
#[ignore = "needs rdma_rxe and rdma_ucm: run by tests/run-all.sh inside the VM harness"]
fn rdma_cm_programs_share_a_device_through_the_guest_service() {
    let a = guest("service", "192.168.77.80");
    let service = ServiceProcess::start(&a.socket, &[]);
    let target = service.target();
    let through = On::Service(&a, &target);
    // Each end a program of its own: with a native peer both ways, and both through vrdmad
    // (their CM ids and events kept apart by it), connected to each other.
    rping(On::Native, through, 7561);
    rping(through, On::Native, 7562);
    rping(through, through, 7563);
    udaddy(through, On::Native);
}
