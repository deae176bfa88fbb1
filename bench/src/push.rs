//! `djinn bench push`: a node pushes a kept tensor into another node's memory (two node
//! processes on loopback, the staging path: device to host when the device is a GPU, TCP, or
//! RDMA with `--rdma-device`, host to device), against the legs it is made of, measured in the
//! same run: the link (a raw one-way TCP send of the same bytes between two processes, answered
//! by 8 bytes; over RDMA, `ib_write_bw` at that size on the same device) and, on a GPU, the
//! device-to-host copy. The ratio is the push's bandwidth over the slower leg's.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::Args;
use djinn_client::{Client, ClientOptions, DType, TensorRef, TensorSource};
use djinn_executor::Device;
use djinn_executor::tch;
use djinn_memory::ByteSize;
use tch::{Kind, Tensor};

use crate::Spawned;
use crate::rdma::LinkArgs;
use crate::report::{Stats, append_section, measure, measure_timed};

#[derive(Args, Debug)]
pub struct PushArgs {
    /// Tensor sizes.
    #[arg(long, value_delimiter = ',', default_value = "64KiB,1MiB,16MiB,64MiB,256MiB")]
    sizes: Vec<ByteSize>,
    /// The nodes' device: `auto` (the first GPU if CUDA is present, else the CPU), `cpu` or `cuda:N`.
    #[arg(long, default_value = "auto", value_parser = djinn_executor::parse_device)]
    device: Device,
    /// Bytes moved per measurement (iterations = this / size, between 10 and 2000).
    #[arg(long, default_value = "2GiB")]
    volume: ByteSize,
    #[command(flatten)]
    link: LinkArgs,
    /// Append the table, the command and the machine to this markdown file.
    #[arg(long)]
    results: Option<PathBuf>,
}

const HEADER: &str = "| size | push p50 µs | p99 µs | p999 µs | push GB/s | link GB/s | device→host GB/s | push / slower leg |\n|---|---|---|---|---|---|---|---|";

pub fn run(args: PushArgs) -> Result<()> {
    let device = djinn_executor::device_name(args.device);
    let mut node_args = vec!["node", "--listen", "127.0.0.1:0", "--device", &device, "--log", "warn"];
    node_args.extend(args.link.node_args());
    let b = Spawned::start(&node_args)?;
    let to_b = b.addr.to_string();
    node_args.extend(["--push-peers", &to_b]);
    let a = Spawned::start(&node_args)?;
    let mut on_a = Client::connect_with(a.addr, ClientOptions::default())?;
    let mut on_b = Client::connect_with(b.addr, ClientOptions::default())?;
    println!("{HEADER}");
    let mut rows = Vec::new();
    let mut paths = std::collections::BTreeSet::new();
    for size in args.sizes.iter().map(|s| s.0) {
        let iters = (args.volume.0 / size.max(1)).clamp(10, 2000);
        let bytes = vec![7u8; size as usize];
        let kept = on_a.keep(TensorRef { dtype: DType::U8, shape: &[size], bytes: &bytes })?;
        let push = measure_timed(iters, || {
            // A push as a tenant makes one: the peer's grant, then the push.
            let start = Instant::now();
            let grant = on_b.grant_push(&kept.tensor)?;
            let (pushed, path) = on_a.push(TensorSource::Handle(kept.handle), &to_b, &grant)?;
            let took = start.elapsed();
            paths.insert(path);
            on_b.release(&[pushed.handle])?;
            Ok(took)
        })?;
        on_a.release(&[kept.handle])?;
        let gbps = |s: &Stats| size as f64 / (s.p50 * 1e3);
        let (link, link_gbps) = args.link.baseline(size, iters)?;
        let d2h = device_to_host(args.device, size, iters)?;
        let slower = d2h.map_or(link_gbps, |d| gbps(&d).min(link_gbps));
        let row = format!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.3} | {link} | {} | **{:.2}** |",
            ByteSize(size),
            push.p50,
            push.p99,
            push.p999,
            gbps(&push),
            d2h.map_or("— (CPU node)".into(), |d| format!("{:.2}", gbps(&d))),
            gbps(&push) / slower,
        );
        println!("{row}");
        rows.push(row);
    }
    if let Some(path) = &args.results {
        let paths: Vec<_> = paths.into_iter().collect();
        let notes = [format!("Nodes' device: {device}; path: {}.", paths.join(", "))];
        let table: Vec<String> = std::iter::once(HEADER.to_owned()).chain(rows).collect();
        append_section(path, "push", &notes, &table.join("\n"))?;
    }
    Ok(())
}

/// The device-to-host copy of `size` bytes the pushing node makes (into pageable memory, as it
/// does); `None` on the CPU.
fn device_to_host(device: Device, size: u64, iters: u64) -> Result<Option<Stats>> {
    if device == Device::Cpu {
        return Ok(None);
    }
    let on_device = Tensor::f_ones([size as i64], (Kind::Uint8, device))?;
    let stats = measure(iters, || {
        let host = on_device.f_to_device(Device::Cpu)?;
        drop(std::hint::black_box(host));
        Ok(())
    })?;
    Ok(Some(stats))
}
