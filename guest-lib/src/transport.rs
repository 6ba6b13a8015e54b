//! How guest-lib reaches the device. Everything above this trait — the verbs API and the wire
//! protocol — is the same for every transport.

use std::os::unix::fs::FileExt;
use std::time::Duration;

use vrdma_spec::config::{features, DeviceConfig, FIRST_NOTIFY_QUEUE};
use vrdma_spec::ctrl::{request_bytes, Opcode, ResponseHeader, SetNotifyAreaRequest, Status};
use vrdma_spec::ring::Event;
use vrdma_spec::{read_wire, ByteValued};

use std::sync::Arc;

use crate::shm::{Region, SharedBuffer};
use crate::{Error, Result};

/// Device features guest-lib knows how to use, on every transport that negotiates them.
pub(crate) const WANTED_FEATURES: u64 = features::VERSION_1
    | features::RC
    | features::UD
    | features::UC
    | features::SRQ
    | features::ATOMIC
    | features::INDIRECT_PAGE_LIST
    | features::DOORBELL_AREAS
    | features::CM
    | features::RESET_COMMAND
    | features::RESIZE_CQ;

pub trait Transport: Send + Sync {
    /// The device configuration space, read at attach time.
    fn config(&self) -> &DeviceConfig;

    /// The negotiated device feature bits.
    fn features(&self) -> u64;

    /// Sends one control request and waits for its response; returns the bytes the device
    /// wrote into `response`.
    fn control(&self, request: &[u8], response: &mut [u8]) -> Result<usize>;

    /// Memory the device can reach, zeroed, `align`-aligned.
    fn alloc(&self, len: u64, align: u64) -> Result<SharedBuffer>;

    /// Kicks notification queue `queue` (0-based): the device's poller for it is asleep.
    fn notify(&self, queue: u32) -> Result<()>;

    /// The next event the device posted on the event queue, waiting up to `timeout`.
    fn next_event(&self, timeout: Duration) -> Result<Option<Event>>;

    /// Makes `addr..addr + len` of this process's own memory (malloc'd, stack, mmap'd)
    /// reachable by the device without moving it: in direct attach it becomes shared memory
    /// in place, in a VM its pages are locked and addressed by their guest-physical address.
    ///
    /// # Safety
    /// The range must be memory of this process that nothing writes during the call and
    /// that stays mapped, as it is, while the device uses it.
    unsafe fn share(&self, addr: u64, len: u64) -> Result<()>;

    /// The page size of the shared memory holding `addr..addr + len` and the device's
    /// (guest-physical) address of each of its pages, or `None` when the range is not
    /// (entirely) in memory shared with the device.
    fn device_pages(&self, addr: u64, len: u64) -> Option<(u64, Vec<u64>)>;

    /// Makes `region`, memory of another process mapped into this one (a memfd it passed,
    /// [`Region::from_file`]), reachable by the device, for a driver that serves several
    /// programs (the guest service): in direct attach it is added to the backend's memory
    /// table, in a VM its pages are locked. The returned region knows the device's address of
    /// each of its pages.
    fn adopt(&self, _region: Region) -> Result<Arc<Region>> {
        Err(Error::InvalidArgument(
            "only the device's own driver can share another program's memory with it".into(),
        ))
    }

    /// Undoes [`Transport::adopt`] once the device no longer uses the region.
    fn forget(&self, _region: &Region) -> Result<()> {
        Ok(())
    }

    /// The memory regions this transport has made known to the device and how many it may,
    /// where the device bounds them (a vhost-user backend: each region is one of its memory
    /// table's, and one past its limit ends the connection); `None` where memory is not
    /// announced region by region (a VM's device reaches all guest RAM). Past the limit,
    /// allocating, sharing and adopting fail with [`Error::OverLimit`], with nothing sent.
    fn memory_regions(&self) -> Option<MemoryRegions> {
        None
    }

    /// The notify area and doorbell bitmap (SPEC.md §8.5) when the device's driver set them
    /// up before this transport was handed out (a program served by the guest service);
    /// `None` when whoever opens the device issues SET_NOTIFY_AREA itself.
    fn notify_area(&self) -> Option<(SharedBuffer, SharedBuffer)> {
        None
    }

    /// A way to kick the device that does nothing else, which a driver serving several
    /// programs (the guest service) can hand them so that their kicks do not pass through it:
    /// in a VM, the PCI device's notification port ([`NotifyPort`]), when it has one.
    fn notify_port(&self) -> Option<&NotifyPort> {
        None
    }

    /// Tells the transport that its driver has reset the device (SPEC.md §9: RESET, or the
    /// reset that opened it where RESET is not offered): nothing a driver before this one
    /// left reaches memory any more. In a VM, the pins dead drivers left end.
    fn device_reset(&self) -> Result<()> {
        Ok(())
    }

    /// Whether the device is known to be gone for good (a direct attachment whose backend
    /// closed the socket). Cheap enough to ask whenever a wait for events times out.
    fn disconnected(&self) -> bool {
        false
    }

    /// Makes `ahead` control queue entries available that the driver never wrote, as a
    /// broken or hostile driver might (conformance tests of a device).
    fn publish_bogus_control_entries(&self, ahead: u16) -> Result<()>;

    /// Lets this transport announce memory regions past the limit the device states, as a
    /// broken or hostile front end might (conformance tests of a device, which must refuse
    /// them); only a vhost-user front end announces regions.
    fn lift_memory_region_limit(&self) -> Result<()> {
        Err(Error::InvalidArgument(
            "only a direct attachment announces memory regions".into(),
        ))
    }

    /// Gives the device a new kick descriptor for every queue while they run, as a front end
    /// may (conformance tests of a device); only a vhost-user front end can.
    fn renew_kick_descriptors(&self) -> Result<()> {
        Err(Error::InvalidArgument(
            "only a direct attachment has kick descriptors to renew".into(),
        ))
    }

    /// Hands the device to a new connection of this front end, as a hypervisor replacing
    /// itself under a running guest does (SPEC.md §11.1): the queues stop, the device state
    /// is saved, a new connection loads it and starts the queues where they stopped, and the
    /// old connection closes. Only a vhost-user front end can.
    fn replace_front_end(&self) -> Result<()> {
        Err(Error::InvalidArgument(
            "only a direct attachment is a vhost-user front end".into(),
        ))
    }
}

impl dyn Transport + '_ {
    /// Refuses a device of another specification version than this library's (SPEC.md §3
    /// `version`): a driver never drives a device whose rules it does not know.
    pub fn check_version(&self) -> Result<()> {
        match self.config().version.to_native() {
            vrdma_spec::SPEC_VERSION => Ok(()),
            device => Err(Error::SpecVersion { device }),
        }
    }

    /// One control command (SPEC.md §6): `payload` framed as `opcode`'s request, the answer
    /// read up to `opcode`'s response size. An answer shorter than its header, or with a
    /// status SPEC.md does not define, is [`Error::BadResponse`].
    pub fn command(&self, opcode: Opcode, payload: &[u8]) -> Result<Response> {
        let header_len = std::mem::size_of::<ResponseHeader>();
        let mut bytes = vec![0u8; header_len + opcode.response_size()];
        let written = self
            .control(&request_bytes(opcode as u16, payload), &mut bytes)?
            .min(bytes.len());
        let malformed = Error::BadResponse {
            opcode,
            len: written,
        };
        bytes.truncate(written);
        let Some(header) = read_wire::<ResponseHeader>(&bytes) else {
            return Err(malformed);
        };
        let status = Status::try_from(header.status.to_native()).map_err(|_| malformed)?;
        Ok(Response {
            opcode,
            status,
            detail: header.detail.to_native(),
            payload: bytes.split_off(header_len),
        })
    }

    /// A new driver's start once its notify area is made (SPEC.md §9 step 3): RESET where the
    /// device offers it (what an earlier driver left, a killed or an upgraded one, goes; a
    /// device without RESET dropped all at the reset that opened it), then the pins dead
    /// drivers left end ([`Transport::device_reset`]), then SET_NOTIFY_AREA.
    pub fn start_driver(&self, notify_area: &SetNotifyAreaRequest) -> Result<()> {
        if self.features() & features::RESET_COMMAND != 0 {
            self.command(Opcode::Reset, &[])?.accepted()?;
        }
        self.device_reset()?;
        self.command(Opcode::SetNotifyArea, notify_area.as_slice())?
            .accepted()?;
        Ok(())
    }
}

/// The device's answer to a control command (`command` of a `dyn Transport`).
#[derive(Debug)]
pub struct Response {
    pub opcode: Opcode,
    pub status: Status,
    /// The header's `detail` (SPEC.md §6): which rule refused the request.
    pub detail: u32,
    /// The bytes the device wrote after the header.
    pub payload: Vec<u8>,
}

impl Response {
    /// The payload of an answer with status OK; any other status as [`Error::Device`].
    pub fn accepted(self) -> Result<Vec<u8>> {
        match self.status {
            Status::Ok => Ok(self.payload),
            status => Err(Error::Device {
                opcode: self.opcode,
                status,
                detail: self.detail,
            }),
        }
    }
}

/// Memory regions of a transport whose device bounds them ([`Transport::memory_regions`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryRegions {
    /// Regions made known to the device now.
    pub in_use: usize,
    /// Regions the device takes at most.
    pub limit: usize,
}

/// A file where writing a virtqueue's index (2 bytes, little-endian) at `offset` notifies that
/// queue: the sysfs file of a PCI I/O BAR that holds only a virtio notification structure with
/// a multiplier of 0 (the PCI transport finds it: `VirtioCapabilities::notify_port`).
#[derive(Debug)]
pub struct NotifyPort {
    pub file: std::fs::File,
    pub offset: u64,
}

impl NotifyPort {
    /// Kicks notification queue `queue` (0-based).
    pub fn kick(&self, queue: u32) -> Result<()> {
        let index = u16::try_from(queue)
            .ok()
            .and_then(|queue| queue.checked_add(FIRST_NOTIFY_QUEUE))
            .ok_or_else(|| Error::InvalidArgument(format!("no notification queue {queue}")))?;
        self.file
            .write_all_at(&index.to_le_bytes(), self.offset)
            .map_err(Error::Transport)
    }
}
