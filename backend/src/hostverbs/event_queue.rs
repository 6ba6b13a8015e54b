//! A queue of events behind a file descriptor, as a host's event channels are.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{Error, Result};

/// Events behind a file descriptor that is readable while some are pending: a context's
/// asynchronous events, a connection manager channel's events.
pub(in crate::hostverbs) struct EventQueue<T> {
    pub(in crate::hostverbs) fd: EventFd,
    queue: Mutex<VecDeque<T>>,
}

impl<T> EventQueue<T> {
    pub(in crate::hostverbs) fn new() -> Result<EventQueue<T>> {
        let fd = EventFd::new(EFD_NONBLOCK).map_err(|source| Error::Verbs {
            call: "eventfd",
            source,
        })?;
        Ok(EventQueue {
            fd,
            queue: Mutex::default(),
        })
    }

    pub(in crate::hostverbs) fn push(&self, event: T) {
        self.queue().push_back(event);
        // A full counter (2^64 - 2 unread events) still leaves the fd readable.
        let _ = self.fd.write(1);
    }

    fn queue(&self) -> MutexGuard<'_, VecDeque<T>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(in crate::hostverbs) fn take(&self) -> Option<T> {
        if let Some(event) = self.queue().pop_front() {
            return Some(event);
        }
        // Cleared before looking again: an event pushed after this read makes the fd
        // readable again, one pushed before is found below.
        let _ = self.fd.read();
        self.queue().pop_front()
    }
}
