//! Memory shared with the device: memfd regions mapped into this process.
//!
//! How the device addresses a region depends on the transport. In direct attach the region is
//! handed to the backend through the vhost-user memory table with its address in this process
//! as its guest-physical address, so a buffer's "guest virtual" and "guest physical" addresses
//! are one and the same. Inside a VM a region is pinned ([`crate::pin`]), which also gives
//! each of its pages' guest-physical address.
//!
//! This module and `mmio` hold guest-lib's `unsafe`: mapping, and access to memory the device
//! also writes.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8};
use std::sync::{Arc, Mutex};

use crate::pin::{Pin, PinFile};
use crate::{Error, Result};

/// 4 KiB: the page size guest-lib describes memory in.
pub const PAGE_SIZE: u64 = 4096;
const HUGE_PAGE_SIZE: u64 = 2 << 20;

/// First-fit free list over `0..size`, kept sorted and coalesced.
#[derive(Debug)]
struct FreeList {
    free: Vec<(u64, u64)>,
}

impl FreeList {
    fn new(size: u64) -> Self {
        FreeList {
            free: vec![(0, size)],
        }
    }

    /// An `align`-aligned range of `len` bytes, if one is free.
    fn alloc(&mut self, len: u64, align: u64) -> Option<u64> {
        for i in 0..self.free.len() {
            let (start, size) = self.free[i];
            let aligned = start.next_multiple_of(align);
            let end = start + size;
            if aligned.checked_add(len).is_some_and(|e| e <= end) {
                self.free.remove(i);
                if aligned + len < end {
                    self.free.insert(i, (aligned + len, end - aligned - len));
                }
                if aligned > start {
                    self.free.insert(i, (start, aligned - start));
                }
                return Some(aligned);
            }
        }
        None
    }

    fn release(&mut self, offset: u64, len: u64) {
        let i = self.free.partition_point(|&(s, _)| s < offset);
        self.free.insert(i, (offset, len));
        // Merge with the neighbour after, then the one before.
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }
}

/// A region's allocator. The page list hands out whole pages only; buffers smaller than a page
/// and aligned to less than one (doorbell records) are carved from pages set aside for them.
/// So no fragment lies between whole pages, and a page-aligned allocation finds room at the
/// front of the page list instead of scanning one fragment per earlier small buffer.
#[derive(Debug)]
struct Heap {
    pages: FreeList,
    small: FreeList,
}

impl Heap {
    fn new(size: u64) -> Self {
        Heap {
            pages: FreeList::new(size),
            small: FreeList { free: Vec::new() },
        }
    }

    fn is_small(len: u64, align: u64) -> bool {
        len < PAGE_SIZE && align < PAGE_SIZE
    }

    /// What a small buffer takes: a multiple of its alignment, so that carving leaves no gap
    /// too small for the next buffer of its kind (a 16-byte record aligned to 64 would leave
    /// a 48-byte fragment behind each).
    fn small_len(len: u64, align: u64) -> u64 {
        len.next_multiple_of(align.max(1))
    }

    fn alloc(&mut self, len: u64, align: u64) -> Option<u64> {
        if !Self::is_small(len, align) {
            return self.pages.alloc(
                len.checked_next_multiple_of(PAGE_SIZE)?,
                align.max(PAGE_SIZE),
            );
        }
        let len = Self::small_len(len, align);
        if let Some(offset) = self.small.alloc(len, align) {
            return Some(offset);
        }
        // Small buffers keep the pages they were given: they are few, and reused.
        let page = self.pages.alloc(PAGE_SIZE, PAGE_SIZE)?;
        self.small.release(page, PAGE_SIZE);
        self.small.alloc(len, align)
    }

    fn release(&mut self, offset: u64, len: u64, align: u64) {
        if Self::is_small(len, align) {
            self.small.release(offset, Self::small_len(len, align));
        } else {
            self.pages.release(offset, len.next_multiple_of(PAGE_SIZE));
        }
    }
}

/// How the device addresses a region's memory.
#[derive(Debug)]
enum DeviceAddressing {
    /// At this process's addresses (direct attach).
    SameAsProcess,
    /// Page by page, at these guest-physical addresses (inside a VM).
    Pages(Vec<u64>),
}

/// Memory this process shares with the device: a memfd mapped for guest-lib's own buffers,
/// or memory of the program's that was made shareable in place (`share_in_place`,
/// `pin_in_place`), which guest-lib never allocates from nor unmaps.
pub struct Region {
    /// The memfd behind the memory, when there is one (not for pinned program memory).
    file: Option<File>,
    base: NonNull<u8>,
    len: u64,
    page_size: u64,
    addressing: DeviceAddressing,
    heap: Mutex<Heap>,
    /// Whether dropping the region unmaps it (guest-lib's own) or leaves it mapped (the
    /// program's).
    owned: bool,
    /// The pin that keeps the pages where the device was told they are (inside a VM), until
    /// the region is dropped.
    pin: Option<Pin>,
}

// SAFETY: the mapping is plain shared memory; all access goes through bounds-checked copies or
// atomics, and the free list is behind a mutex.
unsafe impl Send for Region {}
// SAFETY: `&self` methods copy with bounds checks or use atomics on shared memory the device
// writes at any time anyway, and take the mutex for the free list.
unsafe impl Sync for Region {}

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

    fn map(len: u64, huge: bool) -> Result<Region> {
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

    /// The region's address in this process.
    pub fn addr(&self) -> u64 {
        self.base.as_ptr() as u64
    }

    /// Size in bytes; never zero.
    pub fn size(&self) -> u64 {
        self.len
    }

    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// The memfd behind the region; `None` for program memory pinned in a VM.
    pub fn file(&self) -> Option<&File> {
        self.file.as_ref()
    }

    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr()
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr() + self.len)
    }

    /// The device's address of each page of `offset..offset + len`.
    fn device_pages(&self, offset: u64, len: u64) -> impl Iterator<Item = u64> + '_ {
        let first = offset / self.page_size * self.page_size;
        (first..offset + len.max(1))
            .step_by(self.page_size as usize)
            .map(move |page| match &self.addressing {
                DeviceAddressing::SameAsProcess => self.addr() + page,
                DeviceAddressing::Pages(pages) => pages[(page / self.page_size) as usize],
            })
    }

    /// The device's address of `offset..offset + len` when the device sees it as one
    /// contiguous range.
    fn device_range(&self, offset: u64, len: u64) -> Option<u64> {
        let mut pages = self.device_pages(offset, len);
        let first = pages.next()?;
        let contiguous = pages
            .enumerate()
            .all(|(i, page)| page == first + (i as u64 + 1) * self.page_size);
        contiguous.then_some(first + offset % self.page_size)
    }

    /// Each run of the region's pages that the device sees back to back, as `(device
    /// address, offset in the region, length)`.
    pub fn device_runs(&self) -> Vec<(u64, u64, u64)> {
        let mut runs: Vec<(u64, u64, u64)> = Vec::new();
        for (index, page) in self.device_pages(0, self.len).enumerate() {
            match runs.last_mut() {
                Some((start, _, len)) if *start + *len == page => *len += self.page_size,
                _ => runs.push((page, index as u64 * self.page_size, self.page_size)),
            }
        }
        runs
    }

    /// Fails unless `offset..offset + len` lies inside the region.
    fn check_span(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Copies the bytes at `offset` out of the region.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_span(offset, out.len() as u64)?;
        // SAFETY: `offset..offset + out.len()` is inside the mapping (checked), which cannot
        // overlap `out`; the bytes are plain memory, whatever another process writes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.as_ptr().add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// A buffer over `offset..offset + len` of the region as it is, neither zeroed nor taken
    /// from its heap: memory another process laid out, such as the service's notify area.
    pub fn view(self: &Arc<Self>, offset: u64, len: u64) -> Result<SharedBuffer> {
        self.check_span(offset, len)?;
        Ok(SharedBuffer {
            region: Arc::clone(self),
            offset,
            len,
            align: 1,
            pooled: false,
        })
    }

    /// A zeroed buffer of `len` bytes aligned to `align` (a power of two), if there is room.
    pub fn alloc(self: &Arc<Self>, len: u64, align: u64) -> Option<SharedBuffer> {
        let len = len.max(1).next_multiple_of(8);
        let offset = self
            .heap
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .alloc(len, align)?;
        let buffer = SharedBuffer {
            region: Arc::clone(self),
            offset,
            len,
            align,
            pooled: true,
        };
        buffer.zero();
        Some(buffer)
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

/// A piece of shared memory; returned to its region when dropped.
pub struct SharedBuffer {
    region: Arc<Region>,
    offset: u64,
    len: u64,
    /// The alignment it was allocated with, which says which pool it returns to.
    align: u64,
    /// Whether it came from the region's heap (and goes back to it), or is a view.
    pooled: bool,
}

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBuffer({:#x}+{:#x})", self.addr(), self.len)
    }
}

impl SharedBuffer {
    /// The buffer's address in this process: the guest-virtual address verbs speak of.
    pub fn addr(&self) -> u64 {
        self.region.addr() + self.offset
    }

    /// The device's (guest-physical) address of the buffer, for structures the device finds
    /// by one address: virtqueues, doorbell records, page-list pages.
    pub fn device_addr(&self) -> Result<u64> {
        self.region
            .device_range(self.offset, self.len)
            .ok_or(Error::NotContiguous {
                addr: self.addr(),
                len: self.len,
            })
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn ptr(&self, offset: u64, len: u64) -> Result<*mut u8> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {
                // SAFETY: offset + len is inside the buffer, which is inside the mapping.
                Ok(unsafe {
                    self.region
                        .base
                        .as_ptr()
                        .add((self.offset + offset) as usize)
                })
            }
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Copies `data` into the buffer at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        let dst = self.ptr(offset, data.len() as u64)?;
        // SAFETY: `dst` has room for `data` (checked) and cannot overlap it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` out of the buffer.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let src = self.ptr(offset, out.len() as u64)?;
        // SAFETY: as in `write`, in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn zero(&self) {
        let dst = self.ptr(0, self.len).expect("whole buffer");
        // SAFETY: the whole buffer is writable.
        unsafe { std::ptr::write_bytes(dst, 0, self.len as usize) };
    }

    /// The byte at `offset` as an atomic shared with the device.
    pub fn atomic_u8(&self, offset: u64) -> Result<&AtomicU8> {
        let ptr = self.ptr(offset, 1)?;
        // SAFETY: in bounds and valid for as long as `self`; AtomicU8 has the layout of u8.
        Ok(unsafe { AtomicU8::from_ptr(ptr) })
    }

    /// The `u16` at `offset` (2-byte aligned) as an atomic shared with the device.
    pub fn atomic_u16(&self, offset: u64) -> Result<&AtomicU16> {
        let ptr = self.ptr(offset, 2)?;
        if !(ptr as usize).is_multiple_of(2) {
            return Err(Error::OutOfBounds {
                offset,
                len: 2,
                size: self.len,
            });
        }
        // SAFETY: aligned, in bounds, and valid for as long as `self` (which keeps the region
        // mapped); AtomicU16 has the layout of u16 and any bit pattern is valid.
        Ok(unsafe { AtomicU16::from_ptr(ptr.cast()) })
    }

    /// The `u32` at `offset` (4-byte aligned) as an atomic shared with the device.
    pub fn atomic_u32(&self, offset: u64) -> Result<&AtomicU32> {
        let ptr = self.ptr(offset, 4)?;
        if !(ptr as usize).is_multiple_of(4) {
            return Err(Error::OutOfBounds {
                offset,
                len: 4,
                size: self.len,
            });
        }
        // SAFETY: as in `atomic_u16`.
        Ok(unsafe { AtomicU32::from_ptr(ptr.cast()) })
    }

    pub fn atomic_u64(&self, offset: u64) -> Result<&AtomicU64> {
        let ptr = self.ptr(offset, 8)?;
        if !(ptr as usize).is_multiple_of(8) {
            return Err(Error::OutOfBounds {
                offset,
                len: 8,
                size: self.len,
            });
        }
        // SAFETY: as in `atomic_u16`.
        Ok(unsafe { AtomicU64::from_ptr(ptr.cast()) })
    }
}

/// The regions of one transport: where its buffers come from and how the device addresses
/// them.
#[derive(Default)]
pub struct RegionSet {
    regions: Mutex<Vec<Arc<Region>>>,
    /// Held through [`RegionSet::share`], so that two registrations of overlapping program
    /// memory cannot both remap the same page.
    sharing: Mutex<()>,
}

impl RegionSet {
    pub fn add(&self, region: Arc<Region>) {
        self.lock().push(region);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Region>>> {
        self.regions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes of the regions buffers are allocated from (not those of program memory shared
    /// in place).
    pub fn owned_bytes(&self) -> u64 {
        self.lock()
            .iter()
            .filter(|region| region.owned)
            .map(|region| region.len)
            .sum()
    }

    /// A buffer from the regions there are, if one has room.
    pub fn alloc(&self, len: u64, align: u64) -> Option<SharedBuffer> {
        self.lock().iter().find_map(|r| r.alloc(len, align))
    }

    /// A buffer from the regions there are or, when none has room, from a new region of at
    /// least `min_region` bytes that `new_region` makes (and makes known to the device).
    pub fn alloc_or_grow(
        &self,
        len: u64,
        align: u64,
        min_region: u64,
        new_region: impl FnOnce(u64) -> Result<Arc<Region>>,
    ) -> Result<SharedBuffer> {
        if let Some(buffer) = self.alloc(len, align) {
            return Ok(buffer);
        }
        let size = len
            .checked_add(align)
            .ok_or(Error::OutOfSharedMemory(len))?
            .max(min_region);
        let region = new_region(size)?;
        let buffer = region
            .alloc(len, align)
            .ok_or(Error::OutOfSharedMemory(len))?;
        self.add(region);
        Ok(buffer)
    }

    /// The page size and the device's address of every page of `addr..addr + len`, or
    /// `None` when some of the range is not shared, or it spans regions of different page
    /// sizes.
    pub fn device_pages(&self, addr: u64, len: u64) -> Option<(u64, Vec<u64>)> {
        let regions = self.lock();
        let end = addr.checked_add(len.max(1))?;
        let first = regions.iter().find(|r| r.contains(addr, 1))?;
        let page_size = first.page_size;
        let mut pages = Vec::new();
        let mut at = addr;
        // Region by region, for ranges that run on into an adjacent region.
        while at < end {
            let region = regions
                .iter()
                .find(|r| r.contains(at, 1) && r.page_size == page_size)?;
            let piece = (region.addr() + region.len).min(end) - at;
            // Regions are page-aligned: every piece after the first starts on a page.
            pages.extend(region.device_pages(at - region.addr(), piece));
            at += piece;
        }
        Some((page_size, pages))
    }

    /// Makes `addr..addr + len` of this process's memory reachable by the device, in place:
    /// every whole page of it not shared yet goes into a region `share` makes (and makes
    /// known to the device). Pages already shared stay as they are.
    ///
    /// # Safety
    /// As for [`Region::share_in_place`], which `share` is expected to call.
    pub unsafe fn share(
        &self,
        addr: u64,
        len: u64,
        share: impl Fn(u64, u64) -> Result<Arc<Region>>,
    ) -> Result<()> {
        let start = addr / PAGE_SIZE * PAGE_SIZE;
        let end = addr
            .checked_add(len.max(1))
            .and_then(|end| end.checked_next_multiple_of(PAGE_SIZE))
            .ok_or_else(|| Error::InvalidArgument(format!("{addr:#x}+{len:#x} overflows")))?;
        let _sharing = self.sharing.lock().unwrap_or_else(|e| e.into_inner());
        let mut page = start;
        while page < end {
            if self.lock().iter().any(|r| r.contains(page, 1)) {
                page += PAGE_SIZE;
                continue;
            }
            let mut run_end = page + PAGE_SIZE;
            while run_end < end && !self.lock().iter().any(|r| r.contains(run_end, 1)) {
                run_end += PAGE_SIZE;
            }
            self.add(share(page, run_end - page)?);
            page = run_end;
        }
        Ok(())
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        if !self.pooled {
            return;
        }
        self.region
            .heap
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .release(self.offset, self.len, self.align);
    }
}

#[cfg(test)]
mod tests;
