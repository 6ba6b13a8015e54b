//! `vrdma-perf`: perftest's latency and bandwidth tests, through vrdma.
//!
//! Run a server and a client, each attached to a vrdma backend socket:
//!
//!     vrdma-perf write_lat --socket S                       # server
//!     vrdma-perf write_lat --socket S --connect 127.0.0.1   # client
//!
//! Tests: write_lat, send_lat, read_lat, atomic_lat, write_bw, send_bw, read_bw. The client
//! prints perftest's columns (or JSON lines with --json); the server only serves.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use vrdma_guest::{
    access, random_psn, wc_opcode, CompletionQueue, Device, Gid, MemoryRegion, Payload, QpType,
    QueuePair, RcPeer, RecvWr, SendOp, SendWr, Sge, SharedBuffer, WorkCompletion,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[clap(rename_all = "snake_case")]
enum Test {
    WriteLat,
    SendLat,
    ReadLat,
    AtomicLat,
    WriteBw,
    SendBw,
    ReadBw,
}

impl Test {
    fn is_latency(self) -> bool {
        matches!(
            self,
            Test::WriteLat | Test::SendLat | Test::ReadLat | Test::AtomicLat
        )
    }
}

/// perftest's tests through vrdma.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    test: Test,
    /// The backend's vhost-user socket, or `pci` inside a VM (see `Device::open`).
    #[arg(long)]
    socket: String,
    /// Run as the client of the server at this address (otherwise serve).
    #[arg(long)]
    connect: Option<String>,
    /// TCP port of the out-of-band exchange.
    #[arg(short = 'p', long, default_value_t = 18515)]
    port: u16,
    /// Message size in bytes.
    #[arg(short = 's', long, default_value_t = 2)]
    size: u32,
    /// Iterations per size.
    #[arg(short = 'n', long, default_value_t = 1000)]
    iters: u32,
    /// All sizes from 2 bytes to 8 MiB (powers of two).
    #[arg(short = 'a', long)]
    all: bool,
    /// QPs (bandwidth tests spread their requests over them).
    #[arg(short = 'q', long, default_value_t = 1)]
    qps: u32,
    /// Requests in flight (bandwidth tests).
    #[arg(long, default_value_t = 128)]
    tx_depth: u32,
    /// Print one JSON object per size instead of perftest's table.
    #[arg(long)]
    json: bool,
}

/// What each side tells the other over TCP about one QP.
struct PeerInfo {
    qpn: u32,
    /// The PSN its send queue starts at.
    psn: u32,
    gid: Gid,
    rkey: u32,
    addr: u64,
}

struct Side {
    device: Device,
    buffer: SharedBuffer,
    mr: MemoryRegion,
    cq: CompletionQueue,
    qps: Vec<QueuePair>,
    _pd: vrdma_guest::ProtectionDomain,
}

type Error = Box<dyn std::error::Error>;

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("vrdma-perf: {e}");
        std::process::exit(1);
    }
}

fn sizes(args: &Args) -> Vec<u32> {
    if args.all {
        (1..=23).map(|shift| 1 << shift).collect()
    } else {
        vec![args.size]
    }
}

fn run(args: &Args) -> Result<(), Error> {
    if args.test.is_latency() && args.qps != 1 {
        return Err("latency tests use one QP (-q 1)".into());
    }
    if args.size == 0 || args.iters == 0 || args.qps == 0 || args.tx_depth == 0 {
        return Err("size, iterations, QPs and tx depth must be positive".into());
    }
    if matches!(args.test, Test::AtomicLat) && args.size != 8 && !args.all {
        eprintln!("vrdma-perf: atomics move 8 bytes; -s is ignored");
    }
    let largest = *sizes(args).iter().max().expect("at least one size");
    let side = setup(args, largest)?;
    let stream = match &args.connect {
        Some(host) => connect_with_retry(&format!("{host}:{}", args.port))?,
        None => TcpListener::bind(("0.0.0.0", args.port))?.accept()?.0,
    };
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let (gid_index, gid) = side.device.gid()?;
    let psns: Vec<u32> = side.qps.iter().map(|_| random_psn()).collect();
    for (qp, psn) in side.qps.iter().zip(&psns) {
        writeln!(
            writer,
            "{} {psn} {} {} {}",
            qp.qp_num(),
            std::net::Ipv6Addr::from(gid.0),
            side.mr.rkey(),
            side.mr.addr()
        )?;
    }
    let mut peers = Vec::new();
    for _ in &side.qps {
        peers.push(read_peer(&mut reader)?);
    }
    for ((qp, peer), &psn) in side.qps.iter().zip(&peers).zip(&psns) {
        connect(qp, gid_index as u8, psn, peer)?;
    }
    let mut line = String::new();
    writeln!(writer, "ready")?;
    reader.read_line(&mut line)?;
    if args.connect.is_some() {
        if !args.json {
            print_header(args);
        }
        for size in sizes(args) {
            let result = client(args, &side, &peers, size)?;
            report(args, size, &result);
        }
        writeln!(writer, "done")?;
    } else {
        for size in sizes(args) {
            server(args, &side, &peers, size)?;
        }
        line.clear();
        reader.read_line(&mut line)?;
    }
    Ok(())
}

fn connect_with_retry(address: &str) -> Result<TcpStream, Error> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match TcpStream::connect(address) {
            Ok(stream) => return Ok(stream),
            Err(e) if Instant::now() > deadline => {
                return Err(format!("connecting to {address}: {e}").into())
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn read_peer(reader: &mut impl BufRead) -> Result<PeerInfo, Error> {
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let fields: Vec<&str> = line.split_whitespace().collect();
    let [qpn, psn, gid, rkey, addr] = fields.as_slice() else {
        return Err(format!("malformed peer line {line:?}").into());
    };
    let gid: std::net::Ipv6Addr = gid.parse()?;
    Ok(PeerInfo {
        qpn: qpn.parse()?,
        psn: psn.parse()?,
        gid: Gid(gid.octets()),
        rkey: rkey.parse()?,
        addr: addr.parse()?,
    })
}

fn setup(args: &Args, largest: u32) -> Result<Side, Error> {
    let device = Device::open(&args.socket)?;
    let pd = device.alloc_pd()?;
    // Room for the in-flight window of the largest message, and a separate receive area.
    let window = u64::from(largest) * u64::from(args.tx_depth.min(64));
    let buffer = device.alloc_buffer(2 * window.max(4096))?;
    let all =
        access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;
    let mr = pd.reg_mr(&buffer, all)?;
    let depth = (args.tx_depth * 2).next_power_of_two().max(256);
    let cq = device.create_cq(depth * args.qps.next_power_of_two())?;
    let qps = (0..args.qps)
        .map(|_| {
            QueuePair::builder(QpType::Rc, &cq)
                .max_send_wr(args.tx_depth)
                .max_recv_wr(args.tx_depth)
                .max_inline_data(64)
                .build(&pd)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Side {
        device,
        buffer,
        mr,
        cq,
        qps,
        _pd: pd,
    })
}

fn connect(qp: &QueuePair, sgid_index: u8, psn: u32, peer: &PeerInfo) -> Result<(), Error> {
    let far = RcPeer {
        qp_num: peer.qpn,
        gid: peer.gid,
        psn: peer.psn,
    };
    Ok(qp.connect_rc(sgid_index, psn, &far)?)
}

/// Polls until one completion arrives; errors on a failed one.
fn next_completion(cq: &CompletionQueue) -> Result<WorkCompletion, Error> {
    let mut one = [WorkCompletion::default(); 1];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if cq.poll(&mut one)? == 1 {
            if !one[0].is_success() {
                return Err(format!("completion failed: {:?}", one[0]).into());
            }
            return Ok(one[0]);
        }
        if Instant::now() > deadline {
            return Err("no completion within 30 s".into());
        }
        // Busy-poll, but leave the CPU to the device's poller if it shares ours.
        std::thread::yield_now();
    }
}

/// Spins until the last byte of the message at `offset` becomes `value` (write_lat's signal).
fn wait_for_byte(buffer: &SharedBuffer, offset: u64, value: u8) -> Result<(), Error> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let flag = buffer.atomic_u8(offset)?;
    while flag.load(std::sync::atomic::Ordering::Acquire) != value {
        if Instant::now() > deadline {
            return Err("the peer's write never arrived".into());
        }
        std::thread::yield_now();
    }
    Ok(())
}

/// Latency samples in microseconds, or bandwidth totals.
enum Measured {
    Latency(Vec<f64>),
    Bandwidth {
        bytes: u64,
        ops: u64,
        elapsed: Duration,
    },
}

fn sge(side: &Side, offset: u64, size: u32) -> Sge {
    Sge {
        addr: side.mr.addr() + offset,
        length: size,
        lkey: side.mr.lkey(),
    }
}

fn client(args: &Args, side: &Side, peers: &[PeerInfo], size: u32) -> Result<Measured, Error> {
    let qp = &side.qps[0];
    let peer = &peers[0];
    let recv_area = side.buffer.len() / 2;
    let mut samples = Vec::with_capacity(args.iters as usize);
    match args.test {
        Test::WriteLat => {
            for i in 0..args.iters {
                let mark = (i % 255 + 1) as u8;
                side.buffer.write(u64::from(size) - 1, &[mark])?;
                let start = Instant::now();
                let op = SendOp::RdmaWrite {
                    remote_addr: peer.addr + recv_area,
                    rkey: peer.rkey,
                };
                qp.post_send(&[unsignaled(
                    i.into(),
                    op,
                    Payload::Sges(&[sge(side, 0, size)]),
                )])?;
                wait_for_byte(&side.buffer, recv_area + u64::from(size) - 1, mark)?;
                samples.push(start.elapsed().as_secs_f64() * 1e6 / 2.0);
                drain(&side.cq)?;
            }
        }
        Test::SendLat => {
            for i in 0..args.iters {
                qp.post_recv(&[RecvWr {
                    wr_id: i.into(),
                    sges: &[sge(side, recv_area, size)],
                }])?;
                let start = Instant::now();
                qp.post_send(&[SendWr::new(
                    i.into(),
                    SendOp::Send,
                    Payload::Sges(&[sge(side, 0, size)]),
                )])?;
                wait_for(&side.cq, wc_opcode::RECV)?;
                samples.push(start.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        }
        Test::ReadLat | Test::AtomicLat => {
            for i in 0..args.iters {
                let op = if args.test == Test::ReadLat {
                    SendOp::RdmaRead {
                        remote_addr: peer.addr,
                        rkey: peer.rkey,
                    }
                } else {
                    SendOp::FetchAndAdd {
                        remote_addr: peer.addr,
                        rkey: peer.rkey,
                        add: 1,
                    }
                };
                let length = if args.test == Test::ReadLat { size } else { 8 };
                let start = Instant::now();
                qp.post_send(&[SendWr::new(
                    i.into(),
                    op,
                    Payload::Sges(&[sge(side, 0, length)]),
                )])?;
                next_completion(&side.cq)?;
                samples.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        Test::WriteBw | Test::SendBw | Test::ReadBw => return bandwidth(args, side, peers, size),
    }
    Ok(Measured::Latency(samples))
}

fn unsignaled(wr_id: u64, op: SendOp, payload: Payload<'_>) -> SendWr<'_> {
    SendWr {
        signaled: false,
        ..SendWr::new(wr_id, op, payload)
    }
}

/// Takes completions off the CQ without waiting (unsignaled writes produce none; this keeps
/// error completions from going unnoticed).
fn drain(cq: &CompletionQueue) -> Result<(), Error> {
    let mut batch = [WorkCompletion::default(); 16];
    let n = cq.poll(&mut batch)?;
    if let Some(failed) = batch[..n].iter().find(|c| !c.is_success()) {
        return Err(format!("completion failed: {failed:?}").into());
    }
    Ok(())
}

/// Waits for a completion with `opcode`, letting others (send completions) pass.
fn wait_for(cq: &CompletionQueue, opcode: u8) -> Result<(), Error> {
    while next_completion(cq)?.opcode != opcode {}
    Ok(())
}

fn bandwidth(args: &Args, side: &Side, peers: &[PeerInfo], size: u32) -> Result<Measured, Error> {
    let total = u64::from(args.iters);
    let window = u64::from(args.tx_depth.min(64)).max(1);
    let recv_area = side.buffer.len() / 2;
    let (mut posted, mut completed) = (0u64, 0u64);
    let mut batch = [WorkCompletion::default(); 32];
    let start = Instant::now();
    while completed < total {
        while posted < total && posted - completed < u64::from(args.tx_depth) {
            let q = (posted % u64::from(args.qps)) as usize;
            let slot = (posted % window) * u64::from(size);
            let remote = peers[q].addr + recv_area + slot;
            let op = match args.test {
                Test::WriteBw => SendOp::RdmaWrite {
                    remote_addr: remote,
                    rkey: peers[q].rkey,
                },
                Test::ReadBw => SendOp::RdmaRead {
                    remote_addr: peers[q].addr + slot,
                    rkey: peers[q].rkey,
                },
                _ => SendOp::Send,
            };
            let sges = [sge(side, slot, size)];
            let wr = SendWr::new(posted, op, Payload::Sges(&sges));
            match side.qps[q].post_send(&[wr]) {
                Ok(()) => posted += 1,
                Err(vrdma_guest::Error::QueueFull { .. }) => break,
                Err(e) => return Err(e.into()),
            }
        }
        let n = side.cq.poll(&mut batch)?;
        if let Some(failed) = batch[..n].iter().find(|c| !c.is_success()) {
            return Err(format!("completion failed: {failed:?}").into());
        }
        if n == 0 {
            std::thread::yield_now();
        }
        completed += n as u64;
    }
    let elapsed = start.elapsed();
    Ok(Measured::Bandwidth {
        bytes: total * u64::from(size),
        ops: total,
        elapsed,
    })
}

fn server(args: &Args, side: &Side, peers: &[PeerInfo], size: u32) -> Result<(), Error> {
    let qp = &side.qps[0];
    let recv_area = side.buffer.len() / 2;
    match args.test {
        Test::WriteLat => {
            // Ping-pong: each write that lands is answered with one back.
            for i in 0..args.iters {
                let mark = (i % 255 + 1) as u8;
                wait_for_byte(&side.buffer, recv_area + u64::from(size) - 1, mark)?;
                side.buffer.write(u64::from(size) - 1, &[mark])?;
                let op = SendOp::RdmaWrite {
                    remote_addr: peers[0].addr + recv_area,
                    rkey: peers[0].rkey,
                };
                qp.post_send(&[unsignaled(
                    i.into(),
                    op,
                    Payload::Sges(&[sge(side, 0, size)]),
                )])?;
                drain(&side.cq)?;
            }
            Ok(())
        }
        Test::SendLat => {
            for i in 0..args.iters {
                qp.post_recv(&[RecvWr {
                    wr_id: i.into(),
                    sges: &[sge(side, recv_area, size)],
                }])?;
                wait_for(&side.cq, wc_opcode::RECV)?;
                qp.post_send(&[SendWr::new(
                    i.into(),
                    SendOp::Send,
                    Payload::Sges(&[sge(side, 0, size)]),
                )])?;
            }
            Ok(())
        }
        Test::SendBw => {
            // Keep receives posted for every message the client sends.
            let window = u64::from(args.tx_depth.min(64)).max(1);
            let depth = args.tx_depth.min(128);
            let post = |i: u64, q: &QueuePair| {
                let slot = recv_area + (i % window) * u64::from(size);
                q.post_recv(&[RecvWr {
                    wr_id: i,
                    sges: &[sge(side, slot, size)],
                }])
            };
            let total = u64::from(args.iters);
            let per_qp = |q: usize| {
                (0..total)
                    .filter(|i| (i % u64::from(args.qps)) as usize == q)
                    .count() as u64
            };
            let mut posted: Vec<u64> = vec![0; side.qps.len()];
            for (q, queue) in side.qps.iter().enumerate() {
                while posted[q] < per_qp(q).min(u64::from(depth)) {
                    post(posted[q], queue)?;
                    posted[q] += 1;
                }
            }
            let mut received = 0u64;
            let mut batch = [WorkCompletion::default(); 32];
            while received < total {
                let n = side.cq.poll(&mut batch)?;
                if n == 0 {
                    std::thread::yield_now();
                }
                for done in &batch[..n] {
                    if !done.is_success() {
                        return Err(format!("receive failed: {done:?}").into());
                    }
                    received += 1;
                    let q = side
                        .qps
                        .iter()
                        .position(|qp| qp.qp_num() == done.qp_num)
                        .unwrap_or(0);
                    if posted[q] < per_qp(q) {
                        post(posted[q], &side.qps[q])?;
                        posted[q] += 1;
                    }
                }
            }
            Ok(())
        }
        // One-sided tests: the server's NIC does the work.
        Test::ReadLat | Test::AtomicLat | Test::WriteBw | Test::ReadBw => Ok(()),
    }
}

fn print_header(args: &Args) {
    if args.test.is_latency() {
        println!(
            " {:<10} {:<12} {:>12} {:>12} {:>16} {:>12} {:>12} {:>22} {:>24}",
            "#bytes",
            "#iterations",
            "t_min[usec]",
            "t_max[usec]",
            "t_typical[usec]",
            "t_avg[usec]",
            "t_stdev[usec]",
            "99% percentile[usec]",
            "99.9% percentile[usec]"
        );
    } else {
        println!(
            " {:<10} {:<12} {:>20} {:>16}",
            "#bytes", "#iterations", "BW average[MB/sec]", "MsgRate[Mpps]"
        );
    }
}

fn report(args: &Args, size: u32, result: &Measured) {
    let test = format!("{:?}", args.test).to_lowercase();
    match result {
        Measured::Latency(samples) => {
            let mut sorted = samples.clone();
            sorted.sort_by(f64::total_cmp);
            let n = sorted.len();
            let at = |q: f64| sorted[((n as f64 * q) as usize).min(n - 1)];
            let avg = sorted.iter().sum::<f64>() / n as f64;
            let stdev = (sorted.iter().map(|s| (s - avg).powi(2)).sum::<f64>() / n as f64).sqrt();
            let (min, max, typical) = (sorted[0], sorted[n - 1], at(0.5));
            if args.json {
                println!(
                    "{{\"test\":\"{test}\",\"bytes\":{size},\"iterations\":{n},\"t_min\":{min:.2},\"t_max\":{max:.2},\"t_typical\":{typical:.2},\"t_avg\":{avg:.2},\"t_stdev\":{stdev:.2},\"p99\":{:.2},\"p99_9\":{:.2}}}",
                    at(0.99),
                    at(0.999)
                );
            } else {
                println!(
                    " {size:<10} {n:<12} {min:>12.2} {max:>12.2} {typical:>16.2} {avg:>12.2} {stdev:>12.2} {:>22.2} {:>24.2}",
                    at(0.99),
                    at(0.999)
                );
            }
        }
        Measured::Bandwidth {
            bytes,
            ops,
            elapsed,
        } => {
            let seconds = elapsed.as_secs_f64();
            let mb = *bytes as f64 / seconds / 1e6;
            let mpps = *ops as f64 / seconds / 1e6;
            if args.json {
                println!("{{\"test\":\"{test}\",\"bytes\":{size},\"iterations\":{ops},\"bw_avg\":{mb:.2},\"msg_rate\":{mpps:.6}}}");
            } else {
                println!(" {size:<10} {ops:<12} {mb:>20.2} {mpps:>16.6}");
            }
        }
    }
}
