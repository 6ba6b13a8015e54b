//! Address vectors (SPEC.md §5.10): where a QP or an AH sends. Apart from the control
//! commands that take them (MODIFY_QP, CREATE_AH) because connection management's events
//! carry them too.

use crate::{wire_struct, Le16, Le32};

/// Address vector (SPEC.md §5.10), used by MODIFY_QP (RC) and CREATE_AH (UD).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AhAttr {
    /// Destination GID, network order. Used when `is_global` is 1 (always, on RoCE).
    pub dgid: [u8; 16],
    /// 20 bits.
    pub flow_label: Le32,
    pub dlid: Le16,
    /// Below the port's `gid_tbl_len`.
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    /// 0..=15.
    pub sl: u8,
    /// 0 or 1; must be 1 on an Ethernet port.
    pub is_global: u8,
    /// Must be 1.
    pub port_num: u8,
    pub reserved: Le32,
}

wire_struct!(AhAttr = 32);
