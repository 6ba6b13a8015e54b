//! The C edge for verbs objects (PD, MR, completion channel, CQ, QP, SRQ, AH) and the data
//! path that verbs.h inlines (`ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`,
//! `ibv_poll_cq`, `ibv_req_notify_cq` call through `context->ops`). Each object programs hold is the first field of a `#[repr(C)]` struct
//! that owns its guest-lib object, so the hot path finds guest-lib's rings with one cast: no
//! allocation, no lock beyond guest-lib's own, no system call while the backend's poller is
//! awake.
//!
//! By object: `cq.rs` CQs and completion channels (with the extended poll API), `qp.rs` QPs
//! and SRQs, `qp_ex.rs` the `ibv_wr_*` API of QPs made with send ops, which stages work
//! requests in the QP itself; this file PDs, MRs, AHs and what they share.

mod cq;
mod qp;
mod qp_ex;

pub(crate) use cq::*;
pub(crate) use qp::*;

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

use crate::context::context_of;
use crate::errno::{raise_errno, report_once, set_errno};
use crate::events::{Channel, ObjectKind};
use crate::translate::{self, send_flags};
use qp_ex::{Staged, SERVED_SEND_OPS};

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
struct VrdmaQp {
    qp_ex: ibv_qp_ex,
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

    fn staged(&self) -> Option<&Mutex<Staged>> {
        self.staged.as_ref()
    }

    /// One send request as guest-lib posts it; `flags` are `ibv_send_flags`, `ud` a UD
    /// QP's destination.
    ///
    /// # Safety
    /// `ud`'s AH must be NULL or one of this library's, alive while the request is.
    unsafe fn send_wr<'p>(
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

    fn inner(&self) -> &QueuePair {
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
