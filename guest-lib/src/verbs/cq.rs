//! Completion queues: the driver's side of a CQ ring, and what it counts of the receive
//! queues completing into it. Polling is `posting.rs`.

use super::*;

pub(super) struct CqInner {
    pub(super) device: Arc<DeviceInner>,
    pub(super) handle: u32,
    pub(super) doorbell: SharedBuffer,
    pub(super) consumer: Mutex<CqConsumer>,
    pub(super) arm_sequence: AtomicU32,
}

/// The driver's side of a CQ ring.
pub(super) struct CqConsumer {
    pub(super) ring: SharedBuffer,
    pub(super) depth: u32,
    pub(super) index: u32,
    /// Polls in a row that found nothing.
    pub(super) empty_polls: u32,
    /// When a poll that found nothing last gave up the CPU (or, before any did, found
    /// nothing first). Not reset by completions: right after one, the program has just
    /// posted its answer, often, and the poller that relays it may need this CPU.
    pub(super) yielded_at: Option<std::time::Instant>,
    /// The receive completions taken so far, by QP number, of each QP whose RQ completes
    /// here: a receive slot is free again once the device took its WQE, so the QP counts
    /// completions to refuse a post past `max_recv_wr` outstanding receives, as verbs does
    /// (SPEC.md §8.1).
    pub(super) receive_queues: HashMap<u32, Arc<AtomicU32>>,
}

impl CqInner {
    #[inline]
    pub(super) fn consumer(&self) -> std::sync::MutexGuard<'_, CqConsumer> {
        self.consumer.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        self.device.destroy(Opcode::DestroyCq, self.handle);
    }
}

/// A completion queue.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(super) inner: Arc<CqInner>,
}

impl CompletionQueue {
    pub fn depth(&self) -> u32 {
        self.inner.consumer().depth
    }
    pub fn handle(&self) -> u32 {
        self.inner.handle
    }

    /// Moves the CQ to a ring of `depth` entries (a power of two), keeping the completions
    /// not yet polled (RESIZE_CQ, SPEC.md §5.7.1); polls wait meanwhile. A depth below the
    /// completions the CQ holds is refused (`INVALID_ARGUMENT`, detail `EINVAL`), and the CQ
    /// stays as it was.
    pub fn resize(&self, depth: u32) -> Result<()> {
        let device = &self.inner.device;
        if device.transport()?.features() & features::RESIZE_CQ == 0 {
            // What the device would answer; a driver does not send it (SPEC.md §2).
            return Err(Error::Device {
                opcode: Opcode::ResizeCq,
                status: Status::Unsupported,
                detail: 0,
            });
        }
        let mut consumer = self.inner.consumer();
        let ring_bytes = u64::from(depth) * CQE_SIZE as u64;
        let ring = device.transport()?.alloc(ring_bytes.max(1), PAGE_SIZE)?;
        // Every slot reads as consumed until the device writes it (SPEC.md §5.7.1).
        for slot in 0..depth {
            let owner = resized_cq_owner(slot, consumer.index, depth);
            ring.write(
                u64::from(slot) * CQE_SIZE as u64 + CQE_SIZE as u64 - 1,
                &[owner],
            )?;
        }
        let (list, _list_pages) = device.ring_page_list(ring.addr(), ring_bytes.max(1))?;
        let request = ResizeCqRequest {
            cq: Le32::from(self.inner.handle),
            cqe: Le32::from(depth),
            ring: list,
        };
        let _: CreatedResponse = device.command(Opcode::ResizeCq, &request)?;
        consumer.ring = ring;
        consumer.depth = depth;
        Ok(())
    }

    /// True while QPs complete here: each keeps the CQ alive (see [`ProtectionDomain::in_use`]).
    pub fn in_use(&self) -> bool {
        Arc::strong_count(&self.inner) > 1
    }
}
