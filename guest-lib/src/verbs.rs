//! The verbs API: typed objects over the device's control commands, each destroyed on the
//! device when dropped. Children keep their parents alive (a QP its PD and CQs, an MR its PD).

pub mod cm;
mod cq;
mod posting;
mod qp;
pub mod work;

pub use cq::CompletionQueue;
use cq::{CqConsumer, CqInner};
pub use posting::{encode_recv, encode_send, Chain, SendShape};
use qp::WorkQueue;
pub use qp::{QueuePair, QueuePairBuilder, RcPeer, SharedReceiveQueue};

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vrdma_spec::codec::{
    doorbell_bitmap_bytes, doorbell_word, notify_area_bytes, notify_state_offset, recv_wqe_shift,
    ring_pending, ring_slot, send_wqe_shift, sge_offset, ArmRequest, SendHeader, UdAddress,
    WqePayload, RECV_WQE_HEADER, SEND_WQE_HEADER,
};
use vrdma_spec::config::{features, DeviceConfig};
use vrdma_spec::ctrl::{
    qp_type, CreateAhRequest, CreateCqRequest, CreateQpRequest, CreateQpResponse, CreateSrqRequest,
    CreateSrqResponse, CreatedResponse, DeviceAttr, HandleRequest, ModifyQpRequest,
    ModifySrqRequest, Opcode, PortAttr, QpAttr as WireQpAttr, QueryGidRequest, QueryGidResponse,
    QueryPortRequest, RegMrRequest, RegMrResponse, ResizeCqRequest, ResponseHeader,
    SetNotifyAreaRequest, Status,
};
use vrdma_spec::mem::{PageList, PageListForm, MAX_DIRECT_PAGES, PAGE_LIST_ENTRIES_PER_PAGE};
use vrdma_spec::ring::{
    cqe_is_valid, event_kind, resized_cq_owner, CqDoorbell, Cqe, QpDoorbell, RecvWqe, SendWqe,
    Sge as WireSge, SrqDoorbell, CQE_SIZE, NOTIFY_NEED_WAKEUP,
};
use vrdma_spec::{read_wire, ByteValued, Gid, Le16, Le32, Le64};

use crate::direct::{DirectOptions, DirectTransport};
use crate::fork::OpenedBy;
use crate::shm::{SharedBuffer, PAGE_SIZE};
use crate::transport::Transport;
use crate::{Error, Result};
use work::{DeviceEvent, Payload, RecvWr, SendWr, WorkCompletion};

struct DeviceInner {
    /// Reached through [`DeviceInner::transport`], which refuses a forked child and a device
    /// that went away.
    raw_transport: Box<dyn Transport>,
    notify_area: SharedBuffer,
    doorbell_bitmap: SharedBuffer,
    kicks: AtomicU64,
    /// Times a poll of an empty CQ gave up the CPU ([`Device::polling_yields`]).
    yields: AtomicU64,
    /// The process that opened the device: only it may use it ([`crate::fork`]).
    opened_by: OpenedBy,
    /// The device is gone (its connection ended, it failed or was reset): requests, posts and
    /// polls fail from now on, so that no program waits for completions that cannot come.
    lost: AtomicBool,
}

/// A vrdma device, reached through a transport.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

/// An empty request or response payload.
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Empty;
// SAFETY: a zero-sized type has no bytes, so no invalid ones and no padding.
unsafe impl ByteValued for Empty {}

impl DeviceInner {
    fn new(
        transport: Box<dyn Transport>,
        notify_area: SharedBuffer,
        doorbell_bitmap: SharedBuffer,
        opened_by: OpenedBy,
    ) -> DeviceInner {
        DeviceInner {
            raw_transport: transport,
            notify_area,
            doorbell_bitmap,
            kicks: AtomicU64::new(0),
            yields: AtomicU64::new(0),
            opened_by,
            lost: AtomicBool::new(false),
        }
    }

    /// The configuration space the device reported.
    fn config(&self) -> &DeviceConfig {
        self.raw_transport.config()
    }

    /// The transport, for a request to the device: refused, with nothing sent, in a child
    /// forked from the process that opened the device, and once the device is gone.
    fn transport(&self) -> Result<&dyn Transport> {
        if !self.opened_by.is_this_process() {
            return Err(Error::Forked);
        }
        if self.lost.load(Ordering::Relaxed) {
            return Err(Error::Disconnected);
        }
        Ok(&*self.raw_transport)
    }

    /// Whether the data path (posting, polling, arming) may run: as [`DeviceInner::transport`],
    /// with the cheap fork check.
    fn check_data_path(&self) -> Result<()> {
        if !self.opened_by.is_this_process_fast() {
            return Err(Error::Forked);
        }
        if self.lost.load(Ordering::Relaxed) {
            return Err(Error::Disconnected);
        }
        Ok(())
    }

    /// Notes that the device is gone when `result` says so; passes it on.
    fn noting_loss<T>(&self, result: Result<T>) -> Result<T> {
        if let Err(Error::Disconnected | Error::DeviceReset) = &result {
            self.lost.store(true, Ordering::Relaxed);
        }
        result
    }

    /// Looks whether the device went away meanwhile (its connection closed), for a program
    /// that only polls: it then learns it without a request.
    fn look_for_loss(&self) -> Result<()> {
        if self.opened_by.is_this_process_fast() && self.raw_transport.disconnected() {
            self.lost.store(true, Ordering::Relaxed);
        }
        self.check_data_path()
    }

    /// After a doorbell update: sets the queue's doorbell `bit`, and kicks `queue` only if
    /// its poller said it is going to sleep (SPEC.md §8.5). The bit is set with a
    /// read-modify-write even when it looks set already: a poller may be taking it at that
    /// moment, before this update's producer index was visible. The fence orders the bit
    /// before the flag load.
    fn ring_doorbell(&self, queue: u32, bit: u16) -> Result<()> {
        let (offset, mask) = doorbell_word(bit);
        self.doorbell_bitmap
            .atomic_u64(offset)?
            .fetch_or(mask, Ordering::Release);
        fence(Ordering::SeqCst);
        let offset = notify_state_offset(queue);
        let flags = self.notify_area.atomic_u32(offset)?.load(Ordering::SeqCst);
        if flags & NOTIFY_NEED_WAKEUP != 0 {
            self.kicks.fetch_add(1, Ordering::Relaxed);
            let kicked = self.raw_transport.notify(queue);
            self.noting_loss(kicked)?;
            // Where the woken poller shares this CPU (direct attach on a busy host), it runs
            // now rather than after the rest of this thread's scheduler slice.
            std::thread::yield_now();
        }
        Ok(())
    }

    fn command<Req: ByteValued, Resp: ByteValued + Default>(
        &self,
        opcode: Opcode,
        request: &Req,
    ) -> Result<Resp> {
        let response = self.noting_loss(self.transport()?.command(opcode, request.as_slice()))?;
        if response.status == Status::NotReady {
            return self.noting_loss(Err(Error::DeviceReset));
        }
        let payload = response.accepted()?;
        let malformed = Error::BadResponse {
            opcode,
            len: std::mem::size_of::<ResponseHeader>() + payload.len(),
        };
        if payload.len() != std::mem::size_of::<Resp>() {
            return Err(malformed);
        }
        read_wire(&payload).ok_or(malformed)
    }

    /// Destroys `handle` with `opcode`; used by Drop, where an error can only be logged.
    fn destroy(&self, opcode: Opcode, handle: u32) {
        let request = HandleRequest {
            handle: Le32::from(handle),
            reserved: Le32::from(0),
        };
        match self.command::<_, Empty>(opcode, &request) {
            Ok(_) => {}
            // Nothing to destroy: the device is gone with everything on it, or this is a
            // forked child's copy of its parent's object (the parent's stays).
            Err(Error::Disconnected | Error::DeviceReset | Error::Forked) => {}
            Err(e) => log::error!("{opcode:?} of handle {handle:#x}: {e}"),
        }
    }

    /// A page list for `addr..addr + len` of shared memory, and the list pages it lives in.
    fn page_list(&self, addr: u64, len: u64) -> Result<(PageList, Vec<SharedBuffer>)> {
        let transport = self.transport()?;
        let (page_size, pages) = transport
            .device_pages(addr, len)
            .ok_or(Error::NotShared { addr, len })?;
        page_list(transport, page_size, &pages)
    }

    /// A page list for a ring at `addr..addr + len` (page-aligned), and the list pages it
    /// lives in. A ring starts at offset 0 of its list's first page (SPEC.md §7), so a ring
    /// inside a larger page (huge pages) is listed in base pages.
    fn ring_page_list(&self, addr: u64, len: u64) -> Result<(PageList, Vec<SharedBuffer>)> {
        let transport = self.transport()?;
        let (page_size, pages) = transport
            .device_pages(addr, len)
            .ok_or(Error::NotShared { addr, len })?;
        if page_size == PAGE_SIZE {
            return page_list(transport, page_size, &pages);
        }
        let first_page = addr / page_size * page_size;
        let base_pages: Vec<u64> = (addr..addr + len.max(1))
            .step_by(PAGE_SIZE as usize)
            .map(|at| {
                let within = at - first_page;
                pages[(within / page_size) as usize] + within % page_size
            })
            .collect();
        page_list(transport, PAGE_SIZE, &base_pages)
    }
}

/// A page list (SPEC.md §6) of `pages`, each `page_size` bytes at the device address given,
/// written into memory `transport` allocates; returns it with the list pages it lives in,
/// which must be kept until the device has taken the command naming it.
pub fn page_list(
    transport: &dyn Transport,
    page_size: u64,
    pages: &[u64],
) -> Result<(PageList, Vec<SharedBuffer>)> {
    let entries =
        |pages: &[u64]| -> Vec<u8> { pages.iter().flat_map(|p| p.to_le_bytes()).collect() };
    let list_page = |bytes: &[u8]| -> Result<SharedBuffer> {
        let page = transport.alloc(PAGE_SIZE, PAGE_SIZE)?;
        page.write(0, bytes)?;
        Ok(page)
    };
    let npages =
        u32::try_from(pages.len()).map_err(|_| Error::InvalidArgument("range too large".into()))?;
    let mut keep = Vec::new();
    let form = if npages <= MAX_DIRECT_PAGES {
        keep.push(list_page(&entries(pages))?);
        PageListForm::Direct
    } else {
        let mut tops = Vec::new();
        for chunk in pages.chunks(PAGE_LIST_ENTRIES_PER_PAGE as usize) {
            let page = list_page(&entries(chunk))?;
            tops.push(page.device_addr()?);
            keep.push(page);
        }
        if tops.len() > PAGE_LIST_ENTRIES_PER_PAGE as usize {
            return Err(Error::InvalidArgument(format!(
                "{npages} pages exceed one indirect list"
            )));
        }
        keep.insert(0, list_page(&entries(&tops))?);
        PageListForm::Indirect
    };
    let list = PageList {
        addr: Le64::from(keep[0].device_addr()?),
        npages: Le32::from(npages),
        page_shift: page_size.trailing_zeros() as u8,
        form: form as u8,
        reserved: Le16::from(0),
    };
    Ok((list, keep))
}

/// Zeroed memory for the notify area and doorbell bitmap of the device `transport` reaches.
fn alloc_notify_area(transport: &dyn Transport) -> Result<(SharedBuffer, SharedBuffer)> {
    let config = transport.config();
    let notify_area = transport.alloc(
        notify_area_bytes(config.num_notify_queues.to_native()),
        PAGE_SIZE,
    )?;
    let doorbell_bitmap = transport.alloc(
        doorbell_bitmap_bytes(config.max_qp.to_native(), config.max_srq.to_native()),
        PAGE_SIZE,
    )?;
    Ok((notify_area, doorbell_bitmap))
}

impl Device {
    /// Opens the device `target` names (see [`crate::target::open`]).
    pub fn open(target: &str) -> Result<Device> {
        Self::with_transport(crate::target::open(target)?)
    }

    /// Attaches directly to the backend's vhost-user socket (a process or container on the
    /// host), with default options.
    pub fn attach(socket: impl AsRef<Path>) -> Result<Device> {
        Self::attach_with(socket, DirectOptions::default())
    }

    pub fn attach_with(socket: impl AsRef<Path>, options: DirectOptions) -> Result<Device> {
        Self::with_transport(Box::new(DirectTransport::connect(
            socket.as_ref(),
            options,
        )?))
    }

    /// Initialises the device over any transport (SPEC.md §9 step 3).
    pub fn with_transport(transport: Box<dyn Transport>) -> Result<Device> {
        transport.check_version()?;
        let opened_by = OpenedBy::this_process();
        if let Some((notify_area, doorbell_bitmap)) = transport.notify_area() {
            // The device's driver (the guest service) set the area up for every program.
            return Ok(Device {
                inner: Arc::new(DeviceInner::new(
                    transport,
                    notify_area,
                    doorbell_bitmap,
                    opened_by,
                )),
            });
        }
        let (notify_area, doorbell_bitmap) = alloc_notify_area(&*transport)?;
        let request = SetNotifyAreaRequest {
            addr: Le64::from(notify_area.device_addr()?),
            doorbell_bitmap: Le64::from(doorbell_bitmap.device_addr()?),
        };
        let inner = DeviceInner::new(transport, notify_area, doorbell_bitmap, opened_by);
        inner.transport()?.start_driver(&request)?;
        Ok(Device {
            inner: Arc::new(inner),
        })
    }

    /// The configuration space the device reported.
    pub fn config(&self) -> &DeviceConfig {
        self.inner.config()
    }

    /// The process that opened the device, the only one that may use it.
    pub fn opened_by(&self) -> OpenedBy {
        self.inner.opened_by
    }

    pub fn query_device(&self) -> Result<DeviceAttr> {
        self.inner.command(Opcode::QueryDevice, &Empty)
    }

    pub fn query_port(&self) -> Result<PortAttr> {
        self.inner.command(
            Opcode::QueryPort,
            &QueryPortRequest {
                port: 1,
                reserved: [0; 7],
            },
        )
    }

    /// The GID at `index` of port 1, and its type (`vrdma_spec::ctrl::gid_type`).
    pub fn query_gid(&self, index: u32) -> Result<(Gid, u8)> {
        let request = QueryGidRequest {
            port: 1,
            reserved: [0; 3],
            index: Le32::from(index),
        };
        let response: QueryGidResponse = self.inner.command(Opcode::QueryGid, &request)?;
        Ok((Gid(response.gid), response.gid_type))
    }

    /// The GID this guest may send from, with its index: the one entry the device shows.
    pub fn gid(&self) -> Result<(u32, Gid)> {
        let index = self.query_port()?.gid_index.to_native();
        let (gid, _) = self.query_gid(index)?;
        Ok((index, gid))
    }

    /// Page-aligned, zeroed memory shared with the device: what MRs are registered over.
    pub fn alloc_buffer(&self, len: u64) -> Result<SharedBuffer> {
        self.inner.transport()?.alloc(len, PAGE_SIZE)
    }

    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        let created: CreatedResponse = self.inner.command(Opcode::AllocPd, &Empty)?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                device: Arc::clone(&self.inner),
                handle: created.handle.to_native(),
            }),
        })
    }

    /// A completion queue of `depth` entries (a power of two); its ring lives in shared memory.
    pub fn create_cq(&self, depth: u32) -> Result<CompletionQueue> {
        let ring_bytes = u64::from(depth) * CQE_SIZE as u64;
        let transport = self.inner.transport()?;
        let ring = transport.alloc(ring_bytes.max(1), PAGE_SIZE)?;
        let doorbell = transport.alloc(std::mem::size_of::<CqDoorbell>() as u64, 64)?;
        let (list, _list_pages) = self.inner.ring_page_list(ring.addr(), ring_bytes.max(1))?;
        let request = CreateCqRequest {
            cqe: Le32::from(depth),
            flags: Le32::from(0),
            ring: list,
            doorbell: Le64::from(doorbell.device_addr()?),
        };
        let created: CreatedResponse = self.inner.command(Opcode::CreateCq, &request)?;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                device: Arc::clone(&self.inner),
                handle: created.handle.to_native(),
                doorbell,
                consumer: Mutex::new(CqConsumer {
                    ring,
                    depth,
                    index: 0,
                    empty_polls: 0,
                    yielded_at: None,
                    receive_queues: HashMap::new(),
                }),
                arm_sequence: AtomicU32::new(0),
            }),
        })
    }
    /// Waits up to `timeout` for the next device event (an armed CQ's completion, an error);
    /// [`Error::Disconnected`] once the backend is gone.
    pub fn wait_event(&self, timeout: Duration) -> Result<Option<DeviceEvent>> {
        let inner = &self.inner;
        let transport = inner.transport()?;
        let Some(event) = inner.noting_loss(transport.next_event(timeout))? else {
            if transport.disconnected() {
                return inner.noting_loss(Err(Error::Disconnected));
            }
            return Ok(None);
        };
        if event.kind.to_native() == event_kind::DEVICE_FATAL {
            // Whatever the device still holds, it serves no more: posts and polls fail too.
            inner.lost.store(true, Ordering::Relaxed);
        }
        let handle = event.handle.to_native();
        Ok(Some(match event.kind.to_native() {
            event_kind::CQ_COMPLETION => DeviceEvent::CqCompletion(handle),
            event_kind::CQ_ERROR => DeviceEvent::CqError(handle),
            event_kind::QP_FATAL => DeviceEvent::QpFatal(handle),
            event_kind::SRQ_LIMIT_REACHED => DeviceEvent::SrqLimitReached(handle),
            event_kind::SRQ_ERROR => DeviceEvent::SrqError(handle),
            event_kind::CM_EVENT => DeviceEvent::CmEvent(handle),
            event_kind::DEVICE_FATAL => DeviceEvent::DeviceFatal,
            event_kind::PORT_ACTIVE | event_kind::PORT_ERROR if handle <= u32::from(u8::MAX) => {
                let port = handle as u8;
                if event.kind.to_native() == event_kind::PORT_ACTIVE {
                    DeviceEvent::PortActive(port)
                } else {
                    DeviceEvent::PortError(port)
                }
            }
            kind => DeviceEvent::Unknown { kind, handle },
        }))
    }

    /// Kicks this process has sent the device (doorbells it rang while a poller slept).
    pub fn kicks_sent(&self) -> u64 {
        self.inner.kicks.load(Ordering::Relaxed)
    }

    /// Times this process's polls of an empty CQ gave up the CPU (to let the device's poller
    /// run where it shares the CPU: see [`CompletionQueue::poll`]).
    pub fn polling_yields(&self) -> u64 {
        self.inner.yields.load(Ordering::Relaxed)
    }

    /// Sets every bit of the doorbell bitmap and kicks every notification queue, whether or
    /// not a poller asked for it: a driver ringing everything, for conformance tests of the
    /// device's doorbell handling (it must not let one driver's storm cost every guest).
    pub fn ring_every_doorbell(&self) -> Result<()> {
        let bitmap = &self.inner.doorbell_bitmap;
        for offset in (0..bitmap.len()).step_by(8) {
            bitmap
                .atomic_u64(offset)?
                .store(u64::MAX, Ordering::Release);
        }
        for queue in 0..self.config().num_notify_queues.to_native() {
            self.inner.transport()?.notify(queue)?;
        }
        Ok(())
    }

    /// Gives the device a new kick descriptor for each of its queues while they run (a
    /// vhost-user front end may): for conformance tests of the device, which must take them.
    pub fn renew_kick_descriptors(&self) -> Result<()> {
        self.inner.transport()?.renew_kick_descriptors()
    }

    /// Hands the device to a new vhost-user connection of this process, as a hypervisor
    /// replacing itself under a running VM does (SPEC.md §11.1): every object, ring and
    /// pending completion carries over; for tests of the device's hand-over.
    pub fn replace_front_end(&self) -> Result<()> {
        self.inner.transport()?.replace_front_end()
    }

    /// Lets this driver add memory regions past the limit the device states (a direct
    /// attachment): for conformance tests of the device, which must refuse them.
    pub fn lift_memory_region_limit(&self) -> Result<()> {
        self.inner.transport()?.lift_memory_region_limit()
    }

    /// Makes `ahead` control queue entries available that this driver never wrote: for
    /// conformance tests of the device's queue handling (the device must survive it).
    pub fn publish_bogus_control_entries(&self, ahead: u16) -> Result<()> {
        self.inner.transport()?.publish_bogus_control_entries(ahead)
    }

    /// Sends raw request bytes on the control queue and returns the raw response (at most
    /// `response_len` bytes): for conformance tests of the device's validation.
    pub fn raw_control(&self, request: &[u8], response_len: usize) -> Result<Vec<u8>> {
        let mut response = vec![0u8; response_len];
        let written = self
            .inner
            .noting_loss(self.inner.transport()?.control(request, &mut response))?;
        response.truncate(written);
        Ok(response)
    }
}

struct PdInner {
    device: Arc<DeviceInner>,
    handle: u32,
}

impl Drop for PdInner {
    fn drop(&mut self) {
        self.device.destroy(Opcode::DeallocPd, self.handle);
    }
}

/// A protection domain.
pub struct ProtectionDomain {
    inner: Arc<PdInner>,
}

/// Memory access rights of an MR or QP (ibverbs values).
pub use vrdma_spec::ctrl::access;

impl ProtectionDomain {
    pub fn handle(&self) -> u32 {
        self.inner.handle
    }

    /// True while MRs, QPs, SRQs or AHs made on this PD exist: each keeps the PD alive, so
    /// dropping it now would not deallocate it (libibverbs refuses with EBUSY).
    pub fn in_use(&self) -> bool {
        Arc::strong_count(&self.inner) > 1
    }

    /// Registers all of `buffer`.
    pub fn reg_mr(&self, buffer: &SharedBuffer, access: u32) -> Result<MemoryRegion> {
        self.reg_mr_range(buffer.addr(), buffer.len(), access)
    }

    /// Registers `addr..addr + len`, which must lie in memory shared with the device (see
    /// [`Device::alloc_buffer`]). Peers and work requests address it by `addr`.
    pub fn reg_mr_range(&self, addr: u64, len: u64, access: u32) -> Result<MemoryRegion> {
        self.register(addr, len, addr, access)
    }

    /// Registers `addr..addr + len` of shared memory so that peers and work requests address
    /// it from `iova`, which must have `addr`'s offset within a page of that memory.
    fn register(&self, addr: u64, len: u64, iova: u64, access: u32) -> Result<MemoryRegion> {
        let device = &self.inner.device;
        let (pages, _list_pages) = device.page_list(addr, len)?;
        let page_mask = (1u64 << pages.page_shift) - 1;
        if (iova ^ addr) & page_mask != 0 || iova.checked_add(len).is_none() {
            return Err(Error::InvalidArgument(format!(
                "IOVA {iova:#x} for {len:#x} bytes at {addr:#x}: it must not wrap and must have the address's offset in a {}-byte page",
                page_mask + 1
            )));
        }
        let request = RegMrRequest {
            pd: Le32::from(self.inner.handle),
            access: Le32::from(access),
            virt_addr: Le64::from(iova),
            length: Le64::from(len),
            pages,
        };
        let r: RegMrResponse = device.command(Opcode::RegMr, &request)?;
        Ok(MemoryRegion {
            pd: Arc::clone(&self.inner),
            handle: r.handle.to_native(),
            lkey: r.lkey.to_native(),
            rkey: r.rkey.to_native(),
            addr: iova,
            len,
        })
    }

    /// Registers `addr..addr + len` of any memory of this process (malloc'd, stack,
    /// mmap'd), as libibverbs programs do: the memory is made reachable by the device in
    /// place first (see [`Transport::share`]), with no copy of what later goes through it.
    /// Peers and work requests address it from `iova` (`addr` itself, or another address
    /// with the same offset within a page, as `ibv_reg_mr_iova2` allows).
    ///
    /// # Safety
    /// The range must be memory of this process that nothing writes during the call and
    /// that stays mapped, as it is, until the MR and the device are gone.
    pub unsafe fn reg_user_mr(
        &self,
        addr: u64,
        len: u64,
        iova: u64,
        access: u32,
    ) -> Result<MemoryRegion> {
        if len == 0 {
            return Err(Error::InvalidArgument("cannot register zero bytes".into()));
        }
        // SAFETY: the caller's contract is Transport::share's.
        unsafe { self.inner.device.transport()?.share(addr, len)? };
        self.register(addr, len, iova, access)
    }

    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle> {
        let request = CreateAhRequest {
            pd: Le32::from(self.inner.handle),
            reserved: Le32::from(0),
            attr: attr.into(),
        };
        let created: CreatedResponse = self.inner.device.command(Opcode::CreateAh, &request)?;
        Ok(AddressHandle {
            pd: Arc::clone(&self.inner),
            handle: created.handle.to_native(),
        })
    }
}

/// A registered memory region.
pub struct MemoryRegion {
    pd: Arc<PdInner>,
    handle: u32,
    lkey: u32,
    rkey: u32,
    addr: u64,
    len: u64,
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("handle", &self.handle)
            .field("lkey", &self.lkey)
            .field("rkey", &self.rkey)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}

impl MemoryRegion {
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    /// The address peers and work requests use: the registered virtual address.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn handle(&self) -> u32 {
        self.handle
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        self.pd.device.destroy(Opcode::DeregMr, self.handle);
    }
}

/// MODIFY_QP mask bits (ibverbs values).
pub use vrdma_spec::ctrl::qp_attr_mask;
pub use vrdma_spec::verbs::{AhAttr, QpAttr, QpCaps, QpState, QpType};

/// An address handle (UD destination).
pub struct AddressHandle {
    pd: Arc<PdInner>,
    handle: u32,
}

impl std::fmt::Debug for AddressHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AddressHandle").field(&self.handle).finish()
    }
}

impl AddressHandle {
    pub fn handle(&self) -> u32 {
        self.handle
    }
}

impl Drop for AddressHandle {
    fn drop(&mut self) {
        self.pd.device.destroy(Opcode::DestroyAh, self.handle);
    }
}

/// A starting packet sequence number for a QP's send queue: random, as NIC drivers pick them.
/// A peer that can send from an RC connection's address (another guest on the same GID, say)
/// must also hit the 24-bit PSN the connection expects to inject anything into it.
pub fn random_psn() -> u32 {
    let mut bytes = [0u8; 4];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into the local array.
    let filled = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if filled != bytes.len() as isize {
        // No entropy to be had (never on Linux after boot): the time is still no constant.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        bytes = nanos.to_le_bytes();
    }
    u32::from_le_bytes(bytes) & 0x00ff_ffff
}
