//! Direct attach: this process is the vhost-user front end of a vrdma backend, as a VMM would
//! be. Its shared memory (memfd regions) is the guest memory the backend maps.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags,
    VhostUserHeaderFlag, VhostUserProtocolFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::EventFd;
use vrdma_spec::config::{features, DeviceConfig, FIRST_NOTIFY_QUEUE, MAX_NOTIFY_QUEUES};
use vrdma_spec::ring::Event;

use crate::shm::{Region, RegionSet, SharedBuffer};
use crate::transport::{MemoryRegions, Transport, WANTED_FEATURES};
use crate::virtq::{DeviceQueues, EventFdSignal, SplitQueue, QUEUE_SIZE};
use crate::{Error, Result};

/// VHOST_USER_F_PROTOCOL_FEATURES.
const PROTOCOL_FEATURES: u64 = 1 << 30;

/// The vhost-user protocol features direct attach needs (SPEC.md §11).
const NEEDED_PROTOCOL_FEATURES: VhostUserProtocolFeatures = VhostUserProtocolFeatures::CONFIG
    .union(VhostUserProtocolFeatures::MQ)
    .union(VhostUserProtocolFeatures::REPLY_ACK)
    .union(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS);
/// And those it uses where offered: the device state, to replace its connection (§11.1).
const ACCEPTED_PROTOCOL_FEATURES: VhostUserProtocolFeatures =
    NEEDED_PROTOCOL_FEATURES.union(VhostUserProtocolFeatures::DEVICE_STATE);

/// Default shared memory added at a time, unless a single allocation needs more.
const REGION_SIZE: u64 = 32 << 20;

/// Options of a direct attachment.
#[derive(Clone, Copy, Debug)]
pub struct DirectOptions {
    /// Back shared memory with 2 MiB huge pages.
    pub huge_pages: bool,
    /// Shared memory created at attach time, and added at a time when more is needed.
    pub region_size: u64,
}

impl Default for DirectOptions {
    fn default() -> Self {
        DirectOptions {
            huge_pages: false,
            region_size: REGION_SIZE,
        }
    }
}

pub struct DirectTransport {
    frontend: Mutex<Frontend>,
    socket: PathBuf,
    /// Memory regions in the backend's table now, and how many it takes: it ends the
    /// connection at a region past its limit, so none is sent past it.
    regions: Mutex<MemoryRegions>,
    /// The regions in the backend's table, to give a new connection the same table.
    table: Mutex<Vec<Weak<Region>>>,
    /// Each queue's kick eventfd, by queue index (owned by the queues' signals).
    kick_fds: Vec<std::os::fd::RawFd>,
    /// Each queue's ring and its kick and call eventfds (the signals' own, duplicated), to
    /// set the queues up again on a new connection.
    vrings: Mutex<Vec<(VringConfigData, EventFd, EventFd)>>,
    memory: RegionSet,
    queues: DeviceQueues,
    config: DeviceConfig,
    features: u64,
    options: DirectOptions,
}

fn region_info(region: &Region) -> VhostUserMemoryRegionInfo {
    // Guest-physical addresses are this process's addresses of the shared memory.
    VhostUserMemoryRegionInfo {
        guest_phys_addr: region.addr(),
        memory_size: region.size(),
        userspace_addr: region.addr(),
        mmap_offset: 0,
        mmap_handle: region
            .file()
            .expect("direct attach only makes memfd regions")
            .as_raw_fd(),
    }
}

/// Saves the device state into a pipe (direction save) or loads `state` from one (load), and
/// asks whether the device took it: what a migrating hypervisor does with
/// `SET_DEVICE_STATE_FD` and `CHECK_DEVICE_STATE`. Returns what was saved.
fn transfer_state(
    frontend: &Frontend,
    direction: VhostTransferStateDirection,
    state: &[u8],
) -> Result<Vec<u8>> {
    let failed = |source| Error::VhostUser {
        what: "handing the device state over",
        source,
    };
    let (mut read, mut write) = std::io::pipe().map_err(Error::Transport)?;
    let mut saved = Vec::new();
    if direction == VhostTransferStateDirection::SAVE {
        frontend
            .set_device_state_fd(direction, VhostTransferStatePhase::STOPPED, write.into())
            .map_err(failed)?;
        read.read_to_end(&mut saved).map_err(Error::Transport)?;
    } else {
        frontend
            .set_device_state_fd(direction, VhostTransferStatePhase::STOPPED, read.into())
            .map_err(failed)?;
        write.write_all(state).map_err(Error::Transport)?;
        drop(write);
    }
    frontend.check_device_state().map_err(failed)?;
    Ok(saved)
}

impl DirectTransport {
    /// Starts the device on `frontend`'s connection with this transport's features, memory
    /// table and queues, each queue at its `bases` entry.
    fn start_queues(
        &self,
        frontend: &mut Frontend,
        vrings: &[(VringConfigData, EventFd, EventFd)],
        bases: &[u32],
    ) -> Result<()> {
        let vhost = |source| Error::VhostUser {
            what: "starting the device on the new connection",
            source,
        };
        frontend
            .set_features(self.features | PROTOCOL_FEATURES)
            .map_err(vhost)?;
        let table: Vec<_> = self
            .lock_table()
            .iter()
            .filter_map(Weak::upgrade)
            .map(|region| region_info(&region))
            .collect();
        frontend.set_mem_table(&table).map_err(vhost)?;
        for (index, ((ring, kick, call), &base)) in vrings.iter().zip(bases).enumerate() {
            frontend.set_vring_call(index, call).map_err(vhost)?;
            frontend.set_vring_kick(index, kick).map_err(vhost)?;
            frontend
                .set_vring_num(index, ring.queue_size)
                .map_err(vhost)?;
            frontend.set_vring_addr(index, ring).map_err(vhost)?;
            frontend.set_vring_base(index, base as u16).map_err(vhost)?;
            frontend.set_vring_enable(index, true).map_err(vhost)?;
        }
        Ok(())
    }

    /// Adds `region` to the backend's memory table; refused, with nothing sent, when the
    /// table holds as many regions as the backend takes.
    fn announce(&self, region: Region) -> Result<Arc<Region>> {
        let mut regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        if regions.in_use >= regions.limit {
            return Err(Error::OverLimit(format!(
                "the vrdma backend takes at most {} memory regions from one connection, and all are in use",
                regions.limit
            )));
        }
        self.frontend
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add_mem_region(&region_info(&region))
            .map_err(|source| Error::VhostUser {
                what: "adding shared memory",
                source,
            })?;
        regions.in_use += 1;
        let region = Arc::new(region);
        self.lock_table().push(Arc::downgrade(&region));
        Ok(region)
    }

    fn lock_table(&self) -> std::sync::MutexGuard<'_, Vec<Weak<Region>>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Attaches to the backend listening on `socket`.
    pub fn connect(socket: &Path, options: DirectOptions) -> Result<DirectTransport> {
        let max_queues = u64::from(FIRST_NOTIFY_QUEUE) + u64::from(MAX_NOTIFY_QUEUES);
        let mut frontend =
            Frontend::connect(socket, max_queues).map_err(|source| Error::VhostUser {
                what: "connecting to the backend",
                source,
            })?;
        let vhost = |source| Error::VhostUser {
            what: "setting the device up",
            source,
        };
        // A backend that serves no more guests accepts the connection and closes it at once:
        // the first message or the first reply finds the socket closed.
        let refused = |e: vhost::Error| {
            use vhost::vhost_user::Error as Protocol;
            match e {
                vhost::Error::VhostUserProtocol(
                    Protocol::Disconnected
                    | Protocol::PartialMessage
                    | Protocol::SocketBroken(_)
                    | Protocol::SocketError(_),
                ) => Error::Refused,
                e => vhost(e),
            }
        };
        frontend.set_owner().map_err(refused)?;
        let offered = frontend.get_features().map_err(refused)?;
        for (bit, name) in [
            (features::VERSION_1, "VIRTIO_F_VERSION_1"),
            (PROTOCOL_FEATURES, "protocol features"),
        ] {
            if offered & bit == 0 {
                return Err(Error::Incompatible(format!(
                    "the backend does not offer {name}"
                )));
            }
        }
        let needed = NEEDED_PROTOCOL_FEATURES;
        let protocol = frontend.get_protocol_features().map_err(refused)?;
        if !protocol.contains(needed) {
            return Err(Error::Incompatible(format!(
                "the backend lacks protocol features {:?}",
                needed - protocol
            )));
        }
        frontend
            .set_protocol_features(protocol & ACCEPTED_PROTOCOL_FEATURES)
            .map_err(refused)?;
        frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);

        let size = std::mem::size_of::<DeviceConfig>() as u32;
        let (_, bytes) = frontend
            .get_config(
                0,
                size,
                VhostUserConfigFlags::empty(),
                &vec![0; size as usize],
            )
            .map_err(refused)?;
        let config: DeviceConfig = match vrdma_spec::read_wire(&bytes) {
            Some(config) if bytes.len() == size as usize => config,
            _ => {
                return Err(Error::Incompatible(format!(
                    "config space of {} bytes, expected {size}",
                    bytes.len()
                )))
            }
        };
        let notify_queues = config.num_notify_queues.to_native();
        if !(1..=MAX_NOTIFY_QUEUES).contains(&notify_queues) {
            return Err(Error::Incompatible(format!(
                "the device reports {notify_queues} notification queues"
            )));
        }
        let num_queues = usize::from(FIRST_NOTIFY_QUEUE) + notify_queues as usize;
        let queue_num = frontend.get_queue_num().map_err(refused)?;
        if queue_num < num_queues as u64 {
            return Err(Error::Incompatible(format!(
                "the backend has {queue_num} queues, the device needs {num_queues}"
            )));
        }
        let features = offered & (WANTED_FEATURES | PROTOCOL_FEATURES);
        // A backend past its limit of guests accepts a front end as a successor, which may
        // take a device over (SPEC.md §11.1), and refuses it when it starts one of its own:
        // here.
        frontend.set_features(features).map_err(refused)?;
        // The backend's own bound on regions, where it states one, within vhost-user's.
        let slots = frontend.get_max_mem_slots().map_err(vhost)?;
        let slots = usize::try_from(slots).unwrap_or(usize::MAX);
        let region_limit = match config.max_memory_regions.to_native() {
            0 => slots,
            stated => slots.min(stated as usize),
        };
        if region_limit < 1 {
            return Err(Error::Incompatible(
                "the backend takes no memory region at all".into(),
            ));
        }

        let region = Region::new(options.region_size, options.huge_pages)?;
        frontend
            .set_mem_table(&[region_info(&region)])
            .map_err(vhost)?;
        let table = vec![Arc::downgrade(&region)];
        let memory = RegionSet::default();
        memory.add(region);
        let mut queues = Vec::with_capacity(num_queues);
        let mut kick_fds = Vec::with_capacity(num_queues);
        let mut vrings = Vec::with_capacity(num_queues);
        for index in 0..num_queues {
            let signal = EventFdSignal::new()?;
            kick_fds.push(signal.kick.as_raw_fd());
            let fds = (
                signal.kick.try_clone().map_err(Error::Transport)?,
                signal.call.try_clone().map_err(Error::Transport)?,
            );
            frontend
                .set_vring_call(index, &signal.call)
                .map_err(vhost)?;
            frontend
                .set_vring_kick(index, &signal.kick)
                .map_err(vhost)?;
            let queue = SplitQueue::new(&memory, QUEUE_SIZE, Box::new(signal))?;
            let ring = VringConfigData {
                queue_max_size: QUEUE_SIZE,
                queue_size: QUEUE_SIZE,
                flags: 0,
                desc_table_addr: queue.desc_addr(),
                used_ring_addr: queue.used_addr(),
                avail_ring_addr: queue.avail_addr(),
                log_addr: None,
            };
            frontend.set_vring_num(index, QUEUE_SIZE).map_err(vhost)?;
            frontend.set_vring_addr(index, &ring).map_err(vhost)?;
            frontend.set_vring_base(index, 0).map_err(vhost)?;
            frontend.set_vring_enable(index, true).map_err(vhost)?;
            queues.push(queue);
            vrings.push((ring, fds.0, fds.1));
        }
        Ok(DirectTransport {
            frontend: Mutex::new(frontend),
            socket: socket.to_owned(),
            table: Mutex::new(table),
            vrings: Mutex::new(vrings),
            // The memory table set above.
            regions: Mutex::new(MemoryRegions {
                in_use: 1,
                limit: region_limit,
            }),
            kick_fds,
            queues: DeviceQueues::new(&memory, queues)?,
            memory,
            config,
            features: features & !PROTOCOL_FEATURES,
            options,
        })
    }
}

impl Transport for DirectTransport {
    fn config(&self) -> &DeviceConfig {
        &self.config
    }

    fn features(&self) -> u64 {
        self.features
    }

    fn control(&self, request: &[u8], response: &mut [u8]) -> Result<usize> {
        self.queues
            .control(request, response, &|| self.disconnected())
    }

    fn publish_bogus_control_entries(&self, ahead: u16) -> Result<()> {
        self.queues.publish_bogus_control_entries(ahead)
    }

    fn renew_kick_descriptors(&self) -> Result<()> {
        let frontend = self.frontend.lock().unwrap_or_else(|e| e.into_inner());
        for (index, &kick) in self.kick_fds.iter().enumerate() {
            let renewed = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK)
                .map_err(Error::Transport)?;
            frontend
                .set_vring_kick(index, &renewed)
                .map_err(|source| Error::VhostUser {
                    what: "renewing a kick descriptor",
                    source,
                })?;
            // SAFETY: makes the queue's own kick descriptor number refer to the renewed
            // eventfd (closing the old one): the queue's signal keeps using its number, now
            // for the descriptor the device was given.
            if unsafe { libc::dup2(renewed.as_raw_fd(), kick) } < 0 {
                return Err(Error::Transport(std::io::Error::last_os_error()));
            }
            if let Some(vring) = self
                .vrings
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_mut(index)
            {
                vring.1 = renewed;
            }
        }
        Ok(())
    }

    fn replace_front_end(&self) -> Result<()> {
        // No region comes or goes meanwhile: the new connection gets the table as it is.
        // (Taken before the front end, as `announce` and `forget` take them.)
        let _regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        let mut frontend = self.frontend.lock().unwrap_or_else(|e| e.into_inner());
        let vrings = self.vrings.lock().unwrap_or_else(|e| e.into_inner());
        let vhost = |what| move |source| Error::VhostUser { what, source };
        let mut bases = Vec::with_capacity(vrings.len());
        for index in 0..vrings.len() {
            let base = frontend
                .get_vring_base(index)
                .map_err(vhost("stopping the queues"))?;
            bases.push(base);
        }
        let moved =
            transfer_state(&frontend, VhostTransferStateDirection::SAVE, &[]).and_then(|state| {
                let mut successor = Frontend::connect(&self.socket, vrings.len() as u64)
                    .map_err(vhost("connecting to the backend again"))?;
                successor
                    .set_owner()
                    .map_err(vhost("greeting the backend"))?;
                successor
                    .get_features()
                    .map_err(vhost("greeting the backend"))?;
                let protocol = successor
                    .get_protocol_features()
                    .map_err(vhost("greeting the backend"))?;
                successor
                    .set_protocol_features(protocol & ACCEPTED_PROTOCOL_FEATURES)
                    .map_err(vhost("greeting the backend"))?;
                successor.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
                transfer_state(&successor, VhostTransferStateDirection::LOAD, &state)?;
                Ok(successor)
            });
        let next = match moved {
            Ok(successor) => successor,
            Err(e) => {
                // The old connection runs the device again, as a hypervisor whose
                // migration failed does; the error says why it did not move.
                let _ = self.start_queues(&mut frontend, &vrings, &bases);
                return Err(e);
            }
        };
        *frontend = next;
        self.start_queues(&mut frontend, &vrings, &bases)
    }

    fn notify(&self, queue: u32) -> Result<()> {
        self.queues.notify(queue)
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<Event>> {
        self.queues.next_event(timeout)
    }

    fn alloc(&self, len: u64, align: u64) -> Result<SharedBuffer> {
        self.memory
            .alloc_or_grow(len, align, self.options.region_size, |size| {
                self.announce(Region::create_with(size, self.options.huge_pages)?)
            })
    }

    unsafe fn share(&self, addr: u64, len: u64) -> Result<()> {
        // SAFETY: the caller's contract is Region::share_in_place's.
        unsafe {
            self.memory.share(addr, len, |start, len| {
                self.announce(Region::share_in_place(start, len)?)
            })
        }
    }

    fn device_pages(&self, addr: u64, len: u64) -> Option<(u64, Vec<u64>)> {
        self.memory.device_pages(addr, len)
    }

    fn adopt(&self, region: Region) -> Result<Arc<Region>> {
        // Mapped here, so addressed by the device where this process maps it, as the
        // transport's own regions are.
        self.announce(region)
    }

    fn forget(&self, region: &Region) -> Result<()> {
        let mut regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        self.frontend
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove_mem_region(&region_info(region))
            .map_err(|source| Error::VhostUser {
                what: "removing shared memory",
                source,
            })?;
        regions.in_use = regions.in_use.saturating_sub(1);
        self.lock_table().retain(|kept| {
            kept.upgrade()
                .is_some_and(|kept| kept.addr() != region.addr())
        });
        Ok(())
    }

    fn lift_memory_region_limit(&self) -> Result<()> {
        self.regions.lock().unwrap_or_else(|e| e.into_inner()).limit = usize::MAX;
        Ok(())
    }

    fn memory_regions(&self) -> Option<MemoryRegions> {
        Some(*self.regions.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn disconnected(&self) -> bool {
        // A poll loop looks here too: it must not wait while another thread talks to the
        // backend (a closed socket then shows in that thread's answer).
        let frontend = match self.frontend.try_lock() {
            Ok(frontend) => frontend,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        // SAFETY: the descriptor is the frontend's socket, which the lock keeps open for
        // the look.
        let socket = unsafe { std::os::fd::BorrowedFd::borrow_raw(frontend.as_raw_fd()) };
        crate::poll::hung_up(&socket)
    }
}
