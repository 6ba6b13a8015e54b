//! The device state a vhost-user front end carries from one connection to the next when it
//! hands a running guest's device to a new front end on the same backend (SPEC.md §11.1):
//! what `SET_DEVICE_STATE_FD` saves on the old connection and loads on the new one.

use crate::Le32;

/// First bytes of a saved device state.
pub const MAGIC: [u8; 8] = *b"vrdmaDS\0";
/// Layout version of [`SavedState`].
pub const VERSION: u32 = 1;

/// A saved device state (SPEC.md §11.1): 32 bytes. The device's objects stay in the backend;
/// the state names them by a token only the connection that saved them was told.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SavedState {
    /// [`MAGIC`].
    pub magic: [u8; 8],
    /// [`VERSION`].
    pub version: Le32,
    /// 0.
    pub reserved: Le32,
    /// Random, chosen by the backend when it saved the state.
    pub token: [u8; 16],
}

crate::wire_struct!(SavedState = 32);

impl SavedState {
    /// The state naming `token`.
    pub fn new(token: [u8; 16]) -> SavedState {
        SavedState {
            magic: MAGIC,
            version: VERSION.into(),
            reserved: 0.into(),
            token,
        }
    }

    /// The token of a saved state that is exactly `bytes`; `None` for anything else (another
    /// length, magic or version, reserved bytes set).
    pub fn token_of(bytes: &[u8]) -> Option<[u8; 16]> {
        if bytes.len() != core::mem::size_of::<SavedState>() {
            return None;
        }
        let state: SavedState = crate::read_wire(bytes)?;
        let valid = state.magic == MAGIC
            && state.version.to_native() == VERSION
            && state.reserved.to_native() == 0;
        valid.then_some(state.token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ByteValued;

    #[test]
    fn a_saved_state_reads_back_and_nothing_else_does() {
        let token = [7; 16];
        let saved = SavedState::new(token);
        assert_eq!(SavedState::token_of(saved.as_slice()), Some(token));
        assert_eq!(SavedState::token_of(&saved.as_slice()[..31]), None);
        let mut longer = saved.as_slice().to_vec();
        longer.push(0);
        assert_eq!(SavedState::token_of(&longer), None);
        for (offset, what) in [(0, "magic"), (8, "version"), (12, "reserved")] {
            let mut bad = saved.as_slice().to_vec();
            bad[offset] ^= 1;
            assert_eq!(SavedState::token_of(&bad), None, "{what}");
        }
    }
}
