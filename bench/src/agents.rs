//! `djinn bench agents`: N simulated LLM agents share one node's session budget. Each arrives
//! (a Poisson process), opens a session of the tiny transformer with an empty KV cache, and
//! alternates bursts of decode steps with tool waits drawn from an exponential distribution
//! until the trial ends (`--duration` after the last arrival),
//! telling the node of each wait (IO_WAIT with the wait's length: the simulated tool's latency
//! is known to its agent). The budget holds `--budget-sessions` sessions' state.
//!
//! The baseline is one agent alone with the same bursts and waits, measured in the same run;
//! a trial passes when no request fails and its step p99 is within `--bound` times the
//! baseline's p99 (like for like: the first step of a burst finds the caches cold, loaded or
//! not). For each policy the agent count grows until a trial fails; the largest count that
//! passed is the policy's capacity. Both policies see the same arrivals and waits (one seed),
//! each trial on a fresh node.
//!
//! The whole is run for each of `--formats`: the decoder as TorchScript (its state the client
//! gives at open) and as a graph (its state the node makes from the graph's buffers and writes
//! in place), with the same weights, arrivals and waits.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Args;
use djinn_client::{Client, DType, Handle, Output, Signal, TensorRef, Value};
use djinn_executor::Device;
use djinn_executor::tch;
use djinn_memory::ByteSize;
use hdrhistogram::Histogram;
use tch::jit::CModule;
use tch::{IValue, Kind, Tensor};

use crate::Spawned;
use crate::report::{Stats, append_section, bytes_of, measure};
use djinn_sync::Locked;

#[derive(Args, Debug)]
pub struct AgentsArgs {
    /// The model's context, the positions of each session's KV cache: its state is 2 layers ×
    /// (keys, values) × 4 heads × this × 16 f32.
    #[arg(long, default_value_t = 2048)]
    context: i64,
    /// Sessions the session budget holds.
    #[arg(long, default_value_t = 16)]
    budget_sessions: u64,
    /// Decode steps per burst.
    #[arg(long, default_value_t = 16)]
    burst: u32,
    /// Seconds the agents keep alternating once the last has arrived.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Mean tool wait, milliseconds (exponentially distributed).
    #[arg(long, default_value_t = 1000.0)]
    tool_wait_ms: f64,
    /// Mean time between two agents' arrivals, milliseconds (exponentially distributed).
    #[arg(long, default_value_t = 20.0)]
    arrival_ms: f64,
    /// The p99 step latency allowed, as a multiple of the unloaded agent's p99.
    #[arg(long, default_value_t = 5.0)]
    bound: f64,
    /// Seconds of the unloaded agent (its p99 is the baseline).
    #[arg(long, default_value_t = 30.0)]
    unloaded_duration: f64,
    /// Agent counts tried in turn for each policy, up to the first that fails.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64,128,192,256,384")]
    agents: Vec<usize>,
    /// Timed steps of the hot step (one session stepping without waits; fewer than the context).
    #[arg(long, default_value_t = 1000)]
    iters: u64,
    /// Seed of the arrivals and waits.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The node's device: `auto`, `cpu` or `cuda:N`.
    #[arg(long, default_value = "auto", value_parser = djinn_executor::parse_device)]
    device: Device,
    /// The Python that makes the model (with torch; the package's own).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python"))]
    python: PathBuf,
    /// The script that writes the model (it imports the Python package's GPT example from
    /// beside it, as in this repository's layout).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/agents_model.py"))]
    model_script: PathBuf,
    /// The decoder's forms to run, in turn.
    #[arg(long, value_delimiter = ',', default_value = "torchscript,graph")]
    formats: Vec<Format>,
    /// Append the tables, the command and the machine to this markdown file.
    #[arg(long)]
    results: Option<PathBuf>,
}

const POLICIES: [&str; 2] = ["semantic", "lru"];

/// How the decoder reaches the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// A scripted CachedGPT: the client gives the empty cache and position at open.
    Torchscript,
    /// A graph whose buffers are the state: the node makes them at open, writes them in place.
    Graph,
}

impl Format {
    fn name(self) -> &'static str {
        match self {
            Self::Torchscript => "TorchScript",
            Self::Graph => "graph",
        }
    }
}

/// The decoder in one format.
struct Decoder<'a> {
    archive: &'a [u8],
    format: Format,
}

/// SplitMix64: the bench's reproducible random numbers.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Exponentially distributed with this mean.
    fn exponential(&mut self, mean: f64) -> f64 {
        // In (0, 1]: never ln(0).
        let u = ((self.next() >> 11) + 1) as f64 / (1u64 << 53) as f64;
        -mean * u.ln()
    }
}

/// The decoder, made by `bench/agents_model.py` (the Python package's `CachedGPT`: TorchScript
/// methods with several outputs cannot be traced from Rust): its TorchScript archive, its
/// graph container, and its KV cache's shape.
fn decoder(args: &AgentsArgs) -> Result<(Vec<u8>, Vec<u8>, Vec<i64>)> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("decoder.pt");
    let script = &args.model_script;
    let output = std::process::Command::new(&args.python)
        .arg(script)
        .arg(args.context.to_string())
        .arg(&path)
        .output()
        .with_context(|| format!("cannot run {} (see --python)", args.python.display()))?;
    ensure!(output.status.success(), "{} failed: {}", script.display(), String::from_utf8_lossy(&output.stderr));
    let shape = String::from_utf8_lossy(&output.stdout)
        .trim()
        .split(',')
        .map(|d| d.parse().with_context(|| format!("{} printed {d:?} for a dimension", script.display())))
        .collect::<Result<Vec<i64>>>()?;
    let graph = std::fs::read(dir.path().join("decoder.pt.graph"))?;
    Ok((std::fs::read(&path)?, graph, shape))
}

/// The argmax of a step's logits (f32 bytes).
fn argmax(logits: &[u8]) -> i64 {
    let values = logits.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    values.enumerate().fold((0, f32::NEG_INFINITY), |best, (i, v)| if v > best.1 { (i, v) } else { best }).0 as i64
}

/// One agent's session on the node.
struct Agent {
    client: Client,
    session: Handle,
    token: i64,
}

/// Every session's initial state: an empty KV cache (the bytes of a zero tensor, and its
/// shape), then position 0.
struct EmptyState<'a> {
    cache: &'a [u8],
    shape: Vec<u64>,
}

impl<'a> EmptyState<'a> {
    fn of(cache: &'a Tensor) -> Self {
        Self { cache: bytes_of(cache), shape: cache.size().iter().map(|&d| d as u64).collect() }
    }

    /// The state's bytes on the node: the cache and the position.
    fn bytes(&self) -> u64 {
        self.cache.len() as u64 + 8
    }
}

impl Agent {
    /// A session with an empty cache: given by the client for TorchScript, made by the node
    /// from a graph's buffers.
    fn open(
        node: std::net::SocketAddr,
        model: &djinn_client::Fingerprint,
        state: &EmptyState<'_>,
        format: Format,
    ) -> Result<Self> {
        let mut client = Client::connect(node)?;
        let position = 0i64.to_le_bytes();
        let given = [
            TensorRef { dtype: DType::F32, shape: &state.shape, bytes: state.cache },
            TensorRef { dtype: DType::I64, shape: &[1], bytes: &position },
        ];
        let given: &[TensorRef<'_>] = if format == Format::Graph { &[] } else { &given };
        let session = client.session_open(model, given, 0)?;
        Ok(Self { client, session, token: 0 })
    }

    /// One decode step, fed the last step's argmax; returns the output (the logits).
    fn step(&mut self) -> Result<Output> {
        let token = self.token.to_le_bytes();
        let input = [TensorRef { dtype: DType::I64, shape: &[1, 1], bytes: &token }];
        let output = self.client.session_step(self.session, &[Value::Tensor(0)], &input)?;
        self.token = argmax(output.tensor_bytes(0));
        Ok(output)
    }
}

/// The node for one measurement: a fresh process with the policy and the budgets.
fn node(args: &AgentsArgs, policy: &str, state: &EmptyState<'_>, agents: usize) -> Result<Spawned> {
    let state_bytes = state.bytes();
    let budget = (args.budget_sessions * state_bytes + state_bytes / 2).to_string();
    let pool = ((agents as u64 + 1) * state_bytes).max(64 << 20).to_string();
    let device = djinn_executor::device_name(args.device);
    let argv = ["node", "--listen", "127.0.0.1:0", "--device", &device, "--log", "warn", "--session-policy", policy];
    Spawned::start(&[&argv[..], &["--session-budget", &budget, "--session-host-pool", &pool]].concat())
}

struct Trial {
    format: Format,
    policy: &'static str,
    agents: usize,
    steps: u64,
    failures: u64,
    first_failure: Option<String>,
    stats: Stats,
    swaps_out: u64,
    swaps_in: u64,
    restores_ahead: u64,
}

impl Trial {
    fn within(&self, bound_us: f64) -> bool {
        self.failures == 0 && self.stats.p99 <= bound_us
    }
}

/// What a trial's agents share: the step latencies and the failures.
struct Record {
    latencies: Histogram<u64>,
    failures: u64,
    first_failure: Option<String>,
}

impl Record {
    fn fail(&mut self, e: &anyhow::Error) {
        self.failures += 1;
        self.first_failure.get_or_insert_with(|| format!("{e:#}"));
    }
}

/// `agents` agents on a fresh node under `policy`, alternating until `duration` after the last
/// arrival.
fn trial(
    args: &AgentsArgs,
    (decoder, state): (&Decoder<'_>, &EmptyState<'_>),
    policy: &'static str,
    agents: usize,
    duration: f64,
) -> Result<Trial> {
    let node = node(args, policy, state, agents)?;
    let model = Client::connect(node.addr)?.register_model(&[decoder.archive], |_, _| {})?.fingerprint;
    let format = decoder.format;
    // The node's first runs of a model are TorchScript's profiling runs, tens of milliseconds:
    // warm-up, not load.
    let mut warm_up = Agent::open(node.addr, &model, state, format)?;
    for _ in 0..args.burst {
        warm_up.step()?;
    }
    warm_up.client.session_close(warm_up.session)?;
    let record =
        Mutex::new(Record { latencies: Histogram::new(3).context("histogram")?, failures: 0, first_failure: None });
    let mut rng = Rng(args.seed);
    let mut arrival = 0.0;
    let arrivals: Vec<Duration> = (0..agents)
        .map(|_| {
            arrival += rng.exponential(args.arrival_ms);
            Duration::from_secs_f64(arrival / 1e3)
        })
        .collect();
    let start = Instant::now();
    let end = start + arrivals.last().copied().unwrap_or_default() + Duration::from_secs_f64(duration);
    std::thread::scope(|s| {
        for (i, at) in arrivals.iter().enumerate() {
            let (record, model) = (&record, &model);
            let mut rng = Rng(args.seed ^ ((i as u64 + 1) << 32));
            s.spawn(move || {
                std::thread::sleep(at.saturating_sub(start.elapsed()));
                let mut run = || -> Result<()> {
                    let mut agent = Agent::open(node.addr, model, state, format)?;
                    let mut latencies = Vec::new();
                    // An agent whose next burst would not fit in its context leaves.
                    while latencies.len() as i64 + i64::from(args.burst) <= args.context {
                        for _ in 0..args.burst {
                            let started = Instant::now();
                            agent.step()?;
                            latencies.push(started.elapsed());
                        }
                        let wait = Duration::from_secs_f64(rng.exponential(args.tool_wait_ms) / 1e3);
                        if Instant::now() + wait > end {
                            break;
                        }
                        let signal = Signal::IoWait { resume_in_ms: Some(wait.as_millis() as u32) };
                        agent.client.session_signal(agent.session, signal)?;
                        std::thread::sleep(wait);
                    }
                    agent.client.session_close(agent.session)?;
                    let mut record = record.locked();
                    for l in latencies {
                        record.latencies.record(l.as_nanos() as u64)?;
                    }
                    Ok(())
                };
                if let Err(e) = run() {
                    record.locked().fail(&e);
                }
            });
        }
    });
    let counters: std::collections::HashMap<String, u64> = Client::connect(node.addr)?.stats()?.into_iter().collect();
    let record = record.into_inner().unwrap_or_else(|e| e.into_inner());
    let stats = Stats::of(&record.latencies);
    Ok(Trial {
        format,
        policy,
        agents,
        steps: record.latencies.len(),
        failures: record.failures,
        first_failure: record.first_failure,
        stats,
        swaps_out: counters.get("session_swaps_out").copied().unwrap_or(0),
        swaps_in: counters.get("session_swaps_in").copied().unwrap_or(0),
        restores_ahead: counters.get("session_restores_ahead").copied().unwrap_or(0),
    })
}

/// Runs the first steps of a session on the node and of the TorchScript decoder in this
/// process, on the node's device: their logits must be equal, bit for bit for TorchScript on a
/// CPU, else within float32 rounding (the graph: the same kernels, called by another runner; a
/// GPU: cuBLAS picks its kernels per process). Returns the hot step: p50/p99 of
/// `iters` steps of that one session, its state resident and in the CPU's caches.
fn check_and_time_hot_step(args: &AgentsArgs, script: &[u8], decoder: &Decoder<'_>, cache: &Tensor) -> Result<Stats> {
    let device = args.device;
    let local = CModule::load_data_on_device(&mut &script[..], device).context("the decoder does not load here")?;
    let state = EmptyState::of(cache);
    let node = node(args, "lru", &state, 1)?;
    let fingerprint = Client::connect(node.addr)?.register_model(&[decoder.archive], |_, _| {})?.fingerprint;
    let mut agent = Agent::open(node.addr, &fingerprint, &state, decoder.format)?;
    let (mut local_cache, mut local_position) = (cache.to(device), Tensor::from_slice(&[0i64]).to(device));
    for i in 0..4 {
        let token = Tensor::from_slice(&[agent.token]).view([1, 1]).to(device);
        let out = local.forward_is(&[IValue::from(token), IValue::from(local_cache), IValue::from(local_position)])?;
        let IValue::Tuple(mut out) = out else { anyhow::bail!("the decoder returned no tuple") };
        let (Some(IValue::Tensor(position)), Some(IValue::Tensor(next)), Some(IValue::Tensor(logits))) =
            (out.pop(), out.pop(), out.pop())
        else {
            anyhow::bail!("the decoder returned something else than (logits, cache, position)")
        };
        (local_cache, local_position) = (next, position);
        let logits = logits.to(tch::Device::Cpu).contiguous();
        let remote = agent.step()?;
        let same = match decoder.format {
            Format::Torchscript if device == tch::Device::Cpu => remote.tensor_bytes(0) == bytes_of(&logits),
            _ => {
                let got = Tensor::from_data_size(remote.tensor_bytes(0), &logits.size(), Kind::Float);
                got.allclose(&logits, 1e-5, 1e-6, false)
            }
        };
        ensure!(same, "step {i}: the node's {} logits differ from this process's", decoder.format.name());
    }
    measure(args.iters, || agent.step().map(drop))
}

fn print_trial(t: &Trial, verdict: &str) {
    println!(
        "{:>8} {:>4} agents: {} steps, p50 {:.0} µs, p99 {:.0} µs, {} failures, swaps out/in {}/{}, restored ahead {}{verdict}",
        t.policy, t.agents, t.steps, t.stats.p50, t.stats.p99, t.failures, t.swaps_out, t.swaps_in, t.restores_ahead,
    );
    if let Some(e) = &t.first_failure {
        println!("         first failure: {e}");
    }
}

pub fn run(args: AgentsArgs) -> Result<()> {
    ensure!(args.context > 0 && args.burst > 0, "--context and --burst must be positive");
    // The hot step's session takes one position per step, its warm-up and check included.
    ensure!(args.iters + args.iters / 10 + 6 < args.context as u64, "--iters must stay below --context");
    let _no_grad = tch::no_grad_guard();
    let (script, graph, shape) = decoder(&args)?;
    let cache = Tensor::zeros(&shape, (Kind::Float, tch::Device::Cpu));
    let state = EmptyState::of(&cache);
    let state_bytes = state.bytes();
    println!(
        "tiny transformer, context of {} tokens: a KV cache of {} per session, a budget of {} sessions",
        args.context,
        ByteSize(state_bytes),
        args.budget_sessions
    );
    let mut table = String::new();
    let mut summary = Vec::new();
    for &format in &args.formats {
        let archive = match format {
            Format::Torchscript => &script,
            Format::Graph => &graph,
        };
        let decoder = Decoder { archive, format };
        let (rows, line) = run_format(&args, &script, &decoder, &cache, &state)?;
        table.push_str(&rows);
        summary.push(line);
    }
    table.push_str(&summary.join("  \n"));
    table.push('\n');
    print!("{table}");
    if let Some(path) = &args.results {
        let notes = [format!(
            "The GPT example's tiny transformer (vocabulary 97, width 64, 4 heads, 2 layers) with a context of {} tokens, its KV cache {} per session; budget {} sessions; bursts of {} steps alternating for {} s after the last arrival, tool waits exponential with mean {} ms (announced to the node), arrivals Poisson with mean gap {} ms; device {}; formats {}",
            args.context,
            ByteSize(state_bytes),
            args.budget_sessions,
            args.burst,
            args.duration,
            args.tool_wait_ms,
            args.arrival_ms,
            djinn_executor::device_name(args.device),
            args.formats.iter().map(|f| f.name()).collect::<Vec<_>>().join(", ")
        )];
        append_section(path, "agents", &notes, &table)?;
    }
    Ok(())
}

/// The hot step, the unloaded agent and the trials of each policy, for one format: the table's
/// rows and the summary line.
fn run_format(
    args: &AgentsArgs,
    script: &[u8],
    decoder: &Decoder<'_>,
    cache: &Tensor,
    state: &EmptyState<'_>,
) -> Result<(String, String)> {
    let name = decoder.format.name();
    let hot = check_and_time_hot_step(args, script, decoder, cache)?;
    println!("{name}: hot step (one session, state resident and cached): p50 {:.1} µs, p99 {:.1} µs", hot.p50, hot.p99);

    // The unloaded agent: one agent alone, the same bursts and waits, its state resident. Its
    // p99 is what the loaded p99 is held to: the first step of a burst, after a second's wait,
    // finds the caches cold on any policy.
    let unloaded = trial(args, (decoder, state), "lru", 1, args.unloaded_duration)?;
    print_trial(&unloaded, " (unloaded)");
    ensure!(unloaded.failures == 0, "the unloaded agent failed");
    let bound_us = args.bound * unloaded.stats.p99;
    println!("{name}: the bound on a trial's p99: {bound_us:.0} µs");

    let mut trials = Vec::new();
    let mut capacity = [0usize; 2];
    for (p, policy) in POLICIES.into_iter().enumerate() {
        for &agents in &args.agents {
            let t = trial(args, (decoder, state), policy, agents, args.duration)?;
            let within = t.within(bound_us);
            print_trial(&t, if within { ": within the bound" } else { ": over" });
            trials.push(t);
            if !within {
                break;
            }
            capacity[p] = agents;
        }
    }

    let mut table = String::new();
    writeln!(
        table,
        "\n**{name}**\n\n| format | policy | agents | steps | p50 µs | p99 µs | p999 µs | failures | swaps out / in | restored ahead | p99 ≤ {bound_us:.0} µs |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )?;
    for t in std::iter::once(&unloaded).chain(&trials) {
        writeln!(
            table,
            "| {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {} | {} / {} | {} | {} |",
            t.format.name(),
            t.policy,
            t.agents,
            t.steps,
            t.stats.p50,
            t.stats.p99,
            t.stats.p999,
            t.failures,
            t.swaps_out,
            t.swaps_in,
            t.restores_ahead,
            if t.within(bound_us) { "yes" } else { "no" }
        )?;
    }
    writeln!(
        table,
        "\nThe first row is the unloaded agent (alone, {} s); the bound is {:.0}× its p99.",
        args.unloaded_duration, args.bound,
    )?;
    let ratio = if capacity[1] == 0 { f64::INFINITY } else { capacity[0] as f64 / capacity[1] as f64 };
    let line = format!(
        "{name}: hot step p50 {:.1} µs, p99 {:.1} µs, p999 {:.1} µs; largest agent count within the bound: semantic **{}**, LRU **{}**: **{ratio:.2}×** (aim ≥ 1.5×)",
        hot.p50, hot.p99, hot.p999, capacity[0], capacity[1]
    );
    Ok((table, line))
}
