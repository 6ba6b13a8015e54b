//! librdmacm's API on vrdma's connection management (SPEC.md §13), so unmodified rdma_cm
//! programs run on vrdma. The functions are this library's `vrdma_rdmacm_*`; `link.sh`
//! builds a `librdmacm.so.1` whose versioned `rdma_*` symbols jump to them, so the CM and the
//! verbs share one device connection and one set of objects, as librdmacm and libibverbs do
//! in a process.
//!
//! An id's events are taken from the device by the thread of the context (`events`), which
//! puts the id's handle on its channel; `rdma_get_cm_event` takes them from the device and
//! does what librdmacm does with them: for an id with a QP it moves the QP at CONNECT_RESPONSE
//! and establishes the connection, as librdmacm does for QPs made with `rdma_create_qp`.
//! Ids made without a channel are synchronous: each call waits for its own event.

mod cm_events;
mod connecting;
mod endpoints;

use cm_events::*;

use std::ffi::CStr;
use std::net::SocketAddrV4;
use std::os::fd::AsRawFd;
use std::os::raw::{c_char, c_int, c_void};
use std::ptr;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdma_sys::{
    ibv_comp_channel, ibv_context, ibv_cq, ibv_pd, ibv_qp_attr, ibv_qp_init_attr, ibv_qp_type,
    ibv_sa_path_rec, rdma_addrinfo, rdma_cm_event, rdma_cm_event_type as event_type, rdma_cm_id,
    rdma_conn_param, rdma_event_channel, rdma_port_space,
};
use vrdma_guest::cm::{event, port_space};
use vrdma_guest::{CmEvent, CmId, ConnParam, QpState};
use vrdma_spec::verbs::ibv::{from_sockaddr_in, sockaddr_in};

use crate::context::context_of;
use crate::errno::{raise_errno, report_once, set_errno};
use crate::events::{CmChannel, Lingering, ObjectKind};
use crate::objects;

/// `rdma_getaddrinfo` flags.
const RAI_PASSIVE: c_int = 1;
const RAI_NUMERICHOST: c_int = 2;
/// librdmacm's "as many as the device allows" for responder resources and initiator depth.
const RDMA_MAX_RESP_RES: u8 = 0xff;
/// Waits of synchronous ids, and the route timeout `rdma_create_ep` uses.
const EP_TIMEOUT_MS: c_int = 2000;
/// How long a destroyed listener still listens on the device for a bind in this process to
/// take it over (see `vrdma_rdmacm_rdma_destroy_id`).
const LISTEN_LINGER: Duration = Duration::from_secs(2);

#[repr(C)]
struct VrdmaEventChannel {
    channel: rdma_event_channel,
    queue: Arc<CmChannel>,
}

#[repr(C)]
struct VrdmaCmId {
    id: rdma_cm_id,
    inner: CmId,
    queue: Arc<CmChannel>,
    /// The channel the program did not give (a synchronous id's own).
    own_channel: Option<Box<VrdmaEventChannel>>,
    /// The PD `rdma_create_qp` allocated for want of one.
    own_pd: *mut ibv_pd,
    /// The CQs (and their channels) `rdma_create_qp` made for want of them, for
    /// `rdma_get_send_comp`/`rdma_get_recv_comp`.
    own_cqs: Vec<(*mut ibv_cq, *mut ibv_comp_channel)>,
    /// The route's one path, for `route.path_rec`.
    path: ibv_sa_path_rec,
    /// `rdma_create_ep` on a passive id: what `rdma_get_request` makes QPs of.
    request_qp: Option<(*mut ibv_pd, ibv_qp_init_attr)>,
    /// The address the id is bound to.
    bound: Option<SocketAddrV4>,
    /// The id listens.
    listening: bool,
    /// The device id is a destroyed listener this id took over at its bind: it listens on
    /// the device already.
    took_over: bool,
    /// The id's events the program has not acknowledged, and those being taken:
    /// `rdma_destroy_id` waits for them, as librdmacm's does, so no event outlives the id it
    /// names.
    unacked: Arc<Unacked>,
}

/// A count of an id's events not acknowledged (or being taken), and its waiters.
#[derive(Default)]
struct Unacked {
    count: Mutex<u32>,
    acked: Condvar,
}

impl Unacked {
    fn lock(&self) -> std::sync::MutexGuard<'_, u32> {
        self.count.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts one more event until the hold is dropped.
    fn hold(self: &Arc<Self>) -> Hold {
        *self.lock() += 1;
        Hold(Arc::clone(self))
    }

    fn wait_for_none(&self) {
        let mut count = self.lock();
        while *count > 0 {
            count = self.acked.wait(count).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// One event of an id counted: being taken, then until the program acknowledges it.
struct Hold(Arc<Unacked>);

impl Drop for Hold {
    fn drop(&mut self) {
        let mut count = self.0.lock();
        *count = count.saturating_sub(1);
        self.0.acked.notify_all();
    }
}

/// An event as programs see it, with the private data it points to.
#[repr(C)]
struct VrdmaCmEvent {
    event: rdma_cm_event,
    private_data: Vec<u8>,
    /// Counted on the id the event came to (a connection request's: the listener).
    _hold: Hold,
}

/// The environment variable that asks vrdma's librdmacm (as vrdma's libibverbs) to say why a
/// call failed: set to anything but empty or `0`.
const DEBUG_VARIABLE: &str = "VRDMA_DEBUG";

/// Says why a call failed, on standard error, once per process and kind, and only when
/// `VRDMA_DEBUG` asks: the system's librdmacm fails silently with an errno, and programs
/// that probe by trial (libfabric binds every address of the machine to find its RDMA
/// devices, and creates ids in port spaces to see which are served) expect no line for a
/// refused try.
fn explain(kind: &'static str, message: &str) {
    static ASKED: OnceLock<bool> = OnceLock::new();
    let asked = *ASKED.get_or_init(|| {
        std::env::var_os(DEBUG_VARIABLE).is_some_and(|value| !value.is_empty() && value != "0")
    });
    if asked {
        report_once(kind, message);
    }
}

fn fail<T>(errno: c_int, value: T) -> T {
    set_errno(errno);
    value
}

fn failed(errno: c_int) -> c_int {
    fail(errno, -1)
}

/// The errno the last failed call left.
fn last_errno() -> c_int {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn io_errno(error: &vrdma_guest::Error) -> c_int {
    raise_errno(error);
    -1
}

/// The context connection management uses: the program's own, if it opened one (a backend
/// serves a process one connection; librdmacm programs that open the device themselves, like
/// perftest, make their QPs on that context), else one opened here and kept for the process,
/// as librdmacm keeps one per device.
fn cm_context() -> Option<*mut ibv_context> {
    static CURRENT: std::sync::Mutex<Option<usize>> = std::sync::Mutex::new(None);
    let mut current = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
    let (still_open, oldest) = crate::context::open_context(current.map(|c| c as *mut ibv_context));
    if still_open {
        return current.map(|c| c as *mut ibv_context);
    }
    let context = oldest.or_else(|| {
        // SAFETY: this library's own device list and open; the list is freed at once and the
        // context kept for the life of the process.
        unsafe {
            let list = crate::abi::ibv_get_device_list(ptr::null_mut());
            let first = if list.is_null() {
                ptr::null_mut()
            } else {
                *list
            };
            let context = if first.is_null() {
                ptr::null_mut()
            } else {
                crate::abi::ibv_open_device(first)
            };
            crate::abi::ibv_free_device_list(list);
            (!context.is_null()).then_some(context)
        }
    })?;
    *current = Some(context as usize);
    Some(context)
}

/// # Safety
/// `id` must be an id this library made and not yet destroyed.
unsafe fn ours<'a>(id: *mut rdma_cm_id) -> &'a mut VrdmaCmId {
    // SAFETY: per the contract, `id` is the first field of a live VrdmaCmId.
    unsafe { &mut *id.cast::<VrdmaCmId>() }
}

/// The IPv4 address a program passed, if it is one.
///
/// # Safety
/// `addr` must be NULL or a valid sockaddr of its family's size.
unsafe fn ipv4_of(addr: *const libc::sockaddr) -> Option<SocketAddrV4> {
    if addr.is_null() {
        return None;
    }
    // SAFETY: per the contract; the family says it is a sockaddr_in.
    unsafe {
        if c_int::from((*addr).sa_family) != libc::AF_INET {
            return None;
        }
        from_sockaddr_in(&*addr.cast::<libc::sockaddr_in>())
    }
}

impl VrdmaCmId {
    /// Copies the device's view of the id's addresses and route into the C id.
    fn refresh_route(&mut self) {
        if let Ok(info) = self.inner.query() {
            self.take_route(&info);
        }
    }

    /// Copies `info`, the device's view of the id's addresses and route, into the C id.
    fn take_route(&mut self, info: &vrdma_spec::cm::CmIdInfo) {
        // Writes of the sockaddr_in members of the address unions, as librdmacm fills them.
        let addr = &mut self.id.route.addr;
        if let Some(src) = info.src.to_ipv4() {
            addr.src_addr_union.src_sin = sockaddr_in(src);
        }
        if let Some(dst) = info.dst.to_ipv4() {
            addr.dst_addr_union.dst_sin = sockaddr_in(dst);
        }
        addr.addr.ibaddr = rdma_sys::rdma_ib_addr {
            sgid: rdma_sys::ibv_gid { raw: info.sgid },
            dgid: rdma_sys::ibv_gid { raw: info.dgid },
            pkey: info.pkey.to_native().to_be(),
        };
        self.id.port_num = info.port_num;
        if info.num_paths > 0 {
            self.path.dgid.raw = info.dgid;
            self.path.sgid.raw = info.sgid;
            self.path.pkey = info.pkey.to_native().to_be();
            self.path.mtu = info.path_mtu;
            self.path.hop_limit = 1;
            self.id.route.path_rec = &mut self.path;
            self.id.route.num_paths = 1;
        }
    }

    /// Moves the id's QP to `state` with the connection manager's attributes. Before RTR
    /// the INIT attributes are applied again, as librdmacm does: once the connection's
    /// parameters are exchanged they grant the remote reads the responder resources allow.
    fn move_qp(&self, state: QpState) -> c_int {
        if self.id.qp.is_null() {
            return 0;
        }
        if state == QpState::Rtr && self.move_qp(QpState::Init) != 0 {
            return -1;
        }
        let (attr, mask) = match self.inner.init_qp_attr(state) {
            Ok(found) => found,
            Err(e) => return io_errno(&e),
        };
        let mut raw = ibv_qp_attr::from(&attr);
        // SAFETY: the id's QP, made by rdma_create_qp, and an attribute block of our own.
        let ret = unsafe { objects::ibv_modify_qp(self.id.qp, &mut raw, mask as c_int) };
        if ret != 0 {
            return failed(ret);
        }
        0
    }

    fn qp_to_error(&self) {
        if self.id.qp.is_null() {
            return;
        }
        // SAFETY: all-zero is a valid ibv_qp_attr; the QP is the id's.
        unsafe {
            let mut attr: ibv_qp_attr = std::mem::zeroed();
            attr.qp_state = rdma_sys::ibv_qp_state::IBV_QPS_ERR;
            objects::ibv_modify_qp(
                self.id.qp,
                &mut attr,
                rdma_sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int,
            );
        }
    }

    /// An id that took a lingering listener over at its bind but is used otherwise than to
    /// listen gets a device id of its own, bound to the same address (the listener goes, its
    /// requests refused).
    fn give_back_listener(&mut self) -> vrdma_guest::Result<()> {
        if !std::mem::take(&mut self.took_over) {
            return Ok(());
        }
        // SAFETY: the id's context is the CM context.
        let own = unsafe { context_of(self.id.verbs) }
            .device
            .create_cm_id(self.id.ps)?;
        self.replace_device_id(own);
        match self.bound {
            Some(addr) => self.inner.bind(addr).map(|info| self.take_route(&info)),
            None => Ok(()),
        }
    }

    /// Makes `device_id` this id's device id; the old one's events go nowhere, and it is
    /// destroyed.
    fn replace_device_id(&mut self, device_id: CmId) {
        let old = std::mem::replace(&mut self.inner, device_id);
        // SAFETY: the id's context is the CM context.
        unsafe { context_of(self.id.verbs) }.with_dispatcher(|d| d.forget_cm(old.handle()));
        drop(old);
        // SAFETY: a live id of this library's, with its new device id.
        unsafe { watch(self) };
    }

    fn is_sync(&self) -> bool {
        self.own_channel.is_some()
    }
}

/// A new C id around `inner` on `queue` (and `channel`, the program's, or NULL).
fn new_id(
    inner: CmId,
    context: *mut ibv_context,
    channel: *mut rdma_event_channel,
    queue: Arc<CmChannel>,
    user_context: *mut c_void,
    space: u32,
) -> *mut VrdmaCmId {
    // SAFETY: rdma_cm_id is C data (pointers, integers, sockaddr unions) valid as zero.
    let mut id: rdma_cm_id = unsafe { std::mem::zeroed() };
    id.verbs = context;
    id.channel = channel;
    id.context = user_context;
    id.ps = space;
    id.qp_type = if space == port_space::UDP {
        ibv_qp_type::IBV_QPT_UD
    } else {
        ibv_qp_type::IBV_QPT_RC
    };
    let made = Box::into_raw(Box::new(VrdmaCmId {
        id,
        inner,
        queue,
        own_channel: None,
        own_pd: ptr::null_mut(),
        own_cqs: Vec::new(),
        // SAFETY: ibv_sa_path_rec is C data valid as zero.
        path: unsafe { std::mem::zeroed() },
        request_qp: None,
        bound: None,
        listening: false,
        took_over: false,
        unacked: Arc::default(),
    }));
    // SAFETY: just made; the CM context is this library's.
    unsafe { watch(made) };
    made
}

/// Routes the events of `id` to its channel's queue.
///
/// # Safety
/// `id` must be a live id of this library's.
unsafe fn watch(id: *mut VrdmaCmId) {
    // SAFETY: per the contract; its context is the CM context.
    let id = unsafe { &*id };
    let queue = Arc::clone(&id.queue);
    // SAFETY: the id's context is the CM context, open for the life of the process.
    unsafe { context_of(id.id.verbs) }
        .with_dispatcher(|d| d.watch_cm(id.inner.handle(), ptr::from_ref(id) as usize, queue));
}

// ---- channels ----------------------------------------------------------------------------

fn new_channel() -> Option<Box<VrdmaEventChannel>> {
    let queue = CmChannel::new().ok()?;
    Some(Box::new(VrdmaEventChannel {
        channel: rdma_event_channel {
            fd: queue.as_raw_fd(),
        },
        queue,
    }))
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_create_event_channel() -> *mut rdma_event_channel {
    match new_channel() {
        Some(channel) => Box::into_raw(channel).cast(),
        None => fail(libc::ENOMEM, ptr::null_mut()),
    }
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_destroy_event_channel(channel: *mut rdma_event_channel) {
    if !channel.is_null() {
        // SAFETY: a channel rdma_create_event_channel made, destroyed once.
        drop(unsafe { Box::from_raw(channel.cast::<VrdmaEventChannel>()) });
    }
}

// ---- ids ---------------------------------------------------------------------------------

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_create_id(
    channel: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut c_void,
    space: rdma_port_space::Type,
) -> c_int {
    if id.is_null() || !matches!(space, port_space::TCP | port_space::UDP) {
        explain(
            "cm_ps",
            "rdma_create_id: only RDMA_PS_TCP and RDMA_PS_UDP are served",
        );
        return failed(libc::EINVAL);
    }
    let Some(verbs) = cm_context() else {
        return failed(libc::ENODEV);
    };
    // SAFETY: the CM context is this library's.
    let device = &unsafe { context_of(verbs) }.device;
    let inner = match device.create_cm_id(space) {
        Ok(inner) => inner,
        Err(e) => {
            explain("cm_create", &format!("rdma_create_id failed: {e} (connection management needs a device with an address of its own: the backend's --guest-ip)"));
            return io_errno(&e);
        }
    };
    let (queue, own) = if channel.is_null() {
        let Some(own) = new_channel() else {
            return failed(libc::ENOMEM);
        };
        (Arc::clone(&own.queue), Some(own))
    } else {
        // SAFETY: a channel of this library's, per the API contract.
        (
            Arc::clone(&unsafe { &*channel.cast::<VrdmaEventChannel>() }.queue),
            None,
        )
    };
    let made = new_id(inner, verbs, channel, queue, context, space);
    // SAFETY: just made.
    unsafe {
        if let Some(own) = own {
            (*made).id.channel = ptr::from_ref(&own.channel).cast_mut();
            (*made).own_channel = Some(own);
        }
        *id = made.cast();
    }
    0
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_destroy_id(id: *mut rdma_cm_id) -> c_int {
    if id.is_null() {
        return failed(libc::EINVAL);
    }
    // SAFETY: an id of this library's, destroyed once, per the API contract.
    let mut owned = unsafe { Box::from_raw(id.cast::<VrdmaCmId>()) };
    // A synchronous id's last event is the library's to acknowledge.
    free_event(std::mem::replace(&mut owned.id.event, ptr::null_mut()));
    // No event finds the id from now on; those found before are acknowledged first.
    // SAFETY: the id's context is the CM context.
    unsafe { context_of(owned.id.verbs) }.with_dispatcher(|d| d.forget_cm(owned.inner.handle()));
    owned.unacked.wait_for_none();
    if !owned.own_pd.is_null() {
        // SAFETY: the PD rdma_create_qp allocated; its QP is gone (rdma_destroy_qp first).
        unsafe { objects::ibv_dealloc_pd(owned.own_pd) };
    }
    let owned = *owned;
    match (owned.listening, owned.bound) {
        // A listener keeps listening on the device for a moment. Programs such as perftest
        // destroy a listener and listen again on the same port, and their peer connects the
        // moment it may: with a kernel between program and device the second listen is
        // there in time, but each of vrdma's CM calls is a round trip to the device (under
        // emulation, the three of create, bind and listen took longer than a native peer
        // took to connect). A bind here to the same address takes the listener over with the
        // requests that came meanwhile; else the device destroys it LISTEN_LINGER later,
        // refusing them.
        (true, Some(addr)) => {
            let listener = Lingering {
                id: owned.inner,
                space: owned.id.ps,
                addr,
                until: Instant::now() + LISTEN_LINGER,
            };
            // SAFETY: the id's context is the CM context.
            unsafe { context_of(owned.id.verbs) }.with_dispatcher(|d| d.linger(listener));
        }
        _ => drop(owned), // the device's id goes with its CmId
    }
    0
}

/// Frees an event of a synchronous id that the next call replaces.
fn free_event(event: *mut rdma_cm_event) {
    if !event.is_null() {
        // SAFETY: an event this library made, freed once.
        drop(unsafe { Box::from_raw(event.cast::<VrdmaCmEvent>()) });
    }
}

/// For a synchronous id: waits for its next event and keeps it in `id->event`; 0 when it is
/// `wanted`, else -1 with the event's errno.
fn complete(id: &mut VrdmaCmId, wanted: u32) -> c_int {
    if !id.is_sync() {
        return 0;
    }
    free_event(id.id.event);
    id.id.event = ptr::null_mut();
    let mut event: *mut rdma_cm_event = ptr::null_mut();
    let channel = ptr::from_ref(&id.own_channel.as_ref().expect("sync").channel).cast_mut();
    // SAFETY: the id's own channel; `event` a valid out-pointer.
    if unsafe { vrdma_rdmacm_rdma_get_cm_event(channel, &mut event) } != 0 {
        return -1;
    }
    id.id.event = event;
    // SAFETY: just taken.
    let (kind, status) = unsafe { ((*event).event, (*event).status) };
    if kind == wanted {
        return 0;
    }
    let errno = match (kind, status) {
        (_, s) if s < 0 => -s,
        (event_type::RDMA_CM_EVENT_REJECTED, _) => libc::ECONNREFUSED,
        (event_type::RDMA_CM_EVENT_UNREACHABLE, _) => libc::ENETUNREACH,
        _ => libc::EINVAL,
    };
    failed(errno)
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_bind_addr(
    id: *mut rdma_cm_id,
    addr: *mut libc::sockaddr,
) -> c_int {
    // SAFETY: per the API contract.
    let (id, addr) = unsafe { (ours(id), ipv4_of(addr)) };
    let Some(addr) = addr else {
        explain(
            "cm_af",
            "vrdma's connection management serves IPv4 addresses only",
        );
        return failed(libc::EAFNOSUPPORT);
    };
    // SAFETY: the id's context is the CM context.
    let lingering =
        unsafe { context_of(id.id.verbs) }.with_dispatcher(|d| d.take_lingering(id.id.ps, addr));
    let bound = match lingering {
        Some(listener) => {
            id.replace_device_id(listener);
            id.took_over = true;
            id.inner.query()
        }
        None => id.inner.bind(addr),
    };
    match bound {
        Ok(info) => {
            id.bound = info.src.to_ipv4();
            id.take_route(&info);
            0
        }
        Err(e) => io_errno(&e),
    }
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_resolve_addr(
    id: *mut rdma_cm_id,
    src: *mut libc::sockaddr,
    dst: *mut libc::sockaddr,
    timeout_ms: c_int,
) -> c_int {
    // SAFETY: per the API contract.
    let (id, src, dst) = unsafe { (ours(id), ipv4_of(src), ipv4_of(dst)) };
    let Some(dst) = dst else {
        return failed(libc::EAFNOSUPPORT);
    };
    let timeout = Duration::from_millis(timeout_ms.clamp(1, 60_000) as u64);
    if let Err(e) = id.give_back_listener() {
        return io_errno(&e);
    }
    if let Err(e) = id.inner.resolve_addr(src, dst, timeout) {
        return io_errno(&e);
    }
    complete(id, event_type::RDMA_CM_EVENT_ADDR_RESOLVED)
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_resolve_route(
    id: *mut rdma_cm_id,
    timeout_ms: c_int,
) -> c_int {
    // SAFETY: per the API contract.
    let id = unsafe { ours(id) };
    let timeout = Duration::from_millis(timeout_ms.clamp(1, 60_000) as u64);
    if let Err(e) = id.inner.resolve_route(timeout) {
        return io_errno(&e);
    }
    complete(id, event_type::RDMA_CM_EVENT_ROUTE_RESOLVED)
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int {
    // SAFETY: per the API contract.
    let id = unsafe { ours(id) };
    // The addresses are the ones the bind gave (the driver's own, §13): nothing to query.
    if let Err(e) = id.inner.listen(u32::try_from(backlog).unwrap_or(0)) {
        return io_errno(&e);
    }
    id.listening = true;
    if std::mem::take(&mut id.took_over) {
        // Requests the listener took while it lingered: the device announced them to no one.
        id.queue.push(id.inner.handle());
    }
    0
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_migrate_id(
    id: *mut rdma_cm_id,
    channel: *mut rdma_event_channel,
) -> c_int {
    if channel.is_null() {
        return failed(libc::EINVAL);
    }
    // SAFETY: per the API contract.
    let (id, channel) = unsafe { (ours(id), &*channel.cast::<VrdmaEventChannel>()) };
    id.queue = Arc::clone(&channel.queue);
    id.own_channel = None;
    id.id.channel = ptr::from_ref(&channel.channel).cast_mut();
    // SAFETY: a live id of this library's.
    unsafe { watch(id) };
    0
}

// ---- QPs ---------------------------------------------------------------------------------

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_create_qp(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> c_int {
    if attr.is_null() {
        return failed(libc::EINVAL);
    }
    // SAFETY: per the API contract.
    let id = unsafe { ours(id) };
    let pd = if pd.is_null() {
        if id.own_pd.is_null() {
            // SAFETY: the id's context is the CM context.
            id.own_pd = unsafe { objects::ibv_alloc_pd(id.id.verbs) };
        }
        id.own_pd
    } else {
        pd
    };
    // SAFETY: a PD of this library's.
    if pd.is_null() || unsafe { (*pd).context } != id.id.verbs {
        return failed(libc::EINVAL);
    }
    // SAFETY: the caller's attributes; the QP type is the id's.
    let attr = unsafe { &mut *attr };
    attr.qp_type = id.id.qp_type;
    // Like librdmacm, CQs with completion channels for a QP given none.
    for (cq, depth) in [
        (&mut attr.send_cq, attr.cap.max_send_wr),
        (&mut attr.recv_cq, attr.cap.max_recv_wr),
    ] {
        if cq.is_null() {
            // SAFETY: the id's context; the channel and CQ are kept until rdma_destroy_qp.
            let made = unsafe { own_cq(id.id.verbs, depth.max(1)) };
            let Some((made_cq, channel)) = made else {
                return -1;
            };
            id.own_cqs.push((made_cq, channel));
            *cq = made_cq;
        }
    }
    // SAFETY: a PD of the id's context and the caller's attributes.
    let qp = unsafe { objects::ibv_create_qp(pd, attr) };
    if qp.is_null() {
        return -1;
    }
    id.id.qp = qp;
    id.id.pd = pd;
    id.id.send_cq = attr.send_cq;
    id.id.recv_cq = attr.recv_cq;
    // SAFETY: the CQs the QP was just made with, the program's or our own.
    unsafe {
        id.id.send_cq_channel = (*attr.send_cq).channel;
        id.id.recv_cq_channel = (*attr.recv_cq).channel;
    }
    id.id.srq = attr.srq;
    let ready = id.move_qp(QpState::Init) == 0
        && (id.id.qp_type != ibv_qp_type::IBV_QPT_UD || ud_ready(qp) == 0);
    if !ready {
        let errno = last_errno();
        // SAFETY: the QP just made.
        unsafe { objects::ibv_destroy_qp(qp) };
        id.id.qp = ptr::null_mut();
        return failed(errno);
    }
    0
}

/// Moves a UD QP from INIT to RTS, as librdmacm does (RTR and RTS take only the state and
/// a send PSN of 0).
fn ud_ready(qp: *mut rdma_sys::ibv_qp) -> c_int {
    use rdma_sys::ibv_qp_attr_mask as m;
    for (state, mask) in [
        (rdma_sys::ibv_qp_state::IBV_QPS_RTR, m::IBV_QP_STATE.0),
        (
            rdma_sys::ibv_qp_state::IBV_QPS_RTS,
            m::IBV_QP_STATE.0 | m::IBV_QP_SQ_PSN.0,
        ),
    ] {
        // SAFETY: all-zero is a valid ibv_qp_attr; the QP is the caller's, just made.
        let ret = unsafe {
            let mut attr: ibv_qp_attr = std::mem::zeroed();
            attr.qp_state = state;
            objects::ibv_modify_qp(qp, &mut attr, mask as c_int)
        };
        if ret != 0 {
            return failed(ret);
        }
    }
    0
}

/// A CQ of `depth` with a completion channel of its own.
///
/// # Safety
/// `context` must be the CM context.
unsafe fn own_cq(
    context: *mut ibv_context,
    depth: u32,
) -> Option<(*mut ibv_cq, *mut ibv_comp_channel)> {
    // SAFETY: per the contract; each object is checked before use.
    unsafe {
        let channel = objects::ibv_create_comp_channel(context);
        if channel.is_null() {
            return None;
        }
        let depth = c_int::try_from(depth).unwrap_or(c_int::MAX);
        let cq = objects::ibv_create_cq(context, depth, ptr::null_mut(), channel, 0);
        if cq.is_null() {
            objects::ibv_destroy_comp_channel(channel);
            return None;
        }
        Some((cq, channel))
    }
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_destroy_qp(id: *mut rdma_cm_id) {
    // SAFETY: per the API contract.
    let id = unsafe { ours(id) };
    if !id.id.qp.is_null() {
        // SAFETY: the QP rdma_create_qp made, destroyed once, then the CQs it made for it.
        unsafe {
            objects::ibv_destroy_qp(id.id.qp);
            for (cq, channel) in id.own_cqs.drain(..) {
                objects::ibv_destroy_cq(cq);
                objects::ibv_destroy_comp_channel(channel);
            }
        }
        id.id.qp = ptr::null_mut();
    }
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_init_qp_attr(
    id: *mut rdma_cm_id,
    attr: *mut ibv_qp_attr,
    mask: *mut c_int,
) -> c_int {
    if attr.is_null() || mask.is_null() {
        return failed(libc::EINVAL);
    }
    // SAFETY: per the API contract.
    let (id, attr, mask) = unsafe { (ours(id), &mut *attr, &mut *mask) };
    let state = match attr.qp_state {
        rdma_sys::ibv_qp_state::IBV_QPS_INIT => QpState::Init,
        rdma_sys::ibv_qp_state::IBV_QPS_RTR => QpState::Rtr,
        rdma_sys::ibv_qp_state::IBV_QPS_RTS => QpState::Rts,
        _ => return failed(libc::EINVAL),
    };
    match id.inner.init_qp_attr(state) {
        Ok((found, found_mask)) => {
            *attr = ibv_qp_attr::from(&found);
            *mask = found_mask as c_int;
            0
        }
        Err(e) => io_errno(&e),
    }
}
