//! What every server backend shares: per-connection protocol state, request dispatch, the
//! built-in kinds (hello, ping, stats), authentication, back-pressure, deadlines and counters;
//! tenants' quotas and push grants are the service's (the node core's), asked here. It reads no clock: the backend passes the time ([`Core::set_now`], once per turn
//! of its loop), so the unit tests (`core_tests.rs`) drive it with a clock of their own and no
//! socket. Backends only move bytes and wake.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use djinn_auth::{Authenticator, TenantId};
use djinn_node_core::{Answer, Delivery, LocalNode, LocalRequest, Replier, Reply, ReplyTo, Service};

use crate::rdma::{ChannelError, Completion, RdmaChannel, RdmaContext, RdmaError};
use djinn_proto::rdma::SessionConfig;

use djinn_proto::{
    DataMessage, ErrorCode, Frame, FrameReader, Hello, Limits, Message, OutFrame, PROTOCOL_VERSION, Payload,
    PayloadAlloc, ProtocolError, RdmaParams, RecvEvent, Refusal, SendQueue, transports,
};

/// The server backend, with what each can carry: mio (epoll) polls TLS connections and the
/// RDMA completion channel beside its sockets; io_uring moves plain TCP only. A configuration
/// of io_uring with RDMA or TLS cannot be written.
#[derive(Debug, Clone)]
pub enum Backend {
    Mio {
        /// When set, clients may move their frames to RDMA.
        rdma: Option<Arc<RdmaContext>>,
        /// When set, every connection speaks TLS; frames moved to RDMA do not.
        tls: Option<Arc<rustls::ServerConfig>>,
    },
    Uring,
}

impl Default for Backend {
    fn default() -> Self {
        Self::Mio { rdma: None, tls: None }
    }
}

impl Backend {
    /// The RDMA context clients may move to, where the backend offers RDMA.
    pub fn rdma(&self) -> Option<&Arc<RdmaContext>> {
        match self {
            Self::Mio { rdma, .. } => rdma.as_ref(),
            Self::Uring => None,
        }
    }

    /// The TLS configuration every connection speaks, where the backend has one.
    pub fn tls(&self) -> Option<&Arc<rustls::ServerConfig>> {
        match self {
            Self::Mio { tls, .. } => tls.as_ref(),
            Self::Uring => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub limits: Limits,
    /// How long the poller keeps polling without blocking after its last piece of work.
    pub spin: Duration,
    /// A connection whose unsent replies exceed this many bytes is not read from until they
    /// drain, so a client that does not read its replies cannot make the node buffer without
    /// bound.
    pub max_queued_bytes: u64,
    /// The same bound in frames (small replies).
    pub max_queued_frames: usize,
    /// Unsent reply bytes over all connections before the node stops reading from those that
    /// have replies waiting, until they drain: many connections together cannot hold more than
    /// this and one reply each, and a client that reads its replies is still served.
    pub max_queued_total: u64,
    /// Bytes read from one connection before the poller turns to the others.
    pub read_budget: usize,
    /// Connections beyond this are closed at once.
    pub max_connections: usize,
    /// Where clients need tokens: connections that have not said a good hello yet, over all
    /// sources and from one source address; more are closed at once.
    pub max_unauthenticated: usize,
    pub max_unauthenticated_per_source: usize,
    /// Where clients need tokens: a connection without a good hello this long after it was
    /// accepted is closed.
    pub hello_timeout: Duration,
    /// A connection with nothing under way (no partial frame, no request being answered, no
    /// reply waiting) and no frame in either direction for this long is closed. Clients
    /// reconnect by themselves; what a tenant keeps on the node is not the connection's.
    pub idle_timeout: Duration,
    /// Requests of one connection being answered by other threads before the poller stops
    /// reading that connection.
    pub max_in_flight: usize,
    pub backend: Backend,
    /// RDMA connections at once (their queue pairs share one completion queue); more are
    /// refused and those clients use TCP.
    pub rdma_connections: usize,
    /// How the node's device memory meets the network, announced in the hello.
    pub memory_path: String,
    /// A connection in the middle of a frame, or with replies waiting to be sent, that moves
    /// less than [`MIN_PROGRESS`] bytes in either of those directions over this long is closed:
    /// a client trickling a frame or not reading its replies holds nothing for long.
    pub stall_timeout: Duration,
    /// When set, a connection is served only after a hello with a valid token, its requests
    /// are namespaced by the token's tenant and held to the tenant's request quotas; else
    /// everyone shares one namespace.
    pub auth: Option<Arc<Authenticator>>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            spin: Duration::from_micros(50),
            max_queued_bytes: 64 << 20,
            max_queued_frames: 1024,
            max_queued_total: 1 << 30,
            read_budget: 4 << 20,
            max_connections: 4096,
            max_unauthenticated: 256,
            max_unauthenticated_per_source: 32,
            hello_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(600),
            max_in_flight: 256,
            backend: Backend::default(),
            rdma_connections: 16,
            memory_path: crate::MEMORY_PATH.into(),
            stall_timeout: Duration::from_secs(10),
            auth: None,
        }
    }
}

/// Counters of the data plane, reported in stats replies.
#[derive(Debug, Default, Clone, Copy)]
pub struct ServerCounters {
    pub connections_accepted: u64,
    pub connections_open: u64,
    pub connections_refused: u64,
    pub frames_in: u64,
    pub frames_out: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub requests_refused: u64,
    /// Requests refused for their tenant's request quotas (counted in `requests_refused` too).
    pub quota_refusals: u64,
    pub protocol_failures: u64,
    /// Hellos refused for their token (each closes its connection).
    pub auth_failures: u64,
    /// Connections closed for stalling (see [`ServerConfig::stall_timeout`]).
    pub stalled_connections: u64,
    /// Connections closed without a good hello in time ([`ServerConfig::hello_timeout`]).
    pub hello_timeouts: u64,
    /// Connections closed for being idle ([`ServerConfig::idle_timeout`]).
    pub idle_closed: u64,
    /// Connections refused at once for the bounds on those without a good hello yet.
    pub unauthenticated_refused: u64,
    /// Accepts that failed for want of descriptors or memory, after each of which the listener
    /// waits (see `accept.rs`): a poller out of descriptors retries a few times a second.
    pub accept_backoffs: u64,
}

/// What a backend does in a turn of its loop besides moving the bytes its events announce
/// ([`Core::begin_turn`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Turn {
    /// The replies queued over all connections fell below their bound: every connection may
    /// read again, and one may have bytes waiting that no new event will announce.
    pub resume_reads: bool,
    /// Connections' deadlines are due: [`Core::check_timeouts`] on each, then [`Core::on_tick`].
    pub check_deadlines: bool,
}

/// Bytes a stalling connection must move per [`ServerConfig::stall_timeout`] to stay open.
pub const MIN_PROGRESS: u64 = 64 * 1024;

/// Stops a running server from another thread (a signal handler thread, a test).
#[derive(Clone)]
pub struct ShutdownHandle {
    flag: Arc<AtomicBool>,
    wake: Arc<dyn Fn() + Send + Sync>,
}

impl ShutdownHandle {
    pub(crate) fn new(flag: Arc<AtomicBool>, wake: Arc<dyn Fn() + Send + Sync>) -> Self {
        Self { flag, wake }
    }

    pub fn shutdown(&self) {
        self.flag.store(true, Ordering::Release);
        (self.wake)();
    }
}

impl fmt::Debug for ShutdownHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShutdownHandle").field("requested", &self.flag.load(Ordering::Relaxed)).finish()
    }
}

/// The protocol state of one connection.
#[derive(Debug)]
pub(crate) struct Conn {
    pub reader: FrameReader,
    pub queue: SendQueue,
    pub peer: SocketAddr,
    slot: usize,
    id: u64,
    /// Requests handed to other threads and not answered yet.
    in_flight: usize,
    /// No more reading: the peer closed, or the stream failed. Close once the queue is sent.
    pub closing: bool,
    /// Set once the client moved this connection's frames to RDMA.
    pub rdma: Option<RdmaChannel>,
    /// Whose connection it is; `None` until a hello with a valid token, where one is needed.
    tenant: Option<TenantId>,
    /// See [`ReplyTo::operator`].
    operator: bool,
    /// See [`ReplyTo::torchscript`].
    torchscript: bool,
    /// Set when the connection came in on a push grant: what it may deliver, and whether it
    /// did. It may do nothing else.
    granted: Option<(Delivery, bool)>,
    /// When it was accepted, and when a frame last went either way (set by the timeout check
    /// from `active`, which the hot path sets: no clock read per frame).
    accepted: Instant,
    last_active: Instant,
    active: bool,
    /// The current stall window: when it began, and the bytes read and written since.
    window: (Instant, u64, u64),
    /// The RDMA path's bytes sent when the current stall window began.
    rdma_sent_mark: u64,
    /// Closed without sending what is queued (it stalled).
    dropped: bool,
}

impl Conn {
    /// Replies held for the peer: (frames, bytes) in the send queue and on the RDMA path.
    fn replies_held(&self) -> (usize, u64) {
        let (frames, bytes) = self.rdma.as_ref().map_or((0, 0), RdmaChannel::backlog);
        (self.queue.queued_frames() + frames, self.queue.queued_bytes() + bytes)
    }

    fn under_limits(&self, config: &ServerConfig) -> bool {
        let (frames, bytes) = self.replies_held();
        bytes < config.max_queued_bytes && frames < config.max_queued_frames && self.in_flight < config.max_in_flight
    }

    /// True when `key` names this connection's RDMA channel.
    pub fn has_rdma_key(&self, key: u32) -> bool {
        self.rdma.as_ref().is_some_and(|ch| ch.key() == key)
    }

    /// Closing, with every reply sent (a client that half-closed still gets its answers), or
    /// dropped.
    pub fn is_done(&self) -> bool {
        self.dropped || (self.closing && self.queue.is_empty() && self.in_flight == 0)
    }

    /// Closed without sending what is queued (it stalled).
    pub fn is_dropped(&self) -> bool {
        self.dropped
    }
}

/// Dispatch and accounting shared by the backends.
pub(crate) struct Core<S> {
    pub service: S,
    pub config: ServerConfig,
    pub counters: ServerCounters,
    /// Requests answered by other threads and not answered yet, over every connection.
    deferred: usize,
    /// Unsent reply bytes over every connection.
    queued_total: u64,
    rdma_open: usize,
    hello: Hello,
    replier: Replier,
    replies: Receiver<(ReplyTo, Answer)>,
    /// Connections without a good hello yet, by source address (where clients need tokens).
    unauthenticated: HashMap<IpAddr, usize>,
    /// The time, as the backend last said ([`Self::set_now`]).
    now: Instant,
    /// The loop's policy (see [`Self::begin_turn`]): whether reads were paused for the global
    /// reply bound last turn, when deadlines are checked next, when there was work last.
    paused: bool,
    next_deadline_check: Instant,
    last_work: Instant,
    /// Connections closed since the allocator last gave free memory back, and when it did.
    closed_since_trim: usize,
    last_trim: Instant,
    /// The node's own requests (see `local.rs`): the way in, handed out to the node's threads;
    /// the poller's end; those answered later, by number; the last number given.
    local: LocalNode,
    local_requests: Receiver<LocalRequest>,
    local_waiting: HashMap<u64, crossbeam_channel::Sender<Reply>>,
    last_local: u64,
}

/// Where the replies to the node's own requests go: no connection's slot or number (slots are
/// a table's indices and numbers count connections; neither reaches these).
const LOCAL_SLOT: usize = usize::MAX;
const LOCAL_CONNECTION: u64 = u64::MAX;

/// The service's payload memory, for a connection that said who it is (else nothing is
/// allocated: the payload is skipped and the request refused) and whose tenant's request
/// quotas let the request in.
struct Alloc<'a, S> {
    service: &'a mut S,
    tenant: Option<TenantId>,
    /// See [`Conn::granted`].
    granted: Option<&'a (Delivery, bool)>,
    counters: &'a mut ServerCounters,
    now: Instant,
}

impl<S: Service> PayloadAlloc for Alloc<'_, S> {
    fn alloc(&mut self, message: &Message, len: usize) -> Result<Payload, Refusal> {
        let Some(tenant) = self.tenant else { return Err(unauthenticated()) };
        if let Some((delivery, used)) = self.granted
            && (*used || !delivery.is(message))
        {
            return Err(granted_only());
        }
        self.service.admit(tenant, self.now).inspect_err(|_| self.counters.quota_refusals += 1)?;
        self.service.alloc(message, len, tenant)
    }
}

/// Whether a connection that came on a push grant may make this request: the delivery the
/// grant names, once (marked used here), pings and its RDMA upgrade.
fn grant_allows(granted: &mut (Delivery, bool), message: &Message) -> bool {
    match message {
        Message::Data(DataMessage::Ping) | Message::Data(DataMessage::RdmaConnect(_)) => true,
        message if !granted.1 && granted.0.is(message) => {
            granted.1 = true;
            true
        }
        _ => false,
    }
}

/// What a connection that came on a push grant gets for anything but what the grant allows.
fn granted_only() -> Refusal {
    let message = "this connection came on a push grant: it may make the one delivery the grant names".into();
    Refusal { code: ErrorCode::Forbidden, message }
}

fn unauthenticated() -> Refusal {
    Refusal { code: ErrorCode::Unauthenticated, message: "this node needs a hello with a valid token first".into() }
}

impl<S: Service> Core<S> {
    /// `wake` makes the backend's poller return from a blocking wait; `now` is the time.
    pub fn new(service: S, config: ServerConfig, agent: &str, wake: Arc<dyn Fn() + Send + Sync>, now: Instant) -> Self {
        let offered =
            if config.backend.rdma().is_some() { transports::TCP | transports::RDMA } else { transports::TCP };
        let hello = Hello { memory_path: config.memory_path.clone(), ..Hello::new(&config.limits, offered, agent) };
        let (local, local_requests) = LocalNode::new(Arc::clone(&wake));
        let (replier, replies) = Replier::new(wake);
        Self {
            service,
            config,
            counters: ServerCounters::default(),
            deferred: 0,
            queued_total: 0,
            rdma_open: 0,
            hello,
            replier,
            replies,
            unauthenticated: HashMap::new(),
            now,
            paused: false,
            next_deadline_check: now,
            last_work: now,
            closed_since_trim: 0,
            last_trim: now,
            local,
            local_requests,
            local_waiting: HashMap::new(),
            last_local: 0,
        }
    }

    /// The way in for the node's own requests, served in this poller's turns.
    pub fn local_node(&self) -> LocalNode {
        self.local.clone()
    }

    /// Serves the node's own requests that came since the last turn, as a connection's are
    /// (the data plane's own kinds, then the service); true when there were any.
    pub fn serve_local(&mut self) -> bool {
        let mut served = false;
        while let Ok(LocalRequest { tenant, message, answer }) = self.local_requests.try_recv() {
            served = true;
            let (tenant, operator) = match self.local_principal(&tenant) {
                Ok(principal) => principal,
                Err(e) => {
                    let _ = answer.send(Reply::error(ErrorCode::Unauthenticated, e.to_string()));
                    continue;
                }
            };
            self.last_local += 1;
            let request_id = self.last_local;
            let to = ReplyTo {
                slot: LOCAL_SLOT,
                conn_id: LOCAL_CONNECTION,
                request_id,
                tenant,
                operator,
                torchscript: false,
            };
            match self.dispatch(Frame { request_id, message, payload: None }, to) {
                Some(reply) => _ = answer.send(reply),
                None => {
                    self.deferred += 1;
                    self.local_waiting.insert(request_id, answer);
                }
            }
        }
        served
    }

    /// Whom a request of the node's own acts for, by the tenant's name: that tenant, or, for
    /// no name (or where no token is needed), the node itself, which sees every tenant's lists.
    fn local_principal(&self, name: &str) -> Result<(TenantId, bool), djinn_auth::AuthError> {
        match &self.config.auth {
            Some(auth) if !name.is_empty() => match auth.tenant(name) {
                Some(p) => Ok((p.tenant, false)),
                None => Err(djinn_auth::AuthError::UnknownTenant(name.to_owned())),
            },
            _ => Ok((TenantId::DEFAULT, true)),
        }
    }

    /// The time is now `now` (never earlier than the last time said).
    pub fn set_now(&mut self, now: Instant) {
        self.now = self.now.max(now);
    }

    /// Starts a turn of the backend's loop at `now`: what the backend must do this turn besides
    /// moving the bytes its events announce.
    pub fn begin_turn(&mut self, now: Instant) -> Turn {
        self.set_now(now);
        let paused = self.reads_paused();
        let resume_reads = std::mem::replace(&mut self.paused, paused) && !paused;
        let check_deadlines = self.now >= self.next_deadline_check;
        if check_deadlines {
            self.next_deadline_check = self.now + self.timeout_check_every();
        }
        if self.service.next_expiry().is_some_and(|at| self.now >= at) {
            self.service.expire(self.now, &self.replier);
        }
        Turn { resume_reads, check_deadlines }
    }

    /// The backend found work this turn (events, completions, replies).
    pub fn worked(&mut self) {
        self.last_work = self.now;
    }

    /// Whether the backend should poll again without blocking: a reply from another thread is
    /// near, or there was work within the last `spin` (a wake-up on another core costs more
    /// than polling a while).
    pub fn keep_polling(&self, now: Instant) -> bool {
        self.awaiting_replies() || now.saturating_duration_since(self.last_work) < self.config.spin
    }

    /// When a blocking wait must end at the latest while connections are open: the next
    /// deadline check.
    pub fn next_deadline_check(&self) -> Instant {
        self.next_deadline_check
    }

    /// When a blocking wait must end at the latest, connections open or not: the service's
    /// next expiry (a kept tensor's idle time limit), if it has one.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.service.next_expiry()
    }

    /// Gives the memory of closed connections back to the system: once a second while they
    /// close by the dozen, else every ten seconds when any closed. Freed in a burst (thousands
    /// of idle connections timing out), it otherwise stays in the allocator's arenas wherever a
    /// live allocation sits above it.
    fn trim_memory(&mut self, now: Instant) {
        let since = now.saturating_duration_since(self.last_trim);
        let due = match self.closed_since_trim {
            0 => false,
            1..64 => since >= Duration::from_secs(10),
            _ => since >= Duration::from_secs(1),
        };
        if !due {
            return;
        }
        self.closed_since_trim = 0;
        self.last_trim = now;
        #[cfg(target_env = "gnu")]
        // SAFETY: malloc_trim has no preconditions; it only returns free pages to the system.
        unsafe {
            libc::malloc_trim(0);
        }
    }

    /// Whether a connection from `peer` may be accepted with `open` connections open: under
    /// the connection limit and, before its hello, under the bounds on unauthenticated ones.
    pub fn may_accept(&mut self, peer: SocketAddr, open: usize) -> bool {
        if open >= self.config.max_connections {
            self.counters.connections_refused += 1;
            tracing::warn!(%peer, "connection refused: at the connection limit");
            return false;
        }
        if self.config.auth.is_some() {
            let total: usize = self.unauthenticated.values().sum();
            let from_peer = self.unauthenticated.get(&peer.ip()).copied().unwrap_or(0);
            if total >= self.config.max_unauthenticated || from_peer >= self.config.max_unauthenticated_per_source {
                self.counters.connections_refused += 1;
                self.counters.unauthenticated_refused += 1;
                tracing::info!(%peer, total, from_peer, "connection refused: too many without a hello");
                return false;
            }
        }
        true
    }

    /// `conn` no longer counts as unauthenticated (it said a good hello, or it closed).
    fn authenticated_or_gone(&mut self, conn: &Conn) {
        if self.config.auth.is_some() && conn.tenant.is_none() {
            let ip = conn.peer.ip();
            if let Some(n) = self.unauthenticated.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    self.unauthenticated.remove(&ip);
                }
            }
        }
    }

    /// A new connection in slab slot `slot`.
    pub fn on_accept(&mut self, peer: SocketAddr, slot: usize) -> Conn {
        self.counters.connections_accepted += 1;
        self.counters.connections_open += 1;
        tracing::debug!(%peer, "connection accepted");
        let limits = if self.config.auth.is_some() {
            *self.unauthenticated.entry(peer.ip()).or_default() += 1;
            self.config.limits.before_hello()
        } else {
            self.config.limits
        };
        let now = self.now;
        Conn {
            reader: FrameReader::new(limits),
            queue: SendQueue::default(),
            peer,
            slot,
            id: self.counters.connections_accepted,
            in_flight: 0,
            closing: false,
            rdma: None,
            tenant: if self.config.auth.is_some() { None } else { Some(TenantId::DEFAULT) },
            operator: self.config.auth.is_none(),
            torchscript: self.config.auth.is_none(),
            granted: None,
            accepted: now,
            last_active: now,
            active: false,
            window: (now, 0, 0),
            rdma_sent_mark: 0,
            dropped: false,
        }
    }

    /// True when the backend should read from `conn`.
    pub fn wants_read(&self, conn: &Conn) -> bool {
        !conn.closing && conn.under_limits(&self.config) && (conn.queue.is_empty() || !self.reads_paused())
    }

    /// True while the replies queued on all connections together are over their bound: no
    /// connection with replies waiting is read until they drain. When it turns false, the
    /// backend schedules every connection again (one may have bytes waiting that no new event
    /// will announce).
    pub fn reads_paused(&self) -> bool {
        self.queued_total >= self.config.max_queued_total
    }

    fn queue(&mut self, conn: &mut Conn, frame: OutFrame) {
        let before = conn.queue.queued_bytes();
        conn.queue.push(frame);
        self.queued_total += conn.queue.queued_bytes() - before;
    }

    /// Closes `conn` when it is past a deadline: no good hello in time, idle too long, or
    /// stalled in its stall window (which this ends when it is over). True when it is marked
    /// done (the backend then closes it).
    pub fn check_timeouts(&mut self, conn: &mut Conn, now: Instant) -> bool {
        if conn.dropped {
            return false;
        }
        if std::mem::take(&mut conn.active) {
            conn.last_active = now;
        }
        let close = |conn: &mut Conn| {
            conn.dropped = true;
            conn.closing = true;
            true
        };
        if conn.tenant.is_none() && now.saturating_duration_since(conn.accepted) >= self.config.hello_timeout {
            self.counters.hello_timeouts += 1;
            tracing::info!(peer = %conn.peer, "closing a connection that said no good hello in time");
            return close(conn);
        }
        let under_way = !conn.reader.is_idle() || conn.replies_held().0 > 0 || conn.in_flight > 0;
        if !under_way && now.saturating_duration_since(conn.last_active) >= self.config.idle_timeout {
            self.counters.idle_closed += 1;
            tracing::debug!(peer = %conn.peer, "closing an idle connection");
            return close(conn);
        }
        let (start, read, written) = conn.window;
        if now.saturating_duration_since(start) < self.config.stall_timeout {
            return false;
        }
        conn.window = (now, 0, 0);
        // Not reading is the node's choice while its back-pressure holds: no stall then.
        let reading = !conn.reader.is_idle() && read < MIN_PROGRESS && self.wants_read(conn);
        // Replies on the RDMA path move as the peer returns credits and answers for them; one
        // the device is writing is not the peer's to hold up.
        let (rdma_held, rdma_sent) = conn.rdma.as_ref().map_or((0, 0), |ch| (ch.waiting_on_peer(), ch.sent_bytes()));
        let rdma_moved = rdma_sent - std::mem::replace(&mut conn.rdma_sent_mark, rdma_sent);
        let writing =
            (!conn.queue.is_empty() && written < MIN_PROGRESS) || (rdma_held > 0 && rdma_moved < MIN_PROGRESS);
        if !(reading || writing) {
            return false;
        }
        self.counters.stalled_connections += 1;
        tracing::info!(
            peer = %conn.peer,
            read,
            written,
            waiting = if reading { "in the middle of a frame" } else { "not reading its replies" },
            "closing a stalled connection"
        );
        close(conn)
    }

    /// The backends' timeout tick: the service's expiries, then memory back to the system.
    pub fn on_tick(&mut self, now: Instant) {
        self.service.expire(now, &self.replier);
        self.trim_memory(now);
    }

    /// How often the backend checks its connections' deadlines ([`Self::check_timeouts`]).
    fn timeout_check_every(&self) -> Duration {
        let shortest = self.config.stall_timeout.min(self.config.hello_timeout).min(self.config.idle_timeout);
        (shortest / 4).max(Duration::from_millis(10))
    }

    /// The next reply sent from another thread, with the slot of its connection.
    /// (The answers to the node's own requests go straight back to them.)
    pub fn next_deferred(&mut self) -> Option<(usize, ReplyTo, Reply)> {
        loop {
            let (to, answer) = self.replies.try_recv().ok()?;
            let reply = match answer {
                Answer::Reply(reply) => reply,
                Answer::Executed(answer) => match self.service.complete(to, answer, &self.replier, self.now) {
                    Some(reply) => reply,
                    // The request goes on: its answer comes later.
                    None => continue,
                },
            };
            self.deferred -= 1;
            if to.slot == LOCAL_SLOT {
                if let Some(answer) = self.local_waiting.remove(&to.request_id) {
                    let _ = answer.send(reply);
                }
                continue;
            }
            self.service.finished(to.tenant);
            return Some((to.slot, to, reply));
        }
    }

    /// True while another thread is working on a request: the reply is near, so the poller
    /// keeps polling rather than sleep and pay a wake-up for it.
    pub fn awaiting_replies(&self) -> bool {
        self.deferred > 0
    }

    /// Queues a deferred reply on `conn` (the connection in its slot), unless that connection
    /// is not the one the request came on.
    pub fn deliver(&mut self, conn: &mut Conn, to: ReplyTo, reply: Reply) {
        if conn.id != to.conn_id {
            tracing::debug!(request_id = to.request_id, "reply for a closed connection dropped");
            return;
        }
        conn.in_flight -= 1;
        conn.active = true;
        self.send(conn, to.request_id, reply);
    }

    pub fn on_close(&mut self, conn: &Conn) {
        self.authenticated_or_gone(conn);
        self.closed_since_trim += 1;
        self.counters.connections_open -= 1;
        self.queued_total -= conn.queue.queued_bytes();
        if conn.rdma.is_some() {
            self.rdma_open -= 1;
        }
        self.service.on_disconnect(conn.id);
        tracing::debug!(peer = %conn.peer, "connection closed");
    }

    pub fn on_bytes_read(&mut self, conn: &mut Conn, n: usize) {
        self.counters.bytes_in += n as u64;
        conn.window.1 += n as u64;
        conn.reader.on_read(n);
    }

    pub fn on_bytes_written(&mut self, conn: &mut Conn, n: usize) {
        self.counters.bytes_out += n as u64;
        self.queued_total -= n as u64;
        conn.window.2 += n as u64;
        conn.queue.on_written(n);
    }

    /// Decodes and answers whatever complete frames are buffered (from the socket, then from
    /// RDMA), while the connection's replies stay under the back-pressure limits.
    pub fn process(&mut self, conn: &mut Conn) {
        while self.wants_read(conn) {
            let mut alloc = Alloc {
                service: &mut self.service,
                tenant: conn.tenant,
                granted: conn.granted.as_ref(),
                counters: &mut self.counters,
                now: self.now,
            };
            let event = match conn.reader.next_event(&mut alloc) {
                Some(event) => event,
                None => match conn.rdma.as_mut().and_then(RdmaChannel::poll_event) {
                    Some(event) => event,
                    None => break,
                },
            };
            conn.active = true;
            match event {
                RecvEvent::Frame(Frame { request_id, message: Message::Data(DataMessage::Hello(peer)), .. }) => {
                    self.counters.frames_in += 1;
                    let reply = self.hello(conn, &peer);
                    self.send(conn, request_id, reply);
                }
                RecvEvent::Frame(Frame { request_id, message, .. })
                    if conn.tenant.is_none() && !matches!(message, Message::Data(DataMessage::Ping)) =>
                {
                    self.counters.frames_in += 1;
                    self.counters.requests_refused += 1;
                    let Refusal { code, message } = unauthenticated();
                    self.send(conn, request_id, Reply::error(code, message));
                }
                RecvEvent::Frame(Frame { request_id, message, .. })
                    if conn.granted.as_mut().is_some_and(|granted| !grant_allows(granted, &message)) =>
                {
                    self.counters.frames_in += 1;
                    self.counters.requests_refused += 1;
                    let Refusal { code, message } = granted_only();
                    self.send(conn, request_id, Reply::error(code, message));
                }
                RecvEvent::Frame(Frame {
                    request_id,
                    message: Message::Data(DataMessage::RdmaConnect(params)),
                    ..
                }) => {
                    self.counters.frames_in += 1;
                    // Answered over TCP: the RDMA path exists only once the client has this.
                    let reply = self.rdma_connect(conn, params);
                    let frame = self.frame(request_id, reply);
                    self.queue(conn, frame);
                }
                RecvEvent::Frame(frame) => {
                    self.counters.frames_in += 1;
                    let to = ReplyTo {
                        slot: conn.slot,
                        conn_id: conn.id,
                        request_id: frame.request_id,
                        tenant: conn.tenant.unwrap_or_default(),
                        operator: conn.operator,
                        torchscript: conn.torchscript,
                    };
                    // A request with a payload was admitted when its memory was allocated.
                    if frame.payload.is_none()
                        && !matches!(frame.message, Message::Data(DataMessage::Ping))
                        && let Err(Refusal { code, message }) = self.service.admit(to.tenant, self.now)
                    {
                        self.counters.requests_refused += 1;
                        self.counters.quota_refusals += 1;
                        self.send(conn, to.request_id, Reply::error(code, message));
                        continue;
                    }
                    match self.dispatch(frame, to) {
                        Some(reply) => self.send(conn, to.request_id, reply),
                        None => {
                            conn.in_flight += 1;
                            self.deferred += 1;
                            self.service.started(to.tenant);
                        }
                    }
                }
                RecvEvent::Rejected { request_id, refusal } => {
                    self.counters.frames_in += 1;
                    self.counters.requests_refused += 1;
                    tracing::debug!(peer = %conn.peer, request_id, ?refusal, "request refused");
                    self.send(conn, request_id, Reply::error(refusal.code, refusal.message));
                }
                RecvEvent::Fatal(error) => self.fail(conn, error),
            }
        }
    }

    /// Answers a hello: the versions must match and, where the node needs one, the token must
    /// be valid (a refused token closes the connection). The connection then belongs to the
    /// token's tenant, or to the tenant a node's token acts for.
    fn hello(&mut self, conn: &mut Conn, peer: &Hello) -> Reply {
        if peer.protocol_version != PROTOCOL_VERSION {
            let e = ProtocolError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: peer.protocol_version };
            return Reply::error(e.code(), e.to_string());
        }
        if let Some((tenant, delivery)) = self.service.redeem(&peer.token, &peer.tenant, self.now) {
            tracing::debug!(peer = %conn.peer, agent = %Logged(&peer.agent), tenant = %Logged(&peer.tenant), "hello on a push grant");
            self.authenticated_or_gone(conn);
            conn.reader.set_limits(self.config.limits);
            conn.tenant = Some(tenant);
            conn.operator = false;
            conn.torchscript = false;
            conn.granted = Some((delivery, false));
            return Reply::message(DataMessage::HelloAck(self.hello.clone()));
        }
        conn.granted = None;
        if let Some(auth) = &self.config.auth {
            let principal = auth
                .verify(&peer.token)
                .and_then(|p| if peer.tenant.is_empty() { Ok(p) } else { auth.act_for(&p, &peer.tenant) });
            match principal {
                Ok(p) => {
                    tracing::debug!(peer = %conn.peer, agent = %Logged(&peer.agent), tenant = %p.name, "hello");
                    self.authenticated_or_gone(conn);
                    conn.reader.set_limits(self.config.limits);
                    conn.tenant = Some(p.tenant);
                    conn.operator = p.role != djinn_auth::Role::Tenant;
                    conn.torchscript = p.torchscript;
                }
                Err(e) => {
                    self.counters.auth_failures += 1;
                    tracing::info!(peer = %conn.peer, agent = %Logged(&peer.agent), error = %e, "hello refused");
                    // A refused hello after a good one: the connection closes as unauthenticated.
                    if conn.tenant.take().is_some() {
                        *self.unauthenticated.entry(conn.peer.ip()).or_default() += 1;
                    }
                    conn.operator = false;
                    conn.torchscript = false;
                    conn.closing = true;
                    let code = match e {
                        djinn_auth::AuthError::Forbidden { .. } => ErrorCode::Forbidden,
                        _ => ErrorCode::Unauthenticated,
                    };
                    return Reply::error(code, e.to_string());
                }
            }
        } else {
            tracing::debug!(peer = %conn.peer, agent = %Logged(&peer.agent), "hello");
        }
        Reply::message(DataMessage::HelloAck(self.hello.clone()))
    }

    /// Sets up this connection's RDMA channel; the reply carries the node's side.
    fn rdma_connect(&mut self, conn: &mut Conn, params: RdmaParams) -> Reply {
        let Some(ctx) = self.config.backend.rdma() else {
            return Reply::error(ErrorCode::Unexpected, "this node does not offer RDMA");
        };
        if self.rdma_open >= self.config.rdma_connections || conn.rdma.is_some() {
            return Reply::error(ErrorCode::Busy, "no RDMA connection left on this node: use TCP");
        }
        let config = SessionConfig {
            slots: params.slots.clamp(4, 1024),
            slot_size: params.slot_size.clamp(1024, 1 << 20),
            limits: self.config.limits,
        };
        // Slot and connection number: a completion of a closed connection's queue pair never
        // reaches the connection that took its slot.
        let key = ((conn.slot as u32) << 16) | (conn.id as u32 & 0xffff);
        let channel = RdmaChannel::new(ctx, key, config).and_then(|mut ch| ch.connect(&params).map(|()| ch));
        match channel {
            Ok(channel) => {
                let ours = channel.params();
                tracing::info!(peer = %conn.peer, qp = ours.qp_number, "connection moved to RDMA");
                conn.rdma = Some(channel);
                self.rdma_open += 1;
                Reply::message(DataMessage::RdmaAccept(ours))
            }
            Err(e) => Reply::error(ErrorCode::Internal, format!("cannot set up RDMA: {e}")),
        }
    }

    /// A completion of this connection's RDMA channel (its key matched).
    pub fn on_rdma_completion(&mut self, conn: &mut Conn, completion: Result<Completion, RdmaError>) {
        let Some(channel) = conn.rdma.as_mut() else { return };
        let result = completion.map_err(ChannelError::from).and_then(|c| {
            let mut alloc = Alloc {
                service: &mut self.service,
                tenant: conn.tenant,
                granted: conn.granted.as_ref(),
                counters: &mut self.counters,
                now: self.now,
            };
            channel.on_completion(c, &mut alloc)
        });
        match result {
            Ok(()) => self.process(conn),
            Err(e) => self.fail_rdma(conn, e),
        }
    }

    /// The RDMA path broke (the peer vanished, or broke the protocol): the connection ends.
    fn fail_rdma(&mut self, conn: &mut Conn, error: ChannelError) {
        self.counters.protocol_failures += 1;
        tracing::warn!(peer = %conn.peer, %error, "closing connection: its RDMA path failed");
        if conn.rdma.take().is_some() {
            self.rdma_open -= 1;
        }
        conn.closing = true;
    }

    /// The peer closed its side: a frame cut short is reported (the peer may still read).
    pub fn on_eof(&mut self, conn: &mut Conn) {
        if let Some(error) = conn.reader.on_eof() {
            self.fail(conn, error);
        }
        conn.closing = true;
    }

    fn fail(&mut self, conn: &mut Conn, error: ProtocolError) {
        self.counters.protocol_failures += 1;
        tracing::warn!(peer = %conn.peer, %error, "closing connection after a protocol error");
        self.send(conn, 0, Reply::error(error.code(), error.to_string()));
        conn.closing = true;
    }

    fn frame(&mut self, request_id: u64, reply: Reply) -> OutFrame {
        self.counters.frames_out += 1;
        OutFrame::new(request_id, &reply.message, reply.tensors).unwrap_or_else(|e| {
            tracing::error!(error = %e, "service built an inconsistent reply");
            let error = Message::error(ErrorCode::Internal, format!("inconsistent reply: {e}"));
            OutFrame::new(request_id, &error, Vec::new()).expect("an error frame has no payload")
        })
    }

    fn send(&mut self, conn: &mut Conn, request_id: u64, reply: Reply) {
        let Some(channel) = conn.rdma.as_mut() else {
            let frame = self.frame(request_id, reply);
            self.queue(conn, frame);
            return;
        };
        // A small reply is encoded straight into the RDMA session; a large one, or one that
        // does not match its message (`frame` turns it into an error), goes as a frame.
        let sent = match channel.send_message(request_id, &reply.message, &reply.tensors) {
            Ok(Some(_)) => {
                self.counters.frames_out += 1;
                Ok(())
            }
            Ok(None) | Err(ChannelError::Request(_)) => {
                let frame = self.frame(request_id, reply);
                channel.send_frame(frame)
            }
            Err(e) => Err(e),
        };
        if let Err(e) = sent {
            self.fail_rdma(conn, e);
        }
    }

    fn dispatch(&mut self, frame: Frame, to: ReplyTo) -> Option<Reply> {
        let reply = match &frame.message {
            Message::Data(DataMessage::Ping) => Reply::message(DataMessage::Pong),
            Message::Data(DataMessage::Stats) => {
                let c = &self.counters;
                let counters: Vec<(String, u64)> = [
                    ("connections_accepted", c.connections_accepted),
                    ("connections_open", c.connections_open),
                    ("connections_refused", c.connections_refused),
                    ("frames_in", c.frames_in),
                    ("frames_out", c.frames_out),
                    ("bytes_in", c.bytes_in),
                    ("bytes_out", c.bytes_out),
                    ("requests_refused", c.requests_refused),
                    ("queued_reply_bytes", self.queued_total),
                    ("quota_refusals", c.quota_refusals),
                    ("protocol_failures", c.protocol_failures),
                    ("auth_failures", c.auth_failures),
                    ("stalled_connections", c.stalled_connections),
                    ("hello_timeouts", c.hello_timeouts),
                    ("idle_closed", c.idle_closed),
                    ("unauthenticated_refused", c.unauthenticated_refused),
                    ("accept_backoffs", c.accept_backoffs),
                    // A gauge: requests handed to other threads (executions, session steps,
                    // pushes) and not answered yet.
                    ("requests_in_flight", self.deferred as u64),
                    // Token file reloads refused (the previous tokens stay); 0 without tokens.
                    ("token_reload_failures", self.config.auth.as_ref().map_or(0, |a| a.failed_reloads())),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect();
                return self.service.stats(counters, to, &self.replier);
            }
            message if message.is_reply() => {
                let e = ProtocolError::Unexpected { kind: message.kind().name() };
                Reply::error(e.code(), format!("{e}: replies are not requests"))
            }
            _ => return self.service.handle(frame, to, &self.replier, self.now),
        };
        Some(reply)
    }
}

/// Text a peer chose, as a log line shows it: its first 64 characters with control characters
/// escaped (a newline cannot forge a log line), and how long it was when longer.
struct Logged<'a>(&'a str);

impl std::fmt::Display for Logged<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const SHOWN: usize = 64;
        for c in self.0.chars().take(SHOWN) {
            write!(f, "{}", c.escape_debug())?;
        }
        if self.0.chars().nth(SHOWN).is_some() {
            write!(f, "… ({} bytes)", self.0.len())?;
        }
        Ok(())
    }
}
