//! The C edge for the device, its context and queries: libibverbs' exported functions, each
//! a thin skin over guest-lib (`objects` is the other half). C callers hand in raw pointers
//! that only they can vouch for, exactly as with the system's libibverbs.
//!
//! Objects programs receive (`ibv_device`, `ibv_context`, ...) are the first field of a
//! `#[repr(C)]` struct of this library's own, so a pointer a program passes back leads to
//! its guest-lib object. Verbs vrdma does not serve yet fail with `EOPNOTSUPP` and a NULL or
//! error return, as libibverbs documents for unsupported verbs.
//!
//! By subject: `device.rs` finds and opens the device, `queries.rs` answers queries of an
//! open one, `async_events.rs` hands out its asynchronous events, `compat.rs` holds the verbs
//! of no object. This file keeps what they share: the context.

mod async_events;
mod compat;
mod device;
mod queries;

use std::sync::{Arc, Mutex};

use rdma_sys::{ibv_context, verbs_context};
use vrdma_guest::Device;

use crate::events::{AsyncEvents, Dispatcher};

pub(crate) use device::{ibv_free_device_list, ibv_get_device_list, ibv_open_device, open_context};

/// An open device: libibverbs' extended context (which ends with the `ibv_context` programs
/// hold), then this library's state.
#[repr(C)]
pub(crate) struct VrdmaContext {
    verbs: verbs_context,
    pub(crate) device: Device,
    /// Routes the device's events to channels and to `async_events`.
    dispatcher: Mutex<Dispatcher>,
    /// What `ibv_get_async_event` hands out; its eventfd is `context->async_fd`.
    async_events: Arc<AsyncEvents>,
}

impl VrdmaContext {
    /// Runs `f` on the context's event dispatcher; the lock also serialises changes to
    /// channels' `refcnt`.
    pub(crate) fn with_dispatcher<R>(&self, f: impl FnOnce(&Dispatcher) -> R) -> R {
        f(&self.dispatcher.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// # Safety
/// `context` must be a context this library's `ibv_open_device` returned and not yet closed.
pub(crate) unsafe fn context_of<'a>(context: *mut ibv_context) -> &'a VrdmaContext {
    let offset = std::mem::offset_of!(verbs_context, context);
    // SAFETY: per the contract, `context` is the `verbs.context` field of a live
    // VrdmaContext whose first field is `verbs`; stepping back by the field's offset gives
    // the whole value.
    unsafe { &*(context.cast::<u8>().sub(offset).cast::<VrdmaContext>()) }
}
