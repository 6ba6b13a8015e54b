//! librdmacm: the connection manager's event channel and ids over `/dev/infiniband/rdma_cm`.

use std::ffi::CStr;
use std::io;
use std::net::SocketAddrV4;
use std::os::fd::RawFd;
use std::os::raw::{c_int, c_void};
use std::ptr::NonNull;

use rdma_sys::*;

use vrdma_spec::verbs::ibv::{from_sockaddr_in, sockaddr_in};

use super::{check, last_error, set_nonblocking};
use crate::hostverbs::seam::{CmIdInfo, PortSpace};
use crate::hostverbs::seam::{HostCmChannel, HostCmEvent, HostCmId};
use crate::hostverbs::{AhAttr, Error, Gid, QpAttr, Result};
use vrdma_spec::cm::ConnParam;

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

/// A librdmacm event channel.
pub struct Channel {
    raw: NonNull<rdma_event_channel>,
}

// SAFETY: librdmacm's calls on a channel are thread safe (it locks per id and per channel);
// the value owns the pointer and frees it only in Drop, after every id (see the seam).
unsafe impl Send for Channel {}
// SAFETY: as above: shared references only make librdmacm calls.
unsafe impl Sync for Channel {}

impl Channel {
    /// A new channel, non-blocking.
    pub fn open() -> Result<Channel> {
        // SAFETY: no arguments; the result is checked for NULL.
        let raw = NonNull::new(unsafe { rdma_create_event_channel() })
            .ok_or_else(|| last_error("rdma_create_event_channel"))?;
        let channel = Channel { raw };
        set_nonblocking(channel.fd(), "fcntl(O_NONBLOCK) on the CM event channel")?;
        Ok(channel)
    }

    /// # Safety
    /// `raw` is an unacknowledged event of this channel.
    unsafe fn copy_event(&self, raw: &rdma_cm_event) -> HostCmEvent {
        // SAFETY: the ids of an unacknowledged event are alive (the function's contract).
        let key_of = |id: *mut rdma_cm_id| unsafe { (*id).context } as u64;
        let is_request = raw.event == rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST;
        let (key, new_id) = match NonNull::new(raw.listen_id) {
            Some(listen_id) if is_request => {
                let new_id = NonNull::new(raw.id).map(|id| {
                    // Until the device keys it, none of its events can be routed.
                    // SAFETY: the request's new id is alive and not yet known to anyone else.
                    unsafe { (*id.as_ptr()).context = std::ptr::null_mut() };
                    Box::new(Id { raw: id }) as Box<dyn HostCmId>
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
        HostCmEvent {
            event: raw.event,
            status: raw.status,
            key,
            new_id,
            param,
            ud_ah,
        }
    }
}

impl HostCmChannel for Channel {
    fn fd(&self) -> RawFd {
        // SAFETY: the channel is alive; its fd is set at creation.
        unsafe { (*self.raw.as_ptr()).fd }
    }

    fn create_id(&self, space: PortSpace, key: u64) -> Result<Box<dyn HostCmId>> {
        let space = match space {
            PortSpace::Tcp => rdma_port_space::RDMA_PS_TCP,
            PortSpace::Udp => rdma_port_space::RDMA_PS_UDP,
        };
        let mut id: *mut rdma_cm_id = std::ptr::null_mut();
        // SAFETY: the channel is alive; `id` is a valid out-pointer; the context is an
        // integer key, never dereferenced.
        check("rdma_create_id", unsafe {
            rdma_create_id(self.raw.as_ptr(), &mut id, key as *mut c_void, space)
        })?;
        let raw = NonNull::new(id).ok_or_else(|| last_error("rdma_create_id"))?;
        Ok(Box::new(Id { raw }))
    }

    fn take_event(&self) -> Option<HostCmEvent> {
        let mut raw: *mut rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the channel is alive and non-blocking; `raw` is a valid out-pointer.
        if unsafe { rdma_get_cm_event(self.raw.as_ptr(), &mut raw) } != 0 || raw.is_null() {
            return None;
        }
        // SAFETY: `raw` is the event just returned, valid until acknowledged below; its ids
        // are alive at least as long.
        let event = unsafe { self.copy_event(&*raw) };
        // SAFETY: acknowledged once, after its last use.
        unsafe { rdma_ack_cm_event(raw) };
        Some(event)
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: every id of the channel was dropped before it (see the seam); freed once.
        unsafe { rdma_destroy_event_channel(self.raw.as_ptr()) };
    }
}

/// A librdmacm id.
struct Id {
    raw: NonNull<rdma_cm_id>,
}

// SAFETY: librdmacm locks per id; the value owns the pointer and frees it only in Drop.
unsafe impl Send for Id {}
// SAFETY: shared references only make librdmacm calls, thread safe on one id.
unsafe impl Sync for Id {}

/// The IPv4 address in `storage`, if it holds one with a non-zero address or port.
fn from_sockaddr(storage: &libc::sockaddr_in) -> Option<SocketAddrV4> {
    from_sockaddr_in(storage).filter(|a| !a.ip().is_unspecified() || a.port() != 0)
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

impl HostCmId for Id {
    fn set_key(&self, key: u64) {
        // SAFETY: the id is alive; librdmacm only hands the context back in events, which
        // the one event thread reads after this call for ids it keyed itself.
        unsafe { (*self.raw.as_ptr()).context = key as *mut c_void };
    }

    fn bind(&self, address: SocketAddrV4) -> Result<()> {
        let mut sin = sockaddr_in(address);
        // SAFETY: the id is alive; `sin` is a valid sockaddr_in, copied by the call.
        check("rdma_bind_addr", unsafe {
            rdma_bind_addr(
                self.raw.as_ptr(),
                (&mut sin as *mut libc::sockaddr_in).cast(),
            )
        })
    }

    fn resolve_addr(&self, src: SocketAddrV4, dst: SocketAddrV4, timeout_ms: u32) -> Result<()> {
        let (mut src, mut dst) = (sockaddr_in(src), sockaddr_in(dst));
        let timeout = c_int::try_from(timeout_ms).unwrap_or(c_int::MAX);
        // SAFETY: the id is alive; both sockaddrs are valid and copied by the call.
        check("rdma_resolve_addr", unsafe {
            rdma_resolve_addr(
                self.raw.as_ptr(),
                (&mut src as *mut libc::sockaddr_in).cast(),
                (&mut dst as *mut libc::sockaddr_in).cast(),
                timeout,
            )
        })
    }

    fn resolve_route(&self, timeout_ms: u32) -> Result<()> {
        let timeout = c_int::try_from(timeout_ms).unwrap_or(c_int::MAX);
        // SAFETY: the id is alive.
        check("rdma_resolve_route", unsafe {
            rdma_resolve_route(self.raw.as_ptr(), timeout)
        })
    }

    fn listen(&self, backlog: u32) -> Result<()> {
        let backlog = c_int::try_from(backlog).unwrap_or(c_int::MAX);
        // SAFETY: the id is alive.
        check("rdma_listen", unsafe {
            rdma_listen(self.raw.as_ptr(), backlog)
        })
    }

    fn connect(&self, param: &ConnParam, qp_num: u32) -> Result<()> {
        let mut conn = raw_param(param, qp_num)?;
        // SAFETY: the id is alive; `conn` and the private data it points to outlive the call,
        // which copies them.
        check("rdma_connect", unsafe {
            rdma_connect(self.raw.as_ptr(), &mut conn)
        })
    }

    fn accept(&self, param: &ConnParam, qp_num: u32) -> Result<()> {
        let mut conn = raw_param(param, qp_num)?;
        // SAFETY: as in `connect`.
        check("rdma_accept", unsafe {
            rdma_accept(self.raw.as_ptr(), &mut conn)
        })
    }

    fn reject(&self, private_data: &[u8]) -> Result<()> {
        let len = u8::try_from(private_data.len())
            .map_err(|_| Error::InvalidArgument("private data over 255 bytes".into()))?;
        let data = match private_data.is_empty() {
            true => std::ptr::null(),
            false => private_data.as_ptr().cast(),
        };
        // SAFETY: the id is alive; the data outlives the call, which copies it.
        check("rdma_reject", unsafe {
            rdma_reject(self.raw.as_ptr(), data, len)
        })
    }

    fn disconnect(&self) -> Result<()> {
        // SAFETY: the id is alive.
        check("rdma_disconnect", unsafe {
            rdma_disconnect(self.raw.as_ptr())
        })
    }

    fn establish(&self) -> Result<()> {
        // SAFETY: the id is alive.
        check("rdma_establish", unsafe {
            rdma_establish(self.raw.as_ptr())
        })
    }

    fn init_qp_attr(&self, state: u32) -> Result<(QpAttr, u32)> {
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = state;
        let mut mask: c_int = 0;
        // SAFETY: the id is alive; both out-pointers are valid.
        check("rdma_init_qp_attr", unsafe {
            rdma_init_qp_attr(self.raw.as_ptr(), &mut attr, &mut mask)
        })?;
        // The mask is a set of ibv_qp_attr_mask bits, in a C int.
        let mask = mask.cast_unsigned();
        let attr = QpAttr::from_ibv(&attr, mask).map_err(|state| Error::Verbs {
            call: "rdma_init_qp_attr",
            source: io::Error::other(format!("QP state {state} is not one of ibverbs'")),
        })?;
        Ok((attr, mask))
    }

    fn info(&self) -> CmIdInfo {
        // SAFETY: the id is alive; librdmacm keeps its route and addresses in it, and the
        // sockaddr unions are read as the sockaddr_in their family says they are.
        unsafe {
            let id = &*self.raw.as_ptr();
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

impl Drop for Id {
    fn drop(&mut self) {
        // SAFETY: the id is alive and destroyed once; every event of it that was taken was
        // acknowledged at once (`take_event`), so this does not wait on the event thread.
        let ret = unsafe { rdma_destroy_id(self.raw.as_ptr()) };
        if ret != 0 {
            log::warn!("rdma_destroy_id: {}", io::Error::last_os_error());
        }
    }
}
