//! A region's addresses (its own and the device's), reads of it, and the buffers carved from
//! it.
use std::fs::File;
use std::sync::Arc;

use crate::{Error, Result};

use super::{DeviceAddressing, Region, SharedBuffer};

impl Region {
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
    pub(super) fn device_pages(&self, offset: u64, len: u64) -> impl Iterator<Item = u64> + '_ {
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
    pub(super) fn device_range(&self, offset: u64, len: u64) -> Option<u64> {
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
