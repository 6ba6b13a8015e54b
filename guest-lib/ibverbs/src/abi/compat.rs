//! Verbs of no object that programs and providers call: fork support, the status and type
//! strings, rate conversions and the 1.0 ABI's sysfs helpers.
use std::os::raw::{c_char, c_int, c_void};

use rdma_sys::IBV_FORK_UNNEEDED;

use crate::errno::set_errno;
use crate::{strings, translate};

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
