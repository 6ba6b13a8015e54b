//! Posting work requests: send requests (`SendWr`, `OneSgeSend`, `SendFlags`) built into a
//! `SendBatch` in the host's own layout and posted as one chain, and receives posted in
//! chains (to a QP here, to an SRQ by `srq.rs`).
use std::os::raw::{c_int, c_uint};
use std::sync::Arc;

use rdma_sys::*;

use super::super::{Error, Result};
use super::QueuePair;
use super::{AddressHandle, QpType};

pub use vrdma_spec::codec::{SendOp, SendOpcode, SendOperands};

pub use vrdma_spec::verbs::{Payload, RecvWr, Sge};

/// The most SGEs, and inline bytes, a batch holds: a c_int and a u32 count either.
const CAPACITY_LIMIT: usize = 1 << 30;

/// Destination of a UD send.
#[derive(Clone, Copy, Debug)]
pub struct UdDest<'a> {
    pub ah: &'a Arc<AddressHandle>,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// A send work request, flat as the host takes it: of the operands, those the opcode names
/// count, the others are ignored.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    pub wr_id: u64,
    pub opcode: SendOpcode,
    pub signaled: bool,
    pub solicited: bool,
    pub fence: bool,
    pub operands: SendOperands,
    pub payload: Payload<'a>,
    /// Required on UD QPs, ignored on RC.
    pub ud: Option<UdDest<'a>>,
}

impl<'a> SendWr<'a> {
    /// A signaled request of `op` with no other flags (and no UD destination).
    pub fn new(wr_id: u64, op: SendOp, payload: Payload<'a>) -> Self {
        SendWr {
            wr_id,
            opcode: op.opcode(),
            signaled: true,
            solicited: false,
            fence: false,
            operands: op.operands(),
            payload,
            ud: None,
        }
    }
}

/// A send request with one gathered SGE and no UD destination: what the data path's WQEs
/// mostly are, pushed with [`SendBatch::push_one_sge`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OneSgeSend {
    pub wr_id: u64,
    pub opcode: SendOpcode,
    pub flags: SendFlags,
    pub operands: SendOperands,
    pub sge: Sge,
}

/// A send request's flags, in the host's encoding.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendFlags(c_uint);

impl SendFlags {
    pub const fn new(signaled: bool, solicited: bool, fence: bool) -> SendFlags {
        let mut flags = 0;
        if signaled {
            flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        if solicited {
            flags |= ibv_send_flags::IBV_SEND_SOLICITED.0;
        }
        if fence {
            flags |= ibv_send_flags::IBV_SEND_FENCE.0;
        }
        SendFlags(flags)
    }

    pub fn signaled(self) -> bool {
        self.0 & ibv_send_flags::IBV_SEND_SIGNALED.0 != 0
    }

    pub fn solicited(self) -> bool {
        self.0 & ibv_send_flags::IBV_SEND_SOLICITED.0 != 0
    }

    pub fn fence(self) -> bool {
        self.0 & ibv_send_flags::IBV_SEND_FENCE.0 != 0
    }
}

impl OneSgeSend {
    /// The same request as a [`SendWr`].
    pub fn as_send_wr(&self) -> SendWr<'_> {
        SendWr {
            wr_id: self.wr_id,
            opcode: self.opcode,
            signaled: self.flags.signaled(),
            solicited: self.flags.solicited(),
            fence: self.flags.fence(),
            operands: self.operands,
            payload: Payload::Sges(std::slice::from_ref(&self.sge)),
            ud: None,
        }
    }
}

/// Why [`SendBatch::push_with`] added nothing.
#[derive(Debug)]
pub enum PushError<E> {
    /// No room for the request or its payload, or its payload not in the room.
    Full,
    /// The request could not be made.
    Made(E),
}

/// Send work requests in the host's own layout, filled in place one by one and posted as one
/// chain: whoever builds them (the data path, per WQE) keeps no request of its own between.
/// Every pointer in a request points into the batch's own buffers, which are allocated once
/// at their full size, or at an address handle the batch holds.
pub struct SendBatch {
    /// All zero when made but for the chain: a request writes only the fields its opcode uses.
    wrs: Box<[ibv_send_wr]>,
    len: usize,
    /// The requests' gathered SGEs, in the layout of `ibv_sge` (asserted where `Sge` is
    /// defined).
    sges: Box<[Sge]>,
    sges_used: usize,
    inline: Box<[u8]>,
    inline_used: usize,
    /// The SGE of each inline request, which names its payload in `inline`.
    inline_sges: Box<[Sge]>,
    /// The address handles UD requests name, kept alive until the batch is cleared.
    ahs: Vec<Arc<AddressHandle>>,
    /// Payload bytes of all the requests (their SGEs' lengths, or their inline data's).
    payload: u64,
}

// SAFETY: the raw pointers in `wrs` point into the batch's own heap buffers or at address
// handles it holds (thread-safe verbs objects); moving the batch moves them along.
unsafe impl Send for SendBatch {}

impl SendBatch {
    /// Room for `requests` requests with `sges` gathered SGEs and `inline` bytes of inline payload
    /// among them.
    pub fn with_capacity(requests: usize, sges: usize, inline: usize) -> SendBatch {
        // The counts handed to verbs fit their C types (an SGE count a c_int, an inline length
        // a u32) because the room they come from does.
        let (sges, inline) = (sges.min(CAPACITY_LIMIT), inline.min(CAPACITY_LIMIT));
        // SAFETY: all-zero is a valid ibv_send_wr (integers, null pointers, unions of those).
        let mut wrs: Box<[ibv_send_wr]> = (0..requests)
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        // Chained once (the boxed requests never move): a post cuts the chain after its last
        // request, and mends it after.
        let base = wrs.as_mut_ptr();
        for index in 1..wrs.len() {
            wrs[index - 1].next = base.wrapping_add(index);
        }
        SendBatch {
            wrs,
            len: 0,
            sges: vec![Sge::default(); sges].into_boxed_slice(),
            sges_used: 0,
            inline: vec![0; inline].into_boxed_slice(),
            inline_used: 0,
            inline_sges: vec![Sge::default(); requests].into_boxed_slice(),
            ahs: Vec::with_capacity(requests),
            payload: 0,
        }
    }

    #[inline]
    pub fn clear(&mut self) {
        self.len = 0;
        self.sges_used = 0;
        self.inline_used = 0;
        self.ahs.clear();
        self.payload = 0;
    }

    /// Payload bytes of the first `requests` requests (those a host took): what their SGEs
    /// or inline data name, whatever the operation does with them.
    #[inline]
    pub fn payload_bytes(&self, requests: usize) -> u64 {
        if requests >= self.len {
            return self.payload;
        }
        self.payload_bytes_of_first(requests)
    }

    /// [`SendBatch::payload_bytes`] of a batch the host took only part of: counted again.
    #[inline(never)]
    fn payload_bytes_of_first(&self, requests: usize) -> u64 {
        let inline = ibv_send_flags::IBV_SEND_INLINE.0;
        let mut gathered = self.sges.iter();
        let mut bytes = 0;
        for (index, raw) in self.wrs[..requests].iter().enumerate() {
            bytes += if raw.send_flags & inline != 0 {
                u64::from(self.inline_sges[index].length)
            } else {
                #[expect(
                    clippy::cast_sign_loss,
                    reason = "num_sge is the batch's own count, written by push from a usize"
                )]
                let count = raw.num_sge.max(0) as usize;
                gathered
                    .by_ref()
                    .take(count)
                    .map(|sge| u64::from(sge.length))
                    .sum()
            };
        }
        bytes
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Adds `wr` at the end, its payload copied in; refused when it does not fit the room the
    /// batch was made with.
    pub fn push(&mut self, wr: &SendWr<'_>) -> Result<()> {
        let pushed = self.push_with::<()>(|sge_room, inline_room| {
            let payload = match wr.payload {
                Payload::Sges(from) => {
                    let to = sge_room.get_mut(..from.len()).ok_or(PushError::Full)?;
                    to.copy_from_slice(from);
                    Payload::Sges(to)
                }
                Payload::Inline(from) => {
                    let to = inline_room.get_mut(..from.len()).ok_or(PushError::Full)?;
                    to.copy_from_slice(from);
                    Payload::Inline(to)
                }
            };
            Ok(SendWr { payload, ..*wr })
        });
        pushed.map_err(|_| Error::InvalidArgument("the send batch is full".into()))
    }

    /// Adds the request `make` makes at the end. `make` gets the batch's free SGE and
    /// inline-payload room and writes the request's payload there, from the start: it is
    /// used in place. Refused, `make` not called, when the batch has no room for another
    /// request; refused when the payload is not where it should be.
    // Inlined into the data path's loop, where the request is made from a WQE: it is then
    // never materialised, only its fields written here, and its SGEs are checked in place.
    #[inline(always)]
    pub fn push_with<'r, E>(
        &'r mut self,
        make: impl FnOnce(&'r mut [Sge], &'r mut [u8]) -> std::result::Result<SendWr<'r>, PushError<E>>,
    ) -> std::result::Result<(), PushError<E>> {
        if self.len == self.wrs.len() {
            return Err(PushError::Full);
        }
        let sge_room = &mut self.sges[self.sges_used..];
        let inline_room = &mut self.inline[self.inline_used..];
        let (gathered_at, inline_at) = (sge_room.as_mut_ptr(), inline_room.as_mut_ptr());
        let wr = make(sge_room, inline_room)?;
        let mut flags = SendFlags::new(wr.signaled, wr.solicited, wr.fence).0;
        let (sg_list, sge_count) = match wr.payload {
            Payload::Sges(sges) if std::ptr::eq(sges.as_ptr(), gathered_at) => {
                self.sges_used += sges.len();
                self.payload += sges.iter().map(|sge| u64::from(sge.length)).sum::<u64>();
                (gathered_at, sges.len())
            }
            Payload::Inline(data) if std::ptr::eq(data.as_ptr(), inline_at) => {
                // An SGE of its own: `self.sges` stays lent to `make` for `'r`.
                let sge = &mut self.inline_sges[self.len];
                #[expect(
                    clippy::cast_possible_truncation,
                    reason = "inline data lies in the batch's inline room, at most CAPACITY_LIMIT"
                )]
                let length = data.len() as u32;
                *sge = Sge {
                    addr: inline_at as u64,
                    length,
                    lkey: 0,
                };
                self.inline_used += data.len();
                self.payload += data.len() as u64;
                flags |= ibv_send_flags::IBV_SEND_INLINE.0;
                (std::ptr::from_mut(sge), 1)
            }
            _ => return Err(PushError::Full),
        };
        let ud = wr.ud.map(|dest| {
            self.ahs.push(Arc::clone(dest.ah));
            ud_t {
                // libibverbs' AH, or the number another host knows it by: never followed but
                // by the host that made it (`SendBatch::post` checks).
                ah: dest.ah.handle() as *mut ibv_ah,
                remote_qpn: dest.remote_qpn,
                remote_qkey: dest.remote_qkey,
            }
        });
        let raw = &mut self.wrs[self.len];
        self.len += 1;
        let sg_list = sg_list.cast::<ibv_sge>();
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_possible_wrap,
            reason = "the SGEs lie in the batch's SGE room, at most CAPACITY_LIMIT"
        )]
        let num_sge = sge_count as c_int;
        write_request(
            raw,
            (wr.wr_id, wr.opcode, flags),
            &wr.operands,
            (sg_list, num_sge),
            ud,
        );
        Ok(())
    }

    /// Adds `wr` at the end, its SGE copied in, as [`push`](Self::push) would add
    /// `wr.as_send_wr()`, with less work; false, adding nothing, when the batch is full.
    // Inlined into the data path's loop for its common WQE.
    #[inline(always)]
    pub fn push_one_sge(&mut self, wr: &OneSgeSend) -> bool {
        let (Some(raw), Some(sge)) = (
            self.wrs.get_mut(self.len),
            self.sges.get_mut(self.sges_used),
        ) else {
            return false;
        };
        *sge = wr.sge;
        let sg_list = std::ptr::from_mut(sge).cast::<ibv_sge>();
        write_request(
            raw,
            (wr.wr_id, wr.opcode, wr.flags.0),
            &wr.operands,
            (sg_list, 1),
            None,
        );
        self.len += 1;
        self.sges_used += 1;
        self.payload += u64::from(wr.sge.length);
        true
    }

    /// The requests' ids, in order (what a fake host records).
    pub fn wr_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.wrs[..self.len].iter().map(|raw| raw.wr_id)
    }

    /// The batch's requests, in order, read back as a host takes them (the loopback host).
    pub(in crate::hostverbs) fn requests(&self) -> impl Iterator<Item = SendWr<'_>> {
        let ud = self.ahs.len() == self.len;
        self.wrs[..self.len]
            .iter()
            .enumerate()
            .map(move |(index, raw)| {
                let flags = SendFlags(raw.send_flags);
                #[expect(
                    clippy::cast_sign_loss,
                    reason = "num_sge is the batch's own count, written by push from a usize"
                )]
                let num_sge = raw.num_sge as usize;
                // SAFETY: `sg_list` points at `num_sge` SGEs of the batch's own (`sges`, or the
                // request's entry of `inline_sges`), written when the request was pushed and
                // unchanged until the batch is cleared, which needs `&mut self`.
                let sges =
                    unsafe { std::slice::from_raw_parts(raw.sg_list.cast::<Sge>(), num_sge) };
                let payload = match sges {
                    [sge] if raw.send_flags & ibv_send_flags::IBV_SEND_INLINE.0 != 0 => {
                        // SAFETY: an inline request's one SGE names its bytes in `inline`, the
                        // batch's own, which stay as pushed while the batch is borrowed.
                        Payload::Inline(unsafe {
                            std::slice::from_raw_parts(sge.addr as *const u8, sge.length as usize)
                        })
                    }
                    sges => Payload::Sges(sges),
                };
                let opcode = SEND_OPCODES
                    .into_iter()
                    .find(|&op| host_opcode(op) == raw.opcode)
                    .expect("every request's opcode is written by write_request");
                // SAFETY: every member of the unions is plain integers (and, for UD, a pointer
                // not followed here); `write_request` wrote the one the request uses.
                let (imm, wr) = unsafe { (raw.imm_data_invalidated_rkey_union.imm_data, &raw.wr) };
                let mut operands = SendOperands {
                    imm: u32::from_be(imm),
                    ..SendOperands::default()
                };
                let dest = ud.then(|| {
                    // SAFETY: as above: a batch with an AH for every request holds UD requests.
                    let ud = unsafe { wr.ud };
                    UdDest {
                        ah: &self.ahs[index],
                        remote_qpn: ud.remote_qpn,
                        remote_qkey: ud.remote_qkey,
                    }
                });
                if dest.is_none() && opcode.is_atomic() {
                    // SAFETY: as above.
                    let atomic = unsafe { wr.atomic };
                    operands.remote_addr = atomic.remote_addr;
                    operands.rkey = atomic.rkey;
                    operands.compare_add = atomic.compare_add;
                    operands.swap = atomic.swap;
                } else if dest.is_none() {
                    // SAFETY: as above.
                    let rdma = unsafe { wr.rdma };
                    operands.remote_addr = rdma.remote_addr;
                    operands.rkey = rdma.rkey;
                }
                SendWr {
                    wr_id: raw.wr_id,
                    opcode,
                    signaled: flags.signaled(),
                    solicited: flags.solicited(),
                    fence: flags.fence(),
                    operands,
                    payload,
                    ud: dest,
                }
            })
    }

    /// Posts the batch on `qp` as one chain; on failure the error says how many requests
    /// the host took before the one it refused.
    // Kept out of the data path's loop: inlined there, it cost the loop 13 instructions per
    // WQE (callgrind, loopback, batches of 16).
    #[inline(never)]
    pub fn post(&mut self, qp: &QueuePair) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        if qp.qp_type == QpType::Ud && self.ahs.len() != self.len {
            return Err(Error::InvalidArgument(
                "UD send without a destination".into(),
            ));
        }
        if !self.ahs.iter().all(|ah| qp.same_device(ah)) {
            return Err(Error::InvalidArgument(
                "a UD send names an address handle of another device".into(),
            ));
        }
        qp.host.post_send(self)
    }

    /// Hands the batch to `post` as one chain of `ibv_send_wr` (its first request, and where
    /// to say which one was refused), as libibverbs' `ibv_post_send` takes it; on failure,
    /// how many requests were taken before the refused one, and what `post` returned.
    /// Every pointer in the chain stays valid for the call (see [`SendBatch`]).
    pub(in crate::hostverbs) fn post_chain(
        &mut self,
        post: impl FnOnce(*mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int,
    ) -> std::result::Result<(), (usize, c_int)> {
        if self.len == 0 {
            return Ok(());
        }
        let base = self.wrs.as_mut_ptr();
        let last = self.len - 1;
        let after_last = std::mem::replace(&mut self.wrs[last].next, std::ptr::null_mut());
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        let ret = post(base, &mut bad);
        self.wrs[last].next = after_last;
        if ret == 0 {
            return Ok(());
        }
        let accepted = if bad.is_null() {
            0
        } else {
            // SAFETY: `bad` points into `wrs`, per the verbs contract (at or after `base`:
            // the offset is not negative).
            unsafe { bad.offset_from(base) }.unsigned_abs()
        };
        Err((accepted, ret))
    }

    /// Runs `post` over the batch cut to its first `count` requests (a host that takes only
    /// part of a post), then restores the rest.
    pub(in crate::hostverbs) fn with_first<R>(
        &mut self,
        count: usize,
        post: impl FnOnce(&mut SendBatch) -> R,
    ) -> R {
        let count = count.min(self.len);
        let len = std::mem::replace(&mut self.len, count);
        let ud_tail = match self.ahs.len() == len {
            true => self.ahs.split_off(count),
            false => Vec::new(),
        };
        let result = post(self);
        self.len = len;
        self.ahs.extend(ud_tail);
        result
    }
}

const SEND_OPCODES: [SendOpcode; 7] = [
    SendOpcode::RdmaWrite,
    SendOpcode::RdmaWriteWithImm,
    SendOpcode::Send,
    SendOpcode::SendWithImm,
    SendOpcode::RdmaRead,
    SendOpcode::CompareAndSwap,
    SendOpcode::FetchAndAdd,
];

/// Fills a request of the batch (its `next` is the batch's) with the fields the opcode uses.
#[inline(always)]
fn write_request(
    raw: &mut ibv_send_wr,
    (wr_id, opcode, flags): (u64, SendOpcode, c_uint),
    operands: &SendOperands,
    (sg_list, num_sge): (*mut ibv_sge, c_int),
    ud: Option<ud_t>,
) {
    raw.wr_id = wr_id;
    raw.sg_list = sg_list;
    raw.num_sge = num_sge;
    raw.send_flags = flags;
    raw.opcode = host_opcode(opcode);
    raw.imm_data_invalidated_rkey_union.imm_data = operands.imm.to_be();
    if let Some(ud) = ud {
        raw.wr.ud = ud;
    } else if opcode.is_atomic() {
        raw.wr.atomic = atomic_t {
            remote_addr: operands.remote_addr,
            compare_add: operands.compare_add,
            swap: operands.swap,
            rkey: operands.rkey,
        };
    } else {
        raw.wr.rdma = rdma_t {
            remote_addr: operands.remote_addr,
            rkey: operands.rkey,
        };
    }
}

fn host_opcode(opcode: SendOpcode) -> ibv_wr_opcode::Type {
    match opcode {
        SendOpcode::RdmaWrite => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        SendOpcode::RdmaWriteWithImm => ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
        SendOpcode::Send => ibv_wr_opcode::IBV_WR_SEND,
        SendOpcode::SendWithImm => ibv_wr_opcode::IBV_WR_SEND_WITH_IMM,
        SendOpcode::RdmaRead => ibv_wr_opcode::IBV_WR_RDMA_READ,
        SendOpcode::CompareAndSwap => ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP,
        SendOpcode::FetchAndAdd => ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD,
    }
}

impl QueuePair {
    /// Posts `wrs` in order, as one chain. On failure the error says how many were posted
    /// before the one the provider refused.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        let sges = wrs.iter().map(|wr| match wr.payload {
            Payload::Sges(sges) => sges.len(),
            Payload::Inline(_) => 1,
        });
        let inline = wrs.iter().map(|wr| match wr.payload {
            Payload::Sges(_) => 0,
            Payload::Inline(data) => data.len(),
        });
        let mut batch = SendBatch::with_capacity(wrs.len(), sges.sum(), inline.sum());
        for wr in wrs {
            batch.push(wr)?;
        }
        batch.post(self)
    }

    /// Posts receive work requests in order.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.host.post_recv(wrs)
    }
}

#[cfg(test)]
mod tests;
