//! The regions of one transport: allocation across them (growing by a region when they are
//! full), where the device finds a range's pages, and program memory shared in place.
use std::sync::{Arc, Mutex};

use crate::{Error, Result};

use super::{Region, SharedBuffer, PAGE_SIZE};

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

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Region>>> {
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
