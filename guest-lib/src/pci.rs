//! PCI transport: guest-lib drives the vrdma virtio-pci device of the VM it runs in from
//! userspace, with no guest kernel driver. The device is bound to `uio_pci_generic` (which
//! enables it and keeps other drivers off it), its BARs are mapped through sysfs, and the
//! virtio 1.x initialisation runs here (virtio spec §3.1, §4.1). Memory shared with the device
//! is pinned through the vrdma_pin module ([`crate::pin`]), which gives its guest-physical
//! addresses; the device itself needs root.
//!
//! A driver waiting for the control or event queue sleeps on the device's INTx interrupt
//! (`Interrupt`), or polls every 100 µs where it has none.

use std::fs;
use std::os::unix::fs::FileExt;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_spec::config::{features, DeviceConfig, FIRST_NOTIFY_QUEUE, MAX_NOTIFY_QUEUES};
use vrdma_spec::ring::Event;

use crate::mmio::Bar;
use crate::pin::PinFile;
use crate::shm::{Region, RegionSet, SharedBuffer};
use crate::transport::{NotifyPort, Transport, WANTED_FEATURES};
use crate::virtq::{DeviceQueues, QueueSignal, SplitQueue, QUEUE_SIZE};
use crate::{Error, Result};

/// PCI vendor of virtio devices.
pub const VIRTIO_VENDOR: u16 = 0x1af4;
/// Modern virtio-pci device id of virtio device type 42 (RDMA): 0x1040 + 42.
pub const VRDMA_DEVICE_ID: u16 = 0x106a;
const SYSFS_DEVICES: &str = "/sys/bus/pci/devices";
const UIO_DRIVER: &str = "uio_pci_generic";
/// Shared memory locked at a time.
const REGION_SIZE: u64 = 8 << 20;
const POLL_INTERVAL: Duration = Duration::from_micros(100);

/// Device status bits (virtio spec §2.1).
mod status {
    pub const ACKNOWLEDGE: u8 = 1;
    pub const DRIVER: u8 = 2;
    pub const DRIVER_OK: u8 = 4;
    pub const FEATURES_OK: u8 = 8;
    pub const NEEDS_RESET: u8 = 64;
    pub const FAILED: u8 = 128;
}

/// Offsets in the common configuration structure (virtio spec §4.1.4.3).
mod common {
    pub const DEVICE_FEATURE_SELECT: u64 = 0x00;
    pub const DEVICE_FEATURE: u64 = 0x04;
    pub const DRIVER_FEATURE_SELECT: u64 = 0x08;
    pub const DRIVER_FEATURE: u64 = 0x0c;
    pub const NUM_QUEUES: u64 = 0x12;
    pub const DEVICE_STATUS: u64 = 0x14;
    pub const CONFIG_GENERATION: u64 = 0x15;
    pub const QUEUE_SELECT: u64 = 0x16;
    pub const QUEUE_SIZE: u64 = 0x18;
    pub const QUEUE_ENABLE: u64 = 0x1c;
    pub const QUEUE_NOTIFY_OFF: u64 = 0x1e;
    pub const QUEUE_DESC: u64 = 0x20;
    pub const QUEUE_DRIVER: u64 = 0x28;
    pub const QUEUE_DEVICE: u64 = 0x30;
}

/// Where one virtio structure lives: BAR, offset, length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    pub bar: u8,
    pub offset: u64,
    pub length: u64,
}

/// The virtio structures a vendor-specific capability list points at (virtio spec §4.1.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VirtioCapabilities {
    pub common: Location,
    pub notify: Location,
    pub notify_off_multiplier: u32,
    pub device: Location,
    /// The ISR status register, which INTx interrupts need (optional: without it the
    /// driver polls).
    pub isr: Option<Location>,
    /// A second notification structure, in an I/O BAR and with a multiplier of 0 (QEMU's
    /// `modern-pio-notify=on`): one port where writing any queue's index notifies it. Such a
    /// BAR holds nothing else, so the guest service can let its programs kick the device
    /// through it without being able to do anything more (SPEC.md §12).
    pub notify_port: Option<Location>,
}

/// Finds the virtio structures in a PCI configuration space (as the sysfs `config` file
/// reads). Every pointer is checked: a device, too, can be wrong.
pub fn parse_capabilities(config: &[u8]) -> Result<VirtioCapabilities> {
    const CAP_VENDOR: u8 = 0x09;
    const STATUS_CAP_LIST: u8 = 0x10;
    let bad = |what: &str| Error::Incompatible(format!("PCI configuration space: {what}"));
    let byte = |at: usize| config.get(at).copied().ok_or_else(|| bad("truncated"));
    let le32 = |at: usize| -> Result<u32> {
        let bytes = config.get(at..at + 4).ok_or_else(|| bad("truncated"))?;
        Ok(u32::from_le_bytes(bytes.try_into().expect("4 bytes")))
    };
    if byte(0x06)? & STATUS_CAP_LIST == 0 {
        return Err(bad("no capability list"));
    }
    // Bit 0 of a base address register: the BAR is I/O space (PCI spec §6.2.5.1).
    let io_bar =
        |bar: u8| -> Result<bool> { Ok(bar <= 5 && le32(0x10 + 4 * usize::from(bar))? & 1 == 1) };
    let (mut common, mut notify, mut device, mut isr) = (None, None, None, None);
    let mut notify_port = None;
    let mut at = usize::from(byte(0x34)? & !3);
    // 48 capabilities fill the 192 bytes after the header: more means a loop.
    for _ in 0..48 {
        if at == 0 {
            break;
        }
        if at < 0x40 {
            return Err(bad("capability pointer into the header"));
        }
        if byte(at)? == CAP_VENDOR && byte(at + 2)? >= 16 {
            let location = Location {
                bar: byte(at + 4)?,
                offset: u64::from(le32(at + 8)?),
                length: u64::from(le32(at + 12)?),
            };
            match byte(at + 3)? {
                1 => common = common.or(Some(location)),
                2 => {
                    let multiplier = le32(at + 16)?;
                    if !io_bar(location.bar)? {
                        notify = notify.or(Some((location, multiplier)));
                    } else if multiplier == 0 && location.length >= 2 {
                        notify_port = notify_port.or(Some(location));
                    }
                }
                3 => isr = isr.or(Some(location)),
                4 => device = device.or(Some(location)),
                _ => {}
            }
        }
        at = usize::from(byte(at + 1)? & !3);
    }
    match (common, notify, device) {
        (Some(common), Some((notify, notify_off_multiplier)), Some(device)) => {
            Ok(VirtioCapabilities {
                common,
                notify,
                notify_off_multiplier,
                device,
                isr,
                notify_port,
            })
        }
        _ => Err(bad("missing a virtio common, notify or device capability")),
    }
}

/// A mapped virtio structure.
#[derive(Clone)]
struct Structure {
    bar: Arc<Bar>,
    offset: u64,
    length: u64,
}

impl Structure {
    fn at(&self, offset: u64, width: u64) -> Result<u64> {
        if offset + width > self.length {
            return Err(Error::Incompatible(format!(
                "register {offset:#x} beyond a {}-byte virtio structure",
                self.length
            )));
        }
        Ok(self.offset + offset)
    }
    fn read8(&self, offset: u64) -> Result<u8> {
        self.bar.read(self.at(offset, 1)?)
    }
    fn read16(&self, offset: u64) -> Result<u16> {
        self.bar.read::<u16>(self.at(offset, 2)?).map(u16::from_le)
    }
    fn read32(&self, offset: u64) -> Result<u32> {
        self.bar.read::<u32>(self.at(offset, 4)?).map(u32::from_le)
    }
    fn write8(&self, offset: u64, value: u8) -> Result<()> {
        self.bar.write(self.at(offset, 1)?, value)
    }
    fn write16(&self, offset: u64, value: u16) -> Result<()> {
        self.bar.write(self.at(offset, 2)?, value.to_le())
    }
    fn write32(&self, offset: u64, value: u32) -> Result<()> {
        self.bar.write(self.at(offset, 4)?, value.to_le())
    }
    /// 64-bit fields are written as two 32-bit halves, low first (virtio spec §4.1.3.1).
    fn write64(&self, offset: u64, value: u64) -> Result<()> {
        self.write32(offset, value as u32)?;
        self.write32(offset + 4, (value >> 32) as u32)
    }
}

/// A queue's notification register, and how its driver waits for used buffers.
struct PciSignal {
    bar: Arc<Bar>,
    offset: u64,
    queue: u16,
    /// The device's interrupt, for a queue the driver waits on; `None`: it polls.
    interrupt: Option<Interrupt>,
}

impl QueueSignal for PciSignal {
    fn kick(&self) -> Result<()> {
        self.bar.write(self.offset, self.queue.to_le())
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        match &self.interrupt {
            Some(interrupt) => interrupt.wait(timeout),
            None => {
                std::thread::sleep(timeout.min(POLL_INTERVAL));
                Ok(())
            }
        }
    }
}

/// The device's INTx interrupt as `uio_pci_generic` hands it to userspace, for one waiting
/// queue: each waiting queue reads its own descriptor of the uio node, as the kernel counts
/// interrupts per open descriptor, so every waiter sees every interrupt.
///
/// INTx rather than MSI-X through vfio-pci's no-IOMMU mode: uio_pci_generic is what the
/// driver binds already, needs no kernel option (no-IOMMU vfio taints the kernel and must be
/// enabled by a module parameter), and the device raises INTx with no set-up beyond
/// reading its ISR status register, while the driver's waits are few (control responses
/// and events) and not on the data path, which never interrupts.
struct Interrupt {
    uio: fs::File,
    /// The device's PCI configuration space (sysfs), whose command register masks INTx.
    config: fs::File,
    isr: Structure,
    /// Whether INTx may be masked: the kernel masks it at each interrupt, which this waiter
    /// then sees; a wait that timed out saw none, and leaves the next one nothing to unmask.
    /// (Each config space access is a trap to the hypervisor: an idle wait makes none.)
    may_be_masked: std::sync::atomic::AtomicBool,
}

/// The high byte of the PCI command register, and its INTx Disable bit (bit 10).
const COMMAND_HIGH: u64 = 0x05;
const INTX_DISABLE_HIGH: u8 = 1 << 2;

impl Interrupt {
    /// The interrupt of the device at `path`, when `uio_pci_generic` gave it a uio node
    /// and the device has an ISR status register; `None` otherwise (the driver then polls).
    fn open(path: &Path, isr: Option<&Structure>) -> Option<Interrupt> {
        let isr = isr?.clone();
        let node = fs::read_dir(path.join("uio"))
            .ok()?
            .filter_map(|entry| entry.ok())
            .find_map(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                name.starts_with("uio")
                    .then(|| Path::new("/dev").join(name))
            })?;
        let open = |file: &Path| {
            fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(file)
                .map_err(|e| log::warn!("{}: {e}; the driver polls instead", file.display()))
                .ok()
        };
        let uio = open(&node)?;
        let config = open(&path.join("config"))?;
        Some(Interrupt {
            uio,
            config,
            isr,
            may_be_masked: std::sync::atomic::AtomicBool::new(true),
        })
    }

    /// Returns after an interrupt, or after `timeout`.
    fn wait(&self, timeout: Duration) -> Result<()> {
        use std::io::Read;
        // uio_pci_generic masks INTx (the command register's INTx Disable) at each interrupt:
        // unmask it. An interrupt the device raised meanwhile is pending on its line
        // (level-triggered until its ISR is read) and comes now, so none is lost between the
        // caller's look at its ring and this wait. (Other waiters may unmask it at the same
        // time: every one of them clears the same bit.)
        use std::sync::atomic::Ordering::Relaxed;
        if self.may_be_masked.swap(false, Relaxed) {
            let mut command = [0u8];
            self.config
                .read_exact_at(&mut command, COMMAND_HIGH)
                .map_err(Error::Transport)?;
            if command[0] & INTX_DISABLE_HIGH != 0 {
                self.config
                    .write_all_at(&[command[0] & !INTX_DISABLE_HIGH], COMMAND_HIGH)
                    .map_err(Error::Transport)?;
            }
        }
        if crate::poll::readable(&self.uio, timeout).map_err(Error::Transport)? {
            self.may_be_masked.store(true, Relaxed);
            let mut count = [0u8; 4];
            (&self.uio)
                .read_exact(&mut count)
                .map_err(Error::Transport)?;
            // Reading the ISR lowers the line; the caller then looks at its ring.
            self.isr.read8(0)?;
        }
        Ok(())
    }
}

pub struct PciTransport {
    /// This process's claim on the device, held while it drives it.
    _claim: Flock<fs::File>,
    common: Structure,
    memory: RegionSet,
    queues: DeviceQueues,
    config: DeviceConfig,
    features: u64,
    notify_port: Option<NotifyPort>,
    /// The process that opened the device: a forked child's copy never resets it.
    opened_by: crate::fork::OpenedBy,
    /// The pins of all memory the device is given, made for this device.
    pins: Arc<PinFile>,
}

impl PciTransport {
    /// Takes over the vrdma PCI device at `address` (`DDDD:BB:DD.F`), or the first one found.
    /// Resets it first: whatever an earlier user left on it is gone. A device another process
    /// drives (the guest service, usually) is refused, never reset under it.
    pub fn open(address: Option<&str>) -> Result<PciTransport> {
        let path = find_device(address)?;
        let claim = claim(&path)?;
        bind_to_uio(&path)?;
        enable_bus_mastering(&path)?;
        let config_space = fs::read(path.join("config")).map_err(|source| Error::System {
            what: format!("reading {}/config", path.display()),
            source,
        })?;
        let capabilities = parse_capabilities(&config_space)?;
        let mut bars: Vec<(u8, Arc<Bar>)> = Vec::new();
        let mut structure = |location: Location| -> Result<Structure> {
            let bar = match bars.iter().find(|(index, _)| *index == location.bar) {
                Some((_, bar)) => Arc::clone(bar),
                None => {
                    if location.bar > 5 {
                        return Err(Error::Incompatible(format!(
                            "capability names BAR {}",
                            location.bar
                        )));
                    }
                    let bar = Arc::new(Bar::map(&path.join(format!("resource{}", location.bar)))?);
                    bars.push((location.bar, Arc::clone(&bar)));
                    bar
                }
            };
            Ok(Structure {
                bar,
                offset: location.offset,
                length: location.length,
            })
        };
        let common = structure(capabilities.common)?;
        let notify = structure(capabilities.notify)?;
        let device = structure(capabilities.device)?;
        let isr = capabilities.isr.map(&mut structure).transpose()?;

        reset(&common)?;
        common.write8(common::DEVICE_STATUS, status::ACKNOWLEDGE | status::DRIVER)?;
        let offered = read_features(&common)?;
        if offered & features::VERSION_1 == 0 {
            return fail(
                &common,
                "the device does not offer VIRTIO_F_VERSION_1".into(),
            );
        }
        let features = offered & WANTED_FEATURES;
        for half in 0..2u32 {
            common.write32(common::DRIVER_FEATURE_SELECT, half)?;
            common.write32(common::DRIVER_FEATURE, (features >> (32 * half)) as u32)?;
        }
        let negotiating = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
        common.write8(common::DEVICE_STATUS, negotiating)?;
        if common.read8(common::DEVICE_STATUS)? & status::FEATURES_OK == 0 {
            return fail(&common, "the device refused our features".into());
        }
        let config = read_device_config(&common, &device)?;
        let notify_queues = config.num_notify_queues.to_native();
        if !(1..=MAX_NOTIFY_QUEUES).contains(&notify_queues) {
            return fail(
                &common,
                format!("the device reports {notify_queues} notification queues"),
            );
        }
        let num_queues = FIRST_NOTIFY_QUEUE + notify_queues as u16;
        let offered_queues = common.read16(common::NUM_QUEUES)?;
        if offered_queues < num_queues {
            return fail(
                &common,
                format!("the device has {offered_queues} queues, it needs {num_queues}"),
            );
        }

        let pins = PinFile::for_device(pin_device_number(&path)?)?;
        let memory = RegionSet::default();
        memory.add(Region::new_pinned(&pins, REGION_SIZE, false)?);
        let mut queues = Vec::with_capacity(usize::from(num_queues));
        for index in 0..num_queues {
            common.write16(common::QUEUE_SELECT, index)?;
            let max = common.read16(common::QUEUE_SIZE)?;
            if max < QUEUE_SIZE {
                return fail(&common, format!("queue {index} holds only {max} entries"));
            }
            // The driver waits on the control and event queues; notification queues are
            // only kicked.
            let waited = index < FIRST_NOTIFY_QUEUE;
            let signal = PciSignal {
                bar: Arc::clone(&notify.bar),
                offset: notify.at(
                    u64::from(common.read16(common::QUEUE_NOTIFY_OFF)?)
                        * u64::from(capabilities.notify_off_multiplier),
                    2,
                )?,
                queue: index,
                interrupt: waited
                    .then(|| Interrupt::open(&path, isr.as_ref()))
                    .flatten(),
            };
            if waited && signal.interrupt.is_none() {
                log::info!(
                    "no interrupt for queue {index} of {}: polling it",
                    path.display()
                );
            }
            let queue = SplitQueue::new(&memory, QUEUE_SIZE, Box::new(signal))?;
            common.write16(common::QUEUE_SIZE, QUEUE_SIZE)?;
            common.write64(common::QUEUE_DESC, queue.desc_addr())?;
            common.write64(common::QUEUE_DRIVER, queue.avail_addr())?;
            common.write64(common::QUEUE_DEVICE, queue.used_addr())?;
            common.write16(common::QUEUE_ENABLE, 1)?;
            queues.push(queue);
        }
        common.write8(common::DEVICE_STATUS, negotiating | status::DRIVER_OK)?;
        let queues = DeviceQueues::new(&memory, queues)?;
        let notify_port = capabilities
            .notify_port
            .and_then(|location| open_notify_port(&path, location));
        log::info!(
            "attached to the vrdma PCI device {}{}",
            path.display(),
            if notify_port.is_some() {
                ", which has a notification port"
            } else {
                ""
            }
        );
        Ok(PciTransport {
            _claim: claim,
            common,
            memory,
            queues,
            config,
            features,
            notify_port,
            opened_by: crate::fork::OpenedBy::this_process(),
            pins,
        })
    }

    /// Fails if the device asks to be reset (its backend went away, or it found an error).
    fn check_device(&self) -> Result<()> {
        let device_status = self.common.read8(common::DEVICE_STATUS)?;
        if device_status & (status::NEEDS_RESET | status::FAILED) != 0
            || device_status & status::DRIVER_OK == 0
        {
            return Err(Error::DeviceReset);
        }
        Ok(())
    }
}

impl Drop for PciTransport {
    fn drop(&mut self) {
        // A forked child dropping its copy leaves its parent's device alone.
        if !self.opened_by.is_this_process() {
            return;
        }
        // The backend destroys every object of this device when it is reset.
        if let Err(e) = reset(&self.common) {
            log::error!("resetting the vrdma device: {e}");
        }
    }
}

impl Transport for PciTransport {
    fn config(&self) -> &DeviceConfig {
        &self.config
    }

    fn features(&self) -> u64 {
        self.features
    }

    fn control(&self, request: &[u8], response: &mut [u8]) -> Result<usize> {
        self.check_device()?;
        // A device reset is what the driver sees of a vanished backend here (§9).
        self.queues.control(request, response, &|| false)
    }

    fn publish_bogus_control_entries(&self, ahead: u16) -> Result<()> {
        self.queues.publish_bogus_control_entries(ahead)
    }

    fn notify(&self, queue: u32) -> Result<()> {
        self.queues.notify(queue)
    }

    fn notify_port(&self) -> Option<&NotifyPort> {
        self.notify_port.as_ref()
    }

    fn device_reset(&self) -> Result<()> {
        self.pins.device_reset()
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<Event>> {
        self.check_device()?;
        self.queues.next_event(timeout)
    }

    fn alloc(&self, len: u64, align: u64) -> Result<SharedBuffer> {
        // The device reaches all guest RAM: a new region needs no announcing.
        self.memory.alloc_or_grow(len, align, REGION_SIZE, |size| {
            Region::new_pinned(&self.pins, size, false)
        })
    }

    unsafe fn share(&self, addr: u64, len: u64) -> Result<()> {
        // The device reaches all guest RAM: pinned pages need no announcing.
        // SAFETY: the caller's contract is Region::pin_in_place's.
        unsafe {
            self.memory.share(addr, len, |start, len| {
                Region::pin_in_place(&self.pins, start, len)
            })
        }
    }

    fn device_pages(&self, addr: u64, len: u64) -> Option<(u64, Vec<u64>)> {
        self.memory.device_pages(addr, len)
    }

    fn adopt(&self, region: Region) -> Result<Arc<Region>> {
        // The device reaches all guest RAM: pinned pages need no announcing.
        region.pinned(&self.pins).map(Arc::new)
    }

    fn forget(&self, _region: &Region) -> Result<()> {
        // Unlocked when the region is unmapped.
        Ok(())
    }
}

/// The device's notification port (in an I/O BAR, written through its sysfs file), opened
/// for writing only; `None`, said in the log, when it cannot be.
fn open_notify_port(path: &Path, location: Location) -> Option<NotifyPort> {
    let file = path.join(format!("resource{}", location.bar));
    match fs::OpenOptions::new().write(true).open(&file) {
        Ok(opened) => Some(NotifyPort {
            file: opened,
            offset: location.offset,
        }),
        Err(e) => {
            log::warn!("{}: {e}; its notification port is not used", file.display());
            None
        }
    }
}

fn fail<T>(common: &Structure, why: String) -> Result<T> {
    let _ = common.write8(common::DEVICE_STATUS, status::FAILED);
    Err(Error::Incompatible(why))
}

/// Writes 0 to the device status and waits until the device reads back 0 (virtio spec
/// §4.1.4.3.2).
fn reset(common: &Structure) -> Result<()> {
    common.write8(common::DEVICE_STATUS, 0)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while common.read8(common::DEVICE_STATUS)? != 0 {
        if Instant::now() > deadline {
            return Err(Error::Incompatible(
                "the device does not finish its reset".into(),
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

fn read_features(common: &Structure) -> Result<u64> {
    let mut offered = 0;
    for half in 0..2u32 {
        common.write32(common::DEVICE_FEATURE_SELECT, half)?;
        offered |= u64::from(common.read32(common::DEVICE_FEATURE)?) << (32 * half);
    }
    Ok(offered)
}

/// Reads the device configuration, again if it changed meanwhile (its generation moved).
fn read_device_config(common: &Structure, device: &Structure) -> Result<DeviceConfig> {
    let size = std::mem::size_of::<DeviceConfig>() as u64;
    if device.length < size {
        return Err(Error::Incompatible(format!(
            "config space of {} bytes, expected {size}",
            device.length
        )));
    }
    for _ in 0..10 {
        let generation = common.read8(common::CONFIG_GENERATION)?;
        let mut bytes = Vec::with_capacity(size as usize);
        for offset in (0..size).step_by(4) {
            bytes.extend_from_slice(&device.read32(offset)?.to_le_bytes());
        }
        if common.read8(common::CONFIG_GENERATION)? == generation {
            return vrdma_spec::read_wire(&bytes)
                .ok_or_else(|| Error::Incompatible("malformed config space".into()));
        }
    }
    Err(Error::Incompatible(
        "the config space keeps changing".into(),
    ))
}

fn sysfs_hex(path: &Path) -> Option<u16> {
    let text = fs::read_to_string(path).ok()?;
    u16::from_str_radix(text.trim().trim_start_matches("0x"), 16).ok()
}

/// The number that names the device at `path` to the pinning module: its PCI address
/// (`DDDD:BB:DD.F`, as sysfs names it) read as one hexadecimal number, never 0.
fn pin_device_number(path: &Path) -> Result<u64> {
    let name = path
        .file_name()
        .and_then(|name| name.to_str())
        .unwrap_or_default();
    let digits: String = name.chars().filter(char::is_ascii_hexdigit).collect();
    u64::from_str_radix(&digits, 16)
        .ok()
        .filter(|&number| number != 0 && digits.len() == 9)
        .ok_or_else(|| Error::NoDevice(format!("{} is not named by a PCI address", path.display())))
}

/// The sysfs folder of the vrdma device at `address`, or of the first one.
fn find_device(address: Option<&str>) -> Result<PathBuf> {
    let is_vrdma = |path: &Path| {
        sysfs_hex(&path.join("vendor")) == Some(VIRTIO_VENDOR)
            && sysfs_hex(&path.join("device")) == Some(VRDMA_DEVICE_ID)
    };
    if let Some(address) = address {
        let path = Path::new(SYSFS_DEVICES).join(address);
        return if is_vrdma(&path) {
            Ok(path)
        } else {
            Err(Error::NoDevice(format!(
                "{address} is not a vrdma PCI device"
            )))
        };
    }
    let mut found: Vec<PathBuf> = fs::read_dir(SYSFS_DEVICES)
        .map_err(|source| Error::System {
            what: format!("listing {SYSFS_DEVICES}"),
            source,
        })?
        .filter_map(|entry| Some(entry.ok()?.path()))
        .filter(|path| is_vrdma(path))
        .collect();
    found.sort();
    found.into_iter().next().ok_or_else(|| {
        Error::NoDevice(format!(
            "no vrdma PCI device ({VIRTIO_VENDOR:04x}:{VRDMA_DEVICE_ID:04x}) in this VM"
        ))
    })
}

/// Claims the device at `path` for this process with an exclusive lock on its sysfs config
/// file, which the kernel drops when the process ends, however it ends.
fn claim(path: &Path) -> Result<Flock<fs::File>> {
    let config = path.join("config");
    let file = fs::File::open(&config).map_err(|source| Error::System {
        what: format!("opening {}", config.display()),
        source,
    })?;
    Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| match errno {
        Errno::EWOULDBLOCK => Error::DeviceBusy(format!(
            "the vrdma PCI device {} is driven by another process, which it would lose \
                 were it opened here: when that is the vrdma service (vrdmad), use the device \
                 `service` (its socket) instead",
            path.display()
        )),
        errno => Error::System {
            what: format!("locking {}", config.display()),
            source: errno.into(),
        },
    })
}

/// Hands the device to `uio_pci_generic`, unless it has it already.
fn bind_to_uio(path: &Path) -> Result<()> {
    let driver = |path: &Path| {
        fs::read_link(path.join("driver"))
            .ok()
            .and_then(|link| Some(link.file_name()?.to_string_lossy().into_owned()))
    };
    if driver(path).as_deref() == Some(UIO_DRIVER) {
        return Ok(());
    }
    let address = path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    let write = |file: PathBuf, value: &str| {
        fs::write(&file, value).map_err(|source| Error::System {
            what: format!("writing {value} to {}", file.display()),
            source,
        })
    };
    if driver(path).is_some() {
        write(path.join("driver/unbind"), &address)?;
    }
    if !Path::new("/sys/bus/pci/drivers").join(UIO_DRIVER).exists() {
        return Err(Error::NoDevice(format!(
            "the {UIO_DRIVER} driver is not loaded (modprobe {UIO_DRIVER})"
        )));
    }
    write(path.join("driver_override"), UIO_DRIVER)?;
    write(PathBuf::from("/sys/bus/pci/drivers_probe"), &address)?;
    match driver(path) {
        Some(name) if name == UIO_DRIVER => Ok(()),
        other => Err(Error::DeviceBusy(format!(
            "{address} did not bind to {UIO_DRIVER} (driver: {other:?})"
        ))),
    }
}

/// Sets Bus Master Enable in the PCI command register: the device's queues live in our
/// memory.
fn enable_bus_mastering(path: &Path) -> Result<()> {
    const COMMAND: u64 = 0x04;
    const BUS_MASTER: u16 = 1 << 2;
    let io = |source| Error::System {
        what: "setting bus mastering in the PCI command register".into(),
        source,
    };
    let config = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path.join("config"))
        .map_err(io)?;
    let mut command = [0u8; 2];
    config.read_exact_at(&mut command, COMMAND).map_err(io)?;
    let value = u16::from_le_bytes(command);
    if value & BUS_MASTER == 0 {
        config
            .write_all_at(&(value | BUS_MASTER).to_le_bytes(), COMMAND)
            .map_err(io)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
