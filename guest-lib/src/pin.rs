//! Pinning memory for the device of a VM, through the guest kernel's vrdma_pin module
//! (`guest-lib/kmod`, `/dev/vrdma-pin`), as uverbs pins registered memory.
//!
//! Inside a VM the device is given guest-physical addresses. `mlock` keeps a page resident
//! but neither in its frame (compaction, NUMA balancing and THP collapse move locked pages)
//! nor its frame allocated (a hole punched in a memfd frees it), so the device would go on
//! writing where the kernel has put someone else's memory. A pin keeps the page in its frame
//! and the frame allocated until the pin ends: when the [`Pin`] is dropped, or when the
//! process ends. Pins are charged to the process's RLIMIT_MEMLOCK (ENOMEM past it).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::OnceLock;

use crate::shm::PAGE_SIZE;
use crate::{Error, Result};

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

/// `_IOWR('v', 1, struct vrdma_pin)` and `_IOW('v', 2, __u32)`.
const VRDMA_PIN_IOC_PIN: libc::c_ulong = ioc(3, 1, std::mem::size_of::<PinRequest>());
const VRDMA_PIN_IOC_UNPIN: libc::c_ulong = ioc(1, 2, std::mem::size_of::<u32>());

/// Linux's `_IOC(dir, 'v', nr, size)` on x86_64 (dir: 1 write, 2 read, 3 both).
const fn ioc(dir: libc::c_ulong, nr: libc::c_ulong, size: usize) -> libc::c_ulong {
    (dir << 30) | ((size as libc::c_ulong) << 16) | ((b'v' as libc::c_ulong) << 8) | nr
}

/// The process's pinning device, opened once (pins live on the open file).
fn pin_device() -> Result<&'static File> {
    static DEVICE: OnceLock<std::result::Result<File, i32>> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            File::options()
                .read(true)
                .write(true)
                .open(PIN_DEVICE)
                .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))
        })
        .as_ref()
        .map_err(|&errno| Error::Pin {
            call: "open",
            source: std::io::Error::from_raw_os_error(errno),
        })
}

/// Pinned pages of this process; unpinned when dropped.
#[derive(Debug)]
pub struct Pin {
    id: u32,
}

impl Pin {
    /// Pins `addr..addr + len` (page-aligned) of this process's memory and returns the pin
    /// with the guest-physical address of each of its 4 KiB pages, in order.
    pub fn new(addr: u64, len: u64) -> Result<(Pin, Vec<u64>)> {
        let device = pin_device()?;
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
        let done = unsafe { libc::ioctl(device.as_raw_fd(), VRDMA_PIN_IOC_PIN, &mut request) };
        if done != 0 {
            return Err(Error::Pin {
                call: "pin",
                source: std::io::Error::last_os_error(),
            });
        }
        Ok((Pin { id: request.id }, frames))
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        let Ok(device) = pin_device() else { return };
        // SAFETY: passes a pointer to a u32 the kernel only reads.
        let done = unsafe { libc::ioctl(device.as_raw_fd(), VRDMA_PIN_IOC_UNPIN, &self.id) };
        if done != 0 {
            log::error!(
                "unpinning pin {}: {}",
                self.id,
                std::io::Error::last_os_error()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_are_those_of_vrdma_pin_h() {
        // As the kernel's _IOWR('v', 1, 32-byte struct) and _IOW('v', 2, __u32) compute them.
        assert_eq!(VRDMA_PIN_IOC_PIN, 0xc020_7601);
        assert_eq!(VRDMA_PIN_IOC_UNPIN, 0x4004_7602);
    }
}
