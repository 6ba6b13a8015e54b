//! Control requests as the backend reads them from the control queue: framing (SPEC.md §5.1)
//! and the validation of every command's fields that needs no host object. Handles are
//! checked against a connection's tables, which the `objects` unit tests cover.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vrdma_backend::device::{frame_request, validate, Refusal};
use vrdma_backend::hostverbs::{DeviceAttr, PortAttr, LINK_LAYER_ETHERNET};
use vrdma_backend::{limits, mtt, Quotas};
use vrdma_spec::config::{features, DeviceConfig};
use vrdma_spec::ctrl::{
    CreateAhRequest, CreateCqRequest, CreateQpRequest, CreateSrqRequest, ModifyQpRequest,
    ModifySrqRequest, Opcode, RegMrRequest, SetNotifyAreaRequest, Status,
};
use vrdma_spec::read_wire;
use vrdma_spec::ring::{CqDoorbell, NotifyState, QpDoorbell};

struct Fixture {
    config: DeviceConfig,
    port: PortAttr,
    mem: GuestMemoryMmap,
}

/// A device as rxe offers it, and 2 MiB of guest memory in two regions with a hole.
fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let host = DeviceAttr {
            max_mr_size: u64::MAX,
            page_size_cap: 0xffff_f000,
            max_qp: 1 << 16,
            max_qp_wr: 1 << 20,
            max_sge: 32,
            max_cq: 1 << 16,
            max_cqe: 1 << 20,
            max_mr: 1 << 16,
            max_pd: 1 << 16,
            max_qp_rd_atom: 128,
            max_qp_init_rd_atom: 128,
            max_ah: 1 << 16,
            max_srq: 1 << 16,
            max_srq_wr: 1 << 20,
            max_srq_sge: 27,
            atomic_cap: 1,
            phys_port_cnt: 1,
            max_inline_data: 4032,
            ..Default::default()
        };
        let port = PortAttr {
            active_mtu: 3,
            max_mtu: 5,
            gid_tbl_len: 1024,
            pkey_tbl_len: 1,
            link_layer: LINK_LAYER_ETHERNET,
            ..Default::default()
        };
        let mem = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 1 << 20),
            (GuestAddress(4 << 20), 1 << 20),
        ])
        .expect("guest memory");
        Fixture {
            config: limits::advertised_config(&host, &Quotas::default(), 4),
            port,
            mem,
        }
    })
}

fuzz_target!(|input: &[u8]| {
    let [room, negotiated, readable @ ..] = input else {
        return;
    };
    let room = usize::from(*room) * 2;
    let negotiated = u64::from(*negotiated)
        & (features::RC | features::UD | features::SRQ | features::ATOMIC)
        | features::INDIRECT_PAGE_LIST;
    let Some((opcode, payload)) = checked(frame_request(readable, room)) else {
        return;
    };
    assert_eq!(payload.len(), opcode.request_size());
    assert!(room >= opcode.response_size());
    let f = fixture();
    let config = &f.config;
    let record = |gpa: u64, size: usize| {
        checked(validate::guest_range(&f.mem, gpa, size as u64));
    };
    match opcode {
        Opcode::CreateCq => {
            let req: CreateCqRequest = read_wire(payload).unwrap();
            checked(validate::depth(
                "CQ depth",
                req.cqe.to_native(),
                2,
                config.max_cqe.to_native(),
            ));
            let doorbell = req.doorbell.to_native();
            checked(validate::guest_record::<_, CqDoorbell>(
                &f.mem,
                "CQ doorbell",
                doorbell,
                16,
            ));
        }
        Opcode::RegMr => {
            let req: RegMrRequest = read_wire(payload).unwrap();
            checked(validate::mr_access(req.access.to_native(), negotiated));
            let offset = req.virt_addr.to_native() % (1 << 12);
            let _ = mtt::pages_needed(offset, req.length.to_native(), req.pages.page_shift);
        }
        Opcode::CreateQp => {
            let req: CreateQpRequest = read_wire(payload).unwrap();
            if checked(validate::create_qp(&req, config, negotiated)).is_some() {
                let doorbell = req.doorbell.to_native();
                checked(validate::guest_record::<_, QpDoorbell>(
                    &f.mem,
                    "QP doorbell",
                    doorbell,
                    16,
                ));
            }
        }
        Opcode::ModifyQp => {
            let req: ModifyQpRequest = read_wire(payload).unwrap();
            let limits = validate::QpLimits {
                port: f.port,
                host_gid_index: 1,
                max_rd_atomic: config.max_qp_init_rd_atom.to_native(),
                max_dest_rd_atomic: config.max_qp_rd_atom.to_native(),
                atomics: negotiated & features::ATOMIC != 0,
            };
            if let Some((attr, _)) = checked(validate::modify_qp(&req, &limits)) {
                assert!(attr.ah_attr.sgid_index == 1 || attr.ah_attr.sgid_index == 0);
            }
        }
        Opcode::CreateAh => {
            let req: CreateAhRequest = read_wire(payload).unwrap();
            if let Some(attr) = checked(validate::ah_attr(&req.attr, &f.port, 1)) {
                assert_eq!(attr.sgid_index, 1, "only the guest's own GID");
            }
        }
        Opcode::CreateSrq => {
            let req: CreateSrqRequest = read_wire(payload).unwrap();
            if let Some((max_wr, max_sge)) = checked(validate::create_srq(&req, config)) {
                assert!(max_wr <= config.max_srq_wr.to_native());
                assert!(max_sge <= config.max_sge.to_native());
            }
        }
        Opcode::ModifySrq => {
            let req: ModifySrqRequest = read_wire(payload).unwrap();
            if let Some(limit) = checked(validate::modify_srq(&req, 64)) {
                assert!(limit < 64);
            }
        }
        Opcode::SetNotifyArea => {
            let req: SetNotifyAreaRequest = read_wire(payload).unwrap();
            let area = req.addr.to_native();
            checked(validate::guest_record::<_, NotifyState>(
                &f.mem,
                "notify area",
                area,
                64,
            ));
            record(req.doorbell_bitmap.to_native(), 8192);
        }
        // The rest carry handles only, or nothing.
        _ => {}
    }
});

/// A refusal names a status other than OK, a rule and a reason.
fn checked<T>(result: Result<T, Refusal>) -> Option<T> {
    result
        .map_err(|refusal| {
            assert_ne!(refusal.status(), Status::Ok, "{refusal:?}");
            assert!(!refusal.rule().is_empty() && !refusal.to_string().is_empty());
        })
        .ok()
}
