//! `djinn bench drain`: `djinn drain` of a node that holds N sessions (a control plane and two
//! CPU nodes on loopback) while clients step every session in turn, as they would through a
//! drain in production. The baseline, in the same run, is the same clients' steps before the
//! drain: the table gives the steps' latency before, during and after it, and the ratio to
//! before. The drain's time runs from the operator's request to the node's renewal saying it
//! holds nothing; beside it, the same bytes sent one state at a time over raw loopback TCP.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use djinn_client::{ClientOptions, ClusterClient, ControlClient, DType, FailoverOptions, TensorRef, Value};
use djinn_memory::ByteSize;
use hdrhistogram::Histogram;

use crate::Spawned;
use crate::moves::CarryModel;
use crate::report::{Stats, append_section, raw};

#[derive(Args, Debug)]
pub struct DrainArgs {
    /// Sessions on the drained node.
    #[arg(long, default_value_t = 20)]
    sessions: usize,
    /// Each session's state.
    #[arg(long, default_value = "16MiB")]
    state: ByteSize,
    /// Client threads, each stepping its share of the sessions in turn.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Seconds of steps before the drain (the baseline) and after it.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Append the table, the command and the machine to this markdown file.
    #[arg(long)]
    results: Option<PathBuf>,
    #[command(flatten)]
    model: CarryModel,
}

/// Which part of the run a step started in.
const BEFORE: u8 = 0;
const DURING: u8 = 1;
const AFTER: u8 = 2;
const STOP: u8 = 3;

pub fn run(args: DrainArgs) -> Result<()> {
    ensure!(args.clients > 0 && args.sessions >= args.clients, "--sessions must be at least --clients (≥ 1)");
    let model = args.model.archive()?;
    let dir = tempfile::tempdir()?;
    let store = dir.path().join("control.redb");
    let control = Spawned::start(&[
        "control",
        "--listen",
        "127.0.0.1:0",
        "--store",
        store.to_str().context("a temporary path that is not UTF-8")?,
        "--lease-ttl",
        "1s",
        "--log",
        "warn",
    ])?;
    let url = format!("http://{}", control.addr);
    let node = |name: &str| {
        Spawned::start(&[
            "node",
            "--listen",
            "127.0.0.1:0",
            "--device",
            "cpu",
            "--control",
            &url,
            "--name",
            name,
            "--log",
            "warn",
            "--device-memory-budget",
            "6GiB",
            "--session-budget",
            "5GiB",
            "--flops",
            "1e11",
            "--memory-bandwidth",
            "1e10",
            "--host-to-device",
            "1e10",
        ])
    };
    let _nodes = [node("a")?, node("b")?];
    let ops = ControlClient::new(&url, Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(30);
    while ops.live_nodes()?.len() < 2 {
        ensure!(Instant::now() < deadline, "the nodes did not join the control plane");
        std::thread::sleep(Duration::from_millis(50));
    }

    // Each client registers the model (it goes where the first put it) and opens its share of
    // the sessions there.
    let size = args.state.0;
    let bytes = vec![5u8; size as usize];
    let state = [TensorRef { dtype: DType::U8, shape: &[size], bytes: &bytes }];
    let mut clients = Vec::with_capacity(args.clients);
    for c in 0..args.clients {
        let mut client = ClusterClient::open(&url, ClientOptions::default(), FailoverOptions::default())?;
        let fp = client.register_model(vec![model.clone().into()], None, None, false, |_, _| {})?.fingerprint;
        let share = (c..args.sessions).step_by(args.clients).count();
        let sessions = (0..share).map(|_| client.session_open(&fp, &state, 0, None)).collect::<Result<Vec<_>, _>>()?;
        clients.push((client, sessions));
    }
    let drained_addr = clients[0].1[0].node.clone();
    ensure!(clients.iter().all(|(_, s)| s.iter().all(|s| s.node == drained_addr)), "the sessions are not on one node");
    let drained = ops.nodes()?.into_iter().find(|n| n.addr == drained_addr).context("the sessions' node")?.name;

    let phase = Arc::new(AtomicU8::new(BEFORE));
    let failed = Arc::new(AtomicU64::new(0));
    let steppers: Vec<_> = clients
        .into_iter()
        .map(|(mut client, mut sessions)| {
            let (phase, failed) = (Arc::clone(&phase), Arc::clone(&failed));
            std::thread::spawn(move || -> Result<[Histogram<u64>; 3]> {
                let mut h = [Histogram::new(3)?, Histogram::new(3)?, Histogram::new(3)?];
                let input = [0u8; 16];
                let x = [TensorRef { dtype: DType::F32, shape: &[4], bytes: &input }];
                loop {
                    for session in &mut sessions {
                        let at = phase.load(Ordering::Relaxed);
                        if at == STOP {
                            return Ok(h);
                        }
                        let start = Instant::now();
                        match client.session_step(session, &[Value::Tensor(0)], &x) {
                            Ok(_) => h[usize::from(at)].record(start.elapsed().as_nanos() as u64)?,
                            Err(e) => {
                                eprintln!("a step failed: {e}");
                                failed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
            })
        })
        .collect();

    let seconds = Duration::try_from_secs_f64(args.seconds).context("--seconds")?;
    std::thread::sleep(seconds);
    phase.store(DURING, Ordering::Relaxed);
    let started = Instant::now();
    ops.drain(&drained, true)?;
    loop {
        let status: djinn_control::DrainStatus = serde_json::from_str(&ops.drain_status(&drained)?)?;
        if status.drained {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            bail!("the node was not drained in 10 minutes: {status:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let took = started.elapsed();
    phase.store(AFTER, Ordering::Relaxed);
    std::thread::sleep(seconds);
    phase.store(STOP, Ordering::Relaxed);
    let mut merged = [Histogram::<u64>::new(3)?, Histogram::new(3)?, Histogram::new(3)?];
    for stepper in steppers {
        let h = stepper.join().map_err(|_| anyhow::anyhow!("a stepping thread panicked"))??;
        for (m, h) in merged.iter_mut().zip(&h) {
            m.add(h)?;
        }
    }
    let failed = failed.load(Ordering::Relaxed);

    let link = raw(size as usize, 8, 20)?;
    let link_s = args.sessions as f64 * link.p50 / 1e6;
    let header =
        "| steps | count | p50 µs | p99 µs | p999 µs | p50 / before | p99 / before |\n|---|---|---|---|---|---|---|";
    println!("{header}");
    let mut rows = vec![header.to_owned()];
    let before = Stats::of(&merged[0]);
    for (name, h) in ["before the drain", "during the drain", "after the drain"].iter().zip(&merged) {
        let s = Stats::of(h);
        let row = format!(
            "| {name} | {} | {:.1} | {:.1} | {:.1} | **{:.2}** | **{:.2}** |",
            h.len(),
            s.p50,
            s.p99,
            s.p999,
            s.p50 / before.p50,
            s.p99 / before.p99
        );
        println!("{row}");
        rows.push(row);
    }
    let line = format!(
        "{} sessions of {} ({}) drained in {:.2} s, from the request to the renewal that said the node held nothing; \
         the same bytes over raw loopback TCP, one state at a time: {:.2} s (p50 {:.1} µs a state); failed steps: {failed}.",
        args.sessions,
        ByteSize(size),
        ByteSize(size * args.sessions as u64),
        took.as_secs_f64(),
        link_s,
        link.p50,
    );
    println!("\n{line}");
    if let Some(path) = &args.results {
        let notes = [
            format!("{} clients stepping the sessions in turn; nodes' device: cpu; transport: TCP.", args.clients),
            line,
        ];
        append_section(path, "drain", &notes, &rows.join("\n"))?;
    }
    ensure!(failed == 0, "{failed} steps failed during the drain");
    Ok(())
}
