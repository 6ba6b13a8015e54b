//! What an id of the loopback connection manager does: librdmacm's calls on one id, each
//! under the connection manager's lock, telling the peer what the IB CM would.

use std::net::SocketAddrV4;

use vrdma_spec::cm::{cm_event, ConnParam};

use super::*;
use crate::hostverbs::loopback::verbs::required_attributes;
use crate::hostverbs::QpType;

impl Id {
    /// Runs `call` on the id's slot.
    fn with<T>(
        &self,
        call: &'static str,
        f: impl FnOnce(&mut ManagerState, u64) -> Result<T>,
    ) -> Result<T> {
        let mut state = lock(&self.manager.state);
        state.slot(self.number, call)?;
        f(&mut state, self.number)
    }

    /// Keys the id: its events are routed by `key` from now on.
    pub fn set_key(&self, key: u64) {
        if let Some(slot) = lock(&self.manager.state).slots.get_mut(&self.number) {
            slot.key = key;
        }
    }

    pub fn bind(&self, address: SocketAddrV4) -> Result<()> {
        const CALL: &str = "rdma_bind_addr";
        self.with(CALL, |state, n| {
            let slot = state.slot(n, CALL)?;
            if slot.stage != Stage::Idle {
                return Err(einval(CALL));
            }
            let udp = slot.udp;
            let bound = state.claim(udp, address, CALL)?;
            let slot = state.slot(n, CALL)?;
            slot.src = Some(bound);
            slot.stage = Stage::Bound;
            Ok(())
        })
    }

    /// Binds the id to `src` if it is not bound, then resolves `dst`: ADDR_RESOLVED where a
    /// guest of the device holds it, ADDR_ERROR (the id stays bound) where none does.
    pub fn resolve_addr(&self, src: SocketAddrV4, dst: SocketAddrV4) -> Result<()> {
        const CALL: &str = "rdma_resolve_addr";
        self.with(CALL, |state, n| {
            let slot = state.slot(n, CALL)?;
            let (stage, udp) = (slot.stage, slot.udp);
            match stage {
                Stage::Idle => {
                    let bound = state.claim(udp, src, CALL)?;
                    let slot = state.slot(n, CALL)?;
                    slot.src = Some(bound);
                    slot.stage = Stage::Bound;
                }
                Stage::Bound => {}
                _ => return Err(einval(CALL)),
            }
            let reachable = state.addresses.contains_key(dst.ip());
            let slot = state.slot(n, CALL)?;
            let (event, status) = if reachable {
                slot.dst = Some(dst);
                slot.stage = Stage::AddrResolved;
                (cm_event::ADDR_RESOLVED, 0)
            } else {
                (cm_event::ADDR_ERROR, -libc::ETIMEDOUT)
            };
            deliver(state, n, event, status, ConnParam::default());
            Ok(())
        })
    }

    pub fn resolve_route(&self) -> Result<()> {
        const CALL: &str = "rdma_resolve_route";
        self.with(CALL, |state, n| {
            let slot = state.slot(n, CALL)?;
            if slot.stage != Stage::AddrResolved {
                return Err(einval(CALL));
            }
            slot.stage = Stage::RouteResolved;
            deliver(state, n, cm_event::ROUTE_RESOLVED, 0, ConnParam::default());
            Ok(())
        })
    }

    /// Listens with room for `backlog` requests nobody took yet; the next ones are rejected.
    pub fn listen(&self, backlog: u32) -> Result<()> {
        const CALL: &str = "rdma_listen";
        self.with(CALL, |state, n| {
            let slot = state.slot(n, CALL)?;
            if !matches!(slot.stage, Stage::Bound | Stage::Listening) {
                return Err(einval(CALL));
            }
            slot.stage = Stage::Listening;
            slot.backlog = match backlog {
                0 => vrdma_spec::cm::MAX_BACKLOG,
                b => b,
            };
            Ok(())
        })
    }

    fn side(state: &mut ManagerState, param: &ConnParam, qp_num: u32) -> Side {
        Side {
            qp_num,
            psn: state.new_psn(),
            responder_resources: param.responder_resources,
            initiator_depth: param.initiator_depth,
            retry_count: param.retry_count,
            rnr_retry_count: param.rnr_retry_count,
        }
    }

    /// Sends a connection request to the resolved destination from the QP `qp_num`.
    pub fn connect(&self, param: &ConnParam, qp_num: u32) -> Result<()> {
        const CALL: &str = "rdma_connect";
        self.with(CALL, |state, n| {
            let slot = state.slot(n, CALL)?;
            let (Stage::RouteResolved, Some(src), Some(dst)) = (slot.stage, slot.src, slot.dst)
            else {
                return Err(einval(CALL));
            };
            let udp = slot.udp;
            let local = Self::side(state, param, qp_num);
            let slot = state.slot(n, CALL)?;
            slot.local = local;
            slot.stage = Stage::Connecting;
            let listener = state.listener(udp, dst);
            let full = listener
                .and_then(|l| state.slots.get(&l))
                .is_none_or(|l| l.unanswered >= l.backlog);
            let (Some(listener), false) = (listener, full) else {
                let slot = state.slot(n, CALL)?;
                slot.stage = Stage::Closed;
                let (event, status) = match (udp, listener.is_some()) {
                    (false, false) => (cm_event::REJECTED, REJECT_NO_LISTENER),
                    (false, true) => (cm_event::REJECTED, REJECT_CONSUMER),
                    (true, false) => (cm_event::UNREACHABLE, SIDR_NO_LISTENER),
                    (true, true) => (cm_event::UNREACHABLE, SIDR_REJECT),
                };
                deliver(state, n, event, status, ConnParam::default());
                return Ok(());
            };
            let Some(channel) = state.slots.get(&listener).and_then(|l| l.channel.upgrade()) else {
                return Err(einval(CALL));
            };
            state.next_slot += 1;
            let request = state.next_slot;
            let mut slot = Slot::new(&channel, udp, 0);
            slot.src = Some(dst);
            slot.dst = Some(src);
            slot.passive = true;
            slot.stage = Stage::Requested;
            slot.untaken_at = Some(listener);
            slot.peer = Some(n);
            slot.remote = Some(local);
            state.slots.insert(request, slot);
            state.slot(n, CALL)?.peer = Some(request);
            if let Some(l) = state.slots.get_mut(&listener) {
                l.unanswered += 1;
            }
            deliver_pending(
                state,
                Pending {
                    slot: listener,
                    event: cm_event::CONNECT_REQUEST,
                    status: 0,
                    new_slot: Some(request),
                    param: ConnParam {
                        qkey: if udp { UDP_QKEY } else { 0 },
                        ..param_from(&local, &param.private_data)
                    },
                    ud_ah: udp.then(device_ah),
                },
            );
            Ok(())
        })
    }

    /// Accepts the request this id came from with the QP `qp_num`: CONNECT_RESPONSE at the
    /// connecting side (RC; ESTABLISHED follows its `establish`), or ESTABLISHED there (UD).
    pub fn accept(&self, param: &ConnParam, qp_num: u32) -> Result<()> {
        const CALL: &str = "rdma_accept";
        self.with(CALL, |state, n| {
            let slot = state.slot(n, CALL)?;
            let (Stage::Requested, Some(peer), udp) = (slot.stage, slot.peer, slot.udp) else {
                return Err(einval(CALL));
            };
            let local = Self::side(state, param, qp_num);
            let slot = state.slot(n, CALL)?;
            slot.local = local;
            slot.stage = if udp {
                Stage::Established
            } else {
                Stage::Accepted
            };
            let other = state.slot(peer, CALL)?;
            other.remote = Some(local);
            let pending = if udp {
                other.stage = Stage::Established;
                Pending {
                    slot: peer,
                    event: cm_event::ESTABLISHED,
                    status: 0,
                    new_slot: None,
                    param: ConnParam {
                        qkey: UDP_QKEY,
                        ..param_from(&local, &param.private_data)
                    },
                    ud_ah: Some(device_ah()),
                }
            } else {
                other.stage = Stage::ConnectResponse;
                Pending {
                    slot: peer,
                    event: cm_event::CONNECT_RESPONSE,
                    status: 0,
                    new_slot: None,
                    param: param_from(&local, &param.private_data),
                    ud_ah: None,
                }
            };
            deliver_pending(state, pending);
            Ok(())
        })
    }

    /// Refuses the request this id came from (or, connecting, the answer it got): REJECTED
    /// (UD: UNREACHABLE) with `private_data` at the peer.
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        const CALL: &str = "rdma_reject";
        self.with(CALL, |state, n| {
            let slot = state.slot(n, CALL)?;
            if !matches!(slot.stage, Stage::Requested | Stage::ConnectResponse) {
                return Err(einval(CALL));
            }
            slot.stage = Stage::Closed;
            let udp = slot.udp;
            let Some(peer) = slot.peer.take() else {
                return Ok(());
            };
            if let Some(other) = state.slots.get_mut(&peer) {
                other.peer = None;
                other.stage = Stage::Closed;
            }
            let (event, status) = match udp {
                false => (cm_event::REJECTED, REJECT_CONSUMER),
                true => (cm_event::UNREACHABLE, SIDR_REJECT),
            };
            let param = ConnParam {
                private_data: private_data.to_vec(),
                ..ConnParam::default()
            };
            deliver(state, peer, event, status, param);
            Ok(())
        })
    }

    /// The connecting side's RTU: the connection is up, ESTABLISHED at the accepting side.
    pub fn establish(&self) -> Result<()> {
        const CALL: &str = "rdma_establish";
        self.with(CALL, |state, n| {
            let slot = state.slot(n, CALL)?;
            if slot.stage != Stage::ConnectResponse {
                return Err(einval(CALL));
            }
            slot.stage = Stage::Established;
            let Some(peer) = slot.peer else {
                return Ok(());
            };
            if let Some(other) = state.slots.get_mut(&peer) {
                other.stage = Stage::Established;
                deliver(state, peer, cm_event::ESTABLISHED, 0, ConnParam::default());
            }
            Ok(())
        })
    }

    /// DREQ on an established connection (DISCONNECTED at the peer; this side hears its
    /// DREP), DREP on one the peer disconnected; where no connection is up, nothing is sent,
    /// as `rdma_disconnect` does then.
    pub fn disconnect(&self) -> Result<()> {
        const CALL: &str = "rdma_disconnect";
        self.with(CALL, |state, n| {
            let slot = state.slot(n, CALL)?;
            match (slot.stage, slot.peer) {
                (Stage::Idle | Stage::Bound | Stage::Listening, _) => Err(einval(CALL)),
                (Stage::AddrResolved | Stage::RouteResolved, _) => Err(einval(CALL)),
                (Stage::Established, Some(peer)) if !slot.udp => {
                    slot.stage = Stage::DisconnectSent;
                    if let Some(other) = state.slots.get_mut(&peer) {
                        other.stage = Stage::DisconnectReceived;
                    }
                    deliver(state, peer, cm_event::DISCONNECTED, 0, ConnParam::default());
                    Ok(())
                }
                (Stage::DisconnectReceived, Some(peer)) => {
                    slot.stage = Stage::Closed;
                    slot.peer = None;
                    if let Some(other) = state.slots.get_mut(&peer) {
                        other.stage = Stage::Closed;
                        other.peer = None;
                    }
                    deliver(state, peer, cm_event::DISCONNECTED, 0, ConnParam::default());
                    Ok(())
                }
                (Stage::Established, None) if !slot.udp => {
                    // The peer is gone: its DREP never comes, the DREQ times out.
                    slot.stage = Stage::Closed;
                    deliver(state, n, cm_event::DISCONNECTED, 0, ConnParam::default());
                    Ok(())
                }
                (Stage::DisconnectReceived, None) => {
                    slot.stage = Stage::Closed;
                    Ok(())
                }
                _ => Ok(()),
            }
        })
    }

    /// The attributes (and their mask) that move a QP of this id to `state`: INIT on any id
    /// bound to the device, RTR and RTS once the peer's QP is known.
    pub fn init_qp_attr(&self, qp_state: u32) -> Result<(QpAttr, u32)> {
        const CALL: &str = "rdma_init_qp_attr";
        let qp_state = QpState::try_from(qp_state).map_err(|_| einval(CALL))?;
        self.with(CALL, |state, n| {
            let slot = state.slot(n, CALL)?;
            if matches!(slot.stage, Stage::Idle | Stage::Listening | Stage::Closed) {
                return Err(einval(CALL));
            }
            let mut attr = QpAttr {
                qp_state,
                ..QpAttr::default()
            };
            let remote = slot.remote.filter(|_| slot.stage != Stage::Closed);
            // The states the CM walks a QP through, each from the one before.
            let from = match qp_state {
                QpState::Init => QpState::Reset,
                QpState::Rtr => QpState::Init,
                QpState::Rts => QpState::Rtr,
                _ => return Err(einval(CALL)),
            };
            match (qp_state, slot.udp, remote) {
                (QpState::Init, true, _) => {
                    attr.port_num = 1;
                    attr.qkey = UDP_QKEY;
                }
                (QpState::Init, false, _) => {
                    attr.port_num = 1;
                    // Remote access once there is a connection, READ and atomics where this side
                    // is a responder for them: its own responder resources once it gave them,
                    // until then (a request's id) what the request asks for, as the kernel's
                    // CM gives them.
                    if let Some(remote) = remote {
                        let responder = match slot.stage {
                            Stage::Requested => remote.initiator_depth,
                            _ => slot.local.responder_resources,
                        };
                        attr.qp_access_flags = REMOTE_WRITE;
                        if responder > 0 {
                            attr.qp_access_flags |= REMOTE_READ | REMOTE_ATOMIC;
                        }
                    }
                }
                (QpState::Rtr, true, _) => {}
                (QpState::Rts, true, _) => attr.sq_psn = slot.local.psn,
                (QpState::Rtr, false, Some(remote)) => {
                    attr.ah_attr = device_ah();
                    attr.path_mtu = MTU_4096_BYTE;
                    attr.dest_qp_num = remote.qp_num;
                    attr.rq_psn = remote.psn;
                    attr.max_dest_rd_atomic = slot.local.responder_resources;
                    attr.min_rnr_timer = MIN_RNR_TIMER;
                }
                (QpState::Rts, false, Some(remote)) => {
                    attr.sq_psn = slot.local.psn;
                    attr.timeout = TIMEOUT;
                    attr.retry_cnt = slot.local.retry_count;
                    attr.rnr_retry = remote.rnr_retry_count;
                    attr.max_rd_atomic = slot.local.initiator_depth;
                }
                _ => return Err(einval(CALL)),
            }
            let qp_type = if slot.udp { QpType::Ud } else { QpType::Rc };
            let required = required_attributes(qp_type, from, qp_state)
                .expect("the connection manager's transitions are the verbs specification's");
            Ok((attr, mask::STATE | required))
        })
    }

    pub fn info(&self) -> CmIdInfo {
        let state = lock(&self.manager.state);
        let Some(slot) = state.slots.get(&self.number) else {
            return CmIdInfo::default();
        };
        let bound = slot.src.is_some();
        let routed = matches!(
            slot.stage,
            Stage::RouteResolved
                | Stage::Connecting
                | Stage::Requested
                | Stage::ConnectResponse
                | Stage::Accepted
                | Stage::Established
                | Stage::DisconnectSent
                | Stage::DisconnectReceived
        );
        CmIdInfo {
            src: slot.src,
            dst: slot.dst,
            sgid: if bound { gid() } else { Gid::default() },
            dgid: if slot.dst.is_some() {
                gid()
            } else {
                Gid::default()
            },
            pkey: 0xffff,
            path_mtu: if routed { MTU_4096_BYTE } else { 0 },
            num_paths: routed.into(),
            device: bound.then(|| self.manager.name.clone()),
            port_num: bound.into(),
        }
    }
}

impl Drop for Id {
    fn drop(&mut self) {
        let mut state = lock(&self.manager.state);
        // A listener's requests nobody took are refused, as the kernel destroys their ids.
        let untaken: Vec<u64> = state
            .slots
            .iter()
            .filter(|(_, s)| s.untaken_at == Some(self.number))
            .map(|(&number, _)| number)
            .collect();
        for request in untaken.into_iter().chain([self.number]) {
            state.leave(request);
            state.slots.remove(&request);
        }
    }
}
