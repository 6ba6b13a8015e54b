//! The host refuses: every host verb a control command calls fails once (the backend's host
//! wrapped by [`Faults`]), and the guest gets HOST_ERROR (NO_RESOURCES for ENOMEM)
//! with the host's errno, nothing of the failed command stays behind on the host, and the
//! same command succeeds when asked again. Posts the host takes only in part lose and double
//! nothing; a QP the host fails reaches the guest as QP_FATAL with its work flushed; a port
//! going down and up reaches every guest; a guest whose GID the host reassigned is told so.
//! The wrapper fails any host on cue: the test command runs these on the loopback host, and
//! the control commands' refusals on rxe too.

use std::time::Duration;

use std::sync::Arc;

use vrdma_backend::hostverbs::faults::{Faults, Verb};
use vrdma_guest::{
    access, qp_attr_mask as mask, wc_status, AhAttr, Device, DeviceEvent, Error, Payload, QpAttr,
    QpState, QpType, QueuePair, RecvWr, SendOp, SendWr, Sge, Status,
};
use vrdma_tests::{
    host_resource_counts, start_backend, test_device_name, wait_for_guest_completions,
    wait_for_host_counts, TestBackend, WritingGuest,
};

/// The faults of the test's own device (the backend serves it in this process): taken before
/// the backend opens the device ([`start_faulty_backend`]), so that its contexts are wrapped.
fn host() -> Arc<Faults> {
    Faults::on(&test_device_name())
}

/// A backend on the test's device, whose host fails on demand.
fn start_faulty_backend() -> TestBackend {
    host();
    start_backend()
}

/// Arms one failure of `verb` with `errno`, runs `command`, and checks the guest got `status`
/// with the host's errno, the failure fired, and the host holds what it held before.
fn refused_once<T>(
    verb: Verb,
    errno: i32,
    status: Status,
    command: impl FnOnce() -> Result<T, Error>,
) {
    let before = host_resource_counts();
    host().fail(verb, 0, errno);
    match command() {
        Err(Error::Device {
            status: s, detail, ..
        }) if s == status && detail == errno as u32 => {}
        Err(other) => panic!("{verb} failing with errno {errno}: the guest got {other}"),
        Ok(_) => panic!("{verb} failing with errno {errno}: the command succeeded"),
    }
    assert_eq!(host().failures_pending(), 0, "{verb} was never called");
    assert_eq!(
        host_resource_counts(),
        before,
        "{verb} failed, yet left objects behind"
    );
}

#[test]
fn every_host_refusal_of_a_control_command_reaches_the_guest_and_leaves_nothing() {
    every_host_refusal_of_a_control_command();
}

/// The same over libibverbs: the faults wrap any host.
#[test]
#[ignore = "needs rdma_rxe: run by tests/run-all.sh inside the VM harness"]
fn every_libibverbs_refusal_of_a_control_command_reaches_the_guest_and_leaves_nothing() {
    every_host_refusal_of_a_control_command();
}

fn every_host_refusal_of_a_control_command() {
    let backend = start_faulty_backend();
    let baseline = host_resource_counts();
    {
        let device = Device::attach(&backend.socket).unwrap();
        refused_once(Verb::QueryPort, libc::EIO, Status::HostError, || {
            device.query_port()
        });
        device.query_port().unwrap();
        refused_once(Verb::QueryGid, libc::ENODATA, Status::HostError, || {
            device.query_gid(0)
        });
        device.query_gid(0).unwrap();

        refused_once(Verb::AllocPd, libc::ENOMEM, Status::NoResources, || {
            device.alloc_pd()
        });
        let pd = device.alloc_pd().unwrap();
        refused_once(Verb::CreateCq, libc::ENOMEM, Status::NoResources, || {
            device.create_cq(16)
        });
        let cq = device.create_cq(16).unwrap();

        let buffer = device.alloc_buffer(8192).unwrap();
        refused_once(Verb::RegMr, libc::EFAULT, Status::HostError, || {
            pd.reg_mr(&buffer, access::LOCAL_WRITE)
        });
        let _mr = pd.reg_mr(&buffer, access::LOCAL_WRITE).unwrap();

        refused_once(Verb::CreateQp, libc::ENOMEM, Status::NoResources, || {
            QueuePair::builder(QpType::Rc, &cq).build(&pd)
        });
        let qp = QueuePair::builder(QpType::Rc, &cq).build(&pd).unwrap();
        let init = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: access::REMOTE_WRITE,
            ..Default::default()
        };
        let init_mask = mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS;
        // The host refusing a transition is the guest's invalid argument (SPEC.md §5.11).
        refused_once(
            Verb::ModifyQp,
            libc::EINVAL,
            Status::InvalidArgument,
            || qp.modify(&init, init_mask),
        );
        refused_once(Verb::ModifyQp, libc::EIO, Status::HostError, || {
            qp.modify(&init, init_mask)
        });
        assert_eq!(qp.query().unwrap().qp_state, QpState::Reset);
        qp.modify(&init, init_mask).unwrap();
        refused_once(Verb::QueryQp, libc::EIO, Status::HostError, || qp.query());
        assert_eq!(qp.query().unwrap().qp_state, QpState::Init);

        refused_once(Verb::CreateSrq, libc::ENOMEM, Status::NoResources, || {
            pd.create_srq(16, 1)
        });
        let _srq = pd.create_srq(16, 1).unwrap();

        let (gid_index, gid) = device.gid().unwrap();
        let route = AhAttr {
            dgid: gid,
            sgid_index: gid_index as u8,
            hop_limit: 1,
            is_global: true,
            port_num: 1,
            ..Default::default()
        };
        refused_once(Verb::CreateAh, libc::ENOMEM, Status::NoResources, || {
            pd.create_ah(&route)
        });
        let _ah = pd.create_ah(&route).unwrap();
    }
    wait_for_host_counts(&baseline);
}

/// A refused resize leaves the CQ where it was: its old ring, its completions, its depth.
#[test]
fn a_cq_the_host_cannot_resize_keeps_its_ring_and_its_completions() {
    let backend = start_faulty_backend();
    let baseline = host_resource_counts();
    {
        let guest = WritingGuest::on(Device::attach(&backend.socket).unwrap());
        guest.post_write(&[1; 64]).unwrap();
        // The completion waits in the ring while the resize is refused.
        std::thread::sleep(Duration::from_millis(100));
        refused_once(Verb::ResizeCq, libc::ENOMEM, Status::NoResources, || {
            guest.cq.resize(64)
        });
        assert_eq!(guest.cq.depth(), 16);
        let done = wait_for_guest_completions(&guest.cq, 1);
        assert!(done[0].is_success() && done[0].wr_id == 1, "{done:?}");
        guest.still_served(2);
        guest.cq.resize(64).unwrap();
        guest.still_served(3);
    }
    wait_for_host_counts(&baseline);
}

/// The host takes three of a chain of sends and refuses the fourth (EIO): the refused ones
/// stay in the guest's ring and go at the next pass, so each completes once, in order.
#[test]
fn sends_the_host_takes_only_in_part_are_neither_lost_nor_doubled() {
    let backend = start_faulty_backend();
    let guest = WritingGuest::on(Device::attach(&backend.socket).unwrap());
    host().fail(Verb::PostSend, 3, libc::EIO);
    let page = 4096;
    let sge = [Sge {
        addr: guest.buffer.addr(),
        length: 64,
        lkey: guest.mr.lkey(),
    }];
    guest.buffer.write(0, &[7; 64]).unwrap();
    let writes: Vec<SendWr> = (0..8u64)
        .map(|i| {
            let write = SendOp::RdmaWrite {
                remote_addr: guest.buffer.addr() + page + 64 * i,
                rkey: guest.mr.rkey(),
            };
            SendWr::new(100 + i, write, Payload::Sges(&sge))
        })
        .collect();
    guest.qp.post_send(&writes).unwrap();
    let done = wait_for_guest_completions(&guest.cq, 8);
    let ids: Vec<u64> = done.iter().map(|wc| wc.wr_id).collect();
    assert_eq!(ids, (100..108).collect::<Vec<_>>(), "{done:?}");
    assert!(done.iter().all(|wc| wc.is_success()), "{done:?}");
    assert_eq!(
        host().failures_pending(),
        0,
        "the host was never asked for the fourth"
    );
    let mut landed = [0u8; 8 * 64];
    guest.buffer.read(page, &mut landed).unwrap();
    assert!(landed.iter().all(|&b| b == 7));
    // Nothing more comes.
    std::thread::sleep(Duration::from_millis(100));
    let mut more = [Default::default(); 4];
    assert_eq!(guest.cq.poll(&mut more).unwrap(), 0, "{more:?}");
}

/// Receives the host takes only in part: each refused one is posted again, each message
/// lands in its own receive.
#[test]
fn receives_the_host_takes_only_in_part_are_neither_lost_nor_doubled() {
    let backend = start_faulty_backend();
    let device = Device::attach(&backend.socket).unwrap();
    let pd = device.alloc_pd().unwrap();
    let cq = device.create_cq(32).unwrap();
    let (sender, receiver) = (
        QueuePair::builder(QpType::Rc, &cq).build(&pd).unwrap(),
        QueuePair::builder(QpType::Rc, &cq).build(&pd).unwrap(),
    );
    let (gid_index, gid) = device.gid().unwrap();
    vrdma_tests::connect_guest_qp(&sender, gid_index as u8, gid, receiver.qp_num()).unwrap();
    vrdma_tests::connect_guest_qp(&receiver, gid_index as u8, gid, sender.qp_num()).unwrap();
    let buffer = device.alloc_buffer(8192).unwrap();
    let mr = pd.reg_mr(&buffer, access::LOCAL_WRITE).unwrap();
    host().fail(Verb::PostRecv, 1, libc::EIO);
    let slots: Vec<[Sge; 1]> = (0..4u64)
        .map(|i| {
            [Sge {
                addr: buffer.addr() + 4096 + 64 * i,
                length: 64,
                lkey: mr.lkey(),
            }]
        })
        .collect();
    let receives: Vec<RecvWr> = slots
        .iter()
        .enumerate()
        .map(|(i, sge)| RecvWr {
            wr_id: 200 + i as u64,
            sges: sge,
        })
        .collect();
    receiver.post_recv(&receives).unwrap();
    for i in 0..4u8 {
        buffer.write(64 * u64::from(i), &[i + 1; 64]).unwrap();
    }
    let sends: Vec<[Sge; 1]> = (0..4u64)
        .map(|i| {
            [Sge {
                addr: buffer.addr() + 64 * i,
                length: 64,
                lkey: mr.lkey(),
            }]
        })
        .collect();
    let sends: Vec<SendWr> = sends
        .iter()
        .enumerate()
        .map(|(i, sge)| SendWr::new(300 + i as u64, SendOp::Send, Payload::Sges(sge)))
        .collect();
    sender.post_send(&sends).unwrap();
    let done = wait_for_guest_completions(&cq, 8);
    assert!(done.iter().all(|wc| wc.is_success()), "{done:?}");
    let mut received: Vec<u64> = done
        .iter()
        .map(|wc| wc.wr_id)
        .filter(|&id| id < 300)
        .collect();
    received.sort_unstable();
    assert_eq!(received, [200, 201, 202, 203], "{done:?}");
    assert_eq!(host().failures_pending(), 0);
    for i in 0..4u8 {
        let mut landed = [0u8; 64];
        buffer.read(4096 + 64 * u64::from(i), &mut landed).unwrap();
        assert_eq!(landed, [i + 1; 64], "receive {i}");
    }
}

/// A QP the host fails on its own: the guest gets QP_FATAL for it, its outstanding work
/// flushed, and its other objects keep working.
#[test]
fn a_qp_the_host_fails_reaches_the_guest_as_qp_fatal() {
    let backend = start_faulty_backend();
    let baseline = host_resource_counts();
    {
        let guest = WritingGuest::on(Device::attach(&backend.socket).unwrap());
        let buffer = &guest.buffer;
        let sge = [Sge {
            addr: buffer.addr(),
            length: 64,
            lkey: guest.mr.lkey(),
        }];
        guest
            .qp
            .post_recv(&[RecvWr {
                wr_id: 9,
                sges: &sge,
            }])
            .unwrap();
        // The receive reaches the host before the QP fails.
        std::thread::sleep(Duration::from_millis(100));
        assert!(host().raise_qp_fatal(guest.qp.qp_num()));
        let event = guest.device.wait_event(Duration::from_secs(10)).unwrap();
        assert_eq!(event, Some(DeviceEvent::QpFatal(guest.qp.handle())));
        let done = wait_for_guest_completions(&guest.cq, 1);
        assert_eq!(
            (done[0].wr_id, done[0].status),
            (9, wc_status::WR_FLUSH_ERR)
        );
        assert_eq!(guest.qp.query().unwrap().qp_state, QpState::Err);
        // The connection goes on.
        guest.device.query_port().unwrap();
        drop(guest.device.create_cq(4).unwrap());
    }
    wait_for_host_counts(&baseline);
}

/// The port goes down and comes back: every guest of the device hears both, and QUERY_PORT
/// says which state the port is in.
#[test]
fn a_port_going_down_and_up_reaches_every_guest() {
    const PORT_ACTIVE: u8 = 4;
    const PORT_DOWN: u8 = 1;
    let backend = start_faulty_backend();
    let guests = [
        Device::attach(&backend.socket).unwrap(),
        Device::attach(&backend.socket).unwrap(),
    ];
    let port_event = |device: &Device| device.wait_event(Duration::from_secs(10)).unwrap();
    host().set_port_active(false);
    for device in &guests {
        assert_eq!(port_event(device), Some(DeviceEvent::PortError(1)));
        assert_eq!(device.query_port().unwrap().state, PORT_DOWN);
    }
    host().set_port_active(true);
    for device in &guests {
        assert_eq!(port_event(device), Some(DeviceEvent::PortActive(1)));
        assert_eq!(device.query_port().unwrap().state, PORT_ACTIVE);
    }
}

/// The host's GID under the guest's entry changed (its address was taken away and the entry
/// reused): the guest is told its GID is gone, not shown another's.
#[test]
fn a_guest_whose_gid_the_host_reassigned_is_told_it_is_gone() {
    let backend = start_faulty_backend();
    let device = Device::attach(&backend.socket).unwrap();
    let (gid, _) = device.query_gid(0).unwrap();
    let other = vrdma_backend::hostverbs::Gid::from(std::net::Ipv4Addr::new(10, 9, 8, 7));
    host().replace_gid(0, other);
    match device.query_gid(0) {
        Err(Error::Device {
            status: Status::HostError,
            detail,
            ..
        }) if detail == libc::ENODATA as u32 => {}
        answer => panic!("the guest's GID {gid:?} was replaced; QUERY_GID answered {answer:?}"),
    }
}

/// Every librdmacm call a CM command makes fails once: the guest gets HOST_ERROR with the
/// errno, the id stays where it was (the same command then works), and when the guests go no
/// id is left on the host. A path the connection manager routes from a GID not the guest's
/// is refused too.
#[test]
fn every_host_refusal_of_a_cm_command_reaches_the_guest_and_leaves_no_id() {
    use std::net::SocketAddrV4;
    use vrdma_guest::cm::{event, port_space};
    use vrdma_guest::ConnParam;
    use vrdma_tests::{expect_cm_event, start_backend_for_guest};

    host();
    let (server_backend, client_backend) = (
        start_backend_for_guest("10.77.0.1/24"),
        start_backend_for_guest("10.77.0.2/24"),
    );
    let baseline = host_resource_counts();
    {
        let server = Device::attach(&server_backend.socket).unwrap();
        let client = Device::attach(&client_backend.socket).unwrap();
        let param = ConnParam {
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            ..ConnParam::default()
        };
        let rc_qp = |device: &Device| {
            let pd = device.alloc_pd().unwrap();
            let cq = device.create_cq(16).unwrap();
            let qp = QueuePair::builder(QpType::Rc, &cq).build(&pd).unwrap();
            (pd, cq, qp)
        };
        let host_error = |verb, command: &mut dyn FnMut() -> Result<(), Error>| {
            refused_once(verb, libc::EIO, Status::HostError, &mut *command);
            command().unwrap_or_else(|e| panic!("{verb} once the failure fired: {e}"));
        };

        let listener = server.create_cm_id(port_space::TCP).unwrap();
        refused_once(Verb::CmCreateId, libc::EIO, Status::HostError, || {
            server.create_cm_id(port_space::TCP)
        });
        let address: SocketAddrV4 = "10.77.0.1:7600".parse().unwrap();
        host_error(Verb::CmBind, &mut || listener.bind(address).map(drop));
        host_error(Verb::CmListen, &mut || listener.listen(4));

        let id = client.create_cm_id(port_space::TCP).unwrap();
        let wait = Duration::from_secs(2);
        host_error(Verb::CmResolveAddr, &mut || {
            id.resolve_addr(None, address, wait)
        });
        expect_cm_event(&client, &id, event::ADDR_RESOLVED);
        host_error(Verb::CmResolveRoute, &mut || id.resolve_route(wait));
        expect_cm_event(&client, &id, event::ROUTE_RESOLVED);
        let (_client_pd, _client_cq, client_qp) = rc_qp(&client);
        host_error(Verb::CmInitQpAttr, &mut || {
            id.move_qp(&client_qp, QpState::Init)
        });
        host_error(Verb::CmConnect, &mut || id.connect(&client_qp, &param));

        let request = expect_cm_event(&server, &listener, event::CONNECT_REQUEST);
        let accepted = request.new_id.expect("the request's id");
        let (_server_pd, _server_cq, server_qp) = rc_qp(&server);
        accepted.move_qp(&server_qp, QpState::Init).unwrap();
        // A path from a GID that is not the guest's is refused, not handed to the guest.
        host().route_from_gid(Some(1));
        match accepted.move_qp(&server_qp, QpState::Rtr) {
            Err(Error::Device {
                status: Status::HostError,
                detail,
                ..
            }) if detail == libc::EADDRNOTAVAIL as u32 => {}
            other => panic!("a path from another source GID: {other:?}"),
        }
        host().route_from_gid(None);
        for state in [QpState::Rtr, QpState::Rts] {
            accepted.move_qp(&server_qp, state).unwrap();
        }
        host_error(Verb::CmAccept, &mut || accepted.accept(&server_qp, &param));
        expect_cm_event(&client, &id, event::CONNECT_RESPONSE);
        for state in [QpState::Rtr, QpState::Rts] {
            id.move_qp(&client_qp, state).unwrap();
        }
        host_error(Verb::CmEstablish, &mut || id.establish());
        expect_cm_event(&server, &accepted, event::ESTABLISHED);
        host_error(Verb::CmDisconnect, &mut || id.disconnect());
        expect_cm_event(&server, &accepted, event::DISCONNECTED);

        // A second request, which the server turns down.
        let second = client.create_cm_id(port_space::TCP).unwrap();
        second.resolve_addr(None, address, wait).unwrap();
        expect_cm_event(&client, &second, event::ADDR_RESOLVED);
        second.resolve_route(wait).unwrap();
        expect_cm_event(&client, &second, event::ROUTE_RESOLVED);
        let (_pd, _cq, second_qp) = rc_qp(&client);
        second.move_qp(&second_qp, QpState::Init).unwrap();
        second.connect(&second_qp, &param).unwrap();
        let request = expect_cm_event(&server, &listener, event::CONNECT_REQUEST);
        let turned_down = request.new_id.expect("the request's id");
        host_error(Verb::CmReject, &mut || turned_down.reject(b"not now"));
        expect_cm_event(&client, &second, event::REJECTED);
    }
    wait_for_host_counts(&baseline);
}
