//! Waiting on descriptors: the transports' sockets and the device's interrupt.

use std::os::fd::AsFd;
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

/// Waits up to `timeout` (at least a millisecond) for `fd` to be readable; whether it is.
/// An interrupted wait counts as a timeout: callers look again anyway.
pub(crate) fn readable(fd: &impl AsFd, timeout: Duration) -> std::io::Result<bool> {
    let timeout =
        PollTimeout::try_from(timeout.clamp(Duration::from_millis(1), Duration::from_secs(3600)))
            .unwrap_or(PollTimeout::MAX);
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    match poll(&mut fds, timeout) {
        Ok(ready) => Ok(ready > 0),
        Err(Errno::EINTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Whether the peer of the unix socket `fd` is gone (looked at without waiting): its
/// closing shuts both directions down, which poll reports as POLLHUP whatever was asked.
pub(crate) fn hung_up(fd: &impl AsFd) -> bool {
    // Not POLLRDHUP: nix does not know it, and would then report no events at all.
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(ready) if ready > 0)
        && fds[0]
            .revents()
            .is_some_and(|revents| revents.intersects(PollFlags::POLLHUP | PollFlags::POLLERR))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_socket_whose_peer_is_gone_has_hung_up_and_one_with_data_has_not() {
        let (mine, peer) = UnixStream::pair().unwrap();
        assert!(!hung_up(&mine));
        assert!(!readable(&mine, Duration::from_millis(1)).unwrap());
        (&peer).write_all(b"x").unwrap();
        assert!(readable(&mine, Duration::from_secs(1)).unwrap());
        assert!(!hung_up(&mine), "data waiting is not a hang-up");
        drop(peer);
        assert!(hung_up(&mine));
    }
}
