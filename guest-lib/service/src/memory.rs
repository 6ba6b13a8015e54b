//! The memory one program shares with the device through the service: the memfds it passed,
//! mapped here, and where the device sees each of their pages.

use std::collections::BTreeMap;
use std::sync::Arc;

use vrdma_guest::shm::Region;

use crate::requests::ProgramMemory;

/// Pages the device sees back to back, in one of the program's regions.
struct Run {
    len: u64,
    region: Arc<Region>,
    /// Where the run starts in the region.
    offset: u64,
}

#[derive(Default)]
pub struct Regions {
    regions: Vec<Arc<Region>>,
    /// Runs by device address.
    runs: BTreeMap<u64, Run>,
    bytes: u64,
}

impl Regions {
    /// Adds a region the device reaches.
    pub fn add(&mut self, region: Arc<Region>) {
        for (device, offset, len) in region.device_runs() {
            self.runs.insert(
                device,
                Run {
                    len,
                    region: Arc::clone(&region),
                    offset,
                },
            );
        }
        self.bytes += region.size();
        self.regions.push(region);
    }

    /// Bytes of all the regions.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn count(&self) -> usize {
        self.regions.len()
    }

    /// Takes every region out, for the device to forget.
    pub fn take(&mut self) -> Vec<Arc<Region>> {
        self.runs.clear();
        self.bytes = 0;
        std::mem::take(&mut self.regions)
    }

    /// Walks `addr..addr + len` run by run, handing each piece (region, offset in it,
    /// length) to `visit`; false if some byte of it is not the program's.
    fn walk(&self, addr: u64, len: u64, mut visit: impl FnMut(&Region, u64, u64)) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        let mut at = addr;
        while at < end {
            let Some((&start, run)) = self.runs.range(..=at).next_back() else {
                return false;
            };
            if at >= start + run.len {
                return false;
            }
            let piece = (start + run.len).min(end) - at;
            visit(&run.region, run.offset + (at - start), piece);
            at += piece;
        }
        true
    }
}

impl ProgramMemory for Regions {
    fn owns(&self, addr: u64, len: u64) -> bool {
        self.walk(addr, len, |_, _, _| {})
    }

    fn read(&self, addr: u64, out: &mut [u8]) -> bool {
        let mut done = 0usize;
        let mut ok = true;
        let owned = self.walk(addr, out.len() as u64, |region, offset, len| {
            let piece = &mut out[done..done + len as usize];
            ok &= region.read(offset, piece).is_ok();
            done += len as usize;
        });
        owned && ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_the_programs_only_where_its_regions_are() {
        let make = |pages: Vec<u64>| {
            Arc::new(
                Region::create(pages.len() as u64 * 4096)
                    .unwrap()
                    .with_device_pages(pages)
                    .unwrap(),
            )
        };
        let mut regions = Regions::default();
        // Two pages the device sees back to back, then one elsewhere.
        let first = make(vec![0x10_0000, 0x10_1000, 0x50_0000]);
        let mut filled = vec![0u8; 3 * 4096];
        filled[4090..4100].copy_from_slice(b"0123456789");
        use std::os::unix::fs::FileExt;
        first.file().unwrap().write_all_at(&filled, 0).unwrap();
        regions.add(first);
        // A second region right after the first run, in device addresses.
        regions.add(make(vec![0x10_2000]));
        assert!(regions.owns(0x10_0000, 3 * 4096), "across regions");
        assert!(regions.owns(0x50_0000, 4096));
        assert!(!regions.owns(0x50_0000, 4097));
        assert!(!regions.owns(0x0f_f000, 8));
        assert!(!regions.owns(u64::MAX - 4, 8));
        let mut out = [0u8; 10];
        assert!(regions.read(0x10_0000 + 4090, &mut out), "across pages");
        assert_eq!(&out, b"0123456789");
        assert!(!regions.read(0x20_0000, &mut out));
        assert_eq!((regions.count(), regions.bytes()), (2, 4 * 4096));
        assert_eq!(regions.take().len(), 2);
        assert!(!regions.owns(0x10_0000, 8));
    }
}
