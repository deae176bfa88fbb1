//! Executor worker threads. The poller hands them model work through a queue served fairly
//! between tenants (`fair.rs`; it never runs model code itself); they answer through the data
//! plane's `Replier`.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use std::time::{Duration, Instant};

use djinn_auth::TenantId;
use djinn_node_core::{Executed, PeerError, Replier, Reply, ReplyTo, TenantNames};
use djinn_proto::{
    Breakpoint, BreakpointMessage, DType, DataMessage, Handle, KeptMessage, Message, ModelMessage, Payload,
    SessionEntry, SessionMessage, SharedBytes, Signal, TensorDesc, Value,
};
use tch::{Device, Tensor};

use crate::allocator::JobMemory;
use crate::convert::{OutputTensor, Outputs, aliases, input_tensors, kept_inputs, model_value};
use crate::cost::{self, Account, Limits};
use crate::deadline;
use crate::error::ExecError;
use crate::error::SessionError;
use crate::fair::FairQueue;
use crate::kept::KeptTensors;
use crate::models::{Model, ModelStore, spread};
use crate::parked::{Parked, ParkedTable, SessionStep, Stopped, check_breakpoint, check_parkable};
use crate::sessions::Sessions;
use crate::value::ModelValue;
use djinn_node_core::CallInputs;
use djinn_node_core::Upload;
use djinn_sync::Locked;

pub enum Work {
    Execute {
        model: Arc<Model>,
        inputs: CallInputs,
        keep: bool,
        until: Option<Breakpoint>,
    },
    Load {
        upload: Upload,
    },
    /// Drops an unregistered model (the last reference, unless a request still runs it) and
    /// acknowledges the unregistration.
    Free {
        model: Arc<Model>,
    },
    /// Keeps a received tensor in device memory.
    Keep {
        tensor: TensorDesc,
        payload: Option<Payload>,
    },
    /// Sends a kept tensor's bytes back.
    Fetch {
        handle: Handle,
    },
    /// Opens a session: its initial state goes to the device.
    SessionOpen {
        model: Arc<Model>,
        /// The initial state's tensors, in the payload (none: the graph's own initial state).
        state: Vec<TensorDesc>,
        payload: Option<Payload>,
        reserve: u64,
    },
    /// A session's step (the core hands the executor a session's requests one at a time).
    Step {
        id: u64,
        inputs: CallInputs,
        until: Option<Breakpoint>,
    },
    Signal {
        id: u64,
        signal: Signal,
    },
    Close {
        id: u64,
    },
    /// Reads a session's state into host memory, as the `Open` that makes it a session on the
    /// node it moves to.
    Move {
        id: u64,
    },
    /// Ends a session's move as the peer answered: the session is there now (its state here
    /// is freed, on this worker), or it stays here.
    EndMove {
        id: u64,
        moved: Result<(String, Handle), PeerError>,
    },
    /// Ends a session's step that parked and was aborted: the state stays as before it.
    EndStep {
        id: u64,
    },
    /// Brings a swapped-out session's state back ahead of its agent's expected resume (no
    /// reply).
    Restore {
        id: u64,
    },
    /// Frees sessions the core found idle (no reply).
    FreeSessions {
        ids: Vec<u64>,
    },
    /// Runs a parked request on from its breakpoint (taken out of the table by the poller).
    Resume {
        handle: Handle,
        parked: Parked,
        /// The activation that replaces the parked one, if any, and the tensors it names.
        activation: Option<Value>,
        tensors: Vec<TensorDesc>,
        payload: Option<Payload>,
        until: Option<Breakpoint>,
    },
    /// Sends a parked request's activation back.
    Inspect {
        activation: ModelValue,
        handle: Handle,
        block: usize,
    },
    /// Reads bytes of a model's archives back.
    ReadArchives {
        model: Arc<Model>,
        public: bool,
        offset: u64,
        len: u64,
    },
    /// Lists a page of the sessions after `after`: the caller's, or every tenant's, each named
    /// as `all` names it.
    ListSessions {
        all: Option<TenantNames>,
        after: u64,
    },
}

struct Envelope {
    job: Work,
    /// Where the job's reply goes; `None` for a job that answers its requests itself.
    reply: Option<(ReplyTo, Replier)>,
}

/// The jobs waiting for a worker, by tenant, and how many queues can still add to them.
struct Queued {
    jobs: FairQueue<Envelope>,
    /// Live [`WorkQueue`]s: the workers stop once none is left and every job is done.
    senders: usize,
}

struct Scheduler {
    queued: Mutex<Queued>,
    ready: Condvar,
}

impl Scheduler {
    fn lock(&self) -> MutexGuard<'_, Queued> {
        self.queued.locked()
    }

    /// Queues a job in `tenant`'s turn.
    fn push(&self, counters: &WorkerCounters, tenant: TenantId, envelope: Envelope) {
        counters.queued.fetch_add(1, Ordering::Relaxed);
        self.lock().jobs.push(tenant, envelope);
        self.ready.notify_one();
    }
}

/// What the worker threads share.
struct Shared {
    device: Device,
    models: Arc<Mutex<ModelStore>>,
    kept: Arc<Mutex<KeptTensors>>,
    sessions: Sessions,
    parked: Arc<Mutex<ParkedTable>>,
    counters: Arc<WorkerCounters>,
    /// What bounds an execution: its deadline, its graph runs' plans (see `cost.rs`).
    limits: Limits,
}

impl Shared {
    /// Runs an execution of `tenant`'s under the node's deadline, its graph runs planned and
    /// charged to the tenant before each runs.
    /// On a CPU node the job's allocations are counted as they happen too (see
    /// `allocator.rs`), and a job that failed for an allocation refused says so, typed.
    fn limited<T>(&self, tenant: TenantId, f: impl FnOnce() -> Result<T, ExecError>) -> Result<T, ExecError> {
        let memory = (self.device == Device::Cpu)
            .then(|| JobMemory::open(tenant, &self.limits.budget, self.limits.max_run_bytes));
        let account = Rc::new(Account { tenant, limits: self.limits.clone(), memory });
        // A panic (a tch call that failed for an allocation refused) is an error here, so that
        // the refusal below still names it.
        let f = || caught(f);
        let result = cost::within(Some(Rc::clone(&account)), || {
            deadline::within(self.limits.deadline, || match &account.memory {
                Some(memory) => memory.charging(f),
                None => f(),
            })
        });
        match (result, account.memory.as_ref().and_then(JobMemory::refusal)) {
            (Err(_), Some(refused)) => {
                self.limits.counters.allocations_refused.fetch_add(1, Ordering::Relaxed);
                Err(refused)
            }
            (result, _) => result,
        }
    }
}

#[derive(Debug, Default)]
pub struct WorkerCounters {
    pub executions: AtomicU64,
    pub execution_errors: AtomicU64,
    /// Time the workers spent on executions (inputs, the run, outputs; not the wire).
    pub execution_ns: AtomicU64,
    pub loads: AtomicU64,
    pub load_errors: AtomicU64,
    /// Jobs submitted and not finished (waiting or running).
    pub queued: AtomicU64,
}

/// The way into the workers; clones of it queue work from other threads (the session clock).
pub struct WorkQueue {
    scheduler: Arc<Scheduler>,
    counters: Arc<WorkerCounters>,
}

impl Clone for WorkQueue {
    fn clone(&self) -> Self {
        self.scheduler.lock().senders += 1;
        Self { scheduler: Arc::clone(&self.scheduler), counters: Arc::clone(&self.counters) }
    }
}

impl Drop for WorkQueue {
    fn drop(&mut self) {
        let mut queued = self.scheduler.lock();
        queued.senders -= 1;
        if queued.senders == 0 {
            self.scheduler.ready.notify_all();
        }
    }
}

impl WorkQueue {
    /// Queues `job`, which answers no request, in `tenant`'s turn.
    pub fn quiet(&self, tenant: TenantId, job: Work) {
        self.send(tenant, Envelope { job, reply: None });
    }

    fn send(&self, tenant: TenantId, envelope: Envelope) {
        self.scheduler.push(&self.counters, tenant, envelope);
    }
}

pub struct Workers {
    /// Dropped first on shutdown: the workers stop once every queue is gone.
    queue: Option<WorkQueue>,
    threads: Vec<JoinHandle<()>>,
    pub counters: Arc<WorkerCounters>,
    pub limits: Limits,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers").field("threads", &self.threads.len()).finish()
    }
}

/// What the workers work on, shared with the node's service.
pub struct Tables {
    pub models: Arc<Mutex<ModelStore>>,
    pub kept: Arc<Mutex<KeptTensors>>,
    pub sessions: Sessions,
    pub parked: Arc<Mutex<ParkedTable>>,
}

impl Workers {
    pub fn start(
        count: usize,
        intra_op_threads: usize,
        device: Device,
        tables: Tables,
        limits: Limits,
    ) -> std::io::Result<Self> {
        let Tables { models, kept, sessions, parked } = tables;
        let scheduler = Arc::new(Scheduler {
            queued: Mutex::new(Queued { jobs: FairQueue::default(), senders: 1 }),
            ready: Condvar::new(),
        });
        let counters = Arc::new(WorkerCounters::default());
        let shared = Arc::new(Shared {
            device,
            models,
            kept,
            sessions,
            parked,
            counters: Arc::clone(&counters),
            limits: limits.clone(),
        });
        let threads = (0..count.max(1))
            .map(|i| {
                let scheduler = Arc::clone(&scheduler);
                let shared = Arc::clone(&shared);
                std::thread::Builder::new().name(format!("djinn-worker-{i}")).spawn(move || {
                    // OpenMP's and MKL's thread counts are each thread's own: set on the node's
                    // main thread, they leave a worker's matrix products on every core, each
                    // waiting on the others (and on the poller) at every operation.
                    tch::set_num_threads(intra_op_threads.clamp(1, i32::MAX as usize) as i32);
                    work(&scheduler, &shared)
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { queue: Some(WorkQueue { scheduler, counters: Arc::clone(&counters) }), threads, counters, limits })
    }

    /// Queues `job` in its tenant's turn (the tenant of the connection it came on).
    pub fn submit(&self, job: Work, to: ReplyTo, replier: &Replier) {
        if let Some(queue) = &self.queue {
            queue.send(to.tenant, Envelope { job, reply: Some((to, replier.clone())) });
        }
    }

    /// Queues `job`, which answers no request, in `tenant`'s turn.
    pub fn quiet(&self, tenant: TenantId, job: Work) {
        if let Some(queue) = &self.queue {
            queue.quiet(tenant, job);
        }
    }

    pub fn queue(&self) -> Option<WorkQueue> {
        self.queue.clone()
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.queue = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// How long an idle worker keeps polling its queue before it sleeps: a request that comes in
/// that window costs no thread wake-up (about 20 µs each on these machines).
const WORKER_SPIN: Duration = Duration::from_micros(100);

/// The next job in turn, with its tenant; `None` once no queue is left and nothing is queued.
fn next_job(scheduler: &Scheduler) -> Option<(TenantId, Envelope)> {
    let until = Instant::now() + WORKER_SPIN;
    loop {
        let mut queued = scheduler.lock();
        if let Some(job) = queued.jobs.pop() {
            return Some(job);
        }
        if queued.senders == 0 {
            return None;
        }
        if Instant::now() >= until {
            loop {
                queued = scheduler.ready.wait(queued).unwrap_or_else(|e| e.into_inner());
                if let Some(job) = queued.jobs.pop() {
                    return Some(job);
                }
                if queued.senders == 0 {
                    return None;
                }
            }
        }
        drop(queued);
        std::thread::yield_now();
    }
}

fn work(scheduler: &Scheduler, shared: &Shared) {
    let Shared { device, models, kept, sessions, counters, .. } = shared;
    let device = *device;
    while let Some((tenant, Envelope { job, reply })) = next_job(scheduler) {
        // Jobs that answer no request: a panic in one is logged, and the worker goes on.
        let quiet = |f: &dyn Fn()| {
            if let Err(e) = caught(|| {
                f();
                Ok(())
            }) {
                tracing::warn!(error = %e, "a session's restore or release failed");
            }
            counters.queued.fetch_sub(1, Ordering::Relaxed);
        };
        let job = match job {
            Work::Restore { id } => {
                quiet(&|| sessions.table.locked().restore_ahead(id));
                continue;
            }
            Work::FreeSessions { ids } => {
                quiet(&|| {
                    // Their states are freed after the table's lock is let go.
                    let states = sessions.table.locked().expire(&ids);
                    drop(states);
                });
                continue;
            }
            job => job,
        };
        // What the node's stats count, by kind of job: (done, failed).
        let counted = match job {
            Work::Execute { .. } | Work::Resume { .. } => Some((&counters.executions, &counters.execution_errors)),
            Work::Load { .. } => Some((&counters.loads, &counters.load_errors)),
            _ => None,
        };
        // A session's state that left, freed once the answer has gone (a large one takes a while).
        let mut free_after = Vec::new();
        let resumed = match &job {
            Work::Resume { handle, .. } => Some(handle.id),
            _ => None,
        };
        let started = Instant::now();
        let timed = matches!(job, Work::Execute { .. } | Work::Resume { .. });
        let result = caught(|| match job {
            Work::Execute { model, inputs, keep, until } => {
                shared.limited(tenant, || execute(tenant, model, inputs, keep, until, shared))
            }
            Work::Resume { handle, parked, activation, tensors, payload, until } => shared.limited(tenant, || {
                let replacement = Replacement { activation, tensors, payload };
                resume(handle, parked, replacement, until, shared)
            }),
            Work::Step { id, inputs, until } => {
                let stepped = shared.limited(tenant, || step(tenant, id, inputs, until, shared));
                if stepped.is_err() {
                    // Whatever failed (a panic included), the session is not stepping any more.
                    let _ = sessions.table.locked().end_step(id, None);
                }
                stepped
            }
            Work::Signal { id, signal } => {
                sessions.table.locked().signal(id, signal);
                Ok(Reply::message(SessionMessage::Signaled))
            }
            Work::Close { id } => {
                free_after.extend(sessions.table.locked().close(id).into_iter().flatten());
                Ok(Reply::message(SessionMessage::Closed))
            }
            Work::Move { id } => caught(|| session_state(id, shared)).inspect_err(|e| {
                sessions.table.locked().move_failed(id);
                tracing::info!(session = id, error = %e, "session move failed: it stays here");
            }),
            Work::EndMove { id, moved } => end_move(id, moved, shared, &mut free_after),
            Work::EndStep { id } => {
                let _ = sessions.table.locked().end_step(id, None);
                Ok(Reply::message(BreakpointMessage::Aborted))
            }
            Work::Inspect { activation, handle, block } => {
                Ok(paused(handle, block, Sent::activation(Some(&activation))?))
            }
            Work::Load { upload } => load(upload, device, models),
            Work::Free { model } => {
                drop(model);
                Ok(Reply::message(ModelMessage::UnregisterAck))
            }
            Work::Keep { tensor, payload } => keep(&tensor, payload, device, kept),
            Work::Fetch { handle } => fetch(handle, kept),
            Work::SessionOpen { model, state, payload, reserve } => {
                open_session(tenant, model, &state, payload, reserve, sessions)
            }
            Work::ReadArchives { model, public, offset, len } => {
                let (blocks, bytes) = model.read_archives(offset, len)?;
                let chunk = TensorDesc::new(DType::U8, vec![bytes.len() as u64])
                    .map_err(|e| ExecError::Internal(e.to_string()))?;
                Ok(Reply {
                    message: ModelMessage::ArchiveBytes { blocks, public, chunk }.into(),
                    tensors: vec![Arc::new(bytes) as SharedBytes],
                })
            }
            Work::ListSessions { all, after } => {
                let (listed, more) = sessions.table.locked().list(all.is_none().then_some(tenant), after);
                let sessions = listed
                    .into_iter()
                    .map(|(owner, session, fingerprint, state_bytes)| SessionEntry {
                        tenant: all.as_ref().and_then(|names| names.get(&owner).cloned()).unwrap_or_default(),
                        session,
                        fingerprint,
                        state_bytes,
                    })
                    .collect();
                Ok(Reply::message(SessionMessage::SessionList { sessions, more }))
            }
            Work::Restore { .. } | Work::FreeSessions { .. } => {
                Err(ExecError::Internal("a job that answers no request among those that do".into()))
            }
        });
        if timed {
            counters.execution_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        let result = match result {
            Ok(reply) => {
                if let Some((done, _)) = counted {
                    done.fetch_add(1, Ordering::Relaxed);
                }
                reply
            }
            Err(e) => {
                if let Some((_, failed)) = counted {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
                tracing::debug!(error = %e, "request failed");
                error_reply(e)
            }
        };
        counters.queued.fetch_sub(1, Ordering::Relaxed);
        if let Some((to, replier)) = reply {
            // A resume whose blocks failed before they ran left its request parked.
            let still_parked = resumed.is_some_and(|id| shared.parked.locked().holds(id));
            replier.executed(to, Executed { reply: result, still_parked });
        }
        drop(free_after);
    }
}

/// Runs `f`, turning a panic into an error.
fn caught<T>(f: impl FnOnce() -> Result<T, ExecError>) -> Result<T, ExecError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let what =
            panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()));
        Err(ExecError::Internal(format!("worker panicked: {}", what.unwrap_or_default())))
    })
}

/// The answer to a request that failed.
pub(crate) fn error_reply(e: ExecError) -> Reply {
    Reply::error(e.code(), e.to_string())
}

/// A moving session's state, read into host memory, as the `Open` that makes it a session on
/// the peer. The state stays here, unchanged, until the move ends.
fn session_state(id: u64, shared: &Shared) -> Result<Reply, ExecError> {
    let (model, state, reserve) = shared.sessions.table.locked().begin_move(id)?;
    let mut descs = Vec::with_capacity(state.len());
    let mut tensors = Vec::with_capacity(state.len());
    for t in state {
        let (bytes, desc) = OutputTensor::new(t, None)?;
        descs.push(desc);
        tensors.push(Arc::new(bytes) as SharedBytes);
    }
    let open = SessionMessage::Open { fingerprint: model.fingerprint, state: descs, reserve };
    Ok(Reply { message: open.into(), tensors })
}

/// Ends session `id`'s move as the peer answered: on the peer, its state here leaves the table
/// (into `free_after`); refused, it stays here as it was.
fn end_move(
    id: u64,
    moved: Result<(String, Handle), PeerError>,
    shared: &Shared,
    free_after: &mut Vec<Tensor>,
) -> Result<Reply, ExecError> {
    let sessions = &shared.sessions.table;
    match moved {
        Ok((peer, session)) => {
            free_after.extend(sessions.locked().moved_out(id));
            tracing::info!(session = id, peer = %peer, "session moved");
            Ok(Reply::message(SessionMessage::Moved { to: peer, session }))
        }
        Err((code, message)) => {
            sessions.locked().move_failed(id);
            tracing::info!(session = id, error = %message, "session move failed: it stays here");
            Err(ExecError::Moving { code, message })
        }
    }
}

/// One step: the model runs on the inputs followed by the state; the last outputs become the
/// new state. A step with a breakpoint parks (the session's later requests wait).
fn step(
    tenant: TenantId,
    id: u64,
    inputs: CallInputs,
    until: Option<Breakpoint>,
    shared: &Shared,
) -> Result<Reply, ExecError> {
    let (model, state) = shared.sessions.table.locked().begin_step(id)?;
    let session = SessionStep { id, state: state.len() };
    let payload = inputs.payload.map(Arc::new);
    let tensors = input_tensors(&inputs.tensors, payload.as_ref(), model.device)?;
    let kept = kept_inputs(&inputs.values, &shared.kept)?;
    let mut args = inputs.values.iter().map(|v| model_value(v, &tensors, &kept)).collect::<Result<Vec<_>, _>>()?;
    args.extend(state.into_iter().map(ModelValue::Tensor));
    let run = Run { tenant, model, first: 0, keep: false, session: Some(session), payload };
    let ran = run.blocks(args, until)?;
    run.reply(ran, shared)
}

/// A run of a model's blocks from `first`: an execute, a session step, or a resume.
struct Run {
    tenant: TenantId,
    model: Arc<Model>,
    first: usize,
    /// The final outputs stay on the node.
    keep: bool,
    session: Option<SessionStep>,
    /// The request's payload, which input tensors may be views of.
    payload: Option<Arc<Payload>>,
}

/// How far a run went.
enum Ran {
    /// It stopped after `block`; `send`: the reply carries the activation.
    Stopped {
        activation: ModelValue,
        block: usize,
        send: bool,
    },
    Done(ModelValue),
}

impl Run {
    /// Runs the blocks, to the breakpoint when there is one.
    fn blocks(&self, args: Vec<ModelValue>, until: Option<Breakpoint>) -> Result<Ran, ExecError> {
        let blocks = self.model.blocks();
        Ok(match until {
            Some(b) => {
                let block = check_breakpoint(b.block, self.first, blocks)?;
                let activation = self.model.forward_range(args, self.first, block)?;
                Ran::Stopped { activation, block, send: b.send_activation }
            }
            None => Ran::Done(self.model.forward_range(args, self.first, blocks.saturating_sub(1))?),
        })
    }

    /// Parks a stopped run, or answers a finished one (a session's new state taken first).
    fn reply(self, ran: Ran, shared: &Shared) -> Result<Reply, ExecError> {
        let output = match ran {
            Ran::Stopped { activation, block, send } => return self.park(activation, block, send, shared),
            Ran::Done(output) => output,
        };
        let output = match self.session {
            Some(s) => {
                let (output, new_state) = split_state(output, s.state)?;
                let new_state = new_state
                    .into_iter()
                    .map(|t| owned(&t, self.payload.as_ref()))
                    .collect::<Result<Vec<_>, ExecError>>()?;
                shared.sessions.table.locked().end_step(s.id, Some(new_state))?;
                output
            }
            None => output,
        };
        let mut outputs = Outputs::new(self.payload, self.keep.then_some(&*shared.kept));
        let output = outputs.value(output).inspect_err(|_| outputs.release_kept())?;
        Ok(Reply {
            message: Message::Model(ModelMessage::ExecuteReply { tensors: outputs.descs, output, kept: outputs.kept }),
            tensors: outputs.tensors.into_iter().map(|t| Arc::new(t) as SharedBytes).collect(),
        })
    }

    fn park(self, activation: ModelValue, block: usize, send: bool, shared: &Shared) -> Result<Reply, ExecError> {
        check_parkable(&activation)?;
        // The request's payload goes back with the request: what the activation shares of it is
        // copied (see `aliases`).
        let payload = self.payload.as_ref();
        let activation =
            activation.map_tensors(&mut |t| if aliases(&t, payload) { t.f_detach_copy() } else { Ok(t) })?;
        let sent = Sent::activation(send.then_some(&activation))?;
        let charged = self.session.map_or_else(Vec::new, |s| shared.sessions.table.locked().state_addrs(s.id));
        let stopped = Stopped {
            tenant: self.tenant,
            model: self.model,
            block,
            activation,
            keep: self.keep,
            session: self.session,
            charged,
        };
        let handle = shared.parked.locked().park(stopped)?;
        Ok(paused(handle, block, sent))
    }
}

/// An activation on its way to the client.
struct Sent {
    value: Option<Value>,
    descs: Vec<TensorDesc>,
    tensors: Vec<SharedBytes>,
}

impl Sent {
    /// A copy of `activation` when given: a resume may run blocks that change their inputs in
    /// place while the reply is being sent.
    fn activation(activation: Option<&ModelValue>) -> Result<Self, ExecError> {
        let mut outputs = Outputs::new(None, None);
        let value = match activation {
            Some(a) => {
                let copy = a
                    .shallow_clone()
                    .map_tensors(&mut |t| if t.device() == Device::Cpu { t.f_detach_copy() } else { Ok(t) })?;
                Some(outputs.value(copy)?)
            }
            None => None,
        };
        let tensors = outputs.tensors.into_iter().map(|t| Arc::new(t) as SharedBytes).collect();
        Ok(Self { value, descs: outputs.descs, tensors })
    }
}

fn paused(parked: Handle, block: usize, sent: Sent) -> Reply {
    Reply {
        message: Message::Breakpoint(BreakpointMessage::Paused {
            parked,
            block: block as u32,
            tensors: sent.descs,
            activation: sent.value,
        }),
        tensors: sent.tensors,
    }
}

/// The activation a resume gives in place of the parked one, and the tensors it names.
struct Replacement {
    activation: Option<Value>,
    tensors: Vec<TensorDesc>,
    payload: Option<Payload>,
}

/// Runs a parked request on from its breakpoint. When its blocks fail it is parked again as it
/// was, so the client may try another activation; once they ran, it is over.
fn resume(
    handle: Handle,
    parked: Parked,
    given: Replacement,
    until: Option<Breakpoint>,
    shared: &Shared,
) -> Result<Reply, ExecError> {
    let Replacement { activation, tensors, payload } = given;
    let payload = payload.map(Arc::new);
    let run = Run {
        tenant: parked.tenant,
        model: Arc::clone(&parked.model),
        first: parked.block + 1,
        keep: parked.keep,
        session: parked.session,
        payload,
    };
    let ran = (|| {
        let args = match replacement(&run, &tensors, activation.as_ref())? {
            Some(args) => args,
            None => spread(parked.activation.shallow_clone()),
        };
        run.blocks(args, until)
    })();
    let ran = match ran {
        Ok(ran) => ran,
        Err(e) => {
            shared.parked.locked().put_back(handle.id, parked);
            return Err(e);
        }
    };
    let session = run.session;
    let result = run.reply(ran, shared);
    if let Some(s) = session
        && result.is_err()
    {
        let _ = shared.sessions.table.locked().end_step(s.id, None);
    }
    result
}

/// The arguments of the block after the breakpoint from a replacement activation (checked
/// against the parked one already), or `None` when there is none.
fn replacement(
    run: &Run,
    tensors: &[TensorDesc],
    activation: Option<&Value>,
) -> Result<Option<Vec<ModelValue>>, ExecError> {
    let Some(value) = activation else { return Ok(None) };
    let tensors = input_tensors(tensors, run.payload.as_ref(), run.model.device)?;
    Ok(Some(spread(model_value(value, &tensors, &Default::default())?)))
}

/// `t`, copied when it is a view of the request's payload (see `aliases`).
fn owned(t: &Tensor, payload: Option<&Arc<Payload>>) -> Result<Tensor, ExecError> {
    Ok(if aliases(t, payload) { t.f_detach_copy()? } else { t.shallow_clone() })
}

/// Splits a step's output into what goes back and the `n` state tensors at its end.
fn split_state(output: ModelValue, n: usize) -> Result<(ModelValue, Vec<Tensor>), ExecError> {
    if n == 0 {
        return Ok((output, Vec::new()));
    }
    let bad = |got: String| ExecError::from(SessionError::BadStep { state: n, got });
    let mut items = match output {
        ModelValue::Tuple(items) if items.len() > n => items,
        ModelValue::Tuple(items) => return Err(bad(format!("a tuple of {} items", items.len()))),
        other => return Err(bad(output_kind(&other).to_owned())),
    };
    let state = items
        .split_off(items.len() - n)
        .into_iter()
        .map(|v| match v {
            ModelValue::Tensor(t) => Ok(t),
            other => Err(bad(format!("{} where a state tensor belongs", output_kind(&other)))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let output = if items.len() == 1 { items.pop().unwrap_or(ModelValue::None) } else { ModelValue::Tuple(items) };
    Ok((output, state))
}

fn output_kind(v: &ModelValue) -> &'static str {
    match v {
        ModelValue::Tensor(_) => "a tensor",
        ModelValue::Tuple(_) => "a tuple",
        ModelValue::List(_) => "a list",
        ModelValue::Dict(_) => "a dict",
        ModelValue::None => "None",
        _ => "a scalar",
    }
}

fn open_session(
    tenant: TenantId,
    model: Arc<Model>,
    state: &[TensorDesc],
    payload: Option<Payload>,
    reserve: u64,
    sessions: &Sessions,
) -> Result<Reply, ExecError> {
    // On the CPU the state is the received payload itself, held by the tensors over it and
    // charged to the session (its charge to the host budget as a request's input ends here).
    let payload = payload.map(|mut p| {
        if model.device == Device::Cpu {
            p.reservation = None;
        }
        Arc::new(p)
    });
    let mut state = input_tensors(state, payload.as_ref(), model.device)?;
    // A graph with state starts from its initial values, or from a state the client gave.
    if let Some(graph) = model.stateful() {
        if state.is_empty() {
            sessions.table.locked().could_hold(graph.state_bytes())?;
            state = graph.initial_state()?;
        } else {
            graph.check_state(&state)?;
        }
    }
    let session = sessions.table.locked().open(tenant, model, state, reserve)?;
    Ok(Reply::message(SessionMessage::Opened { session }))
}

fn execute(
    tenant: TenantId,
    model: Arc<Model>,
    inputs: CallInputs,
    keep: bool,
    until: Option<Breakpoint>,
    shared: &Shared,
) -> Result<Reply, ExecError> {
    if model.stateful().is_some() {
        return Err(ExecError::BadInput(
            "the model keeps state between calls (a KV cache): run it in a session (rm.session())".into(),
        ));
    }
    let payload = inputs.payload.map(Arc::new);
    let tensors = input_tensors(&inputs.tensors, payload.as_ref(), model.device)?;
    let kept = kept_inputs(&inputs.values, &shared.kept)?;
    let args = inputs.values.iter().map(|v| model_value(v, &tensors, &kept)).collect::<Result<Vec<_>, _>>()?;
    let run = Run { tenant, model, first: 0, keep, session: None, payload };
    let ran = run.blocks(args, until)?;
    run.reply(ran, shared)
}

/// A received tensor kept on `device`: on the CPU a view of the payload it arrived in (no copy),
/// on a GPU a copy there.
/// (On the CPU the tensor is a view of the payload, which it holds, and its charge with it: the
/// core charges its bookkeeping alone.)
fn keep(
    desc: &TensorDesc,
    payload: Option<Payload>,
    device: Device,
    kept: &Mutex<KeptTensors>,
) -> Result<Reply, ExecError> {
    let payload = payload.map(Arc::new);
    let tensor = input_tensors(std::slice::from_ref(desc), payload.as_ref(), device)?
        .pop()
        .ok_or_else(|| ExecError::Internal("no tensor".into()))?;
    let kept = kept.locked().keep(tensor)?;
    Ok(Reply::message(KeptMessage::Kept { kept }))
}

fn fetch(handle: Handle, kept: &Mutex<KeptTensors>) -> Result<Reply, ExecError> {
    let tensor = kept.locked().get(handle)?;
    let (bytes, desc) = OutputTensor::new(tensor, None)?;
    Ok(Reply {
        message: Message::Data(DataMessage::GetReply { tensor: desc }),
        tensors: vec![Arc::new(bytes) as SharedBytes],
    })
}

fn load(upload: Upload, device: Device, models: &Mutex<ModelStore>) -> Result<Reply, ExecError> {
    let started = std::time::Instant::now();
    let fingerprint = upload.archives.fingerprint();
    let model = crate::models::load(upload, device, models)?;
    tracing::info!(model = %fingerprint, weight_bytes = model.weight_bytes, seconds = started.elapsed().as_secs_f64(), "model loaded");
    Ok(Reply::message(ModelMessage::Registered { model: model.info() }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: f32) -> ModelValue {
        ModelValue::Tensor(Tensor::from(v))
    }

    #[test]
    fn a_step_output_splits_into_outputs_and_state() {
        let (out, state) = split_state(ModelValue::Tuple(vec![t(1.0), t(2.0), t(3.0)]), 2).unwrap();
        assert!(matches!(out, ModelValue::Tensor(_)), "one output is unwrapped");
        assert_eq!(state.len(), 2);
        let (out, state) = split_state(ModelValue::Tuple(vec![t(1.0), t(2.0), t(3.0)]), 1).unwrap();
        assert!(matches!(out, ModelValue::Tuple(ref items) if items.len() == 2));
        assert_eq!(state.len(), 1);
        let (out, state) = split_state(t(1.0), 0).unwrap();
        assert!(matches!(out, ModelValue::Tensor(_)) && state.is_empty(), "no state: the output as it is");
    }

    #[test]
    fn a_step_output_without_its_state_is_refused() {
        let err = |out, n| split_state(out, n).unwrap_err().to_string();
        assert!(err(t(1.0), 1).contains("a tensor"), "{}", err(t(1.0), 1));
        assert!(err(ModelValue::Tuple(vec![t(1.0)]), 1).contains("a tuple of 1 items"));
        let e = err(ModelValue::Tuple(vec![t(1.0), ModelValue::Int(3)]), 1);
        assert!(e.contains("a scalar where a state tensor belongs"), "{e}");
    }
}
