//! Page lists (SPEC.md §6) as REG_MR, CREATE_CQ, CREATE_QP and CREATE_SRQ give them: read out
//! of guest memory, bounded, checked page by page against the memory table and resolved to
//! the file behind guest RAM.
#![no_main]

#[path = "guest_memory.rs"]
mod guest_memory;

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vrdma_backend::mtt::{resolve_page_list, PageListRules};
use vrdma_spec::mem::PageList;
use vrdma_spec::read_wire;

/// Where the input's page-list bytes are written before each run.
const LIST_AREA: u64 = 0x10000;
const LIST_AREA_LEN: usize = 0x10000;

/// Two regions of file-backed guest memory with a hole between them, as a VM's would be.
fn memory() -> &'static GuestMemoryMmap {
    static MEMORY: OnceLock<GuestMemoryMmap> = OnceLock::new();
    MEMORY.get_or_init(|| guest_memory::file_backed(&[(0, 4 << 20), (8 << 20, 4 << 20)]))
}

fuzz_target!(|input: &[u8]| {
    if input.len() < 20 {
        return;
    }
    let (head, entries) = input.split_at(20);
    let list: PageList = read_wire(head).unwrap();
    let expected = u64::from(u32::from_le_bytes(head[16..20].try_into().unwrap()) % 4096);
    let rules = PageListRules {
        page_size_cap: (1 << 12) | (1 << 21),
        indirect_allowed: head[19] & 1 != 0,
    };
    let mem = memory();
    let len = entries.len().min(LIST_AREA_LEN);
    mem.write_slice(&entries[..len], GuestAddress(LIST_AREA))
        .unwrap();
    mem.write_slice(
        &vec![0; LIST_AREA_LEN - len],
        GuestAddress(LIST_AREA + len as u64),
    )
    .unwrap();
    if let Ok(runs) = resolve_page_list(mem, &list, expected, &rules) {
        let page_size = 1u64 << list.page_shift;
        assert_eq!(runs.iter().map(|run| run.pages).sum::<u64>(), expected);
        for run in runs {
            assert_eq!(run.gpa % page_size, 0);
            // Every run lies inside one region.
            let region = mem.find_region(GuestAddress(run.gpa)).unwrap();
            assert!(run.gpa + run.pages * page_size - 1 <= region.last_addr().0);
        }
    }
});
