//! The verbs API: typed objects over the device's control commands, each destroyed on the
//! device when dropped. Children keep their parents alive (a QP its PD and CQs, an MR its PD).

pub mod cm;
mod posting;
pub mod work;

pub use posting::{encode_recv, encode_send, Chain, SendShape};

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

fn encode<T: ByteValued>(opcode: Opcode, request: &T) -> Vec<u8> {
    vrdma_spec::ctrl::request_bytes(opcode as u16, request.as_slice())
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
        let header_len = std::mem::size_of::<ResponseHeader>();
        let mut response = vec![0u8; header_len + std::mem::size_of::<Resp>()];
        let written = self.noting_loss(
            self.transport()?
                .control(&encode(opcode, request), &mut response),
        )?;
        if written < header_len {
            return Err(Error::BadResponse {
                opcode,
                len: written,
            });
        }
        let header: ResponseHeader = read_wire(&response).ok_or(Error::BadResponse {
            opcode,
            len: written,
        })?;
        let status =
            Status::try_from(header.status.to_native()).map_err(|_| Error::BadResponse {
                opcode,
                len: written,
            })?;
        if status == Status::NotReady {
            return self.noting_loss(Err(Error::DeviceReset));
        }
        if status != Status::Ok {
            return Err(Error::Device {
                opcode,
                status,
                detail: header.detail.to_native(),
            });
        }
        if written != response.len() {
            return Err(Error::BadResponse {
                opcode,
                len: written,
            });
        }
        read_wire(&response[header_len..]).ok_or(Error::BadResponse {
            opcode,
            len: written,
        })
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
        let reset = transport.features() & vrdma_spec::config::features::RESET_COMMAND != 0;
        let request = SetNotifyAreaRequest {
            addr: Le64::from(notify_area.device_addr()?),
            doorbell_bitmap: Le64::from(doorbell_bitmap.device_addr()?),
        };
        let inner = DeviceInner::new(transport, notify_area, doorbell_bitmap, opened_by);
        if reset {
            // A device that keeps its objects across a stop of its queues (a paused VM)
            // learns here that this is a new driver: whatever an earlier one left goes.
            inner.command::<_, Empty>(Opcode::Reset, &Empty)?;
        }
        // Reset either way (a device without RESET drops all at the reset that opened it).
        inner.transport()?.device_reset()?;
        inner.command::<_, Empty>(Opcode::SetNotifyArea, &request)?;
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

struct CqInner {
    device: Arc<DeviceInner>,
    handle: u32,
    doorbell: SharedBuffer,
    consumer: Mutex<CqConsumer>,
    arm_sequence: AtomicU32,
}

/// The driver's side of a CQ ring.
struct CqConsumer {
    ring: SharedBuffer,
    depth: u32,
    index: u32,
    /// Polls in a row that found nothing.
    empty_polls: u32,
    /// When a poll that found nothing last gave up the CPU (or, before any did, found
    /// nothing first). Not reset by completions: right after one, the program has just
    /// posted its answer, often, and the poller that relays it may need this CPU.
    yielded_at: Option<std::time::Instant>,
    /// The receive completions taken so far, by QP number, of each QP whose RQ completes
    /// here: a receive slot is free again once the device took its WQE, so the QP counts
    /// completions to refuse a post past `max_recv_wr` outstanding receives, as verbs does
    /// (SPEC.md §8.1).
    receive_queues: HashMap<u32, Arc<AtomicU32>>,
}

impl CqInner {
    fn consumer(&self) -> std::sync::MutexGuard<'_, CqConsumer> {
        self.consumer.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        self.device.destroy(Opcode::DestroyCq, self.handle);
    }
}

/// A completion queue.
#[derive(Clone)]
pub struct CompletionQueue {
    inner: Arc<CqInner>,
}

impl CompletionQueue {
    pub fn depth(&self) -> u32 {
        self.inner.consumer().depth
    }
    pub fn handle(&self) -> u32 {
        self.inner.handle
    }

    /// Moves the CQ to a ring of `depth` entries (a power of two), keeping the completions
    /// not yet polled (RESIZE_CQ, SPEC.md §5.7.1); polls wait meanwhile. A depth below the
    /// completions the CQ holds is refused (`INVALID_ARGUMENT`, detail `EINVAL`), and the CQ
    /// stays as it was.
    pub fn resize(&self, depth: u32) -> Result<()> {
        let device = &self.inner.device;
        if device.transport()?.features() & features::RESIZE_CQ == 0 {
            // What the device would answer; a driver does not send it (SPEC.md §2).
            return Err(Error::Device {
                opcode: Opcode::ResizeCq,
                status: Status::Unsupported,
                detail: 0,
            });
        }
        let mut consumer = self.inner.consumer();
        let ring_bytes = u64::from(depth) * CQE_SIZE as u64;
        let ring = device.transport()?.alloc(ring_bytes.max(1), PAGE_SIZE)?;
        // Every slot reads as consumed until the device writes it (SPEC.md §5.7.1).
        for slot in 0..depth {
            let owner = resized_cq_owner(slot, consumer.index, depth);
            ring.write(
                u64::from(slot) * CQE_SIZE as u64 + CQE_SIZE as u64 - 1,
                &[owner],
            )?;
        }
        let (list, _list_pages) = device.ring_page_list(ring.addr(), ring_bytes.max(1))?;
        let request = ResizeCqRequest {
            cq: Le32::from(self.inner.handle),
            cqe: Le32::from(depth),
            ring: list,
        };
        let _: CreatedResponse = device.command(Opcode::ResizeCq, &request)?;
        consumer.ring = ring;
        consumer.depth = depth;
        Ok(())
    }

    /// True while QPs complete here: each keeps the CQ alive (see [`ProtectionDomain::in_use`]).
    pub fn in_use(&self) -> bool {
        Arc::strong_count(&self.inner) > 1
    }
}

/// MODIFY_QP mask bits (ibverbs values).
pub use vrdma_spec::ctrl::qp_attr_mask;
pub use vrdma_spec::verbs::{AhAttr, QpAttr, QpCaps, QpState, QpType};

/// The far end of an RC connection, as exchanged out of band.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RcPeer {
    pub qp_num: u32,
    pub gid: Gid,
    /// The first packet sequence number the peer sends.
    pub psn: u32,
}

/// Builds a [`QueuePair`]: `QueuePair::builder(QpType::Rc, &cq).max_send_wr(64).build(&pd)`.
pub struct QueuePairBuilder<'a> {
    qp_type: QpType,
    send_cq: &'a CompletionQueue,
    recv_cq: &'a CompletionQueue,
    srq: Option<&'a SharedReceiveQueue>,
    max_send_wr: u32,
    max_recv_wr: u32,
    max_send_sge: u32,
    max_recv_sge: u32,
    max_inline_data: u32,
    sq_sig_all: bool,
}

impl<'a> QueuePairBuilder<'a> {
    pub fn recv_cq(mut self, cq: &'a CompletionQueue) -> Self {
        self.recv_cq = cq;
        self
    }
    /// Receive through `srq` instead of an RQ of the QP's own.
    pub fn srq(mut self, srq: &'a SharedReceiveQueue) -> Self {
        self.srq = Some(srq);
        self
    }
    /// SQ depth; rounded up to a power of two.
    pub fn max_send_wr(mut self, n: u32) -> Self {
        self.max_send_wr = n;
        self
    }
    /// RQ depth; rounded up to a power of two.
    pub fn max_recv_wr(mut self, n: u32) -> Self {
        self.max_recv_wr = n;
        self
    }
    pub fn max_send_sge(mut self, n: u32) -> Self {
        self.max_send_sge = n;
        self
    }
    pub fn max_recv_sge(mut self, n: u32) -> Self {
        self.max_recv_sge = n;
        self
    }
    pub fn max_inline_data(mut self, n: u32) -> Self {
        self.max_inline_data = n;
        self
    }
    pub fn sq_sig_all(mut self, all: bool) -> Self {
        self.sq_sig_all = all;
        self
    }

    pub fn build(self, pd: &ProtectionDomain) -> Result<QueuePair> {
        let device = &pd.inner.device;
        let send_wr = ring_depth(self.max_send_wr, "send")?;
        let on_srq = self.srq.is_some();
        let (recv_wr, max_recv_sge) = if on_srq {
            (0, 0)
        } else {
            (ring_depth(self.max_recv_wr, "receive")?, self.max_recv_sge)
        };
        let too_large = || Error::InvalidArgument("WQEs too large for the largest slot".into());
        let sq_shift =
            send_wqe_shift(self.max_send_sge, self.max_inline_data).ok_or_else(too_large)?;
        let rq_shift = if on_srq {
            0
        } else {
            recv_wqe_shift(max_recv_sge).ok_or_else(too_large)?
        };
        let (sq_stride, rq_stride) = (1u32 << sq_shift, 1u32 << rq_shift);
        let sq_bytes = u64::from(send_wr) * u64::from(sq_stride);
        let rq_bytes = u64::from(recv_wr) * u64::from(rq_stride);
        let transport = device.transport()?;
        let sq = transport.alloc(sq_bytes, PAGE_SIZE)?;
        let rq = if on_srq {
            None
        } else {
            Some(transport.alloc(rq_bytes, PAGE_SIZE)?)
        };
        let doorbell = transport.alloc(std::mem::size_of::<QpDoorbell>() as u64, 64)?;
        let (sq_list, _sq_pages) = device.ring_page_list(sq.addr(), sq_bytes)?;
        let (rq_list, _rq_pages) = match &rq {
            Some(rq) => device.ring_page_list(rq.addr(), rq_bytes)?,
            None => (PageList::default(), Vec::new()),
        };
        let request = CreateQpRequest {
            pd: Le32::from(pd.inner.handle),
            send_cq: Le32::from(self.send_cq.inner.handle),
            recv_cq: Le32::from(self.recv_cq.inner.handle),
            srq: Le32::from(self.srq.map_or(0, |srq| srq.inner.handle)),
            qp_type: match self.qp_type {
                QpType::Rc => qp_type::RC,
                QpType::Uc => qp_type::UC,
                QpType::Ud => qp_type::UD,
            },
            sq_sig_all: self.sq_sig_all.into(),
            sq_wqe_shift: sq_shift,
            rq_wqe_shift: rq_shift,
            max_send_wr: Le32::from(send_wr),
            max_recv_wr: Le32::from(recv_wr),
            max_send_sge: Le32::from(self.max_send_sge),
            max_recv_sge: Le32::from(max_recv_sge),
            max_inline_data: Le32::from(self.max_inline_data),
            // The device's first area; the guest service puts its program's own area here
            // (SPEC.md §8.6) when it forwards the request.
            doorbell_area: Le32::from(0),
            reserved: Default::default(),
            sq_ring: sq_list,
            rq_ring: rq_list,
            doorbell: Le64::from(doorbell.device_addr()?),
        };
        let created: CreateQpResponse = device.command(Opcode::CreateQp, &request)?;
        let qp_num = created.qp_num.to_native();
        let rq = rq.map(|ring| {
            let completed = Arc::new(AtomicU32::new(0));
            self.recv_cq
                .inner
                .consumer()
                .receive_queues
                .insert(qp_num, Arc::clone(&completed));
            WorkQueue {
                ring,
                depth: recv_wr,
                stride: u64::from(rq_stride),
                producer: Mutex::new(0),
                completed: Some(completed),
            }
        });
        Ok(QueuePair {
            handle: created.handle.to_native(),
            qp_num,
            qp_type: self.qp_type,
            notify_queue: u32::from(created.notify_queue.to_native()),
            doorbell_bit: created.doorbell_bit.to_native(),
            max_send_sge: self.max_send_sge,
            max_recv_sge,
            max_inline_data: self.max_inline_data,
            state: AtomicU8::new(QpState::Reset as u8),
            pd: Arc::clone(&pd.inner),
            _cqs: [
                Arc::clone(&self.send_cq.inner),
                Arc::clone(&self.recv_cq.inner),
            ],
            sq: WorkQueue {
                ring: sq,
                depth: send_wr,
                stride: u64::from(sq_stride),
                producer: Mutex::new(0),
                completed: None,
            },
            rq,
            _srq: self.srq.map(|srq| Arc::clone(&srq.inner)),
            doorbell,
        })
    }
}

/// A send or receive queue: a ring of WQE slots in shared memory.
struct WorkQueue {
    ring: SharedBuffer,
    depth: u32,
    stride: u64,
    producer: Mutex<u32>,
    /// An RQ's receive completions taken from its CQ (free-running): posted less these is
    /// what the queue holds in verbs' terms, which may not exceed `depth`. None where
    /// completions are not counted (an SQ, whose unsignaled sends complete unseen; an SRQ).
    completed: Option<Arc<AtomicU32>>,
}

/// A queue pair.
pub struct QueuePair {
    handle: u32,
    qp_num: u32,
    qp_type: QpType,
    notify_queue: u32,
    doorbell_bit: u16,
    max_send_sge: u32,
    max_recv_sge: u32,
    max_inline_data: u32,
    /// The [`qp_state`] the driver last moved the QP to (the device may have failed it since,
    /// which only a later state is).
    state: AtomicU8,
    pd: Arc<PdInner>,
    _cqs: [Arc<CqInner>; 2],
    _srq: Option<Arc<SrqInner>>,
    sq: WorkQueue,
    /// None when the QP receives through an SRQ.
    rq: Option<WorkQueue>,
    doorbell: SharedBuffer,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("handle", &self.handle)
            .field("qp_num", &self.qp_num)
            .finish()
    }
}

impl QueuePair {
    /// A builder for a QP of `qp_type` completing into `cq` (send and receive alike, unless
    /// [`QueuePairBuilder::recv_cq`] says otherwise).
    pub fn builder(qp_type: QpType, cq: &CompletionQueue) -> QueuePairBuilder<'_> {
        QueuePairBuilder {
            qp_type,
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            sq_sig_all: false,
        }
    }

    /// The QP number peers address.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    pub fn caps(&self) -> QpCaps {
        QpCaps {
            max_send_wr: self.sq.depth,
            max_recv_wr: self.rq.as_ref().map_or(0, |rq| rq.depth),
            max_send_sge: self.max_send_sge,
            max_recv_sge: self.max_recv_sge,
            max_inline_data: self.max_inline_data,
        }
    }

    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// Applies the fields of `attr` selected by `mask` ([`qp_attr_mask`] bits).
    pub fn modify(&self, attr: &QpAttr, mask: u32) -> Result<()> {
        let request = ModifyQpRequest {
            handle: Le32::from(self.handle),
            attr_mask: Le32::from(mask),
            attr: attr.into(),
        };
        self.pd
            .device
            .command::<_, Empty>(Opcode::ModifyQp, &request)?;
        if mask & qp_attr_mask::STATE != 0 {
            self.state.store(attr.qp_state as u8, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Refuses to post to a queue the QP's state does not take work on yet, as verbs does
    /// (`EINVAL`): receives before INIT, sends before RTS. Posted anyway, the host would
    /// refuse them later and fail the QP.
    fn check_state(&self, least: QpState, queue: &str) -> Result<()> {
        let state = self.state.load(Ordering::Relaxed);
        if state < least as u8 {
            let state = QpState::try_from(u32::from(state)).unwrap_or_default();
            return Err(Error::InvalidArgument(format!(
                "a QP in state {state:?} takes no {queue} (it needs state {least:?} or later)"
            )));
        }
        Ok(())
    }

    /// Walks an RC QP RESET -> INIT -> RTR -> RTS towards `peer`, sending from GID
    /// `sgid_index`, with the usual settings: the port's active MTU, remote read/write/atomic
    /// access, up to 16 outstanding reads and atomics (as the device allows), unlimited RNR
    /// retries, and transport retries as [`QueuePair::connect_rc_retrying`] with 7.
    pub fn connect_rc(&self, sgid_index: u8, local_psn: u32, peer: &RcPeer) -> Result<()> {
        self.connect_rc_retrying(sgid_index, local_psn, peer, 7)
    }

    /// As [`QueuePair::connect_rc`], retransmitting an unanswered request `retry_cnt` times
    /// (0..=7) before the QP fails with `RETRY_EXC_ERR`. Soft-RoCE takes 7 as "forever", so a
    /// QP that must notice a vanished peer there asks for at most 6.
    pub fn connect_rc_retrying(
        &self,
        sgid_index: u8,
        local_psn: u32,
        peer: &RcPeer,
        retry_cnt: u8,
    ) -> Result<()> {
        let device = &self.pd.device;
        let path_mtu = device
            .command::<_, vrdma_spec::ctrl::PortAttr>(
                Opcode::QueryPort,
                &QueryPortRequest {
                    port: 1,
                    reserved: [0; 7],
                },
            )?
            .active_mtu;
        let config = device.config();
        let reads = |limit: Le32| limit.to_native().clamp(1, 16) as u8;
        let init = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC,
            ..Default::default()
        };
        self.modify(
            &init,
            qp_attr_mask::STATE
                | qp_attr_mask::PKEY_INDEX
                | qp_attr_mask::PORT
                | qp_attr_mask::ACCESS_FLAGS,
        )?;
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu,
            dest_qp_num: peer.qp_num,
            rq_psn: peer.psn,
            max_dest_rd_atomic: reads(config.max_qp_rd_atom),
            min_rnr_timer: 12,
            ah_attr: AhAttr {
                dgid: peer.gid,
                sgid_index,
                hop_limit: 1,
                is_global: true,
                port_num: 1,
                ..Default::default()
            },
            ..Default::default()
        };
        let m = qp_attr_mask::STATE
            | qp_attr_mask::AV
            | qp_attr_mask::PATH_MTU
            | qp_attr_mask::DEST_QPN
            | qp_attr_mask::RQ_PSN
            | qp_attr_mask::MAX_DEST_RD_ATOMIC
            | qp_attr_mask::MIN_RNR_TIMER;
        self.modify(&rtr, m)?;
        let rts = QpAttr {
            qp_state: QpState::Rts,
            timeout: 14,
            retry_cnt,
            rnr_retry: 7,
            sq_psn: local_psn,
            max_rd_atomic: reads(config.max_qp_init_rd_atom),
            ..Default::default()
        };
        let m = qp_attr_mask::STATE
            | qp_attr_mask::TIMEOUT
            | qp_attr_mask::RETRY_CNT
            | qp_attr_mask::RNR_RETRY
            | qp_attr_mask::SQ_PSN
            | qp_attr_mask::MAX_QP_RD_ATOMIC;
        self.modify(&rts, m)
    }

    pub fn query(&self) -> Result<QpAttr> {
        let request = HandleRequest {
            handle: Le32::from(self.handle),
            reserved: Le32::from(0),
        };
        let attr: WireQpAttr = self.pd.device.command(Opcode::QueryQp, &request)?;
        QpAttr::try_from(&attr).map_err(|_| Error::BadResponse {
            opcode: Opcode::QueryQp,
            len: std::mem::size_of::<WireQpAttr>(),
        })
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.pd.device.destroy(Opcode::DestroyQp, self.handle);
        if let Some(completed) = self.rq.as_ref().and_then(|rq| rq.completed.as_ref()) {
            let mut consumer = self._cqs[1].consumer();
            // Only this QP's entry: a QP number the host gave again has its own.
            if consumer
                .receive_queues
                .get(&self.qp_num)
                .is_some_and(|counted| Arc::ptr_eq(counted, completed))
            {
                consumer.receive_queues.remove(&self.qp_num);
            }
        }
    }
}

struct SrqInner {
    pd: Arc<PdInner>,
    handle: u32,
    notify_queue: u32,
    doorbell_bit: u16,
    max_sge: u32,
    queue: WorkQueue,
    doorbell: SharedBuffer,
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        self.pd.device.destroy(Opcode::DestroySrq, self.handle);
    }
}

/// A shared receive queue: receives for every QP built on it.
pub struct SharedReceiveQueue {
    inner: Arc<SrqInner>,
}

/// The depth of a ring for `wrs` work requests: the power of two at or above, refused past
/// 2^31 (the device refuses depths past its own maximum).
fn ring_depth(wrs: u32, ring: &str) -> Result<u32> {
    wrs.max(1).checked_next_power_of_two().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{wrs} {ring} work requests: more than any ring holds"
        ))
    })
}

impl ProtectionDomain {
    /// An SRQ of `max_wr` entries (rounded up to a power of two) of up to `max_sge` SGEs.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        let device = &self.inner.device;
        let depth = ring_depth(max_wr, "SRQ")?;
        let shift = recv_wqe_shift(max_sge).ok_or_else(|| {
            Error::InvalidArgument(format!("{max_sge} SGEs exceed the largest slot"))
        })?;
        let stride = 1u32 << shift;
        let bytes = u64::from(depth) * u64::from(stride);
        let transport = device.transport()?;
        let ring = transport.alloc(bytes, PAGE_SIZE)?;
        let doorbell = transport.alloc(std::mem::size_of::<SrqDoorbell>() as u64, 64)?;
        let (list, _list_pages) = device.ring_page_list(ring.addr(), bytes)?;
        let request = CreateSrqRequest {
            pd: Le32::from(self.inner.handle),
            max_wr: Le32::from(depth),
            max_sge: Le32::from(max_sge),
            srq_limit: Le32::from(0),
            wqe_shift: shift,
            reserved: [0; 3],
            doorbell_area: Le32::from(0), // as CREATE_QP's
            ring: list,
            doorbell: Le64::from(doorbell.device_addr()?),
        };
        let created: CreateSrqResponse = device.command(Opcode::CreateSrq, &request)?;
        Ok(SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                pd: Arc::clone(&self.inner),
                handle: created.handle.to_native(),
                notify_queue: u32::from(created.notify_queue.to_native()),
                doorbell_bit: created.doorbell_bit.to_native(),
                max_sge,
                queue: WorkQueue {
                    ring,
                    depth,
                    stride: u64::from(stride),
                    producer: Mutex::new(0),
                    completed: None,
                },
                doorbell,
            }),
        })
    }
}

impl SharedReceiveQueue {
    pub fn handle(&self) -> u32 {
        self.inner.handle
    }

    /// True while QPs take their receives from it (see [`ProtectionDomain::in_use`]).
    pub fn in_use(&self) -> bool {
        Arc::strong_count(&self.inner) > 1
    }

    /// Receive requests it holds at most (rounded up to a power of two).
    pub fn depth(&self) -> u32 {
        self.inner.queue.depth
    }

    pub fn max_sge(&self) -> u32 {
        self.inner.max_sge
    }

    /// Arms the SRQ's limit: [`DeviceEvent::SrqLimitReached`] once, when fewer than `limit`
    /// of its receive WQEs are left (SPEC.md §5.13); 0 disarms. Below the SRQ's depth.
    pub fn set_limit(&self, limit: u32) -> Result<()> {
        let request = ModifySrqRequest {
            handle: Le32::from(self.inner.handle),
            attr_mask: Le32::from(vrdma_spec::ctrl::SRQ_ATTR_LIMIT),
            srq_limit: Le32::from(limit),
            reserved: Le32::from(0),
        };
        self.inner
            .pd
            .device
            .command::<_, Empty>(Opcode::ModifySrq, &request)?;
        Ok(())
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_depths_round_up_to_powers_of_two_and_huge_requests_are_refused_not_a_panic() {
        assert_eq!(ring_depth(0, "send").unwrap(), 1);
        assert_eq!(ring_depth(5, "send").unwrap(), 8);
        assert_eq!(ring_depth(1 << 31, "send").unwrap(), 1 << 31);
        for wrs in [(1 << 31) + 1, u32::MAX] {
            assert!(matches!(
                ring_depth(wrs, "receive"),
                Err(Error::InvalidArgument(_))
            ));
        }
    }
}
