//! The texts of libibverbs' `*_str` functions, by enum value.

use std::ffi::CStr;
use std::os::raw::c_int;

fn lookup(table: &[&'static CStr], value: c_int, unknown: &'static CStr) -> &'static CStr {
    usize::try_from(value)
        .ok()
        .and_then(|i| table.get(i).copied())
        .unwrap_or(unknown)
}

/// `enum ibv_wc_status`, in order from IBV_WC_SUCCESS (0).
pub fn wc_status(status: c_int) -> &'static CStr {
    const TEXT: [&CStr; 24] = [
        c"success",
        c"local length error",
        c"local QP operation error",
        c"local EE context operation error",
        c"local protection error",
        c"Work Request Flushed Error",
        c"memory management operation error",
        c"bad response error",
        c"local access error",
        c"remote invalid request error",
        c"remote access error",
        c"remote operation error",
        c"transport retry counter exceeded",
        c"RNR retry counter exceeded",
        c"local RDD violation error",
        c"remote invalid RD request",
        c"aborted error",
        c"invalid EE context number",
        c"invalid EE context state",
        c"fatal error",
        c"response timeout error",
        c"general error",
        c"TM error",
        c"TM software rendezvous",
    ];
    lookup(&TEXT, status, c"unknown")
}

/// `enum ibv_node_type`: IBV_NODE_CA is 1; 0 and IBV_NODE_UNKNOWN (-1) are unknown.
pub fn node_type(node_type: c_int) -> &'static CStr {
    const TEXT: [&CStr; 8] = [
        c"unknown",
        c"InfiniBand channel adapter",
        c"InfiniBand switch",
        c"InfiniBand router",
        c"iWARP NIC",
        c"usNIC",
        c"usNIC UDP",
        c"unspecified",
    ];
    lookup(&TEXT, node_type, c"unknown")
}

/// `enum ibv_port_state`, from IBV_PORT_NOP (0).
pub fn port_state(state: c_int) -> &'static CStr {
    const TEXT: [&CStr; 6] = [
        c"no state change (NOP)",
        c"down",
        c"init",
        c"armed",
        c"active",
        c"active defer",
    ];
    lookup(&TEXT, state, c"unknown")
}

/// `enum ibv_event_type`, from IBV_EVENT_CQ_ERR (0).
pub fn event_type(event: c_int) -> &'static CStr {
    const TEXT: [&CStr; 20] = [
        c"CQ error",
        c"local work queue catastrophic error",
        c"invalid request local work queue error",
        c"local access violation work queue error",
        c"communication established",
        c"send queue drained",
        c"path migrated",
        c"path migration request error",
        c"local catastrophic error",
        c"port active",
        c"port error",
        c"LID change",
        c"P_Key change",
        c"SM change",
        c"SRQ catastrophic error",
        c"SRQ limit reached",
        c"last WQE reached",
        c"client reregistration",
        c"GID table change",
        c"WQ fatal",
    ];
    lookup(&TEXT, event, c"unknown")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_map_to_their_texts_and_strangers_to_unknown() {
        assert_eq!(wc_status(0), c"success");
        assert_eq!(wc_status(10), c"remote access error");
        assert_eq!(wc_status(12), c"transport retry counter exceeded");
        assert_eq!(wc_status(-1), c"unknown");
        assert_eq!(wc_status(999), c"unknown");
        assert_eq!(node_type(1), c"InfiniBand channel adapter");
        assert_eq!(node_type(-1), c"unknown");
        assert_eq!(node_type(7), c"unspecified");
        assert_eq!(node_type(c_int::MAX), c"unknown");
        assert_eq!(port_state(4), c"active");
        assert_eq!(event_type(15), c"SRQ limit reached");
        assert_eq!(event_type(-5), c"unknown");
    }
}
