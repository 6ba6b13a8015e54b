//! Field rules of control commands (SPEC.md §5): pure functions from wire structs to host
//! verbs parameters, refusing anything outside the specification.

use vm_memory::GuestMemoryBackend;
use vrdma_spec::codec::{recv_slot_bytes, send_slot_bytes};
use vrdma_spec::config::{features, DeviceConfig};
use vrdma_spec::ctrl::{
    access, qp_attr_mask as wire_mask, qp_type, AhAttr as WireAhAttr, CreateQpRequest,
    CreateSrqRequest, ModifyQpRequest, ModifySrqRequest, GUEST_GID_INDEX, SRQ_ATTR_LIMIT,
};
use vrdma_spec::ring::{MAX_WQE_SHIFT, MIN_RQ_WQE_SHIFT, MIN_SQ_WQE_SHIFT};

use super::{QpShape, Refusal};
use crate::hostverbs::{
    qp_attr_mask as host_mask, AhAttr, Gid, PortAttr, QpAttr, QpCaps, QpState, QpType,
    LINK_LAYER_ETHERNET,
};
use crate::mtt;

/// A queue depth: a power of two in `min..=max`.
pub fn depth(field: &'static str, value: u32, min: u32, max: u32) -> Result<(), Refusal> {
    if !value.is_power_of_two() || value < min || value > max {
        return Err(Refusal::NotPowerOfTwo {
            field,
            value,
            min,
            max,
        });
    }
    Ok(())
}

/// A guest range the device will read or write: inside one region of guest memory.
pub fn guest_range<M: GuestMemoryBackend>(mem: &M, gpa: u64, len: u64) -> Result<(), Refusal> {
    mtt::check_guest_range(mem, gpa, len).map_err(Refusal::Pages)
}

/// A record of type `T` (`what`) at `gpa`, aligned to `align`, inside guest memory.
pub fn guest_record<M: GuestMemoryBackend, T>(
    mem: &M,
    what: &'static str,
    gpa: u64,
    align: u64,
) -> Result<(), Refusal> {
    if !gpa.is_multiple_of(align) {
        return Err(Refusal::Misaligned { what, gpa, align });
    }
    guest_range(mem, gpa, std::mem::size_of::<T>() as u64)
}

/// MR access flags (SPEC.md §5.8).
pub fn mr_access(flags: u32, negotiated: u64) -> Result<u32, Refusal> {
    if flags & !access::ALL != 0 {
        return Err(Refusal::UnknownBits {
            field: "MR access flags",
            value: flags,
            bits: flags & !access::ALL,
        });
    }
    if flags & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0
        && flags & access::LOCAL_WRITE == 0
    {
        return Err(Refusal::RemoteWithoutLocalWrite);
    }
    if flags & access::REMOTE_ATOMIC != 0 && negotiated & features::ATOMIC == 0 {
        return Err(Refusal::NotNegotiated("ATOMIC"));
    }
    Ok(flags)
}

fn range(field: &'static str, value: u32, min: u32, max: u32) -> Result<u32, Refusal> {
    if value < min || value > max {
        return Err(Refusal::OutOfRange {
            field,
            value: value.into(),
            min: min.into(),
            max: max.into(),
        });
    }
    Ok(value)
}

/// CREATE_QP fields (SPEC.md §5.9); CQ and PD handles are checked by the caller.
pub fn create_qp(
    req: &CreateQpRequest,
    config: &DeviceConfig,
    negotiated: u64,
) -> Result<QpShape, Refusal> {
    let qp_type = match req.qp_type {
        qp_type::RC => QpType::Rc,
        qp_type::UC if negotiated & features::UC != 0 => QpType::Uc,
        qp_type::UC => return Err(Refusal::NotNegotiated("UC")),
        qp_type::UD if negotiated & features::UD != 0 => QpType::Ud,
        qp_type::UD => return Err(Refusal::NotNegotiated("UD")),
        other => return Err(Refusal::QpType(other)),
    };
    let with_srq = req.srq.to_native() != 0;
    if with_srq && negotiated & features::SRQ == 0 {
        return Err(Refusal::NotNegotiated("SRQ"));
    }
    if req.sq_sig_all > 1 {
        return Err(Refusal::NotBoolean {
            field: "sq_sig_all",
            value: req.sq_sig_all,
        });
    }
    let max_wr = config.max_qp_wr.to_native();
    let max_sge = config.max_sge.to_native();
    let send_wr = req.max_send_wr.to_native();
    let recv_wr = req.max_recv_wr.to_native();
    depth("max_send_wr", send_wr, 1, max_wr)?;
    if with_srq {
        let rq_fields = [
            recv_wr,
            req.max_recv_sge.to_native(),
            req.rq_wqe_shift.into(),
            req.rq_ring.npages.to_native(),
        ];
        if rq_fields.iter().any(|&v| v != 0) {
            return Err(Refusal::RqOnSrqQp);
        }
    } else {
        depth("max_recv_wr", recv_wr, 1, max_wr)?;
    }
    let send_sge = range("max_send_sge", req.max_send_sge.to_native(), 1, max_sge)?;
    let recv_sge = if with_srq {
        0
    } else {
        range("max_recv_sge", req.max_recv_sge.to_native(), 1, max_sge)?
    };
    let inline = range(
        "max_inline_data",
        req.max_inline_data.to_native(),
        0,
        config.max_inline_data.to_native(),
    )?;
    let sq_shift = u32::from(req.sq_wqe_shift);
    let rq_shift = u32::from(req.rq_wqe_shift);
    range(
        "sq_wqe_shift",
        sq_shift,
        MIN_SQ_WQE_SHIFT.into(),
        MAX_WQE_SHIFT.into(),
    )?;
    if !with_srq {
        range(
            "rq_wqe_shift",
            rq_shift,
            MIN_RQ_WQE_SHIFT.into(),
            MAX_WQE_SHIFT.into(),
        )?;
    }
    let sq_needed = send_slot_bytes(send_sge, inline);
    if sq_needed > 1 << sq_shift {
        return Err(Refusal::SlotTooSmall {
            queue: "SQ",
            slot: 1 << sq_shift,
            needed: sq_needed,
        });
    }
    let rq_needed = recv_slot_bytes(recv_sge);
    if !with_srq && rq_needed > 1 << rq_shift {
        return Err(Refusal::SlotTooSmall {
            queue: "RQ",
            slot: 1 << rq_shift,
            needed: rq_needed,
        });
    }
    if req.reserved.to_native() != 0 {
        return Err(Refusal::Reserved);
    }
    Ok(QpShape {
        qp_type,
        caps: QpCaps {
            max_send_wr: send_wr,
            max_recv_wr: recv_wr,
            max_send_sge: send_sge,
            max_recv_sge: recv_sge,
            max_inline_data: inline,
        },
    })
}

/// An SRQ limit (SPEC.md §5.13): below the SRQ's depth; 0 disarms.
pub fn srq_limit(limit: u32, max_wr: u32) -> Result<u32, Refusal> {
    if limit >= max_wr {
        return Err(Refusal::SrqLimit {
            limit,
            depth: max_wr,
        });
    }
    Ok(limit)
}

/// MODIFY_SRQ (SPEC.md §5.13): the limit to arm, for an SRQ of `max_wr` WQEs.
pub fn modify_srq(req: &ModifySrqRequest, max_wr: u32) -> Result<u32, Refusal> {
    let mask = req.attr_mask.to_native();
    if mask != SRQ_ATTR_LIMIT {
        // Only the limit can change, and a request must change something.
        return Err(Refusal::UnknownBits {
            field: "MODIFY_SRQ attr_mask",
            value: mask,
            bits: (mask & !SRQ_ATTR_LIMIT) | (!mask & SRQ_ATTR_LIMIT),
        });
    }
    if req.reserved.to_native() != 0 {
        return Err(Refusal::Reserved);
    }
    srq_limit(req.srq_limit.to_native(), max_wr)
}

/// CREATE_SRQ fields (SPEC.md §5.13): the depth and SGE count granted.
pub fn create_srq(req: &CreateSrqRequest, config: &DeviceConfig) -> Result<(u32, u32), Refusal> {
    let max_wr = req.max_wr.to_native();
    depth("SRQ depth", max_wr, 1, config.max_srq_wr.to_native())?;
    let max_sge = range(
        "SRQ max_sge",
        req.max_sge.to_native(),
        1,
        config.max_sge.to_native(),
    )?;
    srq_limit(req.srq_limit.to_native(), max_wr)?;
    let shift = u32::from(req.wqe_shift);
    range(
        "SRQ wqe_shift",
        shift,
        MIN_RQ_WQE_SHIFT.into(),
        MAX_WQE_SHIFT.into(),
    )?;
    if recv_slot_bytes(max_sge) > 1 << shift {
        return Err(Refusal::SlotTooSmall {
            queue: "SRQ",
            slot: 1 << shift,
            needed: recv_slot_bytes(max_sge),
        });
    }
    if req.reserved.iter().any(|&r| r != 0) {
        return Err(Refusal::Reserved);
    }
    Ok((max_wr, max_sge))
}

/// What MODIFY_QP checks fields against.
pub struct QpLimits {
    pub port: PortAttr,
    /// The host's index of the guest's GID, the only source GID it may use.
    pub host_gid_index: u8,
    pub max_rd_atomic: u32,
    pub max_dest_rd_atomic: u32,
    pub atomics: bool,
}

/// `ibv_mtu` 4096, the largest path MTU there is.
const IBV_MTU_4096: u32 = 5;

/// An address vector (SPEC.md §5.10); the guest may only source traffic from its own GID,
/// which it names as [`GUEST_GID_INDEX`] and the host knows as `host_gid_index`.
pub fn ah_attr(a: &WireAhAttr, port: &PortAttr, host_gid_index: u8) -> Result<AhAttr, Refusal> {
    if a.port_num != 1 {
        return Err(Refusal::NoSuchPort(a.port_num));
    }
    if a.sgid_index != GUEST_GID_INDEX {
        return Err(Refusal::ForeignSourceGid(a.sgid_index));
    }
    // The wire carries 20 bits; like the kernel, keep those and ignore the rest (UCX passes
    // 0xFFFFFFFF).
    let flow_label = a.flow_label.to_native() & ((1 << 20) - 1);
    range("service level", a.sl.into(), 0, 15)?;
    let is_global = match a.is_global {
        0 => false,
        1 => true,
        value => {
            return Err(Refusal::NotBoolean {
                field: "is_global",
                value,
            })
        }
    };
    if port.link_layer == LINK_LAYER_ETHERNET && !is_global {
        return Err(Refusal::NoGlobalRoute);
    }
    if is_global && a.hop_limit == 0 {
        return Err(Refusal::ZeroHopLimit);
    }
    if a.reserved.to_native() != 0 {
        return Err(Refusal::Reserved);
    }
    Ok(AhAttr {
        dgid: Gid(a.dgid),
        flow_label,
        sgid_index: host_gid_index,
        hop_limit: a.hop_limit,
        traffic_class: a.traffic_class,
        is_global,
        dlid: a.dlid.to_native(),
        sl: a.sl,
        port_num: a.port_num,
    })
}

fn state(value: u8) -> Result<QpState, Refusal> {
    QpState::try_from(u32::from(value)).map_err(Refusal::NoSuchQpState)
}

const PSN_LIMIT: u32 = 1 << 24;

/// MODIFY_QP (SPEC.md §5.11): the host attributes and mask, after every selected field was
/// checked against its rule. Spec mask bits equal ibverbs bits, checked at compile time below.
pub fn modify_qp(req: &ModifyQpRequest, limits: &QpLimits) -> Result<(QpAttr, u32), Refusal> {
    let mask = req.attr_mask.to_native();
    if mask & !wire_mask::SUPPORTED != 0 {
        return Err(Refusal::UnknownBits {
            field: "MODIFY_QP attr_mask",
            value: mask,
            bits: mask & !wire_mask::SUPPORTED,
        });
    }
    let a = &req.attr;
    let has = |bit: u32| mask & bit != 0;
    let mut attr = QpAttr::default();
    if has(wire_mask::STATE) {
        attr.qp_state = state(a.qp_state)?;
    }
    if has(wire_mask::CUR_STATE) {
        attr.cur_qp_state = state(a.cur_qp_state)?;
    }
    if has(wire_mask::PATH_MTU) {
        // Like rxe, a path MTU above the port's active MTU is taken as the active MTU: the
        // link carries no more (`ibv_rc_pingpong -m 4096` on a 1500-byte link).
        let path_mtu = range("path MTU", a.path_mtu.into(), 1, IBV_MTU_4096)?;
        // Both are ibv_mtu values, 1 to 5.
        #[expect(
            clippy::cast_possible_truncation,
            reason = "path_mtu is in 1..=IBV_MTU_4096 (5), checked just above"
        )]
        let path_mtu = path_mtu.min(limits.port.active_mtu) as u8;
        attr.path_mtu = path_mtu;
    }
    if has(wire_mask::PORT) && a.port_num != 1 {
        return Err(Refusal::NoSuchPort(a.port_num));
    }
    attr.port_num = a.port_num;
    if has(wire_mask::ACCESS_FLAGS) {
        let remote = access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;
        // LOCAL_WRITE means nothing for a QP, but libibverbs programs set it and native
        // devices accept it: accepted and dropped (SPEC.md §5.11).
        let flags = a.qp_access_flags.to_native() & !access::LOCAL_WRITE;
        if flags & !remote != 0 {
            return Err(Refusal::UnknownBits {
                field: "QP access flags",
                value: flags,
                bits: flags & !remote,
            });
        }
        if flags & access::REMOTE_ATOMIC != 0 && !limits.atomics {
            return Err(Refusal::NotNegotiated("ATOMIC"));
        }
        attr.qp_access_flags = flags;
    }
    if has(wire_mask::PKEY_INDEX) {
        let index = a.pkey_index.to_native();
        if u32::from(index) >= u32::from(limits.port.pkey_tbl_len).max(1) {
            return Err(Refusal::PkeyIndex(index));
        }
        attr.pkey_index = index;
    }
    if has(wire_mask::TIMEOUT) {
        range("timeout", a.timeout.into(), 0, 31)?;
        attr.timeout = a.timeout;
    }
    if has(wire_mask::RETRY_CNT) {
        range("retry count", a.retry_cnt.into(), 0, 7)?;
        attr.retry_cnt = a.retry_cnt;
    }
    if has(wire_mask::RNR_RETRY) {
        range("RNR retry", a.rnr_retry.into(), 0, 7)?;
        attr.rnr_retry = a.rnr_retry;
    }
    if has(wire_mask::MIN_RNR_TIMER) {
        range("minimum RNR timer", a.min_rnr_timer.into(), 0, 31)?;
        attr.min_rnr_timer = a.min_rnr_timer;
    }
    if has(wire_mask::MAX_QP_RD_ATOMIC) {
        range(
            "max_rd_atomic",
            a.max_rd_atomic.into(),
            0,
            limits.max_rd_atomic.min(255),
        )?;
        attr.max_rd_atomic = a.max_rd_atomic;
    }
    if has(wire_mask::MAX_DEST_RD_ATOMIC) {
        range(
            "max_dest_rd_atomic",
            a.max_dest_rd_atomic.into(),
            0,
            limits.max_dest_rd_atomic.min(255),
        )?;
        attr.max_dest_rd_atomic = a.max_dest_rd_atomic;
    }
    if has(wire_mask::QKEY) {
        attr.qkey = a.qkey.to_native();
        if attr.qkey & (1 << 31) != 0 {
            return Err(Refusal::PrivilegedQkey);
        }
    }
    if has(wire_mask::RQ_PSN) {
        attr.rq_psn = range("RQ PSN", a.rq_psn.to_native(), 0, PSN_LIMIT - 1)?;
    }
    if has(wire_mask::SQ_PSN) {
        attr.sq_psn = range("SQ PSN", a.sq_psn.to_native(), 0, PSN_LIMIT - 1)?;
    }
    if has(wire_mask::DEST_QPN) {
        attr.dest_qp_num = range(
            "destination QPN",
            a.dest_qp_num.to_native(),
            0,
            PSN_LIMIT - 1,
        )?;
    }
    if has(wire_mask::AV) {
        attr.ah_attr = ah_attr(&a.ah_attr, &limits.port, limits.host_gid_index)?;
    }
    Ok((attr, mask))
}

// The wire mask is passed to the host unchanged: the bit values must agree.
const _: () = {
    assert!(wire_mask::STATE == host_mask::STATE);
    assert!(wire_mask::CUR_STATE == host_mask::CUR_STATE);
    assert!(wire_mask::ACCESS_FLAGS == host_mask::ACCESS_FLAGS);
    assert!(wire_mask::PKEY_INDEX == host_mask::PKEY_INDEX);
    assert!(wire_mask::PORT == host_mask::PORT);
    assert!(wire_mask::QKEY == host_mask::QKEY);
    assert!(wire_mask::AV == host_mask::AV);
    assert!(wire_mask::PATH_MTU == host_mask::PATH_MTU);
    assert!(wire_mask::TIMEOUT == host_mask::TIMEOUT);
    assert!(wire_mask::RETRY_CNT == host_mask::RETRY_CNT);
    assert!(wire_mask::RNR_RETRY == host_mask::RNR_RETRY);
    assert!(wire_mask::RQ_PSN == host_mask::RQ_PSN);
    assert!(wire_mask::MAX_QP_RD_ATOMIC == host_mask::MAX_QP_RD_ATOMIC);
    assert!(wire_mask::MIN_RNR_TIMER == host_mask::MIN_RNR_TIMER);
    assert!(wire_mask::SQ_PSN == host_mask::SQ_PSN);
    assert!(wire_mask::MAX_DEST_RD_ATOMIC == host_mask::MAX_DEST_RD_ATOMIC);
    assert!(wire_mask::DEST_QPN == host_mask::DEST_QPN);
};

#[cfg(test)]
mod tests;
