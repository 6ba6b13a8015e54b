//! Helpers shared by the vrdma integration tests.
//!
//! Tests run on the test device ([`test_device_name`]): under plain `cargo test`, a loopback
//! device of the test's own (the backend's software RDMA device, in this process), so that
//! the control path, the data path and unmodified programs run with no VM; inside the VM
//! harness, rxe0, where `tests/guest-tests.sh` runs the tests that only rxe can run (native
//! peers on rxe0, host links, pinned registrations, timings of a real NIC), marked
//! `#[ignore = "needs rdma_rxe: why"]`; in the VM a missing rxe device fails them all.

pub mod target_writer;

use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_backend::hostverbs::{
    loopback, qp_attr_mask as mask, AhAttr, CompletionQueue, Context, Gid, ProtectionDomain,
    QpAttr, QpCaps, QpInit, QpState, QpType, QueuePair, WorkCompletion,
};

/// The RDMA device the tests use: `$VRDMA_TEST_DEVICE` (the VM harness sets `rxe0`), or
/// else a loopback device of the test's own, named after its thread: tests run side by side
/// in one process, and must neither reach nor count each other's objects.
pub fn test_device_name() -> String {
    std::env::var("VRDMA_TEST_DEVICE").unwrap_or_else(|_| match std::thread::current().name() {
        Some(test) if test != "main" => format!("{}-{test}", loopback::NAME),
        _ => loopback::NAME.to_string(),
    })
}

/// Opens the test device; panics with the reason (naming rxe) when it is missing.
pub fn open_test_device() -> Arc<Context> {
    let name = test_device_name();
    Context::open(&name).unwrap_or_else(|e| panic!("cannot open RDMA device {name}: {e}"))
}

/// The port every test uses.
pub const PORT: u8 = 1;
/// `ibv_mtu` 1024, the rxe-on-veth active MTU.
pub const MTU_1024: u8 = 3;
/// Remote access every test QP grants.
pub const FULL_ACCESS: u32 = 1 | 2 | 4 | 8;

/// One side of an RC connection: its own PD, CQ and QP on the shared device.
pub struct RcEndpoint {
    pub pd: Arc<ProtectionDomain>,
    pub cq: Arc<CompletionQueue>,
    pub qp: QueuePair,
}

impl RcEndpoint {
    pub fn new(context: &Arc<Context>) -> RcEndpoint {
        let pd = context.alloc_pd().expect("alloc PD");
        let cq = context.create_cq(64, None).expect("create CQ");
        let caps = QpCaps {
            max_send_wr: 32,
            max_recv_wr: 32,
            max_send_sge: 2,
            max_recv_sge: 2,
            max_inline_data: 64,
        };
        let init = QpInit {
            qp_type: QpType::Rc,
            caps,
            srq: None,
            sq_sig_all: false,
        };
        let qp = pd.create_qp(&cq, &cq, &init).expect("create RC QP");
        RcEndpoint { pd, cq, qp }
    }

    /// Walks the QP RESET -> INIT -> RTR -> RTS towards `remote_qpn` at `remote_gid`; its send
    /// queue starts at `psn`, the remote one's at `remote_psn`.
    pub fn connect(
        &self,
        sgid_index: u8,
        remote_gid: Gid,
        remote_qpn: u32,
        (psn, remote_psn): (u32, u32),
    ) {
        let init = QpAttr {
            qp_state: QpState::Init,
            pkey_index: 0,
            port_num: PORT,
            qp_access_flags: FULL_ACCESS,
            ..Default::default()
        };
        self.qp
            .modify(
                &init,
                mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS,
            )
            .expect("RESET -> INIT");
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: MTU_1024,
            dest_qp_num: remote_qpn,
            rq_psn: remote_psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ah_attr: AhAttr {
                dgid: remote_gid,
                sgid_index,
                hop_limit: 1,
                is_global: true,
                port_num: PORT,
                ..Default::default()
            },
            ..Default::default()
        };
        self.qp
            .modify(
                &rtr,
                mask::STATE
                    | mask::AV
                    | mask::PATH_MTU
                    | mask::DEST_QPN
                    | mask::RQ_PSN
                    | mask::MAX_DEST_RD_ATOMIC
                    | mask::MIN_RNR_TIMER,
            )
            .expect("INIT -> RTR");
        let rts = QpAttr {
            qp_state: QpState::Rts,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            sq_psn: psn,
            max_rd_atomic: 1,
            ..Default::default()
        };
        self.qp
            .modify(
                &rts,
                mask::STATE
                    | mask::TIMEOUT
                    | mask::RETRY_CNT
                    | mask::RNR_RETRY
                    | mask::SQ_PSN
                    | mask::MAX_QP_RD_ATOMIC,
            )
            .expect("RTR -> RTS");
    }
}

/// The host's own index of `gid` on the test device: where a native peer finds the GID a
/// vrdma guest (whose table holds only that GID, at index 0) sends from.
pub fn host_gid_index(context: &Context, gid: Gid) -> u8 {
    let index = context
        .find_roce_v2_gid(PORT, gid)
        .expect("query the GID table")
        .unwrap_or_else(|| panic!("{gid} is not in the host's GID table"));
    u8::try_from(index).expect("GID index fits in a byte")
}

/// Two RC endpoints on one device, connected to each other through its RoCEv2 IPv4 GID.
pub fn connected_rc_pair(context: &Arc<Context>) -> (RcEndpoint, RcEndpoint) {
    let (gid_index, gid) = context
        .find_roce_v2_ipv4_gid(PORT)
        .expect("the test device needs a RoCEv2 GID with an IPv4 address");
    let gid_index = u8::try_from(gid_index).expect("GID index fits in a byte");
    let a = RcEndpoint::new(context);
    let b = RcEndpoint::new(context);
    let psns = (vrdma_guest::random_psn(), vrdma_guest::random_psn());
    a.connect(gid_index, gid, b.qp.qp_num(), psns);
    b.connect(gid_index, gid, a.qp.qp_num(), (psns.1, psns.0));
    (a, b)
}

/// Calls `poll` (which fills a batch and says how many it filled) until `count` completions
/// arrived; panics after a generous timeout (the tests run under TCG emulation).
fn poll_until<T: Default + std::fmt::Debug>(
    count: usize,
    mut poll: impl FnMut(&mut [T]) -> usize,
) -> Vec<T> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut done = Vec::with_capacity(count);
    let mut batch: Vec<T> = (0..16).map(|_| T::default()).collect();
    while done.len() < count {
        let want = (count - done.len()).min(batch.len());
        let n = poll(&mut batch[..want]);
        done.extend(batch[..n].iter_mut().map(std::mem::take));
        assert!(
            Instant::now() < deadline,
            "timed out with {} of {count} completions: {done:?}",
            done.len()
        );
        if n == 0 {
            std::thread::yield_now();
        }
    }
    done
}

/// Waits (at most 60 s) until a TCP socket listens on `port`, as `tests/listening.sh` does:
/// ibv_*_pingpong and perftest servers say they are ready before they listen, so a client
/// started on that word alone may find no listener. False if none did.
pub fn wait_until_listening(port: u16) -> bool {
    let local = format!(":{port:04X} ");
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let listening = ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
            std::fs::read_to_string(table).is_ok_and(|sockets| {
                // Fields: sl local_address rem_address st ...; 0A is LISTEN.
                sockets.lines().any(|socket| {
                    let fields: Vec<&str> = socket.split_whitespace().collect();
                    fields.len() > 3 && fields[1].ends_with(local.trim_end()) && fields[3] == "0A"
                })
            })
        });
        if listening {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Polls a host CQ until `count` completions arrived.
pub fn wait_for_completions(cq: &CompletionQueue, count: usize) -> Vec<WorkCompletion> {
    poll_until(count, |batch| cq.poll(batch).expect("poll CQ"))
}

/// A backend serving guests on a fresh socket, in this process, on the test device.
pub struct TestBackend {
    pub socket: std::path::PathBuf,
}

/// Starts a backend thread on the test device, listening on a new socket under the temp
/// directory.
pub fn start_backend() -> TestBackend {
    start_backend_on(&test_device_name())
}

/// Starts a backend thread on RDMA device `device`, listening on a new socket under the temp
/// directory.
pub fn start_backend_on(device: &str) -> TestBackend {
    start_backend_with(device, vrdma_backend::Quotas::default())
}

/// Starts a backend thread on RDMA device `device` with `quotas`, listening on a new socket
/// under the temp directory.
pub fn start_backend_with(device: &str, quotas: vrdma_backend::Quotas) -> TestBackend {
    serve_in_background(test_config(device, quotas), new_test_socket())
}

/// Starts a backend thread on the test device serving a guest whose address is `address`
/// (`--guest-ip`, with its prefix length), listening on a new socket under the temp
/// directory. On the loopback host, the guests of all such backends of one test reach each
/// other through its loopback device's connection manager.
pub fn start_backend_for_guest(address: &str) -> TestBackend {
    let config = vrdma_backend::Config {
        guest_ip: Some(address.parse().expect("a guest address")),
        ..test_config(&test_device_name(), vrdma_backend::Quotas::default())
    };
    serve_in_background(config, new_test_socket())
}

/// A socket path no other test backend of this process uses.
fn new_test_socket() -> std::path::PathBuf {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!("vrdma-test-{}-{n}.sock", std::process::id()))
}

/// The configuration of an in-process test backend on `device` with `quotas`.
fn test_config(device: &str, quotas: vrdma_backend::Quotas) -> vrdma_backend::Config {
    vrdma_backend::Config {
        device: device.to_string(),
        port: PORT,
        gid_index: None,
        guest_ip: None,
        quotas,
        // Two pool threads: a test's connections are spread over both.
        notify_queues: 2,
        poll_threads: 2,
        poll_idle: Duration::from_millis(2),
        poll_cpus: Vec::new(),
        // The test process itself is not confined.
        seccomp: vrdma_backend::sandbox::SeccompMode::None,
        // Tests connect several guests (a pair of peers, an attacker and its victim).
        max_guests: vrdma_backend::limits::DEFAULT_GUESTS,
        shared_gid: true,
        unsealed_memory: vrdma_backend::memory_regions::UnsealedFiles::Refuse,
        rate_limits: vrdma_backend::datapath::RateLimits::default(),
        socket_group: None,
        handshake_timeout: Duration::from_secs(10),
    }
}

/// Starts a backend thread serving `config` on `socket`; returns once it listens.
pub fn serve_in_background(
    config: vrdma_backend::Config,
    socket: std::path::PathBuf,
) -> TestBackend {
    let path = socket.clone();
    std::thread::spawn(move || {
        if let Err(e) = vrdma_backend::vhost_user::serve(&config, &path) {
            panic!("backend stopped: {e}");
        }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        assert!(
            Instant::now() < deadline,
            "the backend never created {}",
            socket.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    TestBackend { socket }
}

/// A size a benchmark takes from the environment variable `name`, or `default`.
pub fn size_from_env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The backend binary, `vhost-user-rdma`, as a process of its own on the test device,
/// accepting guests on `socket` once this returns; `args` are added to its command line and its log
/// (RUST_LOG=info) goes to [`backend_log`]`(socket)`. The test may signal or kill it.
pub fn spawn_backend_process(socket: &std::path::Path, args: &[&str]) -> BackendProcess {
    let binary = backend_binary();
    let _ = std::fs::remove_file(socket);
    let log = std::fs::File::create(backend_log(socket)).expect("create the backend's log");
    let mut backend = std::process::Command::new(&binary)
        .arg("--socket-path")
        .arg(socket)
        .args(["--device", &test_device_name()])
        .args(args)
        .env("RUST_LOG", "info")
        .stderr(log)
        .spawn()
        .expect("start the backend");
    // Ready once it says so: the socket exists before the device is opened.
    wait_for_backend_log(socket, "`accepting guests`", |log| {
        if let Some(status) = backend.try_wait().expect("poll the backend") {
            panic!("the backend exited ({status}) before listening:\n{log}");
        }
        log.contains("accepting guests")
    });
    BackendProcess(backend)
}

/// A backend process a test started: killed when dropped, so that a test that fails leaves
/// no backend behind holding the GID the tests after it need.
pub struct BackendProcess(std::process::Child);

impl std::ops::Deref for BackendProcess {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for BackendProcess {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for BackendProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits up to 10 s for the log of the backend on `socket` ([`backend_log`]) to satisfy `done`,
/// and returns it. Lines a backend logs after an event (a connection's summary after its
/// objects are released) land a moment later, so a test never reads the log just once.
pub fn wait_for_backend_log(
    socket: &std::path::Path,
    awaited: &str,
    mut done: impl FnMut(&str) -> bool,
) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = std::fs::read_to_string(backend_log(socket)).unwrap_or_default();
        if done(&log) {
            return log;
        }
        assert!(Instant::now() < deadline, "no {awaited} in:\n{log}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs the backend binary on the test device with `args` added, expects it to refuse them
/// (exit with failure before serving), and returns what it printed on stderr.
pub fn backend_refuses(socket: &std::path::Path, args: &[&str]) -> String {
    let refused = std::process::Command::new(backend_binary())
        .arg("--socket-path")
        .arg(socket)
        .args(["--device", &test_device_name()])
        .args(args)
        .output()
        .expect("run the backend");
    let stderr = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert!(
        !refused.status.success(),
        "the backend accepted {args:?}:\n{stderr}"
    );
    stderr
}

/// The backend binary, `vhost-user-rdma`, as the workspace built it.
pub fn backend_binary() -> std::path::PathBuf {
    workspace_binary("vhost-user-rdma")
}

/// A binary of the workspace, `name`, as the workspace built it (debug).
pub fn workspace_binary(name: &str) -> std::path::PathBuf {
    let binary = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/debug")
        .join(name);
    assert!(
        binary.exists(),
        "no {}: build the workspace's binaries first (cargo build --workspace --bins)",
        binary.display()
    );
    binary
}

/// Where link.sh put vrdma's libibverbs.so.1 and librdmacm.so.1 for this build:
/// `$VRDMA_IBVERBS_DIR`, or target/debug/vrdma-ibverbs.
pub fn vrdma_library_dir() -> std::path::PathBuf {
    let dir = std::env::var_os("VRDMA_IBVERBS_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../target/debug/vrdma-ibverbs")
        });
    for library in ["libibverbs.so.1", "librdmacm.so.1"] {
        assert!(
            dir.join(library).exists(),
            "no {library} in {}: run guest-lib/ibverbs/link.sh first",
            dir.display()
        );
    }
    dir
}

/// `vrdma-run`, which runs an unmodified program on a vrdma device.
pub fn vrdma_run_script() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../guest-lib/ibverbs/vrdma-run")
}

/// A test program of tests/c/, compiled against the system's libraries (`-libverbs`,
/// `-lrdmacm`: it runs natively, or on vrdma's through `vrdma-run`); removed on drop.
pub struct CProgram(std::path::PathBuf);

impl CProgram {
    pub fn build(name: &str, libraries: &[&str]) -> CProgram {
        CProgram::build_with("cc", name, libraries)
    }

    /// Builds `c/NAME.c` with `compiler` (`mpicc` for an MPI program).
    pub fn build_with(compiler: &str, name: &str, libraries: &[&str]) -> CProgram {
        let source =
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("c/{name}.c"));
        let program = std::env::temp_dir().join(format!("vrdma-{name}-{}", std::process::id()));
        let compiled = std::process::Command::new(compiler)
            .args(["-Wall", "-O1", "-o"])
            .arg(&program)
            .arg(&source)
            .args(libraries)
            .output()
            .expect("run cc");
        assert!(
            compiled.status.success(),
            "{}",
            String::from_utf8_lossy(&compiled.stderr)
        );
        CProgram(program)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().expect("a UTF-8 path")
    }
}

impl Drop for CProgram {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Copies of workspace files for programs the tests run as another user (nobody): the
/// checkout may lie below a folder only its owner may enter (a home, or a `mktemp -d`
/// folder), so such programs run from copies in a folder of the temporary directory that
/// everyone may read. Removed when dropped.
pub struct UnprivilegedCopies(std::path::PathBuf);

impl UnprivilegedCopies {
    pub fn new() -> UnprivilegedCopies {
        use std::os::unix::fs::PermissionsExt;
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("vrdma-unprivileged-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the folder for unprivileged copies");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
            .expect("open the folder for unprivileged copies to all");
        UnprivilegedCopies(dir)
    }

    /// A copy of `path` (a file, or a folder with what it holds), which everyone may read
    /// and, where its owner may, execute.
    pub fn copy(&self, path: &std::path::Path) -> std::path::PathBuf {
        let name = path.file_name().expect("a file or folder name");
        let copy = self.0.join(name);
        let succeeds = |command: &mut std::process::Command| {
            command.status().is_ok_and(|status| status.success())
        };
        let copied = succeeds(
            std::process::Command::new("cp")
                .arg("-r")
                .arg(path)
                .arg(&copy),
        ) && succeeds(
            std::process::Command::new("chmod")
                .args(["-R", "a+rX"])
                .arg(&copy),
        );
        assert!(
            copied,
            "copying {} for unprivileged use failed",
            path.display()
        );
        copy
    }
}

impl Default for UnprivilegedCopies {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for UnprivilegedCopies {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The guest service, `vrdmad`, as a process sharing the device behind `device` (a
/// backend's socket) on a socket of its own, [`ServiceProcess::socket`]; `args` are added
/// to its command line and its log goes to [`ServiceProcess::log`]. Killed when dropped.
pub struct ServiceProcess {
    pub child: std::process::Child,
    pub socket: std::path::PathBuf,
}

impl ServiceProcess {
    pub fn start(device: &std::path::Path, args: &[&str]) -> ServiceProcess {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let socket =
            std::env::temp_dir().join(format!("vrdmad-test-{}-{n}.sock", std::process::id()));
        let log = std::fs::File::create(socket.with_extension("log")).expect("create its log");
        let child = std::process::Command::new(workspace_binary("vrdmad"))
            .arg("--device")
            .arg(device)
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .env("RUST_LOG", "info")
            .stderr(log)
            .spawn()
            .expect("start vrdmad");
        let mut service = ServiceProcess { child, socket };
        service.wait_for_log("`listening on`", |log| log.contains("listening on"));
        service
    }

    /// The device target programs name to reach the service.
    pub fn target(&self) -> String {
        format!("service:{}", self.socket.display())
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.socket.with_extension("log")).unwrap_or_default()
    }

    /// Waits up to 10 s for the service's log to satisfy `done`, and returns it; fails if
    /// the service exits meanwhile.
    pub fn wait_for_log(&mut self, awaited: &str, mut done: impl FnMut(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = self.log();
            if done(&log) {
                return log;
            }
            if let Some(status) = self.child.try_wait().expect("poll vrdmad") {
                panic!("vrdmad exited ({status}) waiting for {awaited}:\n{log}");
            }
            assert!(Instant::now() < deadline, "no {awaited} in:\n{log}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where [`spawn_backend_process`] writes the log of the backend listening on `socket`.
pub fn backend_log(socket: &std::path::Path) -> std::path::PathBuf {
    socket.with_extension("log")
}

/// Host object counts of the test device, from `rdma resource show` (pd, cq, qp, mr, ctx ...);
/// on the loopback host, its own (of this process: test backends run in it).
pub fn host_resource_counts() -> std::collections::BTreeMap<String, u64> {
    let device = test_device_name();
    if loopback::is_loopback(&device) {
        return loopback::Device::named(&device).resource_counts();
    }
    let output = std::process::Command::new("rdma")
        .args(["resource", "show"])
        .output()
        .expect("run `rdma resource show`");
    assert!(output.status.success(), "rdma resource show failed");
    let text = String::from_utf8_lossy(&output.stdout);
    let device = format!("{}:", test_device_name());
    let line = text
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(device.as_str()))
        .unwrap_or_else(|| panic!("no {device} line in: {text}"));
    let words: Vec<&str> = line.split_whitespace().skip(2).collect();
    words
        .chunks(2)
        .filter_map(|pair| Some((pair[0].to_string(), pair.get(1)?.parse().ok()?)))
        .collect()
}

/// Waits until the host's resource counts equal `baseline` (object teardown is asynchronous
/// to the guest); panics with both when they do not within the timeout.
pub fn wait_for_host_counts(baseline: &std::collections::BTreeMap<String, u64>) {
    wait_for_host_counts_within(baseline, Duration::from_secs(20))
}

/// [`wait_for_host_counts`] with a timeout of its own, for teardowns of many objects.
pub fn wait_for_host_counts_within(
    baseline: &std::collections::BTreeMap<String, u64>,
    timeout: Duration,
) {
    let deadline = Instant::now() + timeout;
    loop {
        let now = host_resource_counts();
        if &now == baseline {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "host objects leaked: baseline {baseline:?}, now {now:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Watches a process that should soon say it is ready: if it has not within the given time,
/// prints to stderr where its threads and this test process's (where in-process backends run)
/// are, user stacks (gdb, when installed) and kernel ones, so that a hang shows where it is.
/// Dropping the watch ends it: its watching thread hears the channel close.
pub struct HangWatch {
    _ready: std::sync::mpsc::Sender<()>,
}

impl HangWatch {
    /// Watches `pid` and its descendants (a `timeout` running the program, say), described
    /// as `what` in the report.
    pub fn start(pid: u32, after: Duration, what: String) -> HangWatch {
        let (ready, watch) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if watch.recv_timeout(after) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                let mut pids = vec![pid];
                let mut next = 0;
                while next < pids.len() {
                    pids.extend(child_pids(pids[next]));
                    next += 1;
                }
                pids.push(std::process::id());
                eprintln!("{what}: not ready after {after:?}; where its processes and this test's threads are:");
                for pid in pids {
                    eprintln!("{}", thread_stacks(pid));
                }
            }
        });
        HangWatch { _ready: ready }
    }
}

/// The thread folders (`/proc/PID/task/TID`) of `pid`; none when it is gone.
fn task_dirs(pid: u32) -> impl Iterator<Item = std::fs::DirEntry> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
}

/// The processes whose parent is `pid` (started by any of its threads).
pub fn child_pids(pid: u32) -> Vec<u32> {
    task_dirs(pid)
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|children| {
            children
                .split_whitespace()
                .filter_map(|child| child.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// Each thread of `pid`: its name and kernel stack (as root) and, when gdb is installed, its
/// user stack. gdb writes to a file: it stops every thread of the process it attaches to,
/// which for this process includes the one that would read a pipe.
fn thread_stacks(pid: u32) -> String {
    let command = std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .replace('\0', " ");
    let mut report = format!("== process {pid}: {command}\n");
    for task in task_dirs(pid) {
        let read = |name: &str| std::fs::read_to_string(task.path().join(name)).unwrap_or_default();
        report += &format!(
            "thread {} {} in {}\n{}",
            task.file_name().to_string_lossy(),
            read("comm").trim(),
            read("wchan"),
            read("stack")
        );
    }
    let file = std::env::temp_dir().join(format!("vrdma-stacks-{pid}.txt"));
    let traced = std::process::Command::new("timeout")
        .args(["60", "gdb", "-q", "-batch", "-p", &pid.to_string()])
        .args(["-ex", "thread apply all bt"])
        .stdin(std::process::Stdio::null())
        .stdout(
            std::fs::File::create(&file)
                .map(std::process::Stdio::from)
                .unwrap_or(std::process::Stdio::null()),
        )
        .stderr(std::process::Stdio::null())
        .status();
    match traced {
        Ok(status) if status.success() => {
            report += &std::fs::read_to_string(&file).unwrap_or_default();
        }
        other => report += &format!("(no user stacks: gdb {other:?})\n"),
    }
    let _ = std::fs::remove_file(&file);
    report
}

/// CPU time (user + system) the process (or thread: `PID/task/TID`) `pid` has used.
pub fn cpu_time(pid: impl std::fmt::Display) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces), from field 3 on.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf reads a constant of the system.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Duration::from_millis(ticks * 1000 / per_second)
}

/// A global route to `gid` from source GID index `sgid_index` on port 1, one hop.
pub fn route_to(sgid_index: u32, gid: vrdma_guest::Gid) -> vrdma_guest::AhAttr {
    vrdma_guest::AhAttr {
        dgid: gid,
        sgid_index: sgid_index as u8,
        hop_limit: 1,
        is_global: true,
        port_num: 1,
        ..Default::default()
    }
}

/// Walks a guest-lib RC QP to RTS towards `remote_qpn` at `remote_gid`, both sides at PSN
/// 0x1234: for a test's own pairs; programs that face a peer pick random PSNs and exchange
/// them ([`EndpointAddress`]).
pub fn connect_guest_qp(
    qp: &vrdma_guest::QueuePair,
    sgid_index: u8,
    remote_gid: Gid,
    remote_qpn: u32,
) -> vrdma_guest::Result<()> {
    let peer = vrdma_guest::RcPeer {
        qp_num: remote_qpn,
        gid: remote_gid,
        psn: 0x1234,
    };
    qp.connect_rc(sgid_index, 0x1234, &peer)
}

/// Walks a guest-lib RC QP to RTS connected to itself (through the device's GID 0): a QP
/// that takes sends with no peer, for tests of what the device does with the WQEs.
pub fn connect_to_itself(
    device: &vrdma_guest::Device,
    qp: &vrdma_guest::QueuePair,
) -> vrdma_guest::Result<()> {
    let (gid, _) = device.query_gid(0)?;
    connect_guest_qp(qp, 0, gid, qp.qp_num())
}

/// A socket path under the temp directory for a test's own backend process, named `name` and
/// this process.
pub fn socket_named(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("vrdma-{name}-{}.sock", std::process::id()))
}

/// A guest attached to the backend on `socket` that checks it is still served.
pub fn served_guest(socket: &std::path::Path) -> WritingGuest {
    WritingGuest::open(socket.to_str().expect("a UTF-8 socket path"))
}

/// A guest that checks it is still served: two QPs of its own connected to each other, and an
/// RDMA WRITE between two pages of its MR whose bytes are checked where they land.
pub struct WritingGuest {
    pub qp: vrdma_guest::QueuePair,
    _peer: vrdma_guest::QueuePair,
    pub cq: vrdma_guest::CompletionQueue,
    pub mr: vrdma_guest::MemoryRegion,
    pub buffer: vrdma_guest::SharedBuffer,
    pub device: vrdma_guest::Device,
}

impl WritingGuest {
    const PAGE: u64 = 4096;

    /// Sets it up on the device `target` names (see `Device::open`).
    pub fn open(target: &str) -> WritingGuest {
        let device =
            vrdma_guest::Device::open(target).unwrap_or_else(|e| panic!("opening {target}: {e}"));
        Self::on(device)
    }

    /// Sets it up on `device`.
    pub fn on(device: vrdma_guest::Device) -> WritingGuest {
        use vrdma_guest::{access, QpType, QueuePair};
        let pd = device.alloc_pd().unwrap();
        let cq = device.create_cq(16).unwrap();
        let qp = QueuePair::builder(QpType::Rc, &cq).build(&pd).unwrap();
        let peer = QueuePair::builder(QpType::Rc, &cq).build(&pd).unwrap();
        let (gid_index, gid) = device.gid().unwrap();
        connect_guest_qp(&qp, gid_index as u8, gid, peer.qp_num()).unwrap();
        connect_guest_qp(&peer, gid_index as u8, gid, qp.qp_num()).unwrap();
        let buffer = device.alloc_buffer(2 * Self::PAGE).unwrap();
        let mr = pd
            .reg_mr(
                &buffer,
                access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ,
            )
            .unwrap();
        WritingGuest {
            qp,
            _peer: peer,
            cq,
            mr,
            buffer,
            device,
        }
    }

    /// Writes `seed`s from the first page to the second and checks them there.
    pub fn still_served(&self, seed: u8) {
        let message = [seed; 64];
        self.post_write(&message).unwrap();
        let done = wait_for_guest_completions(&self.cq, 1);
        assert!(done[0].is_success(), "write {seed}: {:?}", done[0]);
        let mut landed = [0u8; 64];
        self.buffer.read(Self::PAGE, &mut landed).unwrap();
        assert_eq!(landed, message, "write {seed}");
    }
}

impl WritingGuest {
    /// Posts an RDMA WRITE of `message` from the first page to the second.
    pub fn post_write(&self, message: &[u8]) -> vrdma_guest::Result<()> {
        use vrdma_guest::{Payload, SendOp, SendWr, Sge};
        self.buffer.write(0, message)?;
        let write = SendOp::RdmaWrite {
            remote_addr: self.buffer.addr() + Self::PAGE,
            rkey: self.mr.rkey(),
        };
        let sge = [Sge {
            addr: self.buffer.addr(),
            length: message.len() as u32,
            lkey: self.mr.lkey(),
        }];
        let wr_id = u64::from(message.first().copied().unwrap_or(0));
        self.qp
            .post_send(&[SendWr::new(wr_id, write, Payload::Sges(&sge))])
    }
}

/// Polls a guest-lib CQ until `count` completions arrived.
pub fn wait_for_guest_completions(
    cq: &vrdma_guest::CompletionQueue,
    count: usize,
) -> Vec<vrdma_guest::WorkCompletion> {
    poll_until(count, |batch| cq.poll(batch).expect("poll guest CQ"))
}

/// Walks a guest-lib UD QP to RTS with queue key `qkey` on port 1.
pub fn ud_to_rts(qp: &vrdma_guest::QueuePair, qkey: u32) -> vrdma_guest::Result<()> {
    use vrdma_guest::{qp_attr_mask as mask, QpAttr, QpState};
    let init = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qkey,
        ..Default::default()
    };
    qp.modify(
        &init,
        mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY,
    )?;
    for (state, extra) in [(QpState::Rtr, 0), (QpState::Rts, mask::SQ_PSN)] {
        let attr = QpAttr {
            qp_state: state,
            ..Default::default()
        };
        qp.modify(&attr, mask::STATE | extra)?;
    }
    Ok(())
}

/// The bytes the data-path tests write and verify: distinct per `seed`, aperiodic enough that
/// a shifted or repeated block does not match.
pub fn test_pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((i ^ seed << 32).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8)
        .collect()
}

/// The value of `name=value` in a line of space-separated fields (the guest-endpoint
/// programs' output).
pub fn line_field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(name)?.strip_prefix('='))
}

/// Length of one ping-pong message (guest-endpoint, native-endpoint).
pub const MESSAGE_LEN: usize = 512;

/// FNV-1a, enough to catch a byte that went astray.
pub fn checksum(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

/// Ping-pong message `i`: its sequence number, a pattern, and the checksum of both.
pub fn ping_message(i: u64) -> [u8; MESSAGE_LEN] {
    let mut message = [0u8; MESSAGE_LEN];
    message[..8].copy_from_slice(&i.to_le_bytes());
    message[8..MESSAGE_LEN - 4].copy_from_slice(&test_pattern(MESSAGE_LEN - 12, i));
    let sum = checksum(&message[..MESSAGE_LEN - 4]);
    message[MESSAGE_LEN - 4..].copy_from_slice(&sum.to_le_bytes());
    message
}

/// Panics unless `message` is an intact message `i`.
pub fn check_message(i: u64, message: &[u8]) {
    assert_eq!(message.len(), MESSAGE_LEN, "message {i}: length");
    let sum = u32::from_le_bytes(message[MESSAGE_LEN - 4..].try_into().unwrap());
    assert_eq!(
        checksum(&message[..MESSAGE_LEN - 4]),
        sum,
        "message {i}: checksum"
    );
    assert_eq!(message[..8], i.to_le_bytes(), "message {i}: sequence");
}

/// Where in its buffer a ping-pong peer exposes memory to one-sided operations, and how much.
pub const RDMA_AREA: (u64, usize) = (16 << 10, 16 << 10);

/// What a test endpoint publishes on its first output line, `qpn=N psn=P gid=G rkey=K va=A`:
/// enough for a peer to connect to its QP (whose send queue starts at the random PSN P) and to
/// address its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointAddress {
    pub qpn: u32,
    pub psn: u32,
    pub gid: Gid,
    pub rkey: u32,
    pub va: u64,
}

impl std::fmt::Display for EndpointAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gid = std::net::Ipv6Addr::from(self.gid.0);
        write!(
            f,
            "qpn={} psn={} gid={gid} rkey={} va={:#x}",
            self.qpn, self.psn, self.rkey, self.va
        )
    }
}

impl EndpointAddress {
    /// Parses a published line; panics, naming the field, on a malformed one.
    pub fn parse(line: &str) -> EndpointAddress {
        let field = |name| line_field(line, name).unwrap_or_else(|| panic!("{line}: no {name}"));
        let gid: std::net::Ipv6Addr = field("gid").parse().expect("gid");
        EndpointAddress {
            qpn: field("qpn").parse().expect("qpn"),
            psn: field("psn").parse().expect("psn"),
            gid: Gid(gid.octets()),
            rkey: field("rkey").parse().expect("rkey"),
            va: u64::from_str_radix(field("va").trim_start_matches("0x"), 16).expect("va"),
        }
    }

    /// Reads the peer's line from stdin.
    pub fn read_peer() -> EndpointAddress {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::stdin().lock(), &mut line).expect("peer line");
        Self::parse(&line)
    }
}

/// A raw control request: the header for `opcode`, then `payload`'s bytes.
pub fn control_request<T: vrdma_guest::spec::ByteValued>(opcode: u16, payload: &T) -> Vec<u8> {
    vrdma_guest::spec::ctrl::request_bytes(opcode, payload.as_slice())
}

/// The status of a raw control response.
pub fn response_status(response: &[u8]) -> u16 {
    assert!(response.len() >= 8, "no response header: {response:?}");
    u16::from_le_bytes([response[0], response[1]])
}

/// How long a test waits for a CM event.
const CM_EVENT_WAIT: Duration = Duration::from_secs(20);

/// The next CM event of `id`, waiting for the device to announce one.
pub fn next_cm_event(device: &vrdma_guest::Device, id: &vrdma_guest::CmId) -> vrdma_guest::CmEvent {
    let deadline = Instant::now() + CM_EVENT_WAIT;
    loop {
        if let Some(event) = id.get_event().expect("CM_GET_EVENT") {
            return event;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no CM event on id {:#x}", id.handle());
        // Any device event ends the wait; only the id's own CM event is awaited.
        let _ = device.wait_event(left).expect("wait for a device event");
    }
}

/// The next CM event of `id`, which must be `wanted` (a `vrdma_guest::cm::event` value).
pub fn expect_cm_event(
    device: &vrdma_guest::Device,
    id: &vrdma_guest::CmId,
    wanted: u32,
) -> vrdma_guest::CmEvent {
    let got = next_cm_event(device, id);
    assert_eq!(
        got.event,
        wanted,
        "{} (status {}) where {} was due",
        got.name(),
        got.status,
        vrdma_guest::cm::event::name(wanted)
    );
    got
}
