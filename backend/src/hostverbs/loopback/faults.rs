//! Failures on demand, a test instrument: a loopback device can be told to fail a verb
//! with an errno, after a number of calls (or, for posts, of work requests) succeed. A NIC
//! refuses rarely and rxe never on cue, yet every host refusal is a path of the backend
//! (HOST_ERROR to the guest, the undoing of a half-made object, a post the host took only
//! part of): with this they run under `cargo test`, where they can be checked.

use std::fmt;

/// A verb of the loopback device that can be made to fail.
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

/// One armed failure.
struct Fault {
    verb: Verb,
    /// Calls (posts: work requests) still to let through before failing.
    successes: u32,
    errno: i32,
}

/// The failures a device has armed, each firing once, in the order armed for one verb.
#[derive(Default)]
pub(super) struct Faults {
    armed: Vec<Fault>,
}

impl Faults {
    pub(super) fn arm(&mut self, verb: Verb, successes: u32, errno: i32) {
        self.armed.push(Fault {
            verb,
            successes,
            errno,
        });
    }

    /// One call (or work request) of `verb`: the errno it fails with, if a failure armed
    /// for it falls on it now.
    pub(super) fn check(&mut self, verb: Verb) -> Result<(), i32> {
        let Some(index) = self.armed.iter().position(|f| f.verb == verb) else {
            return Ok(());
        };
        let fault = &mut self.armed[index];
        if fault.successes > 0 {
            fault.successes -= 1;
            return Ok(());
        }
        Err(self.armed.remove(index).errno)
    }

    /// Failures armed that have not fired yet.
    pub(super) fn pending(&self) -> usize {
        self.armed.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_fires_once_after_its_successes_and_only_for_its_verb() {
        let mut faults = Faults::default();
        faults.arm(Verb::CreateQp, 2, libc::ENOMEM);
        faults.arm(Verb::CreateQp, 0, libc::EIO);
        assert_eq!(faults.check(Verb::RegMr), Ok(()));
        assert_eq!(faults.check(Verb::CreateQp), Ok(()));
        assert_eq!(faults.check(Verb::CreateQp), Ok(()));
        assert_eq!(faults.check(Verb::CreateQp), Err(libc::ENOMEM));
        assert_eq!(faults.pending(), 1);
        assert_eq!(faults.check(Verb::CreateQp), Err(libc::EIO));
        assert_eq!(faults.check(Verb::CreateQp), Ok(()));
        assert_eq!(faults.pending(), 0);
    }
}
