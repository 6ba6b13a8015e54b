//! A region's allocator: a page list, and pages set aside for small buffers.

use super::PAGE_SIZE;

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
pub(super) struct Heap {
    pages: FreeList,
    small: FreeList,
}

impl Heap {
    pub(super) fn new(size: u64) -> Self {
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

    pub(super) fn alloc(&mut self, len: u64, align: u64) -> Option<u64> {
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

    pub(super) fn release(&mut self, offset: u64, len: u64, align: u64) {
        if Self::is_small(len, align) {
            self.small.release(offset, Self::small_len(len, align));
        } else {
            self.pages.release(offset, len.next_multiple_of(PAGE_SIZE));
        }
    }
}

#[cfg(test)]
mod tests;
