//! The loopback host: a software RDMA device inside the backend process (`--device
//! loopback`). It carries SEND/RECV (with immediate), WRITE (with immediate), READ, both
//! atomics and UD between the QPs of this one backend, by copying between registered memory,
//! with the error semantics verbs gives on rxe for keys, PDs, access flags, bounds, QP states
//! and RNR. It is a test and measurement instrument: what a guest does on it costs what the
//! relay costs, with no NIC, no wire and no kernel under it. rxe remains the real check.
//!
//! A device serves every context of the process opened by its name, so the guests of one
//! backend reach each other through it, on its one GID (the IPv4-mapped 127.0.0.1).
//! `loopback` is one device; `loopback-NAME` are others, each a fabric of its own (tests
//! running side by side in one process each take one, so that they neither meet nor count
//! each other's objects). A request is carried out when it is posted, under the device's
//! lock. An RC request whose destination QP does not receive yet waits on its QP, as a NIC
//! retransmits an unanswered request, until the peer reaches RTR or the QP's `retry_cnt`
//! transport timeouts pass (RETRY_EXC_ERR); an RC SEND (or WRITE with immediate) that finds
//! no receive waits, as a NIC retries after an RNR NAK, until a receive is posted or its
//! RNR retries run out (RNR_RETRY_EXC_ERR). A thread of the device keeps the time.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use rdma_sys::{ibv_access_flags, ibv_wc_status};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub mod cm;
mod host;
#[cfg(test)]
mod tests;
mod transfer;
mod verbs;

pub use verbs::QpSetup;

use transfer::{receive_completion, Retries, Wait};

use super::event_queue::EventQueue;

use super::{
    qp_attr_mask as mask, AhAttr, AsyncEvent, DeviceAttr, Error, Gid, GidType, ObjectId, Payload,
    PinnedMemory, PortAttr, QpAttr, QpCaps, QpState, QpType, RecvWr, Result, SendBatch, SendWr,
    Sge, WorkCompletion,
};
use vrdma_spec::codec::{SendOpcode, SendOperands};

/// The device name that selects the loopback host.
pub const NAME: &str = "loopback";

/// Whether `device` names a loopback device: `loopback` or `loopback-ANYTHING`.
pub fn is_loopback(device: &str) -> bool {
    device
        .strip_prefix(NAME)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('-'))
}

/// The device's one GID: RoCEv2's for 127.0.0.1.
pub fn gid() -> Gid {
    Gid::from(std::net::Ipv4Addr::LOCALHOST)
}

const MAX_QP: u32 = 1 << 17;
const MAX_WR: u32 = 1 << 15;
const MAX_SGE: u32 = 32;
const MAX_CQE: u32 = 1 << 20;
const MAX_INLINE: u32 = 256;
const MAX_RD_ATOMIC: u32 = 128;
/// What one message may carry, as rxe's port says.
const MAX_MSG: u64 = 1 << 31;
#[expect(clippy::cast_possible_truncation, reason = "MAX_MSG is 1 << 31")]
const MAX_MSG_U32: u32 = MAX_MSG as u32;
/// `ibv_mtu` 4096: UD messages are at most this long.
const MTU_4096: u32 = 5;
/// [`MTU_4096`] as a QP attribute's byte holds it.
#[expect(clippy::cast_possible_truncation, reason = "MTU_4096 is 5")]
const MTU_4096_BYTE: u8 = MTU_4096 as u8;
const UD_MTU: u64 = 4096;
/// Bytes of the GRH that heads every UD receive buffer.
const GRH_LEN: usize = 40;
/// `rnr_retry` that means retrying for ever.
const RNR_FOREVER: u8 = 7;

const LOCAL_WRITE: u32 = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
const REMOTE_WRITE: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
const REMOTE_READ: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
const REMOTE_ATOMIC: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;

fn errno(call: &'static str, code: i32) -> Error {
    Error::Verbs {
        call,
        source: io::Error::from_raw_os_error(code),
    }
}

fn post_refused(call: &'static str, posted: usize, code: i32) -> Error {
    Error::Post {
        call,
        posted,
        source: io::Error::from_raw_os_error(code),
    }
}

/// The device's attributes: rxe's shape, with the loopback's own limits.
pub fn device_attr() -> DeviceAttr {
    DeviceAttr {
        fw_ver: env!("CARGO_PKG_VERSION").into(),
        node_guid: 0x7672_646d_616c_6f6f,
        sys_image_guid: 0x7672_646d_616c_6f6f,
        max_mr_size: u64::MAX,
        page_size_cap: 0xffff_f000,
        vendor_id: 0,
        vendor_part_id: 0,
        hw_ver: 0,
        max_qp: MAX_QP,
        max_qp_wr: MAX_WR,
        // IBV_DEVICE_RC_RNR_NAK_GEN | IBV_DEVICE_SRQ_RESIZE | IBV_DEVICE_N_NOTIFY_CQ, as rxe
        device_cap_flags: (1 << 12) | (1 << 13) | (1 << 14),
        max_sge: MAX_SGE,
        max_cq: MAX_QP,
        max_cqe: MAX_CQE,
        max_mr: MAX_QP,
        max_pd: MAX_QP,
        max_qp_rd_atom: MAX_RD_ATOMIC,
        max_qp_init_rd_atom: MAX_RD_ATOMIC,
        max_ah: MAX_QP,
        max_srq: MAX_QP,
        max_srq_wr: MAX_WR,
        max_srq_sge: MAX_SGE,
        atomic_cap: rdma_sys::ibv_atomic_cap::IBV_ATOMIC_HCA,
        phys_port_cnt: 1,
        max_inline_data: MAX_INLINE,
    }
}

/// Port 1, the only one: active, Ethernet, one GID.
pub fn port_attr(port: u8) -> Result<PortAttr> {
    if port != 1 {
        return Err(errno("ibv_query_port", libc::EINVAL));
    }
    Ok(PortAttr {
        state: super::PORT_ACTIVE,
        max_mtu: MTU_4096,
        active_mtu: MTU_4096,
        gid_tbl_len: 1,
        port_cap_flags: 0,
        max_msg_sz: MAX_MSG_U32,
        pkey_tbl_len: 1,
        lid: 0,
        active_width: 1,
        active_speed: 1,
        phys_state: 5, // LinkUp
        link_layer: super::LINK_LAYER_ETHERNET,
    })
}

/// Entry `index` of port `port`'s GID table.
pub fn query_gid(port: u8, index: u32) -> Result<(Gid, GidType)> {
    if port != 1 || index != 0 {
        return Err(errno("ibv_query_gid_ex", libc::ENODATA));
    }
    Ok((gid(), GidType::RoceV2))
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// One open context of the loopback device.
pub struct Context {
    device: &'static Device,
    events: Arc<EventQueue<AsyncEvent>>,
}

impl Drop for Context {
    fn drop(&mut self) {
        (self.device.state().contexts).retain(|events| !Arc::ptr_eq(events, &self.events));
    }
}

impl Context {
    /// A context of the loopback device `name` ([`is_loopback`]).
    pub fn open(name: &str) -> Result<Context> {
        let device = Device::named(name);
        let events = Arc::new(EventQueue::new()?);
        device.state().contexts.push(Arc::clone(&events));
        Ok(Context { device, events })
    }

    pub fn create_cq(&self, depth: u32, channel: Option<Arc<Channel>>) -> Result<Arc<Cq>> {
        if depth == 0 || depth > MAX_CQE {
            return Err(errno("ibv_create_cq", libc::EINVAL));
        }
        let mut state = self.device.state();
        state.cqs += 1;
        drop(state);
        Ok(Arc::new(Cq {
            depth: AtomicU32::new(depth),
            state: Mutex::default(),
            channel,
            events: Arc::clone(&self.events),
            device: self.device,
        }))
    }
}

/// An object of a loopback device: the device and the object's number there (a QP's number,
/// an MR's key).
#[derive(Clone, Copy)]
pub struct Handle {
    pub device: &'static Device,
    pub id: u32,
}

impl Handle {
    /// Another object of the same device.
    pub fn with_id(self, id: u32) -> Handle {
        Handle { id, ..self }
    }
}

/// A completion channel: an event counter, readable while events are unread.
pub struct Channel {
    fd: EventFd,
}

impl Channel {
    pub fn new() -> Result<Arc<Channel>> {
        let fd = EventFd::new(EFD_NONBLOCK).map_err(|e| Error::Verbs {
            call: "eventfd",
            source: e,
        })?;
        Ok(Arc::new(Channel { fd }))
    }

    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Takes every pending event; returns how many there were.
    pub fn drain(&self) -> usize {
        // An eventfd's count is at most u64::MAX - 1: beyond a usize, it is as many as a
        // usize holds.
        self.fd
            .read()
            .map_or(0, |count| usize::try_from(count).unwrap_or(usize::MAX))
    }
}

/// A completion queue.
pub struct Cq {
    /// Completions it holds at most; changed only by [`Cq::resize`].
    depth: AtomicU32,
    state: Mutex<CqState>,
    channel: Option<Arc<Channel>>,
    events: Arc<EventQueue<AsyncEvent>>,
    device: &'static Device,
}

impl Drop for Cq {
    fn drop(&mut self) {
        self.device.state().cqs -= 1;
    }
}

#[derive(Default)]
struct CqState {
    entries: VecDeque<WorkCompletion>,
    /// Armed for one event: at the next completion, or (true) the next solicited one.
    armed: Option<bool>,
    overrun: bool,
}

impl Cq {
    pub fn id(&self) -> ObjectId {
        std::ptr::from_ref(self) as ObjectId
    }

    pub fn depth(&self) -> u32 {
        self.depth.load(Ordering::Relaxed)
    }

    /// Holds up to `depth` completions from now on; EINVAL, changing nothing, if that is
    /// not a depth a CQ may have or the CQ holds more, as `ibv_resize_cq` on rxe.
    pub fn resize(&self, depth: u32) -> std::result::Result<(), i32> {
        let state = lock(&self.state);
        if depth == 0 || depth > MAX_CQE || state.entries.len() > depth as usize {
            return Err(libc::EINVAL);
        }
        self.depth.store(depth, Ordering::Relaxed);
        Ok(())
    }

    pub fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        let mut state = lock(&self.state);
        let n = out.len().min(state.entries.len());
        for (slot, wc) in out.iter_mut().zip(state.entries.drain(..n)) {
            *slot = wc;
        }
        n
    }

    pub fn arm(&self, solicited_only: bool) {
        let mut state = lock(&self.state);
        // Asking for "next" after "solicited" widens the request, never the reverse.
        state.armed = Some(solicited_only && state.armed != Some(false));
    }

    /// Adds a completion; a full CQ overruns, as a NIC's does: the completion is lost and
    /// the CQ's context gets CQ_ERR (once).
    fn push(&self, wc: WorkCompletion, solicited: bool) {
        let mut state = lock(&self.state);
        if state.entries.len() >= self.depth() as usize {
            if !state.overrun {
                state.overrun = true;
                self.events.push(AsyncEvent::CqError(self.id()));
            }
            return;
        }
        let fire = match state.armed {
            Some(solicited_only) => !solicited_only || solicited || !wc.is_success(),
            None => false,
        };
        state.entries.push_back(wc);
        if fire {
            state.armed = None;
            if let Some(channel) = &self.channel {
                let _ = channel.fd.write(1);
            }
        }
    }
}

/// The loopback device: every object of every context of the process.
pub struct Device {
    state: Mutex<State>,
    /// Wakes the RNR clock when a send starts waiting.
    clock: Condvar,
    /// Its connection manager's ids and addresses.
    cm: cm::ConnectionManager,
}

impl Device {
    /// The device called `name`, made (with its RNR clock thread) on first use; it lives as
    /// long as the process.
    pub fn named(name: &str) -> &'static Device {
        static DEVICES: OnceLock<Mutex<HashMap<String, &'static Device>>> = OnceLock::new();
        let mut devices = lock(DEVICES.get_or_init(Mutex::default));
        if let Some(device) = devices.get(name) {
            return device;
        }
        let device: &'static Device = Box::leak(Box::new(Device {
            state: Mutex::new(State::default()),
            clock: Condvar::new(),
            cm: cm::ConnectionManager::new(name),
        }));
        let started = std::thread::Builder::new()
            .name("vrdma-loopback".into())
            .spawn(|| device.run_clock());
        if let Err(e) = started {
            log::error!("loopback device {name}: no RNR clock thread: {e}");
        }
        devices.insert(name.to_string(), device);
        device
    }

    /// Its connection manager: the guests' addresses, their ids and listeners.
    pub fn connection_manager(&self) -> &cm::ConnectionManager {
        &self.cm
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// The objects alive, by kind (`rdma resource show`'s names): what tests compare
    /// before and after to find leaks.
    pub fn resource_counts(&self) -> std::collections::BTreeMap<String, u64> {
        let state = self.state();
        let counts = [
            ("ctx", state.contexts.len()),
            ("pd", state.pds),
            ("cq", state.cqs),
            ("qp", state.qps.len()),
            ("mr", state.mrs.len()),
            ("srq", state.srqs.len()),
            ("ah", state.ahs.len()),
            ("cm_id", self.cm.id_count()),
        ];
        counts
            .into_iter()
            .map(|(kind, count)| (kind.to_string(), count as u64))
            .collect()
    }

    /// Retries waiting sends, and fails those whose RNR retries ran out, at their deadlines
    /// and at least every 10 ms while any waits (a peer's state may change meanwhile).
    fn run_clock(&self) {
        let mut state = self.state();
        loop {
            let now = Instant::now();
            state.resume_waiting_at(now);
            let wait = match state.waiting.is_empty() {
                true => Duration::from_secs(3600),
                false => state
                    .next_deadline()
                    .map_or(Duration::from_millis(10), |at| {
                        at.saturating_duration_since(now)
                            .min(Duration::from_millis(10))
                    }),
            };
            state = self
                .clock
                .wait_timeout(state, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// The RNR timer an encoded `min_rnr_timer` stands for (InfiniBand's table).
fn rnr_timer(code: u8) -> Duration {
    const MICROS: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(MICROS[usize::from(code & 31)])
}

/// The transport timeout an encoded `timeout` stands for: 4.096 us times 2^timeout; none
/// for 0, which InfiniBand defines as waiting for ever.
fn transport_timeout(code: u8) -> Option<Duration> {
    (code != 0).then(|| Duration::from_nanos(4096 << u32::from(code.min(31))))
}

/// Hashes the numbers the device hands out (QP numbers, keys, handles): one multiply, where
/// the default hasher's keyed hashing protects tables from keys chosen against them.
#[derive(Default)]
struct NumberHasher(u64);

impl std::hash::Hasher for NumberHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, number: u32) {
        self.0 = u64::from(number).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// The device's objects of one kind, by number.
type Table<V> = HashMap<u32, V, std::hash::BuildHasherDefault<NumberHasher>>;

#[derive(Default)]
struct State {
    /// The asynchronous events of every context alive.
    contexts: Vec<Arc<EventQueue<AsyncEvent>>>,
    /// PDs and CQs alive (the objects that have no table here).
    pds: usize,
    cqs: usize,
    next_id: u32,
    next_qpn: u32,
    next_key: u32,
    mrs: Table<Mr>,
    qps: Table<Qp>,
    srqs: Table<Srq>,
    ahs: Table<Ah>,
    /// QPs with sends waiting for a receive, oldest first.
    waiting: Vec<u32>,
}

struct Mr {
    pd: u32,
    memory: Arc<dyn PinnedMemory>,
    /// Where the region starts in `memory`.
    offset: usize,
    len: u64,
    iova: u64,
    access: u32,
}

struct Qp {
    pd: u32,
    qp_type: QpType,
    caps: QpCaps,
    send_cq: Arc<Cq>,
    recv_cq: Arc<Cq>,
    srq: Option<u32>,
    sq_sig_all: bool,
    attr: QpAttr,
    rq: VecDeque<Recv>,
    /// Sends not carried out yet: the first waits for a receive at its destination.
    waiting: VecDeque<Request<'static>>,
    /// The first waiting send's retries (none while nothing waits).
    retries: Option<Retries>,
}

impl Qp {
    fn apply(&mut self, a: &QpAttr, m: u32) {
        let t = &mut self.attr;
        let set = |bit: u32| m & bit != 0;
        if set(mask::STATE) {
            t.qp_state = a.qp_state;
        }
        if set(mask::ACCESS_FLAGS) {
            t.qp_access_flags = a.qp_access_flags;
        }
        if set(mask::PKEY_INDEX) {
            t.pkey_index = a.pkey_index;
        }
        if set(mask::PORT) {
            t.port_num = a.port_num;
        }
        if set(mask::QKEY) {
            t.qkey = a.qkey;
        }
        if set(mask::AV) {
            t.ah_attr = a.ah_attr;
        }
        if set(mask::PATH_MTU) {
            t.path_mtu = a.path_mtu;
        }
        if set(mask::TIMEOUT) {
            t.timeout = a.timeout;
        }
        if set(mask::RETRY_CNT) {
            t.retry_cnt = a.retry_cnt;
        }
        if set(mask::RNR_RETRY) {
            t.rnr_retry = a.rnr_retry;
        }
        if set(mask::RQ_PSN) {
            t.rq_psn = a.rq_psn;
        }
        if set(mask::SQ_PSN) {
            t.sq_psn = a.sq_psn;
        }
        if set(mask::MAX_QP_RD_ATOMIC) {
            t.max_rd_atomic = a.max_rd_atomic;
        }
        if set(mask::MAX_DEST_RD_ATOMIC) {
            t.max_dest_rd_atomic = a.max_dest_rd_atomic;
        }
        if set(mask::MIN_RNR_TIMER) {
            t.min_rnr_timer = a.min_rnr_timer;
        }
        if set(mask::DEST_QPN) {
            t.dest_qp_num = a.dest_qp_num;
        }
    }

    fn receiving(&self) -> bool {
        matches!(self.attr.qp_state, QpState::Rtr | QpState::Rts)
    }
}

struct Srq {
    pd: u32,
    max_wr: u32,
    max_sge: u32,
    queue: VecDeque<Recv>,
}

struct Ah {
    pd: u32,
    dgid: Gid,
}

struct Recv {
    wr_id: u64,
    sges: RecvSges,
}

impl Recv {
    fn new(wr: &RecvWr<'_>) -> Recv {
        let sges = match wr.sges {
            [sge] => RecvSges::One(*sge),
            sges => RecvSges::Many(sges.into()),
        };
        Recv {
            wr_id: wr.wr_id,
            sges,
        }
    }
}

/// A receive's SGEs: most receives have one, kept without an allocation.
enum RecvSges {
    One(Sge),
    Many(Box<[Sge]>),
}

impl std::ops::Deref for RecvSges {
    type Target = [Sge];
    fn deref(&self) -> &[Sge] {
        match self {
            RecvSges::One(sge) => std::slice::from_ref(sge),
            RecvSges::Many(sges) => sges,
        }
    }
}

/// A send request as the device keeps it: borrowed from the batch while it is carried out
/// at once, owned when it waits.
struct Request<'a> {
    wr_id: u64,
    opcode: SendOpcode,
    signaled: bool,
    solicited: bool,
    operands: SendOperands,
    payload: OwnedOrBorrowed<'a>,
    /// UD: the AH, the destination QP and its Q_Key.
    ud: Option<(u32, u32, u32)>,
}

enum OwnedOrBorrowed<'a> {
    Sges(std::borrow::Cow<'a, [Sge]>),
    Inline(std::borrow::Cow<'a, [u8]>),
}

impl<'a> Request<'a> {
    fn from_batch(r: &SendWr<'a>) -> Self {
        Request {
            wr_id: r.wr_id,
            opcode: r.opcode,
            signaled: r.signaled,
            solicited: r.solicited,
            operands: r.operands,
            payload: match r.payload {
                Payload::Sges(s) => OwnedOrBorrowed::Sges(s.into()),
                Payload::Inline(d) => OwnedOrBorrowed::Inline(d.into()),
            },
            ud: r.ud.as_ref().and_then(|ud| {
                Some((
                    u32::try_from(ud.ah.handle()).ok()?,
                    ud.remote_qpn,
                    ud.remote_qkey,
                ))
            }),
        }
    }

    fn into_owned(self) -> Request<'static> {
        Request {
            payload: match self.payload {
                OwnedOrBorrowed::Sges(s) => OwnedOrBorrowed::Sges(s.into_owned().into()),
                OwnedOrBorrowed::Inline(d) => OwnedOrBorrowed::Inline(d.into_owned().into()),
            },
            ..self
        }
    }

    fn signaled(&self, qp: &Qp) -> bool {
        qp.sq_sig_all || self.signaled
    }
}

impl State {
    fn new_id(&mut self) -> u32 {
        self.next_id = self.next_id.wrapping_add(1).max(1);
        self.next_id
    }

    fn new_key(&mut self) -> u32 {
        loop {
            self.next_key = self.next_key.wrapping_add(0x101).max(1);
            if !self.mrs.contains_key(&self.next_key) {
                return self.next_key;
            }
        }
    }

    fn new_qpn(&mut self) -> u32 {
        loop {
            // QP numbers are 24 bits; 0 and 1 are the special QPs.
            self.next_qpn = (self.next_qpn + 1) & 0xff_ffff;
            if self.next_qpn >= 0x11 && !self.qps.contains_key(&self.next_qpn) {
                return self.next_qpn;
            }
        }
    }
}
