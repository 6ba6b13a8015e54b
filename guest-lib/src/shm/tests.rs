//! Unit tests of `shm`.

use super::*;
use std::os::unix::fs::FileExt;

use crate::Error;

#[test]
fn buffers_are_zeroed_bounded_and_returned() {
    let region = Region::new(2 * PAGE_SIZE, false).unwrap();
    let buffer = region.alloc(PAGE_SIZE, PAGE_SIZE).unwrap();
    assert_eq!(buffer.addr() % PAGE_SIZE, 0);
    buffer.write(10, b"abc").unwrap();
    let mut out = [0u8; 4];
    buffer.read(9, &mut out).unwrap();
    assert_eq!(&out, b"\0abc");
    assert!(buffer.write(PAGE_SIZE - 1, b"xy").is_err());
    assert!(buffer.atomic_u32(2).is_err(), "misaligned atomic");
    assert!(region.alloc(2 * PAGE_SIZE, 8).is_none());
    drop(buffer);
    let again = region.alloc(2 * PAGE_SIZE, 8).expect("space came back");
    let mut first = [1u8; 16];
    again.read(0, &mut first).unwrap();
    assert_eq!(first, [0u8; 16], "reused memory is zeroed");
}

#[test]
fn device_addresses_follow_the_page_table() {
    let mut region = Region::map(3 * PAGE_SIZE, false).unwrap();
    // Pages 0 and 1 are contiguous for the device, page 2 is elsewhere.
    region.addressing = DeviceAddressing::Pages(vec![0x10_0000, 0x10_1000, 0x50_0000]);
    let region = Arc::new(region);
    let set = RegionSet::default();
    set.add(Arc::clone(&region));
    let (page_size, pages) = set
        .device_pages(region.addr() + 100, 2 * PAGE_SIZE)
        .unwrap();
    assert_eq!(
        (page_size, pages),
        (PAGE_SIZE, vec![0x10_0000, 0x10_1000, 0x50_0000])
    );
    assert!(set
        .device_pages(region.addr() + 100, 3 * PAGE_SIZE)
        .is_none());
    assert_eq!(region.device_range(8, 2 * PAGE_SIZE - 8), Some(0x10_0008));
    assert_eq!(region.device_range(PAGE_SIZE + 8, PAGE_SIZE), None);
    let a = region.alloc(PAGE_SIZE, PAGE_SIZE).unwrap();
    let b = region.alloc(2 * PAGE_SIZE, PAGE_SIZE).unwrap();
    assert_eq!(a.device_addr().unwrap(), 0x10_0000);
    assert!(matches!(b.device_addr(), Err(Error::NotContiguous { .. })));
}

/// Anonymous private memory of `pages` pages, as malloc would give a program.
fn program_memory(pages: u64) -> u64 {
    // SAFETY: a fresh anonymous mapping; checked.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            (pages * PAGE_SIZE) as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    ptr as u64
}

#[test]
fn program_memory_is_shared_in_place_with_its_bytes_and_addresses() {
    let addr = program_memory(4);
    let bytes = addr as *mut u8;
    // SAFETY: the 4 pages mapped above, written and read only by this test.
    unsafe { std::ptr::copy_nonoverlapping(b"kept".as_ptr(), bytes.add(5000), 4) };
    let set = RegionSet::default();
    let made = std::cell::RefCell::new(Vec::new());
    let share = |start, len| {
        made.borrow_mut().push((start, len));
        // SAFETY: nothing else uses this test's memory.
        unsafe { Region::share_in_place(start, len) }.map(Arc::new)
    };
    // Bytes 100..4200: pages 0 and 1.
    // SAFETY: the test's own mapping, which nothing else uses or writes meanwhile.
    unsafe { set.share(addr + 100, 4100, share).unwrap() };
    // Pages 1..4 next: only 2 and 3 are new.
    // SAFETY: the test's own mapping, which nothing else uses or writes meanwhile.
    unsafe { set.share(addr + PAGE_SIZE, 3 * PAGE_SIZE, share).unwrap() };
    assert_eq!(
        *made.borrow(),
        vec![(addr, 2 * PAGE_SIZE), (addr + 2 * PAGE_SIZE, 2 * PAGE_SIZE)]
    );
    // SAFETY: bytes 5000..5004 of the 4 pages mapped above, now over the memfd.
    let kept = unsafe { std::slice::from_raw_parts(bytes.add(5000), 4) };
    assert_eq!(kept, b"kept", "contents survive the remap");
    // The memfd now backs the program's memory: a write to the file shows there.
    let regions = set.lock();
    regions[0]
        .file()
        .unwrap()
        .write_all_at(b"NIC", 5000)
        .unwrap();
    drop(regions);
    // SAFETY: bytes 5000..5003 of the 4 pages mapped above, now over the memfd.
    let seen = unsafe { std::slice::from_raw_parts(bytes.add(5000), 3) };
    assert_eq!(seen, b"NIC");
    // One page list across both regions, at the program's own addresses.
    let (page_size, pages) = set.device_pages(addr + 10, 4 * PAGE_SIZE - 10).unwrap();
    assert_eq!(page_size, PAGE_SIZE);
    assert_eq!(
        pages,
        (0..4).map(|i| addr + i * PAGE_SIZE).collect::<Vec<_>>()
    );
    assert!(
        set.device_pages(addr, 5 * PAGE_SIZE).is_none(),
        "page 4 is not shared"
    );
    assert!(
        set.alloc(8, 8).is_none(),
        "program memory is never handed out"
    );
    drop(set);
    // SAFETY: bytes of the test's own mapping, which outlives the regions dropped above.
    let after = unsafe { std::slice::from_raw_parts(bytes.add(5000), 3) };
    assert_eq!(after, b"NIC");
    // SAFETY: the test's own mapping, no longer used.
    unsafe { libc::munmap(addr as *mut libc::c_void, (4 * PAGE_SIZE) as usize) };
}

#[test]
fn sharing_memory_that_cannot_be_read_fails_cleanly() {
    let addr = program_memory(1);
    // Made unreadable, not unmapped: a test running alongside could map a freed page
    // again, and this one would then share (and replace) that test's memory.
    // SAFETY: this test's own page, which nothing dereferences from now on.
    let protected = unsafe {
        libc::mprotect(
            addr as *mut libc::c_void,
            PAGE_SIZE as usize,
            libc::PROT_NONE,
        )
    };
    assert_eq!(protected, 0);
    // SAFETY: the range cannot be read, which the kernel reports; nothing is dereferenced.
    let err = unsafe { Region::share_in_place(addr, PAGE_SIZE) }
        .err()
        .unwrap();
    assert!(matches!(err, Error::SharedMemory(_)), "{err}");
    // SAFETY: the address is refused for its alignment before anything is touched.
    let unaligned = unsafe { Region::share_in_place(addr + 1, PAGE_SIZE) };
    assert!(unaligned.is_err(), "unaligned");
    // SAFETY: the test's own mapping, no longer used.
    unsafe { libc::munmap(addr as *mut libc::c_void, PAGE_SIZE as usize) };
}
