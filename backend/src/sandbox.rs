//! The backend confined: once it listens, every thread runs under a seccomp filter that allows
//! only the system calls serving guests needs (vhost-user messages and guest memory, the host
//! RDMA device through libibverbs, threads, eventfds and epoll, logging). Anything else kills
//! the process, after one line on stderr naming the system call.
//!
//! What is allowed was read off the backend serving the whole test suite (strace -f), then
//! reasoned about; `--seccomp log` lets an operator find what a new host library adds.
//!
//! Started as root, the backend can also become an unprivileged user ([`run_as`]) before it
//! starts any thread, once what needs root is done (raising its resource limits, putting a
//! guest's address on the host).

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

/// What happens to a system call outside the allowed list.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SeccompMode {
    /// No filter (the default for the library, whose users are other programs and tests).
    #[default]
    None,
    /// The kernel logs the call and lets it through.
    Log,
    /// The process exits, with a line on stderr naming the call.
    Kill,
}

/// The exit status of a process a disallowed system call ended (128 + SIGSYS, as a shell
/// reports a process SIGSYS killed).
pub const KILLED_STATUS: i32 = 128 + libc::SIGSYS;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("cannot build the seccomp filter: {0}")]
    Filter(#[from] seccompiler::BackendError),
    #[error("cannot compile the seccomp filter: {0}")]
    Compile(#[from] seccompiler::Error),
    #[error("cannot install the SIGSYS handler: {0}")]
    Handler(vmm_sys_util::errno::Error),
    #[error("cannot become user {user}: {step} failed: {source}")]
    RunAs {
        user: String,
        step: &'static str,
        source: nix::Error,
    },
    #[error("cannot keep CAP_NET_ADMIN as user {user}: {source}")]
    Capabilities {
        user: String,
        source: caps::errors::CapsError,
    },
    #[error("cannot become user {0} with {1} threads running: capabilities are per thread")]
    Threads(String, usize),
    #[error("user {0} could take root back; refusing to serve")]
    RootRegained(String),
}

/// A user to serve as, looked up when the command line is read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunAs {
    pub name: String,
    pub uid: nix::unistd::Uid,
    pub gid: nix::unistd::Gid,
}

impl std::str::FromStr for RunAs {
    type Err = String;

    fn from_str(name: &str) -> Result<RunAs, String> {
        let user = nix::unistd::User::from_name(name)
            .map_err(|e| format!("cannot look up user {name}: {e}"))?
            .ok_or_else(|| format!("no user named {name}"))?;
        Ok(RunAs {
            name: user.name,
            uid: user.uid,
            gid: user.gid,
        })
    }
}

/// A group whose members may open one of the backend's sockets: the guests' (`--socket-group`,
/// for front ends running as another user, as libvirt's QEMU does) or the management socket
/// (`--admin-group`). Looked up before the backend is confined: a guest added at run time gets
/// its socket under the seccomp filter, where the group database cannot be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketGroup {
    pub name: String,
    pub gid: nix::unistd::Gid,
}

#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    #[error("no group named {0}")]
    NotFound(String),
    #[error("cannot look up group {name}: {source}")]
    Lookup { name: String, source: nix::Error },
}

impl SocketGroup {
    pub fn named(name: &str) -> Result<SocketGroup, GroupError> {
        let group = nix::unistd::Group::from_name(name)
            .map_err(|source| GroupError::Lookup {
                name: name.to_string(),
                source,
            })?
            .ok_or_else(|| GroupError::NotFound(name.to_string()))?;
        Ok(SocketGroup {
            name: group.name,
            gid: group.gid,
        })
    }

    /// Makes the socket at `path` this group's, mode 0660. The backend owns the socket; once
    /// it serves as `--user`, the group is among that user's ([`run_as`]), which is what lets
    /// an owner give a file to a group without CAP_CHOWN.
    pub fn give(&self, path: &std::path::Path) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        nix::unistd::chown(path, None, Some(self.gid))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
    }
}

impl std::str::FromStr for SocketGroup {
    type Err = String;

    fn from_str(name: &str) -> Result<SocketGroup, String> {
        SocketGroup::named(name).map_err(|e| e.to_string())
    }
}

/// Becomes `user` (its uid and primary group, and `socket_group`, which lets it give the
/// sockets of guests added later to that group; no other groups, no capabilities) for good;
/// with `keep_net_admin` it keeps CAP_NET_ADMIN alone, to take a guest's address off the host
/// when it stops. Memory regions pin guest memory, which an unprivileged process may do only
/// up to RLIMIT_MEMLOCK: the limit is lifted first (the guest quotas bound it instead).
///
/// Call it while the process has one thread: capabilities belong to threads, and threads
/// started later inherit the ones of the thread that starts them.
pub fn run_as(
    user: &RunAs,
    socket_group: Option<&SocketGroup>,
    keep_net_admin: bool,
) -> Result<(), SandboxError> {
    use nix::sys::resource::{setrlimit, Resource, RLIM_INFINITY};
    use nix::unistd::{setgroups, setresgid, setresuid, setuid, Uid};

    let threads = std::fs::read_dir("/proc/self/task").map_or(0, |tasks| tasks.count());
    if threads != 1 {
        return Err(SandboxError::Threads(user.name.clone(), threads));
    }
    let failed = |step| {
        move |source| SandboxError::RunAs {
            user: user.name.clone(),
            step,
            source,
        }
    };
    setrlimit(Resource::RLIMIT_MEMLOCK, RLIM_INFINITY, RLIM_INFINITY)
        .map_err(failed("lifting RLIMIT_MEMLOCK"))?;
    nix::sys::prctl::set_keepcaps(keep_net_admin).map_err(failed("PR_SET_KEEPCAPS"))?;
    let groups: Vec<_> = std::iter::once(user.gid)
        .chain(socket_group.map(|group| group.gid))
        .collect();
    setgroups(&groups).map_err(failed("setgroups"))?;
    setresgid(user.gid, user.gid, user.gid).map_err(failed("setresgid"))?;
    setresuid(user.uid, user.uid, user.uid).map_err(failed("setresuid"))?;
    if keep_net_admin {
        let only = std::collections::HashSet::from([caps::Capability::CAP_NET_ADMIN]);
        for set in [caps::CapSet::Permitted, caps::CapSet::Effective] {
            caps::set(None, set, &only).map_err(|source| SandboxError::Capabilities {
                user: user.name.clone(),
                source,
            })?;
        }
        nix::sys::prctl::set_keepcaps(false).map_err(failed("PR_SET_KEEPCAPS"))?;
    }
    if !user.uid.is_root() && setuid(Uid::from_raw(0)).is_ok() {
        return Err(SandboxError::RootRegained(user.name.clone()));
    }
    log::info!(
        "running as user {} (uid {}, gid {}){}",
        user.name,
        user.uid,
        user.gid,
        if keep_net_admin {
            ", keeping CAP_NET_ADMIN only"
        } else {
            ", no capabilities"
        }
    );
    Ok(())
}

/// System calls the backend makes while serving guests (x86_64 and aarch64 names).
const ALLOWED: &[libc::c_long] = &[
    // vhost-user socket (and those of guests added at run time), netlink (libibverbs lists
    // devices over it for every new context; a guest address going away), eventfds, epoll.
    // `socket` itself is allowed for netlink and unix sockets only (see `rules`).
    libc::SYS_accept4,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_unlinkat,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_unlink,
    // A guest added at run time claims its GID (crate::gid_claim: a lock file, its directory
    // made if missing).
    libc::SYS_flock,
    libc::SYS_mkdirat,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_mkdir,
    libc::SYS_fchmodat,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_chmod,
    // ... and gives its socket to --socket-group.
    libc::SYS_fchownat,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_chown,
    libc::SYS_setsockopt,
    libc::SYS_getsockname,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
    libc::SYS_shutdown,
    libc::SYS_getsockopt,
    libc::SYS_eventfd2,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_pwait,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_epoll_wait,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_pipe2,
    // files: the RDMA device and its sysfs attributes (a context per connection), guest
    // memory files, /proc limits
    libc::SYS_openat,
    libc::SYS_close,
    libc::SYS_read,
    libc::SYS_readv,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_lseek,
    libc::SYS_fstat,
    // Guest memory regions: is the file on hugetlbfs (crate::memory_regions)?
    libc::SYS_fstatfs,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_getdents64,
    libc::SYS_readlinkat,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_readlink,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_access,
    libc::SYS_faccessat,
    libc::SYS_ioctl,
    libc::SYS_fcntl,
    libc::SYS_dup,
    libc::SYS_dup3,
    // memory: guest RAM, MR mappings, the device's queues, heap and thread stacks
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_brk,
    // threads (a few per connection, and the poller pool), time, signals, exit
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_prctl,
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    // Poller threads pin themselves (--poll-cpus).
    libc::SYS_sched_setaffinity,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_tgkill,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    // A sleep or poll with a timeout that a stop signal interrupted resumes through it.
    libc::SYS_restart_syscall,
    libc::SYS_sigaltstack,
    libc::SYS_getrandom,
    libc::SYS_prlimit64,
    libc::SYS_exit,
    libc::SYS_exit_group,
];

/// Confines every thread of the process as `mode` says. Threads started later inherit it.
pub fn confine(mode: SeccompMode) -> Result<(), SandboxError> {
    if mode != SeccompMode::None {
        crate::hostverbs::cm::prepare();
    }
    let mismatch = match mode {
        SeccompMode::None => return Ok(()),
        SeccompMode::Log => SeccompAction::Log,
        SeccompMode::Kill => {
            vmm_sys_util::signal::register_signal_handler(libc::SIGSYS, disallowed_system_call)
                .map_err(SandboxError::Handler)?;
            SeccompAction::Trap
        }
    };
    let filter = SeccompFilter::new(
        rules()?,
        mismatch,
        SeccompAction::Allow,
        std::env::consts::ARCH.try_into()?,
    )?;
    let program: BpfProgram = filter.try_into()?;
    seccompiler::apply_filter_all_threads(&program)?;
    log::info!(
        "seccomp filter installed ({mode:?}): {} system calls allowed",
        ALLOWED.len()
    );
    Ok(())
}

/// The filter's rules: every call of [`ALLOWED`], and `socket` for netlink and unix sockets
/// only (the socket of a guest added at run time).
fn rules() -> Result<BTreeMap<i64, Vec<SeccompRule>>, SandboxError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        ALLOWED.iter().map(|&call| (call, Vec::new())).collect();
    let domain = |family: libc::c_int| {
        // The families are AF_UNIX and AF_NETLINK, small positive constants.
        let family = u64::from(family.unsigned_abs());
        SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, family)
            .and_then(|is| SeccompRule::new(vec![is]))
    };
    rules.insert(
        libc::SYS_socket,
        vec![domain(libc::AF_NETLINK)?, domain(libc::AF_UNIX)?],
    );
    Ok(rules)
}

/// SIGSYS from the filter: one line naming the call, then exit. Only async-signal-safe calls
/// (write, _exit), both of them allowed.
extern "C" fn disallowed_system_call(
    _signal: libc::c_int,
    info: *mut libc::siginfo_t,
    _context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo_t for SIGSYS, whose seccomp part holds the
    // call number as the int after si_signo, si_errno, si_code (and padding) and the
    // faulting address: byte offset 24 on 64-bit Linux.
    let call = unsafe { *(info as *const i32).add(6) };
    const PREFIX: &[u8] = b"vhost-user-rdma: seccomp: system call ";
    const SUFFIX: &[u8] = b" is not allowed; exiting\n";
    let mut digits = [0u8; 10];
    let mut count = 0;
    let mut n = call.unsigned_abs();
    loop {
        digits[count] = b'0' + (n % 10) as u8;
        count += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut line = [0u8; 80];
    let mut len = 0;
    for &byte in PREFIX
        .iter()
        .chain(digits[..count].iter().rev())
        .chain(SUFFIX)
    {
        line[len] = byte;
        len += 1;
    }
    // SAFETY: writing a buffer we own to stderr, then ending the process: both allowed by
    // the filter and async-signal-safe.
    unsafe {
        libc::write(2, line.as_ptr().cast(), len);
        libc::_exit(KILLED_STATUS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Set in the child process the test below starts.
    const CHILD: &str = "VRDMA_SANDBOX_TEST_CHILD";

    /// Runs `test` of this module in a child process that confines itself and then does
    /// what the test's child branch does; returns the child's exit code and stderr.
    fn confined_child(test: &str) -> (Option<i32>, String) {
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &format!("sandbox::tests::{test}"), "--nocapture"])
            .args(["--test-threads=1"])
            .env(CHILD, "1")
            .output()
            .expect("run the child");
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        (output.status.code(), stderr)
    }

    fn in_child() -> bool {
        if std::env::var_os(CHILD).is_none() {
            return false;
        }
        confine(SeccompMode::Kill).expect("install the filter");
        eprintln!("confined, and still logging");
        true
    }

    fn expect_killed_for(test: &str, call: libc::c_long) {
        let (status, stderr) = confined_child(test);
        assert_eq!(status, Some(KILLED_STATUS), "{stderr}");
        assert!(stderr.contains("confined, and still logging"), "{stderr}");
        let line = format!("vhost-user-rdma: seccomp: system call {call} is not allowed; exiting");
        assert!(stderr.contains(&line), "{stderr}");
    }

    #[test]
    fn a_disallowed_system_call_ends_the_process_with_a_line_naming_it() {
        if in_child() {
            // getppid: serving guests never asks for its parent.
            let parent = std::os::unix::process::parent_id();
            unreachable!("the filter let getppid through ({parent})");
        }
        expect_killed_for(
            "a_disallowed_system_call_ends_the_process_with_a_line_naming_it",
            libc::SYS_getppid,
        );
    }

    /// Finding: the first guest added at run time on rxe killed the backend, its GID claim's
    /// flock outside the filter (the loopback host claims no GID, so the fast tier missed it).
    #[test]
    fn what_a_guest_added_at_run_time_needs_passes_the_filter() {
        if in_child() {
            let gid = vrdma_spec::Gid([0xfe; 16]);
            let claim = crate::gid_claim::claim("vrdma-sandbox-test", 1, gid, true);
            eprintln!("claimed: {}", claim.is_ok());
            let dir = std::env::temp_dir();
            let socket = dir.join(format!("vrdma-sandbox-{}.sock", std::process::id()));
            // The group as --socket-group resolves it before the filter; the process's own.
            let group = SocketGroup {
                name: "own".into(),
                gid: nix::unistd::getegid(),
            };
            let listener = crate::vhost_user::listen(&socket, Some(&group));
            eprintln!("listening: {}", listener.is_ok());
            drop(listener);
            let _ = std::fs::remove_file(&socket);
            eprintln!("added");
            return;
        }
        let (status, stderr) =
            confined_child("what_a_guest_added_at_run_time_needs_passes_the_filter");
        assert_eq!(status, Some(0), "{stderr}");
        for line in ["claimed: true", "listening: true", "added"] {
            assert!(stderr.contains(line), "{stderr}");
        }
    }

    #[test]
    fn a_group_that_does_not_exist_is_refused_by_name() {
        let error = "vrdma-no-such-group".parse::<SocketGroup>().unwrap_err();
        assert_eq!(error, "no group named vrdma-no-such-group");
    }

    #[test]
    fn only_netlink_and_unix_sockets_can_be_opened() {
        if in_child() {
            let netlink = nix::sys::socket::socket(
                nix::sys::socket::AddressFamily::Netlink,
                nix::sys::socket::SockType::Raw,
                nix::sys::socket::SockFlag::SOCK_CLOEXEC,
                nix::sys::socket::SockProtocol::NetlinkRoute,
            );
            eprintln!(
                "netlink: {}",
                if netlink.is_ok() { "opened" } else { "refused" }
            );
            let unix = std::os::unix::net::UnixDatagram::unbound();
            eprintln!("unix: {}", if unix.is_ok() { "opened" } else { "refused" });
            let inet = std::net::TcpListener::bind("127.0.0.1:0");
            unreachable!("the filter let an inet socket through ({inet:?})");
        }
        let test = "only_netlink_and_unix_sockets_can_be_opened";
        expect_killed_for(test, libc::SYS_socket);
        let (_, stderr) = confined_child(test);
        assert!(stderr.contains("netlink: opened"), "{stderr}");
        assert!(stderr.contains("unix: opened"), "{stderr}");
    }

    /// Finding: a thread sleeping with a timeout resumes through restart_syscall after a
    /// stop and continue (SIGSTOP/SIGCONT, a debugger, a container freezer); the filter
    /// lacked it, so stopping the backend at the wrong moment killed it.
    #[test]
    fn a_sleep_stopped_and_continued_resumes() {
        if in_child() {
            std::thread::sleep(std::time::Duration::from_secs(2));
            eprintln!("woke");
            return;
        }
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "sandbox::tests::a_sleep_stopped_and_continued_resumes",
            ])
            .args(["--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run the child");
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        // Stop it mid-sleep, more than once: one stop may land before the sleep starts.
        for _ in 0..4 {
            std::thread::sleep(std::time::Duration::from_millis(300));
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(50));
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
        }
        let output = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{stderr}");
        assert!(stderr.contains("woke"), "{stderr}");
    }

    #[test]
    fn the_filter_compiles_for_this_architecture() {
        let rules = rules().unwrap();
        assert_eq!(rules.len(), ALLOWED.len() + 1, "no call listed twice");
        let filter = SeccompFilter::new(
            rules,
            SeccompAction::Trap,
            SeccompAction::Allow,
            std::env::consts::ARCH.try_into().unwrap(),
        )
        .unwrap();
        let _: BpfProgram = filter.try_into().unwrap();
    }
}
