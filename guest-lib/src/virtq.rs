//! The driver side of virtio split virtqueues in shared memory, for synchronous requests (one
//! chain in flight at a time), as the control queue needs; and the device's set of queues
//! (SPEC.md §4), which every transport drives the same way once it has set them up.

use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_spec::ring::Event;
use vrdma_spec::ByteValued;

use crate::shm::{RegionSet, SharedBuffer, PAGE_SIZE};
use crate::{Error, Result};

/// How a transport tells the device about new buffers, and learns about used ones.
pub trait QueueSignal: Send + Sync {
    /// Notifies the device that the queue has new buffers.
    fn kick(&self) -> Result<()>;
    /// Returns when the device may have used buffers, or after `timeout` at the latest.
    fn wait(&self, timeout: Duration) -> Result<()>;
}

/// Kick and call eventfds, as vhost-user passes them to the backend.
pub struct EventFdSignal {
    pub kick: EventFd,
    pub call: EventFd,
    epoll: Epoll,
}

impl EventFdSignal {
    pub fn new() -> Result<EventFdSignal> {
        let call = EventFd::new(EFD_NONBLOCK).map_err(Error::Transport)?;
        let epoll = Epoll::new().map_err(Error::Transport)?;
        epoll
            .ctl(
                ControlOperation::Add,
                std::os::fd::AsRawFd::as_raw_fd(&call),
                EpollEvent::new(EventSet::IN, 0),
            )
            .map_err(Error::Transport)?;
        Ok(EventFdSignal {
            kick: EventFd::new(EFD_NONBLOCK).map_err(Error::Transport)?,
            call,
            epoll,
        })
    }
}

impl QueueSignal for EventFdSignal {
    fn kick(&self) -> Result<()> {
        self.kick.write(1).map_err(Error::Transport)
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        let mut events = [EpollEvent::default(); 1];
        let wait_ms = timeout.as_millis().clamp(1, 100) as i32;
        self.epoll
            .wait(wait_ms, &mut events)
            .map_err(Error::Transport)?;
        // Drain the call eventfd; the caller's index check decides.
        let _ = self.call.read();
        Ok(())
    }
}

const DESC_SIZE: u64 = 16;
const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;

/// A buffer of a chain: address, length, and whether the device writes it.
#[derive(Clone, Copy, Debug)]
pub struct ChainBuffer {
    pub addr: u64,
    pub len: u32,
    pub device_writes: bool,
}

pub struct SplitQueue {
    ring: SharedBuffer,
    /// The device's address of `ring`.
    ring_addr: u64,
    size: u16,
    next_avail: u16,
    next_used: u16,
    signal: Box<dyn QueueSignal>,
}

impl SplitQueue {
    /// A queue of `size` entries (a power of two) with its rings in `memory`.
    pub fn new(memory: &RegionSet, size: u16, signal: Box<dyn QueueSignal>) -> Result<SplitQueue> {
        assert!(size.is_power_of_two(), "queue sizes are powers of two");
        let bytes = Self::used_offset(size) + 6 + 8 * u64::from(size);
        let ring = memory
            .alloc(bytes, PAGE_SIZE)
            .ok_or(Error::OutOfSharedMemory(bytes))?;
        Ok(SplitQueue {
            ring_addr: ring.device_addr()?,
            ring,
            size,
            next_avail: 0,
            next_used: 0,
            signal,
        })
    }

    fn avail_offset(size: u16) -> u64 {
        DESC_SIZE * u64::from(size)
    }

    fn used_offset(size: u16) -> u64 {
        (Self::avail_offset(size) + 6 + 2 * u64::from(size)).next_multiple_of(4)
    }

    pub fn size(&self) -> u16 {
        self.size
    }
    pub fn desc_addr(&self) -> u64 {
        self.ring_addr
    }
    pub fn avail_addr(&self) -> u64 {
        self.ring_addr + Self::avail_offset(self.size)
    }
    pub fn used_addr(&self) -> u64 {
        self.ring_addr + Self::used_offset(self.size)
    }

    /// Makes `chain` available to the device and kicks it.
    /// Publishes `index` as the available index and kicks, whatever the ring holds: what a
    /// broken or hostile driver might do (for conformance tests of a device).
    pub fn publish_avail_index(&mut self, index: u16) -> Result<()> {
        let avail = Self::avail_offset(self.size);
        self.ring
            .atomic_u16(avail + 2)?
            .store(index, Ordering::Release);
        self.signal.kick()
    }

    pub fn submit(&mut self, chain: &[ChainBuffer]) -> Result<()> {
        assert!(!chain.is_empty() && chain.len() <= usize::from(self.size));
        for (i, buffer) in chain.iter().enumerate() {
            let mut flags = if buffer.device_writes {
                DESC_F_WRITE
            } else {
                0
            };
            let next = if i + 1 < chain.len() {
                flags |= DESC_F_NEXT;
                i as u16 + 1
            } else {
                0
            };
            let mut desc = [0u8; DESC_SIZE as usize];
            desc[0..8].copy_from_slice(&buffer.addr.to_le_bytes());
            desc[8..12].copy_from_slice(&buffer.len.to_le_bytes());
            desc[12..14].copy_from_slice(&flags.to_le_bytes());
            desc[14..16].copy_from_slice(&next.to_le_bytes());
            self.ring.write(DESC_SIZE * i as u64, &desc)?;
        }
        let avail = Self::avail_offset(self.size);
        let slot = u64::from(self.next_avail % self.size);
        self.ring.write(avail + 4 + 2 * slot, &0u16.to_le_bytes())?; // head: descriptor 0
        self.next_avail = self.next_avail.wrapping_add(1);
        // Release: the descriptors and ring entry are visible before the new index.
        self.ring
            .atomic_u16(avail + 2)?
            .store(self.next_avail, Ordering::Release);
        self.signal.kick()
    }

    /// Makes every descriptor available as one device-writable buffer of `len` bytes at
    /// `base + i * len` (a receive-only queue, such as the event queue).
    pub fn post_all(&mut self, base: u64, len: u32) -> Result<()> {
        let avail = Self::avail_offset(self.size);
        for i in 0..self.size {
            let mut desc = [0u8; DESC_SIZE as usize];
            desc[0..8].copy_from_slice(&(base + u64::from(i) * u64::from(len)).to_le_bytes());
            desc[8..12].copy_from_slice(&len.to_le_bytes());
            desc[12..14].copy_from_slice(&DESC_F_WRITE.to_le_bytes());
            self.ring.write(DESC_SIZE * u64::from(i), &desc)?;
            self.ring
                .write(avail + 4 + 2 * u64::from(i), &i.to_le_bytes())?;
        }
        self.next_avail = self.size;
        self.ring
            .atomic_u16(avail + 2)?
            .store(self.next_avail, Ordering::Release);
        self.signal.kick()
    }

    /// The next used element (descriptor id, bytes written), waiting up to `timeout`: for the
    /// first `poll` of it by looking at the used ring, then on the transport's signal; `None`
    /// when the device returned nothing in time.
    fn next_used_element(
        &mut self,
        timeout: Duration,
        poll: Duration,
    ) -> Result<Option<(u32, u32)>> {
        let used = Self::used_offset(self.size);
        let started = Instant::now();
        let deadline = started + timeout;
        loop {
            if self.ring.atomic_u16(used + 2)?.load(Ordering::Acquire) != self.next_used {
                let slot = u64::from(self.next_used % self.size);
                let mut elem = [0u8; 8];
                self.ring.read(used + 4 + 8 * slot, &mut elem)?;
                self.next_used = self.next_used.wrapping_add(1);
                let id = u32::from_le_bytes(elem[0..4].try_into().expect("4 bytes"));
                let len = u32::from_le_bytes(elem[4..8].try_into().expect("4 bytes"));
                return Ok(Some((id, len)));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            if started.elapsed() < poll {
                // Not sched_yield: that lets the scheduler wake the device's thread on this
                // CPU, behind this one (16 us a round trip instead of 2 on real cores). A
                // woken thread preempts a thread that polls anyway.
                std::hint::spin_loop();
                continue;
            }
            self.signal.wait(left)?;
        }
    }

    /// The next used buffer of a [`SplitQueue::post_all`] queue: its descriptor index and the
    /// bytes written, waiting up to `timeout`; the caller gives it back with `repost`.
    pub fn next_used(&mut self, timeout: Duration) -> Result<Option<(u16, u32)>> {
        Ok(self
            .next_used_element(timeout, Duration::ZERO)?
            .map(|(id, len)| ((id % u32::from(self.size)) as u16, len)))
    }

    /// Makes descriptor `id` available again.
    pub fn repost(&mut self, id: u16) -> Result<()> {
        let avail = Self::avail_offset(self.size);
        let slot = u64::from(self.next_avail % self.size);
        self.ring.write(avail + 4 + 2 * slot, &id.to_le_bytes())?;
        self.next_avail = self.next_avail.wrapping_add(1);
        self.ring
            .atomic_u16(avail + 2)?
            .store(self.next_avail, Ordering::Release);
        self.signal.kick()
    }

    /// Kicks the device (a notification queue: no buffers).
    pub fn kick(&self) -> Result<()> {
        self.signal.kick()
    }

    /// Waits for the device to return the chain, looking at the used ring for the first
    /// `poll` of `timeout`; returns the bytes it wrote.
    pub fn wait_used(&mut self, timeout: Duration, poll: Duration) -> Result<u32> {
        match self.next_used_element(timeout, poll)? {
            Some((_, len)) => Ok(len),
            None => Err(Error::Timeout(timeout)),
        }
    }
}

/// Queue size guest-lib sets up on every queue: one control request is in flight at a time,
/// and events are few.
pub const QUEUE_SIZE: u16 = 16;
/// Size of one event (SPEC.md §8.4).
const EVENT_SIZE: u64 = std::mem::size_of::<Event>() as u64;
/// Control requests and responses are at most this long (one page each, so that they are
/// contiguous for the device on any transport).
const CONTROL_BUFFER: u64 = PAGE_SIZE;
/// How long a control request may take before the device is considered gone. Generous: the
/// tests run under full emulation, nested.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a wait for the device looks whether it is gone.
const GONE_CHECK_INTERVAL: Duration = Duration::from_millis(200);
/// How long a control request's wait looks at the used ring before it sleeps until the device
/// signals, when the last request's round trip took no longer. Sleeping costs a wake-up on the
/// program's side, most of a short command's round trip when the device runs on other cores
/// (ALLOC_PD through a loopback backend on real cores: 45 us sleeping, 2.6 us looking). Where
/// round trips take longer (the device busy, or sharing the program's few CPUs: under
/// emulation, waits that looked for 500 us kept the device's thread off its CPU, and the
/// emulated test tier had not ended after twice its usual time), the program sleeps at once.
const CONTROL_POLL: Duration = Duration::from_micros(50);

struct Control {
    queue: SplitQueue,
    request: SharedBuffer,
    response: SharedBuffer,
    /// How long the last request took.
    last_round_trip: Duration,
}

struct Events {
    queue: SplitQueue,
    buffers: SharedBuffer,
}

/// The device's queues once a transport has set them up: control, event, notification.
pub struct DeviceQueues {
    control: Mutex<Control>,
    events: Mutex<Events>,
    /// Notification queues: only ever kicked.
    notify: Vec<SplitQueue>,
}

impl DeviceQueues {
    /// Takes `queues` in device order; posts the event queue's buffers.
    pub fn new(memory: &RegionSet, queues: Vec<SplitQueue>) -> Result<DeviceQueues> {
        let buffer = |len, align| {
            memory
                .alloc(len, align)
                .ok_or(Error::OutOfSharedMemory(len))
        };
        let mut queues = queues.into_iter();
        let (Some(control_queue), Some(mut event_queue)) = (queues.next(), queues.next()) else {
            return Err(Error::Incompatible(
                "the device needs at least two queues".into(),
            ));
        };
        let control = Control {
            queue: control_queue,
            request: buffer(CONTROL_BUFFER, PAGE_SIZE)?,
            response: buffer(CONTROL_BUFFER, PAGE_SIZE)?,
            last_round_trip: Duration::ZERO,
        };
        let buffers = buffer(EVENT_SIZE * u64::from(event_queue.size()), PAGE_SIZE)?;
        event_queue.post_all(buffers.device_addr()?, EVENT_SIZE as u32)?;
        Ok(DeviceQueues {
            control: Mutex::new(control),
            events: Mutex::new(Events {
                queue: event_queue,
                buffers,
            }),
            notify: queues.collect(),
        })
    }

    /// Sends one control request and waits for its response; returns the bytes the device
    /// wrote into `response`.
    /// Sends `request` on the control queue and waits for the response, giving up when
    /// `gone` says the device went away, or after a minute.
    pub fn control(
        &self,
        request: &[u8],
        response: &mut [u8],
        gone: &dyn Fn() -> bool,
    ) -> Result<usize> {
        if request.len() as u64 > CONTROL_BUFFER || response.len() as u64 > CONTROL_BUFFER {
            return Err(Error::OutOfBounds {
                offset: 0,
                len: request.len().max(response.len()) as u64,
                size: CONTROL_BUFFER,
            });
        }
        let mut control = self.control.lock().unwrap_or_else(|e| e.into_inner());
        let control = &mut *control;
        control.request.write(0, request)?;
        let chain = [
            ChainBuffer {
                addr: control.request.device_addr()?,
                len: request.len() as u32,
                device_writes: false,
            },
            ChainBuffer {
                addr: control.response.device_addr()?,
                len: response.len() as u32,
                device_writes: true,
            },
        ];
        control.queue.submit(&chain)?;
        let started = std::time::Instant::now();
        let mut poll = if control.last_round_trip <= CONTROL_POLL {
            CONTROL_POLL
        } else {
            Duration::ZERO
        };
        let written = loop {
            match control
                .queue
                .wait_used(GONE_CHECK_INTERVAL, std::mem::take(&mut poll))
            {
                Ok(written) => break written,
                Err(Error::Timeout(_)) if gone() => return Err(Error::Disconnected),
                Err(Error::Timeout(_)) if started.elapsed() >= CONTROL_TIMEOUT => {
                    return Err(Error::Timeout(CONTROL_TIMEOUT))
                }
                Err(Error::Timeout(_)) => {}
                Err(e) => return Err(e),
            }
        };
        control.last_round_trip = started.elapsed();
        let written = (written as usize).min(response.len());
        control.response.read(0, &mut response[..written])?;
        Ok(written)
    }

    /// Publishes `ahead` entries more than were made available on the control queue
    /// (conformance tests of the device's queue handling).
    pub fn publish_bogus_control_entries(&self, ahead: u16) -> Result<()> {
        let mut control = self.control.lock().unwrap_or_else(|e| e.into_inner());
        let index = control.queue.next_avail.wrapping_add(ahead);
        control.queue.publish_avail_index(index)
    }

    /// Kicks notification queue `queue`.
    pub fn notify(&self, queue: u32) -> Result<()> {
        let queue = self.notify.get(queue as usize).ok_or_else(|| {
            Error::InvalidArgument(format!("the device has no notification queue {queue}"))
        })?;
        queue.kick()
    }

    /// The next event the device posted, waiting up to `timeout`.
    pub fn next_event(&self, timeout: Duration) -> Result<Option<Event>> {
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        let Some((id, len)) = events.queue.next_used(timeout)? else {
            return Ok(None);
        };
        let mut event = Event::default();
        if len as u64 >= EVENT_SIZE {
            events
                .buffers
                .read(u64::from(id) * EVENT_SIZE, event.as_mut_slice())?;
        }
        events.queue.repost(id)?;
        Ok(Some(event))
    }
}
