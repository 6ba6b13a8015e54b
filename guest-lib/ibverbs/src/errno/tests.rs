//! Unit tests of `errno`.

use super::*;

fn errno() -> c_int {
    // SAFETY: this thread's errno slot.
    unsafe { *libc::__errno_location() }
}

#[test]
fn a_failure_is_returned_and_left_in_errno() {
    set_errno(0);
    let full = vrdma_guest::Error::QueueFull { posted: 3 };
    assert_eq!(
        raise_errno(&full),
        libc::ENOMEM,
        "a full queue, as rxe says it"
    );
    assert_eq!(errno(), libc::ENOMEM);
    let refused = vrdma_guest::Error::Device {
        opcode: vrdma_guest::Opcode::ModifyQp,
        status: vrdma_guest::Status::InvalidArgument,
        detail: 0,
    };
    assert_eq!(raise_errno(&refused), libc::EINVAL);
    assert_eq!(errno(), libc::EINVAL);
}

#[test]
fn a_failed_system_call_keeps_its_own_errno() {
    use vrdma_guest::Error;
    let os = |errno| std::io::Error::from_raw_os_error(errno);
    let cases = [
        (
            Error::System {
                what: "opening a sysfs file".into(),
                source: os(libc::EACCES),
            },
            libc::EACCES,
        ),
        (Error::Transport(os(libc::EPIPE)), libc::EPIPE),
        (Error::SharedMemory(os(libc::EMFILE)), libc::EMFILE),
        (
            Error::Transport(std::io::Error::other("no errno")),
            libc::EIO,
        ),
        (Error::NoDevice("none in this VM".into()), libc::ENODEV),
        (Error::DeviceBusy("vrdmad drives it".into()), libc::EBUSY),
        (
            Error::ServiceRefused("too many programs".into()),
            libc::EAGAIN,
        ),
    ];
    for (error, expected) in cases {
        assert_eq!(errno_of(&error), expected, "{error}");
    }
}

#[test]
fn every_kind_of_error_maps_to_its_errno() {
    use std::time::Duration;
    use vrdma_guest::{Error, Opcode, Status};
    let os = |errno| std::io::Error::from_raw_os_error(errno);
    let no_os_code = || std::io::Error::other("no errno");
    let device = |status, detail| Error::Device {
        opcode: Opcode::CreateQp,
        status,
        detail,
    };
    let cases = [
        // The host's errno, when the device passed one on, whatever the status.
        (
            device(Status::HostError, libc::ENODATA as u32),
            libc::ENODATA,
        ),
        (device(Status::NoResources, libc::EPERM as u32), libc::EPERM),
        // A detail no errno can hold: EIO.
        (device(Status::HostError, u32::MAX), libc::EIO),
        // Detail 0: by status.
        (device(Status::NoResources, 0), libc::ENOMEM),
        (device(Status::Unsupported, 0), libc::EOPNOTSUPP),
        (device(Status::Busy, 0), libc::EBUSY),
        (device(Status::BadAddress, 0), libc::EFAULT),
        (device(Status::BadHandle, 0), libc::EBADF),
        (device(Status::InvalidArgument, 0), libc::EINVAL),
        (device(Status::BadLength, 0), libc::EINVAL),
        (device(Status::HostError, 0), libc::EINVAL),
        (device(Status::NotReady, 0), libc::EINVAL),
        (Error::InvalidArgument("max_sge".into()), libc::EINVAL),
        (
            Error::OutOfBounds {
                offset: 8,
                len: 8,
                size: 8,
            },
            libc::EINVAL,
        ),
        (Error::OutOfSharedMemory(4096), libc::ENOMEM),
        (Error::QueueFull { posted: 0 }, libc::ENOMEM),
        (Error::Timeout(Duration::from_secs(1)), libc::ETIMEDOUT),
        (Error::OverLimit("RLIMIT_MEMLOCK".into()), libc::ENOMEM),
        // The OS error itself, EIO only where there is none.
        (
            Error::Pin {
                call: "pin",
                source: os(libc::ENOMEM),
            },
            libc::ENOMEM,
        ),
        (
            Error::Pin {
                call: "pin",
                source: no_os_code(),
            },
            libc::EIO,
        ),
        (
            Error::System {
                what: "mapping a BAR".into(),
                source: os(libc::EPERM),
            },
            libc::EPERM,
        ),
        (
            Error::System {
                what: "mapping a BAR".into(),
                source: no_os_code(),
            },
            libc::EIO,
        ),
        (Error::Transport(os(libc::ECONNRESET)), libc::ECONNRESET),
        (Error::Transport(no_os_code()), libc::EIO),
        (Error::SharedMemory(os(libc::ENOSPC)), libc::ENOSPC),
        (Error::SharedMemory(no_os_code()), libc::EIO),
        (Error::NoDevice("no PCI device".into()), libc::ENODEV),
        (Error::DeviceBusy("vrdmad drives it".into()), libc::EBUSY),
        (
            Error::ServiceRefused("too many programs".into()),
            libc::EAGAIN,
        ),
        (Error::Incompatible("no event queue".into()), libc::EPROTO),
        // The rest: EIO.
        (Error::SpecVersion { device: 99 }, libc::EIO),
        (Error::Refused, libc::EIO),
        (
            Error::BadResponse {
                opcode: Opcode::CreateQp,
                len: 3,
            },
            libc::EIO,
        ),
        (Error::NotShared { addr: 0, len: 1 }, libc::EIO),
        (Error::NotContiguous { addr: 0, len: 1 }, libc::EIO),
        (Error::DeviceReset, libc::EIO),
        (Error::Disconnected, libc::EIO),
        (Error::Forked, libc::EIO),
    ];
    for (error, expected) in cases {
        assert_eq!(errno_of(&error), expected, "{error:?}");
    }
}
