//! The vrdma device logic of one guest connection: control commands (SPEC.md §5), validated
//! and executed on host verbs. It knows nothing of vhost-user: requests come in as bytes, guest
//! memory as any [`GuestMemoryBackend`].

mod cm;
pub mod cm_state;
mod local_peers;
mod objects;
mod queues;
mod refusal;
mod report;
pub mod validate;

use std::sync::Arc;

use vm_memory::GuestMemoryBackend;
use vrdma_spec::codec::{
    doorbell_bitmap_bits, doorbell_bitmap_bytes, notify_area_bytes, MAX_DOORBELL_AREAS,
};
use vrdma_spec::config::{features, DeviceConfig};
use vrdma_spec::ctrl::{
    device_cap, gid_type, AddDoorbellAreaRequest, CreateAhRequest, CreateCqRequest,
    CreateQpRequest, CreateQpResponse, CreateSrqRequest, CreateSrqResponse, CreatedResponse,
    DeviceAttr as WireDeviceAttr, HandleRequest, ModifyQpRequest, ModifySrqRequest, Opcode,
    PortAttr as WirePortAttr, QpAttr as WireQpAttr, QueryGidRequest, QueryGidResponse,
    QueryPortRequest, RegMrRequest, RegMrResponse, RequestHeader, ResizeCqRequest, ResponseHeader,
    SetNotifyAreaRequest, Status, GUEST_GID_INDEX, GUEST_GID_TABLE_LEN, PORT_NUM,
};
use vrdma_spec::ring::{CqDoorbell, NotifyState, QpDoorbell, SrqDoorbell, CQE_SHIFT};
use vrdma_spec::{ByteValued, Le16, Le32, Le64};

use crate::datapath::wqe::{MrRange, QpRules};
use crate::datapath::{
    AreaInUse, CqData, DataPath, GuestRing, NoBit, NotifyArea, PollerPool, QpData, ResizeCqError,
    SrqData,
};
use crate::guest_faults::FaultDomain;
use crate::guest_mapping;
use crate::hostverbs::{self, AhAttr, GidType, PortAttr, QpAttr, QpCaps, QpInit, QpType};
use crate::mtt::{self, pages_needed, PageListRules};
use crate::{limits, Config, HostDevice};
pub use local_peers::LocalPeers;
pub use objects::Objects;
use objects::{AhEntry, CqEntry, MrEntry, QpEntry, SrqEntry};
pub use refusal::{CommandError, Refusal, RefusalLog};
pub use report::{GuestReport, GuestState, QpReport, Relayed, Usage};

type CommandResult = Result<Vec<u8>, CommandError>;

/// One guest connection's device: its own host context, its objects, its negotiated state.
pub struct Device {
    host: HostDevice,
    host_attr: hostverbs::DeviceAttr,
    /// The port as it was when the connection began; guides validation.
    port: PortAttr,
    config: DeviceConfig,
    /// What the device offers; fixed for the connection.
    offered: u64,
    /// What the driver acknowledged (of `offered`): what commands are checked against.
    features: u64,
    quotas: crate::Quotas,
    objects: Objects,
    data_path: DataPath,
    /// The connection's failed commands, counted by rule.
    refusals: RefusalLog,
    /// What of the backend's mapping of guest RAM registrations have populated.
    populated: guest_mapping::PopulatedRanges,
    /// The guest's memory as far as faults go: a fault in any mapping of it ends this
    /// connection ([`crate::guest_faults`]).
    fault_domain: Arc<FaultDomain>,
    /// The RC QPs of every guest of the backend, and this connection's identity among them.
    peers: Arc<LocalPeers>,
    connection: u64,
    /// Connection management on the guest's own address, where it has one (SPEC.md §13).
    cm: Option<cm::ConnectionManager>,
}

/// Whether `bytes` more of `kind` fit a quota of `quota` bytes with `used` in use.
fn check_byte_quota(
    kind: &'static str,
    bytes: u64,
    used: u64,
    quota: u64,
) -> Result<(), CommandError> {
    if used.saturating_add(bytes) > quota {
        return Err(Refusal::ByteQuota {
            kind,
            bytes,
            quota,
            used,
        }
        .into());
    }
    Ok(())
}

fn reply<T: ByteValued>(value: T) -> CommandResult {
    Ok(value.as_slice().to_vec())
}

fn no_doorbell_bit(area: u32) -> impl FnOnce(NoBit) -> CommandError {
    move |why| match why {
        NoBit::UnknownArea => unknown_doorbell_area(area).into(),
        NoBit::Full => Refusal::NoDoorbellBit.into(),
    }
}

fn unknown_doorbell_area(area: u32) -> Refusal {
    Refusal::BadHandle {
        kind: "doorbell area",
        handle: area,
    }
}

/// The framing of a control request (SPEC.md §5.1): its opcode and payload, given the bytes
/// the driver wrote and `room` bytes for the response payload.
pub fn frame_request(readable: &[u8], room: usize) -> Result<(Opcode, &[u8]), Refusal> {
    let header_len = std::mem::size_of::<RequestHeader>();
    if readable.len() < header_len {
        return Err(Refusal::ShortRequest);
    }
    let header: RequestHeader = parse(readable);
    let opcode = Opcode::try_from(header.opcode.to_native()).map_err(Refusal::UnknownOpcode)?;
    let flags = header.flags.to_native();
    if flags != 0 {
        return Err(Refusal::UnknownBits {
            field: "request flags",
            value: flags.into(),
            bits: flags.into(),
        });
    }
    let length = header.length.to_native() as usize;
    if length != opcode.request_size() || readable.len() - header_len < length {
        return Err(Refusal::RequestLength {
            opcode,
            length,
            present: readable.len() - header_len,
            expected: opcode.request_size(),
        });
    }
    if room < opcode.response_size() {
        return Err(Refusal::ResponseRoom {
            opcode,
            room,
            needed: opcode.response_size(),
        });
    }
    Ok((opcode, &readable[header_len..header_len + length]))
}

/// A wire struct from request bytes whose length `frame_request` has already checked.
fn parse<T: ByteValued + Default>(payload: &[u8]) -> T {
    vrdma_spec::read_wire(payload).expect("the request length was checked")
}

impl Device {
    /// Opens a host context of its own for one guest connection.
    pub fn new(
        config: &Config,
        pool: &Arc<PollerPool>,
        peers: &Arc<LocalPeers>,
    ) -> Result<Device, crate::Error> {
        let host = HostDevice::open(config)?;
        let host_attr = host.context.query_device()?;
        let port = host.context.query_port(host.port)?;
        let advertised =
            limits::advertised_config(&host_attr, &config.quotas, config.notify_queues);
        let doorbell_bits = doorbell_bitmap_bits(
            advertised.max_qp.to_native(),
            advertised.max_srq.to_native(),
        );
        let data_path = DataPath::new(
            &host.context,
            pool,
            (advertised.num_notify_queues.to_native(), doorbell_bits),
            host.port,
        )?;
        data_path.set_rate_limits(config.rate_limits);
        let cm = Self::connection_manager(config, &host, &advertised, &data_path);
        let offered =
            limits::offered_features(&host_attr) | if cm.is_some() { features::CM } else { 0 };
        Ok(Device {
            cm,
            refusals: RefusalLog::new(data_path.log_budget().clone()),
            data_path,
            quotas: config.quotas,
            offered,
            features: offered,
            host,
            host_attr,
            port,
            config: advertised,
            objects: Objects::new(),
            populated: guest_mapping::PopulatedRanges::default(),
            fault_domain: FaultDomain::new("a connection starting"),
            connection: peers.new_connection(),
            peers: Arc::clone(peers),
        })
    }

    /// The connection manager of a guest with an address of its own; `None` (and the
    /// feature not offered) otherwise. On the loopback host the address is the loopback's
    /// own (held in its address table while the connection lasts); elsewhere it is on the
    /// host device's network interface.
    fn connection_manager(
        config: &Config,
        host: &HostDevice,
        advertised: &DeviceConfig,
        data_path: &DataPath,
    ) -> Option<cm::ConnectionManager> {
        let ip = config.guest_ip?;
        let quota = advertised.max_qp.to_native() as usize;
        let device = (config.device.as_str(), host.port, host.gid_index);
        match cm::ConnectionManager::new(ip.address, device, quota, data_path.event_raiser()) {
            Ok(cm) => Some(cm),
            Err(e) => {
                log::warn!("connection management not offered to the guest at {ip}: {e} (is the rdma_ucm module loaded?)");
                None
            }
        }
    }

    /// The configuration space (SPEC.md §3).
    pub fn config(&self) -> &DeviceConfig {
        &self.config
    }

    /// Feature bits the device offers.
    pub fn offered_features(&self) -> u64 {
        self.offered
    }

    /// Records the features the driver acknowledged.
    pub fn set_acked_features(&mut self, acked: u64) {
        // Each SET_FEATURES (a driver negotiates again after a reset) replaces the last.
        self.features = self.offered & (acked | features::VERSION_1);
    }

    /// The guest's memory table changed: the backend's mappings of guest RAM are new.
    pub fn memory_changed(&mut self) {
        self.populated.clear();
    }

    /// The guest's memory as far as faults go ([`crate::guest_faults`]).
    pub fn fault_domain(&self) -> &Arc<FaultDomain> {
        &self.fault_domain
    }

    /// The data path serving this connection's rings.
    pub fn data_path(&self) -> &DataPath {
        &self.data_path
    }

    /// Destroys every object of the connection (device reset, SPEC.md §5.3.1).
    pub fn reset(&mut self) {
        if let Some(cm) = &self.cm {
            cm.clear();
        }
        self.data_path.clear();
        let count = self.objects.count();
        self.objects = Objects::new();
        if count > 0 {
            self.data_path
                .log_budget()
                .info(|| format!("device reset: destroyed {count} objects"));
        }
    }

    /// RESET (SPEC.md §9): the driver starts afresh; every object it held goes.
    fn reset_command(&mut self) -> CommandResult {
        if self.features & features::RESET_COMMAND == 0 {
            return Err(Refusal::NotNegotiated("RESET").into());
        }
        self.reset();
        Ok(Vec::new())
    }

    /// The hypervisor stopped the device's queues (GET_VRING_BASE of the control queue):
    /// a reset for a driver that does not say when it resets, and nothing at all for one
    /// that does (VRDMA_F_RESET_COMMAND: the VM is paused or moved, SPEC.md §9), whose
    /// objects, rings and pending events wait for the queues to start again.
    pub fn queues_stopped(&mut self) {
        if self.features & features::RESET_COMMAND == 0 {
            self.reset();
        }
    }

    /// Objects the connection holds.
    pub fn object_count(&self) -> usize {
        self.objects.count()
    }

    /// The connection's failed commands so far.
    pub fn refusals(&self) -> &RefusalLog {
        &self.refusals
    }

    /// Processes one control request (SPEC.md §5.1): `readable` is the device-readable part of
    /// the chain, `writable_len` the room in its writable part. Returns the bytes to write
    /// back (empty when not even a response header fits).
    pub fn process_request<M: GuestMemoryBackend>(
        &mut self,
        mem: &M,
        readable: &[u8],
        writable_len: usize,
    ) -> Vec<u8> {
        let header_len = std::mem::size_of::<ResponseHeader>();
        if writable_len < header_len {
            self.note_failure(&Refusal::NoResponseRoom { room: writable_len }.into());
            return Vec::new();
        }
        let (status, detail, payload) = match self.execute(mem, readable, writable_len - header_len)
        {
            Ok(payload) => (Status::Ok, 0, payload),
            Err(e) => {
                self.note_failure(&e);
                (e.status(), e.detail(), Vec::new())
            }
        };
        let header = ResponseHeader {
            status: Le16::from(status as u16),
            reserved: Le16::from(0),
            detail: Le32::from(detail),
        };
        let mut out = header.as_slice().to_vec();
        out.extend_from_slice(&payload);
        out
    }

    /// A control chain the driver got wrong, so badly that no response could be written.
    pub fn note_malformed_chain(&mut self, head: u16, error: &std::io::Error) {
        let reason = error.to_string();
        self.note_failure(&Refusal::MalformedChain { head, reason }.into());
    }

    fn note_failure(&mut self, error: &CommandError) {
        if let Some(line) = self.refusals.record(error, std::time::Instant::now()) {
            log::warn!("{line}");
        }
    }

    fn execute<M: GuestMemoryBackend>(
        &mut self,
        mem: &M,
        readable: &[u8],
        room: usize,
    ) -> CommandResult {
        let (opcode, payload) = frame_request(readable, room)?;
        let query_or_setup = matches!(
            opcode,
            Opcode::QueryDevice
                | Opcode::QueryPort
                | Opcode::QueryGid
                | Opcode::SetNotifyArea
                | Opcode::Reset
        );
        if !query_or_setup && self.data_path.notify_area().is_none() {
            return Err(Refusal::NoNotifyArea.into());
        }
        match opcode {
            Opcode::QueryDevice => self.query_device(),
            Opcode::QueryPort => self.query_port(parse(payload)),
            Opcode::QueryGid => self.query_gid(parse(payload)),
            Opcode::AllocPd => self.alloc_pd(),
            Opcode::DeallocPd => self
                .objects
                .remove_pd(parse::<HandleRequest>(payload).handle.to_native())
                .map(|_| Vec::new()),
            Opcode::CreateCq => self.create_cq(mem, parse(payload)),
            Opcode::DestroyCq => self.destroy_cq(parse(payload)),
            Opcode::ResizeCq => self.resize_cq(mem, parse(payload)),
            Opcode::RegMr => self.reg_mr(mem, parse(payload)),
            Opcode::DeregMr => self.dereg_mr(parse(payload)),
            Opcode::CreateQp => self.create_qp(mem, parse(payload)),
            Opcode::ModifyQp => self.modify_qp(parse(payload)),
            Opcode::QueryQp => self.query_qp(parse(payload)),
            Opcode::DestroyQp => self.destroy_qp(parse(payload)),
            Opcode::CreateAh => self.create_ah(parse(payload)),
            Opcode::DestroyAh => self.destroy_ah(parse(payload)),
            Opcode::SetNotifyArea => self.set_notify_area(mem, parse(payload)),
            Opcode::AddDoorbellArea => self.add_doorbell_area(mem, parse(payload)),
            Opcode::DestroyDoorbellArea => self.destroy_doorbell_area(parse(payload)),
            Opcode::CreateSrq => self.create_srq(mem, parse(payload)),
            Opcode::DestroySrq => self.destroy_srq(parse(payload)),
            Opcode::ModifySrq => self.modify_srq(parse(payload)),
            Opcode::Reset => self.reset_command(),
            Opcode::CmCreateId
            | Opcode::CmDestroyId
            | Opcode::CmBind
            | Opcode::CmResolveAddr
            | Opcode::CmResolveRoute
            | Opcode::CmListen
            | Opcode::CmConnect
            | Opcode::CmAccept
            | Opcode::CmReject
            | Opcode::CmDisconnect
            | Opcode::CmEstablish
            | Opcode::CmInitQpAttr
            | Opcode::CmQuery
            | Opcode::CmGetEvent => self.cm_command(opcode, payload),
        }
    }

    fn query_device(&self) -> CommandResult {
        let h = &self.host_attr;
        let c = &self.config;
        reply(WireDeviceAttr {
            node_guid: Le64::from(h.node_guid),
            sys_image_guid: Le64::from(h.sys_image_guid),
            max_mr_size: c.max_mr_size,
            page_size_cap: c.page_size_cap,
            vendor_id: Le32::from(h.vendor_id),
            vendor_part_id: Le32::from(h.vendor_part_id),
            hw_ver: Le32::from(h.hw_ver),
            max_qp: c.max_qp,
            max_qp_wr: c.max_qp_wr,
            device_cap_flags: Le32::from(h.device_cap_flags & device_cap::HONOURED),
            max_sge: c.max_sge,
            max_cq: c.max_cq,
            max_cqe: c.max_cqe,
            max_mr: c.max_mr,
            max_pd: c.max_pd,
            max_qp_rd_atom: c.max_qp_rd_atom,
            max_qp_init_rd_atom: c.max_qp_init_rd_atom,
            max_ah: c.max_ah,
            max_srq: c.max_srq,
            max_srq_wr: c.max_srq_wr,
            max_srq_sge: c.max_sge,
            atomic_cap: Le32::from(if self.features & features::ATOMIC != 0 {
                h.atomic_cap
            } else {
                0
            }),
            max_inline_data: c.max_inline_data,
            phys_port_cnt: Le32::from(1),
            reserved: Default::default(),
        })
    }

    fn check_port(&self, port: u8) -> Result<(), CommandError> {
        if port != PORT_NUM {
            return Err(Refusal::NoSuchPort(port).into());
        }
        Ok(())
    }

    fn query_port(&self, req: QueryPortRequest) -> CommandResult {
        self.check_port(req.port)?;
        // Live state (a link can go down), limits as checked at connection time.
        let a = self.host.context.query_port(self.host.port)?;
        reply(WirePortAttr {
            state: host_byte("port state", a.state)?,
            max_mtu: host_byte("port max MTU", a.max_mtu)?,
            active_mtu: host_byte("port active MTU", a.active_mtu)?,
            link_layer: a.link_layer,
            phys_state: a.phys_state,
            active_width: a.active_width,
            active_speed: a.active_speed,
            reserved0: 0,
            gid_tbl_len: Le32::from(GUEST_GID_TABLE_LEN),
            port_cap_flags: Le32::from(a.port_cap_flags),
            max_msg_sz: Le32::from(a.max_msg_sz),
            pkey_tbl_len: Le16::from(a.pkey_tbl_len),
            lid: Le16::from(a.lid),
            gid_index: Le32::from(u32::from(GUEST_GID_INDEX)),
            reserved: Le32::from(0),
        })
    }

    /// The guest's table holds one entry, the GID the operator assigned to it; the host's
    /// table and indexes stay hidden.
    fn query_gid(&self, req: QueryGidRequest) -> CommandResult {
        self.check_port(req.port)?;
        let index = req.index.to_native();
        if index != u32::from(GUEST_GID_INDEX) {
            return Err(Refusal::GidIndex(index).into());
        }
        let (gid, kind) = self
            .host
            .context
            .query_gid(self.host.port, self.host.gid_index.into())?;
        if gid != self.host.gid {
            // The host's table changed under the guest (its address was taken away).
            return Err(CommandError::Host {
                status: Status::HostError,
                errno: libc::ENODATA as u32,
                message: format!("the guest's GID {} is gone from the host", self.host.gid),
            });
        }
        reply(QueryGidResponse {
            gid: gid.0,
            gid_type: match kind {
                GidType::Ib => gid_type::IB,
                GidType::RoceV1 => gid_type::ROCE_V1,
                GidType::RoceV2 => gid_type::ROCE_V2,
            },
            reserved: Default::default(),
        })
    }

    fn check_quota(&self, kind: &'static str, held: usize, max: Le32) -> Result<(), CommandError> {
        let max = max.to_native();
        if held >= max as usize {
            return Err(Refusal::Quota { kind, max }.into());
        }
        Ok(())
    }

    fn alloc_pd(&mut self) -> CommandResult {
        self.check_quota("PD", self.objects.pds.len(), self.config.max_pd)?;
        let pd = self.host.context.alloc_pd()?;
        let handle = self.objects.insert_pd(pd);
        reply(CreatedResponse {
            handle: Le32::from(handle),
            value: Le32::from(0),
        })
    }

    fn page_rules(&self) -> PageListRules {
        PageListRules {
            page_size_cap: self.config.page_size_cap.to_native(),
            indirect_allowed: self.features & features::INDIRECT_PAGE_LIST != 0,
        }
    }

    /// The guest pages of a ring of `depth` slots of `1 << stride_shift` bytes described by
    /// `list`, starting at offset 0 of its first page.
    fn ring<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        list: &vrdma_spec::mem::PageList,
        depth: u32,
        stride_shift: u8,
    ) -> Result<GuestRing, CommandError> {
        let bytes = u64::from(depth) << stride_shift;
        let expected =
            pages_needed(0, bytes, list.page_shift).ok_or(Refusal::Overflow("ring size"))?;
        let runs = mtt::resolve_page_list(mem, list, expected, &self.page_rules())?;
        let page_size = 1u64 << list.page_shift;
        let gpas: Vec<u64> = runs.iter().flat_map(|run| run.gpas(page_size)).collect();
        // One page listed many times would let a small guest buffer stand for a huge queue
        // on the host.
        let mut distinct = gpas.clone();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() != gpas.len() {
            return Err(Refusal::RepeatedRingPage.into());
        }
        Ok(GuestRing::new(gpas, list.page_shift, stride_shift, depth))
    }

    /// Whether `bytes` more of rings fit the guest's ring quota.
    fn check_ring_quota(&self, bytes: u64) -> Result<(), CommandError> {
        check_byte_quota(
            "rings",
            bytes,
            self.objects.ring_bytes,
            self.quotas.max_ring_bytes,
        )
    }

    fn create_ah(&mut self, req: CreateAhRequest) -> CommandResult {
        if self.features & features::UD == 0 {
            return Err(Refusal::NotNegotiated("UD").into());
        }
        self.check_quota("AH", self.objects.ahs.len(), self.config.max_ah)?;
        let pd_handle = req.pd.to_native();
        let pd = Arc::clone(&self.objects.pd(pd_handle)?.pd);
        let attr = validate::ah_attr(&req.attr, &self.port, self.host.gid_index)?;
        let ah = Arc::new(pd.create_ah(&attr)?);
        let handle = self.objects.insert_ah(AhEntry {
            ah: Arc::clone(&ah),
            pd: pd_handle,
        });
        self.data_path.add_ah(handle, pd_handle, ah);
        reply(CreatedResponse {
            handle: Le32::from(handle),
            value: Le32::from(0),
        })
    }

    fn destroy_ah(&mut self, req: HandleRequest) -> CommandResult {
        let handle = req.handle.to_native();
        self.objects.remove_ah(handle)?;
        self.data_path.remove_ah(handle);
        Ok(Vec::new())
    }

    fn set_notify_area<M: GuestMemoryBackend>(
        &mut self,
        mem: &M,
        req: SetNotifyAreaRequest,
    ) -> CommandResult {
        if self.data_path.notify_area().is_some() {
            return Err(Refusal::NotifyAreaSet.into());
        }
        let bitmap_bytes = doorbell_bitmap_bytes(
            self.config.max_qp.to_native(),
            self.config.max_srq.to_native(),
        );
        let (states, bitmap) = (req.addr.to_native(), req.doorbell_bitmap.to_native());
        let place = self.doorbell_place(mem, states, bitmap, bitmap_bytes)?;
        self.data_path.set_notify_area(Some(place));
        Ok(Vec::new())
    }

    /// ADD_DOORBELL_AREA (SPEC.md §8.6).
    fn add_doorbell_area<M: GuestMemoryBackend>(
        &mut self,
        mem: &M,
        req: AddDoorbellAreaRequest,
    ) -> CommandResult {
        if self.features & features::DOORBELL_AREAS == 0 {
            return Err(Refusal::NotNegotiated("DOORBELL_AREAS").into());
        }
        let bits = req.bits.to_native();
        let max_bits = doorbell_bitmap_bits(
            self.config.max_qp.to_native(),
            self.config.max_srq.to_native(),
        );
        if bits == 0 || !bits.is_multiple_of(64) || bits > max_bits {
            return Err(Refusal::OutOfRange {
                field: "doorbell area bits (a multiple of 64)",
                value: bits.into(),
                min: 64,
                max: max_bits.into(),
            }
            .into());
        }
        let place = self.doorbell_place(
            mem,
            req.addr.to_native(),
            req.doorbell_bitmap.to_native(),
            u64::from(bits / 8),
        )?;
        let area = self
            .data_path
            .add_doorbell_area(place, bits)
            .ok_or(Refusal::Quota {
                kind: "doorbell area",
                max: MAX_DOORBELL_AREAS,
            })?;
        reply(CreatedResponse {
            handle: Le32::from(area),
            value: Le32::from(bits),
        })
    }

    /// DESTROY_DOORBELL_AREA (SPEC.md §8.6).
    fn destroy_doorbell_area(&mut self, req: HandleRequest) -> CommandResult {
        if self.features & features::DOORBELL_AREAS == 0 {
            return Err(Refusal::NotNegotiated("DOORBELL_AREAS").into());
        }
        let area = req.handle.to_native();
        match self.data_path.remove_doorbell_area(area) {
            Ok(()) => Ok(Vec::new()),
            Err(AreaInUse::Unknown) => Err(unknown_doorbell_area(area).into()),
            Err(AreaInUse::Busy(users)) => Err(Refusal::Busy {
                kind: "doorbell area",
                handle: area,
                users,
            }
            .into()),
        }
    }

    /// The doorbell area a CREATE_QP or CREATE_SRQ names (SPEC.md §8.6): 0, or one the
    /// driver added (the field is reserved without DOORBELL_AREAS).
    fn doorbell_area(&self, area: u32) -> Result<u32, Refusal> {
        // Naming an area uses a capability (SPEC.md §2), not a reserved field.
        if area != 0 && self.features & features::DOORBELL_AREAS == 0 {
            return Err(Refusal::NotNegotiated("doorbell areas"));
        }
        Ok(area)
    }

    /// Checks a doorbell area's notify states at `states` and bitmap of `bitmap_bytes` at
    /// `bitmap` (SPEC.md §8.5): where the pollers may store and swap.
    fn doorbell_place<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        states: u64,
        bitmap: u64,
        bitmap_bytes: u64,
    ) -> Result<NotifyArea, CommandError> {
        let len = notify_area_bytes(self.config.num_notify_queues.to_native());
        if states % 4096 + len > 4096 {
            return Err(Refusal::NotifyAreaCrossesPage.into());
        }
        validate::guest_record::<M, NotifyState>(mem, "notify area", states, 64)?;
        validate::guest_range(mem, states, len)?;
        validate::guest_record::<M, u64>(mem, "doorbell bitmap", bitmap, 64)?;
        validate::guest_range(mem, bitmap, bitmap_bytes)?;
        // Pollers take rung bits with atomic swaps on the backend's mapping of the bitmap.
        if mem
            .get_slice(
                vm_memory::GuestAddress(bitmap),
                usize::try_from(bitmap_bytes).map_err(|_| Refusal::Overflow("doorbell bitmap"))?,
            )
            .is_err()
        {
            return Err(Refusal::BitmapNotContiguous.into());
        }
        Ok(NotifyArea {
            states,
            doorbell_bitmap: bitmap,
        })
    }
}

/// The shape a validated CREATE_QP describes.
pub struct QpShape {
    qp_type: QpType,
    caps: QpCaps,
}

/// A value the host reports as a verbs enum (`ibv_port_state`, `ibv_mtu`), as the wire's byte
/// holds it; a host value beyond a byte is an error of the host, never wrapped.
fn host_byte(what: &str, value: u32) -> Result<u8, crate::hostverbs::Error> {
    u8::try_from(value).map_err(|_| {
        crate::hostverbs::Error::InvalidArgument(format!(
            "the host's {what} {value} is not a verbs value"
        ))
    })
}
