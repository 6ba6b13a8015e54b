//! The host's verbs: the objects the device and the data path make and use on a host RDMA
//! device, whichever host is under them ([`seam`]: libibverbs, the loopback host, or either
//! failing on demand).
//!
//! Every verbs object is an RAII value that destroys its host object on drop and holds an
//! `Arc` of what it depends on (a QP keeps its PD and CQs alive, an MR its PD and the memory
//! it covers), so no drop order can free a parent while a child still uses it: the hosts rely
//! on it.

pub mod cm;
mod cq;
mod event_queue;
pub mod faults;
pub mod ibverbs;
pub mod loopback;
mod memory;
mod qp;
pub mod seam;

use std::io;
use std::sync::Arc;

pub use cq::{CompletionChannel, CompletionQueue, WorkCompletion};
pub use ibverbs::wc_status_name;
pub use memory::{AnonymousMemory, MemoryRegion, PinnedMemory};
pub use qp::{
    qp_attr_mask, AddressHandle, AhAttr, OneSgeSend, Payload, PushError, QpAttr, QpCaps, QpInit,
    QpState, QpType, QueuePair, RecvWr, SendBatch, SendFlags, SendOp, SendWr, Sge,
    SharedReceiveQueue, UdDest,
};
pub use vrdma_spec::Gid;

use seam::{HostContext, HostPd};

/// Errors of host verbs calls.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "RDMA device '{name}' not found (present: {}); is the rdma_rxe module loaded and an rxe link added? (`loopback` is the backend's own software device, for tests)",
        if present.is_empty() { "none".to_string() } else { present.join(", ") }
    )]
    DeviceNotFound { name: String, present: Vec<String> },
    #[error("{call} failed: {source}")]
    Verbs {
        call: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{call} failed after {posted} work requests were accepted: {source}")]
    Post {
        call: &'static str,
        posted: usize,
        #[source]
        source: io::Error,
    },
    #[error("{0}")]
    InvalidArgument(String),
}

impl Error {
    /// An object of one host handed to a call of another (a loopback CQ to a libibverbs
    /// QP): a mistake of the caller, refused.
    pub(crate) fn other_host(call: &'static str) -> Error {
        Error::InvalidArgument(format!("{call}: objects of two hosts mixed"))
    }

    /// The errno a failed verbs call reported, if any.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Verbs { source, .. } | Error::Post { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// GID types, as the kernel reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidType {
    Ib,
    RoceV1,
    RoceV2,
}

/// Device attributes the backend uses (a subset of `ibv_device_attr`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceAttr {
    pub fw_ver: String,
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub device_cap_flags: u32,
    pub max_sge: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    pub max_pd: u32,
    pub max_qp_rd_atom: u32,
    pub max_qp_init_rd_atom: u32,
    pub max_ah: u32,
    pub max_srq: u32,
    pub max_srq_wr: u32,
    pub max_srq_sge: u32,
    pub atomic_cap: u32,
    pub phys_port_cnt: u8,
    /// Inline bytes an RC QP may carry: not in ibv_device_attr; libibverbs' host finds it by
    /// creating QPs that ask for less and less.
    pub max_inline_data: u32,
}

/// Port attributes the backend uses (a subset of `ibv_port_attr`; enums keep ibverbs values).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortAttr {
    pub state: u32,
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub gid_tbl_len: u32,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
}

/// `ibv_port_state` value of an active port.
pub const PORT_ACTIVE: u32 = rdma_sys::ibv_port_state::IBV_PORT_ACTIVE;
/// `link_layer` value of an Ethernet (RoCE) port.
pub const LINK_LAYER_ETHERNET: u8 = 2; // IBV_LINK_LAYER_ETHERNET, a #define bindgen skips

/// Raises this process's soft limit on open files to its hard limit, and the hard limit to
/// `at_least` where it is lower and the process may raise it (CAP_SYS_RESOURCE: a backend
/// started as root); returns the soft limit in force.
pub fn raise_open_file_limit_to(at_least: u64) -> io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit with a valid pointer to a local struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if limit.rlim_max < at_least {
        let raised = libc::rlimit {
            rlim_cur: at_least,
            rlim_max: at_least,
        };
        // SAFETY: setrlimit with a valid pointer to a local struct; a refusal changes nothing.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return Ok(at_least);
        }
    }
    limit.rlim_cur = limit.rlim_max;
    // SAFETY: setrlimit with a valid pointer to a local struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(limit.rlim_cur)
}

/// Raises this process's soft limit on open files to its hard limit.
pub fn raise_open_file_limit() -> io::Result<u64> {
    raise_open_file_limit_to(0)
}

/// Identifies a host CQ or SRQ in an [`AsyncEvent`] (its address, unique while it lives).
pub type ObjectId = usize;

/// A host asynchronous event, as far as vrdma forwards it (SPEC.md §8.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsyncEvent {
    /// The QP with this number entered the error state (fatal, request or access error).
    QpFailed(u32),
    /// The CQ with this [`CompletionQueue::id`] overran or failed.
    CqError(ObjectId),
    /// The SRQ with this [`SharedReceiveQueue::id`] fell below its limit.
    SrqLimitReached(ObjectId),
    PortActive(u8),
    PortError(u8),
    DeviceFatal,
    /// Everything else (communication established, last WQE reached, GID change, ...), by
    /// its `ibv_event_type` value.
    Other(u32),
}

/// An open host RDMA device.
pub struct Context {
    host: Box<dyn HostContext>,
    name: String,
}

impl Context {
    /// Opens the host device called `name` (e.g. `rxe0`, or [`loopback::NAME`]), failing on
    /// demand where a test armed [`faults`] for it.
    pub fn open(name: &str) -> Result<Arc<Context>> {
        let host: Box<dyn HostContext> = match loopback::is_loopback(name) {
            true => Box::new(loopback::Context::open(name)?),
            false => Box::new(ibverbs::Context::open(name)?),
        };
        Ok(Arc::new(Context {
            host: faults::wrap_context(name, host)?,
            name: name.to_string(),
        }))
    }

    /// Readable when the device has an asynchronous event; non-blocking.
    pub fn async_fd(&self) -> std::os::fd::RawFd {
        self.host.async_fd()
    }

    /// Takes the next pending asynchronous event and hands it to `route` before
    /// acknowledging it: until then the host cannot destroy the QP, CQ or SRQ it names, so
    /// its number or id is unambiguous. False when none is pending.
    pub fn take_async_event(&self, route: impl FnOnce(AsyncEvent)) -> bool {
        let mut route = Some(route);
        self.host.take_async_event(&mut |event| {
            if let Some(route) = route.take() {
                route(event);
            }
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's attributes, with the most inline data an RC QP may carry.
    pub fn query_device(&self) -> Result<DeviceAttr> {
        self.host.query_device()
    }

    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        self.host.query_port(port)
    }

    /// The GID at `index` of `port` and its type. An unused entry is an error (ENODATA).
    pub fn query_gid(&self, port: u8, index: u32) -> Result<(Gid, GidType)> {
        self.host.query_gid(port, index)
    }

    /// The interface index of the network device under a RoCE `port` (the one its default
    /// GID, entry 0, belongs to).
    pub fn netdev_index(&self, port: u8) -> Result<u32> {
        self.host.netdev_index(port)?.ok_or_else(|| {
            Error::InvalidArgument(format!("{} port {port} has no network device", self.name))
        })
    }

    /// The index of `gid` as a RoCEv2 entry of `port`'s GID table, if it is there.
    pub fn find_roce_v2_gid(&self, port: u8, gid: Gid) -> Result<Option<u32>> {
        let mut entries = self.roce_v2_gids(port)?;
        Ok(entries
            .find(|&(_, entry)| entry == gid)
            .map(|(index, _)| index))
    }

    /// The index of the first RoCEv2 GID of `port` that maps an IPv4 address.
    pub fn find_roce_v2_ipv4_gid(&self, port: u8) -> Result<(u32, Gid)> {
        let mut entries = self.roce_v2_gids(port)?;
        entries
            .find(|(_, gid)| gid.ipv4().is_some())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{} port {port} has no RoCEv2 GID with an IPv4 address",
                    self.name
                ))
            })
    }

    /// The RoCEv2 entries of `port`'s GID table, in index order (unassigned ones fail to
    /// query and are left out).
    fn roce_v2_gids(&self, port: u8) -> Result<impl Iterator<Item = (u32, Gid)> + '_> {
        let table_len = self.query_port(port)?.gid_tbl_len;
        Ok(
            (0..table_len).filter_map(move |index| match self.query_gid(port, index) {
                Ok((gid, GidType::RoceV2)) => Some((index, gid)),
                _ => None,
            }),
        )
    }

    pub fn alloc_pd(self: &Arc<Self>) -> Result<Arc<ProtectionDomain>> {
        Ok(Arc::new(ProtectionDomain {
            host: self.host.alloc_pd()?,
            context: Arc::clone(self),
        }))
    }
}

/// A host protection domain.
pub struct ProtectionDomain {
    /// Dropped before `context` (fields drop in order), as the seam requires.
    host: Box<dyn HostPd>,
    context: Arc<Context>,
}

impl ProtectionDomain {
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// Whether a registration in this PD pins the pages it covers, so that the memory it
    /// was made over may be unmapped after ([`ProtectionDomain::reg_mr_pinned`]); the
    /// loopback host reaches registered memory through the mapping itself.
    pub fn pins_pages(&self) -> bool {
        self.host.pins_pages()
    }
}
