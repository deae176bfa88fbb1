//! The node's side: an [`Executor`] whose jobs run in a child process.
//!
//! Nothing here blocks the caller (the poller): `start` only starts the link thread, and `run`
//! only queues the job. The link thread makes the link, forks and execs the child (a fork of a
//! large node takes milliseconds), waits for it to say it is ready, then encodes
//! each job and pushes it down the link, sleeping while the rings are full; a reader thread
//! takes the answers up, decodes them and hands each to the [`Replier`] its job came with, as
//! the in-process executor's workers do. The node keeps which requests the child holds: when
//! the child ends (or is not ready in time), each of them is answered
//! [`ErrorCode::ExecutorLost`] with the cause, and so is every job after.

use std::collections::HashMap;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use djinn_node_core::link::{FromExecutor, ToExecutor};
use djinn_node_core::{Answer, Executor, Job, Replier, Reply, ReplyTo};
use djinn_proto::{DataMessage, ErrorCode, Message};
use djinn_shm::{Region, spawn_with_fds};
use djinn_sync::Locked;

use crate::channel::{self, LinkSizes, NodeEnds, link_limits};
use crate::{LINK_FD, SupervisorError, sandbox};

/// How long the reader sleeps on an empty ring before it looks whether the child lives.
const LIVENESS_TICK: Duration = Duration::from_millis(50);

/// What the sender and the reader share with the executor's owner.
struct Shared {
    /// The requests the child holds, by connection and request id, with where each answer
    /// goes and when it was sent.
    in_flight: Mutex<HashMap<(u64, u64), Held>>,
    /// When the child last answered (or was ready), for the deadline's watch.
    answered: Mutex<Instant>,
    supervision: Supervision,
    /// Why the child is gone, once it is.
    lost: Mutex<Option<String>>,
    alive: AtomicBool,
    /// The child, once the link thread has started it.
    child: Mutex<Option<Child>>,
    /// Its process id (0 until it is started).
    pid: AtomicU32,
    /// The layers of its sandbox it is in.
    layers: Mutex<sandbox::Layers>,
}

/// A request the child holds.
struct Held {
    to: ReplyTo,
    replier: Replier,
    sent: Instant,
    /// Whether it is a run the node's limit on one execution bounds.
    bounded: bool,
}

/// How the node supervises an executor process.
#[derive(Debug, Clone, Copy)]
pub struct Supervision {
    /// How long a new process has to say it is ready.
    pub ready_within: Duration,
    /// The node's limit on one execution (`--execute-deadline`; `None`: none). The executor ends
    /// a run past it between two operators; one that runs on inside an operator, or ignores
    /// it, is ended here: a process holding only runs that has answered nothing for the limit
    /// and `grace` is killed.
    pub run_deadline: Option<Duration>,
    pub grace: Duration,
    /// The most memory a process may hold resident, as the node reads it from /proc: the
    /// executor bounds what its tensors allocate itself; this bounds the rest (libraries'
    /// `malloc` inside kernels, a process that ignores its bounds). `None`: no limit.
    pub memory_limit: Option<u64>,
}

impl Supervision {
    /// The grace past the limit on one execution before the process is killed: time for the
    /// executor to notice the limit itself and answer.
    pub const GRACE: Duration = Duration::from_secs(2);
}

impl Shared {
    fn lost(&self) -> Option<String> {
        self.lost.locked().clone()
    }

    /// Answers `to` that the child is gone.
    fn refuse(to: ReplyTo, why: &str, replier: &Replier) {
        replier.executed(to, Reply::error(ErrorCode::ExecutorLost, format!("the executor process ended: {why}")));
    }

    /// The child is gone, for `why`: each request it held is answered so.
    fn end(&self, why: String) {
        self.alive.store(false, Ordering::SeqCst);
        // The held requests' lock first, then the cause's (as `hold` takes them): a request is
        // either held before the child is known lost, and answered here, or refused by `hold`.
        let mut in_flight = self.in_flight.locked();
        let mut lost = self.lost.locked();
        if lost.is_some() {
            return;
        }
        tracing::warn!(cause = %why, "an executor process ended");
        *lost = Some(why.clone());
        drop(lost);
        let held: Vec<Held> = in_flight.drain().map(|(_, held)| held).collect();
        drop(in_flight);
        for Held { to, replier, .. } in held {
            Self::refuse(to, &why, &replier);
        }
    }

    /// When the child holds only runs and has answered none for the limit on one execution
    /// and its grace (measured from the later of its last answer and the oldest run's sending):
    /// the oldest run's key and how long it has gone without an answer.
    fn overdue(&self) -> Option<((u64, u64), Duration)> {
        let limit = self.supervision.run_deadline? + self.supervision.grace;
        let in_flight = self.in_flight.locked();
        if in_flight.values().any(|held| !held.bounded) {
            return None;
        }
        let (&key, oldest) = in_flight.iter().min_by_key(|(_, held)| held.sent)?;
        let quiet = oldest.sent.max(*self.answered.locked()).elapsed();
        (quiet > limit).then_some((key, quiet))
    }

    /// The child's resident memory, when it is over the limit.
    fn over_memory(&self) -> Option<u64> {
        let limit = self.supervision.memory_limit?;
        let resident = resident_bytes(self.pid.load(Ordering::SeqCst))?;
        (resident > limit).then_some(resident)
    }

    /// Kills the child for a run past the limit: that run is answered `DeadlineExceeded`, every
    /// other request the child held `ExecutorLost`.
    fn end_overdue(&self, key: (u64, u64), quiet: Duration) {
        kill(self);
        let (limit, grace) = (self.supervision.run_deadline.unwrap_or_default(), self.supervision.grace);
        let why = format!(
            "killed: a run answered nothing for {quiet:.1?}, past the node's limit of {limit:?} on one execution and {grace:?} of grace"
        );
        if let Some(Held { to, replier, .. }) = self.in_flight.locked().remove(&key) {
            let message = format!(
                "the execution ran past the node's limit of {limit:?}: its executor process answered nothing for {quiet:.1?} (the limit and {grace:?} of grace) and was killed"
            );
            replier.executed(to, Reply::error(ErrorCode::DeadlineExceeded, message));
        }
        self.end(why);
    }

    /// Records that the child holds `to` (a run the limit on one execution bounds when
    /// `bounded`), unless it is lost (then `to` is answered so): whether it is held.
    fn hold(&self, to: ReplyTo, replier: &Replier, bounded: bool) -> bool {
        let mut in_flight = self.in_flight.locked();
        if let Some(why) = self.lost() {
            drop(in_flight);
            Self::refuse(to, &why, replier);
            return false;
        }
        let held = Held { to, replier: replier.clone(), sent: Instant::now(), bounded };
        in_flight.insert((to.conn_id, to.request_id), held);
        true
    }

    /// Whether the child still runs; when not, ends the link with its exit status as the cause.
    fn check_child(&self) -> bool {
        let status = match self.child.locked().as_mut() {
            Some(child) => child.try_wait(),
            None => Ok(None),
        };
        match status {
            Ok(None) => true,
            Ok(Some(status)) => {
                self.end(format!("{status}"));
                false
            }
            Err(e) => {
                self.end(format!("cannot wait for it: {e}"));
                false
            }
        }
    }
}

/// What waits for the sender thread: a job with the replier its answer goes to (and what to do
/// with it just before it is sent), ids to free, or the jobs a process runs before any other,
/// made on the sender's thread, past which nothing goes until each is answered or `within`
/// has passed.
enum Queued {
    Run { job: ToExecutor, replier: Replier, before: Option<BeforeSend> },
    Free(ToExecutor),
    First { jobs: Vec<FirstJob>, within: Duration },
}

/// Called on the link thread with a job just before it is sent to the process (work kept off
/// the caller's thread, the poller).
pub type BeforeSend = Box<dyn FnOnce(&Job) + Send>;

/// A job a new process runs before any other, made on its link thread (none: nothing to run).
pub type FirstJob = Box<dyn FnOnce() -> Option<(Job, ReplyTo)> + Send>;

/// An executor in a child process, started by exec of a program that serves the link on the
/// descriptor [`LINK_FD`] (see [`crate::serve`]).
pub struct ProcessExecutor {
    jobs: Sender<Queued>,
    shared: Arc<Shared>,
    epoch: u64,
    threads: Vec<JoinHandle<()>>,
}

impl ProcessExecutor {
    /// Starts `command` as an executor process with a link of `sizes`, whose handles are of
    /// `epoch`, supervised as `supervision` says; it has `ready_within` to say it is ready
    /// (jobs wait for it meanwhile). The jobs of `first` (a tenant's models loaded again), made
    /// on the link thread, run before any other, and every other waits until each of them has
    /// been answered or `ready_within` has passed; their answers go to no one (a failure is
    /// logged).
    pub fn start(
        command: Command,
        sizes: LinkSizes,
        epoch: u64,
        supervision: Supervision,
        first: Vec<FirstJob>,
    ) -> Result<Self, SupervisorError> {
        let ready_within = supervision.ready_within;
        let shared = Arc::new(Shared {
            in_flight: Mutex::new(HashMap::new()),
            lost: Mutex::new(None),
            alive: AtomicBool::new(true),
            child: Mutex::new(None),
            pid: AtomicU32::new(0),
            layers: Mutex::new(sandbox::Layers::NONE),
            answered: Mutex::new(Instant::now()),
            supervision,
        });
        let (jobs, queued) = crossbeam_channel::unbounded();
        if !first.is_empty() {
            let _ = jobs.send(Queued::First { jobs: first, within: ready_within });
        }
        let link = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("executor-link".into())
                .spawn(move || {
                    let (region, ends) = match launch(command, sizes, &shared) {
                        Ok(started) => started,
                        Err(e) => {
                            shared.end(format!("cannot start it: {e}"));
                            return refuse_queued(queued, &shared);
                        }
                    };
                    let NodeEnds { jobs: down, job_bulk, mut answers, mut answer_bulk } = ends;
                    let pid = shared.pid.load(Ordering::SeqCst);
                    match wait_ready(&mut answers, &mut answer_bulk, &shared, epoch, ready_within) {
                        Ok(()) => {
                            tracing::debug!(pid, "an executor process is ready");
                            note_layers(pid, &shared);
                        }
                        Err(why) => {
                            kill(&shared);
                            shared.end(why);
                        }
                    }
                    let reader = {
                        let shared = Arc::clone(&shared);
                        std::thread::Builder::new().name(format!("executor-{pid}-read")).spawn(move || {
                            read_answers(answers, answer_bulk, &shared);
                            drop(region);
                        })
                    };
                    send_jobs(queued, down, job_bulk, &shared);
                    if let Ok(reader) = reader {
                        let _ = reader.join();
                    }
                })
                .map_err(SupervisorError::Thread)?
        };
        Ok(Self { jobs, shared, epoch, threads: vec![link] })
    }

    /// The child's process id, once it is started.
    pub fn pid(&self) -> Option<u32> {
        Some(self.shared.pid.load(Ordering::SeqCst)).filter(|&pid| pid != 0)
    }

    /// The layers of its sandbox the child is in (those entered before exec once it starts;
    /// its system-call filter once it is ready).
    pub fn layers(&self) -> sandbox::Layers {
        *self.shared.layers.locked()
    }

    /// Why the child ended, once it has.
    pub fn lost(&self) -> Option<String> {
        self.shared.lost()
    }

    fn send(&self, message: ToExecutor) {
        // The sender lives as long as `self`.
        let _ = self.jobs.send(Queued::Free(message));
    }
}

/// Makes the link and starts `command` as the child at its end.
fn launch(mut command: Command, sizes: LinkSizes, shared: &Shared) -> Result<(Arc<Region>, NodeEnds), SupervisorError> {
    let (region, ends) = channel::create(sizes)?;
    let confined = sandbox::confine(&mut command);
    let child = spawn_with_fds(&mut command, &[(region.fd(), LINK_FD)]).map_err(SupervisorError::Start)?;
    let pid = child.id();
    *shared.layers.locked() = confined.entered();
    shared.pid.store(pid, Ordering::SeqCst);
    *shared.child.locked() = Some(child);
    tracing::debug!(pid, "an executor process starts");
    // Stopped while it was being started (`Drop` marks it lost before it kills): kill it here.
    if shared.lost().is_some() {
        kill(shared);
    }
    Ok((region, ends))
}

/// Records the layers of its sandbox a ready child is in (its system-call filter entered by
/// itself before it said it was ready), and logs those the host did not allow.
fn note_layers(pid: u32, shared: &Shared) {
    let mut layers = shared.layers.locked();
    if sandbox::layers_of(pid).contains(sandbox::Layer::Seccomp) {
        *layers = layers.with(sandbox::Layer::Seccomp);
    }
    for layer in sandbox::Layer::ALL.into_iter().filter(|&layer| !layers.contains(layer)) {
        tracing::warn!(pid, %layer, "this host does not let an executor process enter a layer of its sandbox");
    }
}

/// Answers every queued request that the child is lost.
fn refuse_queued(queued: Receiver<Queued>, shared: &Shared) {
    for job in queued {
        if let Queued::Run { job: ToExecutor::Run { to, .. }, replier, .. } = job {
            shared.hold(to, &replier, false);
        }
    }
}

/// What the process `pid` holds resident (/proc's statm, in pages).
fn resident_bytes(pid: u32) -> Option<u64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf with a valid name.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

fn kill(shared: &Shared) {
    if let Some(child) = shared.child.locked().as_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Waits for the child's first message, that it is ready with handles of `epoch`: the cause
/// of its loss when it is not.
fn wait_ready(
    answers: &mut djinn_shm::Consumer,
    bulk: &mut channel::BulkIn,
    shared: &Shared,
    epoch: u64,
    within: Duration,
) -> Result<(), String> {
    let until = Instant::now() + within;
    let mut message = Vec::new();
    loop {
        if answers.pop(&mut message).map_err(|e| format!("its first message: {e}"))? {
            return match FromExecutor::decode(&message, &link_limits(), bulk) {
                Ok(FromExecutor::Ready { epoch: its }) if its == epoch => Ok(()),
                Ok(FromExecutor::Ready { epoch: its }) => {
                    Err(format!("it makes handles of epoch {its:x}, not {epoch:x}"))
                }
                Ok(FromExecutor::Answered { .. }) => Err("it answered before it was ready".into()),
                Err(e) => Err(format!("its first message: {e}")),
            };
        }
        if !shared.check_child() {
            return Err(shared.lost().unwrap_or_default());
        }
        if Instant::now() >= until {
            return Err(format!("it was not ready within {within:?}"));
        }
        answers.wait(LIVENESS_TICK);
    }
}

fn send_jobs(
    queued: Receiver<Queued>,
    mut down: djinn_shm::Producer,
    mut bulk: channel::BulkOut,
    shared: &Arc<Shared>,
) {
    let alive = {
        let shared = Arc::clone(shared);
        move || shared.alive.load(Ordering::SeqCst)
    };
    bulk.while_alive(alive.clone());
    let mut sender = JobsDown { down: &mut down, bulk: &mut bulk, alive: &alive, message: Vec::new() };
    for job in queued {
        match job {
            Queued::Run { job, replier, before } => sender.send(job, Some(&replier), before, shared),
            Queued::Free(free) => sender.send(free, None, None, shared),
            Queued::First { jobs, within } => {
                let (replier, answers) = Replier::new(Arc::new(|| {}));
                let mut count = 0;
                for (job, to) in jobs.into_iter().filter_map(|make| make()) {
                    sender.send(ToExecutor::Run { job, to }, Some(&replier), None, shared);
                    count += 1;
                }
                wait_for(&answers, count, within);
            }
        }
    }
}

/// The link thread's end of the jobs' ring.
struct JobsDown<'a, A: Fn() -> bool> {
    down: &'a mut djinn_shm::Producer,
    bulk: &'a mut channel::BulkOut,
    alive: &'a A,
    message: Vec<u8>,
}

impl<A: Fn() -> bool> JobsDown<'_, A> {
    /// Sends `job`, held with `replier` when it is a request; a request not sent is answered
    /// here, and the child knows nothing of it.
    fn send(&mut self, job: ToExecutor, replier: Option<&Replier>, before: Option<BeforeSend>, shared: &Shared) {
        let (to, bounded) = match &job {
            ToExecutor::Run { to, job } => {
                (Some(*to), matches!(job, Job::Execute { .. } | Job::Step { .. } | Job::Resume { .. }))
            }
            _ => (None, false),
        };
        if let (Some(to), Some(replier)) = (to, replier)
            && !shared.hold(to, replier, bounded)
        {
            return;
        }
        if let (Some(before), ToExecutor::Run { job, .. }) = (before, &job) {
            before(job);
        }
        self.message.clear();
        let sent = job
            .encode(&mut self.message, self.bulk)
            .map_err(|e| e.to_string())
            .and_then(|()| channel::push(self.down, &self.message, self.alive).map_err(|e| e.to_string()));
        let Err(why) = sent else { return };
        let Some(to) = to else {
            return tracing::warn!(error = %why, "cannot send an executor what to free");
        };
        if let Some(Held { replier, .. }) = shared.in_flight.locked().remove(&(to.conn_id, to.request_id)) {
            let code =
                if shared.alive.load(Ordering::SeqCst) { ErrorCode::FrameTooLarge } else { ErrorCode::ExecutorLost };
            replier.executed(to, Reply::error(code, format!("cannot hand the job to the executor process: {why}")));
        }
    }
}

/// Waits for `count` answers on `answers`, logging the refusals among them.
fn wait_for(answers: &Receiver<(ReplyTo, Answer)>, count: usize, within: Duration) {
    let until = Instant::now() + within;
    for _ in 0..count {
        let Ok((to, answer)) = answers.recv_deadline(until) else {
            tracing::warn!("an executor process did not answer the jobs it runs first in time");
            return;
        };
        let reply = match &answer {
            Answer::Reply(reply) => reply,
            Answer::Executed(executed) => &executed.reply,
        };
        if let Message::Data(DataMessage::Error { code, message }) = &reply.message {
            tracing::warn!(tenant = to.tenant.0, ?code, %message, "a job an executor process runs first failed");
        }
    }
}

fn read_answers(mut answers: djinn_shm::Consumer, mut bulk: channel::BulkIn, shared: &Shared) {
    answers.set_spin(Duration::ZERO);
    let limits = link_limits();
    let mut message = Vec::new();
    loop {
        match answers.pop(&mut message) {
            Ok(true) => {}
            Ok(false) => {
                if !shared.alive.load(Ordering::SeqCst) || !shared.check_child() {
                    return;
                }
                if let Some((run, quiet)) = shared.overdue() {
                    return shared.end_overdue(run, quiet);
                }
                if let Some(resident) = shared.over_memory() {
                    kill(shared);
                    let limit = shared.supervision.memory_limit.unwrap_or_default();
                    return shared.end(format!(
                        "killed: it held {resident} bytes resident, past the node's limit of {limit} on an executor process"
                    ));
                }
                answers.wait(LIVENESS_TICK);
                continue;
            }
            Err(e) => return compromised(shared, format!("its answers' ring: {e}")),
        }
        let (to, answer) = match FromExecutor::decode(&message, &limits, &mut bulk) {
            Ok(FromExecutor::Answered { to, answer }) => (to, answer),
            Ok(FromExecutor::Ready { .. }) => return compromised(shared, "said it was ready twice".into()),
            Err(e) => return compromised(shared, format!("an answer that does not decode: {e}")),
        };
        // A child cannot answer for another connection, nor twice.
        let held = shared.in_flight.locked().remove(&(to.conn_id, to.request_id));
        *shared.answered.locked() = Instant::now();
        let Some(Held { replier, .. }) = held.filter(|held| held.to == to) else {
            return compromised(shared, format!("an answer to request {} it does not hold", to.request_id));
        };
        match answer {
            Answer::Reply(reply) => replier.send(to, reply),
            Answer::Executed(executed) => replier.executed(to, executed),
        }
    }
}

/// The child wrote what no executor writes: it is killed and treated as lost.
fn compromised(shared: &Shared, why: String) {
    tracing::error!(cause = %why, "an executor process broke the link; killing it");
    kill(shared);
    shared.end(format!("killed: it broke the link ({why})"));
}

impl ProcessExecutor {
    /// As [`Executor::run`], calling `before` with the job on the link thread just before it is
    /// sent (not when the process is lost first).
    pub fn run_with(&mut self, job: Job, to: ReplyTo, replier: &Replier, before: Option<BeforeSend>) {
        if let Some(why) = self.shared.lost() {
            return Shared::refuse(to, &why, replier);
        }
        // The sender lives as long as `self`.
        let _ = self.jobs.send(Queued::Run { job: ToExecutor::Run { job, to }, replier: replier.clone(), before });
    }
}

impl Executor for ProcessExecutor {
    fn run(&mut self, job: Job, to: ReplyTo, replier: &Replier) {
        self.run_with(job, to, replier, None);
    }

    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn free_kept(&mut self, ids: &[u64]) {
        self.send(ToExecutor::FreeKept(ids.to_vec()));
    }

    fn free_parked(&mut self, ids: &[u64]) {
        self.send(ToExecutor::FreeParked(ids.to_vec()));
    }

    fn free_sessions(&mut self, ids: &[u64]) {
        self.send(ToExecutor::FreeSessions(ids.to_vec()));
    }
}

impl std::fmt::Debug for ProcessExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessExecutor").field("pid", &self.pid()).field("lost", &self.lost()).finish()
    }
}

impl Drop for ProcessExecutor {
    fn drop(&mut self) {
        // Lost first, so that a child the link thread starts meanwhile is killed by it.
        self.shared.end("the node stopped it".into());
        kill(&self.shared);
        // The sender ends when its queue closes; the reader when it sees the child gone.
        let (closed, _) = crossbeam_channel::bounded(0);
        self.jobs = closed;
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}
