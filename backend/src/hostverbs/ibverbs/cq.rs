//! libibverbs completion queues and their event channels.

use std::any::Any;
use std::io;
use std::os::fd::RawFd;
use std::os::raw::c_int;
use std::ptr::NonNull;

use rdma_sys::*;

use super::{check, last_error, set_nonblocking, verbs_object_is_thread_safe};
use crate::hostverbs::seam::{HostChannel, HostCq};
use crate::hostverbs::{Error, ObjectId, Result, WorkCompletion};

pub(super) fn create(
    context: NonNull<ibv_context>,
    depth: u32,
    channel: Option<&dyn HostChannel>,
) -> Result<Box<dyn HostCq>> {
    let cqe = c_int::try_from(depth)
        .map_err(|_| Error::InvalidArgument(format!("CQ depth {depth} too large")))?;
    let channel = match channel {
        None => std::ptr::null_mut(),
        Some(channel) => match channel.as_any().downcast_ref::<Channel>() {
            Some(channel) => channel.raw.as_ptr(),
            None => return Err(Error::other_host("ibv_create_cq")),
        },
    };
    // SAFETY: the context (and the channel, if any) are alive and outlive the CQ (see the
    // seam); no user context is passed.
    let raw = NonNull::new(unsafe {
        ibv_create_cq(context.as_ptr(), cqe, std::ptr::null_mut(), channel, 0)
    })
    .ok_or_else(|| last_error("ibv_create_cq"))?;
    Ok(Box::new(Cq { raw }))
}

pub(super) fn create_channel(context: NonNull<ibv_context>) -> Result<Box<dyn HostChannel>> {
    // SAFETY: the context is open.
    let raw = NonNull::new(unsafe { ibv_create_comp_channel(context.as_ptr()) })
        .ok_or_else(|| last_error("ibv_create_comp_channel"))?;
    let channel = Channel { raw };
    set_nonblocking(channel.fd(), "fcntl(O_NONBLOCK) on a completion channel")?;
    Ok(Box::new(channel))
}

/// A libibverbs completion channel.
pub(super) struct Channel {
    raw: NonNull<ibv_comp_channel>,
}

verbs_object_is_thread_safe!(Channel);

impl HostChannel for Channel {
    fn fd(&self) -> RawFd {
        // SAFETY: the channel is alive; fd is set at creation.
        unsafe { (*self.raw.as_ptr()).fd }
    }

    fn drain(&self) -> usize {
        let mut count = 0;
        loop {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut context: *mut std::os::raw::c_void = std::ptr::null_mut();
            // SAFETY: the channel is alive and non-blocking; both out-pointers are valid.
            if unsafe { ibv_get_cq_event(self.raw.as_ptr(), &mut cq, &mut context) } != 0 {
                return count;
            }
            // SAFETY: `cq` was just returned by the channel, and CQs attached to it are
            // dropped before it (see the seam), so the CQ is alive; each event is
            // acknowledged once.
            unsafe { ibv_ack_cq_events(cq, 1) };
            count += 1;
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: CQs attached to the channel were dropped before it (see the seam).
        if unsafe { ibv_destroy_comp_channel(self.raw.as_ptr()) } != 0 {
            log::error!("ibv_destroy_comp_channel failed");
        }
    }
}

/// A libibverbs completion queue.
pub(super) struct Cq {
    pub(super) raw: NonNull<ibv_cq>,
}

verbs_object_is_thread_safe!(Cq);

impl HostCq for Cq {
    fn id(&self) -> ObjectId {
        self.raw.as_ptr() as ObjectId
    }

    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let max = c_int::try_from(out.len()).unwrap_or(c_int::MAX);
        // SAFETY: the CQ is alive; `out` has room for `max` ibv_wc (WorkCompletion is a
        // transparent wrapper).
        let n = unsafe { ibv_poll_cq(self.raw.as_ptr(), max, out.as_mut_ptr().cast()) };
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

    fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: the CQ is alive.
        check("ibv_req_notify_cq", unsafe {
            ibv_req_notify_cq(self.raw.as_ptr(), solicited_only.into())
        })
    }

    fn resize(&self, depth: u32) -> Result<()> {
        let cqe = c_int::try_from(depth).map_err(|_| Error::Verbs {
            call: "ibv_resize_cq",
            source: io::Error::from_raw_os_error(libc::EINVAL),
        })?;
        // SAFETY: the CQ is alive; libibverbs serialises a resize with polls of the CQ.
        check("ibv_resize_cq", unsafe {
            ibv_resize_cq(self.raw.as_ptr(), cqe)
        })
    }

    fn depth(&self) -> u32 {
        // SAFETY: the CQ is alive; `cqe` is set at creation and only changed by resize.
        u32::try_from(unsafe { (*self.raw.as_ptr()).cqe }).unwrap_or(0)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: QPs over the CQ were dropped before it (see the seam).
        let ret = unsafe { ibv_destroy_cq(self.raw.as_ptr()) };
        if ret != 0 {
            log::error!("ibv_destroy_cq failed: {ret}");
        }
    }
}
