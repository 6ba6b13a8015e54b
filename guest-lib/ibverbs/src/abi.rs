//! The C edge for the device, its context and queries: libibverbs' exported functions, each
//! a thin skin over guest-lib (`objects` is the other half). C callers hand in raw pointers
//! that only they can vouch for, exactly as with the system's libibverbs.
//!
//! Objects programs receive (`ibv_device`, `ibv_context`, ...) are the first field of a
//! `#[repr(C)]` struct of this library's own, so a pointer a program passes back leads to
//! its guest-lib object. Verbs vrdma does not serve yet fail with `EOPNOTSUPP` and a NULL or
//! error return, as libibverbs documents for unsupported verbs.
//!
//! By subject: `device.rs` finds and opens the device, `queries.rs` answers queries of an
//! open one, `async_events.rs` hands out its asynchronous events, `compat.rs` holds the verbs
//! of no object. This file keeps what they share: the context and errno.

mod async_events;
mod compat;
mod device;
mod queries;

use std::os::raw::c_int;
use std::sync::{Arc, Mutex, OnceLock};

use rdma_sys::{ibv_context, verbs_context};
use vrdma_guest::Device;

use crate::events::{AsyncEvents, Dispatcher};

pub(crate) use device::{ibv_free_device_list, ibv_get_device_list, ibv_open_device, open_context};

/// An open device: libibverbs' extended context (which ends with the `ibv_context` programs
/// hold), then this library's state.
#[repr(C)]
pub(crate) struct VrdmaContext {
    verbs: verbs_context,
    pub(crate) device: Device,
    /// Routes the device's events to channels and to `async_events`.
    dispatcher: Mutex<Dispatcher>,
    /// What `ibv_get_async_event` hands out; its eventfd is `context->async_fd`.
    async_events: Arc<AsyncEvents>,
}

pub(crate) fn set_errno(errno: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's life.
    unsafe { *libc::__errno_location() = errno };
}

/// The environment variable that asks this library (and vrdma's librdmacm) to say on standard
/// error why a call failed: set to anything but empty or `0`.
pub(crate) const DEBUG_VARIABLE: &str = "VRDMA_DEBUG";

/// Whether the program's environment asked for [`report_once`]'s lines, read once.
fn debug_asked() -> bool {
    static ASKED: OnceLock<bool> = OnceLock::new();
    *ASKED.get_or_init(|| {
        std::env::var_os(DEBUG_VARIABLE).is_some_and(|value| !value.is_empty() && value != "0")
    })
}

/// Says why a verb failed, on standard error, once per process and kind, and only when
/// `VRDMA_DEBUG` asks for it: a kernel provider fails silently with an errno, and programs
/// that search a device's limits by trial (libfabric's inline size, UCX's queue depths)
/// expect no line for a refused try.
pub(crate) fn report_once(kind: &'static str, message: &str) {
    if debug_asked() {
        say_once(kind, message);
    }
}

/// Says `message` on standard error once per process and kind, asked or not: for what keeps a
/// program from reaching vrdma0 at all (no device configured, a backend that does not answer),
/// which only the user can fix and nothing else would tell them.
pub(crate) fn report_setup(kind: &'static str, message: &str) {
    say_once(kind, message);
}

/// A library cannot log through the program, and a program looping over a failing call must
/// not flood its terminal: each kind is said once.
fn say_once(kind: &'static str, message: &str) {
    static SAID: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
    if !said.contains(&kind) {
        said.push(kind);
        eprintln!("vrdma: {message}");
    }
}

impl VrdmaContext {
    /// Runs `f` on the context's event dispatcher; the lock also serialises changes to
    /// channels' `refcnt`.
    pub(crate) fn with_dispatcher<R>(&self, f: impl FnOnce(&Dispatcher) -> R) -> R {
        f(&self.dispatcher.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// # Safety
/// `context` must be a context this library's `ibv_open_device` returned and not yet closed.
pub(crate) unsafe fn context_of<'a>(context: *mut ibv_context) -> &'a VrdmaContext {
    let offset = std::mem::offset_of!(verbs_context, context);
    // SAFETY: per the contract, `context` is the `verbs.context` field of a live
    // VrdmaContext whose first field is `verbs`; stepping back by the field's offset gives
    // the whole value.
    unsafe { &*(context.cast::<u8>().sub(offset).cast::<VrdmaContext>()) }
}

/// The errno for a guest-lib error, also left in the thread's `errno`, as libibverbs leaves
/// it whether a call reports failure by its return value or by NULL (programs read either).
pub(crate) fn raise_errno(error: &vrdma_guest::Error) -> c_int {
    let errno = errno_of(error);
    set_errno(errno);
    errno
}

/// An errno for a guest-lib error: the host's errno when the device passed one on (an empty
/// GID entry is ENODATA, as on a native device), else what the status means.
fn errno_of(error: &vrdma_guest::Error) -> c_int {
    use vrdma_guest::{Error, Status};
    match error {
        Error::Device { detail, .. } if *detail != 0 => {
            c_int::try_from(*detail).unwrap_or(libc::EIO)
        }
        Error::Device { status, .. } => match status {
            Status::NoResources => libc::ENOMEM,
            Status::Unsupported => libc::EOPNOTSUPP,
            Status::Busy => libc::EBUSY,
            Status::BadAddress => libc::EFAULT,
            Status::BadHandle => libc::EBADF,
            _ => libc::EINVAL,
        },
        Error::InvalidArgument(_) | Error::OutOfBounds { .. } => libc::EINVAL,
        // A full work queue: ENOMEM, as rxe and mlx5 say it.
        Error::OutOfSharedMemory(_) | Error::QueueFull { .. } => libc::ENOMEM,
        Error::Timeout(_) => libc::ETIMEDOUT,
        // ENOMEM past RLIMIT_MEMLOCK, as uverbs answers a registration past it.
        Error::Pin { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        // Past a memory limit (RLIMIT_MEMLOCK, the service's shares, the backend's memory
        // regions): ENOMEM, as uverbs refuses pinning past RLIMIT_MEMLOCK.
        Error::OverLimit(_) => libc::ENOMEM,
        // The OS error of a failed system call, not a generic EIO.
        Error::System { source, .. } | Error::Transport(source) | Error::SharedMemory(source) => {
            source.raw_os_error().unwrap_or(libc::EIO)
        }
        Error::NoDevice(_) => libc::ENODEV,
        Error::DeviceBusy(_) => libc::EBUSY,
        // Past the service's limit on programs: a later attempt may be served.
        Error::ServiceRefused(_) => libc::EAGAIN,
        Error::Incompatible(_) => libc::EPROTO,
        _ => libc::EIO,
    }
}

#[cfg(test)]
mod tests;
