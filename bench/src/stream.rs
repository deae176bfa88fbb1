//! `djinn bench stream`: a stack of MLP blocks about three times the device budget, run by the
//! node's own executor code (upload, plan, streamer) in this process, against, in the same run:
//! (a) the same model fully resident, (b) the naive way (before each block, its weights copied
//! synchronously from pageable host memory, as offloading hooks do), and (c) the raw copy rate
//! (pinned host to device on CUDA; memcpy between touched buffers on the CPU). The stack is run
//! twice, as TorchScript blocks and as graph blocks (the Python package's export of each block),
//! both resident and streamed.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use djinn_executor::tch;
use djinn_executor::{Device, Model, ModelStore, ModelValue};
use djinn_gpudirect::{CopyStream, CudaContext, PinnedBuf};
use djinn_memory::{ByteSize, HostBuf, MemoryBudget};
use djinn_node_core::Upload;
use djinn_proto::{Fingerprint, Payload};
use tch::jit::CModule;
use tch::{Kind, Tensor};

use crate::report::{Stats, append_section, measure};
use djinn_sync::Locked;

/// Writes `block{i}.pt` and `block{i}.graph`: `Linear(width, width)` then GELU, random weights,
/// traced as TorchScript and exported as a graph.
const MAKE_BLOCKS: &str = r#"
import sys, torch
from djinn import graphs
out, blocks, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
for i in range(blocks):
    block = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()).eval()
    x = torch.randn(1, width)
    torch.jit.trace(block, x).save(f"{out}/block{i}.pt")
    with open(f"{out}/block{i}.graph", "wb") as f:
        f.write(graphs.export(block, (x,), dynamic={"input": {0: "batch"}}).containers[0])
"#;

#[derive(Args, Debug)]
pub struct StreamArgs {
    /// Blocks in the stack.
    #[arg(long, default_value_t = 12)]
    blocks: usize,
    /// Width of each block's Linear (its weights are width² × 4 bytes).
    #[arg(long, default_value_t = 4096)]
    width: i64,
    /// Rows of the input.
    #[arg(long, default_value_t = 1)]
    batch: i64,
    /// The device budget is the model's weights divided by this.
    #[arg(long, default_value_t = 3.0)]
    oversubscription: f64,
    /// Timed forwards of each variant.
    #[arg(long, default_value_t = 30)]
    iters: u64,
    /// `cpu`, `cuda:N`, or `auto` (the first GPU if there is one).
    #[arg(long, default_value = "auto")]
    device: String,
    /// The Python with torch that writes the blocks (TorchScript with parameters needs it).
    #[arg(long, default_value = ".venv/bin/python")]
    python: PathBuf,
    /// Append the table, the command and the machine to this markdown file.
    #[arg(long)]
    results: Option<PathBuf>,
}

/// Each block's bytes, in order.
type Blocks = Vec<Vec<u8>>;

/// The stack's blocks as TorchScript archives and as graph containers.
fn make_blocks(args: &StreamArgs) -> Result<(Blocks, Blocks)> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path();
    let status = std::process::Command::new(&args.python)
        .args(["-c", MAKE_BLOCKS])
        .arg(dir)
        .args([args.blocks.to_string(), args.width.to_string()])
        .status()
        .with_context(|| format!("cannot run {} (set --python)", args.python.display()))?;
    ensure!(status.success(), "{} failed to write the blocks: {status}", args.python.display());
    let read = |ext: &str| -> std::io::Result<Blocks> {
        (0..args.blocks).map(|i| std::fs::read(dir.join(format!("block{i}.{ext}")))).collect()
    };
    Ok((read("pt")?, read("graph")?))
}

/// The model, loaded by the node's code path under a device budget of `budget` bytes.
fn load(archives: &[Vec<u8>], device: Device, budget: u64) -> Result<(Arc<Model>, Mutex<ModelStore>)> {
    let lens = archives.iter().map(|a| a.len() as u64).collect();
    let mut upload = Upload::new(Fingerprint::of_blocks(archives), lens, (Default::default(), false), 0)?;
    // The bench's own blocks: TorchScript is allowed beside the graphs it is compared with.
    upload.torchscript = true;
    let mut offset = 0;
    for archive in archives {
        upload.archives.add(offset, Payload { buf: HostBuf::copy_from(archive)?, reservation: None })?;
        offset += archive.len() as u64;
    }
    let store = Mutex::new(ModelStore::new(MemoryBudget::new(budget), MemoryBudget::new(u64::MAX)));
    let model = djinn_executor::load(upload, device, &store)?;
    Ok((model, store))
}

fn stat(store: &Mutex<ModelStore>, name: &str) -> u64 {
    let mut stats = Vec::new();
    store.locked().stats(&mut stats);
    stats.into_iter().find(|(n, _)| n == name).map_or(0, |(_, v)| v)
}

/// Waits for the device's queued work, so a timing covers it.
fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

fn forward(model: &Model, x: &Tensor) -> Result<Tensor> {
    match model.forward(vec![ModelValue::Tensor(x.shallow_clone())])? {
        ModelValue::Tensor(t) => Ok(t),
        other => bail!("the stack returned {other:?}"),
    }
}

/// The naive way: every block's weights in pageable host tensors, copied to the device
/// synchronously just before the block runs. The copies go into device tensors reused from
/// block to block (as a caching allocator would give them back), so what this adds to the
/// resident forward is the copies, not allocation.
struct Naive {
    blocks: Vec<(CModule, Vec<(Tensor, Tensor)>)>,
    /// The device tensor each parameter position was last copied into.
    scratch: Vec<Tensor>,
    device: Device,
}

impl Naive {
    fn new(archives: &[Vec<u8>], device: Device) -> Result<Self> {
        let mut blocks = Vec::new();
        for archive in archives {
            let mut block = CModule::load_data_on_device(&mut archive.as_slice(), device)?;
            block.f_set_eval()?;
            let mut params = Vec::new();
            for (_, mut param) in block.named_parameters()? {
                let host = param.f_to_device(Device::Cpu)?.f_contiguous()?.f_detach_copy()?;
                param.set_data(&Tensor::f_empty([0], (param.kind(), device))?);
                params.push((param, host));
            }
            blocks.push((block, params));
        }
        Ok(Self { blocks, scratch: Vec::new(), device })
    }

    fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.shallow_clone();
        for (block, params) in &mut self.blocks {
            for (j, (param, host)) in params.iter_mut().enumerate() {
                let reusable = self.scratch.get(j).is_some_and(|t| t.size() == host.size() && t.kind() == host.kind());
                if !reusable {
                    let fresh = Tensor::f_empty(host.size(), (host.kind(), self.device))?;
                    match self.scratch.get_mut(j) {
                        Some(t) => *t = fresh,
                        None => self.scratch.push(fresh),
                    }
                }
                let on_device = &mut self.scratch[j];
                on_device.f_copy_(host)?;
                param.set_data(on_device);
            }
            x = block.forward_ts(&[&x])?;
        }
        Ok(x)
    }
}

/// One block's bytes copied the fastest way the device has: pinned host memory to the device
/// on a copy stream, or memcpy between touched host buffers.
fn raw_copy(device: Device, len: usize, iters: u64) -> Result<Stats> {
    match device {
        Device::Cuda(i) => {
            let context = CudaContext::primary(i as i32)?;
            let stream = CopyStream::new(&context)?;
            let src = PinnedBuf::zeroed(&context, len)?;
            let dst = Tensor::f_empty([len as i64], (Kind::Uint8, device))?;
            measure(iters, || {
                // SAFETY: both ranges hold `len` bytes and outlive the copy, which is waited for.
                let done = unsafe { stream.copy_to_device(dst.data_ptr() as u64, src.as_slice().as_ptr(), len) }?;
                Ok(done.synchronize()?)
            })
        }
        _ => {
            let src = HostBuf::copy_from(&vec![1u8; len])?;
            let mut dst = HostBuf::copy_from(&vec![2u8; len])?;
            measure(iters, || {
                dst.as_mut_slice().copy_from_slice(src.as_slice());
                std::hint::black_box(dst.as_slice().as_ptr());
                Ok(())
            })
        }
    }
}

pub fn run(args: StreamArgs) -> Result<()> {
    tch::set_num_threads(1);
    let device = djinn_executor::parse_device(&args.device).map_err(anyhow::Error::msg)?;
    let _grad = tch::no_grad_guard();
    eprintln!("writing {} blocks of Linear({w}, {w}) with {}", args.blocks, args.python.display(), w = args.width);
    let (archives, graphs) = make_blocks(&args)?;
    let x = Tensor::f_randn([args.batch, args.width], (Kind::Float, device))?;

    eprintln!("loading the model resident and streamed, as TorchScript and as graphs");
    let (resident, _resident_store) = load(&archives, device, u64::MAX / 2)?;
    let weights = resident.weight_bytes;
    let budget = (weights as f64 / args.oversubscription) as u64;
    let (streamed, store) = load(&archives, device, budget)?;
    ensure!(stat(&store, "streamed_models") == 1, "a budget of {} did not make the model stream", ByteSize(budget));
    let expected = forward(&resident, &x)?;
    ensure!(forward(&streamed, &x)?.equal(&expected), "streamed and resident outputs differ");
    let (resident_graph, _graph_store) = load(&graphs, device, u64::MAX / 2)?;
    let (streamed_graph, graph_store) = load(&graphs, device, budget)?;
    ensure!(stat(&graph_store, "streamed_models") == 1, "the graphs did not stream under {}", ByteSize(budget));
    let expected_graph = forward(&resident_graph, &x)?;
    ensure!(forward(&streamed_graph, &x)?.equal(&expected_graph), "streamed and resident graphs differ");
    ensure!(expected_graph.allclose(&expected, 1e-5, 1e-6, false), "the graphs and TorchScript disagree");
    let mut naive = Naive::new(&archives, device)?;
    ensure!(naive.forward(&x)?.equal(&expected), "the naive baseline's output differs");

    eprintln!("timing");
    let timed = |f: &mut dyn FnMut() -> Result<Tensor>| {
        measure(args.iters, || {
            drop(f()?);
            sync(device);
            Ok(())
        })
    };
    let resident_t = timed(&mut || forward(&resident, &x))?;
    let (bytes_before, stall_before) = (stat(&store, "stream_bytes"), stat(&store, "stream_stall_us"));
    let streamed_t = timed(&mut || forward(&streamed, &x))?;
    let forwards = args.iters + (args.iters / 10).max(2);
    let per_forward = (stat(&store, "stream_bytes") - bytes_before) / forwards;
    let stall_ms = (stat(&store, "stream_stall_us") - stall_before) as f64 / 1e3 / forwards as f64;
    let resident_graph_t = timed(&mut || forward(&resident_graph, &x))?;
    let streamed_graph_t = timed(&mut || forward(&streamed_graph, &x))?;
    let naive_t = timed(&mut || naive.forward(&x))?;
    let block_bytes = (weights / args.blocks as u64) as usize;
    let raw_t = raw_copy(device, block_bytes, args.iters)?;

    let gbps = |bytes: u64, us: f64| bytes as f64 / (us * 1e3);
    let raw_gbps = gbps(block_bytes as u64, raw_t.p50);
    let stream_gbps = gbps(per_forward, streamed_t.p50);
    let ms = |s: &Stats| format!("{:.2} | {:.2} | {:.2}", s.p50 / 1e3, s.p99 / 1e3, s.p999 / 1e3);
    let mut table = String::new();
    writeln!(table, "| per forward | p50 ms | p99 ms | p999 ms |\n|---|---|---|---|")?;
    writeln!(table, "| (a) fully resident | {} |", ms(&resident_t))?;
    writeln!(table, "| **streamed** through the ring | {} |", ms(&streamed_t))?;
    writeln!(table, "| graphs, fully resident | {} |", ms(&resident_graph_t))?;
    writeln!(table, "| **graphs, streamed** through the ring | {} |", ms(&streamed_graph_t))?;
    writeln!(table, "| (b) naive: synchronous copy from pageable memory before each block | {} |", ms(&naive_t))?;
    writeln!(table, "| (c) raw copy of one block ({}) | {} |", ByteSize(block_bytes as u64), ms(&raw_t))?;
    writeln!(
        table,
        "\nStreamed {} per forward at **{stream_gbps:.2} GB/s**, **{:.0}%** of the raw copy's {raw_gbps:.2} GB/s \
         (target ≥ 80% on a GPU); stalled {stall_ms:.2} ms per forward waiting for copies.  ",
        ByteSize(per_forward),
        100.0 * stream_gbps / raw_gbps,
    )?;
    writeln!(
        table,
        "Naive p50 / streamed p50 = **{:.2}×** (target ≥ 1.5× on a GPU); streamed p50 / resident p50 = {:.2}×.",
        naive_t.p50 / streamed_t.p50,
        streamed_t.p50 / resident_t.p50
    )?;
    writeln!(
        table,
        "\nGraphs against TorchScript: streamed p50 **{:.3}×**, resident p50 {:.3}×; graphs streamed p50 / graphs \
         resident p50 = {:.2}×.",
        streamed_graph_t.p50 / streamed_t.p50,
        resident_graph_t.p50 / resident_t.p50,
        streamed_graph_t.p50 / resident_graph_t.p50,
    )?;
    print!("{table}");
    if let Some(path) = &args.results {
        let notes = [format!(
            "Device {device:?}; {} blocks of Linear({w}, {w}) + GELU, batch {}, {} of weights; device budget {} \
             (weights / {}); {} timed forwards each",
            args.blocks,
            args.batch,
            ByteSize(weights),
            ByteSize(budget),
            args.oversubscription,
            args.iters,
            w = args.width,
        )];
        append_section(path, "stream", &notes, &table)?;
    }
    Ok(())
}
