//! vrdmad, the guest service: it owns the vrdma device of a VM (the PCI device) or one
//! connection to a backend (on a host or in a container) and shares it among any number of
//! programs, as a kernel driver with uverbs would.
//!
//! - A program connects to the service's unix socket (`vrdma_guest::service`); whoever may
//!   open the socket may use RDMA.
//! - The program's control requests pass through the service, which forwards them only when
//!   every object they name is the program's and every page they name is memory the program
//!   shared (`requests.rs`), and copies their page lists into its own memory, so that what it
//!   checked is what the device reads.
//! - The program's memory (memfds it passes) is made reachable by the device here; its rings,
//!   doorbell records and CQs stay in that memory, so the data path never passes through the
//!   service: the program posts and polls as it would with the device to itself.
//! - Each program rings the device through a doorbell area of its own (SPEC.md §8.6), so no
//!   program can take or hide another's doorbells, where the device offers such areas.
//! - The device's events go to the program whose object they name.
//! - When a program goes (exit, crash, SIGKILL), everything it created is destroyed on the
//!   device and its memory released; the other programs keep running.

pub mod accounts;
pub mod memory;
mod program;
pub mod requests;

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use vrdma_guest::service::protocol::{self, Kind, Welcome};
use vrdma_guest::shm::{Region, PAGE_SIZE};
use vrdma_guest::transport::Transport;
use vrdma_spec::codec::{doorbell_bitmap_bits, notify_area_bytes};
use vrdma_spec::config::{features, DeviceConfig};
use vrdma_spec::ctrl::{
    AddDoorbellAreaRequest, CreatedResponse, DeviceAttr, HandleRequest, Opcode,
    SetNotifyAreaRequest, Status,
};
use vrdma_spec::ring::{event_kind, Event};
use vrdma_spec::{read_wire, ByteValued, Le16, Le32, Le64};

use accounts::{Accounts, Shares};
use requests::ObjectKind;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("opening the vrdma device {target}: {source}")]
    Device {
        target: String,
        source: vrdma_guest::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("another vrdma service already listens on {0}")]
    AlreadyServed(PathBuf),
    #[error("the vrdma device failed (DEVICE_FATAL) or went away: every program's objects are gone; restart the service")]
    DeviceLost,
}

pub type Result<T> = std::result::Result<T, Error>;

fn io_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// How the service shares the device out (SPEC.md §12, "Shares").
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Each user's programs may hold at most `1 / share` of each of the device's object
    /// limits together, of the memory regions the device takes, and of the locked memory.
    pub share: u32,
    /// Bytes of memory one program may share with the device.
    pub max_program_memory: u64,
    /// Programs served at once; more are refused.
    pub max_programs: usize,
    /// Programs (connections) one user may have at once; `None`: `max_programs / share`.
    pub max_programs_per_user: Option<usize>,
    /// Bytes of memory all programs together may share with the device (which the service
    /// locks for it in a VM); `None`: half of the system's memory.
    pub max_locked_memory: Option<u64>,
    /// How long a connection may take to say HELLO before it is closed.
    pub hello_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            share: 4,
            max_program_memory: 1 << 30,
            max_programs: 256,
            max_programs_per_user: None,
            max_locked_memory: None,
            hello_timeout: Duration::from_secs(10),
        }
    }
}

/// Memory regions the service keeps for itself where the device bounds them: its own
/// memory grows by a region when its page-list copies need more room.
const SERVICE_REGIONS: usize = 4;
/// Memory regions (memfds, each an open file and a mapping of the service's) all programs
/// may share where the device does not bound them (a VM's device reaches all guest RAM).
const MAX_REGIONS: usize = 16 << 10;
/// Memory regions one program may share at most.
const MAX_REGIONS_PER_PROGRAM: usize = 1024;
/// Descriptors the service keeps for itself besides its programs' memory regions: its
/// programs' sockets (two each), the device, logging.
const DESCRIPTORS_OF_THE_SERVICE: u64 = 1024;

/// Puts the program's limits of `$shares` in the like-named fields of `$target` (the
/// configuration space or QUERY_DEVICE's answer, which name them alike).
macro_rules! with_program_limits {
    ($shares:expr, $target:expr) => {{
        let limit = |kind| Le32::from($shares.objects_per_user[&kind]);
        $target.max_qp = limit(ObjectKind::Qp);
        $target.max_srq = limit(ObjectKind::Srq);
        $target.max_ah = limit(ObjectKind::Ah);
        $target.max_mr = limit(ObjectKind::Mr);
        $target.max_cq = limit(ObjectKind::Cq);
        $target.max_pd = limit(ObjectKind::Pd);
        let size = $target
            .max_mr_size
            .to_native()
            .min($shares.bytes_per_program);
        $target.max_mr_size = Le64::from(size);
    }};
}

impl Shares {
    /// The configuration space a program is shown: the device's, with its user's share
    /// (what it can create), and no memory region bound (the service's business).
    pub fn program_config(&self, config: &DeviceConfig) -> DeviceConfig {
        let mut config = *config;
        with_program_limits!(self, config);
        config.max_memory_regions = Le32::from(0);
        config
    }

    /// QUERY_DEVICE's answer as a program is given it: with its user's share, which is what
    /// it can create (SPEC.md §12).
    pub fn program_device_attr(&self, attr: &mut DeviceAttr) {
        with_program_limits!(self, attr);
    }

    /// The shares of a device of `config`: a `1 / share` part of each object limit per user
    /// (at least one of each), `regions` memory regions for all programs and `memory` bytes.
    pub fn fair(config: &DeviceConfig, options: &Options, regions: usize, memory: u64) -> Shares {
        let share = options.share.max(1);
        let part = |max: u32| max.div_ceil(share).max(1);
        let objects_per_user = [
            (ObjectKind::Qp, config.max_qp.to_native()),
            // The device's CM id quota is its QP quota (SPEC.md §13.1).
            (ObjectKind::CmId, config.max_qp.to_native()),
            (ObjectKind::Srq, config.max_srq.to_native()),
            (ObjectKind::Ah, config.max_ah.to_native()),
            (ObjectKind::Mr, config.max_mr.to_native()),
            (ObjectKind::Cq, config.max_cq.to_native()),
            (ObjectKind::Pd, config.max_pd.to_native()),
        ]
        .into_iter()
        .map(|(kind, max)| (kind, part(max)))
        .collect();
        let regions_per_user = regions.div_ceil(share as usize).max(1);
        Shares {
            programs: options.max_programs,
            programs_per_user: options
                .max_programs_per_user
                .unwrap_or(options.max_programs / share as usize)
                .max(1),
            objects_per_user,
            regions,
            regions_per_user,
            regions_per_program: regions_per_user.min(MAX_REGIONS_PER_PROGRAM),
            bytes: memory,
            bytes_per_user: memory / u64::from(share),
            bytes_per_program: options.max_program_memory,
        }
    }
}

/// Half of the system's memory: what the service locks for all programs at most unless
/// told (`--max-locked-memory`).
fn half_of_the_memory() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let (pages, page_size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages.max(0) as u64).saturating_mul(page_size.max(0) as u64) / 2
}

/// Memory regions all programs may share where the device does not bound them: as many as
/// the service's open file limit (raised to its hard limit) holds beside its own files.
fn regions_the_descriptors_hold() -> usize {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return MAX_REGIONS;
    };
    let wanted = MAX_REGIONS as u64 + DESCRIPTORS_OF_THE_SERVICE;
    let raised = wanted.min(hard).max(soft);
    if raised > soft {
        if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, raised, hard) {
            log::warn!("cannot raise the open file limit to {raised}: {e}");
            return (soft.saturating_sub(DESCRIPTORS_OF_THE_SERVICE) as usize).min(MAX_REGIONS);
        }
    }
    (raised.saturating_sub(DESCRIPTORS_OF_THE_SERVICE) as usize).min(MAX_REGIONS)
}

/// Notify states and a doorbell bitmap (SPEC.md §8.5) in a memfd of their own: the states in
/// the first page, the bitmap from the second, nothing else, so a program it is handed to
/// sees nothing more.
struct DoorbellRegion {
    region: Arc<Region>,
    bitmap_bytes: u64,
}

impl DoorbellRegion {
    const BITMAP_OFFSET: u64 = PAGE_SIZE;

    fn create(transport: &dyn Transport, bitmap_bytes: u64) -> vrdma_guest::Result<Self> {
        let len = (Self::BITMAP_OFFSET + bitmap_bytes).next_multiple_of(PAGE_SIZE);
        Ok(DoorbellRegion {
            region: transport.adopt(Region::create(len)?)?,
            bitmap_bytes,
        })
    }

    /// The device addresses of the notify states (of `num_notify_queues`) and the bitmap.
    fn device_addrs(&self, num_notify_queues: u32) -> vrdma_guest::Result<(Le64, Le64)> {
        let states = self.region.view(0, notify_area_bytes(num_notify_queues))?;
        let bitmap = self.region.view(Self::BITMAP_OFFSET, self.bitmap_bytes)?;
        Ok((
            Le64::from(states.device_addr()?),
            Le64::from(bitmap.device_addr()?),
        ))
    }

    /// `welcome` for a program that maps this region.
    fn welcome(&self, welcome: &Welcome) -> Welcome {
        Welcome {
            notify_len: self.region.size(),
            bitmap_offset: Self::BITMAP_OFFSET,
            bitmap_len: self.bitmap_bytes,
            ..welcome.clone()
        }
    }

    fn file(&self) -> &std::fs::File {
        self.region.file().expect("a doorbell region is a memfd")
    }
}

/// A program's doorbell area (SPEC.md §8.6): its number on the device and its region.
struct ProgramArea {
    number: u32,
    doorbells: DoorbellRegion,
}

/// The service: the device, and the programs it serves.
pub struct Service {
    transport: Arc<dyn Transport>,
    /// The device's first doorbell area (SET_NOTIFY_AREA's): every program's when the device
    /// has no doorbell areas of programs' own, else only the service's.
    notify: DoorbellRegion,
    /// The doorbell bits of a program's own area; `None`: the device offers none.
    program_area_bits: Option<u32>,
    /// What every program is told at WELCOME but where its doorbells are.
    welcome: Welcome,
    options: Options,
    /// What the programs, their users and all of them together hold, against their shares.
    accounts: Mutex<Accounts>,
    /// Which program owns each CQ, QP and SRQ, for routing the device's events.
    owners: Mutex<HashMap<(ObjectKind, u32), u64>>,
    /// Each program's event socket.
    programs: Mutex<HashMap<u64, UnixStream>>,
    next_program: AtomicU64,
    /// Connections refused, for a log that a flood of them cannot fill.
    refused: AtomicU64,
}

impl Service {
    /// Opens the device `target` names (`pci`, `pci:ADDRESS` or a backend's socket path),
    /// resetting it (whatever an earlier instance left on it is gone), and sets up the
    /// notify area every program will share.
    pub fn open(target: &str, options: &Options) -> Result<Arc<Service>> {
        let device_error = |source| Error::Device {
            target: target.to_string(),
            source,
        };
        let transport: Arc<dyn Transport> =
            Arc::from(vrdma_guest::target::open(target).map_err(device_error)?);
        transport.check_version().map_err(device_error)?;
        let config = *transport.config();
        let num_notify_queues = config.num_notify_queues.to_native();
        let device_bits =
            doorbell_bitmap_bits(config.max_qp.to_native(), config.max_srq.to_native());
        let notify = DoorbellRegion::create(&*transport, u64::from(device_bits / 8))
            .map_err(device_error)?;
        let (addr, doorbell_bitmap) = notify
            .device_addrs(num_notify_queues)
            .map_err(device_error)?;
        transport
            .start_driver(&SetNotifyAreaRequest {
                addr,
                doorbell_bitmap,
            })
            .map_err(device_error)?;
        // A backend ends the connection at a memory region past its limit: the programs get
        // what the service's own memory leaves, less a few for its growth.
        let regions = match transport.memory_regions() {
            Some(regions) => regions
                .limit
                .saturating_sub(regions.in_use + SERVICE_REGIONS),
            None => regions_the_descriptors_hold(),
        };
        let memory = options.max_locked_memory.unwrap_or_else(half_of_the_memory);
        let shares = Shares::fair(&config, options, regions, memory);
        log::info!(
            "shares: {} programs ({} per user); per user 1/{} of the device's objects, {} of \
             {} memory regions and {} of {} bytes of locked memory; {} bytes and {} regions per \
             program",
            shares.programs,
            shares.programs_per_user,
            options.share.max(1),
            shares.regions_per_user,
            shares.regions,
            shares.bytes_per_user,
            shares.bytes,
            shares.bytes_per_program,
            shares.regions_per_program,
        );
        // A program's area holds a bit for each QP and SRQ it may hold.
        let program_area_bits = (transport.features() & features::DOORBELL_AREAS != 0).then(|| {
            let queues = shares.objects_per_user[&ObjectKind::Qp]
                + shares.objects_per_user[&ObjectKind::Srq];
            queues.next_multiple_of(64).min(device_bits)
        });
        if program_area_bits.is_none() {
            log::warn!(
                "the vrdma device {target} has no doorbell areas for programs: they share one, \
                 and each can delay the others' doorbells (SPEC.md §12)"
            );
        }
        let notify_port = transport.notify_port().map(|port| port.offset);
        log::info!(
            "serving the vrdma device {target}: {} notification queues, up to {} QPs; programs kick it {}",
            config.num_notify_queues.to_native(),
            config.max_qp.to_native(),
            if notify_port.is_some() {
                "through its notification port"
            } else {
                "through the service"
            }
        );
        Ok(Arc::new(Service {
            welcome: Welcome {
                version: vrdma_guest::service::protocol::VERSION,
                features: transport.features(),
                // Each program is told these of the region it is handed (see
                // `DoorbellRegion::welcome`).
                notify_len: 0,
                bitmap_offset: 0,
                bitmap_len: 0,
                notify_port,
                config: shares.program_config(&config).as_slice().to_vec(),
            },
            options: *options,
            accounts: Mutex::new(Accounts::new(shares)),
            transport,
            notify,
            program_area_bits,
            owners: Mutex::default(),
            programs: Mutex::default(),
            next_program: AtomicU64::new(1),
            refused: AtomicU64::new(0),
        }))
    }

    fn accounts(&self) -> MutexGuard<'_, Accounts> {
        self.accounts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the device offers each program a doorbell area of its own (a memory region
    /// of its own too).
    fn has_program_areas(&self) -> bool {
        self.program_area_bits.is_some()
    }

    /// A doorbell area of a program's own (SPEC.md §8.6); `None` where the device offers
    /// none, and the program shares the service's.
    fn add_program_area(&self) -> std::result::Result<Option<ProgramArea>, String> {
        let Some(bits) = self.program_area_bits else {
            return Ok(None);
        };
        let num_notify_queues = self.transport.config().num_notify_queues.to_native();
        let doorbells = DoorbellRegion::create(&*self.transport, u64::from(bits / 8))
            .map_err(|e| format!("its doorbell area: {e}"))?;
        let (addr, doorbell_bitmap) = doorbells
            .device_addrs(num_notify_queues)
            .map_err(|e| format!("its doorbell area: {e}"))?;
        let request = AddDoorbellAreaRequest {
            addr,
            doorbell_bitmap,
            bits: Le32::from(bits),
            reserved: Le32::from(0),
        };
        let reply = self
            .transport
            .command(Opcode::AddDoorbellArea, request.as_slice())
            .and_then(|response| response.accepted())
            .map_err(|e| format!("ADD_DOORBELL_AREA: {e}"))?;
        let created: CreatedResponse =
            read_wire(&reply).ok_or("ADD_DOORBELL_AREA: a short answer")?;
        Ok(Some(ProgramArea {
            number: created.handle.to_native(),
            doorbells,
        }))
    }

    /// Removes a program's doorbell area once none of its queues rings through it.
    fn remove_program_area(&self, area: ProgramArea) -> vrdma_guest::Result<Status> {
        let request = HandleRequest {
            handle: Le32::from(area.number),
            reserved: Le32::from(0),
        };
        let response = self
            .transport
            .command(Opcode::DestroyDoorbellArea, request.as_slice())?;
        self.transport.forget(&area.doorbells.region)?;
        Ok(response.status)
    }

    /// Serves programs connecting to `listener` until the device is lost.
    pub fn serve(self: &Arc<Self>, listener: UnixListener) -> Result<()> {
        let events = {
            let service = Arc::clone(self);
            std::thread::Builder::new()
                .name("vrdmad-events".into())
                .spawn(move || service.route_events())
                .map_err(io_error("starting the event thread"))?
        };
        let accepting = {
            let service = Arc::clone(self);
            std::thread::Builder::new()
                .name("vrdmad-accept".into())
                .spawn(move || {
                    for stream in listener.incoming() {
                        match stream {
                            Ok(stream) => service.start_program(stream),
                            Err(e) => {
                                // Out of descriptors, say: programs wait rather than the
                                // service spinning on the error.
                                log::error!("accepting a program: {e}");
                                std::thread::sleep(Duration::from_millis(100));
                            }
                        }
                    }
                })
                .map_err(io_error("starting the accept thread"))?
        };
        // Serving ends only when the device is lost.
        let lost = events.join().unwrap_or(Err(Error::DeviceLost));
        drop(accepting);
        lost
    }

    /// Admits the program that connected on `stream` (its user, from the socket's peer
    /// credentials, within its share of connections, before its HELLO: silent connections
    /// count too) and serves it on a thread of its own; or refuses it, saying why.
    fn start_program(self: &Arc<Self>, stream: UnixStream) {
        let id = self.next_program.fetch_add(1, Ordering::Relaxed);
        let admitted = program::Peer::of(&stream)
            .map_err(|e| format!("its credentials are unknown: {e}"))
            .and_then(|peer| {
                self.accounts()
                    .admit(peer.uid)
                    .map(|()| peer)
                    .map_err(|refusal| format!("{refusal}"))
            });
        let peer = match admitted {
            Ok(peer) => peer,
            Err(why) => {
                let refused = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
                if refused <= 10 || refused.is_multiple_of(1000) {
                    log::warn!("program {id} refused ({refused} so far): {why}");
                }
                // A short frame into the fresh socket's empty buffer: it does not block.
                let _ = protocol::send(&stream, Kind::Failed, why.as_bytes(), &[]);
                return;
            }
        };
        let service = Arc::clone(self);
        let started = std::thread::Builder::new()
            .name(format!("vrdmad-program-{id}"))
            .spawn(move || program::serve(&service, id, stream, peer));
        if let Err(e) = started {
            log::error!("starting a thread for program {id}: {e}");
            self.accounts().depart(peer.uid);
        }
    }

    /// Forwards the device's events: each to the program whose object it names; port and
    /// device events to every program. Returns when the device is lost.
    fn route_events(&self) -> Result<()> {
        loop {
            // Events wake the thread (an interrupt in a VM); the timeout only bounds how long
            // a device gone without a word (a backend that vanished) goes unnoticed, while
            // each wake-up costs an idle VM some CPU.
            match self.transport.next_event(Duration::from_secs(10)) {
                Ok(Some(event)) => {
                    let kind = event.kind.to_native();
                    if kind == event_kind::DEVICE_FATAL {
                        self.broadcast(&event);
                        return Err(Error::DeviceLost);
                    }
                    self.route(&event);
                }
                Ok(None) if self.transport.disconnected() => {
                    self.broadcast_device_fatal();
                    return Err(Error::DeviceLost);
                }
                Ok(None) => {}
                Err(e) => {
                    log::error!("reading the device's events: {e}");
                    self.broadcast_device_fatal();
                    return Err(Error::DeviceLost);
                }
            }
        }
    }

    fn route(&self, event: &Event) {
        let object = match event.kind.to_native() {
            event_kind::CQ_COMPLETION | event_kind::CQ_ERROR => Some(ObjectKind::Cq),
            event_kind::QP_FATAL => Some(ObjectKind::Qp),
            event_kind::SRQ_LIMIT_REACHED | event_kind::SRQ_ERROR => Some(ObjectKind::Srq),
            event_kind::CM_EVENT => Some(ObjectKind::CmId),
            _ => None,
        };
        let Some(object) = object else {
            self.broadcast(event);
            return;
        };
        let owner = self
            .owners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(object, event.handle.to_native()))
            .copied();
        // An event about an object destroyed meanwhile has no owner: dropped, as a driver
        // drops it (SPEC.md §8.4).
        if let Some(program) = owner {
            if let Some(socket) = self
                .programs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&program)
            {
                send_event(program, socket, event);
            }
        }
    }

    fn broadcast(&self, event: &Event) {
        for (&program, socket) in self
            .programs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            send_event(program, socket, event);
        }
    }

    fn broadcast_device_fatal(&self) {
        self.broadcast(&Event {
            kind: Le16::from(event_kind::DEVICE_FATAL),
            reserved: Le16::from(0),
            handle: Le32::from(0),
        });
    }
}

/// Writes `event` to a program's event socket without waiting: a program that reads no
/// events cannot stall the others' (the socket holds about 270 before one is dropped, whole:
/// it is a seqpacket socket).
fn send_event(program: u64, socket: &UnixStream, event: &Event) {
    let written = (&*socket).write(event.as_slice());
    match written {
        Ok(n) if n == event.as_slice().len() => {}
        Ok(_) | Err(_) => log::warn!(
            "program {program} reads no events: one of kind {} dropped",
            event.kind.to_native()
        ),
    }
}

/// Binds the service's socket at `path`, with `mode` and, if given, `group`: who may open it
/// may use RDMA. A socket left by an instance that is gone is replaced; one an instance still
/// answers on is not. The socket is bound under a name of its own and renamed into place once
/// it has its mode and group: no program ever connects to it with other rights, and a program
/// that finds the path finds a socket that listens (or the gone instance's, refusing).
/// The device node ([`make_device_node`]) gets the same mode and group.
pub fn bind(path: &Path, mode: u32, group: Option<u32>) -> Result<UnixListener> {
    if UnixStream::connect(path).is_ok() {
        return Err(Error::AlreadyServed(path.to_path_buf()));
    }
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io_error(format!("binding {}", path.display()))(
            std::io::ErrorKind::InvalidInput.into(),
        ));
    };
    std::fs::create_dir_all(dir).map_err(io_error(format!("creating {}", dir.display())))?;
    // Before the socket: a program that finds the socket finds the node too. Without the
    // node only programs that look for one (UCX) miss vrdma0.
    if let Err(e) = make_device_node(mode, group) {
        log::warn!("{e}");
    }
    let staged = dir.join(format!(
        ".{}.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&staged);
    let listener =
        UnixListener::bind(&staged).map_err(io_error(format!("binding {}", staged.display())))?;
    let placed = give_access(&staged, mode, group).and_then(|()| {
        std::fs::rename(&staged, path).map_err(io_error(format!(
            "moving the socket into place at {}",
            path.display()
        )))
    });
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&staged);
        return Err(e);
    }
    log::info!(
        "listening on {} (mode {mode:o}{})",
        path.display(),
        group.map(|g| format!(", group {g}")).unwrap_or_default()
    );
    Ok(listener)
}

/// Gives `path` the `mode` and, if given, the `group` that decide who may use RDMA.
fn give_access(path: &Path, mode: u32, group: Option<u32>) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io_error(format!("setting the mode of {}", path.display())))?;
    if let Some(gid) = group {
        std::os::unix::fs::chown(path, None, Some(gid)).map_err(io_error(format!(
            "giving {} to group {gid}",
            path.display()
        )))?;
    }
    Ok(())
}

/// Makes the device's marker node ([`vrdma_guest::DEVICE_NODE`]) with the socket's `mode`
/// and `group`, so that programs that look for a device node (UCX) find vrdma0 exactly when
/// they may use the service. A marker an earlier run left is made again; anything else at
/// that path is left alone.
pub fn make_device_node(mode: u32, group: Option<u32>) -> Result<()> {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let path = Path::new(vrdma_guest::DEVICE_NODE);
    let (major, minor) = vrdma_guest::DEVICE_NODE_NUMBERS;
    let marker = makedev(major, minor);
    let failed = |what: &str| io_error(format!("{what} {}", path.display()));
    match std::fs::symlink_metadata(path) {
        Ok(found) if found.file_type().is_char_device() && found.rdev() == marker => {
            std::fs::remove_file(path).map_err(failed("removing the old"))?
        }
        Ok(_) => {
            log::warn!(
                "{} exists and is not vrdma's marker node: left as it is",
                path.display()
            );
            return Ok(());
        }
        Err(_) => {}
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io_error(format!("creating {}", dir.display())))?;
    }
    mknod(
        path,
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o600),
        marker,
    )
    .map_err(|errno| failed("making")(errno.into()))?;
    give_access(path, mode, group)
}

/// Tells systemd the service is ready (a `Type=notify` unit), when it runs under one.
pub fn notify_systemd_ready() -> Result<()> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(());
    };
    let path = path.to_string_lossy().into_owned();
    let address = match path.strip_prefix('@') {
        Some(name) => SocketAddr::from_abstract_name(name.as_bytes()),
        None => SocketAddr::from_pathname(&path),
    }
    .map_err(io_error(format!("NOTIFY_SOCKET {path}")))?;
    let socket = UnixDatagram::unbound().map_err(io_error("a socket for systemd"))?;
    socket
        .send_to_addr(b"READY=1", &address)
        .map_err(io_error(format!(
            "telling systemd at {path} the service is ready"
        )))?;
    Ok(())
}

#[cfg(test)]
mod tests;
