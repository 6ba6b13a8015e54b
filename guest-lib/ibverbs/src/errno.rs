//! How a failed call tells the program why: the errno libibverbs' callers read, mapped from
//! guest-lib's errors, and, when asked, a line on standard error.

use std::os::raw::c_int;
use std::sync::{Mutex, OnceLock};

pub(crate) fn set_errno(errno: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's life.
    unsafe { *libc::__errno_location() = errno };
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

/// The environment variable that asks this library (and vrdma's librdmacm) to say on standard
/// error why a call failed: set to anything but empty or `0`.
const DEBUG_VARIABLE: &str = "VRDMA_DEBUG";

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

#[cfg(test)]
mod tests;
