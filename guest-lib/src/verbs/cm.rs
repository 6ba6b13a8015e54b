//! Connection management (SPEC.md §13): CM ids the device runs the host's connection manager
//! with, on this driver's own address. Events come as [`crate::work::DeviceEvent::CmEvent`] naming the id;
//! [`CmId::get_event`] takes them.

use std::net::SocketAddrV4;
use std::sync::Arc;
use std::time::Duration;

pub use vrdma_spec::cm::{cm_event as event, port_space, ConnParam};
use vrdma_spec::cm::{
    cm_event, private_data_field, CmAddr, CmBindRequest, CmConnectRequest, CmCreateIdRequest,
    CmEvent as WireCmEvent, CmIdInfo, CmInitQpAttrRequest, CmListenRequest, CmRejectRequest,
    CmResolveAddrRequest, CmResolveRouteRequest,
};
use vrdma_spec::ctrl::{CreatedResponse, HandleRequest, ModifyQpRequest, Opcode};
use vrdma_spec::Le32;

use super::{Device, DeviceInner, Empty, QueuePair};
use crate::verbs::{AhAttr, QpAttr, QpState};
use crate::{Error, Result};

/// A connection-manager id. Dropping it destroys it on the device (a connected one
/// disconnects).
pub struct CmId {
    device: Arc<DeviceInner>,
    handle: u32,
}

impl std::fmt::Debug for CmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmId")
            .field("handle", &self.handle)
            .finish()
    }
}

/// One event taken from an id.
#[derive(Debug)]
pub struct CmEvent {
    /// A [`cm_event`] value.
    pub event: u32,
    /// 0, a negative errno, or for REJECTED the peer's reason.
    pub status: i32,
    /// CONNECT_REQUEST: the id the request came on, now the caller's.
    pub new_id: Option<CmId>,
    /// Events still queued on the id.
    pub pending: u32,
    pub param: ConnParam,
    /// CONNECT_REQUEST and ESTABLISHED on a UD id: the peer's address vector.
    pub ah_attr: Option<AhAttr>,
}

impl CmEvent {
    /// librdmacm's name of the event.
    pub fn name(&self) -> &'static str {
        cm_event::name(self.event)
    }
}

fn millis(timeout: Duration) -> Le32 {
    Le32::from(
        u32::try_from(timeout.as_millis())
            .unwrap_or(u32::MAX)
            .max(1),
    )
}

impl Device {
    /// A new CM id in `space` ([`port_space::TCP`] for RC QPs, [`port_space::UDP`] for UD).
    pub fn create_cm_id(&self, space: u32) -> Result<CmId> {
        let request = CmCreateIdRequest {
            port_space: Le32::from(space),
            reserved: Le32::from(0),
        };
        let created: CreatedResponse = self.inner.command(Opcode::CmCreateId, &request)?;
        Ok(CmId {
            device: Arc::clone(&self.inner),
            handle: created.handle.to_native(),
        })
    }
}

impl CmId {
    pub fn handle(&self) -> u32 {
        self.handle
    }

    fn handle_request(&self) -> HandleRequest {
        HandleRequest {
            handle: Le32::from(self.handle),
            reserved: Le32::from(0),
        }
    }

    fn id(&self) -> Le32 {
        Le32::from(self.handle)
    }

    /// Binds to this driver's own address (0.0.0.0 stands for it) and `address`'s port;
    /// the bound id's addresses and route (as [`CmId::query`] tells them).
    pub fn bind(&self, address: SocketAddrV4) -> Result<CmIdInfo> {
        let request = CmBindRequest {
            id: self.id(),
            addr: CmAddr::ipv4(address),
        };
        self.device.command(Opcode::CmBind, &request)
    }

    /// Resolves `dst` (ADDR_RESOLVED or ADDR_ERROR follows), from `src` or this driver's own
    /// address.
    pub fn resolve_addr(
        &self,
        src: Option<SocketAddrV4>,
        dst: SocketAddrV4,
        timeout: Duration,
    ) -> Result<()> {
        let request = CmResolveAddrRequest {
            id: self.id(),
            timeout_ms: millis(timeout),
            src: src.map(CmAddr::ipv4).unwrap_or_default(),
            dst: CmAddr::ipv4(dst),
        };
        self.device
            .command::<_, Empty>(Opcode::CmResolveAddr, &request)?;
        Ok(())
    }

    /// Resolves the route to the resolved address (ROUTE_RESOLVED or ROUTE_ERROR follows).
    pub fn resolve_route(&self, timeout: Duration) -> Result<()> {
        let request = CmResolveRouteRequest {
            id: self.id(),
            timeout_ms: millis(timeout),
        };
        self.device
            .command::<_, Empty>(Opcode::CmResolveRoute, &request)?;
        Ok(())
    }

    /// Listens on the bound address; `backlog` 0 is the device's largest.
    pub fn listen(&self, backlog: u32) -> Result<()> {
        let request = CmListenRequest {
            id: self.id(),
            backlog: Le32::from(backlog),
        };
        self.device
            .command::<_, Empty>(Opcode::CmListen, &request)?;
        Ok(())
    }

    fn connect_request(&self, qp: &QueuePair, param: &ConnParam) -> Result<CmConnectRequest> {
        let param = param.to_wire().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{} bytes of private data: at most {} fit",
                param.private_data.len(),
                vrdma_spec::cm::MAX_PRIVATE_DATA
            ))
        })?;
        Ok(CmConnectRequest {
            id: self.id(),
            qp: Le32::from(qp.handle()),
            param,
        })
    }

    /// Connects `qp` (RC: in INIT, see [`CmId::move_qp`]) to the resolved route's peer.
    pub fn connect(&self, qp: &QueuePair, param: &ConnParam) -> Result<()> {
        let request = self.connect_request(qp, param)?;
        self.device
            .command::<_, Empty>(Opcode::CmConnect, &request)?;
        Ok(())
    }

    /// Accepts the connection request this id came with, on `qp` (RC: in RTS).
    pub fn accept(&self, qp: &QueuePair, param: &ConnParam) -> Result<()> {
        let request = self.connect_request(qp, param)?;
        self.device
            .command::<_, Empty>(Opcode::CmAccept, &request)?;
        Ok(())
    }

    /// Rejects the connection request this id came with.
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        let (private_data_len, private_data) = private_data_field(private_data)
            .ok_or_else(|| Error::InvalidArgument("private data over 255 bytes".into()))?;
        let request = CmRejectRequest {
            id: self.id(),
            private_data_len,
            reserved: [0; 3],
            private_data,
        };
        self.device
            .command::<_, Empty>(Opcode::CmReject, &request)?;
        Ok(())
    }

    pub fn disconnect(&self) -> Result<()> {
        self.device
            .command::<_, Empty>(Opcode::CmDisconnect, &self.handle_request())?;
        Ok(())
    }

    /// After CONNECT_RESPONSE, once the QP is in RTS: tells the peer the connection is up.
    pub fn establish(&self) -> Result<()> {
        self.device
            .command::<_, Empty>(Opcode::CmEstablish, &self.handle_request())?;
        Ok(())
    }

    /// The attributes (and mask) that move this id's QP to `state`.
    pub fn init_qp_attr(&self, state: QpState) -> Result<(QpAttr, u32)> {
        let request = CmInitQpAttrRequest {
            id: self.id(),
            qp_state: state as u8,
            reserved: [0; 3],
        };
        let response: ModifyQpRequest = self.device.command(Opcode::CmInitQpAttr, &request)?;
        let attr = QpAttr::try_from(&response.attr).map_err(|_| Error::BadResponse {
            opcode: Opcode::CmInitQpAttr,
            len: std::mem::size_of::<ModifyQpRequest>(),
        })?;
        Ok((attr, response.attr_mask.to_native()))
    }

    /// Moves `qp` to `state` with the attributes the connection manager gives.
    pub fn move_qp(&self, qp: &QueuePair, state: QpState) -> Result<()> {
        let (attr, mask) = self.init_qp_attr(state)?;
        qp.modify(&attr, mask)
    }

    /// The id's addresses and route.
    pub fn query(&self) -> Result<CmIdInfo> {
        self.device.command(Opcode::CmQuery, &self.handle_request())
    }

    /// Takes the oldest event queued on the id, if any.
    pub fn get_event(&self) -> Result<Option<CmEvent>> {
        let wire: WireCmEvent = self
            .device
            .command(Opcode::CmGetEvent, &self.handle_request())?;
        let event = wire.event.to_native();
        if event == cm_event::NONE {
            return Ok(None);
        }
        let new_id = match wire.new_id.to_native() {
            0 => None,
            handle => Some(CmId {
                device: Arc::clone(&self.device),
                handle,
            }),
        };
        let ud = wire.ah_attr != Default::default();
        Ok(Some(CmEvent {
            event,
            status: wire.status.to_native() as i32,
            new_id,
            pending: wire.pending.to_native(),
            param: ConnParam::from(&wire.param),
            ah_attr: ud.then(|| AhAttr::from(&wire.ah_attr)),
        }))
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        self.device.destroy(Opcode::CmDestroyId, self.handle);
    }
}
