//! The connection manager of a host that fails on demand: every librdmacm call a CM
//! command makes can be refused.

use std::net::SocketAddrV4;
use std::os::fd::RawFd;
use std::sync::Arc;

use super::{Faults, Verb};
use crate::hostverbs::seam::{CmIdInfo, PortSpace};
use crate::hostverbs::seam::{HostCmChannel, HostCmEvent, HostCmId};
use crate::hostverbs::{qp_attr_mask, QpAttr, Result};
use vrdma_spec::cm::ConnParam;

pub(super) struct Channel {
    pub(super) inner: Box<dyn HostCmChannel>,
    pub(super) faults: Arc<Faults>,
}

impl Channel {
    fn wrap(&self, inner: Box<dyn HostCmId>) -> Box<dyn HostCmId> {
        Box::new(Id {
            inner,
            faults: Arc::clone(&self.faults),
        })
    }
}

impl HostCmChannel for Channel {
    fn fd(&self) -> RawFd {
        self.inner.fd()
    }

    fn create_id(&self, space: PortSpace, key: u64) -> Result<Box<dyn HostCmId>> {
        self.faults.refuse(Verb::CmCreateId)?;
        Ok(self.wrap(self.inner.create_id(space, key)?))
    }

    fn take_event(&self) -> Option<HostCmEvent> {
        let event = self.inner.take_event()?;
        Some(HostCmEvent {
            new_id: event.new_id.map(|id| self.wrap(id)),
            ..event
        })
    }
}

struct Id {
    inner: Box<dyn HostCmId>,
    faults: Arc<Faults>,
}

impl HostCmId for Id {
    fn set_key(&self, key: u64) {
        self.inner.set_key(key);
    }

    fn bind(&self, address: SocketAddrV4) -> Result<()> {
        self.faults.refuse(Verb::CmBind)?;
        self.inner.bind(address)
    }

    fn resolve_addr(&self, src: SocketAddrV4, dst: SocketAddrV4, timeout_ms: u32) -> Result<()> {
        self.faults.refuse(Verb::CmResolveAddr)?;
        self.inner.resolve_addr(src, dst, timeout_ms)
    }

    fn resolve_route(&self, timeout_ms: u32) -> Result<()> {
        self.faults.refuse(Verb::CmResolveRoute)?;
        self.inner.resolve_route(timeout_ms)
    }

    fn listen(&self, backlog: u32) -> Result<()> {
        self.faults.refuse(Verb::CmListen)?;
        self.inner.listen(backlog)
    }

    fn connect(&self, param: &ConnParam, qp_num: u32) -> Result<()> {
        self.faults.refuse(Verb::CmConnect)?;
        self.inner.connect(param, qp_num)
    }

    fn accept(&self, param: &ConnParam, qp_num: u32) -> Result<()> {
        self.faults.refuse(Verb::CmAccept)?;
        self.inner.accept(param, qp_num)
    }

    fn reject(&self, private_data: &[u8]) -> Result<()> {
        self.faults.refuse(Verb::CmReject)?;
        self.inner.reject(private_data)
    }

    fn disconnect(&self) -> Result<()> {
        self.faults.refuse(Verb::CmDisconnect)?;
        self.inner.disconnect()
    }

    fn establish(&self) -> Result<()> {
        self.faults.refuse(Verb::CmEstablish)?;
        self.inner.establish()
    }

    fn init_qp_attr(&self, state: u32) -> Result<(QpAttr, u32)> {
        self.faults.refuse(Verb::CmInitQpAttr)?;
        let (mut attr, mask) = self.inner.init_qp_attr(state)?;
        if let Some(index) = self.faults.state().cm_source_gid {
            if mask & qp_attr_mask::AV != 0 {
                attr.ah_attr.sgid_index = index;
            }
        }
        Ok((attr, mask))
    }

    fn info(&self) -> CmIdInfo {
        self.inner.info()
    }
}
