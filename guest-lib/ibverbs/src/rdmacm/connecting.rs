//! Connecting: rdma_connect, rdma_accept, rdma_reject, rdma_disconnect and rdma_establish
//! over the device's CM commands, with the parameters a program gave or librdmacm's defaults.

use super::*;

/// The parameters a program gave, or librdmacm's defaults; 0xff asks for the device's most.
///
/// # Safety
/// `param` must be NULL or valid, its private data `private_data_len` bytes.
pub(super) unsafe fn conn_param(
    id: &VrdmaCmId,
    param: *const rdma_conn_param,
) -> Result<ConnParam, c_int> {
    // SAFETY: the CM context is this library's.
    let config = unsafe { context_of(id.id.verbs) }.device.config();
    let (max_resp, max_init) = (
        config.max_qp_rd_atom.to_native().min(255) as u8,
        config.max_qp_init_rd_atom.to_native().min(255) as u8,
    );
    let pick = |asked: u8, max: u8| match asked {
        RDMA_MAX_RESP_RES => Ok(max),
        n if n <= max => Ok(n),
        _ => Err(libc::EINVAL),
    };
    if param.is_null() {
        return Ok(ConnParam {
            responder_resources: max_resp,
            initiator_depth: max_init,
            retry_count: 7,
            rnr_retry_count: 7,
            ..ConnParam::default()
        });
    }
    // SAFETY: per the contract.
    let p = unsafe { &*param };
    let private_data = if p.private_data.is_null() || p.private_data_len == 0 {
        Vec::new()
    } else {
        // SAFETY: per the contract.
        unsafe {
            std::slice::from_raw_parts(p.private_data.cast::<u8>(), p.private_data_len.into())
        }
        .to_vec()
    };
    Ok(ConnParam {
        responder_resources: pick(p.responder_resources, max_resp)?,
        initiator_depth: pick(p.initiator_depth, max_init)?,
        flow_control: p.flow_control,
        retry_count: p.retry_count.min(7),
        rnr_retry_count: p.rnr_retry_count.min(7),
        srq: p.srq != 0 || !id.id.srq.is_null(),
        qp_num: 0,
        qkey: 0,
        private_data,
    })
}

/// The QP a connection is made on, as guest-lib knows it: the id's, from `rdma_create_qp`, or
/// else the program's own QP numbered `param->qp_num` (a program that moves its QP itself).
///
/// # Safety
/// `param` must be NULL or valid.
pub(super) unsafe fn qp_of(
    id: &VrdmaCmId,
    param: *const rdma_conn_param,
) -> Result<&vrdma_guest::QueuePair, c_int> {
    let qp = if id.id.qp.is_null() {
        // SAFETY: per the contract.
        let qp_num = unsafe { param.as_ref() }.map_or(0, |p| p.qp_num);
        // SAFETY: the id's context is the CM context; the dispatcher holds the addresses of
        // the context's live QPs, read while none can be destroyed.
        let found = unsafe { context_of(id.id.verbs) }.with_dispatcher(|d| {
            d.find(ObjectKind::Qp, |address| {
                // SAFETY: a live QP of the context (see above).
                unsafe { (*(address as *const rdma_sys::ibv_qp)).qp_num == qp_num }
            })
        });
        let Some(address) = found.filter(|_| qp_num != 0) else {
            explain(
                "cm_qp",
                "rdma_connect/rdma_accept: the id has no QP from rdma_create_qp, and conn_param's qp_num names no QP of the program's",
            );
            return Err(libc::EINVAL);
        };
        address as *mut rdma_sys::ibv_qp
    } else {
        id.id.qp
    };
    // SAFETY: a QP of this library's, the id's or the program's, live.
    Ok(unsafe { objects::qp_of(qp) })
}

/// Sends the connection parameters the program gave (or librdmacm's defaults) with the
/// connection's QP by `send` (CM_CONNECT or CM_ACCEPT); the errno when it cannot.
///
/// # Safety
/// As [`conn_param`].
pub(super) unsafe fn send_conn_param(
    id: &VrdmaCmId,
    param: *const rdma_conn_param,
    send: fn(&CmId, &vrdma_guest::QueuePair, &ConnParam) -> vrdma_guest::Result<()>,
) -> Result<(), c_int> {
    // SAFETY: per the contract.
    let (wire, qp) = unsafe { (conn_param(id, param)?, qp_of(id, param)?) };
    send(&id.inner, qp, &wire).map_err(|e| raise_errno(&e))
}

#[no_mangle]
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_connect(
    id: *mut rdma_cm_id,
    param: *mut rdma_conn_param,
) -> c_int {
    // SAFETY: per the API contract.
    let id = unsafe { ours(id) };
    // SAFETY: per the API contract.
    if let Err(errno) = unsafe { send_conn_param(id, param, CmId::connect) } {
        return failed(errno);
    }
    complete(id, event_type::RDMA_CM_EVENT_ESTABLISHED)
}

#[no_mangle]
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_accept(
    id: *mut rdma_cm_id,
    param: *mut rdma_conn_param,
) -> c_int {
    // SAFETY: per the API contract.
    let id = unsafe { ours(id) };
    if id.id.qp_type != ibv_qp_type::IBV_QPT_UD
        && (id.move_qp(QpState::Rtr) != 0 || id.move_qp(QpState::Rts) != 0)
    {
        return -1;
    }
    // SAFETY: per the API contract.
    if let Err(errno) = unsafe { send_conn_param(id, param, CmId::accept) } {
        return failed(errno);
    }
    if id.id.qp_type == ibv_qp_type::IBV_QPT_UD {
        return 0;
    }
    complete(id, event_type::RDMA_CM_EVENT_ESTABLISHED)
}

#[no_mangle]
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_reject(
    id: *mut rdma_cm_id,
    private_data: *const c_void,
    len: u8,
) -> c_int {
    // SAFETY: per the API contract.
    let id = unsafe { ours(id) };
    let data = if private_data.is_null() {
        &[][..]
    } else {
        // SAFETY: per the API contract, `len` bytes.
        unsafe { std::slice::from_raw_parts(private_data.cast::<u8>(), len.into()) }
    };
    match id.inner.reject(data) {
        Ok(()) => 0,
        Err(e) => io_errno(&e),
    }
}

#[no_mangle]
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_disconnect(id: *mut rdma_cm_id) -> c_int {
    // SAFETY: per the API contract.
    let id = unsafe { ours(id) };
    id.qp_to_error();
    match id.inner.disconnect() {
        Ok(()) => 0,
        Err(e) => io_errno(&e),
    }
}

#[no_mangle]
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_establish(id: *mut rdma_cm_id) -> c_int {
    // SAFETY: per the API contract.
    let id = unsafe { ours(id) };
    match id.inner.establish() {
        Ok(()) => 0,
        Err(e) => io_errno(&e),
    }
}

#[no_mangle]
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_notify(
    _id: *mut rdma_cm_id,
    _event: c_int,
) -> c_int {
    // The device hears of the first receive itself (an RTU is sent by CM_ESTABLISH).
    0
}
