//! MTT translation on real verbs: guest pages listed out of order are mapped contiguously by
//! the backend and registered at the guest's virtual address, and the mapping is dropped; a
//! peer's RDMA WRITE and READ at guest VAs then reach exactly the right bytes of guest RAM.
//! Runs inside the VM harness.

use std::fs::File;
use std::sync::Arc;

use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap};
use vrdma_backend::guest_mapping::GuestPagesMapping;
use vrdma_backend::hostverbs::{AnonymousMemory, Payload, PinnedMemory, SendOp, SendWr, Sge};
use vrdma_backend::mtt::{pages_needed, resolve_page_list, PageListRules};
use vrdma_spec::mem::{PageList, PageListForm};
use vrdma_spec::{Le16, Le32, Le64};
use vrdma_tests::{connected_rc_pair, open_test_device, wait_for_completions, FULL_ACCESS};

const PAGE: u64 = 4096;

/// 4 MiB of "guest RAM" backed by a shared-memory file, as a VMM's memfd would be.
fn guest_ram() -> GuestMemoryMmap {
    let path = format!("/dev/shm/vrdma-mtt-rxe-{}", std::process::id());
    let file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    file.set_len(4 << 20).unwrap();
    GuestMemoryMmap::from_ranges_with_files([(
        GuestAddress(0x1000_0000),
        4 << 20,
        Some(FileOffset::new(file, 0)),
    )])
    .unwrap()
}

#[test]
#[ignore = "needs rdma_rxe: run by tests/run-all.sh inside the VM harness"]
fn rdma_at_guest_virtual_addresses_reaches_scattered_guest_pages() {
    let mem = guest_ram();
    let base = 0x1000_0000u64;
    // The guest's buffer: VA 0x7f12_3456_7123, 14000 bytes: 4 pages, starting mid-page.
    let virt_addr = 0x7f12_3456_7123u64;
    let length = 14_000u64;
    let npages = pages_needed(virt_addr % PAGE, length, 12).unwrap();
    assert_eq!(npages, 4);
    let gpas = [
        base + 200 * PAGE,
        base + 7 * PAGE,
        base + 8 * PAGE,
        base + 3 * PAGE,
    ];
    let list_at = base + 900 * PAGE;
    let entries: Vec<u8> = gpas.iter().flat_map(|g| g.to_le_bytes()).collect();
    mem.write_slice(&entries, GuestAddress(list_at)).unwrap();
    let list = PageList {
        addr: Le64::from(list_at),
        npages: Le32::from(npages as u32),
        page_shift: 12,
        form: PageListForm::Direct as u8,
        reserved: Le16::from(0),
    };
    let rules = PageListRules {
        page_size_cap: 1 << 12,
        indirect_allowed: true,
    };
    let pages = resolve_page_list(&mem, &list, npages, &rules).expect("valid page list");
    let faults = vrdma_backend::guest_faults::FaultDomain::new("the test's guest memory");
    let mapping = GuestPagesMapping::new(&pages, PAGE, &faults).expect("map guest pages");

    let context = open_test_device();
    let (a, b) = connected_rc_pair(&context);
    let guest_mr =
        b.pd.reg_mr_pinned(
            &*mapping,
            (virt_addr % PAGE) as usize,
            length as usize,
            virt_addr,
            FULL_ACCESS,
        )
        .expect("register guest MR at the guest VA");
    assert_eq!(guest_mr.iova(), virt_addr);
    // As the device does: the backend's mapping goes right after registration; the NIC
    // keeps reaching the pinned guest pages through the MR.
    drop(mapping);

    let local = Arc::new(AnonymousMemory::new(8192).unwrap());
    let local_mr =
        a.pd.reg_mr(
            local.clone() as Arc<dyn PinnedMemory>,
            0x5000_0000,
            FULL_ACCESS,
        )
        .unwrap();
    let pattern: Vec<u8> = (0..6000u32).map(|i| (i * 13 % 256) as u8).collect();
    local.write(0, &pattern).unwrap();

    // Write 6000 bytes at guest VA virt_addr + 3000: they straddle guest pages 0, 1 and 2.
    let sge = [Sge {
        addr: local_mr.iova(),
        length: 6000,
        lkey: local_mr.lkey(),
    }];
    let target = virt_addr + 3000;
    let write = SendOp::RdmaWrite {
        remote_addr: target,
        rkey: guest_mr.rkey(),
    };
    a.qp.post_send(&[SendWr::new(1, write, Payload::Sges(&sge))])
        .unwrap();
    let done = wait_for_completions(&a.cq, 1);
    assert!(done[0].is_success(), "{:?}", done[0]);

    // Check every byte where the guest sees it: VA -> page index -> the listed GPA.
    let page_start = virt_addr & !(PAGE - 1);
    for (i, expected) in pattern.iter().enumerate() {
        let va = target + i as u64;
        let page = ((va - page_start) / PAGE) as usize;
        let gpa = gpas[page] + (va % PAGE);
        let mut got = [0u8];
        mem.read_slice(&mut got, GuestAddress(gpa)).unwrap();
        assert_eq!(got[0], *expected, "byte {i} at VA {va:#x} (GPA {gpa:#x})");
    }

    // The guest changes its memory; an RDMA READ at guest VAs brings the new bytes back.
    mem.write_slice(b"guest wrote this", GuestAddress(gpas[3] + 100))
        .unwrap();
    let sge_read = [Sge {
        addr: local_mr.iova() + 7000,
        length: 16,
        lkey: local_mr.lkey(),
    }];
    let read_va = page_start + 3 * PAGE + 100;
    let read = SendOp::RdmaRead {
        remote_addr: read_va,
        rkey: guest_mr.rkey(),
    };
    a.qp.post_send(&[SendWr::new(2, read, Payload::Sges(&sge_read))])
        .unwrap();
    assert!(wait_for_completions(&a.cq, 1)[0].is_success());
    let mut read_back = [0u8; 16];
    local.read(7000, &mut read_back).unwrap();
    assert_eq!(&read_back, b"guest wrote this");

    // One byte past the registered range is refused by the NIC, not written.
    let past_the_end = SendOp::RdmaWrite {
        remote_addr: virt_addr + length - 8,
        rkey: guest_mr.rkey(),
    };
    a.qp.post_send(&[SendWr::new(3, past_the_end, Payload::Sges(&sge_read))])
        .unwrap();
    const IBV_WC_REM_ACCESS_ERR: u32 = 10;
    assert_eq!(
        wait_for_completions(&a.cq, 1)[0].status(),
        IBV_WC_REM_ACCESS_ERR
    );
}
