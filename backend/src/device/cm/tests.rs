//! Unit tests of `cm`.

use super::*;

const OWN: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);

fn addr(text: &str) -> CmAddr {
    CmAddr::ipv4(text.parse().unwrap())
}

#[test]
fn a_guest_names_only_its_own_source_address() {
    let own = |a: &CmAddr, optional| own_source(OWN, a, optional);
    assert_eq!(
        own(&addr("192.0.2.10:7471"), false),
        Ok("192.0.2.10:7471".parse().unwrap())
    );
    // 0.0.0.0 and no address at all (where allowed) stand for the guest's own.
    assert_eq!(
        own(&addr("0.0.0.0:80"), false),
        Ok("192.0.2.10:80".parse().unwrap())
    );
    assert_eq!(
        own(&CmAddr::default(), true),
        Ok("192.0.2.10:0".parse().unwrap())
    );
    // So does a loopback address: the guest's own machine (libfabric binds "localhost"
    // to find the device of an address), never the host's.
    assert_eq!(
        own(&addr("127.0.0.1:0"), false),
        Ok("192.0.2.10:0".parse().unwrap())
    );
    assert_eq!(
        own(&addr("127.1.2.3:99"), true),
        Ok("192.0.2.10:99".parse().unwrap())
    );
    assert_eq!(
        own(&CmAddr::default(), false),
        Err(Refusal::NotIpv4("source address"))
    );
    assert_eq!(
        own(&addr("192.0.2.11:7471"), true),
        Err(Refusal::ForeignAddress("192.0.2.11".into()))
    );
    let mut ipv6_like = addr("192.0.2.10:1");
    ipv6_like.family = vrdma_spec::Le16::from(10);
    assert_eq!(
        own(&ipv6_like, true),
        Err(Refusal::NotIpv4("source address"))
    );
}

#[test]
fn a_loopback_destination_is_the_guest_itself() {
    assert_eq!(
        destination(OWN, &addr("127.0.0.1:7471")),
        Ok("192.0.2.10:7471".parse().unwrap())
    );
    assert_eq!(
        destination(OWN, &addr("198.51.100.7:7471")),
        Ok("198.51.100.7:7471".parse().unwrap())
    );
    assert_eq!(
        destination(OWN, &addr("0.0.0.0:7471")),
        Err(Refusal::NotIpv4("destination address"))
    );
    assert_eq!(
        destination(OWN, &CmAddr::default()),
        Err(Refusal::NotIpv4("destination address"))
    );
}

#[test]
fn private_data_is_bounded_by_what_each_message_holds() {
    use vrdma_spec::cm::private_data_limit as limit;
    for (command, space, max) in [
        (CmCommand::Connect, PortSpace::Tcp, limit::CONNECT_TCP),
        (CmCommand::Connect, PortSpace::Udp, limit::CONNECT_UDP),
        (CmCommand::Accept, PortSpace::Tcp, limit::ACCEPT_TCP),
        (CmCommand::Accept, PortSpace::Udp, limit::ACCEPT_UDP),
        (CmCommand::Reject, PortSpace::Tcp, limit::REJECT_TCP),
        (CmCommand::Reject, PortSpace::Udp, limit::REJECT_UDP),
    ] {
        assert_eq!(check_private_data(command, space, max), Ok(()));
        let refused = check_private_data(command, space, max + 1).unwrap_err();
        assert_eq!(
            refused,
            Refusal::PrivateData {
                command: command.action(),
                len: max + 1,
                max
            }
        );
        assert_eq!(refused.status(), ctrl::Status::InvalidArgument);
        assert_eq!(refused.detail(), 0, "a field's rule, not a state");
    }
    // The numbers of the messages: REQ 92, SIDR REQ 216 (less rdma_cm's 36-byte header),
    // REP 196, SIDR REP 136, REJ 148.
    assert_eq!(
        (limit::CONNECT_TCP, limit::CONNECT_UDP),
        (92 - 36, 216 - 36)
    );
}

#[test]
fn a_state_refusal_says_einval_as_a_native_device_does() {
    let refused = Refusal::CmState {
        state: IdState::Idle,
        command: CmCommand::ResolveRoute,
    };
    assert_eq!(refused.status(), ctrl::Status::InvalidArgument);
    assert_eq!(refused.detail(), libc::EINVAL as u32);
    assert_eq!(refused.rule(), "CmState(ResolveRoute)");
    assert_eq!(
        refused.to_string(),
        "the id cannot resolve a route while IDLE (SPEC.md §13.3)"
    );
}

#[test]
fn connection_parameters_are_bounded_by_the_device() {
    let config = vrdma_spec::config::DeviceConfig {
        max_qp_rd_atom: Le32::from(4),
        max_qp_init_rd_atom: Le32::from(2),
        ..Default::default()
    };
    let wire = |f: &dyn Fn(&mut CmConnParam)| {
        let mut p = CmConnParam {
            responder_resources: 4,
            initiator_depth: 2,
            retry_count: 7,
            rnr_retry_count: 7,
            private_data_len: 3,
            ..CmConnParam::default()
        };
        p.private_data[..3].copy_from_slice(b"abc");
        f(&mut p);
        p
    };
    let ok = conn_param(&wire(&|_| {}), &config).unwrap();
    assert_eq!(
        (ok.responder_resources, &ok.private_data[..]),
        (4, &b"abc"[..])
    );
    let refused = |f: &dyn Fn(&mut CmConnParam)| conn_param(&wire(f), &config).unwrap_err();
    assert!(matches!(
        refused(&|p| p.responder_resources = 5),
        Refusal::OutOfRange {
            field: "responder_resources",
            ..
        }
    ));
    assert!(matches!(
        refused(&|p| p.initiator_depth = 3),
        Refusal::OutOfRange {
            field: "initiator_depth",
            ..
        }
    ));
    assert!(matches!(
        refused(&|p| p.retry_count = 8),
        Refusal::OutOfRange {
            field: "retry_count",
            ..
        }
    ));
    assert!(matches!(
        refused(&|p| p.srq = 2),
        Refusal::NotBoolean { field: "srq", .. }
    ));
    assert!(timeout(0).is_err() && timeout(MAX_TIMEOUT_MS + 1).is_err());
    assert_eq!(timeout(2000), Ok(2000));
}
