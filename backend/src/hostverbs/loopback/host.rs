//! The loopback device as a host of the seam: each object a handle into the device, which
//! carries out every verb under its lock.

use std::any::Any;
use std::net::SocketAddrV4;
use std::os::fd::RawFd;

use super::*;
use crate::hostverbs::seam::{CmIdInfo, PortSpace};
use crate::hostverbs::seam::{
    HostAh, HostChannel, HostCmChannel, HostCmEvent, HostCmId, HostContext, HostCq, HostMr, HostPd,
    HostQp, HostSrq, NewQp, QpQueues, Registration,
};
use crate::hostverbs::{AhAttr, QpInit};
use vrdma_spec::cm::ConnParam;

impl HostContext for Context {
    fn async_fd(&self) -> RawFd {
        self.events.fd.as_raw_fd()
    }

    fn take_async_event(&self, route: &mut dyn FnMut(AsyncEvent)) -> bool {
        self.events.take().map(route).is_some()
    }

    fn query_device(&self) -> Result<DeviceAttr> {
        Ok(device_attr())
    }

    fn query_port(&self, port: u8) -> Result<PortAttr> {
        port_attr(port)
    }

    fn query_gid(&self, port: u8, index: u32) -> Result<(Gid, GidType)> {
        query_gid(port, index)
    }

    fn netdev_index(&self, _port: u8) -> Result<Option<u32>> {
        // The loopback's port is on no network device.
        Ok(None)
    }

    fn alloc_pd(&self) -> Result<Box<dyn HostPd>> {
        let mut state = self.device.state();
        state.pds += 1;
        Ok(Box::new(Pd(Handle {
            device: self.device,
            id: state.new_id(),
        })))
    }

    fn create_cq(&self, depth: u32, channel: Option<&dyn HostChannel>) -> Result<Box<dyn HostCq>> {
        let channel = match channel {
            None => None,
            Some(channel) => match channel.as_any().downcast_ref::<Arc<Channel>>() {
                Some(channel) => Some(Arc::clone(channel)),
                None => return Err(Error::other_host("ibv_create_cq")),
            },
        };
        Ok(Box::new(Context::create_cq(self, depth, channel)?))
    }

    fn create_comp_channel(&self) -> Result<Box<dyn HostChannel>> {
        Ok(Box::new(Channel::new()?))
    }
}

impl HostChannel for Arc<Channel> {
    fn fd(&self) -> RawFd {
        Channel::fd(self)
    }

    fn drain(&self) -> usize {
        Channel::drain(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl HostCq for Arc<Cq> {
    fn id(&self) -> ObjectId {
        Cq::id(self)
    }

    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        Ok(Cq::poll(self, out))
    }

    fn req_notify(&self, solicited_only: bool) -> Result<()> {
        self.arm(solicited_only);
        Ok(())
    }

    fn resize(&self, depth: u32) -> Result<()> {
        Cq::resize(self, depth).map_err(|code| errno("ibv_resize_cq", code))
    }

    fn depth(&self) -> u32 {
        Cq::depth(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A protection domain of the loopback device (counted in `pds` while it lives).
struct Pd(Handle);

impl Drop for Pd {
    fn drop(&mut self) {
        self.0.device.state().pds -= 1;
    }
}

impl HostPd for Pd {
    fn pins_pages(&self) -> bool {
        false
    }

    fn reg_mr(&self, memory: &Arc<dyn PinnedMemory>, at: Registration) -> Result<Box<dyn HostMr>> {
        let pd = self.0;
        let key = pd.device.reg_mr(pd.id, Arc::clone(memory), at)?;
        Ok(Box::new(Mr(pd.with_id(key))))
    }

    fn reg_mr_pinned(&self, _: &dyn PinnedMemory, _: Registration) -> Result<Box<dyn HostMr>> {
        Err(Error::InvalidArgument(
            "the loopback host pins no pages: register memory it may keep mapped".into(),
        ))
    }

    fn create_qp(&self, queues: QpQueues<'_>, init: &QpInit<'_>) -> Result<NewQp> {
        let cq = |cq: &dyn HostCq| {
            cq.as_any()
                .downcast_ref::<Arc<Cq>>()
                .cloned()
                .ok_or_else(|| Error::other_host("ibv_create_qp"))
        };
        let srq = match queues.srq {
            None => None,
            Some(srq) => match srq.as_any().downcast_ref::<Srq>() {
                Some(srq) => Some(srq.0.id),
                None => return Err(Error::other_host("ibv_create_qp")),
            },
        };
        let setup = QpSetup {
            qp_type: init.qp_type,
            caps: init.caps,
            srq,
            sq_sig_all: init.sq_sig_all,
        };
        let pd = self.0;
        let (send_cq, recv_cq) = (cq(queues.send_cq)?, cq(queues.recv_cq)?);
        let (qpn, caps) = pd.device.create_qp(pd.id, (&send_cq, &recv_cq), setup)?;
        Ok((Box::new(Qp(pd.with_id(qpn))), caps))
    }

    fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Box<dyn HostSrq>> {
        let pd = self.0;
        let srq = pd.device.create_srq(pd.id, max_wr, max_sge)?;
        Ok(Box::new(Srq(pd.with_id(srq))))
    }

    fn create_ah(&self, attr: &AhAttr) -> Result<Box<dyn HostAh>> {
        let pd = self.0;
        Ok(Box::new(Ah(pd.with_id(pd.device.create_ah(pd.id, attr)?))))
    }
}

/// A memory region of the loopback device, by its key (its lkey and its rkey).
struct Mr(Handle);

impl Drop for Mr {
    fn drop(&mut self) {
        self.0.device.dereg_mr(self.0.id);
    }
}

impl HostMr for Mr {
    fn lkey(&self) -> u32 {
        self.0.id
    }

    fn rkey(&self) -> u32 {
        self.0.id
    }
}

/// A queue pair of the loopback device, by its number.
struct Qp(Handle);

impl Drop for Qp {
    fn drop(&mut self) {
        self.0.device.destroy_qp(self.0.id);
    }
}

impl HostQp for Qp {
    fn qp_num(&self) -> u32 {
        self.0.id
    }

    fn modify(&self, attr: &QpAttr, mask: u32) -> Result<()> {
        self.0.device.modify_qp(self.0.id, attr, mask)
    }

    fn query(&self) -> Result<QpAttr> {
        self.0.device.query_qp(self.0.id)
    }

    fn post_send(&self, batch: &mut SendBatch) -> Result<()> {
        self.0.device.post_send(self.0.id, batch)
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.0.device.post_recv(self.0.id, wrs)
    }
}

/// A shared receive queue of the loopback device.
struct Srq(Handle);

impl Drop for Srq {
    fn drop(&mut self) {
        self.0.device.destroy_srq(self.0.id);
    }
}

impl HostSrq for Srq {
    fn id(&self) -> ObjectId {
        self.0.id as ObjectId
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.0.device.srq_post_recv(self.0.id, wrs)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// An address handle of the loopback device; sends name it by its number.
struct Ah(Handle);

impl Drop for Ah {
    fn drop(&mut self) {
        self.0.device.destroy_ah(self.0.id);
    }
}

impl HostAh for Ah {
    fn handle(&self) -> usize {
        self.0.id as usize
    }
}

impl HostCmChannel for Arc<cm::Channel> {
    fn fd(&self) -> RawFd {
        cm::Channel::fd(self)
    }

    fn create_id(&self, space: PortSpace, key: u64) -> Result<Box<dyn HostCmId>> {
        Ok(Box::new(cm::Channel::create_id(
            self,
            space == PortSpace::Udp,
            key,
        )?))
    }

    fn take_event(&self) -> Option<HostCmEvent> {
        let event = cm::Channel::take_event(self)?;
        Some(HostCmEvent {
            event: event.event,
            status: event.status,
            key: event.key,
            new_id: event.new_id.map(|id| Box::new(id) as Box<dyn HostCmId>),
            param: event.param,
            ud_ah: event.ud_ah,
        })
    }
}

impl HostCmId for cm::Id {
    fn set_key(&self, key: u64) {
        cm::Id::set_key(self, key);
    }

    fn bind(&self, address: SocketAddrV4) -> Result<()> {
        cm::Id::bind(self, address)
    }

    fn resolve_addr(&self, src: SocketAddrV4, dst: SocketAddrV4, _timeout_ms: u32) -> Result<()> {
        // Resolved at once (see the module): no timeout to wait out.
        cm::Id::resolve_addr(self, src, dst)
    }

    fn resolve_route(&self, _timeout_ms: u32) -> Result<()> {
        cm::Id::resolve_route(self)
    }

    fn listen(&self, backlog: u32) -> Result<()> {
        cm::Id::listen(self, backlog)
    }

    fn connect(&self, param: &ConnParam, qp_num: u32) -> Result<()> {
        cm::Id::connect(self, param, qp_num)
    }

    fn accept(&self, param: &ConnParam, qp_num: u32) -> Result<()> {
        cm::Id::accept(self, param, qp_num)
    }

    fn reject(&self, private_data: &[u8]) -> Result<()> {
        cm::Id::reject(self, private_data)
    }

    fn disconnect(&self) -> Result<()> {
        cm::Id::disconnect(self)
    }

    fn establish(&self) -> Result<()> {
        cm::Id::establish(self)
    }

    fn init_qp_attr(&self, state: u32) -> Result<(QpAttr, u32)> {
        cm::Id::init_qp_attr(self, state)
    }

    fn info(&self) -> CmIdInfo {
        cm::Id::info(self)
    }
}
