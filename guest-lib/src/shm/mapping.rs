//! Making regions: memfds mapped here (sealed, so a backend may take them as guest memory),
//! the program's memory made shareable in place, pinned inside a VM; and unmapping them.
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::pin::{Pin, PinFile};
use crate::{Error, Result};

use super::heap::Heap;
use super::{DeviceAddressing, Region, HUGE_PAGE_SIZE, PAGE_SIZE};

/// A memfd of `len` bytes (backed by 2 MiB huge pages with `huge`) whose size is sealed: a
/// backend accepts as guest memory only files that cannot shrink under its mappings (a
/// shrunk file would fault the backend), SPEC.md §11.
fn sealed_memfd(name: &std::ffi::CStr, len: u64, huge: bool) -> Result<File> {
    let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    if huge {
        flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_2MB;
    }
    // SAFETY: the name is NUL-terminated; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        return Err(Error::SharedMemory(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len).map_err(Error::SharedMemory)?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: adds seals to the memfd this function owns; the result is checked.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } != 0 {
        return Err(Error::SharedMemory(std::io::Error::last_os_error()));
    }
    Ok(file)
}

impl Region {
    /// A zeroed region of `len` bytes (rounded up to the page size); with `huge`, backed by
    /// 2 MiB huge pages (the host must have them reserved).
    pub fn new(len: u64, huge: bool) -> Result<Arc<Region>> {
        Self::map(len, huge).map(Arc::new)
    }

    /// As [`Region::new`], not yet shared: the device's address of each page is given later
    /// by whoever makes the region known to it ([`Region::with_device_pages`]).
    pub fn create(len: u64) -> Result<Region> {
        Self::map(len, false)
    }

    /// As [`Region::create`], with 2 MiB huge pages when `huge`.
    pub fn create_with(len: u64, huge: bool) -> Result<Region> {
        Self::map(len, huge)
    }

    /// Maps `file`, `len` bytes of memory another process shares (a memfd it passed), into
    /// this process, at first addressed by the device where it is mapped here. The file must
    /// be sealed against shrinking: a file the other process could shrink would fault this
    /// one when it reads the memory.
    pub fn from_file(file: File, len: u64) -> Result<Region> {
        check_page_range(PAGE_SIZE, len)?;
        // SAFETY: F_GET_SEALS only reads the descriptor's seals; the result is checked.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(Error::InvalidArgument(
                "shared memory must be a memfd sealed against shrinking".into(),
            ));
        }
        let size = file.metadata().map_err(Error::SharedMemory)?.len();
        if size < len {
            return Err(Error::InvalidArgument(format!(
                "shared memory of {size} bytes, {len} announced"
            )));
        }
        Ok(Region {
            base: map_shared(&file, len, false)?,
            file: Some(file),
            len,
            page_size: PAGE_SIZE,
            addressing: DeviceAddressing::SameAsProcess,
            // Nothing is allocated from another process's memory.
            heap: Mutex::new(Heap::new(0)),
            owned: true,
            pin: None,
        })
    }

    /// The region, addressed by the device at `pages`: the address of each of its pages.
    pub fn with_device_pages(mut self, pages: Vec<u64>) -> Result<Region> {
        if pages.len() as u64 != self.len / self.page_size {
            return Err(Error::InvalidArgument(format!(
                "{} device pages for a region of {} pages",
                pages.len(),
                self.len / self.page_size
            )));
        }
        self.addressing = DeviceAddressing::Pages(pages);
        Ok(self)
    }

    /// The region pinned, addressed by the device at its pages' guest-physical addresses (as
    /// [`Region::new_pinned`]).
    pub fn pinned(self, pins: &Arc<PinFile>) -> Result<Region> {
        let (pin, pages) = pin_and_locate(pins, self.addr(), self.len, self.page_size)?;
        let mut region = self.with_device_pages(pages)?;
        region.pin = Some(pin);
        Ok(region)
    }

    /// As [`Region::new`], pinned, with each page's guest-physical address from the pin.
    /// Pinned pages stay in their frames, so the device may keep using these addresses for as
    /// long as the region lives.
    pub fn new_pinned(pins: &Arc<PinFile>, len: u64, huge: bool) -> Result<Arc<Region>> {
        Self::map(len, huge)?.pinned(pins).map(Arc::new)
    }

    /// Makes `addr..addr + len` (page-aligned) of this process's memory shared with a
    /// backend in direct attach, in place: its bytes are copied into a new memfd, which is
    /// then mapped over the same addresses. The program sees the same bytes at the same
    /// addresses, now in memory the backend can map too.
    ///
    /// # Safety
    /// The range must be memory of this process that nothing writes during the call (writes
    /// between the copy and the remap would be lost) and that the program does not unmap or
    /// remap while the device uses it.
    pub unsafe fn share_in_place(addr: u64, len: u64) -> Result<Region> {
        check_page_range(addr, len)?;
        let file = sealed_memfd(c"vrdma-user-memory", len, false)?;
        let fd = file.as_raw_fd();
        // The kernel copies out of the program's memory, so an unmapped or unreadable range is
        // an EFAULT here rather than a crash.
        let mut copied = 0;
        while copied < len {
            // SAFETY: write() reads `len - copied` bytes at `addr + copied` through the
            // kernel, which checks the range; nothing in this process is dereferenced.
            let n = unsafe {
                libc::pwrite(
                    fd,
                    (addr + copied) as *const libc::c_void,
                    (len - copied) as usize,
                    copied as libc::off_t,
                )
            };
            if n <= 0 {
                return Err(Error::SharedMemory(std::io::Error::last_os_error()));
            }
            copied += n as u64;
        }
        // SAFETY: replaces the caller's range (page-aligned, checked above) with a shared
        // mapping of a file holding the same bytes; per the contract nothing else relies on
        // the old pages.
        let ptr = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::SharedMemory(std::io::Error::last_os_error()));
        }
        Ok(Self::program_memory(
            Some(file),
            addr,
            len,
            DeviceAddressing::SameAsProcess,
        ))
    }

    /// Makes `addr..addr + len` (page-aligned) of this process's memory reachable by the
    /// device of a VM, in place: the pages are pinned and the device is given their
    /// guest-physical addresses.
    ///
    /// # Safety
    /// The range must stay mapped, as it is, while the device uses it.
    pub unsafe fn pin_in_place(pins: &Arc<PinFile>, addr: u64, len: u64) -> Result<Arc<Region>> {
        check_page_range(addr, len)?;
        let (pin, pages) = pin_and_locate(pins, addr, len, PAGE_SIZE)?;
        let mut region = Self::program_memory(None, addr, len, DeviceAddressing::Pages(pages));
        region.pin = Some(pin);
        Ok(Arc::new(region))
    }

    fn program_memory(
        file: Option<File>,
        addr: u64,
        len: u64,
        addressing: DeviceAddressing,
    ) -> Region {
        Region {
            file,
            base: NonNull::new(addr as *mut u8).expect("checked to be page-aligned and nonzero"),
            len,
            page_size: PAGE_SIZE,
            addressing,
            heap: Mutex::new(Heap::new(0)),
            owned: false,
            pin: None,
        }
    }

    pub(super) fn map(len: u64, huge: bool) -> Result<Region> {
        let page_size = if huge { HUGE_PAGE_SIZE } else { PAGE_SIZE };
        let len = len.max(page_size).next_multiple_of(page_size);
        let file = sealed_memfd(c"vrdma-guest", len, huge)?;
        Ok(Region {
            base: map_shared(&file, len, huge)?,
            file: Some(file),
            len,
            page_size,
            addressing: DeviceAddressing::SameAsProcess,
            heap: Mutex::new(Heap::new(len)),
            owned: true,
            pin: None,
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: the mapping made in `map`; buffers hold an Arc of the region, so none
            // is left.
            unsafe { libc::munmap(self.base.as_ptr().cast(), self.len as usize) };
        } else if let DeviceAddressing::Pages(_) = self.addressing {
            // The program's memory stays as it is, only no longer locked for the device.
            // SAFETY: unlocking pages has no effect on their contents or mapping.
            unsafe { libc::munlock(self.base.as_ptr().cast(), self.len as usize) };
        }
    }
}

/// A shared mapping of the first `len` bytes of `file` (which cannot shrink below them) at an
/// address the kernel chooses. With `populate`, its pages are taken now: huge pages, so that
/// too few reserved fails here, not later as a SIGBUS. Base pages come as they are first
/// touched: a region's memory is paid for by what uses it (a QP's rings), not all at once by
/// whichever call made it grow.
fn map_shared(file: &File, len: u64, populate: bool) -> Result<NonNull<u8>> {
    let populate = if populate { libc::MAP_POPULATE } else { 0 };
    // SAFETY: a new shared mapping at a kernel-chosen address, of a file the caller checked
    // covers it; the result is checked.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | populate,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(Error::SharedMemory(std::io::Error::last_os_error()));
    }
    Ok(NonNull::new(ptr.cast()).expect("mmap never returns page 0"))
}

fn check_page_range(addr: u64, len: u64) -> Result<()> {
    if addr == 0 || !addr.is_multiple_of(PAGE_SIZE) || len == 0 || !len.is_multiple_of(PAGE_SIZE) {
        return Err(Error::InvalidArgument(format!(
            "{addr:#x}+{len:#x} is not a range of whole pages"
        )));
    }
    addr.checked_add(len)
        .map(|_| ())
        .ok_or_else(|| Error::InvalidArgument(format!("{addr:#x}+{len:#x} overflows")))
}

/// Pins `addr..addr + len` and returns the pin with the guest-physical address of each of
/// its pages of `page_size` bytes (a huge page's is its first 4 KiB page's).
fn pin_and_locate(
    pins: &Arc<PinFile>,
    addr: u64,
    len: u64,
    page_size: u64,
) -> Result<(Pin, Vec<u64>)> {
    let (pin, frames) = Pin::new(pins, addr, len)?;
    let step = (page_size / PAGE_SIZE) as usize;
    Ok((pin, frames.into_iter().step_by(step.max(1)).collect()))
}
