//! Completion channels. The device reports "CQ n has a completion" on its event queue; a
//! thread per context (started with the context's first channel) reads that queue and hands
//! each event to the channel of its CQ: a queue of ready CQs and a semaphore eventfd, which is
//! the channel's `fd`, so programs may poll it before `ibv_get_cq_event`.

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsRawFd;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_sys_util::eventfd::{EventFd, EFD_SEMAPHORE};
use vrdma_guest::{Device, DeviceEvent, Error};

/// How often the dispatcher looks up from the event queue to see whether to stop.
const WAKE_INTERVAL: Duration = Duration::from_millis(100);

/// The events of one completion channel.
pub(crate) struct Channel {
    /// One count per event, read one at a time (EFD_SEMAPHORE).
    pub(crate) fd: EventFd,
    /// The CQs (their `ibv_cq` addresses) with an event not yet taken, oldest first.
    ready: Mutex<VecDeque<usize>>,
}

impl Channel {
    pub(crate) fn new() -> std::io::Result<Arc<Channel>> {
        Ok(Arc::new(Channel {
            fd: EventFd::new(EFD_SEMAPHORE | libc::EFD_CLOEXEC)?,
            ready: Mutex::default(),
        }))
    }

    fn push(&self, cq: usize) {
        self.ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(cq);
        // Cannot fail short of 2^64 - 1 pending events.
        let _ = self.fd.write(1);
    }

    /// The next CQ with an event, blocking on the fd as the program set it (EAGAIN when
    /// non-blocking and there is none).
    pub(crate) fn take(&self) -> Result<usize, c_int> {
        loop {
            self.fd
                .read()
                .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
            // A count whose CQ was destroyed since has no entry: wait for the next one.
            let next = self
                .ready
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front();
            if let Some(cq) = next {
                return Ok(cq);
            }
        }
    }

    /// Drops the events of `cq`, which is being destroyed.
    fn forget(&self, cq: usize) {
        self.ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|&ready| ready != cq);
    }
}

/// Which channel each CQ (by device handle) reports to, and its `ibv_cq` address.
type Routes = Arc<Mutex<HashMap<u32, (usize, Arc<Channel>)>>>;

/// The thread that routes one context's completion events to channels.
pub(crate) struct Dispatcher {
    routes: Routes,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Dispatcher {
    pub(crate) fn start(device: Device) -> std::io::Result<Dispatcher> {
        let routes = Routes::default();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name("vrdma-cq-events".into())
            .spawn({
                let (routes, stop) = (Arc::clone(&routes), Arc::clone(&stop));
                move || route_events(&device, &routes, &stop)
            })?;
        Ok(Dispatcher {
            routes,
            stop,
            thread: Some(thread),
        })
    }

    /// Completion events of CQ `handle` (at `cq`) go to `channel` from now on.
    pub(crate) fn watch(&self, handle: u32, cq: usize, channel: Arc<Channel>) {
        self.routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(handle, (cq, channel));
    }

    /// CQ `handle` is being destroyed: no more events, and none left to take.
    pub(crate) fn forget(&self, handle: u32) {
        let removed = self
            .routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&handle);
        if let Some((cq, channel)) = removed {
            channel.forget(cq);
        }
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn route_events(device: &Device, routes: &Routes, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        match device.wait_event(WAKE_INTERVAL) {
            Ok(Some(DeviceEvent::CqCompletion(handle))) => {
                let route = routes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&handle)
                    .cloned();
                if let Some((cq, channel)) = route {
                    channel.push(cq);
                }
            }
            // Asynchronous events are not forwarded to programs yet.
            Ok(Some(other)) => log::debug!("device event not forwarded: {other:?}"),
            Ok(None) => {}
            Err(Error::DeviceReset) => return,
            Err(e) => {
                log::warn!("reading the device's events: {e}");
                std::thread::sleep(WAKE_INTERVAL);
            }
        }
    }
}

impl AsRawFd for Channel {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_channel_hands_out_its_cqs_in_order_and_skips_forgotten_ones() {
        let channel = Channel::new().unwrap();
        channel.push(0x10);
        channel.push(0x20);
        channel.push(0x10);
        channel.forget(0x10);
        assert_eq!(channel.take(), Ok(0x20));
        // The forgotten events' counts remain; a non-blocking take runs out cleanly.
        // SAFETY: only changes the flags of this test's own eventfd.
        unsafe {
            libc::fcntl(channel.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK);
        }
        assert_eq!(channel.take(), Err(libc::EAGAIN));
    }
}
