//! A node draining itself (`djinn drain NODE`). The control plane marks the node and places
//! nothing new on it; the membership agent learns of the mark at a renewal and hands it here.
//! A round then moves every session the node holds to the node the control plane places it on
//! (weighing the state's move), as the session's tenant: the model goes there first when that
//! node lacks it, read back from this node and registered there; then that node grants the
//! session and this node moves it, node to node, after the session's earlier requests. Later
//! requests for the session here are answered with where it went, which clients follow. Kept
//! tensors go to the open node with the most free memory, pushed node to node, and their
//! handles here are forwarded to the copies (requests naming them are told where they went).
//! What cannot move now (a session whose step is parked at a breakpoint, no room anywhere) is
//! tried again next round, while running requests finish; the control plane reports when the
//! node holds nothing.
//!
//! The drain asks this node in process and speaks the data plane to its peers, with the node's
//! own token, acting for each tenant (the right a node's role has); it shares no state with the
//! poller.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use djinn_client::{
    BlockEstimate, Client, ClientOptions, ControlClient, ControlError, Fingerprint, Forward, Handle, HandleInfo,
    ModelDescription, Moving, PlaceOptions, SessionEntry, Transport,
};
use djinn_dataplane::tcp::ClientTls;

use crate::own_node::OwnNode;

/// How often a drain looks again for what is left.
const ROUND: Duration = Duration::from_secs(1);

/// Bytes of a model's archives read from this node and sent to the other at a time.
const MODEL_CHUNK: u64 = 8 << 20;

/// The drain's thread: told by the membership agent whether the node is draining.
#[derive(Debug)]
pub struct Drainer {
    draining: mpsc::Sender<bool>,
    thread: JoinHandle<()>,
    unrecorded: Arc<AtomicU64>,
}

/// What a drain needs to know of its node.
pub struct DrainConfig {
    pub control: ControlClient,
    /// The node's name at the control plane.
    pub name: String,
    pub token: String,
    /// This node, asked in process.
    pub node: OwnNode,
    /// Where other nodes reach it (the address the control plane knows it by).
    pub advertised: String,
    /// Roots for the peers' TLS, where they serve it.
    pub peer_tls: Option<ClientTls>,
}

impl std::fmt::Debug for DrainConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainConfig")
            .field("control", &self.control.url())
            .field("name", &self.name)
            .field("advertised", &self.advertised)
            .finish_non_exhaustive()
    }
}

impl Drainer {
    pub fn start(config: DrainConfig) -> Result<Self> {
        let (draining, told) = mpsc::channel();
        let unrecorded = Arc::new(AtomicU64::new(0));
        let drain = Drain::new(config, Arc::clone(&unrecorded));
        let thread = std::thread::Builder::new().name("djinn-drain".into()).spawn(move || drain.run(&told))?;
        Ok(Self { draining, thread, unrecorded })
    }

    /// Moves begun whose destination the control plane has not recorded yet: the node is not
    /// drained until they are (a client that comes once it is gone asks the control plane).
    pub fn unrecorded(&self) -> u64 {
        self.unrecorded.load(Ordering::Acquire)
    }

    /// Whether the control plane says the node is draining (at every renewal).
    pub fn set(&self, draining: bool) {
        let _ = self.draining.send(draining);
    }

    pub fn stop(self) {
        drop(self.draining);
        let _ = self.thread.join();
    }
}

struct Drain {
    config: DrainConfig,
    /// Connections acting for a tenant (by name), to peers, by address.
    conns: HashMap<(String, String), Client>,
    /// The models (by tenant and fingerprint) this drain has seen to elsewhere.
    models_placed: HashSet<(String, Fingerprint)>,
    /// Where moved sessions and tensors went, for the control plane (sent after each round,
    /// kept until it took them).
    forwards: Vec<Forward>,
    /// Moves begun and not recorded at the control plane yet (see [`Drainer::unrecorded`]).
    unrecorded: Arc<AtomicU64>,
}

impl Drain {
    fn new(config: DrainConfig, unrecorded: Arc<AtomicU64>) -> Self {
        Self { config, conns: HashMap::new(), models_placed: HashSet::new(), forwards: Vec::new(), unrecorded }
    }

    fn run(mut self, told: &mpsc::Receiver<bool>) {
        let mut draining = false;
        let mut next_round = Instant::now();
        loop {
            // Renewals come more often than rounds: a round waits its time, not a quiet spell.
            match told.recv_timeout(next_round.saturating_duration_since(Instant::now())) {
                Ok(now) => {
                    if now != draining {
                        tracing::info!(draining = now, "the control plane says whether the node is draining");
                        // A drain starts at once; it goes on at the pace of rounds.
                        next_round = Instant::now();
                    }
                    draining = now;
                    continue;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            next_round = Instant::now() + ROUND;
            if !draining {
                self.conns.clear();
                self.models_placed.clear();
                continue;
            }
            match self.round() {
                Ok((0, _)) => {}
                Ok((found, moved)) => tracing::info!(found, moved, "drain: sessions and kept tensors moved this round"),
                Err(e) => tracing::warn!(error = %format!("{e:#}"), "drain round failed; trying again"),
            }
            self.send_forwards();
        }
    }

    /// Moves every session and kept tensor it can: how many were here, and how many moved.
    fn round(&mut self) -> Result<(usize, usize)> {
        let sessions = self.config.node.list_sessions().context("listing this node's sessions")?;
        let mut moved = 0;
        for entry in &sessions {
            // Counted before the session leaves the node: no renewal sees it nowhere.
            self.unrecorded.fetch_add(1, Ordering::AcqRel);
            match self.move_session(entry) {
                Ok((to, there)) => {
                    moved += 1;
                    tracing::info!(session = %entry.session, tenant = %entry.tenant, %to, "drain: session moved");
                    self.forwards.push(forward("session", &entry.tenant, entry.session, to, there));
                }
                Err(e) => {
                    self.unrecorded.fetch_sub(1, Ordering::AcqRel);
                    self.not_moved("session", &entry.session, &entry.tenant, &e);
                }
            }
        }
        let kept = self.config.node.list_kept().context("listing this node's kept tensors")?;
        if kept.is_empty() {
            if sessions.is_empty() {
                self.place_models()?;
            }
            return Ok((sessions.len(), moved));
        }
        let mut nodes = self.config.control.nodes()?;
        nodes.retain(|n| !n.draining && n.addr != self.config.advertised);
        for entry in &kept {
            let bytes = entry.kept.tensor.byte_len;
            // Where there is the most room: a tensor has no model to follow.
            let Some(to) = nodes.iter_mut().filter(|n| n.memory_free >= bytes).max_by_key(|n| n.memory_free) else {
                let e = anyhow!("no other node has {bytes} bytes free");
                self.not_moved("kept tensor", &entry.kept.handle, &entry.tenant, &e);
                continue;
            };
            to.memory_free -= bytes;
            let to = to.addr.clone();
            self.unrecorded.fetch_add(1, Ordering::AcqRel);
            match self.move_kept(&entry.tenant, &entry.kept, &to) {
                Ok(there) => {
                    moved += 1;
                    tracing::info!(handle = %entry.kept.handle, tenant = %entry.tenant, %to, "drain: kept tensor moved");
                    self.forwards.push(forward("kept", &entry.tenant, entry.kept.handle, to, there));
                }
                Err(e) => {
                    self.unrecorded.fetch_sub(1, Ordering::AcqRel);
                    self.not_moved("kept tensor", &entry.kept.handle, &entry.tenant, &e);
                }
            }
        }
        Ok((sessions.len() + kept.len(), moved))
    }

    /// Sees each model the node holds to where the control plane places it now (the model
    /// sent there, node to node, unless it holds it), once the node holds nothing else: the
    /// clients that run it here find it there when this node is gone.
    fn place_models(&mut self) -> Result<()> {
        let models = self.config.node.list_models("").context("listing this node's models")?;
        for model in models {
            // Listed with their holders' names, for a node; one holder, unnamed, without tokens.
            let owners = if model.owners.is_empty() { vec![String::new()] } else { model.owners.clone() };
            for tenant in owners {
                let key = (tenant, model.fingerprint);
                if self.models_placed.contains(&key) {
                    continue;
                }
                let placed = self
                    .place(&key.0, &model.fingerprint, None)
                    .and_then(|to| self.copy_model(&key.0, &model.fingerprint, &to));
                match placed {
                    Ok(()) => _ = self.models_placed.insert(key),
                    Err(e) => {
                        tracing::info!(model = %model.fingerprint, tenant = %key.0, error = %format!("{e:#}"), "drain: model not placed elsewhere yet")
                    }
                }
            }
        }
        Ok(())
    }

    fn not_moved(&mut self, what: &str, handle: &Handle, tenant: &str, e: &anyhow::Error) {
        tracing::info!(%handle, %tenant, error = %format!("{e:#}"), "drain: {what} not moved yet");
        // A connection that failed is opened again next time.
        self.conns.retain(|_, c| c.is_usable());
    }

    /// Pushes a kept tensor to the node at `to` and forwards its handle here to the copy; the
    /// copy's handle there.
    fn move_kept(&mut self, tenant: &str, kept: &HandleInfo, to: &str) -> Result<Handle> {
        let grant = self.conn(to, tenant)?.grant_push(&kept.tensor).context("a grant for the tensor")?;
        let node = &self.config.node;
        let copy = node.push(tenant, kept.handle, to, &grant).context("the push")?;
        node.forward(tenant, kept.handle, to, &copy).context("forwarding the handle")?;
        Ok(copy.handle)
    }

    /// Tells the control plane where what moved went, so that clients that come after this
    /// node is gone find it; what it does not take now goes with the next round.
    fn send_forwards(&mut self) {
        if self.forwards.is_empty() {
            return;
        }
        while !self.forwards.is_empty() {
            let chunk = &self.forwards[..self.forwards.len().min(1024)];
            let recorded = match self.config.control.put_forwards(&self.config.name, chunk) {
                Ok(()) => chunk.len(),
                // Refused for good (a destination that left since the move): each is sent alone
                // and the refused ones dropped, or the drain would wait on them for ever.
                Err(e) if refused_for_good(&e) => {
                    tracing::warn!(error = %e, "the control plane refused forwards: sending them one at a time");
                    let control = &self.config.control;
                    let stopped = chunk.iter().position(|forward| {
                        match control.put_forwards(&self.config.name, std::slice::from_ref(forward)) {
                            Ok(()) => false,
                            Err(e) if refused_for_good(&e) => {
                                tracing::warn!(error = %e, ?forward, "a forward the control plane refuses: dropped");
                                false
                            }
                            Err(_) => true,
                        }
                    });
                    stopped.unwrap_or(chunk.len())
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot tell the control plane where moved sessions and tensors went");
                    0
                }
            };
            let whole = recorded == chunk.len();
            self.forwards.drain(..recorded);
            self.unrecorded.fetch_sub(recorded as u64, Ordering::AcqRel);
            if !whole {
                return;
            }
        }
    }

    /// Moves one session to where the control plane places it; that node's address and the
    /// session's handle there.
    fn move_session(&mut self, entry: &SessionEntry) -> Result<(String, Handle)> {
        let tenant = entry.tenant.as_str();
        let to = self.place(tenant, &entry.fingerprint, Some(entry.state_bytes))?;
        self.copy_model(tenant, &entry.fingerprint, &to)?;
        let grant = self.conn(&to, tenant)?.grant_session(&entry.fingerprint).context("a grant for the session")?;
        self.config.node.session_move(tenant, entry.session, &to, &grant).context("the move")
    }

    /// Where the control plane would have the session or the model go (it leaves draining
    /// nodes out); a model it was never told of is described from what this node knows of it.
    /// With `state_bytes`, for a session of that state; else for the model's calls.
    fn place(&mut self, tenant: &str, fingerprint: &Fingerprint, state_bytes: Option<u64>) -> Result<String> {
        let advertised = self.config.advertised.clone();
        let moving = state_bytes.map(|state_bytes| Moving { from: &advertised, state_bytes, calls: 1 });
        let options = PlaceOptions { moving, tenant: Some(tenant), ..PlaceOptions::default() };
        let placed = match self.config.control.place_with(fingerprint, &options) {
            Err(e) if e.kind() == Some("unknown_model") => {
                let models = self.config.node.list_models(tenant)?;
                let model = models.iter().find(|m| m.fingerprint == *fingerprint).ok_or_else(|| anyhow!("no model"))?;
                let per_block = model.weight_bytes / u64::from(model.blocks.max(1));
                let description = ModelDescription {
                    blocks: vec![BlockEstimate { weight_bytes: per_block, flops: 0.0 }; model.blocks.max(1) as usize],
                    io_bytes: 0,
                    phase: None,
                    graph: None,
                };
                self.config.control.describe_model_of(Some(tenant), fingerprint, &description)?;
                self.config.control.place_with(fingerprint, &options)?
            }
            placed => placed?,
        };
        if placed.addr == self.config.advertised {
            return Err(anyhow!("the control plane placed the session on this node, which it is draining"));
        }
        Ok(placed.addr)
    }

    /// Registers the model at `to` from this node's copy, unless it holds it already.
    fn copy_model(&mut self, tenant: &str, fingerprint: &Fingerprint, to: &str) -> Result<()> {
        let node = self.config.node.clone();
        let (lens, public, _) = node.read_archives(tenant, fingerprint, 0, 0).context("the model here")?;
        let read = |offset, len| node.read_archives(tenant, fingerprint, offset, len).map(|(_, _, chunk)| chunk);
        let copied = self
            .conn(to, tenant)?
            .register_streamed(*fingerprint, &lens, public, MODEL_CHUNK, read)
            .context("registering the model there")?;
        if let Some(model) = copied.uploaded {
            tracing::info!(model = %model.fingerprint, %to, bytes = lens.iter().sum::<u64>(), "drain: model sent");
        }
        Ok(())
    }

    /// The connection to the peer at `addr` acting for `tenant`, opened if need be.
    fn conn(&mut self, addr: &str, tenant: &str) -> Result<&mut Client> {
        let key = (addr.to_owned(), tenant.to_owned());
        if !self.conns.contains_key(&key) {
            let client = self.open(addr, tenant)?;
            self.conns.insert(key.clone(), client);
        }
        self.conns.get_mut(&key).ok_or_else(|| anyhow!("no connection"))
    }

    fn open(&self, addr: &str, tenant: &str) -> Result<Client> {
        let options = ClientOptions {
            transport: Transport::Tcp,
            token: self.config.token.clone(),
            tenant: tenant.to_owned(),
            timeout: Some(Duration::from_secs(60)),
            tls: self.config.peer_tls.clone(),
            pool_bytes: 64 << 20,
            ..ClientOptions::default()
        };
        Client::connect_with(addr, options).with_context(|| format!("connecting to {addr} for {tenant:?}"))
    }
}

/// Where the `kind` under `handle` here went: the node at `to`, as `there`.
fn forward(kind: &str, tenant: &str, handle: Handle, to: String, there: Handle) -> Forward {
    Forward {
        kind: kind.into(),
        tenant: tenant.into(),
        id: handle.id,
        epoch: handle.epoch,
        to,
        to_id: there.id,
        to_epoch: there.epoch,
    }
}

/// A refusal the control plane will repeat (not a moment's unavailability or load).
fn refused_for_good(e: &ControlError) -> bool {
    matches!(e, ControlError::Refused { status, .. } if (400..500).contains(status) && !matches!(status, 408 | 429))
}
