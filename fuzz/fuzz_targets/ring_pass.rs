//! A poller's passes over the rings, doorbell records, notify area and doorbell bitmap a
//! hostile driver wrote (SPEC.md §7-§8): WQEs taken, validated and posted to a fake host,
//! completions written back, events raised. Runs the data path's own code over plain guest
//! memory (`datapath::fake`), the input being a script of driver and host actions.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress};
use vrdma_backend::datapath::fake::{
    Rig, CQ_DOORBELL, CQ_RING, DOORBELL_BITMAP, LKEY, MR_START, NOTIFY_AREA, QP_DOORBELL, RQ_RING,
    SQ_RING,
};

/// What a driver may scribble on.
const AREAS: [u64; 8] = [
    SQ_RING,
    RQ_RING,
    CQ_RING,
    QP_DOORBELL,
    CQ_DOORBELL,
    NOTIFY_AREA,
    DOORBELL_BITMAP,
    MR_START,
];

fuzz_target!(|input: &[u8]| {
    // Rings of one run of memory, or (odd lengths) of scattered pages.
    let mut rig = if input.len().is_multiple_of(2) {
        Rig::new(16)
    } else {
        Rig::with_scattered_rings(16)
    };
    let mut script = input;
    while let [action, rest @ ..] = script {
        script = rest;
        match action % 6 {
            // The driver writes up to 63 bytes anywhere in one of its areas.
            0 => {
                let [area, at, len, data @ ..] = script else {
                    break;
                };
                let len = usize::from(*len % 64).min(data.len());
                let gpa = AREAS[usize::from(*area) % AREAS.len()] + u64::from(*at) * 8;
                rig.mem
                    .write_slice(&data[..len], GuestAddress(gpa))
                    .expect("inside guest memory");
                script = &data[len..];
            }
            // A well-formed RDMA WRITE, with the MR's key or another.
            1 => {
                let [wr_id, key, data @ ..] = script else {
                    break;
                };
                let lkey = if key % 2 == 0 { LKEY } else { u32::from(*key) };
                rig.write_send(u64::from(*wr_id), lkey);
                script = data;
            }
            2 => rig.ring_sq(),
            // The host completes a WQE, known or not.
            3 => {
                let [wr_id, data @ ..] = script else {
                    break;
                };
                rig.complete([u64::from(*wr_id)]);
                script = data;
            }
            // The host takes only so many sends.
            4 => {
                let [room, data @ ..] = script else {
                    break;
                };
                rig.qp
                    .room
                    .store(usize::from(*room), std::sync::atomic::Ordering::Relaxed);
                script = data;
            }
            _ => {
                rig.pass();
            }
        }
    }
    rig.pass();
});
