//! The executor behind the node's core: the jobs it is given (models, kept tensors, sessions,
//! parked runs), answered through the replier: at once, from the poller's thread, when they
//! only read or change its tables, and by its workers otherwise (loading and execution).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use djinn_auth::{Authenticator, Quota, TenantId};
use djinn_memory::MemoryBudget;
use djinn_node_core::{Executed, Executor, Job, Replier, Reply, ReplyTo};
use djinn_proto::{BreakpointMessage, DataMessage, Fingerprint, ModelMessage};
use tch::Device;

use crate::cost::{ComputeMeter, ComputeQuota, Limits};
use crate::kept::{HandleSpace, KeptTensors};
use crate::models::{ModelStore, Unregistered};
use crate::parked::{Parked, ParkedTable};
use crate::sessions::{SessionOptions, SessionTable, Sessions};
use crate::workers::{Tables, Work, WorkQueue, Workers, error_reply};
use djinn_sync::Locked;

#[derive(Debug, Clone)]
pub struct ExecutorOptions {
    pub device: Device,
    pub workers: usize,
    /// libtorch's threads inside one operation, on each worker.
    pub intra_op_threads: usize,
    /// Host memory for streamed blocks' weights (shared with the core's uploads and inputs).
    pub host_budget: MemoryBudget,
    pub sessions: SessionOptions,
    /// The longest one execution (an execute, a session step, a resume) may run: checked
    /// between operators and blocks; `None` for no limit.
    pub execute_deadline: Option<Duration>,
    /// The most bytes one graph run's plan may hold at once (intermediates and outputs); a run
    /// planned over it is refused before it runs. `None`: the device budget's limit.
    pub max_run_memory: Option<u64>,
    /// The node's rate of floating-point operations: a step planned to take longer at it than
    /// what is left of `execute_deadline` is refused before it runs. `None`: not weighed.
    pub flops_per_second: Option<f64>,
    /// Where each tenant's compute quota and its part of the sessions' host pool come from,
    /// when clients need tokens.
    pub quotas: Option<Quotas>,
    /// The epoch and ids of the handles it makes ([`HandleSpace::fresh`] for a node's one
    /// executor).
    pub handles: HandleSpace,
}

/// Where an executor finds a tenant's quotas.
#[derive(Debug, Clone)]
pub enum Quotas {
    /// The node's principals (a node's one executor).
    Principals(Arc<Authenticator>),
    /// The one tenant's, as its node passed them (a tenant's executor process).
    OneTenant(Quota),
}

impl Quotas {
    pub fn of(&self, tenant: TenantId) -> Quota {
        match self {
            Self::Principals(auth) => auth.quota(tenant),
            Self::OneTenant(quota) => *quota,
        }
    }
}

/// The node's executor: libtorch on the node's device, with worker threads.
#[derive(Debug)]
pub struct TorchExecutor {
    models: Arc<Mutex<ModelStore>>,
    kept: Arc<Mutex<KeptTensors>>,
    sessions: Sessions,
    parked: Arc<Mutex<ParkedTable>>,
    // Before the workers: the clock holds a queue into them, which must go first.
    _restores: RestoreClock,
    workers: Workers,
}

impl TorchExecutor {
    pub fn new(budget: MemoryBudget, options: ExecutorOptions) -> std::io::Result<Self> {
        let models = Arc::new(Mutex::new(ModelStore::new(budget.clone(), options.host_budget.clone())));
        let kept = Arc::new(Mutex::new(KeptTensors::new(options.handles)));
        let host_pool = match options.quotas.clone() {
            Some(quotas) => MemoryBudget::with_quotas(
                options.sessions.host_pool,
                Arc::new(move |tenant| quotas.of(tenant).host_swap),
            ),
            None => MemoryBudget::new(options.sessions.host_pool),
        };
        // Kept tensors, sessions and parked requests are of one life: their handles carry its
        // epoch, which the core checks.
        let epoch = options.handles.epoch;
        let table =
            SessionTable::new(options.sessions.clone(), options.handles, budget.clone(), host_pool, options.device);
        let sessions = Sessions::new(table);
        let parked = Arc::new(Mutex::new(ParkedTable::new(budget.clone(), options.handles)));
        let meter = match options.quotas.clone() {
            Some(quotas) => ComputeMeter::new(move |tenant| ComputeQuota::of(&quotas.of(tenant))),
            None => ComputeMeter::unbounded(),
        };
        let limits = Limits {
            deadline: options.execute_deadline,
            max_run_bytes: options.max_run_memory.unwrap_or(budget.limit()),
            budget: budget.clone(),
            meter: Arc::new(meter),
            counters: Arc::default(),
            flops_per_second: options.flops_per_second,
        };
        let tables = Tables {
            models: Arc::clone(&models),
            kept: Arc::clone(&kept),
            sessions: sessions.clone(),
            parked: Arc::clone(&parked),
        };
        let workers = Workers::start(options.workers, options.intra_op_threads, options.device, tables, limits)?;
        tracing::info!(
            epoch = format_args!("{epoch:016x}"),
            session_policy = options.sessions.policy.name(),
            session_budget = options.sessions.budget,
            "kept tensors and sessions start a new epoch"
        );
        let queue = workers.queue().ok_or_else(|| std::io::Error::other("no worker queue"))?;
        Ok(Self { models, _restores: RestoreClock::start(sessions.clone(), queue)?, kept, sessions, parked, workers })
    }

    fn models(&self) -> MutexGuard<'_, ModelStore> {
        self.models.locked()
    }

    fn parked(&self) -> MutexGuard<'_, ParkedTable> {
        self.parked.locked()
    }

    /// Takes `job`: its answer now, when the executor's tables give it (or refuse it), else
    /// `None` and its answer later from a worker.
    fn take(&mut self, job: Job, to: ReplyTo, replier: &Replier) -> Option<Reply> {
        let tenant = to.tenant;
        let work = match job {
            Job::Claim { fingerprint, public } => {
                return Some(match self.models().claim(tenant, &fingerprint, public, to.torchscript) {
                    Ok(registered) => Reply::message(ModelMessage::RegisterReady { upload: 0, registered }),
                    Err(e) => Reply::error(e.code(), e.to_string()),
                });
            }
            Job::Load { upload } => Work::Load { upload },
            Job::Execute { fingerprint, inputs, keep, until } => match self.models().get(tenant, &fingerprint) {
                Some(model) => Work::Execute { model, inputs, keep, until },
                None => return Some(unknown_model(&fingerprint)),
            },
            Job::Unregister { fingerprint } => match self.models().remove(tenant, &fingerprint) {
                // Freeing gigabytes of weights (and a streamer's pinned memory) is a worker's
                // job, not the poller's.
                Unregistered::Freed(model) => Work::Free { model },
                Unregistered::StillShared => return Some(Reply::message(ModelMessage::UnregisterAck)),
                Unregistered::Unknown => return Some(unknown_model(&fingerprint)),
            },
            Job::ListModels { all: Some(names) } => {
                let models = self.models().list_all(|t| names.get(&t).cloned());
                return Some(Reply::message(ModelMessage::ModelList { models }));
            }
            Job::ListModels { all: None } => {
                return Some(Reply::message(ModelMessage::ModelList { models: self.models().list(tenant) }));
            }
            Job::ReadArchives { fingerprint, offset, len } => {
                let mut models = self.models();
                let public = models.is_public(tenant, &fingerprint);
                match models.get(tenant, &fingerprint) {
                    Some(model) => Work::ReadArchives { model, public, offset, len },
                    None => return Some(unknown_model(&fingerprint)),
                }
            }
            Job::ListSessions { all, after } => Work::ListSessions { all, after },
            Job::Keep { tensor, payload } => Work::Keep { tensor, payload },
            Job::Fetch { handle } => Work::Fetch { handle },
            Job::OpenSession { fingerprint, state, payload, reserve } => {
                match self.models().get(tenant, &fingerprint) {
                    Some(model) => Work::SessionOpen { model, state, payload, reserve },
                    None => return Some(unknown_model(&fingerprint)),
                }
            }
            // A session's requests come one at a time, the core having checked they are the
            // tenant's: each runs on a worker, as the state may move between host and device.
            Job::Step { session, inputs, until } => Work::Step { id: session.id, inputs, until },
            Job::Signal { session, signal } => Work::Signal { id: session.id, signal },
            Job::Move { session } => Work::Move { id: session.id },
            Job::EndMove { session, moved } => Work::EndMove { id: session.id, moved },
            Job::Close { session } => Work::Close { id: session.id },
            // The activation a resume replaces is checked here, before anything runs: a
            // mismatch leaves the request parked.
            Job::Resume { parked: handle, tensors, activation, payload, until } => {
                let taken = self.parked().take_for_resume(handle.id, activation.as_ref(), &tensors);
                match taken {
                    Ok(parked) => Work::Resume { handle, parked, activation, tensors, payload, until },
                    Err(e) => {
                        let still_parked = self.parked().holds(handle.id);
                        replier.executed(to, Executed { reply: error_reply(e), still_parked });
                        return None;
                    }
                }
            }
            Job::Inspect { parked: handle } => match self.parked().activation(handle.id) {
                Ok((activation, block)) => Work::Inspect { activation, handle, block },
                Err(e) => return Some(error_reply(e)),
            },
            Job::Abort { parked } => match self.parked().abort(parked.id) {
                // A session's step ends on a worker, its state as before the step.
                Ok(Parked { session: Some(s), .. }) => Work::EndStep { id: s.id },
                Ok(_) => return Some(Reply::message(BreakpointMessage::Aborted)),
                Err(e) => return Some(error_reply(e)),
            },
            Job::Stats => return Some(Reply::message(DataMessage::StatsReply { counters: self.stats() })),
        };
        self.workers.submit(work, to, replier);
        None
    }

    /// The executor's counters, read from its tables.
    fn stats(&self) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        self.models().stats(&mut out);
        out.push(("executor_kept_tensors".to_owned(), self.kept.locked().len() as u64));
        self.sessions.stats.append(&mut out);
        self.parked().stats(&mut out);
        let c = &self.workers.counters;
        let plans = &self.workers.limits.counters;
        out.extend(
            [
                ("executions", c.executions.load(Ordering::Relaxed)),
                ("execution_errors", c.execution_errors.load(Ordering::Relaxed)),
                ("execution_us", c.execution_ns.load(Ordering::Relaxed) / 1000),
                ("model_loads", c.loads.load(Ordering::Relaxed)),
                ("model_load_errors", c.load_errors.load(Ordering::Relaxed)),
                ("jobs_queued", c.queued.load(Ordering::Relaxed)),
                ("planned_flops", plans.planned_flops.load(Ordering::Relaxed)),
                ("largest_planned_run_bytes", plans.largest_peak_bytes.load(Ordering::Relaxed)),
                ("partly_planned_runs", plans.partly_planned.load(Ordering::Relaxed)),
                ("runs_refused_by_plan", plans.refused.load(Ordering::Relaxed)),
                ("allocations_refused", plans.allocations_refused.load(Ordering::Relaxed)),
            ]
            .map(|(k, v)| (k.to_owned(), v)),
        );
        out
    }
}

/// The answer to a request for a model the tenant does not have here.
fn unknown_model(fingerprint: &Fingerprint) -> Reply {
    Reply::error(djinn_proto::ErrorCode::UnknownModel, format!("no model {fingerprint} on this node"))
}

impl Executor for TorchExecutor {
    fn run(&mut self, job: Job, to: ReplyTo, replier: &Replier) {
        if let Some(reply) = self.take(job, to, replier) {
            replier.executed(to, reply);
        }
    }

    fn epoch(&self) -> u64 {
        self.kept.locked().epoch()
    }

    fn free_kept(&mut self, ids: &[u64]) {
        self.kept.locked().free(ids);
    }

    fn free_parked(&mut self, ids: &[u64]) {
        let lapsed = self.parked().free(ids);
        for request in lapsed {
            // The core aborts a session's step instead, in the session's turn; were one freed
            // here, its step would still end on a worker.
            if let Some(s) = request.session {
                self.workers.quiet(request.tenant, Work::EndStep { id: s.id });
            }
        }
    }

    fn free_sessions(&mut self, ids: &[u64]) {
        // Freeing their state (a large one takes a while) is a worker's job, not the poller's.
        self.workers.quiet(TenantId::DEFAULT, Work::FreeSessions { ids: ids.to_vec() });
    }
}

/// Starts the restores of swapped-out sessions when they are due (ahead of their agents'
/// expected resumes).
struct RestoreClock {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RestoreClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestoreClock").finish_non_exhaustive()
    }
}

impl RestoreClock {
    fn start(sessions: Sessions, queue: WorkQueue) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let table = Arc::clone(&sessions.table);
        let thread = std::thread::Builder::new().name("djinn-restores".into()).spawn(move || {
            while !flag.load(Ordering::Acquire) {
                let (due, next) = table.locked().due_restores(Instant::now());
                for (id, tenant) in due {
                    queue.quiet(tenant, Work::Restore { id });
                }
                // Woken early when a restore is scheduled, and to stop.
                match next {
                    Some(at) => std::thread::park_timeout(at.saturating_duration_since(Instant::now())),
                    None => std::thread::park(),
                }
            }
        })?;
        sessions.table.locked().set_clock(thread.thread().clone());
        Ok(Self { stop, thread: Some(thread) })
    }
}

impl Drop for RestoreClock {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}
