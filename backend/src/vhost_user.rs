//! The vhost-user face of the device: virtqueue plumbing around [`Device`], and a server that
//! gives every front-end connection a device (and host context) of its own.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use vhost::vhost_user::message::VhostUserProtocolFeatures;
pub use vhost::vhost_user::Listener;
use vhost_user_backend::{VhostUserBackendMut, VhostUserDaemon, VringT};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{
    GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_spec::config::{CONTROL_QUEUE, EVENT_QUEUE, FIRST_NOTIFY_QUEUE};
use vrdma_spec::ring::Event;
use vrdma_spec::ByteValued;

use crate::admin::{AdminSocket, Managed, Registry};
use crate::datapath::{EventSink, PollerPool, RateDebt, RateLimits};
use crate::device::{Device, GuestReport, GuestState, LocalPeers};
use crate::guest_faults::WatchedMapping;
use crate::memory_regions::{self, UnsealedFiles};
use crate::per_second::PerSecond;
use crate::vring::Vring;
use crate::{Config, Error};

/// Virtqueue size the device offers on every queue.
const QUEUE_SIZE: usize = 256;
/// Longest control request the device reads: header plus the largest payload, with room to
/// spare; anything longer is cut here and refused by the length check.
const MAX_REQUEST_BYTES: u64 = 512;
/// VHOST_USER_F_PROTOCOL_FEATURES: the front end may negotiate protocol features.
const VHOST_USER_F_PROTOCOL_FEATURES: u64 = 1 << 30;

type GuestMemory = GuestMemoryAtomic<GuestMemoryMmap>;

/// vhost-user backend state of one connection.
pub struct RdmaBackend {
    device: Device,
    num_queues: usize,
    /// The memory table last accepted, the only guest memory the device touches (see
    /// [`crate::vring`]): the daemon's own memory holds each new table before it is checked.
    mem: GuestMemory,
    event_idx: bool,
    /// Tells the vring worker to exit when the connection ends.
    exit: EventNotifier,
    /// The worker's ends of the exit event, made with the backend so that a worker always
    /// gets them (without them it would never exit, and the connection's objects would never
    /// be released): taken by the daemon when it starts the worker.
    worker_exit: Mutex<Option<(EventConsumer, EventNotifier)>>,
    event_sink_set: bool,
    /// The regions of the accepted table by host address, each watched for faults
    /// ([`crate::guest_faults`]) since it was checked.
    accepted_regions: HashMap<usize, WatchedMapping>,
    /// The regions of the table accepted before, still watched: a thread may hold a
    /// snapshot of that table for a moment longer.
    retired_regions: Vec<WatchedMapping>,
    /// Most memory regions the front end may have (each holds a file descriptor).
    max_memory_regions: usize,
    unsealed_memory: UnsealedFiles,
    /// The driver broke the control queue; it is served again after a reset.
    control_broken: bool,
    /// The control queue, once it has run: whether it runs says whether the front end has
    /// paused the device.
    control_queue: Option<Vring>,
    kicks: KickThrottle,
    /// The front end asked for the device's features, as every front end does first.
    greeted: Arc<Greeting>,
}

/// Whether a connection's front end has spoken; its watchdog ([`close_if_silent`]) sleeps on
/// it and ends as soon as it has, so that no thread outlives a greeting.
#[derive(Default)]
struct Greeting {
    greeted: Mutex<bool>,
    spoken: std::sync::Condvar,
}

impl Greeting {
    fn mark(&self) {
        let mut greeted = self.greeted.lock().unwrap_or_else(|e| e.into_inner());
        if !*greeted {
            *greeted = true;
            self.spoken.notify_all();
        }
    }

    /// Waits at most `timeout` for the greeting; whether it came.
    fn wait(&self, timeout: std::time::Duration) -> bool {
        let greeted = self.greeted.lock().unwrap_or_else(|e| e.into_inner());
        let (greeted, _) = self
            .spoken
            .wait_timeout_while(greeted, timeout, |greeted| !*greeted)
            .unwrap_or_else(|e| e.into_inner());
        *greeted
    }
}

/// Kicks no poller asked for (none was asleep, SPEC.md §8.5) are wasted work: a wake-up of
/// the connection's vring worker and of the poller. A driver kicking in a loop could keep
/// CPUs busy and slow every guest; past [`SPURIOUS_KICKS_PER_SECOND`] such kicks in a
/// second, the worker waits [`SPURIOUS_KICK_DELAY`] after each, which bounds how often one
/// guest's kicks wake the backend. Kicks a sleeping poller asked for are never delayed.
#[derive(Default)]
struct KickThrottle {
    spurious: PerSecond,
}

const SPURIOUS_KICKS_PER_SECOND: u32 = 100;
const SPURIOUS_KICK_DELAY: std::time::Duration = std::time::Duration::from_millis(20);

impl KickThrottle {
    fn spurious_kick(&mut self) {
        if self.spurious.note(std::time::Instant::now()) > SPURIOUS_KICKS_PER_SECOND {
            std::thread::sleep(SPURIOUS_KICK_DELAY);
        }
    }
}

/// Delivers device events into buffers the driver posted on the event queue.
struct EventQueue {
    vring: Vring,
    mem: GuestMemory,
    log: crate::log_budget::LogBudget,
}

impl EventSink for EventQueue {
    fn deliver(&self, event: &Event) -> bool {
        let mem = self.mem.memory();
        let chain = {
            let mut state = self.vring.get_mut();
            match state.get_queue_mut().iter(mem.clone()) {
                Ok(mut chains) => chains.next(),
                Err(_) => None,
            }
        };
        let Some(chain) = chain else { return false };
        let head = chain.head_index();
        let written = match chain.writer(&mem) {
            Ok(mut writer) => writer
                .write_all(event.as_slice())
                .map(|_| event.as_slice().len()),
            Err(e) => Err(io::Error::other(e)),
        };
        let used = written.unwrap_or_else(|e| {
            self.log
                .warn(|| format!("event buffer {head} is malformed: {e}"));
            0
        });
        self.vring.add_used(head, used as u32).is_ok() && self.vring.signal_used_queue().is_ok()
    }
}

impl RdmaBackend {
    pub fn new(
        config: &Config,
        pool: &Arc<PollerPool>,
        peers: &Arc<LocalPeers>,
    ) -> Result<Self, Error> {
        let (consumer, exit) = new_event_consumer_and_notifier(EventFlag::NONBLOCK)?;
        let worker_exit = (consumer, exit.try_clone()?);
        Ok(RdmaBackend {
            device: Device::new(config, pool, peers)?,
            num_queues: usize::from(FIRST_NOTIFY_QUEUE) + config.notify_queues as usize,
            mem: GuestMemoryAtomic::new(GuestMemoryMmap::new()),
            event_idx: false,
            exit,
            worker_exit: Mutex::new(Some(worker_exit)),
            event_sink_set: false,
            accepted_regions: HashMap::new(),
            retired_regions: Vec::new(),
            max_memory_regions: config.quotas.max_memory_regions as usize,
            unsealed_memory: config.unsealed_memory,
            control_broken: false,
            control_queue: None,
            kicks: KickThrottle::default(),
            greeted: Arc::default(),
        })
    }

    /// Checks the regions of `table` that were not in the last accepted one
    /// ([`memory_regions::accept`]) and the front end's region quota; returns the new ones,
    /// watched for faults.
    fn check_memory_table(
        &self,
        table: &GuestMemoryMmap,
    ) -> io::Result<Vec<(usize, WatchedMapping)>> {
        let regions = table.num_regions();
        if regions > self.max_memory_regions {
            return Err(io::Error::other(format!(
                "{regions} memory regions: at most {} (the guest's quota)",
                self.max_memory_regions
            )));
        }
        let mut new = Vec::new();
        for region in table.iter() {
            let host_address = region.as_ptr() as usize;
            if !self.accepted_regions.contains_key(&host_address) {
                let page_size = memory_regions::accept(region, self.unsealed_memory)
                    .map_err(io::Error::other)?;
                let watched = self
                    .device
                    .fault_domain()
                    .watch(host_address, region.len() as usize, page_size)
                    .map_err(io::Error::other)?;
                new.push((host_address, watched));
            }
        }
        Ok(new)
    }

    /// Tells the worker threads to exit (the connection is over).
    fn stop_workers(&self) {
        if let Err(e) = self.exit.notify() {
            log::error!("cannot stop the vring workers: {e}");
        }
    }

    /// Serves the control queue. A queue the driver broke (an available index more than a
    /// queue ahead, a head beyond the queue) is not served again until a reset, and the driver
    /// hears DEVICE_FATAL (SPEC.md §8.4): the connection's worker lives on.
    fn process_control_queue(&mut self, vring: &Vring) -> io::Result<()> {
        if self.control_broken {
            return Ok(());
        }
        loop {
            if self.event_idx {
                vring.disable_notification().map_err(io::Error::other)?;
            }
            let mem = self.mem.memory();
            let device = &mut self.device;
            let served = {
                // Held only while serving: signalling below takes the vring again.
                let mut state = vring.get_mut();
                serve_control_chains(state.get_queue_mut(), mem.clone(), |r, room| {
                    device.process_request(&*mem, r, room)
                })
            };
            match served {
                Ok(malformed) => {
                    for (head, error) in malformed {
                        self.device.note_malformed_chain(head, &error);
                    }
                }
                Err(e) => {
                    self.break_control_queue(&e);
                    return Ok(());
                }
            }
            vring.signal_used_queue()?;
            if !self.event_idx || !vring.enable_notification().map_err(io::Error::other)? {
                return Ok(());
            }
        }
    }

    fn break_control_queue(&mut self, error: &dyn std::fmt::Display) {
        self.device.data_path().log_budget().warn(|| {
            format!("the driver broke the control queue ({error}); it must reset the device")
        });
        self.control_broken = true;
        self.device.data_path().device_fatal();
    }
}

/// Serves every chain the driver made available on the control queue: its readable bytes (at
/// most [`MAX_REQUEST_BYTES`]) and the room in its writable part go to `respond`, whose answer
/// is written back before the chain is marked used. A malformed chain is used with nothing
/// written, and returned with what is wrong with it; an error means the driver broke the
/// queue itself (an index beyond it).
pub fn serve_control_chains<M>(
    queue: &mut Queue,
    mem: M,
    mut respond: impl FnMut(&[u8], usize) -> Vec<u8>,
) -> Result<Vec<(u16, io::Error)>, virtio_queue::Error>
where
    M: std::ops::Deref + Clone,
    M::Target: vm_memory::GuestMemory + Sized,
{
    let chains: Vec<_> = queue.iter(mem.clone())?.collect();
    let mut malformed = Vec::new();
    for chain in chains {
        let head = chain.head_index();
        let used = respond_in_chain(&mem, chain, &mut respond).unwrap_or_else(|e| {
            malformed.push((head, e));
            0
        });
        queue.add_used(&*mem, head, used)?;
    }
    Ok(malformed)
}

/// Runs one request; returns the bytes written into the chain.
fn respond_in_chain<M>(
    mem: &M,
    chain: virtio_queue::DescriptorChain<M>,
    respond: &mut impl FnMut(&[u8], usize) -> Vec<u8>,
) -> io::Result<u32>
where
    M: std::ops::Deref + Clone,
    M::Target: vm_memory::GuestMemory + Sized,
{
    let mut request = Vec::new();
    chain
        .clone()
        .reader(mem)
        .map_err(io::Error::other)?
        .take(MAX_REQUEST_BYTES)
        .read_to_end(&mut request)?;
    let mut writer = chain.writer(mem).map_err(io::Error::other)?;
    let response = respond(&request, writer.available_bytes());
    writer.write_all(&response)?;
    Ok(response.len() as u32)
}

/// The part of the configuration space `config` a GET_CONFIG of `size` bytes at `offset`
/// reads: what of it lies inside, possibly nothing.
pub fn config_window(config: &[u8], offset: u32, size: u32) -> &[u8] {
    let start = (offset as usize).min(config.len());
    let end = start.saturating_add(size as usize).min(config.len());
    &config[start..end]
}

impl VhostUserBackendMut for RdmaBackend {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.num_queues
    }

    fn max_queue_size(&self) -> usize {
        QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        self.greeted.mark();
        self.device.offered_features()
            | 1 << VIRTIO_F_VERSION_1
            | 1 << VIRTIO_RING_F_EVENT_IDX
            | VHOST_USER_F_PROTOCOL_FEATURES
    }

    fn acked_features(&mut self, features: u64) {
        self.device.set_acked_features(features);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::RESET_DEVICE
    }

    fn reset_device(&mut self) {
        self.device.reset();
        self.control_broken = false;
    }

    /// QEMU's generic vhost-user device sends neither RESET_DEVICE nor SET_STATUS when the
    /// driver resets it; it stops the rings, as it does when the VM is paused. A driver that
    /// says when it resets keeps its objects across a stop; for any other, a stopped control
    /// queue means the driver is gone, and its objects go too (Device::queues_stopped).
    fn stop_vring(&mut self, queue_index: u32) -> io::Result<()> {
        if queue_index == u32::from(CONTROL_QUEUE) {
            self.device.queues_stopped();
            self.control_broken = false;
        }
        Ok(())
    }

    fn set_event_idx(&mut self, enabled: bool) {
        self.event_idx = enabled;
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        config_window(self.device.config().as_slice(), offset, size).to_vec()
    }

    fn update_memory(&mut self, unchecked: GuestMemory) -> io::Result<()> {
        // vhost-user-backend has put the new table in its own memory (`unchecked`), which
        // nothing of the device reads: a table with a region the backend cannot safely touch,
        // or more regions than the quota (each costs a descriptor and a mapping), is refused
        // and the daemon's memory put back; an accepted one becomes the device's memory.
        let table = (*unchecked.memory()).clone();
        let new_regions = match self.check_memory_table(&table) {
            Ok(new_regions) => new_regions,
            Err(e) => {
                log::warn!("memory table refused: {e}");
                let previous = (*self.mem.memory()).clone();
                unchecked
                    .lock()
                    .map_err(|_| io::Error::other("memory table lock poisoned"))?
                    .replace(previous);
                return Err(e);
            }
        };
        let mut accepted: HashMap<usize, WatchedMapping> = new_regions.into_iter().collect();
        for region in table.iter() {
            let host_address = region.as_ptr() as usize;
            if let Some(kept) = self.accepted_regions.remove(&host_address) {
                accepted.insert(host_address, kept);
            }
        }
        let gone = std::mem::replace(&mut self.accepted_regions, accepted);
        self.retired_regions = gone.into_values().collect();
        self.mem
            .lock()
            .map_err(|_| io::Error::other("memory table lock poisoned"))?
            .replace(table);
        self.device.memory_changed();
        self.device.data_path().set_memory(self.mem.clone());
        Ok(())
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        // One worker thread (the default queues_per_thread), started once per backend.
        self.worker_exit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    fn handle_event(
        &mut self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Vring],
        _thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!("unexpected event set {evset:?}")));
        }
        if !self.event_sink_set {
            // The first event of a connection is a control request; from then on the data
            // path can post events.
            let vring = vrings[usize::from(EVENT_QUEUE)].clone();
            let sink = EventQueue {
                vring,
                mem: self.mem.clone(),
                log: self.device.data_path().log_budget().clone(),
            };
            self.device
                .data_path()
                .set_event_sink(std::sync::Arc::new(sink));
            self.event_sink_set = true;
            self.control_queue = Some(vrings[usize::from(CONTROL_QUEUE)].clone());
        }
        match device_event {
            CONTROL_QUEUE => self.process_control_queue(&vrings[usize::from(CONTROL_QUEUE)]),
            EVENT_QUEUE => {
                self.device.data_path().events_available();
                Ok(())
            }
            queue => {
                let asked_for = self
                    .device
                    .data_path()
                    .kick(u32::from(queue - FIRST_NOTIFY_QUEUE));
                if !asked_for {
                    self.kicks.spurious_kick();
                }
                Ok(())
            }
        }
    }
}

/// Serves front ends on `socket_path` until an error, as [`serve_listener`] does; the first
/// guest's host context is open before the socket exists, so a front end (or a test counting
/// the host's objects) that sees the socket finds the backend ready.
pub fn serve(config: &Config, socket_path: &Path) -> Result<(), Error> {
    // Held while serving: no other backend serves guests on this GID unless all share it.
    let _claim = crate::claim_guest_gid(config)?;
    let serving = Serving::start(config)?;
    let socket = serving.prepare(config.clone(), ONE_SOCKET, || {
        listen(socket_path, config.socket_group.as_ref())
    })?;
    crate::sandbox::confine(config.seccomp)?;
    log::info!("accepting guests");
    serving.serve(socket, None)
}

impl Managed for RwLock<RdmaBackend> {
    fn report(&self, guest: u64) -> GuestReport {
        let backend = self.read().unwrap_or_else(|e| e.into_inner());
        let state = match &backend.control_queue {
            None => GuestState::Starting,
            Some(queue) if queue.get_ref().get_queue().ready() => GuestState::Running,
            Some(_) => GuestState::Paused,
        };
        GuestReport {
            state,
            ..backend.device.report(guest)
        }
    }

    fn set_rate_limits(&self, limits: RateLimits) {
        self.read()
            .unwrap_or_else(|e| e.into_inner())
            .device
            .data_path()
            .set_rate_limits(limits);
    }
}

/// The vhost-user socket at `socket_path`, listening; with `group`, that group's members may
/// connect to it too. A socket left there by a backend that is gone is replaced; anything
/// else there (a file that is not a socket, or a socket something still serves) is not
/// touched, and refused.
pub fn listen(
    socket_path: &Path,
    group: Option<&crate::sandbox::SocketGroup>,
) -> Result<Listener, Error> {
    check_socket_path(socket_path)?;
    let listener = Listener::new(socket_path, true).map_err(Error::VhostUser)?;
    if let Some(group) = group {
        group
            .give(socket_path)
            .map_err(|source| Error::SocketGroup {
                path: socket_path.to_owned(),
                group: group.name.clone(),
                source,
            })?;
    }
    log::info!("listening on {}", socket_path.display());
    Ok(listener)
}

/// Refuses `path` for a new socket unless nothing is there or a socket no process serves.
fn check_socket_path(path: &Path) -> Result<(), Error> {
    use std::os::unix::fs::FileTypeExt;
    let refused = |reason: &str| Error::SocketPath {
        path: path.to_owned(),
        reason: reason.to_string(),
    };
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(refused(&e.to_string())),
        Ok(meta) if !meta.file_type().is_socket() => {
            Err(refused("something other than a socket is there"))
        }
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Err(refused("a process serves the socket there")),
            Err(_) => Ok(()),
        },
    }
}

/// The name of the one socket `--socket-path` serves, in reports.
pub const ONE_SOCKET: &str = "guest";

/// Serves the front ends `listener` accepts until an error (the caller holds the claim on the
/// guests' GID, [`crate::claim_guest_gid`]): each connection gets its own
/// backend (its own host context and objects), served on its own threads; when it ends,
/// everything it created on the host is destroyed. With `admin`, the management socket
/// reports the connected guests.
pub fn serve_listener(
    config: &Config,
    listener: Listener,
    admin: Option<AdminSocket>,
) -> Result<(), Error> {
    let serving = Serving::start(config)?;
    let socket = serving.prepare(config.clone(), ONE_SOCKET, || Ok(listener))?;
    if let Some(admin) = admin {
        admin.serve(Arc::clone(&serving.registry))?;
    }
    // Everything serving needs from here on is in the filter (crate::sandbox).
    crate::sandbox::confine(config.seccomp)?;
    // Front ends may connect once the socket exists; this line says their host context is
    // ready (test harnesses count the host's objects from here).
    log::info!("accepting guests");
    serving.serve(socket, None)
}

/// What every socket a backend serves shares: the poller pool, the RC QPs of all its guests,
/// the registry of connections the management socket reports, and the connections' numbers.
pub struct Serving {
    pool: Arc<PollerPool>,
    peers: Arc<LocalPeers>,
    pub registry: Arc<Registry>,
    connections: std::sync::atomic::AtomicU64,
}

/// A socket ready to serve: its guest's configuration and name, and the device context its
/// first front end gets, opened before it arrives (so a front end never waits for it, and a
/// bad device fails before the first guest is accepted).
pub struct PreparedSocket {
    config: Config,
    name: String,
    listener: Listener,
    first: RdmaBackend,
    /// What its guest's sends owe their rate limits, from one connection to the next.
    rate_debt: Arc<RateDebt>,
}

impl Serving {
    /// Starts the poller pool `config` asks for, and the recovery from faults in guest
    /// memory ([`crate::guest_faults`]).
    pub fn start(config: &Config) -> Result<Arc<Serving>, Error> {
        crate::guest_faults::install()?;
        let pool = PollerPool::start(config.poll_threads, config.poll_idle, &config.poll_cpus)?;
        Ok(Arc::new(Serving {
            pool: Arc::new(pool),
            peers: Arc::default(),
            registry: Arc::default(),
            connections: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    /// Readies the socket `listen` gives to serve the guest `name` with `config`; its first
    /// device context is open before `listen` is called, so a front end (or a test counting
    /// the host's objects) that finds a new socket finds the backend ready.
    pub fn prepare(
        &self,
        config: Config,
        name: &str,
        listen: impl FnOnce() -> Result<Listener, Error>,
    ) -> Result<PreparedSocket, Error> {
        let first = RdmaBackend::new(&config, &self.pool, &self.peers)?;
        Ok(PreparedSocket {
            config,
            name: name.to_string(),
            listener: listen()?,
            first,
            rate_debt: Arc::default(),
        })
    }

    /// Serves the front ends `socket` accepts until an error, or until `stop` is written:
    /// then its connection is ended, and this returns once everything it held is freed.
    pub fn serve(&self, socket: PreparedSocket, stop: Option<&EventFd>) -> Result<(), Error> {
        let PreparedSocket {
            config,
            name,
            mut listener,
            first,
            rate_debt,
        } = socket;
        let mut backend = Arc::new(RwLock::new(first));
        let admission = Arc::new(Admission::new(&config)?);
        loop {
            if !admission.wait_for_room(&listener, stop)? || !wait_for_front_end(&listener, stop)? {
                self.registry.disconnect(&name);
                admission.wait_until_empty()?;
                return Ok(());
            }
            let connection = self.connections.fetch_add(1, Ordering::Relaxed) + 1;
            // One connection failing to start (no threads, descriptors or memory left) must
            // not stop the guests already served, nor the ones that come later.
            let started = start_connection(
                (connection, &name),
                Arc::clone(&backend),
                (&mut listener, config.handshake_timeout),
                (
                    Arc::clone(&admission),
                    Arc::clone(&self.registry),
                    Arc::clone(&rate_debt),
                ),
            );
            if let Err(e) = started {
                log::error!("connection {connection}: cannot be served: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            // The backend was handed to the connection, or half used by a failed start:
            // either way the next connection gets a fresh one.
            backend = loop {
                match RdmaBackend::new(&config, &self.pool, &self.peers) {
                    Ok(next) => break Arc::new(RwLock::new(next)),
                    Err(e) => {
                        log::error!(
                            "cannot prepare a device for the next guest: {e}; retrying in 1 s"
                        );
                        std::thread::sleep(std::time::Duration::from_secs(1));
                    }
                }
            };
        }
    }
}

/// Waits until a front end connects to `listener` (true) or `stop` is written (false).
fn wait_for_front_end(listener: &Listener, stop: Option<&EventFd>) -> Result<bool, Error> {
    let Some(stop) = stop else { return Ok(true) };
    let ready = wait_readable(&[listener.as_raw_fd(), stop.as_raw_fd()], -1)?;
    Ok(!ready[1])
}

/// How long a front end that connects while the backend is full waits for a connection to
/// end before it is refused.
const REFUSAL_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Which of `fds` are readable, waiting up to `timeout_ms` (-1: until one is).
fn wait_readable(fds: &[std::os::fd::RawFd], timeout_ms: i32) -> Result<Vec<bool>, Error> {
    let mut polled: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: polls descriptors the caller borrows, through a local array of their count.
        let ready = unsafe {
            libc::poll(
                polled.as_mut_ptr(),
                polled.len() as libc::nfds_t,
                timeout_ms,
            )
        };
        if ready >= 0 {
            return Ok(polled.iter().map(|p| p.revents != 0).collect());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(Error::Io(e));
        }
    }
}

/// How many guest connections the backend serves at once, and the refusal of the ones past
/// that. Every connection of a backend sends from one GID, and a peer that shares a GID can
/// inject packets into another's RC connections (it sends from the address they accept); so
/// unless the operator declares the guests one trust domain (`--shared-gid`), a backend
/// serves one guest at a time. Either way at most `--max-guests` at once (by default
/// `--guests`: the quotas are the backend's totals divided among that many, so the totals
/// hold only if no more connect).
struct Admission {
    limit: usize,
    /// Why no more are served, for the refusal's log line.
    reason: String,
    live: AtomicUsize,
    /// Written when a connection ends: a room may be free.
    freed: EventFd,
}

impl Admission {
    fn new(config: &Config) -> Result<Admission, Error> {
        let (limit, reason) = if config.shared_gid {
            (
                config.max_guests as usize,
                format!("{} guests are connected (--max-guests)", config.max_guests),
            )
        } else {
            (
                1,
                "a guest is connected and guests do not share the backend's GID unless it runs with --shared-gid".to_string(),
            )
        };
        Ok(Admission {
            limit,
            reason,
            live: AtomicUsize::new(0),
            freed: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    /// Returns once a connection may be accepted. A front end that connects while the
    /// backend is full is refused (accepted and closed at once, with a log line) unless a
    /// connection ends within [`REFUSAL_GRACE`]: one that just disconnected may still be
    /// releasing its objects (a program often opens the device again right after a short
    /// first connection).
    /// False, at once, when `stop` is written.
    fn wait_for_room(&self, listener: &Listener, stop: Option<&EventFd>) -> Result<bool, Error> {
        let mut watched = vec![listener.as_raw_fd(), self.freed.as_raw_fd()];
        watched.extend(stop.map(|stop| stop.as_raw_fd()));
        while self.live.load(Ordering::Acquire) >= self.limit {
            let ready = wait_readable(&watched, -1)?;
            if ready.get(2) == Some(&true) {
                return Ok(false);
            }
            if !ready[0] {
                let _ = self.freed.read();
                continue;
            }
            let grace = REFUSAL_GRACE.as_millis() as i32;
            if wait_readable(&[self.freed.as_raw_fd()], grace)?[0] {
                let _ = self.freed.read();
                continue;
            }
            if let Ok(Some(refused)) = listener.accept() {
                drop(refused);
                log::warn!("a front end connected and was refused: {}", self.reason);
            }
        }
        Ok(true)
    }

    fn connected(&self) {
        self.live.fetch_add(1, Ordering::AcqRel);
    }

    /// Returns once every connection has ended and released what it held.
    fn wait_until_empty(&self) -> Result<(), Error> {
        while self.live.load(Ordering::Acquire) > 0 {
            wait_readable(&[self.freed.as_raw_fd()], 1000)?;
            let _ = self.freed.read();
        }
        Ok(())
    }

    fn disconnected(&self) {
        self.live.fetch_sub(1, Ordering::AcqRel);
        let _ = self.freed.write(1);
    }
}

/// Closes the connection (`handle`) unless its front end has spoken after `timeout`: a
/// connection that says nothing would hold the guest's room (a backend that serves one
/// guest at a time keeps the guest's own front end out meanwhile).
fn close_if_silent(
    connection: u64,
    backend: &RwLock<RdmaBackend>,
    timeout: std::time::Duration,
    handle: vhost_user_backend::ShutdownHandle,
) {
    let greeted = Arc::clone(&backend.read().unwrap_or_else(|e| e.into_inner()).greeted);
    let watch = move || {
        if !greeted.wait(timeout) {
            log::warn!(
                "connection {connection}: the front end said nothing for {timeout:?} (no GET_FEATURES): closed"
            );
            handle.shutdown();
        }
    };
    if let Err(e) = std::thread::Builder::new()
        .name(format!("vrdma-hello{connection}"))
        .spawn(watch)
    {
        log::warn!("connection {connection}: no handshake timeout ({e})");
    }
}

/// Accepts one front end and serves it with `backend` until it disconnects, in threads of its
/// own; returns once the connection is running.
fn start_connection(
    (connection, name): (u64, &str),
    backend: Arc<RwLock<RdmaBackend>>,
    (listener, handshake_timeout): (&mut Listener, std::time::Duration),
    (admission, registry, rate_debt): (Arc<Admission>, Arc<Registry>, Arc<RateDebt>),
) -> Result<(), Error> {
    // The guest's sends start with what its last connection owed their rate limits.
    backend
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .device
        .data_path()
        .take_rate_debt(&rate_debt);
    // The thread that tears the connection down exists before the connection is accepted, so
    // an accepted connection always has one.
    let (daemon_tx, daemon_rx) = std::sync::mpsc::channel::<VhostUserDaemon<_>>();
    let serving = Arc::clone(&backend);
    let room = Arc::clone(&admission);
    let reported = Arc::clone(&registry);
    std::thread::Builder::new()
        .name(format!("vrdma-conn{connection}-wait"))
        .spawn(move || {
            let Ok(mut daemon) = daemon_rx.recv() else {
                return; // the connection never started
            };
            match daemon.wait() {
                Ok(())
                | Err(vhost_user_backend::Error::HandleRequest(
                    vhost::vhost_user::Error::Disconnected
                    | vhost::vhost_user::Error::PartialMessage,
                )) => {}
                Err(e) => log::warn!("connection {connection} ended with an error: {e}"),
            }
            // Before the last reference goes: no report holds the device after this.
            reported.remove(connection);
            let state = serving.read().unwrap_or_else(|e| e.into_inner());
            let objects = state.device.object_count();
            let stats = state.device.data_path().stats();
            let refusals = state.device.refusals().summary();
            state.device.data_path().leave_rate_debt(&rate_debt);
            state.stop_workers();
            drop(state);
            drop(daemon);
            drop(serving); // the last reference: the device and its host objects go
            log::info!(
                "connection {connection}: closed, {objects} objects released; {} WQEs, {} completions, {} kicks, {} storms of kicks without work, {} WQEs refused",
                stats.wqes,
                stats.completions,
                stats.kicks,
                stats.storms,
                stats.refused
            );
            if let Some(refusals) = refusals {
                log::info!("connection {connection}: failed control requests: {refusals}");
            }
            room.disconnected();
        })
        .map_err(Error::Io)?;
    let accepted = backend
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .mem
        .clone();
    let mut daemon = crate::vring::over_accepted_memory(&accepted, || {
        VhostUserDaemon::new(
            format!("vrdma-conn{connection}"),
            Arc::clone(&backend),
            GuestMemoryAtomic::new(GuestMemoryMmap::new()),
        )
    })
    .map_err(Error::Daemon)?;
    daemon.start(listener).map_err(Error::Daemon)?;
    // Counted before the next accept looks at the count.
    admission.connected();
    let disconnect = daemon.shutdown_handle();
    if let Some(handle) = daemon.shutdown_handle() {
        close_if_silent(connection, &backend, handshake_timeout, handle);
    }
    if let Some(handle) = daemon.shutdown_handle() {
        // A fault in the guest's memory ends this connection (and only this one).
        backend
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .device
            .fault_domain()
            .serve(
                format!("connection {connection} (guest {name})"),
                Box::new(move || handle.shutdown()),
            );
    }
    registry.add(
        connection,
        name,
        backend,
        Box::new(move || {
            if let Some(handle) = &disconnect {
                handle.shutdown();
            }
        }),
    );
    log::info!("connection {connection}: front end attached (guest {name})");
    daemon_tx
        .send(daemon)
        .expect("the wait thread holds the receiver until it gets the daemon");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    /// Finding: the backend (and `vrdmactl add`) replaced whatever file sat at a guest's
    /// socket path. Now only a socket no process serves is replaced.
    #[test]
    fn only_a_socket_no_one_serves_is_replaced() {
        let path = std::env::temp_dir().join(format!("vrdma-path-{}.sock", std::process::id()));
        std::fs::write(&path, "an operator's file").unwrap();
        let refused = listen(&path, None).err().expect("a plain file is refused");
        assert!(
            refused.to_string().contains("other than a socket"),
            "{refused}"
        );
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "an operator's file"
        );
        std::fs::remove_file(&path).unwrap();

        let served = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let refused = listen(&path, None)
            .err()
            .expect("a served socket is refused");
        assert!(refused.to_string().contains("serves"), "{refused}");
        drop(served); // the file stays, served by no one
        let listener = listen(&path, None).unwrap();
        drop(listener);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_socket_group_gets_the_guests_socket_with_mode_0660() {
        let own_group = nix::unistd::Group::from_gid(nix::unistd::getegid())
            .unwrap()
            .expect("the process's group has a name");
        let group: crate::sandbox::SocketGroup = own_group.name.parse().unwrap();
        let socket = std::env::temp_dir().join(format!("vrdma-group-{}.sock", std::process::id()));
        let listener = listen(&socket, Some(&group)).unwrap();
        let meta = std::fs::metadata(&socket).unwrap();
        assert_eq!(meta.gid(), group.gid.as_raw());
        assert_eq!(meta.permissions().mode() & 0o777, 0o660);
        drop(listener);
        let _ = std::fs::remove_file(&socket);
    }
}
