//! Node-to-node moves: a thread that pushes this node's tensors into other nodes' device memory.
//! It holds one connection per peer (opened on first use, opened again after a failure) and
//! speaks the ordinary protocol to it: the bytes go as a `Keep` request, and the peer answers
//! with a handle of its own. Where the peer needs a token, the mover presents the node's and
//! acts for the tenant whose tensor it is, so the handle on the peer is that tenant's.
//!
//! The path built so far is staging: the tensor's bytes leave from host memory (copied there
//! first from a GPU), and the peer copies them to its device. Between the two hosts they go over
//! RDMA where both nodes have it (a large tensor is RDMA-WRITten into the host memory the peer
//! takes for it), else over TCP.

use std::collections::HashMap;
use std::net::ToSocketAddrs;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use djinn_dataplane::proto::{ErrorCode, Hello, Limits, Message, SharedBytes, TensorDesc, transports};
use djinn_dataplane::rdma::{RdmaPort, SessionConfig};
use djinn_dataplane::tcp::{ClientConn, ClientError, ClientOptions, Replier, Reply, ReplyTo};
use tch::Tensor;

use crate::convert::OutputTensor;

/// How the bytes of a push travel, by the transport between the hosts; reported in the `Pushed`
/// reply.
pub fn staging_path(transport: &str) -> &'static str {
    if transport == "rdma" { "staging-rdma" } else { "staging-tcp" }
}

/// What is pushed: bytes already in host memory (a named tensor), or a kept tensor.
pub enum PushSource {
    Bytes { desc: TensorDesc, bytes: SharedBytes },
    Tensor(Tensor),
}

struct PushJob {
    source: PushSource,
    to: String,
    /// The tenant the tensor belongs to, by name (empty where nodes need no token).
    tenant: String,
    reply_to: ReplyTo,
    replier: Replier,
}

pub struct Mover {
    tx: Option<Sender<PushJob>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Mover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mover").finish_non_exhaustive()
    }
}

impl Mover {
    /// `timeout` bounds each push's wait on its peer; `token` is this node's, for peers that
    /// need one; pushes go over RDMA on `rdma` to peers that offer it.
    pub fn start(timeout: Duration, token: String, rdma: Option<RdmaPort>) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let thread =
            std::thread::Builder::new().name("djinn-mover".into()).spawn(move || run(rx, timeout, token, rdma))?;
        Ok(Self { tx: Some(tx), thread: Some(thread) })
    }

    pub fn push(&self, source: PushSource, to: String, tenant: String, reply_to: ReplyTo, replier: &Replier) {
        let job = PushJob { source, to, tenant, reply_to, replier: replier.clone() };
        if let Some(tx) = &self.tx
            && let Err(e) = tx.send(job)
        {
            let PushJob { reply_to, replier, .. } = e.into_inner();
            replier.send(reply_to, Reply::error(ErrorCode::Internal, "the mover has stopped"));
        }
    }
}

impl Drop for Mover {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A connection to a peer, for one tenant.
type PeerKey = (String, String);

fn run(rx: Receiver<PushJob>, timeout: Duration, token: String, rdma: Option<RdmaPort>) {
    let mut peers: HashMap<PeerKey, ClientConn> = HashMap::new();
    let options = ClientOptions {
        token,
        timeout: Some(timeout),
        connect_timeout: timeout.min(Duration::from_secs(5)),
        // Replies to pushes are small; no pool of reply buffers is needed.
        pool_bytes: 0,
        ..ClientOptions::default()
    };
    while let Ok(PushJob { source, to, tenant, reply_to, replier }) = rx.recv() {
        let started = std::time::Instant::now();
        let result = push(&mut peers, &options, rdma.as_ref(), source, (to.clone(), tenant));
        let reply = match result {
            Ok((kept, path)) => {
                let seconds = started.elapsed().as_secs_f64();
                tracing::debug!(peer = %to, bytes = kept.tensor.byte_len, seconds, path, "pushed");
                Reply::message(Message::Pushed { kept, path: path.into() })
            }
            Err((code, message)) => {
                tracing::info!(peer = %to, %message, "push failed");
                Reply::error(code, message)
            }
        };
        replier.send(reply_to, reply);
    }
}

/// Pushes `source` to the peer of `key`; the handle the peer gives it and the path it took.
fn push(
    peers: &mut HashMap<PeerKey, ClientConn>,
    options: &ClientOptions,
    rdma: Option<&RdmaPort>,
    source: PushSource,
    key: PeerKey,
) -> Result<(djinn_dataplane::proto::HandleInfo, &'static str), (ErrorCode, String)> {
    let (desc, bytes): (TensorDesc, SharedBytes) = match source {
        PushSource::Bytes { desc, bytes } => (desc, bytes),
        PushSource::Tensor(t) => {
            let (bytes, desc) = OutputTensor::new(t, None).map_err(|e| (e.code(), e.to_string()))?;
            (desc, std::sync::Arc::new(bytes))
        }
    };
    let message = Message::Keep { tensor: desc };
    let (to, tenant) = (key.0.as_str(), key.1.as_str());
    // A cached connection found broken is opened again once: the peer may have restarted since.
    let mut retried = false;
    loop {
        let conn = match peers.get_mut(&key).filter(|c| c.is_usable()) {
            Some(conn) => conn,
            None => {
                let conn = connect(to, tenant, options, rdma)?;
                peers.entry(key.clone()).insert_entry(conn).into_mut()
            }
        };
        let result = conn.request(&message, &[bytes.as_ref().as_ref()]);
        let broken = !conn.is_usable();
        let path = staging_path(conn.transport());
        match result {
            Ok(reply) => {
                return match reply.message {
                    Message::Kept { kept } => Ok((kept, path)),
                    other => Err((ErrorCode::Internal, format!("the peer at {to} answered a {}", other.kind().name()))),
                };
            }
            Err(ClientError::Remote { code, message, .. }) => {
                return Err((code, format!("the peer at {to} refused the tensor: {message}")));
            }
            Err(e) => {
                peers.remove(&key);
                if retried || !broken {
                    return Err((ErrorCode::PeerUnreachable, format!("pushing to {to} failed: {e}")));
                }
                tracing::info!(peer = %to, error = %e, "connection to the peer lost; opening it again");
                retried = true;
            }
        }
    }
}

/// Opens a connection to the peer at `to`, for `tenant`, over RDMA on `rdma` when the peer
/// offers it too. A peer that refuses the node's token says so in its own code (a
/// misconfiguration, not an unreachable peer).
fn connect(
    to: &str,
    tenant: &str,
    options: &ClientOptions,
    rdma: Option<&RdmaPort>,
) -> Result<ClientConn, (ErrorCode, String)> {
    let unreachable = |e: String| (ErrorCode::PeerUnreachable, e);
    let addrs: Vec<_> =
        to.to_socket_addrs().map_err(|e| unreachable(format!("{to:?} is not a reachable address: {e}")))?.collect();
    let open = |rdma: Option<&RdmaPort>| {
        let mut conn = ClientConn::connect(&addrs[..], options.clone())
            .map_err(|e| unreachable(format!("cannot reach {to}: {e}")))?;
        let ours = if rdma.is_some() { transports::TCP | transports::RDMA } else { transports::TCP };
        let hello = Hello {
            token: options.token.clone(),
            tenant: tenant.to_owned(),
            ..Hello::new(&Limits::default(), ours, concat!("djinn-node/", env!("CARGO_PKG_VERSION")))
        };
        match conn.hello(hello) {
            Ok(theirs) => Ok((conn, theirs)),
            Err(ClientError::Remote { code, message, .. }) => {
                Err((code, format!("the peer at {to} refused this node's hello: {message}")))
            }
            Err(e) => Err(unreachable(format!("hello to {to} failed: {e}"))),
        }
    };
    let (mut conn, theirs) = open(rdma)?;
    let Some(port) = rdma.filter(|_| theirs.transports & transports::RDMA != 0) else { return Ok(conn) };
    if let Err(e) = conn.upgrade_to_rdma(port, SessionConfig::default()) {
        // Both ends have RDMA but it does not connect them (another fabric, say): TCP, on this
        // connection if the peer only refused the upgrade, else on a new one.
        tracing::warn!(peer = %to, error = %e, "no RDMA to the peer; pushing over TCP");
        if !conn.is_usable() {
            conn = open(None)?.0;
        }
    }
    Ok(conn)
}
