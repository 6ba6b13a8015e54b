//! A fault in guest memory ends only the guest whose memory it is.
//!
//! The backend maps each guest's RAM from the files its front end sends and touches it from
//! threads every guest shares (the poller pool, the loopback host's copies) and from code it
//! does not own (virtio-queue, vm-memory). A shared file mapping raises SIGBUS where the file
//! cannot supply a page: past its end, or on hugetlbfs when a front end punched a hole and
//! the pool has no page left to fill it. The checks made when a region is accepted
//! (`memory_regions`) close the first door, not the second: a front end may punch its own
//! file whenever it likes, and SIGBUS would end every guest.
//!
//! So every mapping of guest memory is listed here ([`FaultDomain::watch`]) with the guest
//! (the fault domain) it belongs to, and a SIGBUS handler looks the faulting address up: one
//! inside a listed mapping has the faulting page replaced by a private zero page (an
//! anonymous mapping put over it), after which the access that faulted is made again and
//! succeeds; the guest's domain is marked, and a watcher thread ends that guest's connection
//! (its objects destroyed as on any disconnect) and logs the address and the mapping. The
//! thread that faulted, and every other guest, go on: what the thread read is zeros, which
//! is no worse than any other value a guest could have written there. A SIGBUS anywhere else
//! is handed to the handler that was there before (Rust's own, which reports stack
//! overflows), or kills the process as it always did.
//!
//! The data path pays nothing for this: no accessor changes, no check per access; the cost
//! is one slot write when a mapping is made or unmade. The handler only reads atomics and
//! calls `mmap` and `write`, both async-signal-safe.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// Mappings listed at once, at most: the guests' RAM regions (a few hundred per guest at
/// most, `limits::MAX_MEMORY_SLOTS`) and the MR mappings (a quarter of `vm.max_map_count`).
const SLOTS: usize = 1 << 16;

/// One listed mapping. Written under [`Table::free`]'s lock, read by the handler without
/// locks: `seq` is odd while a writer changes the other fields (a sequence lock).
struct Slot {
    seq: AtomicU32,
    start: AtomicUsize,
    /// Zero: the slot is free.
    len: AtomicUsize,
    page_size: AtomicUsize,
    domain: AtomicU64,
    /// Which listing this is, so that a listing ends only itself.
    ticket: AtomicU64,
    /// The address of the last fault the handler recovered in this mapping, or zero.
    faulted_at: AtomicUsize,
}

impl Slot {
    const fn free() -> Slot {
        Slot {
            seq: AtomicU32::new(0),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            page_size: AtomicUsize::new(0),
            domain: AtomicU64::new(0),
            ticket: AtomicU64::new(0),
            faulted_at: AtomicUsize::new(0),
        }
    }

    fn write(&self, start: usize, len: usize, page_size: usize, (domain, ticket): (u64, u64)) {
        self.seq.fetch_add(1, Ordering::AcqRel);
        self.start.store(start, Ordering::Relaxed);
        self.page_size.store(page_size, Ordering::Relaxed);
        self.domain.store(domain, Ordering::Relaxed);
        self.ticket.store(ticket, Ordering::Relaxed);
        self.faulted_at.store(0, Ordering::Relaxed);
        self.len.store(len, Ordering::Relaxed);
        self.seq.fetch_add(1, Ordering::Release);
    }

    /// The mapping as one consistent read: (start, len, page size, domain); None while it is
    /// being changed or when free.
    fn read(&self) -> Option<(usize, usize, usize, u64)> {
        let before = self.seq.load(Ordering::Acquire);
        if before % 2 == 1 {
            return None;
        }
        let read = (
            self.start.load(Ordering::Relaxed),
            self.len.load(Ordering::Relaxed),
            self.page_size.load(Ordering::Relaxed),
            self.domain.load(Ordering::Relaxed),
        );
        std::sync::atomic::fence(Ordering::Acquire);
        (self.seq.load(Ordering::Relaxed) == before && read.1 != 0).then_some(read)
    }
}

static SLOT_TABLE: [Slot; SLOTS] = [const { Slot::free() }; SLOTS];
/// Slots in use lie below this index: the handler looks no further.
static SLOTS_USED: AtomicUsize = AtomicUsize::new(0);
/// The eventfd the handler writes to wake the watcher; -1 before [`install`].
static WAKE_FD: AtomicI32 = AtomicI32::new(-1);
/// What was installed for SIGBUS before [`install`]: the handler passes on faults that are
/// not in guest memory.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// The list's bookkeeping, outside the handler's view.
struct Table {
    /// Free slot indexes below `SLOTS_USED`.
    free: Vec<usize>,
    domains: HashMap<u64, Weak<FaultDomain>>,
    next_domain: u64,
    next_ticket: u64,
}

fn table() -> std::sync::MutexGuard<'static, Table> {
    static TABLE: OnceLock<Mutex<Table>> = OnceLock::new();
    TABLE
        .get_or_init(|| {
            Mutex::new(Table {
                free: Vec::new(),
                domains: HashMap::new(),
                next_domain: 0,
                next_ticket: 0,
            })
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Why guest memory could not be watched.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("{SLOTS} mappings of guest memory exist already")]
    Full,
    #[error("cannot install the SIGBUS handler: {0}")]
    Install(#[source] std::io::Error),
}

/// Installs the SIGBUS handler and starts the thread that ends faulted guests' connections;
/// once per process (later calls do nothing). Must run before any guest memory is watched.
pub fn install() -> Result<(), WatchError> {
    static INSTALLED: OnceLock<Result<(), i32>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| install_once().map_err(|e| e.raw_os_error().unwrap_or(libc::EIO)))
        .map_err(|errno| WatchError::Install(std::io::Error::from_raw_os_error(errno)))
}

fn install_once() -> std::io::Result<()> {
    // SAFETY: eventfd(2) with valid flags; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor nothing else owns.
    let wake: OwnedFd = unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) };
    std::thread::Builder::new()
        .name("vrdma-faults".into())
        .spawn(move || watch_faults(wake))?;
    // SAFETY: an all-zero sigaction is a valid value to fill.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = on_sigbus as *const () as usize;
    action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
    // SAFETY: an all-zero sigaction is a valid value for sigaction(2) to fill.
    let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: sigemptyset on our own sigaction's mask.
    unsafe { libc::sigemptyset(&mut action.sa_mask) };
    // The previous action and the wake descriptor are in place before the handler can run.
    // SAFETY: reads the current action into `previous`, a valid sigaction.
    if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut previous) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let _ = PREVIOUS.set(previous);
    WAKE_FD.store(fd, Ordering::Release);
    // SAFETY: installs `on_sigbus`, which is async-signal-safe (module docs), for SIGBUS.
    if unsafe { libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The SIGBUS handler (see the module).
extern "C" fn on_sigbus(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let address = unsafe { (*info).si_addr() } as usize;
    if recover(address) {
        return;
    }
    let Some(previous) = PREVIOUS.get() else {
        return default_action(signal);
    };
    let handler = previous.sa_sigaction;
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        return default_action(signal);
    }
    if previous.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the previous handler was installed as an SA_SIGINFO handler, so it has this
        // signature; it gets the signal's own arguments.
        let previous: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(handler) };
        previous(signal, info, context);
    } else {
        // SAFETY: the previous handler was installed without SA_SIGINFO: a plain handler.
        let previous: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
        previous(signal);
    }
}

/// Restores the default action, so that the fault, made again when the handler returns,
/// ends the process as an unhandled SIGBUS does.
fn default_action(signal: libc::c_int) {
    // SAFETY: an all-zero sigaction with SIG_DFL (0) is the default action.
    let default: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: sigaction(2) is async-signal-safe; `default` is a valid sigaction.
    unsafe { libc::sigaction(signal, &default, std::ptr::null_mut()) };
}

/// In the handler: replaces the page at `address` with a zero page if it lies in watched
/// guest memory, and tells the watcher. Async-signal-safe: atomics, mmap and write only.
fn recover(address: usize) -> bool {
    let used = SLOTS_USED.load(Ordering::Acquire).min(SLOTS);
    for slot in &SLOT_TABLE[..used] {
        let Some((start, len, page_size, _)) = slot.read() else {
            continue;
        };
        if address < start || address - start >= len {
            continue;
        }
        let page = address & !(page_size - 1);
        // SAFETY: the page lies inside a mapping of guest memory the backend made and listed
        // (the slot is consistent); replacing it with a private anonymous page of the same
        // size changes only what the backend sees there, never the guest's file, and the
        // guest's connection is ended for it.
        let replaced = unsafe {
            libc::mmap(
                page as *mut libc::c_void,
                page_size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if replaced == libc::MAP_FAILED {
            return false;
        }
        slot.faulted_at.store(address, Ordering::Release);
        let one = 1u64.to_ne_bytes();
        // SAFETY: write(2) of 8 bytes from a local array to the watcher's eventfd; a failed
        // write leaves the fault to the watcher's next look.
        unsafe { libc::write(WAKE_FD.load(Ordering::Acquire), one.as_ptr().cast(), 8) };
        return true;
    }
    false
}

/// The watcher thread: on every wake, ends the connection of each guest whose memory faulted.
fn watch_faults(wake: OwnedFd) {
    let mut count = [0u8; 8];
    loop {
        // SAFETY: reads 8 bytes into a local array from the eventfd this thread owns.
        let read = unsafe { libc::read(wake.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
        if read < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            log::error!(
                "the guest fault watcher stops: {}",
                std::io::Error::last_os_error()
            );
            return;
        }
        let used = SLOTS_USED.load(Ordering::Acquire).min(SLOTS);
        let mut faulted = Vec::new();
        for slot in &SLOT_TABLE[..used] {
            let at = slot.faulted_at.swap(0, Ordering::AcqRel);
            if at == 0 {
                continue;
            }
            if let Some((start, len, _, domain)) = slot.read() {
                faulted.push((domain, at, start, len));
            }
        }
        for (domain, at, start, len) in faulted {
            let found = table().domains.get(&domain).and_then(Weak::upgrade);
            match found {
                Some(domain) => domain.faulted(at, start, len),
                None => log::warn!(
                    "guest memory fault at {at:#x} (mapping {start:#x}+{len:#x}) of a guest already gone"
                ),
            }
        }
    }
}

/// The guest a set of mappings belongs to: a fault in any of them ends it.
pub struct FaultDomain {
    id: u64,
    name: Mutex<String>,
    state: Mutex<DomainState>,
}

#[derive(Default)]
struct DomainState {
    faulted: bool,
    end: Option<Box<dyn Fn() + Send + Sync>>,
}

impl FaultDomain {
    /// A new domain, `name` in log lines until [`FaultDomain::serve`] names it.
    pub fn new(name: &str) -> Arc<FaultDomain> {
        let mut table = table();
        table.next_domain += 1;
        let domain = Arc::new(FaultDomain {
            id: table.next_domain,
            name: Mutex::new(name.to_string()),
            state: Mutex::default(),
        });
        table.domains.insert(domain.id, Arc::downgrade(&domain));
        domain
    }

    /// From now on a fault ends the guest by calling `end` (at once, if one came already).
    pub fn serve(&self, name: String, end: Box<dyn Fn() + Send + Sync>) {
        *self.name.lock().unwrap_or_else(|e| e.into_inner()) = name;
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.faulted {
            end();
        }
        state.end = Some(end);
    }

    /// Whether a fault in this domain's memory was recovered.
    pub fn has_faulted(&self) -> bool {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).faulted
    }

    fn faulted(&self, at: usize, start: usize, len: usize) {
        let name = self.name.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !state.faulted {
            log::warn!(
                "{name}: a page of its memory could not be had (SIGBUS at {at:#x}, in its mapping {start:#x}+{len:#x}: a hole punched in its file, or the file shrunk): its connection ends"
            );
        }
        state.faulted = true;
        if let Some(end) = &state.end {
            end();
        }
    }

    /// Lists the mapping `start..start + len` (of pages of `page_size` bytes, a power of
    /// two) as this domain's guest memory, until the returned value is dropped. A listed
    /// mapping that overlaps it is gone (its address range was given to this one), and is
    /// taken off the list.
    pub fn watch(
        self: &Arc<Self>,
        start: usize,
        len: usize,
        page_size: usize,
    ) -> Result<WatchedMapping, WatchError> {
        debug_assert!(page_size.is_power_of_two() && len > 0);
        let mut table = table();
        let used = SLOTS_USED.load(Ordering::Acquire);
        for (index, slot) in SLOT_TABLE[..used].iter().enumerate() {
            if let Some((s, l, _, _)) = slot.read() {
                if s < start.saturating_add(len) && start < s.saturating_add(l) {
                    slot.write(0, 0, 0, (0, 0));
                    table.free.push(index);
                }
            }
        }
        let index = match table.free.pop() {
            Some(index) => index,
            None if used < SLOTS => {
                SLOTS_USED.store(used + 1, Ordering::Release);
                used
            }
            None => return Err(WatchError::Full),
        };
        table.next_ticket += 1;
        let ticket = table.next_ticket;
        SLOT_TABLE[index].write(start, len, page_size, (self.id, ticket));
        Ok(WatchedMapping {
            index,
            ticket,
            _domain: Arc::clone(self),
        })
    }
}

impl Drop for FaultDomain {
    fn drop(&mut self) {
        table().domains.remove(&self.id);
    }
}

/// A mapping of guest memory on the list; taken off when dropped.
pub struct WatchedMapping {
    index: usize,
    ticket: u64,
    _domain: Arc<FaultDomain>,
}

impl Drop for WatchedMapping {
    fn drop(&mut self) {
        let mut table = table();
        let slot = &SLOT_TABLE[self.index];
        // Taken off already if a later mapping took its addresses.
        if slot.ticket.load(Ordering::Relaxed) == self.ticket {
            slot.write(0, 0, 0, (0, 0));
            table.free.push(self.index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::fd::FromRawFd;
    use std::sync::atomic::AtomicBool;

    const PAGE: usize = 4096;

    fn memfd(len: usize) -> File {
        // SAFETY: a literal name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"faults".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a new descriptor nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len as u64).unwrap();
        file
    }

    fn map_shared(file: &File, len: usize) -> *mut u8 {
        // SAFETY: a new shared mapping of our own memfd; the result is checked.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED);
        at.cast()
    }

    fn wait_for(mut done: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "timed out");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn a_fault_in_watched_memory_reads_zeros_and_ends_only_its_domain() {
        install().unwrap();
        let file = memfd(4 * PAGE);
        let base = map_shared(&file, 4 * PAGE);
        // SAFETY: inside the 4-page mapping made above.
        unsafe { base.add(PAGE).write_volatile(7) };
        let victim = FaultDomain::new("victim");
        let faulty = FaultDomain::new("faulty");
        let ended = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&ended);
        faulty.serve(
            "faulty guest".into(),
            Box::new(move || flag.store(true, Ordering::SeqCst)),
        );
        let other = memfd(PAGE);
        let other_base = map_shared(&other, PAGE);
        let _victim_memory = victim.watch(other_base as usize, PAGE, PAGE).unwrap();
        let _watched = faulty.watch(base as usize, 4 * PAGE, PAGE).unwrap();

        // The file shrinks under the mapping: its last pages are gone.
        file.set_len(PAGE as u64).unwrap();
        // SAFETY: inside the mapping; the page is beyond the file, which faults, and the
        // handler puts a zero page there.
        let read = unsafe { base.add(3 * PAGE + 8).read_volatile() };
        assert_eq!(read, 0);
        // SAFETY: as above; writes land in the private page.
        unsafe { base.add(2 * PAGE).write_volatile(9) };
        // SAFETY: as above.
        assert_eq!(unsafe { base.add(2 * PAGE).read_volatile() }, 9);
        wait_for(|| ended.load(Ordering::SeqCst));
        assert!(faulty.has_faulted());
        assert!(!victim.has_faulted());
        // The page the file still has is the file's.
        // SAFETY: inside the mapping and the file.
        assert_eq!(unsafe { base.read_volatile() }, 0);
    }

    #[test]
    fn a_domain_that_faulted_before_it_was_served_is_ended_when_it_is() {
        install().unwrap();
        let file = memfd(2 * PAGE);
        let base = map_shared(&file, 2 * PAGE);
        let domain = FaultDomain::new("early");
        let _watched = domain.watch(base as usize, 2 * PAGE, PAGE).unwrap();
        file.set_len(0).unwrap();
        // SAFETY: inside the mapping; beyond the file, so it faults and is recovered.
        let _ = unsafe { base.read_volatile() };
        wait_for(|| domain.has_faulted());
        let ended = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&ended);
        domain.serve(
            "late".into(),
            Box::new(move || flag.store(true, Ordering::SeqCst)),
        );
        assert!(ended.load(Ordering::SeqCst));
    }

    #[test]
    fn a_mapping_given_the_addresses_of_one_gone_takes_its_place() {
        let old = FaultDomain::new("old");
        let new = FaultDomain::new("new");
        let gone = old.watch(0x7000_0000_0000, 4 * PAGE, PAGE).unwrap();
        let taken = new.watch(0x7000_0000_2000, PAGE, PAGE).unwrap();
        let listed = |start: usize| {
            SLOT_TABLE[..SLOTS_USED.load(Ordering::Acquire)]
                .iter()
                .filter_map(Slot::read)
                .any(|(s, _, _, d)| s == start && (d == old.id || d == new.id))
        };
        assert!(!listed(0x7000_0000_0000));
        assert!(listed(0x7000_0000_2000));
        drop(gone); // leaves the new mapping listed
        assert!(listed(0x7000_0000_2000));
        drop(taken);
        assert!(!listed(0x7000_0000_2000));
    }
}
