//! What a node answers: named tensors (on the poller thread: they are cheap) and models
//! (registration bookkeeping on the poller, loading and execution on the workers).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use djinn_auth::{Authenticator, TenantId};
use djinn_memory::{BufferPool, MemoryBudget};
use djinn_node_core::{Peers, PushSource, Replier, Reply, ReplyTo, Service};
use djinn_proto::{
    Archives, BreakpointMessage, DataMessage, ErrorCode, Fingerprint, Frame, Handle, KeptEntry, KeptMessage, Message,
    ModelMessage, Payload, Refusal, SessionMessage, SharedBytes, TensorSource,
};
use tch::Device;

use crate::convert::OutputTensor;
use crate::cost::{ComputeMeter, ComputeQuota, Limits};
use crate::error::{ExecError, SessionError};
use crate::handles::HandleTable;
use crate::models::{ModelStore, Unregistered, Upload};
use crate::parked::{Parked, ParkedTable};
use crate::request::CallInputs;
use crate::sessions::{Op, SessionOptions, SessionTable, Sessions};
use crate::store::TensorStore;
use crate::workers::{Job, Tables, WorkQueue, Workers, error_reply};
use djinn_sync::Locked;

/// The most bytes of a model's archives one `ReadArchives` reads back (its reply holds them in
/// host memory until sent).
pub const MAX_ARCHIVE_READ: u64 = 8 << 20;

/// The longest node address a forwarded handle keeps.
const MAX_ADDRESS_LEN: usize = 256;

#[derive(Debug, Clone)]
pub struct NodeOptions {
    pub device: Device,
    pub workers: usize,
    /// Free receive buffers kept for reuse, bytes.
    pub pool_bytes: u64,
    /// The peer-facing metadata limit (list replies are sized to fit it).
    pub max_meta: u32,
    /// Host memory for archives being uploaded, requests' inputs and streamed blocks' weights;
    /// with quotas per tenant, so that one tenant's uploads cannot take every other's inputs.
    pub host_budget: MemoryBudget,
    /// A registration that receives no chunk for this long is dropped, with what it holds.
    pub upload_timeout: Duration,
    /// A kept tensor unused this long is freed.
    pub handle_ttl: Duration,
    pub sessions: SessionOptions,
    /// A request parked at a breakpoint is released after this long.
    pub parked_ttl: Duration,
    /// The longest one execution (an execute, a session step, a resume) may run: checked
    /// between operators and blocks; `None` for no limit.
    pub execute_deadline: Option<Duration>,
    /// The most bytes one graph run's plan may hold at once (intermediates and outputs); a run
    /// planned over it is refused before it runs. `None`: the device budget's limit.
    pub max_run_memory: Option<u64>,
    /// The node's rate of floating-point operations: a step planned to take longer at it than
    /// what is left of `execute_deadline` is refused before it runs. `None`: not weighed.
    pub flops_per_second: Option<f64>,
    /// The node's principals, when clients need tokens: what a push names the tenant by.
    pub auth: Option<Arc<Authenticator>>,
    /// The node's way to other nodes: pushes and session moves go through it.
    pub peers: Arc<dyn Peers>,
}

/// A budget of `limit` bytes in which each tenant of `auth` holds no more than the part of its
/// quota that `quota` picks.
pub fn tenant_budget(
    limit: u64,
    auth: Option<&Arc<Authenticator>>,
    quota: impl Fn(&djinn_auth::Quota) -> Option<u64> + Send + Sync + 'static,
) -> MemoryBudget {
    match auth {
        Some(auth) => {
            let auth = Arc::clone(auth);
            MemoryBudget::with_quotas(limit, Arc::new(move |tenant| quota(&auth.quota(tenant))))
        }
        None => MemoryBudget::new(limit),
    }
}

#[derive(Debug)]
pub struct NodeService {
    tensors: TensorStore,
    models: Arc<Mutex<ModelStore>>,
    uploads: HashMap<u64, InProgress>,
    next_upload: u64,
    upload_timeout: Duration,
    pool: BufferPool,
    host_budget: MemoryBudget,
    device: tch::Device,
    handles: Arc<Mutex<HandleTable>>,
    sessions: Sessions,
    parked: Arc<Mutex<ParkedTable>>,
    peers: Arc<dyn Peers>,
    auth: Option<Arc<Authenticator>>,
    // Before the workers: the sweeper holds a queue into them, which must go first.
    _sweeper: Sweeper,
    workers: Workers,
}

impl NodeService {
    pub fn new(budget: MemoryBudget, options: NodeOptions) -> std::io::Result<Self> {
        let pool = BufferPool::new(options.pool_bytes, 64 * 1024);
        let models = Arc::new(Mutex::new(ModelStore::new(budget.clone(), options.host_budget.clone())));
        let handles = Arc::new(Mutex::new(HandleTable::new(budget.clone(), options.handle_ttl)));
        let host_pool = tenant_budget(options.sessions.host_pool, options.auth.as_ref(), |q| q.host_swap);
        let sessions =
            Sessions::new(SessionTable::new(options.sessions.clone(), budget.clone(), host_pool, options.device));
        let parked = Arc::new(Mutex::new(ParkedTable::new(budget.clone(), options.parked_ttl)));
        let meter = match &options.auth {
            Some(auth) => {
                let auth = Arc::clone(auth);
                ComputeMeter::new(move |tenant| ComputeQuota::of(&auth.quota(tenant)))
            }
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
            handles: Arc::clone(&handles),
            sessions: sessions.clone(),
            parked: Arc::clone(&parked),
            peers: Arc::clone(&options.peers),
        };
        let workers = Workers::start(options.workers, options.device, tables, limits)?;
        tracing::info!(
            epoch = format_args!("{:016x}", handles.locked().epoch()),
            session_policy = options.sessions.policy.name(),
            session_budget = options.sessions.budget,
            "kept tensors and sessions start a new epoch"
        );
        let queue = workers.queue().ok_or_else(|| std::io::Error::other("no worker queue"))?;
        Ok(Self {
            tensors: TensorStore::new(budget, pool.clone(), options.max_meta),
            models,
            uploads: HashMap::new(),
            next_upload: 1,
            upload_timeout: options.upload_timeout,
            pool,
            host_budget: options.host_budget,
            device: options.device,
            _sweeper: Sweeper::start(Arc::clone(&handles), sessions.clone(), Arc::clone(&parked), queue)?,
            handles,
            sessions,
            parked,
            peers: options.peers,
            auth: options.auth,
            workers,
        })
    }

    fn models(&self) -> MutexGuard<'_, ModelStore> {
        self.models.locked()
    }

    /// A receive buffer charged to `tenant`'s part of the host budget (`charge` bytes of it).
    fn host_alloc(&self, tenant: TenantId, len: usize, charge: u64) -> Result<Payload, Refusal> {
        let reservation = self.host_budget.try_reserve_for(tenant, charge)?;
        Ok(Payload { buf: self.pool.take(len)?, reservation: Some(reservation) })
    }

    fn handles(&self) -> MutexGuard<'_, HandleTable> {
        self.handles.locked()
    }

    fn parked(&self) -> MutexGuard<'_, ParkedTable> {
        self.parked.locked()
    }

    /// Drops a parked request; a session step parked ends with the state it had before it.
    fn abort(&self, tenant: TenantId, parked: Handle) -> Reply {
        match self.parked().abort(tenant, parked) {
            Ok(request) => {
                if let Some(id) = end_parked_step(&request, &self.sessions) {
                    self.workers.drain_session(id, request.tenant);
                }
                Reply::message(BreakpointMessage::Aborted)
            }
            Err(e) => Reply::error(e.code(), e.to_string()),
        }
    }

    /// Queues a request on its session (drained by one worker at a time, in order).
    fn enqueue(&self, tenant: TenantId, session: Handle, op: Op) -> Option<Reply> {
        match self.sessions.queues().enqueue(tenant, session, op) {
            Ok(start) => {
                if start {
                    self.workers.drain_session(session.id, tenant);
                }
                None
            }
            Err(SessionError::Moved { to, session }) => Some(Reply::message(SessionMessage::Moved { to, session })),
            Err(e) => Some(Reply::error(e.code(), e.to_string())),
        }
    }

    /// The name of `tenant`, as other nodes know it (empty where nodes need no token).
    fn tenant_name(&self, tenant: TenantId) -> String {
        self.auth.as_ref().and_then(|a| a.name(tenant)).map_or_else(String::new, |n| n.to_string())
    }

    fn push(
        &mut self,
        source: TensorSource,
        to: String,
        grant: String,
        reply_to: ReplyTo,
        replier: &Replier,
    ) -> Option<Reply> {
        let tenant = reply_to.tenant;
        let source = match source {
            TensorSource::Named(name) => match self.tensors.shared(tenant, &name) {
                Some((desc, bytes)) => PushSource::Bytes { desc, bytes },
                None => return Some(Reply::error(ErrorCode::NotFound, format!("no tensor named {name:?}"))),
            },
            TensorSource::Handle(handle) => match self.handles().get(tenant, handle) {
                // Read (copied from the device) in the push's turn, off the poller's thread.
                Ok((tensor, _)) => PushSource::Read(Box::new(move || {
                    let (bytes, desc) = OutputTensor::new(tensor, None).map_err(|e| (e.code(), e.to_string()))?;
                    Ok((desc, Arc::new(bytes) as SharedBytes))
                })),
                Err(e) => return Some(error_reply(e.into())),
            },
        };
        // On the peer, the tensor is the same tenant's.
        self.peers.push(source, to, grant, self.tenant_name(tenant), reply_to, replier);
        None
    }

    fn register_begin(&mut self, fingerprint: Fingerprint, blocks: Vec<u64>, public: bool, to: ReplyTo) -> Reply {
        // Whether the blocks are graphs or TorchScript shows in their bytes: a TorchScript
        // block from a principal without the right is refused when it is loaded, and a
        // TorchScript model the node holds already when it is claimed.
        match self.models().claim(to.tenant, &fingerprint, public, to.torchscript) {
            Ok(true) => {
                return Reply::message(ModelMessage::RegisterReady { upload: 0, registered: true });
            }
            Ok(false) => {}
            Err(e) => return Reply::error(e.code(), e.to_string()),
        }
        let held = self.uploads.values().filter(|u| u.upload.tenant == to.tenant).count();
        if held >= crate::MAX_UPLOADS_PER_TENANT {
            let message = format!("{held} registrations are in progress already: the most one tenant has on a node");
            return Reply::error(ErrorCode::QuotaExceeded, message);
        }
        // The block lengths stay until the upload ends: charged with a page of bookkeeping.
        let bookkeeping = (blocks.len() as u64 * 8).saturating_add(crate::MIN_CHARGE);
        let bookkeeping = match self.host_budget.try_reserve_for(to.tenant, bookkeeping) {
            Ok(reservation) => reservation,
            Err(e) => {
                let refusal = Refusal::from(e);
                return Reply::error(refusal.code, refusal.message);
            }
        };
        match Upload::new(fingerprint, blocks, (to.tenant, public), to.connection()) {
            Ok(mut upload) => {
                upload.torchscript = to.torchscript;
                let id = self.next_upload;
                self.next_upload += 1;
                tracing::info!(model = %fingerprint, bytes = upload.archives.total(), upload = id, "registration started");
                self.uploads.insert(id, InProgress { upload, last_chunk: Instant::now(), _bookkeeping: bookkeeping });
                Reply::message(ModelMessage::RegisterReady { upload: id, registered: false })
            }
            Err(e) => Reply::error(ErrorCode::BadArchive, e.to_string()),
        }
    }

    fn register_chunk(&mut self, id: u64, offset: u64, payload: Option<Payload>, to: ReplyTo) -> Reply {
        let Some(upload) = self.uploads.get_mut(&id).filter(|u| u.upload.connection == to.connection()) else {
            return Reply::error(ErrorCode::NotFound, format!("no upload {id} on this connection"));
        };
        let Some(chunk) = payload else {
            return Reply::error(ErrorCode::BadArchive, "an empty chunk");
        };
        upload.last_chunk = Instant::now();
        let archives = &mut upload.upload.archives;
        let tenths = |a: &Archives| a.received() * 10 / a.total().max(1);
        let before = tenths(archives);
        if let Err(e) = archives.add(offset, chunk) {
            self.uploads.remove(&id);
            return Reply::error(ErrorCode::BadArchive, e.to_string());
        }
        let after = tenths(archives);
        if after > before {
            tracing::info!(model = %archives.fingerprint(), received = archives.received(), total = archives.total(), "registration {}%", after * 10);
        }
        Reply::message(ModelMessage::RegisterProgress { received: archives.received(), total: archives.total() })
    }
}

impl Service for NodeService {
    fn alloc(&mut self, message: &Message, len: usize, tenant: TenantId) -> Result<Payload, Refusal> {
        match message {
            Message::Data(DataMessage::Put { .. }) => self.tensors.alloc(tenant, len),
            // Archive bytes stay in host memory until the model is loaded: they are charged to
            // the host budget (a model larger than the device streams, so its archive may be
            // larger than the device budget).
            // Each chunk is charged a page besides its bytes: chunks of a byte cannot hold more
            // memory in bookkeeping than they are charged.
            Message::Model(ModelMessage::RegisterChunk { upload, .. }) => {
                if !self.uploads.contains_key(upload) {
                    return Err(Refusal { code: ErrorCode::NotFound, message: format!("no upload {upload}") });
                }
                self.host_alloc(tenant, len, (len as u64).saturating_add(crate::MIN_CHARGE))
            }
            // Inputs live for one request, in host memory (copied to the device when it is a GPU);
            // a session's initial state is copied out of it. The host budget bounds what all
            // requests' inputs hold at once.
            Message::Model(ModelMessage::Execute { .. })
            | Message::Session(SessionMessage::Step { .. })
            | Message::Session(SessionMessage::Open { .. })
            | Message::Breakpoint(BreakpointMessage::Resume { .. }) => self.host_alloc(tenant, len, len as u64),
            // A tensor to keep: on the CPU it stays in this buffer, which is charged to the
            // device budget; on a GPU it is copied there (and charged then), so the buffer is
            // only host memory for a while.
            Message::Kept(KeptMessage::Keep { .. }) if self.device == tch::Device::Cpu => {
                self.tensors.alloc(tenant, len)
            }
            Message::Kept(KeptMessage::Keep { .. }) => self.host_alloc(tenant, len, len as u64),
            other => Err(Refusal {
                code: ErrorCode::Unexpected,
                message: format!("a {} request carries no payload", other.kind().name()),
            }),
        }
    }

    fn handle(&mut self, frame: Frame, to: ReplyTo, replier: &Replier) -> Option<Reply> {
        let Frame { message, payload, .. } = frame;
        let tenant = to.tenant;
        Some(match message {
            message @ (Message::Data(DataMessage::Put { .. })
            | Message::Data(DataMessage::Get { .. })
            | Message::Data(DataMessage::Delete { .. })
            | Message::Data(DataMessage::List { .. })) => self.tensors.handle(tenant, message, payload),
            Message::Model(ModelMessage::RegisterBegin { fingerprint, blocks, public }) => {
                self.register_begin(fingerprint, blocks, public, to)
            }
            Message::Model(ModelMessage::RegisterChunk { upload, offset, .. }) => {
                self.register_chunk(upload, offset, payload, to)
            }
            Message::Model(ModelMessage::RegisterCommit { upload: id }) => {
                match self.uploads.remove(&id).filter(|u| u.upload.connection == to.connection()) {
                    Some(InProgress { upload, .. }) => {
                        self.workers.submit(Job::Load { upload }, to, replier);
                        return None;
                    }
                    None => Reply::error(ErrorCode::NotFound, format!("no upload {id} on this connection")),
                }
            }
            Message::Model(ModelMessage::Execute { fingerprint, tensors, inputs, keep, until }) => {
                match self.models().get(tenant, &fingerprint) {
                    Some(model) => {
                        let inputs = CallInputs { values: inputs, tensors, payload };
                        self.workers.submit(Job::Execute { model, inputs, keep, until }, to, replier);
                        return None;
                    }
                    None => Reply::error(ErrorCode::UnknownModel, format!("no model {fingerprint} on this node")),
                }
            }
            Message::Model(ModelMessage::Unregister { fingerprint }) => {
                let removed = self.models().remove(tenant, &fingerprint);
                match removed {
                    // Freeing gigabytes of weights (and a streamer's pinned memory) is a
                    // worker's job, not the poller's.
                    Unregistered::Freed(model) => {
                        self.workers.submit(Job::Free { model }, to, replier);
                        return None;
                    }
                    Unregistered::StillShared => Reply::message(ModelMessage::UnregisterAck),
                    Unregistered::Unknown => {
                        Reply::error(ErrorCode::UnknownModel, format!("no model {fingerprint} on this node"))
                    }
                }
            }
            Message::Model(ModelMessage::ListModels) if to.operator => {
                let name = |t| self.auth.as_ref().and_then(|a| a.name(t)).map(|n| n.to_string());
                Reply::message(ModelMessage::ModelList { models: self.models().list_all(name) })
            }
            Message::Model(ModelMessage::ListModels) => {
                Reply::message(ModelMessage::ModelList { models: self.models().list(tenant) })
            }
            Message::Model(ModelMessage::ReadArchives { fingerprint, offset, len }) => {
                if len > MAX_ARCHIVE_READ {
                    let e = ExecError::BadInput(format!(
                        "{len} bytes asked for at once; a read takes at most {MAX_ARCHIVE_READ}"
                    ));
                    return Some(Reply::error(e.code(), e.to_string()));
                }
                let mut models = self.models();
                let public = models.is_public(tenant, &fingerprint);
                match models.get(tenant, &fingerprint) {
                    Some(model) => {
                        drop(models);
                        self.workers.submit(Job::ReadArchives { model, public, offset, len }, to, replier);
                        return None;
                    }
                    None => Reply::error(ErrorCode::UnknownModel, format!("no model {fingerprint} on this node")),
                }
            }
            Message::Session(SessionMessage::List { after }) => {
                let auth = self.auth.clone();
                let name = move |t| auth.as_ref().and_then(|a| a.name(t)).map_or_else(String::new, |n| n.to_string());
                self.workers.submit(Job::ListSessions { all: to.operator, after, name: Box::new(name) }, to, replier);
                return None;
            }
            Message::Kept(KeptMessage::Keep { tensor }) => {
                self.workers.submit(Job::Keep { tensor, payload }, to, replier);
                return None;
            }
            Message::Kept(KeptMessage::Fetch { handle }) => {
                self.workers.submit(Job::Fetch { handle }, to, replier);
                return None;
            }
            Message::Kept(KeptMessage::List { after }) => {
                let all = to.operator;
                let (listed, more) = self.handles().list((!all).then_some(tenant), after);
                let tensors = listed
                    .into_iter()
                    .map(|(owner, kept)| KeptEntry {
                        tenant: if all { self.tenant_name(owner) } else { String::new() },
                        kept,
                    })
                    .collect();
                Reply::message(KeptMessage::KeptList { tensors, more })
            }
            Message::Kept(KeptMessage::Forward { to: peer, .. }) if peer.len() > MAX_ADDRESS_LEN => {
                let e =
                    ExecError::BadInput(format!("a node's address of {} bytes; at most {MAX_ADDRESS_LEN}", peer.len()));
                Reply::error(e.code(), e.to_string())
            }
            Message::Kept(KeptMessage::Forward { handle, to: peer, kept }) => {
                match self.handles().forward(tenant, handle, peer, kept) {
                    Ok(()) => Reply::message(KeptMessage::Forwarded),
                    Err(e) => error_reply(e.into()),
                }
            }
            Message::Kept(KeptMessage::Release { handles }) => {
                Reply::message(KeptMessage::Released { released: self.handles().release(tenant, &handles) })
            }
            Message::Kept(KeptMessage::Push { source, to: peer, grant }) => {
                return self.push(source, peer, grant, to, replier);
            }
            Message::Session(SessionMessage::Open { fingerprint, state, reserve }) => {
                match self.models().get(tenant, &fingerprint) {
                    Some(model) => {
                        self.workers.submit(Job::SessionOpen { model, state, payload, reserve }, to, replier);
                        return None;
                    }
                    None => Reply::error(ErrorCode::UnknownModel, format!("no model {fingerprint} on this node")),
                }
            }
            Message::Session(SessionMessage::Step { session, tensors, inputs, until }) => {
                let inputs = CallInputs { values: inputs, tensors, payload };
                let op = Op::Step { inputs, until, to, replier: replier.clone() };
                return self.enqueue(tenant, session, op);
            }
            // Acknowledged at once (the signal takes effect in its turn, in the background),
            // unless a move is under way: then it waits for the move like a step.
            Message::Session(SessionMessage::Signal { session, signal }) => {
                let ack = self.sessions.queues().is_moving(tenant, session).then(|| (to, replier.clone()));
                let acked_now = ack.is_none();
                match self.enqueue(tenant, session, Op::Signal { signal, ack }) {
                    None if acked_now => Reply::message(SessionMessage::Signaled),
                    None => return None,
                    Some(refused) => refused,
                }
            }
            Message::Session(SessionMessage::Move { session, to: peer, grant }) => {
                let tenant_name = self.tenant_name(tenant);
                let op = Op::Move { to: peer, grant, tenant: tenant_name, reply: to, replier: replier.clone() };
                return self.enqueue(tenant, session, op);
            }
            Message::Session(SessionMessage::Close { session }) => {
                return self.enqueue(tenant, session, Op::Close { to, replier: replier.clone() });
            }
            // The activation a resume replaces is checked here, before anything runs: a
            // mismatch leaves the request parked.
            Message::Breakpoint(BreakpointMessage::Resume { parked: handle, tensors, activation, until }) => {
                match self.parked().take_for_resume(tenant, handle, activation.as_ref(), &tensors) {
                    Ok(parked) => {
                        let job = Job::Resume { handle, parked, activation, tensors, payload, until };
                        self.workers.submit(job, to, replier);
                        return None;
                    }
                    Err(e) => Reply::error(e.code(), e.to_string()),
                }
            }
            Message::Breakpoint(BreakpointMessage::Inspect { parked: handle }) => {
                match self.parked().activation(tenant, handle) {
                    Ok((activation, block)) => {
                        self.workers.submit(Job::Inspect { activation, handle, block }, to, replier);
                        return None;
                    }
                    Err(e) => Reply::error(e.code(), e.to_string()),
                }
            }
            Message::Breakpoint(BreakpointMessage::Abort { parked }) => self.abort(tenant, parked),
            other => {
                Reply::error(ErrorCode::Unexpected, format!("a node does not serve {} requests", other.kind().name()))
            }
        })
    }

    fn stats(&self, out: &mut Vec<(String, u64)>) {
        self.tensors.stats(out);
        self.models().stats(out);
        self.handles().stats(out);
        self.sessions.stats.append(self.sessions.queues().len(), out);
        self.parked().stats(out);
        let c = &self.workers.counters;
        let plans = &self.workers.limits.counters;
        out.extend(
            [
                ("uploads", self.uploads.len() as u64),
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
                ("host_budget_used_bytes", self.host_budget.used()),
                ("host_budget_limit_bytes", self.host_budget.limit()),
            ]
            .map(|(k, v)| (k.to_owned(), v)),
        );
    }

    fn on_disconnect(&mut self, connection: u64) {
        self.uploads.retain(|id, u| {
            let keep = u.upload.connection != connection;
            if !keep {
                tracing::info!(upload = id, model = %u.upload.archives.fingerprint(), "registration abandoned: its connection closed");
            }
            keep
        });
    }

    fn expire(&mut self, now: Instant) {
        let timeout = self.upload_timeout;
        self.uploads.retain(|id, u| {
            let keep = now.saturating_duration_since(u.last_chunk) < timeout;
            if !keep {
                tracing::info!(upload = id, model = %u.upload.archives.fingerprint(), ?timeout, "registration dropped: no chunk within the upload timeout");
            }
            keep
        });
    }
}

/// A registration between its begin and its commit.
#[derive(Debug)]
struct InProgress {
    upload: Upload,
    last_chunk: Instant,
    /// The block lengths' charge.
    _bookkeeping: djinn_memory::Reservation,
}

/// Ends the session step a parked request stopped (its state stays as before the step, and a
/// worker ends the step first in the session's turn); returns the session when its requests
/// must be drained.
fn end_parked_step(request: &Parked, sessions: &Sessions) -> Option<u64> {
    let s = request.session?;
    sessions.queues().end_parked(s.id).then_some(s.id)
}

/// Frees kept tensors, parked requests and sessions that lie unused past their time limits
/// (checking a few times per limit), and starts the restores of swapped-out sessions when they
/// are due.
struct Sweeper {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Sweeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sweeper").finish_non_exhaustive()
    }
}

impl Sweeper {
    fn start(
        handles: Arc<Mutex<HandleTable>>,
        sessions: Sessions,
        parked: Arc<Mutex<ParkedTable>>,
        queue: WorkQueue,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let parked_ttl = parked.locked().ttl();
        let ttl = handles.locked().idle_ttl().min(sessions.table.locked().options().idle_ttl).min(parked_ttl);
        let period = (ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(10));
        let flag = Arc::clone(&stop);
        let table = sessions.clone();
        let thread = std::thread::Builder::new().name("djinn-sweeper".into()).spawn(move || {
            let mut next_sweep = Instant::now() + period;
            while !flag.load(Ordering::Acquire) {
                let now = Instant::now();
                if now >= next_sweep {
                    handles.locked().expire(now);
                    let expired = parked.locked().expire(now);
                    for request in expired {
                        if let Some(id) = end_parked_step(&request, &table) {
                            queue.drain_session(id, request.tenant);
                        }
                    }
                    table.table.locked().expire(now, &mut table.queues());
                    next_sweep = now + period;
                }
                let (due, next_restore) = table.table.locked().due_restores(now);
                for (id, tenant) in due {
                    if table.queues().enqueue_restore(id) {
                        queue.drain_session(id, tenant);
                    }
                }
                let wake = next_restore.map_or(next_sweep, |at| at.min(next_sweep));
                std::thread::park_timeout(wake.saturating_duration_since(Instant::now()));
            }
        })?;
        sessions.table.locked().set_clock(thread.thread().clone());
        Ok(Self { stop, thread: Some(thread) })
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}
