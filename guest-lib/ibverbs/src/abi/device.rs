//! The device as programs find and open it: the device list, its name, GUID and index, and
//! opening and closing a context.
use std::os::fd::AsRawFd;
use std::os::raw::{c_char, c_int, c_void};
use std::ptr;
use std::sync::{Arc, Mutex, OnceLock};

use rdma_sys::{ibv_context, ibv_device, verbs_context};
use vrdma_guest::Device;

use super::queries::{query_device_ex, query_port_extended};
use crate::attr::{self};
use crate::config::{self, DeviceTarget, DEVICE_NAME};
use crate::context::{free_context, make_context};
use crate::errno::{report_setup, set_errno};
use crate::events::{AsyncEvents, Dispatcher};
use crate::objects;

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
    make_context(verbs, opened, dispatcher, async_events)
}

#[no_mangle]
unsafe extern "C" fn ibv_close_device(context: *mut ibv_context) -> c_int {
    if context.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: per libibverbs' contract `context` came from ibv_open_device, which
    // make_context made, and is closed once.
    unsafe { free_context(context) };
    0
}
