//! A peer of `guest-endpoint target` (see its `Target`) that RDMA-WRITEs patterns into the
//! target's buffer and has the target check them where its program reads them: for the tests of
//! memory that must stay where the device was told it is (SPEC.md §12).

use vrdma_guest::{
    access, CompletionQueue, Device, MemoryRegion, Payload, ProtectionDomain, QpType, QueuePair,
    SendOp, SendWr, Sge, SharedBuffer, WorkCompletion,
};

use std::time::{Duration, Instant};

use crate::{connect_guest_qp, line_field, test_pattern, wait_for_guest_completions};

/// Chunks written and checked each round, spread over the target's buffer.
pub const CHUNKS: u64 = 32;
pub const CHUNK_LEN: u32 = 64 << 10;

/// How the target is driven: a line to it, its next line.
pub trait TargetLines {
    fn send(&mut self, line: &str);
    fn receive(&mut self) -> String;
}

/// The number `name=` holds in `line` (decimal, or hex with 0x).
fn field(line: &str, name: &str) -> u64 {
    let value = line_field(line, name).unwrap_or_else(|| panic!("no {name} in {line}"));
    let (digits, radix) = match value.strip_prefix("0x") {
        Some(hex) => (hex, 16),
        None => (value, 10),
    };
    u64::from_str_radix(digits, radix).unwrap_or_else(|_| panic!("{name} in {line}"))
}

/// A guest-lib program with an RC QP connected to a `guest-endpoint target`'s, RDMA-WRITEing
/// patterns into the target's registered buffer and having the target check them.
pub struct TargetWriter {
    _device: Device,
    cq: CompletionQueue,
    qp: QueuePair,
    source: SharedBuffer,
    source_mr: MemoryRegion,
    _pd: ProtectionDomain,
    /// The target's buffer: its rkey, address and length.
    rkey: u32,
    va: u64,
    pub length: u64,
}

impl TargetWriter {
    /// Attaches to the backend at `socket` and connects to `target`, which has printed its
    /// first line.
    pub fn connect(socket: &str, target: &mut impl TargetLines) -> TargetWriter {
        let hello = target.receive();
        let device = Device::open(socket).expect("attach to the backend");
        let pd = device.alloc_pd().expect("alloc PD");
        let cq = device.create_cq(64).expect("create CQ");
        let qp = QueuePair::builder(QpType::Rc, &cq)
            .max_send_wr(64)
            .build(&pd)
            .expect("create QP");
        let source = device
            .alloc_buffer(u64::from(CHUNK_LEN))
            .expect("source buffer");
        let source_mr = pd.reg_mr(&source, access::LOCAL_WRITE).expect("register");
        target.send("rc");
        let theirs = field(&target.receive(), "qpn") as u32;
        target.send(&format!("connect {theirs} {}", qp.qp_num()));
        assert_eq!(target.receive(), "ok", "the target connected");
        let length = field(&hello, "len");
        assert!(
            length >= CHUNKS * u64::from(CHUNK_LEN),
            "a target of {length} bytes is too small for a round's writes"
        );
        let (gid_index, gid) = device.gid().expect("GID");
        connect_guest_qp(&qp, gid_index as u8, gid, theirs).expect("connect");
        TargetWriter {
            _device: device,
            cq,
            qp,
            source,
            source_mr,
            _pd: pd,
            rkey: field(&hello, "rkey") as u32,
            va: field(&hello, "va"),
            length,
        }
    }

    /// RDMA-WRITEs the pattern of `seed` at `offset` of the target's buffer; its completion.
    pub fn write(&self, offset: u64, seed: u64) -> WorkCompletion {
        self.post_write(offset, seed);
        wait_for_guest_completions(&self.cq, 1)[0]
    }

    /// As [`TargetWriter::write`], waiting at most `wait` for the completion: a WRITE to a QP
    /// that is gone completes only once the NIC's retries are spent (with an error), which on
    /// a real NIC may take longer than a test waits.
    pub fn write_within(&self, offset: u64, seed: u64, wait: Duration) -> Option<WorkCompletion> {
        self.post_write(offset, seed);
        let deadline = Instant::now() + wait;
        let mut done = [WorkCompletion::default()];
        while Instant::now() < deadline {
            if self.cq.poll(&mut done).expect("poll the CQ") == 1 {
                return Some(done[0]);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        None
    }

    fn post_write(&self, offset: u64, seed: u64) {
        self.source
            .write(0, &test_pattern(CHUNK_LEN as usize, seed))
            .expect("fill the source");
        let write = SendOp::RdmaWrite {
            remote_addr: self.va + offset,
            rkey: self.rkey,
        };
        let sge = [Sge {
            addr: self.source.addr(),
            length: CHUNK_LEN,
            lkey: self.source_mr.lkey(),
        }];
        self.qp
            .post_send(&[SendWr::new(seed, write, Payload::Sges(&sge))])
            .expect("post the WRITE");
    }

    /// One round: CHUNKS writes spread over the target's buffer, one chunk further into their
    /// stretch than the last round's (so that over the rounds every page is written), each
    /// checked by the target where its program reads it. Returns the mismatches.
    pub fn round(&self, target: &mut impl TargetLines, round: u64) -> u64 {
        let stride = self.length / CHUNKS;
        let at = |chunk: u64| chunk * stride + round * u64::from(CHUNK_LEN) % stride;
        for chunk in 0..CHUNKS {
            let seed = round * CHUNKS + chunk;
            let done = self.write(at(chunk), seed);
            assert!(done.is_success(), "WRITE {seed}: {done:?}");
        }
        for chunk in 0..CHUNKS {
            let seed = round * CHUNKS + chunk;
            target.send(&format!("expect {} {CHUNK_LEN} {seed}", at(chunk)));
        }
        let mut mismatches = 0;
        for chunk in 0..CHUNKS {
            let answer = target.receive();
            if answer != "ok" {
                mismatches += 1;
                println!("round {round} chunk {chunk}: {answer}");
            }
        }
        mismatches
    }
}
