//! vrdma guest library: RDMA verbs over the vrdma device, with no guest kernel driver.
//!
//! It speaks the wire format of `vrdma-spec` (see `spec/SPEC.md`) over a [`transport`]:
//! - direct attach ([`direct`]): the process is the vhost-user front end of a backend, sharing
//!   its memory through memfd (a process or container on the host);
//! - PCI ([`pci`]): inside a VM, the process drives the vrdma virtio-pci device from userspace.
//! - the guest service ([`service`]): the device is owned by `vrdmad`, which shares it among
//!   the programs of a VM or host; a program's data path still goes straight to the device.
//!
//! [`Device::open`] picks one at run time from a name (`pci`, or a socket path); the verbs API
//! ([`verbs`]) is the same whatever the transport.
//!
//! ```no_run
//! use vrdma_guest::{access, Device, QpType, QueuePair};
//! let device = Device::open("/run/vrdma.sock")?; // or Device::open("pci") inside a VM
//! let pd = device.alloc_pd()?;
//! let buffer = device.alloc_buffer(1 << 20)?;
//! let mr = pd.reg_mr(&buffer, access::LOCAL_WRITE | access::REMOTE_WRITE)?;
//! let cq = device.create_cq(256)?;
//! let qp = QueuePair::builder(QpType::Rc, &cq).max_send_wr(64).build(&pd)?;
//! # Ok::<(), vrdma_guest::Error>(())
//! ```

pub mod direct;
pub mod fork;
mod mmio;
pub mod pci;
pub mod pin;
mod poll;
pub mod service;
pub mod shm;
pub mod target;
pub mod transport;
pub mod verbs;
mod virtq;

use std::time::Duration;

/// The name programs see the device under (`ibv_get_device_name` in vrdma's libibverbs).
pub const DEVICE_NAME: &str = "vrdma0";
/// The device's node as programs that look for a kernel verbs device expect it (UCX keeps an
/// IB device only if this is a character device it may open read-write). vrdma has no kernel
/// driver: the node is only a marker, whose device is /dev/null's ([`DEVICE_NODE_NUMBERS`]),
/// and vrdma's libibverbs never opens it. vrdmad makes it with its socket's group and mode.
pub const DEVICE_NODE: &str = "/dev/infiniband/vrdma0";
/// The marker node's major and minor numbers: /dev/null's, which no open of it can harm.
pub const DEVICE_NODE_NUMBERS: (u64, u64) = (1, 3);

pub use direct::DirectOptions;
pub use fork::OpenedBy;
pub use shm::SharedBuffer;
pub use verbs::cm::{self, CmEvent, CmId, ConnParam};
pub use verbs::work;
pub use verbs::{
    access, qp_attr_mask, random_psn, AddressHandle, AhAttr, Chain, CompletionQueue, Device,
    MemoryRegion, ProtectionDomain, QpAttr, QpCaps, QpState, QpType, QueuePair, QueuePairBuilder,
    RcPeer, SharedReceiveQueue,
};
pub use vrdma_spec as spec;

/// 4 KiB: the page size guest-lib describes memory in (and pins it by).
pub const PAGE_SIZE: u64 = 4096;
pub use vrdma_spec::ctrl::{Opcode, Status};
pub use vrdma_spec::Gid;
pub use work::{
    wc_opcode, wc_status, DeviceEvent, Payload, RecvWr, SendOp, SendWr, Sge, UdDest, WorkCompletion,
};

/// Errors of guest-lib.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No vrdma device where the target says: no PCI device in the VM (or none at that
    /// address), or what it needs to be reached is missing.
    #[error("no vrdma device: {0}")]
    NoDevice(String),
    /// Another process (or driver) drives the device: in a VM, the guest service usually.
    #[error("{0}")]
    DeviceBusy(String),
    /// A system call on the way to the device failed: what was being done, and the OS error.
    #[error("{what}: {source}")]
    System {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The vhost-user conversation with a backend (direct attach) failed: at what, and how.
    #[error("{what}: {source}")]
    VhostUser {
        what: &'static str,
        #[source]
        source: vhost::Error,
    },
    /// The device (or the backend, or the guest service) is not one this library can drive:
    /// it lacks what the library needs, or says something the specification does not allow.
    #[error("the device cannot be driven by this library: {0}")]
    Incompatible(String),
    /// The guest service refused to serve this program (past its limits); its reason.
    #[error("the vrdma service refused this program: {0}")]
    ServiceRefused(String),
    #[error(
        "the device implements specification version {device}, this library version {}",
        vrdma_spec::SPEC_VERSION
    )]
    SpecVersion { device: u32 },
    #[error("the vrdma backend closed the connection before serving it: it serves no more guests now (another guest is connected and the backend does not share its GID, or it is at its --guests limit; its log says which)")]
    Refused,
    #[error("device transport: {0}")]
    Transport(#[source] std::io::Error),
    #[error("shared memory: {0}")]
    SharedMemory(#[source] std::io::Error),
    #[error(
        "pinning memory for the device ({call} of {}): {source}{}",
        crate::pin::PIN_DEVICE,
        pin_hint(source)
    )]
    Pin {
        call: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("no shared memory left for {0} bytes")]
    OutOfSharedMemory(u64),
    #[error("range {offset}+{len} outside a {size}-byte buffer")]
    OutOfBounds { offset: u64, len: u64, size: u64 },
    #[error("the device did not answer within {0:?}; the backend may be gone")]
    Timeout(Duration),
    #[error("{opcode:?} refused by the device: {status:?}{}", errno_suffix(*.detail))]
    Device {
        opcode: Opcode,
        status: Status,
        detail: u32,
    },
    #[error("the device answered {opcode:?} with a malformed response of {len} bytes")]
    BadResponse { opcode: Opcode, len: usize },
    #[error(
        "memory {addr:#x}+{len:#x} is not shared with the device; allocate it with Device::alloc_buffer"
    )]
    NotShared { addr: u64, len: u64 },
    #[error("memory {addr:#x}+{len:#x} is not physically contiguous, yet the device must find it by one address")]
    NotContiguous { addr: u64, len: u64 },
    #[error("the work queue is full after {posted} requests were posted")]
    QueueFull { posted: usize },
    #[error("{0}")]
    InvalidArgument(String),
    #[error("the device was reset (its backend restarted, or it failed): every object on it is gone; drop the Device and open it again")]
    DeviceReset,
    #[error("the vrdma device went away (its backend or the guest service closed the connection): every object on it is gone")]
    Disconnected,
    #[error("this process is a child forked from the one that opened the vrdma device: it cannot use its parent's device (nothing was sent); open the device again in the child")]
    Forked,
    /// A request past a limit that was refused before it reached the device: the memory
    /// regions a backend takes from one connection, or what the guest service lets a program
    /// or its user lock (libibverbs programs see `ENOMEM`).
    #[error("refused: {0}")]
    OverLimit(String),
}

/// What to do about a failed pin, where the error says something a user can change.
fn pin_hint(error: &std::io::Error) -> &'static str {
    match error.raw_os_error() {
        Some(libc::ENOENT) => ": load the vrdma_pin module (modprobe vrdma_pin; guest-lib/kmod)",
        Some(libc::ENOTTY) => {
            ": the loaded vrdma_pin module is older than this library: load its own"
        }
        Some(libc::ENOMEM) => {
            ": over the process's locked-memory limit (ulimit -l, RLIMIT_MEMLOCK)"
        }
        _ => "",
    }
}

fn errno_suffix(detail: u32) -> String {
    if detail == 0 {
        String::new()
    } else {
        format!(" ({})", std::io::Error::from_raw_os_error(detail as i32))
    }
}

impl Error {
    /// The device status, when the device refused a command.
    pub fn status(&self) -> Option<Status> {
        match self {
            Error::Device { status, .. } => Some(*status),
            _ => None,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
