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

/// Writes `count` entries made by `entry` (given their index among the `count`) back to back
/// over the whole of `slice` so that each appears whole: all its words but the last with
/// volatile writes, then the last with a release store, so a guest that sees an entry's last
/// word change (a CQE's owner byte is in it) with an acquire load also sees the rest of it.
/// False, writing nothing, if the entries do not fill the slice exactly or it is misaligned.
#[inline(always)]
fn publish_words<const N: usize>(
    slice: &VolatileSlice,
    count: usize,
    mut entry: impl FnMut(usize) -> [u64; N],
) -> bool {
    if N == 0 || count * 8 * N != slice.len() {
        return false;
    }
    let guard = slice.ptr_guard_mut();
    let base = guard.as_ptr().cast::<u64>();
    if !base.is_aligned() {
        return false;
    }
    for index in 0..count {
        let words = entry(index);
        let at = base.wrapping_add(index * N);
        for (word, value) in words[..N - 1].iter().enumerate() {
            // SAFETY: the word lies inside the slice (the entries fill it exactly, checked
            // above), which stays mapped while `guard` lives, and is 8-byte aligned.
            unsafe { at.add(word).write_volatile(*value) };
        }
        // SAFETY: as above; the guest's side of the word is only ever accessed atomically or
        // by volatile copies, and the mapping outlives this borrow.
        let last = unsafe { AtomicU64::from_ptr(at.add(N - 1)) };
        last.store(words[N - 1], Ordering::Release);
    }
    true
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

/// The slots of `stride` bytes each that `run` holds, `count` at most, in order.
fn slots_of<'m>(
    run: VolatileSlice<'m>,
    stride: usize,
    count: u32,
) -> impl Iterator<Item = VolatileSlice<'m>> {
    let count = (count as usize).min(run.len() / stride.max(1));
    (0..count).map(move |slot| {
        // SAFETY: slot `slot` of `run` lies inside it (`count` slots fit, checked above),
        // and `run`, a slice of a region of the snapshot `'m` borrows, stays mapped for `'m`.
        unsafe { VolatileSlice::new(run.ptr_guard_mut().as_ptr().add(slot * stride), stride) }
    })
}

/// Where a queue's spans of guest memory (its doorbell record, its rings' pages) are in this
/// process, as last resolved: while the memory snapshot they were resolved through is the
/// current one, a visit looks none of them up. It keeps a `Weak` of that snapshot: no mapping
/// stays alive for it, but no later snapshot can take its address, so the same address is the
/// same snapshot.
#[derive(Default)]
pub(super) struct Resolved {
    snapshot: Weak<Memory>,
    /// Host address and length of each span; (0, 0) where guest memory holds none of it.
    spans: Box<[(usize, usize)]>,
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
        if !std::ptr::eq(self.snapshot.as_ptr(), Arc::as_ptr(mem)) {
            self.resolve(mem, spans());
        }
        Mapped {
            spans: &self.spans,
            _snapshot: PhantomData,
        }
    }

    #[cold]
    fn resolve(&mut self, mem: &Arc<Memory>, spans: impl Iterator<Item = (u64, usize)>) {
        self.spans = spans
            .map(|(gpa, len)| match slice_at(mem, gpa, len) {
                Ok(slice) => (slice.ptr_guard_mut().as_ptr() as usize, len),
                Err(_) => (0, 0),
            })
            .collect();
        self.snapshot = Arc::downgrade(mem);
    }
}

/// A queue's spans through the snapshot `'m` borrows (see [`Resolved::through`]).
#[derive(Clone, Copy)]
pub(super) struct Mapped<'m> {
    spans: &'m [(usize, usize)],
    _snapshot: PhantomData<&'m Memory>,
}

impl<'m> Mapped<'m> {
    /// Span `index`; `None` where guest memory holds none of it.
    #[inline(always)]
    pub(super) fn span(&self, index: usize) -> Option<VolatileSlice<'m>> {
        match self.spans.get(index) {
            Some(&(host, len)) if host != 0 => {
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

    /// The naturally aligned word at `offset` in span `index`, if it lies there.
    // Not through vm-memory's atomic accessors: they are not inlined into another crate, and
    // the data path makes a few of these accesses on every visit.
    #[inline(always)]
    fn word(&self, index: usize, offset: u64) -> Option<&'m AtomicU32> {
        let &(host, len) = self.spans.get(index)?;
        let offset = usize::try_from(offset).ok()?;
        if host == 0 || offset.checked_add(size_of::<u32>())? > len {
            return None;
        }
        let at = (host as *mut u8).wrapping_add(offset).cast::<u32>();
        if !at.is_aligned() {
            return None;
        }
        // SAFETY: the word lies inside span `index` (checked above), a slice of a region of
        // the snapshot `'m` borrows, mapped for as long as it lives (see `span`), and is
        // aligned; the guest's side of it is only ever accessed atomically or by volatile
        // copies.
        Some(unsafe { AtomicU32::from_ptr(at) })
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
}

impl<'m> Slots<'m> {
    /// `pages` are the ring's pages, in its order.
    pub(super) fn new(ring: &'m GuestRing, pages: Mapped<'m>) -> Self {
        Slots { ring, pages }
    }

    /// Writes `count` entries made by `entry` into consecutive slots from `first` (any u32:
    /// the ring index wraps) as [`publish_words`] does (CQEs: each one's owner byte last), run
    /// by run; returns how many it wrote, fewer if guest memory no longer holds a page or an
    /// entry is not a slot. `entry` is given the entry's index among the `count` and the ring
    /// index its run starts at: a run ends at the ring's end at the latest, so its entries
    /// are all written in the same lap of the ring (a CQE's owner bit is the same for all).
    #[inline(always)]
    pub(super) fn publish<const N: usize>(
        &self,
        first: u32,
        count: u32,
        mut entry: impl FnMut(u32, u32) -> [u64; N],
    ) -> u32 {
        let mut written = 0;
        while written < count {
            let start = first.wrapping_add(written);
            let Some((run, slots)) = self.run(start, count - written) else {
                break;
            };
            let at = written;
            if !publish_words(&run, slots as usize, |index| {
                entry(at + index as u32, start)
            }) {
                break;
            }
            written += slots;
        }
        written
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
        let stride = self.ring.stride();
        let mut taken = 0;
        while taken < count {
            let Some((run, slots)) = self.run(first.wrapping_add(taken), count - taken) else {
                break;
            };
            let end_of_run = taken + slots;
            for slot in slots_of(run, stride, slots) {
                if !take(slot) {
                    return taken;
                }
                taken += 1;
            }
            if taken < end_of_run {
                break;
            }
        }
        taken
    }

    /// Up to `max` (at least 1) consecutive slots from `index` (any u32: the ring index
    /// wraps), as many as follow it in its page before the ring wraps: one slice and their
    /// count; `None` if guest memory no longer holds the page.
    fn run(&self, index: u32, max: u32) -> Option<(VolatileSlice<'m>, u32)> {
        let ring = self.ring;
        let (page, in_page) = self.page_of(index)?;
        let left_in_ring = ring.depth - ring_slot(index, ring.depth);
        // Truncated only for pages of more than 2^32 slots: a shorter run, never a wrong one.
        let left_in_page = (page.len().saturating_sub(in_page) >> ring.stride_shift) as u32;
        let count = max.min(left_in_ring).min(left_in_page).max(1);
        let slots = page
            .subslice(in_page, (count as usize) << ring.stride_shift)
            .ok()?;
        Some((slots, count))
    }

    /// The page holding slot `index` and the slot's offset in it.
    fn page_of(&self, index: u32) -> Option<(VolatileSlice<'m>, usize)> {
        let (page, in_page) = self.ring.slot_position(index);
        Some((self.pages.span(page)?, in_page))
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
        let entries = [[1u64, 2, 3, u64::MAX], [5, 6, 7, 8]];
        let made = |index: usize| entries[index];
        let slots = slice_at(&mem, 0x200, 0x40).unwrap();
        assert!(publish_words(&slots, 2, made));
        let mut seen = [0u8; 64];
        slice_at(&mem, 0x200, 64).unwrap().copy_to(&mut seen);
        let expected: Vec<u8> = entries
            .iter()
            .flatten()
            .flat_map(|w| w.to_ne_bytes())
            .collect();
        assert_eq!(seen[..], expected[..]);
        assert!(!publish_words(&slots, 1, made), "not the whole slice");
        let short = slice_at(&mem, 0x200, 0x20).unwrap();
        assert!(!publish_words(&short, 2, made), "past the end");
        let misaligned = slice_at(&mem, 0x204, 0x40).unwrap();
        assert!(!publish_words(&misaligned, 2, made), "misaligned");
    }

    #[test]
    fn spans_are_resolved_once_per_snapshot() {
        let first = two_regions();
        let mut resolved = Resolved::default();
        let lookups = std::cell::Cell::new(0);
        let spans = || {
            lookups.set(lookups.get() + 1);
            [(0x1008, 8), (0x3000, 8), (0xffc, 8)].into_iter()
        };
        let mapped = resolved.through(&first, spans);
        assert!(mapped.store(0, 7u32, 4, Ordering::Release));
        assert_eq!(first.read_obj::<u32>(GuestAddress(0x100c)).unwrap(), 7);
        assert_eq!(mapped.load(0, 4, Ordering::Acquire), Some(7));
        assert_eq!(mapped.load(0, 6, Ordering::Acquire), None, "misaligned");
        assert_eq!(mapped.load(0, 8, Ordering::Acquire), None, "past the span");
        assert!(mapped.span(1).is_none(), "outside guest memory");
        assert!(mapped.span(2).is_none(), "straddles two regions");
        assert!(mapped.span(3).is_none(), "no such span");
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
    fn slots_follow_the_ring_pages_and_wrap() {
        let mem = two_regions();
        // Two 4 KiB pages in reverse order, 1 KiB slots: slot 5 is the second slot of page 1.
        let ring = GuestRing::new(vec![0x1000, 0], 12, 10, 8);
        let mut resolved = Resolved::default();
        let slots = slots_through(&ring, &mem, &mut resolved);
        slots.run(5, 1).unwrap().0.copy_from(b"five");
        let mut out = [0u8; 4];
        mem.read_slice(&mut out, GuestAddress(0x400)).unwrap();
        assert_eq!(&out, b"five");
        slots
            .run(5u32.wrapping_add(8 << 20), 1)
            .unwrap()
            .0
            .copy_to(&mut out);
        assert_eq!(&out, b"five", "the index wraps at the depth");
        assert_eq!(slots.run(1, 1).unwrap().0.len(), 1024);
        // Runs stop at the end of a page and where the ring wraps.
        let (run, count) = slots.run(4, 8).unwrap();
        assert_eq!((run.len(), count), (4 * 1024, 4));
        let (_, count) = slots.run(6, 8).unwrap();
        assert_eq!(count, 2, "the page ends");
        let (_, count) = slots.run(2, 1).unwrap();
        assert_eq!(count, 1, "no more than asked");
        let (run, count) = slots.run(7u32.wrapping_add(8 << 20), 8).unwrap();
        assert_eq!((run.len(), count), (1024, 1), "the ring wraps");
        let gone = GuestRing::new(vec![0x4000], 12, 10, 4);
        assert!(slots_through(&gone, &mem, &mut Resolved::default())
            .run(0, 1)
            .is_none());
        // A run's slots, read in place; a page guest memory no longer holds has none.
        mem.write_slice(b"three", GuestAddress(0x1c00)).unwrap();
        mem.write_slice(b"seven", GuestAddress(0xc00)).unwrap();
        mem.write_slice(b"zero.", GuestAddress(0x1000)).unwrap();
        let half_gone = GuestRing::new(vec![0x1000, 0x4000], 12, 10, 8);
        let mut half_resolved = Resolved::default();
        let half = slots_through(&half_gone, &mem, &mut half_resolved);
        let (run, count) = half.run(2, 4).unwrap();
        let starts: Vec<[u8; 5]> = slots_of(run, 1024, count)
            .map(|slot| {
                let mut start = [0; 5];
                assert!(slot.copy_bytes(0, &mut start));
                start
            })
            .collect();
        assert_eq!(starts.len(), 2, "slots 2 and 3, the rest of the first page");
        assert_eq!(&starts[1], b"three");
        assert!(half.run(4, 4).is_none());
        // Slots 7, 0 and 1 of `ring`: the end of its second page, then its first.
        let (run, count) = slots.run(7, 3).unwrap();
        let slot = slots_of(run, 1024, count).next().unwrap();
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
        let (run, _) = slots.run(8, 2).unwrap();
        let mut first = slots_of(run, 1024, 2);
        assert_eq!(first.next().unwrap().field::<[u8; 5]>(0), Some(*b"zero."));
        assert_eq!(first.count(), 1);
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
        // 1 KiB entries into slots 7, 0 and 1 (across the wrap, so in two runs, the second
        // starting at ring index 8); slot 2's page is gone.
        let wrapping = GuestRing::new(vec![0x1000, 0], 12, 10, 8);
        let entries = |index: u32, run: u32| [u64::from(run) << 32 | u64::from(7 + index); 128];
        assert_eq!(
            slots_through(&wrapping, &mem, &mut Resolved::default()).publish(7, 3, entries),
            3
        );
        let word = |gpa| mem.read_obj::<u64>(GuestAddress(gpa)).unwrap();
        let (seventh, eighth) = (7 << 32, 8 << 32);
        assert_eq!(
            (word(0xc00), word(0x1000), word(0x1400)),
            (seventh | 7, eighth | 8, eighth | 9)
        );
        let half_gone = GuestRing::new(vec![0x1000, 0x4000], 12, 10, 8);
        assert_eq!(
            slots_through(&half_gone, &mem, &mut Resolved::default()).publish(3, 3, entries),
            1
        );
    }
}
