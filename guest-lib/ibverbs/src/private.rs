//! libibverbs' private ABI (`IBVERBS_PRIVATE_*`), which only provider libraries import. Programs
//! such as perftest link provider libraries (libmlx5, libefa) and librdmacm directly, and the
//! loader refuses to start them unless every symbol those import exists. vrdma loads no
//! provider and gives none a device, so apart from the registration their constructors call
//! at load time, nothing here is ever reached; if it were, it fails with EOPNOTSUPP.
//! (`ibv_query_gid_type`, private too, is served in `abi`: ibv_devinfo calls it.)

use std::os::raw::{c_int, c_void};
use std::ptr;

type P = *mut c_void;

/// Called by every provider library's constructor: vrdma takes no providers.
#[no_mangle]
unsafe extern "C" fn verbs_register_driver_34(_ops: P) {}

macro_rules! refuse_with_errno {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        unsafe extern "C" fn $name() -> c_int {
            crate::errno::set_errno(libc::EOPNOTSUPP);
            libc::EOPNOTSUPP
        }
    )*};
}

macro_rules! refuse_with_null {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        unsafe extern "C" fn $name() -> P {
            crate::errno::set_errno(libc::EOPNOTSUPP);
            ptr::null_mut()
        }
    )*};
}

macro_rules! ignore {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        unsafe extern "C" fn $name() {}
    )*};
}

refuse_with_null!(_verbs_init_and_alloc_context, verbs_open_device);

ignore!(
    __verbs_log,
    verbs_init_cq,
    verbs_set_ops,
    verbs_uninit_context
);

/// `bool verbs_allow_disassociate_destroy(int ret)`: never allowed.
#[no_mangle]
unsafe extern "C" fn verbs_allow_disassociate_destroy(_ret: c_int) -> bool {
    false
}

refuse_with_errno!(
    execute_ioctl,
    __ioctl_final_num_attrs,
    ibv_read_ibdev_sysfs_file,
    ibv_cmd_advise_mr,
    ibv_cmd_alloc_dm,
    ibv_cmd_alloc_mw,
    ibv_cmd_alloc_pd,
    ibv_cmd_attach_mcast,
    ibv_cmd_close_xrcd,
    ibv_cmd_create_ah,
    ibv_cmd_create_counters,
    ibv_cmd_create_cq,
    ibv_cmd_create_cq_ex,
    ibv_cmd_create_flow,
    ibv_cmd_create_flow_action_esp,
    ibv_cmd_create_qp,
    ibv_cmd_create_qp_ex,
    ibv_cmd_create_qp_ex2,
    ibv_cmd_create_rwq_ind_table,
    ibv_cmd_create_srq,
    ibv_cmd_create_srq_ex,
    ibv_cmd_create_wq,
    ibv_cmd_dealloc_mw,
    ibv_cmd_dealloc_pd,
    ibv_cmd_dereg_mr,
    ibv_cmd_destroy_ah,
    ibv_cmd_destroy_counters,
    ibv_cmd_destroy_cq,
    ibv_cmd_destroy_flow,
    ibv_cmd_destroy_flow_action,
    ibv_cmd_destroy_qp,
    ibv_cmd_destroy_rwq_ind_table,
    ibv_cmd_destroy_srq,
    ibv_cmd_destroy_wq,
    ibv_cmd_detach_mcast,
    ibv_cmd_free_dm,
    ibv_cmd_get_context,
    ibv_cmd_modify_cq,
    ibv_cmd_modify_flow_action_esp,
    ibv_cmd_modify_qp,
    ibv_cmd_modify_qp_ex,
    ibv_cmd_modify_srq,
    ibv_cmd_modify_wq,
    ibv_cmd_open_qp,
    ibv_cmd_open_xrcd,
    ibv_cmd_poll_cq,
    ibv_cmd_post_recv,
    ibv_cmd_post_send,
    ibv_cmd_post_srq_recv,
    ibv_cmd_query_context,
    ibv_cmd_query_device_any,
    ibv_cmd_query_mr,
    ibv_cmd_query_port,
    ibv_cmd_query_qp,
    ibv_cmd_query_srq,
    ibv_cmd_read_counters,
    ibv_cmd_reg_dm_mr,
    ibv_cmd_reg_dmabuf_mr,
    ibv_cmd_reg_mr,
    ibv_cmd_req_notify_cq,
    ibv_cmd_rereg_mr,
    ibv_cmd_resize_cq,
);
