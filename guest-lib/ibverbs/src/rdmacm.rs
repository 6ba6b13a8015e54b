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

use crate::abi::{context_of, raise_errno, report_once, set_errno};
use crate::events::{EventQueue, Lingering, ObjectKind};
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

/// A channel: the ids with events waiting, by handle.
pub(crate) type CmChannel = EventQueue<u32>;

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
    let (still_open, oldest) = crate::abi::open_context(current.map(|c| c as *mut ibv_context));
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

// ---- connecting --------------------------------------------------------------------------

/// The parameters a program gave, or librdmacm's defaults; 0xff asks for the device's most.
///
/// # Safety
/// `param` must be NULL or valid, its private data `private_data_len` bytes.
unsafe fn conn_param(id: &VrdmaCmId, param: *const rdma_conn_param) -> Result<ConnParam, c_int> {
    // SAFETY: the CM context is this library's.
    let config = unsafe { context_of(id.id.verbs) }.device.config();
    let (max_resp, max_init) = (
        config.max_qp_rd_atom.to_native().min(255) as u8,
        config.max_qp_init_rd_atom.to_native().min(255) as u8,
    );
    let pick = |asked: u8, max: u8| match asked {
        RDMA_MAX_RESP_RES => Ok(max),
        n if n <= max => Ok(n),
        _ => Err(libc::EINVAL),
    };
    if param.is_null() {
        return Ok(ConnParam {
            responder_resources: max_resp,
            initiator_depth: max_init,
            retry_count: 7,
            rnr_retry_count: 7,
            ..ConnParam::default()
        });
    }
    // SAFETY: per the contract.
    let p = unsafe { &*param };
    let private_data = if p.private_data.is_null() || p.private_data_len == 0 {
        Vec::new()
    } else {
        // SAFETY: per the contract.
        unsafe {
            std::slice::from_raw_parts(p.private_data.cast::<u8>(), p.private_data_len.into())
        }
        .to_vec()
    };
    Ok(ConnParam {
        responder_resources: pick(p.responder_resources, max_resp)?,
        initiator_depth: pick(p.initiator_depth, max_init)?,
        flow_control: p.flow_control,
        retry_count: p.retry_count.min(7),
        rnr_retry_count: p.rnr_retry_count.min(7),
        srq: p.srq != 0 || !id.id.srq.is_null(),
        qp_num: 0,
        qkey: 0,
        private_data,
    })
}

/// The QP a connection is made on, as guest-lib knows it: the id's, from `rdma_create_qp`, or
/// else the program's own QP numbered `param->qp_num` (a program that moves its QP itself).
///
/// # Safety
/// `param` must be NULL or valid.
unsafe fn qp_of(
    id: &VrdmaCmId,
    param: *const rdma_conn_param,
) -> Result<&vrdma_guest::QueuePair, c_int> {
    let qp = if id.id.qp.is_null() {
        // SAFETY: per the contract.
        let qp_num = unsafe { param.as_ref() }.map_or(0, |p| p.qp_num);
        // SAFETY: the id's context is the CM context; the dispatcher holds the addresses of
        // the context's live QPs, read while none can be destroyed.
        let found = unsafe { context_of(id.id.verbs) }.with_dispatcher(|d| {
            d.find(ObjectKind::Qp, |address| {
                // SAFETY: a live QP of the context (see above).
                unsafe { (*(address as *const rdma_sys::ibv_qp)).qp_num == qp_num }
            })
        });
        let Some(address) = found.filter(|_| qp_num != 0) else {
            explain(
                "cm_qp",
                "rdma_connect/rdma_accept: the id has no QP from rdma_create_qp, and conn_param's qp_num names no QP of the program's",
            );
            return Err(libc::EINVAL);
        };
        address as *mut rdma_sys::ibv_qp
    } else {
        id.id.qp
    };
    // SAFETY: a QP of this library's, the id's or the program's, live.
    Ok(unsafe { objects::qp_of(qp) })
}

/// Sends the connection parameters the program gave (or librdmacm's defaults) with the
/// connection's QP by `send` (CM_CONNECT or CM_ACCEPT); the errno when it cannot.
///
/// # Safety
/// As [`conn_param`].
unsafe fn send_conn_param(
    id: &VrdmaCmId,
    param: *const rdma_conn_param,
    send: fn(&CmId, &vrdma_guest::QueuePair, &ConnParam) -> vrdma_guest::Result<()>,
) -> Result<(), c_int> {
    // SAFETY: per the contract.
    let (wire, qp) = unsafe { (conn_param(id, param)?, qp_of(id, param)?) };
    send(&id.inner, qp, &wire).map_err(|e| raise_errno(&e))
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_connect(
    id: *mut rdma_cm_id,
    param: *mut rdma_conn_param,
) -> c_int {
    // SAFETY: per the API contract.
    let id = unsafe { ours(id) };
    // SAFETY: per the API contract.
    if let Err(errno) = unsafe { send_conn_param(id, param, CmId::connect) } {
        return failed(errno);
    }
    complete(id, event_type::RDMA_CM_EVENT_ESTABLISHED)
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_accept(
    id: *mut rdma_cm_id,
    param: *mut rdma_conn_param,
) -> c_int {
    // SAFETY: per the API contract.
    let id = unsafe { ours(id) };
    if id.id.qp_type != ibv_qp_type::IBV_QPT_UD
        && (id.move_qp(QpState::Rtr) != 0 || id.move_qp(QpState::Rts) != 0)
    {
        return -1;
    }
    // SAFETY: per the API contract.
    if let Err(errno) = unsafe { send_conn_param(id, param, CmId::accept) } {
        return failed(errno);
    }
    if id.id.qp_type == ibv_qp_type::IBV_QPT_UD {
        return 0;
    }
    complete(id, event_type::RDMA_CM_EVENT_ESTABLISHED)
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_reject(
    id: *mut rdma_cm_id,
    private_data: *const c_void,
    len: u8,
) -> c_int {
    // SAFETY: per the API contract.
    let id = unsafe { ours(id) };
    let data = if private_data.is_null() {
        &[][..]
    } else {
        // SAFETY: per the API contract, `len` bytes.
        unsafe { std::slice::from_raw_parts(private_data.cast::<u8>(), len.into()) }
    };
    match id.inner.reject(data) {
        Ok(()) => 0,
        Err(e) => io_errno(&e),
    }
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_disconnect(id: *mut rdma_cm_id) -> c_int {
    // SAFETY: per the API contract.
    let id = unsafe { ours(id) };
    id.qp_to_error();
    match id.inner.disconnect() {
        Ok(()) => 0,
        Err(e) => io_errno(&e),
    }
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_establish(id: *mut rdma_cm_id) -> c_int {
    // SAFETY: per the API contract.
    let id = unsafe { ours(id) };
    match id.inner.establish() {
        Ok(()) => 0,
        Err(e) => io_errno(&e),
    }
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_notify(_id: *mut rdma_cm_id, _event: c_int) -> c_int {
    // The device hears of the first receive itself (an RTU is sent by CM_ESTABLISH).
    0
}

// ---- events ------------------------------------------------------------------------------

/// What librdmacm does with an event before the program sees it; the event the program
/// sees.
fn process(id: &mut VrdmaCmId, mut taken: CmEvent) -> (u32, i32, CmEvent) {
    let mut kind = taken.event;
    let mut status = taken.status;
    match kind {
        event::ADDR_RESOLVED | event::ROUTE_RESOLVED => id.refresh_route(),
        event::CONNECT_RESPONSE if !id.id.qp.is_null() => {
            let step = if id.move_qp(QpState::Rtr) != 0 {
                Err(("moving its QP to RTR", last_errno()))
            } else if id.move_qp(QpState::Rts) != 0 {
                Err(("moving its QP to RTS", last_errno()))
            } else {
                id.inner
                    .establish()
                    .map_err(|e| ("establishing it", raise_errno(&e)))
            };
            match step {
                Ok(()) => kind = event::ESTABLISHED,
                Err((what, errno)) => {
                    explain(
                        "cm_connect_response",
                        &format!(
                            "a connection's response was refused: {what} failed: {}",
                            std::io::Error::from_raw_os_error(errno)
                        ),
                    );
                    let _ = id.inner.reject(&[]);
                    kind = event::CONNECT_ERROR;
                    status = -errno;
                }
            }
        }
        // As librdmacm: a rejected connection's QP fails; a disconnected one's was failed by
        // whoever disconnected (rdma_disconnect).
        event::REJECTED => id.qp_to_error(),
        _ => {}
    }
    taken.event = kind;
    (kind, status, taken)
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_get_cm_event(
    channel: *mut rdma_event_channel,
    out: *mut *mut rdma_cm_event,
) -> c_int {
    if channel.is_null() || out.is_null() {
        return failed(libc::EINVAL);
    }
    // SAFETY: a channel of this library's, per the API contract.
    let channel = unsafe { &*channel.cast::<VrdmaEventChannel>() };
    loop {
        let handle = match channel.queue.take() {
            Ok(handle) => handle,
            Err(errno) => return failed(errno),
        };
        let Some((id, hold)) = lookup(handle) else {
            continue;
        };
        // SAFETY: a live id of this library's: ids are forgotten before they are freed, and
        // not freed while held.
        let id = unsafe { ours(id) };
        let taken = match id.inner.get_event() {
            Ok(Some(taken)) => taken,
            Ok(None) => continue,
            Err(e) => return io_errno(&e),
        };
        if taken.pending > 0 {
            channel.queue.push(handle);
        }
        let (kind, status, mut taken) = process(id, taken);
        // SAFETY: rdma_cm_event is C data valid as zero.
        let mut event: rdma_cm_event = unsafe { std::mem::zeroed() };
        event.id = ptr::from_mut(&mut id.id);
        event.event = kind;
        event.status = status;
        if let Some(new) = taken.new_id.take() {
            let made = new_id(
                new,
                id.id.verbs,
                id.id.channel,
                Arc::clone(&id.queue),
                id.id.context,
                id.id.ps,
            );
            // SAFETY: just made.
            unsafe { (*made).refresh_route() };
            event.listen_id = ptr::from_mut(&mut id.id);
            event.id = made.cast();
        }
        let mut boxed = Box::new(VrdmaCmEvent {
            event,
            private_data: std::mem::take(&mut taken.param.private_data),
            _hold: hold,
        });
        let data = boxed.private_data.as_ptr().cast::<c_void>();
        let len = boxed.private_data.len() as u8;
        let data = if len == 0 { ptr::null() } else { data };
        match taken.ah_attr {
            Some(ah) => {
                let ud = rdma_sys::rdma_ud_param {
                    private_data: data,
                    private_data_len: len,
                    ah_attr: rdma_sys::ibv_ah_attr::from(&ah),
                    qp_num: taken.param.qp_num,
                    qkey: taken.param.qkey,
                };
                boxed.event.param.ud = ud;
            }
            None => {
                let p = &taken.param;
                boxed.event.param.conn = rdma_conn_param {
                    private_data: data,
                    private_data_len: len,
                    responder_resources: p.responder_resources,
                    initiator_depth: p.initiator_depth,
                    flow_control: p.flow_control,
                    retry_count: p.retry_count,
                    rnr_retry_count: p.rnr_retry_count,
                    srq: p.srq.into(),
                    qp_num: p.qp_num,
                };
            }
        }
        // SAFETY: the caller's out-pointer.
        unsafe { *out = Box::into_raw(boxed).cast() };
        return 0;
    }
}

/// The id with device handle `handle`, if it still exists, held (see `rdma_destroy_id`): the
/// hold is taken where the id is found, so no destroy frees it in between.
fn lookup(handle: u32) -> Option<(*mut rdma_cm_id, Hold)> {
    let context = cm_context()?;
    // SAFETY: the CM context is this library's.
    unsafe { context_of(context) }.with_dispatcher(|d| {
        let id = d.cm_id(handle)? as *mut rdma_cm_id;
        // SAFETY: watched, so live: rdma_destroy_id forgets it (under this lock) first. Only
        // the count is borrowed, which is shared.
        let unacked = unsafe { &(*id.cast::<VrdmaCmId>()).unacked };
        Some((id, unacked.hold()))
    })
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    if event.is_null() {
        return failed(libc::EINVAL);
    }
    free_event(event);
    0
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_event_str(kind: c_int) -> *const c_char {
    static NAMES: OnceLock<Vec<std::ffi::CString>> = OnceLock::new();
    let names = NAMES.get_or_init(|| {
        (0..=16)
            .map(|k| std::ffi::CString::new(event::name(k)).expect("no NUL"))
            .collect()
    });
    let index = usize::try_from(kind).unwrap_or(16).min(16);
    names[index].as_ptr()
}

// ---- endpoints and addresses ----------------------------------------------------------

/// The first IPv4 address of `node` and `service` as getaddrinfo(3) finds it (no node: the
/// unspecified address for a passive side, the loopback address for an active one, as
/// getaddrinfo gives them); the errno when there is none.
///
/// # Safety
/// `node` and `service` must be NULL or NUL-terminated strings.
unsafe fn resolve_ipv4(
    node: *const c_char,
    service: *const c_char,
    flags: c_int,
    qp_type: c_int,
) -> Result<SocketAddrV4, c_int> {
    // SAFETY: all-zero is a valid addrinfo hint.
    let mut hints: libc::addrinfo = unsafe { std::mem::zeroed() };
    hints.ai_family = libc::AF_INET;
    hints.ai_socktype = if qp_type == ibv_qp_type::IBV_QPT_UD as c_int {
        libc::SOCK_DGRAM
    } else {
        libc::SOCK_STREAM
    };
    if flags & RAI_PASSIVE != 0 {
        hints.ai_flags |= libc::AI_PASSIVE;
    }
    if flags & RAI_NUMERICHOST != 0 {
        hints.ai_flags |= libc::AI_NUMERICHOST;
    }
    let mut found: *mut libc::addrinfo = ptr::null_mut();
    // SAFETY: strings per the contract, a valid hint and out-pointer; the list is freed once
    // below, after its last use.
    let ret = unsafe { libc::getaddrinfo(node, service, &hints, &mut found) };
    if ret != 0 {
        return Err(match ret {
            libc::EAI_SERVICE | libc::EAI_BADFLAGS => libc::EINVAL,
            libc::EAI_SYSTEM => last_errno(),
            libc::EAI_MEMORY => libc::ENOMEM,
            // Not a numeric host where one was asked for, a name without an IPv4 address.
            _ if flags & RAI_NUMERICHOST != 0 => libc::EINVAL,
            _ => libc::EADDRNOTAVAIL,
        });
    }
    let mut address = None;
    let mut next = found;
    while !next.is_null() && address.is_none() {
        // SAFETY: an entry of the list getaddrinfo made; an AF_INET entry's address is a
        // sockaddr_in.
        unsafe {
            let entry = &*next;
            if entry.ai_family == libc::AF_INET && !entry.ai_addr.is_null() {
                address = from_sockaddr_in(&*entry.ai_addr.cast::<libc::sockaddr_in>());
            }
            next = entry.ai_next;
        }
    }
    // SAFETY: the list getaddrinfo made, freed once.
    unsafe { libc::freeaddrinfo(found) };
    address.ok_or(libc::EADDRNOTAVAIL)
}

/// A copy of `len` bytes at `addr` in memory of malloc(3)'s, as librdmacm keeps an
/// `rdma_addrinfo`'s addresses: programs free them, and put their own there, for
/// `rdma_freeaddrinfo` to free (libfabric does).
///
/// # Safety
/// `addr` must be valid for reads of `len` bytes.
unsafe fn malloc_copy(addr: *const c_void, len: usize) -> Result<*mut libc::sockaddr, c_int> {
    // SAFETY: malloc has no preconditions; the result is checked.
    let copy = unsafe { libc::malloc(len.max(1)) };
    if copy.is_null() {
        return Err(libc::ENOMEM);
    }
    // SAFETY: `len` bytes each side, per the contract and the allocation.
    unsafe { ptr::copy_nonoverlapping(addr.cast::<u8>(), copy.cast::<u8>(), len) };
    Ok(copy.cast())
}

/// librdmacm's `rdma_getaddrinfo` for IPv4: `node` and `service` resolved as the passive or
/// active side's address, or, with neither, the hints' addresses taken as they are (a
/// program that knows its addresses, as libfabric, passes them that way); the hints' source
/// address also where the resolution gave none. The result and its addresses are malloc(3)'s,
/// as librdmacm's.
#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    if res.is_null() || (node.is_null() && service.is_null() && hints.is_null()) {
        return failed(libc::EINVAL);
    }
    // SAFETY: per the API contract.
    let hints = (!hints.is_null()).then(|| unsafe { &*hints });
    let flags = hints.map_or(0, |h| h.ai_flags);
    let family = hints.map_or(0, |h| h.ai_family);
    // SAFETY: calloc has no preconditions; rdma_addrinfo is C data valid as zero.
    let info =
        unsafe { libc::calloc(1, std::mem::size_of::<rdma_addrinfo>()) }.cast::<rdma_addrinfo>();
    if info.is_null() {
        return failed(libc::ENOMEM);
    }
    // SAFETY: just allocated and zeroed.
    let made = unsafe { &mut *info };
    made.ai_flags = flags;
    made.ai_qp_type = hints.map_or(0, |h| h.ai_qp_type);
    made.ai_port_space = match hints.map_or(0, |h| h.ai_port_space) {
        0 if made.ai_qp_type == ibv_qp_type::IBV_QPT_UD as c_int => port_space::UDP as c_int,
        0 => port_space::TCP as c_int,
        space => space,
    };
    if made.ai_qp_type == 0 {
        made.ai_qp_type = if made.ai_port_space == port_space::UDP as c_int {
            ibv_qp_type::IBV_QPT_UD as c_int
        } else {
            ibv_qp_type::IBV_QPT_RC as c_int
        };
    }
    let filled = (|| -> Result<(), c_int> {
        if !node.is_null() || !service.is_null() {
            if family != 0 && family != libc::AF_INET {
                // Only IPv4 is served (AF_INET6 and AF_IB hints find nothing).
                return Err(libc::EAFNOSUPPORT);
            }
            // SAFETY: the program's strings, per the API contract.
            let address = unsafe { resolve_ipv4(node, service, flags, made.ai_qp_type) }?;
            let address = sockaddr_in(address);
            let len = std::mem::size_of::<libc::sockaddr_in>();
            // SAFETY: a sockaddr_in of ours, `len` bytes.
            let copy = unsafe { malloc_copy(ptr::from_ref(&address).cast(), len) }?;
            made.ai_family = libc::AF_INET;
            if flags & RAI_PASSIVE != 0 {
                (made.ai_src_addr, made.ai_src_len) = (copy, len as libc::socklen_t);
            } else {
                (made.ai_dst_addr, made.ai_dst_len) = (copy, len as libc::socklen_t);
            }
        } else {
            made.ai_family = family;
            if let Some(h) = hints.filter(|h| h.ai_dst_len > 0 && !h.ai_dst_addr.is_null()) {
                // SAFETY: the hints' address of `ai_dst_len` bytes, per the API contract.
                made.ai_dst_addr =
                    unsafe { malloc_copy(h.ai_dst_addr.cast(), h.ai_dst_len as usize) }?;
                made.ai_dst_len = h.ai_dst_len;
            }
        }
        if let Some(h) = hints.filter(|h| h.ai_src_len > 0 && !h.ai_src_addr.is_null()) {
            if made.ai_src_len == 0 {
                // SAFETY: as above.
                made.ai_src_addr =
                    unsafe { malloc_copy(h.ai_src_addr.cast(), h.ai_src_len as usize) }?;
                made.ai_src_len = h.ai_src_len;
            }
        }
        Ok(())
    })();
    if let Err(errno) = filled {
        // SAFETY: the list just made, freed once.
        unsafe { vrdma_rdmacm_rdma_freeaddrinfo(info) };
        return failed(errno);
    }
    // SAFETY: the caller's out-pointer.
    unsafe { *res = info };
    0
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    let mut next = res;
    while !next.is_null() {
        // SAFETY: an rdma_addrinfo of malloc(3)'s that rdma_getaddrinfo made, whose pointers
        // are NULL or malloc(3)'s (its own, or a program's put there), each freed once.
        unsafe {
            let info = &*next;
            let following = info.ai_next;
            for owned in [
                info.ai_src_addr.cast::<c_void>(),
                info.ai_dst_addr.cast(),
                info.ai_src_canonname.cast(),
                info.ai_dst_canonname.cast(),
                info.ai_route,
                info.ai_connect,
            ] {
                libc::free(owned);
            }
            libc::free(next.cast());
            next = following;
        }
    }
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_create_ep(
    id: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    if id.is_null() || res.is_null() {
        return failed(libc::EINVAL);
    }
    // SAFETY: per the API contract.
    let res = unsafe { &*res };
    let mut made: *mut rdma_cm_id = ptr::null_mut();
    // SAFETY: a synchronous id (no channel).
    let ret = unsafe {
        vrdma_rdmacm_rdma_create_id(
            ptr::null_mut(),
            &mut made,
            ptr::null_mut(),
            res.ai_port_space as u32,
        )
    };
    if ret != 0 {
        return ret;
    }
    // SAFETY: just made; the addresses are the caller's.
    let ret = unsafe {
        if res.ai_flags & RAI_PASSIVE != 0 {
            let ret = vrdma_rdmacm_rdma_bind_addr(made, res.ai_src_addr.cast());
            if ret == 0 && !qp_init_attr.is_null() {
                ours(made).request_qp = Some((pd, *qp_init_attr));
            }
            ret
        } else {
            let mut ret = vrdma_rdmacm_rdma_resolve_addr(
                made,
                res.ai_src_addr.cast(),
                res.ai_dst_addr.cast(),
                EP_TIMEOUT_MS,
            );
            if ret == 0 {
                ret = vrdma_rdmacm_rdma_resolve_route(made, EP_TIMEOUT_MS);
            }
            if ret == 0 && !qp_init_attr.is_null() {
                ret = vrdma_rdmacm_rdma_create_qp(made, pd, qp_init_attr);
            }
            ret
        }
    };
    if ret != 0 {
        let errno = last_errno();
        // SAFETY: the id just made.
        unsafe { vrdma_rdmacm_rdma_destroy_id(made) };
        return failed(errno);
    }
    // SAFETY: the caller's out-pointer.
    unsafe { *id = made };
    0
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_destroy_ep(id: *mut rdma_cm_id) {
    // SAFETY: per the API contract.
    unsafe {
        vrdma_rdmacm_rdma_destroy_qp(id);
        vrdma_rdmacm_rdma_destroy_id(id);
    }
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_get_request(
    listen: *mut rdma_cm_id,
    id: *mut *mut rdma_cm_id,
) -> c_int {
    if id.is_null() {
        return failed(libc::EINVAL);
    }
    // SAFETY: per the API contract.
    let listener = unsafe { ours(listen) };
    if !listener.is_sync() {
        return failed(libc::EINVAL);
    }
    if complete(listener, event_type::RDMA_CM_EVENT_CONNECT_REQUEST) != 0 {
        return -1;
    }
    let event = std::mem::replace(&mut listener.id.event, ptr::null_mut());
    // SAFETY: the request event just taken; its id is the new one, made synchronous here.
    let (made, new) = unsafe { ((*event).id, ours((*event).id)) };
    if let Some(own) = new_channel() {
        new.queue = Arc::clone(&own.queue);
        new.id.channel = ptr::from_ref(&own.channel).cast_mut();
        new.own_channel = Some(own);
        // SAFETY: a live id of this library's.
        unsafe { watch(new) };
    }
    new.id.event = event;
    if let Some((pd, mut attr)) = listener.request_qp {
        // SAFETY: the new id and the attributes rdma_create_ep kept.
        if unsafe { vrdma_rdmacm_rdma_create_qp(made, pd, &mut attr) } != 0 {
            let errno = last_errno();
            let _ = new.inner.reject(&[]);
            // SAFETY: the new id, never handed out.
            unsafe { vrdma_rdmacm_rdma_destroy_id(made) };
            return failed(errno);
        }
    }
    // SAFETY: the caller's out-pointer.
    unsafe { *id = made };
    0
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    // SAFETY: per the API contract; the source is a sockaddr_in once bound.
    unsafe { ours(id).id.route.addr.src_addr_union.src_sin.sin_port }
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    // SAFETY: as above.
    unsafe { ours(id).id.route.addr.dst_addr_union.dst_sin.sin_port }
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_get_devices(count: *mut c_int) -> *mut *mut ibv_context {
    let context = cm_context();
    // SAFETY: calloc has no preconditions; the result is checked. NULL-terminated.
    let list = unsafe { libc::calloc(2, std::mem::size_of::<*mut ibv_context>()) }
        .cast::<*mut ibv_context>();
    if list.is_null() {
        return fail(libc::ENOMEM, ptr::null_mut());
    }
    if let Some(context) = context {
        // SAFETY: room for two.
        unsafe { *list = context };
    }
    if !count.is_null() {
        // SAFETY: the caller's int.
        unsafe { *count = c_int::from(context.is_some()) };
    }
    list
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_free_devices(list: *mut *mut ibv_context) {
    // SAFETY: rdma_get_devices' calloc, or NULL.
    unsafe { libc::free(list.cast()) };
}

#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_rdma_set_option(
    _id: *mut rdma_cm_id,
    level: c_int,
    name: c_int,
    _value: *mut c_void,
    _len: usize,
) -> c_int {
    // RDMA_OPTION_ID (0): TOS (0), REUSEADDR (1), AFONLY (2), ACK_TIMEOUT (3): the device's
    // defaults stand; accepted, as a device without the option's effect would.
    if level == 0 && (0..=3).contains(&name) {
        return 0;
    }
    explain(
        "cm_option",
        "rdma_set_option: only the RDMA_OPTION_ID options are accepted",
    );
    failed(libc::ENOSYS)
}

/// Every librdmacm function vrdma does not serve (rsockets, multicast, SRQs on ids, ECE):
/// -1 (as int or ssize_t) with ENOSYS, said once per function.
///
/// # Safety
/// `name` must be a NUL-terminated string (link.sh's stubs pass the function's name).
#[no_mangle]
unsafe extern "C" fn vrdma_rdmacm_unserved(name: *const c_char) -> i64 {
    // SAFETY: per the contract.
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    let kind: &'static str = Box::leak(name.into_boxed_str());
    explain(kind, &format!("{kind} is not served by vrdma's librdmacm"));
    set_errno(libc::ENOSYS);
    -1
}
