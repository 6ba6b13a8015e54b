//! Which doorbell bit each QP and SRQ of a connection has (SPEC.md §8.5). A poller owns
//! whole 64-bit words of the bitmap, word `w` belonging to shard `w % shards`, so it can
//! take a word's rung bits with one atomic swap that no other poller races.

use vrdma_spec::codec::MAX_DOORBELL_BITS;

pub struct DoorbellBits {
    /// One bit per doorbell bit in use.
    used: Vec<u64>,
    shards: usize,
}

impl DoorbellBits {
    /// `bits` doorbell bits (a multiple of 64, at most [`MAX_DOORBELL_BITS`]) shared by
    /// `shards` pollers.
    pub fn new(bits: u32, shards: usize) -> DoorbellBits {
        debug_assert!(bits <= MAX_DOORBELL_BITS && bits.is_multiple_of(64));
        DoorbellBits {
            used: vec![0; (bits / 64) as usize],
            shards: shards.max(1),
        }
    }

    /// A free bit in a word of `shard`, now in use; `None` when the shard's words are full.
    pub fn alloc(&mut self, shard: usize) -> Option<u16> {
        let shards = self.shards;
        let (word, used) = self
            .used
            .iter_mut()
            .enumerate()
            .skip(shard % shards)
            .step_by(shards)
            .find(|(_, used)| **used != u64::MAX)?;
        let free = used.trailing_ones();
        *used |= 1 << free;
        u16::try_from(word * 64 + free as usize).ok()
    }

    pub fn free(&mut self, bit: u16) {
        if let Some(used) = self.used.get_mut(usize::from(bit / 64)) {
            *used &= !(1 << (bit % 64));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_shard_allocates_in_its_own_words_and_reuses_freed_bits() {
        let mut bits = DoorbellBits::new(256, 2);
        let first: Vec<u16> = (0..64).map(|_| bits.alloc(0).unwrap()).collect();
        assert_eq!(first, (0..64).collect::<Vec<_>>());
        assert_eq!(bits.alloc(0), Some(128), "word 1 belongs to shard 1");
        assert_eq!(bits.alloc(1), Some(64));
        bits.free(5);
        assert_eq!(bits.alloc(0), Some(5));
    }

    #[test]
    fn a_full_shard_has_no_bit_left() {
        let mut bits = DoorbellBits::new(128, 2);
        for _ in 0..64 {
            bits.alloc(1).unwrap();
        }
        assert_eq!(bits.alloc(1), None);
        assert!(bits.alloc(0).is_some(), "the other shard is not affected");
    }

    #[test]
    fn the_last_bit_of_the_largest_bitmap_is_usable() {
        let mut bits = DoorbellBits::new(MAX_DOORBELL_BITS, 1);
        for _ in 0..MAX_DOORBELL_BITS - 1 {
            bits.alloc(0).unwrap();
        }
        assert_eq!(bits.alloc(0), Some(u16::MAX));
        assert_eq!(bits.alloc(0), None);
    }
}
