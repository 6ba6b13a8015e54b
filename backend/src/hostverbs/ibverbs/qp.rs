//! libibverbs queue pairs, shared receive queues and address handles, and posting to them.

use std::io;
use std::mem::MaybeUninit;
use std::os::raw::c_int;
use std::ptr::NonNull;

use rdma_sys::*;

use super::cq::Cq;
use super::{check, last_error, verbs_object_is_thread_safe};
use crate::hostverbs::seam::{HostAh, HostCq, HostQp, HostSrq, NewQp, QpQueues};
use crate::hostverbs::{
    qp_attr_mask, AhAttr, Error, ObjectId, QpAttr, QpInit, QpType, RecvWr, Result, SendBatch,
};

/// Receive requests chained into one post call; bounds the stack space a post needs.
const POST_BATCH: usize = 16;

/// The libibverbs CQ behind `cq`, or the refusal of another host's.
fn verbs_cq(cq: &dyn HostCq) -> Result<*mut ibv_cq> {
    cq.as_any()
        .downcast_ref::<Cq>()
        .map(|cq| cq.raw.as_ptr())
        .ok_or_else(|| Error::other_host("ibv_create_qp"))
}

pub(super) fn create_qp(
    pd: NonNull<ibv_pd>,
    queues: QpQueues<'_>,
    init: &QpInit<'_>,
) -> Result<NewQp> {
    // SAFETY: all-zero is a valid ibv_qp_init_attr (null pointers and integers).
    let mut attr: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    attr.send_cq = verbs_cq(queues.send_cq)?;
    attr.recv_cq = verbs_cq(queues.recv_cq)?;
    attr.srq = match queues.srq {
        None => std::ptr::null_mut(),
        Some(srq) => match srq.as_any().downcast_ref::<Srq>() {
            Some(srq) => srq.raw.as_ptr(),
            None => return Err(Error::other_host("ibv_create_qp")),
        },
    };
    attr.qp_type = match init.qp_type {
        QpType::Rc => ibv_qp_type::IBV_QPT_RC,
        QpType::Uc => ibv_qp_type::IBV_QPT_UC,
        QpType::Ud => ibv_qp_type::IBV_QPT_UD,
    };
    attr.sq_sig_all = init.sq_sig_all.into();
    attr.cap = (&init.caps).into();
    // SAFETY: PD and CQs (and the SRQ) are alive and outlive the QP (see the seam); `attr` is
    // valid and the provider writes the granted caps back into it.
    let raw = NonNull::new(unsafe { ibv_create_qp(pd.as_ptr(), &mut attr) })
        .ok_or_else(|| last_error("ibv_create_qp"))?;
    Ok((Box::new(Qp { raw }), (&attr.cap).into()))
}

/// A libibverbs queue pair.
struct Qp {
    raw: NonNull<ibv_qp>,
}

verbs_object_is_thread_safe!(Qp);

impl HostQp for Qp {
    fn qp_num(&self) -> u32 {
        // SAFETY: the QP is alive; qp_num never changes after creation.
        unsafe { (*self.raw.as_ptr()).qp_num }
    }

    fn modify(&self, attr: &QpAttr, mask: u32) -> Result<()> {
        let mut raw = ibv_qp_attr::from(attr);
        // SAFETY: the QP is alive and `raw` is a valid attribute struct.
        check("ibv_modify_qp", unsafe {
            // The mask is a set of ibv_qp_attr_mask bits, which the C API takes as an int.
            ibv_modify_qp(self.raw.as_ptr(), &mut raw, mask.cast_signed())
        })
    }

    fn query(&self) -> Result<QpAttr> {
        // SAFETY: all-zero is valid for both structs (integers, null pointers, unions).
        let (mut raw, mut init): (ibv_qp_attr, ibv_qp_init_attr) =
            unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        let mask = qp_attr_mask::STATE
            | qp_attr_mask::CUR_STATE
            | qp_attr_mask::ACCESS_FLAGS
            | qp_attr_mask::PKEY_INDEX
            | qp_attr_mask::PORT
            | qp_attr_mask::QKEY
            | qp_attr_mask::AV
            | qp_attr_mask::PATH_MTU
            | qp_attr_mask::TIMEOUT
            | qp_attr_mask::RETRY_CNT
            | qp_attr_mask::RNR_RETRY
            | qp_attr_mask::RQ_PSN
            | qp_attr_mask::MAX_QP_RD_ATOMIC
            | qp_attr_mask::MIN_RNR_TIMER
            | qp_attr_mask::SQ_PSN
            | qp_attr_mask::MAX_DEST_RD_ATOMIC
            | qp_attr_mask::DEST_QPN;
        // SAFETY: the QP is alive; both out-pointers are valid.
        check("ibv_query_qp", unsafe {
            ibv_query_qp(self.raw.as_ptr(), &mut raw, mask.cast_signed(), &mut init)
        })?;
        QpAttr::from_ibv(&raw, mask).map_err(|state| Error::Verbs {
            call: "ibv_query_qp",
            source: io::Error::other(format!(
                "the host reported QP state {state}, not one of ibverbs'"
            )),
        })
    }

    fn post_send(&self, batch: &mut SendBatch) -> Result<()> {
        let qp = self.raw.as_ptr();
        batch
            .post_chain(|first, bad| {
                // SAFETY: the QP is alive; the chain covers exactly the batch's requests, and
                // every SGE list, inline payload and AH it points to is the batch's own, alive
                // and unmoved for the call (`SendBatch::post_chain`); the provider copies what
                // it keeps.
                unsafe { ibv_post_send(qp, first, bad) }
            })
            .map_err(|(posted, ret)| post_error("ibv_post_send", posted, ret))
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        let qp = self.raw.as_ptr();
        post_recv_chains("ibv_post_recv", wrs, |first, bad| {
            // SAFETY: the QP is alive; the chain and its SGE slices live for the call.
            unsafe { ibv_post_recv(qp, first, bad) }
        })
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created by create_qp and destroyed once; its PD and CQs are still alive
        // (see the seam).
        let ret = unsafe { ibv_destroy_qp(self.raw.as_ptr()) };
        if ret != 0 {
            log::error!("ibv_destroy_qp failed: {ret}");
        }
    }
}

pub(super) fn create_srq(
    pd: NonNull<ibv_pd>,
    max_wr: u32,
    max_sge: u32,
) -> Result<Box<dyn HostSrq>> {
    // SAFETY: all-zero is a valid ibv_srq_init_attr (a null context and integers).
    let mut attr: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
    attr.attr.max_wr = max_wr;
    attr.attr.max_sge = max_sge;
    // SAFETY: the PD is alive (and outlives the SRQ) and `attr` is valid.
    let raw = NonNull::new(unsafe { ibv_create_srq(pd.as_ptr(), &mut attr) })
        .ok_or_else(|| last_error("ibv_create_srq"))?;
    Ok(Box::new(Srq { raw }))
}

/// A libibverbs shared receive queue.
struct Srq {
    raw: NonNull<ibv_srq>,
}

verbs_object_is_thread_safe!(Srq);

impl HostSrq for Srq {
    fn id(&self) -> ObjectId {
        self.raw.as_ptr() as ObjectId
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        let srq = self.raw.as_ptr();
        post_recv_chains("ibv_post_srq_recv", wrs, |first, bad| {
            // SAFETY: the SRQ is alive; the chain and its SGE slices live for the call.
            unsafe { ibv_post_srq_recv(srq, first, bad) }
        })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        // SAFETY: QPs using the SRQ were dropped before it (see the seam).
        if unsafe { ibv_destroy_srq(self.raw.as_ptr()) } != 0 {
            log::error!("ibv_destroy_srq failed");
        }
    }
}

pub(super) fn create_ah(pd: NonNull<ibv_pd>, attr: &AhAttr) -> Result<Box<dyn HostAh>> {
    let mut raw_attr = ibv_ah_attr::from(attr);
    // SAFETY: the PD is alive and `raw_attr` is a valid address vector.
    let raw = NonNull::new(unsafe { ibv_create_ah(pd.as_ptr(), &mut raw_attr) })
        .ok_or_else(|| last_error("ibv_create_ah"))?;
    Ok(Box::new(Ah { raw }))
}

/// A libibverbs address handle.
struct Ah {
    raw: NonNull<ibv_ah>,
}

verbs_object_is_thread_safe!(Ah);

impl HostAh for Ah {
    fn handle(&self) -> usize {
        self.raw.as_ptr() as usize
    }
}

impl Drop for Ah {
    fn drop(&mut self) {
        // SAFETY: created by create_ah, destroyed once; its PD is still alive (see the seam).
        let ret = unsafe { ibv_destroy_ah(self.raw.as_ptr()) };
        if ret != 0 {
            log::error!("ibv_destroy_ah failed: {ret}");
        }
    }
}

fn post_error(call: &'static str, posted: usize, ret: c_int) -> Error {
    Error::Post {
        call,
        posted,
        source: if ret > 0 {
            io::Error::from_raw_os_error(ret)
        } else {
            io::Error::last_os_error()
        },
    }
}

/// Chains `wrs` in batches and hands each chain to `post` (a QP's or an SRQ's post_recv).
fn post_recv_chains(
    call: &'static str,
    wrs: &[RecvWr<'_>],
    post: impl Fn(*mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int,
) -> Result<()> {
    let mut posted = 0;
    for chunk in wrs.chunks(POST_BATCH) {
        // Only the entries a chunk uses are initialised.
        let mut raw = [const { MaybeUninit::<ibv_recv_wr>::uninit() }; POST_BATCH];
        for (i, wr) in chunk.iter().enumerate() {
            // SAFETY: all-zero is a valid ibv_recv_wr (integers and null pointers).
            let raw = unsafe { raw[i].write(std::mem::zeroed()) };
            raw.wr_id = wr.wr_id;
            raw.sg_list = wr.sges.as_ptr() as *mut ibv_sge;
            raw.num_sge = c_int::try_from(wr.sges.len())
                .map_err(|_| Error::InvalidArgument("too many SGEs".into()))?;
        }
        // The chain below covers exactly the initialised entries.
        let base = raw.as_mut_ptr().cast::<ibv_recv_wr>();
        for i in 1..chunk.len() {
            // SAFETY: both indexes are inside the array.
            unsafe { (*base.add(i - 1)).next = base.add(i) };
        }
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        let ret = post(base, &mut bad);
        if ret != 0 {
            let accepted = if bad.is_null() {
                0
            } else {
                // SAFETY: `bad` points into `raw`, per the verbs contract (at or after `base`:
                // the offset is not negative).
                unsafe { bad.offset_from(base) }.unsigned_abs()
            };
            return Err(post_error(call, posted + accepted, ret));
        }
        posted += chunk.len();
    }
    Ok(())
}
