//! `djinn bench rdma`: round trips over RDMA through a node process, from 2 B to 64 MiB, and
//! streaming bandwidth (several gets in flight), beside perftest's `ib_write_lat` and
//! `ib_write_bw` run on the same device in the same run (the soft-RoCE VM of
//! scripts/softroce-vm.sh), and beside a bare SEND/RECV ping-pong over djinn's own verbs layer:
//! the floor that the device, the kernel and the completion queue set for any protocol on top.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use djinn_client::{Client, ClientOptions, DType, Transport};
use djinn_gpudirect::ByteSize;

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
fn perftest(tool: &str, device: &str, addr: &str, extra: &[&str]) -> Result<String> {
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

/// The first data row's column `col` of perftest's table.
fn perftest_value(output: &str, col: usize) -> Option<f64> {
    output
        .lines()
        .filter(|l| l.trim_start().chars().next().is_some_and(|c| c.is_ascii_digit()))
        .find_map(|l| l.split_whitespace().nth(col)?.parse().ok())
}

pub fn run(args: RdmaArgs) -> Result<()> {
    let node = Spawned::start(&[
        "node",
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
            let bw = perftest_value(&out, 3).context("no BW average in ib_write_bw's output")?;
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
    let floor = verbs_floor(&args.device, args.iters.max(2000))?;
    let typical = write_lat_typical(&args.device, &args.addr, 64)?;
    let line = format!(
        "| 64 B, bare verbs | {:.1} | {:.1} | {:.1} | — | ib_write_lat 2 × {typical:.2} µs | **{:.2}** |",
        floor.p50,
        floor.p99,
        floor.p999,
        floor.p50 / (2.0 * typical)
    );
    println!("{line}");
    writeln!(table, "{line}")?;
    let floor = verbs_floor_write(&args.device, args.iters.max(2000))?;
    let line = format!(
        "| 64 B, bare verbs, WRITE polled in memory | {:.1} | {:.1} | {:.1} | — | ib_write_lat 2 × {typical:.2} µs | **{:.2}** |",
        floor.p50,
        floor.p99,
        floor.p999,
        floor.p50 / (2.0 * typical)
    );
    println!("{line}");
    writeln!(table, "{line}")?;
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

/// Round trips of a bare ping-pong: two threads, each with its own context and queue pair
/// connected to the other's, bouncing a 64-byte inline SEND. What is left of djinn's round trip
/// above this is its protocol, the node and the client.
fn verbs_floor(device: &str, iters: u64) -> Result<Stats> {
    use djinn_dataplane::rdma::{QueueDepths, RcEndpoint, RdmaContext, find_port};
    use djinn_gpudirect::HostBuf;

    const RECVS: u64 = 16;
    let side = |me: usize, to_peer: std::sync::mpsc::Sender<_>, from_peer: std::sync::mpsc::Receiver<_>| {
        let device = device.to_owned();
        std::thread::spawn(move || -> Result<Option<Stats>> {
            let port = find_port(Some(&device))?;
            let ctx = RdmaContext::new(&port, 256)?;
            let mut ep = RcEndpoint::new(&ctx, QueueDepths::default())?;
            to_peer.send(ep.info())?;
            ep.connect(&from_peer.recv()?)?;
            let buf = HostBuf::zeroed(4096)?;
            // SAFETY: `buf` outlives the registration and the queue pair (all dropped at the
            // end of this closure, the buffer last).
            let mr = unsafe { ctx.register(buf.as_ptr(), buf.len()) }?;
            for id in 0..RECVS {
                // SAFETY: within the registered buffer.
                unsafe { ep.post_recv(id, &mr, mr.addr, 4096) }?;
            }
            // Both queue pairs are connected once each side has posted its receives and said so.
            to_peer.send(ep.info())?;
            from_peer.recv()?;
            let message = [7u8; 64];
            let turn = |ep: &mut RcEndpoint, send_first: bool, n: u64| -> Result<()> {
                let send = |ep: &mut RcEndpoint| {
                    // SAFETY: inline data is copied into the work request.
                    unsafe { ep.post_send(RECVS, &message, None, n % 16 == 15) }
                };
                if send_first {
                    send(ep)?;
                }
                loop {
                    let mut received = None;
                    let mut failed = None;
                    ctx.poll(|c| match c {
                        Ok(c) if c.wr_id < RECVS => received = Some(c.wr_id),
                        Ok(_) => {}
                        Err(e) => failed = Some(e),
                    })?;
                    if let Some(e) = failed {
                        return Err(e.into());
                    }
                    if let Some(id) = received {
                        // SAFETY: as above.
                        unsafe { ep.post_recv(id, &mr, mr.addr, 4096) }?;
                        break;
                    }
                }
                if !send_first {
                    send(ep)?;
                }
                Ok(())
            };
            let total = iters + (iters / 10).max(2);
            if me == 0 {
                let mut n = 0;
                let stats = measure(iters, || {
                    n += 1;
                    turn(&mut ep, true, n)
                })?;
                Ok(Some(stats))
            } else {
                for n in 0..total {
                    turn(&mut ep, false, n)?;
                }
                Ok(None)
            }
        })
    };
    let (to_b, from_a) = std::sync::mpsc::channel();
    let (to_a, from_b) = std::sync::mpsc::channel();
    let a = side(0, to_b, from_b);
    let b = side(1, to_a, from_a);
    let stats = a.join().map_err(|_| anyhow::anyhow!("ping side panicked"))??;
    b.join().map_err(|_| anyhow::anyhow!("pong side panicked"))??;
    stats.context("no figures from the ping side")
}

/// The same ping-pong with each message RDMA-WRITten inline into the peer's memory, which polls
/// the message's last byte (as `ib_write_lat` does): no receive to post or complete.
fn verbs_floor_write(device: &str, iters: u64) -> Result<Stats> {
    use djinn_dataplane::rdma::{QueueDepths, RcEndpoint, RdmaContext, find_port};
    use djinn_gpudirect::HostBuf;

    const LEN: usize = 64;
    let side = |me: usize, to_peer: std::sync::mpsc::Sender<_>, from_peer: std::sync::mpsc::Receiver<_>| {
        let device = device.to_owned();
        std::thread::spawn(move || -> Result<Option<Stats>> {
            let port = find_port(Some(&device))?;
            let ctx = RdmaContext::new(&port, 256)?;
            let mut ep = RcEndpoint::new(&ctx, QueueDepths::default())?;
            let buf = HostBuf::zeroed(4096)?;
            // SAFETY: `buf` outlives the registration and the queue pair (all dropped at the
            // end of this closure, the buffer last).
            let mr = unsafe { ctx.register(buf.as_ptr(), buf.len()) }?;
            to_peer.send((ep.info(), mr.addr, mr.rkey()))?;
            let (info, remote, rkey) = from_peer.recv()?;
            ep.connect(&info)?;
            to_peer.send((ep.info(), 0, 0))?;
            from_peer.recv()?;
            let mut message = [7u8; LEN];
            let last = buf.as_ptr().wrapping_add(LEN - 1);
            let mut turn = |ep: &mut RcEndpoint, send_first: bool, n: u64| -> Result<()> {
                let mark = (n % 255) as u8 + 1;
                let mut send = |ep: &mut RcEndpoint| {
                    message[LEN - 1] = mark;
                    ep.post_write_inline(0, &message, rkey, remote, n % 16 == 15)
                };
                if send_first {
                    send(ep)?;
                }
                // SAFETY: a byte of the registered buffer, which the peer's WRITEs change.
                while unsafe { std::ptr::read_volatile(last) } != mark {
                    std::hint::spin_loop();
                }
                let mut failed = None;
                ctx.poll(|c| failed = failed.take().or(c.err()))?;
                if let Some(e) = failed {
                    return Err(e.into());
                }
                if !send_first {
                    send(ep)?;
                }
                Ok(())
            };
            let total = iters + (iters / 10).max(2);
            if me == 0 {
                let mut n = 0;
                let stats = measure(iters, || {
                    n += 1;
                    turn(&mut ep, true, n)
                })?;
                Ok(Some(stats))
            } else {
                for n in 1..=total {
                    turn(&mut ep, false, n)?;
                }
                Ok(None)
            }
        })
    };
    let (to_b, from_a) = std::sync::mpsc::channel();
    let (to_a, from_b) = std::sync::mpsc::channel();
    let a = side(0, to_b, from_b);
    let b = side(1, to_a, from_a);
    let stats = a.join().map_err(|_| anyhow::anyhow!("ping side panicked"))??;
    b.join().map_err(|_| anyhow::anyhow!("pong side panicked"))??;
    stats.context("no figures from the ping side")
}
