//! `djinn bench execute`: remote execution through a node process against, in the same run,
//! the same TorchScript forward in this process (libtorch, one thread, as the node runs it) and
//! a raw blocking-socket ping-pong carrying the same bytes; and the same execution through the
//! cluster client, placed by a `djinn control` process (what its placement cache costs a call).

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use djinn_client::{Client, ClientOptions, ClusterClient, DType, FailoverOptions, TensorRef, Value};
use djinn_executor::tch;
use djinn_memory::ByteSize;
use tch::jit::CModule;
use tch::{Device, Kind, Tensor, nn, nn::Module};

use crate::Spawned;
use crate::report::{Stats, append_section, bytes_of, measure, raw};

#[derive(Args, Debug)]
pub struct ExecuteArgs {
    /// Timed calls of the TinyMLP (each measurement).
    #[arg(long, default_value_t = 20000)]
    iters: u64,
    /// Timed 64 MiB identity round trips.
    #[arg(long, default_value_t = 30)]
    big_iters: u64,
    /// Node backend.
    #[arg(long, default_value = "mio")]
    backend: String,
    /// The node's device, and the local forward's: `cpu`, `cuda:N` or `auto`.
    #[arg(long, default_value = "cpu", value_parser = djinn_executor::parse_device)]
    device: Device,
    /// Append the tables, the command and the machine to this markdown file.
    #[arg(long)]
    results: Option<PathBuf>,
    /// A flag for the node under test, as `djinn node` takes it (`--node-arg=--executor-processes`);
    /// repeat for more.
    #[arg(long = "node-arg", allow_hyphen_values = true)]
    node_args: Vec<String>,
}

/// A TorchScript archive made by tracing `f` on `examples` (its inputs).
pub(crate) fn archive(name: &str, examples: &[Tensor], f: &mut dyn FnMut(&[Tensor]) -> Vec<Tensor>) -> Result<Vec<u8>> {
    let module = CModule::create_by_tracing(name, "forward", examples, &mut |xs: &[Tensor]| f(xs))?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join(format!("{name}.pt"));
    module.save(&path)?;
    Ok(std::fs::read(&path)?)
}

pub fn run(args: ExecuteArgs) -> Result<()> {
    tch::set_num_threads(1);
    tch::manual_seed(0);
    let _grad = tch::no_grad_guard();
    let mut vs = nn::VarStore::new(Device::Cpu);
    let mlp = nn::seq()
        .add(nn::linear(vs.root() / "fc1", 256, 1024, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "fc2", 1024, 256, Default::default()));
    // Weights become constants of the traced graph, which they may only be without gradients.
    vs.freeze();
    let x = Tensor::randn([4, 256], (Kind::Float, Device::Cpu));
    let tiny_mlp = archive("tiny_mlp", std::slice::from_ref(&x), &mut |xs| vec![mlp.forward(&xs[0])])?;
    let big = Tensor::randn([16 << 20], (Kind::Float, Device::Cpu));
    let identity = archive("identity", &[big.narrow(0, 0, 4)], &mut |xs| vec![xs[0].shallow_clone()])?;

    let store = tempfile::tempdir()?;
    let store_arg = store.path().join("control.redb").display().to_string();
    let control = Spawned::start(&["control", "--listen", "127.0.0.1:0", "--store", &store_arg, "--log", "warn"])?;
    let control_url = format!("http://{}", control.addr);
    let device = djinn_executor::device_name(args.device);
    let mut node_args = vec![
        "node",
        "--listen",
        "127.0.0.1:0",
        "--tcp-backend",
        &args.backend,
        "--log",
        "warn",
        "--control",
        &control_url,
        "--device",
        &device,
    ];
    node_args.extend(args.node_args.iter().map(String::as_str));
    let node = Spawned::start(&node_args)?;
    let mut client = Client::connect(node.addr)?;
    let mlp_fp = client.register_model(&[&tiny_mlp], |_, _| {})?.fingerprint;
    let id_fp = client.register_model(&[&identity], |_, _| {})?.fingerprint;
    let local = CModule::load_data_on_device(&mut tiny_mlp.as_slice(), args.device).context("local load")?;
    // The local baseline gives its caller what a remote call does: the output in host memory.
    let x_local = x.f_to_device(args.device)?;
    let local_forward = || -> Result<Tensor> { Ok(local.forward_ts(&[&x_local])?.f_to_device(Device::Cpu)?) };

    let x_bytes = bytes_of(&x).to_vec();
    let input = [TensorRef { dtype: DType::F32, shape: &[4, 256], bytes: &x_bytes }];
    let remote_out = client.execute(&mlp_fp, &[Value::Tensor(0)], &input)?;
    let local_out = local_forward()?;
    anyhow::ensure!(remote_out.tensor_bytes(0) == bytes_of(&local_out), "remote and local outputs differ");

    let n = args.iters;
    let local_stats = measure(n, || local_forward().map(drop))?;
    let remote = measure(n, || client.execute(&mlp_fp, &[Value::Tensor(0)], &input).map(drop).map_err(Into::into))?;
    // Placed once (the node joins the control plane within a moment: placement is retried
    // until it has), then every call goes by the cached placement.
    let mut cluster = ClusterClient::open(&control_url, ClientOptions::default(), FailoverOptions::default())?;
    let placed_fp = cluster.register_model(vec![tiny_mlp.clone().into()], None, None, false, |_, _| {})?.fingerprint;
    anyhow::ensure!(placed_fp == mlp_fp, "the cluster client registered another model");
    let placed =
        measure(n, || cluster.execute(&mlp_fp, None, &[Value::Tensor(0)], &input).map(drop).map_err(Into::into))?;
    drop(cluster);
    let pingpong = raw(4096, 4096, n)?;

    let big_bytes = bytes_of(&big).to_vec();
    let big_input = [TensorRef { dtype: DType::F32, shape: &[16 << 20], bytes: &big_bytes }];
    let out = client.execute(&id_fp, &[Value::Tensor(0)], &big_input)?;
    anyhow::ensure!(out.tensor_bytes(0) == big_bytes.as_slice(), "the identity changed its input");
    drop(out);
    let big_remote = measure(args.big_iters, || {
        client.execute(&id_fp, &[Value::Tensor(0)], &big_input).map(drop).map_err(Into::into)
    })?;
    let big_raw = raw(64 << 20, 64 << 20, args.big_iters)?;

    let us = |s: &Stats| format!("{:.1} | {:.1} | {:.1}", s.p50, s.p99, s.p999);
    let gbps = |s: &Stats| 2.0 * (64u64 << 20) as f64 / (s.p50 * 1e3);
    let mut table = String::new();
    writeln!(table, "| what | p50 µs | p99 µs | p999 µs |\n|---|---|---|---|")?;
    writeln!(table, "| TinyMLP execute through the node (256→1024→256, batch 4, f32) | {} |", us(&remote))?;
    writeln!(
        table,
        "| TinyMLP execute through the cluster client (placed by `djinn control`, placement cached) | {} |",
        us(&placed)
    )?;
    writeln!(
        table,
        "| TinyMLP forward in this process (libtorch, 1 thread, output in host memory) | {} |",
        us(&local_stats)
    )?;
    writeln!(table, "| raw blocking-socket ping-pong, 4 KiB each way | {} |", us(&pingpong))?;
    writeln!(table, "| 64 MiB identity execute round trip | {} |", us(&big_remote))?;
    writeln!(table, "| raw ping-pong, 64 MiB each way | {} |", us(&big_raw))?;
    writeln!(
        table,
        "\nTinyMLP: remote p50 − local p50 = **{:.1} µs** (target ≤ 100 µs); remote p50 / raw ping-pong p50 = **{:.2}**.  ",
        remote.p50 - local_stats.p50,
        remote.p50 / pingpong.p50
    )?;
    writeln!(
        table,
        "Cluster client p50 − direct client p50 = **{:.2} µs** (what the cached placement costs a call).  ",
        placed.p50 - remote.p50
    )?;
    writeln!(
        table,
        "64 MiB identity: **{:.2} GB/s** counting both directions, against **{:.2} GB/s** raw: **{:.0}%** of raw (target ≥ 70%).",
        gbps(&big_remote),
        gbps(&big_raw),
        100.0 * big_raw.p50 / big_remote.p50
    )?;
    print!("{table}");
    if let Some(path) = &args.results {
        let notes = [format!(
            "Timed iterations: {n} (TinyMLP), {} (64 MiB); node backend {}, device {}, payload {}",
            args.big_iters,
            djinn_executor::device_name(args.device),
            args.backend,
            ByteSize(64 << 20)
        )];
        append_section(path, "execute", &notes, &table)?;
    }
    // The node renews its lease until the end: the control plane goes with it.
    drop((node, control, store));
    Ok(())
}
