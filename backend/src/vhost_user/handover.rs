//! Handing a running guest's device from one front-end connection to the next on the same
//! socket (SPEC.md §11.1): how QEMU replaces itself under a running VM (a local migration or
//! live update) without the guest's RDMA objects noticing. The device never leaves the
//! backend: the old connection saves a token (`SET_DEVICE_STATE_FD`, direction save), the
//! front end carries it to its successor, which loads it, and the successor's connection takes
//! the device (its host objects, rings, doorbells and pending events) as they are.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::sync::{Arc, Mutex, RwLock, Weak};

use vrdma_spec::handover::SavedState;
use vrdma_spec::ByteValued;

use super::RdmaBackend;

pub type Token = [u8; 16];

/// The device states saved on one socket and not yet taken, by token: the connection whose
/// device each names.
#[derive(Default)]
pub struct Handovers {
    saved: Mutex<HashMap<Token, Weak<RwLock<RdmaBackend>>>>,
}

impl Handovers {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<Token, Weak<RwLock<RdmaBackend>>>> {
        self.saved.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Saves `connection`'s device under a fresh token, written to `file` as the state the
    /// front end carries; returns the token.
    pub fn save(
        &self,
        connection: Weak<RwLock<RdmaBackend>>,
        mut file: std::fs::File,
    ) -> io::Result<Token> {
        let mut token = Token::default();
        getrandom(&mut token)?;
        // 32 bytes into an empty pipe: written at once (the front end reads once we answer).
        file.write_all(SavedState::new(token).as_slice())?;
        let mut table = self.table();
        // States of connections that ended untaken go: the table holds live ones only.
        table.retain(|_, saved| saved.strong_count() > 0);
        table.insert(token, connection);
        Ok(token)
    }

    /// Forgets a saved state (its connection runs the device again, or ended).
    pub fn withdraw(&self, token: &Token) {
        self.table().remove(token);
    }

    /// The connection whose device the state read from `file` names, taken off the table:
    /// the front end wrote the state and closed its end before asking for the check.
    pub fn take(&self, mut file: std::fs::File) -> io::Result<Arc<RwLock<RdmaBackend>>> {
        let mut bytes = Vec::new();
        // One byte more than a state, so that a longer one is seen.
        (&mut file)
            .take(std::mem::size_of::<SavedState>() as u64 + 1)
            .read_to_end(&mut bytes)?;
        let token = SavedState::token_of(&bytes).ok_or_else(|| {
            io::Error::other(format!(
                "the device state loaded ({} bytes) is not one this backend saves",
                bytes.len()
            ))
        })?;
        self.table()
            .remove(&token)
            .and_then(|saved| saved.upgrade())
            .ok_or_else(|| {
                io::Error::other(
                    "the device state loaded names no device saved on this socket (taken already, run again by its front end, or its connection ended)",
                )
            })
    }
}

fn getrandom(buffer: &mut [u8]) -> io::Result<()> {
    let mut filled = 0;
    while filled < buffer.len() {
        let rest = &mut buffer[filled..];
        // SAFETY: writes at most `rest.len()` bytes into the borrowed slice.
        let got = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        match usize::try_from(got) {
            Ok(got) => filled += got,
            Err(_) => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}
