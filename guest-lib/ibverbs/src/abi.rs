//! The C edge for the device, its context and queries: libibverbs' exported functions, each
//! a thin skin over guest-lib (`objects` is the other half). C callers hand in raw pointers
//! that only they can vouch for, exactly as with the system's libibverbs.
//!
//! Objects programs receive (`ibv_device`, `ibv_context`, ...) are the first field of a
//! `#[repr(C)]` struct of this library's own, so a pointer a program passes back leads to
//! its guest-lib object. Verbs vrdma does not serve yet fail with `EOPNOTSUPP` and a NULL or
//! error return, as libibverbs documents for unsupported verbs.

use std::os::fd::AsRawFd;
use std::os::raw::{c_char, c_int, c_void};
use std::ptr;
use std::sync::{Arc, Mutex, OnceLock};

use rdma_sys::{
    ibv_async_event, ibv_context, ibv_device, ibv_device_attr, ibv_gid, ibv_gid_entry,
    ibv_port_attr, verbs_context, IBV_FORK_UNNEEDED,
};
use vrdma_guest::Device;

use crate::attr::{self, COMPAT_PORT_ATTR_LEN};
use crate::config::{self, DeviceTarget, DEVICE_NAME};
use crate::events::{AsyncEvents, Dispatcher, Element};
use crate::{objects, strings, translate};

/// The one device this library shows, as programs see it and as guest-lib opens it.
#[repr(C)]
struct VrdmaDevice {
    device: ibv_device,
    target: DeviceTarget,
    /// The node GUID, once a context or `ibv_get_device_guid` has queried it: asked again,
    /// it needs no connection of its own (a backend may serve one connection at a time).
    node_guid: std::sync::OnceLock<u64>,
    /// The connection `ibv_get_device_guid` opened to ask, kept for the next
    /// `ibv_open_device`: a program that reads the GUID before it opens the device (most do,
    /// listing devices) connects once, not twice.
    unused_connection: Mutex<Option<Device>>,
}

// SAFETY: the C part is plain data written once, before the value is shared, and only read
// afterwards; the target is an immutable String, the GUID a OnceLock, the kept connection
// behind a Mutex.
unsafe impl Sync for VrdmaDevice {}
// SAFETY: nothing in it belongs to a thread: the C part is plain data (its pointers are
// unused and NULL), the rest are owned Rust values that are Send.
unsafe impl Send for VrdmaDevice {}

/// An open device: libibverbs' extended context (which ends with the `ibv_context` programs
/// hold), then this library's state.
#[repr(C)]
pub(crate) struct VrdmaContext {
    verbs: verbs_context,
    pub(crate) device: Device,
    /// Routes the device's events to channels and to `async_events`.
    dispatcher: Mutex<Dispatcher>,
    /// What `ibv_get_async_event` hands out; its eventfd is `context->async_fd`.
    async_events: Arc<AsyncEvents>,
}

pub(crate) fn set_errno(errno: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's life.
    unsafe { *libc::__errno_location() = errno };
}

/// The environment variable that asks this library (and vrdma's librdmacm) to say on standard
/// error why a call failed: set to anything but empty or `0`.
pub(crate) const DEBUG_VARIABLE: &str = "VRDMA_DEBUG";

/// Whether the program's environment asked for [`report_once`]'s lines, read once.
fn debug_asked() -> bool {
    static ASKED: OnceLock<bool> = OnceLock::new();
    *ASKED.get_or_init(|| {
        std::env::var_os(DEBUG_VARIABLE).is_some_and(|value| !value.is_empty() && value != "0")
    })
}

/// Says why a verb failed, on standard error, once per process and kind, and only when
/// `VRDMA_DEBUG` asks for it: a kernel provider fails silently with an errno, and programs
/// that search a device's limits by trial (libfabric's inline size, UCX's queue depths)
/// expect no line for a refused try.
pub(crate) fn report_once(kind: &'static str, message: &str) {
    if debug_asked() {
        say_once(kind, message);
    }
}

/// Says `message` on standard error once per process and kind, asked or not: for what keeps a
/// program from reaching vrdma0 at all (no device configured, a backend that does not answer),
/// which only the user can fix and nothing else would tell them.
pub(crate) fn report_setup(kind: &'static str, message: &str) {
    say_once(kind, message);
}

/// A library cannot log through the program, and a program looping over a failing call must
/// not flood its terminal: each kind is said once.
fn say_once(kind: &'static str, message: &str) {
    static SAID: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
    if !said.contains(&kind) {
        said.push(kind);
        eprintln!("vrdma: {message}");
    }
}

/// The configured device, resolved once per process.
fn vrdma_device() -> Option<&'static VrdmaDevice> {
    static DEVICE: OnceLock<Option<VrdmaDevice>> = OnceLock::new();
    DEVICE
        .get_or_init(|| match config::configured_device() {
            Ok(target) => {
                // SAFETY: ibv_device is plain C data (enums, char arrays and two unused
                // function pointers, all valid as zero).
                let mut device: ibv_device = unsafe { std::mem::zeroed() };
                device.node_type = rdma_sys::ibv_node_type::IBV_NODE_CA;
                device.transport_type = rdma_sys::ibv_transport_type::IBV_TRANSPORT_IB;
                attr::fill_c_string(&mut device.name, DEVICE_NAME);
                attr::fill_c_string(&mut device.dev_name, DEVICE_NAME);
                Some(VrdmaDevice {
                    device,
                    target,
                    node_guid: std::sync::OnceLock::new(),
                    unused_connection: Mutex::new(None),
                })
            }
            Err(e) => {
                report_setup("config", &e.to_string());
                None
            }
        })
        .as_ref()
}

/// The vrdma device behind `device`, if it is this library's.
fn device_of(device: *mut ibv_device) -> Option<&'static VrdmaDevice> {
    vrdma_device().filter(|ours| ptr::eq(&ours.device, device))
}

impl VrdmaContext {
    /// Runs `f` on the context's event dispatcher; the lock also serialises changes to
    /// channels' `refcnt`.
    pub(crate) fn with_dispatcher<R>(&self, f: impl FnOnce(&Dispatcher) -> R) -> R {
        f(&self.dispatcher.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// # Safety
/// `context` must be a context this library's `ibv_open_device` returned and not yet closed.
pub(crate) unsafe fn context_of<'a>(context: *mut ibv_context) -> &'a VrdmaContext {
    let offset = std::mem::offset_of!(verbs_context, context);
    // SAFETY: per the contract, `context` is the `verbs.context` field of a live
    // VrdmaContext whose first field is `verbs`; stepping back by the field's offset gives
    // the whole value.
    unsafe { &*(context.cast::<u8>().sub(offset).cast::<VrdmaContext>()) }
}

/// The errno for a guest-lib error, also left in the thread's `errno`, as libibverbs leaves
/// it whether a call reports failure by its return value or by NULL (programs read either).
pub(crate) fn raise_errno(error: &vrdma_guest::Error) -> c_int {
    let errno = errno_of(error);
    set_errno(errno);
    errno
}

/// An errno for a guest-lib error: the host's errno when the device passed one on (an empty
/// GID entry is ENODATA, as on a native device), else what the status means.
fn errno_of(error: &vrdma_guest::Error) -> c_int {
    use vrdma_guest::{Error, Status};
    match error {
        Error::Device { detail, .. } if *detail != 0 => {
            c_int::try_from(*detail).unwrap_or(libc::EIO)
        }
        Error::Device { status, .. } => match status {
            Status::NoResources => libc::ENOMEM,
            Status::Unsupported => libc::EOPNOTSUPP,
            Status::Busy => libc::EBUSY,
            Status::BadAddress => libc::EFAULT,
            Status::BadHandle => libc::EBADF,
            _ => libc::EINVAL,
        },
        Error::InvalidArgument(_) | Error::OutOfBounds { .. } => libc::EINVAL,
        // A full work queue: ENOMEM, as rxe and mlx5 say it.
        Error::OutOfSharedMemory(_) | Error::QueueFull { .. } => libc::ENOMEM,
        Error::Timeout(_) => libc::ETIMEDOUT,
        // ENOMEM past RLIMIT_MEMLOCK, as uverbs answers a registration past it.
        Error::Pin { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        // Past a memory limit (RLIMIT_MEMLOCK, the service's shares, the backend's memory
        // regions): ENOMEM, as uverbs refuses pinning past RLIMIT_MEMLOCK.
        Error::OverLimit(_) => libc::ENOMEM,
        // The OS error of a failed system call, not a generic EIO.
        Error::System { source, .. } | Error::Transport(source) | Error::SharedMemory(source) => {
            source.raw_os_error().unwrap_or(libc::EIO)
        }
        Error::NoDevice(_) => libc::ENODEV,
        Error::DeviceBusy(_) => libc::EBUSY,
        // Past the service's limit on programs: a later attempt may be served.
        Error::ServiceRefused(_) => libc::EAGAIN,
        Error::Incompatible(_) => libc::EPROTO,
        _ => libc::EIO,
    }
}

// ---- device list -------------------------------------------------------------------------

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_get_device_list(
    num_devices: *mut c_int,
) -> *mut *mut ibv_device {
    let device = vrdma_device();
    // NULL-terminated, freed by ibv_free_device_list with free().
    // SAFETY: calloc has no preconditions; the result is checked.
    let list = unsafe { libc::calloc(2, std::mem::size_of::<*mut ibv_device>()) }
        .cast::<*mut ibv_device>();
    if list.is_null() {
        set_errno(libc::ENOMEM);
        return ptr::null_mut();
    }
    let count = match device {
        Some(device) => {
            // SAFETY: `list` has room for two pointers. Programs never write through an
            // ibv_device pointer; the cast only follows the C signature.
            unsafe { *list = ptr::from_ref(&device.device).cast_mut() };
            1
        }
        None => 0,
    };
    if !num_devices.is_null() {
        // SAFETY: the caller passes NULL or a valid int pointer.
        unsafe { *num_devices = count };
    }
    list
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    // SAFETY: `list` came from ibv_get_device_list's calloc (or is NULL).
    unsafe { libc::free(list.cast()) };
}

#[no_mangle]
unsafe extern "C" fn ibv_get_device_name(device: *mut ibv_device) -> *const c_char {
    match device_of(device) {
        Some(ours) => ours.device.name.as_ptr(),
        None => {
            set_errno(libc::ENODEV);
            ptr::null()
        }
    }
}

/// The node GUID, in network byte order; 0 when the device cannot be reached.
#[no_mangle]
unsafe extern "C" fn ibv_get_device_guid(device: *mut ibv_device) -> u64 {
    let Some(ours) = device_of(device) else {
        return 0;
    };
    if let Some(&guid) = ours.node_guid.get() {
        return guid.to_be();
    }
    let opened = Device::open(&ours.target.target);
    match opened.and_then(|device| Ok((device.query_device()?, device))) {
        Ok((attr, device)) => {
            *ours
                .unused_connection
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(device);
            ours.node_guid
                .get_or_init(|| attr.node_guid.to_native())
                .to_be()
        }
        Err(e) => {
            report_setup("open", &open_failure(ours, &e));
            0
        }
    }
}

#[no_mangle]
unsafe extern "C" fn ibv_get_device_index(device: *mut ibv_device) -> c_int {
    if device_of(device).is_some() {
        0
    } else {
        -1
    }
}

fn open_failure(device: &VrdmaDevice, error: &vrdma_guest::Error) -> String {
    format!(
        "cannot open {DEVICE_NAME} at {}: {error}",
        device.target.describe()
    )
}

// ---- open / close ------------------------------------------------------------------------

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_open_device(device: *mut ibv_device) -> *mut ibv_context {
    let Some(ours) = device_of(device) else {
        set_errno(libc::ENODEV);
        return ptr::null_mut();
    };
    let kept = ours
        .unused_connection
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    let opened = match kept.map_or_else(|| Device::open(&ours.target.target), Ok) {
        Ok(opened) => opened,
        Err(e) => {
            report_setup("open", &open_failure(ours, &e));
            set_errno(libc::ENODEV);
            return ptr::null_mut();
        }
    };
    if ours.node_guid.get().is_none() {
        if let Ok(attr) = opened.query_device() {
            ours.node_guid.get_or_init(|| attr.node_guid.to_native());
        }
    }
    let started = AsyncEvents::new().and_then(|async_events| {
        let dispatcher = Dispatcher::start(opened.clone(), Arc::clone(&async_events))?;
        Ok((async_events, dispatcher))
    });
    let (async_events, dispatcher) = match started {
        Ok(started) => started,
        Err(e) => {
            set_errno(e.raw_os_error().unwrap_or(libc::EIO));
            return ptr::null_mut();
        }
    };
    // SAFETY: verbs_context is C data (pointers, function pointers as Options, integers, a
    // pthread mutex for which all-zero is PTHREAD_MUTEX_INITIALIZER on glibc).
    let mut verbs: verbs_context = unsafe { std::mem::zeroed() };
    verbs.sz = std::mem::size_of::<verbs_context>();
    verbs.query_port = Some(query_port_extended);
    verbs.query_device_ex = Some(query_device_ex);
    verbs.create_qp_ex = Some(objects::create_qp_ex);
    verbs.create_cq_ex = Some(objects::create_cq_ex);
    // The verbs verbs.h inlines call these through the context.
    verbs.context.ops.post_send = Some(objects::post_send);
    verbs.context.ops.post_recv = Some(objects::post_recv);
    verbs.context.ops.post_srq_recv = Some(objects::post_srq_recv);
    verbs.context.ops.poll_cq = Some(objects::poll_cq);
    verbs.context.ops.req_notify_cq = Some(objects::req_notify_cq);
    verbs.context.device = device;
    verbs.context.cmd_fd = -1;
    verbs.context.async_fd = async_events.as_raw_fd();
    verbs.context.num_comp_vectors = objects::COMP_VECTORS;
    // __VERBS_ABI_IS_EXTENDED: tells verbs.h's inline functions that `verbs` surrounds the
    // context.
    verbs.context.abi_compat = usize::MAX as *mut c_void;
    let context = Box::into_raw(Box::new(VrdmaContext {
        verbs,
        device: opened,
        dispatcher: Mutex::new(dispatcher),
        async_events,
    }));
    // SAFETY: `context` is a valid, uniquely owned allocation until ibv_close_device.
    let opened = unsafe { ptr::addr_of_mut!((*context).verbs.context) };
    open_contexts().push(opened as usize);
    opened
}

/// The contexts open in the process, oldest first, by address: connection management uses
/// the program's own (a backend serves a process one connection).
fn open_contexts() -> std::sync::MutexGuard<'static, Vec<usize>> {
    static OPEN: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    OPEN.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether `context` is open, and the oldest open context.
pub(crate) fn open_context(context: Option<*mut ibv_context>) -> (bool, Option<*mut ibv_context>) {
    let open = open_contexts();
    let is_open = context.is_some_and(|c| open.contains(&(c as usize)));
    (is_open, open.first().map(|&c| c as *mut ibv_context))
}

#[no_mangle]
unsafe extern "C" fn ibv_close_device(context: *mut ibv_context) -> c_int {
    if context.is_null() {
        return libc::EINVAL;
    }
    open_contexts().retain(|&c| c != context as usize);
    // SAFETY: per libibverbs' contract `context` came from ibv_open_device and is closed
    // once; the VrdmaContext it sits in was made by Box::new there.
    let owned = unsafe {
        let offset = std::mem::offset_of!(verbs_context, context);
        Box::from_raw(context.cast::<u8>().sub(offset).cast::<VrdmaContext>())
    };
    drop(owned); // guest-lib closes the device; the eventfd closes
    0
}

// ---- queries -----------------------------------------------------------------------------

#[no_mangle]
unsafe extern "C" fn ibv_query_device(
    context: *mut ibv_context,
    device_attr: *mut ibv_device_attr,
) -> c_int {
    if context.is_null() || device_attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a context from ibv_open_device, per the API contract.
    let ours = unsafe { context_of(context) };
    match ours.device.query_device() {
        Ok(wire) => {
            // SAFETY: the caller passes a valid ibv_device_attr to fill.
            unsafe { device_attr.write(attr::device_attr(&wire)) };
            0
        }
        Err(e) => raise_errno(&e),
    }
}

/// `verbs_context.query_device_ex`: what verbs.h's `ibv_query_device_ex` calls. The
/// extended attributes vrdma has are the plain ones, its device capability flags and its one
/// port; every other field (ODP, TSO, RSS, timestamps, ...) is zero: not served.
unsafe extern "C" fn query_device_ex(
    context: *mut ibv_context,
    _input: *const rdma_sys::ibv_query_device_ex_input,
    attr: *mut rdma_sys::ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    // A caller built against older headers passes a smaller structure; anything shorter
    // than the plain attributes is not one.
    if context.is_null() || attr.is_null() || attr_size < std::mem::size_of::<ibv_device_attr>() {
        return libc::EINVAL;
    }
    // SAFETY: a context from ibv_open_device, per the API contract.
    let ours = unsafe { context_of(context) };
    let wire = match ours.device.query_device() {
        Ok(wire) => wire,
        Err(e) => return raise_errno(&e),
    };
    // SAFETY: plain C data, valid as zero.
    let mut extended: rdma_sys::ibv_device_attr_ex = unsafe { std::mem::zeroed() };
    extended.orig_attr = attr::device_attr(&wire);
    extended.device_cap_flags_ex = u64::from(extended.orig_attr.device_cap_flags);
    extended.phys_port_cnt_ex = u32::from(extended.orig_attr.phys_port_cnt);
    let size = attr_size.min(std::mem::size_of::<rdma_sys::ibv_device_attr_ex>());
    // SAFETY: the caller's structure holds `attr_size` bytes, of which the first `size` are
    // the fields both versions share.
    unsafe {
        ptr::copy_nonoverlapping(
            (&extended as *const rdma_sys::ibv_device_attr_ex).cast::<u8>(),
            attr.cast::<u8>(),
            size,
        );
    }
    0
}

fn port_attributes(context: &VrdmaContext, port: u8) -> Result<ibv_port_attr, c_int> {
    if port != 1 {
        return Err(libc::EINVAL);
    }
    context
        .device
        .query_port()
        .map(|wire| attr::port_attr(&wire))
        .map_err(|e| raise_errno(&e))
}

/// `verbs_context.query_port`: what verbs.h's `ibv_query_port` calls.
unsafe extern "C" fn query_port_extended(
    context: *mut ibv_context,
    port: u8,
    port_attr: *mut ibv_port_attr,
    port_attr_len: usize,
) -> c_int {
    if port_attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: verbs.h passes the context the program gave it, one of ours.
    match port_attributes(unsafe { context_of(context) }, port) {
        Ok(attr) => {
            let len = port_attr_len.min(std::mem::size_of::<ibv_port_attr>());
            // SAFETY: the caller's buffer holds `port_attr_len` bytes; at most that many are
            // written, from a local value that cannot overlap it.
            unsafe {
                ptr::copy_nonoverlapping(
                    ptr::from_ref(&attr).cast::<u8>(),
                    port_attr.cast::<u8>(),
                    len,
                )
            };
            0
        }
        Err(errno) => errno,
    }
}

/// The exported `ibv_query_port`, for programs built before `verbs_context.query_port`:
/// their structure ends before `flags`.
#[no_mangle]
unsafe extern "C" fn ibv_query_port(
    context: *mut ibv_context,
    port: u8,
    port_attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: same contract as the extended entry point, with the older, shorter structure.
    unsafe { query_port_extended(context, port, port_attr, COMPAT_PORT_ATTR_LEN) }
}

fn gid_entry(context: &VrdmaContext, port: u8, index: u32) -> Result<(ibv_gid, u8), c_int> {
    if port != 1 {
        return Err(libc::EINVAL);
    }
    let (gid, gid_type) = context
        .device
        .query_gid(index)
        .map_err(|e| raise_errno(&e))?;
    Ok((ibv_gid { raw: gid.0 }, gid_type))
}

/// 0, or -1 with errno set, as libibverbs documents. The guest's table has one entry, its own
/// GID (SPEC.md §5.6); should the host have lost it, it reads as zero, as an empty entry of a
/// native device's table does.
#[no_mangle]
unsafe extern "C" fn ibv_query_gid(
    context: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    let Ok(index) = u32::try_from(index) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    if context.is_null() || gid.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: a context from ibv_open_device, per the API contract.
    let value = match gid_entry(unsafe { context_of(context) }, port, index) {
        Ok((value, _)) => value,
        Err(libc::ENODATA) => ibv_gid { raw: [0; 16] },
        Err(errno) => {
            set_errno(errno);
            return -1;
        }
    };
    // SAFETY: the caller passes a valid ibv_gid to fill.
    unsafe { gid.write(value) };
    0
}

/// `enum ibv_gid_type_sysfs` (driver.h): what the private `ibv_query_gid_type` reports.
const GID_TYPE_SYSFS_IB_ROCE_V1: c_int = 0;
const GID_TYPE_SYSFS_ROCE_V2: c_int = 1;

/// Private ABI, but ibv_devinfo calls it for each GID it prints: 0, or -1 with errno set.
#[no_mangle]
unsafe extern "C" fn ibv_query_gid_type(
    context: *mut ibv_context,
    port: u8,
    index: u32,
    gid_type: *mut c_int,
) -> c_int {
    if context.is_null() || gid_type.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: a context from ibv_open_device, per the API contract.
    match gid_entry(unsafe { context_of(context) }, port, index) {
        Ok((_, kind)) => {
            let value = if kind == vrdma_guest::spec::ctrl::gid_type::ROCE_V2 {
                GID_TYPE_SYSFS_ROCE_V2
            } else {
                GID_TYPE_SYSFS_IB_ROCE_V1
            };
            // SAFETY: the caller passes a valid enum to fill.
            unsafe { gid_type.write(value) };
            0
        }
        Err(errno) => {
            set_errno(errno);
            -1
        }
    }
}

/// What verbs.h's `ibv_query_gid_ex` calls: 0 or an errno.
#[no_mangle]
unsafe extern "C" fn _ibv_query_gid_ex(
    context: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    if context.is_null()
        || entry.is_null()
        || flags != 0
        || entry_size < std::mem::size_of::<ibv_gid_entry>()
    {
        return libc::EINVAL;
    }
    let Ok(port) = u8::try_from(port) else {
        return libc::EINVAL;
    };
    // SAFETY: a context from ibv_open_device, per the API contract.
    match gid_entry(unsafe { context_of(context) }, port, index) {
        Ok((gid, gid_type)) => {
            let value = ibv_gid_entry {
                gid,
                gid_index: index,
                port_num: port.into(),
                gid_type: gid_type.into(),
                ndev_ifindex: 0,
            };
            // SAFETY: the caller's entry holds at least size_of::<ibv_gid_entry>() bytes.
            unsafe { entry.write(value) };
            0
        }
        Err(errno) => {
            set_errno(errno); // callers test either
            errno
        }
    }
}

/// The GID entries of the guest's table (only its own GID): how many were written to
/// `entries`, or a negative errno.
#[no_mangle]
unsafe extern "C" fn _ibv_query_gid_table(
    context: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    if context.is_null()
        || (entries.is_null() && max_entries > 0)
        || flags != 0
        || entry_size < std::mem::size_of::<ibv_gid_entry>()
    {
        return -(libc::EINVAL as isize);
    }
    // SAFETY: a context from ibv_open_device, per the API contract.
    let ours = unsafe { context_of(context) };
    let table_len = match port_attributes(ours, 1) {
        Ok(port) => u32::try_from(port.gid_tbl_len).unwrap_or(0),
        Err(errno) => return -(errno as isize),
    };
    let mut written = 0;
    for index in 0..table_len {
        let (gid, gid_type) = match gid_entry(ours, 1, index) {
            Ok(entry) => entry,
            Err(libc::ENODATA) => continue,
            Err(errno) => return -(errno as isize),
        };
        if written == max_entries {
            return -(libc::EINVAL as isize);
        }
        let value = ibv_gid_entry {
            gid,
            gid_index: index,
            port_num: 1,
            gid_type: gid_type.into(),
            ndev_ifindex: 0,
        };
        // SAFETY: the caller's array holds `max_entries` entries of `entry_size` bytes
        // each, and written < max_entries.
        unsafe {
            entries
                .cast::<u8>()
                .add(written * entry_size)
                .cast::<ibv_gid_entry>()
                .write_unaligned(value)
        };
        written += 1;
    }
    written as isize
}

/// The only P_Key of a RoCE port: the default, full-membership 0xffff.
const DEFAULT_PKEY: u16 = 0xffff;

#[no_mangle]
unsafe extern "C" fn ibv_query_pkey(
    context: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    if context.is_null() || pkey.is_null() || port != 1 || index != 0 {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller passes a valid __be16 to fill.
    unsafe { pkey.write(DEFAULT_PKEY.to_be()) };
    0
}

#[no_mangle]
unsafe extern "C" fn ibv_get_pkey_index(context: *mut ibv_context, port: u8, pkey: u16) -> c_int {
    if !context.is_null() && port == 1 && u16::from_be(pkey) == DEFAULT_PKEY {
        0
    } else {
        set_errno(libc::ENOENT);
        -1
    }
}

// ---- asynchronous events -----------------------------------------------------------------

/// The next asynchronous event (a QP or CQ failed, the port changed state, the device is
/// gone): 0, or -1 with errno (EAGAIN when `async_fd` is non-blocking and there is none).
/// Destroying an object drops its events not yet taken.
#[no_mangle]
unsafe extern "C" fn ibv_get_async_event(
    context: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    if context.is_null() || event.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: a context from ibv_open_device, per the API contract.
    match unsafe { context_of(context) }.async_events.take() {
        Ok(taken) => {
            // SAFETY: the caller's block to fill; the union member written is the one the
            // event type says is valid.
            unsafe {
                let event = &mut *event;
                event.event_type = taken.kind;
                match taken.element {
                    Element::Qp(qp) => event.element.qp = qp as *mut _,
                    Element::Cq(cq) => event.element.cq = cq as *mut _,
                    Element::Srq(srq) => event.element.srq = srq as *mut _,
                    Element::Port(port) => event.element.port_num = c_int::from(port),
                    Element::Device => event.element.port_num = 0,
                }
            }
            0
        }
        Err(errno) => {
            set_errno(errno);
            -1
        }
    }
}

/// Nothing to release: destroying an object never waits for its events to be acknowledged.
#[no_mangle]
unsafe extern "C" fn ibv_ack_async_event(_event: *mut ibv_async_event) {}

// ---- fork support ------------------------------------------------------------------------

/// Nothing to do: memory registered through vrdma is shared memory, which fork leaves
/// shared rather than copy-on-write.
#[no_mangle]
unsafe extern "C" fn ibv_fork_init() -> c_int {
    0
}

#[no_mangle]
unsafe extern "C" fn ibv_is_fork_initialized() -> rdma_sys::ibv_fork_status {
    IBV_FORK_UNNEEDED
}

#[no_mangle]
unsafe extern "C" fn ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

#[no_mangle]
unsafe extern "C" fn ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

// ---- strings -----------------------------------------------------------------------------

#[no_mangle]
unsafe extern "C" fn ibv_wc_status_str(status: c_int) -> *const c_char {
    strings::wc_status(status).as_ptr()
}

#[no_mangle]
unsafe extern "C" fn ibv_node_type_str(node_type: c_int) -> *const c_char {
    strings::node_type(node_type).as_ptr()
}

#[no_mangle]
unsafe extern "C" fn ibv_port_state_str(state: c_int) -> *const c_char {
    strings::port_state(state).as_ptr()
}

#[no_mangle]
unsafe extern "C" fn ibv_event_type_str(event: c_int) -> *const c_char {
    strings::event_type(event).as_ptr()
}

// ---- rates ------------------------------------------------------------------------------

#[no_mangle]
unsafe extern "C" fn ibv_rate_to_mult(rate: rdma_sys::ibv_rate::Type) -> c_int {
    translate::rate_to_mult(rate)
}

#[no_mangle]
unsafe extern "C" fn mult_to_ibv_rate(mult: c_int) -> rdma_sys::ibv_rate::Type {
    translate::mult_to_rate(mult)
}

#[no_mangle]
unsafe extern "C" fn ibv_rate_to_mbps(rate: rdma_sys::ibv_rate::Type) -> c_int {
    translate::rate_to_mbps(rate)
}

#[no_mangle]
unsafe extern "C" fn mbps_to_ibv_rate(mbps: c_int) -> rdma_sys::ibv_rate::Type {
    translate::mbps_to_rate(mbps)
}

// ---- sysfs helpers of the 1.0 ABI --------------------------------------------------------

#[no_mangle]
unsafe extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// vrdma devices have no sysfs entries: always -1.
#[no_mangle]
unsafe extern "C" fn ibv_read_sysfs_file(
    _dir: *const c_char,
    _file: *const c_char,
    _buf: *mut c_char,
    _size: usize,
) -> c_int {
    set_errno(libc::ENOENT);
    -1
}

#[cfg(test)]
mod tests;
