//! The loopback host's connection manager: rdma_cm's ids, addresses, listeners and
//! connection handshake between the guests of one loopback device, with librdmacm's events.
//!
//! A guest's address (`--guest-ip`) is not put on any network interface on loopback: the
//! guest's event channel registers it in its device's address table for as long as the
//! channel lives ([`Channel::open`]), and only registered addresses resolve (ADDR_ERROR
//! otherwise). Each id's events go to the channel it was created on, an eventfd readable while
//! any wait, as librdmacm's channel is. The handshake is the IB CM's, as the device sees it
//! through librdmacm with QPs it moves itself: REQ (CONNECT_REQUEST at the listener, with a
//! new id), REP (CONNECT_RESPONSE at the connecting side), RTU (`establish`: ESTABLISHED at
//! the accepting side), REJ (REJECTED), DREQ and DREP (DISCONNECTED at each side once its
//! peer disconnected), SIDR for UD (ESTABLISHED at the connecting side on accept).
//!
//! What the loopback does at once a network makes the caller wait for: an address no guest
//! holds fails to resolve as soon as it is asked (ADDR_ERROR, status -ETIMEDOUT, as when
//! nobody answers ARP), and a destroyed peer is known at once (no CM timeouts).

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, Weak};

use vrdma_spec::cm::{cm_event, ConnParam};

use super::{
    errno, gid, lock, Device, EventQueue, MTU_4096_BYTE, REMOTE_ATOMIC, REMOTE_READ, REMOTE_WRITE,
};
use crate::hostverbs::seam::CmIdInfo;
use crate::hostverbs::{qp_attr_mask as mask, AhAttr, Error, Gid, QpAttr, QpState, Result};

/// `IB_CM_REJ_INVALID_SERVICE_ID`: nobody listens on the port.
pub const REJECT_NO_LISTENER: i32 = 8;
/// `IB_CM_REJ_CONSUMER_DEFINED`: the listening side refused (its application, or its
/// backlog).
pub const REJECT_CONSUMER: i32 = 28;
/// A SIDR answer's status where nobody listens on a UD port (`IB_SIDR_UNSUPPORTED`).
pub const SIDR_NO_LISTENER: i32 = 1;
/// A SIDR answer's status where the listener refused (`IB_SIDR_REJECT`).
pub const SIDR_REJECT: i32 = 2;
/// The Q_Key librdmacm gives UD ids (`RDMA_UDP_QKEY`).
pub const UDP_QKEY: u32 = 0x0123_4567;
/// The ports a bind to port 0 picks from (Linux's default ephemeral range).
const EPHEMERAL_PORTS: std::ops::RangeInclusive<u16> = 32768..=60999;
/// What the handshake gives a QP: RNR timer 0.64 ms, transport timeout 67 ms.
const MIN_RNR_TIMER: u8 = 12;
const TIMEOUT: u8 = 14;

/// Where an id is in rdma_cm's life: the IB CM's states for a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Idle,
    Bound,
    AddrResolved,
    RouteResolved,
    Listening,
    /// REQ sent; a REP, REJ or SIDR answer comes.
    Connecting,
    /// A REQ's id at the listening side; accept or reject answers it.
    Requested,
    /// REP received: the connecting side establishes (RTU) or rejects.
    ConnectResponse,
    /// REP sent: the RTU comes.
    Accepted,
    Established,
    /// DREQ sent: the peer's DREP comes.
    DisconnectSent,
    /// DREQ received: this side's disconnect answers it.
    DisconnectReceived,
    /// Rejected, disconnected, or its peer went: nothing more comes.
    Closed,
}

/// The connection parameters one side gave (connect or accept).
#[derive(Clone, Copy, Debug, Default)]
struct Side {
    qp_num: u32,
    psn: u32,
    responder_resources: u8,
    initiator_depth: u8,
    retry_count: u8,
    rnr_retry_count: u8,
}

struct Slot {
    /// What its events are routed by ([`Id::set_key`]).
    key: u64,
    channel: Weak<Channel>,
    udp: bool,
    src: Option<SocketAddrV4>,
    dst: Option<SocketAddrV4>,
    /// Made for a request: it shares its listener's port, which it does not hold.
    passive: bool,
    stage: Stage,
    backlog: u32,
    /// Connection requests queued on its channel and not yet taken (a listener's).
    unanswered: u32,
    /// The listener of a request whose id nobody took yet.
    untaken_at: Option<u64>,
    peer: Option<u64>,
    local: Side,
    remote: Option<Side>,
}

impl Slot {
    fn new(channel: &Arc<Channel>, udp: bool, key: u64) -> Slot {
        Slot {
            key,
            channel: Arc::downgrade(channel),
            udp,
            src: None,
            dst: None,
            passive: false,
            stage: Stage::Idle,
            backlog: 0,
            unanswered: 0,
            untaken_at: None,
            peer: None,
            local: Side::default(),
            remote: None,
        }
    }
}

/// An event on its way to a channel: the slot it concerns, and for a request the new one.
struct Pending {
    slot: u64,
    event: u32,
    status: i32,
    new_slot: Option<u64>,
    param: ConnParam,
    ud_ah: Option<AhAttr>,
}

#[derive(Default)]
struct ManagerState {
    /// Registered guest addresses, by how many channels hold each.
    addresses: HashMap<Ipv4Addr, usize>,
    slots: HashMap<u64, Slot>,
    next_slot: u64,
    next_port: u16,
    next_psn: u32,
}

/// The connection manager of one loopback device: its addresses and ids.
pub struct ConnectionManager {
    name: String,
    state: Mutex<ManagerState>,
}

impl ConnectionManager {
    /// The connection manager of the loopback device `name` (its part of
    /// [`Device`](super::Device)).
    pub(super) fn new(name: &str) -> ConnectionManager {
        ConnectionManager {
            name: name.to_string(),
            state: Mutex::default(),
        }
    }

    /// Ids alive, those of requests nobody took included (what tests check for leaks).
    pub fn id_count(&self) -> usize {
        lock(&self.state).slots.len()
    }

    /// Whether a guest holds `ip` on this device.
    pub fn holds(&self, ip: Ipv4Addr) -> bool {
        lock(&self.state).addresses.contains_key(&ip)
    }

    /// Whether an id listens on `port` (what `rdma resource show cm_id` tells of the
    /// kernel's): how tests know a program's server is ready.
    pub fn listening(&self, port: u16) -> bool {
        lock(&self.state)
            .slots
            .values()
            .any(|s| s.stage == Stage::Listening && s.src.is_some_and(|a| a.port() == port))
    }
}

/// An event channel of a guest whose address is `own`: readable while events wait.
pub struct Channel {
    manager: &'static ConnectionManager,
    own: Ipv4Addr,
    events: EventQueue<Pending>,
}

/// An event taken from a channel ([`Channel::take_event`]).
pub struct Event {
    pub event: u32,
    pub status: i32,
    pub key: u64,
    pub new_id: Option<Id>,
    pub param: ConnParam,
    pub ud_ah: Option<AhAttr>,
}

impl Channel {
    /// A channel on the loopback device `device` for the guest at `own`, which it registers
    /// in the device's address table until it is dropped.
    pub fn open(device: &str, own: Ipv4Addr) -> Result<Arc<Channel>> {
        let events = EventQueue::new()?;
        let manager = &Device::named(device).cm;
        *lock(&manager.state).addresses.entry(own).or_default() += 1;
        Ok(Arc::new(Channel {
            manager,
            own,
            events,
        }))
    }

    pub fn fd(&self) -> RawFd {
        self.events.fd.as_raw_fd()
    }

    /// A new id on this channel, keyed `key`, UD if `udp` (else RC).
    pub fn create_id(self: &Arc<Self>, udp: bool, key: u64) -> Result<Id> {
        let mut state = lock(&self.manager.state);
        state.next_slot += 1;
        let number = state.next_slot;
        state.slots.insert(number, Slot::new(self, udp, key));
        Ok(Id {
            manager: self.manager,
            number,
            _channel: Arc::clone(self),
        })
    }

    /// The next event for an id that is still there; `None` when none waits. A request's
    /// new id is handed out with it, keyed 0 until [`Id::set_key`].
    pub fn take_event(self: &Arc<Self>) -> Option<Event> {
        loop {
            let pending = self.events.take()?;
            let mut state = lock(&self.manager.state);
            let Some(slot) = state.slots.get_mut(&pending.slot) else {
                continue;
            };
            let key = slot.key;
            let mut new_id = None;
            if let Some(new) = pending.new_slot {
                slot.unanswered = slot.unanswered.saturating_sub(1);
                let Some(request) = state.slots.get_mut(&new) else {
                    // Its connecting side went before the request was taken.
                    continue;
                };
                request.untaken_at = None;
                new_id = Some(Id {
                    manager: self.manager,
                    number: new,
                    _channel: Arc::clone(self),
                });
            }
            return Some(Event {
                event: pending.event,
                status: pending.status,
                key,
                new_id,
                param: pending.param,
                ud_ah: pending.ud_ah,
            });
        }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        let mut state = lock(&self.manager.state);
        if let Some(count) = state.addresses.get_mut(&self.own) {
            *count -= 1;
            if *count == 0 {
                state.addresses.remove(&self.own);
            }
        }
    }
}

/// An id; dropping it destroys it, as `rdma_destroy_id` (a connection's peer hears of it).
pub struct Id {
    manager: &'static ConnectionManager,
    number: u64,
    _channel: Arc<Channel>,
}

fn einval(call: &'static str) -> Error {
    errno(call, libc::EINVAL)
}

/// Queues an event for `slot` on its channel (dropped if the channel is gone).
fn deliver(state: &ManagerState, slot: u64, event: u32, status: i32, param: ConnParam) {
    deliver_pending(
        state,
        Pending {
            slot,
            event,
            status,
            new_slot: None,
            param,
            ud_ah: None,
        },
    );
}

fn deliver_pending(state: &ManagerState, pending: Pending) {
    let channel = state
        .slots
        .get(&pending.slot)
        .and_then(|s| s.channel.upgrade());
    if let Some(channel) = channel {
        channel.events.push(pending);
    }
}

/// The parameters an event carries from `from`'s side: the peer's resources seen from the
/// receiving side (its responder resources are the sender's initiator depth).
fn param_from(from: &Side, private_data: &[u8]) -> ConnParam {
    ConnParam {
        responder_resources: from.initiator_depth,
        initiator_depth: from.responder_resources,
        retry_count: from.retry_count,
        rnr_retry_count: from.rnr_retry_count,
        qp_num: from.qp_num,
        private_data: private_data.to_vec(),
        ..ConnParam::default()
    }
}

/// The address vector that reaches any QP of the device: its one GID.
fn device_ah() -> AhAttr {
    AhAttr {
        dgid: gid(),
        sgid_index: 0,
        hop_limit: 64,
        is_global: true,
        port_num: 1,
        ..AhAttr::default()
    }
}

impl ManagerState {
    fn slot(&mut self, number: u64, call: &'static str) -> Result<&mut Slot> {
        self.slots.get_mut(&number).ok_or_else(|| einval(call))
    }

    fn in_use(&self, udp: bool, address: SocketAddrV4) -> bool {
        self.slots.values().any(|s| {
            s.udp == udp
                && !s.passive
                && s.src.is_some_and(|bound| {
                    bound.port() == address.port()
                        && (bound.ip() == address.ip()
                            || bound.ip().is_unspecified()
                            || address.ip().is_unspecified())
                })
        })
    }

    /// `address` with a free port where it names port 0; EADDRINUSE where its port is taken,
    /// EADDRNOTAVAIL where no guest of the device holds its address.
    fn claim(
        &mut self,
        udp: bool,
        address: SocketAddrV4,
        call: &'static str,
    ) -> Result<SocketAddrV4> {
        let ip = *address.ip();
        if !ip.is_unspecified() && !self.addresses.contains_key(&ip) {
            return Err(errno(call, libc::EADDRNOTAVAIL));
        }
        if address.port() != 0 {
            if self.in_use(udp, address) {
                return Err(errno(call, libc::EADDRINUSE));
            }
            return Ok(address);
        }
        let span = EPHEMERAL_PORTS.end() - EPHEMERAL_PORTS.start() + 1;
        for _ in 0..span {
            let port = EPHEMERAL_PORTS.start() + self.next_port % span;
            self.next_port = self.next_port.wrapping_add(1) % span;
            let candidate = SocketAddrV4::new(ip, port);
            if !self.in_use(udp, candidate) {
                return Ok(candidate);
            }
        }
        Err(errno(call, libc::EADDRINUSE))
    }

    /// The listener a request to `to` reaches.
    fn listener(&self, udp: bool, to: SocketAddrV4) -> Option<u64> {
        self.slots.iter().find_map(|(&number, s)| {
            let reaches = s.stage == Stage::Listening
                && s.udp == udp
                && s.src.is_some_and(|a| {
                    a.port() == to.port() && (a.ip() == to.ip() || a.ip().is_unspecified())
                });
            reaches.then_some(number)
        })
    }

    /// A starting PSN for a new connection (24 bits, spread as librdmacm's random ones).
    fn new_psn(&mut self) -> u32 {
        self.next_psn = self.next_psn.wrapping_add(0x9e37_79b9);
        self.next_psn & 0x00ff_ffff
    }

    /// Ends `number`'s link to its peer, telling the peer what the IB CM tells it when this
    /// side goes: REJ before a connection is established, DREQ or DREP after.
    fn leave(&mut self, number: u64) {
        let Some(slot) = self.slots.get_mut(&number) else {
            return;
        };
        let (stage, udp) = (slot.stage, slot.udp);
        slot.stage = Stage::Closed;
        let Some(peer) = slot.peer.take() else {
            return;
        };
        let Some(other) = self.slots.get_mut(&peer) else {
            return;
        };
        other.peer = None;
        let event = match stage {
            Stage::Connecting | Stage::Requested | Stage::ConnectResponse | Stage::Accepted
                if !udp =>
            {
                other.stage = Stage::Closed;
                Some((cm_event::REJECTED, REJECT_CONSUMER))
            }
            Stage::Established | Stage::DisconnectReceived if !udp => {
                other.stage = match other.stage {
                    Stage::DisconnectSent => Stage::Closed,
                    _ => Stage::DisconnectReceived,
                };
                Some((cm_event::DISCONNECTED, 0))
            }
            _ => None,
        };
        if let Some((event, status)) = event {
            deliver(self, peer, event, status, ConnParam::default());
        }
    }
}

mod id;
#[cfg(test)]
mod tests;
