//! Benchmarks of the data plane. Each measures its baseline in the same run, on the same
//! machine, and prints p50/p99/p999 beside it with the ratio: these machines are noisy, ratios
//! are what carry from one run to the next.

mod agents;
mod drain;
mod execute;
mod fair;
mod moves;
mod placement;
mod plan;
mod push;
mod rdma;
mod report;
mod resume;
mod shm;
mod soak;
mod stream;
mod tcp;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, ChildStdout, Command, Stdio};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};

pub use agents::AgentsArgs;
pub use drain::DrainArgs;
pub use execute::ExecuteArgs;
pub use fair::FairArgs;
pub use moves::MoveArgs;
pub use placement::PlacementArgs;
pub use plan::PlanArgs;
pub use push::PushArgs;
pub use rdma::RdmaArgs;
pub use resume::ResumeArgs;
pub use shm::{ShmArgs, ShmPeerArgs, run_peer as run_shm_peer};
pub use soak::SoakArgs;
pub use stream::StreamArgs;
pub use tcp::TcpArgs;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Put and get round trips over TCP, 8 B to 256 MiB, against raw blocking sockets between
    /// two processes, for each TCP backend of the node.
    Tcp(TcpArgs),
    /// Remote execution of a TinyMLP and a 64 MiB identity against the local libtorch forward
    /// and raw sockets.
    Execute(ExecuteArgs),
    /// One tenant flooding a node from many connections while another measures its executes,
    /// against that tenant's latency on the idle node.
    Fair(FairArgs),
    /// Round trips over RDMA, 2 B to 64 MiB, beside perftest on the same device (run it in
    /// the soft-RoCE VM: scripts/softroce-vm.sh).
    Rdma(RdmaArgs),
    /// A model three times the device budget streamed through the ring, against the same model
    /// resident, naive synchronous copies before each block, and the raw copy rate.
    Stream(StreamArgs),
    /// The control plane's placement decision with 1,000 nodes and 10,000 models, against the
    /// simplest placer (most free memory) over the same nodes.
    Placement(PlacementArgs),
    /// What planning a graph run costs (its pass over meta tensors before it runs): runs with
    /// a plan kept and with a new plan each time, against the same runs unplanned.
    Plan(PlanArgs),
    /// A node pushing a kept tensor into another node's memory, 64 KiB to 256 MiB, against raw
    /// loopback TCP and (on a GPU) the device-to-host copy.
    Push(PushArgs),
    /// A session's state moved node to node, 64 KiB to 256 MiB, against raw loopback TCP (or
    /// ib_write_bw), and a step sent behind a move against the move's own time.
    Move(MoveArgs),
    /// `djinn drain` of a node holding N sessions while clients step them: the steps' latency
    /// during the drain against before it, and the drain's time against raw loopback TCP.
    Drain(DrainArgs),
    /// N simulated LLM agents on the tiny transformer (Poisson arrivals, bursts of decode
    /// steps, exponential tool waits) sharing a session budget of 16: the most agents each
    /// session policy serves within a p99 bound, semantic against LRU in the same run.
    Agents(AgentsArgs),
    /// Resuming a request parked at a breakpoint (its activation kept on the node) against a
    /// plain execute of the remaining blocks with the activation sent.
    Resume(ResumeArgs),
    /// Many clients of two tenants with random valid and invalid requests and random
    /// disconnects against two nodes, one killed and restarted: the share of valid requests to
    /// the other that succeeded, wrong results, untyped failures and its memory afterwards.
    Soak(SoakArgs),
    /// A message echoed by a child process through shared-memory rings (how the node speaks
    /// to executor processes), 64 B to 1 MiB, against a Unix socketpair to the same child.
    Shm(ShmArgs),
}

pub fn run(command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Tcp(args) => tcp::run(args),
        BenchCommand::Execute(args) => execute::run(args),
        BenchCommand::Fair(args) => fair::run(args),
        BenchCommand::Rdma(args) => rdma::run(args),
        BenchCommand::Stream(args) => stream::run(args),
        BenchCommand::Placement(args) => placement::run(args),
        BenchCommand::Plan(args) => plan::run(args),
        BenchCommand::Push(args) => push::run(args),
        BenchCommand::Move(args) => moves::run(args),
        BenchCommand::Drain(args) => drain::run(args),
        BenchCommand::Agents(args) => agents::run(args),
        BenchCommand::Resume(args) => resume::run(args),
        BenchCommand::Soak(args) => soak::run(args),
        BenchCommand::Shm(args) => shm::run(args),
    }
}

/// The raw baseline's peer: accepts one connection, then reads exactly `up` bytes and answers
/// with `down` bytes, again and again, from buffers allocated and touched once.
#[derive(Args, Debug)]
pub struct PeerArgs {
    /// Bytes read per round.
    #[arg(long)]
    up: usize,
    /// Bytes answered per round.
    #[arg(long)]
    down: usize,
}

pub fn run_peer(args: PeerArgs) -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("listening on {}", listener.local_addr()?);
    std::io::stdout().flush()?;
    let (mut stream, _) = listener.accept()?;
    stream.set_nodelay(true)?;
    let mut up = vec![1u8; args.up];
    let down = vec![2u8; args.down];
    loop {
        match stream.read_exact(&mut up) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        stream.write_all(&down)?;
    }
}

/// A child process (a node or a baseline peer) that prints its address on its first line of
/// output and is killed when dropped.
pub(crate) struct Spawned {
    child: Child,
    _stdout: BufReader<ChildStdout>,
    pub addr: SocketAddr,
}

impl Spawned {
    pub fn start(args: &[&str]) -> Result<Self> {
        let exe = std::env::current_exe().context("cannot find the djinn binary")?;
        let mut child = Command::new(exe)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot start djinn {}", args.join(" ")))?;
        let mut stdout = BufReader::new(child.stdout.take().context("no stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let Some(addr) = line.split_whitespace().last().and_then(|a| a.parse().ok()) else {
            let _ = child.kill();
            bail!("djinn {} printed {line:?} instead of its address", args.join(" "));
        };
        Ok(Self { child, _stdout: stdout, addr })
    }
}

impl Spawned {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
