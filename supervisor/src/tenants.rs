//! An executor process per tenant, behind the core's one [`Executor`].
//!
//! A tenant's first job starts its process; a job for a tenant whose process has ended starts
//! a new one, which loads the tenant's models again before it runs anything else: the router
//! keeps a copy of the archives of every model a tenant loads, until the tenant unregisters it
//! (host memory charged to the tenant on the node's host budget: a load whose copy does not fit
//! is refused). Each process makes
//! handles of the node's one epoch from an id range of its own, never reused, so that the
//! core's records tell whose each handle is and a handle of an ended process names nothing.
//! What asks about every tenant (the node's counters, an operator's or the node's own lists of
//! models and sessions) is asked of every live process and their answers merged.

use std::collections::{BTreeMap, HashMap};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use djinn_auth::TenantId;
use djinn_memory::{HostBuf, MemoryBudget, OverBudget, Reservation};
use djinn_node_core::{Answer, Executor, Job, LIST_PAGE, Replier, Reply, ReplyTo, Scope, Upload};
use djinn_proto::{
    DataMessage, ErrorCode, Fingerprint, Handle, Message, ModelInfo, ModelMessage, Payload, SessionEntry,
    SessionMessage,
};
use djinn_sync::Locked;

use crate::process::{BeforeSend, FirstJob};
use crate::restarts::{Restarts, WINDOW};
use crate::sandbox::Layer;
use crate::{LinkSizes, ProcessExecutor, Supervision};

/// Ids of the handles one executor process may make.
const IDS_PER_PROCESS: u64 = 1 << 40;
/// How long a gathering waits for each process's answer.
const GATHER_WAIT: Duration = Duration::from_secs(30);

/// What starts a tenant's executor process: the command for a process whose handles are of
/// `epoch` with ids from `first_id`.
pub type Launch = Box<dyn Fn(TenantId, u64, u64) -> Command + Send>;

/// One executor process per tenant.
pub struct TenantExecutors {
    launch: Launch,
    sizes: LinkSizes,
    supervision: Supervision,
    epoch: u64,
    /// The first id of the next process's range.
    next_first_id: u64,
    live: HashMap<TenantId, (ProcessExecutor, u64)>,
    /// Whose each live process's range is, by its first id.
    ranges: BTreeMap<u64, TenantId>,
    started: u64,
    restarts: u64,
    /// Each tenant's recent process ends, while it has any.
    ended: HashMap<TenantId, Restarts>,
    /// Jobs refused because their tenant's next process had to wait.
    deferred: u64,
    /// The archives of each tenant's models, to load in its next process.
    archives: HashMap<TenantId, BTreeMap<Fingerprint, Arc<KeptArchives>>>,
    /// What the archives' copies are charged to.
    host_budget: MemoryBudget,
    /// The request id of the next request the router makes itself (each distinct, so that no
    /// two are held under one id by a process).
    next_request: u64,
    /// Where the processes answer gatherings: one thread takes every answer up.
    gathering: Replier,
    gatherings: Arc<Mutex<Gatherings>>,
}

/// A copy of a model's archives as they were loaded, and whose.
struct KeptArchives {
    block_lens: Vec<u64>,
    /// Each block's archive, copied by the link thread of the process the load went to, as it
    /// sends it (the poller copies nothing); empty while that load has not been sent.
    chunks: OnceLock<Vec<Vec<u8>>>,
    public: bool,
    torchscript: bool,
    /// Their bytes, charged to their tenant.
    _charge: Reservation,
}

impl KeptArchives {
    /// Room for a copy of `upload`'s archives, charged to `tenant` on `budget`.
    fn charged(upload: &Upload, tenant: TenantId, budget: &MemoryBudget) -> Result<Self, OverBudget> {
        let charge = budget.try_reserve_for(tenant, upload.archives.block_lens().iter().sum())?;
        Ok(Self {
            block_lens: upload.archives.block_lens().to_vec(),
            chunks: OnceLock::new(),
            public: upload.scope == Scope::Public,
            torchscript: upload.torchscript,
            _charge: charge,
        })
    }

    /// Copies the archives of `load`.
    fn copy(&self, load: &Job) {
        if let Job::Load { upload } = load {
            let blocks = upload.archives.blocks().into_iter().map(|block| block.slices().collect::<Vec<_>>().concat());
            let _ = self.chunks.set(blocks.collect());
        }
    }

    /// The load of these archives for `to`'s tenant (none when memory for them is short, or
    /// they were never copied).
    fn load(&self, fingerprint: Fingerprint, to: ReplyTo) -> Option<(Job, ReplyTo)> {
        let tenant = to.tenant;
        let mut upload = Upload::new(fingerprint, self.block_lens.clone(), (tenant, self.public), RELOAD_CONN).ok()?;
        upload.torchscript = self.torchscript;
        for chunk in self.chunks.get()? {
            let buf = HostBuf::copy_from(chunk).ok()?;
            let offset = upload.archives.received();
            upload.archives.add(offset, Payload { buf, reservation: None }).ok()?;
        }
        Some((Job::Load { upload }, ReplyTo { torchscript: self.torchscript, ..to }))
    }
}

impl std::fmt::Debug for TenantExecutors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantExecutors").field("live", &self.live.len()).field("restarts", &self.restarts).finish()
    }
}

impl TenantExecutors {
    /// Processes started with `launch`, each linked with rings of `sizes` and supervised as
    /// `supervision` says; their handles are of `epoch`. The copies of tenants' archives
    /// are charged to them on `host_budget`.
    pub fn new(
        launch: Launch,
        sizes: LinkSizes,
        supervision: Supervision,
        epoch: u64,
        host_budget: MemoryBudget,
    ) -> std::io::Result<Self> {
        let (gathering, answers) = Replier::new(Arc::new(|| {}));
        let gatherings = Arc::new(Mutex::new(Gatherings::default()));
        {
            // It ends when the router and its processes, which hold the replier, are gone.
            let gatherings = Arc::clone(&gatherings);
            std::thread::Builder::new().name("executor-gather".into()).spawn(move || gather(&answers, &gatherings))?;
        }
        Ok(Self {
            launch,
            sizes,
            supervision,
            epoch,
            next_first_id: 1,
            live: HashMap::new(),
            ranges: BTreeMap::new(),
            started: 0,
            restarts: 0,
            ended: HashMap::new(),
            deferred: 0,
            archives: HashMap::new(),
            host_budget,
            next_request: 0,
            gathering,
            gatherings,
        })
    }

    fn own_request(&mut self, conn_id: u64, like: ReplyTo) -> ReplyTo {
        self.next_request += 1;
        ReplyTo { slot: usize::MAX, conn_id, request_id: self.next_request, ..like }
    }

    /// The process id of the tenant's process, while it has one.
    pub fn pid_of(&self, tenant: TenantId) -> Option<u32> {
        self.live.get(&tenant).filter(|(process, _)| process.lost().is_none()).and_then(|(process, _)| process.pid())
    }

    /// The tenant's process: its live one, or a new one (unless its processes have ended too
    /// often of late: then why not).
    fn process(&mut self, to: ReplyTo) -> Result<&mut ProcessExecutor, String> {
        let tenant = to.tenant;
        let now = Instant::now();
        if let Some((process, _)) = self.live.get(&tenant)
            && let Some(why) = process.lost()
        {
            tracing::warn!(tenant = tenant.0, cause = %why, "a tenant's executor process ended");
            if let Some((ended, first_id)) = self.live.remove(&tenant) {
                self.ranges.remove(&first_id);
                // Its threads are joined away from the poller's thread, which must not wait.
                let _ = std::thread::Builder::new().name("executor-ended".into()).spawn(move || drop(ended));
            }
            self.ended.entry(tenant).or_default().ended(now);
            self.restarts += 1;
        }
        if !self.live.contains_key(&tenant) {
            self.ended.retain(|_, ended| !ended.is_idle(now));
            if let Some(ended) = self.ended.get(&tenant)
                && let Some(wait) = ended.wait_at(now)
            {
                self.deferred += 1;
                return Err(format!(
                    "its executor processes ended {} times in {WINDOW:?}; the next starts in {:.1} s",
                    ended.recent(now),
                    wait.as_secs_f64()
                ));
            }
            let first_id = self.next_first_id;
            let command = (self.launch)(tenant, self.epoch, first_id);
            // A load its process never sent (it ended first) left nothing to load again.
            let kept = self.archives.entry(tenant).or_default();
            kept.retain(|_, archives| archives.chunks.get().is_some());
            let kept: Vec<(Fingerprint, Arc<KeptArchives>)> = kept.iter().map(|(f, a)| (*f, Arc::clone(a))).collect();
            let mut reloads: Vec<FirstJob> = Vec::new();
            for (fingerprint, archives) in kept {
                let as_tenant = self.own_request(RELOAD_CONN, ReplyTo { operator: false, ..to });
                reloads.push(Box::new(move || archives.load(fingerprint, as_tenant)));
            }
            let models = reloads.len();
            let process = ProcessExecutor::start(command, self.sizes, self.epoch, self.supervision, reloads)
                .map_err(|e| format!("cannot start one: {e}"))?;
            tracing::info!(tenant = tenant.0, first_id, models, "a tenant's executor process starts");
            self.next_first_id += IDS_PER_PROCESS;
            self.ranges.insert(first_id, tenant);
            self.live.insert(tenant, (process, first_id));
            self.started += 1;
        }
        let (process, _) = self.live.get_mut(&tenant).ok_or("no process")?;
        Ok(process)
    }

    /// The live process whose range holds `id` (none for an id of a process that has ended:
    /// what it held went with it).
    fn owner_of(&mut self, id: u64) -> Option<&mut ProcessExecutor> {
        let (&first_id, tenant) = self.ranges.range(..=id).next_back()?;
        if id - first_id >= IDS_PER_PROCESS {
            return None;
        }
        match self.live.get_mut(tenant) {
            Some((process, first)) if *first == first_id => Some(process),
            _ => None,
        }
    }

    /// Whether `handle` names what a process of this router's made and that has ended since:
    /// it went with the process.
    fn went_with_its_process(&mut self, handle: Handle) -> bool {
        handle.epoch == self.epoch
            && handle.id < self.next_first_id
            && self.owner_of(handle.id).is_none_or(|process| process.lost().is_some())
    }

    /// Hands each live process the ids of `ids` in its range.
    fn free(&mut self, ids: &[u64], free: fn(&mut ProcessExecutor, &[u64])) {
        let mut by_range: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for &id in ids {
            if let Some((&first_id, _)) = self.ranges.range(..=id).next_back()
                && id - first_id < IDS_PER_PROCESS
            {
                by_range.entry(first_id).or_default().push(id);
            }
        }
        for (first_id, ids) in by_range {
            if let Some(process) = self.owner_of(first_id) {
                free(process, &ids);
            }
        }
    }

    /// Asks every live process `job()` and answers `to` with what `merge` makes of their
    /// replies, once all have come or `GATHER_WAIT` has passed (the gathering thread answers).
    fn gather(&mut self, job: impl Fn() -> Job, to: ReplyTo, replier: &Replier, merge: Merge) {
        let tenants: Vec<TenantId> =
            self.live.iter().filter(|(_, (process, _))| process.lost().is_none()).map(|(t, _)| *t).collect();
        let asks: Vec<(TenantId, ReplyTo)> =
            tenants.into_iter().map(|tenant| (tenant, self.own_request(GATHER_CONN, to))).collect();
        let mut sandboxed = [0; Layer::ALL.len()];
        for (process, _) in self.live.values().filter(|(process, _)| process.lost().is_none()) {
            let layers = process.layers();
            for (count, layer) in sandboxed.iter_mut().zip(Layer::ALL) {
                *count += u64::from(layers.contains(layer));
            }
        }
        let own = Counts {
            processes: asks.len() as u64,
            sandboxed,
            started: self.started,
            restarts: self.restarts,
            deferred: self.deferred,
        };
        if asks.is_empty() {
            return replier.executed(to, merge(Vec::new(), own));
        }
        // Recorded before any process is asked, so that no answer comes before its gathering.
        let gathering = Gathering {
            to,
            replier: replier.clone(),
            merge,
            own,
            waiting: asks.len(),
            replies: Vec::with_capacity(asks.len()),
            until: Instant::now() + GATHER_WAIT,
        };
        self.gatherings.locked().add(asks.iter().map(|(_, ask)| ask.request_id), gathering);
        for (tenant, ask) in asks {
            if let Some((process, _)) = self.live.get_mut(&tenant) {
                // A process that ends meanwhile is answered `ExecutorLost` by its reader.
                process.run(job(), ask, &self.gathering);
            }
        }
    }
}

/// Gatherings not yet answered: each by the id of its first ask, and which each ask's answer
/// belongs to. As many as the core lets requests be in flight.
#[derive(Default)]
struct Gatherings {
    waiting: BTreeMap<u64, Gathering>,
    asks: HashMap<u64, u64>,
}

/// One request asked of every live process.
struct Gathering {
    to: ReplyTo,
    replier: Replier,
    merge: Merge,
    own: Counts,
    waiting: usize,
    replies: Vec<Reply>,
    until: Instant,
}

impl Gatherings {
    fn add(&mut self, asks: impl Iterator<Item = u64>, gathering: Gathering) {
        let mut first = None;
        for ask in asks {
            let first = *first.get_or_insert(ask);
            self.asks.insert(ask, first);
        }
        if let Some(first) = first {
            self.waiting.insert(first, gathering);
        }
    }

    /// Records the answer to `ask`: the gathering it completes, if it does.
    fn answered(&mut self, ask: u64, reply: Reply) -> Option<Gathering> {
        let first = self.asks.remove(&ask)?;
        let gathering = self.waiting.get_mut(&first)?;
        gathering.replies.push(reply);
        gathering.waiting -= 1;
        if gathering.waiting > 0 {
            return None;
        }
        self.waiting.remove(&first)
    }

    /// The gatherings past their time, answered with what came (the rest of their asks
    /// forgotten), and when the next one's time is up.
    fn lapsed(&mut self, now: Instant) -> (Vec<Gathering>, Option<Instant>) {
        let ended: Vec<u64> = self.waiting.iter().filter(|(_, g)| g.until <= now).map(|(first, _)| *first).collect();
        let lapsed: Vec<Gathering> = ended.iter().filter_map(|first| self.waiting.remove(first)).collect();
        if !lapsed.is_empty() {
            self.asks.retain(|_, first| !ended.contains(first));
        }
        (lapsed, self.waiting.values().map(|g| g.until).min())
    }
}

impl Gathering {
    fn answer(self) {
        self.replier.executed(self.to, (self.merge)(self.replies, self.own));
    }
}

/// The gathering thread: takes every process's answer to a gathering up, and answers each
/// gathering when its last answer comes or its time is up.
fn gather(answers: &crossbeam_channel::Receiver<(ReplyTo, Answer)>, gatherings: &Mutex<Gatherings>) {
    loop {
        let (lapsed, next) = gatherings.locked().lapsed(Instant::now());
        lapsed.into_iter().for_each(Gathering::answer);
        // A gathering added meanwhile lapses after any already waiting.
        let wait = next.map_or(GATHER_WAIT, |next| next.saturating_duration_since(Instant::now()));
        let (ask, answer) = match answers.recv_timeout(wait) {
            Ok(answered) => answered,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => continue,
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
        };
        let reply = match answer {
            Answer::Reply(reply) => reply,
            Answer::Executed(executed) => executed.reply,
        };
        let complete = gatherings.locked().answered(ask.request_id, reply);
        if let Some(gathering) = complete {
            gathering.answer();
        }
    }
}

/// The connections of the requests the router makes of its processes itself: gathering
/// answers from each, and loading a tenant's models in its new process.
const GATHER_CONN: u64 = u64::MAX - 1;
const RELOAD_CONN: u64 = u64::MAX - 2;

/// What an executor holds that `job` names, and its handle.
fn named(job: &Job) -> Option<(&'static str, Handle)> {
    match job {
        Job::Fetch { handle } => Some(("the kept tensor", *handle)),
        Job::Step { session, .. }
        | Job::Signal { session, .. }
        | Job::Move { session }
        | Job::EndMove { session, .. }
        | Job::Close { session } => Some(("the session", *session)),
        Job::Resume { parked, .. } | Job::Inspect { parked } | Job::Abort { parked } => {
            Some(("the parked request", *parked))
        }
        _ => None,
    }
}

/// The processes the router keeps, for its counters.
#[derive(Debug, Clone, Copy)]
struct Counts {
    processes: u64,
    /// Of them, how many are in each layer of the sandbox (in `Layer::ALL`'s order).
    sandboxed: [u64; Layer::ALL.len()],
    started: u64,
    restarts: u64,
    deferred: u64,
}

/// What makes one reply of the replies of every process.
type Merge = fn(Vec<Reply>, Counts) -> Reply;

/// The first refusal among `replies`, if any (a list is whole or refused).
fn refusal(replies: &[Reply]) -> Option<Reply> {
    replies.iter().find_map(|r| match &r.message {
        Message::Data(DataMessage::Error { code, message }) => Some(Reply::error(*code, message.clone())),
        _ => None,
    })
}

/// Every process's counters summed, with the router's own.
fn sum_counters(replies: Vec<Reply>, own: Counts) -> Reply {
    let mut counters: BTreeMap<String, u64> = [
        ("executor_processes".to_owned(), own.processes),
        ("executor_processes_started".to_owned(), own.started),
        ("executor_process_restarts".to_owned(), own.restarts),
        ("executor_process_starts_deferred".to_owned(), own.deferred),
    ]
    .into_iter()
    .collect();
    for (count, layer) in own.sandboxed.into_iter().zip(Layer::ALL) {
        counters.insert(format!("executor_sandbox_{}", layer.name().replace('-', "_")), count);
    }
    for reply in replies {
        if let Message::Data(DataMessage::StatsReply { counters: theirs }) = reply.message {
            for (name, value) in theirs {
                *counters.entry(name).or_default() += value;
            }
        }
    }
    Reply::message(DataMessage::StatsReply { counters: counters.into_iter().collect() })
}

/// Every process's models, a public model held by several tenants (each in its own process)
/// listed once with all of them as its owners.
fn merge_models(replies: Vec<Reply>, _: Counts) -> Reply {
    if let Some(refused) = refusal(&replies) {
        return refused;
    }
    let mut models: BTreeMap<djinn_proto::Fingerprint, ModelInfo> = BTreeMap::new();
    for reply in replies {
        if let Message::Model(ModelMessage::ModelList { models: theirs }) = reply.message {
            for model in theirs {
                match models.get_mut(&model.fingerprint) {
                    Some(seen) => {
                        seen.executions += model.executions;
                        seen.owners.extend(model.owners);
                        seen.owners.sort();
                        seen.owners.dedup();
                    }
                    None => {
                        models.insert(model.fingerprint, model);
                    }
                }
            }
        }
    }
    Reply::message(ModelMessage::ModelList { models: models.into_values().collect() })
}

/// The first page of every process's sessions after the same id, merged in id order (the
/// processes' id ranges do not overlap) and cut to one page.
fn merge_sessions(replies: Vec<Reply>, _: Counts) -> Reply {
    if let Some(refused) = refusal(&replies) {
        return refused;
    }
    let mut sessions: Vec<SessionEntry> = Vec::new();
    let mut more = false;
    for reply in replies {
        if let Message::Session(SessionMessage::SessionList { sessions: theirs, more: theirs_more }) = reply.message {
            sessions.extend(theirs);
            more |= theirs_more;
        }
    }
    sessions.sort_by_key(|s| s.session.id);
    more |= sessions.len() > LIST_PAGE;
    sessions.truncate(LIST_PAGE);
    Reply::message(SessionMessage::SessionList { sessions, more })
}

impl Executor for TenantExecutors {
    fn run(&mut self, job: Job, to: ReplyTo, replier: &Replier) {
        if let Some((what, handle)) = named(&job)
            && self.went_with_its_process(handle)
        {
            let why = format!("{what} {handle} was held by an executor process that has ended, and went with it");
            return replier.executed(to, Reply::error(ErrorCode::ExecutorLost, why));
        }
        let mut kept_load: Option<(Fingerprint, Arc<KeptArchives>)> = None;
        match job {
            Job::Stats => return self.gather(|| Job::Stats, to, replier, sum_counters),
            Job::ListModels { all: Some(names) } => {
                let job = move || Job::ListModels { all: Some(names.clone()) };
                return self.gather(job, to, replier, merge_models);
            }
            Job::ListSessions { all: Some(names), after } => {
                let job = move || Job::ListSessions { all: Some(names.clone()), after };
                return self.gather(job, to, replier, merge_sessions);
            }
            Job::Load { ref upload } => match KeptArchives::charged(upload, to.tenant, &self.host_budget) {
                Ok(kept) => kept_load = Some((upload.archives.fingerprint(), Arc::new(kept))),
                Err(e) => {
                    let code = if e.tenant.is_some() { ErrorCode::QuotaExceeded } else { ErrorCode::OverBudget };
                    let why = format!(
                        "the node keeps a copy of each model's archives to load it again in a new executor \
                         process, and cannot keep this one: {e}"
                    );
                    return replier.executed(to, Reply::error(code, why));
                }
            },
            Job::Unregister { fingerprint } => {
                if let Some(kept) = self.archives.get_mut(&to.tenant) {
                    kept.remove(&fingerprint);
                }
            }
            _ => {}
        }
        if let Err(why) = self.process(to) {
            let why = format!("the tenant has no executor process: {why}");
            return replier.executed(to, Reply::error(ErrorCode::ExecutorLost, why));
        }
        // Recorded once its process is there (a new one loads the models recorded before), and
        // copied as that process's link thread sends it.
        let before = kept_load.map(|(fingerprint, kept)| {
            self.archives.entry(to.tenant).or_default().insert(fingerprint, Arc::clone(&kept));
            Box::new(move |load: &Job| kept.copy(load)) as BeforeSend
        });
        if let Some((process, _)) = self.live.get_mut(&to.tenant) {
            process.run_with(job, to, replier, before);
        }
    }

    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn free_kept(&mut self, ids: &[u64]) {
        self.free(ids, ProcessExecutor::free_kept);
    }

    fn free_parked(&mut self, ids: &[u64]) {
        self.free(ids, ProcessExecutor::free_parked);
    }

    fn free_sessions(&mut self, ids: &[u64]) {
        self.free(ids, ProcessExecutor::free_sessions);
    }
}
