//! What the backend accepts as guest memory: every region a front end sends (SET_MEM_TABLE,
//! ADD_MEM_REG) is checked before the device uses it, because the backend touches guest memory
//! from shared threads (the poller pool serves every guest): a fault there is every guest's.
//!
//! A shared file mapping raises SIGBUS where the file cannot supply a page: past its end (the
//! region was announced larger than the file, or the front end shrank the file later), or on
//! hugetlbfs when the pool has no page left. So a region is accepted only if
//! - its file covers the whole region now;
//! - the file cannot shrink later: it carries the F_SEAL_SHRINK seal (a memfd sealed by its
//!   creator; QEMU's memory-backend-memfd seals by default), unless the operator declared the
//!   front ends trusted with unsealed files ([`UnsealedFiles::Allow`]);
//! - on hugetlbfs, its pages exist: they are populated when the region is accepted, which
//!   fails with an error, not a signal, when the pool is short.
//!
//! What a front end can still do to a sealed file it shares: write it (the guest's memory is
//! the guest's), and punch holes in it (F_SEAL_WRITE, which forbids that, also forbids the
//! writable mapping guest memory needs). A punched page of a memfd comes back as a new zero
//! page when touched; a punched huge page must come from the pool again, so a front end that
//! punches holes in its own hugetlb memory while the pool is exhausted can still make the
//! backend fault: [`crate::guest_faults`] turns such a fault into the end of that guest's
//! connection.

use std::os::fd::AsRawFd;

use vm_memory::{GuestMemoryRegion, GuestRegionMmap};

/// Whether regions whose files may shrink are accepted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnsealedFiles {
    /// Refused: a front end that shrinks a mapped file would kill the backend.
    #[default]
    Refuse,
    /// Accepted, for front ends the host trusts (a VMM whose memory backend does not seal,
    /// such as QEMU's memory-backend-file or cloud-hypervisor).
    Allow,
}

/// Why a memory region was refused.
#[derive(Debug, thiserror::Error)]
pub enum RegionRefusal {
    #[error("the region at guest address {gpa:#x} has no file behind it")]
    NoFile { gpa: u64 },
    #[error("the region at guest address {gpa:#x} maps bytes {start:#x}..{end:#x} of a file of {file_size:#x} bytes")]
    BeyondFile {
        gpa: u64,
        start: u64,
        end: u64,
        file_size: u64,
    },
    #[error("the file of the region at guest address {gpa:#x} may shrink (no F_SEAL_SHRINK seal): seal it, e.g. QEMU's memory-backend-memfd with seal=on, or start the backend with --unsealed-memory for trusted front ends")]
    Unsealed { gpa: u64 },
    #[error("the huge pages of the region at guest address {gpa:#x} cannot be supplied: {source}")]
    HugePagesShort {
        gpa: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("the region at guest address {gpa:#x}: {call}: {source}")]
    Os {
        gpa: u64,
        call: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// hugetlbfs's magic number in `statfs.f_type`.
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
/// madvise(2): fault the range in writable now, failing with an error where a page cannot be
/// had (Linux 5.14).
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Checks a region just mapped from a front end's file (see the module's rules); on success
/// the backend may touch any byte of it for as long as it stays mapped, and learns the size
/// of the pages behind it (huge pages on hugetlbfs).
pub fn accept(region: &GuestRegionMmap, unsealed: UnsealedFiles) -> Result<usize, RegionRefusal> {
    let gpa = region.start_addr().0;
    let Some(file_offset) = region.file_offset() else {
        return Err(RegionRefusal::NoFile { gpa });
    };
    let file = file_offset.file();
    let os = |call| move |source| RegionRefusal::Os { gpa, call, source };
    // Seals first: once F_SEAL_SHRINK is seen, the size read next can only grow. Read the
    // other way round, a front end could shrink the file between the two reads and seal it
    // just before the second.
    if unsealed == UnsealedFiles::Refuse && seals(file.as_raw_fd()) & libc::F_SEAL_SHRINK == 0 {
        return Err(RegionRefusal::Unsealed { gpa });
    }
    let file_size = file.metadata().map_err(os("fstat"))?.len();
    let start = file_offset.start();
    let end = start.checked_add(region.len());
    if end.is_none_or(|end| end > file_size) {
        return Err(RegionRefusal::BeyondFile {
            gpa,
            start,
            end: end.unwrap_or(u64::MAX),
            file_size,
        });
    }
    let fs = nix::sys::statfs::fstatfs(file).map_err(|e| os("fstatfs")(e.into()))?;
    if fs.filesystem_type().0 as i64 == HUGETLBFS_MAGIC {
        populate(region).map_err(|source| RegionRefusal::HugePagesShort { gpa, source })?;
        return usize::try_from(fs.block_size())
            .ok()
            .filter(|size| size.is_power_of_two())
            .ok_or_else(|| RegionRefusal::Os {
                gpa,
                call: "fstatfs (huge page size)",
                source: std::io::Error::from_raw_os_error(libc::EINVAL),
            });
    }
    Ok(base_page_size())
}

/// The size of the pages of memory that is not on hugetlbfs.
fn base_page_size() -> usize {
    // SAFETY: sysconf only reads a system value.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096)
}

/// The file's seals; none where the file system has no seals.
fn seals(fd: std::os::fd::RawFd) -> libc::c_int {
    // SAFETY: F_GET_SEALS only reads the descriptor's seals; `fd` is open (the region holds
    // its file).
    let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    seals.max(0)
}

/// Faults every page of the region's mapping in, writable.
fn populate(region: &GuestRegionMmap) -> std::io::Result<()> {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the region is mapped in this process: its length is a usize"
    )]
    let len = region.len() as usize;
    let addr = region.as_ptr();
    // SAFETY: the range is exactly the region's own mapping, which the caller holds mapped;
    // MADV_POPULATE_WRITE changes no contents, it only allocates the pages behind it.
    let done = unsafe { libc::madvise(addr.cast(), len, MADV_POPULATE_WRITE) };
    if done == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::fd::FromRawFd;
    use vm_memory::{FileOffset, GuestAddress, MmapRegion};

    fn memfd(len: u64, seals: libc::c_int) -> File {
        // SAFETY: a literal name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: a new descriptor nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len).unwrap();
        // SAFETY: adds seals to our own memfd.
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) }, 0);
        file
    }

    fn region(file: File, offset: u64, len: usize) -> GuestRegionMmap {
        let mmap = MmapRegion::from_file(FileOffset::new(file, offset), len).unwrap();
        GuestRegionMmap::new(mmap, GuestAddress(0x10_0000)).unwrap()
    }

    #[test]
    fn a_sealed_file_that_covers_the_region_is_accepted() {
        let file = memfd(8 << 12, libc::F_SEAL_SHRINK);
        let page_size = accept(&region(file, 4096, 7 << 12), UnsealedFiles::Refuse).unwrap();
        assert_eq!(page_size, 4096);
    }

    #[test]
    fn a_region_beyond_its_file_is_refused() {
        let file = memfd(4 << 12, libc::F_SEAL_SHRINK);
        let refusal = accept(&region(file, 4096, 4 << 12), UnsealedFiles::Allow).unwrap_err();
        assert!(
            matches!(
                refusal,
                RegionRefusal::BeyondFile {
                    file_size: 0x4000,
                    end: 0x5000,
                    ..
                }
            ),
            "{refusal}"
        );
    }

    #[test]
    fn a_file_that_may_shrink_is_refused_unless_allowed() {
        let refusal = accept(
            &region(memfd(1 << 12, 0), 0, 1 << 12),
            UnsealedFiles::Refuse,
        );
        assert!(matches!(refusal, Err(RegionRefusal::Unsealed { .. })));
        // Growing is harmless: only shrinking is what must be sealed.
        let file = memfd(1 << 12, libc::F_SEAL_GROW);
        let refusal = accept(&region(file, 0, 1 << 12), UnsealedFiles::Refuse);
        assert!(matches!(refusal, Err(RegionRefusal::Unsealed { .. })));
        accept(&region(memfd(1 << 12, 0), 0, 1 << 12), UnsealedFiles::Allow).unwrap();
    }

    #[test]
    fn huge_pages_the_pool_cannot_supply_are_refused_when_the_region_is_accepted() {
        // SAFETY: a literal name; the result is checked.
        let fd = unsafe {
            libc::memfd_create(
                c"test".as_ptr(),
                libc::MFD_ALLOW_SEALING | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
            )
        };
        if fd < 0 {
            // No hugetlbfs on this machine: the rxe guest's run of this test covers it.
            eprintln!("no hugetlb memfd here: {}", std::io::Error::last_os_error());
            return;
        }
        // SAFETY: a new descriptor nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        let free = std::fs::read_to_string("/proc/meminfo")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("HugePages_Free:"))
            .map(|n| n.trim().parse::<u64>().unwrap())
            .unwrap_or(0);
        let len = (free + 1) * (2 << 20);
        file.set_len(len).unwrap();
        // SAFETY: adds a seal to our own memfd.
        let sealed = unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
        assert_eq!(sealed, 0);
        let refusal = accept(&region(file, 0, len as usize), UnsealedFiles::Refuse);
        assert!(
            matches!(refusal, Err(RegionRefusal::HugePagesShort { .. })),
            "{refusal:?}"
        );
    }
}
