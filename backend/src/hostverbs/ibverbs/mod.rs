//! The libibverbs host: the seam's traits over libibverbs and librdmacm (`rdma-sys`), the
//! only module that calls them. Each object owns its pointer and frees it in `Drop`; the
//! wrappers above keep the objects it was made from alive until then (see [`super::seam`]).

pub mod cm;
mod cq;
mod memory;
mod qp;

use std::ffi::CStr;
use std::io;
use std::os::fd::RawFd;
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use rdma_sys::*;

use super::seam::{
    HostAh, HostChannel, HostContext, HostCq, HostMr, HostPd, HostSrq, NewQp, QpQueues,
    Registration,
};
use super::{
    AhAttr, AsyncEvent, DeviceAttr, Error, Gid, GidType, PinnedMemory, PortAttr, QpInit, Result,
};

/// Error from a call that reports failure through errno (NULL or -1 returns).
fn last_error(call: &'static str) -> Error {
    Error::Verbs {
        call,
        source: io::Error::last_os_error(),
    }
}

/// Error from a call that returns a positive errno (0 on success).
fn check(call: &'static str, ret: c_int) -> Result<()> {
    match ret {
        0 => Ok(()),
        // Some providers return -1 and set errno instead.
        r if r < 0 => Err(last_error(call)),
        r => Err(Error::Verbs {
            call,
            source: io::Error::from_raw_os_error(r),
        }),
    }
}

fn set_nonblocking(fd: RawFd, what: &'static str) -> Result<()> {
    // SAFETY: fcntl on a descriptor the caller's verbs object owns, integer arguments only.
    let ok = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
    };
    match ok {
        true => Ok(()),
        false => Err(Error::Verbs {
            call: what,
            source: io::Error::last_os_error(),
        }),
    }
}

/// libibverbs objects may be used from any thread (the library serialises internally).
macro_rules! verbs_object_is_thread_safe {
    ($($ty:ty),+) => {
        $(
            // SAFETY: libibverbs documents all verbs on an object as thread safe; the value
            // owns the pointer exclusively and only frees it in Drop.
            unsafe impl Send for $ty {}
            // SAFETY: shared references only issue verbs, which libibverbs documents as
            // thread safe on one object.
            unsafe impl Sync for $ty {}
        )+
    };
}
use verbs_object_is_thread_safe;

/// libibverbs' name for a work completion status (`ibv_wc_status_str`: "remote access error",
/// ...), as rdma-core's tools print it.
pub fn wc_status_name(status: u8) -> String {
    // SAFETY: ibv_wc_status_str returns a static string for any value (one that names no
    // status gets "unknown").
    let name = unsafe { CStr::from_ptr(ibv_wc_status_str(ibv_wc_status::Type::from(status))) };
    name.to_string_lossy().into_owned()
}

extern "C" {
    // Exported by libibverbs behind the static inline ibv_query_gid_ex(); rdma-sys's allowlist
    // does not bind names with a leading underscore.
    fn _ibv_query_gid_ex(
        context: *mut ibv_context,
        port_num: u32,
        gid_index: u32,
        entry: *mut ibv_gid_entry,
        flags: u32,
        entry_size: usize,
    ) -> c_int;
    // Declared over `RawAsyncEvent`, whose event type is a plain integer: rdma-sys's Rust enum
    // would be undefined behaviour for a value a newer provider might report.
    fn ibv_get_async_event(context: *mut ibv_context, event: *mut RawAsyncEvent) -> c_int;
    fn ibv_ack_async_event(event: *mut RawAsyncEvent);
}

/// `struct ibv_async_event`: the element union (a pointer or a port number), then the type.
#[repr(C)]
struct RawAsyncEvent {
    element: usize,
    event_type: u32,
}

impl RawAsyncEvent {
    /// # Safety
    /// The event was filled by ibv_get_async_event and is not acknowledged yet, so the object
    /// its element points at is alive.
    unsafe fn event(&self) -> AsyncEvent {
        use ibv_event_type::*;
        let is = |t: ibv_event_type| self.event_type == t as u32;
        if is(IBV_EVENT_QP_FATAL) || is(IBV_EVENT_QP_REQ_ERR) || is(IBV_EVENT_QP_ACCESS_ERR) {
            // SAFETY: for QP events the element is the live QP (see the function's contract).
            AsyncEvent::QpFailed(unsafe { (*(self.element as *const ibv_qp)).qp_num })
        } else if is(IBV_EVENT_CQ_ERR) {
            AsyncEvent::CqError(self.element)
        } else if is(IBV_EVENT_SRQ_LIMIT_REACHED) {
            AsyncEvent::SrqLimitReached(self.element)
        } else if is(IBV_EVENT_PORT_ACTIVE) || is(IBV_EVENT_PORT_ERR) {
            // The element is a C int port number, in the union's low bytes.
            #[expect(clippy::cast_possible_truncation, reason = "masked to its low byte")]
            let port = (self.element & 0xff) as u8;
            if is(IBV_EVENT_PORT_ACTIVE) {
                AsyncEvent::PortActive(port)
            } else {
                AsyncEvent::PortError(port)
            }
        } else if is(IBV_EVENT_DEVICE_FATAL) {
            AsyncEvent::DeviceFatal
        } else {
            AsyncEvent::Other(self.event_type)
        }
    }
}

/// An open libibverbs device.
pub struct Context {
    raw: NonNull<ibv_context>,
    name: String,
}

verbs_object_is_thread_safe!(Context);

impl Context {
    /// Opens the device called `name` (e.g. `rxe0`).
    pub fn open(name: &str) -> Result<Context> {
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-pointer; the list is freed before returning.
        let list = unsafe { ibv_get_device_list(&mut count) };
        if list.is_null() {
            let error = io::Error::last_os_error();
            // ENOSYS: no RDMA support in the kernel at all, which reads as "no devices".
            if error.raw_os_error() == Some(libc::ENOSYS) {
                return Err(Error::DeviceNotFound {
                    name: name.to_string(),
                    present: Vec::new(),
                });
            }
            return Err(Error::Verbs {
                call: "ibv_get_device_list",
                source: error,
            });
        }
        let mut present = Vec::new();
        let mut opened = None;
        // A negative count (none the library returns with a list) is no devices.
        for i in 0..usize::try_from(count).unwrap_or(0) {
            // SAFETY: `list` holds `count` valid device pointers until it is freed.
            let device = unsafe { *list.add(i) };
            // SAFETY: the device's name is a NUL-terminated string it owns.
            let device_name = unsafe { CStr::from_ptr(ibv_get_device_name(device)) }
                .to_string_lossy()
                .into_owned();
            if device_name == name {
                // SAFETY: `device` is valid; the context outlives the list by design.
                opened = Some(NonNull::new(unsafe { ibv_open_device(device) }));
            }
            present.push(device_name);
        }
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ibv_free_device_list(list) };
        match opened {
            None => Err(Error::DeviceNotFound {
                name: name.to_string(),
                present,
            }),
            Some(None) => Err(last_error("ibv_open_device")),
            Some(Some(raw)) => {
                let context = Context {
                    raw,
                    name: name.to_string(),
                };
                set_nonblocking(
                    context.async_fd(),
                    "fcntl(O_NONBLOCK) on the async event fd",
                )?;
                Ok(context)
            }
        }
    }

    fn query_gid_entry(&self, port: u8, index: u32) -> Result<ibv_gid_entry> {
        // SAFETY: all-zero is a valid ibv_gid_entry (integers and a byte union).
        let mut entry: ibv_gid_entry = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open; `entry` is a valid out-pointer of the size passed.
        check("ibv_query_gid_ex", unsafe {
            _ibv_query_gid_ex(
                self.raw.as_ptr(),
                port.into(),
                index,
                &mut entry,
                0,
                std::mem::size_of::<ibv_gid_entry>(),
            )
        })?;
        Ok(entry)
    }

    /// The most inline data the provider grants an RC QP: no verb reports it, so it is found
    /// by creating QPs that ask for less and less (once per device and process).
    fn max_inline_data(&self) -> Result<u32> {
        static FOUND: Mutex<Vec<(String, u32)>> = Mutex::new(Vec::new());
        let found = |name: &str| {
            FOUND
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .find(|(n, _)| n == name)
                .map(|&(_, inline)| inline)
        };
        if let Some(inline) = found(&self.name) {
            return Ok(inline);
        }
        let pd = self.alloc_pd()?;
        let cq = self.create_cq(1, None)?;
        let mut granted = 0;
        for asked in [4096, 2048, 1024, 512, 256, 128, 64, 32] {
            let on_cq = QpQueues {
                send_cq: &*cq,
                recv_cq: &*cq,
                srq: None,
            };
            if let Ok((qp, caps)) = pd.create_qp(on_cq, &QpInit::smallest_rc(asked)) {
                granted = caps.max_inline_data;
                drop(qp);
                break;
            }
        }
        FOUND
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((self.name.clone(), granted));
        Ok(granted)
    }
}

impl HostContext for Context {
    fn async_fd(&self) -> RawFd {
        // SAFETY: the context is open; async_fd is set when it is opened.
        unsafe { (*self.raw.as_ptr()).async_fd }
    }

    fn take_async_event(&self, route: &mut dyn FnMut(AsyncEvent)) -> bool {
        let mut raw = RawAsyncEvent {
            element: 0,
            event_type: 0,
        };
        // SAFETY: the context is open and `raw` has ibv_async_event's layout.
        if unsafe { ibv_get_async_event(self.raw.as_ptr(), &mut raw) } != 0 {
            return false;
        }
        // SAFETY: `raw` was just filled and is not acknowledged yet.
        route(unsafe { raw.event() });
        // SAFETY: each event is acknowledged exactly once, after its last use.
        unsafe { ibv_ack_async_event(&mut raw) };
        true
    }

    fn query_device(&self) -> Result<DeviceAttr> {
        let max_inline_data = self.max_inline_data()?;
        // SAFETY: all-zero is a valid ibv_device_attr (integers and byte arrays).
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid out-pointer.
        check("ibv_query_device", unsafe {
            ibv_query_device(self.raw.as_ptr(), &mut attr)
        })?;
        // SAFETY: fw_ver is a NUL-terminated string inside the struct.
        let fw_ver = unsafe { CStr::from_ptr(attr.fw_ver.as_ptr()) };
        let clamp = |v: c_int| u32::try_from(v).unwrap_or(0);
        Ok(DeviceAttr {
            fw_ver: fw_ver.to_string_lossy().into_owned(),
            node_guid: u64::from_be(attr.node_guid),
            sys_image_guid: u64::from_be(attr.sys_image_guid),
            max_mr_size: attr.max_mr_size,
            page_size_cap: attr.page_size_cap,
            vendor_id: attr.vendor_id,
            vendor_part_id: attr.vendor_part_id,
            hw_ver: attr.hw_ver,
            max_qp: clamp(attr.max_qp),
            max_qp_wr: clamp(attr.max_qp_wr),
            device_cap_flags: attr.device_cap_flags,
            max_sge: clamp(attr.max_sge),
            max_cq: clamp(attr.max_cq),
            max_cqe: clamp(attr.max_cqe),
            max_mr: clamp(attr.max_mr),
            max_pd: clamp(attr.max_pd),
            max_qp_rd_atom: clamp(attr.max_qp_rd_atom),
            max_qp_init_rd_atom: clamp(attr.max_qp_init_rd_atom),
            max_ah: clamp(attr.max_ah),
            max_srq: clamp(attr.max_srq),
            max_srq_wr: clamp(attr.max_srq_wr),
            max_srq_sge: clamp(attr.max_srq_sge),
            atomic_cap: attr.atomic_cap,
            phys_port_cnt: attr.phys_port_cnt,
            max_inline_data,
        })
    }

    fn query_port(&self, port: u8) -> Result<PortAttr> {
        // SAFETY: all-zero is a valid ibv_port_attr (integers only).
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid, correctly sized out-pointer.
        check("ibv_query_port", unsafe {
            ___ibv_query_port(self.raw.as_ptr(), port, &mut attr)
        })?;
        Ok(PortAttr {
            state: attr.state,
            max_mtu: attr.max_mtu,
            active_mtu: attr.active_mtu,
            gid_tbl_len: u32::try_from(attr.gid_tbl_len).unwrap_or(0),
            port_cap_flags: attr.port_cap_flags,
            max_msg_sz: attr.max_msg_sz,
            pkey_tbl_len: attr.pkey_tbl_len,
            lid: attr.lid,
            active_width: attr.active_width,
            active_speed: attr.active_speed,
            phys_state: attr.phys_state,
            link_layer: attr.link_layer,
        })
    }

    fn query_gid(&self, port: u8, index: u32) -> Result<(Gid, GidType)> {
        let entry = self.query_gid_entry(port, index)?;
        let gid_type = match entry.gid_type {
            IBV_GID_TYPE_ROCE_V1 => GidType::RoceV1,
            IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
            _ => GidType::Ib,
        };
        // SAFETY: every bit pattern of the union is a valid byte array.
        Ok((Gid(unsafe { entry.gid.raw }), gid_type))
    }

    fn netdev_index(&self, port: u8) -> Result<Option<u32>> {
        let index = self.query_gid_entry(port, 0)?.ndev_ifindex;
        Ok((index != 0).then_some(index))
    }

    fn alloc_pd(&self) -> Result<Box<dyn HostPd>> {
        // SAFETY: the context is open.
        let raw = NonNull::new(unsafe { ibv_alloc_pd(self.raw.as_ptr()) })
            .ok_or_else(|| last_error("ibv_alloc_pd"))?;
        Ok(Box::new(Pd { raw }))
    }

    fn create_cq(&self, depth: u32, channel: Option<&dyn HostChannel>) -> Result<Box<dyn HostCq>> {
        cq::create(self.raw, depth, channel)
    }

    fn create_comp_channel(&self) -> Result<Box<dyn HostChannel>> {
        cq::create_channel(self.raw)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object made on the context was dropped before it (see the seam).
        let ret = unsafe { ibv_close_device(self.raw.as_ptr()) };
        if ret != 0 {
            log::error!("ibv_close_device({}) failed: {ret}", self.name);
        }
    }
}

/// A libibverbs protection domain.
struct Pd {
    raw: NonNull<ibv_pd>,
}

verbs_object_is_thread_safe!(Pd);

impl HostPd for Pd {
    fn pins_pages(&self) -> bool {
        true
    }

    fn reg_mr(&self, memory: &Arc<dyn PinnedMemory>, at: Registration) -> Result<Box<dyn HostMr>> {
        memory::register(self.raw, &**memory, at)
    }

    fn reg_mr_pinned(
        &self,
        memory: &dyn PinnedMemory,
        at: Registration,
    ) -> Result<Box<dyn HostMr>> {
        memory::register(self.raw, memory, at)
    }

    fn create_qp(&self, queues: QpQueues<'_>, init: &QpInit<'_>) -> Result<NewQp> {
        qp::create_qp(self.raw, queues, init)
    }

    fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Box<dyn HostSrq>> {
        qp::create_srq(self.raw, max_wr, max_sge)
    }

    fn create_ah(&self, attr: &AhAttr) -> Result<Box<dyn HostAh>> {
        qp::create_ah(self.raw, attr)
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: MRs, QPs, SRQs and AHs of the PD were dropped before it (see the seam).
        let ret = unsafe { ibv_dealloc_pd(self.raw.as_ptr()) };
        if ret != 0 {
            log::error!("ibv_dealloc_pd failed: {ret}");
        }
    }
}
