//! `djinn bench resume`: resuming a request parked at a breakpoint, its activation kept on the
//! node, against the baseline a user without breakpoints has: a plain execute of the remaining
//! blocks (registered as a model of their own) with the activation sent from the client. Both
//! in the same run, through the same node, for a small and a large activation.
//!
//! Each timed call follows an untimed run of the first blocks (the run to the breakpoint, or
//! for the baseline an execute of those blocks as a model of their own), so that both find the
//! same weights in the CPU's caches.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, ensure};
use clap::Args;
use djinn_client::{Breakpoint, Client, DType, Fingerprint, Resumed, TensorRef, Value};
use djinn_executor::tch;
use tch::nn::Module;
use tch::{Device, Kind, Tensor, nn};

use crate::Spawned;
use crate::execute::archive;
use crate::report::{Stats, append_section, bytes_of, measure_timed};

#[derive(Args, Debug)]
pub struct ResumeArgs {
    /// Timed resumes (and timed executes) per activation size.
    #[arg(long, default_value_t = 500)]
    iters: u64,
    /// Blocks of the model (each Linear(width, width) then GELU).
    #[arg(long, default_value_t = 8)]
    blocks: usize,
    #[arg(long, default_value_t = 1024)]
    width: i64,
    /// Rows of the input, one activation size each (f32: rows × width × 4 bytes).
    #[arg(long, value_delimiter = ',', default_value = "4,256")]
    rows: Vec<i64>,
    /// The breakpoint: the run stops after this block (default: the middle).
    #[arg(long)]
    after: Option<usize>,
    /// The node's device: `cpu`, `cuda:N` or `auto` (parked activations stay in its memory).
    #[arg(long, default_value = "cpu", value_parser = djinn_executor::parse_device)]
    device: Device,
    /// Append the table, the command and the machine to this markdown file.
    #[arg(long)]
    results: Option<PathBuf>,
}

pub fn run(args: ResumeArgs) -> Result<()> {
    ensure!(args.blocks >= 2, "a breakpoint needs at least two blocks");
    let after = args.after.unwrap_or(args.blocks / 2 - 1);
    ensure!(after + 1 < args.blocks, "--after {after}: the last block is {}", args.blocks - 1);
    tch::manual_seed(0);
    let _grad = tch::no_grad_guard();
    let mut archives = Vec::with_capacity(args.blocks);
    let example = Tensor::randn([4, args.width], (Kind::Float, Device::Cpu));
    for i in 0..args.blocks {
        let mut vs = nn::VarStore::new(Device::Cpu);
        let linear = nn::linear(vs.root() / "fc", args.width, args.width, Default::default());
        vs.freeze();
        archives.push(archive(&format!("block{i}"), std::slice::from_ref(&example), &mut |xs| {
            vec![linear.forward(&xs[0]).gelu("none")]
        })?);
    }
    let device = djinn_executor::device_name(args.device);
    let node = Spawned::start(&["node", "--listen", "127.0.0.1:0", "--log", "warn", "--device", &device])?;
    let mut client = Client::connect(node.addr)?;
    let models = Models {
        whole: client.register_model(&archives, |_, _| {})?.fingerprint,
        head: client.register_model(&archives[..=after], |_, _| {})?.fingerprint,
        rest: client.register_model(&archives[after + 1..], |_, _| {})?.fingerprint,
    };

    let mut table = String::new();
    writeln!(table, "| activation | what | p50 µs | p99 µs | p999 µs |\n|---|---|---|---|---|")?;
    let mut ratios = Vec::new();
    for &rows in &args.rows {
        let x = Tensor::randn([rows, args.width], (Kind::Float, Device::Cpu));
        let row = Sizes { rows, width: args.width };
        let [kept, replaced, plain] = measure_size(&mut client, &models, &x, after, row, args.iters)?;
        let size = djinn_memory::ByteSize((rows * args.width * 4) as u64);
        let us = |s: &Stats| format!("{:.1} | {:.1} | {:.1}", s.p50, s.p99, s.p999);
        writeln!(table, "| {size} | resume, activation kept on the node | {} |", us(&kept))?;
        writeln!(table, "| {size} | resume with a replacement activation (sent) | {} |", us(&replaced))?;
        writeln!(
            table,
            "| {size} | plain execute of blocks {}..{} (activation sent) | {} |",
            after + 1,
            args.blocks - 1,
            us(&plain)
        )?;
        ratios.push(format!("{size}: resume p50 / plain execute p50 = **{:.2}**", kept.p50 / plain.p50));
    }
    writeln!(table, "\n{}.", ratios.join("; "))?;
    print!("{table}");
    if let Some(path) = &args.results {
        let notes = [format!(
            "{} blocks of Linear({w}, {w}) + GELU, f32, on the node's {device}; stopped after block {after}; {} timed iterations per row",
            args.blocks,
            args.iters,
            w = args.width
        )];
        append_section(path, "resume", &notes, &table)?;
    }
    Ok(())
}

/// An idle moment before each timed call, the same for all: on a 2-core machine a request sent
/// the instant the previous reply arrived meets the node's threads still spinning, and a
/// baseline that spends that moment receiving an activation would be favoured.
const SETTLE: std::time::Duration = std::time::Duration::from_millis(1);

/// The model, its blocks up to the breakpoint, and the blocks after it.
struct Models {
    whole: Fingerprint,
    head: Fingerprint,
    rest: Fingerprint,
}

#[derive(Clone, Copy)]
struct Sizes {
    rows: i64,
    width: i64,
}

/// Resume with the activation kept, resume with it replaced, and the plain execute of the
/// remaining blocks, after checking that all three give the same output.
fn measure_size(
    client: &mut Client,
    models: &Models,
    x: &Tensor,
    after: usize,
    sizes: Sizes,
    iters: u64,
) -> Result<[Stats; 3]> {
    let shape = [sizes.rows as u64, sizes.width as u64];
    let x_bytes = bytes_of(x).to_vec();
    let input = [TensorRef { dtype: DType::F32, shape: &shape, bytes: &x_bytes }];
    let x_value = [Value::Tensor(0)];
    let stop = |send_activation| Breakpoint { block: after as u32, send_activation };
    let Models { whole: model, head, rest } = models;
    let first = client.execute_until(model, &x_value, &input, false, stop(true))?;
    let activation = first.activation.as_ref().map(|a| a.tensor_bytes(0).to_vec()).unwrap_or_default();
    ensure!(activation.len() == x_bytes.len(), "the activation is {} bytes", activation.len());
    let act = [TensorRef { dtype: DType::F32, shape: &shape, bytes: &activation }];
    let output = |r: Resumed| -> Result<Vec<u8>> {
        match r {
            Resumed::Done(out) => Ok(out.tensor_bytes(0).to_vec()),
            Resumed::Paused(_) => anyhow::bail!("paused again"),
        }
    };
    let resumed = output(client.resume(first.parked, None, None)?)?;
    let plain = client.execute(rest, &x_value, &act)?.tensor_bytes(0).to_vec();
    ensure!(resumed == plain, "resuming and running the remaining blocks give different outputs");

    // The run up to the breakpoint is not timed: only what a resume costs.
    let mut resume_timed = |replacement: Option<(&Value, &[TensorRef<'_>])>| {
        let paused = client.execute_until(model, &x_value, &input, false, stop(false))?;
        std::thread::sleep(SETTLE);
        let start = Instant::now();
        let r = client.resume(paused.parked, replacement, None)?;
        let took = start.elapsed();
        ensure!(matches!(r, Resumed::Done(_)), "paused again");
        Ok(took)
    };
    let kept = measure_timed(iters, || resume_timed(None))?;
    let replaced = measure_timed(iters, || resume_timed(Some((&Value::Tensor(0), &act))))?;
    let plain = measure_timed(iters, || {
        drop(client.execute(head, &x_value, &input)?);
        std::thread::sleep(SETTLE);
        let start = Instant::now();
        drop(client.execute(rest, &x_value, &act)?);
        Ok(start.elapsed())
    })?;
    Ok([kept, replaced, plain])
}
