//! Pinning memory for the device of a VM, through the guest kernel's vrdma_pin module
//! (`guest-lib/kmod`, `/dev/vrdma-pin`), as uverbs pins registered memory.
//!
//! Inside a VM the device is given guest-physical addresses. `mlock` keeps a page resident
//! but neither in its frame (compaction, NUMA balancing and THP collapse move locked pages)
//! nor its frame allocated (a hole punched in a memfd frees it), so the device would go on
//! writing where the kernel has put someone else's memory. A pin keeps the page in its frame
//! and the frame allocated until the pin ends: when the [`Pin`] is dropped, or once the
//! process has ended and the device was reset ([`PinFile`]). Pins are charged to the
//! process's RLIMIT_MEMLOCK (ENOMEM past it).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use crate::{Error, Result, PAGE_SIZE};

/// The pinning module's device node.
pub const PIN_DEVICE: &str = "/dev/vrdma-pin";

/// `struct vrdma_pin` of `vrdma_pin.h`.
#[repr(C)]
struct PinRequest {
    addr: u64,
    length: u64,
    frames: u64,
    id: u32,
    flags: u32,
}

const _: () = assert!(std::mem::size_of::<PinRequest>() == 32);

/// `_IOWR('v', 1, struct vrdma_pin)`, `_IOW('v', 2, __u32)`, `_IOW('v', 3, __u64)` and
/// `_IO('v', 4)`.
const VRDMA_PIN_IOC_PIN: libc::c_ulong = ioc(3, 1, std::mem::size_of::<PinRequest>());
const VRDMA_PIN_IOC_UNPIN: libc::c_ulong = ioc(1, 2, std::mem::size_of::<u32>());
const VRDMA_PIN_IOC_DEVICE: libc::c_ulong = ioc(1, 3, std::mem::size_of::<u64>());
const VRDMA_PIN_IOC_DEVICE_RESET: libc::c_ulong = ioc(0, 4, 0);

/// Linux's `_IOC(dir, 'v', nr, size)` on x86_64 (dir: 0 none, 1 write, 2 read, 3 both).
const fn ioc(dir: libc::c_ulong, nr: libc::c_ulong, size: usize) -> libc::c_ulong {
    (dir << 30) | ((size as libc::c_ulong) << 16) | ((b'v' as libc::c_ulong) << 8) | nr
}

/// The pinning device, opened for one vrdma device: the pins made through it are for that
/// device. A driver that dies leaves its objects on the device, which writes their memory
/// until the next driver resets it (SPEC.md §9), so when the process ends with pins, the
/// module holds them until a driver of the same device reports the reset
/// ([`PinFile::device_reset`]).
#[derive(Debug)]
pub struct PinFile {
    file: File,
}

impl PinFile {
    /// Opens the pinning device for the vrdma device named `device` (any number but 0 that
    /// names it alone in the VM, the same for every driver of it).
    pub fn for_device(device: u64) -> Result<Arc<PinFile>> {
        let file = File::options()
            .read(true)
            .write(true)
            .open(PIN_DEVICE)
            .map_err(|source| Error::Pin {
                call: "open",
                source,
            })?;
        let pins = PinFile { file };
        pins.ioctl("VRDMA_PIN_IOC_DEVICE", VRDMA_PIN_IOC_DEVICE, &device)?;
        Ok(Arc::new(pins))
    }

    /// Reports that this driver has reset the device: what drivers before it left pinned for
    /// the device ends.
    pub fn device_reset(&self) -> Result<()> {
        self.ioctl(
            "VRDMA_PIN_IOC_DEVICE_RESET",
            VRDMA_PIN_IOC_DEVICE_RESET,
            &0u64,
        )
    }

    fn ioctl<T>(&self, call: &'static str, request: libc::c_ulong, arg: &T) -> Result<()> {
        // SAFETY: every request this module makes reads at most a `T` at `arg`, which is
        // valid for the call, and writes nothing.
        let done = unsafe { libc::ioctl(self.file.as_raw_fd(), request, arg as *const T) };
        if done != 0 {
            return Err(Error::Pin {
                call,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

/// Pinned pages of this process; unpinned when dropped.
#[derive(Debug)]
pub struct Pin {
    file: Arc<PinFile>,
    id: u32,
}

impl Pin {
    /// Pins `addr..addr + len` (page-aligned) of this process's memory through `file` and
    /// returns the pin with the guest-physical address of each of its 4 KiB pages, in order.
    pub fn new(file: &Arc<PinFile>, addr: u64, len: u64) -> Result<(Pin, Vec<u64>)> {
        let pages = usize::try_from(len / PAGE_SIZE)
            .map_err(|_| Error::InvalidArgument(format!("{len:#x} bytes to pin")))?;
        let mut frames = vec![0u64; pages];
        let mut request = PinRequest {
            addr,
            length: len,
            frames: frames.as_mut_ptr() as u64,
            id: 0,
            flags: 0,
        };
        // SAFETY: the request is a valid `struct vrdma_pin` whose `frames` points to room for
        // one u64 per page of `len`, which the kernel fills; it reads nothing else of ours.
        let done = unsafe { libc::ioctl(file.file.as_raw_fd(), VRDMA_PIN_IOC_PIN, &mut request) };
        if done != 0 {
            return Err(Error::Pin {
                call: "pin",
                source: std::io::Error::last_os_error(),
            });
        }
        let pin = Pin {
            file: Arc::clone(file),
            id: request.id,
        };
        Ok((pin, frames))
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        if let Err(e) = self.file.ioctl("unpin", VRDMA_PIN_IOC_UNPIN, &self.id) {
            log::error!("pin {}: {e}", self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_are_those_of_vrdma_pin_h() {
        // As the kernel's _IOWR('v', 1, 32-byte struct), _IOW('v', 2, __u32),
        // _IOW('v', 3, __u64) and _IO('v', 4) compute them.
        assert_eq!(VRDMA_PIN_IOC_PIN, 0xc020_7601);
        assert_eq!(VRDMA_PIN_IOC_UNPIN, 0x4004_7602);
        assert_eq!(VRDMA_PIN_IOC_DEVICE, 0x4008_7603);
        assert_eq!(VRDMA_PIN_IOC_DEVICE_RESET, 0x7604);
    }
}
