//! guest-lib's reading of the vrdma PCI device's configuration space (its virtio capability
//! list), which a guest process trusts no more than the device trusts it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_guest::pci::parse_capabilities;

fuzz_target!(|config: &[u8]| {
    if let Ok(caps) = parse_capabilities(config) {
        for location in [caps.common, caps.notify, caps.device] {
            assert!(location.bar < 6, "{caps:?}");
        }
    }
});
