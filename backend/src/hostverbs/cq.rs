//! Completion queues and their event channels: made on a context, polled, armed, resized.

use super::*;

impl Context {
    /// A completion queue with room for at least `depth` completions; with a channel, armed
    /// completions ([`CompletionQueue::req_notify`]) are reported on it.
    pub fn create_cq(
        self: &Arc<Self>,
        depth: u32,
        channel: Option<&Arc<CompletionChannel>>,
    ) -> Result<Arc<CompletionQueue>> {
        let cqe = c_int::try_from(depth)
            .map_err(|_| Error::InvalidArgument(format!("CQ depth {depth} too large")))?;
        let raw = match (&self.raw, channel.map(|c| &c.raw)) {
            (Raw::Verbs(context), channel) => {
                let channel_ptr = match channel {
                    None => std::ptr::null_mut(),
                    Some(Raw::Verbs(channel)) => channel.as_ptr(),
                    Some(Raw::Loopback(_)) => return Err(other_host("ibv_create_cq")),
                };
                // SAFETY: the context (and the channel, if any) are alive and outlive the CQ,
                // which holds Arcs of both; no user context is passed.
                Raw::Verbs(
                    NonNull::new(unsafe {
                        ibv_create_cq(context.as_ptr(), cqe, std::ptr::null_mut(), channel_ptr, 0)
                    })
                    .ok_or_else(|| last_error("ibv_create_cq"))?,
                )
            }
            (Raw::Loopback(context), channel) => {
                let channel = match channel {
                    None => None,
                    Some(Raw::Loopback(channel)) => Some(Arc::clone(channel)),
                    Some(Raw::Verbs(_)) => return Err(other_host("ibv_create_cq")),
                };
                Raw::Loopback(context.create_cq(depth, channel)?)
            }
        };
        Ok(Arc::new(CompletionQueue {
            raw,
            _channel: channel.cloned(),
            _context: Arc::clone(self),
        }))
    }

    /// A completion channel whose file descriptor is non-blocking, for epoll.
    pub fn create_comp_channel(self: &Arc<Self>) -> Result<Arc<CompletionChannel>> {
        let raw = match &self.raw {
            // SAFETY: the context is open.
            Raw::Verbs(raw) => Raw::Verbs(
                NonNull::new(unsafe { ibv_create_comp_channel(raw.as_ptr()) })
                    .ok_or_else(|| last_error("ibv_create_comp_channel"))?,
            ),
            Raw::Loopback(_) => Raw::Loopback(loopback::Channel::new()?),
        };
        let channel = CompletionChannel {
            raw,
            _context: Arc::clone(self),
        };
        set_nonblocking(channel.fd()).map_err(|source| Error::Verbs {
            call: "fcntl(O_NONBLOCK) on a completion channel",
            source,
        })?;
        Ok(Arc::new(channel))
    }
}

/// A completion event channel: readable when an armed CQ attached to it gets a completion.
pub struct CompletionChannel {
    pub(super) raw: Raw<ibv_comp_channel, Arc<loopback::Channel>>,
    _context: Arc<Context>,
}

verbs_object_is_thread_safe!(CompletionChannel);

impl CompletionChannel {
    pub fn fd(&self) -> std::os::fd::RawFd {
        match &self.raw {
            // SAFETY: the channel is alive; fd is set at creation.
            Raw::Verbs(raw) => unsafe { (*raw.as_ptr()).fd },
            Raw::Loopback(channel) => channel.fd(),
        }
    }

    /// Consumes and acknowledges every pending event; returns how many there were.
    pub fn drain(&self) -> usize {
        let raw = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr(),
            Raw::Loopback(channel) => return channel.drain(),
        };
        let mut count = 0;
        loop {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut context: *mut std::os::raw::c_void = std::ptr::null_mut();
            // SAFETY: the channel is alive and non-blocking; both out-pointers are valid.
            if unsafe { ibv_get_cq_event(raw, &mut cq, &mut context) } != 0 {
                return count;
            }
            // SAFETY: `cq` was just returned by the channel, and CQs attached to this channel
            // hold an Arc of it, so the CQ is alive; each event is acknowledged once.
            unsafe { ibv_ack_cq_events(cq, 1) };
            count += 1;
        }
    }
}

impl Drop for CompletionChannel {
    fn drop(&mut self) {
        let Raw::Verbs(raw) = &self.raw else { return };
        // SAFETY: CQs attached to the channel hold an Arc of it, so none is left.
        if unsafe { ibv_destroy_comp_channel(raw.as_ptr()) } != 0 {
            log::error!("ibv_destroy_comp_channel failed");
        }
    }
}

/// A host completion queue.
pub struct CompletionQueue {
    pub(super) raw: Raw<ibv_cq, Arc<loopback::Cq>>,
    _channel: Option<Arc<CompletionChannel>>,
    _context: Arc<Context>,
}

verbs_object_is_thread_safe!(CompletionQueue);

/// One completion, as polled from a host CQ.
#[repr(transparent)]
pub struct WorkCompletion(pub(super) ibv_wc);

impl WorkCompletion {
    /// A completion as a fake host CQ of a unit test hands it out.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn for_test(
        wr_id: u64,
        status: u32,
        opcode: u32,
        byte_len: u32,
        qp_num: u32,
    ) -> Self {
        let mut wc = WorkCompletion::default();
        wc.0.wr_id = wr_id;
        wc.0.status = status;
        wc.0.opcode = opcode;
        wc.0.byte_len = byte_len;
        wc.0.qp_num = qp_num;
        wc
    }
}

impl Default for WorkCompletion {
    fn default() -> Self {
        // SAFETY: all-zero is a valid ibv_wc (integers and a union of integers).
        WorkCompletion(unsafe { std::mem::zeroed() })
    }
}

impl WorkCompletion {
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }
    /// `ibv_wc_status` value; 0 is success.
    pub fn status(&self) -> u32 {
        self.0.status
    }
    pub fn is_success(&self) -> bool {
        self.0.status == ibv_wc_status::IBV_WC_SUCCESS
    }
    /// `ibv_wc_opcode` value.
    pub fn opcode(&self) -> u32 {
        self.0.opcode
    }
    /// A receive completion (`IBV_WC_RECV` or `IBV_WC_RECV_RDMA_WITH_IMM`).
    pub fn is_recv(&self) -> bool {
        self.0.opcode & ibv_wc_opcode::IBV_WC_RECV != 0
    }
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }
    pub fn src_qp(&self) -> u32 {
        self.0.src_qp
    }
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }
    pub fn wc_flags(&self) -> u32 {
        self.0.wc_flags
    }
    pub fn sl(&self) -> u8 {
        self.0.sl
    }
    pub fn pkey_index(&self) -> u16 {
        self.0.pkey_index
    }
    /// The immediate data as a host value, when the completion carries one.
    pub fn imm_data(&self) -> Option<u32> {
        (self.0.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0)
            // SAFETY: with IBV_WC_WITH_IMM set, the union holds imm_data.
            .then(|| u32::from_be(unsafe { self.0.imm_data_invalidated_rkey_union.imm_data }))
    }
}

impl fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.wr_id())
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .field("qp_num", &self.qp_num())
            .finish()
    }
}

impl CompletionQueue {
    /// What names this CQ in an [`AsyncEvent`].
    pub fn id(&self) -> ObjectId {
        match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr() as ObjectId,
            Raw::Loopback(cq) => cq.id(),
        }
    }

    /// Moves up to `out.len()` completions into `out`; returns how many.
    // Inlined into the data path's host seam, as `SendBatch::post` is.
    #[inline(always)]
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let raw = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr(),
            Raw::Loopback(cq) => return Ok(cq.poll(out)),
        };
        let max = c_int::try_from(out.len()).unwrap_or(c_int::MAX);
        // SAFETY: the CQ is alive; `out` has room for `max` ibv_wc (WorkCompletion is a
        // transparent wrapper).
        let n = unsafe { ibv_poll_cq(raw, max, out.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(Error::Verbs {
                call: "ibv_poll_cq",
                source: io::Error::from_raw_os_error(-n),
            });
        }
        #[expect(clippy::cast_sign_loss, reason = "n >= 0, checked just above")]
        let n = n as usize;
        Ok(n)
    }

    /// Asks for one event on the CQ's channel at the next (solicited) completion.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        let raw = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr(),
            Raw::Loopback(cq) => {
                cq.arm(solicited_only);
                return Ok(());
            }
        };
        // SAFETY: the CQ is alive.
        check("ibv_req_notify_cq", unsafe {
            ibv_req_notify_cq(raw, solicited_only.into())
        })
    }

    /// Makes room for at least `depth` completions, keeping those the CQ holds; fails
    /// (EINVAL) if it holds more.
    pub fn resize(&self, depth: u32) -> Result<()> {
        let cqe = c_int::try_from(depth).map_err(|_| Error::Verbs {
            call: "ibv_resize_cq",
            source: io::Error::from_raw_os_error(libc::EINVAL),
        })?;
        let raw = match &self.raw {
            Raw::Verbs(raw) => raw.as_ptr(),
            Raw::Loopback(cq) => {
                return cq.resize(depth).map_err(|errno| Error::Verbs {
                    call: "ibv_resize_cq",
                    source: io::Error::from_raw_os_error(errno),
                })
            }
        };
        // SAFETY: the CQ is alive; libibverbs serialises a resize with polls of the CQ.
        check("ibv_resize_cq", unsafe { ibv_resize_cq(raw, cqe) })
    }

    /// Capacity the provider actually allocated.
    pub fn depth(&self) -> u32 {
        match &self.raw {
            // SAFETY: the CQ is alive; `cqe` is set at creation and only changed by resize.
            Raw::Verbs(raw) => u32::try_from(unsafe { (*raw.as_ptr()).cqe }).unwrap_or(0),
            Raw::Loopback(cq) => cq.depth(),
        }
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        let Raw::Verbs(raw) = &self.raw else { return };
        // SAFETY: QPs hold an Arc of their CQs, so none still uses this one.
        let ret = unsafe { ibv_destroy_cq(raw.as_ptr()) };
        if ret != 0 {
            log::error!("ibv_destroy_cq failed: {ret}");
        }
    }
}
