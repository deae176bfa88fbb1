//! A client of a whole cluster: asks the control plane where each model (and each session)
//! runs, connects there, and keeps what it needs to survive the node's death.
//!
//! It keeps every model's archives, so that a node that lost a model (it restarted, evicted
//! it, or is the new node after a failover) gets it again; and it caches each placement until
//! the node fails. When a node fails, the placement is asked for again (the control plane
//! stops choosing the node once its lease lapses) and the request is replayed there. Only
//! idempotent requests go through here: registration (by fingerprint), execution of a
//! registered model (a function of its inputs), unregistration.
//!
//! With a node's address instead of a control plane, every model goes to that node; a lost
//! model is registered again, and a lost connection is opened again once.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use djinn_dataplane::rdma::Registrations;
use djinn_proto::{Breakpoint, ErrorCode, Fingerprint, Handle, HandleInfo, Signal, TensorSource, Value};

use crate::control::{BlockEstimate, ControlClient, ControlError, ModelDescription, Moving, PlaceOptions, Placed};
use crate::{
    Client, ClientError, ClientOptions, ClientStats, Output, Paused, Registration, Resumed, Tensor, TensorRef,
};

/// A block's TorchScript archive, shared with whoever else holds it (the Python package
/// passes its `bytes` objects).
#[derive(Clone)]
pub struct Archive(pub Arc<dyn AsRef<[u8]> + Send + Sync>);

impl AsRef<[u8]> for Archive {
    fn as_ref(&self) -> &[u8] {
        (*self.0).as_ref()
    }
}

impl std::fmt::Debug for Archive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Archive({} bytes)", self.as_ref().len())
    }
}

impl From<Vec<u8>> for Archive {
    fn from(bytes: Vec<u8>) -> Self {
        Self(Arc::new(bytes))
    }
}

/// A tensor kept on a node: the node's address (as this client reaches it) and its handle
/// there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteTensor {
    pub node: String,
    pub info: HandleInfo,
}

/// A session open on a node: the node's address (as this client reaches it), the session's
/// handle there, and its model. Its state lives on that node alone; when the session moves,
/// these follow it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteSession {
    pub node: String,
    pub session: Handle,
    pub fingerprint: Fingerprint,
    /// The id the control plane placed it by, when it was opened with one: its record moves
    /// with it.
    pub key: Option<String>,
}

/// How many moves one request follows before it gives up (a session moved on and on).
const MAX_FOLLOWED_MOVES: usize = 8;

/// How long the control plane's list of live nodes is trusted without asking again, and how
/// soon after asking it is asked again (an address not in it: a node that just joined).
const LISTED_NODES_TRUSTED_FOR: Duration = Duration::from_secs(30);
const LISTED_NODES_REFRESH: Duration = Duration::from_millis(500);

/// The addresses of the live nodes, as the control plane last listed them.
#[derive(Debug, Default)]
struct ListedNodes {
    addrs: HashSet<String>,
    asked: Option<Instant>,
}

/// A request parked at a breakpoint on a node: the node's address and the request's handle
/// there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteParked {
    pub node: String,
    pub parked: Handle,
}

/// Where models run.
#[derive(Debug, Clone)]
pub enum Target {
    /// One node alone, by its data-plane address.
    Node(String),
    /// Wherever this control plane places them.
    Control(ControlClient),
}

/// How long to keep looking for a live node.
#[derive(Debug, Clone, Copy)]
pub struct FailoverOptions {
    /// Longest time one request spends failing over before it gives up. Give it more than the
    /// control plane's lease TTL: a dead node is chosen until its lease lapses.
    pub deadline: Duration,
    /// First pause between attempts; it doubles up to a second.
    pub first_retry: Duration,
}

impl Default for FailoverOptions {
    fn default() -> Self {
        Self { deadline: Duration::from_secs(30), first_retry: Duration::from_millis(50) }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClusterStats {
    /// Placements asked of the control plane (cache misses).
    pub placements: u64,
    /// Connection failures that sent this client back to the control plane.
    pub node_failures: u64,
    /// Models sent again to a node that did not hold them.
    pub reregistrations: u64,
    /// Requests sent again after a failure.
    pub replays: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Node(#[from] ClientError),
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("no node served model {fingerprint} within {waited:?}; the last failure: {last}")]
    Unavailable { fingerprint: String, waited: Duration, last: String },
    #[error("this client is connected to a control plane, not to one node: ask the control plane for the cluster")]
    NotOneNode,
    #[error("this client is connected to one node, not to a control plane: it places nothing")]
    NoControlPlane,
    /// A node (or a forward) sent this client to an address it does not trust: none of the
    /// live nodes the control plane lists, or any address at all for a client given one node.
    /// Nothing was sent there.
    #[error("not following a node to {to}: {why}")]
    UntrustedAddress { to: String, why: String },
    #[error(
        "the node at {node}, which holds the kept tensors or the session's state, cannot be reached ({source}): they are lost with it"
    )]
    HandleLost {
        node: String,
        #[source]
        source: ClientError,
    },
}

#[derive(Debug)]
struct Kept {
    archives: Vec<Archive>,
    description: ModelDescription,
    policy: Option<String>,
    public: bool,
}

#[derive(Debug)]
pub struct ClusterClient {
    target: Target,
    options: ClientOptions,
    failover: FailoverOptions,
    /// Connections by node address.
    nodes: HashMap<String, Client>,
    models: HashMap<Fingerprint, Kept>,
    placed: HashMap<(Fingerprint, Option<String>), Placed>,
    /// Where kept tensors went that this client followed (their node was drained), by where
    /// they were: later requests go there at once, also once the old node is gone.
    moved_tensors: HashMap<(String, Handle), (String, Handle)>,
    /// Where moves and forwards may send this client (with a control plane).
    listed: ListedNodes,
    stats: ClusterStats,
}

/// The connection or the node is gone (as opposed to the node refusing the request).
fn is_node_failure(e: &ClientError) -> bool {
    matches!(e, ClientError::Io { .. } | ClientError::Closed { .. } | ClientError::Rdma { .. })
}

impl ClusterClient {
    /// Connects to `address`: a control plane when it is a URL (`http://HOST:PORT`) or a list
    /// of them (control processes that share a store, separated by commas), else a node; a bare
    /// `HOST:PORT` that turns out to serve HTTP is taken as a control plane.
    pub fn open(address: &str, options: ClientOptions, failover: FailoverOptions) -> Result<Self, ClusterError> {
        let timeout = options.timeout.unwrap_or(Duration::from_secs(60));
        let target = if address.contains("://") || address.contains(',') {
            let control = ControlClient::new(address, timeout).with_token(&options.token);
            control.whoami()?;
            Target::Control(control)
        } else {
            match Client::connect_with(address, options_for(&options, address)) {
                Ok(node) => {
                    let mut this = Self::new(Target::Node(address.to_owned()), options, failover);
                    this.nodes.insert(address.to_owned(), node);
                    return Ok(this);
                }
                // An HTTP server answers a hello with an HTTP error, or hangs up.
                Err(e @ (ClientError::Protocol { .. } | ClientError::Closed { .. })) => {
                    let control = ControlClient::new(address, timeout).with_token(&options.token);
                    control.whoami().map_err(|_| e)?;
                    Target::Control(control)
                }
                Err(e) => return Err(e.into()),
            }
        };
        Ok(Self::new(target, options, failover))
    }

    fn new(target: Target, options: ClientOptions, failover: FailoverOptions) -> Self {
        Self {
            target,
            options,
            failover,
            nodes: HashMap::new(),
            models: HashMap::new(),
            placed: HashMap::new(),
            moved_tensors: HashMap::new(),
            listed: ListedNodes::default(),
            stats: ClusterStats::default(),
        }
    }

    pub fn target(&self) -> &Target {
        &self.target
    }

    pub fn control(&self) -> Option<&ControlClient> {
        match &self.target {
            Target::Control(control) => Some(control),
            Target::Node(_) => None,
        }
    }

    /// The node this client is connected to, when it was given one alone.
    pub fn node(&mut self) -> Result<&mut Client, ClusterError> {
        let Target::Node(addr) = &self.target else {
            return Err(ClusterError::NotOneNode);
        };
        let addr = addr.clone();
        Ok(self.connection(&addr)?)
    }

    /// The cached placement of a model (and session), if it was placed.
    pub fn placement(&self, fingerprint: &Fingerprint, session: Option<&str>) -> Option<&Placed> {
        self.placed.get(&(*fingerprint, session.map(str::to_owned)))
    }

    /// This client's failover counts, and the sum of its connections' counts and bytes.
    pub fn stats(&self) -> (ClusterStats, ClientStats, u64, u64) {
        let mut total = (ClientStats::default(), 0, 0);
        for node in self.nodes.values() {
            let (s, sent, received) = node.client_stats();
            total.0.requests += s.requests;
            total.0.errors += s.errors;
            total.0.reconnects += s.reconnects;
            total.1 += sent;
            total.2 += received;
        }
        (self.stats, total.0, total.1, total.2)
    }

    /// The transports of the open connections (`tcp`, `rdma`), without repeats.
    pub fn transports(&self) -> Vec<&'static str> {
        let mut all: Vec<_> = self.nodes.values().map(Client::transport).collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    /// The connected nodes' [`Client::rdma_registrations`], summed.
    pub fn rdma_registrations(&self) -> Registrations {
        let mut sum = Registrations::default();
        for r in self.nodes.values().map(Client::rdma_registrations) {
            sum.made += r.made;
            sum.reused += r.reused;
        }
        sum
    }

    /// How the connected nodes' device memory meets the network (`staging`), without repeats.
    pub fn memory_paths(&self) -> Vec<&str> {
        let mut all: Vec<_> = self.nodes.values().map(|n| n.node().memory_path.as_str()).collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    fn connection(&mut self, addr: &str) -> Result<&mut Client, ClientError> {
        if !self.nodes.contains_key(addr) {
            let client = Client::connect_with(addr, options_for(&self.options, addr))?;
            self.nodes.insert(addr.to_owned(), client);
        }
        Ok(self.nodes.get_mut(addr).expect("inserted above"))
    }

    /// Checks that a move or a forward may send this client (and its token) to `to`: a live
    /// node the control plane lists (asked again when `to` is not in the list as last asked,
    /// a node may have joined since). A client given one node follows nothing. A node could
    /// otherwise send the client anywhere, to collect its token or to serve it forged bytes.
    fn check_listed(&mut self, to: &str) -> Result<(), ClusterError> {
        let untrusted = |why: &str| ClusterError::UntrustedAddress { to: to.to_owned(), why: why.to_owned() };
        let control = match &self.target {
            Target::Node(_) => {
                return Err(untrusted(
                    "this client was given one node's address, not a control plane: it follows no node elsewhere",
                ));
            }
            Target::Control(control) => control,
        };
        let asked = self.listed.asked.map(|at| at.elapsed());
        if asked.is_some_and(|ago| ago < LISTED_NODES_TRUSTED_FOR) && self.listed.addrs.contains(to) {
            return Ok(());
        }
        // At most one list every LISTED_NODES_REFRESH, however often nodes send this client
        // elsewhere.
        if let Some(ago) = asked.filter(|ago| *ago < LISTED_NODES_REFRESH) {
            std::thread::sleep(LISTED_NODES_REFRESH - ago);
        }
        let addrs = control.live_nodes()?;
        self.listed = ListedNodes { addrs: addrs.into_iter().collect(), asked: Some(Instant::now()) };
        if self.listed.addrs.contains(to) {
            Ok(())
        } else {
            Err(untrusted("no live node of the cluster has that address (the control plane's GET /v1/nodes)"))
        }
    }

    /// Drops the connection to a failed node and every placement on it.
    fn forget(&mut self, addr: &str) {
        self.nodes.remove(addr);
        self.placed.retain(|_, p| p.addr != addr);
        self.stats.node_failures += 1;
    }

    /// The address to send a model's requests to: the node given, or the cached placement,
    /// or a new one.
    fn address_for(&mut self, fingerprint: &Fingerprint, session: Option<&str>) -> Result<String, ControlError> {
        let control = match &self.target {
            Target::Node(addr) => return Ok(addr.clone()),
            Target::Control(control) => control,
        };
        let key = (*fingerprint, session.map(str::to_owned));
        if let Some(placed) = self.placed.get(&key) {
            return Ok(placed.addr.clone());
        }
        let kept = self.models.get(fingerprint);
        let policy = kept.and_then(|k| k.policy.as_deref());
        let placed = match (control.place(fingerprint, session, policy), kept) {
            // The control plane has no description (another cluster state, or it was lost):
            // this client has one.
            (Err(e), Some(kept)) if e.kind() == Some("unknown_model") => {
                control.describe_model(fingerprint, &kept.description)?;
                control.place(fingerprint, session, policy)?
            }
            (placed, _) => placed?,
        };
        tracing::debug!(node = %placed.node, rule = %placed.rule, model = %fingerprint, "placed");
        self.stats.placements += 1;
        let addr = placed.addr.clone();
        self.placed.insert(key, placed);
        Ok(addr)
    }

    /// Sends the kept archives of a model to the node at `addr`.
    fn register_on(&mut self, addr: &str, fingerprint: &Fingerprint) -> Result<(), ClientError> {
        let Some((archives, public)) = self.models.get(fingerprint).map(|k| (k.archives.clone(), k.public)) else {
            return Ok(());
        };
        let started = Instant::now();
        self.connection(addr)?.register_model_as(*fingerprint, &archives, public, |_, _| {})?;
        self.stats.reregistrations += 1;
        tracing::info!(model = %fingerprint, node = addr, took = ?started.elapsed(), "model registered again");
        Ok(())
    }

    /// Runs `op` on the node that serves the model, failing over to another node (and
    /// registering the model there from the kept archives) until it succeeds, fails for a
    /// reason of its own, or the failover deadline passes.
    fn on_node<T>(
        &mut self,
        fingerprint: &Fingerprint,
        session: Option<&str>,
        mut op: impl FnMut(&mut Client) -> Result<T, ClientError>,
    ) -> Result<(T, String), ClusterError> {
        let started = Instant::now();
        let mut pause = self.failover.first_retry;
        let mut registered_again = false;
        let fails_over = matches!(self.target, Target::Control(_));
        loop {
            let failure = match self.address_for(fingerprint, session) {
                Err(e) if fails_over && e.is_transient() => e.to_string(),
                Err(e) => return Err(e.into()),
                Ok(addr) => match self.connection(&addr).and_then(&mut op) {
                    Ok(value) => return Ok((value, addr)),
                    Err(e)
                        if e.remote_code() == Some(ErrorCode::UnknownModel)
                            && !registered_again
                            && self.models.contains_key(fingerprint) =>
                    {
                        registered_again = true;
                        match self.register_on(&addr, fingerprint) {
                            Ok(()) => {
                                self.stats.replays += 1;
                                continue;
                            }
                            Err(e) if fails_over && is_node_failure(&e) => {
                                self.forget(&addr);
                                e.to_string()
                            }
                            Err(e) => return Err(e.into()),
                        }
                    }
                    Err(e) if fails_over && is_node_failure(&e) => {
                        tracing::warn!(node = %addr, error = %e, "node failed: asking the control plane again");
                        self.forget(&addr);
                        e.to_string()
                    }
                    Err(e) => return Err(e.into()),
                },
            };
            if started.elapsed() + pause > self.failover.deadline {
                return Err(ClusterError::Unavailable {
                    fingerprint: fingerprint.to_hex(),
                    waited: started.elapsed(),
                    last: failure,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_secs(1));
            self.stats.replays += 1;
            // A node that is new to the model gets it from the kept archives.
            registered_again = false;
        }
    }

    /// Registers a model (its blocks' archives, in execution order): describes it to the
    /// control plane (when there is one), places it and uploads it there unless the node holds
    /// it. `description` defaults to the archives' sizes with no FLOPs; `policy` (the control
    /// plane's names) applies to this model's placements. The archives are kept for failover.
    /// `public` weights are held once per node for every tenant that registers them as public;
    /// else the model is this tenant's alone.
    pub fn register_model(
        &mut self,
        archives: Vec<Archive>,
        description: Option<ModelDescription>,
        policy: Option<String>,
        public: bool,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<Registration, ClusterError> {
        let fingerprint = Fingerprint::of_blocks(&archives);
        let description = description.unwrap_or_else(|| ModelDescription {
            blocks: archives
                .iter()
                .map(|a| BlockEstimate { weight_bytes: a.as_ref().len() as u64, flops: 0.0 })
                .collect(),
            io_bytes: 0,
            phase: None,
            graph: None,
        });
        if let Target::Control(control) = &self.target {
            control.describe_model(&fingerprint, &description)?;
        }
        let kept = Kept { archives: archives.clone(), description, policy, public };
        let earlier = self.models.insert(fingerprint, kept);
        if earlier.is_some() {
            // Described again, perhaps with another policy: place again on the next call.
            self.placed.retain(|(fp, _), _| *fp != fingerprint);
        }
        let registered = self
            .on_node(&fingerprint, None, |node| node.register_model_as(fingerprint, &archives, public, &mut progress))
            .map(|(registration, _)| registration);
        if registered.is_err() {
            // The caller has no model to call: keep what was kept before, or nothing.
            match earlier {
                Some(earlier) => self.models.insert(fingerprint, earlier),
                None => self.models.remove(&fingerprint),
            };
        }
        registered
    }

    /// Runs a registered model on the node that serves it (or, with `session`, on the node
    /// the session lives on).
    pub fn execute(
        &mut self,
        fingerprint: &Fingerprint,
        session: Option<&str>,
        inputs: &[Value],
        tensors: &[TensorRef<'_>],
    ) -> Result<Output, ClusterError> {
        self.on_node(fingerprint, session, |node| node.execute(fingerprint, inputs, tensors)).map(|(output, _)| output)
    }

    /// [`Self::execute`] with the output tensors kept on the node; returns the node's address
    /// with the output.
    pub fn execute_keep(
        &mut self,
        fingerprint: &Fingerprint,
        session: Option<&str>,
        inputs: &[Value],
        tensors: &[TensorRef<'_>],
    ) -> Result<(Output, String), ClusterError> {
        self.on_node(fingerprint, session, |node| node.execute_keep(fingerprint, inputs, tensors))
    }

    /// Runs a model on the node at `node`, where the kept tensors among `inputs` are: the data
    /// does not move, the model goes there (from the kept archives) if the node lacks it. No
    /// failover: when that node is gone, so are its tensors.
    pub fn execute_at(
        &mut self,
        node: &str,
        fingerprint: &Fingerprint,
        inputs: &[Value],
        tensors: &[TensorRef<'_>],
        keep: bool,
    ) -> Result<Output, ClusterError> {
        self.run_at(node, fingerprint, |client| {
            if keep {
                client.execute_keep(fingerprint, inputs, tensors)
            } else {
                client.execute(fingerprint, inputs, tensors)
            }
        })
    }

    /// Runs `op`, a call of a model, on the node at `node`, registering the model there again
    /// (from the kept archives) when the node lacks it.
    fn run_at<T>(
        &mut self,
        node: &str,
        fingerprint: &Fingerprint,
        mut op: impl FnMut(&mut Client) -> Result<T, ClientError>,
    ) -> Result<T, ClusterError> {
        match self.at_node(node, &mut op) {
            Err(ClusterError::Node(e))
                if e.remote_code() == Some(ErrorCode::UnknownModel) && self.models.contains_key(fingerprint) =>
            {
                self.register_on(node, fingerprint).map_err(|source| self.lost(node, source))?;
                self.stats.replays += 1;
                self.at_node(node, op)
            }
            other => other,
        }
    }

    /// Runs a model up to a breakpoint, where the model is placed (or at `at`, the node of the
    /// kept tensors among `inputs`); the request stays parked on that node, whose address is
    /// returned with it.
    pub fn execute_until(
        &mut self,
        fingerprint: &Fingerprint,
        at: Option<&str>,
        inputs: &[Value],
        tensors: &[TensorRef<'_>],
        keep: bool,
        until: Breakpoint,
    ) -> Result<(Paused, String), ClusterError> {
        let run = |client: &mut Client| client.execute_until(fingerprint, inputs, tensors, keep, until);
        match at {
            Some(node) => self.run_at(node, fingerprint, run).map(|paused| (paused, node.to_owned())),
            None => self.on_node(fingerprint, None, run),
        }
    }

    /// Runs a parked request on, on its node (see [`Client::resume`]).
    pub fn resume(
        &mut self,
        parked: &RemoteParked,
        activation: Option<(&Value, &[TensorRef<'_>])>,
        until: Option<Breakpoint>,
    ) -> Result<Resumed, ClusterError> {
        self.at_node(&parked.node, |client| client.resume(parked.parked, activation, until))
    }

    /// A parked request's activation.
    pub fn inspect(&mut self, parked: &RemoteParked) -> Result<Paused, ClusterError> {
        self.at_node(&parked.node, |client| client.inspect(parked.parked))
    }

    /// Drops a parked request.
    pub fn abort(&mut self, parked: &RemoteParked) -> Result<(), ClusterError> {
        self.at_node(&parked.node, |client| client.abort(parked.parked))
    }

    /// Runs `op` on the node at `node`, which holds kept tensors: a connection failure there
    /// means they are lost.
    fn at_node<T>(
        &mut self,
        node: &str,
        op: impl FnOnce(&mut Client) -> Result<T, ClientError>,
    ) -> Result<T, ClusterError> {
        self.connection(node).and_then(op).map_err(|e| self.lost(node, e))
    }

    fn lost(&mut self, node: &str, e: ClientError) -> ClusterError {
        if !is_node_failure(&e) {
            return e.into();
        }
        if matches!(self.target, Target::Control(_)) {
            self.forget(node);
        }
        ClusterError::HandleLost { node: node.to_owned(), source: e }
    }

    /// The node a call without a model goes to: `node`, or the one node this client has.
    fn node_or_own(&self, node: Option<&str>) -> Result<String, ClusterError> {
        match (node, &self.target) {
            (Some(node), _) => Ok(node.to_owned()),
            (None, Target::Node(addr)) => Ok(addr.clone()),
            (None, Target::Control(_)) => Err(ClusterError::NotOneNode),
        }
    }

    /// Uploads a tensor to be kept on `node` (by default the node this client has).
    pub fn keep(&mut self, node: Option<&str>, tensor: TensorRef<'_>) -> Result<RemoteTensor, ClusterError> {
        let node = self.node_or_own(node)?;
        let info = self.at_node(&node, |client| client.keep(tensor))?;
        Ok(RemoteTensor { node, info })
    }

    /// The bytes of a kept tensor: a reply unlike its descriptor is refused (see
    /// [`Client::fetch_as`]).
    pub fn fetch(&mut self, tensor: &RemoteTensor) -> Result<Tensor, ClusterError> {
        self.on_tensor_node(tensor, |client, handle| client.fetch_as(handle, &tensor.info.tensor))
    }

    /// Runs `op` on the kept tensor's node; where the node answers that the tensor moved (its
    /// node was drained), `op` runs again where it went.
    fn on_tensor_node<T>(
        &mut self,
        tensor: &RemoteTensor,
        mut op: impl FnMut(&mut Client, Handle) -> Result<T, ClientError>,
    ) -> Result<T, ClusterError> {
        let (mut node, mut handle) = self.where_now(&tensor.node, tensor.info.handle);
        for _ in 0..MAX_FOLLOWED_MOVES {
            match self.at_node(&node, |client| op(client, handle)) {
                Err(ClusterError::Node(ClientError::TensorMoved { to, kept })) => {
                    self.check_listed(&to)?;
                    tracing::debug!(from = %node, %to, "following a kept tensor that moved");
                    (node, handle) = (to, kept.handle);
                    // Kept under the name the caller knows it by: later requests go straight there.
                    self.moved_tensors.insert((tensor.node.clone(), tensor.info.handle), (node.clone(), handle));
                }
                Err(lost @ ClusterError::HandleLost { .. }) => match self.forwarded("kept", &node, handle) {
                    Some(moved) => {
                        self.check_listed(&moved.0)?;
                        tracing::info!(from = %node, to = %moved.0, "following a kept tensor of a drained node");
                        (node, handle) = moved;
                        self.moved_tensors.insert((tensor.node.clone(), tensor.info.handle), (node.clone(), handle));
                    }
                    None => return Err(lost),
                },
                other => return other,
            }
        }
        self.at_node(&node, |client| op(client, handle))
    }

    /// Frees tensors kept on `node` (or where they went from there); returns how many were
    /// held.
    pub fn release(&mut self, node: &str, handles: &[Handle]) -> Result<u32, ClusterError> {
        let mut by_node: HashMap<String, Vec<Handle>> = HashMap::new();
        for &handle in handles {
            let (at, now) = self.where_now(node, handle);
            self.moved_tensors.remove(&(node.to_owned(), handle));
            by_node.entry(at).or_default().push(now);
        }
        by_node.into_iter().try_fold(0, |n, (at, handles)| Ok(n + self.at_node(&at, |c| c.release(&handles))?))
    }

    /// Where the control plane says the `kind` (`session`, `kept`) under `handle` at `node`
    /// went when its node was drained; `None` when it knows of no such move (or cannot be
    /// asked).
    fn forwarded(&self, kind: &str, node: &str, handle: Handle) -> Option<(String, Handle)> {
        let Target::Control(control) = &self.target else { return None };
        control.forward(kind, node, handle).unwrap_or_else(|e| {
            tracing::info!(error = %e, "cannot ask the control plane where a drained node's {kind} went");
            None
        })
    }

    /// Where the tensor kept as `handle` at `node` is, as far as this client followed it.
    fn where_now(&self, node: &str, handle: Handle) -> (String, Handle) {
        let at = (node.to_owned(), handle);
        self.moved_tensors.get(&at).cloned().unwrap_or(at)
    }

    /// Copies a kept tensor into the device memory of the node at `to`, node to node.
    /// Returns the copy and the path its bytes took.
    /// The node at `to` grants the push first (the pushing node carries no credential of its
    /// own there).
    pub fn push(&mut self, tensor: &RemoteTensor, to: &str) -> Result<(RemoteTensor, String), ClusterError> {
        let grant = self.connection(to).and_then(|client| client.grant_push(&tensor.info.tensor))?;
        let (info, path) =
            self.on_tensor_node(tensor, |client, handle| client.push(TensorSource::Handle(handle), to, &grant))?;
        Ok((RemoteTensor { node: to.to_owned(), info }, path))
    }

    /// Opens a session of a registered model with its initial `state` on the node that serves
    /// the model (placed, and the model registered again, as for a call); with `key`, placed
    /// as the control plane places that session id (where calls with it go). The session
    /// stays on that node unless it is moved: its steps go there, and if the node dies its
    /// state is lost with it. `reserve`: device bytes to hold for the state as it grows.
    pub fn session_open(
        &mut self,
        fingerprint: &Fingerprint,
        state: &[TensorRef<'_>],
        reserve: u64,
        key: Option<&str>,
    ) -> Result<RemoteSession, ClusterError> {
        let (session, node) = self.on_node(fingerprint, key, |node| node.session_open(fingerprint, state, reserve))?;
        Ok(RemoteSession { node, session, fingerprint: *fingerprint, key: key.map(str::to_owned) })
    }

    /// Runs `op` on the session's node; where the node answers that the session moved, the
    /// session follows (its node and handle change) and `op` runs again there.
    fn on_session_node<T>(
        &mut self,
        session: &mut RemoteSession,
        mut op: impl FnMut(&mut Client, Handle) -> Result<T, ClientError>,
    ) -> Result<T, ClusterError> {
        for _ in 0..MAX_FOLLOWED_MOVES {
            let handle = session.session;
            match self.at_node(&session.node.clone(), |client| op(client, handle)) {
                Err(ClusterError::Node(ClientError::SessionMoved { to, session: moved })) => {
                    self.check_listed(&to)?;
                    tracing::debug!(from = %session.node, %to, "following a session that moved");
                    session.node = to;
                    session.session = moved;
                    // Moved by its node (a drain): the control plane learns where a keyed one
                    // went from here. The call goes on whether it does or not.
                    if let Err(e) = self.record_move(session) {
                        tracing::info!(error = %e, "cannot record where the session went");
                    }
                }
                // Its node is gone: drained, the control plane says where the session went.
                Err(lost @ ClusterError::HandleLost { .. }) => match self.forwarded("session", &session.node, handle) {
                    Some((to, moved)) => {
                        self.check_listed(&to)?;
                        tracing::info!(from = %session.node, %to, "following a session of a drained node");
                        (session.node, session.session) = (to, moved);
                        if let Err(e) = self.record_move(session) {
                            tracing::info!(error = %e, "cannot record where the session went");
                        }
                    }
                    None => return Err(lost),
                },
                other => return other,
            }
        }
        let handle = session.session;
        self.at_node(&session.node.clone(), |client| op(client, handle))
    }

    /// One step of a session, on its node.
    pub fn session_step(
        &mut self,
        session: &mut RemoteSession,
        inputs: &[Value],
        tensors: &[TensorRef<'_>],
    ) -> Result<Output, ClusterError> {
        self.on_session_node(session, |client, handle| client.session_step(handle, inputs, tensors))
    }

    /// A step of a session stopped at a breakpoint, parked on the session's node.
    pub fn session_step_until(
        &mut self,
        session: &mut RemoteSession,
        inputs: &[Value],
        tensors: &[TensorRef<'_>],
        until: Breakpoint,
    ) -> Result<Paused, ClusterError> {
        self.on_session_node(session, |client, handle| client.session_step_until(handle, inputs, tensors, until))
    }

    /// Tells a session's node what its agent does next.
    pub fn session_signal(&mut self, session: &mut RemoteSession, signal: Signal) -> Result<(), ClusterError> {
        self.on_session_node(session, |client, handle| client.session_signal(handle, signal))
    }

    /// Frees a session's state on its node.
    pub fn session_close(&mut self, session: &mut RemoteSession) -> Result<(), ClusterError> {
        self.on_session_node(session, |client, handle| client.session_close(handle))
    }

    /// Where the control plane would run calls of a registered model in `phase` (`prefill`, a
    /// session's prompt; `decode`, its tokens), weighing the move of a session that `moving`
    /// says where it is: its decision, which this client does not cache.
    pub fn place_calls(
        &mut self,
        fingerprint: &Fingerprint,
        phase: Option<&str>,
        moving: Option<Moving<'_>>,
    ) -> Result<Placed, ClusterError> {
        let Target::Control(control) = &self.target else { return Err(ClusterError::NoControlPlane) };
        let kept = self.models.get(fingerprint);
        let options =
            PlaceOptions { policy: kept.and_then(|k| k.policy.as_deref()), phase, moving, ..PlaceOptions::default() };
        Ok(match (control.place_with(fingerprint, &options), kept) {
            (Err(e), Some(kept)) if e.kind() == Some("unknown_model") => {
                control.describe_model(fingerprint, &kept.description)?;
                control.place_with(fingerprint, &options)?
            }
            (placed, _) => placed?,
        })
    }

    /// Opens a session of a registered model on the node at `node`, which gets the model from
    /// this client's kept archives when it lacks it.
    pub fn session_open_on(
        &mut self,
        node: &str,
        fingerprint: &Fingerprint,
        state: &[TensorRef<'_>],
        reserve: u64,
    ) -> Result<RemoteSession, ClusterError> {
        let open = |client: &mut Client| client.session_open(fingerprint, state, reserve);
        let opened = match self.connection(node).and_then(open) {
            Err(e) if e.remote_code() == Some(ErrorCode::UnknownModel) && self.models.contains_key(fingerprint) => {
                self.register_on(node, fingerprint).and_then(|()| self.connection(node).and_then(open))
            }
            other => other,
        };
        let session = opened.map_err(|e| self.lost(node, e))?;
        Ok(RemoteSession { node: node.to_owned(), session, fingerprint: *fingerprint, key: None })
    }

    /// Moves a session to the node at `to`, node to node: the session's earlier requests
    /// finish where it is, then its state goes to `to` (which gets the model from this
    /// client's kept archives when it lacks it) and `session` follows it; a session opened
    /// with a key is recorded there by the control plane, so that calls with the key follow it
    /// too. If the move fails, the session stays where it was, whole, and this says why. A step
    /// of it parked at a breakpoint must be resumed or aborted first.
    pub fn session_move(&mut self, session: &mut RemoteSession, to: &str) -> Result<(), ClusterError> {
        let mut registered_again = false;
        loop {
            if session.node == to {
                return Ok(());
            }
            let fingerprint = session.fingerprint;
            let grant = self.connection(to).and_then(|client| client.grant_session(&fingerprint))?;
            match self.on_session_node(session, |client, handle| client.session_move(handle, to, &grant)) {
                Ok((node, handle)) => {
                    // The node names where the session went: `to`, unless a move on the way
                    // took it elsewhere.
                    if node != to {
                        self.check_listed(&node)?;
                    }
                    session.node = node;
                    session.session = handle;
                    return self.record_move(session);
                }
                // The node at `to` lacks the model: it gets it, and the move is tried again.
                Err(ClusterError::Node(e))
                    if e.remote_code() == Some(ErrorCode::UnknownModel)
                        && !registered_again
                        && self.models.contains_key(&fingerprint) =>
                {
                    registered_again = true;
                    self.register_on(to, &fingerprint)?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Tells the control plane where a keyed session is now, and forgets the placements of its
    /// key here (the next call with it asks again).
    fn record_move(&mut self, session: &RemoteSession) -> Result<(), ClusterError> {
        let (Target::Control(control), Some(key)) = (&self.target, &session.key) else { return Ok(()) };
        control.session_moved(key, &session.node)?;
        self.placed.retain(|(_, placed), _| placed.as_deref() != Some(key.as_str()));
        Ok(())
    }

    /// Unregisters a model from every node this client placed it on, and forgets it.
    pub fn unregister_model(&mut self, fingerprint: &Fingerprint) -> Result<(), ClusterError> {
        let mut addrs: Vec<String> = match &self.target {
            Target::Node(addr) => vec![addr.clone()],
            Target::Control(_) => {
                self.placed.iter().filter(|((fp, _), _)| fp == fingerprint).map(|(_, p)| p.addr.clone()).collect()
            }
        };
        addrs.sort();
        addrs.dedup();
        self.models.remove(fingerprint);
        self.placed.retain(|(fp, _), _| fp != fingerprint);
        for addr in addrs {
            match self.connection(&addr).and_then(|node| node.unregister_model(fingerprint)) {
                Err(e) if e.remote_code() == Some(ErrorCode::UnknownModel) => {}
                other => other?,
            }
        }
        Ok(())
    }
}

/// The options for a connection to the node at `addr`. With TLS and no name chosen, the node's
/// certificate must name the host of `addr` as written (a DNS name, or an IP address), not
/// only the address that name resolved to: each node is checked by its own name.
fn options_for(options: &ClientOptions, addr: &str) -> ClientOptions {
    let mut options = options.clone();
    if let Some(tls) = options.tls.take_if(|tls| !tls.has_server_name()) {
        // A host that is no valid name does not resolve either: the connection fails anyway.
        options.tls = Some(tls.clone().with_server_name(address_host(addr)).unwrap_or(tls));
    }
    options
}

/// The host of `HOST:PORT` or `[V6]:PORT`.
fn address_host(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host)
}
