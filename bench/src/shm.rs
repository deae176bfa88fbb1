//! `djinn bench shm`: a round trip between this process and a child process started by exec
//! through a pair of shared-memory rings (`djinn-shm`, what the node and an executor process
//! speak through), against the same round trip over a Unix socketpair inherited the same way.
//!
//! The child echoes each message whole; both ways copy the bytes in and out once (into the ring
//! and out of it, or into the kernel and out of it). The ring is measured with its consumers
//! polling for a while before they sleep on the futex and with no polling at all (every message
//! a futex wake-up), since a node with few cores may not spare one to poll.

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use djinn_memory::ByteSize;
use djinn_shm::{Consumer, Producer, Region, RingError};

use crate::report::{Stats, append_section, measure};

/// Where the child finds the region, or its end of the socketpair.
const CHILD_FD: i32 = 3;
/// How long either side waits for its peer before it gives up.
const PEER_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Args, Debug)]
pub struct ShmArgs {
    /// Message sizes.
    #[arg(long, value_delimiter = ',', default_value = "64,4KiB,64KiB,1MiB")]
    sizes: Vec<ByteSize>,
    /// How long each side of the ring polls before it sleeps, in microseconds (one row each).
    #[arg(long, value_delimiter = ',', default_value = "0,50")]
    spin_us: Vec<u64>,
    /// Bytes moved one way per measurement (iterations = this / size, at most --max-iters).
    #[arg(long, default_value = "2GiB")]
    volume: ByteSize,
    #[arg(long, default_value_t = 20000)]
    max_iters: u64,
    /// Append the table, the command and the machine to this markdown file.
    #[arg(long)]
    results: Option<PathBuf>,
}

/// The child's side: echoes what comes until an empty message (ring) or the end of the stream
/// (socket). Not for direct use.
#[derive(Args, Debug)]
pub struct ShmPeerArgs {
    /// Bytes of each ring (the region holds two: to the child, then back); absent: the
    /// descriptor is a socket.
    #[arg(long)]
    ring: Option<usize>,
    #[arg(long, default_value_t = 0)]
    spin_us: u64,
    /// Bytes of each message over the socket.
    #[arg(long, default_value_t = 0)]
    size: usize,
}

/// Kills and reaps the child when the measurement ends, however it ends.
struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_peer(fd: std::os::fd::BorrowedFd<'_>, args: &[String]) -> Result<Peer> {
    let exe = std::env::current_exe().context("cannot find the djinn binary")?;
    let mut command = Command::new(exe);
    command.arg("bench-shm-peer").args(args);
    let child = djinn_shm::spawn_with_fds(&mut command, &[(fd, CHILD_FD)]).context("cannot start the peer")?;
    Ok(Peer(child))
}

fn send(to: &mut Producer, message: &[u8]) -> Result<()> {
    loop {
        match to.push(message) {
            Ok(()) => return Ok(()),
            Err(RingError::Full { .. }) => to.wait_for_room(PEER_TIMEOUT),
            Err(e) => return Err(e.into()),
        }
    }
}

fn receive(from: &mut Consumer, out: &mut Vec<u8>) -> Result<()> {
    for _ in 0..2 {
        if from.pop(out)? {
            return Ok(());
        }
        from.wait(PEER_TIMEOUT);
    }
    if from.pop(out)? {
        return Ok(());
    }
    bail!("the peer sent nothing within {PEER_TIMEOUT:?}")
}

/// Bytes of a ring that holds a few messages of `size`, on a cache line.
fn ring_bytes(size: usize) -> usize {
    djinn_shm::ring_len(size, 4).next_multiple_of(64)
}

fn over_rings(size: usize, spin: Duration, iters: u64) -> Result<Stats> {
    let len = ring_bytes(size);
    let region = Arc::new(Region::create("djinn-bench-shm", (2 * len).max(4096))?);
    let mut to_peer = Producer::create(&region, 0, len)?;
    let mut from_peer = Consumer::create(&region, len, len)?;
    from_peer.set_spin(spin);
    let args = [format!("--ring={len}"), format!("--spin-us={}", spin.as_micros())];
    let _peer = start_peer(region.fd(), &args)?;
    let message = vec![7u8; size];
    let mut back = Vec::with_capacity(size);
    let stats = measure(iters, || {
        send(&mut to_peer, &message)?;
        receive(&mut from_peer, &mut back)?;
        Ok(())
    })?;
    if back != message {
        bail!("the peer echoed {} bytes that differ from the {} sent", back.len(), message.len());
    }
    send(&mut to_peer, &[])?;
    Ok(stats)
}

fn over_socketpair(size: usize, iters: u64) -> Result<Stats> {
    let (mut ours, theirs) = UnixStream::pair()?;
    let _peer = start_peer(theirs.as_fd(), &[format!("--size={size}")])?;
    drop(theirs);
    let message = vec![7u8; size];
    let mut back = vec![0u8; size];
    let stats = measure(iters, || {
        ours.write_all(&message)?;
        ours.read_exact(&mut back)?;
        Ok(())
    })?;
    if back != message {
        bail!("the peer echoed bytes that differ from those sent");
    }
    Ok(stats)
}

pub fn run(args: ShmArgs) -> Result<()> {
    let mut table = String::from(
        "| size | path | p50 µs | p99 µs | p999 µs | socketpair p50 µs | p99 µs | p999 µs | p50 ratio (ring/socketpair) |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for size in &args.sizes {
        let size = usize::try_from(size.0).context("size")?;
        let iters = (args.volume.0 / size.max(1) as u64).clamp(200, args.max_iters.max(200));
        let base = over_socketpair(size, iters)?;
        for &spin_us in &args.spin_us {
            let ring = over_rings(size, Duration::from_micros(spin_us), iters)?;
            let line = format!(
                "| {} | rings, polling {spin_us} µs | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | **{:.2}** |\n",
                ByteSize(size as u64),
                ring.p50,
                ring.p99,
                ring.p999,
                base.p50,
                base.p99,
                base.p999,
                ring.p50 / base.p50,
            );
            print!("{line}");
            table.push_str(&line);
        }
    }
    println!("\n{table}");
    if let Some(path) = &args.results {
        let notes = ["Round trips of one message echoed by a child process started by exec; socketpair measured in the same run, before the rings of each size.".to_owned()];
        append_section(path, "shm", &notes, &table)?;
    }
    Ok(())
}

pub fn run_peer(args: ShmPeerArgs) -> Result<()> {
    // SAFETY: `djinn bench shm` placed the descriptor there for this process to own, and
    // nothing else in this process uses it.
    let fd = unsafe { djinn_shm::inherited(CHILD_FD) }.context("no descriptor from the parent")?;
    let Some(len) = args.ring else {
        let mut stream = UnixStream::from(fd);
        let mut buf = vec![0u8; args.size];
        loop {
            match stream.read_exact(&mut buf) {
                Ok(()) => stream.write_all(&buf)?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    };
    let region = Arc::new(Region::open(fd)?);
    let mut from_parent = Consumer::attach(&region, 0, len)?;
    from_parent.set_spin(Duration::from_micros(args.spin_us));
    let mut to_parent = Producer::attach(&region, len, len)?;
    let mut buf = Vec::new();
    loop {
        receive(&mut from_parent, &mut buf)?;
        if buf.is_empty() {
            return Ok(());
        }
        send(&mut to_parent, &buf)?;
    }
}
