//! Events for the guest (SPEC.md §8.4): delivered, or kept until the event queue has buffers,
//! raised by the data path, the control path's other threads (`EventRaiser`) and the host
//! event thread, which forwards the host context's asynchronous events.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vmm_sys_util::epoll::{Epoll, EpollEvent};
use vrdma_spec::ctrl::PORT_NUM;
use vrdma_spec::ring::{event_kind, Event};
use vrdma_spec::{Le16, Le32};

use super::queue_table::{QueueTable, Rung};
use super::shared::Shared;
use crate::hostverbs::{AsyncEvent, Context};
use crate::log_budget::LogBudget;

/// Where events for the guest go (the event virtqueue); `deliver` is false when the guest
/// has no buffer posted.
pub trait EventSink: Send + Sync {
    fn deliver(&self, event: &Event) -> bool;
}

/// The events kept for delivery, locked; on unlock, whether any are left is published for
/// the passes that look without locking.
pub(super) struct PendingEvents<'a> {
    events: std::sync::MutexGuard<'a, VecDeque<Event>>,
    flag: &'a AtomicBool,
}

impl std::ops::Deref for PendingEvents<'_> {
    type Target = VecDeque<Event>;
    fn deref(&self) -> &Self::Target {
        &self.events
    }
}

impl std::ops::DerefMut for PendingEvents<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.events
    }
}

impl Drop for PendingEvents<'_> {
    fn drop(&mut self) {
        self.flag.store(!self.events.is_empty(), Ordering::Release);
    }
}

impl Shared {
    /// Delivers an event, or keeps it (once per kind and object) for the pollers to deliver
    /// when the guest posts event buffers.
    pub(super) fn post_event(&self, kind: u16, handle: u32) {
        if let Some(count) = self.events.get(usize::from(kind)) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        let event = Event {
            kind: Le16::from(kind),
            reserved: Le16::from(0),
            handle: Le32::from(handle),
        };
        let sink = self.sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if sink.is_some_and(|s| s.deliver(&event)) {
            return;
        }
        let mut pending = self.take_pending_events();
        if !pending.contains(&event) {
            pending.push_back(event);
        }
    }

    /// The events kept for the pollers to deliver; `events_pending` follows what the guard
    /// leaves.
    pub(super) fn take_pending_events(&self) -> PendingEvents<'_> {
        PendingEvents {
            events: self
                .pending_events
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
            flag: &self.events_pending,
        }
    }

    /// The guest handle of the first object `pick` finds in the connection's queue table.
    pub(super) fn find_handle(&self, pick: impl Fn(&QueueTable) -> Option<u32>) -> Option<u32> {
        pick(&self.queues.table.lock())
    }

    /// Turns a host asynchronous event into the guest's event (SPEC.md §8.4), if it concerns
    /// one of this connection's objects or its port.
    pub(super) fn forward_host_event(&self, event: AsyncEvent, host_port: u8) {
        let found = |kind, handle: Option<u32>| handle.map(|handle| (kind, handle));
        let guest_event = match event {
            AsyncEvent::QpFailed(qp_num) => found(
                event_kind::QP_FATAL,
                self.find_handle(|o| {
                    o.queues.values().find_map(|rung| match rung {
                        Rung::Qp(qp) if qp.qp.qp_num() == qp_num => Some(qp.handle),
                        _ => None,
                    })
                }),
            ),
            AsyncEvent::CqError(id) => found(
                event_kind::CQ_ERROR,
                self.find_handle(|o| o.cqs.iter().find(|c| c.host.id() == id).map(|c| c.handle)),
            ),
            AsyncEvent::SrqLimitReached(id) => found(
                event_kind::SRQ_LIMIT_REACHED,
                self.find_handle(|o| {
                    o.queues.values().find_map(|rung| match rung {
                        Rung::Srq(srq) if srq.srq.id() == id => Some(srq.handle),
                        _ => None,
                    })
                }),
            ),
            AsyncEvent::PortActive(port) if port == host_port => {
                Some((event_kind::PORT_ACTIVE, u32::from(PORT_NUM)))
            }
            AsyncEvent::PortError(port) if port == host_port => {
                Some((event_kind::PORT_ERROR, u32::from(PORT_NUM)))
            }
            AsyncEvent::DeviceFatal => Some((event_kind::DEVICE_FATAL, 0)),
            _ => None,
        };
        match guest_event {
            Some((kind, handle)) => {
                self.log
                    .info(|| format!("host event {event:?}: guest event {kind} for {handle:#x}"));
                self.post_event(kind, handle);
                // A sleeping poller delivers what the event queue had no buffer for.
                let _ = self.queues.wake.write(1);
            }
            None => log::debug!("host event {event:?} not forwarded"),
        }
    }
}

/// Raises events for the guest of one connection (SPEC.md §8.4), from any thread.
#[derive(Clone)]
pub struct EventRaiser(pub(super) Arc<Shared>);

impl EventRaiser {
    pub fn raise(&self, kind: u16, handle: u32) {
        self.0.post_event(kind, handle);
        // A sleeping poller delivers what the event queue had no buffer for.
        let _ = self.0.queues.wake.write(1);
    }

    /// The connection's log budget.
    pub fn log_budget(&self) -> &LogBudget {
        &self.0.log
    }
}

/// The body of the host event thread: forwards `context`'s events until told to stop.
pub(super) fn forward_host_events(
    context: &Context,
    shared: &Shared,
    epoll: &Epoll,
    host_port: u8,
) {
    let mut ready = [EpollEvent::default(); 2];
    while !shared.stop.load(Ordering::Acquire) {
        if let Err(e) = epoll.wait(-1, &mut ready) {
            if e.kind() != std::io::ErrorKind::Interrupted {
                log::error!("host event thread: epoll_wait: {e}");
                return;
            }
        }
        while context.take_async_event(|event| shared.forward_host_event(event, host_port)) {}
    }
}
