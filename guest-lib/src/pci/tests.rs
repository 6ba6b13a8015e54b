//! Unit tests of `pci`.

use super::*;

#[test]
fn a_device_is_numbered_for_the_pinning_module_by_its_pci_address() {
    let number = |name: &str| pin_device_number(&Path::new(SYSFS_DEVICES).join(name)).ok();
    assert_eq!(number("0000:00:04.0"), Some(0x40));
    assert_eq!(number("0001:af:1f.7"), Some(0x1a_f1f7));
    assert_ne!(number("0000:00:04.1"), number("0000:00:40.0"));
    assert_eq!(number("0000:00:00.0"), None);
    assert_eq!(number("vrdma"), None);
}

/// A configuration space with a capability list: `caps` are (offset, bytes).
fn config_space(first: u8, caps: &[(usize, Vec<u8>)]) -> Vec<u8> {
    let mut config = vec![0u8; 256];
    config[0x06] = 0x10;
    config[0x34] = first;
    for (at, bytes) in caps {
        config[*at..*at + bytes.len()].copy_from_slice(bytes);
    }
    config
}

fn virtio_cap(next: u8, cfg_type: u8, bar: u8, offset: u32, length: u32) -> Vec<u8> {
    let mut cap = vec![0x09, next, 16, cfg_type, bar, 0, 0, 0];
    cap.extend_from_slice(&offset.to_le_bytes());
    cap.extend_from_slice(&length.to_le_bytes());
    if cfg_type == 2 {
        cap[2] = 20;
        cap.extend_from_slice(&4u32.to_le_bytes());
    }
    cap
}

#[test]
fn finds_the_virtio_structures() {
    let config = config_space(
        0x40,
        &[
            (0x40, virtio_cap(0x50, 1, 4, 0x0000, 0x38)),
            (0x50, vec![0x11, 0x60, 0, 0]), // MSI-X: skipped
            (0x60, virtio_cap(0x78, 2, 4, 0x3000, 0x1000)),
            (0x78, virtio_cap(0x88, 4, 4, 0x2000, 0x100)),
            (0x88, virtio_cap(0x00, 3, 4, 0x1000, 0x4)),
        ],
    );
    let caps = parse_capabilities(&config).unwrap();
    assert_eq!(
        caps.isr,
        Some(Location {
            bar: 4,
            offset: 0x1000,
            length: 4
        })
    );
    assert_eq!(
        caps.common,
        Location {
            bar: 4,
            offset: 0,
            length: 0x38
        }
    );
    assert_eq!(
        (caps.notify.offset, caps.notify_off_multiplier),
        (0x3000, 4)
    );
    assert_eq!(caps.device.offset, 0x2000);
    let without_isr = config_space(
        0x40,
        &[
            (0x40, virtio_cap(0x60, 1, 4, 0x0000, 0x38)),
            (0x60, virtio_cap(0x78, 2, 4, 0x3000, 0x1000)),
            (0x78, virtio_cap(0x00, 4, 4, 0x2000, 0x100)),
        ],
    );
    assert_eq!(parse_capabilities(&without_isr).unwrap().isr, None);
    assert_eq!(caps.notify_port, None);
}

#[test]
fn a_notification_structure_in_an_io_bar_is_the_notify_port() {
    let mut port = virtio_cap(0x88, 2, 2, 0, 4);
    port[16..20].copy_from_slice(&0u32.to_le_bytes());
    let mut with_port = config_space(
        0x40,
        &[
            (0x40, virtio_cap(0x60, 1, 4, 0x0000, 0x38)),
            // Listed first: the driver still maps the one in the memory BAR.
            (0x60, port.clone()),
            (0x78, virtio_cap(0x00, 4, 4, 0x2000, 0x100)),
            (0x88, virtio_cap(0x78, 2, 4, 0x3000, 0x1000)),
        ],
    );
    with_port[0x18] = 0x01; // BAR 2: I/O space
    let caps = parse_capabilities(&with_port).unwrap();
    assert_eq!((caps.notify.bar, caps.notify.offset), (4, 0x3000));
    assert_eq!(
        caps.notify_port,
        Some(Location {
            bar: 2,
            offset: 0,
            length: 4
        })
    );
    // A port whose queues notify at different offsets is not one port.
    with_port[0x60 + 16] = 4;
    assert_eq!(parse_capabilities(&with_port).unwrap().notify_port, None);
    // Nor is a structure in a memory BAR.
    with_port[0x60 + 16] = 0;
    with_port[0x18] = 0;
    let caps = parse_capabilities(&with_port).unwrap();
    assert_eq!((caps.notify.bar, caps.notify_port), (2, None));
}

#[test]
fn hostile_capability_lists_are_refused() {
    // A loop between two capabilities, neither of them useful.
    let looping = config_space(
        0x40,
        &[
            (0x40, vec![0x11, 0x50, 0, 0]),
            (0x50, vec![0x11, 0x40, 0, 0]),
        ],
    );
    assert!(parse_capabilities(&looping).is_err());
    // A pointer into the header.
    assert!(parse_capabilities(&config_space(0x10, &[])).is_err());
    // A pointer past the end of what was read.
    let truncated = config_space(0xfc, &[(0xfc, vec![0x09, 0x00, 16, 1])]);
    assert!(parse_capabilities(&truncated).is_err());
    // No capability list at all.
    let mut none = config_space(0x40, &[]);
    none[0x06] = 0;
    assert!(parse_capabilities(&none).is_err());
}
