//! libibverbs verbs that vrdma does not serve yet. Programs linked against them must still
//! load (Debian builds them with BIND_NOW), so each exists, says once on standard error that
//! it is not served when `VRDMA_DEBUG` asks, and fails as libibverbs documents: NULL or an
//! errno, with errno set to EOPNOTSUPP.

use std::os::raw::{c_int, c_void};
use std::ptr;

use crate::errno::{report_once, set_errno};

fn refuse(verb: &'static str) {
    report_once(verb, &format!("{verb} is not served by vrdma yet"));
    set_errno(libc::EOPNOTSUPP);
}

/// Each entry: name, parameter types, and whether it answers with a NULL pointer, an errno
/// (`int`) or nothing (`void`).
macro_rules! unserved {
    ($($name:ident($($ty:ty),*) -> $kind:ident;)*) => {$(
        #[no_mangle]
        unsafe extern "C" fn $name($(_: $ty),*) -> unserved!(@type $kind) {
            refuse(stringify!($name));
            unserved!(@value $kind)
        }
    )*};
    (@type null) => { *mut c_void };
    (@type int) => { c_int };
    (@type void) => { () };
    (@value null) => { ptr::null_mut() };
    (@value int) => { libc::EOPNOTSUPP };
    (@value void) => { () };
}

type P = *mut c_void;

unserved! {
    ibv_rereg_mr(P, c_int, P, P, usize, c_int) -> int;
    ibv_query_ece(P, P) -> int;
    ibv_set_ece(P, P) -> int;
    ibv_attach_mcast(P, P, u16) -> int;
    ibv_detach_mcast(P, P, u16) -> int;
    ibv_resolve_eth_l2_from_gid(P, P, P, P) -> int;
    ibv_reg_dmabuf_mr(P, u64, usize, u64, c_int, c_int) -> null;
    ibv_import_device(c_int) -> null;
    ibv_import_pd(P, u32) -> null;
    ibv_import_mr(P, u32) -> null;
    ibv_import_dm(P, u32) -> null;
    ibv_unimport_pd(P) -> void;
    ibv_unimport_mr(P) -> void;
    ibv_unimport_dm(P) -> void;
    // Kernel ABI converters librdmacm uses on the kernel's RDMA CM path, which a vrdma
    // device never takes.
    ibv_copy_qp_attr_from_kern(P, P) -> void;
    ibv_copy_ah_attr_from_kern(P, P) -> void;
    ibv_copy_path_rec_from_kern(P, P) -> void;
    ibv_copy_path_rec_to_kern(P, P) -> void;
}
