//! `djinn bench plan`: what planning a graph run costs (its pass over meta tensors, see
//! executor/src/cost.rs), in this process on the CPU: the same graph run without a plan, with
//! its plan kept from an earlier call of the same shapes, and with a new plan before each run
//! (shapes that change every call, as a decode step's without a KV cache). Two graphs: the
//! TinyMLP (three operators that do real work) and a chain of 64 small operators (where the
//! dispatcher's cost per operator is all there is, the worst case for planning).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use djinn_executor::graph::GraphModule;
use djinn_executor::tch::{self, Device, Kind, Tensor};
use djinn_graph::format::{FORMAT, WEIGHT_ALIGN};
use djinn_graph::{Arg, DimRange, Input, Node, Program, Weight};
use hdrhistogram::Histogram;

use crate::report::{Stats, append_section};

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Timed runs of each measurement.
    #[arg(long, default_value_t = 20000)]
    iters: u64,
    /// Append the table, the command and the machine to this markdown file.
    #[arg(long)]
    results: Option<PathBuf>,
}

/// A graph of `nodes` over one float32 input of `[1..=4096, width]` and `weights`.
fn graph(width: i64, weights: &[Tensor], nodes: Vec<Node>, output: u32) -> Result<GraphModule> {
    let mut offset = 0;
    let mut specs = Vec::new();
    let mut bytes = Vec::new();
    for (i, w) in weights.iter().enumerate() {
        let len = w.numel() * 4;
        specs.push(Weight {
            name: format!("w{i}"),
            value: i as u32 + 1,
            dtype: "float32".into(),
            shape: w.size(),
            offset,
        });
        offset += (len as u64).next_multiple_of(WEIGHT_ALIGN);
        let mut b = vec![0u8; len];
        w.f_copy_data_u8(&mut b, w.numel())?;
        bytes.push(b);
    }
    let program = Program {
        format: FORMAT,
        inputs: vec![Input {
            name: "x".into(),
            value: 0,
            dtype: "float32".into(),
            dims: vec![DimRange { min: 1, max: 4096 }, DimRange { min: width, max: width }],
            state: false,
        }],
        weights: specs,
        nodes,
        outputs: vec![Arg::Value(output)],
        state: vec![],
        entries: vec![],
    };
    let slices: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let container = djinn_graph::encode(&program, &slices)?;
    GraphModule::load(&container, Device::Cpu).context("loading the graph")
}

fn node(op: &str, args: Vec<Arg>, output: u32) -> Node {
    Node { op: op.into(), overload: String::new(), args, kwargs: Default::default(), outputs: vec![output] }
}

/// Runs `ops` in turn, a hundred calls of each per round, so that drifts of the machine (its
/// clock, other processes) fall on all of them alike; a round of each first, untimed.
fn alternating<const N: usize>(iters: u64, mut ops: [&mut dyn FnMut() -> Result<()>; N]) -> Result<[Stats; N]> {
    const ROUND: u64 = 100;
    let mut histograms: Vec<Histogram<u64>> =
        (0..N).map(|_| Histogram::new(3).context("histogram")).collect::<Result<_>>()?;
    for op in ops.iter_mut() {
        for _ in 0..ROUND {
            op()?;
        }
    }
    for _ in 0..iters.div_ceil(ROUND) {
        for (op, h) in ops.iter_mut().zip(&mut histograms) {
            for _ in 0..ROUND {
                let start = Instant::now();
                op()?;
                h.record(start.elapsed().as_nanos() as u64).context("histogram range")?;
            }
        }
    }
    let stats: Vec<Stats> = histograms.iter().map(Stats::of).collect();
    stats.try_into().map_err(|_| anyhow::anyhow!("one figure per measurement"))
}

/// Runs without a plan and with a kept plan, on inputs of `rows` rows; and without a plan and
/// with a new plan each time, cycling through 128 batch sizes (more than a graph keeps plans
/// of).
fn measure_graph(g: &GraphModule, width: i64, rows: i64, iters: u64) -> Result<[Stats; 4]> {
    let x = Tensor::randn([rows, width], (Kind::Float, Device::Cpu));
    let run = |x: &Tensor| g.run(vec![x.shallow_clone()]).map(drop).map_err(anyhow::Error::from);
    let plan_and_run = |x: &Tensor| -> Result<()> {
        g.estimate_run(std::slice::from_ref(x))?;
        run(x)
    };
    let [bare, kept] = alternating(iters, [&mut || run(&x), &mut || plan_and_run(&x)])?;
    let cycle: Vec<Tensor> = (1..=128).map(|r| Tensor::randn([r, width], (Kind::Float, Device::Cpu))).collect();
    let (mut a, mut b) = (0usize, 0usize);
    let [cycle_bare, cycle_new] = alternating(
        iters,
        [
            &mut || {
                a += 1;
                run(&cycle[a % cycle.len()])
            },
            &mut || {
                b += 1;
                plan_and_run(&cycle[b % cycle.len()])
            },
        ],
    )?;
    Ok([bare, kept, cycle_bare, cycle_new])
}

pub fn run(args: PlanArgs) -> Result<()> {
    tch::set_num_threads(1);
    tch::manual_seed(0);
    let _grad = tch::no_grad_guard();
    let v = Arg::Value;
    let f = |s: &[i64]| Tensor::randn(s, (Kind::Float, Device::Cpu));
    let mlp = graph(
        256,
        &[f(&[1024, 256]), f(&[1024]), f(&[256, 1024]), f(&[256])],
        vec![
            node("aten::linear", vec![v(0), v(1), v(2)], 5),
            node("aten::relu", vec![v(5)], 6),
            node("aten::linear", vec![v(6), v(3), v(4)], 7),
        ],
        7,
    )?;
    // x → relu → add(·, x) → relu → ...: 64 operators on [rows, 64], value 100 + k the k-th's input.
    let chain_nodes = (0..64u32)
        .map(|k| {
            let input = if k == 0 { v(0) } else { v(100 + k) };
            let mut n = node(if k % 2 == 0 { "aten::relu" } else { "aten::add" }, vec![input], 101 + k);
            if k % 2 == 1 {
                n.overload = "Tensor".into();
                n.args.push(v(0));
            }
            n
        })
        .collect();
    let chain = graph(64, &[], chain_nodes, 164)?;

    let n = args.iters;
    let [mlp_bare, mlp_kept, mlp_cycle_bare, mlp_cycle_new] = measure_graph(&mlp, 256, 4, n)?;
    let [chain_bare, chain_kept, chain_cycle_bare, chain_cycle_new] = measure_graph(&chain, 64, 4, n)?;

    let us = |s: &Stats| format!("{:.1} | {:.1} | {:.1}", s.p50, s.p99, s.p999);
    let ratio = |a: &Stats, b: &Stats| format!("{:.2} | {:.2}", a.p50 / b.p50, a.p99 / b.p99);
    let mut table = String::new();
    writeln!(table, "| graph, run | p50 µs | p99 µs | p999 µs | p50 / unplanned | p99 / unplanned |")?;
    writeln!(table, "|---|---|---|---|---|---|")?;
    for (name, bare, kept, cycle_bare, cycle_new) in [
        ("TinyMLP (256→1024→256, batch 4)", &mlp_bare, &mlp_kept, &mlp_cycle_bare, &mlp_cycle_new),
        ("64-operator chain ([4, 64])", &chain_bare, &chain_kept, &chain_cycle_bare, &chain_cycle_new),
    ] {
        writeln!(table, "| {name}, unplanned | {} | 1.00 | 1.00 |", us(bare))?;
        writeln!(table, "| {name}, plan kept from an earlier call | {} | {} |", us(kept), ratio(kept, bare))?;
        writeln!(table, "| {name}, batch 1 to 128 in turn, unplanned | {} | 1.00 | 1.00 |", us(cycle_bare))?;
        writeln!(
            table,
            "| {name}, batch 1 to 128 in turn, a new plan each run | {} | {} |",
            us(cycle_new),
            ratio(cycle_new, cycle_bare)
        )?;
    }
    println!("{table}");
    if let Some(path) = &args.results {
        let notes = [format!(
            "Timed runs: {n} each, in this process, libtorch on 1 thread; each pair measured in alternating rounds of 100"
        )];
        append_section(path, "plan", &notes, &table)?;
    }
    Ok(())
}
