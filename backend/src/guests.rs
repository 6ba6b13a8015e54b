//! Guests declared to one backend (`--config FILE`, and `vrdmactl add` at run time): each with
//! a socket of its own, its own address (or the host's GID), its own quotas and rate limits.
//!
//! The file is TOML (it may declare no guest: `vrdmactl add` adds them):
//!
//! ```toml
//! # Guests without an address of their own send from the host's GID; more than one such
//! # guest needs this (they can forge packets into each other's RC connections).
//! shared_gid = false
//!
//! [[guest]]
//! name = "vm1"                        # how vrdmactl and the log name it
//! socket = "/run/vrdma/vm1.sock"      # its vhost-user socket (one front end at a time)
//! guest_ip = "10.0.0.5/24"            # its own address and GID (else the host's GID)
//! max_qp = 512                        # any quota (--max-* without "--"); unset: the default
//! max_bytes_per_second = 1000000000   # rate limits; unset or 0: none
//! ```

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vhost::vhost_user::Listener;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::admin::{AdminSocket, GuestControl};
use crate::datapath::RateLimits;
use crate::gid_claim::GidClaim;
use crate::guest_address::GuestIp;
use crate::vhost_user::{self, Serving};
use crate::{Config, GuestAddresses, Quotas, SharedGuestAddress};

#[derive(Debug, thiserror::Error)]
pub enum DeclarationError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Syntax(String),
    #[error("guest {name:?}: guest_ip {text:?}: {reason}")]
    Address {
        name: String,
        text: String,
        reason: String,
    },
    #[error("guest names must be unique and non-empty: {0:?}")]
    Name(String),
    #[error("two guests share the socket {0}")]
    SharedSocket(PathBuf),
    #[error("two guests share the address {0}")]
    SharedAddress(String),
    #[error("guest {name:?}: {what} must be at least 1")]
    Zero { name: String, what: &'static str },
}

/// The configuration file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Declarations {
    /// Guests without an address of their own may share the host's GID.
    #[serde(default)]
    pub shared_gid: bool,
    #[serde(default, rename = "guest")]
    pub guests: Vec<GuestDeclaration>,
}

/// One guest as declared.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestDeclaration {
    pub name: String,
    pub socket: PathBuf,
    pub guest_ip: Option<String>,
    pub gid_index: Option<u32>,
    pub max_qp: Option<u32>,
    pub max_cq: Option<u32>,
    pub max_mr: Option<u32>,
    pub max_pd: Option<u32>,
    pub max_ah: Option<u32>,
    pub max_srq: Option<u32>,
    pub max_mr_size: Option<u64>,
    pub max_ring_bytes: Option<u64>,
    pub max_registered_bytes: Option<u64>,
    pub max_memory_regions: Option<u32>,
    pub max_wqes_per_second: Option<u64>,
    pub max_bytes_per_second: Option<u64>,
}

impl Declarations {
    /// Reads and checks the file at `path`.
    pub fn load(path: &Path) -> Result<Declarations, DeclarationError> {
        let text = std::fs::read_to_string(path).map_err(|source| DeclarationError::Read {
            path: path.to_owned(),
            source,
        })?;
        let declarations: Declarations = toml::from_str(&text)
            .map_err(|e| DeclarationError::Syntax(format!("{}: {e}", path.display())))?;
        for guest in &declarations.guests {
            guest.check()?;
        }
        check_apart(&declarations.guests)?;
        Ok(declarations)
    }
}

/// Checks that no two of `guests` share a name, a socket or an address.
pub fn check_apart<'a>(
    guests: impl IntoIterator<Item = &'a GuestDeclaration>,
) -> Result<(), DeclarationError> {
    let (mut names, mut sockets, mut addresses) =
        (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
    for guest in guests {
        if !names.insert(&guest.name) {
            return Err(DeclarationError::Name(guest.name.clone()));
        }
        if !sockets.insert(&guest.socket) {
            return Err(DeclarationError::SharedSocket(guest.socket.clone()));
        }
        if let Some(ip) = &guest.guest_ip {
            let address = ip.split('/').next().unwrap_or(ip);
            if !addresses.insert(address) {
                return Err(DeclarationError::SharedAddress(address.to_string()));
            }
        }
    }
    Ok(())
}

impl GuestDeclaration {
    /// One declaration as `vrdmactl add` sends it: a TOML inline table,
    /// `{ name = "vm4", socket = "/run/vrdma/vm4.sock", max_qp = 64 }`.
    pub fn parse_inline(text: &str) -> Result<GuestDeclaration, DeclarationError> {
        #[derive(Deserialize)]
        struct One {
            guest: GuestDeclaration,
        }
        let one: One = toml::from_str(&format!("guest = {text}"))
            .map_err(|e| DeclarationError::Syntax(e.message().to_string()))?;
        one.guest.check()?;
        Ok(one.guest)
    }

    fn check(&self) -> Result<(), DeclarationError> {
        let name_ok = !self.name.is_empty()
            && self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        if !name_ok {
            return Err(DeclarationError::Name(self.name.clone()));
        }
        self.address()?;
        let counts = [
            ("max_qp", self.max_qp),
            ("max_cq", self.max_cq),
            ("max_mr", self.max_mr),
            ("max_pd", self.max_pd),
            ("max_ah", self.max_ah),
            ("max_srq", self.max_srq),
            ("max_memory_regions", self.max_memory_regions),
        ];
        for (what, value) in counts {
            if value == Some(0) {
                return Err(DeclarationError::Zero {
                    name: self.name.clone(),
                    what,
                });
            }
        }
        Ok(())
    }

    fn address(&self) -> Result<Option<GuestIp>, DeclarationError> {
        let Some(text) = &self.guest_ip else {
            return Ok(None);
        };
        text.parse()
            .map(Some)
            .map_err(
                |e: crate::guest_address::AddressError| DeclarationError::Address {
                    name: self.name.clone(),
                    text: text.clone(),
                    reason: e.to_string(),
                },
            )
    }

    /// The configuration the guest is served with: `base` (the command line's device, port,
    /// pollers, sandbox) with the guest's address, quotas and limits; quotas it leaves unset
    /// are `base`'s.
    pub fn config(&self, base: &Config, shared_gid: bool) -> Config {
        let q = base.quotas;
        let quotas = Quotas {
            max_qp: self.max_qp.unwrap_or(q.max_qp),
            max_cq: self.max_cq.unwrap_or(q.max_cq),
            max_mr: self.max_mr.unwrap_or(q.max_mr),
            max_pd: self.max_pd.unwrap_or(q.max_pd),
            max_ah: self.max_ah.unwrap_or(q.max_ah),
            max_srq: self.max_srq.unwrap_or(q.max_srq),
            max_mr_size: self.max_mr_size.unwrap_or(q.max_mr_size),
            max_ring_bytes: self.max_ring_bytes.unwrap_or(q.max_ring_bytes),
            max_registered_bytes: self.max_registered_bytes.unwrap_or(q.max_registered_bytes),
            max_memory_regions: self
                .max_memory_regions
                .unwrap_or(q.max_memory_regions)
                .min(crate::limits::MAX_MEMORY_SLOTS),
        };
        let address = self.address().ok().flatten();
        Config {
            guest_ip: address,
            gid_index: if address.is_some() {
                None
            } else {
                self.gid_index.or(base.gid_index)
            },
            quotas,
            rate_limits: RateLimits {
                wqes_per_second: self
                    .max_wqes_per_second
                    .unwrap_or(base.rate_limits.wqes_per_second),
                bytes_per_second: self
                    .max_bytes_per_second
                    .unwrap_or(base.rate_limits.bytes_per_second),
            },
            // One front end at a time per socket: a guest is one VM (or one process).
            max_guests: 1,
            shared_gid: shared_gid && address.is_none(),
            ..base.clone()
        }
    }
}

/// A declared guest's socket, address and GID claim, made while the backend still has the
/// privileges they need (before `--user` takes effect); served by [`GuestServers::start`].
pub struct ClaimedGuest {
    declaration: GuestDeclaration,
    config: Config,
    address: SharedGuestAddress,
    claim: Option<GidClaim>,
    listener: Listener,
}

impl ClaimedGuest {
    /// Puts the guest's address on the host, claims its GID and listens on its socket.
    pub fn claim(
        declaration: GuestDeclaration,
        base: &Config,
        shared_gid: bool,
    ) -> Result<ClaimedGuest, crate::Error> {
        let config = declaration.config(base, shared_gid);
        let address = crate::assign_guest_address(&config)?;
        let claim = crate::claim_guest_gid(&config)?;
        let listener = vhost_user::listen(&declaration.socket, config.socket_group.as_ref())?;
        Ok(ClaimedGuest {
            declaration,
            config,
            address,
            claim,
            listener,
        })
    }
}

/// A declared guest being served.
struct Running {
    declaration: GuestDeclaration,
    stop: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
    address: SharedGuestAddress,
    _claim: Option<GidClaim>,
}

/// The declared guests of a backend, served on one [`Serving`]; added and removed at run
/// time through the management socket.
pub struct GuestServers {
    base: Config,
    shared_gid: bool,
    serving: Arc<Serving>,
    running: Mutex<BTreeMap<String, Running>>,
    /// Every guest address on the host: taken off when the process is told to stop.
    addresses: GuestAddresses,
}

impl GuestServers {
    pub fn new(
        base: Config,
        shared_gid: bool,
        serving: Arc<Serving>,
        addresses: GuestAddresses,
    ) -> Arc<GuestServers> {
        Arc::new(GuestServers {
            base,
            shared_gid,
            serving,
            running: Mutex::default(),
            addresses,
        })
    }

    fn running(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Running>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Serves `claimed` on a thread of its own.
    pub fn start(&self, claimed: ClaimedGuest) -> Result<(), crate::Error> {
        let ClaimedGuest {
            declaration,
            config,
            address,
            claim,
            listener,
        } = claimed;
        let name = declaration.name.clone();
        let socket = self.serving.prepare(config, &name, || Ok(listener))?;
        let stop = Arc::new(EventFd::new(EFD_NONBLOCK)?);
        let (serving, stopped) = (Arc::clone(&self.serving), Arc::clone(&stop));
        let thread_name = name.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vrdma-{name}"))
            .spawn(move || {
                if let Err(e) = serving.serve(socket, Some(&stopped)) {
                    log::error!("guest {thread_name}: serving its socket failed: {e}");
                }
            })?;
        self.addresses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::clone(&address));
        log::info!("guest {name}: served on {}", declaration.socket.display());
        self.running().insert(
            name,
            Running {
                declaration,
                stop,
                thread: Some(thread),
                address,
                _claim: claim,
            },
        );
        Ok(())
    }

    /// The management socket answers one request at a time, so no other add comes between
    /// the check and the start.
    fn add_declared(&self, declaration: GuestDeclaration) -> Result<(), String> {
        {
            let running = self.running();
            let declared = running.values().map(|r| &r.declaration);
            check_apart(declared.chain([&declaration])).map_err(|e| e.to_string())?;
        }
        let claimed = ClaimedGuest::claim(declaration, &self.base, self.shared_gid)
            .map_err(|e| e.to_string())?;
        self.start(claimed).map_err(|e| e.to_string())
    }

    fn remove_declared(&self, name: &str) -> Result<(), String> {
        let Some(mut running) = self.running().remove(name) else {
            return Err(format!("no guest {name:?} is declared"));
        };
        // The socket stops taking front ends and ends the one connected; its thread returns
        // once that one's teardown freed everything it held.
        let _ = running.stop.write(1);
        if let Some(thread) = running.thread.take() {
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&running.declaration.socket);
        self.addresses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|held| !Arc::ptr_eq(held, &running.address));
        drop(
            running
                .address
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
        log::info!("guest {name}: removed");
        Ok(())
    }
}

/// Serves the guests `claimed` (in order, each on a thread of its own), on one poller pool,
/// with `admin` reporting them and adding and removing guests; returns only on an error
/// starting them.
pub fn serve_declared(
    base: &Config,
    shared_gid: bool,
    claimed: Vec<ClaimedGuest>,
    (admin, addresses): (Option<AdminSocket>, GuestAddresses),
) -> Result<(), crate::Error> {
    let serving = Serving::start(base)?;
    let servers = GuestServers::new(base.clone(), shared_gid, Arc::clone(&serving), addresses);
    for guest in claimed {
        servers.start(guest)?;
    }
    serving.registry.set_control(servers);
    if let Some(admin) = admin {
        admin.serve(Arc::clone(&serving.registry))?;
    }
    // Everything serving needs from here on is in the filter (crate::sandbox).
    crate::sandbox::confine(base.seccomp)?;
    log::info!("accepting guests");
    loop {
        std::thread::park();
    }
}

impl GuestControl for GuestServers {
    fn add(&self, declaration: &str) -> Result<String, String> {
        let declaration = GuestDeclaration::parse_inline(declaration).map_err(|e| e.to_string())?;
        let (name, socket) = (declaration.name.clone(), declaration.socket.clone());
        self.add_declared(declaration)?;
        Ok(format!("guest {name} is served on {}", socket.display()))
    }

    fn remove(&self, name: &str) -> Result<String, String> {
        self.remove_declared(name)?;
        Ok(format!("guest {name} is removed"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> PathBuf {
        static FILES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let file = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("vrdma-guests-{}-{file}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn a_file_declares_guests_with_their_own_sockets_addresses_quotas_and_limits() {
        let path = write(
            r#"
            shared_gid = true
            [[guest]]
            name = "vm1"
            socket = "/run/vrdma/vm1.sock"
            guest_ip = "10.0.0.5/24"
            max_qp = 512
            max_bytes_per_second = 1000
            [[guest]]
            name = "vm2"
            socket = "/run/vrdma/vm2.sock"
            "#,
        );
        let declared = Declarations::load(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(declared.shared_gid);
        let base = Config {
            max_guests: 64,
            ..Config::for_tests("rxe0")
        };
        let vm1 = declared.guests[0].config(&base, declared.shared_gid);
        assert_eq!(vm1.guest_ip.unwrap().to_string(), "10.0.0.5/24");
        assert_eq!(vm1.quotas.max_qp, 512);
        assert_eq!(vm1.quotas.max_cq, base.quotas.max_cq);
        assert_eq!(vm1.rate_limits.bytes_per_second, 1000);
        assert!(
            !vm1.shared_gid,
            "a guest with its own address shares no GID"
        );
        let vm2 = declared.guests[1].config(&base, declared.shared_gid);
        assert_eq!(
            (vm2.guest_ip, vm2.shared_gid, vm2.max_guests),
            (None, true, 1)
        );
    }

    #[test]
    fn mistakes_in_a_file_are_named() {
        let cases = [
            ("[[guest]]\nname = \"a\"\n", "socket"),
            ("[[guest]]\nname = \"a\"\nsocket = \"/s\"\ncolour = 1\n", "colour"),
            ("[[guest]]\nname = \"a b\"\nsocket = \"/s\"\n", "unique and non-empty"),
            ("[[guest]]\nname = \"a\"\nsocket = \"/s\"\nguest_ip = \"10.0.0.300/24\"\n", "guest_ip"),
            ("[[guest]]\nname = \"a\"\nsocket = \"/s\"\nmax_qp = 0\n", "max_qp"),
            (
                "[[guest]]\nname = \"a\"\nsocket = \"/s\"\n[[guest]]\nname = \"a\"\nsocket = \"/t\"\n",
                "unique",
            ),
            (
                "[[guest]]\nname = \"a\"\nsocket = \"/s\"\n[[guest]]\nname = \"b\"\nsocket = \"/s\"\n",
                "share the socket",
            ),
            (
                "[[guest]]\nname = \"a\"\nsocket = \"/s\"\nguest_ip = \"10.0.0.5/24\"\n[[guest]]\nname = \"b\"\nsocket = \"/t\"\nguest_ip = \"10.0.0.5/16\"\n",
                "share the address",
            ),
        ];
        for (text, said) in cases {
            let path = write(text);
            let error = Declarations::load(&path).unwrap_err().to_string();
            std::fs::remove_file(&path).unwrap();
            assert!(error.contains(said), "{text:?}: {error}");
        }
        let missing = Declarations::load(Path::new("/nonexistent/vrdma.toml")).unwrap_err();
        assert!(missing.to_string().contains("/nonexistent/vrdma.toml"));
    }

    #[test]
    fn a_file_may_declare_no_guest_yet() {
        let path = write("shared_gid = false\n");
        let declared = Declarations::load(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(declared.guests.is_empty());
    }

    #[test]
    fn one_guest_is_declared_inline() {
        let guest =
            GuestDeclaration::parse_inline(r#"{ name = "vm4", socket = "/s4", max_qp = 64 }"#)
                .unwrap();
        assert_eq!((guest.name.as_str(), guest.max_qp), ("vm4", Some(64)));
        assert!(GuestDeclaration::parse_inline(r#"{ name = "vm4" }"#).is_err());
        assert!(GuestDeclaration::parse_inline("name = 1").is_err());
    }
}
