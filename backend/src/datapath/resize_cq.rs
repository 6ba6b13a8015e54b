//! RESIZE_CQ (SPEC.md §5.7.1): a CQ moved to a new ring with the CQEs the driver has not
//! consumed, no pass writing to it meanwhile.

use std::sync::atomic::Ordering;

use vm_memory::GuestAddressSpace;
use vrdma_spec::codec::ring_pending;

use super::queues::{self, CqData, GuestRing};
use super::shared::Shared;
use super::{guest_access, poller, wqe};

/// Why [`DataPath::resize_cq`](super::DataPath::resize_cq) left a CQ as it was.
#[derive(Debug, thiserror::Error)]
pub enum ResizeCqError<E> {
    #[error("the CQ holds {held} completions, more than a ring of {depth}")]
    HoldsMore { held: u32, depth: u32 },
    #[error("the CQ's ring, record or consumer index is unusable, or the CQ failed")]
    Unusable,
    #[error("the host CQ cannot be resized: {0}")]
    Host(E),
}

impl Shared {
    /// Moves `cq` to `ring` (RESIZE_CQ, SPEC.md §5.7.1), no pass writing to it meanwhile:
    /// checks that the ring holds no more CQEs than `ring`'s depth (and that the driver's
    /// consumer index is one it could have), then lets `resize_host` resize the host CQ,
    /// then copies the CQEs the driver has not consumed to their indexes in `ring`, each with
    /// its lap's owner bit for the new depth. Nothing changes unless all of it succeeds.
    pub(super) fn resize_cq<E>(
        &self,
        cq: &CqData,
        ring: GuestRing,
        resize_host: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), ResizeCqError<E>> {
        let mem = self.mem.read().unwrap_or_else(|e| e.into_inner());
        let mem = mem
            .as_ref()
            .ok_or(ResizeCqError::Unusable)?
            .memory()
            .into_inner();
        let mut visit = cq.progress.lock();
        let queues::Visited { progress, resolved } = &mut *visit;
        if progress.failed {
            return Err(ResizeCqError::Unusable);
        }
        let old = resolved.through(&mem, || cq.spans(&progress.ring));
        let consumer = old
            .load(
                queues::RECORD,
                vrdma_spec::ring::CqDoorbell::CONSUMER_INDEX,
                Ordering::Acquire,
            )
            .ok_or(ResizeCqError::Unusable)?;
        let held = ring_pending(progress.producer, consumer);
        if held > progress.ring.depth {
            return Err(ResizeCqError::Unusable);
        }
        if held > ring.depth {
            return Err(ResizeCqError::HoldsMore {
                held,
                depth: ring.depth,
            });
        }
        let mut unconsumed = Vec::with_capacity(held as usize);
        let read = guest_access::Slots::new(&progress.ring, old.from(queues::FIRST_PAGE)).take(
            consumer,
            held,
            |slot| {
                use wqe::Slot;
                slot.field::<vrdma_spec::ring::Cqe>(0)
                    .map(|cqe| unconsumed.push(cqe))
                    .is_some()
            },
        );
        if read != held {
            return Err(ResizeCqError::Unusable);
        }
        let mut fresh = guest_access::Resolved::default();
        let new = fresh.through(&mem, || cq.spans(&ring));
        let slots = guest_access::Slots::new(&ring, new.from(queues::FIRST_PAGE));
        // Every slot the copy writes must be there before the host CQ changes.
        if (0..held).any(|n| slots.slot(consumer.wrapping_add(n)).is_none()) {
            return Err(ResizeCqError::Unusable);
        }
        resize_host().map_err(ResizeCqError::Host)?;
        let depth = ring.depth;
        let written = slots.publish(consumer, held, |n, at| {
            poller::cqe_words(&vrdma_spec::ring::Cqe {
                owner: vrdma_spec::ring::cqe_owner_for(at, depth),
                ..unconsumed[n as usize]
            })
        });
        debug_assert_eq!(written, held, "every slot was checked above");
        progress.ring = ring;
        progress.room = depth - held;
        // The spans changed: resolved again at the next visit.
        *resolved = guest_access::Resolved::default();
        Ok(())
    }
}
