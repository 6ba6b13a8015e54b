//! The guest service's socket protocol (SPEC.md §12.1): what a program and the service that
//! shares the device say to each other. The frames' layout, kinds, limits and payload codecs
//! live here; sending and receiving them (with their descriptors) is guest-lib's
//! `service::protocol`.

/// The version of this protocol; HELLO and WELCOME carry it and must agree.
pub const VERSION: u32 = 3;
/// Where the service listens unless told otherwise; the default device of programs.
pub const DEFAULT_SOCKET: &str = "/run/vrdma/vrdmad.sock";
/// The largest payload a program may send (a control request is far smaller).
pub const MAX_PROGRAM_PAYLOAD: usize = 4096;
/// The largest payload the service sends: the pages of a 4 GiB region.
pub const MAX_SERVICE_PAYLOAD: usize = 8 << 20;
/// The most descriptors one frame carries.
pub const MAX_FILES: usize = 3;
/// Bytes of a frame's header: `le32 length; le16 kind; le16 reserved`.
pub const HEADER_LEN: usize = 8;

/// A frame's kind: 1-4 a program sends, 101-105 the service sends.
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

/// Why a frame's header is refused; the connection ends (SPEC.md §12.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("frame kind {0}")]
    UnknownKind(u16),
    #[error("a {kind:?} frame of {length} bytes, at most {max}")]
    TooLong { kind: Kind, length: u32, max: usize },
}

/// A frame's header for a payload of `length` bytes.
pub fn encode_header(kind: Kind, length: u32) -> [u8; HEADER_LEN] {
    let mut header = [0u8; HEADER_LEN];
    header[0..4].copy_from_slice(&length.to_le_bytes());
    header[4..6].copy_from_slice(&(kind as u16).to_le_bytes());
    header
}

/// A frame's header: its kind and its payload's length, at most `max_payload` (the reserved
/// field is ignored, as every reserved field of SPEC.md).
pub fn decode_header(
    header: &[u8; HEADER_LEN],
    max_payload: usize,
) -> Result<(Kind, usize), HeaderError> {
    let length = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let kind = Kind::try_from(u16::from_le_bytes([header[4], header[5]]))
        .map_err(HeaderError::UnknownKind)?;
    if length as usize > max_payload {
        return Err(HeaderError::TooLong {
            kind,
            length,
            max: max_payload,
        });
    }
    Ok((kind, length as usize))
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
    /// written to kick it; `None`: no port, kicks are NOTIFY frames. On the wire, `u64::MAX`
    /// for none.
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

    #[test]
    fn headers_round_trip_and_refuse_unknown_kinds_and_long_payloads() {
        let header = encode_header(Kind::Control, 64);
        assert_eq!(decode_header(&header, 64), Ok((Kind::Control, 64)));
        assert!(matches!(
            decode_header(&header, 63),
            Err(HeaderError::TooLong { length: 64, .. })
        ));
        assert_eq!(
            decode_header(&[0, 0, 0, 0, 9, 0, 0, 0], 64),
            Err(HeaderError::UnknownKind(9))
        );
        // The reserved field is ignored.
        assert_eq!(
            decode_header(&[4, 0, 0, 0, 4, 0, 0xff, 0xff], 64),
            Ok((Kind::Notify, 4))
        );
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
