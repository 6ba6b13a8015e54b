//! One program the service serves: its connection, the objects it created, the memory it
//! shared, and their release when it goes.

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use vrdma_guest::service::protocol::{self, Frame, Kind};
use vrdma_guest::shm::{Region, PAGE_SIZE};
use vrdma_spec::ctrl::{DeviceAttr, HandleRequest, Opcode, ResponseHeader, Status};
use vrdma_spec::{read_wire, ByteValued, Le16, Le32};

use crate::memory::Regions;
use crate::requests::{self, ObjectKind, ProgramMemory};
use crate::{raw_command, ProgramArea, Service};

/// Refusals logged per program before only every thousandth is: a program cannot flood the
/// log.
const LOGGED_REFUSALS: u64 = 10;

struct Program<'a> {
    service: &'a Service,
    id: u64,
    objects: HashMap<ObjectKind, HashSet<u32>>,
    memory: Regions,
    /// Its own doorbell area, once given (where the device offers them).
    area: Option<ProgramArea>,
    refusals: u64,
}

/// Serves the program connected on `stream` until it goes, then destroys what it left; or
/// refuses it when the service serves as many programs as it may.
pub(crate) fn serve(service: &Arc<Service>, id: u64, stream: UnixStream) {
    let who = peer(&stream)
        .map(|(pid, uid)| format!("pid {pid}, uid {uid}"))
        .unwrap_or_else(|e| format!("credentials unknown: {e}"));
    let max = service.limits.max_programs;
    if service.connected.fetch_add(1, Ordering::AcqRel) >= max {
        service.connected.fetch_sub(1, Ordering::AcqRel);
        log::warn!("program {id} ({who}) refused: {max} programs are served already");
        let why = format!("the vrdma service serves {max} programs at most (--max-programs)");
        let _ = protocol::send(&stream, Kind::Failed, why.as_bytes(), &[]);
        return;
    }
    log::info!("program {id} connected ({who})");
    let mut program = Program {
        service,
        id,
        objects: HashMap::new(),
        memory: Regions::default(),
        area: None,
        refusals: 0,
    };
    if let Err(e) = program.run(&stream) {
        log::warn!("program {id}: {e}");
    }
    program.release();
    service.connected.fetch_sub(1, Ordering::AcqRel);
}

impl Program<'_> {
    fn run(&mut self, stream: &UnixStream) -> io::Result<()> {
        let Some(hello) = protocol::recv(stream, protocol::MAX_PROGRAM_PAYLOAD)? else {
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
                Err(why) => {
                    self.count_refusal(format_args!("shared memory refused: {why}"));
                    protocol::send(stream, Kind::Failed, why.as_bytes(), &[])
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
        if let Some(kind) = plan.creates {
            let limit = self.service.limits.objects_per_program[&kind];
            if self.objects.get(&kind).map_or(0, HashSet::len) >= limit as usize {
                return self.refuse(
                    Status::NoResources,
                    format_args!("{opcode:?}: at its quota of {limit} {kind:?}s"),
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
        let mut reply = vec![0u8; std::mem::size_of::<ResponseHeader>() + opcode.response_size()];
        let written = match self.service.transport.control(&bytes, &mut reply) {
            Ok(written) => written,
            Err(e) => {
                log::error!(
                    "program {}: the device did not answer {opcode:?}: {e}",
                    self.id
                );
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
        }
        reply
    }

    /// Gives the program its own limits in place of the device's in QUERY_DEVICE's answer.
    fn show_program_limits(&self, reply: &mut [u8]) {
        let header = std::mem::size_of::<ResponseHeader>();
        if let Some(mut attr) = reply.get(header..).and_then(read_wire::<DeviceAttr>) {
            self.service.limits.program_device_attr(&mut attr);
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
            if let Some(handle) = reply.get(header..header + 4) {
                let handle = u32::from_le_bytes(handle.try_into().expect("4 bytes"));
                self.objects.entry(kind).or_default().insert(handle);
                owners.insert((kind, handle), self.id);
            }
        }
        if let Some((kind, handle)) = *destroys {
            if let Some(handles) = self.objects.get_mut(&kind) {
                handles.remove(&handle);
            }
            owners.remove(&(kind, handle));
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
        if handle != 0 {
            self.objects.entry(kind).or_default().insert(handle);
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
    /// address of each of its pages.
    fn add_memory(&mut self, frame: &Frame) -> Result<Vec<u64>, String> {
        let len = protocol::decode_u64(&frame.payload)
            .ok_or_else(|| "ADD_MEMORY carries a length of 8 bytes".to_string())?;
        let [file] = &frame.files[..] else {
            return Err("ADD_MEMORY carries one memfd".into());
        };
        let limits = &self.service.limits;
        if self.memory.count() >= limits.regions_per_program {
            return Err(format!(
                "at its quota of {} memory regions",
                limits.regions_per_program
            ));
        }
        if self.memory.bytes().saturating_add(len) > limits.bytes_per_program {
            return Err(format!(
                "{len} more bytes exceed its quota of {} bytes of shared memory",
                limits.bytes_per_program
            ));
        }
        let file = file.try_clone().map_err(|e| e.to_string())?;
        let region = Region::from_file(file, len).map_err(|e| e.to_string())?;
        let region = self
            .service
            .transport
            .adopt(region)
            .map_err(|e| e.to_string())?;
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
                match raw_command(
                    &*self.service.transport,
                    kind.destroy_opcode(),
                    request.as_slice(),
                ) {
                    Ok((Status::Ok, _)) => destroyed += 1,
                    Ok((status, _)) => log::error!(
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
        let bytes = self.memory.bytes();
        for region in self.memory.take() {
            if let Err(e) = self.service.transport.forget(&region) {
                log::error!("program {}: releasing its memory: {e}", self.id);
            }
        }
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

/// The process and user at the other end of `stream`.
fn peer(stream: &UnixStream) -> io::Result<(i32, u32)> {
    let credentials = getsockopt(stream, PeerCredentials)?;
    Ok((credentials.pid(), credentials.uid()))
}
