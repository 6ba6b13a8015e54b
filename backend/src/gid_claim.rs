//! Which backends serve guests on a GID. Guests that send from one GID can inject packets into
//! each other's RC connections (SPEC.md §10), so a backend serves its guests on a GID only if
//! no other backend of the host does, unless every backend on it declares its guests one
//! trust domain (`--shared-gid`). A backend holds a lock on a file named after the GID for as
//! long as it serves: exclusive by default, shared with `--shared-gid`; the kernel drops it
//! when the process ends, however it ends.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::hostverbs::Gid;

/// Where the locks live: one place for every backend of the host, whatever user it runs as.
/// A folder of its own: /run/vrdma also holds the guests' sockets, which no other user may
/// put files beside.
const LOCK_DIR: &str = "/run/vrdma/gid-claims";

/// The backend's claim on its guests' GID, held until dropped.
#[derive(Debug)]
pub struct GidClaim {
    _lock: File,
}

#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("GID {gid} of {device} port {port} is already served by another backend{how}: guests on one GID can inject packets into each other's connections; give each backend a --guest-ip of its own, or run every backend that shares the GID with --shared-gid (its guests are then one trust domain)")]
    Taken {
        gid: Gid,
        device: String,
        port: u8,
        how: &'static str,
    },
    #[error("cannot claim the guests' GID ({}): {source}", path.display())]
    Lock {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Claims `gid` of `device` port `port` for this backend's guests: alone, or `shared` with
/// other backends that share it too.
pub fn claim(device: &str, port: u8, gid: Gid, shared: bool) -> Result<GidClaim, ClaimError> {
    let name = format!(
        "gid-{device}-{port}-{}.lock",
        gid.0.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    let path = lock_dir().join(name);
    let lock_error = |source| ClaimError::Lock {
        path: path.clone(),
        source,
    };
    let file = open_lock_file(&path).map_err(lock_error)?;
    let operation = if shared { libc::LOCK_SH } else { libc::LOCK_EX };
    // SAFETY: flock on a descriptor this function owns; the result is checked.
    if unsafe { libc::flock(file.as_raw_fd(), operation | libc::LOCK_NB) } != 0 {
        let error = io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(lock_error(error));
        }
        return Err(ClaimError::Taken {
            gid,
            device: device.to_string(),
            port,
            how: if shared {
                " that does not share it (--shared-gid)"
            } else {
                ""
            },
        });
    }
    Ok(GidClaim { _lock: file })
}

/// The lock directory for backends that serve as the process's own group.
pub fn lock_dir() -> PathBuf {
    lock_dir_for(nix::unistd::getegid())
}

/// The lock directory, made if missing: open only to `group` (the group of the user the
/// backend serves as), setgid so the lock files are that group's too, and sticky so that no
/// backend removes another's file. A lock file anyone could open, anyone could lock: a folder
/// open to every user (as this one once was, mode 1777) let any local user hold a GID's claim
/// and keep backends from starting, so such a folder is closed to others here, or refused when
/// this process cannot. A process that cannot make the folder claims in its temporary
/// directory instead, which only backends of the same user see. A backend that starts as root
/// and serves as `--user` makes it first: a guest added at run time claims its GID as that
/// user, who may not make folders in /run.
pub fn lock_dir_for(group: nix::unistd::Gid) -> PathBuf {
    let dir = Path::new(LOCK_DIR);
    let parent = dir.parent().expect("LOCK_DIR has a parent");
    let ready = std::fs::create_dir_all(parent)
        .and_then(|()| match std::fs::create_dir(dir) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            made => made,
        })
        .and_then(|()| close_to_others(dir, group));
    match ready {
        Ok(()) => dir.to_path_buf(),
        Err(e) => {
            let fallback = std::env::temp_dir().join("vrdma");
            log::warn!(
                "cannot use {LOCK_DIR} ({e}): GID claims go to {}, which only backends of this user see",
                fallback.display()
            );
            let _ = std::fs::create_dir_all(&fallback);
            let _ = std::fs::set_permissions(&fallback, std::fs::Permissions::from_mode(0o700));
            fallback
        }
    }
}

/// The claims folder's mode: the owner and its group only, setgid and sticky.
const LOCK_DIR_MODE: u32 = 0o3770;

/// Makes `dir` the claims folder of `group` (see [`lock_dir_for`]), if it is not yet closed
/// to other users; fails where it is open to them and this process may not change that.
/// Root preparing the folder for another group (a backend that starts as root and serves as
/// `--user`) gives it, and the claims in it, to that group: claims root made before (its
/// declared guests', an earlier backend's) would otherwise keep the serving user from
/// claiming a GID for a guest added at run time. Backends that serve as different users
/// share the folder only through one group (the packages' `vrdma`).
fn close_to_others(dir: &Path, group: nix::unistd::Gid) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir)?;
    let to_group =
        nix::unistd::geteuid().is_root() && group.as_raw() != 0 && meta.gid() != group.as_raw();
    if meta.mode() & 0o007 == 0 && !to_group {
        return Ok(());
    }
    nix::unistd::chown(dir, None, Some(group)).map_err(io::Error::from)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(LOCK_DIR_MODE))?;
    if to_group {
        for claim in std::fs::read_dir(dir)?.flatten() {
            nix::unistd::chown(&claim.path(), None, Some(group)).map_err(io::Error::from)?;
        }
    }
    Ok(())
}

/// Opens the lock file for reading (all flock needs), making it if missing.
fn open_lock_file(path: &Path) -> io::Result<File> {
    loop {
        match File::open(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            opened => return opened,
        }
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o660)
            .open(path)
        {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            made => return made,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gid(last: u8) -> Gid {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[15] = last;
        Gid(gid)
    }

    /// Finding: the claims folder was open to every user (mode 1777), so any local user could
    /// make a GID's lock file, hold its lock and keep backends from starting. Now it is open
    /// to the serving user's group only, and an old open one is closed.
    #[test]
    fn a_claims_folder_open_to_every_user_is_closed_to_others() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("vrdma-claims-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        close_to_others(&dir, nix::unistd::getegid()).unwrap();
        let meta = std::fs::metadata(&dir).unwrap();
        assert_eq!(meta.mode() & 0o7777, LOCK_DIR_MODE);
        assert_eq!(meta.gid(), nix::unistd::getegid().as_raw());
        std::fs::remove_dir(&dir).unwrap();
        let made = lock_dir();
        assert_eq!(std::fs::metadata(made).unwrap().mode() & 0o007, 0);
    }

    /// Finding: a backend started as root claimed its declared guests' GIDs in a folder of
    /// root's group, so once it served as `--user`, a guest added at run time could not claim
    /// its GID ("Permission denied"). Root preparing the folder for the serving user's group
    /// now gives the folder and its claims to that group.
    #[test]
    fn root_gives_the_claims_folder_and_its_claims_to_the_serving_group() {
        use std::os::unix::fs::MetadataExt;
        assert!(nix::unistd::geteuid().is_root(), "run as root, as CI does");
        let dir = std::env::temp_dir().join(format!("vrdma-claims-root-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        let root = nix::unistd::Gid::from_raw(0);
        close_to_others(&dir, root).unwrap();
        let claim = dir.join("gid-test-1-0.lock");
        open_lock_file(&claim).unwrap();
        assert_eq!(std::fs::metadata(&claim).unwrap().gid(), 0);
        let nogroup = nix::unistd::Gid::from_raw(65534);
        close_to_others(&dir, nogroup).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().gid(), 65534);
        assert_eq!(std::fs::metadata(&claim).unwrap().gid(), 65534);
        // Root's own backends leave a serving group's folder as it is: root opens any claim.
        close_to_others(&dir, root).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().gid(), 65534);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_gid_is_served_by_one_backend_or_shared_by_backends_that_all_share_it() {
        let device = format!("test{}", std::process::id());
        let alone = claim(&device, 1, gid(1), false).unwrap();
        let taken = claim(&device, 1, gid(1), false).unwrap_err();
        assert!(matches!(taken, ClaimError::Taken { .. }), "{taken}");
        assert!(taken.to_string().contains("--shared-gid"), "{taken}");
        let refused = claim(&device, 1, gid(1), true).unwrap_err();
        assert!(matches!(refused, ClaimError::Taken { .. }), "{refused}");
        // Another GID, or another port, is another claim.
        let _other = claim(&device, 1, gid(2), false).unwrap();
        let _port = claim(&device, 2, gid(1), false).unwrap();
        drop(alone);
        let first = claim(&device, 1, gid(1), true).unwrap();
        let second = claim(&device, 1, gid(1), true).unwrap();
        assert!(matches!(
            claim(&device, 1, gid(1), false),
            Err(ClaimError::Taken { .. })
        ));
        drop((first, second));
        claim(&device, 1, gid(1), false).unwrap();
        // The lock files of this test's made-up device go; a real device's stay for reuse.
        for entry in std::fs::read_dir(lock_dir()).unwrap().flatten() {
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with(&format!("gid-{device}-"))
            {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}
