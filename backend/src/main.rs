//! `vhost-user-rdma`: parses the command line and starts the backend.

// Integer casts that could truncate, lose a sign or wrap are proven or converted (tests,
// whose values are small constants, are exempt).
#![cfg_attr(
    not(test),
    deny(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_possible_wrap
    )
)]

use std::process::ExitCode;

use clap::Parser;
use vrdma_backend::admin::AdminSocket;
use vrdma_backend::guest_address::GuestIp;
use vrdma_backend::guests::{ClaimedGuest, Declarations};
use vrdma_backend::memory_regions::UnsealedFiles;
use vrdma_backend::sandbox::{RunAs, SeccompMode, SocketGroup};
use vrdma_backend::{limits, vhost_user, Config, HostDevice, Quotas};

/// vhost-user backend of the vrdma paravirtual RDMA device (virtio id 42).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// vhost-user socket to listen on; every connection is one guest.
    #[arg(long, required_unless_present_any = ["check", "config"], conflicts_with = "config")]
    socket_path: Option<std::path::PathBuf>,
    /// Serve the guests this file declares, each on its own socket with its own address,
    /// quotas and rate limits (docs/operating.md: "Many guests, one backend"); the other
    /// options are their defaults.
    #[arg(long, conflicts_with_all = ["check", "guest_ip"])]
    config: Option<std::path::PathBuf>,
    /// Host RDMA device that serves the guests; `loopback` is the backend's own software
    /// device, which carries traffic between its guests only (a test and measurement
    /// instrument: no NIC, no network).
    #[arg(long, default_value = "rxe0")]
    device: String,
    /// Port of the host device.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..))]
    port: u8,
    /// Source GID index for guest traffic [default: the first RoCEv2 IPv4 GID].
    #[arg(long, conflicts_with = "guest_ip")]
    gid_index: Option<u32>,
    /// The guest's own IPv4 address and prefix (10.0.0.5/24): added to the device's network
    /// interface while the backend runs, its GID is the only one the guest sees and may use.
    #[arg(long)]
    guest_ip: Option<GuestIp>,
    /// Notification virtqueues (doorbell kicks), 1 to 64.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    notify_queues: u32,
    /// Data-path poller threads, shared by all guest connections; each connection is served
    /// by one of them, connections taken in turn.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    poll_threads: u32,
    /// Microseconds a poller keeps polling after its last work before it sleeps (and asks the
    /// guests for kicks).
    #[arg(long, default_value_t = 2000)]
    poll_idle_us: u64,
    /// CPUs for the poller threads (e.g. 2,3): thread i runs on the i-th, round the list
    /// again when there are more threads than CPUs; by default the scheduler places them.
    #[arg(long, value_delimiter = ',')]
    poll_cpus: Vec<usize>,
    /// Guests the backend is sized for: each guest's quotas are the backend's totals (16,384
    /// QPs, 8,192 CQs, 16,384 MRs, 4,096 PDs, 16,384 AHs, 1,024 SRQs, 256 MiB of rings, 64 GiB
    /// registered, 16,384 memory regions) divided by this; the --max-* options override single
    /// quotas.
    #[arg(long, default_value_t = limits::DEFAULT_GUESTS, value_parser = clap::value_parser!(u32).range(1..))]
    guests: u32,
    /// With --shared-gid, the most guests connected at once [default: --guests]; one more
    /// is refused. Above --guests, the backend's totals no longer bound them all.
    #[arg(long, requires = "shared_gid", value_parser = clap::value_parser!(u32).range(1..))]
    max_guests: Option<u32>,
    /// Serve more than one guest at a time (up to --max-guests), all sending from the backend's
    /// one GID. Only for guests that trust each other: a guest that shares another's GID can
    /// forge packets into its RC connections. Without it, a guest that connects while
    /// another is served is refused.
    #[arg(long)]
    shared_gid: bool,
    /// Accept guest memory whose files may shrink (no F_SEAL_SHRINK seal: QEMU's
    /// memory-backend-file, cloud-hypervisor). Only for trusted front ends: one that shrinks
    /// such a file while the backend uses it loses its connection.
    #[arg(long)]
    unsealed_memory: bool,
    /// Most QPs one guest may hold.
    #[arg(long)]
    max_qp: Option<u32>,
    /// Most CQs one guest may hold.
    #[arg(long)]
    max_cq: Option<u32>,
    /// Most memory regions one guest may hold.
    #[arg(long)]
    max_mr: Option<u32>,
    /// Most protection domains one guest may hold.
    #[arg(long)]
    max_pd: Option<u32>,
    /// Most address handles one guest may hold.
    #[arg(long)]
    max_ah: Option<u32>,
    /// Most shared receive queues one guest may hold.
    #[arg(long)]
    max_srq: Option<u32>,
    /// Largest single memory registration, in bytes.
    #[arg(long)]
    max_mr_size: Option<u64>,
    /// Most bytes of queue rings (CQs, QPs, SRQs together) one guest may hold.
    #[arg(long)]
    max_ring_bytes: Option<u64>,
    /// Most bytes one guest may have registered (all MRs together).
    #[arg(long)]
    max_registered_bytes: Option<u64>,
    /// Most send WQEs a second one guest's data path takes (0: no limit); more wait in the
    /// guest's rings.
    #[arg(long, default_value_t = 0)]
    max_wqes_per_second: u64,
    /// Most payload bytes a second one guest's sends carry (0: no limit); more wait in the
    /// guest's rings.
    #[arg(long, default_value_t = 0)]
    max_bytes_per_second: u64,
    /// Most vhost-user memory regions one guest may have (each holds a file descriptor), up
    /// to 509.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(limits::MAX_MEMORY_SLOTS)))]
    max_memory_regions: Option<u32>,
    /// System calls outside what serving needs, once the backend listens: kill the process
    /// (with a line naming the call), log them (kernel audit log), or allow everything.
    #[arg(long, value_enum, default_value_t = SeccompMode::Kill)]
    seccomp: SeccompMode,
    /// Serve as this user (and its primary group), with no capabilities but CAP_NET_ADMIN
    /// when --guest-ip needs it; the backend must start as root. It must be able to open the
    /// host RDMA device (/dev/infiniband/uverbs*, world-accessible as the kernel creates it)
    /// and to create the socket.
    #[arg(long)]
    user: Option<RunAs>,
    /// Management socket (vrdmactl, monitoring): reports each connected guest's objects,
    /// quotas, counters and QPs. Open only to the backend's owner, and to --admin-group.
    #[arg(long, conflicts_with = "check")]
    admin_socket: Option<std::path::PathBuf>,
    /// Group whose members may open the management socket.
    #[arg(long, requires = "admin_socket")]
    admin_group: Option<String>,
    /// Group whose members may connect to the guests' sockets (mode 0660), for front ends
    /// that run as another user than the backend: libvirt's QEMU (libvirt-qemu on Debian).
    #[arg(long)]
    socket_group: Option<SocketGroup>,
    /// Milliseconds a front end that connected may stay silent (send no GET_FEATURES) before
    /// its connection is closed, so that no silent connection keeps the guest's own front end
    /// out.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    handshake_timeout_ms: u64,
    /// Check the host device and print what guests would be offered, then exit.
    #[arg(long, conflicts_with = "socket_path")]
    check: bool,
}

impl From<Args> for Config {
    // `socket_path` and `check` say where and whether to serve; they are not device config.
    fn from(args: Args) -> Config {
        let quotas = quotas(&args);
        Config {
            device: args.device,
            port: args.port,
            gid_index: args.gid_index,
            guest_ip: args.guest_ip,
            quotas,
            notify_queues: args.notify_queues,
            poll_threads: args.poll_threads as usize,
            poll_idle: std::time::Duration::from_micros(args.poll_idle_us),
            poll_cpus: args.poll_cpus,
            seccomp: args.seccomp,
            max_guests: args.max_guests.unwrap_or(args.guests),
            shared_gid: args.shared_gid,
            unsealed_memory: if args.unsealed_memory {
                UnsealedFiles::Allow
            } else {
                UnsealedFiles::Refuse
            },
            rate_limits: vrdma_backend::datapath::RateLimits {
                wqes_per_second: args.max_wqes_per_second,
                bytes_per_second: args.max_bytes_per_second,
            },
            socket_group: args.socket_group,
            handshake_timeout: std::time::Duration::from_millis(args.handshake_timeout_ms),
        }
    }
}

/// The per-guest share for --guests, with any --max-* option in its place.
fn quotas(args: &Args) -> Quotas {
    let share = Quotas::shared_by(args.guests);
    Quotas {
        max_qp: args.max_qp.unwrap_or(share.max_qp),
        max_cq: args.max_cq.unwrap_or(share.max_cq),
        max_mr: args.max_mr.unwrap_or(share.max_mr),
        max_pd: args.max_pd.unwrap_or(share.max_pd),
        max_ah: args.max_ah.unwrap_or(share.max_ah),
        max_srq: args.max_srq.unwrap_or(share.max_srq),
        max_mr_size: args.max_mr_size.unwrap_or(share.max_mr_size),
        max_ring_bytes: args.max_ring_bytes.unwrap_or(share.max_ring_bytes),
        max_registered_bytes: args
            .max_registered_bytes
            .unwrap_or(share.max_registered_bytes),
        max_memory_regions: args.max_memory_regions.unwrap_or(share.max_memory_regions),
    }
}

fn main() -> ExitCode {
    env_logger::init();
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log::error!("{e}");
            eprintln!("vhost-user-rdma: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), vrdma_backend::Error> {
    if let Some(path) = args.config.clone() {
        return serve_declared(args, &path);
    }
    let socket_path = args.socket_path.clone();
    let user = args.user.clone();
    let admin = (args.admin_socket.clone(), args.admin_group.clone());
    let config = Config::from(args);
    // A flag naming a CPU this process may not use is the operator's mistake, told before
    // anything is claimed (a refusal for a GID another backend holds would hide it).
    vrdma_backend::check_poll_cpus(&config.poll_cpus)?;
    if socket_path.is_some() {
        vrdma_backend::reserve_descriptors(&config)?;
    }
    // Taken off the host on SIGINT/SIGTERM, or when serving ends.
    let guest_address = vrdma_backend::assign_guest_address(&config)?;
    let addresses = std::sync::Arc::new(std::sync::Mutex::new(vec![guest_address.clone()]));
    // What needs root comes first: the address, the claim on its GID (before the socket, so
    // that a backend refused for a GID another serves leaves that one's socket alone), the
    // socket (whose directory may be root's).
    let _claim = match &socket_path {
        Some(_) => vrdma_backend::claim_guest_gid(&config)?,
        None => None,
    };
    let listener = socket_path
        .as_deref()
        .map(|path| vhost_user::listen(path, config.socket_group.as_ref()))
        .transpose()?;
    let admin = listen_admin(admin)?;
    if let Some(user) = &user {
        vrdma_backend::sandbox::run_as(
            user,
            config.socket_group.as_ref(),
            config.guest_ip.is_some(),
        )?;
    }
    vrdma_backend::exit_on_signals(&addresses)?;
    let result = check_or_serve(&config, listener, admin);
    drop(
        guest_address
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(),
    );
    result
}

/// Serves the guests the file at `path` declares.
fn serve_declared(args: Args, path: &std::path::Path) -> Result<(), vrdma_backend::Error> {
    let declared = Declarations::load(path)?;
    let user = args.user.clone();
    let admin = (args.admin_socket.clone(), args.admin_group.clone());
    let config = Config::from(args);
    vrdma_backend::check_poll_cpus(&config.poll_cpus)?;
    // Room for every declared guest at its quotas (and as many again added at run time).
    let room = Config {
        shared_gid: true,
        max_guests: config.max_guests.max(
            u32::try_from(declared.guests.len())
                .unwrap_or(u32::MAX)
                .saturating_mul(2),
        ),
        ..config.clone()
    };
    vrdma_backend::reserve_descriptors(&room)?;
    // What needs root first, as for one socket: each guest's address, GID claim and socket.
    let keep_net_admin = declared.guests.iter().any(|g| g.guest_ip.is_some());
    let claimed = declared
        .guests
        .into_iter()
        .map(|guest| ClaimedGuest::claim(guest, &config, declared.shared_gid))
        .collect::<Result<Vec<_>, _>>()?;
    let admin = listen_admin(admin)?;
    if let Some(user) = &user {
        // Guests added at run time claim their GIDs there, as `user`.
        vrdma_backend::gid_claim::lock_dir_for(user.gid);
        vrdma_backend::sandbox::run_as(user, config.socket_group.as_ref(), keep_net_admin)?;
    }
    let addresses = vrdma_backend::GuestAddresses::default();
    vrdma_backend::exit_on_signals(&addresses)?;
    vrdma_backend::guests::serve_declared(&config, declared.shared_gid, claimed, (admin, addresses))
}

/// The management socket --admin-socket asks for (and --admin-group may open), made while
/// the backend still runs as root.
fn listen_admin(
    (path, group): (Option<std::path::PathBuf>, Option<String>),
) -> Result<Option<AdminSocket>, vrdma_backend::Error> {
    let Some(path) = path else { return Ok(None) };
    Ok(Some(vrdma_backend::admin::listen(&path, group.as_deref())?))
}

fn check_or_serve(
    config: &Config,
    listener: Option<vhost_user::Listener>,
    admin: Option<AdminSocket>,
) -> Result<(), vrdma_backend::Error> {
    // Fail fast on an unusable device (as the user that serves), before accepting guests.
    let device = HostDevice::open(config)?;
    match listener {
        None => {
            print_check(config, &device, &device.context.query_device()?);
            Ok(())
        }
        Some(listener) => {
            drop(device); // each connection opens a context of its own
            vhost_user::serve_listener(config, listener, admin)
        }
    }
}

fn print_check(config: &Config, device: &HostDevice, host: &vrdma_backend::hostverbs::DeviceAttr) {
    println!(
        "{} port {}: GID index {} ({})",
        config.device, device.port, device.gid_index, device.gid
    );
    println!("features offered: {:#x}", limits::offered_features(host));
    let offered = limits::advertised_config(host, &config.quotas, config.notify_queues);
    for (name, value) in limits::describe(&offered) {
        println!("  {name:<20} {value:#x} ({value})");
    }
}
