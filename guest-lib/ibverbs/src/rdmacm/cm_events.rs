//! Events: rdma_get_cm_event takes an id's events from its channel (or waits for its own,
//! on a synchronous id) and does what librdmacm does with them; rdma_ack_cm_event lets an id
//! go once its events are acknowledged.

use super::*;

/// What librdmacm does with an event before the program sees it; the event the program
/// sees.
pub(super) fn process(id: &mut VrdmaCmId, mut taken: CmEvent) -> (u32, i32, CmEvent) {
    let mut kind = taken.event;
    let mut status = taken.status;
    match kind {
        event::ADDR_RESOLVED | event::ROUTE_RESOLVED => id.refresh_route(),
        event::CONNECT_RESPONSE if !id.id.qp.is_null() => {
            let step = if id.move_qp(QpState::Rtr) != 0 {
                Err(("moving its QP to RTR", last_errno()))
            } else if id.move_qp(QpState::Rts) != 0 {
                Err(("moving its QP to RTS", last_errno()))
            } else {
                id.inner
                    .establish()
                    .map_err(|e| ("establishing it", raise_errno(&e)))
            };
            match step {
                Ok(()) => kind = event::ESTABLISHED,
                Err((what, errno)) => {
                    explain(
                        "cm_connect_response",
                        &format!(
                            "a connection's response was refused: {what} failed: {}",
                            std::io::Error::from_raw_os_error(errno)
                        ),
                    );
                    let _ = id.inner.reject(&[]);
                    kind = event::CONNECT_ERROR;
                    status = -errno;
                }
            }
        }
        // As librdmacm: a rejected connection's QP fails; a disconnected one's was failed by
        // whoever disconnected (rdma_disconnect).
        event::REJECTED => id.qp_to_error(),
        _ => {}
    }
    taken.event = kind;
    (kind, status, taken)
}

#[no_mangle]
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_get_cm_event(
    channel: *mut rdma_event_channel,
    out: *mut *mut rdma_cm_event,
) -> c_int {
    if channel.is_null() || out.is_null() {
        return failed(libc::EINVAL);
    }
    // SAFETY: a channel of this library's, per the API contract.
    let channel = unsafe { &*channel.cast::<VrdmaEventChannel>() };
    loop {
        let handle = match channel.queue.take() {
            Ok(handle) => handle,
            Err(errno) => return failed(errno),
        };
        let Some((id, hold)) = lookup(handle) else {
            continue;
        };
        // SAFETY: a live id of this library's: ids are forgotten before they are freed, and
        // not freed while held.
        let id = unsafe { ours(id) };
        let taken = match id.inner.get_event() {
            Ok(Some(taken)) => taken,
            Ok(None) => continue,
            Err(e) => return io_errno(&e),
        };
        if taken.pending > 0 {
            channel.queue.push(handle);
        }
        let (kind, status, mut taken) = process(id, taken);
        // SAFETY: rdma_cm_event is C data valid as zero.
        let mut event: rdma_cm_event = unsafe { std::mem::zeroed() };
        event.id = ptr::from_mut(&mut id.id);
        event.event = kind;
        event.status = status;
        if let Some(new) = taken.new_id.take() {
            let made = new_id(
                new,
                id.id.verbs,
                id.id.channel,
                Arc::clone(&id.queue),
                id.id.context,
                id.id.ps,
            );
            // SAFETY: just made.
            unsafe { (*made).refresh_route() };
            event.listen_id = ptr::from_mut(&mut id.id);
            event.id = made.cast();
        }
        let mut boxed = Box::new(VrdmaCmEvent {
            event,
            private_data: std::mem::take(&mut taken.param.private_data),
            _hold: hold,
        });
        let data = boxed.private_data.as_ptr().cast::<c_void>();
        let len = boxed.private_data.len() as u8;
        let data = if len == 0 { ptr::null() } else { data };
        match taken.ah_attr {
            Some(ah) => {
                let ud = rdma_sys::rdma_ud_param {
                    private_data: data,
                    private_data_len: len,
                    ah_attr: rdma_sys::ibv_ah_attr::from(&ah),
                    qp_num: taken.param.qp_num,
                    qkey: taken.param.qkey,
                };
                boxed.event.param.ud = ud;
            }
            None => {
                let p = &taken.param;
                boxed.event.param.conn = rdma_conn_param {
                    private_data: data,
                    private_data_len: len,
                    responder_resources: p.responder_resources,
                    initiator_depth: p.initiator_depth,
                    flow_control: p.flow_control,
                    retry_count: p.retry_count,
                    rnr_retry_count: p.rnr_retry_count,
                    srq: p.srq.into(),
                    qp_num: p.qp_num,
                };
            }
        }
        // SAFETY: the caller's out-pointer.
        unsafe { *out = Box::into_raw(boxed).cast() };
        return 0;
    }
}

/// The id with device handle `handle`, if it still exists, held (see `rdma_destroy_id`): the
/// hold is taken where the id is found, so no destroy frees it in between.
pub(super) fn lookup(handle: u32) -> Option<(*mut rdma_cm_id, Hold)> {
    let context = cm_context()?;
    // SAFETY: the CM context is this library's.
    unsafe { context_of(context) }.with_dispatcher(|d| {
        let id = d.cm_id(handle)? as *mut rdma_cm_id;
        // SAFETY: watched, so live: rdma_destroy_id forgets it (under this lock) first. Only
        // the count is borrowed, which is shared.
        let unacked = unsafe { &(*id.cast::<VrdmaCmId>()).unacked };
        Some((id, unacked.hold()))
    })
}

#[no_mangle]
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    if event.is_null() {
        return failed(libc::EINVAL);
    }
    free_event(event);
    0
}

#[no_mangle]
pub(super) unsafe extern "C" fn vrdma_rdmacm_rdma_event_str(kind: c_int) -> *const c_char {
    static NAMES: OnceLock<Vec<std::ffi::CString>> = OnceLock::new();
    let names = NAMES.get_or_init(|| {
        (0..=16)
            .map(|k| std::ffi::CString::new(event::name(k)).expect("no NUL"))
            .collect()
    });
    let index = usize::try_from(kind).unwrap_or(16).min(16);
    names[index].as_ptr()
}
