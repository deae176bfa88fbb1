//! `djinn bench rdma`: round trips over RDMA through a node process, from 2 B to 64 MiB, beside
//! perftest's `ib_write_lat` and `ib_write_bw` run on the same device in the same run (the
//! soft-RoCE VM of scripts/softroce-vm.sh).

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
        "| size | djinn get p50 µs | p99 µs | p999 µs | djinn MB/s at p50 | perftest | ratio |\n|---|---|---|---|---|---|---|\n",
    );
    for size in args.sizes.iter().map(|s| s.0 as usize) {
        let iters = (args.volume.0 / size as u64).clamp(5, args.iters);
        client.put("bench", DType::U8, &[size as u64], &vec![7u8; size])?;
        let s: Stats = measure(iters, || client.get("bench").map(drop).map_err(Into::into))?;
        let mbps = size as f64 / s.p50;
        let (baseline, ratio) = if size <= 64 {
            // ib_write_lat reports one-way latency: a round trip is twice its typical value.
            let out = perftest("ib_write_lat", &args.device, &args.addr, &["-s", &size.to_string(), "-n", "2000"])?;
            let typical = perftest_value(&out, 4).context("no t_typical in ib_write_lat's output")?;
            (format!("ib_write_lat 2 × {typical:.2} µs"), s.p50 / (2.0 * typical))
        } else {
            let n = (args.volume.0 / size as u64).clamp(5, 2000).to_string();
            let out = perftest("ib_write_bw", &args.device, &args.addr, &["-s", &size.to_string(), "-n", &n])?;
            let bw = perftest_value(&out, 3).context("no BW average in ib_write_bw's output")?;
            (format!("ib_write_bw {bw:.1} MB/s"), mbps / bw)
        };
        let line = format!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {baseline} | **{ratio:.2}** |",
            ByteSize(size as u64),
            s.p50,
            s.p99,
            s.p999,
            mbps
        );
        println!("{line}");
        writeln!(table, "{line}")?;
    }
    if let Some(path) = &args.results {
        let notes = [
            format!("Device: soft-RoCE {} in the qemu VM", args.device),
            "Ratio: for 2 B, djinn's round trip over 2 × ib_write_lat's typical one-way latency (lower is better); from 64 KiB, djinn's bandwidth over ib_write_bw's average (higher is better).".to_owned(),
        ];
        append_section(path, "rdma", &notes, &table)?;
    }
    Ok(())
}
