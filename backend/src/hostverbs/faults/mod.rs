//! Failures on demand, a test instrument over any host: once a test takes a device's
//! [`Faults`] ([`Faults::on`]), every context and connection manager channel opened on that
//! device is wrapped, and the test can make a verb fail with an errno after a number of calls
//! (for posts: of work requests) succeed, take the port down and up, change a GID under the
//! guest, and fail a QP as a NIC's fatal error does. A NIC refuses rarely and rxe never on
//! cue, yet every host refusal is a path of the backend (HOST_ERROR to the guest, the undoing
//! of a half-made object, a post the host took only in part): with this they run under
//! `cargo test`, where they can be checked. A device nobody took the faults of is not
//! wrapped: the wrapper costs nothing outside tests.

mod cm;
mod objects;

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use super::event_queue::EventQueue;
use super::seam::{HostCmChannel, HostContext, HostQp};
use super::{qp_attr_mask, AsyncEvent, Error, Gid, QpAttr, QpState, Result};

/// A verb that can be made to fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    QueryPort,
    QueryGid,
    AllocPd,
    CreateCq,
    ResizeCq,
    RegMr,
    CreateQp,
    ModifyQp,
    QueryQp,
    CreateSrq,
    CreateAh,
    /// Counted by work request: a post fails at the request the fault falls on, with the
    /// requests before it carried out.
    PostSend,
    /// Counted by work request, as [`Verb::PostSend`].
    PostRecv,
    /// Counted by work request, as [`Verb::PostSend`].
    PostSrqRecv,
    CmCreateId,
    CmBind,
    CmResolveAddr,
    CmResolveRoute,
    CmListen,
    CmConnect,
    CmAccept,
    CmReject,
    CmEstablish,
    CmDisconnect,
    CmInitQpAttr,
}

impl Verb {
    /// The libibverbs (or librdmacm) call the verb stands for, as errors name it.
    pub const fn call(self) -> &'static str {
        match self {
            Verb::QueryPort => "ibv_query_port",
            Verb::QueryGid => "ibv_query_gid_ex",
            Verb::AllocPd => "ibv_alloc_pd",
            Verb::CreateCq => "ibv_create_cq",
            Verb::ResizeCq => "ibv_resize_cq",
            Verb::RegMr => "ibv_reg_mr",
            Verb::CreateQp => "ibv_create_qp",
            Verb::ModifyQp => "ibv_modify_qp",
            Verb::QueryQp => "ibv_query_qp",
            Verb::CreateSrq => "ibv_create_srq",
            Verb::CreateAh => "ibv_create_ah",
            Verb::PostSend => "ibv_post_send",
            Verb::PostRecv => "ibv_post_recv",
            Verb::PostSrqRecv => "ibv_post_srq_recv",
            Verb::CmCreateId => "rdma_create_id",
            Verb::CmBind => "rdma_bind_addr",
            Verb::CmResolveAddr => "rdma_resolve_addr",
            Verb::CmResolveRoute => "rdma_resolve_route",
            Verb::CmListen => "rdma_listen",
            Verb::CmConnect => "rdma_connect",
            Verb::CmAccept => "rdma_accept",
            Verb::CmReject => "rdma_reject",
            Verb::CmEstablish => "rdma_establish",
            Verb::CmDisconnect => "rdma_disconnect",
            Verb::CmInitQpAttr => "rdma_init_qp_attr",
        }
    }
}

impl fmt::Display for Verb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.call())
    }
}

/// `ibv_port_state` of a port taken down, and its physical state then.
const PORT_DOWN: u32 = 1;
const PHYS_STATE_DISABLED: u8 = 3;

/// What a test made of one device.
pub struct Faults {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    armed: Armed,
    port_down: bool,
    /// GID table entries that answer another GID ([`Faults::replace_gid`]).
    gids: HashMap<u32, Gid>,
    /// The source GID the connection manager's paths take ([`Faults::route_from_gid`]).
    cm_source_gid: Option<u8>,
    /// The asynchronous events of every wrapped context of the device.
    contexts: Vec<Weak<EventQueue<AsyncEvent>>>,
    /// Every QP made through the wrapper, by number.
    qps: HashMap<u32, FailableQp>,
}

/// A QP a fatal error can be raised on, and where its context hears of it.
struct FailableQp {
    qp: Weak<dyn HostQp>,
    events: Weak<EventQueue<AsyncEvent>>,
}

impl Faults {
    /// The faults of the device called `device`: contexts and connection manager channels
    /// opened on it from now on fail on demand.
    pub fn on(device: &str) -> Arc<Faults> {
        let mut devices = lock(registry());
        Arc::clone(devices.entry(device.to_string()).or_insert_with(|| {
            Arc::new(Faults {
                state: Mutex::default(),
            })
        }))
    }

    fn of(device: &str) -> Option<Arc<Faults>> {
        lock(registry()).get(device).cloned()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Makes a call of `verb` fail with `errno` once `successes` more have succeeded (for
    /// posts, counted by work request); failures armed for one verb fire in turn.
    pub fn fail(&self, verb: Verb, successes: u32, errno: i32) {
        self.state().armed.arm(verb, successes, errno);
    }

    /// Failures armed ([`Faults::fail`]) that have not fired yet.
    pub fn failures_pending(&self) -> usize {
        self.state().armed.pending()
    }

    /// Takes the port down or brings it up, as a cable pulled and put back: queries say so
    /// and every context gets PORT_ERR or PORT_ACTIVE. What is under test is what the
    /// backend tells its guests.
    pub fn set_port_active(&self, active: bool) {
        let mut state = self.state();
        if state.port_down != active {
            return;
        }
        state.port_down = !active;
        let event = match active {
            true => AsyncEvent::PortActive(1),
            false => AsyncEvent::PortError(1),
        };
        state.contexts.retain(|events| match events.upgrade() {
            Some(events) => {
                events.push(event);
                true
            }
            None => false,
        });
    }

    /// Makes queries of GID table entry `index` answer `gid`, as a host's table does when the
    /// address under an entry changes.
    pub fn replace_gid(&self, index: u32, gid: Gid) {
        self.state().gids.insert(index, gid);
    }

    /// Makes the connection manager's paths start from GID table entry `index` (`None`: the
    /// host's own choice), as it may where the host has several addresses on the guest's
    /// subnet.
    pub fn route_from_gid(&self, index: Option<u8>) {
        self.state().cm_source_gid = index;
    }

    /// A fatal error of QP `qpn`, as a NIC reports one: the QP enters the error state (its
    /// work flushed) and its context gets the QP_FATAL event. False if the device has no
    /// such QP.
    pub fn raise_qp_fatal(&self, qpn: u32) -> bool {
        // The lock is held throughout: the QP's wrapper takes it before the QP is destroyed.
        let state = self.state();
        let Some(entry) = state.qps.get(&qpn) else {
            return false;
        };
        let (Some(qp), Some(events)) = (entry.qp.upgrade(), entry.events.upgrade()) else {
            return false;
        };
        let error = QpAttr {
            qp_state: QpState::Err,
            ..QpAttr::default()
        };
        if let Err(e) = qp.modify(&error, qp_attr_mask::STATE) {
            log::warn!("QP {qpn}: cannot move it to the error state: {e}");
            return false;
        }
        events.push(AsyncEvent::QpFailed(qpn));
        true
    }

    /// Fails a call of `verb` when a failure armed for it falls on it.
    fn refuse(&self, verb: Verb) -> Result<()> {
        match self.state().armed.check(verb) {
            Ok(()) => Ok(()),
            Err(errno) => Err(Error::Verbs {
                call: verb.call(),
                source: io::Error::from_raw_os_error(errno),
            }),
        }
    }

    /// For a post of `count` work requests of `verb`: where a failure armed for it falls,
    /// as the requests taken before it and the errno.
    fn refuse_post(&self, verb: Verb, count: usize) -> Option<(usize, i32)> {
        let mut state = self.state();
        (0..count).find_map(|index| state.armed.check(verb).err().map(|errno| (index, errno)))
    }
}

/// The faults of every device a test took them of, by name.
fn registry() -> &'static Mutex<HashMap<String, Arc<Faults>>> {
    static DEVICES: OnceLock<Mutex<HashMap<String, Arc<Faults>>>> = OnceLock::new();
    DEVICES.get_or_init(Mutex::default)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// `host`, a context of `device`, failing on demand if a test took the device's faults.
pub(super) fn wrap_context(
    device: &str,
    host: Box<dyn HostContext>,
) -> Result<Box<dyn HostContext>> {
    match Faults::of(device) {
        None => Ok(host),
        Some(faults) => Ok(Box::new(objects::Context::new(host, faults)?)),
    }
}

/// `host`, a connection manager channel of `device`, failing on demand if a test took the
/// device's faults.
pub(super) fn wrap_cm_channel(
    device: &str,
    host: Box<dyn HostCmChannel>,
) -> Box<dyn HostCmChannel> {
    match Faults::of(device) {
        None => host,
        Some(faults) => Box::new(cm::Channel {
            inner: host,
            faults,
        }),
    }
}

/// One armed failure.
struct Fault {
    verb: Verb,
    /// Calls (posts: work requests) still to let through before failing.
    successes: u32,
    errno: i32,
}

/// The failures armed, each firing once, in the order armed for one verb.
#[derive(Default)]
struct Armed(Vec<Fault>);

impl Armed {
    fn arm(&mut self, verb: Verb, successes: u32, errno: i32) {
        self.0.push(Fault {
            verb,
            successes,
            errno,
        });
    }

    /// One call (or work request) of `verb`: the errno it fails with, if a failure armed
    /// for it falls on it now.
    fn check(&mut self, verb: Verb) -> std::result::Result<(), i32> {
        let Some(index) = self.0.iter().position(|f| f.verb == verb) else {
            return Ok(());
        };
        let fault = &mut self.0[index];
        if fault.successes > 0 {
            fault.successes -= 1;
            return Ok(());
        }
        Err(self.0.remove(index).errno)
    }

    fn pending(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_fires_once_after_its_successes_and_only_for_its_verb() {
        let mut armed = Armed::default();
        armed.arm(Verb::CreateQp, 2, libc::ENOMEM);
        armed.arm(Verb::CreateQp, 0, libc::EIO);
        assert_eq!(armed.check(Verb::RegMr), Ok(()));
        assert_eq!(armed.check(Verb::CreateQp), Ok(()));
        assert_eq!(armed.check(Verb::CreateQp), Ok(()));
        assert_eq!(armed.check(Verb::CreateQp), Err(libc::ENOMEM));
        assert_eq!(armed.pending(), 1);
        assert_eq!(armed.check(Verb::CreateQp), Err(libc::EIO));
        assert_eq!(armed.check(Verb::CreateQp), Ok(()));
        assert_eq!(armed.pending(), 0);
    }

    #[test]
    fn a_post_fails_at_the_request_the_fault_falls_on() {
        let faults = Faults::on("faults-unit-post");
        faults.fail(Verb::PostSend, 3, libc::EIO);
        assert_eq!(faults.refuse_post(Verb::PostSend, 2), None);
        assert_eq!(faults.refuse_post(Verb::PostSend, 4), Some((1, libc::EIO)));
        assert_eq!(faults.refuse_post(Verb::PostSend, 4), None);
    }
}
