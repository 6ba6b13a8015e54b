//! Direct attach: this process is the vhost-user front end of a vrdma backend, as a VMM would
//! be. Its shared memory (memfd regions) is the guest memory the backend maps.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserProtocolFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vrdma_spec::config::{features, DeviceConfig, FIRST_NOTIFY_QUEUE, MAX_NOTIFY_QUEUES};
use vrdma_spec::ring::Event;
use vrdma_spec::ByteValued;

use crate::shm::{Region, SharedBuffer};
use crate::transport::Transport;
use crate::virtq::{ChainBuffer, SplitQueue};
use crate::{Error, Result};

/// VHOST_USER_F_PROTOCOL_FEATURES.
const PROTOCOL_FEATURES: u64 = 1 << 30;
/// Device features guest-lib knows how to use.
const WANTED_FEATURES: u64 = features::VERSION_1
    | features::RC
    | features::UD
    | features::SRQ
    | features::ATOMIC
    | features::INDIRECT_PAGE_LIST
    | PROTOCOL_FEATURES;
const QUEUE_SIZE: u16 = 16;
/// Size of one event (SPEC.md §8.4).
const EVENT_SIZE: u64 = std::mem::size_of::<Event>() as u64;
/// Control requests and responses are at most this long.
const CONTROL_BUFFER: u64 = 4096;
/// Default shared memory added at a time, unless a single allocation needs more.
const REGION_SIZE: u64 = 32 << 20;
/// How long a control request may take before the device is considered gone. Generous: the
/// tests run under full emulation.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(60);

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

struct Control {
    queue: SplitQueue,
    request: SharedBuffer,
    response: SharedBuffer,
}

struct Events {
    queue: SplitQueue,
    buffers: SharedBuffer,
}

pub struct DirectTransport {
    frontend: Mutex<Frontend>,
    regions: Mutex<Vec<Arc<Region>>>,
    control: Mutex<Control>,
    events: Mutex<Events>,
    /// Notification queues: only ever kicked.
    notify: Vec<SplitQueue>,
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
        mmap_handle: region.file().as_raw_fd(),
    }
}

impl DirectTransport {
    /// Attaches to the backend listening on `socket`.
    pub fn connect(socket: &Path, options: DirectOptions) -> Result<DirectTransport> {
        let max_queues = u64::from(FIRST_NOTIFY_QUEUE) + u64::from(MAX_NOTIFY_QUEUES);
        let mut frontend =
            Frontend::connect(socket, max_queues).map_err(|e| Error::Attach(e.to_string()))?;
        let vhost = |e: vhost::Error| Error::Attach(e.to_string());
        frontend.set_owner().map_err(vhost)?;
        let offered = frontend.get_features().map_err(vhost)?;
        for (bit, name) in [
            (features::VERSION_1, "VIRTIO_F_VERSION_1"),
            (PROTOCOL_FEATURES, "protocol features"),
        ] {
            if offered & bit == 0 {
                return Err(Error::Attach(format!("the backend does not offer {name}")));
            }
        }
        let needed = VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS;
        let protocol = frontend.get_protocol_features().map_err(vhost)?;
        if !protocol.contains(needed) {
            return Err(Error::Attach(format!(
                "the backend lacks protocol features {:?}",
                needed - protocol
            )));
        }
        frontend.set_protocol_features(needed).map_err(vhost)?;
        frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);

        let size = std::mem::size_of::<DeviceConfig>() as u32;
        let (_, bytes) = frontend
            .get_config(
                0,
                size,
                VhostUserConfigFlags::empty(),
                &vec![0; size as usize],
            )
            .map_err(vhost)?;
        let config: DeviceConfig = match vrdma_spec::read_wire(&bytes) {
            Some(config) if bytes.len() == size as usize => config,
            _ => {
                return Err(Error::Attach(format!(
                    "config space of {} bytes, expected {size}",
                    bytes.len()
                )))
            }
        };
        let notify_queues = config.num_notify_queues.to_native();
        if !(1..=MAX_NOTIFY_QUEUES).contains(&notify_queues) {
            return Err(Error::Attach(format!(
                "the device reports {notify_queues} notification queues"
            )));
        }
        let num_queues = usize::from(FIRST_NOTIFY_QUEUE) + notify_queues as usize;
        let queue_num = frontend.get_queue_num().map_err(vhost)?;
        if queue_num < num_queues as u64 {
            return Err(Error::Attach(format!(
                "the backend has {queue_num} queues, the device needs {num_queues}"
            )));
        }
        let features = offered & WANTED_FEATURES;
        frontend.set_features(features).map_err(vhost)?;

        let region = Region::new(options.region_size, options.huge_pages)?;
        frontend
            .set_mem_table(&[region_info(&region)])
            .map_err(vhost)?;
        let mut queues = Vec::with_capacity(num_queues);
        for index in 0..num_queues {
            let queue = SplitQueue::new(&region, QUEUE_SIZE)?;
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
            frontend.set_vring_call(index, &queue.call).map_err(vhost)?;
            frontend.set_vring_kick(index, &queue.kick).map_err(vhost)?;
            frontend.set_vring_enable(index, true).map_err(vhost)?;
            queues.push(queue);
        }
        let control_queue = queues.remove(0);
        let buffer = |len| region.alloc(len, 8).ok_or(Error::OutOfSharedMemory(len));
        let control = Control {
            queue: control_queue,
            request: buffer(CONTROL_BUFFER)?,
            response: buffer(CONTROL_BUFFER)?,
        };
        let mut event_queue = queues.remove(0);
        let event_buffers = buffer(EVENT_SIZE * u64::from(QUEUE_SIZE))?;
        event_queue.post_all(event_buffers.addr(), EVENT_SIZE as u32)?;
        let events = Events {
            queue: event_queue,
            buffers: event_buffers,
        };
        Ok(DirectTransport {
            frontend: Mutex::new(frontend),
            regions: Mutex::new(vec![region]),
            control: Mutex::new(control),
            events: Mutex::new(events),
            notify: queues,
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
        if request.len() as u64 > CONTROL_BUFFER || response.len() as u64 > CONTROL_BUFFER {
            return Err(Error::OutOfBounds {
                offset: 0,
                len: request.len().max(response.len()) as u64,
                size: CONTROL_BUFFER,
            });
        }
        let mut control = self.control.lock().unwrap_or_else(|e| e.into_inner());
        let control = &mut *control;
        control.request.write(0, request)?;
        let chain = [
            ChainBuffer {
                addr: control.request.addr(),
                len: request.len() as u32,
                device_writes: false,
            },
            ChainBuffer {
                addr: control.response.addr(),
                len: response.len() as u32,
                device_writes: true,
            },
        ];
        control.queue.submit(&chain)?;
        let written = (control.queue.wait_used(CONTROL_TIMEOUT)? as usize).min(response.len());
        control.response.read(0, &mut response[..written])?;
        Ok(written)
    }

    fn notify(&self, queue: u32) -> Result<()> {
        let queue = self.notify.get(queue as usize).ok_or_else(|| {
            Error::InvalidArgument(format!("the device has no notification queue {queue}"))
        })?;
        queue.kick()
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<Event>> {
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        let Some((id, len)) = events.queue.next_used(timeout)? else {
            return Ok(None);
        };
        let mut event = Event::default();
        if len as u64 >= EVENT_SIZE {
            events
                .buffers
                .read(u64::from(id) * EVENT_SIZE, event.as_mut_slice())?;
        }
        events.queue.repost(id)?;
        Ok(Some(event))
    }

    fn alloc(&self, len: u64, align: u64) -> Result<SharedBuffer> {
        let mut regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(buffer) = regions.iter().find_map(|r| r.alloc(len, align)) {
            return Ok(buffer);
        }
        let size = len
            .checked_add(align)
            .ok_or(Error::OutOfSharedMemory(len))?
            .max(self.options.region_size);
        let region = Region::new(size, self.options.huge_pages)?;
        self.frontend
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add_mem_region(&region_info(&region))
            .map_err(|e| Error::Attach(format!("adding shared memory: {e}")))?;
        let buffer = region
            .alloc(len, align)
            .ok_or(Error::OutOfSharedMemory(len))?;
        regions.push(region);
        Ok(buffer)
    }

    fn page_size(&self, addr: u64, len: u64) -> Option<u64> {
        self.regions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|r| r.contains(addr, len))
            .map(|r| r.page_size())
    }
}
