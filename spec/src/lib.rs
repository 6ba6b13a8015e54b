//! The vrdma wire format: every structure the guest driver and the device exchange, as
//! `#[repr(C)]` little-endian types. `SPEC.md` beside this crate is the normative text; each
//! type here names the section that defines it.
//!
//! All multi-byte fields are little-endian ([`Le16`], [`Le32`], [`Le64`]); byte arrays (GIDs,
//! immediate data) are in network order as on the wire. No type has implicit padding: every
//! size is asserted at compile time against the size the specification states.
//!
//! Beside the wire format, [`verbs`] is the one verbs vocabulary both sides speak (QP types,
//! states, attributes, address vectors, SGEs), with its wire forms.

// Integer casts that could truncate, lose a sign or wrap are proven or converted (tests,
// whose values are small constants, are exempt).
#![cfg_attr(
    not(test),
    deny(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_possible_wrap
    )
)]

pub mod address;
pub mod cm;
pub mod codec;
pub mod config;
pub mod ctrl;
pub mod handover;
pub mod mem;
pub mod ring;
pub mod service;
pub mod verbs;

pub use vm_memory::endian::{Le16, Le32, Le64};
pub use vm_memory::ByteValued;

/// Virtio device id of the vrdma device (SPEC.md §1).
pub const VIRTIO_ID_RDMA: u32 = 42;

/// Version of this specification; reported in the config space (SPEC.md §3).
pub const SPEC_VERSION: u32 = 2;

/// Copies a wire struct out of the start of `bytes`, which need not be aligned; `None` when
/// `bytes` is shorter than the struct.
pub fn read_wire<T: ByteValued + Default>(bytes: &[u8]) -> Option<T> {
    let mut value = T::default();
    let size = core::mem::size_of::<T>();
    value.as_mut_slice().copy_from_slice(bytes.get(..size)?);
    Some(value)
}

/// Implements [`ByteValued`] for wire structs and asserts their specified size.
macro_rules! wire_struct {
    ($($ty:ty = $size:expr),+ $(,)?) => {
        $(
            const _: () = assert!(::core::mem::size_of::<$ty>() == $size);
            // SAFETY: the type is `#[repr(C)]`, made only of integers, little-endian integer
            // wrappers and byte arrays (every bit pattern is valid), and the assertion above
            // pins its size to the sum of its fields, so it has no padding bytes.
            unsafe impl $crate::ByteValued for $ty {}
        )+
    };
}
pub(crate) use wire_struct;

/// A 128-bit GID, in network order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// True for the all-zero GID of an unused table entry.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`), as RoCEv2 uses for IPv4.
    pub fn ipv4(&self) -> Option<std::net::Ipv4Addr> {
        std::net::Ipv6Addr::from(self.0).to_ipv4_mapped()
    }
}

impl From<std::net::Ipv4Addr> for Gid {
    /// The IPv4-mapped GID RoCEv2 gives an IPv4 address.
    fn from(address: std::net::Ipv4Addr) -> Gid {
        Gid(address.to_ipv6_mapped().octets())
    }
}

impl core::fmt::Display for Gid {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        std::net::Ipv6Addr::from(self.0).fmt(f)
    }
}

impl core::fmt::Debug for Gid {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "Gid({self})")
    }
}
