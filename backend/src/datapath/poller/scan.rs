//! Taking the rung doorbell bits: which words of the connection's doorbell bitmaps a look
//! reads, and reading them.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::super::doorbells::{DoorbellArea, DoorbellBit};
use super::super::guest_access::Resolved;
use super::super::shared::Shared;
use super::super::Memory;

/// The doorbell bitmap words a look reads, kept from look to look, so that a look takes no
/// lock and looks nothing up: which words they are changes only with the queue table and the
/// doorbell areas, where they are in this process only with the memory snapshot.
#[derive(Default)]
pub(super) struct DoorbellScan {
    /// The queue table's and the doorbell areas' versions the words are those of.
    versions: Option<(u64, u64)>,
    /// Each word's area and byte offset in that area's bitmap.
    words: Vec<(u32, u64)>,
    /// Each word's guest-physical address.
    places: Vec<u64>,
    resolved: Resolved,
}

impl DoorbellScan {
    /// Takes the bits rung in the connection's bitmap words into `bits`.
    pub(super) fn take_rung_bits(
        &mut self,
        shared: &Shared,
        mem: &Arc<Memory>,
        bits: &mut Vec<DoorbellBit>,
    ) {
        let versions = (
            shared.queues.table_version.load(Ordering::Acquire),
            shared.areas_version.load(Ordering::Acquire),
        );
        if self.versions != Some(versions) {
            self.refresh(shared);
        }
        let places = &self.places;
        let mapped = self
            .resolved
            .through(mem, || places.iter().map(|&gpa| (gpa, size_of::<u64>())));
        for (index, &(area, offset)) in self.words.iter().enumerate() {
            // A word the memory table no longer holds costs the guest its doorbells, never
            // the backend its safety.
            let Some(word) = mapped.word64(index) else {
                continue;
            };
            if word.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut rung = word.swap(0, Ordering::Acquire);
            while rung != 0 {
                let bit = rung.trailing_zeros();
                rung &= rung - 1;
                #[expect(
                    clippy::cast_possible_truncation,
                    reason = "offset + 8 is within the area's bitmap (checked when the words were \
                              resolved), of at most MAX_DOORBELL_BITS (1 << 16) bits: \
                              offset * 8 + bit is below 1 << 16"
                )]
                let bit = (offset * 8) as u16 + bit as u16;
                bits.push(DoorbellBit { area, bit });
            }
        }
    }

    #[cold]
    fn refresh(&mut self, shared: &Shared) {
        let objects = shared.queues.table.lock();
        // Read under the queue table's lock and before the areas': what is copied is these
        // versions' or later ones' (each changes after what it counts).
        let versions = (
            shared.queues.table_version.load(Ordering::Acquire),
            shared.areas_version.load(Ordering::Acquire),
        );
        let areas = shared.areas();
        self.words.clear();
        self.places.clear();
        // The words come sorted by area: each area is looked up once.
        let mut current: Option<(u32, Option<&DoorbellArea>)> = None;
        for &(area, offset) in objects.words.keys() {
            if current.is_none_or(|(number, _)| number != area) {
                current = Some((area, areas.get(area)));
            }
            let Some((_, Some(found))) = current else {
                continue;
            };
            if offset + 8 > found.bitmap_bytes() as u64 {
                continue;
            }
            self.words.push((area, offset));
            self.places.push(found.place.doorbell_bitmap + offset);
        }
        self.versions = Some(versions);
        // The words changed: they are resolved again at the next look.
        self.resolved = Resolved::default();
    }
}
