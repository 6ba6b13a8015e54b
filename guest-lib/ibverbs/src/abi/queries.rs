//! Queries of an open device: its attributes, its port's, GIDs and P_Keys.
use std::os::raw::c_int;
use std::ptr;

use rdma_sys::{ibv_context, ibv_device_attr, ibv_gid, ibv_gid_entry, ibv_port_attr};

use crate::attr::{self, COMPAT_PORT_ATTR_LEN};
use crate::context::{context_of, VrdmaContext};
use crate::errno::{raise_errno, set_errno};

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
pub(super) unsafe extern "C" fn query_device_ex(
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
pub(super) unsafe extern "C" fn query_port_extended(
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
