//! What a program's control request asks of the device, read before the service forwards it:
//! the objects it names (which the program must own), the memory it names (which must be the
//! program's), and what it creates or destroys. Pure over the request bytes and the program's
//! memory, so every rule is unit-tested.

use std::mem::{offset_of, size_of};

use vrdma_spec::ctrl::{
    CreateAhRequest, CreateCqRequest, CreateQpRequest, CreateSrqRequest, HandleRequest,
    ModifyQpRequest, ModifySrqRequest, Opcode, RegMrRequest, RequestHeader, ResizeCqRequest,
    Status,
};
use vrdma_spec::mem::{
    PageList, PageListForm, MAX_DIRECT_PAGES, MAX_INDIRECT_PAGES, MAX_PAGE_SHIFT, MIN_PAGE_SHIFT,
    PAGE_LIST_ENTRIES_PER_PAGE, PAGE_LIST_PAGE_SIZE,
};
use vrdma_spec::read_wire;
use vrdma_spec::ring::{CqDoorbell, QpDoorbell, SrqDoorbell};

const HEADER: usize = size_of::<RequestHeader>();

/// The kinds of device objects (SPEC.md §5.3.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ObjectKind {
    // In the order a program's objects are destroyed when it goes: users before what they use
    // (a CM id names its QP in its messages; destroying it first disconnects the peer).
    CmId,
    Qp,
    Srq,
    Ah,
    Mr,
    Cq,
    Pd,
}

impl ObjectKind {
    pub const ALL: [ObjectKind; 7] = [
        ObjectKind::CmId,
        ObjectKind::Qp,
        ObjectKind::Srq,
        ObjectKind::Ah,
        ObjectKind::Mr,
        ObjectKind::Cq,
        ObjectKind::Pd,
    ];

    /// The command that destroys an object of this kind.
    pub fn destroy_opcode(self) -> Opcode {
        match self {
            ObjectKind::CmId => Opcode::CmDestroyId,
            ObjectKind::Qp => Opcode::DestroyQp,
            ObjectKind::Srq => Opcode::DestroySrq,
            ObjectKind::Ah => Opcode::DestroyAh,
            ObjectKind::Mr => Opcode::DeregMr,
            ObjectKind::Cq => Opcode::DestroyCq,
            ObjectKind::Pd => Opcode::DeallocPd,
        }
    }
}

/// A program's memory as the device sees it.
pub trait ProgramMemory {
    /// Whether `addr..addr + len` of device memory is all the program's.
    fn owns(&self, addr: u64, len: u64) -> bool;
    /// Copies the program's device memory at `addr` out; false if it is not all the program's.
    fn read(&self, addr: u64, out: &mut [u8]) -> bool;
}

/// A control request, read.
#[derive(Debug, PartialEq, Eq)]
pub struct Plan {
    pub opcode: Opcode,
    /// The request as forwarded: header and payload, nothing past `length`.
    pub bytes: Vec<u8>,
    /// Objects the request names; the program must own each.
    pub names: Vec<(ObjectKind, u32)>,
    /// Byte offsets (in `bytes`) of the page lists it carries.
    pub page_lists: Vec<usize>,
    /// Byte offsets (in `bytes`) of the `le64` device addresses of records it names, with the
    /// record's size: the program must own the record.
    pub records: Vec<(usize, u64)>,
    /// The kind of object a successful request creates (its handle leads the response).
    pub creates: Option<ObjectKind>,
    /// The object a successful request destroys.
    pub destroys: Option<(ObjectKind, u32)>,
    /// An object the device made for the program and names in a successful response, at this
    /// byte offset of the response payload (0 when none): the CM id of a connection request
    /// that CM_GET_EVENT hands out.
    pub adopts: Option<(ObjectKind, usize)>,
    /// Byte offset (in `bytes`) of the `le32` doorbell area a CREATE_QP or CREATE_SRQ names
    /// (SPEC.md §8.6), which the service sets to the program's own; the program leaves it 0.
    pub doorbell_area: Option<usize>,
}

fn le32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(
        bytes[at..at + 4]
            .try_into()
            .expect("inside the checked length"),
    )
}

/// Why a request is refused before it reaches the device.
pub type Refusal = (Status, &'static str);

/// Reads `request`, refusing with the status the device would give for its framing, or
/// INVALID_ARGUMENT for what is the service's alone: SET_NOTIFY_AREA, the doorbell area
/// commands, and naming a doorbell area.
pub fn plan(request: &[u8]) -> Result<Plan, Refusal> {
    let framing = (Status::BadLength, "a request framed wrongly");
    let header: RequestHeader = read_wire(request).ok_or(framing)?;
    let opcode = Opcode::try_from(header.opcode.to_native())
        .map_err(|_| (Status::Unsupported, "an unknown opcode"))?;
    let length = header.length.to_native() as usize;
    if length != opcode.request_size() || request.len() < HEADER + length {
        return Err(framing);
    }
    let bytes = request[..HEADER + length].to_vec();
    let field = |offset: usize| HEADER + offset;
    let handle_at = |offset: usize| le32_at(&bytes, field(offset));
    let mut plan = Plan {
        opcode,
        bytes: Vec::new(),
        names: Vec::new(),
        page_lists: Vec::new(),
        records: Vec::new(),
        creates: None,
        destroys: None,
        adopts: None,
        doorbell_area: None,
    };
    let handle = || handle_at(offset_of!(HandleRequest, handle));
    match opcode {
        Opcode::QueryDevice | Opcode::QueryPort | Opcode::QueryGid => {}
        Opcode::SetNotifyArea => {
            return Err((
                Status::InvalidArgument,
                "SET_NOTIFY_AREA: the service set the device's up for every program",
            ))
        }
        // Every CM request names its id first (SPEC.md §13.3), CONNECT and ACCEPT a QP too.
        Opcode::CmCreateId => plan.creates = Some(ObjectKind::CmId),
        Opcode::CmDestroyId => {
            plan.names.push((ObjectKind::CmId, handle()));
            plan.destroys = Some((ObjectKind::CmId, handle()));
        }
        Opcode::CmConnect | Opcode::CmAccept => {
            plan.names.push((ObjectKind::CmId, handle()));
            plan.names.push((
                ObjectKind::Qp,
                handle_at(offset_of!(vrdma_spec::cm::CmConnectRequest, qp)),
            ));
        }
        Opcode::CmGetEvent => {
            plan.names.push((ObjectKind::CmId, handle()));
            plan.adopts = Some((
                ObjectKind::CmId,
                offset_of!(vrdma_spec::cm::CmEvent, new_id),
            ));
        }
        Opcode::CmBind
        | Opcode::CmResolveAddr
        | Opcode::CmResolveRoute
        | Opcode::CmListen
        | Opcode::CmReject
        | Opcode::CmDisconnect
        | Opcode::CmEstablish
        | Opcode::CmInitQpAttr
        | Opcode::CmQuery => plan.names.push((ObjectKind::CmId, handle())),
        Opcode::Reset => {
            return Err((
                Status::InvalidArgument,
                "RESET: the service's device is every program's; a program starts afresh by connecting again",
            ))
        }
        Opcode::AddDoorbellArea | Opcode::DestroyDoorbellArea => {
            return Err((
                Status::InvalidArgument,
                "doorbell areas: the service gives each program its own",
            ))
        }
        Opcode::AllocPd => plan.creates = Some(ObjectKind::Pd),
        Opcode::CreateCq => {
            plan.page_lists
                .push(field(offset_of!(CreateCqRequest, ring)));
            plan.records.push((
                field(offset_of!(CreateCqRequest, doorbell)),
                size_of::<CqDoorbell>() as u64,
            ));
            plan.creates = Some(ObjectKind::Cq);
        }
        Opcode::ResizeCq => {
            plan.names
                .push((ObjectKind::Cq, handle_at(offset_of!(ResizeCqRequest, cq))));
            plan.page_lists
                .push(field(offset_of!(ResizeCqRequest, ring)));
        }
        Opcode::RegMr => {
            plan.names
                .push((ObjectKind::Pd, handle_at(offset_of!(RegMrRequest, pd))));
            plan.page_lists.push(field(offset_of!(RegMrRequest, pages)));
            plan.creates = Some(ObjectKind::Mr);
        }
        Opcode::CreateQp => {
            plan.names.extend([
                (ObjectKind::Pd, handle_at(offset_of!(CreateQpRequest, pd))),
                (
                    ObjectKind::Cq,
                    handle_at(offset_of!(CreateQpRequest, send_cq)),
                ),
                (
                    ObjectKind::Cq,
                    handle_at(offset_of!(CreateQpRequest, recv_cq)),
                ),
            ]);
            let srq = handle_at(offset_of!(CreateQpRequest, srq));
            if srq != 0 {
                plan.names.push((ObjectKind::Srq, srq));
            }
            plan.page_lists.extend([
                field(offset_of!(CreateQpRequest, sq_ring)),
                field(offset_of!(CreateQpRequest, rq_ring)),
            ]);
            plan.records.push((
                field(offset_of!(CreateQpRequest, doorbell)),
                size_of::<QpDoorbell>() as u64,
            ));
            plan.doorbell_area = Some(field(offset_of!(CreateQpRequest, doorbell_area)));
            plan.creates = Some(ObjectKind::Qp);
        }
        Opcode::ModifyQp => plan.names.push((
            ObjectKind::Qp,
            handle_at(offset_of!(ModifyQpRequest, handle)),
        )),
        Opcode::QueryQp => plan.names.push((ObjectKind::Qp, handle())),
        Opcode::CreateAh => {
            plan.names
                .push((ObjectKind::Pd, handle_at(offset_of!(CreateAhRequest, pd))));
            plan.creates = Some(ObjectKind::Ah);
        }
        Opcode::CreateSrq => {
            plan.names
                .push((ObjectKind::Pd, handle_at(offset_of!(CreateSrqRequest, pd))));
            plan.page_lists
                .push(field(offset_of!(CreateSrqRequest, ring)));
            plan.records.push((
                field(offset_of!(CreateSrqRequest, doorbell)),
                size_of::<SrqDoorbell>() as u64,
            ));
            plan.doorbell_area = Some(field(offset_of!(CreateSrqRequest, doorbell_area)));
            plan.creates = Some(ObjectKind::Srq);
        }
        Opcode::ModifySrq => plan.names.push((
            ObjectKind::Srq,
            handle_at(offset_of!(ModifySrqRequest, handle)),
        )),
        Opcode::DeallocPd
        | Opcode::DestroyCq
        | Opcode::DeregMr
        | Opcode::DestroyQp
        | Opcode::DestroyAh
        | Opcode::DestroySrq => {
            let kind = ObjectKind::ALL
                .into_iter()
                .find(|kind| kind.destroy_opcode() == opcode)
                .expect("every destroy opcode has its kind");
            plan.names.push((kind, handle()));
            plan.destroys = Some((kind, handle()));
        }
    }
    if let Some(offset) = plan.doorbell_area {
        if le32_at(&bytes, offset) != 0 {
            return Err((
                Status::InvalidArgument,
                "a doorbell area named: the service gives each program its own",
            ));
        }
    }
    plan.bytes = bytes;
    Ok(plan)
}

/// The page list at `offset` of `bytes`.
pub fn page_list_at(bytes: &[u8], offset: usize) -> PageList {
    read_wire(&bytes[offset..]).expect("page list offsets lie inside the request")
}

/// The `le64` device address at `offset` of `bytes`.
pub fn address_at(bytes: &[u8], offset: usize) -> u64 {
    u64::from_le_bytes(
        bytes[offset..offset + 8]
            .try_into()
            .expect("record offsets lie inside the request"),
    )
}

/// The pages a program's page list names, each checked to be the program's memory: the
/// page size and each page's device address. The list itself (and, indirect, its list pages)
/// must be the program's memory too; each entry is read once, here, so the program changing
/// its list afterwards changes nothing the service checked. Refusals are the statuses the
/// device gives for such lists (SPEC.md §6), BAD_ADDRESS for memory not the program's.
pub fn read_page_list(
    memory: &dyn ProgramMemory,
    list: &PageList,
) -> Result<(u64, Vec<u64>), Status> {
    let npages = list.npages.to_native();
    let shift = list.page_shift;
    if !(MIN_PAGE_SHIFT..=MAX_PAGE_SHIFT).contains(&shift) {
        return Err(Status::InvalidArgument);
    }
    let page_size = 1u64 << shift;
    let form = PageListForm::try_from(list.form).map_err(|_| Status::InvalidArgument)?;
    let limit = match form {
        PageListForm::Direct => MAX_DIRECT_PAGES,
        PageListForm::Indirect => MAX_INDIRECT_PAGES,
    };
    if npages == 0 || npages > limit {
        return Err(Status::InvalidArgument);
    }
    let read_entries = |addr: u64, count: u32| -> Result<Vec<u64>, Status> {
        if !addr.is_multiple_of(8) {
            return Err(Status::BadAddress);
        }
        let mut raw = vec![0u8; count as usize * 8];
        if !memory.read(addr, &mut raw) {
            return Err(Status::BadAddress);
        }
        Ok(raw
            .chunks_exact(8)
            .map(|entry| u64::from_le_bytes(entry.try_into().expect("8 bytes")))
            .collect())
    };
    let addr = list.addr.to_native();
    let pages = match form {
        PageListForm::Direct => read_entries(addr, npages)?,
        PageListForm::Indirect => {
            let list_pages = npages.div_ceil(PAGE_LIST_ENTRIES_PER_PAGE);
            let mut pages = Vec::with_capacity(npages as usize);
            for (index, list_page) in read_entries(addr, list_pages)?.into_iter().enumerate() {
                if !list_page.is_multiple_of(PAGE_LIST_PAGE_SIZE) {
                    return Err(Status::BadAddress);
                }
                let left = npages - index as u32 * PAGE_LIST_ENTRIES_PER_PAGE;
                pages.extend(read_entries(
                    list_page,
                    left.min(PAGE_LIST_ENTRIES_PER_PAGE),
                )?);
            }
            pages
        }
    };
    for &page in &pages {
        if !page.is_multiple_of(page_size) || !memory.owns(page, page_size) {
            return Err(Status::BadAddress);
        }
    }
    Ok((page_size, pages))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_spec::ctrl::{HandleRequest, RequestHeader};
    use vrdma_spec::{ByteValued, Le16, Le32, Le64};

    fn request<T: ByteValued>(opcode: Opcode, payload: &T) -> Vec<u8> {
        let header = RequestHeader {
            opcode: Le16::from(opcode as u16),
            flags: Le16::from(0),
            length: Le32::from(size_of::<T>() as u32),
        };
        [header.as_slice(), payload.as_slice()].concat()
    }

    /// Device memory `start..end` is the program's, each byte holding its address's low byte
    /// unless written.
    struct Owned {
        start: u64,
        bytes: Vec<u8>,
    }

    impl Owned {
        fn new(start: u64, len: u64) -> Owned {
            Owned {
                start,
                bytes: vec![0; len as usize],
            }
        }
        fn put(&mut self, addr: u64, entries: &[u64]) {
            let at = (addr - self.start) as usize;
            for (i, entry) in entries.iter().enumerate() {
                self.bytes[at + 8 * i..at + 8 * i + 8].copy_from_slice(&entry.to_le_bytes());
            }
        }
    }

    impl ProgramMemory for Owned {
        fn owns(&self, addr: u64, len: u64) -> bool {
            addr >= self.start
                && addr
                    .checked_add(len)
                    .is_some_and(|end| end <= self.start + self.bytes.len() as u64)
        }
        fn read(&self, addr: u64, out: &mut [u8]) -> bool {
            if !self.owns(addr, out.len() as u64) {
                return false;
            }
            let at = (addr - self.start) as usize;
            out.copy_from_slice(&self.bytes[at..at + out.len()]);
            true
        }
    }

    fn list(addr: u64, npages: u32, form: PageListForm) -> PageList {
        PageList {
            addr: Le64::from(addr),
            npages: Le32::from(npages),
            page_shift: 12,
            form: form as u8,
            reserved: Le16::from(0),
        }
    }

    #[test]
    fn a_create_qp_names_its_pd_cqs_and_srq_rings_and_doorbell() {
        let create = CreateQpRequest {
            pd: Le32::from(1),
            send_cq: Le32::from(2),
            recv_cq: Le32::from(3),
            srq: Le32::from(4),
            ..Default::default()
        };
        let plan = plan(&request(Opcode::CreateQp, &create)).unwrap();
        assert_eq!(
            plan.names,
            vec![
                (ObjectKind::Pd, 1),
                (ObjectKind::Cq, 2),
                (ObjectKind::Cq, 3),
                (ObjectKind::Srq, 4)
            ]
        );
        assert_eq!(plan.page_lists.len(), 2);
        assert_eq!(plan.records, vec![(HEADER + 80, 16)]);
        assert_eq!(plan.creates, Some(ObjectKind::Qp));
        let without_srq = CreateQpRequest {
            srq: Le32::from(0),
            ..create
        };
        assert_eq!(
            super::plan(&request(Opcode::CreateQp, &without_srq))
                .unwrap()
                .names
                .len(),
            3,
            "srq 0 names none"
        );
    }

    #[test]
    fn a_resize_cq_names_its_cq_and_ring_and_creates_nothing() {
        let resize = ResizeCqRequest {
            cq: Le32::from(7),
            cqe: Le32::from(64),
            ..Default::default()
        };
        let plan = plan(&request(Opcode::ResizeCq, &resize)).unwrap();
        assert_eq!(plan.names, vec![(ObjectKind::Cq, 7)]);
        assert_eq!(plan.page_lists, vec![HEADER + 8]);
        assert_eq!((plan.creates, plan.destroys), (None, None));
    }

    /// The doorbell area of a QP or SRQ is the service's to choose (SPEC.md §12): a program
    /// leaves it 0, and the doorbell area commands are the service's alone.
    #[test]
    fn doorbell_areas_are_the_services_to_give() {
        let status = |request: &[u8]| plan(request).map(|_| ()).map_err(|(status, _)| status);
        let qp = CreateQpRequest::default();
        let srq = CreateSrqRequest::default();
        let qp_plan = plan(&request(Opcode::CreateQp, &qp)).unwrap();
        let srq_plan = plan(&request(Opcode::CreateSrq, &srq)).unwrap();
        assert_eq!(qp_plan.doorbell_area, Some(HEADER + 40));
        assert_eq!(srq_plan.doorbell_area, Some(HEADER + 20));
        let named = Le32::from(1);
        let qp = CreateQpRequest {
            doorbell_area: named,
            ..qp
        };
        let srq = CreateSrqRequest {
            doorbell_area: named,
            ..srq
        };
        assert_eq!(
            status(&request(Opcode::CreateQp, &qp)),
            Err(Status::InvalidArgument)
        );
        assert_eq!(
            status(&request(Opcode::CreateSrq, &srq)),
            Err(Status::InvalidArgument)
        );
        let add = vrdma_spec::ctrl::AddDoorbellAreaRequest::default();
        let destroy = HandleRequest::default();
        assert_eq!(
            status(&request(Opcode::AddDoorbellArea, &add)),
            Err(Status::InvalidArgument)
        );
        assert_eq!(
            status(&request(Opcode::DestroyDoorbellArea, &destroy)),
            Err(Status::InvalidArgument)
        );
    }

    #[test]
    fn connection_management_names_the_programs_ids_and_qps() {
        use vrdma_spec::cm::{CmConnectRequest, CmCreateIdRequest, CmEvent};
        let create = plan(&request(Opcode::CmCreateId, &CmCreateIdRequest::default())).unwrap();
        assert_eq!(create.creates, Some(ObjectKind::CmId));
        let connect = CmConnectRequest {
            id: Le32::from(5),
            qp: Le32::from(9),
            ..CmConnectRequest::default()
        };
        let connect = plan(&request(Opcode::CmAccept, &connect)).unwrap();
        assert_eq!(connect.names, [(ObjectKind::CmId, 5), (ObjectKind::Qp, 9)]);
        let handle = HandleRequest {
            handle: Le32::from(5),
            reserved: Le32::from(0),
        };
        let get = plan(&request(Opcode::CmGetEvent, &handle)).unwrap();
        assert_eq!(get.names, [(ObjectKind::CmId, 5)]);
        assert_eq!(
            get.adopts,
            Some((ObjectKind::CmId, std::mem::offset_of!(CmEvent, new_id)))
        );
        let destroy = plan(&request(Opcode::CmDestroyId, &handle)).unwrap();
        assert_eq!(destroy.destroys, Some((ObjectKind::CmId, 5)));
    }

    #[test]
    fn destroys_name_what_they_destroy() {
        let handle = HandleRequest {
            handle: Le32::from(9),
            reserved: Le32::from(0),
        };
        for kind in ObjectKind::ALL {
            let plan = plan(&request(kind.destroy_opcode(), &handle)).unwrap();
            assert_eq!(plan.names, vec![(kind, 9)]);
            assert_eq!(plan.destroys, Some((kind, 9)));
        }
        let query = plan(&request(Opcode::QueryQp, &handle)).unwrap();
        assert_eq!(
            (query.names, query.destroys),
            (vec![(ObjectKind::Qp, 9)], None)
        );
    }

    #[test]
    fn framing_and_the_notify_area_are_refused_as_the_device_would() {
        let handle = HandleRequest::default();
        let mut short = request(Opcode::DestroyQp, &handle);
        short.pop();
        let status = |request: &[u8]| plan(request).map(|_| ()).map_err(|(status, _)| status);
        assert_eq!(status(&short), Err(Status::BadLength));
        let mut wrong_length = request(Opcode::DestroyQp, &handle);
        wrong_length[4] = 4;
        assert_eq!(status(&wrong_length), Err(Status::BadLength));
        let mut unknown = request(Opcode::DestroyQp, &handle);
        unknown[0] = 99;
        assert_eq!(status(&unknown), Err(Status::Unsupported));
        let notify = vrdma_spec::ctrl::SetNotifyAreaRequest::default();
        assert_eq!(
            status(&request(Opcode::SetNotifyArea, &notify)),
            Err(Status::InvalidArgument)
        );
        let mut extra = request(Opcode::DestroyQp, &handle);
        extra.extend_from_slice(&[1, 2, 3]);
        assert_eq!(
            plan(&extra).unwrap().bytes.len(),
            HEADER + 8,
            "cut at length"
        );
    }

    #[test]
    fn page_lists_are_read_once_and_every_page_must_be_the_programs() {
        let mut memory = Owned::new(0x10_0000, 0x10_0000);
        memory.put(0x10_0000, &[0x11_0000, 0x12_0000]);
        let (size, pages) =
            read_page_list(&memory, &list(0x10_0000, 2, PageListForm::Direct)).unwrap();
        assert_eq!((size, pages), (4096, vec![0x11_0000, 0x12_0000]));
        // A page of someone else's.
        memory.put(0x10_0000, &[0x11_0000, 0x90_0000]);
        assert_eq!(
            read_page_list(&memory, &list(0x10_0000, 2, PageListForm::Direct)),
            Err(Status::BadAddress)
        );
        // A list that is someone else's memory.
        assert_eq!(
            read_page_list(&memory, &list(0x90_0000, 1, PageListForm::Direct)),
            Err(Status::BadAddress)
        );
        // A page that runs past the program's memory.
        memory.put(0x10_0000, &[0x1f_f000 + 8]);
        assert_eq!(
            read_page_list(&memory, &list(0x10_0000, 1, PageListForm::Direct)),
            Err(Status::BadAddress)
        );
        // Counts and forms.
        assert_eq!(
            read_page_list(&memory, &list(0x10_0000, 0, PageListForm::Direct)),
            Err(Status::InvalidArgument)
        );
        assert_eq!(
            read_page_list(
                &memory,
                &list(0x10_0000, MAX_DIRECT_PAGES + 1, PageListForm::Direct)
            ),
            Err(Status::InvalidArgument)
        );
        let mut bad_form = list(0x10_0000, 1, PageListForm::Direct);
        bad_form.form = 7;
        assert_eq!(
            read_page_list(&memory, &bad_form),
            Err(Status::InvalidArgument)
        );
    }

    #[test]
    fn indirect_lists_are_followed_within_the_programs_memory() {
        let mut memory = Owned::new(0x10_0000, 0x10_0000);
        let pages: Vec<u64> = (0..600).map(|i| 0x10_0000 + (i % 256) * 4096).collect();
        memory.put(0x10_0000, &[0x10_1000, 0x10_2000]);
        memory.put(0x10_1000, &pages[..512]);
        memory.put(0x10_2000, &pages[512..]);
        let read = read_page_list(&memory, &list(0x10_0000, 600, PageListForm::Indirect)).unwrap();
        assert_eq!(read.1, pages);
        // A list page of someone else's.
        memory.put(0x10_0000, &[0x10_1000, 0x90_0000]);
        assert_eq!(
            read_page_list(&memory, &list(0x10_0000, 600, PageListForm::Indirect)),
            Err(Status::BadAddress)
        );
    }
}
