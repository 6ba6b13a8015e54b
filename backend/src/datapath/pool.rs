//! The backend's poller threads, shared by every guest connection (SPEC.md §8.5). Each
//! connection is served by one of them, connections taken in turn; a pool thread passes over
//! all the connections it serves, spins while any of them has work, and sleeps on all their
//! kicks and host completion events at once when none has.

use std::os::fd::AsRawFd;
use std::sync::atomic::{fence, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::poller::Poller;
use super::{Shared, SLEEP_LIMIT_MS};
use crate::hostverbs;

/// An idle pool thread spins for a while after its last work, so that a busy driver's next
/// doorbell is seen without a kick, but only while it has its CPU to itself: when a yield
/// lets another thread run for longer than this, spinning takes the CPU from someone (most
/// likely the very threads that ring the doorbells, on a machine with fewer CPUs than
/// spinners), and the thread sleeps until kicked instead.
const CONTENDED_YIELD: Duration = Duration::from_micros(200);

/// Ready descriptors taken per wake-up; more wait for the next `epoll_wait`.
const EVENTS_PER_WAIT: usize = 64;

/// The epoll key of a pool thread's own command eventfd; connections use `id << 1 | kind`.
const COMMAND_KEY: u64 = u64::MAX;

/// Yields the CPU; true if nobody else wanted it for long.
fn yield_uncontended() -> bool {
    let start = Instant::now();
    std::thread::yield_now();
    start.elapsed() < CONTENDED_YIELD
}

/// Pins the calling thread to `cpu` (checked usable at start-up; a thread that cannot be
/// pinned still runs, where the scheduler puts it).
fn pin_to(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    let pinned = set
        .set(cpu)
        .and_then(|()| nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set));
    if let Err(e) = pinned {
        log::warn!("poller not pinned to CPU {cpu}: {e}");
    }
}

enum Command {
    /// Serve a connection.
    Attach(Arc<Shared>),
    /// Stop serving the connection; the sender hears when no pass uses it.
    Detach(Arc<Shared>, Sender<()>),
    Stop,
}

struct PoolThread {
    commands: Sender<Command>,
    wake: Arc<EventFd>,
    handle: Option<JoinHandle<()>>,
}

impl PoolThread {
    fn send(&self, command: Command) {
        // A thread that is gone has nothing left to serve or to stop.
        if self.commands.send(command).is_ok() {
            let _ = self.wake.write(1);
        }
    }
}

/// The poller threads of a backend.
pub struct PollerPool {
    threads: Vec<PoolThread>,
    /// The thread the next connection goes to.
    next: AtomicUsize,
}

impl PollerPool {
    /// Starts `threads` pollers (at least one), thread `i` pinned to `cpus[i % cpus.len()]`
    /// when CPUs are given; each spins for `idle_spin` after its last work before it sleeps.
    pub fn start(
        threads: usize,
        idle_spin: Duration,
        cpus: &[usize],
    ) -> hostverbs::Result<PollerPool> {
        let os_error = |call| move |source| hostverbs::Error::Verbs { call, source };
        let mut pool = PollerPool {
            threads: Vec::new(),
            next: AtomicUsize::new(0),
        };
        // Threads start one by one; if one cannot, dropping `pool` stops the others.
        for index in 0..threads.max(1) {
            let (commands, inbox) = mpsc::channel();
            let wake = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(os_error("eventfd"))?);
            let epoll = Epoll::new().map_err(os_error("epoll_create"))?;
            let command_event = EpollEvent::new(EventSet::IN, COMMAND_KEY);
            epoll
                .ctl(ControlOperation::Add, wake.as_raw_fd(), command_event)
                .map_err(os_error("epoll_ctl"))?;
            let cpu = (!cpus.is_empty()).then(|| cpus[index % cpus.len()]);
            let worker = PoolWorker {
                inbox,
                wake: Arc::clone(&wake),
                epoll,
                idle_spin,
                connections: Vec::new(),
                next_id: 0,
            };
            let handle = std::thread::Builder::new()
                .name(format!("vrdma-poll{index}"))
                .spawn(move || {
                    if let Some(cpu) = cpu {
                        pin_to(cpu);
                    }
                    worker.run()
                })
                .map_err(os_error("spawn a poller thread"))?;
            pool.threads.push(PoolThread {
                commands,
                wake,
                handle: Some(handle),
            });
        }
        Ok(pool)
    }

    /// Poller threads in the pool.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Serves a new connection, on the thread after the last connection's; that thread's
    /// index, for [`PollerPool::detach`].
    pub(super) fn attach(&self, shared: &Arc<Shared>) -> usize {
        let thread = self.next.fetch_add(1, Ordering::Relaxed) % self.threads.len();
        self.threads[thread].send(Command::Attach(Arc::clone(shared)));
        thread
    }

    /// Stops serving a connection that `attach` gave to `thread`; returns once no pass uses
    /// it.
    pub(super) fn detach(&self, thread: usize, shared: &Arc<Shared>) {
        let (done, acknowledged) = mpsc::channel();
        self.threads[thread].send(Command::Detach(Arc::clone(shared), done));
        // An error is a thread that is gone, and with it its references.
        let _ = acknowledged.recv();
    }
}

impl Drop for PollerPool {
    fn drop(&mut self) {
        for thread in &self.threads {
            thread.send(Command::Stop);
        }
        for thread in &mut self.threads {
            if let Some(handle) = thread.handle.take() {
                let _ = handle.join();
            }
        }
    }
}

/// A connection a pool thread serves, with the key its descriptors have in the thread's epoll.
struct Served {
    id: u64,
    poller: Poller,
}

/// One pool thread.
struct PoolWorker {
    inbox: Receiver<Command>,
    wake: Arc<EventFd>,
    epoll: Epoll,
    idle_spin: Duration,
    connections: Vec<Served>,
    next_id: u64,
}

impl PoolWorker {
    fn run(mut self) {
        let mut last_work = Instant::now();
        while self.take_commands() {
            if self.pass() {
                last_work = Instant::now();
                continue;
            }
            if last_work.elapsed() < self.idle_spin && yield_uncontended() {
                continue;
            }
            // Going to sleep: ask for kicks and completion events, then look once more so
            // that nothing that arrived meanwhile is missed (SPEC.md §8.5).
            for served in &self.connections {
                served.poller.set_need_wakeup(true);
                served.poller.arm_cqs();
            }
            fence(Ordering::SeqCst);
            let woken = self.pass() || self.sleep();
            for served in &self.connections {
                served.poller.set_need_wakeup(false);
            }
            // Spin again only for real work; after a quiet timeout, go straight back to sleep.
            if woken {
                last_work = Instant::now();
            }
        }
    }

    /// One pass over every shard served; true if anything moved.
    fn pass(&mut self) -> bool {
        let mut work = false;
        for served in &mut self.connections {
            work |= served.poller.pass();
        }
        work
    }

    /// Waits for a kick, a host completion event or a command; true if one came. With
    /// connections to serve, it looks again after a while anyway.
    fn sleep(&mut self) -> bool {
        let mut events = [EpollEvent::default(); EVENTS_PER_WAIT];
        let timeout = if self.connections.is_empty() {
            -1
        } else {
            SLEEP_LIMIT_MS
        };
        let ready = match self.epoll.wait(timeout, &mut events) {
            Ok(ready) => ready,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
            Err(e) => {
                log::error!("poller: epoll_wait: {e}");
                std::thread::sleep(Duration::from_millis(SLEEP_LIMIT_MS as u64));
                0
            }
        };
        for event in &events[..ready] {
            let key = event.data();
            if key == COMMAND_KEY {
                let _ = self.wake.read();
                continue;
            }
            let Some(served) = self.connections.iter().find(|s| s.id == key >> 1) else {
                continue; // detached since
            };
            let shard = served.poller.shard();
            match (key & 1, &shard.channel) {
                (0, _) => {
                    let _ = shard.wake.read();
                }
                (_, Some(channel)) => {
                    channel.drain();
                }
                (_, None) => {}
            }
        }
        ready > 0
    }

    /// Applies the commands that arrived; false once told to stop.
    fn take_commands(&mut self) -> bool {
        while let Ok(command) = self.inbox.try_recv() {
            match command {
                Command::Attach(shared) => self.attach(shared),
                Command::Detach(shared, done) => {
                    self.detach(&shared);
                    let _ = done.send(());
                }
                Command::Stop => return false,
            }
        }
        true
    }

    fn attach(&mut self, shared: Arc<Shared>) {
        let id = self.next_id;
        self.next_id += 1;
        let shard = &shared.shard;
        let channel = shard.channel.as_ref().map(|c| (c.fd(), 1));
        for (fd, kind) in [(shard.wake.as_raw_fd(), 0)].into_iter().chain(channel) {
            let event = EpollEvent::new(EventSet::IN, id << 1 | kind);
            if let Err(e) = self.epoll.ctl(ControlOperation::Add, fd, event) {
                // Served still, by passes; it only sleeps up to SLEEP_LIMIT_MS through events.
                log::error!("poller: cannot wait on a connection's events: {e}");
            }
        }
        self.connections.push(Served {
            id,
            poller: Poller::new(shared),
        });
        log::debug!("poller: serving {} connections", self.connections.len());
    }

    fn detach(&mut self, shared: &Arc<Shared>) {
        let epoll = &self.epoll;
        self.connections.retain(|served| {
            let keep = !Arc::ptr_eq(served.poller.shared(), shared);
            if !keep {
                let shard = served.poller.shard();
                let channel = shard.channel.as_ref().map(|c| c.fd());
                for fd in [shard.wake.as_raw_fd()].into_iter().chain(channel) {
                    let _ = epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default());
                }
            }
            keep
        });
        log::debug!("poller: serving {} connections", self.connections.len());
    }
}
