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
//! of no object. The context they share with `objects` and `rdmacm` is `context`'s, errnos are
//! `errno`'s.

mod async_events;
mod compat;
mod device;
mod queries;

pub(crate) use device::{ibv_free_device_list, ibv_get_device_list, ibv_open_device};
