//! guest-lib's half of the data path (SPEC.md §7-§8): work requests encoded into the rings in
//! shared memory, producer indexes published, doorbells rung only when the device's poller
//! sleeps, and completions taken from the CQ ring by their phase bit. No call into the device
//! on the way.

use super::*;

/// A doorbell record and where in it a queue's producer and consumer indexes live; the
/// notification queue and doorbell bit that tell the device about it.
struct Doorbell<'a> {
    record: &'a SharedBuffer,
    producer_at: u64,
    consumer_at: u64,
    notify_queue: u32,
    bit: u16,
}

/// Work requests written into a queue one at a time and handed to the device together: one
/// producer-index store and one doorbell for all of them (SPEC.md §8.1, §8.5), as for a chain
/// posted with one `ibv_post_send`. Nothing pushed reaches the device before [`Chain::post`];
/// a chain dropped unposted leaves the queue as it was.
pub struct Chain<'a, F> {
    queue: &'a WorkQueue,
    doorbell: Doorbell<'a>,
    device: &'a DeviceInner,
    /// The queue's producer index, held for the chain's life: one chain at a time per queue.
    producer: std::sync::MutexGuard<'a, u32>,
    consumer: u32,
    /// The producer index after the last request pushed.
    next: u32,
    /// Writes a request into the slot at the given offset of the ring.
    write: F,
}

impl<'a, F> Chain<'a, F> {
    fn begin(
        queue: &'a WorkQueue,
        doorbell: Doorbell<'a>,
        device: &'a DeviceInner,
        write: F,
    ) -> Result<Self> {
        // Nothing reaches the rings of a device that is gone, nor a forked child's copy of
        // its parent's.
        device.check_data_path()?;
        let producer = queue.producer.lock().unwrap_or_else(|e| e.into_inner());
        let consumer = doorbell
            .record
            .atomic_u32(doorbell.consumer_at)?
            .load(Ordering::Acquire);
        let next = *producer;
        Ok(Chain {
            queue,
            doorbell,
            device,
            producer,
            consumer,
            next,
            write,
        })
    }

    /// Writes `wr` into the next slot; [`Error::QueueFull`] (counting the requests pushed
    /// before) when the queue has no free slot.
    pub fn push<W: ?Sized>(&mut self, wr: &W) -> Result<()>
    where
        F: Fn(u64, &W) -> Result<()>,
    {
        let outstanding = |completed: &AtomicU32| {
            ring_pending(self.next, completed.load(Ordering::Acquire)) >= self.queue.depth
        };
        if ring_pending(self.next, self.consumer) >= self.queue.depth
            || self.queue.completed.as_deref().is_some_and(outstanding)
        {
            return Err(Error::QueueFull {
                posted: ring_pending(self.next, *self.producer) as usize,
            });
        }
        let slot = u64::from(ring_slot(self.next, self.queue.depth)) * self.queue.stride;
        (self.write)(slot, wr)?;
        self.next = self.next.wrapping_add(1);
        Ok(())
    }

    /// Publishes the requests pushed (release: written before the index that makes them
    /// available) and rings the doorbell, once.
    pub fn post(mut self) -> Result<()> {
        if self.next == *self.producer {
            return Ok(());
        }
        *self.producer = self.next;
        self.doorbell
            .record
            .atomic_u32(self.doorbell.producer_at)?
            .store(self.next, Ordering::Release);
        self.device
            .ring_doorbell(self.doorbell.notify_queue, self.doorbell.bit)
    }
}

/// Posts `wrs` through `chain`: on error, the requests before the failing one were posted.
fn post_all<F, W>(mut chain: Chain<'_, F>, wrs: &[W]) -> Result<()>
where
    F: Fn(u64, &W) -> Result<()>,
{
    let pushed = wrs.iter().try_for_each(|wr| chain.push(wr));
    chain.post()?;
    pushed
}

/// What a send queue accepts: what [`encode_send`] checks a request against.
#[derive(Clone, Copy, Debug)]
pub struct SendShape {
    pub qp_type: QpType,
    pub max_send_sge: u32,
    pub max_inline_data: u32,
}

/// Encodes `wr` as a send WQE (SPEC.md §7.2) through `write(offset in the slot, bytes)`,
/// the header last.
pub fn encode_send(
    wr: &SendWr<'_>,
    shape: &SendShape,
    mut write: impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<()> {
    let ud = match (shape.qp_type, wr.ud) {
        (QpType::Ud, Some(dest)) => UdAddress {
            ah: dest.ah.handle(),
            remote_qpn: dest.remote_qpn,
            remote_qkey: dest.remote_qkey,
        },
        (QpType::Ud, None) => {
            return Err(Error::InvalidArgument(
                "a UD send needs a destination".into(),
            ))
        }
        (QpType::Rc | QpType::Uc, _) => UdAddress::default(),
    };
    let payload = match wr.payload {
        Payload::Sges(sges) => {
            if sges.len() > shape.max_send_sge as usize {
                return Err(Error::InvalidArgument(format!(
                    "{} SGEs exceed max_send_sge {}",
                    sges.len(),
                    shape.max_send_sge
                )));
            }
            write_sges(sges, SEND_WQE_HEADER, &mut write)?;
            WqePayload::Sges(sges.len() as u8)
        }
        Payload::Inline(data) => {
            if data.len() > shape.max_inline_data as usize {
                return Err(Error::InvalidArgument(format!(
                    "{} inline bytes exceed max_inline_data {}",
                    data.len(),
                    shape.max_inline_data
                )));
            }
            write(SEND_WQE_HEADER as u64, data)?;
            WqePayload::Inline(data.len() as u32)
        }
    };
    let header = SendHeader {
        wr_id: wr.wr_id,
        op: wr.op,
        signaled: wr.signaled,
        solicited: wr.solicited,
        fence: wr.fence,
        payload,
        ud,
    };
    write(0, SendWqe::encode(&header).as_slice())
}

/// Encodes `wr` as a receive WQE (SPEC.md §7.3) through `write(offset in the slot, bytes)`.
pub fn encode_recv(
    wr: &RecvWr<'_>,
    max_sge: u32,
    mut write: impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<()> {
    if wr.sges.len() > max_sge as usize {
        return Err(Error::InvalidArgument(format!(
            "{} SGEs exceed the queue's {max_sge}",
            wr.sges.len()
        )));
    }
    write_sges(wr.sges, RECV_WQE_HEADER, &mut write)?;
    write(
        0,
        RecvWqe::encode(wr.wr_id, wr.sges.len() as u32).as_slice(),
    )
}

fn write_sges(
    sges: &[super::work::Sge],
    header: usize,
    write: &mut impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<()> {
    for (i, sge) in sges.iter().enumerate() {
        let wire = WireSge::encode(sge.addr, sge.length, sge.lkey);
        write(sge_offset(header, i) as u64, wire.as_slice())?;
    }
    Ok(())
}

/// A program that busy-polls a CQ yields its CPU once every this many empty polls, and on
/// an empty poll [`YIELD_AFTER_EMPTY_POLLING`] or more after its last yield. The device's poller relays the
/// program's WQEs and completions: where both share CPUs (a process attached directly to the
/// backend on a busy host, a VM's vCPUs), a poll loop that never yields keeps the poller
/// waiting for a scheduler slice per message. Every 64th empty poll costs a pure spin little.
const YIELD_EVERY_EMPTY_POLLS: u32 = 64;

/// A count of polls alone says nothing of time: where each round of the program's loop is
/// slow (UCX polls its receive and send CQs in turn, with its own work between; under
/// emulation one poll costs microseconds), 64 of them held the poller off for hundreds of
/// microseconds per message relayed (UCX's am_lat at 3x native in a VM, where perftest's
/// send_lat was at 1.15x). Natively, 64 empty polls take less than this.
const YIELD_AFTER_EMPTY_POLLING: std::time::Duration = std::time::Duration::from_micros(20);

impl CompletionQueue {
    /// Moves up to `out.len()` new completions into `out`; returns how many. No call into
    /// the device: the CQEs are read from the ring by their phase bit. Once the device is
    /// gone, the completions it wrote are still taken, and then [`Error::Disconnected`]
    /// ends the program's polling loop: no completion can come any more.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let cq = &self.inner;
        if !cq.device.opened_by.is_this_process_fast() {
            return Err(Error::Forked);
        }
        let mut consumer = cq.consumer();
        let mut n = 0;
        while n < out.len() {
            let index = consumer.index;
            let slot = u64::from(ring_slot(index, consumer.depth)) * CQE_SIZE as u64;
            let owner = consumer
                .ring
                .atomic_u8(slot + CQE_SIZE as u64 - 1)?
                .load(Ordering::Acquire);
            if !cqe_is_valid(owner, index, consumer.depth) {
                break;
            }
            let mut cqe = Cqe::default();
            consumer.ring.read(slot, cqe.as_mut_slice())?;
            if cqe.opcode & vrdma_spec::ring::wc_opcode::RECV != 0 {
                if let Some(completed) = consumer.receive_queues.get(&cqe.qp_num.to_native()) {
                    completed.fetch_add(1, Ordering::Release);
                }
            }
            out[n] = WorkCompletion::from(&cqe);
            n += 1;
            consumer.index = index.wrapping_add(1);
        }
        if n > 0 {
            consumer.empty_polls = 0;
            cq.doorbell
                .atomic_u32(CqDoorbell::CONSUMER_INDEX)?
                .store(consumer.index, Ordering::Release);
        } else {
            consumer.empty_polls = consumer.empty_polls.wrapping_add(1);
            let every = consumer.empty_polls.is_multiple_of(YIELD_EVERY_EMPTY_POLLS);
            let now = std::time::Instant::now();
            let since = *consumer.yielded_at.get_or_insert(now);
            if every || now.duration_since(since) >= YIELD_AFTER_EMPTY_POLLING {
                consumer.yielded_at = Some(now);
                drop(consumer);
                std::thread::yield_now();
                cq.device.yields.fetch_add(1, Ordering::Relaxed);
            }
            if every {
                // A program that only polls learns here that the device went away (its
                // connection closed): a look without waiting, once every 64 empty polls.
                cq.device.look_for_loss()?;
            } else {
                cq.device.check_data_path()?;
            }
        }
        Ok(n)
    }

    /// Asks for a [`DeviceEvent::CqCompletion`] at the next (solicited) completion. As with
    /// `ibv_req_notify_cq`, poll once more after arming: completions that arrived before it
    /// raise no event.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // No event can come from a device that is gone: the program's wait would never end.
        self.inner.device.check_data_path()?;
        let request = ArmRequest {
            sequence: self
                .inner
                .arm_sequence
                .fetch_add(1, Ordering::Relaxed)
                .wrapping_add(1),
            solicited_only,
        };
        self.inner
            .doorbell
            .atomic_u32(CqDoorbell::ARM)?
            .store(request.encode(), Ordering::Release);
        // The caller polls next: the arm must be visible before that read, or a CQE the
        // device writes meanwhile is seen by neither side (SPEC.md §8.2).
        std::sync::atomic::fence(Ordering::SeqCst);
        Ok(())
    }
}

impl QueuePair {
    /// What the SQ accepts.
    pub fn send_shape(&self) -> SendShape {
        SendShape {
            qp_type: self.qp_type,
            max_send_sge: self.max_send_sge,
            max_inline_data: self.max_inline_data,
        }
    }

    /// Writes `wrs` into the SQ and rings the doorbell once. No call into the device unless
    /// its poller is asleep. On error, the requests before the failing one were posted.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        post_all(self.send_chain()?, wrs)
    }

    /// A chain of sends for this QP's SQ (see [`Chain`]); refused before RTS.
    pub fn send_chain(&self) -> Result<Chain<'_, impl Fn(u64, &SendWr<'_>) -> Result<()> + '_>> {
        self.check_state(QpState::Rts, "sends")?;
        let doorbell = Doorbell {
            record: &self.doorbell,
            producer_at: QpDoorbell::SQ_PRODUCER,
            consumer_at: QpDoorbell::SQ_CONSUMER,
            notify_queue: self.notify_queue,
            bit: self.doorbell_bit,
        };
        let shape = self.send_shape();
        Chain::begin(
            &self.sq,
            doorbell,
            &self.pd.device,
            move |slot, wr: &SendWr<'_>| {
                encode_send(wr, &shape, |at, bytes| self.sq.ring.write(slot + at, bytes))
            },
        )
    }

    /// Writes `wrs` into the RQ and rings the doorbell once.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        post_all(self.recv_chain()?, wrs)
    }

    /// A chain of receives for this QP's RQ (see [`Chain`]); refused before INIT, and for a
    /// QP on an SRQ.
    pub fn recv_chain(&self) -> Result<Chain<'_, impl Fn(u64, &RecvWr<'_>) -> Result<()> + '_>> {
        let rq = self
            .rq
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("this QP receives through its SRQ".into()))?;
        self.check_state(QpState::Init, "receives")?;
        let doorbell = Doorbell {
            record: &self.doorbell,
            producer_at: QpDoorbell::RQ_PRODUCER,
            consumer_at: QpDoorbell::RQ_CONSUMER,
            notify_queue: self.notify_queue,
            bit: self.doorbell_bit,
        };
        let max_sge = self.max_recv_sge;
        Chain::begin(
            rq,
            doorbell,
            &self.pd.device,
            move |slot, wr: &RecvWr<'_>| {
                encode_recv(wr, max_sge, |at, bytes| rq.ring.write(slot + at, bytes))
            },
        )
    }

    /// Receive WQEs posted but not yet taken by the device. Posting is asynchronous: a UD
    /// sender that must not outrun the receiver waits for this to reach 0.
    pub fn recv_backlog(&self) -> Result<u32> {
        let Some(rq) = &self.rq else { return Ok(0) };
        let producer = *rq.producer.lock().unwrap_or_else(|e| e.into_inner());
        let consumer = self
            .doorbell
            .atomic_u32(QpDoorbell::RQ_CONSUMER)?
            .load(Ordering::Acquire);
        Ok(ring_pending(producer, consumer))
    }

    /// Send WQEs posted but not yet taken by the device.
    pub fn send_backlog(&self) -> Result<u32> {
        let producer = *self.sq.producer.lock().unwrap_or_else(|e| e.into_inner());
        let consumer = self
            .doorbell
            .atomic_u32(QpDoorbell::SQ_CONSUMER)?
            .load(Ordering::Acquire);
        Ok(ring_pending(producer, consumer))
    }
}

impl SharedReceiveQueue {
    /// Writes `wrs` into the SRQ and rings the doorbell once.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        post_all(self.recv_chain()?, wrs)
    }

    /// A chain of receives for this SRQ (see [`Chain`]).
    pub fn recv_chain(&self) -> Result<Chain<'_, impl Fn(u64, &RecvWr<'_>) -> Result<()> + '_>> {
        let srq = &self.inner;
        let doorbell = Doorbell {
            record: &srq.doorbell,
            producer_at: SrqDoorbell::PRODUCER,
            consumer_at: SrqDoorbell::CONSUMER,
            notify_queue: srq.notify_queue,
            bit: srq.doorbell_bit,
        };
        let max_sge = srq.max_sge;
        Chain::begin(
            &srq.queue,
            doorbell,
            &srq.pd.device,
            move |slot, wr: &RecvWr<'_>| {
                encode_recv(wr, max_sge, |at, bytes| {
                    srq.queue.ring.write(slot + at, bytes)
                })
            },
        )
    }
}
