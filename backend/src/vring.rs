//! The device's virtqueues: vhost-user-backend's [`VringRwLock`], except that they read and
//! write guest memory only through the memory table the backend accepted, and that a kick
//! descriptor sent for a running queue is taken.
//!
//! vhost-user-backend installs a new memory table in the memory it gave the queues before it
//! asks the backend to check it (`update_memory`); a queue reading that memory (its used
//! index, its event index) in between could touch a region the backend is about to refuse,
//! one whose file does not cover it, and fault. So the queues are made over the backend's
//! own memory ([`over_accepted_memory`]), which holds only tables it accepted.
//!
//! vhost-user-backend registers a queue's kick descriptor with its worker's epoll once, when
//! the queue starts; SET_VRING_KICK on a running queue replaced the descriptor but left the
//! old one registered, so the queue silently stopped hearing kicks. Here such a queue is
//! marked not ready as the descriptor is replaced, which makes the handler start it again
//! with the new one, as it starts any queue whose kick descriptor arrives (its ring state is
//! kept). The old descriptor leaves the epoll when the front end closes it; a front end that
//! keeps kicking the old one after replacing it breaks only its own connection's worker.

use std::cell::RefCell;
use std::fs::File;
use std::io;

use vhost_user_backend::{VringRwLock, VringStateGuard, VringStateMutGuard, VringT};
use virtio_queue::{Error as QueueError, QueueT};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

type Memory = GuestMemoryAtomic<GuestMemoryMmap>;

thread_local! {
    /// The accepted memory the queues made on this thread read and write.
    static ACCEPTED_MEMORY: RefCell<Option<Memory>> = const { RefCell::new(None) };
}

/// Runs `make` (which creates a vhost-user daemon, and with it its queues, on this thread)
/// so that the queues it makes use `accepted`, the memory holding only the tables the
/// backend accepted, rather than the memory the daemon installs tables in unchecked.
pub fn over_accepted_memory<T>(accepted: &Memory, make: impl FnOnce() -> T) -> T {
    ACCEPTED_MEMORY.with(|m| *m.borrow_mut() = Some(accepted.clone()));
    let made = make();
    ACCEPTED_MEMORY.with(|m| *m.borrow_mut() = None);
    made
}

/// A virtqueue of the device (see the module).
#[derive(Clone)]
pub struct Vring(VringRwLock);

impl<'a> VringStateGuard<'a, Memory> for Vring {
    type G = <VringRwLock as VringStateGuard<'a, Memory>>::G;
}

impl<'a> VringStateMutGuard<'a, Memory> for Vring {
    type G = <VringRwLock as VringStateMutGuard<'a, Memory>>::G;
}

impl VringT<Memory> for Vring {
    /// Made over the accepted memory [`over_accepted_memory`] names, never over `unchecked`,
    /// the memory the daemon installs tables in before they are checked.
    fn new(_unchecked: Memory, max_queue_size: u16) -> Result<Self, QueueError> {
        let Some(accepted) = ACCEPTED_MEMORY.with(|m| m.borrow().clone()) else {
            log::error!("a virtqueue was made outside vring::over_accepted_memory");
            return Err(QueueError::QueueNotReady);
        };
        VringRwLock::new(accepted, max_queue_size).map(Vring)
    }

    fn get_ref(&self) -> <Self as VringStateGuard<'_, Memory>>::G {
        self.0.get_ref()
    }

    fn get_mut(&self) -> <Self as VringStateMutGuard<'_, Memory>>::G {
        self.0.get_mut()
    }

    fn add_used(&self, desc_index: u16, len: u32) -> Result<(), QueueError> {
        self.0.add_used(desc_index, len)
    }

    fn signal_used_queue(&self) -> io::Result<()> {
        self.0.signal_used_queue()
    }

    fn enable_notification(&self) -> Result<bool, QueueError> {
        self.0.enable_notification()
    }

    fn disable_notification(&self) -> Result<(), QueueError> {
        self.0.disable_notification()
    }

    fn needs_notification(&self) -> Result<bool, QueueError> {
        self.0.needs_notification()
    }

    fn set_enabled(&self, enabled: bool) {
        self.0.set_enabled(enabled)
    }

    fn set_queue_info(&self, desc: u64, avail: u64, used: u64) -> Result<(), QueueError> {
        self.0.set_queue_info(desc, avail, used)
    }

    fn queue_next_avail(&self) -> u16 {
        self.0.queue_next_avail()
    }

    fn set_queue_next_avail(&self, base: u16) {
        self.0.set_queue_next_avail(base)
    }

    fn set_queue_next_used(&self, idx: u16) {
        self.0.set_queue_next_used(idx)
    }

    fn queue_used_idx(&self) -> Result<u16, QueueError> {
        self.0.queue_used_idx()
    }

    fn set_queue_size(&self, num: u16) {
        self.0.set_queue_size(num)
    }

    fn set_queue_event_idx(&self, enabled: bool) {
        self.0.set_queue_event_idx(enabled)
    }

    fn set_queue_ready(&self, ready: bool) {
        self.0.set_queue_ready(ready)
    }

    fn set_kick(&self, file: Option<File>) {
        // The queue is looked at once for every kick descriptor it gets, as if kicked (QEMU's
        // notifiers start signalled too): a device taken over from another connection
        // (SPEC.md §11.1) may hold events for the buffers posted before, and a driver asleep
        // waiting for one kicks nothing.
        if let Some(kick) = &file {
            if let Err(e) = io::Write::write(&mut &*kick, &1u64.to_ne_bytes()) {
                log::warn!("cannot look at a queue given a kick descriptor: {e}");
            }
        }
        let running = self.0.get_ref().get_queue().ready();
        self.0.set_kick(file);
        if running {
            // The handler starts a queue that is not ready once it has a kick descriptor,
            // registering that descriptor (see the module).
            self.0.set_queue_ready(false);
        }
    }

    fn read_kick(&self) -> io::Result<bool> {
        self.0.read_kick()
    }

    fn set_call(&self, file: Option<File>) {
        self.0.set_call(file)
    }

    fn set_err(&self, file: Option<File>) {
        self.0.set_err(file)
    }
}
