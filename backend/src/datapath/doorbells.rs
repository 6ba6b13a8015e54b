//! Which doorbell bit each QP and SRQ of a connection has (SPEC.md §8.5). Bits are handed out
//! lowest first, so a connection's queues fill few words of the bitmap and a pass reads only
//! those.

use vrdma_spec::codec::MAX_DOORBELL_BITS;

pub struct DoorbellBits {
    /// One bit per doorbell bit in use.
    used: Vec<u64>,
}

impl DoorbellBits {
    /// `bits` doorbell bits (a multiple of 64, at most [`MAX_DOORBELL_BITS`]).
    pub fn new(bits: u32) -> DoorbellBits {
        debug_assert!(bits <= MAX_DOORBELL_BITS && bits.is_multiple_of(64));
        DoorbellBits {
            used: vec![0; (bits / 64) as usize],
        }
    }

    /// The lowest free bit, now in use; `None` when all are.
    pub fn alloc(&mut self) -> Option<u16> {
        let (word, used) = self
            .used
            .iter_mut()
            .enumerate()
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
