//! Guest pages laid out contiguously in the backend's address space for the NIC to register.
//!
//! Pages that are one run of guest-physical memory are already contiguous in the backend's
//! own mapping of that guest RAM region ([`with_pages_contiguous`] uses it as is). Any other
//! list is mapped afresh, and every run of pages that is not adjacent in the backing file
//! costs one kernel mapping; a process has a fixed number of them (`vm.max_map_count`) for
//! everything it does. Guests choose their page lists, so those mappings are drawn from a
//! process-wide [`MapBudget`], and the device holds them only while it registers an MR
//! (registration pins the pages).

use std::io;
use std::marker::PhantomData;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::hostverbs::PinnedMemory;
use crate::mtt::{BackedPage, MttError};

/// Calls `register` with `pages` (each `page_size` bytes) laid out contiguously in this
/// process: inside the backend's mapping of guest RAM when they are one guest-physical run
/// in one region, else in a [`GuestPagesMapping`] that lives for the call.
pub fn with_pages_contiguous<M: GuestMemoryBackend, T>(
    mem: &M,
    pages: &[BackedPage],
    page_size: u64,
    register: impl FnOnce(&dyn PinnedMemory) -> T,
) -> Result<T, MttError> {
    if let Some(span) = RegionSpan::of(mem, pages, page_size) {
        span.populate();
        return Ok(register(&span));
    }
    let mapping = GuestPagesMapping::new(pages, page_size)?;
    Ok(register(&*mapping))
}

/// A range of the backend's mapping of one guest RAM region, borrowed from the memory table
/// snapshot that holds the mapping.
struct RegionSpan<'a> {
    base: NonNull<u8>,
    len: usize,
    _mem: PhantomData<&'a ()>,
}

// SAFETY: plain shared memory of a guest RAM mapping; accesses go through raw pointers, as
// for any MR's memory.
unsafe impl Send for RegionSpan<'_> {}
// SAFETY: as above.
unsafe impl Sync for RegionSpan<'_> {}

impl<'a> RegionSpan<'a> {
    /// The span covering `pages` if they are consecutive guest-physical pages inside one
    /// region that the backend has mapped.
    fn of<M: GuestMemoryBackend>(mem: &'a M, pages: &[BackedPage], page_size: u64) -> Option<Self> {
        let first = pages.first()?.gpa;
        let consecutive = pages
            .windows(2)
            .all(|w| w[0].gpa.checked_add(page_size) == Some(w[1].gpa));
        let len = (pages.len() as u64).checked_mul(page_size)?;
        let (region, start) = mem.to_region_addr(GuestAddress(first))?;
        let fits = start
            .0
            .checked_add(len)
            .is_some_and(|end| end <= region.len());
        if !consecutive || !fits {
            return None;
        }
        let base = region.get_host_address(start).ok()?;
        Some(RegionSpan {
            base: NonNull::new(base)?,
            len: usize::try_from(len).ok()?,
            _mem: PhantomData,
        })
    }

    /// Maps the span's pages into the page tables many at a time (fault-around), where
    /// registration would fault them in one by one. Only a speed-up: on a kernel without
    /// MADV_POPULATE_READ, registration faults them itself.
    fn populate(&self) {
        // SAFETY: the range lies inside a mapping of guest RAM that outlives `self`;
        // populating it changes no contents.
        unsafe {
            libc::madvise(
                self.base.as_ptr().cast(),
                self.len,
                libc::MADV_POPULATE_READ,
            );
        }
    }
}

// SAFETY: the range lies inside the region's mapping (checked in `of`), which the memory
// table snapshot borrowed for 'a keeps mapped at one address.
unsafe impl PinnedMemory for RegionSpan<'_> {
    fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// Guest pages mapped back to back, in page-list order, shared with the guest (MAP_SHARED of
/// the files behind guest RAM): what the NIC writes here, the guest reads.
///
/// The mapping holds its own references to the files' pages, so it stays valid even if the
/// guest's memory table changes; it is unmapped when dropped.
pub struct GuestPagesMapping {
    base: NonNull<u8>,
    len: usize,
    _reservation: MapReservation,
}

// SAFETY: the mapping is plain shared memory owned by this value; accesses go through raw
// pointers (the NIC, bounds-checked copies), as for any MR's memory.
unsafe impl Send for GuestPagesMapping {}
// SAFETY: as above.
unsafe impl Sync for GuestPagesMapping {}

impl GuestPagesMapping {
    /// Maps `pages` (each `page_size` bytes, a power of two) contiguously, with the start
    /// aligned to `page_size` so that huge pages map as huge pages; the mappings come from
    /// the process-wide budget.
    pub fn new(pages: &[BackedPage], page_size: u64) -> Result<Arc<Self>, MttError> {
        Self::new_within(MapBudget::process(), pages, page_size)
    }

    /// As [`new`](Self::new), with mappings drawn from `budget`.
    pub fn new_within(
        budget: &'static MapBudget,
        pages: &[BackedPage],
        page_size: u64,
    ) -> Result<Arc<Self>, MttError> {
        let map_err = |e: io::Error| MttError::Map(e.raw_os_error().unwrap_or(libc::EIO));
        let too_large = || MttError::Map(libc::ENOMEM);
        if pages.is_empty() || !page_size.is_power_of_two() {
            return Err(MttError::Map(libc::EINVAL));
        }
        let reservation = budget.reserve(file_runs(pages, page_size).count())?;
        let page_size = usize::try_from(page_size).map_err(|_| too_large())?;
        let len = pages.len().checked_mul(page_size).ok_or_else(too_large)?;
        let reserved_len = len.checked_add(page_size).ok_or_else(too_large)?;
        // Reserve address space (no memory) with room to align the start.
        // SAFETY: an anonymous PROT_NONE mapping at a kernel-chosen address affects nothing
        // else; the result is checked.
        let reserved = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserved_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if reserved == libc::MAP_FAILED {
            return Err(map_err(io::Error::last_os_error()));
        }
        let reserved = reserved as usize;
        let base = reserved.next_multiple_of(page_size);
        // Give back the slack before and after the aligned range.
        // SAFETY: both ranges lie inside the reservation just made and nothing uses them.
        unsafe {
            if base > reserved {
                libc::munmap(reserved as *mut libc::c_void, base - reserved);
            }
            let tail = reserved + reserved_len - (base + len);
            if tail > 0 {
                libc::munmap((base + len) as *mut libc::c_void, tail);
            }
        }
        let mapping = GuestPagesMapping {
            base: NonNull::new(base as *mut u8).expect("mmap never returns page 0"),
            len,
            _reservation: reservation,
        };
        for Range { start, end } in file_runs(pages, page_size as u64) {
            let offset = libc::off_t::try_from(pages[start].offset).map_err(|_| too_large())?;
            // SAFETY: the target range lies inside this value's reserved range (replaced in
            // place by MAP_FIXED, so no other mapping is touched); the fd is open for the
            // call and the kernel keeps its own reference to the file.
            let mapped = unsafe {
                libc::mmap(
                    (base + start * page_size) as *mut libc::c_void,
                    (end - start) * page_size,
                    libc::PROT_READ | libc::PROT_WRITE,
                    // Populating here maps the pages many at a time (fault-around);
                    // registration would otherwise fault them in one by one.
                    libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE,
                    pages[start].file.as_raw_fd(),
                    offset,
                )
            };
            if mapped == libc::MAP_FAILED {
                // `mapping` unmaps the whole range when dropped here.
                return Err(map_err(io::Error::last_os_error()));
            }
        }
        Ok(Arc::new(mapping))
    }
}

/// Index ranges of `pages` that are consecutive in one file: each is one mapping.
fn file_runs(pages: &[BackedPage], page_size: u64) -> impl Iterator<Item = Range<usize>> + '_ {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= pages.len() {
            return None;
        }
        let mut end = start + 1;
        while end < pages.len()
            && Arc::ptr_eq(&pages[end].file, &pages[start].file)
            && Some(pages[end].offset) == pages[end - 1].offset.checked_add(page_size)
        {
            end += 1;
        }
        let run = start..end;
        start = end;
        Some(run)
    })
}

/// Kernel mappings the backend may hold for guest pages at once, shared by all connections.
pub struct MapBudget {
    limit: usize,
    in_use: AtomicUsize,
}

/// Mappings taken from a [`MapBudget`], given back when dropped.
pub struct MapReservation {
    budget: &'static MapBudget,
    count: usize,
}

impl MapBudget {
    /// A budget of `limit` mappings.
    pub const fn new(limit: usize) -> MapBudget {
        MapBudget {
            limit,
            in_use: AtomicUsize::new(0),
        }
    }

    /// The process's budget: a quarter of `vm.max_map_count`; the rest is left to
    /// everything else, mostly the host provider's queue buffers (two per QP, one per CQ or
    /// SRQ: see [`Quotas`](crate::Quotas)), then threads and guest RAM regions.
    pub fn process() -> &'static MapBudget {
        static BUDGET: OnceLock<MapBudget> = OnceLock::new();
        BUDGET.get_or_init(|| {
            let max_map_count = std::fs::read_to_string("/proc/sys/vm/max_map_count")
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .unwrap_or(65_530);
            MapBudget::new(max_map_count / 4)
        })
    }

    /// Most mappings one registration may take: a quarter of the budget, so that one guest's
    /// scattered list leaves room for others registering at the same time.
    pub fn per_registration(&self) -> usize {
        self.limit / 4
    }

    /// Takes `count` mappings, or says why not.
    pub fn reserve(&'static self, count: usize) -> Result<MapReservation, MttError> {
        let max = self.per_registration();
        if count > max {
            return Err(MttError::TooManyRuns { runs: count, max });
        }
        self.in_use
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |in_use| {
                in_use
                    .checked_add(count)
                    .filter(|&total| total <= self.limit)
            })
            .map_err(|_| MttError::MappingsExhausted { runs: count })?;
        Ok(MapReservation {
            budget: self,
            count,
        })
    }

    pub fn in_use(&self) -> usize {
        self.in_use.load(Ordering::Acquire)
    }
}

impl Drop for MapReservation {
    fn drop(&mut self) {
        self.budget.in_use.fetch_sub(self.count, Ordering::AcqRel);
    }
}

// SAFETY: the range stays mapped, at the same address, until Drop.
unsafe impl PinnedMemory for GuestPagesMapping {
    fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for GuestPagesMapping {
    fn drop(&mut self) {
        // SAFETY: the range is exactly the one reserved in `new`; any MR over it holds an Arc
        // of this value, so none is registered any more.
        if unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) } != 0 {
            log::error!(
                "munmap of guest pages failed: {}",
                io::Error::last_os_error()
            );
        }
    }
}
