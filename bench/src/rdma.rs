//! `djinn bench rdma`: round trips over RDMA through a node process, from 2 B to 64 MiB, and
//! streaming bandwidth (several gets in flight), beside perftest's `ib_write_lat` and
//! `ib_write_bw` run on the same device in the same run (the soft-RoCE VM of
//! scripts/softroce-vm.sh), and beside a bare SEND/RECV ping-pong over djinn's own verbs layer:
//! the floor that the device, the kernel and the completion queue set for any protocol on top.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use djinn_client::{Client, ClientOptions, DType, Transport};
use djinn_dataplane::rdma::{QueueDepths, RcEndpoint, RdmaContext, Registered, find_port};
use djinn_memory::{ByteSize, HostBuf};

use crate::Spawned;
use crate::report::{Stats, append_section, measure};

#[derive(Args, Debug)]
pub struct RdmaArgs {
    /// RDMA device (as `ibv_devices` names it).
    #[arg(long, default_value = "rxe0")]
    device: String,
    /// This host's address on that device's network (perftest's client connects to it).
    #[arg(long)]
    addr: String,
    /// Payload sizes.
    #[arg(long, value_delimiter = ',', default_value = "2,64KiB,1MiB,16MiB,64MiB")]
    sizes: Vec<ByteSize>,
    /// Timed round trips per size (fewer for the largest: see --volume).
    #[arg(long, default_value_t = 2000)]
    iters: u64,
    /// Bytes moved per size at most (iterations = this / size, at least 5).
    #[arg(long, default_value = "512MiB")]
    volume: ByteSize,
    /// Bytes in flight while streaming: gets per batch = this / size (1 to 16).
    #[arg(long, default_value = "16MiB")]
    window: ByteSize,
    /// Append the table, the command and the machine to this markdown file.
    #[arg(long)]
    results: Option<PathBuf>,
}

/// Runs a perftest pair (server, then client to `addr`) and returns the client's output.
pub(crate) fn perftest(tool: &str, device: &str, addr: &str, extra: &[&str]) -> Result<String> {
    let mut server = Command::new(tool)
        .args(["-d", device])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start {tool} (perftest)"))?;
    let mut last = String::new();
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(300));
        let out = Command::new(tool).args(["-d", device]).args(extra).arg(addr).output()?;
        last = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            let _ = server.wait();
            return Ok(last);
        }
    }
    let _ = server.kill();
    bail!("{tool} did not run: {last}")
}

/// ib_write_lat's typical one-way latency for `size` bytes in µs: the median of three runs
/// (one run's figure moves by 20% from run to run under emulation). A run whose clock
/// calibration failed under emulation (no figure) is run again, up to six runs in all.
fn write_lat_typical(device: &str, addr: &str, size: usize) -> Result<f64> {
    let mut runs = Vec::new();
    for _ in 0..6 {
        let out = perftest("ib_write_lat", device, addr, &["-s", &size.to_string(), "-n", "2000"])?;
        runs.extend(perftest_value(&out, 4).filter(|t| t.is_finite()));
        if runs.len() == 3 {
            runs.sort_by(f64::total_cmp);
            return Ok(runs[1]);
        }
    }
    bail!("ib_write_lat gave a typical latency in only {} of 6 runs", runs.len())
}

/// ib_write_bw's average bandwidth in MB/s (10^6 bytes a second, as djinn's figures are):
/// perftest's "MB/sec" column counts MiB (2^20 bytes).
pub(crate) fn write_bw_mbps(output: &str) -> Result<f64> {
    let mib = perftest_value(output, 3).context("no BW average in ib_write_bw's output")?;
    Ok(mib * 1_048_576.0 / 1e6)
}

/// The first data row's column `col` of perftest's table.
fn perftest_value(output: &str, col: usize) -> Option<f64> {
    output
        .lines()
        .filter(|l| l.trim_start().chars().next().is_some_and(|c| c.is_ascii_digit()))
        .find_map(|l| l.split_whitespace().nth(col)?.parse().ok())
}

pub fn run(args: RdmaArgs) -> Result<()> {
    // Every interface (RDMA connects to the device's address), without tokens: a throwaway
    // node for this bench alone, in the test VM, hence --insecure.
    let node = Spawned::start(&[
        "node",
        "--insecure",
        "--listen",
        "0.0.0.0:0",
        "--transport",
        "rdma",
        "--rdma-device",
        &args.device,
        "--log",
        "warn",
    ])?;
    let options = ClientOptions {
        transport: Transport::Rdma,
        rdma_device: Some(args.device.clone()),
        timeout: Some(Duration::from_secs(300)),
        ..ClientOptions::default()
    };
    let addr = format!("{}:{}", args.addr, node.addr.port());
    let mut client = Client::connect_with(addr.as_str(), options)?;
    anyhow::ensure!(client.transport() == "rdma", "the client is not on RDMA");

    let mut table = String::from(
        "| size | djinn get p50 µs | p99 µs | p999 µs | djinn MB/s streaming (gets in flight) | perftest | ratio |\n|---|---|---|---|---|---|---|\n",
    );
    for size in args.sizes.iter().map(|s| s.0 as usize) {
        let iters = (args.volume.0 / size as u64).clamp(5, args.iters);
        client.put("bench", DType::U8, &[size as u64], &vec![7u8; size])?;
        let s: Stats = measure(iters, || client.get("bench").map(drop).map_err(Into::into))?;
        let window = (args.window.0 / size as u64).clamp(1, 16) as usize;
        let names = vec!["bench"; window];
        let batches = (args.volume.0 / (size * window) as u64).clamp(5, args.iters);
        let streamed = measure(batches, || client.get_many(&names).map(drop).map_err(Into::into))?;
        let mbps = (size * window) as f64 / streamed.p50;
        let (baseline, ratio) = if size <= 64 {
            // ib_write_lat reports one-way latency: a round trip is twice its typical value.
            let typical = write_lat_typical(&args.device, &args.addr, size)?;
            (format!("ib_write_lat 2 × {typical:.2} µs"), s.p50 / (2.0 * typical))
        } else {
            let n = (args.volume.0 / size as u64).clamp(5, 2000).to_string();
            let out = perftest("ib_write_bw", &args.device, &args.addr, &["-s", &size.to_string(), "-n", &n])?;
            let bw = write_bw_mbps(&out)?;
            (format!("ib_write_bw {bw:.1} MB/s"), mbps / bw)
        };
        let line = format!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} ({window}) | {baseline} | **{ratio:.2}** |",
            ByteSize(size as u64),
            s.p50,
            s.p99,
            s.p999,
            mbps
        );
        println!("{line}");
        writeln!(table, "{line}")?;
    }
    let typical = write_lat_typical(&args.device, &args.addr, 64)?;
    let floors = [
        ("bare verbs", verbs_floor(&args.device, args.iters.max(2000))?),
        ("bare verbs, WRITE polled in memory", verbs_floor_write(&args.device, args.iters.max(2000))?),
    ];
    for (what, floor) in floors {
        let line = format!(
            "| 64 B, {what} | {:.1} | {:.1} | {:.1} | — | ib_write_lat 2 × {typical:.2} µs | **{:.2}** |",
            floor.p50,
            floor.p99,
            floor.p999,
            floor.p50 / (2.0 * typical)
        );
        println!("{line}");
        writeln!(table, "{line}")?;
    }
    if let Some(path) = &args.results {
        let notes = [
            format!("Device: soft-RoCE {} in the qemu VM", args.device),
            "Ratio: for 2 B, djinn's round trip over 2 × ib_write_lat's typical one-way latency, the median of 3 runs (lower is better); from 64 KiB, djinn's streaming bandwidth over ib_write_bw's average (higher is better).".to_owned(),
            "Bare verbs: two threads ping-ponging 64-byte inline SENDs over djinn's verbs layer (no protocol, no node): the floor under any protocol on this device. Bare verbs, WRITE: the same with each message RDMA-WRITten inline into the peer's memory and polled there, as ib_write_lat does.".to_owned(),
        ];
        append_section(path, "rdma", &notes, &table)?;
    }
    Ok(())
}

/// One side of a bare ping-pong: a context of its own, a queue pair connected to the other
/// side's and a registered buffer, and where the other side's buffer is.
// Fields drop in order: the queue pair, then the registration, then the memory.
struct Side {
    ep: RcEndpoint,
    mr: Registered,
    buf: HostBuf,
    ctx: Arc<RdmaContext>,
    remote: (u64, u32),
}

/// Receives the SEND ping-pong keeps posted.
const RECVS: u64 = 16;
const MESSAGE: usize = 64;

impl Side {
    /// Polls the completion queue until a receive completes; posts it again.
    fn await_send(&mut self) -> Result<()> {
        loop {
            let mut received = None;
            let mut failed = None;
            self.ctx.poll(|c| match c {
                Ok(c) if c.wr_id < RECVS => received = Some(c.wr_id),
                Ok(_) => {}
                Err(e) => failed = Some(e),
            })?;
            if let Some(e) = failed {
                return Err(e.into());
            }
            if let Some(id) = received {
                // SAFETY: within the registered buffer, which outlives the queue pair.
                unsafe { self.ep.post_recv(id, &self.mr, self.mr.addr, 4096) }?;
                return Ok(());
            }
        }
    }

    /// Spins until the peer's WRITE marks the last byte of the message with `mark`, then reaps
    /// completions (the signalled WRITEs').
    fn await_write(&mut self, mark: u8) -> Result<()> {
        let last = self.buf.as_ptr().wrapping_add(MESSAGE - 1);
        // SAFETY: a byte of the registered buffer, which the peer's WRITEs change.
        while unsafe { std::ptr::read_volatile(last) } != mark {
            std::hint::spin_loop();
        }
        let mut failed = None;
        self.ctx.poll(|c| failed = failed.take().or(c.err()))?;
        failed.map_or(Ok(()), |e| Err(e.into()))
    }
}

/// Runs a ping-pong between two threads on `device`: `prepare` readies each side once
/// connected, `turn(side, send_first, n)` is one side's half of round trip `n`. Returns the
/// round trips as the first side timed them.
fn ping_pong(
    device: &str,
    iters: u64,
    prepare: fn(&mut Side) -> Result<()>,
    turn: fn(&mut Side, bool, u64) -> Result<()>,
) -> Result<Stats> {
    let side = |first: bool, to_peer: mpsc::Sender<_>, from_peer: mpsc::Receiver<_>| {
        let device = device.to_owned();
        std::thread::spawn(move || -> Result<Option<Stats>> {
            let port = find_port(Some(&device))?;
            let ctx = RdmaContext::new(&port, 256)?;
            let mut ep = RcEndpoint::new(&ctx, QueueDepths::default())?;
            let buf = HostBuf::zeroed(4096)?;
            // SAFETY: `buf` outlives the registration and the queue pair (see `Side`).
            let mr = unsafe { ctx.register_for_peer_writes(buf.as_ptr(), buf.len()) }?;
            to_peer.send((ep.info(), mr.addr, mr.rkey()))?;
            let (info, addr, rkey) = from_peer.recv()?;
            ep.connect(&info)?;
            let mut me = Side { ep, mr, buf, ctx, remote: (addr, rkey) };
            prepare(&mut me)?;
            // Both sides are ready once each has prepared and said so.
            to_peer.send((info, 0, 0))?;
            from_peer.recv()?;
            // Both count round trips from 1: the first side counts its warm-up ones too.
            let total = iters + (iters / 10).max(2);
            if first {
                let mut n = 0;
                let stats = measure(iters, || {
                    n += 1;
                    turn(&mut me, true, n)
                })?;
                Ok(Some(stats))
            } else {
                for n in 1..=total {
                    turn(&mut me, false, n)?;
                }
                Ok(None)
            }
        })
    };
    let (to_b, from_a) = mpsc::channel();
    let (to_a, from_b) = mpsc::channel();
    let a = side(true, to_b, from_b);
    let b = side(false, to_a, from_a);
    let stats = a.join().map_err(|_| anyhow::anyhow!("ping side panicked"))??;
    b.join().map_err(|_| anyhow::anyhow!("pong side panicked"))??;
    stats.context("no figures from the ping side")
}

/// Round trips of a bare ping-pong of 64-byte inline SENDs. What is left of djinn's round trip
/// above this is its protocol, the node and the client.
fn verbs_floor(device: &str, iters: u64) -> Result<Stats> {
    fn prepare(side: &mut Side) -> Result<()> {
        for id in 0..RECVS {
            // SAFETY: within the registered buffer, which outlives the queue pair.
            unsafe { side.ep.post_recv(id, &side.mr, side.mr.addr, 4096) }?;
        }
        Ok(())
    }
    fn turn(side: &mut Side, send_first: bool, n: u64) -> Result<()> {
        let send = |side: &mut Side| {
            // SAFETY: inline data is copied into the work request.
            unsafe { side.ep.post_send(RECVS, &[7u8; MESSAGE], None, n % 16 == 15) }
        };
        if send_first {
            send(side)?;
        }
        side.await_send()?;
        if !send_first {
            send(side)?;
        }
        Ok(())
    }
    ping_pong(device, iters, prepare, turn)
}

/// The same ping-pong with each message RDMA-WRITten inline into the peer's memory, which polls
/// the message's last byte (as `ib_write_lat` does): no receive to post or complete.
fn verbs_floor_write(device: &str, iters: u64) -> Result<Stats> {
    fn turn(side: &mut Side, send_first: bool, n: u64) -> Result<()> {
        let mark = (n % 255) as u8 + 1;
        let send = |side: &mut Side| {
            let mut message = [7u8; MESSAGE];
            message[MESSAGE - 1] = mark;
            let (addr, rkey) = side.remote;
            side.ep.post_write_inline(0, &message, rkey, addr, n % 16 == 15)
        };
        if send_first {
            send(side)?;
        }
        side.await_write(mark)?;
        if !send_first {
            send(side)?;
        }
        Ok(())
    }
    ping_pong(device, iters, |_| Ok(()), turn)
}

/// The link a node-to-node benchmark measures against: RDMA on a device (`--rdma-device`,
/// `--rdma-addr`), else loopback TCP.
#[derive(Args, Debug)]
pub struct LinkArgs {
    /// Over RDMA on this device (the soft-RoCE VM's rxe0): the nodes take RDMA only, and the
    /// link is ib_write_bw's bandwidth on the device.
    #[arg(long, requires = "rdma_addr")]
    rdma_device: Option<String>,
    /// This host's address on the RDMA device's network (ib_write_bw's client connects to it).
    #[arg(long, requires = "rdma_device")]
    rdma_addr: Option<String>,
}

impl LinkArgs {
    /// The node flags for the link: RDMA only on the device, or nothing (TCP).
    pub fn node_args(&self) -> Vec<&str> {
        self.rdma_device.as_deref().map_or_else(Vec::new, |d| vec!["--transport", "rdma", "--rdma-device", d])
    }

    pub fn name(&self) -> &'static str {
        if self.rdma_device.is_some() { "RDMA" } else { "TCP" }
    }

    /// The link `size` bytes cross one way, measured in the same run: `ib_write_bw` on the
    /// device, else a raw TCP send answered by 8 bytes. Its description for a table, and its
    /// GB/s.
    pub fn baseline(&self, size: u64, iters: u64) -> Result<(String, f64)> {
        Ok(match (&self.rdma_device, &self.rdma_addr) {
            (Some(device), Some(addr)) => {
                let n = iters.to_string();
                let out = perftest("ib_write_bw", device, addr, &["-s", &size.to_string(), "-n", &n])?;
                let gbps = write_bw_mbps(&out)? / 1e3;
                (format!("{gbps:.3} (ib_write_bw)"), gbps)
            }
            _ => {
                let tcp = crate::report::raw(size as usize, 8, iters)?;
                let gbps = size as f64 / (tcp.p50 * 1e3);
                (format!("{gbps:.2} (raw TCP, p50 {:.1} µs)", tcp.p50), gbps)
            }
        })
    }
}
