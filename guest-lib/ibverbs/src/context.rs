//! An open device's context: what a program's `ibv_context` leads to (this library's state
//! around it), how it is made and freed, and which contexts the process has open. The
//! exported functions of `abi`, `objects` and `rdmacm` find their context here.

use std::ptr;
use std::sync::{Arc, Mutex};

use rdma_sys::{ibv_context, verbs_context};
use vrdma_guest::Device;

use crate::events::{AsyncEvents, Dispatcher};

/// An open device: libibverbs' extended context (which ends with the `ibv_context` programs
/// hold), then this library's state.
#[repr(C)]
pub(crate) struct VrdmaContext {
    verbs: verbs_context,
    pub(crate) device: Device,
    /// Routes the device's events to channels and to `async_events`.
    dispatcher: Mutex<Dispatcher>,
    /// What `ibv_get_async_event` hands out; its eventfd is `context->async_fd`.
    pub(crate) async_events: Arc<AsyncEvents>,
}

impl VrdmaContext {
    /// Runs `f` on the context's event dispatcher; the lock also serialises changes to
    /// channels' `refcnt`.
    pub(crate) fn with_dispatcher<R>(&self, f: impl FnOnce(&Dispatcher) -> R) -> R {
        f(&self.dispatcher.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Makes the context of `device` around `verbs` and hands it to the program: the
/// `ibv_context` it holds until [`free_context`], counted among the open contexts.
pub(crate) fn make_context(
    verbs: verbs_context,
    device: Device,
    dispatcher: Dispatcher,
    async_events: Arc<AsyncEvents>,
) -> *mut ibv_context {
    let context = Box::into_raw(Box::new(VrdmaContext {
        verbs,
        device,
        dispatcher: Mutex::new(dispatcher),
        async_events,
    }));
    // SAFETY: `context` is a valid, uniquely owned allocation until ibv_close_device.
    let opened = unsafe { ptr::addr_of_mut!((*context).verbs.context) };
    open_contexts().push(opened as usize);
    opened
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

/// Closes `context`: it is no longer open, and its device and eventfd close.
///
/// # Safety
/// `context` must be a context [`make_context`] made, freed once.
pub(crate) unsafe fn free_context(context: *mut ibv_context) {
    open_contexts().retain(|&c| c != context as usize);
    // SAFETY: per the contract `context` came from make_context and is freed once; the
    // VrdmaContext it sits in was made by Box::new there.
    let owned = unsafe {
        let offset = std::mem::offset_of!(verbs_context, context);
        Box::from_raw(context.cast::<u8>().sub(offset).cast::<VrdmaContext>())
    };
    drop(owned); // guest-lib closes the device; the eventfd closes
}

/// The contexts open in the process, oldest first, by address: connection management uses
/// the program's own (a backend serves a process one connection).
fn open_contexts() -> std::sync::MutexGuard<'static, Vec<usize>> {
    static OPEN: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    OPEN.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether `context` is open, and the oldest open context.
pub(crate) fn open_context(context: Option<*mut ibv_context>) -> (bool, Option<*mut ibv_context>) {
    let open = open_contexts();
    let is_open = context.is_some_and(|c| open.contains(&(c as usize)));
    (is_open, open.first().map(|&c| c as *mut ibv_context))
}
