//! The host seam: what the device and the data path ask of a host RDMA device, one trait per
//! object kind. Three hosts implement it: libibverbs and librdmacm ([`super::ibverbs`], the
//! only user of `rdma-sys`'s calls), the loopback host ([`super::loopback`], a software device
//! inside the process), and the fault injector ([`super::faults`], any host that fails on
//! demand).
//!
//! A host object knows nothing of the objects it was made from: the public wrappers
//! ([`super::Context`], [`super::QueuePair`], ...) hold those and drop a host object before
//! its parents, so a host may free its object in `Drop` on the strength of that order. Objects
//! handed to a host call (a CQ to `create_qp`) are the same host's; a host refuses another's
//! ([`super::Error::InvalidArgument`]), which is a caller's mistake, never a guest's.
//!
//! Posted work keeps libibverbs' own layout ([`SendBatch`], [`WorkCompletion`]), so the
//! libibverbs host posts and polls with no copy; the others read it as any provider does.

use std::any::Any;
use std::net::SocketAddrV4;
use std::os::fd::RawFd;
use std::sync::Arc;

use super::{
    AhAttr, AsyncEvent, DeviceAttr, Gid, GidType, ObjectId, PinnedMemory, PortAttr, QpAttr, QpCaps,
    QpInit, RecvWr, Result, SendBatch, WorkCompletion,
};
use vrdma_spec::cm::ConnParam;

/// An open host device.
pub trait HostContext: Send + Sync {
    /// Readable when the device has an asynchronous event; non-blocking.
    fn async_fd(&self) -> RawFd;
    /// Takes the next pending asynchronous event and hands it to `route` before acknowledging
    /// it (until then the object it names cannot be destroyed); false when none is pending.
    fn take_async_event(&self, route: &mut dyn FnMut(AsyncEvent)) -> bool;
    fn query_device(&self) -> Result<DeviceAttr>;
    fn query_port(&self, port: u8) -> Result<PortAttr>;
    /// The GID at `index` of `port` and its type; an unused entry is an error (ENODATA).
    fn query_gid(&self, port: u8, index: u32) -> Result<(Gid, GidType)>;
    /// The interface index of the network device under a RoCE `port`, if it has one.
    fn netdev_index(&self, port: u8) -> Result<Option<u32>>;
    fn alloc_pd(&self) -> Result<Box<dyn HostPd>>;
    /// A CQ with room for at least `depth` completions, reporting armed completions on
    /// `channel` if one is given.
    fn create_cq(&self, depth: u32, channel: Option<&dyn HostChannel>) -> Result<Box<dyn HostCq>>;
    /// A completion channel; its descriptor is made non-blocking by the caller.
    fn create_comp_channel(&self) -> Result<Box<dyn HostChannel>>;
}

/// A protection domain: what registrations, QPs, SRQs and AHs are made in.
pub trait HostPd: Send + Sync {
    /// Whether a registration pins the pages it covers ([`HostPd::reg_mr_pinned`] works).
    fn pins_pages(&self) -> bool;
    /// Registers `at` of `memory`; the caller keeps `memory` mapped while the MR lives. The
    /// range is checked by the caller.
    fn reg_mr(&self, memory: &Arc<dyn PinnedMemory>, at: Registration) -> Result<Box<dyn HostMr>>;
    /// As [`HostPd::reg_mr`], with the pages pinned by the host, so that `memory` may be
    /// unmapped once this returns.
    fn reg_mr_pinned(&self, memory: &dyn PinnedMemory, at: Registration)
        -> Result<Box<dyn HostMr>>;
    /// A QP over `queues`, with the caps the host granted.
    fn create_qp(&self, queues: QpQueues<'_>, init: &QpInit<'_>) -> Result<NewQp>;
    fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Box<dyn HostSrq>>;
    fn create_ah(&self, attr: &AhAttr) -> Result<Box<dyn HostAh>>;
}

/// Where a registration lies: `len` bytes from `offset` into the memory registered, seen by
/// the NIC at `iova`, with `access` (`ibv_access_flags`).
#[derive(Clone, Copy, Debug)]
pub struct Registration {
    pub offset: usize,
    pub len: usize,
    pub iova: u64,
    pub access: u32,
}

/// The queues a new QP is made over: the same host's as the PD's.
#[derive(Clone, Copy)]
pub struct QpQueues<'a> {
    pub send_cq: &'a dyn HostCq,
    pub recv_cq: &'a dyn HostCq,
    /// For `init.srq`: its host SRQ.
    pub srq: Option<&'a dyn HostSrq>,
}

/// A host QP and the caps the host granted.
pub type NewQp = (Box<dyn HostQp>, QpCaps);

/// A completion event channel.
pub trait HostChannel: Send + Sync {
    fn fd(&self) -> RawFd;
    /// Consumes and acknowledges every pending event; returns how many there were.
    fn drain(&self) -> usize;
    fn as_any(&self) -> &dyn Any;
}

/// A completion queue.
pub trait HostCq: Send + Sync {
    /// What names the CQ in an [`AsyncEvent`].
    fn id(&self) -> ObjectId;
    /// Moves up to `out.len()` completions into `out`; returns how many.
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize>;
    /// Asks for one event on the CQ's channel at the next (solicited) completion.
    fn req_notify(&self, solicited_only: bool) -> Result<()>;
    /// Makes room for at least `depth` completions, keeping those it holds.
    fn resize(&self, depth: u32) -> Result<()>;
    /// Capacity the host actually allocated.
    fn depth(&self) -> u32;
    fn as_any(&self) -> &dyn Any;
}

/// A memory region.
pub trait HostMr: Send + Sync {
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
}

/// A queue pair.
pub trait HostQp: Send + Sync {
    fn qp_num(&self) -> u32;
    /// Applies the fields of `attr` selected by `mask`.
    fn modify(&self, attr: &QpAttr, mask: u32) -> Result<()>;
    fn query(&self) -> Result<QpAttr>;
    /// Posts the batch's requests in order; on a partial post, `Error::Post` says how many
    /// were taken. Every AH the batch names is this host's (the caller checks).
    fn post_send(&self, batch: &mut SendBatch) -> Result<()>;
    /// Posts receives in order; on a partial post, `Error::Post` says how many were taken.
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()>;
}

/// A shared receive queue.
pub trait HostSrq: Send + Sync {
    /// What names the SRQ in an [`AsyncEvent`].
    fn id(&self) -> ObjectId;
    /// Posts receives in order; on a partial post, `Error::Post` says how many were taken.
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()>;
    fn as_any(&self) -> &dyn Any;
}

/// An address handle (a UD destination).
pub trait HostAh: Send + Sync {
    /// What names the AH in a send request's `wr.ud.ah`: libibverbs' `ibv_ah` address, or the
    /// number another host knows it by.
    fn handle(&self) -> usize;
}

/// A connection manager's event channel, for one guest's address.
pub trait HostCmChannel: Send + Sync {
    /// Readable when an event waits; non-blocking.
    fn fd(&self) -> RawFd;
    /// A new id, keyed `key` (what its events are routed by).
    fn create_id(&self, space: PortSpace, key: u64) -> Result<Box<dyn HostCmId>>;
    /// Takes the next event, copied out and acknowledged; `None` when none waits.
    fn take_event(&self) -> Option<HostCmEvent>;
}

/// One event of a [`HostCmChannel`], as [`super::cm::CmEvent`] with the host's new id.
pub struct HostCmEvent {
    pub event: u32,
    pub status: i32,
    pub key: u64,
    pub new_id: Option<Box<dyn HostCmId>>,
    pub param: ConnParam,
    pub ud_ah: Option<AhAttr>,
}

/// A connection manager id (rdma_cm's verbs on it).
pub trait HostCmId: Send + Sync {
    fn set_key(&self, key: u64);
    fn bind(&self, address: SocketAddrV4) -> Result<()>;
    fn resolve_addr(&self, src: SocketAddrV4, dst: SocketAddrV4, timeout_ms: u32) -> Result<()>;
    fn resolve_route(&self, timeout_ms: u32) -> Result<()>;
    fn listen(&self, backlog: u32) -> Result<()>;
    fn connect(&self, param: &ConnParam, qp_num: u32) -> Result<()>;
    fn accept(&self, param: &ConnParam, qp_num: u32) -> Result<()>;
    fn reject(&self, private_data: &[u8]) -> Result<()>;
    fn disconnect(&self) -> Result<()>;
    fn establish(&self) -> Result<()>;
    /// The attributes (and their mask) that move a QP of this id to `state`.
    fn init_qp_attr(&self, state: u32) -> Result<(QpAttr, u32)>;
    fn info(&self) -> CmIdInfo;
}

/// librdmacm's port spaces the device serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortSpace {
    /// RC QPs.
    Tcp,
    /// UD QPs.
    Udp,
}

/// The addresses and route of an id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CmIdInfo {
    pub src: Option<SocketAddrV4>,
    pub dst: Option<SocketAddrV4>,
    pub sgid: Gid,
    pub dgid: Gid,
    pub pkey: u16,
    /// ibv_mtu of the first path; 0 without one.
    pub path_mtu: u8,
    pub num_paths: u8,
    /// The host device the id is bound to, once it is.
    pub device: Option<String>,
    pub port_num: u8,
}
