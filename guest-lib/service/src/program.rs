//! One program the service serves: its connection, the objects it created, the memory it
//! shared, and their release when it goes.

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use vrdma_guest::service::protocol::{self, Frame, Kind};
use vrdma_guest::shm::{Region, PAGE_SIZE};
use vrdma_spec::ctrl::{DeviceAttr, HandleRequest, Opcode, ResponseHeader, Status};
use vrdma_spec::{read_wire, ByteValued, Le16, Le32};

use crate::accounts::{memlock_of, Memlock};
use crate::memory::Regions;
use crate::requests::{self, ObjectKind, ProgramMemory};
use crate::{ProgramArea, Service};

/// Refusals logged per program before only every thousandth is: a program cannot flood the
/// log.
const LOGGED_REFUSALS: u64 = 10;

/// RLIMIT_MEMLOCK a process is held to when /proc does not tell its own (it lives in another
/// pid namespace): the kernel's default.
const DEFAULT_MEMLOCK: u64 = 8 << 20;

/// Who is at the other end of a program's connection (SO_PEERCRED).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Peer {
    pub(crate) uid: u32,
    /// Its process, as this service's pid namespace numbers it; `None` when it cannot
    /// (another namespace).
    pub(crate) pid: Option<i32>,
}

impl Peer {
    pub(crate) fn of(stream: &UnixStream) -> io::Result<Peer> {
        let credentials = getsockopt(stream, PeerCredentials)?;
        Ok(Peer {
            uid: credentials.uid(),
            pid: Some(credentials.pid()).filter(|&pid| pid > 0),
        })
    }
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.pid {
            Some(pid) => write!(f, "pid {pid}, uid {}", self.uid),
            None => write!(f, "pid unknown, uid {}", self.uid),
        }
    }
}

/// Why an ADD_MEMORY is not served.
enum MemoryRefusal {
    /// Malformed, or the memory cannot be used: FAILED.
    Failed(String),
    /// Past a limit: REFUSED (ENOMEM to libibverbs programs).
    OverLimit(String),
}

struct Program<'a> {
    service: &'a Service,
    id: u64,
    peer: Peer,
    objects: HashMap<ObjectKind, HashSet<u32>>,
    memory: Regions,
    /// Its own doorbell area, once given (where the device offers them).
    area: Option<ProgramArea>,
    /// Whether it holds a memory region of its share for its doorbell area.
    area_region: bool,
    refusals: u64,
    /// Whether the log said that its RLIMIT_MEMLOCK could not be read.
    memlock_unknown_said: bool,
}

/// Serves the program connected on `stream` (admitted already) until it goes, then destroys
/// what it left and gives back its share.
pub(crate) fn serve(service: &Arc<Service>, id: u64, stream: UnixStream, peer: Peer) {
    log::info!("program {id} connected ({peer})");
    let mut program = Program {
        service,
        id,
        peer,
        objects: HashMap::new(),
        memory: Regions::default(),
        area: None,
        area_region: false,
        refusals: 0,
        memlock_unknown_said: false,
    };
    if let Err(e) = program.run(&stream) {
        log::warn!("program {id}: {e}");
    }
    program.release();
    service.accounts().depart(peer.uid);
}

impl Program<'_> {
    /// Waits for the program's HELLO, at most the service's handshake time: a connection
    /// that says nothing holds its user's place no longer.
    fn hello(&self, stream: &UnixStream) -> io::Result<Option<Frame>> {
        let timeout = self.service.options.hello_timeout;
        stream.set_read_timeout(Some(timeout))?;
        let hello = match protocol::recv(stream, protocol::MAX_PROGRAM_PAYLOAD) {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                let why = format!("said no HELLO within {timeout:?}: closed");
                let _ = protocol::send(stream, Kind::Failed, why.as_bytes(), &[]);
                return Err(io::Error::new(io::ErrorKind::TimedOut, why));
            }
            other => other?,
        };
        stream.set_read_timeout(None)?;
        Ok(hello)
    }

    fn run(&mut self, stream: &UnixStream) -> io::Result<()> {
        let Some(hello) = self.hello(stream)? else {
            return Ok(());
        };
        let version = protocol::decode_u32(&hello.payload);
        if hello.kind != Kind::Hello || version != Some(protocol::VERSION) {
            let why = format!(
                "expected HELLO of version {}, got {:?} {version:?}",
                protocol::VERSION,
                hello.kind
            );
            protocol::send(stream, Kind::Failed, why.as_bytes(), &[])?;
            return Err(io::Error::new(io::ErrorKind::InvalidData, why));
        }
        let (events, theirs) = event_socket_pair()?;
        events.set_nonblocking(true)?;
        events.shutdown(std::net::Shutdown::Read)?;
        self.service
            .programs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(self.id, events);
        // A doorbell area of its own is a memory region of its own for the device.
        if self.service.has_program_areas() {
            if let Err(refusal) = self.service.accounts().take_region(self.peer.uid, 0) {
                let why = format!("the vrdma service cannot serve it: {refusal}");
                protocol::send(stream, Kind::Failed, why.as_bytes(), &[])?;
                return Err(io::Error::other(why));
            }
            self.area_region = true;
        }
        self.area = match self.service.add_program_area() {
            Ok(area) => area,
            Err(why) => {
                // Refused as a program past the service's limit is: told why, nothing held.
                let why = format!("the vrdma service could not serve it: {why}");
                protocol::send(stream, Kind::Failed, why.as_bytes(), &[])?;
                return Err(io::Error::other(why));
            }
        };
        let doorbells = match &self.area {
            Some(area) => {
                log::info!(
                    "program {} rings through doorbell area {}",
                    self.id,
                    area.number
                );
                &area.doorbells
            }
            None => &self.service.notify,
        };
        // The notification port only kicks the device: each program may have it.
        let port = self.service.transport.notify_port();
        let files: Vec<_> = [doorbells.file().as_raw_fd(), theirs.as_raw_fd()]
            .into_iter()
            .chain(port.map(|port| port.file.as_raw_fd()))
            .collect();
        let welcome = doorbells.welcome(&self.service.welcome);
        protocol::send(stream, Kind::Welcome, &welcome.encode(), &files)?;
        drop(theirs);
        while let Some(frame) = protocol::recv(stream, protocol::MAX_PROGRAM_PAYLOAD)? {
            self.answer(stream, frame)?;
        }
        Ok(())
    }

    fn answer(&mut self, stream: &UnixStream, frame: Frame) -> io::Result<()> {
        match frame.kind {
            // Descriptors a frame should not carry are closed with it.
            Kind::Control => {
                let response = self.control(&frame.payload);
                protocol::send(stream, Kind::ControlReply, &response, &[])
            }
            Kind::AddMemory => match self.add_memory(&frame) {
                Ok(pages) => {
                    protocol::send(stream, Kind::Memory, &protocol::encode_pages(&pages), &[])
                }
                Err(MemoryRefusal::Failed(why)) => {
                    self.count_refusal(format_args!("shared memory refused: {why}"));
                    protocol::send(stream, Kind::Failed, why.as_bytes(), &[])
                }
                Err(MemoryRefusal::OverLimit(why)) => {
                    self.count_refusal(format_args!("shared memory refused: {why}"));
                    protocol::send(stream, Kind::Refused, why.as_bytes(), &[])
                }
            },
            Kind::Notify => {
                let queue = protocol::decode_u32(&frame.payload).ok_or_else(|| bad("NOTIFY"))?;
                // A kick names a queue only; a bad one is the program's loss alone.
                if let Err(e) = self.service.transport.notify(queue) {
                    self.count_refusal(format_args!("kick refused: {e}"));
                }
                Ok(())
            }
            other => Err(bad(&format!("{other:?} from a program"))),
        }
    }

    /// Forwards one control request if the program may make it; returns the response.
    fn control(&mut self, request: &[u8]) -> Vec<u8> {
        let plan = match requests::plan(request) {
            Ok(plan) => plan,
            Err((status, why)) => return self.refuse(status, format_args!("{why}")),
        };
        let opcode = plan.opcode;
        for &(kind, handle) in &plan.names {
            if !self.owns(kind, handle) {
                return self.refuse(
                    Status::BadHandle,
                    format_args!("{opcode:?} names {kind:?} {handle:#x}, not its own"),
                );
            }
        }
        let mut bytes = plan.bytes;
        if let (Some(offset), Some(area)) = (plan.doorbell_area, &self.area) {
            bytes[offset..offset + 4].copy_from_slice(&area.number.to_le_bytes());
        }
        for &(offset, len) in &plan.records {
            let addr = requests::address_at(&bytes, offset);
            if !self.memory.owns(addr, len) {
                return self.refuse(
                    Status::BadAddress,
                    format_args!("{opcode:?} names a record at {addr:#x}, not its memory"),
                );
            }
        }
        // Page lists are read here, checked, and rewritten into the service's own memory, so
        // the device reads exactly what was checked.
        let mut list_pages = Vec::new();
        for &offset in &plan.page_lists {
            let list = requests::page_list_at(&bytes, offset);
            if list.npages.to_native() == 0 {
                // A QP's absent RQ (it receives from an SRQ): nothing to read.
                continue;
            }
            let (page_size, pages) = match requests::read_page_list(&self.memory, &list) {
                Ok(read) => read,
                Err(status) => {
                    return self.refuse(
                        status,
                        format_args!("{opcode:?} names pages that are not its memory"),
                    )
                }
            };
            match vrdma_guest::verbs::page_list(&*self.service.transport, page_size, &pages) {
                Ok((copy, pages)) => {
                    bytes[offset..offset + copy.as_slice().len()].copy_from_slice(copy.as_slice());
                    list_pages.extend(pages);
                }
                Err(e) => {
                    log::error!("program {}: copying a page list: {e}", self.id);
                    return response(Status::NoResources, 0);
                }
            }
        }
        // The object it creates is counted against its user's share before the device makes
        // it (two programs of one user cannot both take the last one), and given back if the
        // device does not.
        if let Some(kind) = plan.creates {
            if let Err(refusal) = self.service.accounts().take_object(self.peer.uid, kind) {
                return self.refuse(Status::NoResources, format_args!("{opcode:?}: {refusal}"));
            }
        }
        let give_back = |program: &Self| {
            if let Some(kind) = plan.creates {
                program
                    .service
                    .accounts()
                    .give_object(program.peer.uid, kind);
            }
        };
        let mut reply = vec![0u8; std::mem::size_of::<ResponseHeader>() + opcode.response_size()];
        let written = match self.service.transport.control(&bytes, &mut reply) {
            Ok(written) => written,
            Err(e) => {
                log::error!(
                    "program {}: the device did not answer {opcode:?}: {e}",
                    self.id
                );
                give_back(self);
                // What a driver sees of a device that is gone (SPEC.md §5.2).
                return response(Status::NotReady, 0);
            }
        };
        drop(list_pages);
        reply.truncate(written);
        let header: Option<ResponseHeader> = read_wire(&reply);
        if header.map(|h| h.status.to_native()) == Some(Status::Ok as u16) {
            self.record(&plan.creates, &plan.destroys, &reply);
            if let Some((kind, offset)) = plan.adopts {
                self.adopt(kind, offset, &reply);
            }
            if opcode == Opcode::QueryDevice {
                self.show_program_limits(&mut reply);
            }
        } else {
            give_back(self);
        }
        reply
    }

    /// Gives the program its own limits in place of the device's in QUERY_DEVICE's answer.
    fn show_program_limits(&self, reply: &mut [u8]) {
        let header = std::mem::size_of::<ResponseHeader>();
        if let Some(mut attr) = reply.get(header..).and_then(read_wire::<DeviceAttr>) {
            self.service
                .accounts()
                .shares()
                .program_device_attr(&mut attr);
            reply[header..header + attr.as_slice().len()].copy_from_slice(attr.as_slice());
        }
    }

    /// Notes what a successful request created or destroyed.
    fn record(
        &mut self,
        creates: &Option<ObjectKind>,
        destroys: &Option<(ObjectKind, u32)>,
        reply: &[u8],
    ) {
        let mut owners = self
            .service
            .owners
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(kind) = *creates {
            let header = std::mem::size_of::<ResponseHeader>();
            match reply.get(header..header + 4) {
                Some(handle) => {
                    let handle = u32::from_le_bytes(handle.try_into().expect("4 bytes"));
                    self.objects.entry(kind).or_default().insert(handle);
                    owners.insert((kind, handle), self.id);
                }
                // No handle to hold it by: counted as not made.
                None => self.service.accounts().give_object(self.peer.uid, kind),
            }
        }
        if let Some((kind, handle)) = *destroys {
            let held = self
                .objects
                .get_mut(&kind)
                .is_some_and(|handles| handles.remove(&handle));
            owners.remove(&(kind, handle));
            if held {
                self.service.accounts().give_object(self.peer.uid, kind);
            }
        }
    }

    /// Notes the object the device made for the program and named at `offset` of the
    /// response payload, if it named one (a CM id of a connection request). The device
    /// bounds these (a listener's backlog, its id quota), so no program quota applies.
    fn adopt(&mut self, kind: ObjectKind, offset: usize, reply: &[u8]) {
        let at = std::mem::size_of::<ResponseHeader>() + offset;
        let Some(handle) = reply.get(at..at + 4) else {
            return;
        };
        let handle = u32::from_le_bytes(handle.try_into().expect("4 bytes"));
        if handle != 0 && self.objects.entry(kind).or_default().insert(handle) {
            self.service.accounts().add_object(self.peer.uid, kind);
            self.service
                .owners
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert((kind, handle), self.id);
        }
    }

    fn owns(&self, kind: ObjectKind, handle: u32) -> bool {
        self.objects
            .get(&kind)
            .is_some_and(|handles| handles.contains(&handle))
    }

    /// Makes the memfd the program passed reachable by the device; returns the device
    /// address of each of its pages. Memory the device can reach is memory locked for it
    /// (the service locks it in a VM, a backend pins what is registered): it is charged to
    /// the program's process against its RLIMIT_MEMLOCK, as uverbs charges pinned pages, and
    /// to its user's and the service's shares, before it is taken.
    fn add_memory(&mut self, frame: &Frame) -> Result<Vec<u64>, MemoryRefusal> {
        let failed = |why: String| MemoryRefusal::Failed(why);
        let len = protocol::decode_u64(&frame.payload)
            .ok_or_else(|| failed("ADD_MEMORY carries a length of 8 bytes".into()))?;
        let [file] = &frame.files[..] else {
            return Err(failed("ADD_MEMORY carries one memfd".into()));
        };
        // Huge pages the pool may not have would end a backend's connection (SPEC.md §11
        // item 4), every program's: only memory of base pages is taken.
        match nix::sys::statfs::fstatfs(file.as_fd()) {
            Ok(fs) if fs.filesystem_type() == nix::sys::statfs::HUGETLBFS_MAGIC => {
                return Err(failed(
                    "memory of huge pages is not shared through the service".into(),
                ))
            }
            Ok(_) => {}
            Err(e) => return Err(failed(format!("its memory: fstatfs: {e}"))),
        }
        let file = file.try_clone().map_err(|e| failed(e.to_string()))?;
        // Checked (sealed, as large as announced) and mapped here before anything is charged.
        let region = Region::from_file(file, len).map_err(|e| failed(e.to_string()))?;
        let memlock = match self.peer.pid.map(memlock_of) {
            Some(Ok(memlock)) => memlock,
            unknown => {
                if !std::mem::replace(&mut self.memlock_unknown_said, true) {
                    let why = match unknown {
                        Some(Err(why)) => why,
                        _ => "its process is unknown".into(),
                    };
                    log::warn!(
                        "program {}: its RLIMIT_MEMLOCK is unknown ({why}): it is held to {DEFAULT_MEMLOCK} bytes",
                        self.id
                    );
                }
                Memlock::Bytes(DEFAULT_MEMLOCK)
            }
        };
        let regions = self.memory.count() + usize::from(self.area_region);
        let (uid, pid) = (self.peer.uid, self.peer.pid);
        {
            let mut accounts = self.service.accounts();
            accounts
                .take_region(uid, regions)
                .map_err(|refusal| MemoryRefusal::OverLimit(refusal.to_string()))?;
            if let Err(refusal) = accounts.take_bytes(uid, pid, self.memory.bytes(), len, memlock) {
                accounts.give_region(uid);
                return Err(MemoryRefusal::OverLimit(refusal.to_string()));
            }
        }
        let region = match self.service.transport.adopt(region) {
            Ok(region) => region,
            Err(e) => {
                let mut accounts = self.service.accounts();
                accounts.give_bytes(uid, pid, len);
                accounts.give_region(uid);
                return Err(match e {
                    vrdma_guest::Error::OverLimit(why) => MemoryRefusal::OverLimit(why),
                    e => failed(e.to_string()),
                });
            }
        };
        let pages = region
            .device_runs()
            .into_iter()
            .flat_map(|(device, _, len)| (device..device + len).step_by(PAGE_SIZE as usize))
            .collect();
        self.memory.add(region);
        Ok(pages)
    }

    fn refuse(&mut self, status: Status, why: std::fmt::Arguments) -> Vec<u8> {
        self.count_refusal(format_args!("refused with {status:?}: {why}"));
        response(status, 0)
    }

    fn count_refusal(&mut self, what: std::fmt::Arguments) {
        self.refusals += 1;
        if self.refusals <= LOGGED_REFUSALS || self.refusals.is_multiple_of(1000) {
            log::warn!("program {} (refusal {}): {what}", self.id, self.refusals);
        }
    }

    /// Destroys every object the program left on the device, users before what they use,
    /// then releases its memory, which the device no longer touches.
    fn release(&mut self) {
        self.service
            .programs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
        let mut destroyed = 0;
        for kind in ObjectKind::ALL {
            for handle in self.objects.remove(&kind).unwrap_or_default() {
                let request = HandleRequest {
                    handle: Le32::from(handle),
                    reserved: Le32::from(0),
                };
                match self
                    .service
                    .transport
                    .command(kind.destroy_opcode(), request.as_slice())
                    .map(|response| response.status)
                {
                    Ok(Status::Ok) => destroyed += 1,
                    Ok(status) => log::error!(
                        "program {}: destroying {kind:?} {handle:#x}: {status:?}",
                        self.id
                    ),
                    Err(e) => {
                        log::error!("program {}: destroying {kind:?} {handle:#x}: {e}", self.id)
                    }
                }
                self.service
                    .owners
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&(kind, handle));
                // Its share is back whatever the device answered: the program is gone.
                self.service.accounts().give_object(self.peer.uid, kind);
            }
        }
        // Its queues are gone: nothing rings through its doorbell area any more.
        if let Some(area) = self.area.take() {
            match self.service.remove_program_area(area) {
                Ok(Status::Ok) => {}
                Ok(status) => log::error!(
                    "program {}: removing its doorbell area: {status:?}",
                    self.id
                ),
                Err(e) => log::error!("program {}: removing its doorbell area: {e}", self.id),
            }
        }
        if std::mem::take(&mut self.area_region) {
            self.service.accounts().give_region(self.peer.uid);
        }
        let bytes = self.memory.bytes();
        for region in self.memory.take() {
            if let Err(e) = self.service.transport.forget(&region) {
                log::error!("program {}: releasing its memory: {e}", self.id);
            }
            self.service.accounts().give_region(self.peer.uid);
        }
        self.service
            .accounts()
            .give_bytes(self.peer.uid, self.peer.pid, bytes);
        log::info!(
            "program {} gone: {destroyed} objects destroyed, {bytes} bytes of memory released, {} refusals",
            self.id,
            self.refusals
        );
    }
}

/// A connected pair for a program's events: a seqpacket socket, whose 8-byte records arrive
/// whole or not at all (a stream could be left with part of one when it fills). It is used
/// as a stream is, through `UnixStream`'s reads and writes.
fn event_socket_pair() -> io::Result<(UnixStream, UnixStream)> {
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?;
    Ok((UnixStream::from(ours), UnixStream::from(theirs)))
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("malformed {what}"))
}

/// A response with `status` and no payload.
fn response(status: Status, detail: u32) -> Vec<u8> {
    ResponseHeader {
        status: Le16::from(status as u16),
        reserved: Le16::from(0),
        detail: Le32::from(detail),
    }
    .as_slice()
    .to_vec()
}
