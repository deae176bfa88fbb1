//! `djinn bench fair`: one tenant floods a node from many connections while another measures its
//! latency, against the same tenant's latency on the idle node in the same run. Both run the
//! same model on the same input, so that a job of the flood costs what the probe's own does:
//! with work served by tenant in turn (a tenant with nothing queued first) the probe waits for
//! the flood's job running on the worker besides its own, where a single queue made it wait
//! behind all of them.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use djinn_client::{Client, ClientOptions, DType, TensorRef, Value};
use djinn_executor::tch;
use tch::nn::Module;
use tch::{Device, Kind, Tensor, nn};

use crate::Spawned;
use crate::execute::archive;
use crate::report::{Stats, append_section, bytes_of, measure};

#[derive(Args, Debug)]
pub struct FairArgs {
    /// Timed executes of the probing tenant, idle and under the flood.
    #[arg(long, default_value_t = 400)]
    iters: u64,
    /// Connections the flooding tenant keeps busy.
    #[arg(long, default_value_t = 8)]
    flood: usize,
    /// The node's worker threads.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// The model: Linear(width, width) then GELU, on a [rows, width] input (by default about
    /// half a millisecond of one core: the node's worker, not its poller or the clients, is
    /// what the tenants share).
    #[arg(long, default_value_t = 512)]
    width: i64,
    #[arg(long, default_value_t = 64)]
    rows: i64,
    /// Append the table, the command and the machine to this markdown file.
    #[arg(long)]
    results: Option<PathBuf>,
}

const FLOOD: &str = "flooding-tenant-token-01";
const PROBE: &str = "probing-tenant-token-012";

/// A client of `token`'s tenant; `spin`: how long it polls for a reply before it sleeps (the
/// flood's clients do not, so that on a machine of few cores they leave the node its CPU).
fn connect(addr: std::net::SocketAddr, token: &str, spin: Duration) -> Result<Client> {
    let options =
        ClientOptions { token: token.into(), timeout: Some(Duration::from_secs(30)), spin, ..Default::default() };
    Ok(Client::connect_with(addr, options)?)
}

pub fn run(args: FairArgs) -> Result<()> {
    tch::manual_seed(0);
    let _grad = tch::no_grad_guard();
    let mut vs = nn::VarStore::new(Device::Cpu);
    let linear = nn::linear(vs.root() / "fc", args.width, args.width, Default::default());
    vs.freeze();
    let x = Tensor::randn([args.rows, args.width], (Kind::Float, Device::Cpu));
    let model = archive("layer", std::slice::from_ref(&x), &mut |xs| vec![linear.forward(&xs[0]).gelu("none")])?;

    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.json");
    let principal =
        |name: &str, token: &str| format!(r#"{{"name": "{name}", "tokens": ["{token}"], "rights": ["torchscript"]}}"#);
    std::fs::write(
        &tokens,
        format!(r#"{{"principals": [{}, {}]}}"#, principal("flood", FLOOD), principal("probe", PROBE)),
    )?;
    let workers = args.workers.to_string();
    let auth = tokens.display().to_string();
    let node = Spawned::start(&[
        "node",
        "--listen",
        "127.0.0.1:0",
        "--log",
        "warn",
        "--device",
        "cpu",
        "--workers",
        &workers,
        "--auth-file",
        &auth,
    ])?;
    let mut probe = connect(node.addr, PROBE, ClientOptions::default().spin)?;
    let fingerprint = probe.register_model(std::slice::from_ref(&model), |_, _| {})?.fingerprint;
    connect(node.addr, FLOOD, Duration::ZERO)?.register_model(std::slice::from_ref(&model), |_, _| {})?;
    let shape = [args.rows as u64, args.width as u64];
    let input = [TensorRef { dtype: DType::F32, shape: &shape, bytes: bytes_of(&x) }];
    let mut probe_once = || probe.execute(&fingerprint, &[Value::Tensor(0)], &input).map(drop).context("the probe");
    for _ in 0..20 {
        probe_once()?;
    }
    let idle = measure(args.iters, &mut probe_once)?;

    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let threads = (0..args.flood)
        .map(|_| {
            let (stop, done, bytes, addr) = (Arc::clone(&stop), Arc::clone(&done), bytes_of(&x).to_vec(), node.addr);
            std::thread::spawn(move || -> Result<()> {
                let mut client = connect(addr, FLOOD, Duration::ZERO)?;
                let input = [TensorRef { dtype: DType::F32, shape: &shape, bytes: &bytes }];
                while !stop.load(Ordering::Relaxed) {
                    client.execute(&fingerprint, &[Value::Tensor(0)], &input)?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect::<Vec<_>>();
    // Every flooding connection has requests in the queue.
    while done.load(Ordering::Relaxed) < 4 * args.flood as u64 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let started = (Instant::now(), done.load(Ordering::Relaxed));
    // And how many of the flood's executes finished while each of the probe's ran.
    let mut overtaken = Vec::with_capacity(args.iters as usize);
    let loaded = measure(args.iters, || {
        let before = done.load(Ordering::Relaxed);
        probe_once()?;
        overtaken.push(done.load(Ordering::Relaxed) - before);
        Ok(())
    })?;
    overtaken.sort_unstable();
    let at = |q: f64| overtaken[((overtaken.len() - 1) as f64 * q) as usize];
    let flood_rate = (done.load(Ordering::Relaxed) - started.1) as f64 / started.0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().map_err(|_| anyhow::anyhow!("a flooding thread panicked"))??;
    }
    let probe_rate = args.iters as f64 / (loaded.p50 * args.iters as f64 / 1e6);

    let mut table = String::new();
    let us = |s: &Stats| format!("{:.1} | {:.1} | {:.1}", s.p50, s.p99, s.p999);
    writeln!(table, "| the probing tenant's executes | p50 µs | p99 µs | p999 µs |\n|---|---|---|---|")?;
    writeln!(table, "| idle node | {} |", us(&idle))?;
    writeln!(table, "| another tenant flooding from {} connections | {} |", args.flood, us(&loaded))?;
    writeln!(
        table,
        "\nUnder the flood / idle: p50 **{:.2}×**, p99 **{:.2}×** (aim ≤ 2×: the probe's execute waits for the \
         one of the flood's that is running, which costs what its own does); the flood ran {flood_rate:.0} \
         executes/s while the probe ran about {probe_rate:.0}/s.",
        loaded.p50 / idle.p50,
        loaded.p99 / idle.p99,
    )?;
    writeln!(
        table,
        "The flood's executes that finished while one of the probe's ran: p50 {}, p99 {}, most {} (the one \
         running on each worker when the probe's came, give or take one counted late).",
        at(0.5),
        at(0.99),
        at(1.0)
    )?;
    print!("{table}");
    if let Some(path) = &args.results {
        let notes = [format!(
            "Linear({w}, {w}) + GELU on [{}, {w}] f32 (TorchScript), both tenants; {} worker(s), {} flooding \
             connections, {} timed executes each way",
            args.rows,
            args.workers,
            args.flood,
            args.iters,
            w = args.width
        )];
        append_section(path, "fair", &notes, &table)?;
    }
    Ok(())
}
