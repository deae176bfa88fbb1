//! `djinn bench move`: a session's state moved node to node (two node processes on loopback, a
//! move as a client makes one: the target's grant, then the move; back and forth between the
//! nodes), 64 KiB to 256 MiB of state, against the link it crosses, measured in the same run: a
//! raw one-way TCP send of the same bytes between two processes, answered by 8 bytes (over
//! RDMA, `ib_write_bw` at that size on the same device). The ratio is the move's bandwidth over
//! the link's. Then, at the largest size, a step sent from another client right behind each
//! move: how much longer than the move it took (it waits for the move, is told where the session
//! went, and runs there), beside the same client's step of the same session with no move.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Args;
use djinn_client::{
    Client, ClientOptions, ClusterClient, DType, FailoverOptions, Fingerprint, Handle, RemoteSession, TensorRef, Value,
};
use djinn_memory::ByteSize;
use hdrhistogram::Histogram;

use crate::Spawned;
use crate::rdma::LinkArgs;
use crate::report::{Stats, append_section, measure, measure_timed};

#[derive(Args, Debug)]
pub struct MoveArgs {
    /// State sizes.
    #[arg(long, value_delimiter = ',', default_value = "64KiB,1MiB,16MiB,64MiB,256MiB")]
    sizes: Vec<ByteSize>,
    /// Bytes moved per measurement (iterations = this / size, between 10 and 1000).
    #[arg(long, default_value = "2GiB")]
    volume: ByteSize,
    /// Steps sent behind a move of the largest state.
    #[arg(long, default_value_t = 50)]
    behind: u64,
    #[command(flatten)]
    link: LinkArgs,
    /// Append the tables, the command and the machine to this markdown file.
    #[arg(long)]
    results: Option<PathBuf>,
    #[command(flatten)]
    model: CarryModel,
}

/// Where the session's model comes from: a step returns its input's sum and the state, passed
/// through unchanged.
#[derive(Args, Debug)]
pub(crate) struct CarryModel {
    /// The Python that writes the session's model (TorchScript methods with several outputs
    /// cannot be traced from Rust).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python"))]
    python: PathBuf,
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/move_model.py"))]
    model_script: PathBuf,
}

impl CarryModel {
    /// The model's archive, written by `--model-script`.
    pub(crate) fn archive(&self) -> Result<Vec<u8>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("carry.pt");
        let output = std::process::Command::new(&self.python)
            .arg(&self.model_script)
            .arg(&path)
            .output()
            .with_context(|| format!("cannot run {} (see --python)", self.python.display()))?;
        let why = || String::from_utf8_lossy(&output.stderr).into_owned();
        ensure!(output.status.success(), "{} failed: {}", self.model_script.display(), why());
        Ok(std::fs::read(&path)?)
    }
}

const HEADER: &str =
    "| state | move p50 µs | p99 µs | p999 µs | move GB/s | link GB/s | move / link |\n|---|---|---|---|---|---|---|";

/// Two nodes, each holding the session's model, and a client of each.
struct Pair {
    addrs: [String; 2],
    clients: [Client; 2],
    model: Fingerprint,
    _nodes: [Spawned; 2],
}

impl Pair {
    /// Moves `session` (at node `from`) to the other node, as a client does: the grant, then
    /// the move. Its handle there.
    fn move_from(&mut self, from: usize, session: Handle) -> Result<Handle> {
        let to = 1 - from;
        let grant = self.clients[to].grant_session(&self.model)?;
        let (_, moved) = self.clients[from].session_move(session, &self.addrs[to], &grant)?;
        Ok(moved)
    }
}

pub fn run(args: MoveArgs) -> Result<()> {
    let model = args.model.archive()?;

    // Each node may move the session to the other: each is the other's push peer.
    let free = || -> Result<String> { Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.to_string()) };
    let addrs = [free()?, free()?];
    let start = |listen: &str, peer: &str| {
        let mut node_args = vec!["node", "--listen", listen, "--push-peers", peer, "--device", "cpu", "--log", "warn"];
        node_args.extend(["--device-memory-budget", "2GiB", "--session-budget", "1GiB", "--push-timeout", "60"]);
        node_args.extend(args.link.node_args());
        Spawned::start(&node_args)
    };
    let nodes = [start(&addrs[0], &addrs[1])?, start(&addrs[1], &addrs[0])?];
    let mut clients = [Client::connect(nodes[0].addr)?, Client::connect(nodes[1].addr)?];
    let fingerprint = clients[0].register_model(std::slice::from_ref(&model), |_, _| {})?.fingerprint;
    clients[1].register_model(&[model], |_, _| {})?;
    let mut pair = Pair { addrs, clients, model: fingerprint, _nodes: nodes };

    println!("{HEADER}");
    let mut rows = vec![HEADER.to_owned()];
    let input = [0u8; 16];
    let x = [TensorRef { dtype: DType::F32, shape: &[4], bytes: &input }];
    for size in args.sizes.iter().map(|s| s.0) {
        let iters = (args.volume.0 / size.max(1)).clamp(10, 1000);
        let bytes = vec![5u8; size as usize];
        let state = [TensorRef { dtype: DType::U8, shape: &[size], bytes: &bytes }];
        let mut at = 0;
        let mut session = pair.clients[0].session_open(&pair.model, &state, 0)?;
        pair.clients[0].session_step(session, &[Value::Tensor(0)], &x)?;
        let moves = measure_timed(iters, || {
            let start = Instant::now();
            session = pair.move_from(at, session)?;
            let took = start.elapsed();
            at = 1 - at;
            Ok(took)
        })?;
        pair.clients[at].session_close(session)?;
        let gbps = |s: &Stats| size as f64 / (s.p50 * 1e3);
        let (link, link_gbps) = args.link.baseline(size, iters)?;
        let row = format!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.3} | {link} | **{:.2}** |",
            ByteSize(size),
            moves.p50,
            moves.p99,
            moves.p999,
            gbps(&moves),
            gbps(&moves) / link_gbps,
        );
        println!("{row}");
        rows.push(row);
    }

    let largest = args.sizes.iter().map(|s| s.0).max().unwrap_or(0);
    let behind = steps_behind_moves(&mut pair, largest, args.behind)?;
    let line = format!(
        "A step sent right behind a move of {}: it ended after the move by p50 {:.1} µs, p99 {:.1} µs, p999 {:.1} µs \
         (the move took p50 {:.1} µs; the same step with no move, p50 {:.1} µs, p99 {:.1} µs).",
        ByteSize(largest),
        behind.after.p50,
        behind.after.p99,
        behind.after.p999,
        behind.moves.p50,
        behind.plain.p50,
        behind.plain.p99
    );
    println!("\n{line}");
    if let Some(path) = &args.results {
        let notes = [format!("Nodes' device: cpu; transport: {}.", args.link.name()), line];
        append_section(path, "move", &notes, &rows.join("\n"))?;
    }
    Ok(())
}

struct Behind {
    /// How long after the move's answer the step's came.
    after: Stats,
    moves: Stats,
    /// A step with no move: what a step costs in any case.
    plain: Stats,
}

/// Moves a session of `size` bytes `rounds` times; each time another client (a cluster client
/// that still has the session where it was) steps it right after the move is sent.
fn steps_behind_moves(pair: &mut Pair, size: u64, rounds: u64) -> Result<Behind> {
    let bytes = vec![5u8; size as usize];
    let state = [TensorRef { dtype: DType::U8, shape: &[size], bytes: &bytes }];
    let mut session = pair.clients[0].session_open(&pair.model, &state, 0)?;
    let mut at = 0;
    let (mut after, mut moves) = (Histogram::<u64>::new(3)?, Histogram::<u64>::new(3)?);
    let mut stepper = ClusterClient::open(&pair.addrs[0], ClientOptions::default(), FailoverOptions::default())?;
    // The first two rounds (a move each way) open the stepping client's connections to both
    // nodes, an RDMA queue pair's set-up included: they are not counted.
    for round in 0..rounds + 2 {
        let to = 1 - at;
        let grant = pair.clients[to].grant_session(&pair.model)?;
        let mut remote = RemoteSession { node: pair.addrs[at].clone(), session, fingerprint: pair.model, key: None };
        let (addr, from) = (pair.addrs[to].clone(), &mut pair.clients[at]);
        let counted = round >= 2;
        let (moved, (stepped, step_end)) = std::thread::scope(|s| -> Result<_> {
            let start = Instant::now();
            let stepping = s.spawn(|| {
                // Sent once the move is on its way (the node takes requests in order only per
                // connection: this one comes on another, a moment later).
                std::thread::sleep(Duration::from_micros(200));
                let input = [0u8; 16];
                let x = [TensorRef { dtype: DType::F32, shape: &[4], bytes: &input }];
                let out = stepper.session_step(&mut remote, &[Value::Tensor(0)], &x);
                (out.map(|_| remote.node.clone()), Instant::now())
            });
            let moved = from.session_move(session, &addr, &grant)?;
            let move_end = Instant::now();
            if counted {
                moves.record(move_end.duration_since(start).as_nanos() as u64)?;
            }
            let (stepped, step_end) = stepping.join().map_err(|_| anyhow::anyhow!("the stepping thread panicked"))?;
            Ok((moved, (stepped, step_end.saturating_duration_since(move_end))))
        })?;
        // A step that reached the node before the move ran there first: it was not behind it.
        if stepped? == addr && counted {
            after.record(step_end.as_nanos() as u64)?;
        }
        session = moved.1;
        at = to;
    }
    // The baseline: the same client's step of the same session where it is, with no move.
    let mut remote = RemoteSession { node: pair.addrs[at].clone(), session, fingerprint: pair.model, key: None };
    let input = [0u8; 16];
    let x = [TensorRef { dtype: DType::F32, shape: &[4], bytes: &input }];
    let plain = measure(rounds.max(20), || {
        stepper.session_step(&mut remote, &[Value::Tensor(0)], &x).map(drop).map_err(Into::into)
    })?;
    pair.clients[at].session_close(session)?;
    Ok(Behind { after: Stats::of(&after), moves: Stats::of(&moves), plain })
}
