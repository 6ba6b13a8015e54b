//! Events. The device reports "CQ n has a completion" and asynchronous events (a QP or CQ
//! failed, the port changed state, the device is gone) on its event queue; a thread per
//! context reads that queue and hands each completion event to the channel of its CQ and
//! every other event to the context's asynchronous event queue. Both are a queue and a
//! semaphore eventfd, which is the channel's `fd` or the context's `async_fd`, so programs
//! may poll it before `ibv_get_cq_event` or `ibv_get_async_event`.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddrV4;
use std::os::fd::AsRawFd;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdma_sys::ibv_event_type;
use vmm_sys_util::eventfd::{EventFd, EFD_SEMAPHORE};
use vrdma_guest::{CmId, Device, DeviceEvent, Error};

/// How often the dispatcher looks up from the event queue to see whether to stop.
const WAKE_INTERVAL: Duration = Duration::from_millis(100);

/// Items handed from the dispatcher to a program, one eventfd count each.
pub(crate) struct EventQueue<T> {
    /// One count per item, read one at a time (EFD_SEMAPHORE).
    pub(crate) fd: EventFd,
    /// Items not yet taken, oldest first.
    ready: Mutex<VecDeque<T>>,
    /// The device is gone: no item comes any more, and a take finds none (EIO) rather than
    /// waiting forever, as a kernel event file of a removed device answers.
    closed: AtomicBool,
}

/// Counts a closed queue's eventfd gets, so that it stays readable for every waiter that
/// ever comes (each takes one).
const CLOSED_COUNT: u64 = 1 << 62;

impl<T: Copy> EventQueue<T> {
    pub(crate) fn new() -> std::io::Result<Arc<Self>> {
        Ok(Arc::new(EventQueue {
            fd: EventFd::new(EFD_SEMAPHORE | libc::EFD_CLOEXEC)?,
            ready: Mutex::default(),
            closed: AtomicBool::new(false),
        }))
    }

    /// No item comes any more (the device is gone): every waiter wakes, takes what is left,
    /// then gets EIO; the fd stays readable, so a program's poll on it wakes too.
    pub(crate) fn close(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            // Cannot fail: the count is far from the eventfd's limit.
            let _ = self.fd.write(CLOSED_COUNT);
        }
    }

    pub(crate) fn push(&self, item: T) {
        self.ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(item);
        // Cannot fail short of 2^64 - 1 pending items.
        let _ = self.fd.write(1);
    }

    /// The next item, blocking on the fd as the program set it (EAGAIN when non-blocking
    /// and there is none).
    pub(crate) fn take(&self) -> Result<T, c_int> {
        loop {
            self.fd
                .read()
                .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
            // The count of a forgotten item has no entry: wait for the next one.
            let next = self
                .ready
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front();
            if let Some(item) = next {
                return Ok(item);
            }
            if self.closed.load(Ordering::Acquire) {
                return Err(libc::EIO);
            }
        }
    }

    /// Drops the items `stale` picks (their object is being destroyed).
    pub(crate) fn forget(&self, stale: impl Fn(&T) -> bool) {
        self.ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|item| !stale(item));
    }
}

impl<T> AsRawFd for EventQueue<T> {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

/// A completion channel: the CQs (their `ibv_cq` addresses) with an event not yet taken.
pub(crate) type Channel = EventQueue<usize>;

/// A CM event channel: the CM ids with events waiting, by handle.
pub(crate) type CmChannel = EventQueue<u32>;

/// What an asynchronous event is about, with the program's object by address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Element {
    Qp(usize),
    Cq(usize),
    Srq(usize),
    Port(u8),
    Device,
}

/// An asynchronous event as `ibv_get_async_event` hands it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AsyncEvent {
    pub(crate) kind: ibv_event_type,
    pub(crate) element: Element,
}

/// The context's asynchronous events (`async_fd`).
pub(crate) type AsyncEvents = EventQueue<AsyncEvent>;

/// The kinds of objects the device names by handle in events.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) enum ObjectKind {
    Qp,
    Cq,
    Srq,
}

/// Where the dispatcher sends events: the channel of each CQ that has one, and the program's
/// address of every QP, CQ and SRQ, by device handle.
#[derive(Default)]
struct Routes {
    channels: HashMap<u32, (usize, Arc<Channel>)>,
    objects: HashMap<(ObjectKind, u32), usize>,
    /// CM ids (their address) and the channel their events go to, by device handle.
    cm_ids: HashMap<u32, (usize, Arc<CmChannel>)>,
    /// Listeners the program destroyed that still listen on the device for a while.
    lingering: Vec<Lingering>,
}

/// A listener the program destroyed, still listening on the device until `until`: a program
/// that binds an id to its address within that time takes it over, with the connection
/// requests that came meanwhile (`rdmacm::vrdma_rdmacm_rdma_destroy_id` says why). Its events
/// go nowhere until then; the device keeps them.
pub(crate) struct Lingering {
    pub(crate) id: CmId,
    /// Its port space (RDMA_PS_TCP or RDMA_PS_UDP) and address.
    pub(crate) space: u32,
    pub(crate) addr: SocketAddrV4,
    pub(crate) until: Instant,
}

/// Whether a bind of an id of `space` to `addr` takes over a listener of `listener_space`
/// bound to `listener_addr`: the same port space and port (not 0: any free one), and the same
/// address or none (0.0.0.0 and loopback addresses stand for the driver's own, SPEC.md §13.2).
fn takes_over(
    space: u32,
    addr: SocketAddrV4,
    listener_space: u32,
    listener_addr: SocketAddrV4,
) -> bool {
    space == listener_space
        && addr.port() != 0
        && addr.port() == listener_addr.port()
        && (addr.ip().is_unspecified()
            || addr.ip().is_loopback()
            || addr.ip() == listener_addr.ip())
}

/// The thread that routes one context's events.
pub(crate) struct Dispatcher {
    routes: Arc<Mutex<Routes>>,
    async_events: Arc<AsyncEvents>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// The process that started the thread: a forked child has no such thread.
    opened_by: vrdma_guest::OpenedBy,
}

impl Dispatcher {
    pub(crate) fn start(device: Device, async_events: Arc<AsyncEvents>) -> std::io::Result<Self> {
        let opened_by = device.opened_by();
        let routes = Arc::<Mutex<Routes>>::default();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name("vrdma-events".into())
            .spawn({
                let (routes, stop) = (Arc::clone(&routes), Arc::clone(&stop));
                let async_events = Arc::clone(&async_events);
                move || route_events(&device, &routes, &async_events, &stop)
            })?;
        Ok(Dispatcher {
            routes,
            async_events,
            stop,
            thread: Some(thread),
            opened_by,
        })
    }

    fn routes(&self) -> std::sync::MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Events about the device's object `handle` name the program's object at `address`.
    pub(crate) fn register(&self, kind: ObjectKind, handle: u32, address: usize) {
        self.routes().objects.insert((kind, handle), address);
    }

    /// Completion events of CQ `handle` (at `cq`) go to `channel` from now on.
    pub(crate) fn watch(&self, handle: u32, cq: usize, channel: Arc<Channel>) {
        self.routes().channels.insert(handle, (cq, channel));
    }

    /// Events of CM id `handle` (at `id`) go to `channel` from now on.
    pub(crate) fn watch_cm(&self, handle: u32, id: usize, channel: Arc<CmChannel>) {
        self.routes().cm_ids.insert(handle, (id, channel));
    }

    /// Keeps `listener` listening until its time is up or a bind takes it over.
    pub(crate) fn linger(&self, listener: Lingering) {
        self.routes().lingering.push(listener);
    }

    /// The lingering listener a bind of an id of `space` to `addr` takes over, if any.
    pub(crate) fn take_lingering(&self, space: u32, addr: SocketAddrV4) -> Option<CmId> {
        let mut routes = self.routes();
        let at = routes
            .lingering
            .iter()
            .position(|l| takes_over(space, addr, l.space, l.addr))?;
        Some(routes.lingering.swap_remove(at).id)
    }

    /// The address of CM id `handle`, while it is watched.
    pub(crate) fn cm_id(&self, handle: u32) -> Option<usize> {
        self.routes().cm_ids.get(&handle).map(|(id, _)| *id)
    }

    /// CM id `handle` is being destroyed: no more events about it, and none left to take.
    pub(crate) fn forget_cm(&self, handle: u32) {
        if let Some((_, channel)) = self.routes().cm_ids.remove(&handle) {
            channel.forget(|&ready| ready == handle);
        }
    }

    /// The address of a live object of `kind` that `matches` (called with the routes held,
    /// so no object is forgotten, and so destroyed, meanwhile).
    pub(crate) fn find(&self, kind: ObjectKind, matches: impl Fn(usize) -> bool) -> Option<usize> {
        let routes = self.routes();
        routes
            .objects
            .iter()
            .find(|((k, _), &address)| *k == kind && matches(address))
            .map(|(_, &address)| address)
    }

    /// Object `handle` is being destroyed: no more events about it, and none left to take.
    pub(crate) fn forget(&self, kind: ObjectKind, handle: u32) {
        let (address, channel) = {
            let mut routes = self.routes();
            let channel = match kind {
                ObjectKind::Cq => routes.channels.remove(&handle),
                _ => None,
            };
            (routes.objects.remove(&(kind, handle)), channel)
        };
        if let Some((cq, channel)) = channel {
            channel.forget(|&ready| ready == cq);
        }
        if let Some(address) = address {
            let element = match kind {
                ObjectKind::Qp => Element::Qp(address),
                ObjectKind::Cq => Element::Cq(address),
                ObjectKind::Srq => Element::Srq(address),
            };
            self.async_events.forget(|event| event.element == element);
        }
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            if self.opened_by.is_this_process() {
                let _ = thread.join();
            } else {
                // A forked child closing its copy of the context: the thread is its
                // parent's, and waiting for it here would wait forever.
                std::mem::forget(thread);
            }
        }
    }
}

/// The asynchronous event a device event is, if it is one and names a live object.
fn async_event_of(
    event: DeviceEvent,
    objects: &HashMap<(ObjectKind, u32), usize>,
) -> Option<AsyncEvent> {
    use ibv_event_type::*;
    let object = |kind, handle| objects.get(&(kind, handle)).copied();
    let (kind, element) = match event {
        DeviceEvent::QpFatal(h) => (IBV_EVENT_QP_FATAL, Element::Qp(object(ObjectKind::Qp, h)?)),
        DeviceEvent::CqError(h) => (IBV_EVENT_CQ_ERR, Element::Cq(object(ObjectKind::Cq, h)?)),
        DeviceEvent::SrqLimitReached(h) => (
            IBV_EVENT_SRQ_LIMIT_REACHED,
            Element::Srq(object(ObjectKind::Srq, h)?),
        ),
        DeviceEvent::SrqError(h) => (IBV_EVENT_SRQ_ERR, Element::Srq(object(ObjectKind::Srq, h)?)),
        DeviceEvent::PortActive(port) => (IBV_EVENT_PORT_ACTIVE, Element::Port(port)),
        DeviceEvent::PortError(port) => (IBV_EVENT_PORT_ERR, Element::Port(port)),
        DeviceEvent::DeviceFatal => (IBV_EVENT_DEVICE_FATAL, Element::Device),
        // Connection management is librdmacm's, not an asynchronous event of verbs.
        DeviceEvent::CqCompletion(_) | DeviceEvent::CmEvent(_) | DeviceEvent::Unknown { .. } => {
            return None
        }
    };
    Some(AsyncEvent { kind, element })
}

fn route_events(
    device: &Device,
    routes: &Mutex<Routes>,
    async_events: &AsyncEvents,
    stop: &AtomicBool,
) {
    let routes = || routes.lock().unwrap_or_else(|e| e.into_inner());
    // Whether the device said DEVICE_FATAL itself (then its loss is not said again).
    let mut fatal_said = false;
    while !stop.load(Ordering::Acquire) {
        let expired: Vec<Lingering> = {
            let mut routes = routes();
            let now = Instant::now();
            let (expired, kept) = std::mem::take(&mut routes.lingering)
                .into_iter()
                .partition(|l| l.until <= now);
            routes.lingering = kept;
            expired
        };
        // Destroyed on the device (its requests refused) outside the lock.
        drop(expired);
        match device.wait_event(WAKE_INTERVAL) {
            Ok(Some(DeviceEvent::CqCompletion(handle))) => {
                let route = routes().channels.get(&handle).cloned();
                if let Some((cq, channel)) = route {
                    channel.push(cq);
                }
            }
            Ok(Some(DeviceEvent::CmEvent(handle))) => {
                let route = routes().cm_ids.get(&handle).map(|(_, c)| Arc::clone(c));
                if let Some(channel) = route {
                    channel.push(handle);
                }
            }
            Ok(Some(event)) => match async_event_of(event, &routes().objects) {
                Some(event) => {
                    fatal_said |= event.kind == ibv_event_type::IBV_EVENT_DEVICE_FATAL;
                    async_events.push(event)
                }
                None => log::debug!("device event not forwarded: {event:?}"),
            },
            Ok(None) => {}
            // The device is gone: say so once, as a native device's removal does, and wake
            // every program waiting for a completion or CM event that cannot come now.
            Err(Error::DeviceReset | Error::Disconnected) => {
                if !fatal_said {
                    async_events.push(AsyncEvent {
                        kind: ibv_event_type::IBV_EVENT_DEVICE_FATAL,
                        element: Element::Device,
                    });
                }
                let routes = routes();
                for (_, channel) in routes.channels.values() {
                    channel.close();
                }
                for (_, channel) in routes.cm_ids.values() {
                    channel.close();
                }
                return;
            }
            Err(e) => {
                log::warn!("reading the device's events: {e}");
                std::thread::sleep(WAKE_INTERVAL);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bind_takes_over_a_lingering_listener_of_its_port_space_and_port_only() {
        use vrdma_guest::cm::port_space::{TCP as tcp, UDP as udp};
        let listener: SocketAddrV4 = "10.0.0.5:7000".parse().unwrap();
        let at = |a: &str| a.parse::<SocketAddrV4>().unwrap();
        assert!(takes_over(tcp, at("10.0.0.5:7000"), tcp, listener));
        assert!(takes_over(tcp, at("0.0.0.0:7000"), tcp, listener));
        assert!(takes_over(tcp, at("127.0.0.1:7000"), tcp, listener));
        assert!(!takes_over(udp, at("10.0.0.5:7000"), tcp, listener));
        assert!(!takes_over(tcp, at("10.0.0.5:7001"), tcp, listener));
        assert!(!takes_over(tcp, at("10.0.0.6:7000"), tcp, listener));
        let any_port: SocketAddrV4 = "10.0.0.5:0".parse().unwrap();
        assert!(!takes_over(tcp, at("10.0.0.5:0"), tcp, any_port));
    }

    #[test]
    fn a_channel_hands_out_its_cqs_in_order_and_skips_forgotten_ones() {
        let channel = Channel::new().unwrap();
        channel.push(0x10);
        channel.push(0x20);
        channel.push(0x10);
        channel.forget(|&cq| cq == 0x10);
        assert_eq!(channel.take(), Ok(0x20));
        // The forgotten events' counts remain; a non-blocking take runs out cleanly.
        // SAFETY: only changes the flags of this test's own eventfd.
        unsafe {
            libc::fcntl(channel.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK);
        }
        assert_eq!(channel.take(), Err(libc::EAGAIN));
    }

    #[test]
    fn a_closed_channel_hands_out_what_it_holds_then_fails_every_waiter_at_once() {
        let channel = Channel::new().unwrap();
        channel.push(0x10);
        let waiter = {
            let channel = Arc::clone(&channel);
            std::thread::spawn(move || {
                let first = channel.take();
                (first, channel.take())
            })
        };
        // The waiter takes 0x10, then blocks until the close wakes it.
        std::thread::sleep(Duration::from_millis(50));
        channel.close();
        assert_eq!(waiter.join().unwrap(), (Ok(0x10), Err(libc::EIO)));
        // Later takes fail at once, and the fd stays readable for a program's poll.
        assert_eq!(channel.take(), Err(libc::EIO));
        let mut ready = libc::pollfd {
            fd: channel.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd of this test's own eventfd.
        assert_eq!(unsafe { libc::poll(&mut ready, 1, 0) }, 1);
    }

    #[test]
    fn device_events_name_the_programs_objects_and_skip_unknown_ones() {
        use ibv_event_type::*;
        let objects = HashMap::from([
            ((ObjectKind::Qp, 7), 0x1000),
            ((ObjectKind::Cq, 7), 0x2000),
            ((ObjectKind::Srq, 9), 0x3000),
        ]);
        let event = |kind, element| Some(AsyncEvent { kind, element });
        let cases = [
            (
                DeviceEvent::QpFatal(7),
                event(IBV_EVENT_QP_FATAL, Element::Qp(0x1000)),
            ),
            (
                DeviceEvent::CqError(7),
                event(IBV_EVENT_CQ_ERR, Element::Cq(0x2000)),
            ),
            (
                DeviceEvent::SrqLimitReached(9),
                event(IBV_EVENT_SRQ_LIMIT_REACHED, Element::Srq(0x3000)),
            ),
            (
                DeviceEvent::SrqError(9),
                event(IBV_EVENT_SRQ_ERR, Element::Srq(0x3000)),
            ),
            (
                DeviceEvent::PortError(1),
                event(IBV_EVENT_PORT_ERR, Element::Port(1)),
            ),
            (
                DeviceEvent::PortActive(1),
                event(IBV_EVENT_PORT_ACTIVE, Element::Port(1)),
            ),
            (
                DeviceEvent::DeviceFatal,
                event(IBV_EVENT_DEVICE_FATAL, Element::Device),
            ),
            // A destroyed (or never known) object's event has no one to go to.
            (DeviceEvent::QpFatal(8), None),
            (DeviceEvent::SrqLimitReached(7), None),
            (DeviceEvent::CqCompletion(7), None),
            (
                DeviceEvent::Unknown {
                    kind: 99,
                    handle: 7,
                },
                None,
            ),
        ];
        for (device_event, expected) in cases {
            assert_eq!(
                async_event_of(device_event, &objects),
                expected,
                "{device_event:?}"
            );
        }
    }
}
