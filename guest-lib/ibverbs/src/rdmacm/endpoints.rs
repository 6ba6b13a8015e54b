//! Endpoints and addresses: rdma_getaddrinfo (IPv4, numeric or resolved), rdma_create_ep and
//! rdma_get_request, ports, the device list and options.

use super::*;

/// The first IPv4 address of `node` and `service` as getaddrinfo(3) finds it (no node: the
/// unspecified address for a passive side, the loopback address for an active one, as
/// getaddrinfo gives them); the errno when there is none.
///
/// # Safety
/// `node` and `service` must be NULL or NUL-terminated strings.
pub(super) unsafe fn resolve_ipv4(
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
pub(super) unsafe fn malloc_copy(
    addr: *const c_void,
    len: usize,
) -> Result<*mut libc::sockaddr, c_int> {
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
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_getaddrinfo(
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
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
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
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_create_ep(
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
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_destroy_ep(id: *mut rdma_cm_id) {
    // SAFETY: per the API contract.
    unsafe {
        vrdma_rdmacm_rdma_destroy_qp(id);
        vrdma_rdmacm_rdma_destroy_id(id);
    }
}

#[no_mangle]
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_get_request(
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
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    // SAFETY: per the API contract; the source is a sockaddr_in once bound.
    unsafe { ours(id).id.route.addr.src_addr_union.src_sin.sin_port }
}

#[no_mangle]
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    // SAFETY: as above.
    unsafe { ours(id).id.route.addr.dst_addr_union.dst_sin.sin_port }
}

#[no_mangle]
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_get_devices(
    count: *mut c_int,
) -> *mut *mut ibv_context {
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
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_free_devices(list: *mut *mut ibv_context) {
    // SAFETY: rdma_get_devices' calloc, or NULL.
    unsafe { libc::free(list.cast()) };
}

#[no_mangle]
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_set_option(
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
pub(super) unsafe extern "C" fn vrdma_rdmacm_unserved(name: *const c_char) -> i64 {
    // SAFETY: per the contract.
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    let kind: &'static str = Box::leak(name.into_boxed_str());
    explain(kind, &format!("{kind} is not served by vrdma's librdmacm"));
    set_errno(libc::ENOSYS);
    -1
}
