//! Unit tests of `shm::heap`.

use super::*;

#[test]
fn free_list_aligns_splits_and_coalesces() {
    let mut list = FreeList::new(4 * PAGE_SIZE);
    let a = list.alloc(100, 8).unwrap();
    let b = list.alloc(PAGE_SIZE, PAGE_SIZE).unwrap();
    assert_eq!((a, b), (0, PAGE_SIZE));
    let c = list.alloc(16, 8).unwrap();
    assert_eq!(c, 104, "the gap before the aligned page is reused");
    assert!(list.alloc(4 * PAGE_SIZE, 8).is_none());
    list.release(b, PAGE_SIZE);
    list.release(a, 100);
    list.release(c, 16);
    assert_eq!(list.free, vec![(0, 4 * PAGE_SIZE)]);
}

#[test]
fn small_buffers_leave_no_fragments_between_pages() {
    let mut heap = Heap::new(1024 * PAGE_SIZE);
    // A QP's rings and doorbell record, many times over.
    let taken: Vec<[u64; 3]> = (0..300)
        .map(|_| {
            let sq = heap.alloc(PAGE_SIZE, PAGE_SIZE).unwrap();
            let rq = heap.alloc(PAGE_SIZE, PAGE_SIZE).unwrap();
            // A QP's doorbell record: 16 bytes, aligned to 64.
            let doorbell = heap.alloc(16, 64).unwrap();
            [sq, rq, doorbell]
        })
        .collect();
    assert_eq!(heap.pages.free.len(), 1, "the pages stay one free range");
    assert!(heap.small.free.len() <= 1);
    let doorbells: std::collections::HashSet<u64> = taken.iter().map(|t| t[2]).collect();
    assert_eq!(
        doorbells.len(),
        300,
        "no doorbell record is handed out twice"
    );
    for [sq, rq, doorbell] in taken {
        heap.release(sq, PAGE_SIZE, PAGE_SIZE);
        heap.release(rq, PAGE_SIZE, PAGE_SIZE);
        heap.release(doorbell, 16, 64);
    }
    // The small pool keeps its 5 pages (300 records of 64 bytes), whole again.
    assert_eq!(
        heap.small.free.iter().map(|f| f.1).sum::<u64>(),
        5 * PAGE_SIZE
    );
    assert_eq!(
        heap.pages.free.iter().map(|f| f.1).sum::<u64>(),
        1019 * PAGE_SIZE
    );
    let small_ring = heap.alloc(100, PAGE_SIZE).unwrap();
    let next = heap.alloc(PAGE_SIZE, PAGE_SIZE).unwrap();
    assert_eq!(
        next,
        small_ring + PAGE_SIZE,
        "page-aligned small buffers take whole pages"
    );
}
