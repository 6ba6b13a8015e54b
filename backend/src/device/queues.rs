//! The control commands of the queues: CQs, QPs and SRQs, created over rings in guest memory
//! (checked against the guest's memory and quotas), moved through their states, destroyed.

use super::*;

impl Device {
    pub(super) fn create_cq<M: GuestMemoryBackend>(
        &mut self,
        mem: &M,
        req: CreateCqRequest,
    ) -> CommandResult {
        self.check_quota("CQ", self.objects.cqs.len(), self.config.max_cq)?;
        let depth = req.cqe.to_native();
        validate::depth("CQ depth", depth, 2, self.config.max_cqe.to_native())?;
        let flags = req.flags.to_native();
        if flags != 0 {
            return Err(Refusal::UnknownBits {
                field: "CREATE_CQ flags",
                value: flags,
                bits: flags,
            }
            .into());
        }
        let doorbell = req.doorbell.to_native();
        validate::guest_record::<M, CqDoorbell>(mem, "CQ doorbell", doorbell, 16)?;
        self.check_ring_quota(limits::cq_quota_bytes(depth))?;
        let ring = self.ring(mem, &req.ring, depth, CQE_SHIFT)?;
        let handle = self.objects.new_handle();
        let channel = self.data_path.completion_channel();
        // Within the host's limit: `max_cqe` is at most its share of it.
        let cq = self
            .host
            .context
            .create_cq(limits::HOST_CQ_DEPTHS * depth, channel)?;
        let data = Arc::new(CqData::new(handle, Arc::clone(&cq) as _, ring, doorbell));
        let entry = CqEntry {
            host: cq,
            data: Arc::clone(&data),
            users: 0,
        };
        self.objects.insert_cq(handle, entry);
        self.data_path.add_cq(data);
        reply(CreatedResponse {
            handle: Le32::from(handle),
            value: Le32::from(depth),
        })
    }

    /// RESIZE_CQ (SPEC.md §5.7.1): the CQ moves to the driver's new ring, its host CQ
    /// resized to hold as many completions again, the CQEs the driver has not consumed
    /// copied over.
    pub(super) fn resize_cq<M: GuestMemoryBackend>(
        &mut self,
        mem: &M,
        req: ResizeCqRequest,
    ) -> CommandResult {
        if self.features & features::RESIZE_CQ == 0 {
            return Err(Refusal::NotNegotiated("RESIZE_CQ").into());
        }
        let handle = req.cq.to_native();
        let depth = req.cqe.to_native();
        validate::depth("CQ depth", depth, 2, self.config.max_cqe.to_native())?;
        let entry = self.objects.cq(handle)?;
        let (host, data) = (Arc::clone(&entry.host), Arc::clone(&entry.data));
        let (before, after) = (data.ring_bytes(), limits::cq_quota_bytes(depth));
        self.check_ring_quota(after.saturating_sub(before))?;
        let ring = self.ring(mem, &req.ring, depth, CQE_SHIFT)?;
        let senders: Vec<Arc<QpData>> = self
            .objects
            .qps
            .values()
            .filter(|qp| qp.send_cq == handle)
            .map(|qp| Arc::clone(&qp.data))
            .collect();
        self.data_path.settle_cq(&data, &senders);
        self.data_path
            .resize_cq(&data, ring, || host.resize(limits::HOST_CQ_DEPTHS * depth))
            .map_err(|e| -> CommandError {
                match e {
                    ResizeCqError::HoldsMore { held, depth } => {
                        Refusal::CqHoldsMore { held, depth }.into()
                    }
                    ResizeCqError::Unusable => Refusal::CqUnusable.into(),
                    ResizeCqError::Host(e) => e.into(),
                }
            })?;
        self.objects.ring_bytes = self.objects.ring_bytes - before + after;
        reply(CreatedResponse {
            handle: Le32::from(handle),
            value: Le32::from(depth),
        })
    }

    pub(super) fn destroy_cq(&mut self, req: HandleRequest) -> CommandResult {
        let handle = req.handle.to_native();
        self.objects.remove_cq(handle)?;
        self.data_path.remove_cq(handle);
        Ok(Vec::new())
    }

    pub(super) fn reg_mr<M: GuestMemoryBackend>(
        &mut self,
        mem: &M,
        req: RegMrRequest,
    ) -> CommandResult {
        self.check_quota("MR", self.objects.mrs.len(), self.config.max_mr)?;
        let pd_handle = req.pd.to_native();
        let pd = Arc::clone(&self.objects.pd(pd_handle)?.pd);
        let access = validate::mr_access(req.access.to_native(), self.features)?;
        let virt_addr = req.virt_addr.to_native();
        let length = req.length.to_native();
        if length == 0 || length > self.config.max_mr_size.to_native() {
            return Err(Refusal::OutOfRange {
                field: "MR length",
                value: length,
                min: 1,
                max: self.config.max_mr_size.to_native(),
            }
            .into());
        }
        if virt_addr.checked_add(length).is_none() {
            return Err(Refusal::AddressWraps {
                addr: virt_addr,
                len: length,
            }
            .into());
        }
        let shift = req.pages.page_shift;
        if !(vrdma_spec::mem::MIN_PAGE_SHIFT..=vrdma_spec::mem::MAX_PAGE_SHIFT).contains(&shift) {
            return Err(mtt::MttError::PageShift(shift).into());
        }
        let page_size = 1u64 << shift;
        let offset = virt_addr & (page_size - 1);
        check_byte_quota(
            "registered memory",
            length,
            self.objects.registered_bytes,
            self.quotas.max_registered_bytes,
        )?;
        let expected = pages_needed(offset, length, shift).ok_or(Refusal::Overflow("MR range"))?;
        let host_offset = usize::try_from(offset).map_err(|_| Refusal::Overflow("MR offset"))?;
        let host_length = usize::try_from(length).map_err(|_| Refusal::Overflow("MR length"))?;
        let runs = mtt::resolve_page_list(mem, &req.pages, expected, &self.page_rules())?;
        let mr = if pd.pins_pages() {
            // Any mapping made lives only for the registration: the MR keeps the pages
            // pinned, so the mappings a guest causes do not pile up with its MRs (SPEC.md §6).
            let populated = &mut self.populated;
            let faults = &self.fault_domain;
            guest_mapping::with_pages_contiguous(
                mem,
                (&runs, page_size),
                populated,
                faults,
                |memory| pd.reg_mr_pinned(memory, host_offset, host_length, virt_addr, access),
            )??
        } else {
            // A host that reaches the pages through this process (the loopback) keeps a
            // mapping of them of its own, from the same budget, for the MR's life.
            let mapping =
                guest_mapping::GuestPagesMapping::new(&runs, page_size, &self.fault_domain)?;
            pd.reg_mr_range(mapping, host_offset, host_length, virt_addr, access)?
        };
        let (lkey, rkey) = (mr.lkey(), mr.rkey());
        let handle = self.objects.insert_mr(MrEntry {
            mr,
            pd: pd_handle,
            len: length,
        });
        let range = MrRange {
            pd: pd_handle,
            start: virt_addr,
            len: length,
        };
        self.data_path.add_mr(lkey, range);
        reply(RegMrResponse {
            handle: Le32::from(handle),
            lkey: Le32::from(lkey),
            rkey: Le32::from(rkey),
            reserved: Le32::from(0),
        })
    }

    pub(super) fn dereg_mr(&mut self, req: HandleRequest) -> CommandResult {
        let entry = self.objects.remove_mr(req.handle.to_native())?;
        self.data_path.remove_mr(entry.mr.lkey());
        Ok(Vec::new())
    }

    pub(super) fn create_qp<M: GuestMemoryBackend>(
        &mut self,
        mem: &M,
        req: CreateQpRequest,
    ) -> CommandResult {
        self.check_quota("QP", self.objects.qps.len(), self.config.max_qp)?;
        let shape = validate::create_qp(&req, &self.config, self.features)?;
        let caps = shape.caps;
        let pd_handle = req.pd.to_native();
        let (send_cq_handle, recv_cq_handle) = (req.send_cq.to_native(), req.recv_cq.to_native());
        let pd = Arc::clone(&self.objects.pd(pd_handle)?.pd);
        let (send_cq, recv_cq) = (
            self.objects.cq(send_cq_handle)?,
            self.objects.cq(recv_cq_handle)?,
        );
        let (send_cq_host, recv_cq_host) = (Arc::clone(&send_cq.host), Arc::clone(&recv_cq.host));
        let (send_cq, recv_cq) = (Arc::clone(&send_cq.data), Arc::clone(&recv_cq.data));
        let doorbell = req.doorbell.to_native();
        validate::guest_record::<M, QpDoorbell>(mem, "QP doorbell", doorbell, 16)?;
        let area = self.doorbell_area(req.doorbell_area.to_native())?;
        let srq_handle = Some(req.srq.to_native()).filter(|&h| h != 0);
        let (srq, srq_data) = match srq_handle {
            Some(h) => {
                let entry = self.objects.srq(h)?;
                (Some(Arc::clone(&entry.host)), Some(Arc::clone(&entry.data)))
            }
            None => (None, None),
        };
        let rq_bytes = match srq {
            Some(_) => 0,
            None => u64::from(caps.max_recv_wr) << req.rq_wqe_shift,
        };
        self.check_ring_quota((u64::from(caps.max_send_wr) << req.sq_wqe_shift) + rq_bytes)?;
        let sq = self.ring(mem, &req.sq_ring, caps.max_send_wr, req.sq_wqe_shift)?;
        let rq = match srq {
            Some(_) => None,
            None => Some(self.ring(mem, &req.rq_ring, caps.max_recv_wr, req.rq_wqe_shift)?),
        };
        let init = QpInit {
            qp_type: shape.qp_type,
            caps,
            srq: srq.as_ref(),
            sq_sig_all: req.sq_sig_all == 1,
        };
        let qp = Arc::new(pd.create_qp(&send_cq_host, &recv_cq_host, &init)?);
        let qp_num = qp.qp_num();
        if shape.qp_type.is_connected() {
            self.peers.created(self.connection, &qp);
        }
        let handle = self.objects.new_handle();
        let notify_queue = self.data_path.notify_queue_for(handle);
        let rules = QpRules {
            pd: pd_handle,
            ud: shape.qp_type == QpType::Ud,
            reliable: shape.qp_type == QpType::Rc,
            atomics: self.features & features::ATOMIC != 0,
            max_send_sge: caps.max_send_sge,
            max_recv_sge: caps.max_recv_sge,
            max_inline: caps.max_inline_data,
            sq_stride: 1 << req.sq_wqe_shift,
            rq_stride: 1 << req.rq_wqe_shift,
        };
        let rings = (sq, rq);
        let data = Arc::new(QpData::new(
            handle,
            Arc::clone(&qp) as _,
            rules,
            rings,
            doorbell,
            send_cq,
            recv_cq,
        ));
        let entry = QpEntry {
            host: qp,
            data: Arc::clone(&data),
            pd: pd_handle,
            send_cq: send_cq_handle,
            recv_cq: recv_cq_handle,
            srq: srq_handle,
        };
        let doorbell_bit = self
            .data_path
            .add_qp(data, area)
            .map_err(no_doorbell_bit(area))?;
        if let Some(srq) = srq_data {
            self.data_path.receive_through(qp_num, srq);
        }
        self.objects.insert_qp(handle, entry);
        reply(CreateQpResponse {
            handle: Le32::from(handle),
            qp_num: Le32::from(qp_num),
            notify_queue: wire_notify_queue(notify_queue),
            doorbell_bit: Le16::from(doorbell_bit),
            max_send_wr: Le32::from(caps.max_send_wr),
            max_recv_wr: Le32::from(caps.max_recv_wr),
            max_send_sge: Le32::from(caps.max_send_sge),
            max_recv_sge: Le32::from(caps.max_recv_sge),
            max_inline_data: Le32::from(caps.max_inline_data),
        })
    }

    pub(super) fn create_srq<M: GuestMemoryBackend>(
        &mut self,
        mem: &M,
        req: CreateSrqRequest,
    ) -> CommandResult {
        if self.features & features::SRQ == 0 {
            return Err(Refusal::NotNegotiated("SRQ").into());
        }
        self.check_quota("SRQ", self.objects.srqs.len(), self.config.max_srq)?;
        let (max_wr, max_sge) = validate::create_srq(&req, &self.config)?;
        let pd_handle = req.pd.to_native();
        let pd = Arc::clone(&self.objects.pd(pd_handle)?.pd);
        let doorbell = req.doorbell.to_native();
        validate::guest_record::<M, SrqDoorbell>(mem, "SRQ doorbell", doorbell, 16)?;
        let area = self.doorbell_area(req.doorbell_area.to_native())?;
        self.check_ring_quota(u64::from(max_wr) << req.wqe_shift)?;
        let ring = self.ring(mem, &req.ring, max_wr, req.wqe_shift)?;
        let srq = pd.create_srq(max_wr, max_sge)?;
        let handle = self.objects.new_handle();
        let notify_queue = self.data_path.notify_queue_for(handle);
        let rules = QpRules {
            pd: pd_handle,
            ud: false,
            reliable: false,
            atomics: false,
            max_send_sge: 0,
            max_recv_sge: max_sge,
            max_inline: 0,
            sq_stride: 0,
            rq_stride: 1 << req.wqe_shift,
        };
        let data = Arc::new(SrqData::new(
            handle,
            Arc::clone(&srq) as _,
            rules,
            ring,
            doorbell,
        ));
        let entry = SrqEntry {
            host: srq,
            data: Arc::clone(&data),
            pd: pd_handle,
            users: 0,
        };
        self.data_path
            .arm_srq_limit(&data, req.srq_limit.to_native());
        let doorbell_bit = self
            .data_path
            .add_srq(data, area)
            .map_err(no_doorbell_bit(area))?;
        self.objects.insert_srq(handle, entry);
        reply(CreateSrqResponse {
            handle: Le32::from(handle),
            max_wr: Le32::from(max_wr),
            max_sge: Le32::from(max_sge),
            notify_queue: wire_notify_queue(notify_queue),
            doorbell_bit: Le16::from(doorbell_bit),
        })
    }

    pub(super) fn destroy_srq(&mut self, req: HandleRequest) -> CommandResult {
        let handle = req.handle.to_native();
        self.objects.remove_srq(handle)?;
        self.data_path.remove_srq(handle);
        Ok(Vec::new())
    }

    pub(super) fn modify_srq(&mut self, req: ModifySrqRequest) -> CommandResult {
        let entry = self.objects.srq(req.handle.to_native())?;
        let limit = validate::modify_srq(&req, entry.data.depth())?;
        if entry.data.failed() {
            return Err(Refusal::SrqFailed.into());
        }
        self.data_path.arm_srq_limit(&entry.data, limit);
        Ok(Vec::new())
    }

    pub(super) fn destroy_qp(&mut self, req: HandleRequest) -> CommandResult {
        let handle = req.handle.to_native();
        let qp_num = self.objects.qp(handle)?.host.qp_num();
        // Out of its poller first, so that no pass is using the QP when it goes.
        self.data_path.remove_qp(handle);
        self.data_path.forget_receiver(qp_num);
        self.objects.remove_qp(handle)?;
        self.peers.destroyed(qp_num);
        Ok(Vec::new())
    }

    pub(super) fn modify_qp(&mut self, req: ModifyQpRequest) -> CommandResult {
        let entry = self.objects.qp(req.handle.to_native())?;
        let limits = validate::QpLimits {
            port: self.port,
            host_gid_index: self.host.gid_index,
            max_rd_atomic: self.config.max_qp_init_rd_atom.to_native(),
            max_dest_rd_atomic: self.config.max_qp_rd_atom.to_native(),
            atomics: self.features & features::ATOMIC != 0,
        };
        let (attr, mask) = validate::modify_qp(&req, &limits)?;
        // A destination on the backend's own GID is another QP of this backend's guests.
        let local_dest = mask & hostverbs::qp_attr_mask::DEST_QPN != 0
            && attr.ah_attr.dgid == self.host.gid
            && entry.host.qp_type().is_connected();
        if local_dest {
            let qp_num = entry.host.qp_num();
            self.peers
                .connect(self.connection, qp_num, attr.dest_qp_num)?;
        }
        // Receives the guest posted before it failed the QP must flush with the rest.
        if mask & hostverbs::qp_attr_mask::STATE != 0 && attr.qp_state == hostverbs::QpState::Err {
            self.data_path.flush_receives(&entry.data);
        }
        // Every field was checked above; what the host still refuses is the transition from
        // the QP's current state, or an attribute that state needs (SPEC.md §5.11).
        entry
            .host
            .modify(&attr, mask)
            .map_err(|e| match e.errno() {
                Some(libc::EINVAL) => Refusal::QpTransition(e.to_string()).into(),
                _ => CommandError::from(e),
            })?;
        Ok(Vec::new())
    }

    pub(super) fn query_qp(&self, req: HandleRequest) -> CommandResult {
        let a = self.objects.qp(req.handle.to_native())?.host.query()?;
        // The host's GID index means nothing to the guest: a QP can only hold the guest's
        // GID (MODIFY_QP checks it).
        let guest_view = QpAttr {
            ah_attr: AhAttr {
                sgid_index: GUEST_GID_INDEX,
                ..a.ah_attr
            },
            ..a
        };
        reply(WireQpAttr::from(&guest_view))
    }
}

/// A notification queue's number as a create response holds it.
#[expect(
    clippy::cast_possible_truncation,
    reason = "the number is a handle modulo num_notify_queues, clamped to 1..=MAX_NOTIFY_QUEUES (64)"
)]
fn wire_notify_queue(queue: u32) -> Le16 {
    Le16::from(queue as u16)
}
