//! vrdma backend: the vhost-user device that serves vrdma guests on the host's RDMA device.
//!
//! Layers: [`hostverbs`] is the only code that touches libibverbs; [`limits`] decides what a
//! guest is offered; the device logic above them knows nothing of vhost-user plumbing.

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

pub mod admin;
pub mod datapath;
pub mod device;
pub mod gid_claim;
pub mod guest_address;
pub mod guest_faults;
pub mod guest_mapping;
pub mod guests;
pub mod hostverbs;
pub mod limits;
pub mod log_budget;
pub mod memory_regions;
pub mod mtt;
mod per_second;
pub mod sandbox;
pub mod vhost_user;
mod vring;

use std::sync::{Arc, Mutex};

use guest_address::{GuestAddress, GuestIp};
use hostverbs::{Context, Gid, LINK_LAYER_ETHERNET, PORT_ACTIVE};
pub use limits::Quotas;

/// Errors that stop the backend.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    HostVerbs(#[from] hostverbs::Error),
    #[error("port {port} of {device} is not active (state {state})")]
    PortNotActive {
        device: String,
        port: u8,
        state: u32,
    },
    #[error("port {port} of {device} is not an Ethernet (RoCE) port")]
    NotRoce { device: String, port: u8 },
    #[error("GID index {index} of {device} port {port} is unusable: {reason}")]
    BadGidIndex {
        device: String,
        port: u8,
        index: u32,
        reason: String,
    },
    #[error("guest address: {0}")]
    GuestAddress(#[from] guest_address::AddressError),
    #[error(transparent)]
    GidClaim(#[from] gid_claim::ClaimError),
    #[error("the guest's GID {gid} did not appear in the device's GID table: is its address on the device's network interface?")]
    GuestGidMissing { gid: Gid },
    #[error(transparent)]
    Sandbox(#[from] sandbox::SandboxError),
    #[error("guest memory faults: {0}")]
    GuestFaults(#[from] guest_faults::WatchError),
    #[error(transparent)]
    Admin(#[from] admin::AdminError),
    #[error("--config: {0}")]
    Declarations(#[from] guests::DeclarationError),
    #[error("vhost-user socket: {0}")]
    VhostUser(#[source] vhost::vhost_user::Error),
    #[error(
        "will not make the vhost-user socket {path}: {reason}; remove it, or choose another path"
    )]
    SocketPath {
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("cannot give the socket {path} to group {group} (mode 0660): {source}")]
    SocketGroup {
        path: std::path::PathBuf,
        group: String,
        #[source]
        source: std::io::Error,
    },
    /// vhost-user-backend's error type implements Display but not std::error::Error.
    #[error("vhost-user daemon: {0}")]
    Daemon(vhost_user_backend::Error),
    #[error("--poll-cpus: CPU {cpu} is not one this process may run on ({allowed})")]
    PollCpu { cpu: usize, allowed: String },
    #[error("the open file limit ({limit}, the hard limit) is below what {guests} guests need at their quotas ({per_guest} descriptors each, {needed} with the backend's own): raise it (LimitNOFILE=, ulimit -Hn), or lower --max-guests or --max-memory-regions")]
    Descriptors {
        limit: u64,
        guests: u32,
        per_guest: u64,
        needed: u64,
    },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// What the backend serves guests with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Host RDMA device, e.g. `rxe0`.
    pub device: String,
    pub port: u8,
    /// Source GID index for guest traffic; `None` picks the first RoCEv2 IPv4 GID.
    pub gid_index: Option<u32>,
    /// The guest's own address: its GID is the one this address gives (see
    /// [`guest_address`]), instead of one of the host's. On the loopback host it is an
    /// address of the loopback's connection manager only ([`hostverbs::loopback::cm`]): the
    /// guest sends from the device's one GID.
    pub guest_ip: Option<GuestIp>,
    pub quotas: Quotas,
    pub notify_queues: u32,
    /// Data-path poller threads, shared by all connections.
    pub poll_threads: usize,
    /// How long a poller keeps polling after its last work before it sleeps.
    pub poll_idle: std::time::Duration,
    /// CPUs the poller threads run on: thread `i` on `poll_cpus[i % len]`; empty: wherever
    /// the scheduler puts them.
    pub poll_cpus: Vec<usize>,
    /// The system call filter [`vhost_user::serve`] installs once it listens.
    pub seccomp: sandbox::SeccompMode,
    /// Most guest connections served at once (with [`Config::shared_gid`]; otherwise one).
    pub max_guests: u32,
    /// The guests of this backend are one trust domain: more than one may connect, all
    /// sending from the same GID (each can forge packets into the others' RC connections).
    pub shared_gid: bool,
    /// Whether guest memory whose files may shrink is accepted ([`memory_regions`]).
    pub unsealed_memory: memory_regions::UnsealedFiles,
    /// Each guest's rate limits on its sends (changeable per guest at run time, through the
    /// management socket).
    pub rate_limits: datapath::RateLimits,
    /// The group whose members may connect to the guests' sockets (front ends running as
    /// another user: libvirt's QEMU); `None` leaves them to the backend's user.
    pub socket_group: Option<sandbox::SocketGroup>,
    /// How long a front end that connected may stay silent (no GET_FEATURES) before its
    /// connection is closed: a silent connection would keep the guest's own front end out.
    pub handshake_timeout: std::time::Duration,
}

#[cfg(test)]
impl Config {
    /// The command line's defaults on `device`, unconfined.
    pub(crate) fn for_tests(device: &str) -> Config {
        Config {
            device: device.into(),
            port: 1,
            gid_index: None,
            guest_ip: None,
            quotas: Quotas::default(),
            notify_queues: 1,
            poll_threads: 1,
            poll_idle: std::time::Duration::from_millis(2),
            poll_cpus: Vec::new(),
            seccomp: sandbox::SeccompMode::None,
            max_guests: 1,
            shared_gid: false,
            unsealed_memory: memory_regions::UnsealedFiles::Refuse,
            rate_limits: datapath::RateLimits::default(),
            socket_group: None,
            handshake_timeout: std::time::Duration::from_secs(10),
        }
    }
}

/// The host device, checked to be usable for guests.
pub struct HostDevice {
    pub context: Arc<Context>,
    pub port: u8,
    /// The host's index of the guest's GID (the guest knows it as index 0).
    pub gid_index: u8,
    pub gid: Gid,
}

/// How long a guest address may take to show up in the RDMA device's GID table (the kernel
/// adds the entry asynchronously).
const GUEST_GID_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl HostDevice {
    /// Opens the device and checks the port is an active RoCE port with a usable GID.
    pub fn open(config: &Config) -> Result<HostDevice, Error> {
        let context = Context::open(&config.device)?;
        let port_attr = context.query_port(config.port)?;
        if port_attr.state != PORT_ACTIVE {
            return Err(Error::PortNotActive {
                device: config.device.clone(),
                port: config.port,
                state: port_attr.state,
            });
        }
        if port_attr.link_layer != LINK_LAYER_ETHERNET {
            return Err(Error::NotRoce {
                device: config.device.clone(),
                port: config.port,
            });
        }
        let bad = |index: u32, reason: String| Error::BadGidIndex {
            device: config.device.clone(),
            port: config.port,
            index,
            reason,
        };
        let loopback = hostverbs::loopback::is_loopback(&config.device);
        let (gid_index, gid) = match (config.guest_ip, config.gid_index) {
            (Some(_), _) if loopback => (0, hostverbs::loopback::gid()),
            (Some(ip), _) => (wait_for_gid(&context, config.port, ip.gid())?, ip.gid()),
            (None, None) => context.find_roce_v2_ipv4_gid(config.port)?,
            (None, Some(index)) => {
                let (gid, _) = context
                    .query_gid(config.port, index)
                    .map_err(|e| bad(index, e.to_string()))?;
                if gid.is_zero() {
                    return Err(bad(index, "the entry is empty".into()));
                }
                (index, gid)
            }
        };
        // An address vector names its source GID in a byte.
        let gid_index = u8::try_from(gid_index).map_err(|_| {
            bad(
                gid_index,
                "beyond 255, which an address vector cannot name".into(),
            )
        })?;
        Ok(HostDevice {
            context,
            port: config.port,
            gid_index,
            gid,
        })
    }
}

/// Claims the GID the backend's guests send from ([`gid_claim`]), for as long as the claim is
/// held: before listening, so that a backend refused for a GID leaves the socket alone. The
/// loopback host needs none: its GID reaches only the guests of its own process (and it is not
/// opened here: opening it starts its clock thread, and `--user` needs the process to have one
/// thread).
pub fn claim_guest_gid(config: &Config) -> Result<Option<gid_claim::GidClaim>, Error> {
    if hostverbs::loopback::is_loopback(&config.device) {
        return Ok(None);
    }
    let device = HostDevice::open(config)?;
    let claim = gid_claim::claim(&config.device, config.port, device.gid, config.shared_gid)?;
    Ok(Some(claim))
}

/// The guest's address of `config`, put on the network interface of the host device's port
/// (see [`guest_address`]). It is removed when the last holder drops it. The loopback host
/// has no network interface: a guest's connection holds its address in the loopback's own
/// table ([`hostverbs::loopback::cm`]).
pub fn assign_guest_address(config: &Config) -> Result<SharedGuestAddress, Error> {
    let Some(ip) = config.guest_ip else {
        return Ok(SharedGuestAddress::default());
    };
    if hostverbs::loopback::is_loopback(&config.device) {
        return Ok(SharedGuestAddress::default());
    }
    let ifindex = Context::open(&config.device)?.netdev_index(config.port)?;
    let address = GuestAddress::assign(ifindex, ip)?;
    Ok(Arc::new(Mutex::new(Some(address))))
}

/// A guest address that whoever ends the process takes and removes.
pub type SharedGuestAddress = Arc<Mutex<Option<GuestAddress>>>;

/// The guest addresses a backend holds (one per declared guest with one).
pub type GuestAddresses = Arc<Mutex<Vec<SharedGuestAddress>>>;

/// Ends the process on SIGINT or SIGTERM, after taking the guests' addresses off the host.
pub fn exit_on_signals(addresses: &GuestAddresses) -> Result<(), Error> {
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGTERM])?;
    let addresses = Arc::clone(addresses);
    std::thread::Builder::new()
        .name("vrdma-signals".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                log::info!("signal {signal}: stopping");
                let held = addresses.lock().unwrap_or_else(|e| e.into_inner());
                for address in held.iter() {
                    drop(address.lock().unwrap_or_else(|e| e.into_inner()).take());
                }
                std::process::exit(0);
            }
        })?;
    Ok(())
}

/// Raises the open file limit (the hard limit too, where it is lower and the backend may) and
/// checks that it holds every guest the backend may serve at once, each at its quotas ([`limits::descriptors_per_guest`]), so that
/// no guest can take the descriptors another needs.
pub fn reserve_descriptors(config: &Config) -> Result<(), Error> {
    let guests = if config.shared_gid {
        config.max_guests
    } else {
        1
    };
    let per_guest = limits::descriptors_per_guest(config.notify_queues, &config.quotas);
    let needed = u64::from(guests) * per_guest + limits::DESCRIPTORS_OF_THE_BACKEND;
    let limit = hostverbs::raise_open_file_limit_to(needed)?;
    if limit < needed {
        return Err(Error::Descriptors {
            limit,
            guests,
            per_guest,
            needed,
        });
    }
    log::info!(
        "open file limit: {limit}; {guests} guests at most {per_guest} each, {needed} in all"
    );
    Ok(())
}

/// The index of `gid` in `port`'s GID table, waiting for the kernel to add it.
fn wait_for_gid(context: &Context, port: u8, gid: Gid) -> Result<u32, Error> {
    let start = std::time::Instant::now();
    loop {
        if let Some(index) = context.find_roce_v2_gid(port, gid)? {
            return Ok(index);
        }
        if start.elapsed() > GUEST_GID_WAIT {
            return Err(Error::GuestGidMissing { gid });
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Checks that this process may run on every CPU of `--poll-cpus`.
pub fn check_poll_cpus(cpus: &[usize]) -> Result<(), Error> {
    use nix::sched::{sched_getaffinity, CpuSet};
    let allowed =
        sched_getaffinity(nix::unistd::Pid::from_raw(0)).map_err(|e| Error::Io(e.into()))?;
    let usable = |cpu: usize| allowed.is_set(cpu).unwrap_or(false);
    match cpus.iter().find(|&&cpu| !usable(cpu)) {
        None => Ok(()),
        Some(&cpu) => Err(Error::PollCpu {
            cpu,
            allowed: (0..CpuSet::count())
                .filter(|&c| usable(c))
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(","),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_cpus_must_be_cpus_this_process_may_use() {
        use nix::sched::{sched_getaffinity, CpuSet};
        let allowed = sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
        let first = (0..CpuSet::count())
            .find(|&cpu| allowed.is_set(cpu).unwrap())
            .unwrap();
        assert!(check_poll_cpus(&[]).is_ok());
        assert!(check_poll_cpus(&[first]).is_ok());
        let message = check_poll_cpus(&[first, 100_000]).unwrap_err().to_string();
        assert!(message.contains("CPU 100000 is not one"), "{message}");
        assert!(
            message.contains(&first.to_string()),
            "names the usable CPUs: {message}"
        );
    }

    #[test]
    fn a_missing_device_is_reported_by_name_with_the_rxe_hint() {
        let config = Config::for_tests("no-such-rdma-device");
        let message = HostDevice::open(&config)
            .err()
            .expect("no such device")
            .to_string();
        assert!(
            message.contains("'no-such-rdma-device' not found"),
            "{message}"
        );
        assert!(message.contains("rdma_rxe"), "{message}");
    }
}
