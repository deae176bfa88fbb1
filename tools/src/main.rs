//! `djinn`: run a node, talk to one, benchmark the data plane.

mod auth;
mod control;
mod drain;
mod executor;
mod node;
mod status;
mod up;

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use djinn_client::{Client, ClientOptions, DType, Transport};

use djinn_memory::ByteSize;
use djinn_node::gpu_check::GpuCheck;

#[derive(Parser, Debug)]
#[command(name = "djinn", version, about = "Run PyTorch work on the GPUs of other machines in the rack", long_about = None)]
struct Cli {
    /// Log filter (tracing's env-filter syntax), e.g. `info` or `djinn_dataplane=debug`.
    /// RUST_LOG overrides it.
    #[arg(long, global = true, default_value = "info")]
    log: String,
    /// Transport of the client commands (ping, put, get, ls, rm, stats): auto, rdma or tcp.
    #[arg(long, global = true, default_value = "auto")]
    transport: Transport,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve tensors and models on this host (prints `djinn node listening on ADDR` once bound).
    Node(node::NodeArgs),
    /// Everything for one machine in one process: the control plane and a node that joins it.
    /// Takes the flags of `node` (but --control) and prints `djinn control listening on ADDR`,
    /// then `djinn node listening on ADDR`.
    Up(up::UpArgs),
    /// The control plane: membership, placement and the HTTP API (prints `djinn control
    /// listening on ADDR` once bound).
    Control(control::ControlArgs),
    /// What a control plane knows: its nodes, models and sessions.
    Status(status::StatusArgs),
    /// Drain a node: nothing new is placed there, its sessions move to other nodes (node to
    /// node), its running requests finish; waits until it holds nothing.
    Drain(drain::DrainArgs),
    /// What this host's GPUs can do for a node: CUDA discovery, device and pinned buffers, the
    /// staging copies from 1 KiB to --max-size, dma-buf export; one PASS/FAIL/SKIP line each.
    GpuCheck {
        /// The largest transfer of the staging checks (from 1 KiB up, ×64 each step, then this).
        #[arg(long, default_value = "1GiB")]
        max_size: ByteSize,
        /// The device to check.
        #[arg(long, default_value_t = 0)]
        ordinal: i32,
    },
    /// The principals and their tokens, kept in etcd for --auth-etcd.
    #[command(subcommand)]
    Tokens(auth::TokensCommand),
    /// Round trips to a node: prints each one and a summary.
    Ping {
        /// Node address, HOST:PORT.
        addr: String,
        /// Number of pings.
        #[arg(short, long, default_value_t = 5)]
        count: u32,
    },
    /// Store a file's bytes on a node as a named tensor.
    Put {
        addr: String,
        name: String,
        /// Element type: f16, bf16, f32, f64, i8, i16, i32, i64, u8, bool.
        #[arg(long)]
        dtype: DType,
        /// Dimensions, comma-separated (`2,3`); empty for a scalar. Default: the file's length
        /// in elements, one dimension.
        #[arg(long, value_delimiter = ',')]
        shape: Option<Vec<u64>>,
        /// File holding the raw little-endian elements.
        #[arg(long)]
        file: PathBuf,
    },
    /// Fetch a named tensor's bytes into a file and print its descriptor.
    Get {
        addr: String,
        name: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// List a node's tensors.
    Ls { addr: String },
    /// Delete a named tensor.
    Rm { addr: String, name: String },
    /// Print a node's counters.
    Stats { addr: String },
    /// Benchmarks; each prints p50/p99/p999 beside its baseline measured in the same run.
    #[command(subcommand)]
    Bench(djinn_bench::BenchCommand),
    /// A baseline peer for `djinn bench` (raw blocking sockets); not for direct use.
    #[command(hide = true)]
    BenchPeer(djinn_bench::PeerArgs),
    /// The child process of `djinn bench shm`; not for direct use.
    #[command(hide = true)]
    BenchShmPeer(djinn_bench::ShmPeerArgs),
    /// One tenant's executor process, started by its node (`--executor-processes`); not for
    /// direct use.
    #[command(hide = true)]
    Executor(executor::ExecutorArgs),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&cli.log))
        .context("bad --log filter")?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let transport = cli.transport;
    let connect = |addr: &str| {
        let options = ClientOptions { transport, ..ClientOptions::default() };
        Client::connect_with(addr, options).with_context(|| format!("cannot reach {addr}"))
    };
    match cli.command {
        Command::Node(mut args) => {
            // Watched while the node runs.
            let auth = args.auth.principals.authenticator()?;
            args.log = cli.log;
            node::run(args, auth.as_ref().map(|(a, _)| std::sync::Arc::clone(a)))
        }
        Command::Up(mut args) => {
            args.node.log = cli.log;
            up::run(args)
        }
        Command::Control(args) => control::run(args),
        Command::Status(args) => status::run(args),
        Command::Drain(args) => drain::run(args),
        Command::Tokens(command) => auth::tokens(command),
        Command::GpuCheck { max_size, ordinal } => {
            djinn_node::gpu_check::run(GpuCheck { max_size, ordinal }, &mut |line| println!("{line}"))
        }
        Command::Ping { addr, count } => {
            let mut client = connect(&addr)?;
            let node = client.node();
            println!(
                "{addr}: {} (protocol {}, transport {}, max payload {})",
                node.agent,
                node.protocol_version,
                client.transport(),
                ByteSize(node.max_payload)
            );
            let mut times = Vec::new();
            for i in 0..count {
                let rtt = client.ping()?;
                println!("pong {i}: {:.1} µs", rtt.as_secs_f64() * 1e6);
                times.push(rtt);
            }
            times.sort();
            if let (Some(min), Some(max)) = (times.first(), times.last()) {
                let median = times[times.len() / 2];
                println!("{count} pings: min {:.1} µs, median {:.1} µs, max {:.1} µs", us(*min), us(median), us(*max));
            }
            Ok(())
        }
        Command::Put { addr, name, dtype, shape, file } => {
            let bytes = std::fs::read(&file).with_context(|| format!("cannot read {}", file.display()))?;
            let shape = match shape {
                Some(shape) => shape,
                None => {
                    if !(bytes.len() as u64).is_multiple_of(dtype.size()) {
                        bail!("{} bytes is not a whole number of {dtype} elements", bytes.len());
                    }
                    vec![bytes.len() as u64 / dtype.size()]
                }
            };
            let mut client = connect(&addr)?;
            let replaced = client.put(&name, dtype, &shape, &bytes)?;
            println!(
                "stored {name} ({dtype}{shape:?}, {} bytes){}",
                bytes.len(),
                if replaced { ", replacing the old one" } else { "" }
            );
            Ok(())
        }
        Command::Get { addr, name, out } => {
            let mut client = connect(&addr)?;
            let tensor = client.get(&name)?;
            std::fs::write(&out, tensor.bytes()).with_context(|| format!("cannot write {}", out.display()))?;
            println!("{name}: {} → {}", tensor.desc, out.display());
            Ok(())
        }
        Command::Ls { addr } => {
            let mut client = connect(&addr)?;
            for entry in client.list()? {
                println!("{}\t{}", entry.name, entry.tensor);
            }
            Ok(())
        }
        Command::Rm { addr, name } => {
            let mut client = connect(&addr)?;
            client.delete(&name)?;
            println!("deleted {name}");
            Ok(())
        }
        Command::Stats { addr } => {
            let mut client = connect(&addr)?;
            for (name, value) in client.stats()? {
                println!("{name}\t{value}");
            }
            Ok(())
        }
        Command::Bench(command) => djinn_bench::run(command),
        Command::BenchPeer(args) => djinn_bench::run_peer(args),
        Command::BenchShmPeer(args) => djinn_bench::run_shm_peer(args),
        Command::Executor(args) => executor::run(args),
    }
}

fn us(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The async runtime of the control plane and of the commands that talk to etcd.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("djinn-control")
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}
