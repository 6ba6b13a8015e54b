//! `libibverbs.so.1` for vrdma: the libibverbs ABI (same symbols, symbol versions and
//! structure layouts as the system's rdma-core) on top of guest-lib, so that programs built
//! against libibverbs run unmodified on a vrdma device with no guest kernel driver.
//!
//! libibverbs finds devices through the kernel and loads providers only for kernel devices,
//! so a provider plugin cannot add a device that has no kernel driver; instead this library is
//! loaded in place of the system's (`vrdma-run`, or `LD_LIBRARY_PATH`). `link.sh` links it
//! with the version nodes of the installed libibverbs. Which device it shows comes from
//! [`config`].
//!
//! Layout: [`config`] and the conversions in `attr`, `translate` and `strings` are safe and
//! unit-tested; `errno` says why a call failed (errno, and `VRDMA_DEBUG`'s lines); `events`
//! routes the device's events to channels and the asynchronous event queue; `context` is an
//! open device's state; `abi` (device, queries, asynchronous events) and `objects` (PD, MR,
//! CQ, channels, QP with the `ibv_wr_*` API, SRQ, AH and the inlined data path) are the C
//! edge; `rdmacm` is librdmacm's API on top of them; `unserved` holds the verbs not served
//! yet and `private` the provider-only ABI that must exist for programs to load.
//!
//! Modules depend one way: `rdmacm` on `abi` and `objects`, `abi` on `objects`, all three on
//! `context`, which depends on `events`; `events`, `errno` and the conversions depend on no
//! module of the crate.

mod abi;
mod attr;
pub mod config;
mod context;
mod errno;
mod events;
mod objects;
mod private;
mod rdmacm;
mod strings;
mod translate;
mod unserved;
