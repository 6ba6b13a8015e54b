//! Queue pairs and shared receive queues: creation (also ibv_create_qp_ex), state changes,
//! queries, and posting sends and receives.

use super::*;

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
pub(super) unsafe fn create_qp(
    pd: *mut ibv_pd,
    init: &mut ibv_qp_init_attr,
    send_ops: bool,
) -> *mut ibv_qp {
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
pub(super) unsafe fn sges<'a>(
    sg_list: *mut rdma_sys::ibv_sge,
    num_sge: c_int,
) -> Result<&'a [Sge], c_int> {
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
pub(super) unsafe fn inline_bytes<'a>(
    list: &'a [Sge],
    gathered: &'a mut [u8],
) -> Result<&'a [u8], c_int> {
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
pub(super) unsafe fn post_receives<'c, F>(
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
