//! Carrying out send requests between the QPs of a loopback device: checks of keys, PDs,
//! access, bounds and states as rxe makes them, copies between registered memory, and the
//! completions both ends see; sends that wait for a receive (RNR).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use rdma_sys::{ibv_wc_flags, ibv_wc_opcode, ibv_wc_status};
use vrdma_spec::codec::{SendOpcode, SendOperands};

use super::*;

/// A checked range of registered memory (or of the request itself, for inline data), as
/// this process addresses it.
#[derive(Clone, Copy)]
struct Span {
    at: *mut u8,
    len: usize,
}

/// The spans of one request's SGEs (and a GRH ahead of them): the first few on the stack,
/// where a request's usually all are.
struct Spans {
    first: [Span; Spans::INLINE],
    len: usize,
    more: Vec<Span>,
}

impl Spans {
    const INLINE: usize = 4;

    fn new() -> Spans {
        let none = Span {
            at: std::ptr::null_mut(),
            len: 0,
        };
        Spans {
            first: [none; Spans::INLINE],
            len: 0,
            more: Vec::new(),
        }
    }

    fn of(span: Span) -> Spans {
        let mut spans = Spans::new();
        spans.push(span);
        spans
    }

    fn push(&mut self, span: Span) {
        match self.first.get_mut(self.len) {
            Some(slot) => *slot = span,
            None => self.more.push(span),
        }
        self.len += 1;
    }

    fn iter(&self) -> impl Iterator<Item = Span> + '_ {
        let first = &self.first[..self.len.min(Spans::INLINE)];
        first.iter().chain(&self.more).copied()
    }
}

/// A work completion with the fields every completion has.
pub(super) fn completion(wr_id: u64, status: u32, qp_num: u32) -> WorkCompletion {
    let mut wc = WorkCompletion::default();
    wc.0.wr_id = wr_id;
    wc.0.status = status;
    wc.0.qp_num = qp_num;
    wc
}

/// The completion of a receive, with the fields every one has.
pub(super) fn receive_completion(wr_id: u64, status: u32, qp_num: u32) -> WorkCompletion {
    let mut wc = completion(wr_id, status, qp_num);
    wc.0.opcode = ibv_wc_opcode::IBV_WC_RECV;
    wc
}

/// The sender's completion of `request`.
fn send_completion(request: &Request<'_>, status: u32, qp_num: u32) -> WorkCompletion {
    let mut wc = completion(request.wr_id, status, qp_num);
    wc.0.opcode = match request.opcode {
        SendOpcode::Send | SendOpcode::SendWithImm => ibv_wc_opcode::IBV_WC_SEND,
        SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm => ibv_wc_opcode::IBV_WC_RDMA_WRITE,
        SendOpcode::RdmaRead => ibv_wc_opcode::IBV_WC_RDMA_READ,
        SendOpcode::CompareAndSwap => ibv_wc_opcode::IBV_WC_COMP_SWAP,
        SendOpcode::FetchAndAdd => ibv_wc_opcode::IBV_WC_FETCH_ADD,
    };
    wc
}

/// Why a request did not complete successfully: the sender's status, and for an error the
/// receiver saw, the receiver's.
struct Failure {
    status: u32,
    receiver: Option<(u32, Recv, u32)>,
}

impl Failure {
    fn sender(status: u32) -> Self {
        Failure {
            status,
            receiver: None,
        }
    }
}

/// What carrying out a request came to.
enum Outcome {
    /// Done: `len` bytes moved.
    Done {
        len: u64,
    },
    /// Not delivered, without an error (UC and UD drop what nobody receives).
    Dropped {
        len: u64,
    },
    Failed(Failure),
    /// Not carried out yet: try again later (RC).
    NotReady(Wait),
}

/// Why an RC request waits, which decides how long its retries last and how it fails when
/// they run out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Wait {
    /// The destination has no receive posted (an RNR NAK on a wire).
    Receive,
    /// The destination QP does not exist or does not receive (no answer on a wire: the
    /// request is retransmitted after the transport timeout).
    Peer,
}

/// How long a waiting request's retries last.
#[derive(Clone, Copy)]
pub(super) struct Retries {
    /// When the retries run out (none: they never do).
    until: Option<Instant>,
    /// The completion status the request fails with then.
    status: u32,
}

impl State {
    /// Queues `request` behind the QP's waiting ones; `why` says why the first one waits,
    /// when `request` is the first.
    pub(super) fn wait(&mut self, qpn: u32, request: Request<'static>, why: Wait, now: Instant) {
        let first = self.qps.get(&qpn).is_some_and(|qp| qp.waiting.is_empty());
        let retries = first.then(|| self.retries(qpn, why, now));
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        if first {
            qp.retries = retries;
            self.waiting.push(qpn);
        }
        qp.waiting.push_back(request);
    }

    /// The retries a request of QP `qpn` that starts waiting at `now` for `why` gets, as the
    /// QP's attributes set them: `rnr_retry` times the destination's RNR timer for a
    /// receive, `retry_cnt` times the transport timeout for the peer (a timeout of 0 and an
    /// `rnr_retry` of 7 retry for ever, as InfiniBand defines them).
    fn retries(&self, qpn: u32, why: Wait, now: Instant) -> Retries {
        let Some(qp) = self.qps.get(&qpn) else {
            return Retries {
                until: None,
                status: ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
            };
        };
        let (each, count, status) = match why {
            Wait::Receive => {
                let timer = self
                    .qps
                    .get(&qp.attr.dest_qp_num)
                    .map_or(Duration::ZERO, |peer| rnr_timer(peer.attr.min_rnr_timer));
                let forever = qp.attr.rnr_retry >= RNR_FOREVER;
                let status = ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR;
                ((!forever).then_some(timer), qp.attr.rnr_retry, status)
            }
            Wait::Peer => {
                let timeout = transport_timeout(qp.attr.timeout);
                let status = ibv_wc_status::IBV_WC_RETRY_EXC_ERR;
                (timeout, qp.attr.retry_cnt, status)
            }
        };
        Retries {
            until: each.map(|each| now + each * (u32::from(count) + 1)),
            status,
        }
    }

    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.waiting
            .iter()
            .filter_map(|qpn| self.qps.get(qpn)?.retries?.until)
            .min()
    }

    /// [`State::resume_waiting_at`] now, if any QP has something waiting (the clock is read
    /// only then).
    pub(super) fn resume_waiting(&mut self) {
        if !self.waiting.is_empty() {
            self.resume_waiting_at(Instant::now());
        }
    }

    /// Carries out what waits on every waiting QP, as far as receives and peers allow; fails
    /// the first waiting send of a QP whose retries ran out by `now`.
    pub(super) fn resume_waiting_at(&mut self, now: Instant) {
        for qpn in std::mem::take(&mut self.waiting) {
            while let Some(request) = self.qps.get_mut(&qpn).and_then(|qp| qp.waiting.pop_front()) {
                match self.execute(qpn, request) {
                    Ok(()) => {
                        // The next waiting send's retries start when it first fails.
                        if let Some(qp) = self.qps.get_mut(&qpn) {
                            qp.retries = None;
                        }
                    }
                    Err((request, why)) => {
                        // The retries the request got when it first waited, or from now on.
                        let retries = match self.qps.get(&qpn).and_then(|qp| qp.retries) {
                            Some(retries) => retries,
                            None => self.retries(qpn, why, now),
                        };
                        let qp = self.qps.get_mut(&qpn).expect("executed on this QP");
                        qp.waiting.push_front(request);
                        qp.retries = Some(retries);
                        if retries.until.is_some_and(|at| at <= now) {
                            let request = qp.waiting.pop_front().expect("just pushed");
                            qp.retries = None;
                            let failure = Failure::sender(retries.status);
                            self.complete_send(qpn, &request, Err(failure));
                            continue;
                        }
                        self.waiting.push(qpn);
                        break;
                    }
                }
            }
        }
    }

    /// Carries out `request` on QP `qpn` and writes its completions; gives it back, with
    /// the reason, when it must wait.
    pub(super) fn execute<'a>(
        &mut self,
        qpn: u32,
        request: Request<'a>,
    ) -> std::result::Result<(), (Request<'a>, Wait)> {
        let Some(qp) = self.qps.get(&qpn) else {
            return Ok(());
        };
        if qp.attr.qp_state == QpState::Err {
            let status = ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
            self.complete_send(qpn, &request, Err(Failure::sender(status)));
            return Ok(());
        }
        let outcome = self.carry_out(qpn, &request);
        let result = match outcome {
            Outcome::NotReady(why) => return Err((request, why)),
            Outcome::Done { len } | Outcome::Dropped { len } => Ok(len),
            Outcome::Failed(failure) => Err(failure),
        };
        self.complete_send(qpn, &request, result);
        Ok(())
    }

    /// Writes the sender's completion (when signaled, or an error) and, for an error, fails
    /// the QP (and the receiver's, for an error it saw).
    fn complete_send(
        &mut self,
        qpn: u32,
        request: &Request<'_>,
        result: std::result::Result<u64, Failure>,
    ) {
        let Some(qp) = self.qps.get(&qpn) else {
            return;
        };
        match result {
            Ok(len) => {
                if request.signaled(qp) {
                    let success = ibv_wc_status::IBV_WC_SUCCESS;
                    let mut wc = send_completion(request, success, qpn);
                    wc.0.byte_len = wc_len(len);
                    qp.send_cq.push(wc, false);
                }
            }
            Err(failure) => {
                qp.send_cq
                    .push(send_completion(request, failure.status, qpn), false);
                if failure.status != ibv_wc_status::IBV_WC_WR_FLUSH_ERR {
                    self.fail_qp(qpn);
                }
                if let Some((receiver, recv, status)) = failure.receiver {
                    self.fail_receive(receiver, recv, status);
                }
            }
        }
    }

    /// Moves a QP to the error state and flushes what it holds: its receives, then its
    /// waiting sends, each with a WR_FLUSH_ERR completion.
    pub(super) fn fail_qp(&mut self, qpn: u32) {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        qp.attr.qp_state = QpState::Err;
        let flush = ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
        for recv in qp.rq.drain(..) {
            qp.recv_cq
                .push(receive_completion(recv.wr_id, flush, qpn), false);
        }
        for request in qp.waiting.drain(..) {
            qp.send_cq
                .push(send_completion(&request, flush, qpn), false);
        }
        qp.retries = None;
    }

    /// Where the bytes `addr..addr + len` of the region `key` names lie, if the region is
    /// in `pd` and allows `access`.
    fn span(&self, key: u32, addr: u64, len: u64, pd: u32, access: u32) -> Option<Span> {
        let mr = self.mrs.get(&key)?;
        let start = addr.checked_sub(mr.iova)?;
        let fits = start.checked_add(len).is_some_and(|end| end <= mr.len);
        if mr.pd != pd || mr.access & access != access || !fits {
            return None;
        }
        let offset = mr.offset.checked_add(usize::try_from(start).ok()?)?;
        Some(Span {
            // In bounds: `offset + len` is within the registered part of the memory.
            at: mr.memory.as_ptr().wrapping_add(offset),
            len: usize::try_from(len).ok()?,
        })
    }

    /// The spans of a list of SGEs of `pd`, each allowing `access`, and their total length.
    fn sge_spans(&self, sges: &[Sge], pd: u32, access: u32) -> Option<(Spans, u64)> {
        let (mut spans, mut total) = (Spans::new(), 0u64);
        for sge in sges.iter().filter(|sge| sge.length > 0) {
            let len = u64::from(sge.length);
            spans.push(self.span(sge.lkey, sge.addr, len, pd, access)?);
            total += len;
        }
        (total <= MAX_MSG).then_some((spans, total))
    }

    /// Carries out the request's transfer, writing the receiver's completion if it has one.
    fn carry_out(&mut self, qpn: u32, request: &Request<'_>) -> Outcome {
        let qp = &self.qps[&qpn];
        let (pd, qp_type) = (qp.pd, qp.qp_type);
        let local_access = match request.opcode {
            SendOpcode::RdmaRead | SendOpcode::CompareAndSwap | SendOpcode::FetchAndAdd => {
                LOCAL_WRITE
            }
            _ => 0,
        };
        let local = match &request.payload {
            OwnedOrBorrowed::Sges(sges) => self.sge_spans(sges, pd, local_access),
            OwnedOrBorrowed::Inline(data) => {
                let at = data.as_ptr().cast_mut();
                Some((
                    Spans::of(Span {
                        at,
                        len: data.len(),
                    }),
                    data.len() as u64,
                ))
            }
        };
        let Some((local, len)) = local else {
            return Outcome::Failed(Failure::sender(ibv_wc_status::IBV_WC_LOC_PROT_ERR));
        };
        // The destination QP, or why there is none.
        let (target, grh) = match (qp_type, request.ud) {
            (QpType::Ud, Some((ah, remote_qpn, qkey))) => {
                if len > UD_MTU {
                    return Outcome::Failed(Failure::sender(ibv_wc_status::IBV_WC_LOC_LEN_ERR));
                }
                let reaches = self
                    .ahs
                    .get(&ah)
                    .is_some_and(|ah| ah.pd == pd && ah.dgid == gid());
                let qkey = if qkey & 0x8000_0000 != 0 {
                    qp.attr.qkey
                } else {
                    qkey
                };
                let target = self.qps.get(&remote_qpn).filter(|peer| {
                    peer.qp_type == QpType::Ud && peer.receiving() && peer.attr.qkey == qkey
                });
                match (reaches, target) {
                    (true, Some(_)) => (remote_qpn, true),
                    _ => return Outcome::Dropped { len },
                }
            }
            (QpType::Ud, None) => {
                return Outcome::Failed(Failure::sender(ibv_wc_status::IBV_WC_LOC_QP_OP_ERR))
            }
            _ => {
                let dest = qp.attr.dest_qp_num;
                let connected = self.qps.get(&dest).is_some_and(|peer| {
                    peer.receiving() && peer.qp_type == qp_type && qp.attr.ah_attr.dgid == gid()
                });
                match (connected, qp_type) {
                    (true, _) => (dest, false),
                    (false, QpType::Uc) => return Outcome::Dropped { len },
                    (false, _) => return Outcome::NotReady(Wait::Peer),
                }
            }
        };
        let reliable = qp_type == QpType::Rc;
        let ops = request.operands;
        let peer = &self.qps[&target];
        let peer_pd = peer.pd;
        // A zero-length RDMA READ or WRITE names no memory: its rkey and address are not
        // checked (IBTA C9-88, as rxe does), only the QP's access flags.
        let remote = |access: u32, len: u64| {
            let allowed = peer.attr.qp_access_flags & access == access;
            match (allowed, len) {
                (false, _) => None,
                (true, 0) if access != REMOTE_ATOMIC => Some(Span {
                    at: std::ptr::NonNull::dangling().as_ptr(),
                    len: 0,
                }),
                (true, _) => self.span(ops.rkey, ops.remote_addr, len, peer_pd, access),
            }
        };
        let access_error = || match reliable {
            true => Outcome::Failed(Failure::sender(ibv_wc_status::IBV_WC_REM_ACCESS_ERR)),
            false => Outcome::Dropped { len },
        };
        match request.opcode {
            SendOpcode::RdmaWrite => {
                let Some(to) = remote(REMOTE_WRITE, len) else {
                    return access_error();
                };
                copy(local.iter(), [to]);
                Outcome::Done { len }
            }
            SendOpcode::RdmaRead => {
                let Some(from) = remote(REMOTE_READ, len) else {
                    return access_error();
                };
                copy([from], local.iter());
                Outcome::Done { len }
            }
            SendOpcode::CompareAndSwap | SendOpcode::FetchAndAdd => {
                let aligned = ops.remote_addr.is_multiple_of(8);
                let Some(to) = remote(REMOTE_ATOMIC, 8).filter(|_| aligned && len == 8) else {
                    return match aligned && len == 8 {
                        true => access_error(),
                        false => {
                            Outcome::Failed(Failure::sender(ibv_wc_status::IBV_WC_REM_INV_REQ_ERR))
                        }
                    };
                };
                let original = atomic(to, request.opcode, ops);
                let bytes = original.to_ne_bytes();
                let from = Span {
                    at: bytes.as_ptr().cast_mut(),
                    len: 8,
                };
                copy([from], local.iter());
                Outcome::Done { len: 8 }
            }
            SendOpcode::RdmaWriteWithImm => {
                let Some(to) = remote(REMOTE_WRITE, len) else {
                    return access_error();
                };
                let Some((recv, _)) = self.take_receive(target) else {
                    return match reliable {
                        true => Outcome::NotReady(Wait::Receive),
                        false => Outcome::Dropped { len },
                    };
                };
                copy(local.iter(), [to]);
                let mut wc = completion(recv.wr_id, ibv_wc_status::IBV_WC_SUCCESS, target);
                wc.0.opcode = ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM;
                wc.0.byte_len = wc_len(len);
                self.deliver(target, qpn, wc, Some(ops.imm), request.solicited);
                Outcome::Done { len }
            }
            SendOpcode::Send | SendOpcode::SendWithImm => {
                let Some((recv, recv_pd)) = self.take_receive(target) else {
                    return match reliable {
                        true => Outcome::NotReady(Wait::Receive),
                        false => Outcome::Dropped { len },
                    };
                };
                let header = if grh { GRH_LEN as u64 } else { 0 };
                let Some((to, room)) = self.sge_spans(&recv.sges, recv_pd, LOCAL_WRITE) else {
                    let status = ibv_wc_status::IBV_WC_LOC_PROT_ERR;
                    return Outcome::Failed(Failure {
                        status: ibv_wc_status::IBV_WC_REM_OP_ERR,
                        receiver: Some((target, recv, status)),
                    });
                };
                if len + header > room {
                    let status = ibv_wc_status::IBV_WC_LOC_LEN_ERR;
                    return match reliable {
                        true => Outcome::Failed(Failure {
                            status: ibv_wc_status::IBV_WC_REM_INV_REQ_ERR,
                            receiver: Some((target, recv, status)),
                        }),
                        false => {
                            self.fail_receive(target, recv, status);
                            Outcome::Dropped { len }
                        }
                    };
                }
                let grh_bytes = grh_header(len);
                let mut from = Spans::new();
                if grh {
                    let at = grh_bytes.as_ptr().cast_mut();
                    from.push(Span { at, len: GRH_LEN });
                }
                local.iter().for_each(|span| from.push(span));
                copy(from.iter(), to.iter());
                let success = ibv_wc_status::IBV_WC_SUCCESS;
                let mut wc = receive_completion(recv.wr_id, success, target);
                wc.0.byte_len = wc_len(len + header);
                if grh {
                    wc.0.wc_flags |= ibv_wc_flags::IBV_WC_GRH.0;
                }
                let imm = (request.opcode == SendOpcode::SendWithImm).then_some(ops.imm);
                self.deliver(target, qpn, wc, imm, request.solicited);
                Outcome::Done { len }
            }
        }
    }

    /// The next receive of QP `qpn` (from its SRQ if it has one) and the PD its SGEs are in.
    fn take_receive(&mut self, qpn: u32) -> Option<(Recv, u32)> {
        let qp = self.qps.get_mut(&qpn)?;
        match qp.srq {
            Some(srq) => {
                let srq = self.srqs.get_mut(&srq)?;
                Some((srq.queue.pop_front()?, srq.pd))
            }
            None => Some((qp.rq.pop_front()?, qp.pd)),
        }
    }

    /// A receive that failed: its error completion, and its QP fails.
    fn fail_receive(&mut self, qpn: u32, recv: Recv, status: u32) {
        if let Some(qp) = self.qps.get(&qpn) {
            qp.recv_cq
                .push(receive_completion(recv.wr_id, status, qpn), false);
        }
        self.fail_qp(qpn);
    }

    /// Writes a receive completion on QP `qpn`, from QP `source`.
    fn deliver(
        &self,
        qpn: u32,
        source: u32,
        mut wc: WorkCompletion,
        imm: Option<u32>,
        solicited: bool,
    ) {
        let Some(qp) = self.qps.get(&qpn) else {
            return;
        };
        wc.0.src_qp = source;
        if let Some(imm) = imm {
            wc.0.wc_flags |= ibv_wc_flags::IBV_WC_WITH_IMM.0;
            wc.0.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        }
        qp.recv_cq.push(wc, solicited);
    }
}

/// A completion's byte count: a message is at most `MAX_MSG` (1 << 31) bytes, which a u32
/// holds; anything longer would read as `u32::MAX`, never wrapped.
fn wc_len(len: u64) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// The 40 bytes ahead of a UD message in its receive buffer. RoCEv2 over IPv4 (the loopback's
/// GID): an IPv4 header in the last 20, as rxe writes it.
fn grh_header(len: u64) -> [u8; GRH_LEN] {
    let mut grh = [0u8; GRH_LEN];
    let ip = &mut grh[20..];
    ip[0] = 0x45;
    let total = u16::try_from(20 + 8 + 12 + len + 4).unwrap_or(u16::MAX);
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip[8] = 64; // TTL
    ip[9] = 17; // UDP
    let address = std::net::Ipv4Addr::LOCALHOST.octets();
    ip[12..16].copy_from_slice(&address);
    ip[16..20].copy_from_slice(&address);
    grh
}

/// Copies the bytes of `from` into `to`, span after span, as far as both reach.
fn copy(from: impl IntoIterator<Item = Span>, to: impl IntoIterator<Item = Span>) {
    let (mut from, mut to) = (from.into_iter(), to.into_iter());
    let (mut a, mut b) = (from.next(), to.next());
    while let (Some(src), Some(dst)) = (a.as_mut(), b.as_mut()) {
        let n = src.len.min(dst.len);
        // SAFETY: both spans lie inside memory that stays mapped while the device's lock is
        // held: a registered region's (checked by `State::span`, kept by its `Mr`), or the
        // request's own inline bytes or a local array, which the caller borrows for the
        // call; or the empty span of a zero-length RDMA operation, which `n` 0 leaves
        // untouched. They may overlap (a READ within one region), which `copy` allows. The
        // guest may write the same bytes meanwhile, as it may under a NIC's DMA.
        unsafe { std::ptr::copy(src.at, dst.at, n) };
        src.at = src.at.wrapping_add(n);
        src.len -= n;
        dst.at = dst.at.wrapping_add(n);
        dst.len -= n;
        if src.len == 0 {
            a = from.next();
        }
        if dst.len == 0 {
            b = to.next();
        }
    }
}

/// Carries out an atomic on the 8 bytes of `target`; returns the value they held.
fn atomic(target: Span, opcode: SendOpcode, ops: SendOperands) -> u64 {
    debug_assert!(target.len == 8);
    if !(target.at as usize).is_multiple_of(8) {
        // A region registered at an IOVA aligned otherwise than its memory: no atomic
        // instruction reaches it, so do what an emulated NIC does, under the device's lock.
        let mut bytes = [0u8; 8];
        // SAFETY: `target` is 8 bytes of registered memory (see `copy`).
        unsafe { std::ptr::copy(target.at, bytes.as_mut_ptr(), 8) };
        let original = u64::from_ne_bytes(bytes);
        let new = match opcode {
            SendOpcode::CompareAndSwap if original == ops.compare_add => ops.swap,
            SendOpcode::CompareAndSwap => original,
            _ => original.wrapping_add(ops.compare_add),
        };
        // SAFETY: as above.
        unsafe { std::ptr::copy(new.to_ne_bytes().as_ptr(), target.at, 8) };
        return original;
    }
    // SAFETY: `target` is 8 bytes of registered memory (see `copy`), aligned to 8 (checked
    // above), and every access the device makes to it is atomic; the guest's own accesses
    // to shared memory are its business, as under a NIC.
    let word = unsafe { AtomicU64::from_ptr(target.at.cast::<u64>()) };
    match opcode {
        SendOpcode::CompareAndSwap => word
            .compare_exchange(
                ops.compare_add,
                ops.swap,
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .unwrap_or_else(|v| v),
        _ => word.fetch_add(ops.compare_add, Ordering::SeqCst),
    }
}
