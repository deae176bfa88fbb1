//! Node-to-node moves: pushes of this node's tensors into other nodes' device memory. Each
//! tenant's pushes run on a thread of their own, so one tenant's slow peer holds up no other
//! tenant's pushes; each thread keeps a bounded set of connections to peers (opened on first
//! use, opened again after a failure, closed when idle). It speaks the ordinary protocol to the
//! peer: the bytes go as a `Keep` request, and the peer answers with a handle of its own, in
//! the tenant's memory there. The node presents no credential of its own: each push carries a
//! one-time grant the peer gave the tenant for that tensor, which the mover presents in a hello
//! (again on a kept connection) for the tenant, by name.
//!
//! A tenant names the peer, so pushes go only to the nodes of this node's cluster
//! ([`PushPeers`]): the live nodes the control plane lists, or a fixed list. Anywhere else
//! nothing is connected to: no credential leaves the node, and no port is probed.
//!
//! Sessions move the same way ([`Mover::open_session`]): the state goes as a session `Open` of
//! the same model on the peer, on a grant for it, from the worker whose turn the move is.
//!
//! The path built so far is staging: the tensor's bytes leave from host memory (copied there
//! first from a GPU), and the peer copies them to its device. Between the two hosts they go over
//! RDMA where both nodes have it (a large tensor is RDMA-WRITten into the host memory the peer
//! takes for it), else over TCP.

use std::collections::{HashMap, HashSet};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use djinn_dataplane::client::{ClientConn, ClientError, ClientOptions};
use djinn_dataplane::rdma::RdmaPort;
use djinn_dataplane::tcp::ClientTls;
use djinn_node_core::{MovedSession, PeerError, Peers, PushedTensor, Replier, Reply, ReplyTo};
use djinn_proto::rdma::SessionConfig;
use djinn_proto::{
    DataMessage, ErrorCode, Handle, Hello, KeptMessage, Limits, Message, PROTOCOL_VERSION, SessionMessage, transports,
};
use djinn_sync::Locked;

/// How the bytes of a push travel, by the transport between the hosts; reported in the `Pushed`
/// reply.
pub fn staging_path(transport: &str) -> &'static str {
    if transport == "rdma" { "staging-rdma" } else { "staging-tcp" }
}

/// Fetches the addresses of the cluster's live nodes (from the control plane).
pub type ListNodes = Box<dyn Fn() -> Result<Vec<String>, String> + Send + Sync>;

/// The addresses this node may push to: a fixed list, and the live nodes its control plane
/// lists. None at all unless one of them is given.
pub struct PushPeers {
    fixed: HashSet<String>,
    listed: Option<(ListNodes, Mutex<Listed>)>,
}

#[derive(Default)]
struct Listed {
    /// When the control plane was last asked (answered or not).
    asked: Option<Instant>,
    addrs: HashSet<String>,
}

/// The control plane's list is fetched again when it is older than this, or when it lacks the
/// address asked for and is older than [`REFETCH_MISSING`] (a node that just joined is found;
/// pushes to made-up addresses do not hammer the control plane).
const LIST_FRESH: Duration = Duration::from_secs(1);
const REFETCH_MISSING: Duration = Duration::from_millis(200);

impl PushPeers {
    /// The addresses of `fixed` (`HOST:PORT`, as the tenants will name them), and the live
    /// nodes `list` returns, when given.
    pub fn new(fixed: impl IntoIterator<Item = String>, list: Option<ListNodes>) -> Self {
        Self { fixed: fixed.into_iter().collect(), listed: list.map(|l| (l, Mutex::new(Listed::default()))) }
    }

    /// Whether `to` is one of the peers: the same text, or the same socket address (no name is
    /// resolved for this).
    pub fn allows(&self, to: &str) -> bool {
        if self.fixed.iter().any(|a| same_peer(a, to)) {
            return true;
        }
        let Some((list, listed)) = &self.listed else { return false };
        let listed = || listed.locked();
        {
            let mut known = listed();
            let found = known.addrs.iter().any(|a| same_peer(a, to));
            let age = known.asked.map(|t| t.elapsed());
            if age.is_some_and(|a| a <= LIST_FRESH && (found || a <= REFETCH_MISSING)) {
                return found;
            }
            // Counted as asked now, answered or not: a control plane that is down is not asked
            // again by every push, and the pushes meanwhile go by the list there is.
            known.asked = Some(Instant::now());
        }
        // Asked without holding the list: a slow control plane delays this push alone, not
        // other tenants'.
        match list() {
            Ok(addrs) => listed().addrs = addrs.into_iter().collect(),
            Err(e) => tracing::warn!(error = %e, "cannot list the cluster's nodes for a push"),
        }
        listed().addrs.iter().any(|a| same_peer(a, to))
    }
}

impl std::fmt::Debug for PushPeers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushPeers").field("fixed", &self.fixed).field("listed", &self.listed.is_some()).finish()
    }
}

fn same_peer(a: &str, b: &str) -> bool {
    a == b || matches!((a.parse::<SocketAddr>(), b.parse::<SocketAddr>()), (Ok(x), Ok(y)) if x == y)
}

/// What a tenant's thread sends a peer: a tensor to keep, or a session to open.
enum Sent {
    Tensor(PushedTensor),
    Session(MovedSession),
}

struct PushJob {
    sent: Sent,
    to: String,
    grant: String,
    reply_to: ReplyTo,
    replier: Replier,
}

/// What every push worker shares.
struct Config {
    options: ClientOptions,
    rdma: Option<RdmaPort>,
    peers: Arc<PushPeers>,
    limits: PeerLimits,
}

pub struct Mover {
    config: Arc<Config>,
    /// One worker per tenant that pushed (tenants are those of the token document, or the one
    /// tenant where no token is needed), by the tenant's name.
    workers: Mutex<HashMap<String, Worker>>,
}

impl std::fmt::Debug for Mover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mover").finish_non_exhaustive()
    }
}

/// A tenant's push thread and its queue.
type Worker = (Sender<PushJob>, JoinHandle<()>);

/// How many connections to peers one tenant's push thread keeps open, and how long an unused
/// one stays open.
#[derive(Debug, Clone, Copy)]
pub struct PeerLimits {
    pub max: usize,
    pub idle: Duration,
}

impl Default for PeerLimits {
    fn default() -> Self {
        Self { max: 16, idle: Duration::from_secs(60) }
    }
}

impl Mover {
    /// `timeout` bounds each push's wait on its peer; pushes go only to `peers`, over RDMA on
    /// `rdma` to peers that offer it, on connections kept within `limits`.
    /// With `tls`, the connections to peers speak TLS.
    pub fn new(
        timeout: Duration,
        rdma: Option<RdmaPort>,
        peers: Arc<PushPeers>,
        limits: PeerLimits,
        tls: Option<ClientTls>,
    ) -> Self {
        let options = ClientOptions {
            timeout: Some(timeout),
            connect_timeout: timeout.min(Duration::from_secs(5)),
            // A peer answers a push with a handle, in a few hundred bytes and no payload: it
            // may send no more.
            limits: Limits { max_meta: 64 * 1024, ..Limits::default() },
            max_reply_payload: 0,
            pool_bytes: 0,
            tls,
            ..ClientOptions::default()
        };
        Self { config: Arc::new(Config { options, rdma, peers, limits }), workers: Mutex::default() }
    }
}

impl Mover {
    /// Queues `job` on `tenant`'s thread (started on its first job).
    fn queue(&self, job: PushJob, tenant: String) {
        let mut workers = self.workers.locked();
        let job = match workers.get(&tenant) {
            Some((tx, _)) => match tx.send(job) {
                Ok(()) => return,
                Err(e) => e.into_inner(),
            },
            None => job,
        };
        let (tx, rx) = crossbeam_channel::unbounded();
        let config = Arc::clone(&self.config);
        let name = tenant.clone();
        let spawned = std::thread::Builder::new().name("djinn-mover".into()).spawn(move || run(rx, &name, &config));
        match spawned {
            Ok(thread) => {
                let _ = tx.send(job);
                workers.insert(tenant, (tx, thread));
            }
            Err(e) => {
                let reply = Reply::error(ErrorCode::Internal, format!("no push thread: {e}"));
                answer(&job.sent, &job.replier, job.reply_to, reply);
            }
        }
    }
}

impl Peers for Mover {
    /// Pushes `tensor` to the node at `to` on its `grant`, for `tenant` (by name, empty where
    /// nodes need no token); the reply goes to `reply_to`.
    fn push(
        &self,
        tensor: PushedTensor,
        to: String,
        grant: String,
        tenant: String,
        reply_to: ReplyTo,
        replier: &Replier,
    ) {
        self.queue(PushJob { sent: Sent::Tensor(tensor), to, grant, reply_to, replier: replier.clone() }, tenant);
    }

    /// Opens, on the node at `to` and on its `grant`, a session for `tenant` (by name) from
    /// `session`'s state, on the tenant's thread and a connection of its own; the peer's answer
    /// goes to the core, which ends the move.
    fn open_session(
        &self,
        session: MovedSession,
        to: String,
        grant: String,
        tenant: String,
        reply_to: ReplyTo,
        replier: &Replier,
    ) {
        self.queue(PushJob { sent: Sent::Session(session), to, grant, reply_to, replier: replier.clone() }, tenant);
    }
}

/// Sends the answer to what was sent: a push's to its client, a session's to the core.
fn answer(sent: &Sent, replier: &Replier, reply_to: ReplyTo, reply: Reply) {
    match sent {
        Sent::Tensor(_) => replier.send(reply_to, reply),
        Sent::Session(_) => replier.executed(reply_to, reply),
    }
}

/// Opens a session from `session`'s state on the peer at `to`: the handle the peer gives it,
/// and the path the state took.
fn open_session(
    config: &Config,
    session: &MovedSession,
    to: &str,
    grant: &str,
    tenant: &str,
) -> Result<(Handle, &'static str), PeerError> {
    let mut conn = connect(to, grant, tenant, &config.options, config.rdma.as_ref())?;
    let MovedSession { fingerprint, state, bytes, reserve } = session;
    let open =
        Message::Session(SessionMessage::Open { fingerprint: *fingerprint, state: state.clone(), reserve: *reserve });
    let payload: Vec<&[u8]> = bytes.iter().map(|b| b.as_ref().as_ref()).collect();
    let path = staging_path(conn.transport());
    match conn.request(&open, &payload) {
        Ok(reply) => match reply.message {
            Message::Session(SessionMessage::Opened { session }) => Ok((session, path)),
            other => Err((ErrorCode::Internal, format!("the peer at {to} answered a {}", other.kind().name()))),
        },
        Err(ClientError::Remote { code, message, .. }) => {
            Err((code, format!("the peer at {to} refused the session: {message}")))
        }
        Err(e) => Err((ErrorCode::PeerUnreachable, format!("moving the session to {to} failed: {e}"))),
    }
}

fn not_a_peer(to: &str) -> PeerError {
    (
        ErrorCode::Forbidden,
        format!(
            "{to:?} is not a node of this cluster: pushes and moves go to the live nodes the control plane lists, \
             or to the node's --push-peers"
        ),
    )
}

impl Drop for Mover {
    fn drop(&mut self) {
        let workers = std::mem::take(&mut *self.workers.locked());
        let threads: Vec<_> = workers.into_values().map(|(_, thread)| thread).collect();
        for thread in threads {
            let _ = thread.join();
        }
    }
}

/// A worker's open connections to peers, by address, with their last use.
type OpenConns = HashMap<String, (ClientConn, Instant)>;

/// One tenant's pushes, in order.
fn run(rx: Receiver<PushJob>, tenant: &str, config: &Config) {
    let mut peers: OpenConns = HashMap::new();
    let idle = config.limits.idle;
    loop {
        let job = rx.recv_timeout(idle);
        peers.retain(|_, (_, used)| used.elapsed() < idle);
        let PushJob { sent, to, grant, reply_to, replier } = match job {
            Ok(job) => job,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => continue,
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
        };
        let started = Instant::now();
        let reply = match &sent {
            _ if !config.peers.allows(&to) => Err(not_a_peer(&to)),
            Sent::Tensor(tensor) => push(&mut peers, config, tensor, &to, &grant, tenant).map(|(kept, path)| {
                let seconds = started.elapsed().as_secs_f64();
                tracing::debug!(peer = %to, bytes = kept.tensor.byte_len, seconds, path, "pushed");
                Reply::message(KeptMessage::Pushed { kept, path: path.into() })
            }),
            Sent::Session(session) => open_session(config, session, &to, &grant, tenant).map(|(session, path)| {
                let seconds = started.elapsed().as_secs_f64();
                tracing::debug!(peer = %to, seconds, path, "session state sent");
                Reply::message(SessionMessage::Opened { session })
            }),
        };
        let reply = reply.unwrap_or_else(|(code, message)| {
            let what = if matches!(sent, Sent::Tensor(_)) { "push" } else { "session move" };
            tracing::info!(peer = %to, %message, "{what} failed");
            Reply::error(code, message)
        });
        answer(&sent, &replier, reply_to, reply);
    }
}

/// Pushes `tensor` to the peer at `to`; the handle the peer gives it and the path it took.
fn push(
    peers: &mut OpenConns,
    config: &Config,
    tensor: &PushedTensor,
    to: &str,
    grant: &str,
    tenant: &str,
) -> Result<(djinn_proto::HandleInfo, &'static str), PeerError> {
    let PushedTensor { desc, bytes } = tensor;
    let keep = Message::Kept(KeptMessage::Keep { tensor: desc.clone() });
    let payload = [bytes.as_ref().as_ref()];
    // A kept connection is opened again by this push's grant: the hello and the tensor go
    // together, one round trip. One found broken (the peer restarted since the last push) is
    // replaced by a new one.
    let reused = match peers.remove(to).filter(|(c, _)| c.is_usable()).map(|(c, _)| c) {
        Some(mut conn) => match conn.request_two(
            &Message::Data(DataMessage::Hello(greeting(grant, tenant, config.rdma.is_some()))),
            (&keep, &payload),
        ) {
            Ok((Ok(ack), result)) if matches!(&ack.message, Message::Data(DataMessage::HelloAck(h)) if h.protocol_version == PROTOCOL_VERSION) => {
                Some((conn, result))
            }
            Ok((Err(ClientError::Remote { code, message, .. }), _)) => return Err(refused_grant(to, code, &message)),
            outcome => {
                tracing::info!(peer = %to, ?outcome, "connection to the peer lost; opening it again");
                None
            }
        },
        None => None,
    };
    let (conn, result) = match reused {
        Some(done) => done,
        None => {
            let mut conn = connect(to, grant, tenant, &config.options, config.rdma.as_ref())?;
            let result = conn.request(&keep, &payload);
            (conn, result)
        }
    };
    let path = staging_path(conn.transport());
    if conn.is_usable() {
        if peers.len() >= config.limits.max
            && let Some(oldest) = peers.iter().min_by_key(|(_, (_, used))| *used).map(|(a, _)| a.clone())
        {
            peers.remove(&oldest);
        }
        peers.insert(to.to_owned(), (conn, Instant::now()));
    }
    match result {
        Ok(reply) => match reply.message {
            Message::Kept(KeptMessage::Kept { kept }) => Ok((kept, path)),
            other => Err((ErrorCode::Internal, format!("the peer at {to} answered a {}", other.kind().name()))),
        },
        Err(ClientError::Remote { code, message, .. }) => {
            Err((code, format!("the peer at {to} refused the tensor: {message}")))
        }
        Err(e) => Err((ErrorCode::PeerUnreachable, format!("pushing to {to} failed: {e}"))),
    }
}

/// The hello that presents `grant` for `tenant`.
fn greeting(grant: &str, tenant: &str, rdma: bool) -> Hello {
    let ours = if rdma { transports::TCP | transports::RDMA } else { transports::TCP };
    Hello {
        token: grant.to_owned(),
        tenant: tenant.to_owned(),
        ..Hello::new(&Limits::default(), ours, concat!("djinn-node/", env!("CARGO_PKG_VERSION")))
    }
}

/// The peer's refusal of a grant, in its own words (a wrong or spent grant is not an
/// unreachable peer).
fn refused_grant(to: &str, code: ErrorCode, message: &str) -> PeerError {
    (code, format!("the peer at {to} refused the push's grant: {message}"))
}

/// Opens a connection to the peer at `to` on `grant`, for `tenant`, over RDMA on `rdma` when
/// the peer offers it too.
fn connect(
    to: &str,
    grant: &str,
    tenant: &str,
    options: &ClientOptions,
    rdma: Option<&RdmaPort>,
) -> Result<ClientConn, PeerError> {
    let unreachable = |e: String| (ErrorCode::PeerUnreachable, e);
    let addrs: Vec<_> =
        to.to_socket_addrs().map_err(|e| unreachable(format!("{to:?} is not a reachable address: {e}")))?.collect();
    let mut conn =
        ClientConn::connect(&addrs[..], options.clone()).map_err(|e| unreachable(format!("cannot reach {to}: {e}")))?;
    let theirs = match conn.hello(greeting(grant, tenant, rdma.is_some())) {
        Ok(theirs) => theirs,
        Err(ClientError::Remote { code, message, .. }) => return Err(refused_grant(to, code, &message)),
        Err(e) => return Err(unreachable(format!("hello to {to} failed: {e}"))),
    };
    let Some(port) = rdma.filter(|_| theirs.transports & transports::RDMA != 0) else { return Ok(conn) };
    if let Err(e) = conn.upgrade_to_rdma(port, SessionConfig::default()) {
        // Both ends have RDMA but it does not connect them (another fabric, say): TCP on this
        // connection if the peer only refused the upgrade. A broken one took the grant with it.
        tracing::warn!(peer = %to, error = %e, "no RDMA to the peer; pushing over TCP");
        if !conn.is_usable() {
            return Err(unreachable(format!("RDMA to {to} failed ({e}) and took the push's grant: push again")));
        }
    }
    Ok(conn)
}
