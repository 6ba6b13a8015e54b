//! Unit tests of the crate's root module.

use super::*;

#[test]
fn a_program_is_shown_its_users_share_of_the_devices_limits() {
    let config = DeviceConfig {
        max_memory_regions: Le32::from(256),
        max_qp: Le32::from(256),
        max_srq: Le32::from(3),
        max_ah: Le32::from(1000),
        max_mr: Le32::from(1024),
        max_cq: Le32::from(512),
        max_pd: Le32::from(1),
        max_qp_wr: Le32::from(4096),
        max_mr_size: Le64::from(4 << 30),
        ..Default::default()
    };
    let options = Options {
        share: 4,
        max_programs: 16,
        ..Options::default()
    };
    let shares = Shares::fair(&config, &options, 250, 8 << 30);
    assert_eq!(
        (
            shares.programs_per_user,
            shares.regions_per_user,
            shares.regions_per_program,
            shares.bytes_per_user,
            shares.bytes_per_program
        ),
        (4, 63, 63, 2 << 30, 1 << 30),
        "a user's share of programs, regions and memory"
    );
    let shown = shares.program_config(&config);
    assert_eq!(
        [
            shown.max_qp,
            shown.max_srq,
            shown.max_ah,
            shown.max_mr,
            shown.max_cq,
            shown.max_pd
        ]
        .map(|v| v.to_native()),
        [64, 1, 250, 256, 128, 1],
        "a quarter, rounded up, and at least one"
    );
    assert_eq!(shown.max_qp_wr.to_native(), 4096, "sizes are the device's");
    assert_eq!(
        shown.max_memory_regions.to_native(),
        0,
        "memory regions are the service's business"
    );
    assert_eq!(
        shown.max_mr_size.to_native(),
        1 << 30,
        "no more than its memory"
    );
    let mut attr = DeviceAttr {
        max_qp: Le32::from(256),
        max_mr_size: Le64::from(4 << 30),
        ..Default::default()
    };
    shares.program_device_attr(&mut attr);
    assert_eq!(
        (attr.max_qp.to_native(), attr.max_mr_size.to_native()),
        (64, 1 << 30)
    );
}
