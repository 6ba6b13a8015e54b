//! Access to a shared buffer: its addresses, bounds-checked copies in and out, atomics in
//! place; and its return to its region.
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8};

use crate::{Error, Result};

use super::SharedBuffer;

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBuffer({:#x}+{:#x})", self.addr(), self.len)
    }
}

impl SharedBuffer {
    /// The buffer's address in this process: the guest-virtual address verbs speak of.
    pub fn addr(&self) -> u64 {
        self.region.addr() + self.offset
    }

    /// The device's (guest-physical) address of the buffer, for structures the device finds
    /// by one address: virtqueues, doorbell records, page-list pages.
    pub fn device_addr(&self) -> Result<u64> {
        self.region
            .device_range(self.offset, self.len)
            .ok_or(Error::NotContiguous {
                addr: self.addr(),
                len: self.len,
            })
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn ptr(&self, offset: u64, len: u64) -> Result<*mut u8> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {
                // SAFETY: offset + len is inside the buffer, which is inside the mapping.
                Ok(unsafe {
                    self.region
                        .base
                        .as_ptr()
                        .add((self.offset + offset) as usize)
                })
            }
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Copies `data` into the buffer at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        let dst = self.ptr(offset, data.len() as u64)?;
        // SAFETY: `dst` has room for `data` (checked) and cannot overlap it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` out of the buffer.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let src = self.ptr(offset, out.len() as u64)?;
        // SAFETY: as in `write`, in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    pub(super) fn zero(&self) {
        let dst = self.ptr(0, self.len).expect("whole buffer");
        // SAFETY: the whole buffer is writable.
        unsafe { std::ptr::write_bytes(dst, 0, self.len as usize) };
    }

    /// The byte at `offset` as an atomic shared with the device.
    pub fn atomic_u8(&self, offset: u64) -> Result<&AtomicU8> {
        let ptr = self.ptr(offset, 1)?;
        // SAFETY: in bounds and valid for as long as `self`; AtomicU8 has the layout of u8.
        Ok(unsafe { AtomicU8::from_ptr(ptr) })
    }

    /// The `u16` at `offset` (2-byte aligned) as an atomic shared with the device.
    pub fn atomic_u16(&self, offset: u64) -> Result<&AtomicU16> {
        let ptr = self.ptr(offset, 2)?;
        if !(ptr as usize).is_multiple_of(2) {
            return Err(Error::OutOfBounds {
                offset,
                len: 2,
                size: self.len,
            });
        }
        // SAFETY: aligned, in bounds, and valid for as long as `self` (which keeps the region
        // mapped); AtomicU16 has the layout of u16 and any bit pattern is valid.
        Ok(unsafe { AtomicU16::from_ptr(ptr.cast()) })
    }

    /// The `u32` at `offset` (4-byte aligned) as an atomic shared with the device.
    pub fn atomic_u32(&self, offset: u64) -> Result<&AtomicU32> {
        let ptr = self.ptr(offset, 4)?;
        if !(ptr as usize).is_multiple_of(4) {
            return Err(Error::OutOfBounds {
                offset,
                len: 4,
                size: self.len,
            });
        }
        // SAFETY: as in `atomic_u16`.
        Ok(unsafe { AtomicU32::from_ptr(ptr.cast()) })
    }

    pub fn atomic_u64(&self, offset: u64) -> Result<&AtomicU64> {
        let ptr = self.ptr(offset, 8)?;
        if !(ptr as usize).is_multiple_of(8) {
            return Err(Error::OutOfBounds {
                offset,
                len: 8,
                size: self.len,
            });
        }
        // SAFETY: as in `atomic_u16`.
        Ok(unsafe { AtomicU64::from_ptr(ptr.cast()) })
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        if !self.pooled {
            return;
        }
        self.region
            .heap
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .release(self.offset, self.len, self.align);
    }
}
