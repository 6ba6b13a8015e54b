//! The verbs the loopback device carries out on its objects: registrations, QPs and their
//! state machine, posts, SRQs and AHs, each under the device's lock.

use super::*;
use crate::hostverbs::seam::Registration;

impl Device {
    pub fn reg_mr(&self, pd: u32, memory: Arc<dyn PinnedMemory>, at: Registration) -> Result<u32> {
        let mut state = self.state();
        let key = state.new_key();
        state.mrs.insert(
            key,
            Mr {
                pd,
                memory,
                offset: at.offset,
                len: at.len as u64,
                iova: at.iova,
                access: at.access,
            },
        );
        Ok(key)
    }

    pub fn dereg_mr(&self, key: u32) {
        self.state().mrs.remove(&key);
    }

    pub fn create_qp(
        &self,
        pd: u32,
        (send_cq, recv_cq): (&Arc<Cq>, &Arc<Cq>),
        init: QpSetup,
    ) -> Result<(u32, QpCaps)> {
        let c = init.caps;
        let fits = c.max_send_wr <= MAX_WR
            && c.max_recv_wr <= MAX_WR
            && c.max_send_sge <= MAX_SGE
            && c.max_recv_sge <= MAX_SGE
            && c.max_inline_data <= MAX_INLINE;
        if !fits {
            return Err(errno("ibv_create_qp", libc::EINVAL));
        }
        let mut state = self.state();
        if let Some(srq) = init.srq {
            if !state.srqs.contains_key(&srq) {
                return Err(errno("ibv_create_qp", libc::EINVAL));
            }
        }
        if state.qps.len() >= MAX_QP as usize {
            return Err(errno("ibv_create_qp", libc::ENOMEM));
        }
        let qpn = state.new_qpn();
        state.qps.insert(
            qpn,
            Qp {
                pd,
                qp_type: init.qp_type,
                caps: c,
                send_cq: Arc::clone(send_cq),
                recv_cq: Arc::clone(recv_cq),
                srq: init.srq,
                sq_sig_all: init.sq_sig_all,
                attr: QpAttr::default(),
                rq: VecDeque::new(),
                waiting: VecDeque::new(),
                retries: None,
            },
        );
        Ok((qpn, c))
    }

    pub fn destroy_qp(&self, qpn: u32) {
        let mut state = self.state();
        state.qps.remove(&qpn);
        state.waiting.retain(|&q| q != qpn);
    }

    pub fn modify_qp(&self, qpn: u32, attr: &QpAttr, attr_mask: u32) -> Result<()> {
        let mut state = self.state();
        let qp = state
            .qps
            .get_mut(&qpn)
            .ok_or_else(|| errno("ibv_modify_qp", libc::EINVAL))?;
        let current = qp.attr.qp_state;
        let next = if attr_mask & mask::STATE != 0 {
            attr.qp_state
        } else {
            current
        };
        if !transition_allowed(qp.qp_type, current, next, attr_mask) {
            return Err(errno("ibv_modify_qp", libc::EINVAL));
        }
        let bad_port = attr_mask & mask::PORT != 0 && attr.port_num != 1;
        let bad_av = attr_mask & mask::AV != 0
            && (attr.ah_attr.sgid_index != 0 || attr.ah_attr.port_num > 1);
        if bad_port || bad_av {
            return Err(errno("ibv_modify_qp", libc::EINVAL));
        }
        qp.apply(attr, attr_mask);
        match next {
            QpState::Reset => {
                qp.rq.clear();
                qp.waiting.clear();
                qp.attr = QpAttr::default();
            }
            QpState::Err => state.fail_qp(qpn),
            _ => {}
        }
        Ok(())
    }

    pub fn query_qp(&self, qpn: u32) -> Result<QpAttr> {
        let state = self.state();
        let qp = state
            .qps
            .get(&qpn)
            .ok_or_else(|| errno("ibv_query_qp", libc::EINVAL))?;
        Ok(QpAttr {
            cur_qp_state: qp.attr.qp_state,
            ..qp.attr
        })
    }

    /// Carries out the batch's requests in order; those that must wait for a receive wait
    /// on the QP, and every later one behind them.
    pub fn post_send(&self, qpn: u32, batch: &SendBatch) -> Result<()> {
        const CALL: &str = "ibv_post_send";
        let mut state = self.state();
        let Some(qp) = state.qps.get(&qpn) else {
            return Err(post_refused(CALL, 0, libc::EINVAL));
        };
        let (max_wr, max_sge, qp_type) = (qp.caps.max_send_wr, qp.caps.max_send_sge, qp.qp_type);
        let ready = matches!(qp.attr.qp_state, QpState::Rts | QpState::Err);
        // Read only if a request waits: most never do.
        let mut now = None;
        for (posted, request) in batch.requests().enumerate() {
            let sges = match request.payload {
                Payload::Sges(sges) => sges.len(),
                Payload::Inline(_) => 0,
            };
            let allowed = match qp_type {
                QpType::Ud => request.opcode.is_send() && request.ud.is_some(),
                QpType::Uc => !request.opcode.needs_reliable(),
                QpType::Rc => true,
            };
            let waiting = state.qps.get(&qpn).map_or(0, |qp| qp.waiting.len());
            if !ready || !allowed || sges > max_sge as usize {
                return Err(post_refused(CALL, posted, libc::EINVAL));
            }
            if waiting >= max_wr as usize {
                return Err(post_refused(CALL, posted, libc::ENOMEM));
            }
            let request = Request::from_batch(&request);
            if waiting > 0 {
                // Behind a waiting request; its reason decides the retries.
                let now = *now.get_or_insert_with(Instant::now);
                state.wait(qpn, request.into_owned(), Wait::Receive, now);
            } else if let Err((request, why)) = state.execute(qpn, request) {
                let now = *now.get_or_insert_with(Instant::now);
                state.wait(qpn, request.into_owned(), why, now);
                self.clock.notify_one();
            }
        }
        Ok(())
    }

    pub fn post_recv(&self, qpn: u32, wrs: &[RecvWr<'_>]) -> Result<()> {
        const CALL: &str = "ibv_post_recv";
        let mut guard = self.state();
        // The fields apart: the QP and the armed failures are borrowed at once.
        let state = &mut *guard;
        let Some(qp) = state.qps.get_mut(&qpn) else {
            return Err(post_refused(CALL, 0, libc::EINVAL));
        };
        for (posted, wr) in wrs.iter().enumerate() {
            let refused = match qp.attr.qp_state {
                QpState::Reset => Some(libc::EINVAL),
                _ if qp.srq.is_some() || wr.sges.len() > qp.caps.max_recv_sge as usize => {
                    Some(libc::EINVAL)
                }
                _ if qp.rq.len() >= qp.caps.max_recv_wr as usize => Some(libc::ENOMEM),
                _ => None,
            };
            if let Some(code) = refused {
                return Err(post_refused(CALL, posted, code));
            }
            let recv = Recv::new(wr);
            if qp.attr.qp_state == QpState::Err {
                let flush = ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
                qp.recv_cq
                    .push(receive_completion(recv.wr_id, flush, qpn), false);
            } else {
                qp.rq.push_back(recv);
            }
        }
        state.resume_waiting();
        Ok(())
    }

    pub fn create_srq(&self, pd: u32, max_wr: u32, max_sge: u32) -> Result<u32> {
        if max_wr == 0 || max_wr > MAX_WR || max_sge > MAX_SGE {
            return Err(errno("ibv_create_srq", libc::EINVAL));
        }
        let mut state = self.state();
        let id = state.new_id();
        state.srqs.insert(
            id,
            Srq {
                pd,
                max_wr,
                max_sge,
                queue: VecDeque::new(),
            },
        );
        Ok(id)
    }

    pub fn destroy_srq(&self, id: u32) {
        self.state().srqs.remove(&id);
    }

    pub fn srq_post_recv(&self, id: u32, wrs: &[RecvWr<'_>]) -> Result<()> {
        const CALL: &str = "ibv_post_srq_recv";
        let mut guard = self.state();
        // The fields apart: the SRQ and the armed failures are borrowed at once.
        let state = &mut *guard;
        let Some(srq) = state.srqs.get_mut(&id) else {
            return Err(post_refused(CALL, 0, libc::EINVAL));
        };
        for (posted, wr) in wrs.iter().enumerate() {
            if wr.sges.len() > srq.max_sge as usize {
                return Err(post_refused(CALL, posted, libc::EINVAL));
            }
            if srq.queue.len() >= srq.max_wr as usize {
                return Err(post_refused(CALL, posted, libc::ENOMEM));
            }
            srq.queue.push_back(Recv::new(wr));
        }
        state.resume_waiting();
        Ok(())
    }

    pub fn create_ah(&self, pd: u32, attr: &AhAttr) -> Result<u32> {
        if attr.port_num > 1 || attr.sgid_index != 0 {
            return Err(errno("ibv_create_ah", libc::EINVAL));
        }
        let mut state = self.state();
        let id = state.new_id();
        state.ahs.insert(
            id,
            Ah {
                pd,
                dgid: attr.dgid,
            },
        );
        Ok(id)
    }

    pub fn destroy_ah(&self, id: u32) {
        self.state().ahs.remove(&id);
    }
}

/// What [`Device::create_qp`] needs besides the PD and the CQs.
pub struct QpSetup {
    pub qp_type: QpType,
    pub caps: QpCaps,
    pub srq: Option<u32>,
    pub sq_sig_all: bool,
}

/// Whether a QP of `qp_type` may go from `from` to `to` with the attributes `attr_mask`
/// names.
fn transition_allowed(qp_type: QpType, from: QpState, to: QpState, attr_mask: u32) -> bool {
    required_attributes(qp_type, from, to).is_some_and(|required| attr_mask & required == required)
}

/// The attributes a QP of `qp_type` must be given to go from `from` to `to` (`None`: it
/// cannot), as the verbs specification lists them and rxe checks them; what the loopback's
/// connection manager hands out for each transition.
pub(super) fn required_attributes(qp_type: QpType, from: QpState, to: QpState) -> Option<u32> {
    use QpState::*;
    Some(match (from, to, qp_type) {
        (_, Reset | Err, _) => 0,
        (Reset, Init, QpType::Ud) => mask::PKEY_INDEX | mask::PORT | mask::QKEY,
        (Reset, Init, _) => mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS,
        (Init, Init, _) | (Rts, Rts, _) => 0,
        (Init, Rtr, QpType::Rc) => {
            mask::AV
                | mask::PATH_MTU
                | mask::DEST_QPN
                | mask::RQ_PSN
                | mask::MAX_DEST_RD_ATOMIC
                | mask::MIN_RNR_TIMER
        }
        (Init, Rtr, QpType::Uc) => mask::AV | mask::PATH_MTU | mask::DEST_QPN | mask::RQ_PSN,
        (Init, Rtr, QpType::Ud) => 0,
        (Rtr, Rts, QpType::Rc) => {
            mask::SQ_PSN
                | mask::TIMEOUT
                | mask::RETRY_CNT
                | mask::RNR_RETRY
                | mask::MAX_QP_RD_ATOMIC
        }
        (Rtr, Rts, _) => mask::SQ_PSN,
        _ => return None,
    })
}
