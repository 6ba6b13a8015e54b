//! The host's RDMA connection manager: an event channel per guest connection and CM ids on
//! it, as RAII wrappers, on librdmacm or on the loopback host's own connection manager
//! ([`loopback::cm`]). Ids never own a QP here: connection parameters carry the number of a
//! QP the device created, and the device moves its QPs itself (SPEC.md §13).

use std::ffi::CStr;
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::RawFd;
use std::os::raw::{c_int, c_void};
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::*;

pub use vrdma_spec::cm::ConnParam;
use vrdma_spec::verbs::ibv::{from_sockaddr_in, sockaddr_in};

use super::{
    check, last_error, loopback, set_nonblocking, AhAttr, Error, Gid, QpAttr, Raw, Result,
};

/// librdmacm's port spaces the device serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortSpace {
    /// RC QPs.
    Tcp,
    /// UD QPs.
    Udp,
}

impl PortSpace {
    fn raw(self) -> rdma_port_space::Type {
        match self {
            PortSpace::Tcp => rdma_port_space::RDMA_PS_TCP,
            PortSpace::Udp => rdma_port_space::RDMA_PS_UDP,
        }
    }
}

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

/// Does once what librdmacm does the first time a process resolves a route and that a
/// confined process may not: it connects to the ibacm service's socket, if one is there (its
/// address resolution service; on RoCE librdmacm goes on without it). And, where the
/// connection manager is (`rdma_ucm`), it has librdmacm open the device contexts it keeps for
/// the life of the process, which it would otherwise open at a guest's first bind: the
/// backend then holds the same host objects before its guests use connection management as
/// after. Called before the seccomp filter is installed; harmless where the connection
/// manager is missing.
pub fn prepare() {
    if std::path::Path::new("/dev/infiniband/rdma_cm").exists() {
        let mut count: c_int = 0;
        // SAFETY: a valid out-pointer; the list (not the contexts it names, which librdmacm
        // keeps) is freed once, when the call returned one.
        unsafe {
            let list = rdma_get_devices(&mut count);
            if !list.is_null() {
                rdma_free_devices(list);
            }
        }
    }
    // SAFETY: all-zero is a valid rdma_addrinfo hint (no flags, no addresses).
    let mut hints: rdma_addrinfo = unsafe { std::mem::zeroed() };
    hints.ai_family = libc::AF_INET;
    let mut result: *mut rdma_addrinfo = std::ptr::null_mut();
    // SAFETY: no node or service; `hints` is valid for the call and `result` a valid
    // out-pointer, freed below when the call filled it.
    let ret = unsafe { rdma_getaddrinfo(std::ptr::null(), std::ptr::null(), &hints, &mut result) };
    if ret == 0 && !result.is_null() {
        // SAFETY: `result` came from rdma_getaddrinfo and is freed once.
        unsafe { rdma_freeaddrinfo(result) };
    }
}

/// An event channel: readable when an event waits. Non-blocking.
pub struct CmChannel {
    raw: Raw<rdma_event_channel, Arc<loopback::cm::Channel>>,
}

// SAFETY: librdmacm's calls on a channel are thread safe (it locks per id and per channel);
// the wrapper owns the pointer and frees it only in Drop, after every id (each holds an Arc).
// The loopback's channel is thread safe of itself.
unsafe impl Send for CmChannel {}
// SAFETY: as above: shared references only make librdmacm calls, or the loopback's, which
// lock.
unsafe impl Sync for CmChannel {}

impl CmChannel {
    /// Opens the connection manager of `device` for a guest whose address is `own`: the
    /// loopback's, which holds `own` in the device's address table while the channel lives;
    /// otherwise the kernel's (`/dev/infiniband/rdma_cm`, the `rdma_ucm` module), where the
    /// address is on the device's network interface already.
    pub fn open(device: &str, own: Ipv4Addr) -> Result<Arc<CmChannel>> {
        if loopback::is_loopback(device) {
            let channel = loopback::cm::Channel::open(device, own)?;
            return Ok(Arc::new(CmChannel {
                raw: Raw::Loopback(channel),
            }));
        }
        // SAFETY: no arguments; the result is checked for NULL.
        let raw = NonNull::new(unsafe { rdma_create_event_channel() })
            .ok_or_else(|| last_error("rdma_create_event_channel"))?;
        let channel = CmChannel {
            raw: Raw::Verbs(raw),
        };
        set_nonblocking(channel.fd()).map_err(|source| Error::Verbs {
            call: "fcntl(O_NONBLOCK) on the CM event channel",
            source,
        })?;
        Ok(Arc::new(channel))
    }

    /// Readable when an event is waiting.
    pub fn fd(&self) -> RawFd {
        match &self.raw {
            // SAFETY: the channel is alive; its fd is set at creation.
            Raw::Verbs(raw) => unsafe { (*raw.as_ptr()).fd },
            Raw::Loopback(channel) => channel.fd(),
        }
    }

    /// A new id on this channel, keyed `key` (what its events are routed by).
    pub fn create_id(self: &Arc<Self>, space: PortSpace, key: u64) -> Result<CmId> {
        let channel = match &self.raw {
            Raw::Verbs(channel) => *channel,
            Raw::Loopback(channel) => {
                let id = channel.create_id(space == PortSpace::Udp, key)?;
                return Ok(CmId {
                    raw: Raw::Loopback(id),
                    _channel: Arc::clone(self),
                });
            }
        };
        let mut id: *mut rdma_cm_id = std::ptr::null_mut();
        // SAFETY: the channel is alive; `id` is a valid out-pointer; the context is an
        // integer key, never dereferenced.
        check("rdma_create_id", unsafe {
            rdma_create_id(channel.as_ptr(), &mut id, key as *mut c_void, space.raw())
        })?;
        let raw = NonNull::new(id).ok_or_else(|| last_error("rdma_create_id"))?;
        Ok(CmId {
            raw: Raw::Verbs(raw),
            _channel: Arc::clone(self),
        })
    }

    /// Takes the next event, copies what it carries and acknowledges it, so that nothing
    /// waits on it (a destroy of its id waits for its acknowledgement). `None` when none
    /// waits.
    pub fn take_event(self: &Arc<Self>) -> Option<CmEvent> {
        let channel = match &self.raw {
            Raw::Verbs(channel) => *channel,
            Raw::Loopback(channel) => {
                let event = channel.take_event()?;
                return Some(CmEvent {
                    event: event.event,
                    status: event.status,
                    key: event.key,
                    new_id: event.new_id.map(|id| CmId {
                        raw: Raw::Loopback(id),
                        _channel: Arc::clone(self),
                    }),
                    param: event.param,
                    ud_ah: event.ud_ah,
                });
            }
        };
        let mut raw: *mut rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the channel is alive and non-blocking; `raw` is a valid out-pointer.
        if unsafe { rdma_get_cm_event(channel.as_ptr(), &mut raw) } != 0 || raw.is_null() {
            return None;
        }
        // SAFETY: `raw` is the event just returned, valid until acknowledged below; its ids
        // are alive at least as long.
        let event = unsafe { self.copy_event(&*raw) };
        // SAFETY: acknowledged once, after its last use.
        unsafe { rdma_ack_cm_event(raw) };
        Some(event)
    }

    /// # Safety
    /// `raw` is an unacknowledged event of this channel.
    unsafe fn copy_event(self: &Arc<Self>, raw: &rdma_cm_event) -> CmEvent {
        // SAFETY: the ids of an unacknowledged event are alive (the function's contract).
        let key_of = |id: *mut rdma_cm_id| unsafe { (*id).context } as u64;
        let is_request = raw.event == rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST;
        let (key, new_id) = match NonNull::new(raw.listen_id) {
            Some(listen_id) if is_request => {
                let new_id = NonNull::new(raw.id).map(|id| {
                    // Until the device keys it, none of its events can be routed.
                    // SAFETY: the request's new id is alive and not yet known to anyone else.
                    unsafe { (*id.as_ptr()).context = std::ptr::null_mut() };
                    CmId {
                        raw: Raw::Verbs(id),
                        _channel: Arc::clone(self),
                    }
                });
                (key_of(listen_id.as_ptr()), new_id)
            }
            _ => (key_of(raw.id), None),
        };
        // SAFETY: the event's id is alive (the function's contract).
        let ud = unsafe { (*raw.id).ps } == rdma_port_space::RDMA_PS_UDP
            && matches!(
                raw.event,
                rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST
                    | rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED
            );
        let copy = |data: *const c_void, len: u8| match data.is_null() {
            true => Vec::new(),
            // SAFETY: librdmacm gives `len` bytes at `data`, valid until the ack.
            false => unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len.into()) }.to_vec(),
        };
        let (param, ud_ah) = if ud {
            // SAFETY: a UD id's CONNECT_REQUEST and ESTABLISHED events carry `param.ud`.
            let ud = unsafe { &raw.param.ud };
            let param = ConnParam {
                qp_num: ud.qp_num,
                qkey: ud.qkey,
                private_data: copy(ud.private_data, ud.private_data_len),
                ..ConnParam::default()
            };
            (param, Some(AhAttr::from(&ud.ah_attr)))
        } else {
            // SAFETY: every other event carries `param.conn` (zeroed where it has none).
            let conn = unsafe { &raw.param.conn };
            let param = ConnParam {
                responder_resources: conn.responder_resources,
                initiator_depth: conn.initiator_depth,
                flow_control: conn.flow_control,
                retry_count: conn.retry_count,
                rnr_retry_count: conn.rnr_retry_count,
                srq: conn.srq != 0,
                qp_num: conn.qp_num,
                qkey: 0,
                private_data: copy(conn.private_data, conn.private_data_len),
            };
            (param, None)
        };
        CmEvent {
            event: raw.event,
            status: raw.status,
            key,
            new_id,
            param,
            ud_ah,
        }
    }
}

impl Drop for CmChannel {
    fn drop(&mut self) {
        if let Raw::Verbs(raw) = &self.raw {
            // SAFETY: every id of the channel is gone (each held an Arc of it); freed once.
            unsafe { rdma_destroy_event_channel(raw.as_ptr()) };
        }
    }
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

/// A connection-manager id. Dropping it destroys it (a connected id disconnects first).
pub struct CmId {
    raw: Raw<rdma_cm_id, loopback::cm::Id>,
    _channel: Arc<CmChannel>,
}

// SAFETY: librdmacm locks per id; the wrapper owns the pointer and frees it only in Drop. A
// loopback id is thread safe of itself.
unsafe impl Send for CmId {}
// SAFETY: shared references only make librdmacm calls, thread safe on one id, or the
// loopback's, which lock.
unsafe impl Sync for CmId {}

/// The IPv4 address in `storage`, if it holds one with a non-zero address or port.
fn from_sockaddr(storage: &libc::sockaddr_in) -> Option<SocketAddrV4> {
    from_sockaddr_in(storage).filter(|a| !a.ip().is_unspecified() || a.port() != 0)
}

impl CmId {
    /// The librdmacm id, or the loopback's.
    fn host(&self) -> std::result::Result<*mut rdma_cm_id, &loopback::cm::Id> {
        match &self.raw {
            Raw::Verbs(raw) => Ok(raw.as_ptr()),
            Raw::Loopback(id) => Err(id),
        }
    }

    /// Keys the id: its events are routed by `key` from now on.
    pub fn set_key(&self, key: u64) {
        match self.host() {
            // SAFETY: the id is alive; librdmacm only hands the context back in events,
            // which the one event thread reads after this call for ids it keyed itself.
            Ok(raw) => unsafe { (*raw).context = key as *mut c_void },
            Err(id) => id.set_key(key),
        }
    }

    pub fn bind(&self, address: SocketAddrV4) -> Result<()> {
        let raw = match self.host() {
            Ok(raw) => raw,
            Err(id) => return id.bind(address),
        };
        let mut sin = sockaddr_in(address);
        // SAFETY: the id is alive; `sin` is a valid sockaddr_in, copied by the call.
        check("rdma_bind_addr", unsafe {
            rdma_bind_addr(raw, (&mut sin as *mut libc::sockaddr_in).cast())
        })
    }

    pub fn resolve_addr(
        &self,
        src: SocketAddrV4,
        dst: SocketAddrV4,
        timeout_ms: u32,
    ) -> Result<()> {
        let raw = match self.host() {
            Ok(raw) => raw,
            Err(id) => return id.resolve_addr(src, dst),
        };
        let (mut src, mut dst) = (sockaddr_in(src), sockaddr_in(dst));
        let timeout = c_int::try_from(timeout_ms).unwrap_or(c_int::MAX);
        // SAFETY: the id is alive; both sockaddrs are valid and copied by the call.
        check("rdma_resolve_addr", unsafe {
            rdma_resolve_addr(
                raw,
                (&mut src as *mut libc::sockaddr_in).cast(),
                (&mut dst as *mut libc::sockaddr_in).cast(),
                timeout,
            )
        })
    }

    pub fn resolve_route(&self, timeout_ms: u32) -> Result<()> {
        let raw = match self.host() {
            Ok(raw) => raw,
            Err(id) => return id.resolve_route(),
        };
        let timeout = c_int::try_from(timeout_ms).unwrap_or(c_int::MAX);
        // SAFETY: the id is alive.
        check("rdma_resolve_route", unsafe {
            rdma_resolve_route(raw, timeout)
        })
    }

    pub fn listen(&self, backlog: u32) -> Result<()> {
        let raw = match self.host() {
            Ok(raw) => raw,
            Err(id) => return id.listen(backlog),
        };
        let backlog = c_int::try_from(backlog).unwrap_or(c_int::MAX);
        // SAFETY: the id is alive.
        check("rdma_listen", unsafe { rdma_listen(raw, backlog) })
    }

    fn raw_param(param: &ConnParam, qp_num: u32) -> Result<rdma_conn_param> {
        let private_data_len = u8::try_from(param.private_data.len())
            .map_err(|_| Error::InvalidArgument("private data over 255 bytes".into()))?;
        Ok(rdma_conn_param {
            private_data: match param.private_data.is_empty() {
                true => std::ptr::null(),
                false => param.private_data.as_ptr().cast(),
            },
            private_data_len,
            responder_resources: param.responder_resources,
            initiator_depth: param.initiator_depth,
            flow_control: param.flow_control,
            retry_count: param.retry_count,
            rnr_retry_count: param.rnr_retry_count,
            srq: param.srq.into(),
            qp_num,
        })
    }

    /// Connects with the QP numbered `qp_num` (of the same host device).
    pub fn connect(&self, param: &ConnParam, qp_num: u32) -> Result<()> {
        let raw = match self.host() {
            Ok(raw) => raw,
            Err(id) => return id.connect(param, qp_num),
        };
        let mut conn = Self::raw_param(param, qp_num)?;
        // SAFETY: the id is alive; `conn` and the private data it points to outlive the call,
        // which copies them.
        check("rdma_connect", unsafe { rdma_connect(raw, &mut conn) })
    }

    /// Accepts the connection request this id came from, with the QP numbered `qp_num`.
    pub fn accept(&self, param: &ConnParam, qp_num: u32) -> Result<()> {
        let raw = match self.host() {
            Ok(raw) => raw,
            Err(id) => return id.accept(param, qp_num),
        };
        let mut conn = Self::raw_param(param, qp_num)?;
        // SAFETY: as in `connect`.
        check("rdma_accept", unsafe { rdma_accept(raw, &mut conn) })
    }

    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        let raw = match self.host() {
            Ok(raw) => raw,
            Err(id) => return id.reject(private_data),
        };
        let len = u8::try_from(private_data.len())
            .map_err(|_| Error::InvalidArgument("private data over 255 bytes".into()))?;
        let data = match private_data.is_empty() {
            true => std::ptr::null(),
            false => private_data.as_ptr().cast(),
        };
        // SAFETY: the id is alive; the data outlives the call, which copies it.
        check("rdma_reject", unsafe { rdma_reject(raw, data, len) })
    }

    pub fn disconnect(&self) -> Result<()> {
        let raw = match self.host() {
            Ok(raw) => raw,
            Err(id) => return id.disconnect(),
        };
        // SAFETY: the id is alive.
        check("rdma_disconnect", unsafe { rdma_disconnect(raw) })
    }

    pub fn establish(&self) -> Result<()> {
        let raw = match self.host() {
            Ok(raw) => raw,
            Err(id) => return id.establish(),
        };
        // SAFETY: the id is alive.
        check("rdma_establish", unsafe { rdma_establish(raw) })
    }

    /// The attributes (and their mask) that move a QP of this id to `state`, in the host's
    /// view.
    pub fn init_qp_attr(&self, state: u32) -> Result<(QpAttr, u32)> {
        let raw = match self.host() {
            Ok(raw) => raw,
            Err(id) => return id.init_qp_attr(state),
        };
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = state;
        let mut mask: c_int = 0;
        // SAFETY: the id is alive; both out-pointers are valid.
        check("rdma_init_qp_attr", unsafe {
            rdma_init_qp_attr(raw, &mut attr, &mut mask)
        })?;
        // The mask is a set of ibv_qp_attr_mask bits, in a C int.
        let mask = mask.cast_unsigned();
        let attr = QpAttr::from_ibv(&attr, mask).map_err(|state| Error::Verbs {
            call: "rdma_init_qp_attr",
            source: io::Error::other(format!("QP state {state} is not one of ibverbs'")),
        })?;
        Ok((attr, mask))
    }

    /// The id's addresses, route and device.
    pub fn info(&self) -> CmIdInfo {
        let raw = match self.host() {
            Ok(raw) => raw,
            Err(id) => return id.info(),
        };
        // SAFETY: the id is alive; librdmacm keeps its route and addresses in it, and the
        // sockaddr unions are read as the sockaddr_in their family says they are.
        unsafe {
            let id = &*raw;
            let addr = &id.route.addr;
            let ib = &addr.addr.ibaddr;
            let path = match (id.route.num_paths > 0, id.route.path_rec.is_null()) {
                (true, false) => Some(&*id.route.path_rec),
                _ => None,
            };
            let device = NonNull::new(id.verbs).map(|verbs| {
                CStr::from_ptr(ibv_get_device_name((*verbs.as_ptr()).device))
                    .to_string_lossy()
                    .into_owned()
            });
            CmIdInfo {
                src: from_sockaddr(&addr.src_addr_union.src_sin),
                dst: from_sockaddr(&addr.dst_addr_union.dst_sin),
                sgid: Gid(ib.sgid.raw),
                dgid: Gid(ib.dgid.raw),
                pkey: u16::from_be(ib.pkey),
                path_mtu: path.map_or(0, |p| p.mtu),
                num_paths: u8::try_from(id.route.num_paths).unwrap_or(0),
                device,
                port_num: id.port_num,
            }
        }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        let Raw::Verbs(raw) = &self.raw else {
            // The loopback's id destroys itself.
            return;
        };
        // SAFETY: the id is alive and destroyed once; every event of it that was taken was
        // acknowledged at once (`take_event`), so this does not wait on the event thread.
        let ret = unsafe { rdma_destroy_id(raw.as_ptr()) };
        if ret != 0 {
            log::warn!("rdma_destroy_id: {}", io::Error::last_os_error());
        }
    }
}
