//! The vhost-user face of the device: virtqueue plumbing around [`Device`], and a server that
//! gives every front-end connection a device (and host context) of its own.

mod handover;
mod server;

pub use server::*;

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserProtocolFeatures,
};
pub use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserBackendMut, VhostUserDaemon, VringT};
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
    /// The socket's saved device states and this connection's own reference, to hand its
    /// device to a successor or take one (SPEC.md §11.1); set when the connection starts.
    handover: Option<(Arc<handover::Handovers>, Weak<RwLock<RdmaBackend>>)>,
    /// The token of this connection's saved device state, until its front end starts the
    /// device again or a successor takes it.
    saved: Option<handover::Token>,
    /// This connection's device went to a successor; it holds a fresh one, never used.
    handed_over: bool,
    /// A device state being loaded: the front end writes it here until CHECK_DEVICE_STATE.
    loading: Mutex<Option<std::fs::File>>,
    /// The connection whose device this one takes at its next request (checked and marked
    /// handed over by CHECK_DEVICE_STATE, which may not change this connection).
    adopting: Mutex<Option<Arc<RwLock<RdmaBackend>>>>,
    /// Whether the device may start: a connection accepted past the socket's limit is a
    /// successor, which may only take a device over unless a connection ends first (then
    /// this turns true); why it is refused otherwise.
    admitted: (Arc<AtomicBool>, String),
    /// How the connection is named in logs, and the handle that ends it (set when it
    /// starts): a fault in the memory of a device it takes over ends it.
    end: Option<(String, ShutdownHandle)>,
    /// What the guest's sends owe their rate limits, for a successor to take once it is
    /// admitted to start a device of its own: by then the connection before it has left it.
    owed: Option<Arc<RateDebt>>,
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
        #[expect(
            clippy::cast_possible_truncation,
            reason = "used is 0 or the size of one event"
        )]
        let used = used as u32;
        self.vring.add_used(head, used).is_ok() && self.vring.signal_used_queue().is_ok()
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
            handover: None,
            saved: None,
            handed_over: false,
            loading: Mutex::default(),
            adopting: Mutex::default(),
            admitted: (Arc::new(AtomicBool::new(true)), String::new()),
            end: None,
            owed: None,
        })
    }

    /// The connection's name in log lines.
    fn name(&self) -> &str {
        self.end.as_ref().map_or("a connection", |(name, _)| name)
    }

    /// Whether the device state is on its way to another connection, or from one.
    fn migrating(&self) -> bool {
        self.saved.is_some()
            || self.handed_over
            || self
                .adopting
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some()
    }

    /// Takes the device CHECK_DEVICE_STATE found for this connection, if any: the
    /// connection it came from keeps this connection's own fresh device, and a fault in
    /// either's guest memory ends the connection that now holds it.
    fn settle_handover(&mut self) {
        let adopting = self
            .adopting
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some(from) = adopting else { return };
        let mut from = from.write().unwrap_or_else(|e| e.into_inner());
        std::mem::swap(&mut self.device, &mut from.device);
        self.admitted.0.store(true, Ordering::Release);
        self.owed = None; // the device's own sends owe what they owe
        for backend in [&*self, &*from] {
            if let Some((name, handle)) = &backend.end {
                let handle = handle.clone();
                backend
                    .device
                    .fault_domain()
                    .serve(name.clone(), Box::new(move || handle.shutdown()));
            }
        }
        log::info!(
            "{}: took over the guest's device from {} ({} objects)",
            self.name(),
            from.name(),
            self.device.object_count()
        );
    }

    /// Whether this connection may start a device: at once, unless it is a successor that
    /// took no device, which waits up to [`REFUSAL_GRACE`] for a connection to end (one that
    /// just closed may still be releasing its objects: a program often opens the device again
    /// right after a short first connection).
    fn wait_for_admission(&self) -> bool {
        let deadline = std::time::Instant::now() + REFUSAL_GRACE;
        while !self.admitted.0.load(Ordering::Acquire) {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        true
    }

    /// Ends a successor that starts a device of its own while the socket serves as many
    /// connections as it may (SPEC.md §11.1): it is refused, as a front end past the limit
    /// always was, only later.
    fn refuse_successor(&self) {
        log::warn!("a front end connected and was refused: {}", self.admitted.1);
        if let Some((_, handle)) = &self.end {
            handle.shutdown();
        }
    }

    /// CHECK_DEVICE_STATE after a load: the device the state names becomes this
    /// connection's at its next request ([`RdmaBackend::settle_handover`]).
    fn take_loaded_device(&self) -> io::Result<()> {
        let loading = self
            .loading
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some(file) = loading else {
            return Ok(()); // a save: the state was written whole
        };
        let Some((handovers, this)) = &self.handover else {
            return Err(io::Error::other("the connection is not served yet"));
        };
        let from = handovers.take(file)?;
        if std::ptr::eq(Arc::as_ptr(&from), this.as_ptr()) {
            return Err(io::Error::other("a connection cannot take its own device"));
        }
        {
            // Never this connection's own lock (above), and a connection that saved a state
            // never loads one, so no two connections wait for each other here.
            let mut from = from.write().unwrap_or_else(|e| e.into_inner());
            if from.saved.take().is_none() {
                return Err(io::Error::other(
                    "the device state loaded names a device its front end runs again",
                ));
            }
            from.handed_over = true;
        }
        *self.adopting.lock().unwrap_or_else(|e| e.into_inner()) = Some(from);
        Ok(())
    }

    /// Whether the front end runs the device's control queue now.
    fn running(&self) -> bool {
        self.control_queue
            .as_ref()
            .is_some_and(|queue| queue.get_ref().get_queue().ready())
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
                #[expect(
                    clippy::cast_possible_truncation,
                    reason = "the region is mapped in this process: its length is a usize"
                )]
                let len = region.len() as usize;
                let watched = self
                    .device
                    .fault_domain()
                    .watch(host_address, len, page_size)
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
/// most `MAX_REQUEST_BYTES`) and the room in its writable part go to `respond`, whose answer
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
    u32::try_from(response.len()).map_err(io::Error::other)
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
        // Every start of the device sends SET_FEATURES: a successor's start, or the old
        // front end's own after a migration that failed.
        self.settle_handover();
        if let (Some(token), Some((handovers, _))) = (self.saved.take(), &self.handover) {
            handovers.withdraw(&token);
            log::info!(
                "{}: its front end starts the device it saved: the saved state is withdrawn",
                self.name()
            );
        }
        if !self.wait_for_admission() {
            self.refuse_successor();
            return;
        }
        if let Some(owed) = self.owed.take() {
            self.device.data_path().take_rate_debt(&owed);
        }
        self.device.set_acked_features(features);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::RESET_DEVICE
            | VhostUserProtocolFeatures::DEVICE_STATE
    }

    fn reset_device(&mut self) {
        self.settle_handover();
        self.device.reset();
        self.control_broken = false;
    }

    /// QEMU's generic vhost-user device sends neither RESET_DEVICE nor SET_STATUS when the
    /// driver resets it; it stops the rings, as it does when the VM is paused. A driver that
    /// says when it resets keeps its objects across a stop; for any other, a stopped control
    /// queue means the driver is gone, and its objects go too (Device::queues_stopped).
    fn stop_vring(&mut self, queue_index: u32) -> io::Result<()> {
        self.settle_handover();
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
        self.settle_handover();
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

    /// A front end replacing itself under a running guest (SPEC.md §11.1): save, on the
    /// stopped connection, writes a token naming its device; load, on a new connection that
    /// has not started a device, reads one (at CHECK_DEVICE_STATE, once the front end has
    /// written it) and takes that device.
    fn set_device_state_fd(
        &mut self,
        direction: VhostTransferStateDirection,
        phase: VhostTransferStatePhase,
        file: std::fs::File,
    ) -> io::Result<Option<std::fs::File>> {
        self.settle_handover();
        let refused = |why: &str| Err(io::Error::other(format!("device state refused: {why}")));
        if phase != VhostTransferStatePhase::STOPPED {
            return refused("only a stopped device's state is transferred");
        }
        let Some((handovers, this)) = self.handover.clone() else {
            return refused("the connection is not served yet");
        };
        match direction {
            VhostTransferStateDirection::SAVE => {
                if self.running() {
                    return refused("the device's queues run (stop them first: GET_VRING_BASE)");
                }
                if self.handed_over || self.migrating() && self.saved.is_none() {
                    return refused("this connection's device is handed over, or it takes one");
                }
                if let Some(earlier) = self.saved.take() {
                    handovers.withdraw(&earlier);
                }
                self.saved = Some(handovers.save(this, file)?);
                log::info!(
                    "{}: device state saved for a successor ({} objects)",
                    self.name(),
                    self.device.object_count()
                );
            }
            VhostTransferStateDirection::LOAD => {
                let started = self.control_queue.is_some()
                    || self.device.object_count() > 0
                    || !self.accepted_regions.is_empty();
                if started || self.migrating() {
                    return refused(
                        "a device is taken over only by a connection that has not started one, nor saved or taken one (load before SET_MEM_TABLE and the queues)",
                    );
                }
                *self.loading.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(file);
            }
        }
        Ok(None)
    }

    fn check_device_state(&self) -> io::Result<()> {
        self.take_loaded_device()
            .inspect_err(|e| log::warn!("{}: {e}", self.name()))
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
        self.settle_handover();
        if !self.admitted.0.load(Ordering::Acquire) {
            return Ok(()); // a successor's queues run only once it has a device
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

#[cfg(test)]
mod tests;
