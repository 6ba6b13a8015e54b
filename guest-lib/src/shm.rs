//! Memory shared with the device: memfd regions mapped into this process.
//!
//! How the device addresses a region depends on the transport. In direct attach the region is
//! handed to the backend through the vhost-user memory table with its address in this process
//! as its guest-physical address, so a buffer's "guest virtual" and "guest physical" addresses
//! are one and the same. Inside a VM a region is pinned ([`crate::pin`]), which also gives
//! each of its pages' guest-physical address.
//!
//! This module and `mmio` hold guest-lib's `unsafe`: mapping, and access to memory the device
//! also writes.
//!
//! By job: `mapping.rs` makes regions and unmaps them, `heap.rs` allocates within one,
//! `region.rs` gives its addresses and buffers, `buffer.rs` accesses a buffer,
//! `region_set.rs` spans a transport's regions.

mod buffer;
mod heap;
mod mapping;
mod region;
mod region_set;

use std::fs::File;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::pin::Pin;

use heap::Heap;
pub use region_set::RegionSet;

pub use crate::PAGE_SIZE;
const HUGE_PAGE_SIZE: u64 = 2 << 20;

/// How the device addresses a region's memory.
#[derive(Debug)]
enum DeviceAddressing {
    /// At this process's addresses (direct attach).
    SameAsProcess,
    /// Page by page, at these guest-physical addresses (inside a VM).
    Pages(Vec<u64>),
}

/// Memory this process shares with the device: a memfd mapped for guest-lib's own buffers,
/// or memory of the program's that was made shareable in place (`share_in_place`,
/// `pin_in_place`), which guest-lib never allocates from nor unmaps.
pub struct Region {
    /// The memfd behind the memory, when there is one (not for pinned program memory).
    file: Option<File>,
    base: NonNull<u8>,
    len: u64,
    page_size: u64,
    addressing: DeviceAddressing,
    heap: Mutex<Heap>,
    /// Whether dropping the region unmaps it (guest-lib's own) or leaves it mapped (the
    /// program's).
    owned: bool,
    /// The pin that keeps the pages where the device was told they are (inside a VM), until
    /// the region is dropped.
    pin: Option<Pin>,
}

// SAFETY: the mapping is plain shared memory; all access goes through bounds-checked copies or
// atomics, and the free list is behind a mutex.
unsafe impl Send for Region {}
// SAFETY: `&self` methods copy with bounds checks or use atomics on shared memory the device
// writes at any time anyway, and take the mutex for the free list.
unsafe impl Sync for Region {}

/// A piece of shared memory; returned to its region when dropped.
pub struct SharedBuffer {
    region: Arc<Region>,
    offset: u64,
    len: u64,
    /// The alignment it was allocated with, which says which pool it returns to.
    align: u64,
    /// Whether it came from the region's heap (and goes back to it), or is a view.
    pooled: bool,
}

#[cfg(test)]
mod tests;
