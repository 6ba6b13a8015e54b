//! What the device advertises to a guest: the host device's limits capped by per-guest quotas.

use vrdma_spec::codec::{
    recv_wqe_shift, send_wqe_shift, MAX_DOORBELL_BITS, MAX_SEND_INLINE, MAX_SEND_SGE,
};
use vrdma_spec::config::{features, DeviceConfig, MAX_NOTIFY_QUEUES};
use vrdma_spec::ring::CQE_SIZE;
use vrdma_spec::{Le32, Le64, SPEC_VERSION};

use crate::hostverbs::DeviceAttr;

/// What one guest connection may hold at once: objects of each kind, and bytes of rings and of
/// registered memory.
///
/// The defaults divide what one backend can give among 64 guests ([`Quotas::shared_by`]), so
/// that 64 guests at their quotas stay within the host's limits: the host provider maps two
/// queue buffers per QP and one per CQ or SRQ into the backend (`vm.max_map_count`, 65,530 by
/// default, bounds them all), and its queue buffers cost up to ten times the guest's ring
/// bytes on rxe (docs/operating.md: Quotas).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quotas {
    pub max_qp: u32,
    pub max_cq: u32,
    pub max_mr: u32,
    pub max_pd: u32,
    pub max_ah: u32,
    pub max_srq: u32,
    /// Largest single memory registration, in bytes.
    pub max_mr_size: u64,
    /// Bytes of work and completion queue rings (all CQs, QPs and SRQs together): the host
    /// provider's queues for them cost several times as much.
    pub max_ring_bytes: u64,
    /// Bytes registered by all MRs together (a page registered twice counts twice): the host
    /// pins them and keeps a page table per MR.
    pub max_registered_bytes: u64,
    /// vhost-user memory regions (guest RAM, or a direct-attach process's shared memory): the
    /// backend holds a file descriptor and a mapping for each.
    pub max_memory_regions: u32,
}

/// What one backend gives all its guests together, divided among them by [`Quotas::shared_by`].
const BACKEND_TOTAL: Quotas = Quotas {
    max_qp: 16 << 10,
    max_cq: 8 << 10,
    max_mr: 16 << 10,
    max_pd: 4 << 10,
    max_ah: 16 << 10,
    max_srq: 1 << 10,
    max_mr_size: 64 << 30,
    max_ring_bytes: 256 << 20,
    max_registered_bytes: 64 << 30,
    max_memory_regions: 16 << 10,
};

/// Memory regions one front end may have at most: the slots vhost-user-backend advertises
/// (GET_MAX_MEM_SLOTS).
pub const MAX_MEMORY_SLOTS: u32 = 509;

/// File descriptors a guest connection holds besides its memory regions, at most: its socket,
/// three eventfds per virtqueue (kick, call, error), the vring worker's epoll and exit
/// events, the host context's command, asynchronous-event and completion-channel files and
/// the data path's wake-up eventfd, with a margin.
pub fn descriptors_per_guest(notify_queues: u32, quotas: &Quotas) -> u64 {
    let queues = 2 + u64::from(notify_queues);
    16 + 3 * queues + u64::from(quotas.max_memory_regions)
}

/// Descriptors the backend holds whatever its guests: standard streams, the listening
/// socket, the poller pool's epolls and eventfds, libibverbs' files, logging, with a margin.
pub const DESCRIPTORS_OF_THE_BACKEND: u64 = 256;

/// Guests the default quotas are sized for.
pub const DEFAULT_GUESTS: u32 = 64;

impl Quotas {
    /// Each guest's share when `guests` guests share one backend (at least one of each).
    pub fn shared_by(guests: u32) -> Quotas {
        let guests = guests.max(1);
        let count = |total: u32| (total / guests).max(1);
        let bytes = |total: u64| (total / u64::from(guests)).max(1 << 20);
        let t = BACKEND_TOTAL;
        Quotas {
            max_qp: count(t.max_qp),
            max_cq: count(t.max_cq),
            max_mr: count(t.max_mr),
            max_pd: count(t.max_pd),
            max_ah: count(t.max_ah),
            max_srq: count(t.max_srq),
            max_mr_size: bytes(t.max_mr_size),
            max_ring_bytes: bytes(t.max_ring_bytes),
            max_registered_bytes: bytes(t.max_registered_bytes),
            max_memory_regions: count(t.max_memory_regions).min(MAX_MEMORY_SLOTS),
        }
    }
}

impl Default for Quotas {
    fn default() -> Self {
        Quotas::shared_by(DEFAULT_GUESTS)
    }
}

/// A CQ's host CQ has this many times the CQ's depth: completions wait there while the
/// guest's ring is full, and it must hold `depth` more (SPEC.md §7.5; asked for the depth,
/// rxe holds one less). The ring quota counts a CQ's ring this many times over, as the host
/// spends that much on it.
pub const HOST_CQ_DEPTHS: u32 = 2;

/// Bytes of the ring quota a CQ of `depth` takes.
pub fn cq_quota_bytes(depth: u32) -> u64 {
    u64::from(HOST_CQ_DEPTHS) * u64::from(depth) * CQE_SIZE as u64
}

/// Entries of `entry_bytes` (per depth) that half the guest's ring quota holds, as a depth
/// limit: a queue at an advertised depth takes at most half the quota, so a QP at `max_qp_wr`
/// fits beside a CQ at `max_cqe` (SPEC.md §3), and programs that create their queues at the
/// advertised depths get them.
fn depth_within_half_the_quota(quotas: &Quotas, entry_bytes: u64) -> u32 {
    u32::try_from(quotas.max_ring_bytes / 2 / entry_bytes).unwrap_or(u32::MAX)
}

/// The send and receive slots the advertised depths are for: one SGE and no inline data, the
/// smallest WQEs programs post (SPEC.md §3). A NIC's depth limits, too, are for its smallest
/// WQEs; queues of larger slots at those depths take more ring bytes, and the quota decides.
pub fn one_sge_slots() -> (u64, u64) {
    let slot = |shift: Option<u8>| 1u64 << shift.expect("one SGE fits the smallest slots");
    (slot(send_wqe_shift(1, 0)), slot(recv_wqe_shift(1)))
}

/// Page sizes the device maps: 4 KiB and 2 MiB (huge pages) and 1 GiB.
const PAGE_SIZE_CAP: u64 = (1 << 12) | (1 << 21) | (1 << 30);

/// The configuration space a guest sees, given the host device and the quotas.
pub fn advertised_config(
    host: &DeviceAttr,
    quotas: &Quotas,
    num_notify_queues: u32,
) -> DeviceConfig {
    let max_sge = host.max_sge.min(MAX_SEND_SGE);
    let max_inline = host.max_inline_data.min(MAX_SEND_INLINE);
    let (send_slot, recv_slot) = one_sge_slots();
    DeviceConfig {
        version: Le32::from(SPEC_VERSION),
        num_notify_queues: Le32::from(num_notify_queues.clamp(1, MAX_NOTIFY_QUEUES)),
        // Every QP and SRQ has a 16-bit doorbell bit (SPEC.md §8.5); SRQs take theirs first.
        max_qp: Le32::from(
            host.max_qp.min(quotas.max_qp).min(
                MAX_DOORBELL_BITS - host.max_srq.min(quotas.max_srq).min(MAX_DOORBELL_BITS / 2),
            ),
        ),
        max_qp_wr: Le32::from(prev_power_of_two(
            host.max_qp_wr
                .min(depth_within_half_the_quota(quotas, send_slot + recv_slot)),
        )),
        max_sge: Le32::from(max_sge),
        max_cq: Le32::from(host.max_cq.min(quotas.max_cq)),
        max_cqe: Le32::from(prev_power_of_two(
            (host.max_cqe / HOST_CQ_DEPTHS)
                .min(depth_within_half_the_quota(quotas, cq_quota_bytes(1))),
        )),
        max_mr: Le32::from(host.max_mr.min(quotas.max_mr)),
        max_pd: Le32::from(host.max_pd.min(quotas.max_pd)),
        max_ah: Le32::from(host.max_ah.min(quotas.max_ah)),
        max_srq: Le32::from(host.max_srq.min(quotas.max_srq).min(MAX_DOORBELL_BITS / 2)),
        max_srq_wr: Le32::from(prev_power_of_two(
            host.max_srq_wr
                .min(depth_within_half_the_quota(quotas, recv_slot)),
        )),
        max_inline_data: Le32::from(max_inline),
        max_qp_rd_atom: Le32::from(host.max_qp_rd_atom),
        max_qp_init_rd_atom: Le32::from(host.max_qp_init_rd_atom),
        phys_port_cnt: Le32::from(1),
        max_mr_size: Le64::from(
            host.max_mr_size
                .min(quotas.max_mr_size)
                .min(quotas.max_registered_bytes),
        ),
        page_size_cap: Le64::from(PAGE_SIZE_CAP),
        max_memory_regions: Le32::from(quotas.max_memory_regions.min(MAX_MEMORY_SLOTS)),
        reserved: Default::default(),
    }
}

/// The configuration space as (name, value) pairs, in layout order, for people to read.
pub fn describe(config: &DeviceConfig) -> [(&'static str, u64); 19] {
    let c = config;
    [
        ("version", c.version.to_native().into()),
        ("num_notify_queues", c.num_notify_queues.to_native().into()),
        ("max_qp", c.max_qp.to_native().into()),
        ("max_qp_wr", c.max_qp_wr.to_native().into()),
        ("max_sge", c.max_sge.to_native().into()),
        ("max_cq", c.max_cq.to_native().into()),
        ("max_cqe", c.max_cqe.to_native().into()),
        ("max_mr", c.max_mr.to_native().into()),
        ("max_pd", c.max_pd.to_native().into()),
        ("max_ah", c.max_ah.to_native().into()),
        ("max_srq", c.max_srq.to_native().into()),
        ("max_srq_wr", c.max_srq_wr.to_native().into()),
        ("max_inline_data", c.max_inline_data.to_native().into()),
        ("max_qp_rd_atom", c.max_qp_rd_atom.to_native().into()),
        (
            "max_qp_init_rd_atom",
            c.max_qp_init_rd_atom.to_native().into(),
        ),
        ("phys_port_cnt", c.phys_port_cnt.to_native().into()),
        ("max_mr_size", c.max_mr_size.to_native()),
        ("page_size_cap", c.page_size_cap.to_native()),
        (
            "max_memory_regions",
            c.max_memory_regions.to_native().into(),
        ),
    ]
}

/// The device feature bits offered for a host device.
pub fn offered_features(host: &DeviceAttr) -> u64 {
    let mut bits = features::VERSION_1
        | features::RC
        | features::UD
        | features::UC
        | features::INDIRECT_PAGE_LIST
        | features::DOORBELL_AREAS
        | features::RESET_COMMAND
        | features::RESIZE_CQ;
    if host.max_srq > 0 {
        bits |= features::SRQ;
    }
    if host.atomic_cap != 0 {
        bits |= features::ATOMIC;
    }
    bits
}

/// Queue depths are powers of two in the spec; a host limit that is not one rounds down.
fn prev_power_of_two(value: u32) -> u32 {
    if value == 0 {
        0
    } else {
        1 << (31 - value.leading_zeros())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_spec::codec::send_slot_bytes;
    use vrdma_spec::ring::MAX_WQE_SHIFT;

    fn rxe_like() -> DeviceAttr {
        DeviceAttr {
            max_qp: 1 << 17,
            max_qp_wr: 1 << 20,
            max_sge: 32,
            max_cq: 1 << 16,
            max_cqe: (1 << 15) - 1,
            max_mr: 1 << 18,
            max_pd: 1 << 16,
            max_ah: 1 << 15,
            max_srq: 1 << 16,
            max_srq_wr: 1 << 20,
            max_mr_size: u64::MAX,
            atomic_cap: 1,
            max_inline_data: 4096,
            ..Default::default()
        }
    }

    #[test]
    fn quotas_divide_the_backend_among_its_guests() {
        let one = Quotas::shared_by(1);
        let default = Quotas::default();
        assert_eq!(default, Quotas::shared_by(DEFAULT_GUESTS));
        assert_eq!(one.max_qp, 64 * default.max_qp);
        assert_eq!(one.max_registered_bytes, 64 * default.max_registered_bytes);
        // Two QP queue buffers and one per CQ and SRQ are mapped into the backend: 64 guests
        // at their quotas leave room under the default vm.max_map_count (65,530) for the
        // guest-page mappings' budget (a quarter) and everything else.
        let mapped = 2 * default.max_qp + default.max_cq + default.max_srq;
        assert!(DEFAULT_GUESTS * mapped + 65_530 / 4 < 60_000);
        // Never less than one object or 1 MiB, however many guests.
        let many = Quotas::shared_by(u32::MAX);
        assert_eq!((many.max_qp, many.max_ring_bytes), (1, 1 << 20));
        let unshared = Quotas::shared_by(0);
        assert_eq!(unshared, one);
        // A registration never exceeds what a guest may register in all.
        let quotas = Quotas {
            max_registered_bytes: 1 << 30,
            ..default
        };
        let config = advertised_config(&rxe_like(), &quotas, 1);
        assert_eq!(config.max_mr_size.to_native(), 1 << 30);
    }

    #[test]
    fn quotas_cap_host_limits() {
        let quotas = Quotas {
            max_qp: 8,
            max_mr_size: 1 << 20,
            ..Default::default()
        };
        let config = advertised_config(&rxe_like(), &quotas, 4);
        assert_eq!(config.max_qp.to_native(), 8);
        assert_eq!(config.max_mr_size.to_native(), 1 << 20);
        assert_eq!(config.max_pd.to_native(), Quotas::default().max_pd);
        assert_eq!(config.num_notify_queues.to_native(), 4);
        // The memory regions a front end may add before its connection ends (SPEC.md §3).
        assert_eq!(
            config.max_memory_regions.to_native(),
            Quotas::default().max_memory_regions
        );
        let many_regions = Quotas {
            max_memory_regions: 100_000,
            ..Default::default()
        };
        let config = advertised_config(&rxe_like(), &many_regions, 1);
        assert_eq!(config.max_memory_regions.to_native(), MAX_MEMORY_SLOTS);
    }

    #[test]
    fn host_limits_below_quotas_are_kept_and_depths_are_powers_of_two() {
        let mut host = rxe_like();
        host.max_qp = 3;
        let config = advertised_config(&host, &Quotas::default(), 1);
        assert_eq!(config.max_qp.to_native(), 3);
        assert_eq!(
            config.max_cqe.to_native(),
            1 << 13,
            "half the host's, rounded down"
        );
        assert!(config.max_srq_wr.to_native().is_power_of_two());
    }

    #[test]
    fn a_queue_at_an_advertised_depth_fits_the_ring_quota_beside_a_cq_at_max_cqe() {
        let (send_slot, recv_slot) = one_sge_slots();
        assert_eq!((send_slot, recv_slot), (128, 32));
        for guests in [1, DEFAULT_GUESTS, 1 << 20] {
            let quotas = Quotas::shared_by(guests);
            let c = advertised_config(&rxe_like(), &quotas, 1);
            let qp = u64::from(c.max_qp_wr.to_native()) * (send_slot + recv_slot);
            let srq = u64::from(c.max_srq_wr.to_native()) * recv_slot;
            let cq = cq_quota_bytes(c.max_cqe.to_native());
            for (what, bytes) in [("QP", qp), ("SRQ", srq), ("CQ", cq)] {
                assert!(
                    bytes <= quotas.max_ring_bytes / 2,
                    "{guests} guests: {what} {bytes}"
                );
                // Where the quota, not the host, is the bound: as deep as half of it holds.
                if guests == DEFAULT_GUESTS && what != "CQ" {
                    assert!(bytes > quotas.max_ring_bytes / 4, "{what}: {bytes}");
                }
            }
            assert!(qp + cq <= quotas.max_ring_bytes, "{guests} guests");
        }
    }

    #[test]
    fn the_default_quotas_offer_the_queue_depths_ucx_asks_for() {
        // UCX's UD transport asks for a receive queue of 4,096 entries (one SGE each) and
        // its RC transport for an SRQ of 4,095; Open MPI's UCX layer fails MPI_Init
        // without them.
        let c = advertised_config(&rxe_like(), &Quotas::default(), 1);
        assert!(
            c.max_qp_wr.to_native() >= 4096,
            "{}",
            c.max_qp_wr.to_native()
        );
        assert!(c.max_srq_wr.to_native() >= 4096);
        assert!(c.max_cqe.to_native() >= 4096);
    }

    #[test]
    fn notify_queue_count_is_clamped_to_the_spec_range() {
        assert_eq!(
            advertised_config(&rxe_like(), &Quotas::default(), 0)
                .num_notify_queues
                .to_native(),
            1
        );
        assert_eq!(
            advertised_config(&rxe_like(), &Quotas::default(), 1000)
                .num_notify_queues
                .to_native(),
            MAX_NOTIFY_QUEUES
        );
    }

    #[test]
    fn features_follow_host_capabilities() {
        let mut host = rxe_like();
        assert_ne!(offered_features(&host) & features::ATOMIC, 0);
        host.atomic_cap = 0;
        host.max_srq = 0;
        let bits = offered_features(&host);
        assert_eq!(bits & (features::ATOMIC | features::SRQ), 0);
        assert_ne!(bits & features::VERSION_1, 0);
    }

    #[test]
    fn the_largest_send_slot_holds_max_sge_or_max_inline() {
        let config = advertised_config(
            &DeviceAttr {
                max_sge: 1000,
                ..rxe_like()
            },
            &Quotas::default(),
            1,
        );
        let largest = 1 << MAX_WQE_SHIFT;
        assert_eq!(send_slot_bytes(config.max_sge.to_native(), 0), largest);
        assert_eq!(
            send_slot_bytes(0, config.max_inline_data.to_native()),
            largest
        );
    }

    #[test]
    fn every_qp_and_srq_a_guest_may_hold_has_a_doorbell_bit() {
        let huge = DeviceAttr {
            max_qp: 1 << 20,
            max_srq: 1 << 20,
            ..rxe_like()
        };
        let unlimited = Quotas {
            max_qp: u32::MAX,
            max_srq: u32::MAX,
            ..Quotas::default()
        };
        let config = advertised_config(&huge, &unlimited, 1);
        let (qps, srqs) = (config.max_qp.to_native(), config.max_srq.to_native());
        assert_eq!(qps + srqs, MAX_DOORBELL_BITS);
        // The whole backend's QPs and SRQs fit one guest's doorbell bits.
        let config = advertised_config(&huge, &Quotas::shared_by(1), 1);
        assert_eq!(
            (config.max_qp.to_native(), config.max_srq.to_native()),
            (16384, 1024)
        );
    }

    #[test]
    fn inline_data_is_what_the_host_grants_within_the_largest_slot() {
        let small = DeviceAttr {
            max_inline_data: 400,
            ..rxe_like()
        };
        let config = advertised_config(&small, &Quotas::default(), 1);
        assert_eq!(config.max_inline_data.to_native(), 400);
        let config = advertised_config(&rxe_like(), &Quotas::default(), 1);
        assert_eq!(config.max_inline_data.to_native(), MAX_SEND_INLINE);
    }

    #[test]
    fn prev_power_of_two_rounds_down() {
        assert_eq!(prev_power_of_two(0), 0);
        assert_eq!(prev_power_of_two(1), 1);
        assert_eq!(prev_power_of_two(32767), 16384);
        assert_eq!(prev_power_of_two(u32::MAX), 1 << 31);
    }
}
