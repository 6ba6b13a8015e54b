//! Which doorbell bit each QP and SRQ of a connection has, and in which doorbell area
//! (SPEC.md §8.5, §8.6). Bits are handed out lowest first, so an area's queues fill few words
//! of its bitmap and a pass reads only those.

use std::collections::BTreeMap;

use vrdma_spec::codec::{MAX_DOORBELL_AREAS, MAX_DOORBELL_BITS};

/// Where a doorbell area's notification states and bitmap are (SPEC.md §8.5, §8.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotifyArea {
    /// GPA of the `NotifyState` records.
    pub states: u64,
    /// GPA of the doorbell bitmap.
    pub doorbell_bitmap: u64,
}

/// A queue's doorbell bit: the area whose bitmap holds it (0: SET_NOTIFY_AREA's) and its
/// number there, the `doorbell_bit` the driver was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DoorbellBit {
    pub area: u32,
    pub bit: u16,
}

impl DoorbellBit {
    /// The bitmap word holding the bit: its area, and its byte offset in that area's bitmap.
    pub fn word(self) -> (u32, u64) {
        (self.area, u64::from(self.bit / 64) * 8)
    }
}

/// Why a queue got no doorbell bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoBit {
    /// The driver named an area the device does not have.
    UnknownArea,
    /// Every bit of the area is in use.
    Full,
}

/// Why a doorbell area cannot be removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AreaInUse {
    /// Not an area ADD_DOORBELL_AREA returned (area 0 is never removed on its own).
    Unknown,
    /// This many queues still ring through it.
    Busy(u32),
}

/// A doorbell area: where its notify states and bitmap are, and which of its bits are in use.
pub struct DoorbellArea {
    pub place: NotifyArea,
    used: DoorbellBits,
}

impl DoorbellArea {
    /// Bytes of the area's bitmap.
    pub fn bitmap_bytes(&self) -> usize {
        self.used.used.len() * 8
    }
}

/// A connection's doorbell areas, by number: 0 once SET_NOTIFY_AREA came, then those
/// ADD_DOORBELL_AREA added.
#[derive(Default)]
pub struct DoorbellAreas {
    areas: BTreeMap<u32, DoorbellArea>,
}

impl DoorbellAreas {
    pub fn get(&self, area: u32) -> Option<&DoorbellArea> {
        self.areas.get(&area)
    }

    pub fn places(&self) -> impl Iterator<Item = NotifyArea> + '_ {
        self.areas.values().map(|area| area.place)
    }

    /// Area 0, SET_NOTIFY_AREA's, with `bits` doorbell bits.
    pub fn set_first(&mut self, place: NotifyArea, bits: u32) {
        self.areas.insert(
            0,
            DoorbellArea {
                place,
                used: DoorbellBits::new(bits),
            },
        );
    }

    /// Adds an area of `bits` doorbell bits; its number, or `None` when the device has as
    /// many as it may.
    pub fn add(&mut self, place: NotifyArea, bits: u32) -> Option<u32> {
        let number = (1..=MAX_DOORBELL_AREAS).find(|n| !self.areas.contains_key(n))?;
        self.areas.insert(
            number,
            DoorbellArea {
                place,
                used: DoorbellBits::new(bits),
            },
        );
        Some(number)
    }

    pub fn remove(&mut self, area: u32) -> Result<(), AreaInUse> {
        let found = self.areas.get(&area).filter(|_| area != 0);
        let used = found.ok_or(AreaInUse::Unknown)?.used.in_use();
        if used > 0 {
            return Err(AreaInUse::Busy(used));
        }
        self.areas.remove(&area);
        Ok(())
    }

    /// A free bit of `area`, now in use.
    pub fn alloc(&mut self, area: u32) -> Result<DoorbellBit, NoBit> {
        let found = self.areas.get_mut(&area).ok_or(NoBit::UnknownArea)?;
        let bit = found.used.alloc().ok_or(NoBit::Full)?;
        Ok(DoorbellBit { area, bit })
    }

    pub fn free(&mut self, bit: DoorbellBit) {
        if let Some(area) = self.areas.get_mut(&bit.area) {
            area.used.free(bit.bit);
        }
    }

    /// Forgets every area (device reset).
    pub fn clear(&mut self) {
        self.areas.clear();
    }
}

struct DoorbellBits {
    /// One bit per doorbell bit in use.
    used: Vec<u64>,
}

impl DoorbellBits {
    /// `bits` doorbell bits (a multiple of 64, at most [`MAX_DOORBELL_BITS`]).
    fn new(bits: u32) -> DoorbellBits {
        debug_assert!(bits <= MAX_DOORBELL_BITS && bits.is_multiple_of(64));
        DoorbellBits {
            used: vec![0; (bits / 64) as usize],
        }
    }

    /// The lowest free bit, now in use; `None` when all are.
    fn alloc(&mut self) -> Option<u16> {
        let (word, used) = self
            .used
            .iter_mut()
            .enumerate()
            .find(|(_, used)| **used != u64::MAX)?;
        let free = used.trailing_ones();
        *used |= 1 << free;
        u16::try_from(word * 64 + free as usize).ok()
    }

    fn free(&mut self, bit: u16) {
        if let Some(used) = self.used.get_mut(usize::from(bit / 64)) {
            *used &= !(1 << (bit % 64));
        }
    }

    /// How many bits are in use.
    fn in_use(&self) -> u32 {
        self.used.iter().map(|word| word.count_ones()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_are_handed_out_lowest_first_and_freed_ones_reused() {
        let mut bits = DoorbellBits::new(128);
        let first: Vec<u16> = (0..65).map(|_| bits.alloc().unwrap()).collect();
        assert_eq!(first, (0..65).collect::<Vec<_>>());
        bits.free(5);
        assert_eq!(bits.alloc(), Some(5));
        for _ in 65..128 {
            bits.alloc().unwrap();
        }
        assert_eq!(bits.alloc(), None, "all in use");
    }

    fn place(at: u64) -> NotifyArea {
        NotifyArea {
            states: at,
            doorbell_bitmap: at + 0x1000,
        }
    }

    #[test]
    fn each_area_hands_out_its_own_bits_and_goes_only_when_none_is_used() {
        let mut areas = DoorbellAreas::default();
        assert_eq!(
            areas.alloc(0),
            Err(NoBit::UnknownArea),
            "no area before the first"
        );
        areas.set_first(place(0x1_0000), 128);
        let (first, second) = (
            areas.add(place(0x2_0000), 64),
            areas.add(place(0x3_0000), 64),
        );
        assert_eq!((first, second), (Some(1), Some(2)));
        // Bit numbers are each area's own: the first queue of every area has bit 0.
        for area in [0, 1, 2] {
            assert_eq!(areas.alloc(area), Ok(DoorbellBit { area, bit: 0 }));
        }
        assert_eq!(areas.alloc(3), Err(NoBit::UnknownArea));
        for bit in 1..64 {
            assert_eq!(areas.alloc(1), Ok(DoorbellBit { area: 1, bit }));
        }
        assert_eq!(areas.alloc(1), Err(NoBit::Full), "64 bits, all in use");
        assert_eq!(
            areas.remove(0),
            Err(AreaInUse::Unknown),
            "the first goes only with a reset"
        );
        assert_eq!(areas.remove(7), Err(AreaInUse::Unknown));
        assert_eq!(areas.remove(2), Err(AreaInUse::Busy(1)));
        areas.free(DoorbellBit { area: 2, bit: 0 });
        assert_eq!(areas.remove(2), Ok(()));
        assert_eq!(
            areas.add(place(0x4_0000), 64),
            Some(2),
            "its number is free again"
        );
        assert_eq!(areas.places().count(), 3);
        areas.clear();
        assert_eq!(areas.places().count(), 0);
    }

    #[test]
    fn a_device_has_at_most_max_doorbell_areas_besides_the_first() {
        let mut areas = DoorbellAreas::default();
        areas.set_first(place(0x1_0000), 64);
        for n in 1..=MAX_DOORBELL_AREAS {
            assert_eq!(areas.add(place(0x2_0000), 64), Some(n));
        }
        assert_eq!(areas.add(place(0x2_0000), 64), None);
    }

    #[test]
    fn the_last_bit_of_the_largest_bitmap_is_usable() {
        let mut bits = DoorbellBits::new(MAX_DOORBELL_BITS);
        for _ in 0..MAX_DOORBELL_BITS - 1 {
            bits.alloc().unwrap();
        }
        assert_eq!(bits.alloc(), Some(u16::MAX));
        assert_eq!(bits.alloc(), None);
    }
}
