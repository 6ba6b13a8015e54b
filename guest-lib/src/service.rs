//! A program served by the guest service (`vrdmad`), which owns the device and shares it
//! among the programs of a VM (or a host): this transport sends set-up (control requests,
//! memory) and kicks of a sleeping poller over the service's unix socket (kicks through the
//! device's notification port instead, when the service hands it over), while the rings,
//! doorbell records and CQs the program posts and polls stay in memory it shares with the
//! device, and the doorbell bitmap is the one the service set up for the device.

pub mod protocol;

use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vrdma_spec::config::DeviceConfig;
use vrdma_spec::ring::Event;
use vrdma_spec::{read_wire, ByteValued};

use crate::shm::{Region, RegionSet, SharedBuffer, PAGE_SIZE};
use crate::transport::{NotifyPort, Transport};
use crate::{Error, Result};
use protocol::{Frame, Kind};

/// Shared memory added first, unless one allocation needs more. Each later region is as
/// large as all before it together: a program's first rings take little of what the service
/// locks and charges to it (SPEC.md §12), and one that shares much memory needs few regions,
/// which a backend's memory table holds only so many of.
const FIRST_REGION_SIZE: u64 = 256 << 10;

pub struct ServiceTransport {
    /// Requests and their replies, one at a time.
    socket: Mutex<UnixStream>,
    /// The device's events about this program's objects, 8 bytes each.
    events: UnixStream,
    config: DeviceConfig,
    features: u64,
    /// The service's notify area and doorbell bitmap, mapped here.
    notify: Arc<Region>,
    bitmap_offset: u64,
    bitmap_len: u64,
    /// The device's notification port, when the service handed it over: kicks go straight
    /// to the device rather than through the service.
    notify_port: Option<NotifyPort>,
    memory: RegionSet,
}

/// An error on the socket to the service: the service gone (its end closed) is
/// [`Error::Disconnected`].
fn socket_error(error: std::io::Error) -> Error {
    use std::io::ErrorKind::{BrokenPipe, ConnectionReset, UnexpectedEof};
    match error.kind() {
        BrokenPipe | ConnectionReset | UnexpectedEof => Error::Disconnected,
        _ => Error::Transport(error),
    }
}

fn protocol_error(what: impl std::fmt::Display) -> Error {
    Error::Incompatible(format!("the vrdma service: {what}"))
}

impl ServiceTransport {
    /// Connects to the service listening on `socket`.
    pub fn connect(socket: &Path) -> Result<ServiceTransport> {
        let stream = UnixStream::connect(socket).map_err(|source| Error::System {
            what: format!("connecting to the vrdma service at {}", socket.display()),
            source,
        })?;
        Self::greet(stream)
    }

    /// Says HELLO to the service at the other end of `stream` and takes its WELCOME.
    fn greet(stream: UnixStream) -> Result<ServiceTransport> {
        // A service that refuses the program says why at once and closes the connection,
        // maybe before the HELLO is sent: its reason is read all the same.
        let hello = protocol::send(&stream, Kind::Hello, &protocol::VERSION.to_le_bytes(), &[]);
        let answer = protocol::recv(&stream, protocol::MAX_SERVICE_PAYLOAD);
        let Frame {
            kind,
            payload,
            mut files,
        } = match (hello, answer) {
            (_, Ok(Some(frame))) if frame.kind == Kind::Failed => {
                return Err(Error::ServiceRefused(
                    String::from_utf8_lossy(&frame.payload).into_owned(),
                ))
            }
            (Err(e), _) => return Err(Error::Transport(e)),
            (Ok(()), answer) => answer
                .map_err(Error::Transport)?
                .ok_or_else(|| protocol_error("closed the connection before welcoming it"))?,
        };
        let welcome = match protocol::Welcome::decode(&payload) {
            Some(welcome)
                if kind == Kind::Welcome
                    && files.len() == 2 + usize::from(welcome.notify_port.is_some()) =>
            {
                welcome
            }
            _ => return Err(protocol_error(format!("a malformed welcome ({kind:?})"))),
        };
        if welcome.version != protocol::VERSION {
            return Err(protocol_error(format!(
                "speaks version {}, this library {}",
                welcome.version,
                protocol::VERSION
            )));
        }
        let config: DeviceConfig = read_wire(&welcome.config)
            .filter(|_| welcome.config.len() == std::mem::size_of::<DeviceConfig>())
            .ok_or_else(|| protocol_error("a configuration space of the wrong size"))?;
        let notify_port = welcome.notify_port.map(|offset| NotifyPort {
            file: files.pop().expect("a third"),
            offset,
        });
        let events = UnixStream::from(std::os::fd::OwnedFd::from(files.pop().expect("two")));
        let notify = Arc::new(Region::from_file(
            files.pop().expect("two"),
            welcome.notify_len,
        )?);
        let transport = ServiceTransport {
            socket: Mutex::new(stream),
            events,
            config,
            features: welcome.features,
            notify,
            bitmap_offset: welcome.bitmap_offset,
            bitmap_len: welcome.bitmap_len,
            notify_port,
            memory: RegionSet::default(),
        };
        // The views must fit, or the device would be driven through memory that is not there.
        transport
            .notify_area()
            .ok_or_else(|| protocol_error("a notify area too small for the device"))?;
        Ok(transport)
    }

    /// Sends one request and waits for its reply, which must be of kind `reply`.
    fn call(&self, kind: Kind, payload: &[u8], files: &[i32], reply: Kind) -> Result<Vec<u8>> {
        let socket = self.socket.lock().unwrap_or_else(|e| e.into_inner());
        protocol::send(&socket, kind, payload, files).map_err(socket_error)?;
        let frame = protocol::recv(&socket, protocol::MAX_SERVICE_PAYLOAD)
            .map_err(socket_error)?
            .ok_or(Error::Disconnected)?;
        let reason = || String::from_utf8_lossy(&frame.payload).into_owned();
        match frame.kind {
            kind if kind == reply => Ok(frame.payload),
            Kind::Failed => Err(Error::InvalidArgument(format!(
                "the vrdma service refused: {}",
                reason()
            ))),
            Kind::Refused => Err(Error::OverLimit(format!("the vrdma service: {}", reason()))),
            other => Err(protocol_error(format!("answered {kind:?} with {other:?}"))),
        }
    }

    /// Hands `region` to the service, which makes it reachable by the device and says where
    /// the device sees each of its pages.
    fn announce(&self, region: Region) -> Result<Arc<Region>> {
        let file = region.file().ok_or_else(|| {
            Error::InvalidArgument("memory without a file cannot be shared".into())
        })?;
        let payload = self.call(
            Kind::AddMemory,
            &region.size().to_le_bytes(),
            &[file.as_raw_fd()],
            Kind::Memory,
        )?;
        let pages = protocol::decode_pages(&payload)
            .ok_or_else(|| protocol_error("a malformed page list"))?;
        region.with_device_pages(pages).map(Arc::new)
    }
}

impl Transport for ServiceTransport {
    fn config(&self) -> &DeviceConfig {
        &self.config
    }

    fn features(&self) -> u64 {
        self.features
    }

    fn control(&self, request: &[u8], response: &mut [u8]) -> Result<usize> {
        let reply = self.call(Kind::Control, request, &[], Kind::ControlReply)?;
        let written = reply.len().min(response.len());
        response[..written].copy_from_slice(&reply[..written]);
        Ok(written)
    }

    fn alloc(&self, len: u64, align: u64) -> Result<SharedBuffer> {
        let next_region = self.memory.owned_bytes().max(FIRST_REGION_SIZE);
        self.memory.alloc_or_grow(len, align, next_region, |size| {
            self.announce(Region::create(size)?)
        })
    }

    fn notify(&self, queue: u32) -> Result<()> {
        if let Some(port) = &self.notify_port {
            return port.kick(queue);
        }
        let socket = self.socket.lock().unwrap_or_else(|e| e.into_inner());
        protocol::send(&socket, Kind::Notify, &queue.to_le_bytes(), &[]).map_err(socket_error)
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<Event>> {
        if !crate::poll::readable(&self.events, timeout).map_err(Error::Transport)? {
            return Ok(None);
        }
        let mut event = Event::default();
        match (&self.events).read_exact(event.as_mut_slice()) {
            Ok(()) => Ok(Some(event)),
            // The service went away: every object of this program is gone with it.
            Err(e) => Err(socket_error(e)),
        }
    }

    unsafe fn share(&self, addr: u64, len: u64) -> Result<()> {
        // SAFETY: the caller's contract is Region::share_in_place's.
        unsafe {
            self.memory.share(addr, len, |start, len| {
                self.announce(Region::share_in_place(start, len)?)
            })
        }
    }

    fn device_pages(&self, addr: u64, len: u64) -> Option<(u64, Vec<u64>)> {
        self.memory.device_pages(addr, len)
    }

    fn notify_area(&self) -> Option<(SharedBuffer, SharedBuffer)> {
        let notify_len =
            vrdma_spec::codec::notify_area_bytes(self.config.num_notify_queues.to_native());
        if notify_len > PAGE_SIZE || self.bitmap_offset < notify_len {
            return None;
        }
        Some((
            self.notify.view(0, notify_len).ok()?,
            self.notify.view(self.bitmap_offset, self.bitmap_len).ok()?,
        ))
    }

    fn disconnected(&self) -> bool {
        crate::poll::hung_up(&self.events)
    }

    fn publish_bogus_control_entries(&self, _ahead: u16) -> Result<()> {
        Err(Error::InvalidArgument(
            "a program served by the vrdma service does not drive the control queue".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_refused_before_its_hello_is_told_why() {
        let (program, service) = UnixStream::pair().unwrap();
        protocol::send(&service, Kind::Failed, b"user 7 has 1 programs", &[]).unwrap();
        // Closed before the program says anything: its HELLO finds no one.
        drop(service);
        let refused = ServiceTransport::greet(program).err().expect("refused");
        assert!(
            refused.to_string().contains("user 7 has 1 programs"),
            "{refused}"
        );
    }
}
