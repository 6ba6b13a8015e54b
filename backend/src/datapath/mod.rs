//! The data path (SPEC.md §7-§8): poller threads read WQEs from rings in guest memory, post
//! them to the host QPs in batches, poll the host CQs and write CQEs into guest CQ rings.
//!
//! Every access to guest memory goes through the current vhost-user memory snapshot with
//! bounds-checked copies and atomics (`vm-memory`), so a hostile or vanishing ring can make a
//! QP fail but never make the backend touch memory it does not own. WQEs are copied out of the
//! ring before they are validated. Payload is never copied: SGEs name guest memory registered
//! at the guest's addresses (inline data is part of the WQE itself).
//!
//! By subject: `connection.rs` holds `DataPath`, what the control path drives; `shared.rs`
//! what a connection's threads share; `queue_table.rs` the table of its queues, `mr_table.rs` that
//! of its MRs; `events.rs` events for the guest; `resize_cq.rs` RESIZE_CQ; `poller/` a pool
//! thread's passes, `pool.rs` the threads.

mod connection;
mod doorbells;
mod events;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fake;
mod guest_access;
mod mr_table;
mod poller;
mod pool;
mod queue_table;
mod queues;
mod rate;
mod resize_cq;
mod shared;
#[cfg(test)]
mod tests;
pub mod wqe;

pub use connection::{DataPath, Stats};
pub use doorbells::{AreaInUse, NoBit, NotifyArea};
pub use events::{EventRaiser, EventSink};
pub use pool::PollerPool;
pub use queues::{CqData, GuestRing, QpData, SrqData};
pub use rate::{RateDebt, RateLimits};
pub use resize_cq::ResizeCqError;

use vm_memory::GuestMemoryMmap;

type Memory = GuestMemoryMmap;

/// WQEs taken from one ring in one go, and CQEs moved per CQ per pass.
const BATCH: u32 = 16;
/// The longest a poller sleeps while a queue waits on something no kick announces (room the
/// driver makes in a full CQ by polling it); an idle poller sleeps until woken.
const SLEEP_LIMIT_MS: i32 = 100;
