//! vrdmad: the guest service. Parses the command line and starts serving.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use vrdma_guest::service::protocol::DEFAULT_SOCKET;

/// Shares one vrdma device among the programs of this VM (or host): each program reaches it
/// through the socket, sees only its own objects, and loses nothing to another's exit.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The device: `pci` (the VM's vrdma PCI device), `pci:DDDD:BB:DD.F`, or the path of a
    /// vrdma backend's vhost-user socket (on a host or in a container).
    #[arg(long, default_value = "pci")]
    device: String,
    /// Where programs connect.
    #[arg(long, default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// The group whose members may use RDMA (the socket's group). Without it, or when no
    /// such group exists, only the socket's owner may (mode 0600).
    #[arg(long, default_value = "vrdma")]
    group: String,
    /// Each user's programs together may hold at most 1/SHARE of each of the device's object
    /// limits, of the memory regions it takes and of the locked memory (however many
    /// programs the user connects).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=65536))]
    share: u32,
    /// Bytes of memory one program may share with the device.
    #[arg(long, default_value_t = 1 << 30)]
    max_program_memory: u64,
    /// Programs served at once; more are refused.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65536))]
    max_programs: u64,
    /// Programs (connections, also those that have not said HELLO yet) one user may have at
    /// once [default: MAX_PROGRAMS / SHARE].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=65536))]
    max_programs_per_user: Option<u64>,
    /// Bytes of memory all programs together may share with the device, which the service
    /// locks for it in a VM [default: half of the system's memory]. A program's process is
    /// also held to its RLIMIT_MEMLOCK, unless it has CAP_IPC_LOCK (as root has).
    #[arg(long)]
    max_locked_memory: Option<u64>,
    /// Seconds a connection may take to say HELLO before it is closed.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    hello_timeout: u64,
}

/// The group named `name`, if the system has one.
fn group_id(name: &str) -> Option<u32> {
    Some(nix::unistd::Group::from_name(name).ok()??.gid.as_raw())
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = Args::parse();
    let group = group_id(&args.group);
    if group.is_none() {
        log::warn!(
            "no group {}: only the socket's owner may use RDMA",
            args.group
        );
    }
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    let options = vrdmad::Options {
        share: args.share,
        max_program_memory: args.max_program_memory,
        max_programs: args.max_programs as usize,
        max_programs_per_user: args.max_programs_per_user.map(|n| n as usize),
        max_locked_memory: args.max_locked_memory,
        hello_timeout: std::time::Duration::from_secs(args.hello_timeout),
    };
    let served = vrdmad::Service::open(&args.device, &options).and_then(|service| {
        let listener = vrdmad::bind(&args.socket, mode, group)?;
        vrdmad::notify_systemd_ready()?;
        service.serve(listener)
    });
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log::error!("{e}");
            ExitCode::FAILURE
        }
    }
}
