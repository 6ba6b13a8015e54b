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
//! unit-tested; `events` routes completion events to channels; `abi` (device, context,
//! queries) and `objects` (PD, MR, CQ, channels, QP, SRQ, AH and the inlined data path) are
//! the C edge, with `qp_ex` (the `ibv_wr_*` API), where all `unsafe` is; `unserved` holds the verbs not
//! served yet and `private` the provider-only ABI that must exist for programs to load.

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
