//! The node's core: each request routed once, by what it asks. Named tensors and registrations
//! are answered here; the rest is a typed [`Job`] for the executor. No socket and no libtorch
//! in it: the transports call it through [`Service`], and its tests run it with no network.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use djinn_auth::{Authenticator, TenantId};
use djinn_memory::{BufferPool, MemoryBudget, Reservation};
use djinn_proto::{
    Archives, BreakpointMessage, DataMessage, ErrorCode, Fingerprint, Frame, Handle, HandleInfo, KeptEntry,
    KeptMessage, Kind, Message, ModelMessage, Payload, Refusal, SessionMessage, TensorSource, Value,
};

use crate::grants::Grants;
use crate::jobs::{CallInputs, Executor, Job, TenantNames};
use crate::kept::{HandleError, KeptTable};
use crate::parked::{Ended, ParkedRecords, Taken};
use crate::sessions::{Queued, SessionError, SessionRecords};
use crate::store::TensorStore;
use crate::{Admission, Delivery};
use crate::{Executed, MovedSession, Peers, PushedTensor, Replier, Reply, ReplyTo, Service, Upload};

#[cfg(test)]
#[path = "node_tests.rs"]
mod tests;

/// The most bytes of a model's archives one `ReadArchives` reads back (its reply holds them in
/// host memory until sent).
pub const MAX_ARCHIVE_READ: u64 = 8 << 20;

/// The longest node address a forwarded handle keeps.
const MAX_ADDRESS_LEN: usize = 256;

/// The connection of the core's own requests to the executor (a signal acknowledged when it
/// came, an abort of a session's step that lapsed): their answers go to no one. No transport
/// numbers a connection so.
const INTERNAL_CONN: u64 = u64::MAX;

/// What the core is built with, besides its executor.
#[derive(Debug, Clone)]
pub struct CoreOptions {
    /// Free receive buffers kept for reuse, bytes.
    pub pool_bytes: u64,
    /// The peer-facing metadata limit (list replies are sized to fit it).
    pub max_meta: u32,
    /// Host memory for archives being uploaded and requests' inputs; with quotas per tenant, so
    /// that one tenant's uploads cannot take every other's inputs.
    pub host_budget: MemoryBudget,
    /// A registration that receives no chunk for this long is dropped, with what it holds.
    pub upload_timeout: Duration,
    /// Tensors to keep stay in the buffer they arrived in (a CPU node), which is then charged to
    /// the device budget from the start.
    pub keep_in_place: bool,
    /// The node's principals, when clients need tokens: what tenants are named by to other
    /// nodes.
    pub auth: Option<Arc<Authenticator>>,
    /// The node's way to other nodes (pushes of named and kept tensors).
    pub peers: Arc<dyn Peers>,
    /// A kept tensor unused this long is freed.
    pub handle_ttl: Duration,
    /// A request parked at a breakpoint is released this long after it parked.
    pub parked_ttl: Duration,
    /// A session untouched this long is closed (its client is presumed gone).
    pub session_idle_ttl: Duration,
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

/// The node's core, over an executor `E`.
#[derive(Debug)]
pub struct NodeCore<E> {
    tensors: TensorStore,
    uploads: HashMap<u64, InProgress>,
    next_upload: u64,
    upload_timeout: Duration,
    pool: BufferPool,
    host_budget: MemoryBudget,
    keep_in_place: bool,
    auth: Option<Arc<Authenticator>>,
    peers: Arc<dyn Peers>,
    /// Tenants' request quotas, when clients need tokens.
    admission: Option<Admission>,
    grants: Grants,
    /// The records of the tensors the executor keeps.
    kept: KeptTable,
    /// The records of the requests the executor has parked at breakpoints.
    parked: ParkedRecords,
    /// The records of the sessions the executor holds, and their requests waiting their turn.
    sessions: SessionRecords,
    /// The request number of the core's next request of its own.
    next_internal: u64,
    /// Requests whose executor's answer the core finishes itself, by connection and request.
    pending: HashMap<(u64, u64), Pending>,
    executor: E,
}

/// What the core does with the executor's answer to a request, besides recording what it kept.
#[derive(Debug)]
enum Pending {
    /// A model claimed ahead of its registration: when the executor does not hold it, the
    /// core opens its upload (of blocks of these lengths).
    Claim { fingerprint: Fingerprint, blocks: Vec<u64>, public: bool },
    /// A received tensor kept: over its payload (`in_place`), which carries its charge, or a
    /// copy charged its bytes.
    Keep { in_place: bool },
    /// A kept tensor's bytes, read to be pushed to the node at `to` on its `grant`, for the
    /// tenant named `tenant` there.
    Push { to: String, grant: String, tenant: String },
    /// A session's state, readied to be opened as a session on the node at `to` on its
    /// `grant`, for the tenant named `tenant` there.
    Move { session: Handle, to: String, grant: String, tenant: String },
    /// The peer at `to` is opening the session: its answer ends the move here.
    Moving { session: Handle, to: String },
    /// A stats request: the transport's counters and the core's, to which the executor's are
    /// added.
    Stats { counters: Vec<(String, u64)> },
    /// A parked request being resumed (its record ended, as `taken`): put back when the
    /// executor says it is parked still.
    Resume { parked: Handle, taken: Taken },
    /// A parked request's activation read back: its `Paused` answer parks nothing new.
    Inspect,
    /// A request of session `id` (a step, a signal, a close): the session's next goes once it
    /// is answered, or once it ends when it parks.
    Session { id: u64 },
    /// The end of session `id`'s move.
    EndMove { id: u64 },
    /// An abort of a step of session `session` parked: the session's next request goes once
    /// the step has ended.
    Abort { session: u64 },
}

/// A registration between its begin and its commit.
#[derive(Debug)]
struct InProgress {
    upload: Upload,
    last_chunk: Instant,
    /// The block lengths' charge.
    _bookkeeping: Reservation,
}

impl<E: Executor> NodeCore<E> {
    /// Named tensors live in `budget` (the device's).
    pub fn new(budget: MemoryBudget, options: CoreOptions, executor: E) -> Self {
        let pool = BufferPool::new(options.pool_bytes, 64 * 1024);
        let now = Instant::now();
        let kept = KeptTable::new(executor.epoch(), budget.clone(), options.handle_ttl, now);
        let parked = ParkedRecords::new(executor.epoch(), options.parked_ttl, now);
        let sessions = SessionRecords::new(executor.epoch(), options.session_idle_ttl, now);
        Self {
            tensors: TensorStore::new(budget, pool.clone(), options.max_meta),
            uploads: HashMap::new(),
            next_upload: 1,
            upload_timeout: options.upload_timeout,
            pool,
            host_budget: options.host_budget,
            keep_in_place: options.keep_in_place,
            admission: options.auth.clone().map(Admission::new),
            auth: options.auth,
            peers: options.peers,
            grants: Grants::default(),
            kept,
            parked,
            sessions,
            next_internal: 1,
            pending: HashMap::new(),
            executor,
        }
    }

    /// A receive buffer charged to `tenant`'s part of the host budget (`charge` bytes of it).
    fn host_alloc(&self, tenant: TenantId, len: usize, charge: u64) -> Result<Payload, Refusal> {
        let reservation = self.host_budget.try_reserve_for(tenant, charge)?;
        Ok(Payload { buf: self.pool.take(len)?, reservation: Some(reservation) })
    }

    /// The name of `tenant`, as other nodes know it (empty where nodes need no token).
    fn tenant_name(&self, tenant: TenantId) -> String {
        self.auth.as_ref().and_then(|a| a.name(tenant)).map_or_else(String::new, |n| n.to_string())
    }

    /// Every tenant's name (none where nodes need no token).
    fn tenant_names(&self) -> TenantNames {
        let names = self.auth.as_ref().map(|a| a.names()).unwrap_or_default();
        names.into_iter().map(|(tenant, name)| (tenant, name.to_string())).collect()
    }

    /// Opens the upload of a model the executor does not hold (its claim said so).
    fn open_upload(
        &mut self,
        fingerprint: Fingerprint,
        blocks: Vec<u64>,
        public: bool,
        to: ReplyTo,
        now: Instant,
    ) -> Reply {
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
                self.uploads.insert(id, InProgress { upload, last_chunk: now, _bookkeeping: bookkeeping });
                Reply::message(ModelMessage::RegisterReady { upload: id, registered: false })
            }
            Err(e) => Reply::error(ErrorCode::BadArchive, e.to_string()),
        }
    }

    fn register_chunk(&mut self, id: u64, offset: u64, payload: Option<Payload>, to: ReplyTo, now: Instant) -> Reply {
        let Some(upload) = self.uploads.get_mut(&id).filter(|u| u.upload.connection == to.connection()) else {
            return Reply::error(ErrorCode::NotFound, format!("no upload {id} on this connection"));
        };
        let Some(chunk) = payload else {
            return Reply::error(ErrorCode::BadArchive, "an empty chunk");
        };
        upload.last_chunk = now;
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

    /// Pushes `tenant`'s named tensor `name` to the node at `to`.
    fn push_named(&self, name: &str, to: String, grant: String, reply_to: ReplyTo, replier: &Replier) -> Option<Reply> {
        let tenant = reply_to.tenant;
        let Some((desc, bytes)) = self.tensors.shared(tenant, name) else {
            return Some(Reply::error(ErrorCode::NotFound, format!("no tensor named {name:?}")));
        };
        // On the peer, the tensor is the same tenant's.
        self.peers.push(PushedTensor { desc, bytes }, to, grant, self.tenant_name(tenant), reply_to, replier);
        None
    }

    /// Answers a request about kept tensors that the core's records answer alone, or hands
    /// one that needs a tensor's bytes on (a fetch, a push) once its handle is checked.
    fn kept_request(&mut self, message: KeptMessage, to: ReplyTo, replier: &Replier, now: Instant) -> Option<Reply> {
        let tenant = to.tenant;
        let (handle, then) = match message {
            KeptMessage::List { after } => {
                let all = to.operator;
                let (listed, more) = self.kept.list((!all).then_some(tenant), after);
                let tensors = listed
                    .into_iter()
                    .map(|(owner, kept)| KeptEntry {
                        tenant: if all { self.tenant_name(owner) } else { String::new() },
                        kept,
                    })
                    .collect();
                return Some(Reply::message(KeptMessage::KeptList { tensors, more }));
            }
            KeptMessage::Forward { handle, to: peer, kept } => {
                return Some(match self.kept.forward(tenant, handle, peer, kept, now) {
                    Ok(()) => {
                        self.executor.free_kept(&[handle.id]);
                        Reply::message(KeptMessage::Forwarded)
                    }
                    Err(e) => handle_error_reply(e),
                });
            }
            KeptMessage::Release { handles } => {
                let released = self.kept.release(tenant, &handles);
                self.executor.free_kept(&released);
                return Some(Reply::message(KeptMessage::Released { released: released.len() as u32 }));
            }
            KeptMessage::Fetch { handle } => (handle, None),
            // On the peer, the tensor is the same tenant's.
            KeptMessage::Push { source: TensorSource::Handle(handle), to: peer, grant } => {
                (handle, Some(Pending::Push { to: peer, grant, tenant: self.tenant_name(tenant) }))
            }
            other => {
                let kind = Message::Kept(other).kind();
                return Some(Reply::error(
                    ErrorCode::Unexpected,
                    format!("a node does not serve {} requests", kind.name()),
                ));
            }
        };
        if let Err(e) = self.kept.get(tenant, handle, now) {
            return Some(handle_error_reply(e));
        }
        if let Some(pending) = then {
            self.pending.insert((to.conn_id, to.request_id), pending);
        }
        self.executor.run(Job::Fetch { handle }, to, replier);
        None
    }

    /// Resumes, inspects or aborts a parked request, once the core's record says it is the
    /// tenant's and not ended (a resume or an abort ends it here and now).
    fn parked_request(
        &mut self,
        message: BreakpointMessage,
        payload: Option<Payload>,
        to: ReplyTo,
        replier: &Replier,
    ) -> Option<Reply> {
        let tenant = to.tenant;
        let key = (to.conn_id, to.request_id);
        let checked = match message {
            BreakpointMessage::Resume { parked, tensors, activation, until } => {
                self.parked.end(tenant, parked, Ended::Resumed).map(|taken| {
                    self.pending.insert(key, Pending::Resume { parked, taken });
                    Job::Resume { parked, tensors, activation, payload, until }
                })
            }
            BreakpointMessage::Inspect { parked } => self.parked.check(tenant, parked).map(|_| {
                self.pending.insert(key, Pending::Inspect);
                Job::Inspect { parked }
            }),
            BreakpointMessage::Abort { parked } => self.parked.end(tenant, parked, Ended::Aborted).map(|taken| {
                if let Some(session) = taken.session {
                    self.pending.insert(key, Pending::Abort { session });
                }
                Job::Abort { parked }
            }),
            other => {
                let kind = Message::Breakpoint(other).kind();
                let message = format!("a node does not serve {} requests", kind.name());
                return Some(Reply::error(ErrorCode::Unexpected, message));
            }
        };
        match checked {
            Ok(job) => {
                self.executor.run(job, to, replier);
                None
            }
            Err(e) => Some(Reply::error(e.code(), e.to_string())),
        }
    }

    /// Queues `to`'s request `job` on its session, handed to the executor in its turn
    /// (`pending`: what the core does with its answer).
    fn session_request(
        &mut self,
        session: Handle,
        job: Job,
        pending: Pending,
        to: ReplyTo,
        replier: &Replier,
        now: Instant,
    ) -> Option<Reply> {
        // A signal is acknowledged when it comes and takes effect in its turn, unless a move is
        // under way: then it waits for the move like a step (and may be told where it went).
        let ack_now = matches!(job, Job::Signal { .. }) && !self.sessions.is_moving(to.tenant, session);
        let runs_as = if ack_now { self.internal(to.tenant) } else { to };
        match self.sessions.submit(to.tenant, session, job, runs_as, now) {
            Ok(next) => {
                self.pending.insert((runs_as.conn_id, runs_as.request_id), pending);
                self.run(next, replier);
                ack_now.then(|| Reply::message(SessionMessage::Signaled))
            }
            Err(SessionError::Moved { to, session }) => Some(Reply::message(SessionMessage::Moved { to, session })),
            Err(e) => Some(Reply::error(e.code(), e.to_string())),
        }
    }

    /// Where the answer to a request of the core's own goes: to no one.
    fn internal(&mut self, tenant: TenantId) -> ReplyTo {
        let request_id = self.next_internal;
        self.next_internal += 1;
        ReplyTo { slot: usize::MAX, conn_id: INTERNAL_CONN, request_id, tenant, operator: false, torchscript: false }
    }

    /// Hands the executor a session's next request, if one is due.
    fn run(&mut self, next: Option<Queued>, replier: &Replier) {
        if let Some((job, to)) = next {
            self.executor.run(job, to, replier);
        }
    }

    /// Answers the requests that waited for a session that is gone (closed, or moved) with
    /// `reply`; the core's own go to no one.
    fn answer_waiting(&mut self, waiting: VecDeque<Queued>, reply: impl Fn() -> Reply, replier: &Replier) {
        for (_, to) in waiting {
            self.pending.remove(&(to.conn_id, to.request_id));
            if to.conn_id != INTERNAL_CONN {
                replier.send(to, reply());
            }
        }
    }

    /// The executor answered session `id`'s request: a step that parked holds the session's
    /// next requests, a close refuses them, and anything else lets the next go.
    fn session_answered(&mut self, id: u64, to: ReplyTo, reply: &Reply, replier: &Replier, now: Instant) {
        match &reply.message {
            Message::Breakpoint(BreakpointMessage::Paused { parked, .. }) => {
                self.sessions.pause(id, now);
                self.parked.record(to.tenant, *parked, Some(id), now);
            }
            Message::Session(SessionMessage::Closed) => {
                let waiting = self.sessions.closed(id);
                let closed =
                    || Reply::error(ErrorCode::NotFound, format!("session {id} was closed before this request"));
                self.answer_waiting(waiting, closed, replier);
            }
            _ => {
                let next = self.sessions.answered(id, now);
                self.run(next, replier);
            }
        }
    }

    /// Checks the handles `values` name: each one the tenant's, of this life, still here (a
    /// tensor forwarded elsewhere is answered with where it went, which clients follow).
    fn check_handles(&mut self, tenant: TenantId, values: &[Value], now: Instant) -> Result<(), HandleError> {
        let mut handles = Vec::new();
        values.iter().for_each(|v| v.for_each_handle(&mut |h| handles.push(*h)));
        for handle in handles {
            self.kept.get(tenant, handle, now)?;
        }
        Ok(())
    }

    /// Records the tensors the executor says it kept for `tenant` (`in_place`: over their
    /// payload) before `reply` goes; when the records are refused the tensors are freed and the
    /// reply is the refusal.
    fn record_kept(&mut self, tenant: TenantId, reply: Reply, in_place: bool, now: Instant) -> Reply {
        let kept: &[HandleInfo] = match &reply.message {
            Message::Model(ModelMessage::ExecuteReply { kept, .. }) => kept,
            Message::Kept(KeptMessage::Kept { kept }) => std::slice::from_ref(kept),
            _ => return reply,
        };
        match self.kept.record(tenant, kept, in_place, now) {
            Ok(()) => reply,
            Err(refusal) => {
                let ids: Vec<u64> = kept.iter().map(|k| k.handle.id).collect();
                self.executor.free_kept(&ids);
                Reply::error(refusal.code, refusal.message)
            }
        }
    }

    /// The refusal of a request numbered as one still under way on its connection. The core
    /// finishes some answers itself, by the request they answer: a second request of the same
    /// number would take the first one's place (a session moving would never end).
    fn in_use(&self, to: ReplyTo) -> Option<Reply> {
        self.pending.contains_key(&(to.conn_id, to.request_id)).then(|| {
            let message = format!("request {} is still under way on this connection: number each anew", to.request_id);
            Reply::error(ErrorCode::Unexpected, message)
        })
    }

    /// The job a request of the executor's asks for; the request's kind when it is not one.
    fn job(&self, message: Message, payload: Option<Payload>, to: ReplyTo) -> Result<Job, Kind> {
        let all = || to.operator.then(|| self.tenant_names());
        Ok(match message {
            Message::Model(ModelMessage::Execute { fingerprint, tensors, inputs, keep, until }) => {
                Job::Execute { fingerprint, inputs: CallInputs { values: inputs, tensors, payload }, keep, until }
            }
            Message::Model(ModelMessage::Unregister { fingerprint }) => Job::Unregister { fingerprint },
            Message::Model(ModelMessage::ListModels) => Job::ListModels { all: all() },
            Message::Model(ModelMessage::ReadArchives { fingerprint, offset, len }) => {
                Job::ReadArchives { fingerprint, offset, len }
            }
            Message::Kept(KeptMessage::Keep { tensor }) => Job::Keep { tensor, payload },
            Message::Session(SessionMessage::Open { fingerprint, state, reserve }) => {
                Job::OpenSession { fingerprint, state, payload, reserve }
            }
            Message::Session(SessionMessage::Step { session, tensors, inputs, until }) => {
                Job::Step { session, inputs: CallInputs { values: inputs, tensors, payload }, until }
            }
            Message::Session(SessionMessage::Signal { session, signal }) => Job::Signal { session, signal },
            Message::Session(SessionMessage::Close { session }) => Job::Close { session },
            Message::Session(SessionMessage::List { after }) => Job::ListSessions { all: all(), after },
            other => return Err(other.kind()),
        })
    }
}

impl<E: Executor> Service for NodeCore<E> {
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
            // A tensor to keep: on the CPU it stays in this buffer, which is charged to the
            // device budget; on a GPU it is copied there (and charged then), so the buffer is
            // only host memory for a while.
            Message::Kept(KeptMessage::Keep { .. }) if self.keep_in_place => self.tensors.alloc(tenant, len),
            other if other.is_reply() || other.tensors().is_empty() => Err(Refusal {
                code: ErrorCode::Unexpected,
                message: format!("a {} request carries no payload", other.kind().name()),
            }),
            // Any other request's tensors are its inputs (an execution's, a step's, a resume's, a
            // session's initial state, a tensor to keep on a GPU): they live for one request, in
            // host memory (copied to the device when it is a GPU). The host budget bounds what
            // all requests' inputs hold at once.
            _ => self.host_alloc(tenant, len, len as u64),
        }
    }

    fn handle(&mut self, frame: Frame, to: ReplyTo, replier: &Replier, now: Instant) -> Option<Reply> {
        let Frame { message, payload, .. } = frame;
        let tenant = to.tenant;
        // Answered here and now: nothing of theirs is finished later.
        let message = match message {
            Message::Kept(KeptMessage::PushGrant { tensor }) => {
                return Some(self.grants.give(tenant, self.tenant_name(tenant), Delivery::Tensor(tensor), now));
            }
            Message::Session(SessionMessage::ReceiveGrant { fingerprint }) => {
                let delivery = Delivery::Session(fingerprint);
                return Some(self.grants.give(tenant, self.tenant_name(tenant), delivery, now));
            }
            message @ (Message::Data(DataMessage::Put { .. })
            | Message::Data(DataMessage::Get { .. })
            | Message::Data(DataMessage::Delete { .. })
            | Message::Data(DataMessage::List { .. })) => {
                return Some(self.tensors.handle(tenant, message, payload));
            }
            other => other,
        };
        if let Some(refused) = self.in_use(to) {
            return Some(refused);
        }
        let message = match message {
            // Whether the blocks are graphs or TorchScript shows in their bytes: a TorchScript
            // block from a principal without the right is refused when it is loaded, and a
            // TorchScript model the node holds already when it is claimed.
            Message::Model(ModelMessage::RegisterBegin { fingerprint, blocks, public }) => {
                self.pending.insert((to.conn_id, to.request_id), Pending::Claim { fingerprint, blocks, public });
                self.executor.run(Job::Claim { fingerprint, public }, to, replier);
                return None;
            }
            Message::Model(ModelMessage::RegisterChunk { upload, offset, .. }) => {
                return Some(self.register_chunk(upload, offset, payload, to, now));
            }
            Message::Model(ModelMessage::RegisterCommit { upload: id }) => {
                return match self.uploads.remove(&id).filter(|u| u.upload.connection == to.connection()) {
                    Some(InProgress { upload, .. }) => {
                        self.executor.run(Job::Load { upload }, to, replier);
                        None
                    }
                    None => Some(Reply::error(ErrorCode::NotFound, format!("no upload {id} on this connection"))),
                };
            }
            Message::Model(ModelMessage::ReadArchives { len, .. }) if len > MAX_ARCHIVE_READ => {
                let message = format!("{len} bytes asked for at once; a read takes at most {MAX_ARCHIVE_READ}");
                return Some(Reply::error(ErrorCode::ExecutionFailed, message));
            }
            Message::Kept(KeptMessage::Forward { to: peer, .. }) if peer.len() > MAX_ADDRESS_LEN => {
                let message = format!("a node's address of {} bytes; at most {MAX_ADDRESS_LEN}", peer.len());
                return Some(Reply::error(ErrorCode::ExecutionFailed, message));
            }
            Message::Kept(KeptMessage::Push { source: TensorSource::Named(name), to: peer, grant }) => {
                return self.push_named(&name, peer, grant, to, replier);
            }
            Message::Session(SessionMessage::Move { session, to: peer, grant }) => {
                let pending = Pending::Move { session, to: peer, grant, tenant: self.tenant_name(tenant) };
                return self.session_request(session, Job::Move { session }, pending, to, replier, now);
            }
            Message::Breakpoint(message) => return self.parked_request(message, payload, to, replier),
            Message::Kept(KeptMessage::Keep { .. }) => {
                let in_place = self.keep_in_place && payload.is_some();
                self.pending.insert((to.conn_id, to.request_id), Pending::Keep { in_place });
                message
            }
            Message::Kept(
                message @ (KeptMessage::List { .. }
                | KeptMessage::Forward { .. }
                | KeptMessage::Release { .. }
                | KeptMessage::Fetch { .. }
                | KeptMessage::Push { .. }),
            ) => return self.kept_request(message, to, replier, now),
            other => other,
        };
        let job = match self.job(message, payload, to) {
            Ok(job) => job,
            Err(kind) => {
                let message = format!("a node does not serve {} requests", kind.name());
                return Some(Reply::error(ErrorCode::Unexpected, message));
            }
        };
        let named = match &job {
            Job::Execute { inputs, .. } | Job::Step { inputs, .. } => Some(inputs.values.as_slice()),
            _ => None,
        };
        if let Some(values) = named
            && let Err(e) = self.check_handles(tenant, values, now)
        {
            return Some(handle_error_reply(e));
        }
        if let Job::Step { session, .. } | Job::Signal { session, .. } | Job::Close { session } = job {
            return self.session_request(session, job, Pending::Session { id: session.id }, to, replier, now);
        }
        self.executor.run(job, to, replier);
        None
    }

    fn complete(&mut self, to: ReplyTo, answer: Executed, replier: &Replier, now: Instant) -> Option<Reply> {
        let key = (to.conn_id, to.request_id);
        let Executed { reply, still_parked } = answer;
        // The core's own requests' answers go to no one.
        let answer_to = to.conn_id != INTERNAL_CONN;
        let paused = matches!(reply.message, Message::Breakpoint(BreakpointMessage::Paused { .. }));
        // The session whose parked step a resume runs on.
        let mut resumed = None;
        let in_place = match self.pending.remove(&key) {
            Some(Pending::Resume { parked, taken }) => {
                if still_parked {
                    self.parked.put_back(to.tenant, parked, taken);
                } else if let Some(id) = taken.session {
                    // Parked again, it holds the session still; else the step has ended.
                    resumed = Some(id);
                    if !paused {
                        let next = self.sessions.unpause(id, now);
                        self.run(next, replier);
                    }
                }
                false
            }
            Some(Pending::Inspect) => return Some(reply),
            Some(Pending::Session { id }) => {
                self.session_answered(id, to, &reply, replier, now);
                return answer_to.then_some(reply);
            }
            Some(Pending::Abort { session }) => {
                let next = self.sessions.unpause(session, now);
                self.run(next, replier);
                return answer_to.then_some(reply);
            }
            Some(Pending::Move { session, to: peer, grant, tenant }) => {
                let Message::Session(SessionMessage::Open { fingerprint, state, reserve }) = reply.message else {
                    let next = self.sessions.move_failed(session.id, now);
                    self.run(next, replier);
                    return Some(reply);
                };
                let moved = MovedSession { fingerprint, state, bytes: reply.tensors, reserve };
                self.pending.insert(key, Pending::Moving { session, to: peer.clone() });
                self.peers.open_session(moved, peer, grant, tenant, to, replier);
                return None;
            }
            Some(Pending::Moving { session, to: peer }) => {
                let moved = match reply.message {
                    Message::Session(SessionMessage::Opened { session: there }) => Ok((peer, there)),
                    Message::Data(DataMessage::Error { code, message }) => Err((code, message)),
                    other => {
                        Err((ErrorCode::Internal, format!("the peer at {peer} answered a {}", other.kind().name())))
                    }
                };
                self.pending.insert(key, Pending::EndMove { id: session.id });
                self.executor.run(Job::EndMove { session, moved }, to, replier);
                return None;
            }
            Some(Pending::EndMove { id }) => {
                if let Message::Session(SessionMessage::Moved { to: peer, session: there }) = &reply.message {
                    // What waited behind the move is told where the session went.
                    let waiting = self.sessions.moved_out(id, peer.clone(), *there, now);
                    let moved = || Reply::message(SessionMessage::Moved { to: peer.clone(), session: *there });
                    self.answer_waiting(waiting, moved, replier);
                } else {
                    let next = self.sessions.move_failed(id, now);
                    self.run(next, replier);
                }
                return Some(reply);
            }
            Some(Pending::Push { to: peer, grant, tenant }) => {
                let Message::Data(DataMessage::GetReply { tensor: desc }) = reply.message else {
                    return Some(reply);
                };
                let Some(bytes) = reply.tensors.into_iter().next() else {
                    return Some(Reply::error(ErrorCode::Internal, "a kept tensor read back without its bytes"));
                };
                self.peers.push(PushedTensor { desc, bytes }, peer, grant, tenant, to, replier);
                return None;
            }
            Some(Pending::Claim { fingerprint, blocks, public }) => {
                return Some(match reply.message {
                    Message::Model(ModelMessage::RegisterReady { registered: false, .. }) => {
                        self.open_upload(fingerprint, blocks, public, to, now)
                    }
                    _ => reply,
                });
            }
            Some(Pending::Stats { mut counters }) => {
                if let Message::Data(DataMessage::StatsReply { counters: executor }) = reply.message {
                    counters.extend(executor);
                    return Some(Reply::message(DataMessage::StatsReply { counters }));
                }
                return Some(reply);
            }
            Some(Pending::Keep { in_place }) => in_place,
            None => false,
        };
        match &reply.message {
            Message::Breakpoint(BreakpointMessage::Paused { parked, .. }) => {
                self.parked.record(to.tenant, *parked, resumed, now);
            }
            Message::Session(SessionMessage::Opened { session }) => self.sessions.opened(to.tenant, *session, now),
            _ => {}
        }
        Some(self.record_kept(to.tenant, reply, in_place, now))
    }

    fn stats(&mut self, mut counters: Vec<(String, u64)>, to: ReplyTo, replier: &Replier) -> Option<Reply> {
        if let Some(refused) = self.in_use(to) {
            return Some(refused);
        }
        let out = &mut counters;
        self.tensors.stats(out);
        self.kept.stats(out);
        self.parked.stats(out);
        self.sessions.stats(out);
        out.extend(
            [
                ("uploads", self.uploads.len() as u64),
                ("host_budget_used_bytes", self.host_budget.used()),
                ("host_budget_limit_bytes", self.host_budget.limit()),
            ]
            .map(|(k, v)| (k.to_owned(), v)),
        );
        self.pending.insert((to.conn_id, to.request_id), Pending::Stats { counters });
        self.executor.run(Job::Stats, to, replier);
        None
    }

    fn admit(&mut self, tenant: TenantId, now: Instant) -> Result<(), Refusal> {
        self.admission.as_mut().map_or(Ok(()), |a| a.admit(tenant, now))
    }

    fn started(&mut self, tenant: TenantId) {
        if let Some(admission) = &mut self.admission {
            admission.started(tenant);
        }
    }

    fn finished(&mut self, tenant: TenantId) {
        if let Some(admission) = &mut self.admission {
            admission.finished(tenant);
        }
    }

    fn redeem(&mut self, secret: &str, name: &str, now: Instant) -> Option<(TenantId, Delivery)> {
        self.grants.redeem(secret, name, now)
    }

    fn on_disconnect(&mut self, connection: u64) {
        // A claim's answer opens no upload for it; its other requests' answers still come, are
        // completed (what they kept is recorded, to be released or to expire; a session's move
        // ends) and dropped with no one to send them to.
        self.pending.retain(|&(conn, _), p| conn != connection || !matches!(p, Pending::Claim { .. }));
        self.uploads.retain(|id, u| {
            let keep = u.upload.connection != connection;
            if !keep {
                tracing::info!(upload = id, model = %u.upload.archives.fingerprint(), "registration abandoned: its connection closed");
            }
            keep
        });
    }

    fn next_expiry(&self) -> Option<Instant> {
        let kept = Some(self.kept.next_sweep()).filter(|_| !self.kept.is_empty());
        [kept, self.parked.next_sweep(), self.sessions.next_sweep()].into_iter().flatten().min()
    }

    fn expire(&mut self, now: Instant, replier: &Replier) {
        let expired = self.kept.expire(now);
        self.executor.free_kept(&expired);
        let mut free = Vec::new();
        for (id, session) in self.parked.expire(now) {
            // A session's step is aborted in the session's turn: its next request comes after.
            match session.and_then(|s| Some((s, self.sessions.tenant(s)?))) {
                Some((session, tenant)) => {
                    let to = self.internal(tenant);
                    self.pending.insert((to.conn_id, to.request_id), Pending::Abort { session });
                    let parked = Handle { id, epoch: self.parked.epoch() };
                    self.executor.run(Job::Abort { parked }, to, replier);
                }
                None => free.push(id),
            }
        }
        if !free.is_empty() {
            self.executor.free_parked(&free);
        }
        let idle = self.sessions.expire(now);
        if !idle.is_empty() {
            self.executor.free_sessions(&idle);
        }
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

/// The answer to a request naming a handle that names nothing it may use: where the tensor went
/// (a `kept.Moved`, which clients follow), else the error.
fn handle_error_reply(e: HandleError) -> Reply {
    match e {
        HandleError::Moved { to, kept, .. } => Reply::message(KeptMessage::Moved { to, kept }),
        e => Reply::error(e.code(), e.to_string()),
    }
}
