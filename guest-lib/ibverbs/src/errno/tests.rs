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
