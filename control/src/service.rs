//! The control plane over a metadata store: registration and renewal of nodes, the models
//! clients describe, placement. What must survive the process or be shared with other control
//! processes is written to the store first; the [`Cluster`] that decisions read is rebuilt
//! from the store's watch, so every control process on one store decides from the same state.
//! A write returns once this process's view has caught up with it (read your writes).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use djinn_sync::Locked;

use crate::cluster::{Cluster, Decision, PlaceError, PlaceRequest, Rule};
use crate::membership::{Inventory, LeaseId, Member, MembershipError, NodeId};
use crate::placement::{Block, Demand, Phase, Policy, SessionMove};
use crate::store::{Created, Event, Revision, Snapshot, Store, StoreError};

#[derive(Debug, Clone)]
pub struct ControlConfig {
    /// How long a node's lease lasts without a renewal.
    pub lease_ttl: Duration,
    /// Every key of this control plane starts with it (several clusters can share one etcd).
    pub prefix: String,
    /// Model records one tenant may keep (each is a durable write); one namespace counts as a
    /// tenant where there are no tokens.
    pub max_models_per_tenant: usize,
    /// Sessions one tenant may have placed at once (records that live as long as their node).
    pub max_sessions_per_tenant: usize,
    /// A model record that no live node's inventory has listed for this long is deleted: the
    /// descriptions of models gone from the cluster do not pile up in the store.
    pub model_record_ttl: Duration,
    /// How long the control plane says where a drained node's sessions and kept tensors went
    /// (for clients that ask after the node is gone).
    pub forward_ttl: Duration,
}

impl Default for ControlConfig {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(3),
            prefix: "/djinn/".into(),
            max_models_per_tenant: 4096,
            max_sessions_per_tenant: 16384,
            model_record_ttl: Duration::from_secs(600),
            forward_ttl: Duration::from_secs(3600),
        }
    }
}

/// What a client tells the control plane about a model, once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelRecord {
    pub blocks: Vec<Block>,
    /// Bytes of one call's inputs and outputs.
    #[serde(default)]
    pub io_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// For a graph captured by the Python package: its semantic graph's annotations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub graph: Option<GraphAnnotations>,
}

/// What a captured graph's semantic graph says of it, as the client found it by pattern
/// recognition: kept with the model's record and shown by `GET /v1/models/{fingerprint}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GraphAnnotations {
    pub phase: GraphPhase,
    pub modality: Modality,
    pub operations: u64,
    /// Attention blocks recognised.
    pub attention: u64,
    pub flops: f64,
    /// Bytes of the graph's inputs by residency.
    pub weight_bytes: u64,
    pub kv_cache_bytes: u64,
    pub activation_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GraphPhase {
    Prefill,
    Decode,
    Vision,
    Forward,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Modality {
    Text,
    Vision,
    Multimodal,
    Tensor,
}

/// A request for a place to run a described model.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Placement {
    pub fingerprint: String,
    #[serde(default)]
    pub session: Option<String>,
    #[serde(default)]
    pub policy: Policy,
    /// The phase of the calls to place, where it differs from the model's description (a
    /// session's prefill, then its decode).
    #[serde(default)]
    pub phase: Option<Phase>,
    /// A session that would move to the chosen node: its move's cost is part of the decision.
    #[serde(default)]
    pub moving: Option<MovingSession>,
}

/// A session on the node at `from` (its address), with `state_bytes` of state, whose move would
/// be paid over `calls` calls (1 by default).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MovingSession {
    pub from: String,
    pub state_bytes: u64,
    #[serde(default)]
    pub calls: Option<u32>,
}

/// Where a session or a kept tensor of a drained node went: the node at `to`, as the handle
/// `id`/`epoch` there; whose it is (`tenant`, empty without tokens).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Forward {
    pub kind: ForwardKind,
    pub tenant: String,
    /// Its handle on the drained node.
    pub id: u64,
    pub epoch: u64,
    pub to: String,
    pub to_id: u64,
    pub to_epoch: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ForwardKind {
    Session,
    Kept,
}

impl ForwardKind {
    fn name(self) -> &'static str {
        match self {
            Self::Session => "session",
            Self::Kept => "kept",
        }
    }
}

/// The answer to a renewal: whether the node is being drained (it moves what it holds to
/// other nodes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Renewed {
    pub draining: bool,
}

/// Where a drain of a node is: what the node still holds, as its last renewal said.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainStatus {
    pub node: NodeId,
    pub draining: bool,
    pub sessions: u64,
    pub kept: u64,
    pub parked: u64,
    /// Requests queued or running.
    pub requests: u64,
    /// Sessions the control plane has placed there (by key).
    pub placed_sessions: u64,
    /// It holds nothing (no session, kept tensor, parked or running request), and the control
    /// plane knows where everything that moved went.
    pub drained: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registered {
    pub lease: LeaseId,
    pub ttl_ms: u64,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ControlError {
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error(transparent)]
    Membership(#[from] MembershipError),
    #[error("no model {0} is described: PUT /v1/models/{0} first")]
    UnknownModel(String),
    #[error(transparent)]
    Place(#[from] PlaceError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the chosen node {0:?} left while the placement was recorded: ask again")]
    NodeLeft(NodeId),
    #[error("{0}")]
    QuotaExceeded(String),
    #[error("no session {0:?} is placed (it was never placed, or its node left)")]
    UnknownSession(String),
    #[error("no live node serves at {0}")]
    UnknownAddress(String),
    #[error("no forward is known for the {0}")]
    UnknownForward(String),
    /// A model record over [`MAX_RECORD_BLOCKS`] blocks or [`MAX_RECORD_BYTES`] bytes.
    #[error("{0}")]
    TooLarge(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("a forward's destination {0:?} is no other live node's address")]
    UnknownDestination(String),
}

/// The most blocks a model record describes (a model cut at every layer of a deep transformer
/// has a hundred or two).
pub const MAX_RECORD_BLOCKS: usize = 512;
/// The longest body a model record is sent in: [`MAX_RECORD_BLOCKS`] blocks of the largest
/// numbers and a graph's annotations fit (about 37 KiB), and a tenant's records at its cap
/// are bounded by it (4,096 records of 64 KiB).
pub const MAX_RECORD_BYTES: usize = 64 << 10;

/// Counters for /metrics.
#[derive(Debug, Default)]
pub struct ControlCounters {
    /// Registrations asked for, admitted or not.
    pub registration_requests: AtomicU64,
    pub registrations: AtomicU64,
    pub renewals: AtomicU64,
    pub placements: [AtomicU64; 4],
    pub placement_errors: AtomicU64,
    pub placement_ns: AtomicU64,
    /// Model records deleted because no node held them for `model_record_ttl`.
    pub records_expired: AtomicU64,
    /// Nodes whose lease lapsed: gone from this process's view without having left.
    pub leases_lapsed: AtomicU64,
}

/// One node in [`ClusterStatus`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeStatus {
    pub name: NodeId,
    pub lease: LeaseId,
    pub inventory: Inventory,
    /// Device memory promised to models its inventory does not show yet.
    pub promised_bytes: u64,
    /// Being drained: nothing new is placed there.
    #[serde(default)]
    pub draining: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelStatus {
    pub fingerprint: String,
    pub blocks: usize,
    pub weight_bytes: u64,
    /// Live nodes holding it or given it.
    pub nodes: Vec<NodeId>,
}

/// What `djinn status` prints.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterStatus {
    pub revision: Revision,
    pub nodes: Vec<NodeStatus>,
    pub models: Vec<ModelStatus>,
    pub sessions: Vec<(String, NodeId)>,
}

#[derive(Debug)]
struct State {
    cluster: Cluster,
    models: HashMap<String, ModelRecord>,
    /// Since when (this process's clock, ms) each record no live node holds has been so; a
    /// record written again starts afresh.
    unheld_since: HashMap<String, u64>,
    /// Nodes that said they leave (through any control process): their records' going is no
    /// lapse.
    leaving: HashSet<NodeId>,
}

impl State {
    fn new(cluster: Cluster) -> Self {
        Self { cluster, models: HashMap::new(), unheld_since: HashMap::new(), leaving: HashSet::new() }
    }
}

#[derive(Debug)]
pub struct ControlPlane<S> {
    store: S,
    config: ControlConfig,
    state: Mutex<State>,
    /// The last revision applied to `state`.
    applied: watch::Sender<Revision>,
    started: Instant,
    pub counters: ControlCounters,
}

const NODES: &str = "nodes/";
const GIVEN: &str = "given/";
const SESSIONS: &str = "sessions/";
const MODELS: &str = "models/";
const DRAINING: &str = "draining/";
/// A node leaving on purpose, marked under its lease just before the lease is revoked.
const LEAVING: &str = "leaving/";
const FORWARDS: &str = "forwards/";
/// `registrants/{node}/{lease}`: the node principal that registered the node under that lease
/// (with the lease: it goes with the node).
const REGISTRANTS: &str = "registrants/";

/// A node's name: it is part of URLs and store keys.
fn check_node_name(name: &str) -> Result<(), ControlError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ControlError::BadRequest(format!("{name:?} is not a node name: 1 to 128 of A-Z a-z 0-9 . _ : -")))
    }
}

/// A model's key: its fingerprint, 64 hex digits (BLAKE3), returned in lower case; under a
/// token file, prefixed with the name of the tenant whose record it is (`alice/…`).
fn check_fingerprint(key: &str) -> Result<String, ControlError> {
    let (tenant, fingerprint) = match key.split_once('/') {
        Some((tenant, fingerprint)) => (Some(tenant), fingerprint),
        None => (None, key),
    };
    let tenant_ok = tenant.is_none_or(|t| !t.is_empty() && !t.chars().any(char::is_control));
    if tenant_ok && fingerprint.len() == 64 && fingerprint.bytes().all(|b| b.is_ascii_hexdigit()) {
        let fingerprint = fingerprint.to_ascii_lowercase();
        Ok(tenant.map_or_else(|| fingerprint.clone(), |t| format!("{t}/{fingerprint}")))
    } else {
        Err(ControlError::BadRequest(format!("{key:?} is not a model fingerprint: 64 hex digits")))
    }
}

fn check_session(session: &str) -> Result<(), ControlError> {
    if session.is_empty() || session.len() > 256 || session.chars().any(char::is_control) {
        return Err(ControlError::BadRequest("a session id is 1 to 256 printable characters".into()));
    }
    Ok(())
}

fn check_model(record: &ModelRecord) -> Result<(), ControlError> {
    if record.blocks.is_empty() {
        return Err(ControlError::Place(PlaceError::NoBlocks));
    }
    if record.blocks.len() > MAX_RECORD_BLOCKS {
        return Err(ControlError::TooLarge(format!(
            "a model record of {} blocks: at most {MAX_RECORD_BLOCKS}",
            record.blocks.len()
        )));
    }
    if record.blocks.iter().any(|b| !b.flops.is_finite() || b.flops < 0.0) {
        return Err(ControlError::BadRequest("a block's flops must be a finite number ≥ 0".into()));
    }
    if record.blocks.iter().try_fold(0u64, |sum, b| sum.checked_add(b.weight_bytes)).is_none() {
        return Err(ControlError::BadRequest("the blocks' weight bytes overflow".into()));
    }
    if record.graph.as_ref().is_some_and(|g| !g.flops.is_finite() || g.flops < 0.0) {
        return Err(ControlError::BadRequest("a graph's flops must be a finite number ≥ 0".into()));
    }
    Ok(())
}

/// The tenant a scoped key (`alice/…`) belongs to; `""` for the one namespace without tokens.
/// A model's fingerprint has no '/', so its key's first '/' ends the tenant's name; a session's
/// key is scoped with the same name as the model it is placed with.
fn tenant_of(scoped_fingerprint: &str) -> &str {
    scoped_fingerprint.split_once('/').map_or("", |(tenant, _)| tenant)
}

/// How many of `keys` are `tenant`'s: those scoped with its name. For `""` (no tokens, or an
/// operator), the unscoped ones: model keys without a '/'; every session key, as session ids may
/// hold a '/' (so an operator's sessions are counted with every tenant's).
fn count_of<'a>(keys: impl Iterator<Item = &'a String>, tenant: &str, ids_hold_slashes: bool) -> usize {
    match tenant {
        "" if ids_hold_slashes => keys.count(),
        "" => keys.filter(|k| !k.contains('/')).count(),
        _ => keys.filter(|k| k.strip_prefix(tenant).is_some_and(|rest| rest.starts_with('/'))).count(),
    }
}

/// A forward's key below `forwards/`: the drained node's address, the kind, the handle.
fn forward_key(from: &str, kind: ForwardKind, epoch: u64, id: u64) -> String {
    format!("{from}/{}/{epoch:016x}/{id}", kind.name())
}

/// The most forwards one request records: what a draining node sends at once.
const MAX_FORWARDS_AT_ONCE: usize = 1024;

/// How often, at least and at most, expired model records are looked for.
const MIN_SWEEP: Duration = Duration::from_millis(100);
const MAX_SWEEP: Duration = Duration::from_secs(30);

fn json<T: Serialize>(value: &T) -> Vec<u8> {
    // Our own plain data: serialising it cannot fail.
    serde_json::to_vec(value).unwrap_or_default()
}

impl<S: Store> ControlPlane<S> {
    /// Loads the state from the store and follows its changes.
    pub async fn start(store: S, config: ControlConfig) -> Result<Arc<Self>, StoreError> {
        let (snapshot, events) = store.watch(&config.prefix).await?;
        let control = Arc::new(Self {
            store,
            state: Mutex::new(State::new(Cluster::new(0))),
            config,
            applied: watch::channel(0).0,
            started: Instant::now(),
            counters: ControlCounters::default(),
        });
        control.load(snapshot);
        tokio::spawn(Self::follow(Arc::downgrade(&control), events));
        tokio::spawn(Self::expire_records(Arc::downgrade(&control)));
        Ok(control)
    }

    /// Deletes the model records no live node has held for `model_record_ttl`, looking a few
    /// times per period, until the control plane is dropped.
    async fn expire_records(control: std::sync::Weak<Self>) {
        loop {
            let Some(every) = control.upgrade().map(|c| (c.config.model_record_ttl / 4).clamp(MIN_SWEEP, MAX_SWEEP))
            else {
                return;
            };
            tokio::time::sleep(every).await;
            let Some(this) = control.upgrade() else { return };
            if let Err(e) = this.expire_unheld_records().await {
                tracing::warn!(error = %e, "cannot delete expired model records");
            }
        }
    }

    /// Deletes the model records that no live node's inventory has listed for
    /// `model_record_ttl`; returns how many.
    pub async fn expire_unheld_records(&self) -> Result<usize, ControlError> {
        let ttl = self.config.model_record_ttl.as_millis() as u64;
        let expired: Vec<String> = {
            let now = self.now_ms();
            let mut state = self.state();
            let State { cluster, models, unheld_since, .. } = &mut *state;
            unheld_since.retain(|fingerprint, _| models.contains_key(fingerprint));
            models
                .keys()
                .filter(|fingerprint| {
                    if cluster.in_inventory(fingerprint) {
                        unheld_since.remove(*fingerprint);
                        return false;
                    }
                    let since = *unheld_since.entry((*fingerprint).clone()).or_insert(now);
                    now.saturating_sub(since) >= ttl
                })
                .cloned()
                .collect()
        };
        for fingerprint in &expired {
            self.store.delete(&self.key(MODELS, fingerprint)).await?;
            self.counters.records_expired.fetch_add(1, Ordering::Relaxed);
            tracing::info!(model = %fingerprint, "model record expired: no node has held it");
        }
        Ok(expired.len())
    }

    /// Replaces the state with a snapshot's (what this process promised goes with it).
    fn load(&self, snapshot: Snapshot) {
        let mut state = self.state();
        *state = State::new(Cluster::new(self.lease_ttl_ms()));
        for (key, value) in snapshot.entries {
            self.apply(&mut state, Event::Put { key, value });
        }
        drop(state);
        self.applied.send_modify(|r| *r = (*r).max(snapshot.revision));
    }

    /// Applies the store's changes until the control plane is dropped; starts again from a
    /// new snapshot if the watch fails.
    async fn follow(control: std::sync::Weak<Self>, mut events: crate::store::Watch) {
        loop {
            let Some(event) = events.recv().await else { return };
            let Some(this) = control.upgrade() else { return };
            match event {
                Ok((revision, event)) => {
                    let mut state = this.state();
                    this.apply(&mut state, event);
                    drop(state);
                    this.applied.send_if_modified(|r| {
                        let newer = revision > *r;
                        *r = (*r).max(revision);
                        newer
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the store's watch failed: reloading");
                    loop {
                        match this.store.watch(&this.config.prefix).await {
                            Ok((snapshot, watch)) => {
                                this.load(snapshot);
                                events = watch;
                                break;
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "cannot reload from the store; retrying");
                                tokio::time::sleep(Duration::from_millis(500)).await;
                            }
                        }
                    }
                }
            }
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.locked()
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn key(&self, kind: &str, rest: &str) -> String {
        format!("{}{kind}{rest}", self.config.prefix)
    }

    /// One change from the store. A record this version cannot read is logged and skipped.
    fn apply(&self, state: &mut State, event: Event) {
        let (key, value) = match &event {
            Event::Put { key, value } => (key.as_str(), Some(value.as_slice())),
            Event::Delete { key } => (key.as_str(), None),
        };
        let Some(key) = key.strip_prefix(self.config.prefix.as_str()) else { return };
        let unreadable = |e: &dyn std::fmt::Display| tracing::warn!(key, error = %e, "unreadable record skipped");
        if let Some(node) = key.strip_prefix(NODES) {
            match value.map(serde_json::from_slice::<Member>) {
                Some(Ok(member)) => state.cluster.join(node, member, self.now_ms()),
                Some(Err(e)) => unreadable(&e),
                None => {
                    let was_live = state.cluster.membership().get(node).is_some();
                    if !state.leaving.remove(node) && was_live {
                        self.counters.leases_lapsed.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(node, "node's lease lapsed");
                    }
                    state.cluster.leave(node);
                }
            }
        } else if let Some(node) = key.strip_prefix(LEAVING) {
            // The mark goes with the lease, in the same change as the node's record (in either
            // order): it is forgotten once the record goes.
            if value.is_some() {
                state.leaving.insert(node.to_owned());
            }
        } else if let Some(given) = key.strip_prefix(GIVEN) {
            // Given records go with their node's lease, and the node's own record with them.
            // A node's name has no '/'; a tenant's model key has one.
            if let (Some((fingerprint, node)), Some(_)) = (given.rsplit_once('/'), value) {
                state.cluster.give(fingerprint, node);
            }
        } else if let Some(session) = key.strip_prefix(SESSIONS) {
            match value.map(std::str::from_utf8) {
                Some(Ok(node)) => state.cluster.set_session(session, node),
                Some(Err(e)) => unreadable(&e),
                None => state.cluster.end_session(session),
            }
        } else if let Some(node) = key.strip_prefix(DRAINING) {
            state.cluster.set_draining(node, value.is_some());
        } else if let Some(fingerprint) = key.strip_prefix(MODELS) {
            match value.map(serde_json::from_slice::<ModelRecord>) {
                Some(Ok(record)) => {
                    state.models.insert(fingerprint.to_owned(), record);
                    state.unheld_since.remove(fingerprint);
                }
                Some(Err(e)) => unreadable(&e),
                None => {
                    state.models.remove(fingerprint);
                    state.unheld_since.remove(fingerprint);
                }
            }
        }
    }

    /// Waits until this process's view includes `revision`.
    async fn caught_up(&self, revision: Revision) -> Result<(), ControlError> {
        let mut applied = self.applied.subscribe();
        let wait = applied.wait_for(|&r| r >= revision);
        match tokio::time::timeout(Duration::from_secs(10), wait).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(StoreError::Backend(format!("the store's watch has not delivered revision {revision}")).into()),
        }
    }

    pub fn lease_ttl_ms(&self) -> u64 {
        self.config.lease_ttl.as_millis() as u64
    }

    /// Admits a node with a new lease. A name whose lease is live is refused. `registrant`:
    /// the node principal that asks (not an operator, nor everyone without tokens), the one
    /// that may then write the node's forwards.
    pub async fn register(
        &self,
        name: &str,
        inventory: Inventory,
        registrant: Option<&str>,
    ) -> Result<Registered, ControlError> {
        self.counters.registration_requests.fetch_add(1, Ordering::Relaxed);
        check_node_name(name)?;
        let ttl_ms = self.lease_ttl_ms();
        let lease = self.store.grant(ttl_ms).await?;
        // Under the new lease before the node's record: revoked with it if the name is taken.
        if let Some(registrant) = registrant {
            let key = self.key(REGISTRANTS, &format!("{name}/{lease}"));
            self.store.put(&key, registrant.as_bytes().to_vec(), Some(lease)).await?;
        }
        let record = json(&Member { inventory, lease });
        match self.store.create(&self.key(NODES, name), record, Some(lease)).await? {
            Created::Created(revision) => {
                self.caught_up(revision).await?;
                self.counters.registrations.fetch_add(1, Ordering::Relaxed);
                tracing::info!(node = name, lease, "node registered");
                Ok(Registered { lease, ttl_ms })
            }
            Created::Exists(_) => {
                self.store.revoke(lease).await?;
                Err(MembershipError::AlreadyRegistered(name.to_owned()).into())
            }
        }
    }

    /// The node's record in the store (not this process's view: another control process may
    /// have admitted it a moment ago).
    async fn current(&self, name: &str) -> Result<Member, ControlError> {
        check_node_name(name)?;
        let unknown = || ControlError::Membership(MembershipError::UnknownNode(name.to_owned()));
        let stored = self.store.get(&self.key(NODES, name)).await?.ok_or_else(unknown)?;
        serde_json::from_slice(&stored).map_err(|e| StoreError::Backend(format!("node {name:?}'s record: {e}")).into())
    }

    fn check_lease(name: &str, current: &Member, lease: LeaseId) -> Result<(), ControlError> {
        if current.lease != lease {
            return Err(
                MembershipError::StaleLease { node: name.to_owned(), given: lease, current: current.lease }.into()
            );
        }
        Ok(())
    }

    /// Extends a node's lease and, if given, replaces its inventory; says whether the node is
    /// being drained.
    pub async fn renew(
        &self,
        name: &str,
        lease: LeaseId,
        inventory: Option<Inventory>,
    ) -> Result<Renewed, ControlError> {
        let current = self.current(name).await?;
        Self::check_lease(name, &current, lease)?;
        let lapsed = |e| match e {
            StoreError::LeaseNotFound(_) => ControlError::Membership(MembershipError::UnknownNode(name.to_owned())),
            e => e.into(),
        };
        self.store.keep_alive(lease).await.map_err(lapsed)?;
        if let Some(inventory) = inventory.filter(|i| *i != current.inventory) {
            let revision = self
                .store
                .put(&self.key(NODES, name), json(&Member { inventory, lease }), Some(lease))
                .await
                .map_err(lapsed)?;
            self.caught_up(revision).await?;
        }
        self.counters.renewals.fetch_add(1, Ordering::Relaxed);
        Ok(Renewed { draining: self.state().cluster.is_draining(name) })
    }

    /// Starts draining node `name` (or, with `draining` false, stops): nothing new is placed
    /// there, and the node, told so at its next renewal, moves its sessions, kept tensors and
    /// models to other nodes. The mark goes with the node's lease.
    pub async fn drain(&self, name: &str, draining: bool) -> Result<DrainStatus, ControlError> {
        let current = self.current(name).await?;
        let key = self.key(DRAINING, name);
        let left = |e| match e {
            StoreError::LeaseNotFound(_) => ControlError::Membership(MembershipError::UnknownNode(name.to_owned())),
            e => e.into(),
        };
        let revision = match draining {
            true => self.store.put(&key, Vec::new(), Some(current.lease)).await.map_err(left)?,
            false => self.store.delete(&key).await?,
        };
        self.caught_up(revision).await?;
        tracing::info!(node = name, draining, "drain");
        self.drain_status(name)
    }

    /// Records where node `name`'s sessions and kept tensors went (it is draining): for
    /// `forward_ttl`, clients that find the node gone ask [`Self::forward`]. `by`: the node
    /// principal that asks (`None`: an operator), which must be the one that registered the
    /// node (or, for a node registered otherwise, be named as it). Each forward goes to
    /// another live node.
    pub async fn put_forwards(&self, name: &str, by: Option<&str>, forwards: Vec<Forward>) -> Result<(), ControlError> {
        let current = self.current(name).await?;
        if let Some(by) = by {
            let key = self.key(REGISTRANTS, &format!("{name}/{}", current.lease));
            let registrant = self.store.get(&key).await?;
            let is_the_node = registrant.map_or(by == name, |r| r == by.as_bytes());
            if !is_the_node {
                return Err(ControlError::Forbidden(format!("{by} may not write node {name}'s forwards")));
            }
        }
        let from = current.inventory.addr;
        if forwards.len() > MAX_FORWARDS_AT_ONCE {
            return Err(ControlError::BadRequest(format!(
                "{} forwards at once; at most {MAX_FORWARDS_AT_ONCE}",
                forwards.len()
            )));
        }
        if forwards.iter().any(|f| f.to.len() > 256 || f.tenant.len() > 256) {
            return Err(ControlError::BadRequest("a forward's address or tenant is over 256 bytes".into()));
        }
        if forwards.is_empty() {
            return Ok(());
        }
        {
            let state = self.state();
            let live = |to: &str| to != from && state.cluster.membership().live().any(|(_, n)| n.inventory.addr == to);
            if let Some(forward) = forwards.iter().find(|f| !live(&f.to)) {
                return Err(ControlError::UnknownDestination(forward.to.clone()));
            }
        }
        let lease = self.store.grant(self.config.forward_ttl.as_millis() as u64).await?;
        for forward in forwards {
            let key = self.key(FORWARDS, &forward_key(&from, forward.kind, forward.epoch, forward.id));
            self.store.put(&key, json(&forward), Some(lease)).await?;
        }
        Ok(())
    }

    /// Where the `kind` under handle `id`/`epoch` at the node that served at `from` went, if
    /// `tenant` (`None`: a node or an operator, any tenant's) is whose it is.
    pub async fn forward(
        &self,
        from: &str,
        kind: ForwardKind,
        epoch: u64,
        id: u64,
        tenant: Option<&str>,
    ) -> Result<Forward, ControlError> {
        let unknown = || ControlError::UnknownForward(format!("{} {id}@{epoch:016x} of {from}", kind.name()));
        let key = self.key(FORWARDS, &forward_key(from, kind, epoch, id));
        let stored = self.store.get(&key).await?.ok_or_else(unknown)?;
        let forward: Forward =
            serde_json::from_slice(&stored).map_err(|e| StoreError::Backend(format!("a forward's record: {e}")))?;
        if tenant.is_some_and(|t| t != forward.tenant) {
            return Err(unknown());
        }
        Ok(forward)
    }

    /// What node `name` still holds, as its last renewal said.
    pub fn drain_status(&self, name: &str) -> Result<DrainStatus, ControlError> {
        check_node_name(name)?;
        let state = self.state();
        let member = state
            .cluster
            .membership()
            .get(name)
            .ok_or_else(|| ControlError::Membership(MembershipError::UnknownNode(name.to_owned())))?;
        let i = &member.inventory;
        let requests = u64::from(i.queue_depth);
        Ok(DrainStatus {
            node: name.to_owned(),
            draining: state.cluster.is_draining(name),
            sessions: i.sessions,
            kept: i.kept,
            parked: i.parked,
            requests,
            placed_sessions: state.cluster.sessions().values().filter(|n| *n == name).count() as u64,
            drained: i.sessions == 0 && i.kept == 0 && i.parked == 0 && requests == 0 && i.unrecorded == 0,
        })
    }

    /// A node leaving on purpose: its lease ends now.
    pub async fn leave(&self, name: &str, lease: LeaseId) -> Result<(), ControlError> {
        let current = self.current(name).await?;
        Self::check_lease(name, &current, lease)?;
        // Every control process sees the mark before the record goes: a leave, not a lapse.
        match self.store.put(&self.key(LEAVING, name), Vec::new(), Some(lease)).await {
            // The lease lapsed a moment ago: there is nothing left to end.
            Err(StoreError::LeaseNotFound(_)) => return Ok(()),
            marked => marked?,
        };
        self.store.revoke(lease).await?;
        tracing::info!(node = name, "node left");
        Ok(())
    }

    pub async fn describe_model(&self, fingerprint: &str, record: ModelRecord) -> Result<(), ControlError> {
        let fingerprint = check_fingerprint(fingerprint)?;
        check_model(&record)?;
        {
            let state = self.state();
            // Described again while no node holds it: written again all the same, so that
            // every control process starts its time to expiry afresh.
            let held = state.cluster.in_inventory(&fingerprint);
            match state.models.get(&fingerprint) {
                Some(known) if *known == record && held => return Ok(()),
                Some(_) => {}
                None => {
                    let cap = self.config.max_models_per_tenant;
                    if count_of(state.models.keys(), tenant_of(&fingerprint), false) >= cap {
                        return Err(ControlError::QuotaExceeded(format!(
                            "{cap} model records are described already: the most one tenant keeps"
                        )));
                    }
                }
            }
        }
        let revision = self.store.put(&self.key(MODELS, &fingerprint), json(&record), None).await?;
        self.caught_up(revision).await
    }

    pub fn model(&self, fingerprint: &str) -> Result<ModelRecord, ControlError> {
        let fingerprint = check_fingerprint(fingerprint)?;
        self.state().models.get(&fingerprint).cloned().ok_or(ControlError::UnknownModel(fingerprint))
    }

    /// Chooses a node for a described model, records it (the model as given to the node, the
    /// session as living there) and explains it.
    pub async fn place(&self, placement: Placement) -> Result<Decision, ControlError> {
        let started = Instant::now();
        let result = self.place_recorded(placement).await;
        self.counters.placement_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        match &result {
            Ok(d) => self.counters.placements[d.rule as usize].fetch_add(1, Ordering::Relaxed),
            Err(_) => self.counters.placement_errors.fetch_add(1, Ordering::Relaxed),
        };
        result
    }

    async fn place_recorded(&self, placement: Placement) -> Result<Decision, ControlError> {
        let fingerprint = check_fingerprint(&placement.fingerprint)?;
        if let Some(session) = &placement.session {
            check_session(session)?;
        }
        let record = self.model(&fingerprint)?;
        let moving = match placement.moving {
            Some(_) if placement.session.is_some() => {
                return Err(ControlError::BadRequest("a moving session is placed without a session id".into()));
            }
            Some(m) => {
                let state = self.state();
                let from = state.cluster.membership().live().find(|(_, n)| n.inventory.addr == m.from);
                let from = from.map(|(name, _)| name.clone()).ok_or(ControlError::UnknownAddress(m.from))?;
                Some(SessionMove { from, state_bytes: m.state_bytes, calls: m.calls.unwrap_or(1).max(1) })
            }
            None => None,
        };
        let request = PlaceRequest {
            fingerprint,
            blocks: record.blocks,
            io_bytes: record.io_bytes,
            phase: placement.phase.or(record.phase),
            session: placement.session,
            policy: placement.policy,
            moving,
        };
        let (decision, lease, holds) = {
            let mut state = self.state();
            if let Some(session) = &request.session
                && !state.cluster.sessions().contains_key(session)
            {
                let cap = self.config.max_sessions_per_tenant;
                if count_of(state.cluster.sessions().keys(), tenant_of(&request.fingerprint), true) >= cap {
                    return Err(ControlError::QuotaExceeded(format!(
                        "{cap} sessions are placed already: the most one tenant has at once"
                    )));
                }
            }
            state.cluster.expire_promises(self.now_ms());
            let decision = state.cluster.decide(&request)?;
            let lease = state.cluster.membership().get(&decision.node).map_or(0, |m| m.lease);
            let holds = state.cluster.holds(&request.fingerprint, &decision.node);
            (decision, lease, holds)
        };
        let left = |e| match e {
            StoreError::LeaseNotFound(_) => ControlError::NodeLeft(decision.node.clone()),
            e => e.into(),
        };
        let mut revision = 0;
        if let Some(session) = request.session.as_ref().filter(|_| decision.rule != Rule::Session) {
            let key = self.key(SESSIONS, session);
            match self.store.create(&key, decision.node.as_bytes().to_vec(), Some(lease)).await.map_err(left)? {
                Created::Created(r) => revision = r,
                // Placed a moment ago through another control process: that placement stands.
                Created::Exists(node) => {
                    let node = String::from_utf8_lossy(&node).into_owned();
                    let mut applied = self.applied.subscribe();
                    let seen = applied.wait_for(|_| self.state().cluster.sessions().get(session) == Some(&node));
                    let _ = tokio::time::timeout(Duration::from_secs(10), seen).await;
                    let decision = self.state().cluster.decide(&request)?;
                    return Ok(decision);
                }
            }
        }
        if !holds {
            // Promised before the record is written: once it is, the watch may apply it (the
            // node holds the model) before this continues.
            let weight_bytes = Demand::of(&request.blocks, request.io_bytes, request.phase).weight_bytes;
            self.state().cluster.promise(&decision, &request.fingerprint, weight_bytes, self.now_ms());
            let key = self.key(GIVEN, &format!("{}/{}", request.fingerprint, decision.node));
            revision = self.store.put(&key, Vec::new(), Some(lease)).await.map_err(left)?;
        }
        self.caught_up(revision).await?;
        tracing::debug!(node = %decision.node, rule = ?decision.rule, model = %request.fingerprint, "placed");
        Ok(decision)
    }

    /// A placed session now lives on the node that serves at `addr` (it moved there, node to
    /// node): its later placements go there. Its record takes that node's lease, and goes with
    /// that node. The node's name.
    pub async fn move_session(&self, session: &str, addr: &str) -> Result<NodeId, ControlError> {
        check_session(session)?;
        let (node, lease) = {
            let state = self.state();
            if !state.cluster.sessions().contains_key(session) {
                return Err(ControlError::UnknownSession(session.to_owned()));
            }
            let (node, member) = state
                .cluster
                .membership()
                .live()
                .find(|(_, m)| m.inventory.addr == addr)
                .ok_or_else(|| ControlError::UnknownAddress(addr.to_owned()))?;
            (node.clone(), member.lease)
        };
        let key = self.key(SESSIONS, session);
        let left = |e| match e {
            StoreError::LeaseNotFound(_) => ControlError::NodeLeft(node.clone()),
            e => e.into(),
        };
        let revision = self.store.put(&key, node.as_bytes().to_vec(), Some(lease)).await.map_err(left)?;
        self.caught_up(revision).await?;
        tracing::debug!(%session, %node, "session moved");
        Ok(node)
    }

    pub fn status(&self) -> ClusterStatus {
        let mut state = self.state();
        state.cluster.expire_promises(self.now_ms());
        let cluster = &state.cluster;
        let mut nodes: Vec<NodeStatus> = cluster
            .membership()
            .live()
            .map(|(name, m)| NodeStatus {
                name: name.clone(),
                lease: m.lease,
                inventory: m.inventory.clone(),
                promised_bytes: cluster.promised_bytes(name),
                draining: cluster.is_draining(name),
            })
            .collect();
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        let mut models: Vec<ModelStatus> = state
            .models
            .iter()
            .map(|(fingerprint, record)| ModelStatus {
                fingerprint: fingerprint.clone(),
                blocks: record.blocks.len(),
                weight_bytes: record.blocks.iter().map(|b| b.weight_bytes).sum(),
                nodes: cluster.holders(fingerprint),
            })
            .collect();
        models.sort_by(|a, b| a.fingerprint.cmp(&b.fingerprint));
        let mut sessions: Vec<(String, NodeId)> =
            cluster.sessions().iter().map(|(s, n)| (s.clone(), n.clone())).collect();
        sessions.sort();
        ClusterStatus { revision: *self.applied.borrow(), nodes, models, sessions }
    }
}
