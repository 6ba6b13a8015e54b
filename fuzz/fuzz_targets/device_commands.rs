//! A whole device (`device::Device`) on a loopback host, driven by a sequence of control
//! requests a hostile driver writes (SPEC.md §5), over guest memory it also scribbles on:
//! the rings, page lists, doorbell records and notify area the requests name. Requests are
//! built from the input with each field either taken raw or made plausible (a handle the
//! device returned, a page list that covers its ring, a power-of-two depth), so that inputs
//! reach past validation into objects on the host. After every input the device is reset:
//! every host object it made must be gone, whatever the requests were.
#![no_main]

#[path = "guest_memory.rs"]
mod guest_memory;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vrdma_backend::datapath::{PollerPool, RateLimits};
use vrdma_backend::device::{Device, LocalPeers};
use vrdma_backend::hostverbs::loopback;
use vrdma_backend::limits::DEFAULT_GUESTS;
use vrdma_backend::memory_regions::UnsealedFiles;
use vrdma_backend::sandbox::SeccompMode;
use vrdma_backend::{Config, Quotas};
use vrdma_spec::ctrl::{
    request_bytes, AddDoorbellAreaRequest, CreateAhRequest, CreateCqRequest, CreateQpRequest,
    CreateSrqRequest, HandleRequest, ModifyQpRequest, Opcode, RegMrRequest, ResizeCqRequest,
    ResponseHeader, SetNotifyAreaRequest, Status,
};
use vrdma_spec::mem::{PageList, PageListForm};
use vrdma_spec::{read_wire, ByteValued, Le32, Le64};

const DEVICE: &str = "loopback-fuzz-device";
const PAGE: u64 = 4096;
/// Guest RAM: 2 MiB at 0 and 1 MiB at 4 GiB, one file.
const LOW_LEN: u64 = 2 << 20;
const HIGH: u64 = 4 << 30;
const HIGH_LEN: u64 = 1 << 20;
const NOTIFY_AREA: u64 = 0x1000;
const DOORBELL_BITMAP: u64 = 0x4000;
const SECOND_BITMAP: u64 = 0x8000;
/// 256 doorbell records of 16 bytes.
const RECORDS: u64 = 0x10000;
/// Page lists: 64 pages of them.
const LISTS: u64 = 0x20000;
const LIST_PAGES: u64 = 64;
/// The pages rings and MRs are made of: the rest of low memory, then high memory.
const POOL: u64 = 0x60000;
const POOL_LOW_PAGES: u64 = (LOW_LEN - POOL) / PAGE;
const POOL_PAGES: u64 = POOL_LOW_PAGES + HIGH_LEN / PAGE;

struct Fixture {
    mem: GuestMemoryMmap,
    device: Mutex<Device>,
    /// The loopback's object counts with the device fresh.
    baseline: std::collections::BTreeMap<String, u64>,
    _pool: Arc<PollerPool>,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let mem = guest_memory::file_backed(&[(0, LOW_LEN as usize), (HIGH, HIGH_LEN as usize)]);
        // Small quotas, so that inputs reach them.
        let quotas = Quotas {
            max_qp: 8,
            max_cq: 8,
            max_mr: 8,
            max_pd: 4,
            max_ah: 4,
            max_srq: 4,
            max_ring_bytes: 1 << 20,
            max_registered_bytes: 2 << 20,
            max_memory_regions: 64,
            ..Quotas::default()
        };
        let config = Config {
            device: DEVICE.into(),
            port: 1,
            gid_index: None,
            guest_ip: None,
            quotas,
            notify_queues: 2,
            poll_threads: 1,
            poll_idle: Duration::ZERO,
            poll_cpus: Vec::new(),
            seccomp: SeccompMode::None,
            max_guests: DEFAULT_GUESTS,
            shared_gid: true,
            unsealed_memory: UnsealedFiles::Refuse,
            rate_limits: RateLimits::default(),
            socket_group: None,
            handshake_timeout: Duration::from_secs(10),
        };
        let pool = Arc::new(PollerPool::start(1, Duration::ZERO, &[]).expect("a poller"));
        let peers = Arc::new(LocalPeers::default());
        let device = Device::new(&config, &pool, &peers).expect("a device on the loopback host");
        let baseline = loopback::Device::named(DEVICE).resource_counts();
        Fixture {
            mem,
            device: Mutex::new(device),
            baseline,
            _pool: pool,
        }
    })
}

/// The input, read front to back; zeros once it runs out.
struct Script<'a>(&'a [u8]);

impl Script<'_> {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn u8(&mut self) -> u8 {
        let Some((&first, rest)) = self.0.split_first() else {
            return 0;
        };
        self.0 = rest;
        first
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        let len = len.min(self.0.len());
        let (taken, rest) = self.0.split_at(len);
        self.0 = rest;
        taken.to_vec()
    }

    /// A wire struct of raw input bytes (zero-padded).
    fn raw<T: ByteValued + Default>(&mut self) -> T {
        let mut bytes = self.bytes(std::mem::size_of::<T>());
        bytes.resize(std::mem::size_of::<T>(), 0);
        read_wire(&bytes).expect("sized to fit")
    }
}

/// What the device gave the driver so far: handles to name in later requests.
#[derive(Default)]
struct Driver {
    handles: Vec<u32>,
    next_list: u64,
}

impl Driver {
    /// A handle the device returned (raw input with the low bit of `pick` set).
    fn handle(&self, script: &mut Script<'_>) -> Le32 {
        let pick = script.u8();
        if pick & 1 == 1 || self.handles.is_empty() {
            return Le32::from(u32::from(pick >> 1));
        }
        Le32::from(self.handles[usize::from(pick >> 1) % self.handles.len()])
    }

    /// A depth: a power of two up to 1024, or raw.
    fn depth(script: &mut Script<'_>) -> u32 {
        match script.u8() {
            b if b < 200 => 1 << (b % 11),
            _ => script.u32(),
        }
    }

    /// A doorbell record's address: one of the record slots, or raw.
    fn record(script: &mut Script<'_>) -> Le64 {
        match script.u8() {
            b if b < 240 => Le64::from(RECORDS + 16 * u64::from(b)),
            _ => Le64::from(u64::from(script.u32())),
        }
    }

    /// A direct page list for `bytes` of pages, written into a list page of its own and
    /// naming pages of the pool (consecutive, or spread), or (rarely) raw.
    fn page_list(
        &mut self,
        mem: &GuestMemoryMmap,
        script: &mut Script<'_>,
        bytes: u64,
    ) -> PageList {
        let how = script.u8();
        if how >= 240 {
            return script.raw();
        }
        let npages = bytes.div_ceil(PAGE).clamp(1, PAGE / 8);
        let (start, stride) = (u64::from(script.u8()), u64::from(how % 8) + 1);
        let list = LISTS + (self.next_list % LIST_PAGES) * PAGE;
        self.next_list += 1;
        let entries: Vec<u8> = (0..npages)
            .flat_map(|i| {
                let page = (start + i * stride) % POOL_PAGES;
                let gpa = match page < POOL_LOW_PAGES {
                    true => POOL + page * PAGE,
                    false => HIGH + (page - POOL_LOW_PAGES) * PAGE,
                };
                gpa.to_le_bytes()
            })
            .collect();
        mem.write_slice(&entries, GuestAddress(list))
            .expect("list pages are guest memory");
        PageList {
            addr: Le64::from(list),
            npages: Le32::from(npages as u32),
            page_shift: 12,
            form: PageListForm::Direct as u8,
            reserved: Default::default(),
        }
    }

    /// One request, its opcode and payload.
    fn request(&mut self, mem: &GuestMemoryMmap, script: &mut Script<'_>) -> (u16, Vec<u8>) {
        let op = script.u8();
        let payload = match op % 16 {
            // Anything at all: an opcode, defined or not, and bytes.
            0 => {
                let opcode = u16::from(script.u8());
                let len = usize::from(script.u8());
                return (opcode, script.bytes(len));
            }
            1 => {
                let mut req: SetNotifyAreaRequest = script.raw();
                if op & 0x80 == 0 {
                    req.addr = Le64::from(NOTIFY_AREA);
                    req.doorbell_bitmap = Le64::from(DOORBELL_BITMAP);
                }
                (Opcode::SetNotifyArea, req.as_slice().to_vec())
            }
            2 => {
                let mut req: AddDoorbellAreaRequest = script.raw();
                if op & 0x80 == 0 {
                    req.addr = Le64::from(NOTIFY_AREA + 0x800);
                    req.doorbell_bitmap = Le64::from(SECOND_BITMAP);
                    req.bits = Le32::from(64);
                }
                (Opcode::AddDoorbellArea, req.as_slice().to_vec())
            }
            3 => (Opcode::AllocPd, Vec::new()),
            4 => {
                let mut req: CreateCqRequest = script.raw();
                if op & 0x80 == 0 {
                    let depth = Self::depth(script);
                    req.cqe = Le32::from(depth);
                    req.flags = Le32::from(0);
                    req.ring = self.page_list(mem, script, u64::from(depth) * 32);
                    req.doorbell = Self::record(script);
                }
                (Opcode::CreateCq, req.as_slice().to_vec())
            }
            5 => {
                let mut req: ResizeCqRequest = script.raw();
                if op & 0x80 == 0 {
                    let depth = Self::depth(script);
                    req.cq = self.handle(script);
                    req.cqe = Le32::from(depth);
                    req.ring = self.page_list(mem, script, u64::from(depth) * 32);
                }
                (Opcode::ResizeCq, req.as_slice().to_vec())
            }
            6 => {
                let mut req: RegMrRequest = script.raw();
                if op & 0x80 == 0 {
                    req.pd = self.handle(script);
                    let length = u64::from(script.u32() % (64 << 10)) + 1;
                    req.length = Le64::from(length);
                    let offset = req.virt_addr.to_native() % PAGE;
                    req.pages = self.page_list(mem, script, offset + length);
                }
                (Opcode::RegMr, req.as_slice().to_vec())
            }
            7 => {
                let mut req: CreateQpRequest = script.raw();
                if op & 0x80 == 0 {
                    req.pd = self.handle(script);
                    req.send_cq = self.handle(script);
                    req.recv_cq = self.handle(script);
                    req.srq = match script.u8() % 4 {
                        0 => self.handle(script),
                        _ => Le32::from(0),
                    };
                    req.qp_type = [2, 3, 4][usize::from(script.u8() % 3)];
                    req.sq_wqe_shift = 6 + script.u8() % 4;
                    req.rq_wqe_shift = match req.srq.to_native() {
                        0 => 4 + script.u8() % 4,
                        _ => 0,
                    };
                    req.max_send_wr = Le32::from(Self::depth(script));
                    req.max_recv_wr = match req.srq.to_native() {
                        0 => Le32::from(Self::depth(script)),
                        _ => Le32::from(0),
                    };
                    req.max_send_sge = Le32::from(u32::from(script.u8() % 4));
                    req.max_recv_sge = Le32::from(u32::from(script.u8() % 4));
                    req.max_inline_data = Le32::from(u32::from(script.u8() % 2) * 32);
                    req.doorbell_area = Le32::from(0);
                    let sq = u64::from(req.max_send_wr.to_native()) << req.sq_wqe_shift;
                    let rq = u64::from(req.max_recv_wr.to_native()) << req.rq_wqe_shift;
                    req.sq_ring = self.page_list(mem, script, sq);
                    req.rq_ring = self.page_list(mem, script, rq);
                    req.doorbell = Self::record(script);
                }
                (Opcode::CreateQp, req.as_slice().to_vec())
            }
            8 => {
                let mut req: ModifyQpRequest = script.raw();
                if op & 0x80 == 0 {
                    req.handle = self.handle(script);
                }
                (Opcode::ModifyQp, req.as_slice().to_vec())
            }
            9 => {
                let mut req: CreateSrqRequest = script.raw();
                if op & 0x80 == 0 {
                    req.pd = self.handle(script);
                    req.max_wr = Le32::from(Self::depth(script));
                    req.max_sge = Le32::from(u32::from(script.u8() % 4));
                    req.wqe_shift = 4 + script.u8() % 4;
                    req.doorbell_area = Le32::from(0);
                    let bytes = u64::from(req.max_wr.to_native()) << req.wqe_shift;
                    req.ring = self.page_list(mem, script, bytes);
                    req.doorbell = Self::record(script);
                }
                (Opcode::CreateSrq, req.as_slice().to_vec())
            }
            10 => {
                let mut req: CreateAhRequest = script.raw();
                if op & 0x80 == 0 {
                    req.pd = self.handle(script);
                }
                (Opcode::CreateAh, req.as_slice().to_vec())
            }
            // Queries, modifications and destruction of whatever a handle names.
            11 => {
                let opcode = [
                    Opcode::QueryQp,
                    Opcode::DestroyQp,
                    Opcode::DestroyCq,
                    Opcode::DeregMr,
                    Opcode::DeallocPd,
                    Opcode::DestroySrq,
                    Opcode::DestroyAh,
                    Opcode::DestroyDoorbellArea,
                    Opcode::ModifySrq,
                ][usize::from(script.u8() % 9)];
                let mut req = vec![0; opcode.request_size()];
                let handle = HandleRequest {
                    handle: self.handle(script),
                    ..Default::default()
                };
                let bytes = handle.as_slice();
                let len = req.len().min(bytes.len());
                req[..len].copy_from_slice(&bytes[..len]);
                (opcode, req)
            }
            12 => (Opcode::Reset, Vec::new()),
            13 => {
                let opcode = [Opcode::QueryDevice, Opcode::QueryPort, Opcode::QueryGid]
                    [usize::from(script.u8() % 3)];
                (opcode, script.bytes(opcode.request_size()))
            }
            // The driver writes into guest memory: anywhere in its first pages or the pool.
            _ => {
                let at = u64::from(script.u32()) % LOW_LEN;
                let len = usize::from(script.u8() % 64);
                let data = script.bytes(len);
                mem.write_slice(&data, GuestAddress(at)).ok();
                return (0, Vec::new());
            }
        };
        let (opcode, payload) = payload;
        (opcode as u16, payload)
    }
}

fuzz_target!(|input: &[u8]| {
    let fixture = fixture();
    let mut device = fixture.device.lock().unwrap_or_else(|e| e.into_inner());
    let mut script = Script(input);
    // The features the driver takes: all, or what the first byte leaves of them.
    let offered = device.offered_features();
    let taken = match script.u8() {
        0 => offered,
        mask => offered & (u64::from(mask) * 0x0101_0101_0101_0101),
    };
    device.set_acked_features(taken);
    let mut driver = Driver::default();
    while !script.is_empty() {
        let (opcode, payload) = driver.request(&fixture.mem, &mut script);
        if opcode == 0 {
            continue;
        }
        let room = match script.u8() {
            0 => usize::from(script.u8()),
            _ => 4096,
        };
        let request = request_bytes(opcode, &payload);
        let response = device.process_request(&fixture.mem, &request, room);
        let header_len = std::mem::size_of::<ResponseHeader>();
        if response.len() < header_len {
            assert!(
                room < header_len,
                "no response header with {room} bytes of room"
            );
            continue;
        }
        assert!(
            response.len() <= room,
            "{} bytes of response in {room}",
            response.len()
        );
        let header: ResponseHeader = read_wire(&response).expect("a response header");
        let status = Status::try_from(header.status.to_native()).expect("a defined status");
        // Every creating command's answer starts with the new handle.
        let creates = [
            Opcode::AllocPd,
            Opcode::CreateCq,
            Opcode::RegMr,
            Opcode::CreateQp,
            Opcode::CreateSrq,
            Opcode::CreateAh,
            Opcode::AddDoorbellArea,
        ];
        let created = creates.iter().any(|&c| c as u16 == opcode);
        if created && status == Status::Ok && response.len() >= header_len + 4 {
            let handle =
                u32::from_le_bytes(response[header_len..header_len + 4].try_into().unwrap());
            driver.handles.push(handle);
        }
    }
    device.reset();
    assert_eq!(device.object_count(), 0);
    assert_eq!(
        loopback::Device::named(DEVICE).resource_counts(),
        fixture.baseline,
        "host objects outlived the device's reset"
    );
});
