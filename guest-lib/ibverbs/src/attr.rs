//! The device's answers (vrdma wire structures) as libibverbs structures.

use std::os::raw::{c_char, c_int};

use rdma_sys::{ibv_device_attr, ibv_port_attr};
use vrdma_guest::spec::ctrl::{DeviceAttr, PortAttr};

/// The firmware version programs see: this library's version.
pub const FW_VERSION: &str = concat!("vrdma ", env!("CARGO_PKG_VERSION"));

/// A count as a C `int`: counts the device reports above `INT_MAX` are capped there.
fn int(value: u32) -> c_int {
    c_int::try_from(value).unwrap_or(c_int::MAX)
}

/// `text` as a NUL-terminated C string in `out`, cut to fit.
pub fn fill_c_string(out: &mut [c_char], text: &str) {
    let len = text.len().min(out.len().saturating_sub(1));
    for (slot, byte) in out.iter_mut().zip(text.bytes().take(len)) {
        *slot = byte as c_char;
    }
    if let Some(end) = out.get_mut(len) {
        *end = 0;
    }
}

pub fn device_attr(wire: &DeviceAttr) -> ibv_device_attr {
    // SAFETY: ibv_device_attr is plain C data (integers and arrays) for which all-zero bytes
    // are a valid value.
    let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
    fill_c_string(&mut attr.fw_ver, FW_VERSION);
    attr.node_guid = wire.node_guid.to_native().to_be();
    attr.sys_image_guid = wire.sys_image_guid.to_native().to_be();
    attr.max_mr_size = wire.max_mr_size.to_native();
    attr.page_size_cap = wire.page_size_cap.to_native();
    attr.vendor_id = wire.vendor_id.to_native();
    attr.vendor_part_id = wire.vendor_part_id.to_native();
    attr.hw_ver = wire.hw_ver.to_native();
    attr.max_qp = int(wire.max_qp.to_native());
    attr.max_qp_wr = int(wire.max_qp_wr.to_native());
    attr.device_cap_flags = wire.device_cap_flags.to_native();
    attr.max_sge = int(wire.max_sge.to_native());
    attr.max_sge_rd = attr.max_sge;
    attr.max_cq = int(wire.max_cq.to_native());
    attr.max_cqe = int(wire.max_cqe.to_native());
    attr.max_mr = int(wire.max_mr.to_native());
    attr.max_pd = int(wire.max_pd.to_native());
    attr.max_qp_rd_atom = int(wire.max_qp_rd_atom.to_native());
    attr.max_res_rd_atom = attr.max_qp_rd_atom.saturating_mul(attr.max_qp);
    attr.max_qp_init_rd_atom = int(wire.max_qp_init_rd_atom.to_native());
    attr.atomic_cap = wire.atomic_cap.to_native();
    attr.max_ah = int(wire.max_ah.to_native());
    attr.max_srq = int(wire.max_srq.to_native());
    attr.max_srq_wr = int(wire.max_srq_wr.to_native());
    attr.max_srq_sge = int(wire.max_srq_sge.to_native());
    attr.max_pkeys = 1;
    attr.phys_port_cnt = u8::try_from(wire.phys_port_cnt.to_native()).unwrap_or(u8::MAX);
    attr
}

pub fn port_attr(wire: &PortAttr) -> ibv_port_attr {
    // SAFETY: ibv_port_attr is plain C data for which all-zero bytes are a valid value.
    let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
    attr.state = wire.state.into();
    attr.max_mtu = wire.max_mtu.into();
    attr.active_mtu = wire.active_mtu.into();
    attr.gid_tbl_len = int(wire.gid_tbl_len.to_native());
    attr.port_cap_flags = wire.port_cap_flags.to_native();
    attr.max_msg_sz = wire.max_msg_sz.to_native();
    attr.pkey_tbl_len = wire.pkey_tbl_len.to_native();
    attr.lid = wire.lid.to_native();
    attr.active_width = wire.active_width;
    attr.active_speed = wire.active_speed;
    attr.phys_state = wire.phys_state;
    attr.link_layer = wire.link_layer;
    attr.max_vl_num = vrdma_guest::spec::ctrl::PORT_MAX_VL_NUM;
    attr
}

/// Bytes of `ibv_port_attr` that the compatibility entry point `ibv_query_port` writes:
/// the fields programs built before `flags` existed have room for.
pub const COMPAT_PORT_ATTR_LEN: usize = std::mem::offset_of!(ibv_port_attr, flags);

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_guest::spec::{Le16, Le32, Le64};

    #[test]
    fn device_attributes_keep_their_values_and_cap_counts_at_int_max() {
        let wire = DeviceAttr {
            node_guid: Le64::from(0x0011_2233_4455_6677),
            max_mr_size: Le64::from(1 << 32),
            vendor_part_id: Le32::from(0x6a),
            max_qp: Le32::from(u32::MAX),
            max_sge: Le32::from(30),
            max_qp_rd_atom: Le32::from(128),
            atomic_cap: Le32::from(1),
            phys_port_cnt: Le32::from(1),
            ..Default::default()
        };
        let attr = device_attr(&wire);
        assert_eq!(u64::from_be(attr.node_guid), 0x0011_2233_4455_6677);
        assert_eq!(attr.max_mr_size, 1 << 32);
        assert_eq!(attr.vendor_part_id, 0x6a);
        assert_eq!(attr.max_qp, c_int::MAX);
        assert_eq!((attr.max_sge, attr.max_sge_rd), (30, 30));
        assert_eq!(attr.max_res_rd_atom, c_int::MAX, "128 * INT_MAX saturates");
        assert_eq!((attr.atomic_cap, attr.phys_port_cnt), (1, 1));
        let fw: Vec<u8> = attr.fw_ver.iter().map(|&c| c as u8).collect();
        assert!(fw.starts_with(b"vrdma 0."), "{fw:?}");
    }

    #[test]
    fn port_attributes_keep_their_values() {
        let wire = PortAttr {
            state: 4,
            max_mtu: 5,
            active_mtu: 3,
            link_layer: 2,
            gid_tbl_len: Le32::from(1),
            max_msg_sz: Le32::from(1 << 31),
            pkey_tbl_len: Le16::from(1),
            ..Default::default()
        };
        let attr = port_attr(&wire);
        assert_eq!((attr.state, attr.max_mtu, attr.active_mtu), (4, 5, 3));
        assert_eq!((attr.link_layer, attr.gid_tbl_len), (2, 1));
        assert_eq!((attr.max_msg_sz, attr.pkey_tbl_len), (1 << 31, 1));
        assert_eq!(COMPAT_PORT_ATTR_LEN, 47, "up to and including link_layer");
    }

    #[test]
    fn c_strings_are_cut_to_fit_and_terminated() {
        let mut out = [1 as c_char; 6];
        fill_c_string(&mut out, "vrdma0-long");
        assert_eq!(out.map(|c| c as u8), *b"vrdma\0");
        let mut out = [1 as c_char; 8];
        fill_c_string(&mut out, "ok");
        assert_eq!(&out[..3], &[b'o' as c_char, b'k' as c_char, 0]);
    }
}
