//! A guest's own network identity: the IPv4 address an operator gives it (`--guest-ip`), added
//! to the network device under the host's RDMA port while the backend serves the guest. The
//! RDMA device turns the address into a RoCEv2 GID, which the guest then sees as the only
//! entry of its GID table (SPEC.md §10): traffic leaves the host under the guest's address,
//! never the host's.
//!
//! The address carries the label `<netdev>:vrdma`, so a backend that was killed before it could
//! remove its address is recognised when it starts again, and an address that someone else put
//! on the host (the host's own, say) is never handed to a guest.

use std::fmt;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};

use nix::sys::socket::{
    bind, recv, send, socket, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol,
    SockType,
};
use vrdma_spec::Gid;

/// The label suffix that marks an address vrdma added.
const LABEL_SUFFIX: &str = ":vrdma";
/// Longest interface label the kernel keeps (IFNAMSIZ - 1).
const MAX_LABEL_LEN: usize = 15;

#[derive(Debug, thiserror::Error)]
pub enum AddressError {
    #[error("'{0}' is not an IPv4 address with a prefix length, such as 10.0.0.5/24")]
    Syntax(String),
    #[error("{address} is already in use on this host ({holder}) and was not assigned by vrdma: a guest never gets an address someone else holds")]
    InUse { address: Ipv4Addr, holder: String },
    #[error("network device with index {0} not found")]
    NoNetdev(u32),
    #[error("netlink {operation}: {source}")]
    Netlink {
        operation: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// An IPv4 address with its prefix length, as `--guest-ip` gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestIp {
    pub address: Ipv4Addr,
    pub prefix_len: u8,
}

impl FromStr for GuestIp {
    type Err = AddressError;

    fn from_str(text: &str) -> Result<GuestIp, AddressError> {
        let syntax = || AddressError::Syntax(text.to_owned());
        let (address, prefix_len) = text.split_once('/').ok_or_else(syntax)?;
        let address: Ipv4Addr = address.parse().map_err(|_| syntax())?;
        let prefix_len: u8 = prefix_len.parse().map_err(|_| syntax())?;
        let usable = !(address.is_unspecified()
            || address.is_loopback()
            || address.is_multicast()
            || address.is_broadcast());
        if prefix_len == 0 || prefix_len > 32 || !usable {
            return Err(syntax());
        }
        Ok(GuestIp {
            address,
            prefix_len,
        })
    }
}

impl fmt::Display for GuestIp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.address, self.prefix_len)
    }
}

impl GuestIp {
    /// The RoCEv2 GID of the address.
    pub fn gid(&self) -> Gid {
        Gid::from(self.address)
    }
}

/// The guest's address on the host's network device, removed when this is dropped.
pub struct GuestAddress {
    netlink: Netlink,
    ifindex: u32,
    ip: GuestIp,
    removed: bool,
}

impl GuestAddress {
    /// Puts `ip` on the network device with interface index `ifindex`, or adopts it if an
    /// earlier vrdma backend left it there; refuses an address anyone else holds.
    pub fn assign(ifindex: u32, ip: GuestIp) -> Result<GuestAddress, AddressError> {
        let netdev = nix::net::if_::if_nameindex()
            .map_err(|e| netlink_error("list interfaces", e))?
            .iter()
            .find(|i| i.index() == ifindex)
            .map(|i| i.name().to_string_lossy().into_owned())
            .ok_or(AddressError::NoNetdev(ifindex))?;
        let label = label_for(&netdev);
        let netlink = Netlink::open()?;
        let in_use = |holder: String| AddressError::InUse {
            address: ip.address,
            holder,
        };
        match holder_of(ip.address)? {
            Some(holder) if holder == label => {
                log::warn!("{ip} on {netdev} was left by an earlier vrdma backend: taking it over");
            }
            Some(holder) => return Err(in_use(holder)),
            None => {
                let request = address_request(
                    libc::RTM_NEWADDR,
                    NLM_F_CREATE_EXCL,
                    ifindex,
                    &ip,
                    Some(&label),
                );
                netlink.call("add address", request).map_err(|e| match e {
                    AddressError::Netlink { source, .. }
                        if source.raw_os_error() == Some(libc::EEXIST) =>
                    {
                        in_use("added by someone else meanwhile".into())
                    }
                    other => other,
                })?;
                log::info!("guest address {ip} added to {netdev}");
            }
        }
        Ok(GuestAddress {
            netlink,
            ifindex,
            ip,
            removed: false,
        })
    }

    /// Takes the address off the network device (the guest's GID goes with it).
    pub fn remove(&mut self) -> Result<(), AddressError> {
        if self.removed {
            return Ok(());
        }
        let request = address_request(libc::RTM_DELADDR, 0, self.ifindex, &self.ip, None);
        let result = match self.netlink.call("remove address", request) {
            Err(AddressError::Netlink { source, .. })
                if source.raw_os_error() == Some(libc::EADDRNOTAVAIL) =>
            {
                Ok(()) // someone removed it already
            }
            other => other,
        };
        self.removed = true;
        result?;
        log::info!("guest address {} removed", self.ip);
        Ok(())
    }
}

impl Drop for GuestAddress {
    fn drop(&mut self) {
        if let Err(e) = self.remove() {
            log::error!("cannot remove guest address {}: {e}", self.ip);
        }
    }
}

/// `<netdev>:vrdma`, the netdev name shortened to fit the kernel's label length.
fn label_for(netdev: &str) -> String {
    let keep = netdev
        .char_indices()
        .map(|(i, c)| i + c.len_utf8())
        .take_while(|&end| end + LABEL_SUFFIX.len() <= MAX_LABEL_LEN)
        .last()
        .unwrap_or(0);
    format!("{}{LABEL_SUFFIX}", &netdev[..keep])
}

/// The label (or interface name) under which `address` is configured on this host, if it is.
fn holder_of(address: Ipv4Addr) -> Result<Option<String>, AddressError> {
    Ok(nix::ifaddrs::getifaddrs()
        .map_err(|e| netlink_error("list addresses", e))?
        .find(|entry| {
            entry
                .address
                .as_ref()
                .and_then(|a| a.as_sockaddr_in())
                .is_some_and(|a| a.ip() == address)
        })
        .map(|entry| entry.interface_name))
}

fn netlink_error(operation: &'static str, errno: nix::errno::Errno) -> AddressError {
    AddressError::Netlink {
        operation,
        source: std::io::Error::from(errno),
    }
}

// Netlink's constants are small `c_int`s (flags below 0x1000, AF_INET 2, NLMSG_ERROR 2): the
// header's fields hold them.
#[expect(
    clippy::cast_possible_truncation,
    reason = "NLM_F_CREATE | NLM_F_EXCL is 0x600"
)]
const NLM_F_CREATE_EXCL: u16 = (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16;
#[expect(
    clippy::cast_possible_truncation,
    reason = "NLM_F_REQUEST | NLM_F_ACK is 0x5"
)]
const NLM_F_REQUEST_ACK: u16 = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16;
#[expect(clippy::cast_possible_truncation, reason = "NLMSG_ERROR is 2")]
const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
#[expect(clippy::cast_possible_truncation, reason = "AF_INET is 2")]
const AF_INET: u8 = libc::AF_INET as u8;
const NLMSG_HEADER_LEN: usize = 16;

/// An RTM_NEWADDR/RTM_DELADDR request for `ip` on interface `ifindex` (rtnetlink(7)), with a
/// sequence number of 0 that [`Netlink::call`] fills in.
fn address_request(
    kind: u16,
    extra_flags: u16,
    ifindex: u32,
    ip: &GuestIp,
    label: Option<&str>,
) -> Vec<u8> {
    let mut message = Vec::with_capacity(64);
    message.extend_from_slice(&[0; NLMSG_HEADER_LEN]);
    // struct ifaddrmsg
    message.push(AF_INET);
    message.push(ip.prefix_len);
    message.push(0); // flags
    message.push(libc::RT_SCOPE_UNIVERSE);
    message.extend_from_slice(&ifindex.to_ne_bytes());
    push_attribute(&mut message, libc::IFA_LOCAL, &ip.address.octets());
    push_attribute(&mut message, libc::IFA_ADDRESS, &ip.address.octets());
    if let Some(label) = label {
        let mut text = label.as_bytes().to_vec();
        text.push(0);
        push_attribute(&mut message, libc::IFA_LABEL, &text);
    }
    let flags = NLM_F_REQUEST_ACK | extra_flags;
    #[expect(
        clippy::cast_possible_truncation,
        reason = "a header, an ifaddrmsg and three attributes of at most a label (label_for \
                  keeps it to MAX_LABEL_LEN) are under 100 bytes"
    )]
    let len = message.len() as u32;
    message[0..4].copy_from_slice(&len.to_ne_bytes());
    message[4..6].copy_from_slice(&kind.to_ne_bytes());
    message[6..8].copy_from_slice(&flags.to_ne_bytes());
    message
}

#[expect(
    clippy::cast_possible_truncation,
    reason = "data is an IPv4 address or a label of at most MAX_LABEL_LEN + 1 bytes"
)]
fn push_attribute(message: &mut Vec<u8>, kind: u16, data: &[u8]) {
    let len = 4 + data.len();
    message.extend_from_slice(&(len as u16).to_ne_bytes());
    message.extend_from_slice(&kind.to_ne_bytes());
    message.extend_from_slice(data);
    message.resize(message.len().next_multiple_of(4), 0);
}

/// The result of the request numbered `seq` if `reply` is the kernel's acknowledgement of
/// it: `Some(0)` for success, `Some(errno)` for a refusal; `None` for any other message.
fn acknowledgement(reply: &[u8], seq: u32) -> Option<i32> {
    let field = |at: usize| reply.get(at..at + 4).map(|b| [b[0], b[1], b[2], b[3]]);
    let kind = u16::from_ne_bytes([*reply.get(4)?, *reply.get(5)?]);
    if kind != NLMSG_ERROR || u32::from_ne_bytes(field(8)?) != seq {
        return None;
    }
    Some(-i32::from_ne_bytes(field(NLMSG_HEADER_LEN)?))
}

/// A route netlink socket.
struct Netlink {
    socket: OwnedFd,
}

static NEXT_SEQUENCE: AtomicU32 = AtomicU32::new(1);

impl Netlink {
    fn open() -> Result<Netlink, AddressError> {
        let socket = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkRoute,
        )
        .map_err(|e| netlink_error("open socket", e))?;
        bind(socket.as_raw_fd(), &NetlinkAddr::new(0, 0))
            .map_err(|e| netlink_error("bind socket", e))?;
        Ok(Netlink { socket })
    }

    /// Sends `request` and waits for the kernel's acknowledgement.
    fn call(&self, operation: &'static str, mut request: Vec<u8>) -> Result<(), AddressError> {
        let seq = NEXT_SEQUENCE.fetch_add(1, Ordering::Relaxed);
        request[8..12].copy_from_slice(&seq.to_ne_bytes());
        let fail = |e| netlink_error(operation, e);
        send(self.socket.as_raw_fd(), &request, MsgFlags::empty()).map_err(fail)?;
        let mut reply = [0u8; 4096];
        loop {
            let len = recv(self.socket.as_raw_fd(), &mut reply, MsgFlags::empty()).map_err(fail)?;
            match acknowledgement(&reply[..len], seq) {
                None => continue,
                Some(0) => return Ok(()),
                Some(errno) => return Err(fail(nix::errno::Errno::from_raw(errno))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_addresses_need_a_prefix_and_a_usable_ipv4_address() {
        let ip: GuestIp = "10.50.0.11/24".parse().unwrap();
        assert_eq!(ip.address, Ipv4Addr::new(10, 50, 0, 11));
        assert_eq!(ip.prefix_len, 24);
        assert_eq!(ip.to_string(), "10.50.0.11/24");
        assert_eq!(ip.gid().to_string(), "::ffff:10.50.0.11");
        for bad in [
            "10.50.0.11",
            "10.50.0.11/",
            "10.50.0.11/0",
            "10.50.0.11/33",
            "10.50.0/24",
            "fe80::1/64",
            "0.0.0.0/8",
            "127.0.0.1/8",
            "224.0.0.1/4",
            "255.255.255.255/32",
        ] {
            let e = bad.parse::<GuestIp>().unwrap_err();
            assert!(e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn labels_keep_the_netdev_name_and_fit_the_kernel_limit() {
        assert_eq!(label_for("eth0"), "eth0:vrdma");
        assert_eq!(label_for("enp1s0f0np0"), "enp1s0f0n:vrdma");
        assert!(label_for("enp1s0f0np0").len() <= MAX_LABEL_LEN);
    }

    #[test]
    fn address_requests_follow_rtnetlink_framing() {
        let ip: GuestIp = "10.1.2.3/16".parse().unwrap();
        let m = address_request(
            libc::RTM_NEWADDR,
            NLM_F_CREATE_EXCL,
            7,
            &ip,
            Some("eth0:vrdma"),
        );
        assert_eq!(
            u32::from_ne_bytes(m[0..4].try_into().unwrap()) as usize,
            m.len()
        );
        assert_eq!(m.len() % 4, 0);
        assert_eq!(u16::from_ne_bytes([m[4], m[5]]), libc::RTM_NEWADDR);
        let flags = u16::from_ne_bytes([m[6], m[7]]);
        assert_eq!(flags, 0x1 | 0x4 | 0x200 | 0x400);
        assert_eq!(&m[16..20], &[libc::AF_INET as u8, 16, 0, 0]);
        assert_eq!(u32::from_ne_bytes(m[20..24].try_into().unwrap()), 7);
        // IFA_LOCAL, IFA_ADDRESS (8 bytes each), IFA_LABEL "eth0:vrdma\0" padded to 16.
        assert_eq!(&m[24..32], &[8, 0, libc::IFA_LOCAL as u8, 0, 10, 1, 2, 3]);
        assert_eq!(&m[32..40], &[8, 0, libc::IFA_ADDRESS as u8, 0, 10, 1, 2, 3]);
        assert_eq!(&m[40..44], &[15, 0, libc::IFA_LABEL as u8, 0]);
        assert_eq!(&m[44..55], b"eth0:vrdma\0");
        assert_eq!(m.len(), 56);
    }

    #[test]
    fn only_the_acknowledgement_of_the_request_counts() {
        let ack = |kind: u16, seq: u32, error: i32| {
            let mut m = vec![0u8; 36];
            m[4..6].copy_from_slice(&kind.to_ne_bytes());
            m[8..12].copy_from_slice(&seq.to_ne_bytes());
            m[16..20].copy_from_slice(&error.to_ne_bytes());
            m
        };
        let error = libc::NLMSG_ERROR as u16;
        assert_eq!(acknowledgement(&ack(error, 5, 0), 5), Some(0));
        assert_eq!(
            acknowledgement(&ack(error, 5, -libc::EEXIST), 5),
            Some(libc::EEXIST)
        );
        assert_eq!(acknowledgement(&ack(error, 4, 0), 5), None);
        assert_eq!(acknowledgement(&ack(libc::RTM_NEWADDR, 5, 0), 5), None);
        assert_eq!(acknowledgement(&[2, 0, 0], 5), None);
    }
}
