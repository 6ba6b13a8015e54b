//! Which process a device belongs to. A child that `fork` made inherits its parent's
//! connection to the device (the socket, the shared rings, the doorbell records): a request
//! the child sent would land in the parent's conversation with the device (in direct attach
//! the backend then ends the connection; through the guest service both get a garbled
//! answer), and a post or poll would move the parent's queues. So every request, post and
//! poll first asks whether it runs in the process that opened the device, and a child gets
//! [`crate::Error::Forked`] without anything being sent, as natively only the child fails.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

/// Forks this process has been through: every child the C library's `fork` makes counts one
/// more than its parent.
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_fork_in_child() {
    // An atomic add is async-signal-safe, as a fork handler must be.
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// The process that opened a device.
#[derive(Clone, Copy, Debug)]
pub struct OpenedBy {
    pid: u32,
    forks: u64,
}

impl OpenedBy {
    /// This process.
    pub fn this_process() -> OpenedBy {
        static HANDLER: Once = Once::new();
        HANDLER.call_once(|| {
            // SAFETY: registers a child handler that only does an atomic add; the function
            // lives as long as the program (this library is not unloaded while a device it
            // opened is in use).
            let registered = unsafe { libc::pthread_atfork(None, None, Some(count_fork_in_child)) };
            if registered != 0 {
                log::warn!(
                    "cannot watch for fork (pthread_atfork: {registered}): a forked child is told apart by its process id only"
                );
            }
        });
        OpenedBy {
            pid: std::process::id(),
            forks: FORKS.load(Ordering::Relaxed),
        }
    }

    /// Whether this runs in that process, told by the fork count alone: a relaxed load, cheap
    /// enough for the data path. A child made without the C library's `fork` (a raw `clone`)
    /// is not seen here, only by [`OpenedBy::is_this_process`].
    pub fn is_this_process_fast(&self) -> bool {
        FORKS.load(Ordering::Relaxed) == self.forks
    }

    /// Whether this runs in that process: the fork count, then the process id (a system
    /// call), for requests to the device.
    pub fn is_this_process(&self) -> bool {
        self.is_this_process_fast() && std::process::id() == self.pid
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forked_child_is_not_the_process_that_opened_the_device_and_its_parent_still_is() {
        let opened = OpenedBy::this_process();
        assert!(opened.is_this_process() && opened.is_this_process_fast());
        // SAFETY: the child only reads two atomics, makes a system call and exits at once
        // with _exit, touching nothing another thread of this test process might hold.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork");
        if child == 0 {
            let seen = !opened.is_this_process_fast() && !opened.is_this_process();
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(if seen { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just made; `status` is a valid out-pointer.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child saw itself as its parent"
        );
        assert!(opened.is_this_process(), "the parent is unchanged");
    }
}
