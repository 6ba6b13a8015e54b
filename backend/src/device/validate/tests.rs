//! Unit tests of `validate`.

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
