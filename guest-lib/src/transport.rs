//! How guest-lib reaches the device. Everything above this trait — the verbs API and the wire
//! protocol — is the same for every transport.

use std::time::Duration;

use vrdma_spec::config::DeviceConfig;
use vrdma_spec::ring::Event;

use crate::shm::SharedBuffer;
use crate::{Error, Result};

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

    /// Whether the device is known to be gone for good (a direct attachment whose backend
    /// closed the socket). Cheap enough to ask whenever a wait for events times out.
    fn disconnected(&self) -> bool {
        false
    }

    /// Makes `ahead` control queue entries available that the driver never wrote, as a
    /// broken or hostile driver might (conformance tests of a device).
    fn publish_bogus_control_entries(&self, ahead: u16) -> Result<()>;

    /// Gives the device a new kick descriptor for every queue while they run, as a front end
    /// may (conformance tests of a device); only a vhost-user front end can.
    fn renew_kick_descriptors(&self) -> Result<()> {
        Err(Error::InvalidArgument(
            "only a direct attachment has kick descriptors to renew".into(),
        ))
    }
}
