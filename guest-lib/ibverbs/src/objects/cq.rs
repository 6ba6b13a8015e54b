//! Completion queues and channels: ibv_create_cq(_ex) and the extended poll API, resizing,
//! completion events, polling and arming.

use super::*;

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_create_comp_channel(
    context: *mut ibv_context,
) -> *mut ibv_comp_channel {
    if context.is_null() {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    }
    let events = match Channel::new() {
        Ok(events) => events,
        Err(e) => {
            set_errno(e.raw_os_error().unwrap_or(libc::EIO));
            return ptr::null_mut();
        }
    };
    into_c(VrdmaChannel {
        channel: ibv_comp_channel {
            context,
            fd: events.as_raw_fd(),
            refcnt: 0,
        },
        events,
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_destroy_comp_channel(channel: *mut ibv_comp_channel) -> c_int {
    // SAFETY: a channel from ibv_create_comp_channel, per the API contract.
    if !channel.is_null() && unsafe { (*channel).refcnt } != 0 {
        return busy(); // CQs still report to it, as libibverbs refuses too
    }
    // SAFETY: a channel of this library that no CQ reports to (checked above), destroyed
    // once, per the API contract.
    unsafe { destroy::<VrdmaChannel>(channel) }
}

/// The next CQ with a completion event on `channel`: 0, or -1 with errno (EAGAIN when the
/// channel's fd is non-blocking and there is none).
#[no_mangle]
unsafe extern "C" fn ibv_get_cq_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    if channel.is_null() || cq.is_null() || cq_context.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: a channel from ibv_create_comp_channel, per the API contract.
    match unsafe { ours::<VrdmaChannel>(channel) }.events.take() {
        Ok(ready) => {
            let ready = ready as *mut ibv_cq;
            // SAFETY: `ready` is a live CQ of this channel (destroying a CQ forgets its
            // events); the out-pointers are the caller's.
            unsafe {
                *cq = ready;
                *cq_context = (*ready).cq_context;
            }
            0
        }
        Err(errno) => {
            set_errno(errno);
            -1
        }
    }
}

#[no_mangle]
unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: c_uint) {
    if !cq.is_null() {
        // SAFETY: a CQ from ibv_create_cq, per the API contract; the count is the field
        // libibverbs keeps for it.
        unsafe { (*cq).comp_events_completed = (*cq).comp_events_completed.wrapping_add(nevents) };
    }
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_create_cq(
    context: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    let (Ok(cqe), Ok(comp_vector)) = (u32::try_from(cqe), u32::try_from(comp_vector)) else {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    };
    // SAFETY: the caller's context and channel, per the API contract.
    unsafe { create_cq(context, cqe, cq_context, channel, comp_vector) }.cast()
}

/// Completion vectors a context has (`num_comp_vectors`): one, the device's event queue.
pub(crate) const COMP_VECTORS: c_int = 1;

/// `verbs_context.create_cq_ex`: a CQ with the `ibv_start_poll` API as well.
pub(crate) unsafe extern "C" fn create_cq_ex(
    context: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    }
    // SAFETY: an attribute block the caller filled.
    let attr = unsafe { &*attr };
    if attr.wc_flags & !translate::SERVED_CQ_EX_WC_FLAGS != 0
        || attr.comp_mask & !translate::CQ_INIT_ATTR_MASK_FLAGS != 0
    {
        report_once(
            "create_cq_ex",
            "ibv_create_cq_ex: vrdma serves the completion fields of ibv_poll_cq only (no timestamps, VLANs, flow tags, tag matching) and no parent domain",
        );
        set_errno(libc::EOPNOTSUPP);
        return ptr::null_mut();
    }
    // SAFETY: the caller's context and channel, per the API contract.
    let created = unsafe {
        create_cq(
            context,
            attr.cqe,
            attr.cq_context,
            attr.channel,
            attr.comp_vector,
        )
    };
    if let Some(created) = NonNull::new(created) {
        // SAFETY: the CQ just made, not yet handed out.
        let cq = unsafe { &mut (*created.as_ptr()).cq };
        cq.start_poll = Some(start_poll);
        cq.next_poll = Some(next_poll);
        cq.end_poll = Some(end_poll);
        cq.read_opcode = Some(read_opcode);
        cq.read_vendor_err = Some(read_vendor_err);
        cq.read_byte_len = Some(read_byte_len);
        cq.read_imm_data = Some(read_imm_data);
        cq.read_qp_num = Some(read_qp_num);
        cq.read_src_qp = Some(read_src_qp);
        cq.read_wc_flags = Some(read_wc_flags);
        cq.read_slid = Some(read_slid);
        cq.read_sl = Some(read_sl);
        cq.read_dlid_path_bits = Some(read_dlid_path_bits);
    }
    created.cast()
}

/// A CQ of at least `cqe` entries reporting to `channel` (may be NULL) on completion vector
/// `comp_vector` (below [`COMP_VECTORS`]).
///
/// # Safety
/// `context` and `channel` must be NULL or the program's live objects of this library.
pub(super) unsafe fn create_cq(
    context: *mut ibv_context,
    cqe: u32,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: u32,
) -> *mut VrdmaCq {
    if context.is_null() || comp_vector >= COMP_VECTORS as u32 {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    }
    // `cqe` is a minimum; vrdma's CQ depths are powers of two.
    let Some(depth) = cqe.max(2).checked_next_power_of_two() else {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    };
    // SAFETY: a context from ibv_open_device, per the contract.
    let ours_context = unsafe { context_of(context) };
    let inner = match ours_context.device.create_cq(depth) {
        Ok(inner) => inner,
        Err(e) => {
            report_once("create_cq", &format!("ibv_create_cq failed: {e}"));
            raise_errno(&e);
            return ptr::null_mut();
        }
    };
    // SAFETY: ibv_cq_ex is C data (pointers, integers, a pthread mutex and condition
    // variable, function pointers as Options), valid as all-zero bytes (their static
    // initialisers on glibc).
    let mut cq: ibv_cq_ex = unsafe { std::mem::zeroed() };
    cq.context = context;
    cq.channel = channel;
    cq.cq_context = cq_context;
    cq.handle = inner.handle();
    cq.cqe = c_int::try_from(inner.depth()).unwrap_or(c_int::MAX);
    let handle = cq.handle;
    let created: *mut VrdmaCq = into_c(VrdmaCq {
        cq,
        inner,
        current: Mutex::new(translate::wc(&WorkCompletion::default())),
    });
    ours_context.with_dispatcher(|dispatcher| {
        dispatcher.register(ObjectKind::Cq, handle, created as usize);
        if !channel.is_null() {
            // SAFETY: a channel from ibv_create_comp_channel, per the contract.
            let events = Arc::clone(&unsafe { ours::<VrdmaChannel>(channel) }.events);
            dispatcher.watch(handle, created as usize, events);
            // SAFETY: the same live channel; the dispatcher's lock, held here, serialises
            // every change of its refcnt.
            unsafe { (*channel).refcnt += 1 };
        }
    });
    created
}

// The ibv_cq_ex poll API. One completion at a time, moved from guest-lib's ring into
// `current`; `status` and `wr_id` are fields of ibv_cq_ex the program reads directly.

/// Moves the next completion into `current`: 0, ENOENT when there is none, or an errno.
///
/// # Safety
/// `cq` must be a live CQ of [`create_cq_ex`], polled by one thread at a time.
pub(super) unsafe fn advance(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: per the contract; `ours` covers the whole object, but the program only
    // reads the fields written below, between calls.
    let ours_cq = unsafe { ours::<VrdmaCq>(cq) };
    let mut next = [WorkCompletion::default()];
    match ours_cq.inner.poll(&mut next) {
        Ok(0) => libc::ENOENT,
        Ok(_) => {
            let wc = translate::wc(&next[0]);
            // SAFETY: the fields the API defines for the program to read.
            unsafe {
                (*cq).status = wc.status;
                (*cq).wr_id = wc.wr_id;
            }
            *ours_cq.current.lock().unwrap_or_else(|e| e.into_inner()) = wc;
            0
        }
        Err(e) => raise_errno(&e),
    }
}

unsafe extern "C" fn start_poll(cq: *mut ibv_cq_ex, _attr: *mut ibv_poll_cq_attr) -> c_int {
    // SAFETY: a CQ from ibv_create_cq_ex, per the API contract.
    unsafe { advance(cq) }
}

unsafe extern "C" fn next_poll(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: a CQ from ibv_create_cq_ex that ibv_start_poll was called on, per the API
    // contract.
    unsafe { advance(cq) }
}

unsafe extern "C" fn end_poll(_cq: *mut ibv_cq_ex) {}

/// A field of the current completion.
///
/// # Safety
/// `cq` must be a live CQ of [`create_cq_ex`].
pub(super) unsafe fn current<T>(cq: *mut ibv_cq_ex, field: impl FnOnce(&ibv_wc) -> T) -> T {
    // SAFETY: per the contract.
    field(
        &unsafe { ours::<VrdmaCq>(cq) }
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner()),
    )
}

/// The `ibv_cq_ex` accessors (`ibv_wc_read_*`): each reads one field of the completion the
/// last `ibv_start_poll`/`ibv_next_poll` took.
macro_rules! completion_field_readers {
    ($($name:ident -> $ty:ty = |$wc:ident| $field:expr;)+) => {$(
        unsafe extern "C" fn $name(cq: *mut ibv_cq_ex) -> $ty {
            // SAFETY: libibverbs calls the accessors only on the CQ they were set on, one of
            // create_cq_ex, which the program keeps alive while it polls (the API contract);
            // every field is plain data, valid in any bit pattern.
            unsafe { current(cq, |$wc| $field) }
        }
    )+};
}

completion_field_readers! {
    read_opcode -> ibv_wc_opcode::Type = |wc| wc.opcode;
    read_vendor_err -> u32 = |wc| wc.vendor_err;
    read_byte_len -> u32 = |wc| wc.byte_len;
    read_imm_data -> u32 = |wc| wc.imm_data_invalidated_rkey_union.imm_data;
    read_qp_num -> u32 = |wc| wc.qp_num;
    read_src_qp -> u32 = |wc| wc.src_qp;
    read_wc_flags -> c_uint = |wc| wc.wc_flags;
    read_slid -> u32 = |wc| u32::from(wc.slid);
    read_sl -> u8 = |wc| wc.sl;
    read_dlid_path_bits -> u8 = |wc| wc.dlid_path_bits;
}

/// Moves the CQ to a ring of at least `cqe` entries (a power of two), keeping the
/// completions not yet polled; EINVAL when it holds more than that, as on rxe.
#[no_mangle]
unsafe extern "C" fn ibv_resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    let depth = u32::try_from(cqe)
        .ok()
        .filter(|&cqe| cqe > 0)
        .and_then(|cqe| cqe.max(2).checked_next_power_of_two());
    let (Some(depth), false) = (depth, cq.is_null()) else {
        return libc::EINVAL;
    };
    // SAFETY: a CQ from ibv_create_cq, per the API contract.
    let ours_cq = unsafe { ours::<VrdmaCq>(cq) };
    match ours_cq.inner.resize(depth) {
        Ok(()) => {
            // SAFETY: the program's live CQ; `cqe` is the field libibverbs keeps current.
            unsafe { (*cq).cqe = c_int::try_from(depth).unwrap_or(c_int::MAX) };
            0
        }
        Err(e) => {
            report_once("resize_cq", &format!("ibv_resize_cq failed: {e}"));
            raise_errno(&e)
        }
    }
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    if cq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a CQ from ibv_create_cq, per the API contract.
    if unsafe { ours::<VrdmaCq>(cq) }.inner.in_use() {
        return busy();
    }
    // SAFETY: the same live CQ; these fields are plain data set at its creation.
    let (context, channel, handle) = unsafe { ((*cq).context, (*cq).channel, (*cq).handle) };
    // SAFETY: the CQ's context and channel outlive it, per the API contract.
    unsafe { context_of(context) }.with_dispatcher(|dispatcher| {
        dispatcher.forget(ObjectKind::Cq, handle);
        if !channel.is_null() {
            // SAFETY: the CQ's channel, alive (it outlives the CQ); the dispatcher's lock,
            // held here, serialises every change of its refcnt.
            unsafe { (*channel).refcnt -= 1 };
        }
    });
    // SAFETY: destroyed once, per the API contract.
    unsafe { destroy::<VrdmaCq>(cq) }
}

/// `ops.poll_cq`: up to `num_entries` completions into `wc`; how many, or -1.
pub(crate) unsafe extern "C" fn poll_cq(
    cq: *mut ibv_cq,
    num_entries: c_int,
    wc: *mut ibv_wc,
) -> c_int {
    // SAFETY: a CQ from ibv_create_cq, per the API contract.
    let cq = unsafe { ours::<VrdmaCq>(cq) };
    let wanted = usize::try_from(num_entries).unwrap_or(0);
    let mut batch = [WorkCompletion::default(); POLL_BATCH];
    let mut done = 0;
    while done < wanted {
        let room = (wanted - done).min(POLL_BATCH);
        let polled = match cq.inner.poll(&mut batch[..room]) {
            Ok(polled) => polled,
            Err(_) if done > 0 => break,
            Err(e) => {
                raise_errno(&e);
                return -1;
            }
        };
        for (i, completion) in batch[..polled].iter().enumerate() {
            // SAFETY: the caller's array holds `num_entries` entries; done + i < that.
            unsafe { wc.add(done + i).write(translate::wc(completion)) };
        }
        done += polled;
        if polled < room {
            break;
        }
    }
    done as c_int
}

/// `ops.req_notify_cq`.
pub(crate) unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: a CQ from ibv_create_cq, per the API contract.
    match unsafe { ours::<VrdmaCq>(cq) }
        .inner
        .req_notify(solicited_only != 0)
    {
        Ok(()) => 0,
        Err(e) => raise_errno(&e),
    }
}
