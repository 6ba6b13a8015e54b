//! Unmodified libibverbs programs (Debian's binaries) on vrdma through vrdma's libibverbs.so.1,
//! run with `vrdma-run`, against a backend on the test device (see `vrdma_tests`): those
//! that pair vrdma with native rxe0 programs or need rxe otherwise run in the VM harness
//! only. The library is linked beforehand by guest-lib/ibverbs/link.sh (tests/run-all.sh
//! does it).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::Arc;

use std::time::{Duration, Instant};

use vrdma_backend::hostverbs::{loopback, Context};
use vrdma_tests::{
    spawn_backend_process, start_backend, start_backend_on, test_device_name,
    vrdma_library_dir as library_dir, vrdma_run_script as vrdma_run, wait_until_listening,
    CProgram, HangWatch, ServiceProcess, UnprivilegedCopies,
};

/// Runs `program` under a time limit, with `env` set and vrdma's library in place; never
/// hangs the test.
fn run(env: &[(&str, &str)], program: &[&str]) -> Output {
    let mut command = Command::new("timeout");
    command
        .arg("60")
        .args(program)
        .env("LD_LIBRARY_PATH", library_dir())
        .env_remove("VRDMA_DEVICE")
        .env_remove("VRDMA_CONFIG");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("run the program")
}

/// Runs `program` with `vrdma-run --device device`.
fn run_on(device: &str, program: &[&str]) -> Output {
    let output = Command::new("timeout")
        .arg("60")
        .arg(vrdma_run())
        .args(["--device", device, "--"])
        .args(program)
        .env("VRDMA_IBVERBS_DIR", library_dir())
        .output()
        .expect("run vrdma-run");
    assert_eq!(
        output.status.code(),
        Some(0),
        "{program:?} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Runs `program` with `vrdma-run` against a backend process of its own (named after
/// `name`), so that the backend's log is about this program alone: the program's output, and
/// that log once the program's connection closed. The backend stops on return.
fn run_on_a_backend_of_its_own(name: &str, program: &[&str]) -> (Output, String) {
    let socket = std::env::temp_dir().join(format!("vrdma-{name}-{}.sock", std::process::id()));
    let _backend = spawn_backend_process(&socket, &["--shared-gid"]);
    let output = run_on(socket.to_str().unwrap(), program);
    let log = vrdma_tests::wait_for_backend_log(&socket, "`connection 1: closed`", |log| {
        log.contains("connection 1: closed")
    });
    (output, log)
}

/// Starts `program` with `vrdma-run --device socket`, its output piped.
fn spawn_on(program: &CProgram, socket: &str, args: &[&str]) -> Child {
    Command::new("timeout")
        .arg("60")
        .arg(vrdma_run())
        .args(["--device", socket, "--", program.path()])
        .args(args)
        .env("VRDMA_IBVERBS_DIR", library_dir())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the program")
}

/// Reads `child`'s output until it prints `line`; the reader goes on from there.
fn wait_for_line(child: &mut Child, line: &str) -> BufReader<ChildStdout> {
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
    let mut seen = String::new();
    loop {
        let mut next = String::new();
        let n = stdout
            .read_line(&mut next)
            .expect("read the program's output");
        if n == 0 {
            let mut stderr = String::new();
            let _ = child
                .stderr
                .take()
                .map(|mut e| e.read_to_string(&mut stderr));
            panic!("the program ended before printing {line:?}: {seen}{stderr}");
        }
        seen.push_str(&next);
        if next.trim_end() == line {
            return stdout;
        }
    }
}

/// The rest of `child`'s output after `stdout`, once it exits successfully.
fn finish(mut child: Child, mut stdout: BufReader<ChildStdout>) -> String {
    let mut rest = String::new();
    stdout
        .read_to_string(&mut rest)
        .expect("read the program's output");
    let mut stderr = String::new();
    let _ = child
        .stderr
        .take()
        .map(|mut e| e.read_to_string(&mut stderr));
    let status = child.wait().expect("wait for the program");
    assert_eq!(status.code(), Some(0), "{rest}{stderr}");
    rest
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn ibv_devices_lists_vrdma0_with_the_node_guid() {
    let backend = start_backend();
    let socket = backend.socket.to_str().unwrap();
    let stdout = text(&run_on(socket, &["ibv_devices"]).stdout);
    let line = stdout
        .lines()
        .find(|line| line.trim_start().starts_with("vrdma0"))
        .unwrap_or_else(|| panic!("vrdma0 not listed:\n{stdout}"));
    let guid = line.split_whitespace().nth(1).unwrap();
    assert_eq!(guid.len(), 16, "{line}");
    assert_ne!(guid, "0000000000000000", "the GUID comes from the device");
}

/// #32: a program that reads the node GUID (listing devices) and then opens the device
/// connects to the backend once: the connection that asked for the GUID becomes the context's.
#[test]
#[ignore = "needs rdma_rxe and python3-pyverbs: run by tests/run-all.sh inside the VM harness"]
fn reading_the_node_guid_then_opening_the_device_takes_one_connection() {
    // pyverbs lists the devices with their GUIDs, then opens the one named.
    let program = "import pyverbs.device as d\n\
                   devices = [(dev.name, dev.guid) for dev in d.get_device_list()]\n\
                   print(devices, d.Context(name='vrdma0').query_device().node_guid)";
    let (output, log) = run_on_a_backend_of_its_own("guid", &["python3", "-c", program]);
    assert!(
        text(&output.stdout).contains("vrdma"),
        "{}",
        text(&output.stdout)
    );
    assert!(!log.contains("connection 2"), "a second connection:\n{log}");
}

#[test]
#[ignore = "needs rdma_rxe: compares vrdma0 with rxe0"]
fn ibv_devinfo_shows_the_attributes_port_and_gid_of_vrdma0() {
    let backend = start_backend();
    let socket = backend.socket.to_str().unwrap();
    let stdout = text(&run_on(socket, &["ibv_devinfo", "-v"]).stdout);
    let field = |name: &str| {
        stdout
            .lines()
            .find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
            .unwrap_or_else(|| panic!("no {name} in:\n{stdout}"))
    };
    assert_eq!(field("hca_id"), "vrdma0");
    assert!(field("fw_ver").starts_with("vrdma "), "{stdout}");
    assert_eq!(field("phys_port_cnt"), "1");
    assert!(field("max_qp").parse::<u32>().unwrap() > 0, "{stdout}");
    assert!(field("max_cqe").parse::<u32>().unwrap() > 0, "{stdout}");
    assert_eq!(field("state"), "PORT_ACTIVE (4)");
    assert_eq!(field("link_layer"), "Ethernet");
    // SPEC.md §5.4: the host's capability flags among those the device honours; §5.5: one
    // virtual lane, as rxe has.
    let native = Command::new("ibv_devinfo")
        .args(["-v", "-d", "rxe0"])
        .output()
        .expect("run ibv_devinfo");
    let native = text(&native.stdout);
    let native_field = |name: &str| {
        native
            .lines()
            .find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
            .unwrap_or_else(|| panic!("no {name} in:\n{native}"))
    };
    let flags = |value: &str| u32::from_str_radix(value.trim_start_matches("0x"), 16).unwrap();
    let honoured = vrdma_guest::spec::ctrl::device_cap::HONOURED;
    assert_eq!(
        flags(field("device_cap_flags")),
        flags(native_field("device_cap_flags")) & honoured,
        "{stdout}"
    );
    assert_ne!(flags(field("device_cap_flags")), 0, "rxe has some of them");
    assert_eq!(field("max_vl_num"), native_field("max_vl_num"));
    assert!(
        stdout.contains("GID[  0]:") && stdout.contains("::ffff:192.168.77.1"),
        "the guest's GID is listed, as entry 0:\n{stdout}"
    );
    assert!(
        !stdout.contains("GID[  1]:"),
        "no other GID is listed:\n{stdout}"
    );
}

#[test]
fn without_a_configured_device_programs_see_none_and_are_told_what_to_set() {
    let output = run(&[], &["ibv_devices"]);
    assert_eq!(output.status.code(), Some(0));
    assert!(!text(&output.stdout).contains("vrdma0"));
    assert!(
        text(&output.stderr).contains("VRDMA_DEVICE"),
        "{}",
        text(&output.stderr)
    );
    let devinfo = run(&[], &["ibv_devinfo"]);
    assert!(
        devinfo
            .status
            .code()
            .is_some_and(|code| code != 0 && code != 124),
        "fails cleanly, neither killed nor hung: {:?}",
        devinfo.status
    );
    assert!(text(&devinfo.stderr).contains("No IB devices found"));
}

#[test]
fn with_the_backend_down_opening_fails_with_the_socket_named() {
    let socket = std::env::temp_dir().join(format!("vrdma-nobody-{}.sock", std::process::id()));
    let socket = socket.to_str().unwrap();
    let output = run(&[("VRDMA_DEVICE", socket)], &["ibv_devinfo"]);
    assert!(
        output
            .status
            .code()
            .is_some_and(|code| code != 0 && code != 124),
        "fails cleanly, neither killed nor hung: {:?}",
        output.status
    );
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains(&format!("cannot open vrdma0 at socket {socket}")),
        "{stderr}"
    );
}

#[test]
fn perftest_and_its_provider_libraries_load_with_vrdmas_library() {
    // perftest links libmlx5, libefa and librdmacm, which import libibverbs' private ABI;
    // Debian links everything with BIND_NOW, so a missing symbol or version stops the loader.
    for program in ["ib_write_bw", "ib_send_lat", "ibv_rc_pingpong", "rping"] {
        let output = run(&[], &[program, "--help"]);
        let stderr = text(&output.stderr);
        assert!(
            !stderr.contains("symbol lookup error") && !stderr.contains("version `IBVERBS"),
            "{program} does not load: {stderr}"
        );
        assert!(
            output
                .status
                .code()
                .is_some_and(|code| code != 127 && code != 124),
            "{program}: {:?} {stderr}",
            output.status
        );
    }
}

/// Which library a pingpong end runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    /// vrdma's libibverbs, device vrdma0, through `vrdma-run`.
    Vrdma,
    /// The system's libibverbs on rxe0.
    Native,
}

/// GID index of rxe0's IPv4 RoCEv2 GID, which the backend also gives its guests.
/// rxe0's IPv4 GID in the harness guest (index 0 is its link-local one).
const NATIVE_GID_INDEX: &str = "1";
/// A vrdma guest's own GID, the only entry of its table (SPEC.md §5.6).
const VRDMA_GID_INDEX: &str = "0";

/// `program` on `side`, with its device and GID flags (`-g` for the pingpongs, `-x` for
/// perftest) and `args`.
fn peer_command(side: Side, socket: &str, program: &str, args: &[String]) -> Command {
    let mut command = Command::new("timeout");
    // Line-buffered output, so the server's address line arrives while it waits.
    command.args(["90", "stdbuf", "-oL"]);
    if side == Side::Vrdma {
        command
            .arg(vrdma_run())
            .args(["--device", socket, "--"])
            .env("VRDMA_IBVERBS_DIR", library_dir());
    }
    // ucx_perftest's server runs with the client's parameters, its device too: both ends
    // name vrdma0 (natively, rxe0 renamed: see `RenamedRxe`). UCX names a device's port and
    // picks the GID itself.
    let ucx = program == "ucx_perftest";
    let device = match (side, ucx) {
        (_, true) => "vrdma0:1",
        (Side::Vrdma, false) => "vrdma0",
        (Side::Native, false) => "rxe0",
    };
    command.args([program, "-d", device]);
    if ucx {
        // UCX 1.13 drops every datagram whose GRH does not hold its own GID, reading the
        // packet type (IPv4 or IPv6 in RoCEv2) from the completion's `sl` as mlx5 reports it;
        // rxe, and vrdma over it, report 0 there, so UCX takes an IPv4 header for an IPv6
        // one. The same setting is needed on rxe0. (ud_verbs' receive queue of 4,096 entries
        // needs no setting: vrdma0 offers that depth.)
        command.env("UCX_UD_VERBS_ETH_DGID_CHECK", "n").args(args);
        return command;
    }
    let gid_flag = if program.starts_with("ibv_") {
        "-g"
    } else {
        "-x"
    };
    let gid_index = match side {
        Side::Vrdma => VRDMA_GID_INDEX,
        Side::Native => NATIVE_GID_INDEX,
    };
    command.args([gid_flag, gid_index]).args(args);
    command
}

/// Runs `program` (an ibv_*_pingpong or a perftest test) as server on `server` and client on
/// `client`, with `args`; both must exit 0. Returns the client's and the server's output.
fn client_server(
    program: &str,
    socket: &str,
    server: Side,
    client: Side,
    args: &[&str],
) -> (String, String) {
    // perftest calibrates the CPU clock before it reports and gives up ("Can't produce a
    // report") when the samples are noisy, which full emulation sometimes makes them, natively
    // as well: only that is tried again.
    for _ in 1..3 {
        match try_client_server(program, socket, server, client, args) {
            Err(uncalibrated) => eprintln!("{uncalibrated}; running the pair again"),
            Ok(outputs) => return outputs,
        }
    }
    try_client_server(program, socket, server, client, args).unwrap_or_else(|e| panic!("{e}"))
}

/// One run of [`client_server`]: panics on any failure but perftest's clock calibration,
/// which it returns.
fn try_client_server(
    program: &str,
    socket: &str,
    server: Side,
    client: Side,
    args: &[&str],
) -> Result<(String, String), String> {
    static NEXT_PORT: AtomicU16 = AtomicU16::new(18700);
    let port = NEXT_PORT.fetch_add(1, Ordering::Relaxed);
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    args.extend(["-p".to_string(), port.to_string()]);
    let what = format!("{program} {args:?}, server {server:?}, client {client:?}");
    let mut server_process = peer_command(server, socket, program, &args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the server");
    // The pingpongs print their address once the QP is ready, perftest and ucx_perftest
    // that they wait for the client: then the client may start.
    let mut server_out = BufReader::new(server_process.stdout.take().unwrap());
    // Before `timeout` (peer_command) ends it, a server that hangs shows where.
    let watch = HangWatch::start(
        server_process.id(),
        Duration::from_secs(75),
        format!("{what}: the server"),
    );
    let mut first = String::new();
    let ready = [
        "local address",
        "Waiting for client",
        "Waiting for connection",
    ];
    while !ready.iter().any(|said| first.contains(said)) {
        let mut line = String::new();
        if server_out.read_line(&mut line).unwrap() == 0 {
            let mut said = String::new();
            if let Some(mut stderr) = server_process.stderr.take() {
                let _ = stderr.read_to_string(&mut said);
            }
            let status = server_process.wait();
            panic!("{what}: server did not start ({status:?}): {first:?} {said:?}");
        }
        first.push_str(&line);
    }
    drop(watch);
    // Ready, they say, but they may not listen yet; the client then says why it could not
    // connect.
    wait_until_listening(port);
    args.push("127.0.0.1".into());
    let client_output = peer_command(client, socket, program, &args)
        .output()
        .expect("run the client");
    let status = server_process.wait().unwrap();
    let mut server_text = first;
    server_out.read_to_string(&mut server_text).unwrap();
    let mut server_err = String::new();
    server_process
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut server_err)
        .unwrap();
    let client_text = text(&client_output.stdout);
    let client_err = text(&client_output.stderr);
    if [&client_text, &client_err, &server_text, &server_err]
        .iter()
        .any(|output| output.contains("Can't produce a report"))
    {
        return Err(format!("{what}: perftest could not calibrate its clock"));
    }
    assert_eq!(
        client_output.status.code(),
        Some(0),
        "{what}: client failed: {client_text}{client_err}"
    );
    assert_eq!(
        status.code(),
        Some(0),
        "{what}: server failed: {server_text}{server_err}"
    );
    Ok((client_text, server_text))
}

fn pingpong(program: &str, socket: &str, server: Side, client: Side, args: &[&str]) {
    let (client_text, server_text) = client_server(program, socket, server, client, args);
    for output in [client_text, server_text] {
        assert!(
            output.contains(" iters in "),
            "{program} {args:?}, server {server:?}, client {client:?}: {output}"
        );
    }
}

/// [`pingpong`] vrdma <-> vrdma, then with native rxe0 as client, then as server.
fn pingpong_every_pairing(program: &str, socket: &str, args: &[&str]) {
    for (server, client) in [
        (Side::Vrdma, Side::Vrdma),
        (Side::Vrdma, Side::Native),
        (Side::Native, Side::Vrdma),
    ] {
        pingpong(program, socket, server, client, args);
    }
}

#[test]
fn unmodified_pingpongs_and_perftest_run_between_two_vrdma_programs() {
    // Needs no rxe: on a loopback device of its own under plain `cargo test`, on rxe0 in the
    // VM harness.
    let backend = start_backend();
    let socket = backend.socket.to_str().unwrap();
    let (vrdma, args) = (Side::Vrdma, ["-c", "-s", "4096", "-n", "100"]);
    pingpong("ibv_rc_pingpong", socket, vrdma, vrdma, &args);
    let args = ["-c", "-s", "1024", "-n", "100"];
    pingpong("ibv_ud_pingpong", socket, vrdma, vrdma, &args);
    for test in ["ib_write_bw", "ib_read_lat"] {
        let (output, _) = client_server(test, socket, vrdma, vrdma, &["-n", "200"]);
        assert!(has_result_row(&output), "{test}:\n{output}");
    }
}

#[test]
fn unmodified_programs_share_one_device_through_the_guest_service() {
    // Two programs at once on one device (one backend connection) that the guest service
    // shares: a pingpong pair, then a bandwidth pair and a latency pair side by side, then
    // UCX's perftest pairs.
    let backend = start_backend();
    let service = ServiceProcess::start(&backend.socket, &[]);
    let target = service.target();
    let vrdma = Side::Vrdma;
    pingpong(
        "ibv_rc_pingpong",
        &target,
        vrdma,
        vrdma,
        &["-c", "-s", "4096", "-n", "100"],
    );
    std::thread::scope(|pairs| {
        let bandwidth =
            pairs.spawn(|| client_server("ib_write_bw", &target, vrdma, vrdma, &["-n", "200"]));
        let latency =
            pairs.spawn(|| client_server("ib_send_lat", &target, vrdma, vrdma, &["-n", "200"]));
        for (test, pair) in [("ib_write_bw", bandwidth), ("ib_send_lat", latency)] {
            let (output, _) = pair.join().expect("the pair ran");
            assert!(has_result_row(&output), "{test}:\n{output}");
        }
    });
    // UCX too, through the device node vrdmad made.
    ucx_perftest_pair(&target, vrdma, vrdma);
    let log = service.log();
    println!("{log}");
    assert!(!log.contains("refused"), "{log}");
    assert!(log.matches(" connected (").count() >= 10, "{log}");
}

#[test]
#[ignore = "needs rdma_rxe: pairs vrdma with native programs on rxe0"]
fn rc_pingpong_checks_its_buffers_between_vrdma_and_with_native_rxe() {
    let backend = start_backend();
    let socket = backend.socket.to_str().unwrap();
    for size in ["1", "4096", "65536"] {
        let args = ["-c", "-s", size, "-n", "20"];
        pingpong_every_pairing("ibv_rc_pingpong", socket, &args);
    }
}

#[test]
#[ignore = "needs rdma_rxe: pairs vrdma with native programs on rxe0"]
fn completion_events_drive_rc_pingpong_and_perftest() {
    let backend = start_backend();
    let socket = backend.socket.to_str().unwrap();
    // -e: each side sleeps in ibv_get_cq_event on a completion channel instead of polling.
    let args = ["-e", "-c", "-s", "4096", "-n", "20"];
    pingpong_every_pairing("ibv_rc_pingpong", socket, &args);
    for test in ["ib_send_lat", "ib_send_bw"] {
        let (output, _) =
            client_server(test, socket, Side::Vrdma, Side::Vrdma, &["-e", "-n", "100"]);
        assert!(has_result_row(&output), "{test} -e: {output}");
    }
}

#[test]
#[ignore = "needs rdma_rxe: pairs vrdma with native programs on rxe0"]
fn ud_pingpong_checks_its_buffers_between_vrdma_and_with_native_rxe() {
    let backend = start_backend();
    let socket = backend.socket.to_str().unwrap();
    let args = ["-c", "-s", "1024", "-n", "20"];
    pingpong_every_pairing("ibv_ud_pingpong", socket, &args);
}

#[test]
#[ignore = "needs rdma_rxe: pairs vrdma with native programs on rxe0"]
fn uc_pingpong_and_perftest_run_between_vrdma_and_with_native_rxe() {
    // SPEC.md §5.9 and §5.11: UC QPs, connected as RC ones without reads and retries. One
    // packet per message (1 KiB at the pingpong's 1 KiB MTU): UC resends nothing.
    let backend = start_backend();
    let socket = backend.socket.to_str().unwrap();
    let args = ["-c", "-s", "1024", "-n", "20"];
    pingpong_every_pairing("ibv_uc_pingpong", socket, &args);
    for (server, client) in [(Side::Vrdma, Side::Vrdma), (Side::Native, Side::Vrdma)] {
        let args = ["-c", "UC", "-n", "100"];
        let (output, _) = client_server("ib_write_bw", socket, server, client, &args);
        assert!(has_result_row(&output), "ib_write_bw -c UC:\n{output}");
    }
}

/// A perftest result row: "#bytes #iterations ..." with numbers.
fn has_result_row(output: &str) -> bool {
    output.lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.len() >= 4 && fields.iter().all(|f| f.parse::<f64>().is_ok())
    })
}

#[test]
#[ignore = "needs rdma_rxe: pairs vrdma with native programs on rxe0"]
fn perftest_runs_unmodified_on_vrdma_against_native_and_itself() {
    let backend = start_backend();
    let socket = backend.socket.to_str().unwrap();
    let tests = [
        "ib_write_lat",
        "ib_send_lat",
        "ib_read_lat",
        "ib_atomic_lat",
        "ib_write_bw",
        "ib_send_bw",
        "ib_read_bw",
    ];
    for test in tests {
        for (server, client) in [
            (Side::Native, Side::Vrdma),
            (Side::Vrdma, Side::Native),
            (Side::Vrdma, Side::Vrdma),
        ] {
            // The client reports the result (the passive end of read/atomic tests does not).
            let (output, _) = client_server(test, socket, server, client, &["-n", "100"]);
            assert!(
                has_result_row(&output),
                "{test}, server {server:?}, client {client:?}: no result row:\n{output}"
            );
        }
    }
}

/// `ucx_perftest` at UCX's transport layer, server on `server` and client on `client`:
/// active-message latency and RDMA WRITE bandwidth over rc_verbs, active-message latency over
/// ud_verbs, each with a result.
fn ucx_perftest_pair(socket: &str, server: Side, client: Side) {
    let tests = [
        ("rc_verbs", "am_lat"),
        ("rc_verbs", "put_bw"),
        ("ud_verbs", "am_lat"),
    ];
    for (transport, test) in tests {
        let args = ["-x", transport, "-t", test, "-n", "1000"];
        let (output, _) = client_server("ucx_perftest", socket, server, client, &args);
        assert!(
            output.lines().any(|line| line.starts_with("Final:")),
            "ucx_perftest {transport} {test}, server {server:?}, client {client:?}: no result:\n{output}"
        );
    }
}

#[test]
fn ucx_lists_vrdma0_and_its_perftest_runs_over_rc_and_ud_verbs_between_two_vrdma_programs() {
    // UCX, under Open MPI and much HPC software, keeps an IB device only if it has a node in
    // /dev/infiniband, which vrdma-run makes (vrdmad too); and it sends a zero-length RDMA
    // WRITE with no rkey, which a NIC does not check (IBTA C9-88).
    let backend = start_backend();
    let socket = backend.socket.to_str().unwrap();
    let info = run_on(socket, &["ucx_info", "-d"]);
    let info = text(&info.stdout);
    assert!(
        info.contains("Memory domain: vrdma0") && info.contains("Transport: rc_verbs"),
        "ucx_info -d does not list rc_verbs on vrdma0:\n{info}"
    );
    ucx_perftest_pair(socket, Side::Vrdma, Side::Vrdma);
}

/// rxe0 under the name vrdma0 until dropped, for native programs that must name the device
/// as their vrdma peer does (ucx_perftest). Devices already open (the backend's) keep working.
struct RenamedRxe;

impl RenamedRxe {
    fn new() -> RenamedRxe {
        let renamed = Command::new("rdma")
            .args(["dev", "set", "rxe0", "name", "vrdma0"])
            .status()
            .expect("run rdma");
        assert!(renamed.success(), "cannot rename rxe0");
        RenamedRxe
    }
}

impl Drop for RenamedRxe {
    fn drop(&mut self) {
        let _ = Command::new("rdma")
            .args(["dev", "set", "vrdma0", "name", "rxe0"])
            .status();
    }
}

#[test]
#[ignore = "needs rdma_rxe: pairs vrdma with native programs on rxe0"]
fn ucx_perftest_runs_over_rc_and_ud_verbs_between_vrdma_and_native_rxe() {
    let backend = start_backend();
    let socket = backend.socket.to_str().unwrap();
    let _renamed = RenamedRxe::new();
    for (server, client) in [(Side::Native, Side::Vrdma), (Side::Vrdma, Side::Native)] {
        ucx_perftest_pair(socket, server, client);
    }
}

/// Busy threads, one per CPU but one, until dropped: the programs beside them are preempted
/// (on every CPU they would take the TCP exchange perftest starts with past its patience).
struct CpuHog {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl CpuHog {
    fn start() -> CpuHog {
        let stop = Arc::new(AtomicBool::new(false));
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        let threads = (1..cpus)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        CpuHog { stop, threads }
    }
}

impl Drop for CpuHog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

#[test]
fn rdma_between_two_vrdma_programs_under_a_cpu_hog_completes_without_remote_errors() {
    // Remote access and invalid-request errors were seen vrdma <-> vrdma on a loaded
    // machine. Both ends on vrdma, eight QPs on one CQ, every size up to 8 MiB, writes and
    // reads, while busy threads take every CPU: perftest fails on any completion that is not
    // a success, so a WQE, key or address the relay read before the program's writes were
    // visible, or a slot reused too early, fails it. The race is the relay's, not the host
    // NIC's: on the loopback host it runs on real cores, truly in parallel.
    //
    // The QPs wait 4 s for an acknowledgement (-u 20) instead of perftest's 67 ms: rxe's
    // retransmission of large messages itself completes them with these errors, natively
    // too (`ib_write_bw -a -q 8 -u 4` between two native programs, docs/programs.md), and an
    // emulated machine this loaded takes longer than 67 ms to acknowledge 4 MiB.
    let backend = start_backend();
    let socket = backend.socket.to_str().unwrap();
    let _hog = CpuHog::start();
    let retries_before = rxe_retransmissions();
    for test in ["ib_write_bw", "ib_read_bw"] {
        let (output, _) = client_server(
            test,
            socket,
            Side::Vrdma,
            Side::Vrdma,
            &["-a", "-q", "8", "-n", "5", "-u", "20"],
        );
        assert!(has_result_row(&output), "{test}: no result row:\n{output}");
    }
    if let (Some(before), Some(after)) = (retries_before, rxe_retransmissions()) {
        eprintln!("rxe retransmissions during the stress: {}", after - before);
    }
}

/// rxe0's count of retransmissions (a counter of its port's `hw_counters`); None off rxe.
fn rxe_retransmissions() -> Option<u64> {
    if test_device_name() != "rxe0" {
        return None;
    }
    let path = "/sys/class/infiniband/rxe0/ports/1/hw_counters/completer_retry_err";
    let value = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    Some(
        value
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{path}: {e}")),
    )
}

#[test]
#[ignore = "needs rdma_rxe: pairs vrdma with native programs on rxe0"]
fn srq_pingpong_with_16_qps_checks_its_buffers_between_vrdma_and_with_native_rxe() {
    let backend = start_backend();
    let socket = backend.socket.to_str().unwrap();
    let args = ["-q", "16", "-c", "-s", "4096", "-n", "20"];
    pingpong_every_pairing("ibv_srq_pingpong", socket, &args);
}

/// "VERSION symbol" for every default-versioned symbol `library` exports.
fn versioned_exports(library: &std::path::Path) -> std::collections::BTreeSet<String> {
    let output = Command::new("objdump")
        .arg("-T")
        .arg(library)
        .output()
        .expect("run objdump");
    text(&output.stdout)
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [.., version, symbol] = fields[..] else {
                return None;
            };
            (version.starts_with("IBVERBS_") && !symbol.starts_with("IBVERBS_"))
                .then(|| format!("{version} {symbol}"))
        })
        .collect()
}

/// Needs no RDMA device: runs with the unit tests (after guest-lib/ibverbs/link.sh).
#[test]
fn every_symbol_of_the_system_libibverbs_is_exported_with_its_version() {
    let system = Command::new("pkg-config")
        .args(["--variable=libdir", "libibverbs"])
        .output()
        .expect("run pkg-config");
    let system = PathBuf::from(text(&system.stdout).trim()).join("libibverbs.so.1");
    let theirs = versioned_exports(&system);
    let ours = versioned_exports(&library_dir().join("libibverbs.so.1"));
    assert!(theirs.len() > 100, "{} has {theirs:?}", system.display());
    let missing: Vec<_> = theirs.difference(&ours).collect();
    assert!(
        missing.is_empty(),
        "not exported by vrdma's library: {missing:?}"
    );
}

#[test]
fn the_extended_qp_and_cq_apis_send_write_read_do_atomics_and_poll() {
    // A C program against libibverbs only (tests/c/qp_ex.c): no Debian binary uses the
    // ibv_wr_* API on a device like this one.
    let program = CProgram::build("qp_ex", &["-libverbs"]);
    let backend = start_backend();
    let output = run_on(
        backend.socket.to_str().unwrap(),
        &[program.path(), "vrdma0", VRDMA_GID_INDEX],
    );
    assert!(
        text(&output.stdout).contains("qp_ex: ok"),
        "{}",
        text(&output.stderr)
    );
}

/// Runs `program` with `vrdma-run --device socket`, `VRDMA_DEBUG` set to `debug` or removed.
fn run_with_debug(socket: &str, debug: Option<&str>, program: &[&str]) -> Output {
    let mut command = Command::new("timeout");
    command
        .arg("60")
        .arg(vrdma_run())
        .args(["--device", socket, "--"])
        .args(program)
        .env("VRDMA_IBVERBS_DIR", library_dir())
        .env_remove("VRDMA_DEBUG");
    if let Some(value) = debug {
        command.env("VRDMA_DEBUG", value);
    }
    command.output().expect("run vrdma-run")
}

/// Queues as deep as the device advertises are created (a QP at `max_qp_wr` on both queues
/// beside a CQ at `max_cqe`, UCX's UD QP of 4,096 receives: Open MPI over UCX failed in
/// MPI_Init without it), and a program that searches limits by trial, as libfabric and UCX
/// do, gets an errno for each refused try and no line on standard error: a kernel provider
/// says nothing either. `VRDMA_DEBUG` asks for the lines.
#[test]
fn queues_at_the_advertised_depths_are_created_and_refused_probes_print_nothing() {
    let program = CProgram::build("probe_limits", &["-libverbs"]);
    let backend = start_backend();
    let socket = backend.socket.to_str().unwrap();
    let quiet = run_with_debug(socket, None, &[program.path(), "vrdma0"]);
    let (stdout, stderr) = (text(&quiet.stdout), text(&quiet.stderr));
    assert!(
        quiet.status.success() && stdout.contains("probe_limits: ok"),
        "{stdout}{stderr}"
    );
    assert_eq!(stderr, "", "refused probes print nothing unless asked");
    let asked = run_with_debug(socket, Some("1"), &[program.path(), "vrdma0"]);
    let (stdout, stderr) = (text(&asked.stdout), text(&asked.stderr));
    assert!(
        asked.status.success() && stdout.contains("probe_limits: ok"),
        "{stdout}{stderr}"
    );
    assert!(
        stderr.contains("vrdma: ibv_create_qp failed"),
        "VRDMA_DEBUG=1 says why a QP was refused: {stderr:?}"
    );
}

/// Runs `mpirun -np 4 --mca pml ucx` of `program` (tests/c/mpi_check.c), each rank through
/// `wrapper` (nothing: natively), with `env` passed to the ranks; the job must end well with
/// every rank's payloads checked.
fn mpirun(program: &CProgram, wrapper: &[&str], env: &[(&str, &str)]) {
    let mut command = Command::new("timeout");
    // The guest has 2 vCPUs: 4 ranks oversubscribe them. Root, in the test guest.
    command.args([
        "240",
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "4",
        "--mca",
        "pml",
        "ucx",
    ]);
    for (name, value) in env {
        command.env(name, value).args(["-x", name]);
    }
    let output = command
        .args(wrapper)
        .arg(program.path())
        .output()
        .expect("run mpirun");
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(
        output.status.success() && stdout.contains("mpi_check: ok 4 ranks"),
        "mpirun {wrapper:?} {env:?}: {:?}\n{stdout}{stderr}",
        output.status
    );
}

/// Open MPI over UCX (the outside testers' report): every rank's UCP worker creates a UD QP
/// of 4,096 receives, which vrdma0 refused (max_qp_wr 2,048), so MPI_Init failed on every
/// rank. Now 4 ranks pass values around a ring, allreduce and broadcast them (tests/c/
/// mpi_check.c), on vrdma0 with no vrdma-specific setting, as natively on rxe0; and once
/// more with UCX held to its verbs transports, so that the payloads cross vrdma0 (else the
/// ranks of one host talk through shared memory).
///
/// UCX 1.13 needs one setting on rxe0 whatever the device: `UCX_UD_VERBS_ETH_DGID_CHECK=n`
/// (docs/programs.md: UCX), without which natively too every rank dies in a UD timeout. The
/// test checks that rxe0 passes with it, and gives vrdma0 exactly that. About 40 s in the guest.
#[test]
fn open_mpi_over_ucx_runs_on_vrdma0_with_what_rxe0_needs() {
    let program = CProgram::build_with("mpicc", "mpi_check", &[]);
    let rxe_needs = [("UCX_UD_VERBS_ETH_DGID_CHECK", "n")];
    if !loopback::is_loopback(&test_device_name()) {
        mpirun(&program, &[], &rxe_needs);
    }
    // Each rank is a program of its own, with a connection of its own to the backend.
    let socket = std::env::temp_dir().join(format!("vrdma-mpi-{}.sock", std::process::id()));
    let _backend = spawn_backend_process(&socket, &["--shared-gid", "--max-guests", "8"]);
    let run = vrdma_run();
    let wrapper = [
        run.to_str().unwrap(),
        "--device",
        socket.to_str().unwrap(),
        "--",
    ];
    let library = library_dir();
    let library = library.to_str().unwrap();
    let vrdma = [rxe_needs[0], ("VRDMA_IBVERBS_DIR", library)];
    mpirun(&program, &wrapper, &vrdma);
    let verbs_only = [vrdma[0], vrdma[1], ("UCX_TLS", "self,rc_verbs,ud_verbs")];
    mpirun(&program, &wrapper, &verbs_only);
}

/// #35: a chain of work requests given to one `ibv_post_send`/`ibv_post_recv` rings the
/// device once (the backend counts the kicks a sleeping poller gets: one per chain at most),
/// and a request refused at posting stops the chain there with `*bad_wr` at it, the ones
/// before it posted, as on rxe0; a chain longer than the send queue is refused with ENOMEM
/// at the first request with no room. (A library ringing per request kicks more only while the
/// poller is still waking up: 25 kicks for 24 posts in the run that showed it, so this
/// catches it when the wake-up is slow, not every time.)
#[test]
fn a_chain_of_work_requests_rings_one_doorbell_and_stops_at_a_refused_one() {
    const CHAINS: u64 = 8;
    let program = CProgram::build("post_list", &["-libverbs"]);
    let chains = CHAINS.to_string();
    if !loopback::is_loopback(&test_device_name()) {
        let native = Command::new("timeout")
            .args(["60", program.path(), "rxe0", NATIVE_GID_INDEX, &chains])
            .output()
            .expect("run the program on rxe0");
        assert!(
            text(&native.stdout).contains("post_list: ok"),
            "{}",
            text(&native.stderr)
        );
    }
    let (output, log) = run_on_a_backend_of_its_own(
        "chain",
        &[program.path(), "vrdma0", VRDMA_GID_INDEX, &chains],
    );
    assert!(
        text(&output.stdout).contains("post_list: ok"),
        "{}",
        text(&output.stderr)
    );
    let summary = log
        .lines()
        .find(|line| line.contains("connection 1: closed"))
        .unwrap();
    let kicks: u64 = summary
        .split(", ")
        .find_map(|part| part.strip_suffix(" kicks"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no kick count in {summary:?}"));
    // Three posts a round (a chain of receives, a chain of sends, one send), and the chain
    // that overfills the send queue.
    let posts = 3 * CHAINS + 1;
    assert!(
        kicks <= posts,
        "{kicks} kicks for {posts} posts: a chain rang more than once ({summary})"
    );
}

#[test]
fn a_refused_work_request_reaches_the_program_as_qp_fatal_on_its_qp() {
    let program = CProgram::build("async_events", &["-libverbs"]);
    let backend = start_backend();
    let output = run_on(
        backend.socket.to_str().unwrap(),
        &[program.path(), "vrdma0", "qp-fatal"],
    );
    let stdout = text(&output.stdout);
    assert!(
        stdout.contains("qp-fatal: ok"),
        "{stdout}{}",
        text(&output.stderr)
    );
    assert!(
        stdout.contains("completion: local protection error"),
        "{stdout}"
    );
}

/// Runs `ip` with `args`, panicking with its message when it fails.
fn ip(args: &[&str]) {
    let output = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        output.status.success(),
        "ip {args:?}: {}",
        text(&output.stderr)
    );
}

#[test]
#[ignore = "needs rdma_rxe: takes the host link under rxe0 down"]
fn the_host_link_going_down_and_up_reaches_the_program_as_port_events() {
    // An rxe device of its own, so that flapping its link disturbs no other test. It stays
    // until the harness's guest powers off: the backend keeps a context open on it for its
    // next connection, and rxe cannot be removed under an open context.
    let (netdev, device) = ("vrdma-port", "rxe-port");
    if !Path::new("/sys/class/infiniband").join(device).exists() {
        ip(&[
            "link",
            "add",
            netdev,
            "type",
            "veth",
            "peer",
            "name",
            "vrdma-port-b",
        ]);
        ip(&["addr", "add", "192.168.78.1/24", "dev", netdev]);
        ip(&["link", "set", netdev, "up"]);
        ip(&["link", "set", "vrdma-port-b", "up"]);
        let added = Command::new("rdma")
            .args(["link", "add", device, "type", "rxe", "netdev", netdev])
            .output()
            .expect("run rdma");
        assert!(added.status.success(), "{}", text(&added.stderr));
    }
    // The GID of the address appears a moment after the link is up.
    let deadline = Instant::now() + Duration::from_secs(10);
    while Context::open(device)
        .and_then(|context| context.find_roce_v2_ipv4_gid(1))
        .is_err()
    {
        assert!(Instant::now() < deadline, "{device} never got an IPv4 GID");
        std::thread::sleep(Duration::from_millis(100));
    }
    let program = CProgram::build("async_events", &["-libverbs"]);
    let backend = start_backend_on(device);
    let mut child = spawn_on(
        &program,
        backend.socket.to_str().unwrap(),
        &["vrdma0", "port"],
    );
    let stdout = wait_for_line(&mut child, "ready");
    ip(&["link", "set", netdev, "down"]);
    std::thread::sleep(Duration::from_secs(1));
    ip(&["link", "set", netdev, "up"]);
    let rest = finish(child, stdout);
    assert!(rest.contains("port: ok"), "{rest}");
}

#[test]
fn a_backend_that_goes_away_reaches_the_program_as_device_fatal() {
    // The real backend, in a process of its own that the test can kill.
    let socket = std::env::temp_dir().join(format!("vrdma-fatal-{}.sock", std::process::id()));
    // Beside the backends earlier tests started in this process, on the same GID.
    let mut backend = spawn_backend_process(&socket, &["--shared-gid"]);
    let program = CProgram::build("async_events", &["-libverbs"]);
    let mut child = spawn_on(&program, socket.to_str().unwrap(), &["vrdma0", "fatal"]);
    let stdout = wait_for_line(&mut child, "ready");
    backend.kill().expect("kill the backend");
    backend.wait().expect("reap the backend");
    let rest = finish(child, stdout);
    assert!(rest.contains("device-fatal: ok"), "{rest}");
    let _ = std::fs::remove_file(&socket);
}

#[test]
fn a_guest_service_that_goes_away_reaches_its_programs_as_device_fatal() {
    let backend = start_backend();
    let mut service = ServiceProcess::start(&backend.socket, &[]);
    let program = CProgram::build("async_events", &["-libverbs"]);
    let mut child = spawn_on(&program, &service.target(), &["vrdma0", "fatal"]);
    let stdout = wait_for_line(&mut child, "ready");
    service.child.kill().expect("kill vrdmad");
    service.child.wait().expect("reap vrdmad");
    let rest = finish(child, stdout);
    assert!(rest.contains("device-fatal: ok"), "{rest}");
}

/// rdma-core's own test suite (the pyverbs tests Debian's python3-pyverbs ships, gzipped),
/// unpacked into a folder of its own; removed on drop.
struct RdmaCoreSuite(PathBuf);

/// What a run of the suite takes from the workspace: the runner script, `vrdma-run` and
/// vrdma's library folder.
struct SuiteTools {
    runner: PathBuf,
    vrdma_run: PathBuf,
    library: PathBuf,
}

impl SuiteTools {
    /// Those of the checkout.
    fn workspace() -> SuiteTools {
        SuiteTools {
            runner: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("rdma-core-suite.py"),
            vrdma_run: vrdma_run(),
            library: library_dir(),
        }
    }

    /// Copies of them in `copies`.
    fn copied(&self, copies: &UnprivilegedCopies) -> SuiteTools {
        SuiteTools {
            runner: copies.copy(&self.runner),
            vrdma_run: copies.copy(&self.vrdma_run),
            library: copies.copy(&self.library),
        }
    }
}

/// One run of the suite: each case's outcome (pass, fail, error or skip), and the exception
/// of each case that failed or erred.
struct SuiteOutcomes {
    outcomes: BTreeMap<String, String>,
    reasons: BTreeMap<String, String>,
}

impl SuiteOutcomes {
    fn passes(&self) -> BTreeSet<String> {
        self.outcomes
            .iter()
            .filter(|(_, outcome)| *outcome == "pass")
            .map(|(case, _)| case.clone())
            .collect()
    }

    /// `case`'s outcome, with its exception if it has one.
    fn describe(&self, case: &str) -> String {
        let outcome = self.outcomes.get(case).map_or("not run", String::as_str);
        match self.reasons.get(case) {
            Some(reason) => format!("{outcome}: {reason}"),
            None => outcome.to_string(),
        }
    }
}

impl RdmaCoreSuite {
    const SHIPPED: &'static str = "/usr/share/doc/rdma-core/tests";

    fn unpack() -> RdmaCoreSuite {
        assert!(
            Path::new(Self::SHIPPED).join("run_tests.py").exists(),
            "no rdma-core test suite in {}: install python3-pyverbs (tests/vm/setup.sh does)",
            Self::SHIPPED
        );
        let root = std::env::temp_dir().join(format!("vrdma-rdma-core-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("create the suite's folder");
        let tests = root.join("tests");
        let copied = Command::new("cp")
            .args(["-r", Self::SHIPPED])
            .arg(&tests)
            .status()
            .expect("run cp");
        assert!(copied.success(), "copying {} failed", Self::SHIPPED);
        let unpacked = Command::new("sh")
            .arg("-c")
            .arg("gunzip -f \"$0\"/*.gz")
            .arg(&tests)
            .status()
            .expect("run gunzip");
        assert!(unpacked.success(), "unpacking the suite failed");
        RdmaCoreSuite(root)
    }

    /// Runs every case on `device` (through `vrdma-run --device target` when given one).
    fn run(&self, device_args: &[&str], target: Option<&str>) -> SuiteOutcomes {
        let tools = SuiteTools::workspace();
        self.run_with(device_args, target, &tools, Command::new("timeout"))
    }

    /// As [`RdmaCoreSuite::run`], as user nobody (group nogroup), from copies of the
    /// workspace's files it needs.
    fn run_as_nobody(&self, device_args: &[&str], target: &str) -> SuiteOutcomes {
        use std::os::unix::process::CommandExt;
        let copies = UnprivilegedCopies::new();
        let tools = SuiteTools::workspace().copied(&copies);
        let mut command = Command::new("timeout");
        command
            .uid(65534)
            .gid(65534)
            .env("HOME", &self.0)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .current_dir(&self.0);
        self.run_with(device_args, Some(target), &tools, command)
    }

    fn run_with(
        &self,
        device_args: &[&str],
        target: Option<&str>,
        tools: &SuiteTools,
        mut command: Command,
    ) -> SuiteOutcomes {
        command.arg("600");
        if let Some(target) = target {
            command
                .arg(&tools.vrdma_run)
                .arg("--device")
                .arg(target)
                .arg("--")
                .env("VRDMA_IBVERBS_DIR", &tools.library);
        }
        let output = command
            .arg("python3")
            .arg(&tools.runner)
            .arg(self.0.join("tests"))
            .args(device_args)
            .output()
            .expect("run the suite");
        let stdout = text(&output.stdout);
        // The runner's lines "TAG FIRST REST", as (FIRST, REST).
        let tagged = |tag: &'static str| {
            stdout
                .lines()
                .filter_map(move |line| line.strip_prefix(tag)?.split_once(' '))
                .map(|(first, rest)| (first.to_string(), rest.to_string()))
        };
        let outcomes: BTreeMap<String, String> = tagged("RESULT ")
            .map(|(outcome, case)| (case, outcome))
            .collect();
        let reasons = tagged("REASON ").collect();
        assert!(
            output.status.success() && !outcomes.is_empty(),
            "the suite on {device_args:?} did not finish ({}):\n{}\n{}",
            output.status,
            stdout.lines().rev().take(30).collect::<Vec<_>>().join("\n"),
            text(&output.stderr)
                .lines()
                .rev()
                .take(60)
                .collect::<Vec<_>>()
                .join("\n")
        );
        SuiteOutcomes { outcomes, reasons }
    }
}

impl Drop for RdmaCoreSuite {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The cases docs/programs.md's "rdma-core's test suite" table excuses on vrdma0, each named
/// in backquotes in a row's first cell.
fn documented_suite_exceptions() -> BTreeSet<String> {
    let programs_doc = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/programs.md"),
    )
    .expect("read docs/programs.md");
    let section = programs_doc
        .split("\n### rdma-core's test suite")
        .nth(1)
        .expect("docs/programs.md has a section \"rdma-core's test suite\"");
    let section = section.split("\n#").next().unwrap_or(section);
    section
        .lines()
        .filter_map(|row| row.strip_prefix("| "))
        .filter_map(|row| row.split(" | ").next())
        .flat_map(|cell| cell.split('`').skip(1).step_by(2))
        .filter(|case| case.starts_with("tests."))
        .map(str::to_string)
        .collect()
}

/// Issue #32's yardstick: rdma-core's own tests pass on vrdma0 every case they pass on
/// rxe0 in the same guest run, but those docs/programs.md lists with a reason; and each
/// listed exception is still one (vrdma0 does not pass it).
#[test]
#[ignore = "needs rdma_rxe and python3-pyverbs: run by tests/run-all.sh inside the VM harness"]
fn rdma_core_test_suite_passes_on_vrdma0_every_case_it_passes_on_rxe0() {
    let suite = RdmaCoreSuite::unpack();
    let native = suite.run(&["--dev", &vrdma_tests::test_device_name()], None);
    // The backend as deployed by default (one poller thread): the suite's client and server
    // are two contexts of one process, and a receive posted before a send is on the host
    // first across the connections one poller thread serves (SPEC.md §8.5).
    let socket = std::env::temp_dir().join(format!("vrdma-suite-{}.sock", std::process::id()));
    let vrdma_args = ["--dev", "vrdma0", "--gid", "0"];
    let (vrdma, served) = {
        let _backend = spawn_backend_process(&socket, &["--shared-gid"]);
        let vrdma = suite.run(&vrdma_args, socket.to_str());
        // The same device shared by the guest service, the suite an unprivileged user's.
        let service = ServiceProcess::start(&socket, &["--group", "nogroup"]);
        (vrdma, suite.run_as_nobody(&vrdma_args, &service.target()))
    };
    let (on_rxe, on_vrdma) = (native.passes(), vrdma.passes());
    let excused = documented_suite_exceptions();
    println!(
        "rdma-core's suite: {} cases; rxe0 passes {}, vrdma0 passes {} ({} excused in docs/programs.md)",
        native.outcomes.len(),
        on_rxe.len(),
        on_vrdma.len(),
        excused.len()
    );
    let unexcused: Vec<String> = on_rxe
        .difference(&on_vrdma)
        .filter(|case| !excused.contains(*case))
        .map(|case| format!("{case}: {}", vrdma.describe(case)))
        .collect();
    assert!(
        unexcused.is_empty(),
        "passed on rxe0, not on vrdma0, not in docs/programs.md:\n{}",
        unexcused.join("\n")
    );
    // (Whether rxe0 passes an excused case is not checked: some cases draw random values,
    // and rxe0 fails test_resize_cq in some runs.)
    let stale: Vec<&String> = excused
        .iter()
        .filter(|case| on_vrdma.contains(*case))
        .collect();
    assert!(
        stale.is_empty(),
        "docs/programs.md excuses cases that vrdma0 passes: {stale:?}"
    );
    let on_service = served.passes();
    println!(
        "through vrdmad as nobody, vrdma0 passes {} cases",
        on_service.len()
    );
    let differing: Vec<String> = on_service
        .symmetric_difference(&on_vrdma)
        .map(|case| {
            format!(
                "{case}: attached directly {}; through vrdmad {}",
                vrdma.describe(case),
                served.describe(case)
            )
        })
        .collect();
    assert!(
        differing.is_empty(),
        "cases that pass on vrdma0 only attached directly, or only through vrdmad as nobody:\n{}",
        differing.join("\n")
    );
}
