//! The C edge for verbs objects (PD, MR, completion channel, CQ, QP, SRQ, AH) and the data
//! path that verbs.h inlines (`ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`,
//! `ibv_poll_cq`, `ibv_req_notify_cq` call through `context->ops`). Each object programs hold is the first field of a `#[repr(C)]` struct
//! that owns its guest-lib object, so the hot path finds guest-lib's rings with one cast: no
//! allocation, no lock beyond guest-lib's own, no system call while the backend's poller is
//! awake.

use std::os::fd::AsRawFd;
use std::os::raw::{c_int, c_uint, c_void};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use rdma_sys::{
    ibv_ah, ibv_ah_attr, ibv_comp_channel, ibv_context, ibv_cq, ibv_cq_ex, ibv_cq_init_attr_ex,
    ibv_mr, ibv_pd, ibv_poll_cq_attr, ibv_qp, ibv_qp_attr, ibv_qp_ex, ibv_qp_init_attr,
    ibv_qp_init_attr_ex, ibv_qp_state, ibv_recv_wr, ibv_send_wr, ibv_srq, ibv_srq_attr,
    ibv_srq_init_attr, ibv_wc, ibv_wc_opcode,
};
use vrdma_guest::{
    qp_attr_mask, AddressHandle, AhAttr, Chain, CompletionQueue, MemoryRegion, Payload,
    ProtectionDomain, QpAttr, QpCaps, QueuePair, RecvWr, SendOp, SendWr, Sge, SharedReceiveQueue,
    UdDest, WorkCompletion,
};

use crate::abi::{context_of, raise_errno, report_once, set_errno};
use crate::events::{Channel, ObjectKind};
use crate::qp_ex::{self, Staged, SERVED_SEND_OPS};
use crate::translate::{self, send_flags};

#[repr(C)]
struct VrdmaPd {
    pd: ibv_pd,
    inner: ProtectionDomain,
}

#[repr(C)]
struct VrdmaMr {
    mr: ibv_mr,
    _inner: MemoryRegion,
}

#[repr(C)]
struct VrdmaChannel {
    channel: ibv_comp_channel,
    events: Arc<Channel>,
}

/// A CQ. `cq` begins with the `ibv_cq` programs hold (ibv_cq_ex extends it), so one pointer
/// serves both APIs.
#[repr(C)]
struct VrdmaCq {
    cq: ibv_cq_ex,
    inner: CompletionQueue,
    /// The completion `ibv_start_poll`/`ibv_next_poll` moved to, for the `ibv_wc_read_*`s.
    current: Mutex<ibv_wc>,
}

/// A QP. `qp_ex` begins with the `ibv_qp` programs hold, so one pointer serves both APIs.
#[repr(C)]
pub(crate) struct VrdmaQp {
    pub(crate) qp_ex: ibv_qp_ex,
    inner: QueuePair,
    caps: QpCaps,
    sq_sig_all: bool,
    /// The `ibv_wr_*` staging area, for QPs made with send ops (`ibv_create_qp_ex`).
    staged: Option<Mutex<Staged>>,
}

impl VrdmaQp {
    fn base(&self) -> &ibv_qp {
        &self.qp_ex.qp_base
    }

    pub(crate) fn staged(&self) -> Option<&Mutex<Staged>> {
        self.staged.as_ref()
    }

    /// One send request as guest-lib posts it; `flags` are `ibv_send_flags`, `ud` a UD
    /// QP's destination.
    ///
    /// # Safety
    /// `ud`'s AH must be NULL or one of this library's, alive while the request is.
    pub(crate) unsafe fn send_wr<'p>(
        &self,
        wr_id: u64,
        op: SendOp,
        payload: Payload<'p>,
        flags: u32,
        ud: Option<(*mut ibv_ah, u32, u32)>,
    ) -> Result<SendWr<'p>, c_int> {
        let is_ud = self.base().qp_type == rdma_sys::ibv_qp_type::IBV_QPT_UD;
        let ud = match ud {
            Some((ah, remote_qpn, remote_qkey)) if is_ud && !ah.is_null() => Some(UdDest {
                // SAFETY: per the contract.
                ah: &unsafe { ours::<VrdmaAh>(ah) }.inner,
                remote_qpn,
                remote_qkey,
            }),
            None if !is_ud => None,
            _ => return Err(libc::EINVAL),
        };
        Ok(SendWr {
            wr_id,
            op,
            payload,
            signaled: self.sq_sig_all || flags & send_flags::SIGNALED != 0,
            solicited: flags & send_flags::SOLICITED != 0,
            fence: flags & send_flags::FENCE != 0,
            ud,
        })
    }

    pub(crate) fn inner(&self) -> &QueuePair {
        &self.inner
    }
}

/// guest-lib's QP behind a program's.
///
/// # Safety
/// `qp` must be a live QP of this library's.
pub(crate) unsafe fn qp_of<'a>(qp: *mut ibv_qp) -> &'a QueuePair {
    // SAFETY: per the contract.
    unsafe { ours::<VrdmaQp>(qp) }.inner()
}

/// Posts the program's list of requests from `first` on through `chain`, with one doorbell
/// for all of them: 0, or an errno with `*bad_wr` at the first request not posted (those
/// before it are posted, as verbs does).
///
/// # Safety
/// `first` must be NULL or a valid list of requests that `next` walks, `bad_wr` NULL or
/// writable.
unsafe fn post_list<'c, F, R>(
    chain: vrdma_guest::Result<Chain<'c, F>>,
    first: *mut R,
    bad_wr: *mut *mut R,
    next: impl Fn(&R) -> *mut R,
    mut push: impl FnMut(&mut Chain<'c, F>, &R) -> Result<(), c_int>,
) -> c_int {
    let fail = |at: *mut R, errno: c_int| {
        if !bad_wr.is_null() {
            // SAFETY: the caller passes NULL or a pointer to fill.
            unsafe { *bad_wr = at };
        }
        errno
    };
    let mut chain = match chain {
        Ok(chain) => chain,
        Err(e) => return fail(first, raise_errno(&e)),
    };
    let mut result = 0;
    let mut current = first;
    while !current.is_null() {
        // SAFETY: per the contract.
        let request = unsafe { &*current };
        if let Err(errno) = push(&mut chain, request) {
            result = fail(current, errno);
            break;
        }
        current = next(request);
    }
    match chain.post() {
        Ok(()) => result,
        // Nothing pushed was made available: the whole list failed.
        Err(e) => fail(first, raise_errno(&e)),
    }
}

#[repr(C)]
struct VrdmaSrq {
    srq: ibv_srq,
    inner: SharedReceiveQueue,
    /// The limit last armed, for ibv_query_srq.
    limit: AtomicU32,
}

#[repr(C)]
struct VrdmaAh {
    ah: ibv_ah,
    inner: AddressHandle,
}

/// Completions moved per guest-lib poll, on the stack.
const POLL_BATCH: usize = 16;
/// Most inline bytes gathered from several SGEs (on the stack); a single SGE is sent from
/// where it is.
const MAX_GATHERED_INLINE: usize = 4096;
/// `IBV_ACCESS_OPTIONAL_RANGE`: hints a device may ignore (relaxed ordering, ...).
const ACCESS_OPTIONAL_RANGE: c_uint = 0x3ff0_0000;

/// Boxes `value` and returns a pointer to its first field, the C object.
fn into_c<T, C>(value: T) -> *mut C {
    Box::into_raw(Box::new(value)).cast()
}

/// # Safety
/// `object` must be the C object of a live `T` made by [`into_c`].
unsafe fn ours<'a, T>(object: *mut impl Sized) -> &'a T {
    // SAFETY: per the contract, `object` points at the first field of a `#[repr(C)]` T.
    unsafe { &*object.cast::<T>() }
}

/// Drops the `T` whose C object is `object`; 0, or EINVAL for NULL.
///
/// # Safety
/// `object` must be NULL or the C object of a live `T` made by [`into_c`], destroyed once.
unsafe fn destroy<T>(object: *mut impl Sized) -> c_int {
    if object.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: per the contract, the Box made by `into_c`, given back exactly once. guest-lib
    // destroys the device object when the value drops.
    drop(unsafe { Box::from_raw(object.cast::<T>()) });
    0
}

/// EBUSY, also in errno: the object is still used by others (libibverbs' answer when a PD,
/// CQ or SRQ is destroyed before what was made on it); nothing is destroyed.
fn busy() -> c_int {
    set_errno(libc::EBUSY);
    libc::EBUSY
}

/// Drops the events of object `handle` of `context`, which is being destroyed.
///
/// # Safety
/// `context` must be the program's live context of that object.
unsafe fn forget_events(context: *mut ibv_context, kind: ObjectKind, handle: u32) {
    // SAFETY: per the contract.
    unsafe { context_of(context) }.with_dispatcher(|d| d.forget(kind, handle));
}

// ---- PD, MR, AH --------------------------------------------------------------------------

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_alloc_pd(context: *mut ibv_context) -> *mut ibv_pd {
    if context.is_null() {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    }
    // SAFETY: a context from ibv_open_device, per the API contract.
    match unsafe { context_of(context) }.device.alloc_pd() {
        Ok(inner) => into_c(VrdmaPd {
            pd: ibv_pd {
                context,
                handle: inner.handle(),
            },
            inner,
        }),
        Err(e) => {
            report_once("alloc_pd", &format!("ibv_alloc_pd failed: {e}"));
            raise_errno(&e);
            ptr::null_mut()
        }
    }
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    // SAFETY: a PD from ibv_alloc_pd, per the API contract.
    if !pd.is_null() && unsafe { ours::<VrdmaPd>(pd) }.inner.in_use() {
        return busy();
    }
    // SAFETY: a PD of this library that nothing uses any more (checked above), which the
    // program deallocates once, per the API contract.
    unsafe { destroy::<VrdmaPd>(pd) }
}

#[no_mangle]
unsafe extern "C" fn ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: the same contract as ibv_reg_mr_iova2's, at the buffer's own address.
    unsafe { ibv_reg_mr_iova2(pd, addr, length, addr as u64, access as c_uint) }
}

/// Registers memory the program owns, where it is; peers and work requests address it from
/// `iova`, which must have `addr`'s offset within a page (EINVAL otherwise).
#[no_mangle]
unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    if pd.is_null() || addr.is_null() || length == 0 {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    }
    // SAFETY: a PD from ibv_alloc_pd, per the API contract.
    let owner = unsafe { ours::<VrdmaPd>(pd) };
    let access = access & !ACCESS_OPTIONAL_RANGE;
    // SAFETY: libibverbs' contract for registered memory is reg_user_mr's: the program's own
    // memory, kept mapped while registered.
    let registered = unsafe {
        owner
            .inner
            .reg_user_mr(addr as u64, length as u64, iova, access)
    };
    match registered {
        Ok(inner) => into_c(VrdmaMr {
            mr: ibv_mr {
                context: owner.pd.context,
                pd,
                addr,
                length,
                handle: inner.handle(),
                lkey: inner.lkey(),
                rkey: inner.rkey(),
            },
            _inner: inner,
        }),
        Err(e) => {
            report_once("reg_mr", &format!("ibv_reg_mr failed: {e}"));
            raise_errno(&e);
            ptr::null_mut()
        }
    }
}

/// The IBVERBS_1.7 form of ibv_reg_mr_iova2 (an `int` access).
#[no_mangle]
unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: the same contract.
    unsafe { ibv_reg_mr_iova2(pd, addr, length, iova, access as c_uint) }
}

/// 0: vrdma makes no promise that data lands in order (the conservative answer).
#[no_mangle]
unsafe extern "C" fn ibv_query_qp_data_in_order(
    _qp: *mut ibv_qp,
    _op: c_int,
    _flags: u32,
) -> c_int {
    0
}

/// `ibv_init_ah_from_wc`: the address vector back to the sender of a datagram received with
/// a GRH (UD; see [`translate::ah_from_grh`]).
#[no_mangle]
unsafe extern "C" fn ibv_init_ah_from_wc(
    _context: *mut ibv_context,
    port_num: u8,
    wc: *mut ibv_wc,
    grh: *mut rdma_sys::ibv_grh,
    ah_attr: *mut ibv_ah_attr,
) -> c_int {
    if wc.is_null() || grh.is_null() || ah_attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller's completion, the 40-byte GRH at the start of its receive buffer,
    // and an attribute block to fill, per the API contract.
    let (wc, grh, ah_attr) = unsafe { (&*wc, &*grh.cast::<[u8; 40]>(), &mut *ah_attr) };
    if wc.wc_flags & rdma_sys::ibv_wc_flags::IBV_WC_GRH.0 == 0 {
        // Without a GRH there is no address to answer on a RoCE port.
        set_errno(libc::EINVAL);
        return libc::EINVAL;
    }
    *ah_attr = ibv_ah_attr::from(&translate::ah_from_grh(grh, wc.sl, port_num));
    0
}

#[no_mangle]
unsafe extern "C" fn ibv_create_ah_from_wc(
    pd: *mut ibv_pd,
    wc: *mut ibv_wc,
    grh: *mut rdma_sys::ibv_grh,
    port_num: u8,
) -> *mut ibv_ah {
    // SAFETY: all-zero is a valid ibv_ah_attr.
    let mut attr: ibv_ah_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the caller's PD, completion and GRH, per the API contract.
    unsafe {
        if pd.is_null() || ibv_init_ah_from_wc((*pd).context, port_num, wc, grh, &mut attr) != 0 {
            return ptr::null_mut();
        }
        ibv_create_ah(pd, &mut attr)
    }
}

#[no_mangle]
unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    // SAFETY: an MR from ibv_reg_mr, deregistered once, per the API contract.
    unsafe { destroy::<VrdmaMr>(mr) }
}

#[no_mangle]
unsafe extern "C" fn ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    if pd.is_null() || attr.is_null() {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    }
    // SAFETY: a PD from ibv_alloc_pd and an attribute block the caller filled.
    let (owner, attr) = unsafe { (ours::<VrdmaPd>(pd), &*attr) };
    match owner.inner.create_ah(&AhAttr::from(attr)) {
        Ok(inner) => into_c(VrdmaAh {
            ah: ibv_ah {
                context: owner.pd.context,
                pd,
                handle: inner.handle(),
            },
            inner,
        }),
        Err(e) => {
            raise_errno(&e);
            ptr::null_mut()
        }
    }
}

#[no_mangle]
unsafe extern "C" fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    // SAFETY: an AH from ibv_create_ah, destroyed once, per the API contract.
    unsafe { destroy::<VrdmaAh>(ah) }
}

// ---- CQ ----------------------------------------------------------------------------------

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
unsafe fn create_cq(
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
unsafe fn advance(cq: *mut ibv_cq_ex) -> c_int {
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
unsafe fn current<T>(cq: *mut ibv_cq_ex, field: impl FnOnce(&ibv_wc) -> T) -> T {
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

// ---- QP ----------------------------------------------------------------------------------

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_create_qp(
    pd: *mut ibv_pd,
    init: *mut ibv_qp_init_attr,
) -> *mut ibv_qp {
    if pd.is_null() || init.is_null() {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    }
    // SAFETY: a PD from ibv_alloc_pd and an attribute block the caller filled.
    unsafe { create_qp(pd, &mut *init, false) }
}

/// `verbs_context.create_qp_ex`: what verbs.h's `ibv_create_qp_ex` calls. Served: a PD and
/// the send ops in [`SERVED_SEND_OPS`] (which make the `ibv_wr_*` API available).
pub(crate) unsafe extern "C" fn create_qp_ex(
    _context: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    }
    // SAFETY: an attribute block the caller filled.
    let attr = unsafe { &mut *attr };
    let with_pd = rdma_sys::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0;
    let with_send_ops = rdma_sys::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.0;
    // Creation flags are served only as none at all.
    let with_create_flags = rdma_sys::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_CREATE_FLAGS.0;
    let send_ops = attr.comp_mask & with_send_ops != 0;
    let create_flags = attr.comp_mask & with_create_flags != 0 && attr.create_flags != 0;
    if attr.comp_mask & !(with_pd | with_send_ops | with_create_flags) != 0
        || create_flags
        || (send_ops && attr.send_ops_flags & !SERVED_SEND_OPS != 0)
    {
        report_once(
            "create_qp_ex",
            "ibv_create_qp_ex: vrdma serves a PD and the send ops SEND, SEND_WITH_IMM, RDMA_WRITE, RDMA_WRITE_WITH_IMM, RDMA_READ and the two atomics only (no creation flags)",
        );
        set_errno(libc::EOPNOTSUPP);
        return ptr::null_mut();
    }
    if attr.comp_mask & with_pd == 0 || attr.pd.is_null() {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    }
    let mut init = ibv_qp_init_attr {
        qp_context: attr.qp_context,
        send_cq: attr.send_cq,
        recv_cq: attr.recv_cq,
        srq: attr.srq,
        cap: attr.cap,
        qp_type: attr.qp_type,
        sq_sig_all: attr.sq_sig_all,
    };
    // SAFETY: the PD the caller named, per the API contract.
    let qp = unsafe { create_qp(attr.pd, &mut init, send_ops) };
    attr.cap = init.cap;
    qp
}

/// Makes a QP from `init` (whose `cap` learns what the QP got); with `send_ops`, also a
/// staging area for the `ibv_wr_*` API.
///
/// # Safety
/// `pd` must be a live PD of this library, and `init`'s CQs and SRQ this library's too.
unsafe fn create_qp(pd: *mut ibv_pd, init: &mut ibv_qp_init_attr, send_ops: bool) -> *mut ibv_qp {
    // SAFETY: per the contract.
    let owner = unsafe { ours::<VrdmaPd>(pd) };
    let Some(qp_type) = translate::qp_type(init.qp_type) else {
        report_once("qp_type", "vrdma serves RC, UC and UD QPs only");
        set_errno(libc::EOPNOTSUPP);
        return ptr::null_mut();
    };
    if init.send_cq.is_null() || init.recv_cq.is_null() {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    }
    // SAFETY: CQs from ibv_create_cq, per the contract.
    let (send_cq, recv_cq) =
        unsafe { (ours::<VrdmaCq>(init.send_cq), ours::<VrdmaCq>(init.recv_cq)) };
    let cap = init.cap;
    let mut builder = QueuePair::builder(qp_type, &send_cq.inner).recv_cq(&recv_cq.inner);
    if !init.srq.is_null() {
        // SAFETY: an SRQ from ibv_create_srq, per the contract.
        builder = builder.srq(&unsafe { ours::<VrdmaSrq>(init.srq) }.inner);
    }
    let built = builder
        .max_send_wr(cap.max_send_wr)
        .max_recv_wr(cap.max_recv_wr)
        .max_send_sge(cap.max_send_sge)
        .max_recv_sge(cap.max_recv_sge)
        .max_inline_data(cap.max_inline_data)
        .sq_sig_all(init.sq_sig_all != 0)
        .build(&owner.inner);
    let inner = match built {
        Ok(inner) => inner,
        Err(e) => {
            report_once("create_qp", &format!("ibv_create_qp failed: {e}"));
            raise_errno(&e);
            return ptr::null_mut();
        }
    };
    let caps = inner.caps();
    init.cap = (&caps).into();
    // SAFETY: ibv_qp_ex is C data (an ibv_qp, integers, function pointers as Options) valid
    // as all-zero bytes (see ibv_cq).
    let mut qp_ex: ibv_qp_ex = unsafe { std::mem::zeroed() };
    let qp = &mut qp_ex.qp_base;
    qp.context = owner.pd.context;
    qp.qp_context = init.qp_context;
    qp.pd = pd;
    qp.send_cq = init.send_cq;
    qp.recv_cq = init.recv_cq;
    qp.srq = init.srq;
    qp.handle = inner.handle();
    qp.qp_num = inner.qp_num();
    qp.state = ibv_qp_state::IBV_QPS_RESET;
    qp.qp_type = init.qp_type;
    let staged = send_ops.then(|| {
        qp_ex::install(&mut qp_ex);
        Staged::new(caps.max_send_wr, caps.max_send_sge, caps.max_inline_data)
    });
    let handle = qp_ex.qp_base.handle;
    let created: *mut ibv_qp = into_c(VrdmaQp {
        qp_ex,
        inner,
        caps,
        sq_sig_all: init.sq_sig_all != 0,
        staged,
    });
    // SAFETY: the PD's context is the program's live context, per the API contract.
    unsafe { context_of(owner.pd.context) }
        .with_dispatcher(|d| d.register(ObjectKind::Qp, handle, created as usize));
    created
}

/// The `ibv_wr_*` face of a QP made with send ops; NULL (EOPNOTSUPP) for others.
#[no_mangle]
unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp_ex {
    // SAFETY: a QP from ibv_create_qp(_ex), per the API contract.
    if !qp.is_null() && unsafe { ours::<VrdmaQp>(qp) }.staged.is_some() {
        return qp.cast();
    }
    set_errno(libc::EOPNOTSUPP);
    ptr::null_mut()
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    if qp.is_null() || attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a QP from ibv_create_qp and an attribute block the caller filled.
    let (ours_qp, attr) = unsafe { (ours::<VrdmaQp>(qp), &*attr) };
    let mask = mask as u32;
    let Ok(ours_attr) = QpAttr::from_ibv(attr, mask) else {
        report_once(
            "modify_qp",
            "ibv_modify_qp: a QP state that is none of ibverbs'",
        );
        return libc::EINVAL;
    };
    match ours_qp.inner.modify(&ours_attr, mask) {
        Ok(()) => {
            if mask & qp_attr_mask::STATE != 0 {
                // SAFETY: `qp` is the program's live QP; `state` is the field libibverbs
                // keeps current for it.
                unsafe { (*qp).state = attr.qp_state };
            }
            0
        }
        Err(e) => {
            report_once("modify_qp", &format!("ibv_modify_qp failed: {e}"));
            raise_errno(&e)
        }
    }
}

#[no_mangle]
unsafe extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    if qp.is_null() || attr.is_null() || init.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a QP from ibv_create_qp and two blocks to fill.
    let (ours_qp, attr, init) = unsafe { (ours::<VrdmaQp>(qp), &mut *attr, &mut *init) };
    match ours_qp.inner.query() {
        Ok(current) => {
            translate::fill_qp_attr(attr, &current, &ours_qp.caps);
            init.qp_context = ours_qp.base().qp_context;
            init.send_cq = ours_qp.base().send_cq;
            init.recv_cq = ours_qp.base().recv_cq;
            init.srq = ours_qp.base().srq;
            init.cap = (&ours_qp.caps).into();
            init.qp_type = ours_qp.base().qp_type;
            init.sq_sig_all = ours_qp.sq_sig_all.into();
            0
        }
        Err(e) => raise_errno(&e),
    }
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    if !qp.is_null() {
        // SAFETY: a QP from ibv_create_qp, per the API contract; its context outlives it.
        unsafe { forget_events((*qp).context, ObjectKind::Qp, (*qp).handle) };
    }
    // SAFETY: destroyed once, per the API contract.
    unsafe { destroy::<VrdmaQp>(qp) }
}

/// The SGEs of a work request, as guest-lib's (same layout) where they are.
///
/// # Safety
/// `sg_list` must point at `num_sge` SGEs (or `num_sge` be 0).
unsafe fn sges<'a>(sg_list: *mut rdma_sys::ibv_sge, num_sge: c_int) -> Result<&'a [Sge], c_int> {
    match usize::try_from(num_sge) {
        Ok(0) => Ok(&[]),
        Ok(n) if !sg_list.is_null() => {
            // SAFETY: per the contract; ibv_sge and Sge have one layout (translate's test).
            Ok(unsafe { std::slice::from_raw_parts(sg_list.cast::<Sge>(), n) })
        }
        _ => Err(libc::EINVAL),
    }
}

/// `ops.post_send`: 0, or an errno with `*bad_wr` at the first request not posted.
pub(crate) unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: a QP from ibv_create_qp, per the API contract.
    let ours_qp = unsafe { ours::<VrdmaQp>(qp) };
    let mut gathered = [0u8; MAX_GATHERED_INLINE];
    let push = |chain: &mut Chain<'_, _>, request: &ibv_send_wr| {
        // SAFETY: the request's own SGE list.
        let list = unsafe { sges(request.sg_list, request.num_sge) }?;
        let op = translate::send_op(request)?;
        let payload = if request.send_flags & send_flags::INLINE != 0 {
            // SAFETY: inline data is read from the program's buffers, which the SGEs
            // describe and the program vouches for.
            Payload::Inline(unsafe { inline_bytes(list, &mut gathered)? })
        } else {
            Payload::Sges(list)
        };
        // SAFETY: for UD QPs the program fills `wr.ud`, with an AH of this library.
        let ud = unsafe { request.wr.ud };
        let ud = Some((ud.ah, ud.remote_qpn, ud.remote_qkey))
            .filter(|_| ours_qp.base().qp_type == rdma_sys::ibv_qp_type::IBV_QPT_UD);
        // SAFETY: the AH, for UD QPs, is the program's, one of this library's and alive while
        // the request is posted, per the API contract.
        let send = unsafe { ours_qp.send_wr(request.wr_id, op, payload, request.send_flags, ud) }?;
        chain.push(&send).map_err(|e| raise_errno(&e))
    };
    // SAFETY: the program's list of valid work requests, per the API contract.
    unsafe { post_list(ours_qp.inner.send_chain(), wr, bad_wr, |r| r.next, push) }
}

/// The inline bytes the SGEs describe: in place for one SGE, gathered into `gathered` for
/// several. An SGE of no bytes names no memory: its address may be anything, NULL too (UCX
/// posts such SGEs), and is not read.
///
/// # Safety
/// Each SGE of a length other than 0 must describe readable memory of the program.
unsafe fn inline_bytes<'a>(list: &'a [Sge], gathered: &'a mut [u8]) -> Result<&'a [u8], c_int> {
    /// # Safety
    /// As `inline_bytes`', for this one SGE.
    unsafe fn bytes_of<'b>(sge: &Sge) -> &'b [u8] {
        if sge.length == 0 {
            return &[];
        }
        // SAFETY: per the contract, a readable range of the program's.
        unsafe { std::slice::from_raw_parts(sge.addr as *const u8, sge.length as usize) }
    }
    if let [one] = list {
        // SAFETY: per the contract.
        return Ok(unsafe { bytes_of(one) });
    }
    let mut len = 0;
    for sge in list {
        let n = sge.length as usize;
        let room = gathered.get_mut(len..len + n).ok_or(libc::EINVAL)?;
        // SAFETY: per the contract; `room` is this library's stack buffer.
        room.copy_from_slice(unsafe { bytes_of(sge) });
        len += n;
    }
    Ok(&gathered[..len])
}

/// `ops.post_recv`: 0, or an errno with `*bad_wr` at the first request not posted.
pub(crate) unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: a QP from ibv_create_qp, per the API contract.
    let ours_qp = unsafe { ours::<VrdmaQp>(qp) };
    // SAFETY: the program's list of receive requests, per the API contract.
    unsafe { post_receives(ours_qp.inner.recv_chain(), wr, bad_wr) }
}

/// Posts the program's list of receive requests at `wr` through `chain`, where their SGEs
/// are.
///
/// # Safety
/// `wr` must be NULL or a valid list of receive requests, `bad_wr` NULL or writable.
unsafe fn post_receives<'c, F>(
    chain: vrdma_guest::Result<Chain<'c, F>>,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int
where
    F: for<'s> Fn(u64, &RecvWr<'s>) -> vrdma_guest::Result<()>,
{
    let push = |chain: &mut Chain<'c, F>, request: &ibv_recv_wr| {
        // SAFETY: the request's own SGE list.
        let list = unsafe { sges(request.sg_list, request.num_sge) }?;
        let recv = RecvWr {
            wr_id: request.wr_id,
            sges: list,
        };
        chain.push(&recv).map_err(|e| raise_errno(&e))
    };
    // SAFETY: per the contract.
    unsafe { post_list(chain, wr, bad_wr, |r| r.next, push) }
}

// ---- SRQ ---------------------------------------------------------------------------------

#[no_mangle]
unsafe extern "C" fn ibv_create_srq(pd: *mut ibv_pd, init: *mut ibv_srq_init_attr) -> *mut ibv_srq {
    if pd.is_null() || init.is_null() {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    }
    // SAFETY: a PD from ibv_alloc_pd and an attribute block the caller filled.
    let (owner, init) = unsafe { (ours::<VrdmaPd>(pd), &mut *init) };
    let created = owner
        .inner
        .create_srq(init.attr.max_wr, init.attr.max_sge)
        .and_then(|inner| {
            if init.attr.srq_limit != 0 {
                inner.set_limit(init.attr.srq_limit)?;
            }
            Ok(inner)
        });
    match created {
        Ok(inner) => {
            init.attr.max_wr = inner.depth(); // the caller learns what it got
                                              // SAFETY: ibv_srq is C data valid as all-zero bytes (see ibv_cq).
            let mut srq: ibv_srq = unsafe { std::mem::zeroed() };
            srq.context = owner.pd.context;
            srq.srq_context = init.srq_context;
            srq.pd = pd;
            srq.handle = inner.handle();
            let handle = srq.handle;
            let limit = AtomicU32::new(init.attr.srq_limit);
            let created: *mut ibv_srq = into_c(VrdmaSrq { srq, inner, limit });
            // SAFETY: the PD's context is the program's live context, per the API contract.
            unsafe { context_of(owner.pd.context) }
                .with_dispatcher(|d| d.register(ObjectKind::Srq, handle, created as usize));
            created
        }
        Err(e) => {
            report_once("create_srq", &format!("ibv_create_srq failed: {e}"));
            raise_errno(&e);
            ptr::null_mut()
        }
    }
}

/// Only `srq_limit` can be modified, and limit events are not served yet.
#[no_mangle]
unsafe extern "C" fn ibv_modify_srq(
    srq: *mut ibv_srq,
    attr: *mut ibv_srq_attr,
    mask: c_int,
) -> c_int {
    if srq.is_null() || attr.is_null() {
        return libc::EINVAL;
    }
    if mask as u32 != vrdma_guest::spec::ctrl::SRQ_ATTR_LIMIT {
        report_once(
            "srq_resize",
            "ibv_modify_srq: vrdma SRQs cannot be resized; only the limit can change",
        );
        return libc::EINVAL;
    }
    // SAFETY: an SRQ from ibv_create_srq and the caller's attributes.
    let (ours_srq, attr) = unsafe { (ours::<VrdmaSrq>(srq), &*attr) };
    match ours_srq.inner.set_limit(attr.srq_limit) {
        Ok(()) => {
            ours_srq.limit.store(attr.srq_limit, Ordering::Relaxed);
            0
        }
        Err(e) => raise_errno(&e),
    }
}

#[no_mangle]
unsafe extern "C" fn ibv_query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    if srq.is_null() || attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: an SRQ from ibv_create_srq and a block to fill.
    let (ours_srq, attr) = unsafe { (ours::<VrdmaSrq>(srq), &mut *attr) };
    attr.max_wr = ours_srq.inner.depth();
    attr.max_sge = ours_srq.inner.max_sge();
    attr.srq_limit = ours_srq.limit.load(Ordering::Relaxed);
    0
}

#[no_mangle]
unsafe extern "C" fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    if !srq.is_null() {
        // SAFETY: an SRQ from ibv_create_srq, per the API contract.
        if unsafe { ours::<VrdmaSrq>(srq) }.inner.in_use() {
            return busy();
        }
        // SAFETY: an SRQ from ibv_create_srq, per the API contract; its context outlives it.
        unsafe { forget_events((*srq).context, ObjectKind::Srq, (*srq).handle) };
    }
    // SAFETY: destroyed once, per the API contract.
    unsafe { destroy::<VrdmaSrq>(srq) }
}

/// `ops.post_srq_recv`: 0, or an errno with `*bad_wr` at the first request not posted.
pub(crate) unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: an SRQ from ibv_create_srq, per the API contract.
    let queue = unsafe { ours::<VrdmaSrq>(srq) };
    // SAFETY: the program's list of receive requests, per the API contract.
    unsafe { post_receives(queue.inner.recv_chain(), wr, bad_wr) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_sges_of_no_bytes_are_not_read_whatever_their_address() {
        let payload = *b"vrdma";
        let mut gathered = [0u8; 64];
        let empty = Sge {
            addr: 0,
            length: 0,
            lkey: 0,
        };
        let bytes = Sge {
            addr: payload.as_ptr() as u64,
            length: payload.len() as u32,
            lkey: 0,
        };
        // SAFETY: `bytes` describes `payload`; `empty` describes nothing.
        unsafe {
            assert_eq!(inline_bytes(&[empty], &mut gathered), Ok(&[][..]));
            assert_eq!(
                inline_bytes(&[bytes, empty], &mut gathered),
                Ok(&payload[..])
            );
            assert_eq!(
                inline_bytes(&[empty, bytes, empty], &mut gathered),
                Ok(&payload[..])
            );
        }
    }
}
