//! The vhost-user side the backend owns (backend/src/vhost_user.rs): serving the control
//! queue over whatever descriptor table and rings a hostile driver wrote (chains read,
//! requests framed, responses written back, chains marked used, a broken queue reported),
//! and GET_CONFIG windows at any offset and size.
#![no_main]

use libfuzzer_sys::fuzz_target;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vrdma_backend::device::frame_request;
use vrdma_backend::vhost_user::{config_window, serve_control_chains};

const DESC_TABLE: u64 = 0;
const AVAIL_RING: u64 = 0x1000;
const USED_RING: u64 = 0x2000;
/// Guest RAM: two regions with a hole between them, so chains can cross or fall into it.
const REGIONS: [(u64, usize); 2] = [(0, 0x8000), (0x9000, 0x7000)];
/// The configuration space's size (SPEC.md §3).
const CONFIG_LEN: usize = std::mem::size_of::<vrdma_spec::config::DeviceConfig>();

fuzz_target!(|input: &[u8]| {
    let [shift, next_avail_lo, next_avail_hi, event_idx, o0, o1, s0, s1, memory @ ..] = input
    else {
        return;
    };
    let config: Vec<u8> = (0..CONFIG_LEN as u8).collect();
    let (offset, size) = (
        u32::from_le_bytes([*o0, *o1, 0, 0]),
        u32::from_le_bytes([*s0, *s1, 0, 0]),
    );
    let window = config_window(&config, offset, size);
    let start = (offset as usize).min(CONFIG_LEN);
    assert_eq!(
        window,
        &config[start..(start + size as usize).min(CONFIG_LEN)]
    );

    let mem: GuestMemoryMmap =
        GuestMemoryMmap::from_ranges(&REGIONS.map(|(start, len)| (GuestAddress(start), len)))
            .unwrap();
    // The driver's writes: the descriptor table, the rings and the buffers they name.
    let mut at = 0u64;
    for chunk in memory.chunks(0x1000) {
        let _ = mem.write_slice(chunk, GuestAddress(at));
        at += 0x1000;
    }
    let mut queue = Queue::new(256).unwrap();
    queue.set_size(1 << (shift % 9));
    queue.set_desc_table_address(Some(DESC_TABLE as u32), Some(0));
    queue.set_avail_ring_address(Some(AVAIL_RING as u32), Some(0));
    queue.set_used_ring_address(Some(USED_RING as u32), Some(0));
    queue.set_event_idx(event_idx & 1 != 0);
    queue.set_next_avail(u16::from_le_bytes([*next_avail_lo, *next_avail_hi]));
    queue.set_ready(true);
    assert!(queue.is_valid(&mem));
    // Responses shaped as the device's: a header, and the payload when the request framed.
    let respond = |request: &[u8], room: usize| {
        let payload = frame_request(request, room.saturating_sub(8))
            .map_or(0, |(opcode, _)| opcode.response_size());
        vec![0xa5; (8 + payload).min(room)]
    };
    for _ in 0..2 {
        if serve_control_chains(&mut queue, &mem, respond).is_err() {
            break; // a broken queue: served no more until a reset
        }
    }
});
