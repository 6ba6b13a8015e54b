//! The C edge of the extended QP API (`ibv_qp_ex`, `ibv_wr_*`): between `ibv_wr_start` and
//! `ibv_wr_complete` a program builds work requests one call at a time; they are staged in
//! buffers the QP reserved when it was made (no allocation while the reservation lasts) and
//! posted to guest-lib's ring at `ibv_wr_complete`.

use std::ops::Range;
use std::os::raw::{c_int, c_void};
use std::sync::Mutex;

use rdma_sys::{ibv_ah, ibv_data_buf, ibv_qp_create_send_ops_flags as Ops, ibv_qp_ex, ibv_sge};
use vrdma_guest::{Payload, SendOp, Sge};

use super::VrdmaQp;
use crate::errno::raise_errno;

/// `enum ibv_qp_create_send_ops_flags` this library serves.
pub(super) const SERVED_SEND_OPS: u64 = Ops::IBV_QP_EX_WITH_RDMA_WRITE.0 as u64
    | Ops::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM.0 as u64
    | Ops::IBV_QP_EX_WITH_SEND.0 as u64
    | Ops::IBV_QP_EX_WITH_SEND_WITH_IMM.0 as u64
    | Ops::IBV_QP_EX_WITH_RDMA_READ.0 as u64
    | Ops::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP.0 as u64
    | Ops::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD.0 as u64;

enum StagedPayload {
    None,
    Sges(Range<usize>),
    Inline(Range<usize>),
}

struct StagedWr {
    wr_id: u64,
    flags: u32,
    op: SendOp,
    payload: StagedPayload,
    /// UD destination: the `ibv_ah` address, remote QPN and Q_Key.
    ud: Option<(usize, u32, u32)>,
}

/// Work requests between `ibv_wr_start` and `ibv_wr_complete`.
pub(super) struct Staged {
    wrs: Vec<StagedWr>,
    sges: Vec<Sge>,
    inline: Vec<u8>,
    /// The first misuse (a setter with no request, an unserved operation): what
    /// `ibv_wr_complete` answers, posting nothing.
    error: Option<c_int>,
}

impl Staged {
    pub(super) fn new(depth: u32, max_sge: u32, max_inline: u32) -> Mutex<Staged> {
        let depth = depth as usize;
        Mutex::new(Staged {
            wrs: Vec::with_capacity(depth),
            sges: Vec::with_capacity(depth * max_sge.max(1) as usize),
            inline: Vec::with_capacity(depth * max_inline as usize),
            error: None,
        })
    }

    fn clear(&mut self) {
        self.wrs.clear();
        self.sges.clear();
        self.inline.clear();
        self.error = None;
    }

    fn last(&mut self) -> Option<&mut StagedWr> {
        let last = self.wrs.last_mut();
        if last.is_none() {
            self.error.get_or_insert(libc::EINVAL);
        }
        last
    }
}

/// Installs the served `wr_*` entry points in `qp_ex`.
pub(super) fn install(qp_ex: &mut ibv_qp_ex) {
    qp_ex.wr_start = Some(wr_start);
    qp_ex.wr_complete = Some(wr_complete);
    qp_ex.wr_abort = Some(wr_abort);
    qp_ex.wr_send = Some(wr_send);
    qp_ex.wr_send_imm = Some(wr_send_imm);
    qp_ex.wr_rdma_write = Some(wr_rdma_write);
    qp_ex.wr_rdma_write_imm = Some(wr_rdma_write_imm);
    qp_ex.wr_rdma_read = Some(wr_rdma_read);
    qp_ex.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
    qp_ex.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
    qp_ex.wr_set_sge = Some(wr_set_sge);
    qp_ex.wr_set_sge_list = Some(wr_set_sge_list);
    qp_ex.wr_set_inline_data = Some(wr_set_inline_data);
    qp_ex.wr_set_inline_data_list = Some(wr_set_inline_data_list);
    qp_ex.wr_set_ud_addr = Some(wr_set_ud_addr);
}

/// Runs `f` on the staging area of the QP behind `qp_ex`.
///
/// # Safety
/// `qp_ex` must come from `ibv_qp_to_qp_ex` of a live QP of this library.
unsafe fn with_staged<R>(qp_ex: *mut ibv_qp_ex, f: impl FnOnce(&mut Staged, &ibv_qp_ex) -> R) -> R {
    // SAFETY: per the contract: the ibv_qp_ex is the first field of a VrdmaQp made with a
    // staging area (ibv_qp_to_qp_ex answers NULL otherwise).
    let qp = unsafe { &*qp_ex.cast::<VrdmaQp>() };
    let mut staged = qp
        .staged()
        .expect("ibv_qp_to_qp_ex hands out only QPs made with send ops")
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    f(&mut staged, &qp.qp_ex)
}

unsafe extern "C" fn wr_start(qp_ex: *mut ibv_qp_ex) {
    // SAFETY: the ibv_wr_* contract: a QP from ibv_qp_to_qp_ex.
    unsafe { with_staged(qp_ex, |staged, _| staged.clear()) }
}

unsafe extern "C" fn wr_abort(qp_ex: *mut ibv_qp_ex) {
    // SAFETY: as for wr_start.
    unsafe { with_staged(qp_ex, |staged, _| staged.clear()) }
}

/// Starts a request with `op`, the program's current `wr_id` and `wr_flags`.
///
/// # Safety
/// As for [`with_staged`].
unsafe fn begin(qp_ex: *mut ibv_qp_ex, op: SendOp) {
    // SAFETY: per the contract.
    unsafe {
        with_staged(qp_ex, |staged, qp| {
            staged.wrs.push(StagedWr {
                wr_id: qp.wr_id,
                flags: qp.wr_flags,
                op,
                payload: StagedPayload::None,
                ud: None,
            })
        })
    }
}

unsafe extern "C" fn wr_send(qp_ex: *mut ibv_qp_ex) {
    // SAFETY: the ibv_wr_* contract.
    unsafe { begin(qp_ex, SendOp::Send) }
}

unsafe extern "C" fn wr_send_imm(qp_ex: *mut ibv_qp_ex, imm: u32) {
    let imm = u32::from_be(imm);
    // SAFETY: the ibv_wr_* contract.
    unsafe { begin(qp_ex, SendOp::SendWithImm { imm }) }
}

unsafe extern "C" fn wr_rdma_write(qp_ex: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    // SAFETY: the ibv_wr_* contract.
    unsafe { begin(qp_ex, SendOp::RdmaWrite { remote_addr, rkey }) }
}

unsafe extern "C" fn wr_rdma_write_imm(
    qp_ex: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    imm: u32,
) {
    let imm = u32::from_be(imm);
    // SAFETY: the ibv_wr_* contract.
    unsafe {
        begin(
            qp_ex,
            SendOp::RdmaWriteWithImm {
                remote_addr,
                rkey,
                imm,
            },
        )
    }
}

unsafe extern "C" fn wr_rdma_read(qp_ex: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    // SAFETY: the ibv_wr_* contract.
    unsafe { begin(qp_ex, SendOp::RdmaRead { remote_addr, rkey }) }
}

unsafe extern "C" fn wr_atomic_cmp_swp(
    qp_ex: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    compare: u64,
    swap: u64,
) {
    let op = SendOp::CompareAndSwap {
        remote_addr,
        rkey,
        compare,
        swap,
    };
    // SAFETY: the ibv_wr_* contract.
    unsafe { begin(qp_ex, op) }
}

unsafe extern "C" fn wr_atomic_fetch_add(
    qp_ex: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    add: u64,
) {
    // SAFETY: the ibv_wr_* contract.
    unsafe {
        begin(
            qp_ex,
            SendOp::FetchAndAdd {
                remote_addr,
                rkey,
                add,
            },
        )
    }
}

unsafe extern "C" fn wr_set_sge(qp_ex: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    let sge = ibv_sge { addr, length, lkey };
    // SAFETY: the ibv_wr_* contract, with a list of one SGE.
    unsafe { wr_set_sge_list(qp_ex, 1, &sge) }
}

unsafe extern "C" fn wr_set_sge_list(
    qp_ex: *mut ibv_qp_ex,
    num_sge: usize,
    sg_list: *const ibv_sge,
) {
    // SAFETY: the ibv_wr_* contract; `sg_list` holds `num_sge` SGEs (ibv_sge and Sge have
    // one layout), copied here because the program may reuse the list at once.
    unsafe {
        let list: &[Sge] = if num_sge == 0 || sg_list.is_null() {
            &[]
        } else {
            std::slice::from_raw_parts(sg_list.cast::<Sge>(), num_sge)
        };
        with_staged(qp_ex, |staged, _| {
            let start = staged.sges.len();
            staged.sges.extend_from_slice(list);
            let end = staged.sges.len();
            if let Some(last) = staged.last() {
                last.payload = StagedPayload::Sges(start..end);
            }
        })
    }
}

unsafe extern "C" fn wr_set_inline_data(qp_ex: *mut ibv_qp_ex, addr: *mut c_void, length: usize) {
    let buffer = ibv_data_buf { addr, length };
    // SAFETY: the ibv_wr_* contract, with a list of one buffer.
    unsafe { wr_set_inline_data_list(qp_ex, 1, &buffer) }
}

unsafe extern "C" fn wr_set_inline_data_list(
    qp_ex: *mut ibv_qp_ex,
    num_buf: usize,
    buf_list: *const ibv_data_buf,
) {
    // SAFETY: the ibv_wr_* contract: `buf_list` holds `num_buf` buffers of readable bytes,
    // copied here (inline data may be reused as soon as this returns).
    unsafe {
        with_staged(qp_ex, |staged, _| {
            let start = staged.inline.len();
            if num_buf > 0 && !buf_list.is_null() {
                for buffer in std::slice::from_raw_parts(buf_list, num_buf) {
                    if buffer.length > 0 {
                        staged.inline.extend_from_slice(std::slice::from_raw_parts(
                            buffer.addr.cast::<u8>(),
                            buffer.length,
                        ));
                    }
                }
            }
            let end = staged.inline.len();
            if let Some(last) = staged.last() {
                last.payload = StagedPayload::Inline(start..end);
            }
        })
    }
}

unsafe extern "C" fn wr_set_ud_addr(
    qp_ex: *mut ibv_qp_ex,
    ah: *mut ibv_ah,
    remote_qpn: u32,
    remote_qkey: u32,
) {
    // SAFETY: the ibv_wr_* contract.
    unsafe {
        with_staged(qp_ex, |staged, _| {
            if ah.is_null() {
                staged.error.get_or_insert(libc::EINVAL);
            } else if let Some(last) = staged.last() {
                last.ud = Some((ah as usize, remote_qpn, remote_qkey));
            }
        })
    }
}

/// Posts the staged requests in order: 0, or the errno of the first misuse or failure (the
/// requests before a failure stay posted, as with `ibv_post_send`).
unsafe extern "C" fn wr_complete(qp_ex: *mut ibv_qp_ex) -> c_int {
    // SAFETY: the ibv_wr_* contract: a QP from ibv_qp_to_qp_ex.
    let qp = unsafe { &*qp_ex.cast::<VrdmaQp>() };
    // SAFETY: the same QP, which has a staging area (the ibv_wr_* functions are set only on
    // QPs made with send ops); the staged AHs are the program's, alive while it posts.
    unsafe {
        with_staged(qp_ex, |staged, _| {
            let result = match staged.error {
                Some(errno) => Err(errno),
                None => match qp.inner().send_chain() {
                    Err(e) => Err(raise_errno(&e)),
                    // One doorbell for the lot, as for a chain given to ibv_post_send.
                    Ok(mut chain) => {
                        let pushed = staged.wrs.iter().try_for_each(|wr| {
                            let payload = match &wr.payload {
                                StagedPayload::None => Payload::Sges(&[]),
                                StagedPayload::Sges(range) => {
                                    Payload::Sges(&staged.sges[range.clone()])
                                }
                                StagedPayload::Inline(range) => {
                                    Payload::Inline(&staged.inline[range.clone()])
                                }
                            };
                            let ud = wr.ud.map(|(ah, qpn, qkey)| (ah as *mut ibv_ah, qpn, qkey));
                            let send = qp.send_wr(wr.wr_id, wr.op, payload, wr.flags, ud)?;
                            chain.push(&send).map_err(|e| raise_errno(&e))
                        });
                        chain.post().map_err(|e| raise_errno(&e)).and(pushed)
                    }
                },
            };
            staged.clear();
            result.err().unwrap_or(0)
        })
    }
}
