//! Guest RAM for the fuzz targets that need it backed by a file, as a VM's is (page lists
//! resolve to the file's offsets, registrations map them).

use std::sync::Arc;

use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap};

/// Regions `(guest address, length)` of one unlinked temporary file, in order.
pub fn file_backed(regions: &[(u64, usize)]) -> GuestMemoryMmap {
    let path = std::env::temp_dir().join(format!("vrdma-fuzz-{}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("a file for guest memory");
    std::fs::remove_file(&path).expect("unlink the guest memory file");
    let total: usize = regions.iter().map(|&(_, len)| len).sum();
    file.set_len(total as u64)
        .expect("size the guest memory file");
    let file = Arc::new(file);
    let mut offset = 0;
    let ranges: Vec<_> = regions
        .iter()
        .map(|&(gpa, len)| {
            let at = offset;
            offset += len as u64;
            (
                GuestAddress(gpa),
                len,
                Some(FileOffset::from_arc(Arc::clone(&file), at)),
            )
        })
        .collect();
    GuestMemoryMmap::from_ranges_with_files(&ranges).expect("guest memory")
}
