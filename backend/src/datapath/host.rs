//! What the data path asks of the host's queues: posting, polling, arming and failing. The
//! host verbs objects implement it; the data path's unit tests replace them with fakes over
//! plain memory.

use crate::hostverbs::{
    self, qp_attr_mask, CompletionQueue, ObjectId, QpAttr, QpState, QueuePair, RecvWr, SendBatch,
    SharedReceiveQueue, WorkCompletion,
};

pub trait HostQueuePair: Send + Sync {
    fn qp_num(&self) -> u32;
    /// Posts the batch in order; on a partial post, `Error::Post` says how many were taken.
    fn post_send(&self, batch: &mut SendBatch) -> hostverbs::Result<()>;
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> hostverbs::Result<()>;
    /// Moves the QP to the error state: the host flushes what is outstanding.
    fn set_error(&self) -> hostverbs::Result<()>;
}

pub trait HostCompletionQueue: Send + Sync {
    /// What names the CQ in the host's asynchronous events.
    fn id(&self) -> ObjectId;
    fn poll(&self, out: &mut [WorkCompletion]) -> hostverbs::Result<usize>;
    /// Asks for a completion event at the next completion.
    fn arm(&self) -> hostverbs::Result<()>;
}

pub trait HostSharedReceiveQueue: Send + Sync {
    /// What names the SRQ in the host's asynchronous events.
    fn id(&self) -> ObjectId;
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> hostverbs::Result<()>;
}

impl HostQueuePair for QueuePair {
    fn qp_num(&self) -> u32 {
        QueuePair::qp_num(self)
    }

    fn post_send(&self, batch: &mut SendBatch) -> hostverbs::Result<()> {
        batch.post(self)
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> hostverbs::Result<()> {
        QueuePair::post_recv(self, wrs)
    }

    fn set_error(&self) -> hostverbs::Result<()> {
        let attr = QpAttr {
            qp_state: QpState::Err,
            ..Default::default()
        };
        self.modify(&attr, qp_attr_mask::STATE)
    }
}

impl HostCompletionQueue for CompletionQueue {
    fn id(&self) -> ObjectId {
        CompletionQueue::id(self)
    }

    fn poll(&self, out: &mut [WorkCompletion]) -> hostverbs::Result<usize> {
        CompletionQueue::poll(self, out)
    }

    fn arm(&self) -> hostverbs::Result<()> {
        self.req_notify(false)
    }
}

impl HostSharedReceiveQueue for SharedReceiveQueue {
    fn id(&self) -> ObjectId {
        SharedReceiveQueue::id(self)
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> hostverbs::Result<()> {
        SharedReceiveQueue::post_recv(self, wrs)
    }
}
