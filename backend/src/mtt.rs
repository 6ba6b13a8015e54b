//! Memory translation (SPEC.md §6): guest page lists are read, validated against the guest
//! memory table and resolved to the files that back them, so that
//! [`GuestPagesMapping`](crate::guest_mapping::GuestPagesMapping) can
//! map them contiguously and a host MR can be registered at the guest's virtual address.
//!
//! Everything here treats the page list as hostile: counts and shapes are bounded before any
//! guest memory is read, every entry is read exactly once into the backend's own memory, and
//! every range check is overflow-checked.

use std::fs::File;
use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vrdma_spec::ctrl::Status;
use vrdma_spec::mem::{
    PageList, PageListForm, MAX_DIRECT_PAGES, MAX_INDIRECT_PAGES, MAX_PAGE_SHIFT, MIN_PAGE_SHIFT,
    PAGE_LIST_ENTRIES_PER_PAGE, PAGE_LIST_PAGE_SIZE,
};

/// Why a page list was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MttError {
    #[error("page_shift {0} is not an accepted page size")]
    PageShift(u8),
    #[error("page list form {0} is unknown")]
    Form(u8),
    #[error("indirect page lists were not negotiated")]
    IndirectNotNegotiated,
    #[error("page list names {npages} pages where {expected} are needed")]
    PageCount { npages: u32, expected: u64 },
    #[error("page list address {0:#x} is not 8-byte aligned")]
    ListMisaligned(u64),
    #[error("list page {0:#x} is not 4 KiB aligned")]
    ListPageMisaligned(u64),
    #[error("guest range {gpa:#x}+{len:#x} is not inside one region of guest memory")]
    OutsideGuestMemory { gpa: u64, len: u64 },
    #[error("page {gpa:#x} is not aligned to its size {page_size:#x}")]
    PageMisaligned { gpa: u64, page_size: u64 },
    #[error("guest memory at {0:#x} is not backed by a file the backend can map")]
    NotFileBacked(u64),
    #[error("mapping guest pages failed: {}", std::io::Error::from_raw_os_error(*.0))]
    Map(i32),
    #[error("the pages form {runs} separate runs in guest RAM; one registration may map at most {max} (use larger or contiguous pages)")]
    TooManyRuns { runs: usize, max: usize },
    #[error("no room for {runs} more guest-page mappings while other registrations hold theirs")]
    MappingsExhausted { runs: usize },
}

impl MttError {
    /// The control status a guest sees for this error.
    pub fn status(&self) -> Status {
        match self {
            MttError::PageShift(_) | MttError::Form(_) | MttError::PageCount { .. } => {
                Status::InvalidArgument
            }
            MttError::IndirectNotNegotiated => Status::Unsupported,
            MttError::ListMisaligned(_)
            | MttError::ListPageMisaligned(_)
            | MttError::OutsideGuestMemory { .. }
            | MttError::PageMisaligned { .. }
            | MttError::NotFileBacked(_) => Status::BadAddress,
            MttError::Map(_)
            | MttError::TooManyRuns { .. }
            | MttError::MappingsExhausted { .. } => Status::NoResources,
        }
    }
}

/// What a page list may describe, from the negotiated features and the device config.
#[derive(Clone, Copy, Debug)]
pub struct PageListRules {
    /// Bit n set: pages of 2^n bytes are accepted.
    pub page_size_cap: u64,
    pub indirect_allowed: bool,
}

/// Pages needed to cover `length` bytes that start `offset` bytes into the first page.
pub fn pages_needed(offset: u64, length: u64, page_shift: u8) -> Option<u64> {
    let page_size = 1u64.checked_shl(page_shift.into())?;
    let end = offset.checked_add(length)?;
    Some(end.div_ceil(page_size))
}

/// Pages that follow one another in guest-physical memory inside one region, resolved to
/// the range of the file that backs them.
#[derive(Clone, Debug)]
pub struct PageRun {
    /// The first page's guest-physical address.
    pub gpa: u64,
    /// How many pages.
    pub pages: u64,
    pub file: Arc<File>,
    /// The first page's offset in `file`.
    pub offset: u64,
}

impl PageRun {
    /// The guest-physical address of each page, in order.
    pub fn gpas(&self, page_size: u64) -> impl Iterator<Item = u64> + '_ {
        (0..self.pages).map(move |i| self.gpa + i * page_size)
    }
}

/// Reads the page list `list` from guest memory, checks it names exactly `expected_pages`
/// pages, and resolves every page to its backing file. Returns the pages, in list order, as
/// runs: a list over contiguous guest memory costs one region lookup, not one per page.
pub fn resolve_page_list<M: GuestMemoryBackend>(
    mem: &M,
    list: &PageList,
    expected_pages: u64,
    rules: &PageListRules,
) -> Result<Vec<PageRun>, MttError> {
    let gpas = read_page_list(mem, list, expected_pages, rules)?;
    let page_size = 1u64 << list.page_shift;
    let mut runs: Vec<PageRun> = Vec::new();
    // The last address of the region holding the current run: a page after the run and
    // not past it extends the run without looking the region up again.
    let mut region_last = 0;
    for gpa in gpas {
        if !gpa.is_multiple_of(page_size) {
            return Err(MttError::PageMisaligned { gpa, page_size });
        }
        if let Some(run) = runs.last_mut() {
            let next = run.gpa.checked_add(run.pages * page_size);
            let inside = gpa
                .checked_add(page_size - 1)
                .is_some_and(|last| last <= region_last);
            if Some(gpa) == next && inside {
                run.pages += 1;
                continue;
            }
        }
        let region = check_in_one_region(mem, gpa, page_size)?;
        let file_offset = region.file_offset().ok_or(MttError::NotFileBacked(gpa))?;
        let offset = file_offset
            .start()
            .checked_add(gpa - region.start_addr().0)
            .ok_or(MttError::OutsideGuestMemory {
                gpa,
                len: page_size,
            })?;
        region_last = region.last_addr().0;
        runs.push(PageRun {
            gpa,
            pages: 1,
            file: Arc::clone(file_offset.arc()),
            offset,
        });
    }
    Ok(runs)
}

/// Reads and bounds-checks the page addresses of `list` (not yet the pages themselves).
fn read_page_list<M: GuestMemoryBackend>(
    mem: &M,
    list: &PageList,
    expected_pages: u64,
    rules: &PageListRules,
) -> Result<Vec<u64>, MttError> {
    let shift = list.page_shift;
    if !(MIN_PAGE_SHIFT..=MAX_PAGE_SHIFT).contains(&shift)
        || rules.page_size_cap & (1 << shift) == 0
    {
        return Err(MttError::PageShift(shift));
    }
    let form = PageListForm::try_from(list.form).map_err(MttError::Form)?;
    let npages = list.npages.to_native();
    let max = match form {
        PageListForm::Direct => MAX_DIRECT_PAGES,
        PageListForm::Indirect if rules.indirect_allowed => MAX_INDIRECT_PAGES,
        PageListForm::Indirect => return Err(MttError::IndirectNotNegotiated),
    };
    // Bounded before a single entry is read: a huge count cannot make us read or allocate.
    if npages == 0 || npages > max || u64::from(npages) != expected_pages {
        return Err(MttError::PageCount {
            npages,
            expected: expected_pages,
        });
    }
    let addr = list.addr.to_native();
    if !addr.is_multiple_of(8) {
        return Err(MttError::ListMisaligned(addr));
    }
    match form {
        PageListForm::Direct => read_u64_array(mem, addr, npages as usize),
        PageListForm::Indirect => {
            let list_pages = npages.div_ceil(PAGE_LIST_ENTRIES_PER_PAGE) as usize;
            let mut gpas = Vec::with_capacity(npages as usize);
            for (i, list_page) in read_u64_array(mem, addr, list_pages)?
                .into_iter()
                .enumerate()
            {
                if !list_page.is_multiple_of(PAGE_LIST_PAGE_SIZE) {
                    return Err(MttError::ListPageMisaligned(list_page));
                }
                let done = i * PAGE_LIST_ENTRIES_PER_PAGE as usize;
                let count = (npages as usize - done).min(PAGE_LIST_ENTRIES_PER_PAGE as usize);
                gpas.extend(read_u64_array(mem, list_page, count)?);
            }
            Ok(gpas)
        }
    }
}

/// Copies `count` little-endian u64s at `gpa` out of guest memory; the array must lie in one
/// region.
fn read_u64_array<M: GuestMemoryBackend>(
    mem: &M,
    gpa: u64,
    count: usize,
) -> Result<Vec<u64>, MttError> {
    let len = count as u64 * 8;
    check_in_one_region(mem, gpa, len)?;
    let mut bytes = vec![0u8; count * 8];
    mem.read_slice(&mut bytes, GuestAddress(gpa))
        .map_err(|_| MttError::OutsideGuestMemory { gpa, len })?;
    Ok(bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("chunks of 8")))
        .collect())
}

/// Checks `[gpa, gpa + len)` (len > 0) lies inside one region of guest memory.
pub fn check_guest_range<M: GuestMemoryBackend>(
    mem: &M,
    gpa: u64,
    len: u64,
) -> Result<(), MttError> {
    check_in_one_region(mem, gpa, len).map(|_| ())
}

/// Checks `[gpa, gpa + len)` (len > 0) lies inside one region; returns that region.
fn check_in_one_region<M: GuestMemoryBackend>(
    mem: &M,
    gpa: u64,
    len: u64,
) -> Result<&M::R, MttError> {
    let outside = || MttError::OutsideGuestMemory { gpa, len };
    let last = gpa
        .checked_add(len.checked_sub(1).ok_or_else(outside)?)
        .ok_or_else(outside)?;
    let region = mem.find_region(GuestAddress(gpa)).ok_or_else(outside)?;
    if last > region.last_addr().0 {
        return Err(outside());
    }
    Ok(region)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest_faults::FaultDomain;
    use crate::guest_mapping::{
        with_pages_contiguous, GuestPagesMapping, MapBudget, PopulatedRanges,
    };

    fn faults() -> Arc<FaultDomain> {
        FaultDomain::new("test")
    }
    use crate::hostverbs::PinnedMemory;
    use vm_memory::{FileOffset, GuestMemoryMmap};
    use vrdma_spec::{Le16, Le32, Le64};

    const PAGE: u64 = 4096;
    const RULES: PageListRules = PageListRules {
        page_size_cap: (1 << 12) | (1 << 21),
        indirect_allowed: true,
    };

    fn backing_file(len: u64) -> File {
        let path = std::env::temp_dir().join(format!(
            "vrdma-mtt-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        file.set_len(len).unwrap();
        file
    }

    /// Guest RAM like a VMM's: 1 MiB at 0 and 1 MiB at 4 GiB, both in one file.
    fn guest_memory() -> GuestMemoryMmap {
        let file = Arc::new(backing_file(2 << 20));
        GuestMemoryMmap::from_ranges_with_files([
            (
                GuestAddress(0),
                1 << 20,
                Some(FileOffset::from_arc(file.clone(), 0)),
            ),
            (
                GuestAddress(4 << 30),
                1 << 20,
                Some(FileOffset::from_arc(file, 1 << 20)),
            ),
        ])
        .unwrap()
    }

    fn direct(addr: u64, npages: u32) -> PageList {
        PageList {
            addr: Le64::from(addr),
            npages: Le32::from(npages),
            page_shift: 12,
            form: PageListForm::Direct as u8,
            reserved: Le16::from(0),
        }
    }

    fn write_list(mem: &GuestMemoryMmap, at: u64, gpas: &[u64]) {
        let bytes: Vec<u8> = gpas.iter().flat_map(|g| g.to_le_bytes()).collect();
        mem.write_slice(&bytes, GuestAddress(at)).unwrap();
    }

    #[test]
    fn mapping_follows_list_order_across_regions_and_shares_guest_bytes() {
        let mem = guest_memory();
        let gpas = [(4 << 30) + 3 * PAGE, 5 * PAGE, 9 * PAGE];
        write_list(&mem, 0, &gpas);
        for (i, gpa) in gpas.iter().enumerate() {
            mem.write_slice(&[i as u8 + 1; 16], GuestAddress(*gpa))
                .unwrap();
        }
        let pages = resolve_page_list(&mem, &direct(0, 3), 3, &RULES).unwrap();
        assert_eq!(pages[0].offset, (1 << 20) + 3 * PAGE);
        let mapping = GuestPagesMapping::new(&pages, PAGE, &faults()).unwrap();
        assert_eq!(mapping.len() as u64, 3 * PAGE);
        for i in 0..3 {
            let mut got = [0u8; 16];
            mapping.read(i * PAGE as usize, &mut got).unwrap();
            assert_eq!(got, [i as u8 + 1; 16], "page {i}");
        }
        // Writes through the mapping land in guest RAM (the NIC's view is the guest's).
        mapping.write(PAGE as usize + 100, b"from the NIC").unwrap();
        let mut seen = [0u8; 12];
        mem.read_slice(&mut seen, GuestAddress(5 * PAGE + 100))
            .unwrap();
        assert_eq!(&seen, b"from the NIC");
    }

    #[test]
    fn one_guest_physical_run_registers_in_place_and_others_get_a_mapping() {
        let mem = guest_memory();
        let run: Vec<u64> = (0..8).map(|i| (32 + i) * PAGE).collect();
        write_list(&mem, 0, &run);
        let pages = resolve_page_list(&mem, &direct(0, 8), 8, &RULES).unwrap();
        let in_place = mem.get_host_address(GuestAddress(32 * PAGE)).unwrap();
        let mut populated = PopulatedRanges::default();
        let seen =
            with_pages_contiguous(&mem, (&pages, PAGE), &mut populated, &faults(), |memory| {
                memory.write(PAGE as usize + 7, b"in place").unwrap();
                (memory.as_ptr(), memory.len())
            })
            .unwrap();
        assert_eq!(seen, (in_place, 8 * PAGE as usize));
        assert_eq!(
            populated.gaps(0..64 * PAGE),
            [0..32 * PAGE, 40 * PAGE..64 * PAGE]
        );
        let mut got = [0u8; 8];
        mem.read_slice(&mut got, GuestAddress(33 * PAGE + 7))
            .unwrap();
        assert_eq!(&got, b"in place");
        // Pages out of guest-physical order, or repeated, are mapped afresh.
        for gpas in [[5 * PAGE, 4 * PAGE], [4 * PAGE, 4 * PAGE]] {
            write_list(&mem, 0, &gpas);
            let pages = resolve_page_list(&mem, &direct(0, 2), 2, &RULES).unwrap();
            let address =
                with_pages_contiguous(&mem, (&pages, PAGE), &mut populated, &faults(), |m| {
                    m.as_ptr()
                })
                .unwrap();
            assert_ne!(
                address,
                mem.get_host_address(GuestAddress(gpas[0])).unwrap()
            );
        }
    }

    #[test]
    fn runs_stop_at_region_ends_and_file_neighbours_share_one_mapping() {
        static BUDGET: MapBudget = MapBudget::new(16);
        let mem = guest_memory();
        // The last two pages of the low region, then the first two at 4 GiB: adjacent in
        // the file behind both regions, but two runs in guest-physical memory.
        let low_end = (1 << 20) - 2 * PAGE;
        let gpas = [low_end, low_end + PAGE, 4 << 30, (4 << 30) + PAGE];
        write_list(&mem, 0, &gpas);
        let runs = resolve_page_list(&mem, &direct(0, 4), 4, &RULES).unwrap();
        let shape: Vec<(u64, u64, u64)> = runs.iter().map(|r| (r.gpa, r.pages, r.offset)).collect();
        assert_eq!(
            shape,
            [(low_end, 2, low_end), (4 << 30, 2, 1 << 20)],
            "one run per region"
        );
        let mapping = GuestPagesMapping::new_within(&BUDGET, (&runs, PAGE), &faults()).unwrap();
        assert_eq!(BUDGET.in_use(), 1, "one mapping for the file's one range");
        assert_eq!(mapping.len() as u64, 4 * PAGE);
        // Two adjacent regions backed by different files never share a run.
        let split = GuestMemoryMmap::from_ranges_with_files([
            (
                GuestAddress(0),
                1 << 20,
                Some(FileOffset::new(backing_file(1 << 20), 0)),
            ),
            (
                GuestAddress(1 << 20),
                1 << 20,
                Some(FileOffset::new(backing_file(1 << 20), 0)),
            ),
        ])
        .unwrap();
        let across = [(1 << 20) - PAGE, 1 << 20];
        write_list(&split, 0, &across);
        let runs = resolve_page_list(&split, &direct(0, 2), 2, &RULES).unwrap();
        assert_eq!(runs.len(), 2);
        assert!(!Arc::ptr_eq(&runs[0].file, &runs[1].file));
        drop(mapping);
        assert_eq!(BUDGET.in_use(), 0);
    }

    #[test]
    fn scattered_pages_draw_on_the_mapping_budget() {
        // 16 mappings in all, 4 per registration.
        static BUDGET: MapBudget = MapBudget::new(16);
        let mem = guest_memory();
        let every_other: Vec<u64> = (0..5).map(|i| 2 * i * PAGE).collect();
        write_list(&mem, 64 * PAGE, &every_other);
        let scattered = resolve_page_list(&mem, &direct(64 * PAGE, 5), 5, &RULES).unwrap();
        assert!(matches!(
            GuestPagesMapping::new_within(&BUDGET, (&scattered, PAGE), &faults()),
            Err(MttError::TooManyRuns { runs: 5, max: 4 })
        ));
        let held: Vec<_> = (0..4)
            .map(|_| {
                GuestPagesMapping::new_within(&BUDGET, (&scattered[..4], PAGE), &faults()).unwrap()
            })
            .collect();
        assert_eq!(BUDGET.in_use(), 16);
        let Err(err) = GuestPagesMapping::new_within(&BUDGET, (&scattered[..1], PAGE), &faults())
        else {
            panic!("the budget is spent");
        };
        assert!(
            matches!(err, MttError::MappingsExhausted { runs: 1 }),
            "{err}"
        );
        assert_eq!(err.status(), Status::NoResources);
        drop(held);
        assert_eq!(BUDGET.in_use(), 0);
        // Pages adjacent in the backing file are one mapping, however many there are.
        let contiguous: Vec<u64> = (0..64).map(|i| (100 + i) * PAGE).collect();
        write_list(&mem, 64 * PAGE, &contiguous);
        let pages = resolve_page_list(&mem, &direct(64 * PAGE, 64), 64, &RULES).unwrap();
        let mapping = GuestPagesMapping::new_within(&BUDGET, (&pages, PAGE), &faults()).unwrap();
        assert_eq!(BUDGET.in_use(), 1);
        drop(mapping);
        assert_eq!(BUDGET.in_use(), 0);
    }

    #[test]
    fn indirect_lists_span_several_list_pages() {
        let mem = guest_memory();
        let npages = PAGE_LIST_ENTRIES_PER_PAGE + 3;
        // Pages 64.. of the low region, list pages at 16 KiB and 32 KiB, top list at 48 KiB.
        let gpas: Vec<u64> = (0..npages as u64).map(|i| (64 + i % 100) * PAGE).collect();
        write_list(&mem, 4 * PAGE, &gpas[..512]);
        write_list(&mem, 8 * PAGE, &gpas[512..]);
        write_list(&mem, 12 * PAGE, &[4 * PAGE, 8 * PAGE]);
        let list = PageList {
            form: PageListForm::Indirect as u8,
            ..direct(12 * PAGE, npages)
        };
        let pages = resolve_page_list(&mem, &list, npages.into(), &RULES).unwrap();
        let resolved: Vec<u64> = pages.iter().flat_map(|run| run.gpas(PAGE)).collect();
        assert_eq!(resolved, gpas);
    }

    #[test]
    fn counts_are_bounded_before_anything_is_read() {
        let mem = guest_memory();
        // The list address is outside guest memory: only the count check can answer first.
        let huge = direct(1 << 40, u32::MAX);
        assert!(matches!(
            resolve_page_list(&mem, &huge, u32::MAX.into(), &RULES),
            Err(MttError::PageCount { .. })
        ));
        let indirect = PageList {
            form: 1,
            ..direct(1 << 40, MAX_INDIRECT_PAGES + 1)
        };
        assert!(matches!(
            resolve_page_list(&mem, &indirect, (MAX_INDIRECT_PAGES + 1).into(), &RULES),
            Err(MttError::PageCount { .. })
        ));
        assert!(matches!(
            resolve_page_list(&mem, &direct(0, 0), 0, &RULES),
            Err(MttError::PageCount { .. })
        ));
        assert!(matches!(
            resolve_page_list(&mem, &direct(0, 2), 3, &RULES),
            Err(MttError::PageCount { .. })
        ));
    }

    #[test]
    fn hostile_addresses_are_refused_with_bad_address() {
        let mem = guest_memory();
        let cases: [(&str, Vec<u64>, u64); 4] = [
            ("page outside guest RAM", vec![2 << 20], 0),
            (
                "page straddling the end of a region",
                vec![(1 << 20) - PAGE / 2],
                0,
            ),
            ("page whose end overflows", vec![!(PAGE - 1)], 0),
            ("misaligned page", vec![PAGE + 8], 0),
        ];
        for (what, gpas, at) in cases {
            write_list(&mem, at, &gpas);
            let err = resolve_page_list(&mem, &direct(at, 1), 1, &RULES).expect_err(what);
            assert_eq!(err.status(), Status::BadAddress, "{what}: {err}");
        }
        // The list itself outside guest memory, straddling a region end, or misaligned.
        for addr in [3 << 30, (1 << 20) - 8, 4] {
            let err = resolve_page_list(&mem, &direct(addr, 2), 2, &RULES).unwrap_err();
            assert_eq!(err.status(), Status::BadAddress, "list at {addr:#x}: {err}");
        }
    }

    #[test]
    fn shapes_outside_the_rules_are_invalid_or_unsupported() {
        let mem = guest_memory();
        let wrong_shift = PageList {
            page_shift: 13,
            ..direct(0, 1)
        };
        assert_eq!(
            resolve_page_list(&mem, &wrong_shift, 1, &RULES)
                .unwrap_err()
                .status(),
            Status::InvalidArgument
        );
        let wrong_form = PageList {
            form: 7,
            ..direct(0, 1)
        };
        assert_eq!(
            resolve_page_list(&mem, &wrong_form, 1, &RULES)
                .unwrap_err()
                .status(),
            Status::InvalidArgument
        );
        let no_indirect = PageListRules {
            indirect_allowed: false,
            ..RULES
        };
        let indirect = PageList {
            form: 1,
            ..direct(0, 1)
        };
        assert_eq!(
            resolve_page_list(&mem, &indirect, 1, &no_indirect)
                .unwrap_err()
                .status(),
            Status::Unsupported
        );
    }

    #[test]
    fn anonymous_guest_memory_cannot_be_mapped() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write_list(&mem, 0, &[PAGE]);
        assert!(matches!(
            resolve_page_list(&mem, &direct(0, 1), 1, &RULES),
            Err(MttError::NotFileBacked(_))
        ));
    }

    #[test]
    fn pages_needed_counts_partial_pages_and_refuses_overflow() {
        assert_eq!(pages_needed(0, 1, 12), Some(1));
        assert_eq!(pages_needed(4095, 2, 12), Some(2));
        assert_eq!(pages_needed(0, 4096, 12), Some(1));
        assert_eq!(pages_needed(100, 2 << 20, 21), Some(2));
        assert_eq!(pages_needed(1, u64::MAX, 12), None);
    }
}
