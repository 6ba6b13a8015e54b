//! The server: the socket front ends connect to, and the threads that give each connection a
//! backend of its own ([`RdmaBackend`]) and destroy what it held when it ends.

use super::*;

/// Serves front ends on `socket_path` until an error, as [`serve_listener`] does; the first
/// guest's host context is open before the socket exists, so a front end (or a test counting
/// the host's objects) that sees the socket finds the backend ready.
pub fn serve(config: &Config, socket_path: &Path) -> Result<(), Error> {
    // Held while serving: no other backend serves guests on this GID unless all share it.
    let _claim = crate::claim_guest_gid(config)?;
    let serving = Serving::start(config)?;
    let socket = serving.prepare(config.clone(), ONE_SOCKET, || {
        listen(socket_path, config.socket_group.as_ref())
    })?;
    crate::sandbox::confine(config.seccomp)?;
    log::info!("accepting guests");
    serving.serve(socket, None)
}

impl Managed for RwLock<RdmaBackend> {
    fn report(&self, guest: u64) -> GuestReport {
        let backend = self.read().unwrap_or_else(|e| e.into_inner());
        let state = match &backend.control_queue {
            _ if backend.migrating() => GuestState::Migrating,
            None => GuestState::Starting,
            Some(queue) if queue.get_ref().get_queue().ready() => GuestState::Running,
            Some(_) => GuestState::Paused,
        };
        GuestReport {
            state,
            ..backend.device.report(guest)
        }
    }

    fn set_rate_limits(&self, limits: RateLimits) {
        self.read()
            .unwrap_or_else(|e| e.into_inner())
            .device
            .data_path()
            .set_rate_limits(limits);
    }
}

/// The vhost-user socket at `socket_path`, listening; with `group`, that group's members may
/// connect to it too. A socket left there by a backend that is gone is replaced; anything
/// else there (a file that is not a socket, or a socket something still serves) is not
/// touched, and refused.
pub fn listen(
    socket_path: &Path,
    group: Option<&crate::sandbox::SocketGroup>,
) -> Result<Listener, Error> {
    check_socket_path(socket_path)?;
    let listener = Listener::new(socket_path, true).map_err(Error::VhostUser)?;
    if let Some(group) = group {
        group
            .give(socket_path)
            .map_err(|source| Error::SocketGroup {
                path: socket_path.to_owned(),
                group: group.name.clone(),
                source,
            })?;
    }
    log::info!("listening on {}", socket_path.display());
    Ok(listener)
}

/// Refuses `path` for a new socket unless nothing is there or a socket no process serves.
pub(super) fn check_socket_path(path: &Path) -> Result<(), Error> {
    use std::os::unix::fs::FileTypeExt;
    let refused = |reason: &str| Error::SocketPath {
        path: path.to_owned(),
        reason: reason.to_string(),
    };
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(refused(&e.to_string())),
        Ok(meta) if !meta.file_type().is_socket() => {
            Err(refused("something other than a socket is there"))
        }
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Err(refused("a process serves the socket there")),
            Err(_) => Ok(()),
        },
    }
}

/// The name of the one socket `--socket-path` serves, in reports.
pub const ONE_SOCKET: &str = "guest";

/// Serves the front ends `listener` accepts until an error (the caller holds the claim on the
/// guests' GID, [`crate::claim_guest_gid`]): each connection gets its own
/// backend (its own host context and objects), served on its own threads; when it ends,
/// everything it created on the host is destroyed. With `admin`, the management socket
/// reports the connected guests.
pub fn serve_listener(
    config: &Config,
    listener: Listener,
    admin: Option<AdminSocket>,
) -> Result<(), Error> {
    let serving = Serving::start(config)?;
    let socket = serving.prepare(config.clone(), ONE_SOCKET, || Ok(listener))?;
    if let Some(admin) = admin {
        admin.serve(Arc::clone(&serving.registry))?;
    }
    // Everything serving needs from here on is in the filter (crate::sandbox).
    crate::sandbox::confine(config.seccomp)?;
    // Front ends may connect once the socket exists; this line says their host context is
    // ready (test harnesses count the host's objects from here).
    log::info!("accepting guests");
    serving.serve(socket, None)
}

/// What every socket a backend serves shares: the poller pool, the RC QPs of all its guests,
/// the registry of connections the management socket reports, and the connections' numbers.
pub struct Serving {
    pool: Arc<PollerPool>,
    peers: Arc<LocalPeers>,
    pub registry: Arc<Registry>,
    connections: std::sync::atomic::AtomicU64,
}

/// A socket ready to serve: its guest's configuration and name, and the device context its
/// first front end gets, opened before it arrives (so a front end never waits for it, and a
/// bad device fails before the first guest is accepted).
pub struct PreparedSocket {
    config: Config,
    name: String,
    listener: Listener,
    first: RdmaBackend,
    /// What its guest's sends owe their rate limits, from one connection to the next.
    rate_debt: Arc<RateDebt>,
    /// Device states saved on it for a successor connection (SPEC.md §11.1).
    handovers: Arc<super::handover::Handovers>,
}

impl Serving {
    /// Starts the poller pool `config` asks for, and the recovery from faults in guest
    /// memory ([`crate::guest_faults`]).
    pub fn start(config: &Config) -> Result<Arc<Serving>, Error> {
        crate::guest_faults::install()?;
        let pool = PollerPool::start(config.poll_threads, config.poll_idle, &config.poll_cpus)?;
        Ok(Arc::new(Serving {
            pool: Arc::new(pool),
            peers: Arc::default(),
            registry: Arc::default(),
            connections: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    /// Readies the socket `listen` gives to serve the guest `name` with `config`; its first
    /// device context is open before `listen` is called, so a front end (or a test counting
    /// the host's objects) that finds a new socket finds the backend ready.
    pub fn prepare(
        &self,
        config: Config,
        name: &str,
        listen: impl FnOnce() -> Result<Listener, Error>,
    ) -> Result<PreparedSocket, Error> {
        let first = RdmaBackend::new(&config, &self.pool, &self.peers)?;
        Ok(PreparedSocket {
            config,
            name: name.to_string(),
            listener: listen()?,
            first,
            rate_debt: Arc::default(),
            handovers: Arc::default(),
        })
    }

    /// Serves the front ends `socket` accepts until an error, or until `stop` is written:
    /// then its connection is ended, and this returns once everything it held is freed.
    pub fn serve(&self, socket: PreparedSocket, stop: Option<&EventFd>) -> Result<(), Error> {
        let PreparedSocket {
            config,
            name,
            mut listener,
            first,
            rate_debt,
            handovers,
        } = socket;
        let mut backend = Arc::new(RwLock::new(first));
        let admission = Arc::new(Admission::new(&config)?);
        loop {
            let room = admission.wait_for_room(&listener, stop)?;
            if room == Room::Stop || !wait_for_front_end(&listener, stop)? {
                self.registry.disconnect(&name);
                admission.wait_until_empty()?;
                return Ok(());
            }
            {
                let mut next = backend.write().unwrap_or_else(|e| e.into_inner());
                next.handover = Some((Arc::clone(&handovers), Arc::downgrade(&backend)));
                if room == Room::Successor {
                    next.admitted.0.store(false, Ordering::Release);
                    next.admitted.1.clone_from(&admission.reason);
                    admission.await_successor(Arc::clone(&next.admitted.0));
                }
            }
            let connection = self.connections.fetch_add(1, Ordering::Relaxed) + 1;
            // One connection failing to start (no threads, descriptors or memory left) must
            // not stop the guests already served, nor the ones that come later.
            let started = start_connection(
                (connection, &name),
                Arc::clone(&backend),
                (&mut listener, config.handshake_timeout),
                (
                    Arc::clone(&admission),
                    Arc::clone(&self.registry),
                    Arc::clone(&rate_debt),
                ),
            );
            if let Err(e) = started {
                if room == Room::Successor {
                    admission.forget_successor();
                }
                log::error!("connection {connection}: cannot be served: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            // The backend was handed to the connection, or half used by a failed start:
            // either way the next connection gets a fresh one.
            backend = loop {
                match RdmaBackend::new(&config, &self.pool, &self.peers) {
                    Ok(next) => break Arc::new(RwLock::new(next)),
                    Err(e) => {
                        log::error!(
                            "cannot prepare a device for the next guest: {e}; retrying in 1 s"
                        );
                        std::thread::sleep(std::time::Duration::from_secs(1));
                    }
                }
            };
        }
    }
}

/// Waits until a front end connects to `listener` (true) or `stop` is written (false).
pub(super) fn wait_for_front_end(
    listener: &Listener,
    stop: Option<&EventFd>,
) -> Result<bool, Error> {
    let Some(stop) = stop else { return Ok(true) };
    let ready = wait_readable(&[listener.as_raw_fd(), stop.as_raw_fd()], -1)?;
    Ok(!ready[1])
}

/// How long a front end that connects while the backend is full waits for a connection to
/// end before it is refused.
pub(super) const REFUSAL_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Which of `fds` are readable, waiting up to `timeout_ms` (-1: until one is).
pub(super) fn wait_readable(
    fds: &[std::os::fd::RawFd],
    timeout_ms: i32,
) -> Result<Vec<bool>, Error> {
    let mut polled: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: polls descriptors the caller borrows, through a local array of their count.
        let ready = unsafe {
            libc::poll(
                polled.as_mut_ptr(),
                polled.len() as libc::nfds_t,
                timeout_ms,
            )
        };
        if ready >= 0 {
            return Ok(polled.iter().map(|p| p.revents != 0).collect());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(Error::Io(e));
        }
    }
}

/// What [`Admission::wait_for_room`] found.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Room {
    /// A connection may be served.
    Free,
    /// A connection may be accepted as a successor (SPEC.md §11.1): it may take over the
    /// device of one that is served, and is refused if it starts one of its own while they
    /// all remain.
    Successor,
    /// Serving stops.
    Stop,
}

/// How many guest connections the backend serves at once, and the refusal of the ones past
/// that. Every connection of a backend sends from one GID, and a peer that shares a GID can
/// inject packets into another's RC connections (it sends from the address they accept); so
/// unless the operator declares the guests one trust domain (`--shared-gid`), a backend
/// serves one guest at a time. Either way at most `--max-guests` at once (by default
/// `--guests`: the quotas are the backend's totals divided among that many, so the totals
/// hold only if no more connect).
struct Admission {
    limit: usize,
    /// Why no more are served, for the refusal's log line.
    reason: String,
    live: AtomicUsize,
    /// Written when a connection ends: a room may be free.
    freed: EventFd,
    /// The admission of the successor accepted past the limit, if one is: it turns true
    /// once a connection ends (the successor then is one of the limit).
    successor: Mutex<Option<Arc<AtomicBool>>>,
}

impl Admission {
    fn new(config: &Config) -> Result<Admission, Error> {
        let (limit, reason) = if config.shared_gid {
            (
                config.max_guests as usize,
                format!("{} guests are connected (--max-guests)", config.max_guests),
            )
        } else {
            (
                1,
                "a guest is connected and guests do not share the backend's GID unless it runs with --shared-gid".to_string(),
            )
        };
        Ok(Admission {
            limit,
            reason,
            live: AtomicUsize::new(0),
            freed: EventFd::new(EFD_NONBLOCK)?,
            successor: Mutex::default(),
        })
    }

    /// Returns once a connection may be accepted. A front end that connects while the
    /// backend is full is accepted as the successor if there is none; else it waits
    /// [`REFUSAL_GRACE`] for a connection to end (one that just disconnected may still be
    /// releasing its objects: a program often opens the device again right after a short
    /// first connection), and is refused (accepted and closed at once, with a log line) if
    /// none does.
    /// [`Room::Stop`], at once, when `stop` is written.
    fn wait_for_room(&self, listener: &Listener, stop: Option<&EventFd>) -> Result<Room, Error> {
        let mut watched = vec![listener.as_raw_fd(), self.freed.as_raw_fd()];
        watched.extend(stop.map(|stop| stop.as_raw_fd()));
        while self.live.load(Ordering::Acquire) >= self.limit {
            let ready = wait_readable(&watched, -1)?;
            if ready.get(2) == Some(&true) {
                return Ok(Room::Stop);
            }
            if !ready[0] {
                let _ = self.freed.read();
                continue;
            }
            // A successor is accepted at once: a hypervisor replacing itself waits for it
            // with the VM stopped. It waits for room only if it starts a device of its own
            // (RdmaBackend::wait_for_admission).
            if self.lock_successor().is_none() {
                return Ok(Room::Successor);
            }
            let grace = i32::try_from(REFUSAL_GRACE.as_millis()).unwrap_or(i32::MAX);
            if wait_readable(&[self.freed.as_raw_fd()], grace)?[0] {
                let _ = self.freed.read();
                continue;
            }
            if let Ok(Some(refused)) = listener.accept() {
                drop(refused);
                log::warn!("a front end connected and was refused: {}", self.reason);
            }
        }
        Ok(Room::Free)
    }

    fn lock_successor(&self) -> std::sync::MutexGuard<'_, Option<Arc<AtomicBool>>> {
        self.successor.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes the successor about to be accepted, by its admission flag (true at once if a
    /// connection ended since [`Admission::wait_for_room`] looked).
    fn await_successor(&self, admitted: Arc<AtomicBool>) {
        let mut successor = self.lock_successor();
        if self.live.load(Ordering::Acquire) < self.limit {
            admitted.store(true, Ordering::Release);
        } else {
            *successor = Some(admitted);
        }
    }

    /// The successor noted never connected: the next front end past the limit may be one.
    fn forget_successor(&self) {
        self.lock_successor().take();
    }

    fn connected(&self) {
        self.live.fetch_add(1, Ordering::AcqRel);
    }

    /// Returns once every connection has ended and released what it held.
    fn wait_until_empty(&self) -> Result<(), Error> {
        while self.live.load(Ordering::Acquire) > 0 {
            wait_readable(&[self.freed.as_raw_fd()], 1000)?;
            let _ = self.freed.read();
        }
        Ok(())
    }

    fn disconnected(&self) {
        let live = self.live.fetch_sub(1, Ordering::AcqRel) - 1;
        if live <= self.limit {
            // The successor (if it has not ended itself) is one of the limit now.
            if let Some(successor) = self.lock_successor().take() {
                successor.store(true, Ordering::Release);
            }
        }
        let _ = self.freed.write(1);
    }
}

/// Closes the connection (`handle`) unless its front end has spoken after `timeout`: a
/// connection that says nothing would hold the guest's room (a backend that serves one
/// guest at a time keeps the guest's own front end out meanwhile).
pub(super) fn close_if_silent(
    connection: u64,
    backend: &RwLock<RdmaBackend>,
    timeout: std::time::Duration,
    handle: vhost_user_backend::ShutdownHandle,
) {
    let greeted = Arc::clone(&backend.read().unwrap_or_else(|e| e.into_inner()).greeted);
    let watch = move || {
        if !greeted.wait(timeout) {
            log::warn!(
                "connection {connection}: the front end said nothing for {timeout:?} (no GET_FEATURES): closed"
            );
            handle.shutdown();
        }
    };
    if let Err(e) = std::thread::Builder::new()
        .name(format!("vrdma-hello{connection}"))
        .spawn(watch)
    {
        log::warn!("connection {connection}: no handshake timeout ({e})");
    }
}

/// Accepts one front end and serves it with `backend` until it disconnects, in threads of its
/// own; returns once the connection is running.
fn start_connection(
    (connection, name): (u64, &str),
    backend: Arc<RwLock<RdmaBackend>>,
    (listener, handshake_timeout): (&mut Listener, std::time::Duration),
    (admission, registry, rate_debt): (Arc<Admission>, Arc<Registry>, Arc<RateDebt>),
) -> Result<(), Error> {
    // The guest's sends start with what its last connection owed their rate limits; a
    // successor's, once it is admitted (its predecessor leaves the debt as it ends).
    {
        let mut next = backend.write().unwrap_or_else(|e| e.into_inner());
        if next.admitted.0.load(Ordering::Acquire) {
            next.device.data_path().take_rate_debt(&rate_debt);
        } else {
            next.owed = Some(Arc::clone(&rate_debt));
        }
    }
    // The thread that tears the connection down exists before the connection is accepted, so
    // an accepted connection always has one.
    let (daemon_tx, daemon_rx) = std::sync::mpsc::channel::<VhostUserDaemon<_>>();
    let serving = Arc::clone(&backend);
    let room = Arc::clone(&admission);
    let reported = Arc::clone(&registry);
    std::thread::Builder::new()
        .name(format!("vrdma-conn{connection}-wait"))
        .spawn(move || {
            let Ok(mut daemon) = daemon_rx.recv() else {
                return; // the connection never started
            };
            match daemon.wait() {
                Ok(())
                | Err(vhost_user_backend::Error::HandleRequest(
                    vhost::vhost_user::Error::Disconnected
                    | vhost::vhost_user::Error::PartialMessage,
                )) => {}
                Err(e) => log::warn!("connection {connection} ended with an error: {e}"),
            }
            // Before the last reference goes: no report holds the device after this.
            reported.remove(connection);
            let state = serving.read().unwrap_or_else(|e| e.into_inner());
            if state.handed_over {
                // Its device is a successor's (SPEC.md §11.1), which takes it at its next
                // request if it has not yet: nothing of it is this connection's to count.
                state.stop_workers();
                drop(state);
                drop(daemon);
                drop(serving);
                log::info!("connection {connection}: closed, its device handed to a successor");
                room.disconnected();
                return;
            }
            let objects = state.device.object_count();
            let stats = state.device.data_path().stats();
            let refusals = state.device.refusals().summary();
            state.device.data_path().leave_rate_debt(&rate_debt);
            state.stop_workers();
            drop(state);
            drop(daemon);
            drop(serving); // the last reference: the device and its host objects go
            log::info!(
                "connection {connection}: closed, {objects} objects released; {} WQEs, {} completions, {} kicks, {} storms of kicks without work, {} WQEs refused",
                stats.wqes,
                stats.completions,
                stats.kicks,
                stats.storms,
                stats.refused
            );
            if let Some(refusals) = refusals {
                log::info!("connection {connection}: failed control requests: {refusals}");
            }
            room.disconnected();
        })
        .map_err(Error::Io)?;
    let accepted = backend
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .mem
        .clone();
    let mut daemon = crate::vring::over_accepted_memory(&accepted, || {
        VhostUserDaemon::new(
            format!("vrdma-conn{connection}"),
            Arc::clone(&backend),
            GuestMemoryAtomic::new(GuestMemoryMmap::new()),
        )
    })
    .map_err(Error::Daemon)?;
    daemon.start(listener).map_err(Error::Daemon)?;
    // Counted before the next accept looks at the count.
    admission.connected();
    if let Some(handle) = daemon.shutdown_handle() {
        backend.write().unwrap_or_else(|e| e.into_inner()).end =
            Some((format!("connection {connection} (guest {name})"), handle));
    }
    let disconnect = daemon.shutdown_handle();
    if let Some(handle) = daemon.shutdown_handle() {
        close_if_silent(connection, &backend, handshake_timeout, handle);
    }
    if let Some(handle) = daemon.shutdown_handle() {
        // A fault in the guest's memory ends this connection (and only this one).
        backend
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .device
            .fault_domain()
            .serve(
                format!("connection {connection} (guest {name})"),
                Box::new(move || handle.shutdown()),
            );
    }
    registry.add(
        connection,
        name,
        backend,
        Box::new(move || {
            if let Some(handle) = &disconnect {
                handle.shutdown();
            }
        }),
    );
    log::info!("connection {connection}: front end attached (guest {name})");
    daemon_tx
        .send(daemon)
        .expect("the wait thread holds the receiver until it gets the daemon");
    Ok(())
}
