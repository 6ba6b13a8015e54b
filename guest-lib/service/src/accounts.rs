//! What the service shares out, and who holds how much of it (SPEC.md §12, "Shares"): programs
//! served, objects of each kind, memory regions the device knows and bytes of memory the
//! device can reach (which the service locks in a VM, and a backend pins). Each is bounded in
//! total, per user (the uid the socket's peer credentials give) and per program, and a user's
//! share is the same however many programs it connects: its programs hold it together. Pure
//! bookkeeping, under the service's one lock; a request is checked and counted before it is
//! forwarded, and given back if the device refuses it.

use std::collections::HashMap;

use crate::requests::ObjectKind;

/// The bounds the service keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shares {
    /// Programs served at once, and per user (connections count from the moment they are
    /// accepted, before their HELLO).
    pub programs: usize,
    pub programs_per_user: usize,
    /// Objects of each kind one user's programs may hold together (a program alone may hold
    /// all of its user's).
    pub objects_per_user: HashMap<ObjectKind, u32>,
    /// Memory regions the programs may have the device know: in all, per user, per program.
    pub regions: usize,
    pub regions_per_user: usize,
    pub regions_per_program: usize,
    /// Bytes of memory the programs may share with the device (locked for it): in all, per
    /// user, per program. A process is also held to its RLIMIT_MEMLOCK ([`Memlock`]).
    pub bytes: u64,
    pub bytes_per_user: u64,
    pub bytes_per_program: u64,
}

/// How much memory a process may have locked for it, as uverbs reads it when it pins pages:
/// its RLIMIT_MEMLOCK, unless it may lock any amount (CAP_IPC_LOCK, which root has).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memlock {
    Unlimited,
    Bytes(u64),
}

/// Why a request is refused: what it would pass.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the vrdma service serves {0} programs at most (--max-programs)")]
    Programs(usize),
    #[error("user {uid} has {limit} programs connected to the vrdma service already (--max-programs-per-user)")]
    UserPrograms { uid: u32, limit: usize },
    #[error("user {uid} holds its share of {limit} {kind:?}s (1/--share of the device's)")]
    UserObjects {
        uid: u32,
        kind: ObjectKind,
        limit: u32,
    },
    #[error(
        "the device takes no more memory regions from the vrdma service's programs ({0} in all)"
    )]
    Regions(usize),
    #[error("user {uid} has its share of {limit} memory regions with the device")]
    UserRegions { uid: u32, limit: usize },
    #[error("the program has its {0} memory regions with the device")]
    ProgramRegions(usize),
    #[error("{len} more bytes would pass the {limit} bytes the vrdma service locks for all programs (--max-locked-memory)")]
    Bytes { len: u64, limit: u64 },
    #[error("{len} more bytes would pass user {uid}'s share of {limit} bytes of locked memory (1/--share of --max-locked-memory)")]
    UserBytes { uid: u32, len: u64, limit: u64 },
    #[error("{len} more bytes would pass the program's {limit} bytes of shared memory (--max-program-memory)")]
    ProgramBytes { len: u64, limit: u64 },
    #[error("{len} more bytes would pass the process's RLIMIT_MEMLOCK of {limit} bytes ({held} locked for it already)")]
    Memlock { len: u64, held: u64, limit: u64 },
}

/// What one user (or all users together) holds.
#[derive(Debug, Default)]
struct Held {
    programs: usize,
    objects: HashMap<ObjectKind, u32>,
    regions: usize,
    bytes: u64,
}

/// Who holds what.
#[derive(Debug)]
pub struct Accounts {
    shares: Shares,
    users: HashMap<u32, Held>,
    total: Held,
    /// Bytes locked for each process (by the pid its connections' credentials give): a
    /// process's RLIMIT_MEMLOCK bounds all its connections together, as the kernel's
    /// accounting of pinned pages is per process.
    processes: HashMap<i32, u64>,
}

impl Accounts {
    pub fn new(shares: Shares) -> Accounts {
        Accounts {
            shares,
            users: HashMap::new(),
            total: Held::default(),
            processes: HashMap::new(),
        }
    }

    pub fn shares(&self) -> &Shares {
        &self.shares
    }

    fn user(&mut self, uid: u32) -> &mut Held {
        self.users.entry(uid).or_default()
    }

    /// Forgets a user who holds nothing any more.
    fn tidy(&mut self, uid: u32) {
        if let Some(held) = self.users.get(&uid) {
            if held.programs == 0 && held.regions == 0 && held.bytes == 0 {
                self.users.remove(&uid);
            }
        }
    }

    /// Admits a connection of user `uid`.
    pub fn admit(&mut self, uid: u32) -> Result<(), Refusal> {
        let shares = &self.shares;
        if self.total.programs >= shares.programs {
            return Err(Refusal::Programs(shares.programs));
        }
        let limit = shares.programs_per_user;
        if self.users.get(&uid).map_or(0, |held| held.programs) >= limit {
            return Err(Refusal::UserPrograms { uid, limit });
        }
        self.total.programs += 1;
        self.user(uid).programs += 1;
        Ok(())
    }

    /// A connection of `uid` has gone (after it gave back all it held).
    pub fn depart(&mut self, uid: u32) {
        self.total.programs = self.total.programs.saturating_sub(1);
        let held = self.user(uid);
        held.programs = held.programs.saturating_sub(1);
        self.tidy(uid);
    }

    /// Counts an object of `kind` that a program of `uid` is about to create, if its user's
    /// share has room.
    pub fn take_object(&mut self, uid: u32, kind: ObjectKind) -> Result<(), Refusal> {
        let limit = self.shares.objects_per_user[&kind];
        let held = self.user(uid).objects.entry(kind).or_default();
        if *held >= limit {
            return Err(Refusal::UserObjects { uid, kind, limit });
        }
        *held += 1;
        Ok(())
    }

    /// Counts an object of `kind` the device made for a program of `uid` unasked (a CM id of
    /// a connection request: the device bounds those itself).
    pub fn add_object(&mut self, uid: u32, kind: ObjectKind) {
        *self.user(uid).objects.entry(kind).or_default() += 1;
    }

    /// Gives back an object of `kind` of `uid` (destroyed, or never created).
    pub fn give_object(&mut self, uid: u32, kind: ObjectKind) {
        if let Some(held) = self.user(uid).objects.get_mut(&kind) {
            *held = held.saturating_sub(1);
        }
    }

    /// Counts a memory region a program of `uid`, holding `program_regions`, is about to
    /// have the device know.
    pub fn take_region(&mut self, uid: u32, program_regions: usize) -> Result<(), Refusal> {
        let shares = &self.shares;
        if program_regions >= shares.regions_per_program {
            return Err(Refusal::ProgramRegions(shares.regions_per_program));
        }
        if self.total.regions >= shares.regions {
            return Err(Refusal::Regions(shares.regions));
        }
        let limit = shares.regions_per_user;
        if self.users.get(&uid).map_or(0, |held| held.regions) >= limit {
            return Err(Refusal::UserRegions { uid, limit });
        }
        self.total.regions += 1;
        self.user(uid).regions += 1;
        Ok(())
    }

    pub fn give_region(&mut self, uid: u32) {
        self.total.regions = self.total.regions.saturating_sub(1);
        let held = self.user(uid);
        held.regions = held.regions.saturating_sub(1);
        self.tidy(uid);
    }

    /// Counts `len` bytes a program of `uid` in process `pid` (when known), sharing
    /// `program_bytes` already, is about to share, if every bound has room: the program's,
    /// its process's RLIMIT_MEMLOCK (`memlock`), its user's and the total.
    pub fn take_bytes(
        &mut self,
        uid: u32,
        pid: Option<i32>,
        program_bytes: u64,
        len: u64,
        memlock: Memlock,
    ) -> Result<(), Refusal> {
        let shares = &self.shares;
        let over = |held: u64, limit: u64| held.checked_add(len).is_none_or(|sum| sum > limit);
        if over(program_bytes, shares.bytes_per_program) {
            let limit = shares.bytes_per_program;
            return Err(Refusal::ProgramBytes { len, limit });
        }
        // A process whose pid is unknown is held to its limit by its own bytes alone.
        let process_bytes = pid.map_or(program_bytes, |pid| {
            self.processes.get(&pid).copied().unwrap_or(0)
        });
        if let Memlock::Bytes(limit) = memlock {
            if over(process_bytes, limit) {
                return Err(Refusal::Memlock {
                    len,
                    held: process_bytes,
                    limit,
                });
            }
        }
        if over(self.total.bytes, shares.bytes) {
            let limit = shares.bytes;
            return Err(Refusal::Bytes { len, limit });
        }
        let limit = shares.bytes_per_user;
        if over(self.users.get(&uid).map_or(0, |held| held.bytes), limit) {
            return Err(Refusal::UserBytes { uid, len, limit });
        }
        self.total.bytes += len;
        self.user(uid).bytes += len;
        if let Some(pid) = pid {
            *self.processes.entry(pid).or_default() += len;
        }
        Ok(())
    }

    pub fn give_bytes(&mut self, uid: u32, pid: Option<i32>, len: u64) {
        self.total.bytes = self.total.bytes.saturating_sub(len);
        let held = self.user(uid);
        held.bytes = held.bytes.saturating_sub(len);
        self.tidy(uid);
        if let Some(pid) = pid {
            if let Some(bytes) = self.processes.get_mut(&pid) {
                *bytes = bytes.saturating_sub(len);
                if *bytes == 0 {
                    self.processes.remove(&pid);
                }
            }
        }
    }
}

/// CAP_IPC_LOCK's bit in the capability sets of /proc/PID/status.
const CAP_IPC_LOCK: u32 = 14;

/// The RLIMIT_MEMLOCK soft limit of `/proc/PID/limits` text: `None` if it has no such line.
pub fn parse_memlock_limit(limits: &str) -> Option<Memlock> {
    let line = limits
        .lines()
        .find(|line| line.starts_with("Max locked memory"))?;
    let soft = line
        .strip_prefix("Max locked memory")?
        .split_whitespace()
        .next()?;
    match soft {
        "unlimited" => Some(Memlock::Unlimited),
        bytes => bytes.parse().ok().map(Memlock::Bytes),
    }
}

/// Whether `/proc/PID/status` text gives the process CAP_IPC_LOCK (in its effective set).
pub fn parse_ipc_lock_capability(status: &str) -> Option<bool> {
    let effective = status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))?
        .trim();
    let bits = u64::from_str_radix(effective, 16).ok()?;
    Some(bits & (1 << CAP_IPC_LOCK) != 0)
}

/// What a process may have locked for it, read from /proc now (uverbs reads the limit each
/// time it pins); an error when /proc does not tell (a process of another pid namespace).
pub fn memlock_of(pid: i32) -> Result<Memlock, String> {
    let read = |file: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/{file}"))
            .map_err(|e| format!("reading /proc/{pid}/{file}: {e}"))
    };
    let privileged = parse_ipc_lock_capability(&read("status")?)
        .ok_or_else(|| format!("/proc/{pid}/status has no CapEff"))?;
    if privileged {
        return Ok(Memlock::Unlimited);
    }
    parse_memlock_limit(&read("limits")?)
        .ok_or_else(|| format!("/proc/{pid}/limits has no locked memory limit"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shares() -> Shares {
        Shares {
            programs: 4,
            programs_per_user: 2,
            objects_per_user: HashMap::from([(ObjectKind::Pd, 3)]),
            regions: 5,
            regions_per_user: 3,
            regions_per_program: 2,
            bytes: 100,
            bytes_per_user: 60,
            bytes_per_program: 50,
        }
    }

    #[test]
    fn a_user_holds_its_share_however_many_programs_it_connects() {
        let mut accounts = Accounts::new(shares());
        accounts.admit(1).unwrap();
        accounts.admit(1).unwrap();
        assert_eq!(
            accounts.admit(1),
            Err(Refusal::UserPrograms { uid: 1, limit: 2 })
        );
        // Others are served beside it, up to the total.
        accounts.admit(2).unwrap();
        accounts.admit(3).unwrap();
        assert_eq!(accounts.admit(4), Err(Refusal::Programs(4)));
        accounts.depart(3);
        accounts.admit(4).unwrap();
        // Objects: the user's programs hold its share together.
        for _ in 0..3 {
            accounts.take_object(1, ObjectKind::Pd).unwrap();
        }
        assert!(matches!(
            accounts.take_object(1, ObjectKind::Pd),
            Err(Refusal::UserObjects { limit: 3, .. })
        ));
        accounts.take_object(2, ObjectKind::Pd).unwrap();
        accounts.give_object(1, ObjectKind::Pd);
        accounts.take_object(1, ObjectKind::Pd).unwrap();
    }

    #[test]
    fn memory_regions_are_bounded_per_program_per_user_and_in_total() {
        let mut accounts = Accounts::new(shares());
        assert_eq!(accounts.take_region(1, 2), Err(Refusal::ProgramRegions(2)));
        for _ in 0..3 {
            accounts.take_region(1, 0).unwrap();
        }
        assert_eq!(
            accounts.take_region(1, 0),
            Err(Refusal::UserRegions { uid: 1, limit: 3 })
        );
        accounts.take_region(2, 0).unwrap();
        accounts.take_region(3, 0).unwrap();
        assert_eq!(accounts.take_region(4, 0), Err(Refusal::Regions(5)));
        accounts.give_region(1);
        accounts.take_region(4, 0).unwrap();
    }

    #[test]
    fn locked_bytes_are_bounded_by_the_processs_memlock_its_program_user_and_the_total() {
        let mut accounts = Accounts::new(shares());
        let limited = Memlock::Bytes(30);
        // One process, two connections: its RLIMIT_MEMLOCK holds them together.
        accounts.take_bytes(1, Some(10), 0, 20, limited).unwrap();
        assert_eq!(
            accounts.take_bytes(1, Some(10), 0, 20, limited),
            Err(Refusal::Memlock {
                len: 20,
                held: 20,
                limit: 30
            })
        );
        // A privileged process of the same user: the user's share still holds.
        accounts
            .take_bytes(1, Some(11), 0, 40, Memlock::Unlimited)
            .unwrap();
        assert!(matches!(
            accounts.take_bytes(1, Some(12), 0, 1, Memlock::Unlimited),
            Err(Refusal::UserBytes { limit: 60, .. })
        ));
        // The program's own bound, and the total.
        assert!(matches!(
            accounts.take_bytes(2, Some(13), 45, 10, Memlock::Unlimited),
            Err(Refusal::ProgramBytes { limit: 50, .. })
        ));
        accounts
            .take_bytes(2, Some(13), 0, 40, Memlock::Unlimited)
            .unwrap();
        assert!(matches!(
            accounts.take_bytes(3, Some(14), 0, 1, Memlock::Unlimited),
            Err(Refusal::Bytes { limit: 100, .. })
        ));
        // Given back, the room is there again; an unknown pid is held by its own bytes.
        accounts.give_bytes(1, Some(11), 40);
        accounts.take_bytes(3, None, 0, 30, limited).unwrap();
        assert!(matches!(
            accounts.take_bytes(3, None, 30, 1, limited),
            Err(Refusal::Memlock { held: 30, .. })
        ));
        assert!(
            matches!(
                accounts.take_bytes(1, Some(10), 0, u64::MAX, Memlock::Unlimited),
                Err(Refusal::ProgramBytes { .. })
            ),
            "no overflow"
        );
    }

    #[test]
    fn memlock_limits_and_the_ipc_lock_capability_are_read_as_proc_shows_them() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             95534                95534                processes \n\
                      Max locked memory         8388608              16777216             bytes     \n";
        assert_eq!(
            parse_memlock_limit(limits),
            Some(Memlock::Bytes(8 << 20)),
            "the soft limit"
        );
        let unlimited =
            "Max locked memory         unlimited            unlimited            bytes\n";
        assert_eq!(parse_memlock_limit(unlimited), Some(Memlock::Unlimited));
        assert_eq!(parse_memlock_limit("Max processes 1 1\n"), None);
        let status = |eff: &str| format!("Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t{eff}\n");
        assert_eq!(
            parse_ipc_lock_capability(&status("000001fffeffffff")),
            Some(true)
        );
        assert_eq!(
            parse_ipc_lock_capability(&status("0000000000000000")),
            Some(false)
        );
        assert_eq!(
            parse_ipc_lock_capability(&status("0000000000004000")),
            Some(true)
        );
        assert_eq!(parse_ipc_lock_capability("Name:\tx\n"), None);
        // This process: whatever it is, /proc tells.
        assert!(memlock_of(std::process::id() as i32).is_ok());
    }
}
