//! Queue pairs and shared receive queues: their rings of WQE slots in shared memory, their
//! doorbell records, and the control commands that create, move and destroy them. Posting into
//! the rings is `posting.rs`.

use super::*;

/// The far end of an RC connection, as exchanged out of band.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RcPeer {
    pub qp_num: u32,
    pub gid: Gid,
    /// The first packet sequence number the peer sends.
    pub psn: u32,
}

/// Builds a [`QueuePair`]: `QueuePair::builder(QpType::Rc, &cq).max_send_wr(64).build(&pd)`.
pub struct QueuePairBuilder<'a> {
    pub(super) qp_type: QpType,
    pub(super) send_cq: &'a CompletionQueue,
    pub(super) recv_cq: &'a CompletionQueue,
    pub(super) srq: Option<&'a SharedReceiveQueue>,
    pub(super) max_send_wr: u32,
    pub(super) max_recv_wr: u32,
    pub(super) max_send_sge: u32,
    pub(super) max_recv_sge: u32,
    pub(super) max_inline_data: u32,
    pub(super) sq_sig_all: bool,
}

impl<'a> QueuePairBuilder<'a> {
    pub fn recv_cq(mut self, cq: &'a CompletionQueue) -> Self {
        self.recv_cq = cq;
        self
    }
    /// Receive through `srq` instead of an RQ of the QP's own.
    pub fn srq(mut self, srq: &'a SharedReceiveQueue) -> Self {
        self.srq = Some(srq);
        self
    }
    /// SQ depth; rounded up to a power of two.
    pub fn max_send_wr(mut self, n: u32) -> Self {
        self.max_send_wr = n;
        self
    }
    /// RQ depth; rounded up to a power of two.
    pub fn max_recv_wr(mut self, n: u32) -> Self {
        self.max_recv_wr = n;
        self
    }
    pub fn max_send_sge(mut self, n: u32) -> Self {
        self.max_send_sge = n;
        self
    }
    pub fn max_recv_sge(mut self, n: u32) -> Self {
        self.max_recv_sge = n;
        self
    }
    pub fn max_inline_data(mut self, n: u32) -> Self {
        self.max_inline_data = n;
        self
    }
    pub fn sq_sig_all(mut self, all: bool) -> Self {
        self.sq_sig_all = all;
        self
    }

    pub fn build(self, pd: &ProtectionDomain) -> Result<QueuePair> {
        let device = &pd.inner.device;
        let send_wr = ring_depth(self.max_send_wr, "send")?;
        let on_srq = self.srq.is_some();
        let (recv_wr, max_recv_sge) = if on_srq {
            (0, 0)
        } else {
            (ring_depth(self.max_recv_wr, "receive")?, self.max_recv_sge)
        };
        let too_large = || Error::InvalidArgument("WQEs too large for the largest slot".into());
        let sq_shift =
            send_wqe_shift(self.max_send_sge, self.max_inline_data).ok_or_else(too_large)?;
        let rq_shift = if on_srq {
            0
        } else {
            recv_wqe_shift(max_recv_sge).ok_or_else(too_large)?
        };
        let (sq_stride, rq_stride) = (1u32 << sq_shift, 1u32 << rq_shift);
        let sq_bytes = u64::from(send_wr) * u64::from(sq_stride);
        let rq_bytes = u64::from(recv_wr) * u64::from(rq_stride);
        let transport = device.transport()?;
        let sq = transport.alloc(sq_bytes, PAGE_SIZE)?;
        let rq = if on_srq {
            None
        } else {
            Some(transport.alloc(rq_bytes, PAGE_SIZE)?)
        };
        let doorbell = transport.alloc(std::mem::size_of::<QpDoorbell>() as u64, 64)?;
        let (sq_list, _sq_pages) = device.ring_page_list(sq.addr(), sq_bytes)?;
        let (rq_list, _rq_pages) = match &rq {
            Some(rq) => device.ring_page_list(rq.addr(), rq_bytes)?,
            None => (PageList::default(), Vec::new()),
        };
        let request = CreateQpRequest {
            pd: Le32::from(pd.inner.handle),
            send_cq: Le32::from(self.send_cq.inner.handle),
            recv_cq: Le32::from(self.recv_cq.inner.handle),
            srq: Le32::from(self.srq.map_or(0, |srq| srq.inner.handle)),
            qp_type: match self.qp_type {
                QpType::Rc => qp_type::RC,
                QpType::Uc => qp_type::UC,
                QpType::Ud => qp_type::UD,
            },
            sq_sig_all: self.sq_sig_all.into(),
            sq_wqe_shift: sq_shift,
            rq_wqe_shift: rq_shift,
            max_send_wr: Le32::from(send_wr),
            max_recv_wr: Le32::from(recv_wr),
            max_send_sge: Le32::from(self.max_send_sge),
            max_recv_sge: Le32::from(max_recv_sge),
            max_inline_data: Le32::from(self.max_inline_data),
            // The device's first area; the guest service puts its program's own area here
            // (SPEC.md §8.6) when it forwards the request.
            doorbell_area: Le32::from(0),
            reserved: Default::default(),
            sq_ring: sq_list,
            rq_ring: rq_list,
            doorbell: Le64::from(doorbell.device_addr()?),
        };
        let created: CreateQpResponse = device.command(Opcode::CreateQp, &request)?;
        let qp_num = created.qp_num.to_native();
        let rq = rq.map(|ring| {
            let completed = Arc::new(AtomicU32::new(0));
            self.recv_cq
                .inner
                .consumer()
                .receive_queues
                .insert(qp_num, Arc::clone(&completed));
            WorkQueue {
                ring,
                depth: recv_wr,
                stride: u64::from(rq_stride),
                producer: Mutex::new(0),
                completed: Some(completed),
            }
        });
        Ok(QueuePair {
            handle: created.handle.to_native(),
            qp_num,
            qp_type: self.qp_type,
            notify_queue: u32::from(created.notify_queue.to_native()),
            doorbell_bit: created.doorbell_bit.to_native(),
            max_send_sge: self.max_send_sge,
            max_recv_sge,
            max_inline_data: self.max_inline_data,
            state: AtomicU8::new(QpState::Reset as u8),
            pd: Arc::clone(&pd.inner),
            _cqs: [
                Arc::clone(&self.send_cq.inner),
                Arc::clone(&self.recv_cq.inner),
            ],
            sq: WorkQueue {
                ring: sq,
                depth: send_wr,
                stride: u64::from(sq_stride),
                producer: Mutex::new(0),
                completed: None,
            },
            rq,
            _srq: self.srq.map(|srq| Arc::clone(&srq.inner)),
            doorbell,
        })
    }
}

/// A send or receive queue: a ring of WQE slots in shared memory.
pub(super) struct WorkQueue {
    pub(super) ring: SharedBuffer,
    pub(super) depth: u32,
    pub(super) stride: u64,
    pub(super) producer: Mutex<u32>,
    /// An RQ's receive completions taken from its CQ (free-running): posted less these is
    /// what the queue holds in verbs' terms, which may not exceed `depth`. None where
    /// completions are not counted (an SQ, whose unsignaled sends complete unseen; an SRQ).
    pub(super) completed: Option<Arc<AtomicU32>>,
}

/// A queue pair.
pub struct QueuePair {
    pub(super) handle: u32,
    pub(super) qp_num: u32,
    pub(super) qp_type: QpType,
    pub(super) notify_queue: u32,
    pub(super) doorbell_bit: u16,
    pub(super) max_send_sge: u32,
    pub(super) max_recv_sge: u32,
    pub(super) max_inline_data: u32,
    /// The [`qp_state`] the driver last moved the QP to (the device may have failed it since,
    /// which only a later state is).
    pub(super) state: AtomicU8,
    pub(super) pd: Arc<PdInner>,
    pub(super) _cqs: [Arc<CqInner>; 2],
    pub(super) _srq: Option<Arc<SrqInner>>,
    pub(super) sq: WorkQueue,
    /// None when the QP receives through an SRQ.
    pub(super) rq: Option<WorkQueue>,
    pub(super) doorbell: SharedBuffer,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("handle", &self.handle)
            .field("qp_num", &self.qp_num)
            .finish()
    }
}

impl QueuePair {
    /// A builder for a QP of `qp_type` completing into `cq` (send and receive alike, unless
    /// [`QueuePairBuilder::recv_cq`] says otherwise).
    pub fn builder(qp_type: QpType, cq: &CompletionQueue) -> QueuePairBuilder<'_> {
        QueuePairBuilder {
            qp_type,
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            sq_sig_all: false,
        }
    }

    /// The QP number peers address.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    pub fn caps(&self) -> QpCaps {
        QpCaps {
            max_send_wr: self.sq.depth,
            max_recv_wr: self.rq.as_ref().map_or(0, |rq| rq.depth),
            max_send_sge: self.max_send_sge,
            max_recv_sge: self.max_recv_sge,
            max_inline_data: self.max_inline_data,
        }
    }

    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// Applies the fields of `attr` selected by `mask` ([`qp_attr_mask`] bits).
    pub fn modify(&self, attr: &QpAttr, mask: u32) -> Result<()> {
        let request = ModifyQpRequest {
            handle: Le32::from(self.handle),
            attr_mask: Le32::from(mask),
            attr: attr.into(),
        };
        self.pd
            .device
            .command::<_, Empty>(Opcode::ModifyQp, &request)?;
        if mask & qp_attr_mask::STATE != 0 {
            self.state.store(attr.qp_state as u8, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Refuses to post to a queue the QP's state does not take work on yet, as verbs does
    /// (`EINVAL`): receives before INIT, sends before RTS. Posted anyway, the host would
    /// refuse them later and fail the QP.
    pub(super) fn check_state(&self, least: QpState, queue: &str) -> Result<()> {
        let state = self.state.load(Ordering::Relaxed);
        if state < least as u8 {
            let state = QpState::try_from(u32::from(state)).unwrap_or_default();
            return Err(Error::InvalidArgument(format!(
                "a QP in state {state:?} takes no {queue} (it needs state {least:?} or later)"
            )));
        }
        Ok(())
    }

    /// Walks an RC QP RESET -> INIT -> RTR -> RTS towards `peer`, sending from GID
    /// `sgid_index`, with the usual settings: the port's active MTU, remote read/write/atomic
    /// access, up to 16 outstanding reads and atomics (as the device allows), unlimited RNR
    /// retries, and transport retries as [`QueuePair::connect_rc_retrying`] with 7.
    pub fn connect_rc(&self, sgid_index: u8, local_psn: u32, peer: &RcPeer) -> Result<()> {
        self.connect_rc_retrying(sgid_index, local_psn, peer, 7)
    }

    /// As [`QueuePair::connect_rc`], retransmitting an unanswered request `retry_cnt` times
    /// (0..=7) before the QP fails with `RETRY_EXC_ERR`. Soft-RoCE takes 7 as "forever", so a
    /// QP that must notice a vanished peer there asks for at most 6.
    pub fn connect_rc_retrying(
        &self,
        sgid_index: u8,
        local_psn: u32,
        peer: &RcPeer,
        retry_cnt: u8,
    ) -> Result<()> {
        let device = &self.pd.device;
        let path_mtu = device
            .command::<_, vrdma_spec::ctrl::PortAttr>(
                Opcode::QueryPort,
                &QueryPortRequest {
                    port: 1,
                    reserved: [0; 7],
                },
            )?
            .active_mtu;
        let config = device.config();
        let reads = |limit: Le32| limit.to_native().clamp(1, 16) as u8;
        let init = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC,
            ..Default::default()
        };
        self.modify(
            &init,
            qp_attr_mask::STATE
                | qp_attr_mask::PKEY_INDEX
                | qp_attr_mask::PORT
                | qp_attr_mask::ACCESS_FLAGS,
        )?;
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu,
            dest_qp_num: peer.qp_num,
            rq_psn: peer.psn,
            max_dest_rd_atomic: reads(config.max_qp_rd_atom),
            min_rnr_timer: 12,
            ah_attr: AhAttr {
                dgid: peer.gid,
                sgid_index,
                hop_limit: 1,
                is_global: true,
                port_num: 1,
                ..Default::default()
            },
            ..Default::default()
        };
        let m = qp_attr_mask::STATE
            | qp_attr_mask::AV
            | qp_attr_mask::PATH_MTU
            | qp_attr_mask::DEST_QPN
            | qp_attr_mask::RQ_PSN
            | qp_attr_mask::MAX_DEST_RD_ATOMIC
            | qp_attr_mask::MIN_RNR_TIMER;
        self.modify(&rtr, m)?;
        let rts = QpAttr {
            qp_state: QpState::Rts,
            timeout: 14,
            retry_cnt,
            rnr_retry: 7,
            sq_psn: local_psn,
            max_rd_atomic: reads(config.max_qp_init_rd_atom),
            ..Default::default()
        };
        let m = qp_attr_mask::STATE
            | qp_attr_mask::TIMEOUT
            | qp_attr_mask::RETRY_CNT
            | qp_attr_mask::RNR_RETRY
            | qp_attr_mask::SQ_PSN
            | qp_attr_mask::MAX_QP_RD_ATOMIC;
        self.modify(&rts, m)
    }

    pub fn query(&self) -> Result<QpAttr> {
        let request = HandleRequest {
            handle: Le32::from(self.handle),
            reserved: Le32::from(0),
        };
        let attr: WireQpAttr = self.pd.device.command(Opcode::QueryQp, &request)?;
        QpAttr::try_from(&attr).map_err(|_| Error::BadResponse {
            opcode: Opcode::QueryQp,
            len: std::mem::size_of::<WireQpAttr>(),
        })
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.pd.device.destroy(Opcode::DestroyQp, self.handle);
        if let Some(completed) = self.rq.as_ref().and_then(|rq| rq.completed.as_ref()) {
            let mut consumer = self._cqs[1].consumer();
            // Only this QP's entry: a QP number the host gave again has its own.
            if consumer
                .receive_queues
                .get(&self.qp_num)
                .is_some_and(|counted| Arc::ptr_eq(counted, completed))
            {
                consumer.receive_queues.remove(&self.qp_num);
            }
        }
    }
}

pub(super) struct SrqInner {
    pub(super) pd: Arc<PdInner>,
    pub(super) handle: u32,
    pub(super) notify_queue: u32,
    pub(super) doorbell_bit: u16,
    pub(super) max_sge: u32,
    pub(super) queue: WorkQueue,
    pub(super) doorbell: SharedBuffer,
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        self.pd.device.destroy(Opcode::DestroySrq, self.handle);
    }
}

/// A shared receive queue: receives for every QP built on it.
pub struct SharedReceiveQueue {
    pub(super) inner: Arc<SrqInner>,
}

/// The depth of a ring for `wrs` work requests: the power of two at or above, refused past
/// 2^31 (the device refuses depths past its own maximum).
pub(super) fn ring_depth(wrs: u32, ring: &str) -> Result<u32> {
    wrs.max(1).checked_next_power_of_two().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{wrs} {ring} work requests: more than any ring holds"
        ))
    })
}

impl ProtectionDomain {
    /// An SRQ of `max_wr` entries (rounded up to a power of two) of up to `max_sge` SGEs.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        let device = &self.inner.device;
        let depth = ring_depth(max_wr, "SRQ")?;
        let shift = recv_wqe_shift(max_sge).ok_or_else(|| {
            Error::InvalidArgument(format!("{max_sge} SGEs exceed the largest slot"))
        })?;
        let stride = 1u32 << shift;
        let bytes = u64::from(depth) * u64::from(stride);
        let transport = device.transport()?;
        let ring = transport.alloc(bytes, PAGE_SIZE)?;
        let doorbell = transport.alloc(std::mem::size_of::<SrqDoorbell>() as u64, 64)?;
        let (list, _list_pages) = device.ring_page_list(ring.addr(), bytes)?;
        let request = CreateSrqRequest {
            pd: Le32::from(self.inner.handle),
            max_wr: Le32::from(depth),
            max_sge: Le32::from(max_sge),
            srq_limit: Le32::from(0),
            wqe_shift: shift,
            reserved: [0; 3],
            doorbell_area: Le32::from(0), // as CREATE_QP's
            ring: list,
            doorbell: Le64::from(doorbell.device_addr()?),
        };
        let created: CreateSrqResponse = device.command(Opcode::CreateSrq, &request)?;
        Ok(SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                pd: Arc::clone(&self.inner),
                handle: created.handle.to_native(),
                notify_queue: u32::from(created.notify_queue.to_native()),
                doorbell_bit: created.doorbell_bit.to_native(),
                max_sge,
                queue: WorkQueue {
                    ring,
                    depth,
                    stride: u64::from(stride),
                    producer: Mutex::new(0),
                    completed: None,
                },
                doorbell,
            }),
        })
    }
}

impl SharedReceiveQueue {
    pub fn handle(&self) -> u32 {
        self.inner.handle
    }

    /// True while QPs take their receives from it (see [`ProtectionDomain::in_use`]).
    pub fn in_use(&self) -> bool {
        Arc::strong_count(&self.inner) > 1
    }

    /// Receive requests it holds at most (rounded up to a power of two).
    pub fn depth(&self) -> u32 {
        self.inner.queue.depth
    }

    pub fn max_sge(&self) -> u32 {
        self.inner.max_sge
    }

    /// Arms the SRQ's limit: [`DeviceEvent::SrqLimitReached`] once, when fewer than `limit`
    /// of its receive WQEs are left (SPEC.md §5.13); 0 disarms. Below the SRQ's depth.
    pub fn set_limit(&self, limit: u32) -> Result<()> {
        let request = ModifySrqRequest {
            handle: Le32::from(self.inner.handle),
            attr_mask: Le32::from(vrdma_spec::ctrl::SRQ_ATTR_LIMIT),
            srq_limit: Le32::from(limit),
            reserved: Le32::from(0),
        };
        self.inner
            .pd
            .device
            .command::<_, Empty>(Opcode::ModifySrq, &request)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_depths_round_up_to_powers_of_two_and_huge_requests_are_refused_not_a_panic() {
        assert_eq!(ring_depth(0, "send").unwrap(), 1);
        assert_eq!(ring_depth(5, "send").unwrap(), 8);
        assert_eq!(ring_depth(1 << 31, "send").unwrap(), 1 << 31);
        for wrs in [(1 << 31) + 1, u32::MAX] {
            assert!(matches!(
                ring_depth(wrs, "receive"),
                Err(Error::InvalidArgument(_))
            ));
        }
    }
}
