//! A front end replacing itself under a running guest (SPEC.md §11.1), as QEMU does in a local
//! migration or live update: the device goes from one vhost-user connection to the next with
//! every object, ring position and completion, and nothing else may take it.

use std::io::Write;
use std::path::Path;

use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserHeaderFlag,
    VhostUserProtocolFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::VhostBackend;
use vrdma_guest::spec::handover::SavedState;
use vrdma_guest::spec::ByteValued;
use vrdma_guest::{
    access, Device, DeviceEvent, Payload, QpType, QueuePair, RecvWr, SendOp, SendWr, Sge,
};
use vrdma_tests::{
    connect_guest_qp, served_guest, socket_named, spawn_backend_process, start_backend,
    wait_for_backend_log, wait_for_guest_completions,
};

/// A backend that serves one guest at a time, as it runs for a VM: the new connection is
/// accepted past that limit as the successor, takes the device, and goes on with it. Each of
/// three hand-overs happens with an RDMA WRITE posted just before, whose completion arrives on
/// the new connection; every write's bytes are checked where they land; the old connections
/// close holding nothing.
#[test]
fn a_device_handed_to_a_new_connection_keeps_its_objects_and_completions() {
    let socket = socket_named("handover");
    let mut backend = spawn_backend_process(&socket, &[]);
    let guest = served_guest(&socket);
    guest.still_served(1);
    for round in 0..3u8 {
        let in_flight = [0x40 + round; 64];
        guest.post_write(&in_flight).unwrap();
        guest
            .device
            .replace_front_end()
            .unwrap_or_else(|e| panic!("hand-over {round}: {e}"));
        let done = wait_for_guest_completions(&guest.cq, 1);
        assert!(
            done[0].is_success(),
            "the write across hand-over {round}: {:?}",
            done[0]
        );
        guest.still_served(0x50 + round);
    }
    let log = wait_for_backend_log(
        &socket,
        "three hand-overs and the old connections gone",
        |log| {
            log.matches("took over the guest's device").count() == 3
                && log
                    .matches("closed, its device handed to a successor")
                    .count()
                    == 3
        },
    );
    assert!(!log.contains("device reset"), "{log}");
    assert!(backend.try_wait().unwrap().is_none(), "the backend died");
    drop(guest);
    backend.kill().unwrap();
    backend.wait().unwrap();
}

/// A program asleep waiting for a completion event across the hand-over is woken by the
/// event its peer's SEND raises on the new connection, though it kicks nothing there: the
/// device looks at every queue a connection starts (the event queue's buffers among them),
/// so an event never waits on the old connection's stopped queue.
#[test]
fn an_event_raised_after_the_hand_over_wakes_a_program_that_kicks_nothing() {
    let backend = start_backend();
    let target = backend.socket.to_str().expect("a UTF-8 socket path");
    let sender = Device::open(target).unwrap();
    let sleeper = Device::open(target).unwrap();
    let (index, gid) = sender.gid().unwrap();
    let (sender_pd, sleeper_pd) = (sender.alloc_pd().unwrap(), sleeper.alloc_pd().unwrap());
    let (sender_cq, sleeper_cq) = (sender.create_cq(4).unwrap(), sleeper.create_cq(4).unwrap());
    let sender_qp = QueuePair::builder(QpType::Rc, &sender_cq)
        .max_inline_data(16)
        .build(&sender_pd)
        .unwrap();
    let sleeper_qp = QueuePair::builder(QpType::Rc, &sleeper_cq)
        .build(&sleeper_pd)
        .unwrap();
    connect_guest_qp(&sender_qp, index as u8, gid, sleeper_qp.qp_num()).unwrap();
    connect_guest_qp(&sleeper_qp, index as u8, gid, sender_qp.qp_num()).unwrap();
    let buffer = sleeper.alloc_buffer(4096).unwrap();
    let mr = sleeper_pd.reg_mr(&buffer, access::LOCAL_WRITE).unwrap();
    let sge = Sge {
        addr: buffer.addr(),
        length: 64,
        lkey: mr.lkey(),
    };
    sleeper_qp
        .post_recv(&[RecvWr {
            wr_id: 1,
            sges: &[sge],
        }])
        .unwrap();
    sleeper_cq.req_notify(false).unwrap();
    sleeper.replace_front_end().unwrap();
    sender_qp
        .post_send(&[SendWr::new(2, SendOp::Send, Payload::Inline(b"wake up"))])
        .unwrap();
    let event = sleeper
        .wait_event(std::time::Duration::from_secs(30))
        .unwrap();
    assert_eq!(event, Some(DeviceEvent::CqCompletion(sleeper_cq.handle())));
    let done = wait_for_guest_completions(&sleeper_cq, 1);
    assert_eq!((done[0].wr_id, done[0].byte_len), (1, 7));
    let mut landed = [0u8; 7];
    buffer.read(0, &mut landed).unwrap();
    assert_eq!(&landed, b"wake up");
}

/// A successor that loads a state the backend never saved (forged, or cut short) is refused
/// at CHECK_DEVICE_STATE, takes nothing, and the guest's device goes on where it is.
#[test]
fn a_forged_device_state_takes_nothing() {
    let socket = socket_named("handover-forged");
    let mut backend = spawn_backend_process(&socket, &[]);
    let guest = served_guest(&socket);
    guest.still_served(1);
    let forged = SavedState::new([0x5a; 16]);
    for state in [forged.as_slice(), &forged.as_slice()[..16], b"not a state"] {
        let successor = successor(&socket);
        let (read, mut write) = std::io::pipe().unwrap();
        successor
            .set_device_state_fd(
                VhostTransferStateDirection::LOAD,
                VhostTransferStatePhase::STOPPED,
                read.into(),
            )
            .expect("a successor may load a state");
        write.write_all(state).unwrap();
        drop(write);
        assert!(
            successor.check_device_state().is_err(),
            "a state of {} bytes the backend never saved was taken",
            state.len()
        );
        guest.still_served(2);
    }
    wait_for_backend_log(&socket, "the forged states refused", |log| {
        log.matches("names no device saved on this socket").count() == 1
            && log.matches("is not one this backend saves").count() == 2
    });
    assert!(backend.try_wait().unwrap().is_none(), "the backend died");
    drop(guest);
    backend.kill().unwrap();
    backend.wait().unwrap();
}

/// A second front end on the socket, past the greeting, as a migrating hypervisor's new
/// process is before it loads the device state.
fn successor(socket: &Path) -> Frontend {
    let mut frontend = Frontend::connect(socket, 3).expect("connect");
    frontend.set_owner().unwrap();
    frontend.get_features().unwrap();
    let offered = frontend.get_protocol_features().unwrap();
    assert!(offered.contains(VhostUserProtocolFeatures::DEVICE_STATE));
    frontend
        .set_protocol_features(
            VhostUserProtocolFeatures::REPLY_ACK | VhostUserProtocolFeatures::DEVICE_STATE,
        )
        .unwrap();
    frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    frontend
}
