//! The data path's accesses to guest memory. Each lies within one memory region (ring pages
//! and records were checked against the memory table when the guest created them), so it
//! goes through that region's own bounds-checked slice. A queue's record and ring pages are
//! looked up once per memory snapshot ([`Resolved`]), not once per visit: vm-memory's region
//! lookup cost more than a WQE's checks, and its generic `Bytes` path, which looks the
//! region up again and splits every access into fragments, more than everything else the
//! poller does per WQE together.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use vm_memory::{
    AtomicAccess, ByteValued, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryError,
    GuestMemoryRegion, VolatileSlice,
};

use vrdma_spec::codec::ring_slot;

use super::queues::GuestRing;
use super::wqe::Slot;
use super::Memory;

type Result<T> = std::result::Result<T, GuestMemoryError>;

/// The `len` bytes at guest-physical `addr`, when they lie in one region.
pub(super) fn slice_at(mem: &Memory, addr: u64, len: usize) -> Result<VolatileSlice<'_>> {
    let addr = GuestAddress(addr);
    let (region, offset) = mem
        .to_region_addr(addr)
        .ok_or(GuestMemoryError::InvalidGuestAddress(addr))?;
    region.get_slice(offset, len)
}

/// An atomic load of the naturally aligned `O` at `addr`.
pub(super) fn load<O: AtomicAccess>(mem: &Memory, addr: u64, order: Ordering) -> Result<O> {
    Ok(slice_at(mem, addr, size_of::<O>())?.load(0, order)?)
}

/// An atomic store of the naturally aligned `O` at `addr`.
pub(super) fn store<O: AtomicAccess>(
    mem: &Memory,
    value: O,
    addr: u64,
    order: Ordering,
) -> Result<()> {
    Ok(slice_at(mem, addr, size_of::<O>())?.store(value, 0, order)?)
}

/// Writes `words` over the whole of `slot` so that the entry appears whole: all its words but
/// the last with volatile writes, then the last with a release store, so a guest that sees
/// the entry's last word change (a CQE's owner byte is in it) with an acquire load also sees
/// the rest of it. False, writing nothing, if the words do not fill the slot exactly or it is
/// misaligned.
#[inline(always)]
fn publish_words<const N: usize>(slot: &VolatileSlice, words: [u64; N]) -> bool {
    if N == 0 || 8 * N != slot.len() {
        return false;
    }
    let guard = slot.ptr_guard_mut();
    let at = guard.as_ptr().cast::<u64>();
    if !at.is_aligned() {
        return false;
    }
    // SAFETY: the words fill the slot exactly (checked above), which stays mapped while
    // `guard` lives, and are 8-byte aligned.
    unsafe { write_entry(at, words) };
    true
}

/// [`publish_words`] into the `N` words at `at`.
///
/// # Safety
/// `at` is 8-byte aligned and its `N` words lie in guest memory mapped for the call, which
/// the guest only ever accesses atomically or by volatile copies.
#[inline(always)]
unsafe fn write_entry<const N: usize>(at: *mut u64, words: [u64; N]) {
    for (word, value) in words[..N - 1].iter().enumerate() {
        // SAFETY: inside the entry, per the function's contract.
        unsafe { at.add(word).write_volatile(*value) };
    }
    // SAFETY: the entry's last word, 8-byte aligned and mapped for the call per the
    // function's contract; the guest reads it only atomically, so an atomic view is sound.
    let last = unsafe { AtomicU64::from_ptr(at.add(N - 1)) };
    last.store(words[N - 1], Ordering::Release);
}

/// A slot in guest memory, read in place: a wire struct at an offset aligned for it (every
/// field of a WQE is) with one volatile read, anything else copied through vm-memory.
impl Slot for VolatileSlice<'_> {
    #[inline(always)]
    fn field<T: ByteValued + Default>(&self, offset: usize) -> Option<T> {
        if offset.checked_add(size_of::<T>())? > self.len() {
            return None;
        }
        let guard = self.ptr_guard();
        let at = guard.as_ptr().wrapping_add(offset).cast::<T>();
        if !at.is_aligned() {
            let mut value = T::default();
            self.subslice(offset, size_of::<T>())
                .ok()?
                .copy_to(value.as_mut_slice());
            return Some(value);
        }
        // SAFETY: `T` lies inside the slice (checked above), which stays mapped while `guard`
        // lives, and is aligned; it is plain data, valid for any bytes, so a guest writing
        // it meanwhile only changes which value is read.
        Some(unsafe { at.read_volatile() })
    }

    #[inline(always)]
    fn field_head<T: ByteValued + Default>(&self, offset: usize, len: usize) -> Option<T> {
        if len > size_of::<T>() || !len.is_multiple_of(8) || offset.checked_add(len)? > self.len() {
            return None;
        }
        let guard = self.ptr_guard();
        let at = guard.as_ptr().wrapping_add(offset).cast::<u64>();
        if !at.is_aligned() {
            let mut value = T::default();
            self.subslice(offset, len)
                .ok()?
                .copy_to(&mut value.as_mut_slice()[..len]);
            return Some(value);
        }
        let mut value = T::default();
        for (index, word) in value.as_mut_slice()[..len].chunks_exact_mut(8).enumerate() {
            // SAFETY: the word lies inside the slice (checked above), which stays mapped while
            // `guard` lives, and is aligned; a guest writing it meanwhile only changes which
            // value is read.
            let read = unsafe { at.add(index).read_volatile() };
            word.copy_from_slice(&read.to_ne_bytes());
        }
        Some(value)
    }

    fn copy_bytes(&self, offset: usize, out: &mut [u8]) -> bool {
        match self.subslice(offset, out.len()) {
            Ok(bytes) => {
                bytes.copy_to(out);
                true
            }
            Err(_) => false,
        }
    }
}

/// Where a queue's spans of guest memory (its doorbell record, its rings' pages) are in this
/// process, as last resolved: while the memory snapshot they were resolved through is the
/// current one, a visit looks none of them up. It keeps a `Weak` of that snapshot: no mapping
/// stays alive for it, but no later snapshot can take its address, so the same address is the
/// same snapshot.
#[derive(Default)]
pub(super) struct Resolved {
    snapshot: Weak<Memory>,
    /// `snapshot`'s address, compared on every visit: one load, where `Weak::as_ptr` has a
    /// branch.
    snapshot_at: usize,
    spans: Box<[Span]>,
}

/// Where one span is in this process.
#[derive(Clone, Copy, Default)]
struct Span {
    /// Host address; 0 where guest memory holds none of the span.
    host: usize,
    /// 0 where `host` is.
    len: usize,
    /// How many of the spans after this one continue it in this process without a gap: a
    /// ring whose pages all do is one run of memory, its slots found without a page lookup.
    continued_by: u32,
}

impl Resolved {
    /// The spans `spans` lists (the same ones, in the same order, on every call) through
    /// `mem`, resolved again only if `mem` is not the snapshot they were last resolved
    /// through.
    #[inline(always)]
    pub(super) fn through<'m, I>(
        &'m mut self,
        mem: &'m Arc<Memory>,
        spans: impl FnOnce() -> I,
    ) -> Mapped<'m>
    where
        I: Iterator<Item = (u64, usize)>,
    {
        if self.snapshot_at != Arc::as_ptr(mem) as usize {
            self.resolve(mem, spans());
        }
        Mapped {
            spans: &self.spans,
            _snapshot: PhantomData,
        }
    }

    #[cold]
    fn resolve(&mut self, mem: &Arc<Memory>, spans: impl Iterator<Item = (u64, usize)>) {
        // Every span is 4-byte aligned (records are checked aligned when their queue is
        // created, ring pages are pages): one that is not is left unresolved, so that a word
        // access needs no alignment check at run time.
        let mut resolved: Box<[Span]> = spans
            .map(|(gpa, len)| {
                let host = slice_at(mem, gpa, len)
                    .map_or(0, |slice| slice.ptr_guard_mut().as_ptr() as usize);
                match host {
                    0 => Span::default(),
                    host if !host.is_multiple_of(4) => Span::default(),
                    host => Span {
                        host,
                        len,
                        continued_by: 0,
                    },
                }
            })
            .collect();
        for index in (1..resolved.len()).rev() {
            let (before, after) = (resolved[index - 1], resolved[index]);
            if before.host != 0 && after.host != 0 && before.host + before.len == after.host {
                resolved[index - 1].continued_by = after.continued_by + 1;
            }
        }
        self.spans = resolved;
        self.snapshot = Arc::downgrade(mem);
        self.snapshot_at = Arc::as_ptr(mem) as usize;
    }
}

/// A queue's spans through the snapshot `'m` borrows (see [`Resolved::through`]).
#[derive(Clone, Copy)]
pub(super) struct Mapped<'m> {
    spans: &'m [Span],
    _snapshot: PhantomData<&'m Memory>,
}

impl<'m> Mapped<'m> {
    /// Span `index`; `None` where guest memory holds none of it.
    #[inline(always)]
    pub(super) fn span(&self, index: usize) -> Option<VolatileSlice<'m>> {
        match self.spans.get(index) {
            Some(&Span { host, len, .. }) if host != 0 => {
                // SAFETY: `host` and `len` are a slice of a region of the snapshot `'m`
                // borrows (`through` made sure they were resolved through it), whose regions
                // stay mapped while it lives (vm-memory's mmap backend without Xen: a
                // region's host address is valid for the region's life).
                Some(unsafe { VolatileSlice::new(host as *mut u8, len) })
            }
            _ => None,
        }
    }

    /// The spans from `first` on (a ring's pages).
    pub(super) fn from(&self, first: usize) -> Mapped<'m> {
        Mapped {
            spans: self.spans.get(first..).unwrap_or_default(),
            _snapshot: PhantomData,
        }
    }

    /// Host address of the first span if it and the `count - 1` after it are in guest memory
    /// back to back; 0 if not.
    #[inline(always)]
    fn run_of(&self, count: usize) -> usize {
        match self.spans.first() {
            // One outside guest memory has the address 0 and continues nothing.
            Some(first) if first.continued_by as usize >= count.wrapping_sub(1) => first.host,
            _ => 0,
        }
    }

    /// The word at `offset` (a multiple of 4) in span `index`, if it lies there.
    // Not through vm-memory's atomic accessors: they are not inlined into another crate, and
    // the data path makes a few of these accesses on every visit.
    #[inline(always)]
    fn word(&self, index: usize, offset: u64) -> Option<&'m AtomicU32> {
        let &Span { host, len, .. } = self.spans.get(index)?;
        let offset = usize::try_from(offset).ok()?;
        // The offsets are the records' constants: the first test is made when compiling. A
        // span outside guest memory has no length.
        if !offset.is_multiple_of(4) || offset.checked_add(size_of::<u32>())? > len {
            return None;
        }
        let at = (host as *mut u8).wrapping_add(offset).cast::<u32>();
        // SAFETY: the word lies inside span `index` (checked above), a slice of a region of
        // the snapshot `'m` borrows, mapped for as long as it lives (see `span`), and is
        // aligned (the span is, see `Resolved::resolve`, and so is `offset`); the guest's
        // side of it is only ever accessed atomically or by volatile copies.
        Some(unsafe { AtomicU32::from_ptr(at) })
    }

    /// The 8-byte word span `index` starts with, if it holds one and it is aligned.
    #[inline(always)]
    pub(super) fn word64(&self, index: usize) -> Option<&'m AtomicU64> {
        let &Span { host, len, .. } = self.spans.get(index)?;
        // A span outside guest memory has no length.
        if len < size_of::<u64>() || !host.is_multiple_of(8) {
            return None;
        }
        // SAFETY: the word lies inside span `index` (checked above), a slice of a region of
        // the snapshot `'m` borrows, mapped for as long as it lives (see `span`), and is
        // aligned; the guest's side of it is only ever accessed atomically.
        Some(unsafe { AtomicU64::from_ptr(host as *mut u64) })
    }

    /// An atomic load of the word at `offset` in span `index`.
    #[inline(always)]
    pub(super) fn load(&self, index: usize, offset: u64, order: Ordering) -> Option<u32> {
        Some(self.word(index, offset)?.load(order))
    }

    /// An atomic store of the word at `offset` in span `index`; false where there is none.
    #[inline(always)]
    pub(super) fn store(&self, index: usize, value: u32, offset: u64, order: Ordering) -> bool {
        self.word(index, offset)
            .map(|word| word.store(value, order))
            .is_some()
    }
}

/// The slots of one ring, its pages resolved.
pub(super) struct Slots<'m> {
    ring: &'m GuestRing,
    pages: Mapped<'m>,
    /// Host address of slot 0 when the ring's pages lie back to back in this process (as
    /// they do when the guest's pages are contiguous in one region): a slot is then found
    /// with a mask, a shift and an add. 0 when they do not.
    base: usize,
    // The ring's, copied here so that a loop over slots keeps them in registers.
    depth: u32,
    stride_shift: u8,
}

impl<'m> Slots<'m> {
    /// `pages` are the ring's pages, in its order.
    #[inline(always)]
    pub(super) fn new(ring: &'m GuestRing, pages: Mapped<'m>) -> Self {
        let base = pages.run_of(ring.run_pages);
        Slots {
            ring,
            pages,
            base,
            depth: ring.depth,
            stride_shift: ring.stride_shift,
        }
    }

    /// Host address of slot `index` of a ring that is one run (`base` is not 0).
    #[inline(always)]
    fn in_run(&self, index: u32) -> usize {
        self.base + ((ring_slot(index, self.depth) as usize) << self.stride_shift)
    }

    /// Slot `index` (any u32: the ring index wraps), read in place; `None` if guest memory no
    /// longer holds its page.
    #[inline(always)]
    pub(super) fn slot(&self, index: u32) -> Option<VolatileSlice<'m>> {
        if self.base == 0 {
            return self.slot_in_pages(index);
        }
        // SAFETY: the ring's pages, back to back from `base`, cover its `depth` slots
        // (checked in `new`), and each lies in a region of the snapshot `'m` borrows, which
        // stays mapped while it lives (see `Mapped::span`).
        Some(unsafe { VolatileSlice::new(self.in_run(index) as *mut u8, 1 << self.stride_shift) })
    }

    /// [`Slots::slot`] of a ring whose pages are scattered: found through its page (a slot
    /// never straddles two).
    fn slot_in_pages(&self, index: u32) -> Option<VolatileSlice<'m>> {
        let (page, in_page) = self.ring.slot_position(index);
        self.pages
            .span(page)?
            .subslice(in_page, self.ring.stride())
            .ok()
    }

    /// Writes `count` entries made by `entry` into consecutive slots from `first` (any u32:
    /// the ring index wraps) as [`publish_words`] does (CQEs: each one's owner byte last);
    /// returns how many it wrote, fewer if guest memory no longer holds a page or an entry
    /// is not a slot. `entry` is given the entry's index among the `count` and its ring
    /// index.
    #[inline(always)]
    pub(super) fn publish<const N: usize>(
        &self,
        first: u32,
        count: u32,
        mut entry: impl FnMut(u32, u32) -> [u64; N],
    ) -> u32 {
        if self.base != 0 && self.base.is_multiple_of(8) && 8 * N == 1 << self.stride_shift {
            for written in 0..count {
                let index = first.wrapping_add(written);
                // SAFETY: the slot lies in guest memory (see `slot`), its words fill it
                // exactly (checked above) and are aligned: the base is, and so is every
                // slot, a multiple of the stride from it.
                unsafe { write_entry(self.in_run(index) as *mut u64, entry(written, index)) };
            }
            return count;
        }
        for written in 0..count {
            let index = first.wrapping_add(written);
            match self.slot(index) {
                Some(slot) if publish_words(&slot, entry(written, index)) => {}
                _ => return written,
            }
        }
        count
    }

    /// Hands `take` the `count` consecutive slots from `first` (any u32: the ring index
    /// wraps), read in place, in order, until it returns false; returns how many it took.
    /// Fewer than `count` also when guest memory no longer holds a page.
    #[inline(always)]
    pub(super) fn take(
        &self,
        first: u32,
        count: u32,
        mut take: impl FnMut(VolatileSlice<'m>) -> bool,
    ) -> u32 {
        for taken in 0..count {
            match self.slot(first.wrapping_add(taken)) {
                Some(slot) if take(slot) => {}
                _ => return taken,
            }
        }
        count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_regions() -> Arc<Memory> {
        Arc::new(
            Memory::from_ranges(&[(GuestAddress(0), 0x1000), (GuestAddress(0x1000), 0x1000)])
                .unwrap(),
        )
    }

    /// `ring`'s slots through `mem`, its pages resolved into `resolved`.
    fn slots_through<'m>(
        ring: &'m GuestRing,
        mem: &'m Arc<Memory>,
        resolved: &'m mut Resolved,
    ) -> Slots<'m> {
        let pages = || ring.pages.iter().map(|&gpa| (gpa, 1 << ring.page_shift));
        Slots::new(ring, resolved.through(mem, pages))
    }

    #[test]
    fn records_within_a_region() {
        let mem = two_regions();
        store(&mem, 7u32, 0x1004, Ordering::Release).unwrap();
        assert_eq!(load::<u32>(&mem, 0x1004, Ordering::Acquire).unwrap(), 7);
        slice_at(&mem, 0x10, 4).unwrap().copy_from(b"abcd");
        let mut out = [0u8; 4];
        slice_at(&mem, 0x10, 4).unwrap().copy_to(&mut out);
        assert_eq!(&out, b"abcd");
    }

    #[test]
    fn accesses_outside_one_region_fail() {
        let mem = two_regions();
        assert!(slice_at(&mem, 0x2000, 4).is_err(), "outside guest memory");
        assert!(slice_at(&mem, 0xffe, 4).is_err(), "straddles two regions");
        assert!(slice_at(&mem, 0x1ffe, 4).is_err(), "runs past the end");
        assert!(slice_at(&mem, u64::MAX - 1, 2).is_err());
        assert!(load::<u32>(&mem, 0x1ffe, Ordering::Acquire).is_err());
        assert!(
            store(&mem, 1u32, 0x1002, Ordering::Release).is_err(),
            "misaligned"
        );
    }

    #[test]
    fn published_words_land_whole_and_short_or_misaligned_slots_are_refused() {
        let mem = two_regions();
        let entry = [1u64, 2, 3, u64::MAX];
        let slot = slice_at(&mem, 0x200, 0x20).unwrap();
        assert!(publish_words(&slot, entry));
        assert_eq!(
            mem.read_obj::<[u64; 4]>(GuestAddress(0x200)).unwrap(),
            entry
        );
        let long = slice_at(&mem, 0x200, 0x40).unwrap();
        assert!(!publish_words(&long, entry), "not the whole slot");
        let short = slice_at(&mem, 0x200, 0x10).unwrap();
        assert!(!publish_words(&short, entry), "past the end");
        let misaligned = slice_at(&mem, 0x204, 0x20).unwrap();
        assert!(!publish_words(&misaligned, entry), "misaligned");
    }

    #[test]
    fn spans_are_resolved_once_per_snapshot() {
        let first = two_regions();
        let mut resolved = Resolved::default();
        let lookups = std::cell::Cell::new(0);
        let spans = || {
            lookups.set(lookups.get() + 1);
            [(0x1008, 8), (0x3000, 8), (0xffc, 8), (0x1002, 8)].into_iter()
        };
        let mapped = resolved.through(&first, spans);
        assert!(mapped.store(0, 7u32, 4, Ordering::Release));
        assert_eq!(first.read_obj::<u32>(GuestAddress(0x100c)).unwrap(), 7);
        assert_eq!(mapped.load(0, 4, Ordering::Acquire), Some(7));
        assert_eq!(mapped.load(0, 6, Ordering::Acquire), None, "misaligned");
        assert_eq!(mapped.load(0, 8, Ordering::Acquire), None, "past the span");
        assert!(mapped.span(1).is_none(), "outside guest memory");
        assert!(mapped.span(2).is_none(), "straddles two regions");
        assert!(mapped.span(3).is_none(), "misaligned");
        assert!(mapped.span(4).is_none(), "no such span");
        assert!(!mapped.store(1, 1u32, 0, Ordering::Release));
        assert_eq!(mapped.from(1).span(0).map(|s| s.len()), None);
        resolved.through(&first, spans);
        assert_eq!(lookups.get(), 1, "the same snapshot");
        // A new table without the first region: the record is gone from it.
        let second = Arc::new(Memory::from_ranges(&[(GuestAddress(0x2000), 0x1000)]).unwrap());
        drop(first);
        assert!(resolved.through(&second, spans).span(0).is_none());
        assert_eq!(lookups.get(), 2, "a new snapshot");
    }

    #[test]
    fn a_ring_whose_pages_are_back_to_back_is_one_run() {
        let mem = Arc::new(Memory::from_ranges(&[(GuestAddress(0), 0x3000)]).unwrap());
        let run = GuestRing::new(vec![0x1000, 0x2000], 12, 10, 8);
        let mut resolved = Resolved::default();
        let slots = slots_through(&run, &mem, &mut resolved);
        assert_ne!(slots.base, 0);
        // Slot 5 is the second of page 1, whether found in the run or by its page.
        slots.slot(13).unwrap().copy_from(b"five");
        assert_eq!(
            mem.read_obj::<[u8; 4]>(GuestAddress(0x2400)).unwrap(),
            *b"five"
        );
        assert_eq!(
            slots.slot_in_pages(5).unwrap().field::<[u8; 4]>(0),
            Some(*b"five")
        );
        // Written and taken across the wrap, as in a ring of scattered pages.
        let entries = |index: u32, at: u32| [u64::from(at) << 32 | u64::from(index); 128];
        assert_eq!(slots.publish(7, 3, entries), 3);
        let word = |gpa| mem.read_obj::<u64>(GuestAddress(gpa)).unwrap();
        assert_eq!(
            (word(0x2c00), word(0x1000), word(0x1400)),
            (7 << 32, 8 << 32 | 1, 9 << 32 | 2)
        );
        let mut seen = Vec::new();
        let taken = slots.take(7, 3, |slot| {
            seen.push(slot.field::<u64>(0).unwrap());
            seen.len() < 2
        });
        assert_eq!((taken, &seen[..]), (1, &[7 << 32, 8 << 32 | 1][..]));
        // Pages out of order, repeated, or one of them gone: found page by page.
        for pages in [
            vec![0x2000, 0x1000],
            vec![0x1000, 0x1000],
            vec![0x2000, 0x3000],
        ] {
            let ring = GuestRing::new(pages, 12, 10, 8);
            assert_eq!(slots_through(&ring, &mem, &mut Resolved::default()).base, 0);
        }
        // Pages that do not cover the ring are never taken as its run.
        let short = GuestRing::new(vec![0x1000], 12, 10, 8);
        assert_eq!(
            slots_through(&short, &mem, &mut Resolved::default()).base,
            0
        );
    }

    #[test]
    fn slots_follow_the_ring_pages_and_wrap() {
        let mem = two_regions();
        // Two 4 KiB pages in reverse order, 1 KiB slots: slot 5 is the second slot of page 1.
        let ring = GuestRing::new(vec![0x1000, 0], 12, 10, 8);
        let mut resolved = Resolved::default();
        // Found page by page: the two regions' mappings may happen to lie back to back.
        let slots = Slots {
            base: 0,
            ..slots_through(&ring, &mem, &mut resolved)
        };
        slots.slot(5).unwrap().copy_from(b"five");
        let mut out = [0u8; 4];
        mem.read_slice(&mut out, GuestAddress(0x400)).unwrap();
        assert_eq!(&out, b"five");
        slots
            .slot(5u32.wrapping_add(8 << 20))
            .unwrap()
            .copy_to(&mut out);
        assert_eq!(&out, b"five", "the index wraps at the depth");
        assert_eq!(slots.slot(1).unwrap().len(), 1024);
        let gone = GuestRing::new(vec![0x4000], 12, 10, 4);
        assert!(slots_through(&gone, &mem, &mut Resolved::default())
            .slot(0)
            .is_none());
        // Slots read in place; a page guest memory no longer holds has none.
        mem.write_slice(b"three", GuestAddress(0x1c00)).unwrap();
        mem.write_slice(b"seven", GuestAddress(0xc00)).unwrap();
        mem.write_slice(b"zero.", GuestAddress(0x1000)).unwrap();
        let half_gone = GuestRing::new(vec![0x1000, 0x4000], 12, 10, 8);
        let mut half_resolved = Resolved::default();
        let half = slots_through(&half_gone, &mem, &mut half_resolved);
        let mut start = [0; 5];
        assert!(half.slot(3).unwrap().copy_bytes(0, &mut start));
        assert_eq!(&start, b"three");
        assert!(half.slot(4).is_none());
        // Slot 7 of `ring`: the end of its second page.
        let slot = slots.slot(7).unwrap();
        assert_eq!(slot.field::<[u8; 5]>(0), Some(*b"seven"), "copied: 5 bytes");
        assert_eq!(slot.field::<u64>(1016), Some(0), "one word, in place");
        assert_eq!(slot.field::<u64>(1020), None, "past the slot");
        assert!(!slot.copy_bytes(1020, &mut [0; 8]));
        // The head of a struct: its first words read, the rest left default.
        mem.write_obj(0x0102_0304_0506_0708u64, GuestAddress(0xc00 + 1000))
            .unwrap();
        let head = slot.field_head::<[u64; 2]>(1000, 8);
        assert_eq!(head, Some([0x0102_0304_0506_0708, 0]));
        assert_eq!(slot.field_head::<[u64; 2]>(1016, 16), None, "past the slot");
        assert_eq!(
            slot.field_head::<[u64; 2]>(1000, 24),
            None,
            "more than the struct"
        );
        assert_eq!(slot.field_head::<[u64; 2]>(1000, 4), None, "not words");
        assert_eq!(slots.slot(8).unwrap().field::<[u8; 5]>(0), Some(*b"zero."));
        // Slots taken in order across the wrap, until told to stop or a page is missing.
        let mut seen = Vec::new();
        let taken = slots_through(&ring, &mem, &mut Resolved::default()).take(7, 3, |slot| {
            seen.push(slot.field::<[u8; 5]>(0).unwrap());
            true
        });
        assert_eq!((taken, &seen[..]), (3, &[*b"seven", *b"zero.", [0; 5]][..]));
        assert_eq!(
            slots_through(&ring, &mem, &mut Resolved::default()).take(7, 3, |_| false),
            0
        );
        assert_eq!(
            slots_through(&half_gone, &mem, &mut Resolved::default()).take(2, 4, |_| true),
            2
        );
        assert_eq!(
            slots_through(&gone, &mem, &mut Resolved::default()).publish(0, 1, |_, _| [1u64; 128]),
            0
        );
        // 1 KiB entries into slots 7, 0 and 1 (across the wrap); slot 2's page is gone.
        let wrapping = GuestRing::new(vec![0x1000, 0], 12, 10, 8);
        let entries = |index: u32, at: u32| [u64::from(at) << 32 | u64::from(7 + index); 128];
        assert_eq!(
            slots_through(&wrapping, &mem, &mut Resolved::default()).publish(7, 3, entries),
            3
        );
        let word = |gpa| mem.read_obj::<u64>(GuestAddress(gpa)).unwrap();
        assert_eq!(
            (word(0xc00), word(0x1000), word(0x1400)),
            (7 << 32 | 7, 8 << 32 | 8, 9 << 32 | 9)
        );
        let half_gone = GuestRing::new(vec![0x1000, 0x4000], 12, 10, 8);
        assert_eq!(
            slots_through(&half_gone, &mem, &mut Resolved::default()).publish(3, 3, entries),
            1
        );
    }
}
