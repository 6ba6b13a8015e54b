//! The device's asynchronous events, as `ibv_get_async_event` hands them out.
use std::os::raw::c_int;

use rdma_sys::{ibv_async_event, ibv_context};

use crate::context::context_of;
use crate::errno::set_errno;
use crate::events::Element;

// ---- asynchronous events -----------------------------------------------------------------

/// The next asynchronous event (a QP or CQ failed, the port changed state, the device is
/// gone): 0, or -1 with errno (EAGAIN when `async_fd` is non-blocking and there is none).
/// Destroying an object drops its events not yet taken.
#[no_mangle]
unsafe extern "C" fn ibv_get_async_event(
    context: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    if context.is_null() || event.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: a context from ibv_open_device, per the API contract.
    match unsafe { context_of(context) }.async_events.take() {
        Ok(taken) => {
            // SAFETY: the caller's block to fill; the union member written is the one the
            // event type says is valid.
            unsafe {
                let event = &mut *event;
                event.event_type = taken.kind;
                match taken.element {
                    Element::Qp(qp) => event.element.qp = qp as *mut _,
                    Element::Cq(cq) => event.element.cq = cq as *mut _,
                    Element::Srq(srq) => event.element.srq = srq as *mut _,
                    Element::Port(port) => event.element.port_num = c_int::from(port),
                    Element::Device => event.element.port_num = 0,
                }
            }
            0
        }
        Err(errno) => {
            set_errno(errno);
            -1
        }
    }
}

/// Nothing to release: destroying an object never waits for its events to be acknowledged.
#[no_mangle]
unsafe extern "C" fn ibv_ack_async_event(_event: *mut ibv_async_event) {}
