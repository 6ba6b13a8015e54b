//! Memory the host NIC may access, and its registration.

use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::ibv_access_flags;

use super::seam::{HostMr, Registration};
use super::{Error, ProtectionDomain, Result};

/// Memory that stays mapped at one address for as long as the value lives, so that a host MR
/// registered over it never outlives the mapping.
///
/// # Safety
/// `as_ptr()..as_ptr() + len()` must be readable and writable memory of this process that is
/// neither unmapped nor remapped while the value is alive.
pub unsafe trait PinnedMemory: Send + Sync {
    fn as_ptr(&self) -> *mut u8;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `data` into the memory at `offset`.
    fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        check_range(self.len(), offset, data.len())?;
        // SAFETY: the range is inside the memory (checked above; valid per the trait
        // contract) and cannot overlap `data`, which Rust owns elsewhere.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.as_ptr().add(offset), data.len())
        };
        Ok(())
    }

    /// Copies bytes at `offset` out of the memory.
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range(self.len(), offset, out.len())?;
        // SAFETY: as in `write`, with source and destination swapped.
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), out.as_mut_ptr(), out.len())
        };
        Ok(())
    }
}

/// Error from a system call that reports failure through errno.
fn os_error(call: &'static str) -> Error {
    Error::Verbs {
        call,
        source: io::Error::last_os_error(),
    }
}

fn check_range(size: usize, offset: usize, len: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "range {offset}+{len} outside {size} bytes of memory"
        ))),
    }
}

/// Page-aligned anonymous memory owned by the backend (rings it keeps, test buffers).
pub struct AnonymousMemory {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; concurrent access through raw
// pointers is the NIC's and callers' business, exactly as for an MR's memory in C.
unsafe impl Send for AnonymousMemory {}
// SAFETY: `&self` methods only copy through raw pointers with bounds checks, into memory
// the NIC may write at any time anyway; nothing is cached in the value.
unsafe impl Sync for AnonymousMemory {}

impl AnonymousMemory {
    /// `len` bytes (rounded up to whole pages) of zeroed memory.
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("cannot map zero bytes".into()));
        }
        // SAFETY: an anonymous private mapping at a kernel-chosen address has no
        // preconditions; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_error("mmap"));
        }
        Ok(AnonymousMemory {
            ptr: NonNull::new(ptr.cast()).expect("mmap returned NULL without failing"),
            len,
        })
    }

    /// Asks the kernel to back the memory with transparent huge pages (`huge`) or with base
    /// pages only; it applies to pages not yet touched.
    pub fn advise_huge_pages(&self, huge: bool) -> Result<()> {
        let advice = if huge {
            libc::MADV_HUGEPAGE
        } else {
            libc::MADV_NOHUGEPAGE
        };
        // SAFETY: the range is this value's own mapping; the advice changes no contents.
        if unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, advice) } != 0 {
            return Err(os_error("madvise"));
        }
        Ok(())
    }
}

// SAFETY: the mapping lives exactly as long as the value (unmapped in Drop, never moved).
unsafe impl PinnedMemory for AnonymousMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for AnonymousMemory {
    fn drop(&mut self) {
        // SAFETY: the range is the mapping made in `new`; MRs hold an Arc of the memory, so
        // none is registered over it any more.
        if unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) } != 0 {
            log::error!("munmap failed: {}", io::Error::last_os_error());
        }
    }
}

/// A host memory region.
pub struct MemoryRegion {
    /// Dropped before the memory and the PD (fields drop in order), as the seam requires.
    host: Box<dyn HostMr>,
    iova: u64,
    len: usize,
    /// The mapping registered over, kept while the MR lives; `None` for [`reg_mr_pinned`]
    /// regions, whose pages the kernel holds pinned without it.
    ///
    /// [`reg_mr_pinned`]: ProtectionDomain::reg_mr_pinned
    _memory: Option<Arc<dyn PinnedMemory>>,
    _pd: Arc<ProtectionDomain>,
}

impl ProtectionDomain {
    /// Registers all of `memory` so that the NIC sees it at `iova` (`ibv_reg_mr_iova2`):
    /// work requests then address it by `iova..iova + memory.len()`, whatever its host address.
    pub fn reg_mr(
        self: &Arc<Self>,
        memory: Arc<dyn PinnedMemory>,
        iova: u64,
        access: u32,
    ) -> Result<MemoryRegion> {
        let len = memory.len();
        self.reg_mr_range(memory, 0, len, iova, access)
    }

    /// Registers `len` bytes of `memory` from `offset`, seen by the NIC at `iova`; the MR
    /// keeps `memory` mapped while it lives.
    pub fn reg_mr_range(
        self: &Arc<Self>,
        memory: Arc<dyn PinnedMemory>,
        offset: usize,
        len: usize,
        iova: u64,
        access: u32,
    ) -> Result<MemoryRegion> {
        let at = checked_registration(&*memory, offset, len, iova, access)?;
        let host = self.host.reg_mr(&memory, at)?;
        Ok(MemoryRegion {
            host,
            iova,
            len,
            _memory: Some(memory),
            _pd: Arc::clone(self),
        })
    }

    /// Registers `len` bytes of `memory` from `offset`, seen by the NIC at `iova`, without
    /// keeping `memory`: registration pins the pages behind the range (on-demand paging is
    /// refused), and the NIC reaches them through the MR's own page list, not through this
    /// process's address space. So the mapping may go as soon as this returns, and the NIC
    /// keeps reading and writing the same pages (for guest memory: the guest's RAM) until
    /// the MR is deregistered. The backend uses this to register guest pages without holding
    /// a mapping per MR. Only where [`ProtectionDomain::pins_pages`].
    pub fn reg_mr_pinned(
        self: &Arc<Self>,
        memory: &dyn PinnedMemory,
        offset: usize,
        len: usize,
        iova: u64,
        access: u32,
    ) -> Result<MemoryRegion> {
        if access & ibv_access_flags::IBV_ACCESS_ON_DEMAND.0 != 0 {
            return Err(Error::InvalidArgument(
                "an on-demand-paging MR does not pin its pages".into(),
            ));
        }
        if !self.pins_pages() {
            return Err(Error::InvalidArgument(
                "the host pins no pages: register memory it may keep mapped".into(),
            ));
        }
        let at = checked_registration(memory, offset, len, iova, access)?;
        let host = self.host.reg_mr_pinned(memory, at)?;
        Ok(MemoryRegion {
            host,
            iova,
            len,
            _memory: None,
            _pd: Arc::clone(self),
        })
    }
}

/// `len` bytes of `memory` from `offset`, registered at `iova` with `access`, once checked to
/// lie inside `memory` and to fit the IOVA space: the only ranges a host is given.
fn checked_registration(
    memory: &dyn PinnedMemory,
    offset: usize,
    len: usize,
    iova: u64,
    access: u32,
) -> Result<Registration> {
    if len == 0 {
        return Err(Error::InvalidArgument("cannot register zero bytes".into()));
    }
    check_range(memory.len(), offset, len)?;
    if iova.checked_add(len as u64).is_none() {
        return Err(Error::InvalidArgument(format!(
            "IOVA {iova:#x} + {len} overflows"
        )));
    }
    Ok(Registration {
        offset,
        len,
        iova,
        access,
    })
}

impl MemoryRegion {
    pub fn lkey(&self) -> u32 {
        self.host.lkey()
    }
    pub fn rkey(&self) -> u32 {
        self.host.rkey()
    }
    /// The address work requests use for the first byte of the region.
    pub fn iova(&self) -> u64 {
        self.iova
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
