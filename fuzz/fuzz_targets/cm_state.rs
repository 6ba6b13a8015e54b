//! Sequences of CM commands (SPEC.md §13.3) and host events over a few ids, through the
//! device's id-state table (`vrdma_backend::device::cm_state`), against a model of what the
//! host's connection manager does with each call: its kernel's id states (rdma_cm's
//! `cma.c`) and what librdmacm dereferences. The device runs a command on the host only where
//! the table allows it, and keeps the state the table names once the host carried it out,
//! as `device/cm.rs` does.
//!
//! Checked: no command the table allows reaches librdmacm where it would read a NULL
//! device (`rdma_resolve_route` reads `id->verbs->device`; `rdma_connect` and `rdma_accept`
//! read `id->cma_dev`): the backend's SIGSEGV of the issue; the table answers every command
//! and event without panicking; and it does not refuse the steps of an ordinary connection
//! (bind and listen, resolve and connect, accept or reject, establish, disconnect).
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_backend::device::cm_state::{verdict, CmCommand, IdState, Verdict};
use vrdma_backend::device::Refusal;
use vrdma_spec::cm::cm_event;
use vrdma_spec::ctrl::Status;

/// The host id's state in its kernel (`enum rdma_cm_state`, the steps a ucma id takes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Idle,
    AddrBound,
    AddrQuery,
    AddrResolved,
    RouteQuery,
    RouteResolved,
    Listen,
    /// Active, REQ sent (RDMA_CM_CONNECT).
    ReqSent,
    /// Active, the REP came (still RDMA_CM_CONNECT): CONNECT_RESPONSE was delivered.
    RepReceived,
    /// Passive, the REQ came (RDMA_CM_CONNECT).
    ReqReceived,
    /// Passive, REP sent.
    RepSent,
    Established,
    Disconnected,
    /// Rejected, unreachable or timed out.
    Failed,
}

/// One id as the host has it.
#[derive(Clone, Copy, Debug)]
struct HostId {
    kernel: Kernel,
    /// librdmacm knows the id's device (`id->verbs`, `id->cma_dev` set): once it was bound to
    /// the driver's address (CM_BIND binds that address, on the device), once ADDR_RESOLVED
    /// was handed out, or from a connection request. Not after a resolution from an unbound
    /// id that failed: the kernel bound it, librdmacm never asked.
    device: bool,
    ud: bool,
}

/// A device id: the state the device keeps, and the host's id it stands for.
#[derive(Clone, Copy, Debug)]
struct Id {
    state: IdState,
    host: HostId,
}

impl HostId {
    fn new(ud: bool) -> HostId {
        HostId {
            kernel: Kernel::Idle,
            device: false,
            ud,
        }
    }

    /// The call librdmacm and the kernel make of `command`: panics where librdmacm would
    /// read a NULL pointer; `Err` where the kernel refuses (EINVAL), which changes nothing.
    fn call(&mut self, command: CmCommand) -> Result<(), ()> {
        use Kernel::*;
        let next = match command {
            CmCommand::DestroyId | CmCommand::Query | CmCommand::GetEvent => self.kernel,
            CmCommand::Bind => match self.kernel {
                Idle => {
                    // rdma_bind_addr queries the route: the driver's address is on the device.
                    self.device = true;
                    AddrBound
                }
                _ => return Err(()),
            },
            // An unbound id is bound first (to the driver's address, by the kernel alone).
            CmCommand::ResolveAddr => match self.kernel {
                Idle | AddrBound => AddrQuery,
                _ => return Err(()),
            },
            CmCommand::ResolveRoute => {
                assert!(
                    self.device,
                    "rdma_resolve_route on an id without a device: NULL id->verbs"
                );
                match self.kernel {
                    AddrResolved => RouteQuery,
                    _ => return Err(()),
                }
            }
            CmCommand::Listen => match self.kernel {
                // Natively an unbound id listens on every address; rdma_listen then queries
                // the route, which gives no device for a wildcard address.
                Idle => Listen,
                AddrBound | Listen => Listen,
                _ => return Err(()),
            },
            CmCommand::Connect => {
                assert!(self.device, "rdma_connect reads a NULL id->cma_dev");
                match self.kernel {
                    RouteResolved => ReqSent,
                    _ => return Err(()),
                }
            }
            CmCommand::Accept => {
                assert!(self.device, "rdma_accept reads a NULL id->cma_dev");
                match self.kernel {
                    ReqReceived => RepSent,
                    _ => return Err(()),
                }
            }
            // rdma_establish: the kernel's accept on the active side, sending the RTU.
            CmCommand::Establish => match self.kernel {
                RepReceived => Established,
                _ => return Err(()),
            },
            CmCommand::Reject => match self.kernel {
                ReqReceived | RepReceived => Failed,
                _ => return Err(()),
            },
            // librdmacm's rdma_disconnect checks id->verbs itself; the kernel needs the IB CM
            // id a connection made, and always answers 0 then.
            CmCommand::Disconnect => match (self.device, self.kernel) {
                (false, _) => return Err(()),
                (_, ReqSent | RepReceived | RepSent | Established | Disconnected) => Disconnected,
                (_, Failed) => Failed,
                _ => return Err(()),
            },
            // No pointer of the id is read; the kernel needs a device for any attributes.
            CmCommand::InitQpAttr => match self.device {
                true => self.kernel,
                false => return Err(()),
            },
        };
        self.kernel = next;
        Ok(())
    }

    /// The events the host may deliver for the id now, each with the kernel state after it.
    fn deliverable(&self) -> Vec<(u32, Kernel)> {
        use Kernel::*;
        let mut events = match self.kernel {
            AddrQuery => vec![
                (cm_event::ADDR_RESOLVED, AddrResolved),
                (cm_event::ADDR_ERROR, AddrBound),
            ],
            RouteQuery => vec![
                (cm_event::ROUTE_RESOLVED, RouteResolved),
                (cm_event::ROUTE_ERROR, AddrResolved),
            ],
            ReqSent => vec![
                match self.ud {
                    true => (cm_event::ESTABLISHED, Established),
                    false => (cm_event::CONNECT_RESPONSE, RepReceived),
                },
                (cm_event::REJECTED, Failed),
                (cm_event::UNREACHABLE, Failed),
                (cm_event::CONNECT_ERROR, Failed),
            ],
            RepReceived => vec![(cm_event::DISCONNECTED, Disconnected)],
            // A UD id's answer ends the exchange: nothing follows on it.
            RepSent if self.ud => Vec::new(),
            RepSent => vec![
                (cm_event::ESTABLISHED, Established),
                (cm_event::CONNECT_ERROR, Failed),
                (cm_event::REJECTED, Failed),
            ],
            Established => vec![(cm_event::DISCONNECTED, Disconnected)],
            _ => Vec::new(),
        };
        for (event, kernel) in [
            (cm_event::DEVICE_REMOVAL, self.kernel),
            (cm_event::ADDR_CHANGE, self.kernel),
            (cm_event::TIMEWAIT_EXIT, self.kernel),
        ] {
            events.push((event, kernel));
        }
        events
    }
}

/// The steps of an ordinary connection the table must take where the host would.
fn ordinary(kernel: Kernel, command: CmCommand) -> bool {
    use Kernel::*;
    matches!(
        (kernel, command),
        (Idle, CmCommand::Bind | CmCommand::ResolveAddr)
            | (AddrBound, CmCommand::ResolveAddr | CmCommand::Listen)
            | (AddrResolved, CmCommand::ResolveRoute)
            | (RouteResolved, CmCommand::Connect)
            | (ReqReceived, CmCommand::Accept | CmCommand::Reject)
            | (RepReceived, CmCommand::Establish)
            | (Established, CmCommand::Disconnect)
            | (
                _,
                CmCommand::Query | CmCommand::GetEvent | CmCommand::DestroyId
            )
    )
}

const SLOTS: usize = 4;

fuzz_target!(|input: &[u8]| {
    let mut ids: [Option<Id>; SLOTS] = [None; SLOTS];
    for step in input.chunks_exact(2) {
        let (op, arg) = (step[0], step[1]);
        let slot = usize::from(arg) % SLOTS;
        match op % 17 {
            // CM_CREATE_ID (TCP or UDP).
            13 => {
                ids[slot] = Some(Id {
                    state: IdState::Idle,
                    host: HostId::new(arg & 0x80 != 0),
                })
            }
            // A connection request came to a listener of the driver's: the device makes an
            // id for it.
            14 => {
                let listening = ids.iter().flatten().any(|i| i.state == IdState::Listening);
                if listening {
                    ids[slot] = Some(Id {
                        state: IdState::Requested,
                        host: HostId {
                            kernel: Kernel::ReqReceived,
                            device: true,
                            ud: arg & 0x80 != 0,
                        },
                    });
                }
            }
            // The host delivers one of the events it may for the id.
            15 | 16 => {
                let Some(id) = ids[slot].as_mut() else {
                    continue;
                };
                let events = id.host.deliverable();
                let (event, kernel) = events[usize::from(arg >> 2) % events.len()];
                if event == cm_event::ADDR_RESOLVED {
                    // librdmacm takes the id's device as it hands the event out.
                    id.host.device = true;
                }
                id.host.kernel = kernel;
                id.state = id.state.after_event(event);
            }
            command => {
                let command = CmCommand::ALL[usize::from(command)];
                let Some(id) = ids[slot].as_mut() else {
                    continue;
                };
                let ordinary = ordinary(id.host.kernel, command);
                match verdict(id.state, command) {
                    Verdict::Refused => {
                        assert!(
                            !ordinary,
                            "{command:?} refused in {:?}, host {:?}",
                            id.state, id.host
                        );
                        let refusal = Refusal::CmState {
                            state: id.state,
                            command,
                        };
                        assert_eq!(refusal.status(), Status::InvalidArgument);
                        assert_eq!(refusal.detail(), 22);
                    }
                    Verdict::Allowed { next } => {
                        if id.host.call(command).is_ok() {
                            id.state = next;
                        }
                        if command == CmCommand::DestroyId {
                            ids[slot] = None;
                        }
                    }
                }
            }
        }
    }
});
