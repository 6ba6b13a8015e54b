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
use super::shared::Shared;
use super::SLEEP_LIMIT_MS;
use crate::hostverbs;
use crate::per_second::PerSecond;

/// An idle pool thread spins for a while after its last work, so that a busy driver's next
/// doorbell is seen without a kick, but only while it has its CPU to itself: when a yield
/// lets another thread run for longer than this, spinning takes the CPU from someone (most
/// likely the very threads that ring the doorbells, on a machine with fewer CPUs than
/// spinners), and the thread sleeps until kicked instead.
const CONTENDED_YIELD: Duration = Duration::from_micros(200);

/// A yield shorter than this found nobody else wanting the CPU.
const UNCONTENDED_YIELD: Duration = Duration::from_micros(2);

/// While its yields find nobody else wanting the CPU, a spinning pool thread yields (and
/// reads the clock) once every this many empty passes only: a yield is a system call, and a
/// doorbell rung during one waits for it.
const EMPTY_PASSES_PER_YIELD_ALONE: u32 = 32;

/// Ready descriptors taken per wake-up; more wait for the next `epoll_wait`.
const EVENTS_PER_WAIT: usize = 64;

/// The epoll key of a pool thread's own command eventfd; connections use `id << 1 | kind`.
const COMMAND_KEY: u64 = u64::MAX;

/// Whether an idle pool thread spins on, and when it yields meanwhile.
#[derive(Default)]
struct Spin {
    /// When the passes began to find nothing; `None` while they find work.
    idle_since: Option<Instant>,
    /// Empty passes since the last yield.
    empty_passes: u32,
    /// The last yield found the CPU wanted by someone: yield after every empty pass, so that
    /// a thread sharing the CPU (a driver, on a machine with fewer CPUs than spinners) runs.
    shared_cpu: bool,
    /// Slept since the last work: a wake-up that brings none goes straight back to sleep.
    slept: bool,
}

impl Spin {
    fn worked(&mut self) {
        self.idle_since = None;
        self.slept = false;
    }

    fn slept(&mut self) {
        self.slept = true;
    }

    /// After an empty pass: true to pass again, false to sleep.
    fn again(&mut self, idle_spin: Duration) -> bool {
        if self.slept {
            return false;
        }
        let idle_since = *self.idle_since.get_or_insert_with(Instant::now);
        self.empty_passes += 1;
        if !self.shared_cpu && self.empty_passes < EMPTY_PASSES_PER_YIELD_ALONE {
            std::hint::spin_loop();
            return true;
        }
        self.empty_passes = 0;
        if idle_since.elapsed() >= idle_spin {
            return false;
        }
        let start = Instant::now();
        std::thread::yield_now();
        let took = start.elapsed();
        self.shared_cpu = took >= UNCONTENDED_YIELD;
        took < CONTENDED_YIELD
    }
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
    /// Its wake-up eventfd (kicks, mostly) woke the thread since the last pass.
    kicked: bool,
    kicks: WastedWakeups,
    /// Served by the pass under way (see [`WastedWakeups::due`]).
    due: bool,
    /// The pass under way moved something of it.
    worked: bool,
    /// Something of it moved since its last wake-up: a wake-up that finds nothing after
    /// one that brought work is a late kick (the vring worker passed it on after the
    /// poller had taken the work it announced and gone back to sleep), not a wasted one.
    worked_since_wakeup: bool,
}

/// Wake-ups a connection's driver caused that found nothing to do: a driver that kicks in a
/// loop (with every doorbell bit set, say) would otherwise have the poller wake, pass over
/// every connection and sleep again as fast as it can. Past [`WASTED_WAKEUPS_PER_SECOND`]
/// in a second, the connection is storming for a while (one second, doubled each time it
/// storms again soon after, up to [`MAX_STORM_BACKOFF`]): it is not asked for kicks
/// (NEED_WAKEUP stays clear, so its kicks wake no poller and its vring worker delays them)
/// and its rings are looked at every [`STORMING_POLL_MS`] only. An honest driver kicks only
/// when asked, and its kicks bring work.
#[derive(Default)]
struct WastedWakeups {
    wasted: PerSecond,
    storming_until: Option<Instant>,
    backoff: Duration,
    next_pass: Option<Instant>,
}

const WASTED_WAKEUPS_PER_SECOND: u32 = 20;
const MIN_STORM_BACKOFF: Duration = Duration::from_secs(1);
const MAX_STORM_BACKOFF: Duration = Duration::from_secs(64);
const STORMING_POLL_MS: i32 = 50;

impl WastedWakeups {
    /// Counts a wake-up that found nothing; true if the connection storms from now on.
    fn wasted(&mut self, now: Instant) -> bool {
        if self.wasted.note(now) <= WASTED_WAKEUPS_PER_SECOND || self.storming(now) {
            return false;
        }
        // Storming again within the last backoff: twice as long this time.
        let again = self
            .storming_until
            .is_some_and(|until| now.duration_since(until) < self.backoff);
        self.backoff = if again {
            (self.backoff * 2).min(MAX_STORM_BACKOFF)
        } else {
            MIN_STORM_BACKOFF
        };
        self.storming_until = Some(now + self.backoff);
        log::info!(
            "poller: a driver's kicks bring no work; it is not asked for kicks for {:?}",
            self.backoff
        );
        true
    }

    fn storming(&self, now: Instant) -> bool {
        self.storming_until.is_some_and(|until| now < until)
    }

    /// Whether the connection is passed over now: always, unless it is storming and was
    /// passed over less than [`STORMING_POLL_MS`] ago.
    fn due(&mut self, clock: &mut PassClock) -> bool {
        if self.storming_until.is_none() {
            return true;
        }
        let now = clock.now();
        if !self.storming(now) {
            return true;
        }
        if self.next_pass.is_some_and(|next| now < next) {
            return false;
        }
        self.next_pass = Some(now + Duration::from_millis(STORMING_POLL_MS as u64));
        true
    }
}

/// The time of a pass, read once and only if the pass needs it: most passes do not.
#[derive(Default)]
struct PassClock(Option<Instant>);

impl PassClock {
    fn now(&mut self) -> Instant {
        *self.0.get_or_insert_with(Instant::now)
    }
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
        let mut spin = Spin::default();
        while self.take_commands() {
            if self.pass() {
                spin.worked();
                continue;
            }
            if spin.again(self.idle_spin) {
                continue;
            }
            // Going to sleep: ask for kicks (but not a storming driver's) and completion
            // events, then look once more so that nothing that arrived meanwhile is missed
            // (SPEC.md §8.5).
            let now = Instant::now();
            for served in &self.connections {
                served.poller.set_need_wakeup(!served.kicks.storming(now));
                served.poller.arm_cqs();
            }
            fence(Ordering::SeqCst);
            if self.pass() {
                spin.worked();
                // Awake after all: a driver that saw NEED_WAKEUP may have kicked meanwhile,
                // for work this pass took. Its wake-up is stale, not wasted.
                for served in &self.connections {
                    let _ = served.poller.queues().wake.read();
                }
            } else {
                for served in &mut self.connections {
                    served.poller.let_go_of_memory();
                }
                self.sleep();
                spin.slept();
            }
            for served in &self.connections {
                served.poller.set_need_wakeup(false);
            }
            // Spin again only once a pass finds work: a wake-up that brought none (a kick
            // with nothing rung, a quiet timeout) goes straight back to sleep.
        }
    }

    /// One pass over the queues of every connection served; true if anything moved. Each step of a pass is
    /// taken for every connection before the next: the doorbells of all (twice, if any was
    /// rung, bounding the sends between the looks), then their receive WQEs, then their send
    /// WQEs and CQs, so that a receive made available before a send, in any connection of
    /// this thread, reaches the host before it (SPEC.md §8.5). A connection whose kick woke the poller and whose pass found nothing
    /// wasted that wake-up; a storming one is passed over but every [`STORMING_POLL_MS`],
    /// however often the others keep the thread busy.
    fn pass(&mut self) -> bool {
        let mut clock = PassClock::default();
        let mut rung = false;
        for served in &mut self.connections {
            served.due = served.kicks.due(&mut clock);
            if served.due {
                rung |= served.poller.take_doorbells();
            }
        }
        fn due(connections: &mut [Served]) -> impl Iterator<Item = &mut Served> {
            connections.iter_mut().filter(|s| s.due)
        }
        if rung {
            for served in due(&mut self.connections) {
                served.poller.bound_sends();
            }
            for served in due(&mut self.connections) {
                served.poller.take_doorbells();
            }
        }
        for served in due(&mut self.connections) {
            served.worked = served.poller.take_receive_work();
        }
        let mut work = false;
        for served in due(&mut self.connections) {
            served.worked |= served.poller.take_send_work();
            if std::mem::take(&mut served.kicked) {
                let earned = served.worked || served.worked_since_wakeup;
                if !earned && served.kicks.wasted(clock.now()) {
                    served
                        .poller
                        .shared()
                        .storms
                        .fetch_add(1, Ordering::Relaxed);
                }
                served.worked_since_wakeup = false;
            }
            served.worked_since_wakeup |= served.worked;
            work |= served.worked;
        }
        work
    }

    /// Waits for a kick, a host completion event or a command. Where a queue waits on the
    /// driver for something no kick announces, it looks again after a while anyway; an idle
    /// poller costs nothing until woken.
    fn sleep(&mut self) {
        let mut events = [EpollEvent::default(); EVENTS_PER_WAIT];
        let now = Instant::now();
        let mut timeout = if self.connections.iter().any(|s| s.kicks.storming(now)) {
            STORMING_POLL_MS
        } else if self.connections.iter().any(|s| s.poller.waits_on_driver()) {
            SLEEP_LIMIT_MS
        } else {
            -1
        };
        // A guest held back by its rate limits is looked at again when they let it go on.
        let throttled = self
            .connections
            .iter()
            .filter_map(|s| s.poller.throttled_for());
        if let Some(wait) = throttled.min() {
            #[expect(
                clippy::cast_possible_truncation,
                reason = "clamped to 1..=SLEEP_LIMIT_MS, an i32"
            )]
            let wait_ms = wait
                .as_micros()
                .div_ceil(1000)
                .clamp(1, SLEEP_LIMIT_MS as u128) as i32;
            timeout = if timeout < 0 {
                wait_ms
            } else {
                timeout.min(wait_ms)
            };
        }
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
            let Some(served) = self.connections.iter_mut().find(|s| s.id == key >> 1) else {
                continue; // detached since
            };
            let queues = served.poller.queues();
            match (key & 1, &queues.channel) {
                (0, _) => {
                    let _ = queues.wake.read();
                    served.kicked = true;
                }
                (_, Some(channel)) => {
                    channel.drain();
                }
                (_, None) => {}
            }
        }
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
        let queues = &shared.queues;
        let channel = queues.channel.as_ref().map(|c| (c.fd(), 1));
        for (fd, kind) in [(queues.wake.as_raw_fd(), 0)].into_iter().chain(channel) {
            let event = EpollEvent::new(EventSet::IN, id << 1 | kind);
            if let Err(e) = self.epoll.ctl(ControlOperation::Add, fd, event) {
                // Served still, by passes; it only sleeps up to SLEEP_LIMIT_MS through events.
                log::error!("poller: cannot wait on a connection's events: {e}");
            }
        }
        self.connections.push(Served {
            id,
            poller: Poller::new(shared),
            kicked: false,
            kicks: WastedWakeups::default(),
            due: false,
            worked: false,
            worked_since_wakeup: false,
        });
        log::debug!("poller: serving {} connections", self.connections.len());
    }

    fn detach(&mut self, shared: &Arc<Shared>) {
        let epoll = &self.epoll;
        self.connections.retain(|served| {
            let keep = !Arc::ptr_eq(served.poller.shared(), shared);
            if !keep {
                let queues = served.poller.queues();
                let channel = queues.channel.as_ref().map(|c| c.fd());
                for fd in [queues.wake.as_raw_fd()].into_iter().chain(channel) {
                    let _ = epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default());
                }
            }
            keep
        });
        log::debug!("poller: serving {} connections", self.connections.len());
    }
}
