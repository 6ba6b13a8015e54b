//! Completion queues and their event channels: made on a context, polled, armed, resized.

use std::fmt;
use std::sync::Arc;

use rdma_sys::{ibv_wc, ibv_wc_flags, ibv_wc_opcode, ibv_wc_status};

use super::seam::{HostChannel, HostCq};
use super::{Context, ObjectId, Result};

impl Context {
    /// A completion queue with room for at least `depth` completions; with a channel, armed
    /// completions ([`CompletionQueue::req_notify`]) are reported on it.
    pub fn create_cq(
        self: &Arc<Self>,
        depth: u32,
        channel: Option<&Arc<CompletionChannel>>,
    ) -> Result<Arc<CompletionQueue>> {
        let host = self
            .host
            .create_cq(depth, channel.map(|channel| &*channel.host))?;
        Ok(Arc::new(CompletionQueue {
            host,
            _made_of: Some((channel.cloned(), Arc::clone(self))),
        }))
    }

    /// A completion channel whose file descriptor is non-blocking, for epoll.
    pub fn create_comp_channel(self: &Arc<Self>) -> Result<Arc<CompletionChannel>> {
        Ok(Arc::new(CompletionChannel {
            host: self.host.create_comp_channel()?,
            _context: Arc::clone(self),
        }))
    }
}

/// A completion event channel: readable when an armed CQ attached to it gets a completion.
pub struct CompletionChannel {
    /// Dropped before the context (fields drop in order), as the seam requires.
    host: Box<dyn HostChannel>,
    _context: Arc<Context>,
}

impl CompletionChannel {
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.host.fd()
    }

    /// Consumes and acknowledges every pending event; returns how many there were.
    pub fn drain(&self) -> usize {
        self.host.drain()
    }
}

/// A host completion queue.
pub struct CompletionQueue {
    /// Dropped before what it was made of (fields drop in order), as the seam requires.
    host: Box<dyn HostCq>,
    /// Its channel, if any, and its context; none for a unit test's fake.
    _made_of: Option<(Option<Arc<CompletionChannel>>, Arc<Context>)>,
}

/// One completion, as polled from a host CQ.
#[repr(transparent)]
pub struct WorkCompletion(pub(super) ibv_wc);

impl WorkCompletion {
    /// A completion as a fake host CQ of a unit test hands it out.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn for_test(
        wr_id: u64,
        status: u32,
        opcode: u32,
        byte_len: u32,
        qp_num: u32,
    ) -> Self {
        let mut wc = WorkCompletion::default();
        wc.0.wr_id = wr_id;
        wc.0.status = status;
        wc.0.opcode = opcode;
        wc.0.byte_len = byte_len;
        wc.0.qp_num = qp_num;
        wc
    }
}

impl Default for WorkCompletion {
    fn default() -> Self {
        // SAFETY: all-zero is a valid ibv_wc (integers and a union of integers).
        WorkCompletion(unsafe { std::mem::zeroed() })
    }
}

impl WorkCompletion {
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }
    /// `ibv_wc_status` value; 0 is success.
    pub fn status(&self) -> u32 {
        self.0.status
    }
    pub fn is_success(&self) -> bool {
        self.0.status == ibv_wc_status::IBV_WC_SUCCESS
    }
    /// `ibv_wc_opcode` value.
    pub fn opcode(&self) -> u32 {
        self.0.opcode
    }
    /// A receive completion (`IBV_WC_RECV` or `IBV_WC_RECV_RDMA_WITH_IMM`).
    pub fn is_recv(&self) -> bool {
        self.0.opcode & ibv_wc_opcode::IBV_WC_RECV != 0
    }
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }
    pub fn src_qp(&self) -> u32 {
        self.0.src_qp
    }
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }
    pub fn wc_flags(&self) -> u32 {
        self.0.wc_flags
    }
    pub fn sl(&self) -> u8 {
        self.0.sl
    }
    pub fn pkey_index(&self) -> u16 {
        self.0.pkey_index
    }
    /// The immediate data as a host value, when the completion carries one.
    pub fn imm_data(&self) -> Option<u32> {
        (self.0.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0)
            // SAFETY: with IBV_WC_WITH_IMM set, the union holds imm_data.
            .then(|| u32::from_be(unsafe { self.0.imm_data_invalidated_rkey_union.imm_data }))
    }
}

impl fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.wr_id())
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .field("qp_num", &self.qp_num())
            .finish()
    }
}

impl CompletionQueue {
    /// A CQ over a fake host of a unit test, made of nothing.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn over_fake(host: Box<dyn HostCq>) -> CompletionQueue {
        CompletionQueue {
            host,
            _made_of: None,
        }
    }

    /// The host's CQ, for a host call that names it.
    pub(super) fn host(&self) -> &dyn HostCq {
        &*self.host
    }

    /// What names this CQ in an [`AsyncEvent`](super::AsyncEvent).
    pub fn id(&self) -> ObjectId {
        self.host.id()
    }

    /// Moves up to `out.len()` completions into `out`; returns how many.
    #[inline]
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        self.host.poll(out)
    }

    /// Asks for one event on the CQ's channel at the next (solicited) completion.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        self.host.req_notify(solicited_only)
    }

    /// Makes room for at least `depth` completions, keeping those the CQ holds; fails
    /// (EINVAL) if it holds more.
    pub fn resize(&self, depth: u32) -> Result<()> {
        self.host.resize(depth)
    }

    /// Capacity the provider actually allocated.
    pub fn depth(&self) -> u32 {
        self.host.depth()
    }
}
