//! Which transport a device target names: the one place that knows every transport, above
//! them all (the verbs API and vrdmad open devices through it).

use crate::transport::Transport;
use crate::Result;

/// Opens a transport to the device `target` names, chosen at run time:
/// - `pci`: the first vrdma PCI device of the VM this runs in (see [`PciTransport`]);
/// - `pci:DDDD:BB:DD.F`: the vrdma PCI device at that address;
/// - `service:PATH`: the device the guest service listening at `PATH` shares (`service`
///   alone: at its default socket, [`protocol::DEFAULT_SOCKET`]);
/// - anything else: the path of a backend's vhost-user socket, attached directly.
///
/// [`PciTransport`]: crate::pci::PciTransport
/// [`protocol::DEFAULT_SOCKET`]: crate::service::protocol::DEFAULT_SOCKET
pub fn open(target: &str) -> Result<Box<dyn Transport>> {
    use crate::direct::{DirectOptions, DirectTransport};
    use crate::pci::PciTransport;
    use crate::service::{protocol, ServiceTransport};
    use std::path::Path;
    match target.split_once(':').unwrap_or((target, "")) {
        ("pci", "") if target == "pci" => Ok(Box::new(PciTransport::open(None)?)),
        ("pci", address) if !address.is_empty() => Ok(Box::new(PciTransport::open(Some(address))?)),
        ("service", "") if target == "service" => Ok(Box::new(ServiceTransport::connect(
            Path::new(protocol::DEFAULT_SOCKET),
        )?)),
        ("service", path) if !path.is_empty() => {
            Ok(Box::new(ServiceTransport::connect(Path::new(path))?))
        }
        _ => Ok(Box::new(DirectTransport::connect(
            Path::new(target),
            DirectOptions::default(),
        )?)),
    }
}
