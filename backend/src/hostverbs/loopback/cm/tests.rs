//! The loopback connection manager on its own: addresses, state rules, the handshake, the
//! backlog, rejection and disconnection, as librdmacm's events tell them.

use super::*;

/// A fabric of the test's own (tests run side by side).
fn device(test: &str) -> String {
    format!("loopback-cm-unit-{test}")
}

fn address(text: &str) -> SocketAddrV4 {
    text.parse().unwrap()
}

fn param(qp_num: u32, private_data: &[u8]) -> ConnParam {
    ConnParam {
        responder_resources: 1,
        initiator_depth: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        qp_num,
        private_data: private_data.to_vec(),
        ..ConnParam::default()
    }
}

/// The events waiting on `channel`, in order.
fn events(channel: &Arc<Channel>) -> Vec<Event> {
    std::iter::from_fn(|| channel.take_event()).collect()
}

fn kinds(events: &[Event]) -> Vec<u32> {
    events.iter().map(|e| e.event).collect()
}

/// Whether the channel's fd is readable now.
fn readable(channel: &Channel) -> bool {
    let mut poll = libc::pollfd {
        fd: channel.fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, for the length given; no waiting.
    unsafe { libc::poll(&mut poll, 1, 0) == 1 }
}

/// An id of `channel` resolved to `to`, its route too.
fn routed(channel: &Arc<Channel>, from: &str, to: &str, key: u64) -> Id {
    let id = channel.create_id(false, key).unwrap();
    id.resolve_addr(address(&format!("{from}:0")), address(to))
        .unwrap();
    id.resolve_route().unwrap();
    assert_eq!(
        kinds(&events(channel)),
        [cm_event::ADDR_RESOLVED, cm_event::ROUTE_RESOLVED]
    );
    id
}

fn listener(channel: &Arc<Channel>, at: &str, backlog: u32, key: u64) -> Id {
    let id = channel.create_id(false, key).unwrap();
    id.bind(address(at)).unwrap();
    id.listen(backlog).unwrap();
    id
}

fn errno_of(error: Error) -> i32 {
    match error {
        Error::Verbs { source, .. } => source.raw_os_error().unwrap(),
        other => panic!("{other}"),
    }
}

#[test]
fn only_an_address_a_guest_of_the_device_holds_resolves_and_binds() {
    let name = device("addresses");
    let a = Channel::open(&name, "10.1.0.1".parse().unwrap()).unwrap();
    let id = a.create_id(false, 1).unwrap();
    // Nobody holds 10.1.0.2: ADDR_ERROR, and the id stays bound to resolve again.
    id.resolve_addr(address("10.1.0.1:0"), address("10.1.0.2:7000"))
        .unwrap();
    let got = events(&a);
    assert_eq!(kinds(&got), [cm_event::ADDR_ERROR]);
    assert_eq!((got[0].status, got[0].key), (-libc::ETIMEDOUT, 1));
    assert!(!readable(&a), "the fd stays readable with nothing to take");
    let b = Channel::open(&name, "10.1.0.2".parse().unwrap()).unwrap();
    id.resolve_addr(address("10.1.0.1:0"), address("10.1.0.2:7000"))
        .unwrap();
    assert!(readable(&a));
    assert_eq!(kinds(&events(&a)), [cm_event::ADDR_RESOLVED]);
    let info = id.info();
    assert_eq!(
        info.src.unwrap().ip(),
        &"10.1.0.1".parse::<Ipv4Addr>().unwrap()
    );
    assert!(EPHEMERAL_PORTS.contains(&info.src.unwrap().port()));
    assert_eq!(info.dst, Some(address("10.1.0.2:7000")));
    assert_eq!(info.device.as_deref(), Some(name.as_str()));
    // Binding an address nobody holds, or a port another id has.
    let stray = b.create_id(false, 2).unwrap();
    let refused = stray.bind(address("10.1.0.9:7000")).unwrap_err();
    assert_eq!(errno_of(refused), libc::EADDRNOTAVAIL);
    let _first = listener(&b, "10.1.0.2:7000", 1, 3);
    let taken = stray.bind(address("10.1.0.2:7000")).unwrap_err();
    assert_eq!(errno_of(taken), libc::EADDRINUSE);
    // The address goes with the last channel that holds it.
    drop(stray);
    drop(_first);
    drop(b);
    assert!(!super::super::Device::named(&name)
        .connection_manager()
        .holds("10.1.0.2".parse().unwrap()));
    assert!(super::super::Device::named(&name)
        .connection_manager()
        .holds("10.1.0.1".parse().unwrap()));
}

#[test]
fn commands_out_of_order_are_refused() {
    let name = device("order");
    let a = Channel::open(&name, "10.2.0.1".parse().unwrap()).unwrap();
    let id = a.create_id(false, 1).unwrap();
    let einval = |r: Result<()>| assert_eq!(errno_of(r.unwrap_err()), libc::EINVAL);
    einval(id.resolve_route());
    einval(id.listen(1));
    einval(id.connect(&param(5, b""), 5));
    einval(id.accept(&param(5, b""), 5));
    einval(id.reject(b""));
    einval(id.establish());
    einval(id.disconnect());
    assert!(id.init_qp_attr(QpState::Init as u32).is_err());
    assert_eq!(id.info().device, None, "not bound: on no device");
    id.bind(address("10.2.0.1:7100")).unwrap();
    einval(id.bind(address("10.2.0.1:7101")));
    let (attr, mask) = id.init_qp_attr(QpState::Init as u32).unwrap();
    assert_eq!((attr.qp_state, attr.port_num), (QpState::Init, 1));
    assert_eq!(mask & mask::ACCESS_FLAGS, mask::ACCESS_FLAGS);
    // No peer yet: nothing to reach RTR with.
    assert!(id.init_qp_attr(QpState::Rtr as u32).is_err());
    assert!(events(&a).is_empty());
}

#[test]
fn a_connection_is_requested_accepted_established_and_disconnected_from_either_side() {
    let name = device("connection");
    let server = Channel::open(&name, "10.3.0.1".parse().unwrap()).unwrap();
    let client = Channel::open(&name, "10.3.0.2".parse().unwrap()).unwrap();
    let listening = listener(&server, "10.3.0.1:7200", 4, 10);
    let id = routed(&client, "10.3.0.2", "10.3.0.1:7200", 20);
    id.connect(&param(101, b"hello"), 101).unwrap();
    let mut got = events(&server);
    assert_eq!(kinds(&got), [cm_event::CONNECT_REQUEST]);
    let request = got.remove(0);
    assert_eq!(request.key, 10, "routed by the listener's key");
    assert_eq!(
        (request.param.qp_num, request.param.private_data.as_slice()),
        (101, &b"hello"[..])
    );
    let accepted = request.new_id.expect("the request's id");
    accepted.set_key(11);
    assert_eq!(accepted.info().src, Some(address("10.3.0.1:7200")));
    // The peer's QP is known on both sides once the request is answered.
    accepted.accept(&param(202, b"welcome"), 202).unwrap();
    let got = events(&client);
    assert_eq!(kinds(&got), [cm_event::CONNECT_RESPONSE]);
    assert_eq!((got[0].key, got[0].param.qp_num), (20, 202));
    assert_eq!(got[0].param.private_data, b"welcome");
    let (client_rtr, _) = id.init_qp_attr(QpState::Rtr as u32).unwrap();
    let (server_rtr, _) = accepted.init_qp_attr(QpState::Rtr as u32).unwrap();
    let (client_rts, _) = id.init_qp_attr(QpState::Rts as u32).unwrap();
    let (server_rts, mask) = accepted.init_qp_attr(QpState::Rts as u32).unwrap();
    assert_eq!((client_rtr.dest_qp_num, server_rtr.dest_qp_num), (202, 101));
    assert_eq!(client_rtr.rq_psn, server_rts.sq_psn);
    assert_eq!(server_rtr.rq_psn, client_rts.sq_psn);
    assert_eq!(client_rtr.ah_attr.dgid, gid());
    assert_eq!(mask & mask::SQ_PSN, mask::SQ_PSN);
    assert!(events(&server).is_empty(), "ESTABLISHED comes with the RTU");
    id.establish().unwrap();
    let got = events(&server);
    assert_eq!((kinds(&got), got[0].key), (vec![cm_event::ESTABLISHED], 11));
    assert!(events(&client).is_empty());
    // The client disconnects: the server hears it at once, the client once the server
    // answers.
    id.disconnect().unwrap();
    assert_eq!(kinds(&events(&server)), [cm_event::DISCONNECTED]);
    assert!(events(&client).is_empty());
    accepted.disconnect().unwrap();
    assert_eq!(kinds(&events(&client)), [cm_event::DISCONNECTED]);
    // Nothing more on either side, and disconnecting again is no error.
    id.disconnect().unwrap();
    accepted.disconnect().unwrap();
    assert!(events(&server).is_empty() && events(&client).is_empty());
    drop((id, accepted, listening));
    assert_eq!(
        super::super::Device::named(&name)
            .connection_manager()
            .id_count(),
        0
    );
}

#[test]
fn a_request_past_the_backlog_or_to_a_closed_port_is_rejected_and_a_reject_carries_data() {
    let name = device("reject");
    let server = Channel::open(&name, "10.4.0.1".parse().unwrap()).unwrap();
    let client = Channel::open(&name, "10.4.0.2".parse().unwrap()).unwrap();
    // Nobody listens on 7301.
    let lonely = routed(&client, "10.4.0.2", "10.4.0.1:7301", 1);
    lonely.connect(&param(1, b""), 1).unwrap();
    let got = events(&client);
    assert_eq!(
        (kinds(&got), got[0].status),
        (vec![cm_event::REJECTED], REJECT_NO_LISTENER)
    );
    // A backlog of 2: the third request nobody took is rejected.
    let listening = listener(&server, "10.4.0.1:7300", 2, 100);
    let ids: Vec<Id> = (0..3u32)
        .map(|i| {
            let id = routed(&client, "10.4.0.2", "10.4.0.1:7300", 10 + u64::from(i));
            id.connect(&param(i, b""), i).unwrap();
            id
        })
        .collect();
    let got = events(&client);
    assert_eq!(
        (kinds(&got), got[0].key, got[0].status),
        (vec![cm_event::REJECTED], 12, REJECT_CONSUMER)
    );
    // The server takes one and rejects it, with private data.
    let first = server.take_event().unwrap().new_id.unwrap();
    first.reject(b"busy").unwrap();
    let got = events(&client);
    assert_eq!((kinds(&got), got[0].key), (vec![cm_event::REJECTED], 10));
    assert_eq!(got[0].param.private_data, b"busy");
    // The listener goes with a request nobody took: that request is rejected.
    drop(listening);
    let got = events(&client);
    assert_eq!((kinds(&got), got[0].key), (vec![cm_event::REJECTED], 11));
    assert!(
        server.take_event().is_none(),
        "the untaken request went with its listener"
    );
    // The port was the listener's: a request's id, which shares it, does not hold it.
    let again = listener(&server, "10.4.0.1:7300", 1, 200);
    drop((ids, first, lonely, again));
    assert_eq!(
        super::super::Device::named(&name)
            .connection_manager()
            .id_count(),
        0
    );
}

#[test]
fn a_destroyed_peer_is_heard_of() {
    let name = device("destroyed");
    let server = Channel::open(&name, "10.5.0.1".parse().unwrap()).unwrap();
    let client = Channel::open(&name, "10.5.0.2".parse().unwrap()).unwrap();
    let _listening = listener(&server, "10.5.0.1:7400", 4, 1);
    // Before the connection is up: REJECTED at the peer.
    let id = routed(&client, "10.5.0.2", "10.5.0.1:7400", 2);
    id.connect(&param(1, b""), 1).unwrap();
    let accepted = server.take_event().unwrap().new_id.unwrap();
    accepted.set_key(3);
    drop(id);
    let got = events(&server);
    assert_eq!((kinds(&got), got[0].key), (vec![cm_event::REJECTED], 3));
    // Once it is up: DISCONNECTED at the peer.
    let id = routed(&client, "10.5.0.2", "10.5.0.1:7400", 4);
    id.connect(&param(1, b""), 1).unwrap();
    let accepted = server.take_event().unwrap().new_id.unwrap();
    accepted.set_key(5);
    accepted.accept(&param(2, b""), 2).unwrap();
    id.establish().unwrap();
    assert_eq!(kinds(&events(&server)), [cm_event::ESTABLISHED]);
    events(&client);
    drop(accepted);
    assert_eq!(kinds(&events(&client)), [cm_event::DISCONNECTED]);
    // Its peer gone, the client's disconnect answers nothing.
    id.disconnect().unwrap();
    assert!(events(&client).is_empty());
}

#[test]
fn a_ud_request_is_answered_with_the_peer_qp_and_qkey() {
    let name = device("ud");
    let server = Channel::open(&name, "10.6.0.1".parse().unwrap()).unwrap();
    let client = Channel::open(&name, "10.6.0.2".parse().unwrap()).unwrap();
    let listening = server.create_id(true, 1).unwrap();
    listening.bind(address("10.6.0.1:7500")).unwrap();
    listening.listen(1).unwrap();
    let id = client.create_id(true, 2).unwrap();
    id.resolve_addr(address("10.6.0.2:0"), address("10.6.0.1:7500"))
        .unwrap();
    id.resolve_route().unwrap();
    events(&client);
    let (init, mask) = id.init_qp_attr(QpState::Init as u32).unwrap();
    assert_eq!((init.qkey, mask & mask::QKEY), (UDP_QKEY, mask::QKEY));
    id.connect(&param(31, b""), 31).unwrap();
    let request = server.take_event().unwrap();
    assert_eq!(request.param.qp_num, 31);
    assert_eq!(request.ud_ah.map(|ah| ah.dgid), Some(gid()));
    request.new_id.unwrap().accept(&param(32, b""), 32).unwrap();
    let got = events(&client);
    assert_eq!(kinds(&got), [cm_event::ESTABLISHED]);
    assert_eq!((got[0].param.qp_num, got[0].param.qkey), (32, UDP_QKEY));
}
