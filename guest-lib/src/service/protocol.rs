//! What a program and the guest service (`vrdmad`) say to each other over the service's unix
//! socket. Only set-up travels here (control requests, memory; kicks of a sleeping poller
//! where the device has no notification port): the data path stays in memory the program
//! shares with the device.
//!
//! Every message is one frame: `le32 length; le16 kind; le16 reserved`, then `length` bytes
//! of payload, with the descriptors it carries attached to its first byte (SCM_RIGHTS).
//!
//! | kind | from | payload | descriptors |
//! |---|---|---|---|
//! | HELLO | program | `le32 version` | |
//! | WELCOME | service | [`Welcome`] | the notify area's memfd, the event socket, and the device's notification port if it has one |
//! | CONTROL | program | a control request (SPEC.md §5.1) | |
//! | CONTROL_REPLY | service | what the device (or the service, refusing) wrote | |
//! | ADD_MEMORY | program | `le64 length` | a memfd sealed against shrinking |
//! | MEMORY | service | `le64` device address of each 4 KiB page | |
//! | NOTIFY | program | `le32 queue` (no reply; a program given a notification port kicks through it instead) | |
//! | FAILED | service | a UTF-8 reason: the program's request was malformed, or it was not served | |
//! | REFUSED | service | a UTF-8 reason: an ADD_MEMORY past a limit of the program, its user or the service (locked memory, memory regions); libibverbs says `ENOMEM` | |
//!
//! A connection must say HELLO within the service's handshake time, or it is closed.
//!
//! The event socket (a seqpacket socket) carries the device's events about the program's
//! objects (and the port's and device's), one 8-byte record per message, as SPEC.md §8.4
//! lays them out.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

/// The version of this protocol; HELLO and WELCOME must agree on it.
pub const VERSION: u32 = 3;
/// Where the service listens unless told otherwise; the default device of programs.
pub const DEFAULT_SOCKET: &str = "/run/vrdma/vrdmad.sock";
/// The largest payload a program may send (a control request is far smaller).
pub const MAX_PROGRAM_PAYLOAD: usize = 4096;
/// The largest payload the service sends: the pages of a 4 GiB region.
pub const MAX_SERVICE_PAYLOAD: usize = 8 << 20;
/// The most descriptors one frame carries.
const MAX_FILES: usize = 3;
const HEADER: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Kind {
    Hello = 1,
    Control = 2,
    AddMemory = 3,
    Notify = 4,
    Welcome = 101,
    ControlReply = 102,
    Memory = 103,
    Failed = 104,
    Refused = 105,
}

impl TryFrom<u16> for Kind {
    type Error = u16;
    fn try_from(value: u16) -> Result<Kind, u16> {
        Ok(match value {
            1 => Kind::Hello,
            2 => Kind::Control,
            3 => Kind::AddMemory,
            4 => Kind::Notify,
            101 => Kind::Welcome,
            102 => Kind::ControlReply,
            103 => Kind::Memory,
            104 => Kind::Failed,
            105 => Kind::Refused,
            other => return Err(other),
        })
    }
}

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
    frame.extend_from_slice(&length.to_le_bytes());
    frame.extend_from_slice(&(kind as u16).to_le_bytes());
    frame.extend_from_slice(&[0; 2]);
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
    let length = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
    let kind = u16::from_le_bytes(header[4..6].try_into().expect("2 bytes"));
    let kind = Kind::try_from(kind)
        .map_err(|kind| io::Error::new(io::ErrorKind::InvalidData, format!("frame kind {kind}")))?;
    if length > max_payload {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a {kind:?} frame of {length} bytes, at most {max_payload}"),
        ));
    }
    let mut payload = vec![0; length];
    (&*socket).read_exact(&mut payload)?;
    Ok(Some(Frame {
        kind,
        payload,
        files,
    }))
}

/// WELCOME's payload: what a program needs to drive the device it shares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Welcome {
    pub version: u32,
    /// The negotiated device feature bits.
    pub features: u64,
    /// Bytes of the notify area's memfd the program maps.
    pub notify_len: u64,
    /// Where the doorbell bitmap starts in that memfd (the notify area starts at 0).
    pub bitmap_offset: u64,
    /// Bytes of the doorbell bitmap: the device's whole bitmap (SPEC.md §8.5), whatever the
    /// configuration space below says of its limits.
    pub bitmap_len: u64,
    /// Where in the notification port's file (the third descriptor) a queue's index is
    /// written to kick it (see [`crate::transport::NotifyPort`]); `None`: no port, kicks are
    /// NOTIFY frames. On the wire, `u64::MAX` for none.
    pub notify_port: Option<u64>,
    /// The configuration space (SPEC.md §3) as the program is to see it: its limits are the
    /// program's share of the device's.
    pub config: Vec<u8>,
}

impl Welcome {
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(48 + self.config.len());
        bytes.extend_from_slice(&self.version.to_le_bytes());
        bytes.extend_from_slice(&[0; 4]);
        bytes.extend_from_slice(&self.features.to_le_bytes());
        bytes.extend_from_slice(&self.notify_len.to_le_bytes());
        bytes.extend_from_slice(&self.bitmap_offset.to_le_bytes());
        bytes.extend_from_slice(&self.bitmap_len.to_le_bytes());
        bytes.extend_from_slice(&self.notify_port.unwrap_or(u64::MAX).to_le_bytes());
        bytes.extend_from_slice(&self.config);
        bytes
    }

    pub fn decode(bytes: &[u8]) -> Option<Welcome> {
        let u64_at = |at: usize| Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?));
        Some(Welcome {
            version: u32::from_le_bytes(bytes.get(0..4)?.try_into().ok()?),
            features: u64_at(8)?,
            notify_len: u64_at(16)?,
            bitmap_offset: u64_at(24)?,
            bitmap_len: u64_at(32)?,
            notify_port: Some(u64_at(40)?).filter(|&offset| offset != u64::MAX),
            config: bytes.get(48..)?.to_vec(),
        })
    }
}

/// A little-endian `u32` payload (HELLO, NOTIFY).
pub fn decode_u32(payload: &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(payload.try_into().ok()?))
}

/// A little-endian `u64` payload (ADD_MEMORY).
pub fn decode_u64(payload: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(payload.try_into().ok()?))
}

/// MEMORY's payload.
pub fn encode_pages(pages: &[u64]) -> Vec<u8> {
    pages.iter().flat_map(|page| page.to_le_bytes()).collect()
}

pub fn decode_pages(payload: &[u8]) -> Option<Vec<u64>> {
    if !payload.len().is_multiple_of(8) {
        return None;
    }
    Some(
        payload
            .chunks_exact(8)
            .map(|page| u64::from_le_bytes(page.try_into().expect("8 bytes")))
            .collect(),
    )
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

    #[test]
    fn welcome_round_trips() {
        let welcome = Welcome {
            version: VERSION,
            features: 0x1_0000_001f,
            notify_len: 8192,
            bitmap_offset: 4096,
            bitmap_len: 512,
            notify_port: None,
            config: vec![1, 2, 3],
        };
        assert_eq!(Welcome::decode(&welcome.encode()), Some(welcome.clone()));
        let with_port = Welcome {
            notify_port: Some(0),
            ..welcome
        };
        assert_eq!(Welcome::decode(&with_port.encode()), Some(with_port));
        assert_eq!(Welcome::decode(&[0; 10]), None);
        assert_eq!(decode_pages(&[0; 9]), None);
    }
}
