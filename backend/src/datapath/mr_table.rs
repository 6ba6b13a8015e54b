//! The guest's MRs by host lkey, looked up for every SGE, and the cheap hasher of the data
//! path's hot lookups.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::wqe::MrRange;

/// Hashes the host's MR keys for the lookup every SGE makes, and doorbell bits for the one
/// every visit makes: one multiply per word instead of SipHash. The host chooses the keys and
/// the backend the bits, and a guest holds a bounded number of them, so there is nothing for
/// a guest to flood.
#[derive(Default)]
pub(super) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u32(b.into());
        }
    }
    fn write_u16(&mut self, bits: u16) {
        self.write_u32(bits.into());
    }
    fn write_u32(&mut self, key: u32) {
        // The table indexes by the low bits: fold the well-mixed high half into them.
        let mixed = (self.0 ^ u64::from(key)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = mixed ^ (mixed >> 32);
    }
}

/// The guest's MRs by host lkey, and a count of the changes made to them: a poller keeps the
/// last MR it looked up, across passes, while the count stays the same.
#[derive(Default)]
pub(super) struct MrTable {
    ranges: HashMap<u32, MrRange, BuildHasherDefault<KeyHasher>>,
    pub(super) changes: u64,
}

impl MrTable {
    pub(super) fn get(&self, lkey: u32) -> Option<MrRange> {
        self.ranges.get(&lkey).copied()
    }

    pub(super) fn insert(&mut self, lkey: u32, range: MrRange) {
        self.ranges.insert(lkey, range);
        self.changes += 1;
    }

    pub(super) fn remove(&mut self, lkey: u32) {
        self.ranges.remove(&lkey);
        self.changes += 1;
    }

    pub(super) fn clear(&mut self) {
        self.ranges.clear();
        self.changes += 1;
    }
}
