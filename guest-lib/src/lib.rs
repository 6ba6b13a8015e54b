//! vrdma guest library: RDMA verbs over the vrdma device, with no guest kernel driver.
//!
//! It speaks the wire format of `vrdma-spec` (see `spec/SPEC.md`). Its transports — direct
//! attach to a backend's vhost-user socket, and the virtio-pci device inside a VM — and the
//! verbs API on top are built in the control-path and data-path milestones.

pub use vrdma_spec as spec;
