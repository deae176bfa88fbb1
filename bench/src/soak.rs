//! `djinn bench soak`: many clients of two tenants send random valid and invalid requests to
//! two node processes for a fixed time, dropping their connections now and then, while one of
//! the nodes is killed and restarted. At the end: the share of valid requests to the node that
//! stayed up that succeeded (at least 99.9%, or `--min-success`), results checked against what
//! they must be (none wrong), every failure a typed error, and the steady node's memory back
//! within 16 MiB of its baseline. Exits with an error when any of these does not hold.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use djinn_client::{Client, ClientError, ClientOptions, DType, ErrorCode, Fingerprint, TensorRef, Value};
use djinn_executor::tch;
use djinn_proto::{DataMessage, Handle, Message, TensorDesc, encode_head};
use tch::jit::CModule;
use tch::{Device, Kind, Tensor, nn, nn::Module};

use crate::Spawned;
use crate::execute::archive;
use crate::report::{append_section, bytes_of};
use djinn_sync::Locked;

#[derive(Args, Debug)]
pub struct SoakArgs {
    /// How long the clients run, seconds.
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    /// Client threads (half of them each tenant's).
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Seed of the clients' choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Append the summary, the command and the machine to this markdown file.
    #[arg(long)]
    results: Option<PathBuf>,
    /// The least share of valid requests to the steady node that must succeed, percent. Where
    /// the machine is loaded (a test on a shared CI host), requests time out: a typed failure
    /// that says more of the machine than of the node, and such a run sets this lower.
    #[arg(long, default_value_t = 99.9, value_parser = percent)]
    min_success: f64,
    /// Run the steady node with `--executor-processes` and kill one of its executor processes
    /// (SIGKILL, at random) every this many seconds. Its requests answered `ExecutorLost` (in
    /// flight on a killed process, or naming what one held) are counted apart, not against
    /// --min-success.
    #[arg(long)]
    kill_executors: Option<f64>,
}

/// A share in percent, 0 to 100.
fn percent(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(p) if (0.0..=100.0).contains(&p) => Ok(p),
        _ => Err(format!("{text:?} is not a percentage from 0 to 100")),
    }
}

const TOKENS: [&str; 2] = ["soak-tenant-0-secret", "soak-tenant-1-secret"];
/// The most the steady node's memory may have grown when the run ends.
const MEMORY_SLACK: u64 = 16 << 20;

/// What the clients saw.
#[derive(Default)]
struct Tally {
    /// Valid requests to the node that stays up: sent, succeeded.
    steady: (u64, u64),
    /// Of them, those answered `ExecutorLost` (its executor process killed).
    executor_lost: u64,
    /// Valid requests to the node that is killed: sent, succeeded.
    killed: (u64, u64),
    /// Invalid requests: sent, refused as they must be.
    invalid: (u64, u64),
    wrong: u64,
    /// Failures (of valid requests) and unexpected answers (to invalid ones), by type.
    errors: BTreeMap<String, u64>,
    /// Failures that were not a typed error.
    untyped: u64,
    disconnects: u64,
    first_wrong: Vec<String>,
}

impl Tally {
    fn merge(&mut self, other: Tally) {
        let add = |a: &mut (u64, u64), b: (u64, u64)| {
            a.0 += b.0;
            a.1 += b.1;
        };
        add(&mut self.steady, other.steady);
        add(&mut self.killed, other.killed);
        add(&mut self.invalid, other.invalid);
        self.executor_lost += other.executor_lost;
        self.wrong += other.wrong;
        self.untyped += other.untyped;
        self.disconnects += other.disconnects;
        for (k, v) in other.errors {
            *self.errors.entry(k).or_default() += v;
        }
        self.first_wrong.extend(other.first_wrong);
        self.first_wrong.truncate(5);
    }

    fn failed(&mut self, e: &ClientError) {
        let (label, typed) = label(e);
        *self.errors.entry(label).or_default() += 1;
        if !typed {
            self.untyped += 1;
        }
    }
}

/// The error's type, and whether it is one a client can act on (an internal error or a reply
/// of the wrong kind is not).
fn label(e: &ClientError) -> (String, bool) {
    match e {
        ClientError::Remote { code, .. } => (format!("{code:?}"), *code != ErrorCode::Internal),
        ClientError::Io { source, .. } => (format!("transport: {:?}", source.kind()), true),
        ClientError::Closed { .. } => ("transport: closed".into(), true),
        ClientError::Timeout { .. } => ("transport: timeout".into(), true),
        ClientError::Protocol { source, .. } => (format!("protocol: {:?}", source.code()), true),
        ClientError::UnexpectedReply { kind, .. } => (format!("unexpected {kind} reply"), false),
        other => (format!("client: {other}"), true),
    }
}

enum Outcome {
    Ok,
    Wrong(String),
    Failed(ClientError),
}

impl From<ClientError> for Outcome {
    fn from(e: ClientError) -> Self {
        Self::Failed(e)
    }
}

/// xorshift64*: the clients' choices, reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// The model every tenant registers on both nodes, and its forward here for checking.
struct Model {
    archive: Vec<u8>,
    local: CModule,
}

impl Model {
    fn new() -> Result<Self> {
        tch::manual_seed(11);
        let _grad = tch::no_grad_guard();
        let mut vs = nn::VarStore::new(Device::Cpu);
        let mlp = nn::seq()
            .add(nn::linear(vs.root() / "fc1", 64, 128, Default::default()))
            .add_fn(|x| x.relu())
            .add(nn::linear(vs.root() / "fc2", 128, 64, Default::default()));
        vs.freeze();
        let x = Tensor::randn([4, 64], (Kind::Float, Device::Cpu));
        let archive = archive("soak_mlp", std::slice::from_ref(&x), &mut |xs| vec![mlp.forward(&xs[0])])?;
        let local = CModule::load_data(&mut archive.as_slice()).context("load the model here")?;
        Ok(Self { archive, local })
    }

    /// The output the node must return for `input` (this process's own forward of its own
    /// model: a failure is a bug of the bench).
    fn expected(&self, input: &[f32]) -> Vec<u8> {
        let _grad = tch::no_grad_guard();
        let x = Tensor::from_slice(input).reshape([4, 64]);
        let out = self.local.forward_ts(&[&x]).expect("the bench's forward of its own model");
        bytes_of(&out).to_vec()
    }
}

/// One client thread's connection to one node, opened (again) when needed, with the model's
/// fingerprint there once registered.
struct Link {
    addr: SocketAddr,
    token: &'static str,
    client: Option<Client>,
    model: Option<Fingerprint>,
}

impl Link {
    /// The connection, and the model's fingerprint on the node.
    fn client(&mut self, archive: &[u8]) -> Result<(&mut Client, Fingerprint), ClientError> {
        if self.client.is_none() {
            let options =
                ClientOptions { token: self.token.into(), timeout: Some(Duration::from_secs(5)), ..Default::default() };
            self.client = Some(Client::connect_with(self.addr, options)?);
        }
        let Some(client) = self.client.as_mut() else { unreachable!("connected above") };
        let fingerprint = match self.model {
            Some(fingerprint) => fingerprint,
            None => client.register_model(&[archive], |_, _| {})?.fingerprint,
        };
        self.model = Some(fingerprint);
        Ok((client, fingerprint))
    }
}

struct Worker {
    id: usize,
    tenant: usize,
    rng: Rng,
    steady: Link,
    killed: Link,
    model: Arc<Model>,
    tally: Tally,
    serial: u64,
}

impl Worker {
    fn run(mut self, deadline: Instant, done: &AtomicU64) -> Tally {
        while Instant::now() < deadline {
            let roll = self.rng.below(100);
            if roll < 2 {
                // Drop the connection; the next request opens a new one.
                self.steady.client = None;
                self.killed.client = None;
                self.tally.disconnects += 1;
            } else if roll < 20 {
                self.invalid();
            } else {
                let to_killed = roll >= 80;
                let outcome = self.valid(to_killed);
                let (sent, ok) = if to_killed { &mut self.tally.killed } else { &mut self.tally.steady };
                *sent += 1;
                match outcome {
                    Outcome::Ok => *ok += 1,
                    Outcome::Wrong(what) => {
                        self.tally.wrong += 1;
                        self.tally.first_wrong.push(what);
                    }
                    Outcome::Failed(e) => {
                        self.tally.failed(&e);
                        if !to_killed && e.remote_code() == Some(ErrorCode::ExecutorLost) {
                            self.tally.executor_lost += 1;
                        }
                        let link = if to_killed { &mut self.killed } else { &mut self.steady };
                        // A restarted node forgot the model: register it again.
                        if e.remote_code() == Some(ErrorCode::UnknownModel) {
                            link.model = None;
                        }
                    }
                }
            }
            done.fetch_add(1, Ordering::Relaxed);
        }
        self.tally
    }

    fn valid(&mut self, to_killed: bool) -> Outcome {
        self.serial += 1;
        let name = format!("t{}c{}-{}", self.tenant, self.id, self.serial);
        let op = self.rng.below(4);
        let len = 1 + self.rng.below(64 << 10) as usize;
        let bytes = self.rng.bytes(len);
        let input: Vec<f32> = (0..256).map(|_| (self.rng.below(2000) as f32 - 1000.0) / 500.0).collect();
        let tenant = self.tenant;
        let model = Arc::clone(&self.model);
        let link = if to_killed { &mut self.killed } else { &mut self.steady };
        let (client, fingerprint) = match link.client(&model.archive) {
            Ok(c) => c,
            Err(e) => {
                link.client = None;
                return e.into();
            }
        };
        let result = (|| -> Result<Outcome, ClientError> {
            match op {
                0 => {
                    client.put(&name, DType::U8, &[len as u64], &bytes)?;
                    let back = client.get(&name);
                    let _ = client.delete(&name);
                    if back?.bytes() != bytes {
                        return Ok(Outcome::Wrong(format!("get {name}: other bytes than were put")));
                    }
                }
                1 => {
                    let input_bytes: Vec<u8> = input.iter().flat_map(|v| v.to_le_bytes()).collect();
                    let x = [TensorRef { dtype: DType::F32, shape: &[4, 64], bytes: &input_bytes }];
                    let out = client.execute(&fingerprint, &[Value::Tensor(0)], &x)?;
                    if out.tensor_bytes(0) != model.expected(&input).as_slice() {
                        return Ok(Outcome::Wrong("execute: the output differs from the local forward".into()));
                    }
                }
                2 => {
                    let kept = client.keep(TensorRef { dtype: DType::U8, shape: &[len as u64], bytes: &bytes })?;
                    let back = client.fetch(kept.handle);
                    let _ = client.release(&[kept.handle]);
                    if back?.bytes() != bytes {
                        return Ok(Outcome::Wrong("fetch: other bytes than were kept".into()));
                    }
                }
                _ => {
                    let prefix = format!("t{tenant}c");
                    if let Some(other) = client.list()?.into_iter().find(|e| !e.name.starts_with(&prefix)) {
                        return Ok(Outcome::Wrong(format!("list: {:?} is another tenant's", other.name)));
                    }
                }
            }
            Ok(Outcome::Ok)
        })();
        result.unwrap_or_else(Outcome::Failed)
    }

    /// A request that must be refused (sent to the steady node), or bytes that are no request.
    fn invalid(&mut self) {
        self.tally.invalid.0 += 1;
        let kind = self.rng.below(7);
        let junk_len = 1 + self.rng.below(512) as usize;
        let junk = self.rng.bytes(junk_len);
        let random_fp = Fingerprint(std::array::from_fn(|_| self.rng.next() as u8));
        let handle = Handle { id: self.rng.next(), epoch: self.rng.next() };
        let addr = self.steady.addr;
        let model = Arc::clone(&self.model);
        let expected: Result<(), String> = match kind {
            0..=3 => {
                let (client, fingerprint) = match self.steady.client(&model.archive) {
                    Ok(c) => c,
                    Err(e) => {
                        self.steady.client = None;
                        self.tally.failed(&e);
                        return;
                    }
                };
                let (got, want): (Result<(), ClientError>, &[ErrorCode]) = match kind {
                    0 => (client.get("no-such-tensor").map(drop), &[ErrorCode::NotFound]),
                    1 => (client.execute(&random_fp, &[], &[]).map(drop), &[ErrorCode::UnknownModel]),
                    2 => {
                        let x = [TensorRef { dtype: DType::F32, shape: &[3, 7], bytes: &[0u8; 84] }];
                        (client.execute(&fingerprint, &[Value::Tensor(0)], &x).map(drop), &[ErrorCode::ExecutionFailed])
                    }
                    _ => (client.fetch(handle).map(drop), &[ErrorCode::NotFound, ErrorCode::StaleHandle]),
                };
                match got {
                    Err(e) if e.remote_code().is_some_and(|c| want.contains(&c)) => Ok(()),
                    Err(e) => {
                        self.tally.failed(&e);
                        return;
                    }
                    Ok(()) => Err("an invalid request succeeded".into()),
                }
            }
            4 => {
                let options = ClientOptions { token: "not-a-known-token-at-all".into(), ..Default::default() };
                match Client::connect_with(addr, options) {
                    Err(e) if e.remote_code() == Some(ErrorCode::Unauthenticated) => Ok(()),
                    Err(e) => {
                        self.tally.failed(&e);
                        return;
                    }
                    Ok(_) => Err("a wrong token was let in".into()),
                }
            }
            5 => garbage(addr, &junk),
            _ => truncated(addr, junk.len()),
        };
        match expected {
            Ok(()) => self.tally.invalid.1 += 1,
            Err(what) => {
                *self.tally.errors.entry(what).or_default() += 1;
                self.tally.untyped += 1;
            }
        }
    }
}

/// Bytes that are no frame: the node answers an error frame and closes, or just closes.
fn garbage(addr: SocketAddr, junk: &[u8]) -> Result<(), String> {
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    let _ = stream.write_all(junk);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut answer = Vec::new();
    match stream.read_to_end(&mut answer) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(()),
        Err(e) => Err(format!("garbage: no answer and no close ({:?})", e.kind())),
    }
}

/// Half a put, then the connection goes: the node drops the frame.
fn truncated(addr: SocketAddr, sent: usize) -> Result<(), String> {
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    let desc = TensorDesc::new(DType::U8, vec![1 << 20]).map_err(|e| e.to_string())?;
    let mut frame = Vec::new();
    encode_head(&mut frame, 1, &Message::Data(DataMessage::Put { name: "cut".into(), tensor: desc }))
        .map_err(|e| e.to_string())?;
    frame.resize(frame.len() + sent, 0);
    let _ = stream.write_all(&frame);
    Ok(())
}

/// The executor processes of the node `node` (its children running `djinn executor`).
fn executor_processes(node: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let parent =
                stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            parent == Some(node) && cmdline.split(|&b| b == 0).any(|arg| arg == b"executor")
        })
        .collect()
}

/// The process's own resident memory: its RSS less the shared memory it maps (the links to
/// its executor processes, each bounded by its size and gone with its process).
fn rss(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |field: &str| -> Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .with_context(|| format!("no {field} in /proc/{pid}/status"))
    };
    Ok((kib("VmRSS:")? - kib("RssShmem:")?) * 1024)
}

pub fn run(args: SoakArgs) -> Result<()> {
    tch::set_num_threads(1);
    ensure!(args.clients >= 2, "--clients: at least one per tenant");
    let duration = Duration::try_from_secs_f64(args.duration).context("--duration: a number of seconds")?;
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.json");
    let principals: Vec<String> = TOKENS
        .iter()
        .enumerate()
        .map(|(i, t)| format!(r#"{{"name": "tenant{i}", "tokens": ["{t}"], "rights": ["torchscript"]}}"#))
        .collect();
    std::fs::write(&tokens, format!(r#"{{"principals": [{}]}}"#, principals.join(",")))?;
    let tokens_arg = tokens.display().to_string();
    // A small buffer pool, so that memory given back shows in the node's RSS.
    let node = move |listen: &str, extra: &[&str]| {
        let args = ["node", "--listen", listen, "--log", "error", "--auth-file", &tokens_arg];
        Spawned::start(&[&args[..], &["--buffer-pool", "8MiB", "--stall-timeout", "2"], extra].concat())
    };
    let steady = node("127.0.0.1:0", if args.kill_executors.is_some() { &["--executor-processes"] } else { &[] })?;
    let node = move |listen: &str| node(listen, &[]);
    let killed = node("127.0.0.1:0")?;
    let killed_addr = killed.addr;
    let model = Arc::new(Model::new()?);

    let worker = |id: usize| {
        let token = TOKENS[id % 2];
        let link = |addr| Link { addr, token, client: None, model: None };
        Worker {
            id,
            tenant: id % 2,
            rng: Rng(args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (id as u64 + 1)),
            steady: link(steady.addr),
            killed: link(killed_addr),
            model: Arc::clone(&model),
            tally: Tally::default(),
            serial: 0,
        }
    };

    // Warm-up: each tenant's model on both nodes, and rounds of every request, before the
    // baseline is taken.
    for tenant in 0..2 {
        let mut warm = Worker { serial: 1 << 40, ..worker(tenant) };
        for to_killed in [false, true] {
            for _ in 0..40 {
                match warm.valid(to_killed) {
                    Outcome::Ok => {}
                    Outcome::Wrong(what) => bail!("the warm-up got a wrong result: {what}"),
                    Outcome::Failed(e) => bail!("the warm-up failed: {e}"),
                }
            }
        }
        for _ in 0..20 {
            warm.invalid();
        }
        ensure!(warm.tally.untyped == 0, "the warm-up's invalid requests: {:?}", warm.tally.errors);
    }
    let workers: Vec<Worker> = (0..args.clients).map(worker).collect();
    std::thread::sleep(Duration::from_millis(500));
    let baseline = rss(steady.pid())?;
    println!("steady node's baseline RSS: {:.1} MiB", baseline as f64 / 1048576.0);

    let started = Instant::now();
    let deadline = started + duration;
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let threads: Vec<_> = workers
        .into_iter()
        .map(|w| {
            let (done, tally) = (Arc::clone(&done), Arc::clone(&tally));
            std::thread::spawn(move || {
                let t = w.run(deadline, &done);
                tally.locked().merge(t);
            })
        })
        .collect();
    // The killed node: down a third of the way in, back (same address) two seconds later.
    let restarter = {
        let stop = Arc::clone(&stop);
        let node = node.clone();
        std::thread::spawn(move || -> Result<(Spawned, Duration)> {
            std::thread::sleep(duration / 3);
            let down_at = Instant::now();
            drop(killed);
            println!("killed the node at {killed_addr}");
            std::thread::sleep(Duration::from_secs(2));
            let mut back = node(&killed_addr.to_string());
            while back.is_err() && !stop.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(200));
                back = node(&killed_addr.to_string());
            }
            println!("restarted it after {:.1} s", down_at.elapsed().as_secs_f64());
            Ok((back?, down_at.elapsed()))
        })
    };
    // The steady node's executor processes, one killed at random every interval.
    let killer = args.kill_executors.map(|every| {
        let (node, seed) = (steady.pid(), args.seed);
        std::thread::spawn(move || -> Result<u64> {
            let every = Duration::try_from_secs_f64(every).context("--kill-executors: a number of seconds")?;
            let (mut rng, mut kills) = (Rng(seed ^ 0x6b69_6c6c), 0);
            while Instant::now() + every < deadline {
                std::thread::sleep(every);
                let processes = executor_processes(node);
                if let Some(&pid) = processes.get(rng.below(processes.len().max(1) as u64) as usize) {
                    let killed = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status();
                    kills += u64::from(killed.is_ok_and(|status| status.success()));
                }
            }
            Ok(kills)
        })
    });
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_secs(10).min(deadline.saturating_duration_since(Instant::now())));
        println!(
            "{:>5.0} s: {} requests, steady node RSS {:.1} MiB",
            started.elapsed().as_secs_f64(),
            done.load(Ordering::Relaxed),
            rss(steady.pid())? as f64 / 1048576.0
        );
    }
    for t in threads {
        let _ = t.join();
    }
    stop.store(true, Ordering::Release);
    let (_restarted, downtime) = restarter.join().map_err(|_| anyhow::anyhow!("the restarter panicked"))??;
    let kills = match killer {
        Some(killer) => Some(killer.join().map_err(|_| anyhow::anyhow!("the killer panicked"))??),
        None => None,
    };
    std::thread::sleep(Duration::from_secs(2));
    let after = rss(steady.pid())?;
    let mut check = Client::connect_with(
        steady.addr,
        ClientOptions { token: TOKENS[0].into(), timeout: Some(Duration::from_secs(5)), ..Default::default() },
    )?;
    let stats = check.stats()?;
    let stat = |name: &str| stats.iter().find(|(k, _)| k == name).map_or(0, |(_, v)| *v);

    let tally = std::mem::take(&mut *tally.locked());
    let share = |(sent, ok): (u64, u64)| if sent == 0 { 0.0 } else { 100.0 * ok as f64 / sent as f64 };
    // What a killed executor process held is not counted against the steady node.
    let steady_served = (tally.steady.0 - tally.executor_lost, tally.steady.1);
    let growth = after as i64 - baseline as i64;
    let mut out = String::new();
    writeln!(out, "| | |\n|---|---|")?;
    writeln!(out, "| duration | {:.0} s, {} clients of 2 tenants, seed {} |", args.duration, args.clients, args.seed)?;
    writeln!(
        out,
        "| valid requests to the steady node | {} sent, {} succeeded (**{:.3}%** of those not answered `ExecutorLost`, bound {}%) |",
        tally.steady.0,
        tally.steady.1,
        share(steady_served),
        args.min_success
    )?;
    if let (Some(kills), Some(every)) = (kills, args.kill_executors) {
        writeln!(
            out,
            "| the steady node's executor processes | {kills} killed (SIGKILL, one every {every} s at random); {} requests answered `ExecutorLost` |",
            tally.executor_lost
        )?;
    }
    writeln!(
        out,
        "| valid requests to the killed node | {} sent, {} succeeded ({:.1}%; down {:.1} s, killed at {:.0} s) |",
        tally.killed.0,
        tally.killed.1,
        share(tally.killed),
        downtime.as_secs_f64(),
        args.duration / 3.0
    )?;
    writeln!(
        out,
        "| invalid requests and garbage (steady node) | {} sent, {} refused as they must be |",
        tally.invalid.0, tally.invalid.1
    )?;
    writeln!(out, "| wrong results | **{}** |", tally.wrong)?;
    writeln!(out, "| failures that were not a typed error | **{}** |", tally.untyped)?;
    writeln!(out, "| connections dropped by clients | {} |", tally.disconnects)?;
    let errors: Vec<String> = tally.errors.iter().map(|(k, v)| format!("{k} × {v}")).collect();
    writeln!(out, "| failures and unexpected answers, by type | {} |", errors.join(", "))?;
    writeln!(
        out,
        "| steady node RSS (less shared memory) | {:.1} MiB before, {:.1} MiB after (**{:+.1} MiB**, bound +16 MiB) |",
        baseline as f64 / 1048576.0,
        after as f64 / 1048576.0,
        growth as f64 / 1048576.0
    )?;
    writeln!(
        out,
        "| steady node counters | protocol failures {}, stalled connections {}, auth failures {}, named tensors left {}, kept tensors left {}, budget in use {} B |",
        stat("protocol_failures"),
        stat("stalled_connections"),
        stat("auth_failures"),
        stat("store_tensors"),
        stat("handles"),
        stat("budget_used_bytes"),
    )?;
    println!("{out}");
    for w in &tally.first_wrong {
        println!("wrong: {w}");
    }
    let passed = share(steady_served) >= args.min_success
        && tally.wrong == 0
        && tally.untyped == 0
        && growth <= MEMORY_SLACK as i64;
    if let Some(path) = &args.results {
        let verdict = if passed { "all four criteria hold" } else { "FAILED" };
        append_section(path, "soak", &[format!("Verdict: {verdict}.")], &out)?;
    }
    ensure!(passed, "the soak run failed its criteria (see the table)");
    Ok(())
}
