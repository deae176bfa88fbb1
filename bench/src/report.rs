//! What every benchmark shares: timing into a histogram, the raw-socket baseline, and the
//! section each appends to bench/RESULTS.md (date, command, machine, notes, table).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use djinn_executor::tch;
use djinn_memory::ByteSize;
use hdrhistogram::Histogram;

use crate::Spawned;

#[derive(Clone, Copy)]
pub struct Stats {
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
}

impl Stats {
    pub fn of(h: &Histogram<u64>) -> Self {
        let us = |q| h.value_at_quantile(q) as f64 / 1000.0;
        Self { p50: us(0.5), p99: us(0.99), p999: us(0.999) }
    }
}

/// The bytes of a contiguous CPU tensor.
pub fn bytes_of(t: &tch::Tensor) -> &[u8] {
    // SAFETY: a contiguous CPU tensor that outlives the returned slice (borrowed from it).
    unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, t.numel() * t.kind().elt_size_in_bytes()) }
}

/// Runs `op` `iters` times after a tenth as many warm-up runs; latencies in nanoseconds.
pub fn measure(iters: u64, mut op: impl FnMut() -> Result<()>) -> Result<Stats> {
    measure_timed(iters, || {
        let start = Instant::now();
        op()?;
        Ok(start.elapsed())
    })
}

/// [`measure`] for an operation that times the part of itself that counts (and leaves out
/// its clean-up).
pub fn measure_timed(iters: u64, mut op: impl FnMut() -> Result<Duration>) -> Result<Stats> {
    let mut h = Histogram::<u64>::new(3).context("histogram")?;
    for _ in 0..(iters / 10).max(2) {
        op()?;
    }
    for _ in 0..iters {
        h.record(op()?.as_nanos() as u64).context("histogram range")?;
    }
    Ok(Stats::of(&h))
}

/// Round trips against a raw peer that reads `up` bytes and answers `down` bytes.
pub fn raw(up: usize, down: usize, iters: u64) -> Result<Stats> {
    let peer = Spawned::start(&["bench-peer", "--up", &up.to_string(), "--down", &down.to_string()])?;
    let mut stream = TcpStream::connect(peer.addr)?;
    stream.set_nodelay(true)?;
    let out = vec![3u8; up];
    let mut back = vec![0u8; down];
    measure(iters, || {
        stream.write_all(&out)?;
        stream.read_exact(&mut back)?;
        Ok(())
    })
}

fn today() -> String {
    std::process::Command::new("date")
        .arg("+%Y-%m-%d %H:%M %Z")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map_or_else(|| "date unknown".into(), |s| s.trim().to_owned())
}

/// CPU model, core count, memory and kernel, read from /proc.
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split(':').nth(1)))
        .map_or("unknown CPU", str::trim);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{cores} × {model}, {} memory, Linux {}", ByteSize(mem_kib * 1024), kernel.trim())
}

/// Appends a section for `djinn bench <bench>` to the markdown file at `path`.
pub fn append_section(path: &Path, bench: &str, notes: &[String], table: &str) -> Result<()> {
    let command: Vec<String> = std::env::args().collect();
    let mut text = format!(
        "\n### `djinn bench {bench}` — {}\n\nCommand: `{}`  \nMachine: {}",
        today(),
        command.join(" "),
        machine()
    );
    for note in notes {
        text.push_str("  \n");
        text.push_str(note);
    }
    text.push_str("\n\n");
    text.push_str(table.trim_end());
    text.push('\n');
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .with_context(|| format!("cannot append to {}", path.display()))?;
    println!("appended to {}", path.display());
    Ok(())
}
