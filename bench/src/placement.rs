//! `djinn bench placement`: the control plane's placement decision with 1,000 nodes and
//! 10,000 models placed, in this process, against the simplest placer over the same nodes
//! (the one with the most free memory, one pass, no cost model) in the same run.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use djinn_control::{Block, Cluster, Inventory, Member, PlaceRequest, Policy};

use crate::report::{Stats, append_section, measure};

#[derive(Args, Debug)]
pub struct PlacementArgs {
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// Models placed before timing.
    #[arg(long, default_value_t = 10_000)]
    models: usize,
    /// Timed decisions of each kind.
    #[arg(long, default_value_t = 20_000)]
    iters: u64,
    /// Append the table, the command and the machine to this markdown file.
    #[arg(long)]
    results: Option<PathBuf>,
}

const GIB: u64 = 1 << 30;
const POLICIES: [Policy; 4] =
    [Policy::MinimizeLatency, Policy::MaximizeThroughput, Policy::LoadBalance, Policy::MinimizeCost];

/// Node `i` of a varied rack: budgets from 24 to 141 GiB, different speeds, links and prices.
fn inventory(i: usize) -> Inventory {
    let f = (i % 7) as f64;
    Inventory {
        addr: format!("10.0.{}.{}:7070", i / 250, i % 250),
        device: "cuda:0".into(),
        memory_total: (24 + (i as u64 % 118)) * GIB,
        memory_free: (24 + (i as u64 % 118)) * GIB,
        host_memory_free: 1024 * GIB,
        host_to_device: 25e9 + f * 5e9,
        flops: 100e12 + f * 50e12,
        memory_bandwidth: 2e12 + f * 5e11,
        link_bandwidth: 10e9 + (i % 5) as f64 * 10e9,
        memory_path: "staging".into(),
        transports: vec!["rdma".into(), "tcp".into()],
        queue_depth: (i % 4) as u32,
        cost_per_hour: 1.0 + f,
        models: Vec::new(),
        sessions: 0,
        kept: 0,
        parked: 0,
        unrecorded: 0,
        sandbox: String::new(),
    }
}

fn request(i: usize, session: Option<String>) -> PlaceRequest {
    PlaceRequest {
        fingerprint: format!("{i:064x}"),
        // 1–4 GiB in 8 blocks.
        blocks: vec![Block { weight_bytes: (128 + (i as u64 % 384)) << 20, flops: 2e9 }; 8],
        io_bytes: 1 << 20,
        phase: None,
        session,
        policy: POLICIES[i % POLICIES.len()],
        moving: None,
    }
}

pub fn run(args: PlacementArgs) -> Result<()> {
    let mut cluster = Cluster::new(10_000);
    let now = 1;
    for i in 0..args.nodes {
        cluster.join(&format!("node{i:04}"), Member { inventory: inventory(i), lease: i as u64 + 1 }, 0);
    }
    for i in 0..args.models {
        cluster.place(&request(i, Some(format!("session{i}"))), now)?;
    }
    // New models: every live node is a candidate.
    let mut next = args.models;
    let new_model = measure(args.iters, || {
        next += 1;
        cluster.place(&request(next, None), now)?;
        Ok(())
    })?;
    // Models already placed (shared) and sessions already placed.
    let mut k = 0;
    let shared = measure(args.iters, || {
        k += 7919;
        cluster.place(&request(k % args.models, None), now)?;
        Ok(())
    })?;
    let session = measure(args.iters, || {
        k += 7919;
        let i = k % args.models;
        cluster.place(&request(i, Some(format!("session{i}"))), now)?;
        Ok(())
    })?;
    // The baseline: the node with the most free memory, in one pass over the same inventories.
    let live: Vec<(&String, &Inventory)> = cluster.membership().live().map(|(n, m)| (n, &m.inventory)).collect();
    let most_free = measure(args.iters, || {
        std::hint::black_box(live.iter().max_by_key(|(_, inv)| inv.memory_free));
        Ok(())
    })?;

    let us = |s: &Stats| format!("{:.1} | {:.1} | {:.1}", s.p50, s.p99, s.p999);
    let mut table = String::new();
    writeln!(table, "| decision | p50 µs | p99 µs | p999 µs |\n|---|---|---|---|")?;
    writeln!(table, "| new model (rules, then the policy over every node) | {} |", us(&new_model))?;
    writeln!(table, "| model already placed (shared) | {} |", us(&shared))?;
    writeln!(table, "| session already placed | {} |", us(&session))?;
    writeln!(table, "| baseline: most free memory, one pass, no cost model | {} |", us(&most_free))?;
    writeln!(
        table,
        "\nNew model p99 **{:.1} µs** (target < 1000 µs); new model p50 / baseline p50 = {:.1}×.",
        new_model.p99,
        new_model.p50 / most_free.p50
    )?;
    print!("{table}");
    if let Some(path) = &args.results {
        let notes = [format!(
            "{} nodes, {} models placed (with a session each) before timing, {} timed decisions of each kind, \
             the four policies in turn",
            args.nodes, args.models, args.iters
        )];
        append_section(path, "placement", &notes, &table)?;
    }
    Ok(())
}
