//! What a program and the guest service (`vrdmad`) say to each other over the service's unix
//! socket. Only set-up travels here (control requests, memory; kicks of a sleeping poller
//! where the device has no notification port): the data path stays in memory the program
//! shares with the device.
//!
//! The frames, their kinds and payloads are SPEC.md §12.1 (and `vrdma_spec::service`, whose
//! names this module re-exports); here they are sent and received with their descriptors
//! (SCM_RIGHTS, attached to a frame's first byte).

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

use vrdma_spec::service::{decode_header, encode_header, HEADER_LEN as HEADER, MAX_FILES};
pub use vrdma_spec::service::{
    decode_pages, decode_u32, decode_u64, encode_pages, Kind, Welcome, DEFAULT_SOCKET,
    MAX_PROGRAM_PAYLOAD, MAX_SERVICE_PAYLOAD, VERSION,
};

/// One received message.
#[derive(Debug)]
pub struct Frame {
    pub kind: Kind,
    pub payload: Vec<u8>,
    pub files: Vec<File>,
}

/// Sends one frame. A peer that went away is an error, never a SIGPIPE.
pub fn send(socket: &UnixStream, kind: Kind, payload: &[u8], files: &[RawFd]) -> io::Result<()> {
    let mut frame = Vec::with_capacity(HEADER + payload.len());
    let length = u32::try_from(payload.len()).map_err(|_| io::ErrorKind::InvalidInput)?;
    frame.extend_from_slice(&encode_header(kind, length));
    frame.extend_from_slice(payload);
    let rights = [ControlMessage::ScmRights(files)];
    let mut control: &[ControlMessage] = if files.is_empty() { &[] } else { &rights };
    let mut sent = 0;
    // The descriptors go with the first piece; a long frame may take more than one.
    while sent < frame.len() {
        sent += sendmsg::<()>(
            socket.as_raw_fd(),
            &[IoSlice::new(&frame[sent..])],
            control,
            MsgFlags::MSG_NOSIGNAL,
            None,
        )?;
        control = &[];
    }
    Ok(())
}

/// Receives one frame of at most `max_payload` bytes; `None` when the peer closed the socket
/// between frames.
pub fn recv(socket: &UnixStream, max_payload: usize) -> io::Result<Option<Frame>> {
    let mut header = [0u8; HEADER];
    let mut space = nix::cmsg_space!([RawFd; MAX_FILES]);
    let (read, received) = {
        let mut iov = [IoSliceMut::new(&mut header)];
        let message = recvmsg::<()>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            // Descriptors received must not leak into programs the receiver executes.
            MsgFlags::MSG_CMSG_CLOEXEC,
        )?;
        let mut received = Vec::new();
        for control in message.cmsgs()? {
            if let ControlMessageOwned::ScmRights(fds) = control {
                received.extend(fds);
            }
        }
        (message.bytes, received)
    };
    let files: Vec<File> = received
        .into_iter()
        // SAFETY: the kernel just installed these descriptors for this process (SCM_RIGHTS);
        // nothing else owns them, so each is owned (and closed) once, here.
        .map(|fd| File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
        .collect();
    if read == 0 {
        return Ok(None);
    }
    (&*socket).read_exact(&mut header[read..])?;
    let (kind, length) = decode_header(&header, max_payload)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let mut payload = vec![0; length];
    (&*socket).read_exact(&mut payload)?;
    Ok(Some(Frame {
        kind,
        payload,
        files,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn frames_carry_payloads_and_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let (extra, _keep) = UnixStream::pair().unwrap();
        send(&a, Kind::Notify, &7u32.to_le_bytes(), &[]).unwrap();
        send(
            &a,
            Kind::AddMemory,
            &4096u64.to_le_bytes(),
            &[extra.as_raw_fd()],
        )
        .unwrap();
        let first = recv(&b, MAX_PROGRAM_PAYLOAD).unwrap().unwrap();
        assert_eq!(first.kind, Kind::Notify);
        assert_eq!(decode_u32(&first.payload), Some(7));
        assert!(first.files.is_empty());
        let second = recv(&b, MAX_PROGRAM_PAYLOAD).unwrap().unwrap();
        assert_eq!(
            (second.kind, decode_u64(&second.payload), second.files.len()),
            (Kind::AddMemory, Some(4096), 1)
        );
        drop(a);
        assert!(recv(&b, MAX_PROGRAM_PAYLOAD).unwrap().is_none(), "closed");
    }

    #[test]
    fn oversized_and_unknown_frames_are_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        send(&a, Kind::Control, &[0; 100], &[]).unwrap();
        assert!(recv(&b, 64).is_err());
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(&[0, 0, 0, 0, 9, 0, 0, 0]).unwrap();
        assert!(recv(&b, 64).is_err());
    }
}
