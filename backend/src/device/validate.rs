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
        attr.path_mtu = path_mtu.min(limits.port.active_mtu) as u8;
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
        attr.timeout = range("timeout", a.timeout.into(), 0, 31)? as u8;
    }
    if has(wire_mask::RETRY_CNT) {
        attr.retry_cnt = range("retry count", a.retry_cnt.into(), 0, 7)? as u8;
    }
    if has(wire_mask::RNR_RETRY) {
        attr.rnr_retry = range("RNR retry", a.rnr_retry.into(), 0, 7)? as u8;
    }
    if has(wire_mask::MIN_RNR_TIMER) {
        attr.min_rnr_timer = range("minimum RNR timer", a.min_rnr_timer.into(), 0, 31)? as u8;
    }
    if has(wire_mask::MAX_QP_RD_ATOMIC) {
        attr.max_rd_atomic = range(
            "max_rd_atomic",
            a.max_rd_atomic.into(),
            0,
            limits.max_rd_atomic.min(255),
        )? as u8;
    }
    if has(wire_mask::MAX_DEST_RD_ATOMIC) {
        attr.max_dest_rd_atomic = range(
            "max_dest_rd_atomic",
            a.max_dest_rd_atomic.into(),
            0,
            limits.max_dest_rd_atomic.min(255),
        )? as u8;
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
mod tests {
    use super::*;
    use vrdma_spec::ctrl::qp_state;
    use vrdma_spec::ctrl::QpAttr as WireQpAttr;
    use vrdma_spec::ctrl::Status;
    use vrdma_spec::{Le32, Le64};

    fn port() -> PortAttr {
        PortAttr {
            active_mtu: 3,
            gid_tbl_len: 16,
            pkey_tbl_len: 1,
            link_layer: LINK_LAYER_ETHERNET,
            ..Default::default()
        }
    }

    fn limits() -> QpLimits {
        QpLimits {
            port: port(),
            host_gid_index: 3,
            max_rd_atomic: 128,
            max_dest_rd_atomic: 128,
            atomics: true,
        }
    }

    fn av() -> WireAhAttr {
        WireAhAttr {
            sgid_index: 0,
            hop_limit: 1,
            is_global: 1,
            port_num: 1,
            ..Default::default()
        }
    }

    fn modify(mask: u32, attr: WireQpAttr) -> Result<(QpAttr, u32), Refusal> {
        modify_qp(
            &ModifyQpRequest {
                handle: Le32::from(1),
                attr_mask: Le32::from(mask),
                attr,
            },
            &limits(),
        )
    }

    fn refused<T>(r: Result<T, Refusal>) -> Refusal {
        r.err().expect("refused")
    }

    fn out_of_range(field: &'static str, value: u64, min: u64, max: u64) -> Refusal {
        Refusal::OutOfRange {
            field,
            value,
            min,
            max,
        }
    }

    #[test]
    fn rtr_with_a_valid_path_passes_through_with_the_same_mask() {
        let mask = wire_mask::STATE
            | wire_mask::AV
            | wire_mask::PATH_MTU
            | wire_mask::DEST_QPN
            | wire_mask::RQ_PSN;
        let attr = WireQpAttr {
            qp_state: qp_state::RTR,
            path_mtu: 3,
            dest_qp_num: Le32::from(0x11),
            rq_psn: Le32::from(7),
            ah_attr: av(),
            ..Default::default()
        };
        let (host, host_mask) = modify(mask, attr).unwrap();
        assert_eq!(host_mask, mask);
        assert_eq!(
            (host.qp_state, host.path_mtu, host.dest_qp_num, host.rq_psn),
            (QpState::Rtr, 3, 0x11, 7)
        );
        assert!(host.ah_attr.is_global);
    }

    /// Where the kernel is lenient, so is the device (SPEC.md §5.10, §5.11): a path MTU
    /// above the port's active MTU is the active MTU (rxe; `ibv_rc_pingpong -m 4096`), and a
    /// flow label keeps its 20 bits (UCX passes 0xFFFFFFFF).
    #[test]
    fn a_larger_path_mtu_and_a_wide_flow_label_are_taken_as_the_kernel_takes_them() {
        let mask = wire_mask::STATE | wire_mask::AV | wire_mask::PATH_MTU;
        let attr = WireQpAttr {
            qp_state: qp_state::RTR,
            path_mtu: 5,
            ah_attr: WireAhAttr {
                flow_label: Le32::from(u32::MAX),
                ..av()
            },
            ..Default::default()
        };
        let (host, _) = modify(mask, attr).unwrap();
        assert_eq!(host.path_mtu, 3, "the port's active MTU");
        assert_eq!(host.ah_attr.flow_label, 0xf_ffff);
    }

    #[test]
    fn out_of_range_fields_and_unknown_mask_bits_are_invalid() {
        let base = WireQpAttr::default();
        let cases: [(u32, WireQpAttr, Refusal); 11] = [
            (
                1 << 14,
                base,
                Refusal::UnknownBits {
                    field: "MODIFY_QP attr_mask",
                    value: 1 << 14,
                    bits: 1 << 14,
                },
            ),
            (
                wire_mask::STATE,
                WireQpAttr {
                    qp_state: 7,
                    ..base
                },
                Refusal::NoSuchQpState(7),
            ),
            (
                wire_mask::PATH_MTU,
                WireQpAttr {
                    path_mtu: 6,
                    ..base
                },
                out_of_range("path MTU", 6, 1, 5),
            ),
            (
                wire_mask::PATH_MTU,
                WireQpAttr {
                    path_mtu: 0,
                    ..base
                },
                out_of_range("path MTU", 0, 1, 5),
            ),
            (
                wire_mask::PORT,
                WireQpAttr {
                    port_num: 2,
                    ..base
                },
                Refusal::NoSuchPort(2),
            ),
            (
                wire_mask::TIMEOUT,
                WireQpAttr {
                    timeout: 32,
                    ..base
                },
                out_of_range("timeout", 32, 0, 31),
            ),
            (
                wire_mask::RETRY_CNT,
                WireQpAttr {
                    retry_cnt: 8,
                    ..base
                },
                out_of_range("retry count", 8, 0, 7),
            ),
            (
                wire_mask::SQ_PSN,
                WireQpAttr {
                    sq_psn: Le32::from(1 << 24),
                    ..base
                },
                out_of_range("SQ PSN", 1 << 24, 0, (1 << 24) - 1),
            ),
            (
                wire_mask::DEST_QPN,
                WireQpAttr {
                    dest_qp_num: Le32::from(u32::MAX),
                    ..base
                },
                out_of_range("destination QPN", u32::MAX.into(), 0, (1 << 24) - 1),
            ),
            (
                wire_mask::ACCESS_FLAGS,
                WireQpAttr {
                    qp_access_flags: Le32::from(1 << 4),
                    ..base
                },
                Refusal::UnknownBits {
                    field: "QP access flags",
                    value: 1 << 4,
                    bits: 1 << 4,
                },
            ),
            (
                wire_mask::PKEY_INDEX,
                WireQpAttr {
                    pkey_index: 1.into(),
                    ..base
                },
                Refusal::PkeyIndex(1),
            ),
        ];
        for (i, (mask, attr, refusal)) in cases.into_iter().enumerate() {
            assert_eq!(refused(modify(mask, attr)), refusal, "case {i}");
            assert_eq!(refusal.status(), Status::InvalidArgument, "case {i}");
        }
        // LOCAL_WRITE, which libibverbs programs set on QPs, is accepted and dropped.
        let (attr, _) = modify(
            wire_mask::ACCESS_FLAGS,
            WireQpAttr {
                qp_access_flags: Le32::from(access::LOCAL_WRITE | access::REMOTE_WRITE),
                ..base
            },
        )
        .unwrap();
        assert_eq!(attr.qp_access_flags, access::REMOTE_WRITE);
    }

    #[test]
    fn a_guest_cannot_source_traffic_from_another_gid_or_without_a_route() {
        for (bad, refusal) in [
            (
                WireAhAttr {
                    sgid_index: 3,
                    ..av()
                },
                Refusal::ForeignSourceGid(3),
            ),
            (
                WireAhAttr {
                    sgid_index: 1,
                    ..av()
                },
                Refusal::ForeignSourceGid(1),
            ),
            (
                WireAhAttr {
                    is_global: 0,
                    ..av()
                },
                Refusal::NoGlobalRoute,
            ),
            (
                WireAhAttr {
                    is_global: 2,
                    ..av()
                },
                Refusal::NotBoolean {
                    field: "is_global",
                    value: 2,
                },
            ),
            (
                WireAhAttr {
                    hop_limit: 0,
                    ..av()
                },
                Refusal::ZeroHopLimit,
            ),
            (
                WireAhAttr { sl: 16, ..av() },
                out_of_range("service level", 16, 0, 15),
            ),
            (
                WireAhAttr {
                    port_num: 0,
                    ..av()
                },
                Refusal::NoSuchPort(0),
            ),
        ] {
            assert_eq!(refused(ah_attr(&bad, &port(), 3)), refusal, "{bad:?}");
            assert_eq!(refusal.status(), Status::InvalidArgument);
        }
        // The guest's index 0 is the host's entry of the guest's GID.
        assert_eq!(ah_attr(&av(), &port(), 3).unwrap().sgid_index, 3);
    }

    #[test]
    fn mr_access_rules() {
        assert_eq!(
            mr_access(access::LOCAL_WRITE | access::REMOTE_WRITE, features::ATOMIC).unwrap(),
            3
        );
        assert_eq!(
            refused(mr_access(access::REMOTE_WRITE, 0)),
            Refusal::RemoteWithoutLocalWrite
        );
        assert_eq!(
            refused(mr_access(1 << 4, 0)),
            Refusal::UnknownBits {
                field: "MR access flags",
                value: 1 << 4,
                bits: 1 << 4
            }
        );
        let atomics = refused(mr_access(access::LOCAL_WRITE | access::REMOTE_ATOMIC, 0));
        assert_eq!(atomics, Refusal::NotNegotiated("ATOMIC"));
        assert_eq!(atomics.status(), Status::Unsupported);
    }

    fn config() -> DeviceConfig {
        DeviceConfig {
            max_qp_wr: Le32::from(1024),
            max_sge: Le32::from(32),
            max_inline_data: Le32::from(4032),
            max_cqe: Le32::from(4096),
            page_size_cap: Le64::from(1 << 12),
            ..Default::default()
        }
    }

    fn rc_request() -> CreateQpRequest {
        CreateQpRequest {
            qp_type: qp_type::RC,
            sq_wqe_shift: 7,
            rq_wqe_shift: 6,
            max_send_wr: Le32::from(64),
            max_recv_wr: Le32::from(64),
            max_send_sge: Le32::from(4),
            max_recv_sge: Le32::from(3),
            max_inline_data: Le32::from(64),
            ..Default::default()
        }
    }

    #[test]
    fn create_qp_grants_what_was_asked() {
        let shape = create_qp(&rc_request(), &config(), features::RC | features::UD).unwrap();
        assert_eq!((shape.caps.max_send_wr, shape.caps.max_recv_wr), (64, 64));
        assert_eq!(
            (shape.caps.max_send_sge, shape.caps.max_inline_data),
            (4, 64)
        );
    }

    #[test]
    fn create_qp_refuses_bad_shapes() {
        let r = rc_request();
        let depth = |field, value| Refusal::NotPowerOfTwo {
            field,
            value,
            min: 1,
            max: 1024,
        };
        let sq_slot = |needed| Refusal::SlotTooSmall {
            queue: "SQ",
            slot: 128,
            needed,
        };
        let cases = [
            (CreateQpRequest { qp_type: 1, ..r }, Refusal::QpType(1)),
            (
                CreateQpRequest {
                    max_send_wr: Le32::from(48),
                    ..r
                },
                depth("max_send_wr", 48),
            ),
            (
                CreateQpRequest {
                    max_recv_wr: Le32::from(2048),
                    ..r
                },
                depth("max_recv_wr", 2048),
            ),
            (
                CreateQpRequest {
                    max_send_sge: Le32::from(0),
                    ..r
                },
                out_of_range("max_send_sge", 0, 1, 32),
            ),
            (
                CreateQpRequest {
                    max_send_sge: Le32::from(5),
                    ..r
                },
                sq_slot(send_slot_bytes(5, 64)),
            ),
            (
                CreateQpRequest {
                    max_recv_sge: Le32::from(4),
                    ..r
                },
                Refusal::SlotTooSmall {
                    queue: "RQ",
                    slot: 64,
                    needed: recv_slot_bytes(4),
                },
            ),
            (
                CreateQpRequest {
                    max_inline_data: Le32::from(65),
                    ..r
                },
                sq_slot(send_slot_bytes(4, 65)),
            ),
            (
                CreateQpRequest {
                    sq_wqe_shift: 13,
                    ..r
                },
                out_of_range(
                    "sq_wqe_shift",
                    13,
                    MIN_SQ_WQE_SHIFT.into(),
                    MAX_WQE_SHIFT.into(),
                ),
            ),
            (
                CreateQpRequest {
                    rq_wqe_shift: 3,
                    ..r
                },
                out_of_range(
                    "rq_wqe_shift",
                    3,
                    MIN_RQ_WQE_SHIFT.into(),
                    MAX_WQE_SHIFT.into(),
                ),
            ),
            (
                CreateQpRequest { sq_sig_all: 2, ..r },
                Refusal::NotBoolean {
                    field: "sq_sig_all",
                    value: 2,
                },
            ),
            (
                CreateQpRequest {
                    reserved: Le32::from(1),
                    ..r
                },
                Refusal::Reserved,
            ),
        ];
        for (i, (req, refusal)) in cases.iter().enumerate() {
            let got = refused(create_qp(req, &config(), features::RC | features::UD));
            assert_eq!(&got, refusal, "case {i}");
            assert_eq!(got.status(), Status::InvalidArgument, "case {i}");
        }
        let ud = CreateQpRequest {
            qp_type: qp_type::UD,
            ..r
        };
        let not_negotiated = refused(create_qp(&ud, &config(), features::RC));
        assert_eq!(not_negotiated, Refusal::NotNegotiated("UD"));
        assert_eq!(not_negotiated.status(), Status::Unsupported);
        // Finding: UC had no feature bit; a driver could not tell whether a device serves it.
        let uc = CreateQpRequest {
            qp_type: qp_type::UC,
            ..r
        };
        assert_eq!(
            refused(create_qp(&uc, &config(), features::RC)),
            Refusal::NotNegotiated("UC")
        );
        assert!(create_qp(&uc, &config(), features::RC | features::UC).is_ok());
    }

    #[test]
    fn a_qp_on_an_srq_has_no_rq_of_its_own() {
        let on_srq = CreateQpRequest {
            srq: Le32::from(9),
            max_recv_wr: Le32::from(0),
            max_recv_sge: Le32::from(0),
            rq_wqe_shift: 0,
            ..rc_request()
        };
        let shape = create_qp(&on_srq, &config(), features::RC | features::SRQ).unwrap();
        assert_eq!((shape.caps.max_recv_wr, shape.caps.max_recv_sge), (0, 0));
        assert_eq!(
            refused(create_qp(&on_srq, &config(), features::RC)),
            Refusal::NotNegotiated("SRQ")
        );
        let with_rq_too = CreateQpRequest {
            max_recv_wr: Le32::from(8),
            ..on_srq
        };
        assert_eq!(
            refused(create_qp(
                &with_rq_too,
                &config(),
                features::RC | features::SRQ
            )),
            Refusal::RqOnSrqQp
        );
    }

    #[test]
    fn srq_shapes() {
        let config = DeviceConfig {
            max_srq_wr: Le32::from(1024),
            ..config()
        };
        let good = CreateSrqRequest {
            max_wr: Le32::from(64),
            max_sge: Le32::from(3),
            wqe_shift: 6,
            ..Default::default()
        };
        assert_eq!(create_srq(&good, &config).unwrap(), (64, 3));
        for (i, (bad, refusal)) in [
            (
                CreateSrqRequest {
                    max_wr: Le32::from(48),
                    ..good
                },
                Refusal::NotPowerOfTwo {
                    field: "SRQ depth",
                    value: 48,
                    min: 1,
                    max: 1024,
                },
            ),
            (
                CreateSrqRequest {
                    max_sge: Le32::from(0),
                    ..good
                },
                out_of_range("SRQ max_sge", 0, 1, 32),
            ),
            (
                CreateSrqRequest {
                    max_sge: Le32::from(4),
                    ..good
                },
                Refusal::SlotTooSmall {
                    queue: "SRQ",
                    slot: 64,
                    needed: recv_slot_bytes(4),
                },
            ),
            (
                CreateSrqRequest {
                    wqe_shift: 13,
                    ..good
                },
                out_of_range(
                    "SRQ wqe_shift",
                    13,
                    MIN_RQ_WQE_SHIFT.into(),
                    MAX_WQE_SHIFT.into(),
                ),
            ),
            (
                CreateSrqRequest {
                    reserved: [1, 0, 0],
                    ..good
                },
                Refusal::Reserved,
            ),
            (
                CreateSrqRequest {
                    srq_limit: Le32::from(64),
                    ..good
                },
                Refusal::SrqLimit {
                    limit: 64,
                    depth: 64,
                },
            ),
        ]
        .iter()
        .enumerate()
        {
            let got = refused(create_srq(bad, &config));
            assert_eq!(&got, refusal, "case {i}");
            assert_eq!(got.status(), Status::InvalidArgument, "case {i}");
        }
        let limited = CreateSrqRequest {
            srq_limit: Le32::from(4),
            ..good
        };
        assert!(create_srq(&limited, &config).is_ok());
    }

    #[test]
    fn modify_srq_arms_a_limit_below_the_depth_and_nothing_else() {
        let arm = |attr_mask, srq_limit| ModifySrqRequest {
            handle: Le32::from(1),
            attr_mask: Le32::from(attr_mask),
            srq_limit: Le32::from(srq_limit),
            reserved: Le32::from(0),
        };
        assert_eq!(modify_srq(&arm(2, 10), 64).unwrap(), 10);
        assert_eq!(modify_srq(&arm(2, 0), 64).unwrap(), 0);
        let mask = |value, bits| Refusal::UnknownBits {
            field: "MODIFY_SRQ attr_mask",
            value,
            bits,
        };
        for (attr_mask, limit, refusal) in [
            (
                2,
                64,
                Refusal::SrqLimit {
                    limit: 64,
                    depth: 64,
                },
            ),
            (1, 10, mask(1, 3)),
            (3, 10, mask(3, 1)),
        ] {
            assert_eq!(
                refused(modify_srq(&arm(attr_mask, limit), 64)),
                refusal,
                "mask {attr_mask} limit {limit}"
            );
        }
    }

    #[test]
    fn depths_are_powers_of_two_in_range() {
        assert!(depth("d", 64, 2, 64).is_ok());
        for bad in [0, 1, 3, 128] {
            assert_eq!(
                depth("d", bad, 2, 64),
                Err(Refusal::NotPowerOfTwo {
                    field: "d",
                    value: bad,
                    min: 2,
                    max: 64
                })
            );
        }
    }
}
