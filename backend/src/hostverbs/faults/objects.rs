//! The verbs objects of a host that fails on demand: each wraps the host's own, refuses the
//! calls a failure falls on, and hands the rest through. Channels, MRs and AHs are the host's
//! own, unwrapped: nothing of theirs fails apart from the call that makes them.

use std::any::Any;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::{FailableQp, Faults, Verb, PHYS_STATE_DISABLED, PORT_DOWN};
use crate::hostverbs::event_queue::EventQueue;
use crate::hostverbs::seam::{
    HostAh, HostChannel, HostContext, HostCq, HostMr, HostPd, HostQp, HostSrq, NewQp, QpQueues,
    Registration,
};
use crate::hostverbs::{
    AhAttr, AsyncEvent, DeviceAttr, Error, Gid, GidType, ObjectId, PinnedMemory, PortAttr, QpAttr,
    QpInit, RecvWr, Result, SendBatch, WorkCompletion,
};

fn epoll_error(source: io::Error) -> Error {
    Error::Verbs {
        call: "epoll over the async event fds",
        source,
    }
}

/// A context whose asynchronous events are the host's and those the faults raise: its
/// descriptor is an epoll set of both, readable when either is.
pub(super) struct Context {
    inner: Box<dyn HostContext>,
    faults: Arc<Faults>,
    raised: Arc<EventQueue<AsyncEvent>>,
    events: Epoll,
}

impl Context {
    pub(super) fn new(inner: Box<dyn HostContext>, faults: Arc<Faults>) -> Result<Context> {
        let raised = Arc::new(EventQueue::new()?);
        let events = Epoll::new().map_err(epoll_error)?;
        for fd in [inner.async_fd(), raised.fd.as_raw_fd()] {
            let readable = EpollEvent::new(EventSet::IN, 0);
            events
                .ctl(ControlOperation::Add, fd, readable)
                .map_err(epoll_error)?;
        }
        faults.state().contexts.push(Arc::downgrade(&raised));
        Ok(Context {
            inner,
            faults,
            raised,
            events,
        })
    }
}

impl HostContext for Context {
    fn async_fd(&self) -> RawFd {
        self.events.as_raw_fd()
    }

    fn take_async_event(&self, route: &mut dyn FnMut(AsyncEvent)) -> bool {
        match self.raised.take() {
            Some(event) => {
                route(event);
                true
            }
            None => self.inner.take_async_event(route),
        }
    }

    fn query_device(&self) -> Result<DeviceAttr> {
        self.inner.query_device()
    }

    fn query_port(&self, port: u8) -> Result<PortAttr> {
        self.faults.refuse(Verb::QueryPort)?;
        let attr = self.inner.query_port(port)?;
        Ok(match self.faults.state().port_down {
            true => PortAttr {
                state: PORT_DOWN,
                phys_state: PHYS_STATE_DISABLED,
                ..attr
            },
            false => attr,
        })
    }

    fn query_gid(&self, port: u8, index: u32) -> Result<(Gid, GidType)> {
        self.faults.refuse(Verb::QueryGid)?;
        let (gid, kind) = self.inner.query_gid(port, index)?;
        let replaced = self.faults.state().gids.get(&index).copied();
        Ok((replaced.unwrap_or(gid), kind))
    }

    fn netdev_index(&self, port: u8) -> Result<Option<u32>> {
        self.inner.netdev_index(port)
    }

    fn alloc_pd(&self) -> Result<Box<dyn HostPd>> {
        self.faults.refuse(Verb::AllocPd)?;
        Ok(Box::new(Pd {
            inner: self.inner.alloc_pd()?,
            faults: Arc::clone(&self.faults),
            events: Arc::clone(&self.raised),
        }))
    }

    fn create_cq(&self, depth: u32, channel: Option<&dyn HostChannel>) -> Result<Box<dyn HostCq>> {
        self.faults.refuse(Verb::CreateCq)?;
        Ok(Box::new(Cq {
            inner: self.inner.create_cq(depth, channel)?,
            faults: Arc::clone(&self.faults),
        }))
    }

    fn create_comp_channel(&self) -> Result<Box<dyn HostChannel>> {
        self.inner.create_comp_channel()
    }
}

struct Pd {
    inner: Box<dyn HostPd>,
    faults: Arc<Faults>,
    /// Where a QP's fatal error is raised: its context's events.
    events: Arc<EventQueue<AsyncEvent>>,
}

impl HostPd for Pd {
    fn pins_pages(&self) -> bool {
        self.inner.pins_pages()
    }

    fn reg_mr(&self, memory: &Arc<dyn PinnedMemory>, at: Registration) -> Result<Box<dyn HostMr>> {
        self.faults.refuse(Verb::RegMr)?;
        self.inner.reg_mr(memory, at)
    }

    fn reg_mr_pinned(
        &self,
        memory: &dyn PinnedMemory,
        at: Registration,
    ) -> Result<Box<dyn HostMr>> {
        self.faults.refuse(Verb::RegMr)?;
        self.inner.reg_mr_pinned(memory, at)
    }

    fn create_qp(&self, queues: QpQueues<'_>, init: &QpInit<'_>) -> Result<NewQp> {
        self.faults.refuse(Verb::CreateQp)?;
        let srq = match queues.srq {
            None => None,
            Some(srq) => match srq.as_any().downcast_ref::<Srq>() {
                Some(srq) => Some(&*srq.inner),
                None => return Err(Error::other_host("ibv_create_qp")),
            },
        };
        let inner = QpQueues {
            send_cq: inner_cq(queues.send_cq)?,
            recv_cq: inner_cq(queues.recv_cq)?,
            srq,
        };
        let (qp, caps) = self.inner.create_qp(inner, init)?;
        let qp: Arc<dyn HostQp> = Arc::from(qp);
        let qpn = qp.qp_num();
        let entry = FailableQp {
            qp: Arc::downgrade(&qp),
            events: Arc::downgrade(&self.events),
        };
        self.faults.state().qps.insert(qpn, entry);
        Ok((
            Box::new(Qp {
                inner: qp,
                faults: Arc::clone(&self.faults),
            }),
            caps,
        ))
    }

    fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Box<dyn HostSrq>> {
        self.faults.refuse(Verb::CreateSrq)?;
        Ok(Box::new(Srq {
            inner: self.inner.create_srq(max_wr, max_sge)?,
            faults: Arc::clone(&self.faults),
        }))
    }

    fn create_ah(&self, attr: &AhAttr) -> Result<Box<dyn HostAh>> {
        self.faults.refuse(Verb::CreateAh)?;
        self.inner.create_ah(attr)
    }
}

struct Cq {
    inner: Box<dyn HostCq>,
    faults: Arc<Faults>,
}

impl HostCq for Cq {
    fn id(&self) -> ObjectId {
        self.inner.id()
    }

    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        self.inner.poll(out)
    }

    fn req_notify(&self, solicited_only: bool) -> Result<()> {
        self.inner.req_notify(solicited_only)
    }

    fn resize(&self, depth: u32) -> Result<()> {
        self.faults.refuse(Verb::ResizeCq)?;
        self.inner.resize(depth)
    }

    fn depth(&self) -> u32 {
        self.inner.depth()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The host's CQ under a wrapped one.
fn inner_cq(cq: &dyn HostCq) -> Result<&dyn HostCq> {
    match cq.as_any().downcast_ref::<Cq>() {
        Some(cq) => Ok(&*cq.inner),
        None => Err(Error::other_host("ibv_create_qp")),
    }
}

/// A post's failure after `posted` work requests were taken.
fn post_refused(verb: Verb, posted: usize, errno: i32) -> Error {
    Error::Post {
        call: verb.call(),
        posted,
        source: io::Error::from_raw_os_error(errno),
    }
}

struct Qp {
    /// Shared with the faults' table of QPs, which may fail it ([`Faults::raise_qp_fatal`]).
    inner: Arc<dyn HostQp>,
    faults: Arc<Faults>,
}

impl Drop for Qp {
    fn drop(&mut self) {
        // Out of the table before the host's QP goes (with this wrapper's fields, after this):
        // a fatal error raised meanwhile has released its reference.
        let qpn = self.inner.qp_num();
        let mut state = self.faults.state();
        let ours = state
            .qps
            .get(&qpn)
            .is_some_and(|entry| std::ptr::addr_eq(entry.qp.as_ptr(), Arc::as_ptr(&self.inner)));
        if ours {
            state.qps.remove(&qpn);
        }
    }
}

impl HostQp for Qp {
    fn qp_num(&self) -> u32 {
        self.inner.qp_num()
    }

    fn modify(&self, attr: &QpAttr, mask: u32) -> Result<()> {
        self.faults.refuse(Verb::ModifyQp)?;
        self.inner.modify(attr, mask)
    }

    fn query(&self) -> Result<QpAttr> {
        self.faults.refuse(Verb::QueryQp)?;
        self.inner.query()
    }

    fn post_send(&self, batch: &mut SendBatch) -> Result<()> {
        match self.faults.refuse_post(Verb::PostSend, batch.len()) {
            None => self.inner.post_send(batch),
            Some((taken, errno)) => {
                batch.with_first(taken, |taken| self.inner.post_send(taken))?;
                Err(post_refused(Verb::PostSend, taken, errno))
            }
        }
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        match self.faults.refuse_post(Verb::PostRecv, wrs.len()) {
            None => self.inner.post_recv(wrs),
            Some((taken, errno)) => {
                self.inner.post_recv(&wrs[..taken])?;
                Err(post_refused(Verb::PostRecv, taken, errno))
            }
        }
    }
}

struct Srq {
    inner: Box<dyn HostSrq>,
    faults: Arc<Faults>,
}

impl HostSrq for Srq {
    fn id(&self) -> ObjectId {
        self.inner.id()
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        match self.faults.refuse_post(Verb::PostSrqRecv, wrs.len()) {
            None => self.inner.post_recv(wrs),
            Some((taken, errno)) => {
                self.inner.post_recv(&wrs[..taken])?;
                Err(post_refused(Verb::PostSrqRecv, taken, errno))
            }
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
