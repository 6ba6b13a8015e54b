//! Guest memory descriptions: page lists (SPEC.md §6).

use crate::{wire_struct, Le16, Le32, Le64};

/// Entries in one page of a page list: a list page is 4 KiB of `le64` guest-physical addresses.
pub const PAGE_LIST_ENTRIES_PER_PAGE: u32 = 512;
/// Size of one list page, in bytes.
pub const PAGE_LIST_PAGE_SIZE: u64 = 4096;
/// Most pages a [`PageListForm::Direct`] list may name.
pub const MAX_DIRECT_PAGES: u32 = PAGE_LIST_ENTRIES_PER_PAGE;
/// Most pages an [`PageListForm::Indirect`] list may name (512 list pages of 512 entries).
pub const MAX_INDIRECT_PAGES: u32 = PAGE_LIST_ENTRIES_PER_PAGE * PAGE_LIST_ENTRIES_PER_PAGE;
/// Smallest and largest accepted `page_shift`.
pub const MIN_PAGE_SHIFT: u8 = 12;
pub const MAX_PAGE_SHIFT: u8 = 30;

/// How [`PageList::addr`] is to be read (SPEC.md §6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum PageListForm {
    /// `addr` is the GPA of `npages` consecutive `le64` page addresses.
    Direct = 0,
    /// `addr` is the GPA of `ceil(npages / 512)` consecutive `le64` addresses of list pages,
    /// each holding up to 512 page addresses.
    Indirect = 1,
}

impl TryFrom<u8> for PageListForm {
    type Error = u8;
    fn try_from(value: u8) -> Result<Self, u8> {
        match value {
            0 => Ok(Self::Direct),
            1 => Ok(Self::Indirect),
            other => Err(other),
        }
    }
}

/// A list of guest-physical pages, all of size `1 << page_shift` (SPEC.md §6).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageList {
    /// GPA of the list (direct) or of the list of list pages (indirect); 8-byte aligned.
    pub addr: Le64,
    /// Number of pages described.
    pub npages: Le32,
    /// log2 of the page size; a bit set in `page_size_cap`.
    pub page_shift: u8,
    /// A [`PageListForm`] value.
    pub form: u8,
    pub reserved: Le16,
}

wire_struct!(PageList = 16);
