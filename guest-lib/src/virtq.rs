//! The driver side of a virtio split virtqueue in shared memory, for synchronous requests (one
//! chain in flight at a time), as the control queue needs.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::shm::{Region, SharedBuffer, PAGE_SIZE};
use crate::{Error, Result};

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
    size: u16,
    next_avail: u16,
    next_used: u16,
    pub kick: EventFd,
    pub call: EventFd,
    epoll: Epoll,
}

impl SplitQueue {
    /// A queue of `size` entries (a power of two) with its rings in `region`.
    pub fn new(region: &Arc<Region>, size: u16) -> Result<SplitQueue> {
        assert!(size.is_power_of_two(), "queue sizes are powers of two");
        let n = u64::from(size);
        let bytes = Self::used_offset(size) + 6 + 8 * n;
        let ring = region
            .alloc(bytes, PAGE_SIZE)
            .ok_or(Error::OutOfSharedMemory(bytes))?;
        let call = EventFd::new(EFD_NONBLOCK).map_err(Error::Transport)?;
        let epoll = Epoll::new().map_err(Error::Transport)?;
        epoll
            .ctl(
                ControlOperation::Add,
                std::os::fd::AsRawFd::as_raw_fd(&call),
                EpollEvent::new(EventSet::IN, 0),
            )
            .map_err(Error::Transport)?;
        Ok(SplitQueue {
            ring,
            size,
            next_avail: 0,
            next_used: 0,
            kick: EventFd::new(EFD_NONBLOCK).map_err(Error::Transport)?,
            call,
            epoll,
        })
    }

    fn avail_offset(size: u16) -> u64 {
        DESC_SIZE * u64::from(size)
    }

    fn used_offset(size: u16) -> u64 {
        (Self::avail_offset(size) + 6 + 2 * u64::from(size)).next_multiple_of(4)
    }

    pub fn desc_addr(&self) -> u64 {
        self.ring.addr()
    }
    pub fn avail_addr(&self) -> u64 {
        self.ring.addr() + Self::avail_offset(self.size)
    }
    pub fn used_addr(&self) -> u64 {
        self.ring.addr() + Self::used_offset(self.size)
    }

    /// Makes `chain` available to the device and kicks it.
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
        self.kick.write(1).map_err(Error::Transport)
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
        self.kick.write(1).map_err(Error::Transport)
    }

    /// The next used element (descriptor id, bytes written), waiting up to `timeout` on the
    /// call eventfd; `None` when the device returned nothing in time.
    fn next_used_element(&mut self, timeout: Duration) -> Result<Option<(u32, u32)>> {
        let used = Self::used_offset(self.size);
        let deadline = Instant::now() + timeout;
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
            let mut events = [EpollEvent::default(); 1];
            let wait_ms = left.as_millis().clamp(1, 100) as i32;
            self.epoll
                .wait(wait_ms, &mut events)
                .map_err(Error::Transport)?;
            // Drain the call eventfd; the index check above decides.
            let _ = self.call.read();
        }
    }

    /// The next used buffer of a [`SplitQueue::post_all`] queue: its descriptor index and the
    /// bytes written, waiting up to `timeout`; the caller gives it back with `repost`.
    pub fn next_used(&mut self, timeout: Duration) -> Result<Option<(u16, u32)>> {
        Ok(self
            .next_used_element(timeout)?
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
        self.kick.write(1).map_err(Error::Transport)
    }

    /// Kicks the device (a notification queue: no buffers).
    pub fn kick(&self) -> Result<()> {
        self.kick.write(1).map_err(Error::Transport)
    }

    /// Waits for the device to return the chain; returns the bytes it wrote.
    pub fn wait_used(&mut self, timeout: Duration) -> Result<u32> {
        match self.next_used_element(timeout)? {
            Some((_, len)) => Ok(len),
            None => Err(Error::Timeout(timeout)),
        }
    }
}
