//! Connection management for the guest (SPEC.md §13): CM ids on the host's connection
//! manager, bound only to the guest's own address, their events queued per id and announced
//! on the event queue. The guest's QPs stay the guest's: the device only names their numbers
//! in the CM's messages and tells the guest the attributes of each transition.

mod checks;

use checks::*;

use std::collections::{HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_spec::cm::{
    cm_event, port_space, CmAddr, CmBindRequest, CmConnParam, CmConnectRequest, CmCreateIdRequest,
    CmEvent as WireCmEvent, CmIdInfo as WireCmIdInfo, CmInitQpAttrRequest, CmListenRequest,
    CmRejectRequest, CmResolveAddrRequest, CmResolveRouteRequest, MAX_BACKLOG, MAX_TIMEOUT_MS,
};
use vrdma_spec::ctrl::{
    qp_attr_mask, qp_state, CreatedResponse, HandleRequest, ModifyQpRequest, QpAttr as WireQpAttr,
    GUEST_GID_INDEX, PORT_NUM,
};
use vrdma_spec::ring::event_kind;
use vrdma_spec::{ctrl, Le32};

use super::cm_state::{CmCommand, IdState, Verdict};
use super::objects::Handle;
use super::{parse, reply, CommandError, CommandResult, Device, Refusal};
use crate::datapath::EventRaiser;
use crate::hostverbs::cm::{CmChannel, CmEvent, CmId, ConnParam, PortSpace};
use crate::hostverbs::{self, AhAttr, QpType};

/// Events other than connection requests kept on one id the guest does not take; later
/// ones are dropped.
const MAX_QUEUED_EVENTS: usize = 16;

struct Queued {
    event: u32,
    status: i32,
    /// CONNECT_REQUEST: the key of the id it came on.
    new_key: Option<u64>,
    param: ConnParam,
    ud_ah: Option<AhAttr>,
}

struct IdEntry {
    id: Arc<CmId>,
    /// `None` for the id of a connection request the guest has not taken yet.
    handle: Option<Handle>,
    space: PortSpace,
    /// Which commands it takes (SPEC.md §13.3).
    state: IdState,
    /// A listener's backlog.
    backlog: u32,
    /// The QP the id connects (or accepted with).
    qp: Option<Handle>,
    events: VecDeque<Queued>,
    /// Connection requests queued on a listening id.
    requests: u32,
}

impl IdEntry {
    fn new(id: CmId, handle: Option<Handle>, space: PortSpace, state: IdState) -> IdEntry {
        IdEntry {
            id: Arc::new(id),
            handle,
            space,
            state,
            backlog: 0,
            qp: None,
            events: VecDeque::new(),
            requests: 0,
        }
    }
}

/// The connection's ids by key (what their host ids carry), shared with the event thread.
struct CmTable {
    next_key: u64,
    ids: HashMap<u64, IdEntry>,
    /// Ids the connection may hold, those of requests not taken yet included.
    quota: usize,
    /// Events dropped: their id's queue was full, or the id was gone.
    dropped: u64,
}

impl CmTable {
    /// The id keyed `key`. Only the control path removes ids, and it found this one under
    /// its handle, so it is there; the error stands for what cannot happen.
    fn entry(&self, key: u64) -> Result<&IdEntry, CommandError> {
        self.ids.get(&key).ok_or_else(Self::gone)
    }

    fn entry_mut(&mut self, key: u64) -> Result<&mut IdEntry, CommandError> {
        self.ids.get_mut(&key).ok_or_else(Self::gone)
    }

    fn gone() -> CommandError {
        Refusal::CmHost("the id is gone from the device's table".into()).into()
    }

    fn new_key(&mut self) -> u64 {
        self.next_key += 1;
        self.next_key
    }

    /// Takes out the id with `key` and, for a listener, the ids of its requests not taken
    /// yet: the caller drops them outside the lock (a destroy may wait for the event thread).
    fn remove(&mut self, key: u64) -> Vec<Arc<CmId>> {
        let Some(entry) = self.ids.remove(&key) else {
            return Vec::new();
        };
        let mut gone = vec![entry.id];
        for queued in entry.events {
            if let Some(child) = queued.new_key.and_then(|k| self.ids.remove(&k)) {
                // Never taken: the peer is refused (destroying it would too, more slowly).
                let _ = child.id.reject(&[]);
                gone.push(child.id);
            }
        }
        gone
    }
}

/// The connection manager of one guest connection.
pub struct ConnectionManager {
    channel: Arc<CmChannel>,
    table: Arc<Mutex<CmTable>>,
    /// The guest's own address: the only one its ids bind to.
    own: Ipv4Addr,
    /// The host device and port the ids must be bound to, and the host's index of the
    /// guest's GID.
    device: String,
    host_port: u8,
    host_gid_index: u8,
    stop: Arc<AtomicBool>,
    wake: EventFd,
    thread: Option<JoinHandle<()>>,
}

fn lock(table: &Mutex<CmTable>) -> MutexGuard<'_, CmTable> {
    table.lock().unwrap_or_else(|e| e.into_inner())
}

impl ConnectionManager {
    /// Opens the host's connection manager for a guest whose address is `own`, on `device`
    /// (its port `host_port`, the guest's GID at `host_gid_index`), with at most `quota`
    /// ids; events are raised through `events`.
    pub fn new(
        own: Ipv4Addr,
        (device, host_port, host_gid_index): (&str, u8, u8),
        quota: usize,
        events: EventRaiser,
    ) -> hostverbs::Result<ConnectionManager> {
        let os_error = |call| move |source| hostverbs::Error::Verbs { call, source };
        let channel = CmChannel::open(device, own)?;
        let table = Arc::new(Mutex::new(CmTable {
            next_key: 0,
            ids: HashMap::new(),
            quota,
            dropped: 0,
        }));
        let wake = EventFd::new(EFD_NONBLOCK).map_err(os_error("eventfd"))?;
        let epoll = Epoll::new().map_err(os_error("epoll_create"))?;
        for fd in [wake.as_raw_fd(), channel.fd()] {
            epoll
                .ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, 0))
                .map_err(os_error("epoll_ctl"))?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (channel, table, stop) = (Arc::clone(&channel), Arc::clone(&table), stop.clone());
            std::thread::Builder::new()
                .name("vrdma-cm-events".into())
                .spawn(move || {
                    let mut ready = [EpollEvent::default(); 2];
                    while !stop.load(Ordering::Acquire) {
                        if let Err(e) = epoll.wait(-1, &mut ready) {
                            if e.kind() != std::io::ErrorKind::Interrupted {
                                log::error!("CM event thread: epoll_wait: {e}");
                                return;
                            }
                        }
                        loop {
                            let routed = take_and_route(&channel, &mut lock(&table));
                            match routed {
                                Some(routed) => routed.finish(&events),
                                None => break,
                            }
                        }
                    }
                })
                .map_err(os_error("spawn the CM event thread"))?
        };
        Ok(ConnectionManager {
            channel,
            table,
            own,
            device: device.to_owned(),
            host_port,
            host_gid_index,
            stop,
            wake,
            thread: Some(thread),
        })
    }

    /// Destroys every id (device reset).
    pub fn clear(&self) {
        let gone: Vec<_> = {
            let mut table = lock(&self.table);
            let keys: Vec<u64> = table.ids.keys().copied().collect();
            keys.into_iter().flat_map(|k| table.remove(k)).collect()
        };
        drop(gone);
    }

    /// Ids held (those of requests not taken yet included).
    pub fn id_count(&self) -> usize {
        lock(&self.table).ids.len()
    }

    /// Events dropped so far.
    pub fn dropped_events(&self) -> u64 {
        lock(&self.table).dropped
    }

    /// The id with `handle` and its key.
    fn find(&self, objects: &super::Objects, handle: Handle) -> Result<u64, CommandError> {
        objects.cm_ids.get(&handle).copied().ok_or_else(|| {
            Refusal::BadHandle {
                kind: "CM id",
                handle,
            }
            .into()
        })
    }

    /// Runs `call` for `command` on the id `key` (which [`Self::find`] found) under the
    /// table's lock, if the id's state takes the command (`cm_state`), and moves the id to
    /// the state the table names once `call` succeeded. A command the state does not take is
    /// refused here, before anything of it reaches the host. `call` gets the table (to look
    /// at the connection's other ids), whose [`CmTable::entry`] of `key` is the id's.
    fn run<T>(
        &self,
        key: u64,
        command: CmCommand,
        call: impl FnOnce(&mut CmTable) -> Result<T, CommandError>,
    ) -> Result<T, CommandError> {
        let mut table = lock(&self.table);
        let next = Self::admit(&table, key, command)?;
        let result = call(&mut table)?;
        if let Some(entry) = table.ids.get_mut(&key) {
            entry.state = next;
        }
        Ok(result)
    }

    /// The state `command` moves the id `key` to, if its state takes it.
    fn admit(table: &CmTable, key: u64, command: CmCommand) -> Result<IdState, CommandError> {
        let state = table.entry(key)?.state;
        match super::cm_state::verdict(state, command) {
            Verdict::Allowed { next } => Ok(next),
            Verdict::Refused => Err(Refusal::CmState { state, command }.into()),
        }
    }

    /// Runs `f` on the entry of the id `key` under the table's lock, for what takes every
    /// state (CM_QUERY, CM_GET_EVENT).
    fn with_entry<T>(
        &self,
        key: u64,
        f: impl FnOnce(&mut IdEntry) -> Result<T, CommandError>,
    ) -> Result<T, CommandError> {
        let mut table = lock(&self.table);
        f(table.entry_mut(key)?)
    }

    /// Checks the id is bound to the device's own port (so QP numbers mean the same on both).
    /// Called with the table locked.
    fn check_device(&self, id: &CmId, command: CmCommand) -> Result<(), CommandError> {
        let info = id.info();
        if info.device.as_deref() != Some(self.device.as_str()) || info.port_num != self.host_port {
            return Err(Refusal::CmHost(format!(
                "the id cannot {} before it is bound to the device",
                command.action()
            ))
            .into());
        }
        Ok(())
    }

    /// The host's attributes of a transition in the guest's view (SPEC.md §13.3).
    fn guest_view(&self, attr: hostverbs::QpAttr, mask: u32) -> Result<WireQpAttr, CommandError> {
        let mut attr = attr;
        if mask & qp_attr_mask::PORT != 0 {
            attr.port_num = PORT_NUM;
        }
        if mask & qp_attr_mask::AV != 0 {
            attr.ah_attr = self.guest_ah(attr.ah_attr)?;
        }
        Ok(WireQpAttr::from(&attr))
    }

    /// An address vector of the host's in the guest's view: its source can only be the
    /// guest's GID.
    fn guest_ah(&self, ah: AhAttr) -> Result<AhAttr, CommandError> {
        if ah.sgid_index != self.host_gid_index {
            return Err(CommandError::Host {
                status: ctrl::Status::HostError,
                errno: libc::EADDRNOTAVAIL as u32,
                message: format!(
                    "the connection manager chose source GID index {}, not the guest's {}",
                    ah.sgid_index, self.host_gid_index
                ),
            });
        }
        Ok(AhAttr {
            sgid_index: GUEST_GID_INDEX,
            port_num: PORT_NUM,
            ..ah
        })
    }
}

impl Drop for ConnectionManager {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.wake.write(1);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.clear();
    }
}

/// What the event thread does with an event once the table's lock is released.
#[derive(Default)]
struct Routed {
    /// The id of a connection request the device refuses (past the backlog or the quota, or
    /// to an id that no longer listens): rejected, then destroyed.
    rejected: Option<CmId>,
    /// The id whose queue the event started: announced with CM_EVENT.
    announce: Option<Handle>,
}

impl Routed {
    fn finish(self, events: &EventRaiser) {
        if let Some(id) = self.rejected {
            let _ = id.reject(&[]);
            events
                .log_budget()
                .info(|| "a connection request past the backlog or id quota, or to a listener that is gone, was rejected".into());
        }
        if let Some(handle) = self.announce {
            events.raise(event_kind::CM_EVENT, handle);
        }
    }
}

/// Takes the channel's next event and queues it on its id, whose state it moves (the event
/// thread's work). Called with the table locked: librdmacm fills the id's fields (its
/// device, addresses, route) while it hands an event out, and every other call on an id is
/// made under the same lock, so none reads them half written. `None` when no event waits.
fn take_and_route(channel: &Arc<CmChannel>, table: &mut CmTable) -> Option<Routed> {
    let event = channel.take_event()?;
    log::debug!(
        "CM event {} (status {}) for id key {}",
        cm_event::name(event.event),
        event.status,
        event.key
    );
    Some(route(table, event))
}

/// Queues `event` on its id, announcing it when the id's queue was empty.
fn route(table: &mut CmTable, event: CmEvent) -> Routed {
    let full = table.ids.len() >= table.quota;
    let Some(entry) = table.ids.get_mut(&event.key) else {
        // Its id is gone: a request to it is refused (and its id destroyed) once the lock is
        // released, as one past the backlog.
        table.dropped += 1;
        return Routed {
            rejected: event.new_id,
            announce: None,
        };
    };
    // The host's id is where the event says, whether or not the driver hears of it.
    entry.state = entry.state.after_event(event.event);
    let queued = Queued {
        event: event.event,
        status: event.status,
        new_key: None,
        param: event.param,
        ud_ah: event.ud_ah,
    };
    let Some(new_id) = event.new_id else {
        if entry.events.len() >= MAX_QUEUED_EVENTS {
            table.dropped += 1;
            return Routed::default();
        }
        let was_empty = entry.events.is_empty();
        entry.events.push_back(queued);
        return Routed {
            rejected: None,
            announce: entry.handle.filter(|_| was_empty),
        };
    };
    if entry.state != IdState::Listening || entry.requests >= entry.backlog || full {
        // Past the backlog or the quota (or not listening any more): refused here.
        table.dropped += 1;
        return Routed {
            rejected: Some(new_id),
            announce: None,
        };
    }
    entry.requests += 1;
    let (handle, was_empty, space) = (entry.handle, entry.events.is_empty(), entry.space);
    let key = table.new_key();
    new_id.set_key(key);
    if let Some(listener) = table.ids.get_mut(&event.key) {
        listener.events.push_back(Queued {
            new_key: Some(key),
            ..queued
        });
    }
    table
        .ids
        .insert(key, IdEntry::new(new_id, None, space, IdState::Requested));
    Routed {
        rejected: None,
        announce: handle.filter(|_| was_empty),
    }
}

impl Device {
    /// Carries out a CM_* command (SPEC.md §13.3).
    pub(super) fn cm_command(&mut self, opcode: ctrl::Opcode, payload: &[u8]) -> CommandResult {
        use ctrl::Opcode::*;
        negotiated(&self.cm, self.features)?;
        match opcode {
            CmCreateId => self.cm_create_id(parse(payload)),
            CmDestroyId => self.cm_destroy_id(parse(payload)),
            CmBind => self.cm_bind(parse(payload)),
            CmResolveAddr => self.cm_resolve_addr(parse(payload)),
            CmResolveRoute => self.cm_resolve_route(parse(payload)),
            CmListen => self.cm_listen(parse(payload)),
            CmConnect => self.cm_connect(parse(payload), false),
            CmAccept => self.cm_connect(parse(payload), true),
            CmReject => self.cm_reject(parse(payload)),
            CmDisconnect => self.cm_simple(parse(payload), CmCommand::Disconnect, CmId::disconnect),
            CmEstablish => self.cm_simple(parse(payload), CmCommand::Establish, CmId::establish),
            CmInitQpAttr => self.cm_init_qp_attr(parse(payload)),
            CmQuery => self.cm_query(parse(payload)),
            CmGetEvent => self.cm_get_event(parse(payload)),
            _ => unreachable!("cm_command is called for CM opcodes only"),
        }
    }

    fn cm_create_id(&mut self, req: CmCreateIdRequest) -> CommandResult {
        let space = match req.port_space.to_native() {
            port_space::TCP => PortSpace::Tcp,
            port_space::UDP => PortSpace::Udp,
            other => return Err(Refusal::PortSpace(other).into()),
        };
        let cm = negotiated(&self.cm, self.features)?;
        let mut table = lock(&cm.table);
        if table.ids.len() >= table.quota {
            return Err(Refusal::Quota {
                kind: "CM id",
                max: u32::try_from(table.quota).unwrap_or(u32::MAX),
            }
            .into());
        }
        let key = table.new_key();
        let id = cm.channel.create_id(space, key)?;
        let handle = self.objects.new_handle();
        table
            .ids
            .insert(key, IdEntry::new(id, Some(handle), space, IdState::Idle));
        drop(table);
        self.objects.cm_ids.insert(handle, key);
        reply(CreatedResponse {
            handle: Le32::from(handle),
            value: Le32::from(0),
        })
    }

    fn cm_destroy_id(&mut self, req: HandleRequest) -> CommandResult {
        let handle = req.handle.to_native();
        let cm = negotiated(&self.cm, self.features)?;
        let key = cm.find(&self.objects, handle)?;
        // Every state takes it; the id goes outside the lock (a destroy may wait for the
        // event thread to acknowledge the id's last event).
        let gone = cm.run(key, CmCommand::DestroyId, |table| Ok(table.remove(key)))?;
        self.objects.cm_ids.remove(&handle);
        drop(gone);
        Ok(Vec::new())
    }

    fn cm_bind(&mut self, req: CmBindRequest) -> CommandResult {
        let cm = negotiated(&self.cm, self.features)?;
        let key = cm.find(&self.objects, req.id.to_native())?;
        let address = own_source(cm.own, &req.addr, false)?;
        cm.run(key, CmCommand::Bind, |table| {
            table
                .entry(key)?
                .id
                .bind(address)
                .map_err(host(CmCommand::Bind))
        })?;
        // The bound id as CM_QUERY tells it, which the driver needs next (librdmacm fills
        // the id's addresses after a bind): a command less.
        id_info(cm, key)
    }

    fn cm_resolve_addr(&mut self, req: CmResolveAddrRequest) -> CommandResult {
        let cm = negotiated(&self.cm, self.features)?;
        let key = cm.find(&self.objects, req.id.to_native())?;
        let src = own_source(cm.own, &req.src, true)?;
        let dst = destination(cm.own, &req.dst)?;
        let timeout = timeout(req.timeout_ms.to_native())?;
        cm.run(key, CmCommand::ResolveAddr, |table| {
            table
                .entry(key)?
                .id
                .resolve_addr(src, dst, timeout)
                .map_err(host(CmCommand::ResolveAddr))
        })?;
        Ok(Vec::new())
    }

    fn cm_resolve_route(&mut self, req: CmResolveRouteRequest) -> CommandResult {
        let cm = negotiated(&self.cm, self.features)?;
        let key = cm.find(&self.objects, req.id.to_native())?;
        let timeout = timeout(req.timeout_ms.to_native())?;
        cm.run(key, CmCommand::ResolveRoute, |table| {
            table
                .entry(key)?
                .id
                .resolve_route(timeout)
                .map_err(host(CmCommand::ResolveRoute))
        })?;
        Ok(Vec::new())
    }

    fn cm_listen(&mut self, req: CmListenRequest) -> CommandResult {
        let cm = negotiated(&self.cm, self.features)?;
        let key = cm.find(&self.objects, req.id.to_native())?;
        let backlog = match req.backlog.to_native() {
            0 => MAX_BACKLOG,
            b => b.min(MAX_BACKLOG),
        };
        cm.run(key, CmCommand::Listen, |table| {
            let entry = table.entry_mut(key)?;
            // Listening already: the backlog is the device's to keep (SPEC.md §13.3).
            if entry.state != IdState::Listening {
                entry.id.listen(backlog).map_err(host(CmCommand::Listen))?;
            }
            entry.backlog = backlog;
            Ok(())
        })?;
        Ok(Vec::new())
    }

    /// CM_CONNECT, or CM_ACCEPT when `accept`.
    fn cm_connect(&mut self, req: CmConnectRequest, accept: bool) -> CommandResult {
        let command = match accept {
            true => CmCommand::Accept,
            false => CmCommand::Connect,
        };
        let cm = negotiated(&self.cm, self.features)?;
        let key = cm.find(&self.objects, req.id.to_native())?;
        let param = conn_param(&req.param, &self.config)?;
        let qp_handle = req.qp.to_native();
        let qp = self.objects.qp(qp_handle)?;
        let (qp_num, qp_type) = (qp.host.qp_num(), qp.host.qp_type());
        // The id's state and the message's size before anything else is done.
        {
            let table = lock(&cm.table);
            ConnectionManager::admit(&table, key, command)?;
            let space = table.entry(key)?.space;
            check_private_data(command, space, param.private_data.len())?;
        }
        // What the guest posted before it asked must be on the host before the message goes.
        self.data_path.flush_receives(&qp.data);
        cm.run(key, command, |table| {
            let taken = table
                .ids
                .iter()
                .any(|(&k, e)| k != key && e.qp == Some(qp_handle));
            if taken {
                return Err(Refusal::QpOfAnotherId { qp: qp_handle }.into());
            }
            let entry = table.entry_mut(key)?;
            let wanted = match entry.space {
                PortSpace::Tcp => QpType::Rc,
                PortSpace::Udp => QpType::Ud,
            };
            if qp_type != wanted {
                return Err(Refusal::QpType(qp_type as u8).into());
            }
            cm.check_device(&entry.id, command)?;
            let result = match accept {
                true => entry.id.accept(&param, qp_num),
                false => entry.id.connect(&param, qp_num),
            };
            result.map_err(host(command))?;
            entry.qp = Some(qp_handle);
            Ok(())
        })?;
        Ok(Vec::new())
    }

    fn cm_reject(&mut self, req: CmRejectRequest) -> CommandResult {
        let cm = negotiated(&self.cm, self.features)?;
        let key = cm.find(&self.objects, req.id.to_native())?;
        let data = &req.private_data[..usize::from(req.private_data_len)];
        cm.run(key, CmCommand::Reject, |table| {
            let entry = table.entry(key)?;
            check_private_data(CmCommand::Reject, entry.space, data.len())?;
            entry.id.reject(data).map_err(host(CmCommand::Reject))
        })?;
        Ok(Vec::new())
    }

    fn cm_simple(
        &mut self,
        req: HandleRequest,
        command: CmCommand,
        call: fn(&CmId) -> hostverbs::Result<()>,
    ) -> CommandResult {
        let cm = negotiated(&self.cm, self.features)?;
        let key = cm.find(&self.objects, req.handle.to_native())?;
        cm.run(key, command, |table| {
            call(&table.entry(key)?.id).map_err(host(command))
        })?;
        Ok(Vec::new())
    }

    fn cm_init_qp_attr(&mut self, req: CmInitQpAttrRequest) -> CommandResult {
        let cm = negotiated(&self.cm, self.features)?;
        let key = cm.find(&self.objects, req.id.to_native())?;
        if req.reserved != [0; 3] {
            return Err(Refusal::Reserved.into());
        }
        if !matches!(req.qp_state, qp_state::INIT | qp_state::RTR | qp_state::RTS) {
            return Err(Refusal::NoSuchQpState(req.qp_state.into()).into());
        }
        let command = CmCommand::InitQpAttr;
        let (attr, mask) = cm.run(key, command, |table| {
            let id = &table.entry(key)?.id;
            cm.check_device(id, command)?;
            id.init_qp_attr(req.qp_state.into()).map_err(host(command))
        })?;
        log::debug!(
            "CM QP attributes for state {}: mask {mask:#x}, {attr:?}",
            req.qp_state
        );
        let mask = mask & qp_attr_mask::SUPPORTED;
        let mut attr = cm.guest_view(attr, mask)?;
        // Only the access rights of SPEC.md §5.11: the host's connection manager may add
        // its own (the flush rights of newer kernels), and atomics only where negotiated.
        let mut rights = ctrl::access::ALL;
        if self.features & vrdma_spec::config::features::ATOMIC == 0 {
            rights &= !ctrl::access::REMOTE_ATOMIC;
        }
        attr.qp_access_flags = Le32::from(attr.qp_access_flags.to_native() & rights);
        reply(ModifyQpRequest {
            handle: Le32::from(0),
            attr_mask: Le32::from(mask),
            attr,
        })
    }

    fn cm_query(&mut self, req: HandleRequest) -> CommandResult {
        let cm = negotiated(&self.cm, self.features)?;
        let key = cm.find(&self.objects, req.handle.to_native())?;
        id_info(cm, key)
    }

    fn cm_get_event(&mut self, req: HandleRequest) -> CommandResult {
        let cm = negotiated(&self.cm, self.features)?;
        let key = cm.find(&self.objects, req.handle.to_native())?;
        let mut table = lock(&cm.table);
        let entry = table.ids.get_mut(&key).ok_or(Refusal::BadHandle {
            kind: "CM id",
            handle: req.handle.to_native(),
        })?;
        let Some(queued) = entry.events.pop_front() else {
            return reply(WireCmEvent {
                event: Le32::from(cm_event::NONE),
                ..WireCmEvent::default()
            });
        };
        let pending = entry.events.len();
        if queued.new_key.is_some() {
            entry.requests = entry.requests.saturating_sub(1);
        }
        // The peer's address vector, as the guest names sources: by its one GID (the host
        // leaves the source of a received request's vector unresolved).
        let ah_attr = match queued.ud_ah {
            Some(ah) => ctrl::AhAttr::from(&AhAttr {
                sgid_index: GUEST_GID_INDEX,
                port_num: PORT_NUM,
                ..ah
            }),
            None => ctrl::AhAttr::default(),
        };
        // The request's id becomes the guest's now, with a handle of its own.
        let mut new_handle = 0;
        let mut announce_new = false;
        if let Some(child) = queued.new_key.and_then(|k| table.ids.get_mut(&k)) {
            new_handle = self.objects.new_handle();
            child.handle = Some(new_handle);
            announce_new = !child.events.is_empty();
            self.objects
                .cm_ids
                .insert(new_handle, queued.new_key.unwrap_or_default());
        }
        drop(table);
        if announce_new {
            self.data_path
                .event_raiser()
                .raise(event_kind::CM_EVENT, new_handle);
        }
        reply(WireCmEvent {
            event: Le32::from(queued.event),
            // The wire holds librdmacm's signed status as its two's complement bits.
            status: Le32::from(queued.status.cast_unsigned()),
            new_id: Le32::from(new_handle),
            pending: Le32::from(u32::try_from(pending).unwrap_or(u32::MAX)),
            // What the host gave fits the wire: its lengths are bytes.
            param: queued.param.to_wire().unwrap_or_default(),
            ah_attr,
        })
    }
}

/// The addresses and route of the id keyed `key` (CM_QUERY's and CM_BIND's response).
fn id_info(cm: &ConnectionManager, key: u64) -> CommandResult {
    let info = cm.with_entry(key, |e| Ok(e.id.info()))?;
    let addr = |a: Option<SocketAddrV4>| a.map(CmAddr::ipv4).unwrap_or_default();
    let bound = info.device.as_deref() == Some(cm.device.as_str());
    reply(WireCmIdInfo {
        src: addr(info.src),
        dst: addr(info.dst),
        sgid: if bound { info.sgid.0 } else { [0; 16] },
        dgid: info.dgid.0,
        pkey: info.pkey.into(),
        path_mtu: info.path_mtu,
        num_paths: info.num_paths,
        port_num: if bound { PORT_NUM } else { 0 },
        reserved: [0; 3],
    })
}

#[cfg(test)]
mod tests;
