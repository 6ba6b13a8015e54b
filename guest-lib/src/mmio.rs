//! A PCI BAR mapped from sysfs (`/sys/bus/pci/devices/*/resourceN`), accessed with volatile
//! loads and stores of each register's width. With `shm`, the only `unsafe` in guest-lib.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;

use crate::{Error, Result};

/// Register widths a BAR is accessed with.
pub trait Register: Copy {}
impl Register for u8 {}
impl Register for u16 {}
impl Register for u32 {}

pub struct Bar {
    _file: File,
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is device memory that every access reaches through volatile, bounds- and
// alignment-checked loads and stores; it is not tied to a thread.
unsafe impl Send for Bar {}
// SAFETY: `&self` methods are single volatile loads and stores of device registers, checked
// for bounds and alignment, which the device serialises; no state is cached in the value.
unsafe impl Sync for Bar {}

impl Bar {
    /// Maps the whole BAR that the sysfs `resource` file at `path` exposes.
    pub fn map(path: &Path) -> Result<Bar> {
        let io = |source| Error::System {
            what: format!("mapping {}", path.display()),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io)?;
        let len = file.metadata().map_err(io)?.len() as usize;
        if len == 0 {
            return Err(io(std::io::Error::other("empty BAR")));
        }
        // SAFETY: a shared mapping of the whole resource file at a kernel-chosen address;
        // checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io(std::io::Error::last_os_error()));
        }
        Ok(Bar {
            _file: file,
            base: NonNull::new(ptr.cast()).expect("mmap never returns page 0"),
            len,
        })
    }

    fn register<T: Register>(&self, offset: u64) -> Result<*mut T> {
        let size = std::mem::size_of::<T>() as u64;
        if !offset.is_multiple_of(size) || offset.saturating_add(size) > self.len as u64 {
            return Err(Error::OutOfBounds {
                offset,
                len: size,
                size: self.len as u64,
            });
        }
        // SAFETY: offset + size is inside the mapping (checked above).
        Ok(unsafe { self.base.as_ptr().add(offset as usize) }.cast())
    }

    pub fn read<T: Register>(&self, offset: u64) -> Result<T> {
        let register = self.register::<T>(offset)?;
        // SAFETY: aligned and inside the mapping; device registers need volatile access.
        Ok(unsafe { register.read_volatile() })
    }

    pub fn write<T: Register>(&self, offset: u64, value: T) -> Result<()> {
        let register = self.register::<T>(offset)?;
        // SAFETY: as in `read`.
        unsafe { register.write_volatile(value) };
        Ok(())
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, used by nothing after this.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}
