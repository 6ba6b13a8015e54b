//! Guest pages laid out contiguously in the backend's address space for the NIC to register.
//!
//! Pages that are one run of guest-physical memory are already contiguous in the backend's
//! own mapping of that guest RAM region ([`with_pages_contiguous`] uses it as is). Any other
//! list is mapped afresh, and every run of pages that is not adjacent in the backing file
//! costs one kernel mapping; a process has a fixed number of them (`vm.max_map_count`) for
//! everything it does. Guests choose their page lists, so those mappings are drawn from a
//! process-wide [`MapBudget`], and the device holds them only while it registers an MR
//! (registration pins the pages).

use std::collections::BTreeMap;
use std::io;
use std::marker::PhantomData;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::guest_faults::{FaultDomain, WatchedMapping};
use crate::hostverbs::PinnedMemory;
use crate::mtt::{MttError, PageRun};

/// Calls `register` with `runs` of pages (each `page_size` bytes) laid out contiguously in
/// this process: inside the backend's mapping of guest RAM when they are one guest-physical
/// run, else in a [`GuestPagesMapping`] that lives for the call (watched for faults as the
/// guest `faults`' memory). `populated` tracks what of the backend's mapping of guest RAM is
/// in its page tables already.
pub fn with_pages_contiguous<M: GuestMemoryBackend, T>(
    mem: &M,
    (runs, page_size): (&[PageRun], u64),
    populated: &mut PopulatedRanges,
    faults: &Arc<FaultDomain>,
    register: impl FnOnce(&dyn PinnedMemory) -> T,
) -> Result<T, MttError> {
    if let [run] = runs {
        if let Some(span) = RegionSpan::of(mem, run, page_size) {
            let start = run.gpa;
            for gap in populated.gaps(start..start + span.len as u64) {
                #[expect(
                    clippy::cast_possible_truncation,
                    reason = "the gap lies in start..start + span.len: both ends are at most \
                              span.len, a usize"
                )]
                let range = (gap.start - start) as usize..(gap.end - start) as usize;
                if span.populate(range) {
                    populated.insert(gap);
                }
            }
            return Ok(register(&span));
        }
    }
    let mapping = GuestPagesMapping::new(runs, page_size, faults)?;
    Ok(register(&*mapping))
}

/// Guest-physical ranges whose pages the backend's mapping of guest RAM has in its page
/// tables, so a registration over them skips populating, which walks every page again.
/// Only a speed-up: a range the kernel has unmapped since (reclaim, a guest's discard) is
/// faulted in by the registration itself.
#[derive(Debug, Default)]
pub struct PopulatedRanges {
    /// Start -> end (exclusive); disjoint and never adjacent.
    ranges: BTreeMap<u64, u64>,
}

impl PopulatedRanges {
    /// The parts of `range` not populated yet, in order.
    pub fn gaps(&self, range: Range<u64>) -> Vec<Range<u64>> {
        let mut gaps = Vec::new();
        if range.is_empty() {
            return gaps;
        }
        let mut at = range.start;
        let reaching_in = self.ranges.range(..=range.start).next_back();
        let starting_in = self.ranges.range(range.start + 1..range.end);
        for (&start, &end) in reaching_in.into_iter().chain(starting_in) {
            if start > at {
                gaps.push(at..start);
            }
            at = at.max(end);
            if at >= range.end {
                return gaps;
            }
        }
        gaps.push(at..range.end);
        gaps
    }

    /// Records `range` as populated.
    pub fn insert(&mut self, range: Range<u64>) {
        if range.is_empty() {
            return;
        }
        let (mut start, mut end) = (range.start, range.end);
        if let Some((&before, &before_end)) = self.ranges.range(..=start).next_back() {
            if before_end >= start {
                start = before;
                end = end.max(before_end);
            }
        }
        let absorbed: Vec<u64> = self.ranges.range(start..=end).map(|(&s, _)| s).collect();
        for s in absorbed {
            end = end.max(self.ranges.remove(&s).expect("listed just now"));
        }
        self.ranges.insert(start, end);
    }

    /// Forgets everything: the guest's memory table changed, and with it the mappings.
    pub fn clear(&mut self) {
        self.ranges.clear();
    }
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
// SAFETY: `&self` gives no access but through raw pointers into shared guest memory, which
// other threads and the guest may touch at any time anyway.
unsafe impl Sync for RegionSpan<'_> {}

impl<'a> RegionSpan<'a> {
    /// The span covering `run` in the region that holds it, if the backend has it mapped.
    fn of<M: GuestMemoryBackend>(mem: &'a M, run: &PageRun, page_size: u64) -> Option<Self> {
        let len = run.pages.checked_mul(page_size)?;
        let (region, start) = mem.to_region_addr(GuestAddress(run.gpa))?;
        let fits = start
            .0
            .checked_add(len)
            .is_some_and(|end| end <= region.len());
        if !fits {
            return None;
        }
        let base = region.get_host_address(start).ok()?;
        Some(RegionSpan {
            base: NonNull::new(base)?,
            len: usize::try_from(len).ok()?,
            _mem: PhantomData,
        })
    }

    /// Maps the span's bytes `range` (page-aligned) into the page tables many pages at a
    /// time (fault-around), where registration would fault them in one by one. Only a
    /// speed-up: on a kernel without MADV_POPULATE_READ, registration faults them itself.
    /// Returns whether the pages are in the page tables now.
    fn populate(&self, range: Range<usize>) -> bool {
        debug_assert!(range.end <= self.len);
        // SAFETY: the range lies inside a mapping of guest RAM that outlives `self`;
        // populating it changes no contents.
        unsafe {
            libc::madvise(
                self.base.as_ptr().add(range.start).cast(),
                range.len(),
                libc::MADV_POPULATE_READ,
            ) == 0
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
/// guest's memory table changes; it is unmapped when dropped. A fault in it ends its guest
/// ([`crate::guest_faults`]), as one in the guest's RAM does.
pub struct GuestPagesMapping {
    base: NonNull<u8>,
    len: usize,
    _reservation: MapReservation,
    /// The range on the list of guest memory, from when it is mapped until this value
    /// drops (after `Drop::drop` unmapped it).
    _watched: Option<WatchedMapping>,
}

// SAFETY: the mapping is plain shared memory owned by this value; accesses go through raw
// pointers (the NIC, bounds-checked copies), as for any MR's memory.
unsafe impl Send for GuestPagesMapping {}
// SAFETY: `&self` gives no access but through raw pointers (and bounds-checked copies) into
// shared memory that the NIC and the guest touch at any time anyway.
unsafe impl Sync for GuestPagesMapping {}

impl GuestPagesMapping {
    /// Maps `runs` of pages (each `page_size` bytes, a power of two) contiguously, with the
    /// start aligned to `page_size` so that huge pages map as huge pages, as the guest
    /// `faults`' memory; the mappings come from the process-wide budget.
    pub fn new(
        runs: &[PageRun],
        page_size: u64,
        faults: &Arc<FaultDomain>,
    ) -> Result<Arc<Self>, MttError> {
        Self::new_within(MapBudget::process(), (runs, page_size), faults)
    }

    /// As [`new`](Self::new), with mappings drawn from `budget`.
    pub fn new_within(
        budget: &'static MapBudget,
        (runs, page_size): (&[PageRun], u64),
        faults: &Arc<FaultDomain>,
    ) -> Result<Arc<Self>, MttError> {
        let map_err = |e: io::Error| MttError::Map(e.raw_os_error().unwrap_or(libc::EIO));
        let too_large = || MttError::Map(libc::ENOMEM);
        if runs.is_empty() || !page_size.is_power_of_two() {
            return Err(MttError::Map(libc::EINVAL));
        }
        let file_runs = file_runs(runs, page_size);
        let reservation = budget.reserve(file_runs.len())?;
        let pages = runs
            .iter()
            .try_fold(0u64, |total, run| total.checked_add(run.pages))
            .ok_or_else(too_large)?;
        let len = pages
            .checked_mul(page_size)
            .and_then(|len| usize::try_from(len).ok())
            .ok_or_else(too_large)?;
        let page_size = usize::try_from(page_size).map_err(|_| too_large())?;
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
        let mut mapping = GuestPagesMapping {
            base: NonNull::new(base as *mut u8).expect("mmap never returns page 0"),
            len,
            _reservation: reservation,
            _watched: None,
        };
        let mut at = base;
        for run in &file_runs {
            let offset = libc::off_t::try_from(run.offset).map_err(|_| too_large())?;
            // The runs' pages add up to `len`, so neither this nor `at` overflows.
            #[expect(
                clippy::cast_possible_truncation,
                reason = "the runs' pages add up to len, a usize"
            )]
            let run_len = run.pages as usize * page_size;
            // SAFETY: the target range lies inside this value's reserved range (replaced in
            // place by MAP_FIXED, so no other mapping is touched); the fd is open for the
            // call and the kernel keeps its own reference to the file.
            let mapped = unsafe {
                libc::mmap(
                    at as *mut libc::c_void,
                    run_len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    // Populating here maps the pages many at a time (fault-around);
                    // registration would otherwise fault them in one by one.
                    libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE,
                    run.file.as_raw_fd(),
                    offset,
                )
            };
            if mapped == libc::MAP_FAILED {
                // `mapping` unmaps the whole range when dropped here.
                return Err(map_err(io::Error::last_os_error()));
            }
            at += run_len;
        }
        mapping._watched = Some(
            faults
                .watch(base, len, page_size)
                .map_err(|_| MttError::Map(libc::ENOMEM))?,
        );
        Ok(Arc::new(mapping))
    }
}

/// `runs` with neighbours that are adjacent in one backing file merged (guest RAM split
/// into regions around a hole is one file): each is one mapping.
fn file_runs(runs: &[PageRun], page_size: u64) -> Vec<PageRun> {
    let mut merged: Vec<PageRun> = Vec::new();
    for run in runs {
        match merged.last_mut() {
            Some(last)
                if Arc::ptr_eq(&last.file, &run.file)
                    && Some(run.offset) == last.offset.checked_add(last.pages * page_size) =>
            {
                last.pages += run.pages;
            }
            _ => merged.push(run.clone()),
        }
    }
    merged
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // lists of ranges, some of one
    fn populated_ranges_merge_and_leave_exactly_the_gaps() {
        let mut populated = PopulatedRanges::default();
        assert_eq!(populated.gaps(0..100), [0..100]);
        populated.insert(10..20);
        populated.insert(30..40);
        assert_eq!(populated.gaps(0..50), [0..10, 20..30, 40..50]);
        assert_eq!(populated.gaps(12..18), []);
        assert_eq!(populated.gaps(15..35), [20..30]);
        assert_eq!(populated.gaps(20..30), [20..30]);
        assert_eq!(populated.gaps(5..5), []);
        // Adjacent and overlapping ranges merge into one.
        populated.insert(20..30);
        assert_eq!(populated.ranges.len(), 1);
        populated.insert(5..12);
        populated.insert(38..45);
        assert_eq!(populated.ranges, BTreeMap::from([(5, 45)]));
        populated.insert(0..100);
        assert_eq!(populated.ranges, BTreeMap::from([(0, 100)]));
        assert_eq!(populated.gaps(90..u64::MAX), [100..u64::MAX]);
        populated.clear();
        assert_eq!(populated.gaps(0..10), [0..10]);
    }
}
