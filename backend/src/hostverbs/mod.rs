//! The host's verbs: safe wrappers over libibverbs (the only module that touches
//! `rdma-sys`) or, for the device named [`loopback::NAME`], over the loopback host, a
//! software RDMA device inside the process. This is the seam under the device: the same
//! objects and calls serve the control path and the data path whichever host is under them.
//!
//! Every verbs object is an RAII value that destroys its host object on drop and holds an
//! `Arc` of what it depends on (a QP keeps its PD and CQs alive, an MR its PD and the memory
//! it covers), so no drop order can free a parent while a child still uses it.

pub mod cm;
mod cq;
pub mod loopback;
mod memory;
mod qp;

use std::ffi::CStr;
use std::fmt;
use std::io;
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::*;

pub use cq::{CompletionChannel, CompletionQueue, WorkCompletion};
pub use memory::{AnonymousMemory, MemoryRegion, PinnedMemory};
pub use qp::{
    qp_attr_mask, AddressHandle, AhAttr, OneSgeSend, Payload, PushError, QpAttr, QpCaps, QpInit,
    QpState, QpType, QueuePair, RecvWr, SendBatch, SendFlags, SendOp, SendWr, Sge,
    SharedReceiveQueue, UdDest,
};
pub use vrdma_spec::Gid;

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
    /// The errno a failed verbs call reported, if any.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Verbs { source, .. } | Error::Post { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Error from a call that reports failure through errno (NULL or -1 returns).
fn last_error(call: &'static str) -> Error {
    Error::Verbs {
        call,
        source: io::Error::last_os_error(),
    }
}

/// Error from a call that returns a positive errno (0 on success).
fn check(call: &'static str, ret: c_int) -> Result<()> {
    match ret {
        0 => Ok(()),
        // Some providers return -1 and set errno instead.
        r if r < 0 => Err(last_error(call)),
        r => Err(Error::Verbs {
            call,
            source: io::Error::from_raw_os_error(r),
        }),
    }
}

/// Which host an object lives in: libibverbs' object, or the loopback's (by its handle).
enum Raw<T, L> {
    Verbs(NonNull<T>),
    Loopback(L),
}

/// libibverbs objects may be used from any thread (the library serialises internally); the
/// loopback's are `Send` and `Sync` of themselves (handles into a device behind a lock).
macro_rules! verbs_object_is_thread_safe {
    ($($ty:ty),+) => {
        $(
            // SAFETY: libibverbs documents all verbs on an object as thread safe; the wrapper
            // owns the pointer exclusively and only frees it in Drop. A loopback object
            // (the other `Raw` case) is thread safe by its own types.
            unsafe impl Send for $ty {}
            // SAFETY: shared references only issue verbs, which libibverbs documents as
            // thread safe on one object, or calls into the loopback, which locks.
            unsafe impl Sync for $ty {}
        )+
    };
}
pub(crate) use verbs_object_is_thread_safe;

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
    /// Inline bytes an RC QP may carry: not in ibv_device_attr, found by
    /// [`Context::max_inline_data`].
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
pub const PORT_ACTIVE: u32 = ibv_port_state::IBV_PORT_ACTIVE;
/// `link_layer` value of an Ethernet (RoCE) port.
pub const LINK_LAYER_ETHERNET: u8 = 2; // IBV_LINK_LAYER_ETHERNET, a #define bindgen skips

/// libibverbs' name for a work completion status (`ibv_wc_status_str`: "remote access error",
/// ...), as rdma-core's tools print it.
pub fn wc_status_name(status: u8) -> String {
    // SAFETY: ibv_wc_status_str returns a static string for any value (one that names no
    // status gets "unknown").
    let name = unsafe { CStr::from_ptr(ibv_wc_status_str(ibv_wc_status::Type::from(status))) };
    name.to_string_lossy().into_owned()
}

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

extern "C" {
    // Exported by libibverbs behind the static inline ibv_query_gid_ex(); rdma-sys's allowlist
    // does not bind names with a leading underscore.
    fn _ibv_query_gid_ex(
        context: *mut ibv_context,
        port_num: u32,
        gid_index: u32,
        entry: *mut ibv_gid_entry,
        flags: u32,
        entry_size: usize,
    ) -> c_int;
    // Declared over `RawAsyncEvent`, whose event type is a plain integer: rdma-sys's Rust enum
    // would be undefined behaviour for a value a newer provider might report.
    fn ibv_get_async_event(context: *mut ibv_context, event: *mut RawAsyncEvent) -> c_int;
    fn ibv_ack_async_event(event: *mut RawAsyncEvent);
}

/// `struct ibv_async_event`: the element union (a pointer or a port number), then the type.
#[repr(C)]
struct RawAsyncEvent {
    element: usize,
    event_type: u32,
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

impl AsyncEvent {
    /// # Safety
    /// `raw` was filled by ibv_get_async_event and is not acknowledged yet, so the object
    /// its element points at is alive.
    unsafe fn from_raw(raw: &RawAsyncEvent) -> AsyncEvent {
        use ibv_event_type::*;
        let is = |t: ibv_event_type| raw.event_type == t as u32;
        if is(IBV_EVENT_QP_FATAL) || is(IBV_EVENT_QP_REQ_ERR) || is(IBV_EVENT_QP_ACCESS_ERR) {
            // SAFETY: for QP events the element is the live QP (see the function's contract).
            AsyncEvent::QpFailed(unsafe { (*(raw.element as *const ibv_qp)).qp_num })
        } else if is(IBV_EVENT_CQ_ERR) {
            AsyncEvent::CqError(raw.element)
        } else if is(IBV_EVENT_SRQ_LIMIT_REACHED) {
            AsyncEvent::SrqLimitReached(raw.element)
        } else if is(IBV_EVENT_PORT_ACTIVE) || is(IBV_EVENT_PORT_ERR) {
            // The element is a C int port number, in the union's low bytes.
            #[expect(clippy::cast_possible_truncation, reason = "masked to its low byte")]
            let port = (raw.element & 0xff) as u8;
            if is(IBV_EVENT_PORT_ACTIVE) {
                AsyncEvent::PortActive(port)
            } else {
                AsyncEvent::PortError(port)
            }
        } else if is(IBV_EVENT_DEVICE_FATAL) {
            AsyncEvent::DeviceFatal
        } else {
            AsyncEvent::Other(raw.event_type)
        }
    }
}

fn set_nonblocking(fd: std::os::fd::RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller's verbs object owns, integer arguments only.
    let ok = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
    };
    if ok {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// An open host RDMA device.
pub struct Context {
    raw: Raw<ibv_context, loopback::Context>,
    name: String,
}

verbs_object_is_thread_safe!(Context);

impl Context {
    /// Opens the host device called `name` (e.g. `rxe0`, or [`loopback::NAME`]).
    pub fn open(name: &str) -> Result<Arc<Context>> {
        if loopback::is_loopback(name) {
            return Ok(Arc::new(Context {
                raw: Raw::Loopback(loopback::Context::open(name)?),
                name: name.to_string(),
            }));
        }
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-pointer; the list is freed before returning.
        let list = unsafe { ibv_get_device_list(&mut count) };
        if list.is_null() {
            let error = io::Error::last_os_error();
            // ENOSYS: no RDMA support in the kernel at all, which reads as "no devices".
            if error.raw_os_error() == Some(libc::ENOSYS) {
                return Err(Error::DeviceNotFound {
                    name: name.to_string(),
                    present: Vec::new(),
                });
            }
            return Err(Error::Verbs {
                call: "ibv_get_device_list",
                source: error,
            });
        }
        let mut present = Vec::new();
        let mut opened = None;
        // A negative count (none the library returns with a list) is no devices.
        for i in 0..usize::try_from(count).unwrap_or(0) {
            // SAFETY: `list` holds `count` valid device pointers until it is freed.
            let device = unsafe { *list.add(i) };
            // SAFETY: the device's name is a NUL-terminated string it owns.
            let device_name = unsafe { CStr::from_ptr(ibv_get_device_name(device)) }
                .to_string_lossy()
                .into_owned();
            if device_name == name {
                // SAFETY: `device` is valid; the context outlives the list by design.
                opened = Some(NonNull::new(unsafe { ibv_open_device(device) }));
            }
            present.push(device_name);
        }
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ibv_free_device_list(list) };
        match opened {
            None => Err(Error::DeviceNotFound {
                name: name.to_string(),
                present,
            }),
            Some(None) => Err(last_error("ibv_open_device")),
            Some(Some(raw)) => {
                let context = Context {
                    raw: Raw::Verbs(raw),
                    name: name.to_string(),
                };
                set_nonblocking(context.async_fd()).map_err(|source| Error::Verbs {
                    call: "fcntl(O_NONBLOCK) on the async event fd",
                    source,
                })?;
                Ok(Arc::new(context))
            }
        }
    }

    /// Readable when the device has an asynchronous event; non-blocking.
    pub fn async_fd(&self) -> std::os::fd::RawFd {
        match &self.raw {
            // SAFETY: the context is open; async_fd is set when it is opened.
            Raw::Verbs(raw) => unsafe { (*raw.as_ptr()).async_fd },
            Raw::Loopback(context) => context.async_fd(),
        }
    }

    /// Takes the next pending asynchronous event and hands it to `route` before
    /// acknowledging it: until then the host cannot destroy the QP, CQ or SRQ it names, so
    /// its number or id is unambiguous. False when none is pending.
    pub fn take_async_event(&self, route: impl FnOnce(AsyncEvent)) -> bool {
        let context = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr(),
            Raw::Loopback(context) => return context.take_async_event().map(route).is_some(),
        };
        let mut raw = RawAsyncEvent {
            element: 0,
            event_type: 0,
        };
        // SAFETY: the context is open and `raw` has ibv_async_event's layout.
        if unsafe { ibv_get_async_event(context, &mut raw) } != 0 {
            return false;
        }
        // SAFETY: `raw` was just filled and is not acknowledged yet.
        route(unsafe { AsyncEvent::from_raw(&raw) });
        // SAFETY: each event is acknowledged exactly once, after its last use.
        unsafe { ibv_ack_async_event(&mut raw) };
        true
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The loopback context, when the device is the loopback host.
    pub(crate) fn loopback(&self) -> Option<&loopback::Context> {
        match &self.raw {
            Raw::Verbs(_) => None,
            Raw::Loopback(context) => Some(context),
        }
    }

    /// The device's attributes, with the inline limit [`Context::max_inline_data`] finds.
    pub fn query_device(self: &Arc<Self>) -> Result<DeviceAttr> {
        let raw = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr(),
            Raw::Loopback(_) => return Ok(loopback::device_attr()),
        };
        let max_inline_data = self.max_inline_data()?;
        // SAFETY: all-zero is a valid ibv_device_attr (integers and byte arrays).
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid out-pointer.
        check("ibv_query_device", unsafe {
            ibv_query_device(raw, &mut attr)
        })?;
        // SAFETY: fw_ver is a NUL-terminated string inside the struct.
        let fw_ver = unsafe { CStr::from_ptr(attr.fw_ver.as_ptr()) };
        let clamp = |v: c_int| u32::try_from(v).unwrap_or(0);
        Ok(DeviceAttr {
            fw_ver: fw_ver.to_string_lossy().into_owned(),
            node_guid: u64::from_be(attr.node_guid),
            sys_image_guid: u64::from_be(attr.sys_image_guid),
            max_mr_size: attr.max_mr_size,
            page_size_cap: attr.page_size_cap,
            vendor_id: attr.vendor_id,
            vendor_part_id: attr.vendor_part_id,
            hw_ver: attr.hw_ver,
            max_qp: clamp(attr.max_qp),
            max_qp_wr: clamp(attr.max_qp_wr),
            device_cap_flags: attr.device_cap_flags,
            max_sge: clamp(attr.max_sge),
            max_cq: clamp(attr.max_cq),
            max_cqe: clamp(attr.max_cqe),
            max_mr: clamp(attr.max_mr),
            max_pd: clamp(attr.max_pd),
            max_qp_rd_atom: clamp(attr.max_qp_rd_atom),
            max_qp_init_rd_atom: clamp(attr.max_qp_init_rd_atom),
            max_ah: clamp(attr.max_ah),
            max_srq: clamp(attr.max_srq),
            max_srq_wr: clamp(attr.max_srq_wr),
            max_srq_sge: clamp(attr.max_srq_sge),
            atomic_cap: attr.atomic_cap,
            phys_port_cnt: attr.phys_port_cnt,
            max_inline_data,
        })
    }

    /// The most inline data the provider grants an RC QP: no
    /// verb reports it, so it is found by creating QPs that ask for less and less (once per
    /// device and process).
    pub fn max_inline_data(self: &Arc<Self>) -> Result<u32> {
        static FOUND: std::sync::Mutex<Vec<(String, u32)>> = std::sync::Mutex::new(Vec::new());
        let found = |name: &str| {
            FOUND
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .find(|(n, _)| n == name)
                .map(|&(_, inline)| inline)
        };
        if let Some(inline) = found(&self.name) {
            return Ok(inline);
        }
        let pd = self.alloc_pd()?;
        let cq = self.create_cq(1, None)?;
        let mut granted = 0;
        for asked in [4096, 2048, 1024, 512, 256, 128, 64, 32] {
            let init = QpInit {
                qp_type: QpType::Rc,
                caps: QpCaps {
                    max_send_wr: 1,
                    max_recv_wr: 1,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: asked,
                },
                srq: None,
                sq_sig_all: false,
            };
            if let Ok(qp) = pd.create_qp(&cq, &cq, &init) {
                granted = qp.caps().max_inline_data;
                break;
            }
        }
        FOUND
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((self.name.clone(), granted));
        Ok(granted)
    }

    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let raw = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr(),
            Raw::Loopback(context) => return context.query_port(port),
        };
        // SAFETY: all-zero is a valid ibv_port_attr (integers only).
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid, correctly sized out-pointer.
        check("ibv_query_port", unsafe {
            ___ibv_query_port(raw, port, &mut attr)
        })?;
        Ok(PortAttr {
            state: attr.state,
            max_mtu: attr.max_mtu,
            active_mtu: attr.active_mtu,
            gid_tbl_len: u32::try_from(attr.gid_tbl_len).unwrap_or(0),
            port_cap_flags: attr.port_cap_flags,
            max_msg_sz: attr.max_msg_sz,
            pkey_tbl_len: attr.pkey_tbl_len,
            lid: attr.lid,
            active_width: attr.active_width,
            active_speed: attr.active_speed,
            phys_state: attr.phys_state,
            link_layer: attr.link_layer,
        })
    }

    /// The GID at `index` of `port` and its type. An unused entry is an error (ENODATA).
    pub fn query_gid(&self, port: u8, index: u32) -> Result<(Gid, GidType)> {
        if let Some(context) = self.loopback() {
            return context.query_gid(port, index);
        }
        let entry = self.query_gid_entry(port, index)?;
        let gid_type = match entry.gid_type {
            IBV_GID_TYPE_ROCE_V1 => GidType::RoceV1,
            IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
            _ => GidType::Ib,
        };
        // SAFETY: every bit pattern of the union is a valid byte array.
        Ok((Gid(unsafe { entry.gid.raw }), gid_type))
    }

    fn query_gid_entry(&self, port: u8, index: u32) -> Result<ibv_gid_entry> {
        let raw = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr(),
            // The loopback's one entry, on no network device.
            Raw::Loopback(_) => {
                let (gid, _) = loopback::query_gid(port, index)?;
                // SAFETY: all-zero is a valid ibv_gid_entry (integers and a byte union).
                let mut entry: ibv_gid_entry = unsafe { std::mem::zeroed() };
                entry.gid.raw = gid.0;
                entry.gid_type = IBV_GID_TYPE_ROCE_V2;
                return Ok(entry);
            }
        };
        // SAFETY: all-zero is a valid ibv_gid_entry (integers and a byte union).
        let mut entry: ibv_gid_entry = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open; `entry` is a valid out-pointer of the size passed.
        check("ibv_query_gid_ex", unsafe {
            _ibv_query_gid_ex(
                raw,
                port.into(),
                index,
                &mut entry,
                0,
                std::mem::size_of::<ibv_gid_entry>(),
            )
        })?;
        Ok(entry)
    }

    /// The interface index of the network device under a RoCE `port` (the one its default
    /// GID, entry 0, belongs to).
    pub fn netdev_index(&self, port: u8) -> Result<u32> {
        match self.query_gid_entry(port, 0)?.ndev_ifindex {
            0 => Err(Error::InvalidArgument(format!(
                "{} port {port} has no network device",
                self.name
            ))),
            index => Ok(index),
        }
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
        let raw = match &self.raw {
            // SAFETY: the context is open.
            Raw::Verbs(raw) => Raw::Verbs(
                NonNull::new(unsafe { ibv_alloc_pd(raw.as_ptr()) })
                    .ok_or_else(|| last_error("ibv_alloc_pd"))?,
            ),
            Raw::Loopback(context) => Raw::Loopback(context.alloc_pd()?),
        };
        Ok(Arc::new(ProtectionDomain {
            raw,
            context: Arc::clone(self),
        }))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        let Raw::Verbs(raw) = &self.raw else { return };
        // SAFETY: every child holds an Arc of the context, so none is alive any more.
        let ret = unsafe { ibv_close_device(raw.as_ptr()) };
        if ret != 0 {
            log::error!("ibv_close_device({}) failed: {ret}", self.name);
        }
    }
}

/// An object of one host handed to a call on another (a loopback CQ to a verbs QP): a
/// mistake of the caller, refused.
fn other_host(call: &'static str) -> Error {
    Error::InvalidArgument(format!("{call}: objects of two hosts mixed"))
}

/// A host protection domain.
pub struct ProtectionDomain {
    raw: Raw<ibv_pd, loopback::Handle>,
    context: Arc<Context>,
}

verbs_object_is_thread_safe!(ProtectionDomain);

impl ProtectionDomain {
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// Whether a registration in this PD pins the pages it covers, so that the memory it
    /// was made over may be unmapped after ([`ProtectionDomain::reg_mr_pinned`]); the
    /// loopback host reaches registered memory through the mapping itself.
    pub fn pins_pages(&self) -> bool {
        matches!(self.raw, Raw::Verbs(_))
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        let raw = match &self.raw {
            Raw::Verbs(raw) => raw,
            Raw::Loopback(_) => {
                if let Some(context) = self.context.loopback() {
                    context.dealloc_pd();
                }
                return;
            }
        };
        // SAFETY: MRs, QPs and AHs hold an Arc of their PD, so none is alive any more.
        let ret = unsafe { ibv_dealloc_pd(raw.as_ptr()) };
        if ret != 0 {
            log::error!("ibv_dealloc_pd failed: {ret}");
        }
    }
}
