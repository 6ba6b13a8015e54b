//! The RC QPs of all the guests of one backend, and which QP each is connected to.
//!
//! A backend's guests send from one GID (several only when the operator declares them one
//! trust domain, `--shared-gid`), and an RC QP takes a packet from its peer's address with the
//! PSN it expects: a guest could connect a QP of its own to another guest's QP and, guessing
//! its PSNs, inject into that guest's connection. So a QP may connect (MODIFY_QP with a
//! destination on the backend's own GID) to another guest's QP only if that QP is not yet
//! connected or is connected back to it; and when a QP connects, another guest's QP that was
//! connected to it beforehand is moved to the error state (SPEC.md §5.11).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::refusal::Refusal;
use crate::hostverbs::{qp_attr_mask, QpAttr, QpState, QueuePair};

/// See the module.
#[derive(Default)]
pub struct LocalPeers {
    next_connection: AtomicU64,
    qps: Mutex<HashMap<u32, LocalQp>>,
}

struct LocalQp {
    connection: u64,
    /// The QP number it was connected to, on the backend's GID.
    peer: Option<u32>,
    /// Gone when its guest destroyed it or went away: then the entry no longer counts.
    qp: Weak<QueuePair>,
}

impl LocalPeers {
    /// A new connection's identity among the backend's guests.
    pub fn new_connection(&self) -> u64 {
        self.next_connection.fetch_add(1, Ordering::Relaxed)
    }

    /// `connection` created the RC QP `qp`.
    pub fn created(&self, connection: u64, qp: &Arc<QueuePair>) {
        let local = LocalQp {
            connection,
            peer: None,
            qp: Arc::downgrade(qp),
        };
        self.lock().insert(qp.qp_num(), local);
    }

    /// The QP numbered `qp_num` was destroyed.
    pub fn destroyed(&self, qp_num: u32) {
        self.lock().remove(&qp_num);
    }

    /// `connection`'s QP `qp_num` is about to connect to QP `dest` on the backend's GID:
    /// refused if `dest` is another guest's QP connected elsewhere. Otherwise recorded, and
    /// another guest's QP that was connected to `qp_num` (other than `dest`) is failed.
    pub fn connect(&self, connection: u64, qp_num: u32, dest: u32) -> Result<(), Refusal> {
        let mut qps = self.lock();
        qps.retain(|_, local| local.qp.strong_count() > 0);
        if let Some(target) = qps.get(&dest) {
            if target.connection != connection && target.peer.is_some_and(|p| p != qp_num) {
                return Err(Refusal::ConnectedElsewhere(dest));
            }
        }
        for (&number, other) in qps.iter() {
            let waiting = other.connection != connection && other.peer == Some(qp_num);
            if waiting && number != dest {
                if let Some(qp) = other.qp.upgrade() {
                    log::warn!(
                        "QP {number:#x} of another guest was connected to QP {qp_num:#x}, which now connects to {dest:#x}: moving it to the error state"
                    );
                    let error = QpAttr {
                        qp_state: QpState::Err,
                        ..Default::default()
                    };
                    let _ = qp.modify(&error, qp_attr_mask::STATE);
                }
            }
        }
        if let Some(local) = qps.get_mut(&qp_num) {
            local.peer = Some(dest);
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, LocalQp>> {
        self.qps.lock().unwrap_or_else(|e| e.into_inner())
    }
}
