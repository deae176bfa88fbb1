//! The node's side: an [`Executor`] whose jobs run in a child process.
//!
//! `run` only queues the job (it is called on the poller's thread and must not block); a sender
//! thread encodes each and pushes it down the link, sleeping while the rings are full, and a
//! reader thread takes the answers up, decodes them and hands each to the node's
//! [`Replier`], as the in-process executor's workers do. The node keeps which requests the
//! child holds: when the child ends, each of them is answered [`ErrorCode::ExecutorLost`] with
//! the cause, and so is every job after.

use std::collections::HashMap;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use djinn_node_core::link::{FromExecutor, ToExecutor};
use djinn_node_core::{Answer, Executor, Job, Replier, Reply, ReplyTo};
use djinn_proto::ErrorCode;
use djinn_shm::spawn_with_fds;
use djinn_sync::Locked;

use crate::channel::{self, LinkSizes, NodeEnds, link_limits};
use crate::{LINK_FD, SupervisorError};

/// How long the reader sleeps on an empty ring before it looks whether the child lives.
const LIVENESS_TICK: Duration = Duration::from_millis(50);

/// What the sender and the reader share with the executor's owner.
struct Shared {
    /// The node's replier, given with the first job (the reader answers through it).
    replier: Mutex<Option<Replier>>,
    /// The requests the child holds, by connection and request id.
    in_flight: Mutex<HashMap<(u64, u64), ReplyTo>>,
    /// Why the child is gone, once it is.
    lost: Mutex<Option<String>>,
    alive: AtomicBool,
    child: Mutex<Child>,
}

impl Shared {
    fn lost(&self) -> Option<String> {
        self.lost.locked().clone()
    }

    /// Answers `to` that the child is gone.
    fn refuse(&self, to: ReplyTo, why: &str, replier: &Replier) {
        replier.executed(to, Reply::error(ErrorCode::ExecutorLost, format!("the executor process ended: {why}")));
    }

    /// The child is gone, for `why`: each request it held is answered so.
    fn end(&self, why: String) {
        self.alive.store(false, Ordering::SeqCst);
        let mut lost = self.lost.locked();
        if lost.is_some() {
            return;
        }
        tracing::warn!(cause = %why, "an executor process ended");
        *lost = Some(why.clone());
        drop(lost);
        let held: Vec<ReplyTo> = self.in_flight.locked().drain().map(|(_, to)| to).collect();
        if let Some(replier) = self.replier.locked().clone() {
            for to in held {
                self.refuse(to, &why, &replier);
            }
        }
    }

    /// Whether the child still runs; when not, ends the link with its exit status as the cause.
    fn check_child(&self) -> bool {
        let status = self.child.locked().try_wait();
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

/// An executor in a child process, started by exec of a program that serves the link on the
/// descriptor [`LINK_FD`] (see [`crate::serve`]).
pub struct ProcessExecutor {
    jobs: Sender<ToExecutor>,
    shared: Arc<Shared>,
    epoch: u64,
    pid: u32,
    threads: Vec<JoinHandle<()>>,
}

impl ProcessExecutor {
    /// Starts `command` as an executor process with a link of `sizes`, and waits (up to
    /// `ready_within`) for it to say it is ready.
    pub fn start(mut command: Command, sizes: LinkSizes, ready_within: Duration) -> Result<Self, SupervisorError> {
        let (region, mut ends) = channel::create(sizes)?;
        let child = spawn_with_fds(&mut command, &[(region.fd(), LINK_FD)]).map_err(SupervisorError::Start)?;
        let pid = child.id();
        let shared = Arc::new(Shared {
            replier: Mutex::new(None),
            in_flight: Mutex::new(HashMap::new()),
            lost: Mutex::new(None),
            alive: AtomicBool::new(true),
            child: Mutex::new(child),
        });
        let epoch = match wait_ready(&mut ends, &shared, ready_within) {
            Ok(epoch) => epoch,
            Err(e) => {
                kill(&shared);
                return Err(e);
            }
        };
        let (jobs, queued) = crossbeam_channel::unbounded();
        let NodeEnds { jobs: down, job_bulk, answers, answer_bulk } = ends;
        let sender = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("executor-{pid}-send"))
                .spawn(move || send_jobs(queued, down, job_bulk, &shared))
                .map_err(SupervisorError::Thread)?
        };
        let reader = {
            let shared = Arc::clone(&shared);
            let region = Arc::clone(&region);
            std::thread::Builder::new()
                .name(format!("executor-{pid}-read"))
                .spawn(move || {
                    read_answers(answers, answer_bulk, &shared);
                    drop(region);
                })
                .map_err(SupervisorError::Thread)?
        };
        tracing::info!(pid, epoch = format_args!("{epoch:016x}"), "an executor process is ready");
        Ok(Self { jobs, shared, epoch, pid, threads: vec![sender, reader] })
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Why the child ended, once it has.
    pub fn lost(&self) -> Option<String> {
        self.shared.lost()
    }

    fn send(&self, message: ToExecutor) {
        // The sender lives as long as `self`.
        let _ = self.jobs.send(message);
    }
}

fn kill(shared: &Shared) {
    let mut child = shared.child.locked();
    let _ = child.kill();
    let _ = child.wait();
}

/// The child's first message, its epoch.
fn wait_ready(ends: &mut NodeEnds, shared: &Shared, within: Duration) -> Result<u64, SupervisorError> {
    let until = Instant::now() + within;
    let mut message = Vec::new();
    loop {
        if ends.answers.pop(&mut message)? {
            return match FromExecutor::decode(&message, &link_limits(), &mut ends.answer_bulk)? {
                FromExecutor::Ready { epoch } => Ok(epoch),
                FromExecutor::Answered { .. } => Err(SupervisorError::Protocol("an answer before it was ready")),
            };
        }
        if !shared.check_child() {
            return Err(SupervisorError::Ended(shared.lost().unwrap_or_default()));
        }
        if Instant::now() >= until {
            return Err(SupervisorError::NotReady(within));
        }
        ends.answers.wait(LIVENESS_TICK);
    }
}

fn send_jobs(
    queued: Receiver<ToExecutor>,
    mut down: djinn_shm::Producer,
    mut bulk: channel::BulkOut,
    shared: &Arc<Shared>,
) {
    let alive = {
        let shared = Arc::clone(shared);
        move || shared.alive.load(Ordering::SeqCst)
    };
    bulk.while_alive(alive.clone());
    let mut message = Vec::new();
    for job in queued {
        let to = match &job {
            ToExecutor::Run { to, .. } => Some(*to),
            _ => None,
        };
        if let (Some(why), Some(to)) = (shared.lost(), to) {
            if let Some(replier) = shared.replier.locked().clone() {
                shared.refuse(to, &why, &replier);
            }
            continue;
        }
        if let Some(to) = to {
            shared.in_flight.locked().insert((to.conn_id, to.request_id), to);
        }
        message.clear();
        let sent = job
            .encode(&mut message, &mut bulk)
            .map_err(|e| e.to_string())
            .and_then(|()| channel::push(&mut down, &message, &alive).map_err(|e| e.to_string()));
        if let Err(why) = sent {
            let Some(to) = to else {
                tracing::warn!(error = %why, "cannot send an executor what to free");
                continue;
            };
            // Not sent: the request is answered here, and the child knows nothing of it.
            if shared.in_flight.locked().remove(&(to.conn_id, to.request_id)).is_some()
                && let Some(replier) = shared.replier.locked().clone()
            {
                let code = if shared.alive.load(Ordering::SeqCst) {
                    ErrorCode::FrameTooLarge
                } else {
                    ErrorCode::ExecutorLost
                };
                replier.executed(to, Reply::error(code, format!("cannot hand the job to the executor process: {why}")));
            }
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
        // An answer to a request it does not hold is dropped: a child cannot answer for
        // another connection, nor twice.
        if shared.in_flight.locked().remove(&(to.conn_id, to.request_id)) != Some(to) {
            return compromised(shared, format!("an answer to request {} it does not hold", to.request_id));
        }
        let Some(replier) = shared.replier.locked().clone() else { continue };
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

impl Executor for ProcessExecutor {
    fn run(&mut self, job: Job, to: ReplyTo, replier: &Replier) {
        {
            let mut slot = self.shared.replier.locked();
            if slot.is_none() {
                *slot = Some(replier.clone());
            }
        }
        if let Some(why) = self.shared.lost() {
            return self.shared.refuse(to, &why, replier);
        }
        self.send(ToExecutor::Run { job, to });
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
        f.debug_struct("ProcessExecutor").field("pid", &self.pid).field("lost", &self.lost()).finish()
    }
}

impl Drop for ProcessExecutor {
    fn drop(&mut self) {
        kill(&self.shared);
        self.shared.end("the node stopped it".into());
        // The sender ends when its queue closes; the reader when it sees the child gone.
        let (closed, _) = crossbeam_channel::bounded(0);
        self.jobs = closed;
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}
