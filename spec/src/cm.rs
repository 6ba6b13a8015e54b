//! Connection management (SPEC.md §13): the device runs the RDMA connection manager for the
//! driver, on the driver's own address, with the driver's QPs.

use crate::address::AhAttr;
use crate::{wire_struct, Le16, Le32};

/// Port spaces of CM_CREATE_ID; librdmacm's values.
pub mod port_space {
    /// Connected (RC) QPs, TCP-like ports.
    pub const TCP: u32 = 0x0106;
    /// UD QPs, UDP-like ports.
    pub const UDP: u32 = 0x0111;
}

/// Address families of [`CmAddr`].
pub mod family {
    /// No address: where a request may name one, the device uses the driver's own.
    pub const NONE: u16 = 0;
    /// IPv4: `addr[0..4]` in network order, the rest zero.
    pub const INET: u16 = 2;
}

/// Events of CM_GET_EVENT (SPEC.md §13.4); librdmacm's `rdma_cm_event_type` values.
pub mod cm_event {
    pub const ADDR_RESOLVED: u32 = 0;
    pub const ADDR_ERROR: u32 = 1;
    pub const ROUTE_RESOLVED: u32 = 2;
    pub const ROUTE_ERROR: u32 = 3;
    pub const CONNECT_REQUEST: u32 = 4;
    pub const CONNECT_RESPONSE: u32 = 5;
    pub const CONNECT_ERROR: u32 = 6;
    pub const UNREACHABLE: u32 = 7;
    pub const REJECTED: u32 = 8;
    pub const ESTABLISHED: u32 = 9;
    pub const DISCONNECTED: u32 = 10;
    pub const DEVICE_REMOVAL: u32 = 11;
    pub const ADDR_CHANGE: u32 = 14;
    pub const TIMEWAIT_EXIT: u32 = 15;
    /// CM_GET_EVENT found nothing queued on the id.
    pub const NONE: u32 = u32::MAX;

    /// The event's name as librdmacm's `rdma_event_str` gives it.
    pub fn name(event: u32) -> &'static str {
        match event {
            ADDR_RESOLVED => "RDMA_CM_EVENT_ADDR_RESOLVED",
            ADDR_ERROR => "RDMA_CM_EVENT_ADDR_ERROR",
            ROUTE_RESOLVED => "RDMA_CM_EVENT_ROUTE_RESOLVED",
            ROUTE_ERROR => "RDMA_CM_EVENT_ROUTE_ERROR",
            CONNECT_REQUEST => "RDMA_CM_EVENT_CONNECT_REQUEST",
            CONNECT_RESPONSE => "RDMA_CM_EVENT_CONNECT_RESPONSE",
            CONNECT_ERROR => "RDMA_CM_EVENT_CONNECT_ERROR",
            UNREACHABLE => "RDMA_CM_EVENT_UNREACHABLE",
            REJECTED => "RDMA_CM_EVENT_REJECTED",
            ESTABLISHED => "RDMA_CM_EVENT_ESTABLISHED",
            DISCONNECTED => "RDMA_CM_EVENT_DISCONNECTED",
            DEVICE_REMOVAL => "RDMA_CM_EVENT_DEVICE_REMOVAL",
            ADDR_CHANGE => "RDMA_CM_EVENT_ADDR_CHANGE",
            TIMEWAIT_EXIT => "RDMA_CM_EVENT_TIMEWAIT_EXIT",
            NONE => "none",
            _ => "UNKNOWN EVENT",
        }
    }
}

/// Bytes of a private data field on the wire.
pub const PRIVATE_DATA_FIELD: usize = 256;
/// Largest private data of one CM message the wire carries (its length is a byte); each
/// message's own limit is the host's, and smaller (SPEC.md §13.3).
pub const MAX_PRIVATE_DATA: usize = 255;

/// The most private data each CM message carries (SPEC.md §13.3): what the host's CM
/// message (InfiniBand CM, which RoCE uses) holds, less the header rdma_cm puts in front of
/// a connection request's. The device refuses more with INVALID_ARGUMENT.
pub mod private_data_limit {
    /// CM_CONNECT on a TCP id: a REQ's 92 bytes less rdma_cm's 36-byte header.
    pub const CONNECT_TCP: usize = 56;
    /// CM_CONNECT on a UDP id: a SIDR REQ's 216 bytes less the header.
    pub const CONNECT_UDP: usize = 180;
    /// CM_ACCEPT on a TCP id: a REP's.
    pub const ACCEPT_TCP: usize = 196;
    /// CM_ACCEPT on a UDP id: a SIDR REP's.
    pub const ACCEPT_UDP: usize = 136;
    /// CM_REJECT on a TCP id: a REJ's.
    pub const REJECT_TCP: usize = 148;
    /// CM_REJECT on a UDP id: a SIDR REP's (it carries the reject).
    pub const REJECT_UDP: usize = 136;
}

/// Largest `backlog` of CM_LISTEN the device honours; a larger one is taken as this.
pub const MAX_BACKLOG: u32 = 128;

/// An IP address and port (SPEC.md §13.2).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmAddr {
    /// A [`family`] value.
    pub family: Le16,
    /// The port, as a number (not in network order); 0 = any.
    pub port: Le16,
    /// IPv4: the first 4 bytes, network order; the rest zero.
    pub addr: [u8; 16],
}

impl CmAddr {
    /// The IPv4 address and port `address`.
    pub fn ipv4(address: std::net::SocketAddrV4) -> CmAddr {
        let mut addr = [0; 16];
        addr[..4].copy_from_slice(&address.ip().octets());
        CmAddr {
            family: Le16::from(family::INET),
            port: Le16::from(address.port()),
            addr,
        }
    }

    /// The IPv4 address and port this names; `None` for another family or non-zero bytes
    /// past the address.
    pub fn to_ipv4(&self) -> Option<std::net::SocketAddrV4> {
        if self.family.to_native() != family::INET || self.addr[4..] != [0; 12] {
            return None;
        }
        let ip = std::net::Ipv4Addr::new(self.addr[0], self.addr[1], self.addr[2], self.addr[3]);
        Some(std::net::SocketAddrV4::new(ip, self.port.to_native()))
    }
}

/// CM_CREATE_ID request.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmCreateIdRequest {
    /// A [`port_space`] value.
    pub port_space: Le32,
    pub reserved: Le32,
}

/// CM_BIND request.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmBindRequest {
    pub id: Le32,
    pub addr: CmAddr,
}

/// CM_RESOLVE_ADDR request.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmResolveAddrRequest {
    pub id: Le32,
    /// 1..=[`MAX_TIMEOUT_MS`].
    pub timeout_ms: Le32,
    /// The driver's own address or [`family::NONE`].
    pub src: CmAddr,
    pub dst: CmAddr,
}

/// Longest timeout of CM_RESOLVE_ADDR and CM_RESOLVE_ROUTE.
pub const MAX_TIMEOUT_MS: u32 = 60_000;

/// CM_RESOLVE_ROUTE request.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmResolveRouteRequest {
    pub id: Le32,
    /// 1..=[`MAX_TIMEOUT_MS`].
    pub timeout_ms: Le32,
}

/// CM_LISTEN request.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmListenRequest {
    pub id: Le32,
    /// Connection requests queued and not yet accepted or rejected; 0 or more than
    /// [`MAX_BACKLOG`] is taken as [`MAX_BACKLOG`].
    pub backlog: Le32,
}

/// Connection parameters (SPEC.md §13.3): what CM_CONNECT and CM_ACCEPT send, and what a
/// CONNECT_REQUEST, CONNECT_RESPONSE or ESTABLISHED event received.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmConnParam {
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    /// 0..=7.
    pub retry_count: u8,
    /// 0..=7.
    pub rnr_retry_count: u8,
    /// 0 or 1: the QP receives from an SRQ.
    pub srq: u8,
    /// Bytes of `private_data` used.
    pub private_data_len: u8,
    pub reserved: u8,
    /// In events: the peer's QP number. In requests: ignored (the device uses its QP's).
    pub qp_num: Le32,
    /// In events on a UD id: the peer's Q_Key. In requests: ignored.
    pub qkey: Le32,
    pub private_data: [u8; PRIVATE_DATA_FIELD],
}

impl Default for CmConnParam {
    fn default() -> Self {
        CmConnParam {
            responder_resources: 0,
            initiator_depth: 0,
            flow_control: 0,
            retry_count: 0,
            rnr_retry_count: 0,
            srq: 0,
            private_data_len: 0,
            reserved: 0,
            qp_num: Le32::from(0),
            qkey: Le32::from(0),
            private_data: [0; PRIVATE_DATA_FIELD],
        }
    }
}

impl CmConnParam {
    /// The private data used.
    pub fn private_data(&self) -> &[u8] {
        &self.private_data[..self.private_data_len as usize]
    }
}

/// Private data in a wire field: its length and `data` copied in. `None` when it is longer
/// than [`MAX_PRIVATE_DATA`].
pub fn private_data_field(data: &[u8]) -> Option<(u8, [u8; PRIVATE_DATA_FIELD])> {
    let len = u8::try_from(data.len()).ok()?;
    let mut field = [0; PRIVATE_DATA_FIELD];
    field[..data.len()].copy_from_slice(data);
    Some((len, field))
}

/// Connection parameters in the verbs vocabulary both sides speak: what a program sends
/// with a connect or accept, and what an event brought from the peer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConnParam {
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: bool,
    /// Received: the peer's QP number. Sent: the QP's own (the device fills it in).
    pub qp_num: u32,
    /// Received on a UD id: the peer's Q_Key.
    pub qkey: u32,
    pub private_data: Vec<u8>,
}

impl ConnParam {
    /// The wire form; `None` when the private data is longer than [`MAX_PRIVATE_DATA`].
    pub fn to_wire(&self) -> Option<CmConnParam> {
        let (private_data_len, private_data) = private_data_field(&self.private_data)?;
        Some(CmConnParam {
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: self.flow_control,
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            srq: self.srq.into(),
            private_data_len,
            reserved: 0,
            qp_num: Le32::from(self.qp_num),
            qkey: Le32::from(self.qkey),
            private_data,
        })
    }
}

impl From<&CmConnParam> for ConnParam {
    /// Every field as it is (`srq` is any non-zero value); the checks are the device's.
    fn from(w: &CmConnParam) -> Self {
        ConnParam {
            responder_resources: w.responder_resources,
            initiator_depth: w.initiator_depth,
            flow_control: w.flow_control,
            retry_count: w.retry_count,
            rnr_retry_count: w.rnr_retry_count,
            srq: w.srq != 0,
            qp_num: w.qp_num.to_native(),
            qkey: w.qkey.to_native(),
            private_data: w.private_data().to_vec(),
        }
    }
}

/// CM_CONNECT and CM_ACCEPT request.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmConnectRequest {
    pub id: Le32,
    /// The QP to connect: RC for [`port_space::TCP`], UD for [`port_space::UDP`].
    pub qp: Le32,
    pub param: CmConnParam,
}

/// CM_REJECT request.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmRejectRequest {
    pub id: Le32,
    pub private_data_len: u8,
    pub reserved: [u8; 3],
    pub private_data: [u8; PRIVATE_DATA_FIELD],
}

impl Default for CmRejectRequest {
    fn default() -> Self {
        CmRejectRequest {
            id: Le32::from(0),
            private_data_len: 0,
            reserved: [0; 3],
            private_data: [0; PRIVATE_DATA_FIELD],
        }
    }
}

/// CM_INIT_QP_ATTR request; answered with a [`crate::ctrl::ModifyQpRequest`] whose handle
/// is 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmInitQpAttrRequest {
    pub id: Le32,
    /// INIT, RTR or RTS ([`crate::ctrl::qp_state`]).
    pub qp_state: u8,
    pub reserved: [u8; 3],
}

/// CM_QUERY response: the id's addresses and route.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmIdInfo {
    pub src: CmAddr,
    pub dst: CmAddr,
    /// The driver's own GID, once the id is bound; zero before.
    pub sgid: [u8; 16],
    /// The peer's GID, once the address is resolved (or the id came from a request).
    pub dgid: [u8; 16],
    pub pkey: Le16,
    /// ibv_mtu of the route; 0 before the route is resolved.
    pub path_mtu: u8,
    /// Paths resolved: 0 or 1.
    pub num_paths: u8,
    /// 1 once the id is bound to the device, 0 before.
    pub port_num: u8,
    pub reserved: [u8; 3],
}

/// CM_GET_EVENT response.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmEvent {
    /// A [`cm_event`] value; [`cm_event::NONE`] when nothing was queued.
    pub event: Le32,
    /// librdmacm's `status`: 0, a negative errno, or for REJECTED the peer's reject reason.
    pub status: Le32,
    /// For CONNECT_REQUEST: the new id the request came on, the driver's from now on.
    pub new_id: Le32,
    /// Events still queued on the id after this one.
    pub pending: Le32,
    /// For CONNECT_REQUEST, CONNECT_RESPONSE, ESTABLISHED, REJECTED, DISCONNECTED (private
    /// data only where the message carried it).
    pub param: CmConnParam,
    /// For CONNECT_REQUEST and ESTABLISHED on a UD id: the address vector of the peer, in the
    /// driver's view (SPEC.md §5.10).
    pub ah_attr: AhAttr,
}

wire_struct!(
    CmAddr = 20,
    CmCreateIdRequest = 8,
    CmBindRequest = 24,
    CmResolveAddrRequest = 48,
    CmResolveRouteRequest = 8,
    CmListenRequest = 8,
    CmConnParam = 272,
    CmConnectRequest = 280,
    CmRejectRequest = 264,
    CmInitQpAttrRequest = 8,
    CmIdInfo = 80,
    CmEvent = 320,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv4_address_round_trips_and_other_forms_are_refused() {
        let address = "192.0.2.7:7471".parse().unwrap();
        let wire = CmAddr::ipv4(address);
        assert_eq!(wire.to_ipv4(), Some(address));
        let mut trailing = wire;
        trailing.addr[9] = 1;
        assert_eq!(trailing.to_ipv4(), None);
        let none = CmAddr::default();
        assert_eq!(none.to_ipv4(), None);
    }

    #[test]
    fn private_data_fits_the_field_or_is_refused() {
        let (len, field) = private_data_field(b"hello").unwrap();
        assert_eq!((len, &field[..5]), (5, &b"hello"[..]));
        assert!(private_data_field(&[0; MAX_PRIVATE_DATA + 1]).is_none());
        let param = CmConnParam {
            private_data_len: 5,
            private_data: field,
            ..CmConnParam::default()
        };
        assert_eq!(param.private_data(), b"hello");
        let vocabulary = ConnParam::from(&param);
        assert_eq!(vocabulary.private_data, b"hello");
        assert_eq!(vocabulary.to_wire(), Some(param));
    }
}
