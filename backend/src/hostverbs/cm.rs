//! The host's RDMA connection manager: an event channel per guest connection and CM ids on
//! it, as RAII wrappers over a host's ([`HostCmChannel`]): librdmacm's, or the loopback
//! host's own ([`loopback::cm`]). Ids never own a QP here: connection parameters carry the
//! number of a QP the device created, and the device moves its QPs itself (SPEC.md §13).

use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::RawFd;
use std::sync::Arc;

pub use vrdma_spec::cm::ConnParam;

pub use super::seam::{CmIdInfo, PortSpace};
use super::seam::{HostCmChannel, HostCmId};
use super::{faults, ibverbs, loopback, AhAttr, QpAttr, Result};

pub use super::ibverbs::cm::prepare;

/// One event taken from the channel, copied out and acknowledged.
pub struct CmEvent {
    /// librdmacm's `rdma_cm_event_type`.
    pub event: u32,
    pub status: i32,
    /// The key of the id it concerns (for a connection request: of the listening id).
    pub key: u64,
    /// For a connection request: the new id, keyed 0 until [`CmId::set_key`].
    pub new_id: Option<CmId>,
    pub param: ConnParam,
    /// UD connection requests and ESTABLISHED: the address vector of the peer, in the
    /// host's view.
    pub ud_ah: Option<AhAttr>,
}

/// An event channel: readable when an event waits. Non-blocking.
pub struct CmChannel {
    host: Box<dyn HostCmChannel>,
}

impl CmChannel {
    /// Opens the connection manager of `device` for a guest whose address is `own`: the
    /// loopback's, which holds `own` in the device's address table while the channel lives;
    /// otherwise the kernel's (`/dev/infiniband/rdma_cm`, the `rdma_ucm` module), where the
    /// address is on the device's network interface already. Fails on demand where a test
    /// armed [`faults`] for the device.
    pub fn open(device: &str, own: Ipv4Addr) -> Result<Arc<CmChannel>> {
        let host: Box<dyn HostCmChannel> = match loopback::is_loopback(device) {
            true => Box::new(loopback::cm::Channel::open(device, own)?),
            false => Box::new(ibverbs::cm::Channel::open()?),
        };
        Ok(Arc::new(CmChannel {
            host: faults::wrap_cm_channel(device, host),
        }))
    }

    /// Readable when an event is waiting.
    pub fn fd(&self) -> RawFd {
        self.host.fd()
    }

    /// A new id on this channel, keyed `key` (what its events are routed by).
    pub fn create_id(self: &Arc<Self>, space: PortSpace, key: u64) -> Result<CmId> {
        Ok(CmId {
            host: self.host.create_id(space, key)?,
            _channel: Arc::clone(self),
        })
    }

    /// Takes the next event, copies what it carries and acknowledges it, so that nothing
    /// waits on it (a destroy of its id waits for its acknowledgement). `None` when none
    /// waits.
    pub fn take_event(self: &Arc<Self>) -> Option<CmEvent> {
        let event = self.host.take_event()?;
        Some(CmEvent {
            event: event.event,
            status: event.status,
            key: event.key,
            new_id: event.new_id.map(|host| CmId {
                host,
                _channel: Arc::clone(self),
            }),
            param: event.param,
            ud_ah: event.ud_ah,
        })
    }
}

/// A connection-manager id. Dropping it destroys it (a connected id disconnects first).
pub struct CmId {
    /// Dropped before the channel (fields drop in order), as the seam requires.
    host: Box<dyn HostCmId>,
    _channel: Arc<CmChannel>,
}

impl CmId {
    /// Keys the id: its events are routed by `key` from now on.
    pub fn set_key(&self, key: u64) {
        self.host.set_key(key);
    }

    pub fn bind(&self, address: SocketAddrV4) -> Result<()> {
        self.host.bind(address)
    }

    pub fn resolve_addr(
        &self,
        src: SocketAddrV4,
        dst: SocketAddrV4,
        timeout_ms: u32,
    ) -> Result<()> {
        self.host.resolve_addr(src, dst, timeout_ms)
    }

    pub fn resolve_route(&self, timeout_ms: u32) -> Result<()> {
        self.host.resolve_route(timeout_ms)
    }

    pub fn listen(&self, backlog: u32) -> Result<()> {
        self.host.listen(backlog)
    }

    /// Connects with the QP numbered `qp_num` (of the same host device).
    pub fn connect(&self, param: &ConnParam, qp_num: u32) -> Result<()> {
        self.host.connect(param, qp_num)
    }

    /// Accepts the connection request this id came from, with the QP numbered `qp_num`.
    pub fn accept(&self, param: &ConnParam, qp_num: u32) -> Result<()> {
        self.host.accept(param, qp_num)
    }

    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        self.host.reject(private_data)
    }

    pub fn disconnect(&self) -> Result<()> {
        self.host.disconnect()
    }

    pub fn establish(&self) -> Result<()> {
        self.host.establish()
    }

    /// The attributes (and their mask) that move a QP of this id to `state`, in the host's
    /// view.
    pub fn init_qp_attr(&self, state: u32) -> Result<(QpAttr, u32)> {
        self.host.init_qp_attr(state)
    }

    /// The id's addresses, route and device.
    pub fn info(&self) -> CmIdInfo {
        self.host.info()
    }
}
