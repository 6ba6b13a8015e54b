//! What a program sends the guest service (SPEC.md §12.1), as the service reads it: frames
//! off its socket (header, kind, the length bound), each kind's payload, and for CONTROL the
//! whole of what the service decides before the device sees a request (`vrdmad::requests`:
//! framing, the names, records and page lists it carries, each page list read from the
//! program's memory and checked). The memory is a stretch of the input the program "shared".
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_spec::service::MAX_PROGRAM_PAYLOAD;
use vrdma_spec::service::{decode_header, decode_u32, decode_u64, Kind, HEADER_LEN};
use vrdmad::requests::{self, ProgramMemory};

/// Device addresses [BASE, BASE + bytes.len()) are the program's, holding `bytes`.
struct Shared<'a> {
    bytes: &'a [u8],
}

const BASE: u64 = 0x10_0000;

impl ProgramMemory for Shared<'_> {
    fn owns(&self, addr: u64, len: u64) -> bool {
        addr >= BASE
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= BASE + self.bytes.len() as u64)
    }

    fn read(&self, addr: u64, out: &mut [u8]) -> bool {
        if !self.owns(addr, out.len() as u64) {
            return false;
        }
        let at = (addr - BASE) as usize;
        out.copy_from_slice(&self.bytes[at..at + out.len()]);
        true
    }
}

fuzz_target!(|input: &[u8]| {
    // The first 2 bytes say how much of the input is the program's memory; the rest is what
    // it sends.
    let Some((split, rest)) = input.split_first_chunk::<2>() else {
        return;
    };
    let shared_len = (u16::from_le_bytes(*split) as usize).min(rest.len());
    let (memory, mut stream) = rest.split_at(shared_len);
    let memory = Shared { bytes: memory };
    while let Some((header, after)) = stream.split_first_chunk::<HEADER_LEN>() {
        let Ok((kind, length)) = decode_header(header, MAX_PROGRAM_PAYLOAD) else {
            return; // the connection ends
        };
        assert!(length <= MAX_PROGRAM_PAYLOAD);
        let Some(payload) = after.get(..length) else {
            return;
        };
        stream = &after[length..];
        match kind {
            Kind::Hello | Kind::Notify => {
                let _ = decode_u32(payload);
            }
            Kind::AddMemory => {
                let _ = decode_u64(payload);
            }
            Kind::Control => control(payload, &memory),
            // Kinds only the service sends end the connection.
            _ => return,
        }
    }
});

fn control(request: &[u8], memory: &Shared) {
    let Ok(plan) = requests::plan(request) else {
        return;
    };
    // What the plan names lies inside the request it forwards.
    let len = plan.bytes.len();
    assert!(len <= request.len());
    for &(offset, _) in &plan.records {
        assert!(offset + 8 <= len, "a record past the request");
        let _ = requests::address_at(&plan.bytes, offset);
    }
    if let Some(offset) = plan.doorbell_area {
        assert!(offset + 4 <= len, "doorbell_area past the request");
    }
    for &offset in &plan.page_lists {
        assert!(offset + 16 <= len, "a page list past the request");
        let list = requests::page_list_at(&plan.bytes, offset);
        if let Ok((page_size, pages)) = requests::read_page_list(memory, &list) {
            assert!(page_size.is_power_of_two());
            assert_eq!(pages.len() as u32, list.npages.to_native());
            for page in pages {
                assert!(page.is_multiple_of(page_size) && memory.owns(page, page_size));
            }
        }
    }
}
