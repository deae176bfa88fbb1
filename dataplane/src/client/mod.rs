//! A client's connection to a node: one request at a time, written straight from the caller's
//! tensor memory, the reply read into a pooled buffer. The connection is a TCP stream (with TLS
//! where asked), over which frames may move to RDMA: [`tcp`] writes and reads frames on the
//! stream; [`rdma`] sets up the RDMA path and exchanges frames over it. While waiting for a reply
//! the client spins for a short while before blocking: a short reply then costs no thread
//! wake-up.

mod rdma;
mod tcp;

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use djinn_memory::BufferPool;
use djinn_proto::{
    DataMessage, ErrorCode, Frame, FrameReader, Handle, HandleInfo, Hello, Limits, Message, PROTOCOL_VERSION, Payload,
    PayloadAlloc, ProtocolError, RecvEvent, Refusal, TensorDesc,
};

use djinn_proto::rdma::SessionConfig;

use self::rdma::RdmaPath;
use crate::rdma::ChannelError;
use crate::tcp::{ClientTls, TlsWire};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    #[error("i/o error talking to {peer}: {source}")]
    Io {
        peer: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("no reply from {peer} within {timeout:?}")]
    Timeout { peer: SocketAddr, timeout: Duration },
    #[error("{peer} closed the connection")]
    Closed { peer: SocketAddr },
    #[error("protocol error from {peer}: {source}")]
    Protocol {
        peer: SocketAddr,
        #[source]
        source: ProtocolError,
    },
    #[error("{peer} answered {code:?}: {message}")]
    Remote { peer: SocketAddr, code: ErrorCode, message: String },
    #[error("{peer} answered request {request_id} with an unexpected {kind} frame")]
    UnexpectedReply { peer: SocketAddr, request_id: u64, kind: &'static str },
    #[error("request does not fit the protocol: {0}")]
    Request(ProtocolError),
    #[error("RDMA path to {peer} failed: {source}")]
    Rdma {
        peer: SocketAddr,
        #[source]
        source: ChannelError,
    },
    #[error("RDMA asked for but not usable: {0}")]
    NoRdma(String),
    #[error("TLS to {peer}: {message}")]
    Tls { peer: SocketAddr, message: String },
    /// The session is on another node now: the request goes there (see `sessions.Moved`).
    #[error("the session moved to the node at {to}, where it is {session}")]
    SessionMoved { to: String, session: Handle },
    /// The kept tensor is on another node now (see `kept.Moved`).
    #[error("the kept tensor moved to the node at {to}, where it is {}", kept.handle)]
    TensorMoved { to: String, kept: HandleInfo },
    /// The reply announced a payload larger than the request can return: refused before any
    /// memory was taken for it, and the connection closed (its bytes are never read).
    #[error("{peer} announced a reply payload of {announced} bytes where this request returns at most {bound}")]
    ReplyTooLarge { peer: SocketAddr, announced: u64, bound: u64 },
    /// The reply holds another tensor than the one asked for (a kept tensor's bytes under
    /// another descriptor).
    #[error("{peer} answered with a {got} tensor where {expected} was asked for")]
    WrongTensor { peer: SocketAddr, expected: Box<TensorDesc>, got: Box<TensorDesc> },
    /// A listing went on past its bound (a node answering "more" without end).
    #[error("{peer} went on listing {what} past {entries} entries in {pages} pages")]
    ListTooLong { peer: SocketAddr, what: &'static str, pages: usize, entries: usize },
    /// A page of a listing that does not move the listing forward (the same page again) or
    /// breaks its order.
    #[error("{peer} sent a page of {what} that {problem}")]
    BadListPage { peer: SocketAddr, what: &'static str, problem: &'static str },
}

impl ClientError {
    /// The error code when the node refused the request.
    pub fn remote_code(&self) -> Option<ErrorCode> {
        match self {
            Self::Remote { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// What became of one request of several: its reply, or why there is none.
pub type Outcome = Result<Frame, ClientError>;

/// Which transport carries frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// RDMA when both ends have an active device that reaches the other, else TCP.
    #[default]
    Auto,
    Rdma,
    Tcp,
}

impl std::str::FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "rdma" => Ok(Self::Rdma),
            "tcp" => Ok(Self::Tcp),
            _ => Err(format!("{s:?} is not a transport: use auto, rdma or tcp")),
        }
    }
}

#[derive(Clone)]
pub struct ClientOptions {
    pub transport: Transport,
    /// The RDMA device to use (the first active one when `None`).
    pub rdma_device: Option<String>,
    /// Receive slots of the RDMA path.
    pub rdma: SessionConfig,
    /// How long to poll without blocking for a reply before sleeping in `poll(2)`.
    pub spin: Duration,
    /// Longest wait for a reply (and for a write to make progress); `None` waits forever.
    pub timeout: Option<Duration>,
    /// Longest wait for a TCP connection to open, when shorter than `timeout`: a host that is
    /// down answers nothing, and a client failing over should not wait a whole request's time.
    pub connect_timeout: Duration,
    pub limits: Limits,
    /// Free reply buffers kept for reuse, bytes.
    pub pool_bytes: u64,
    /// The token the hello presents (empty: none, for a node that needs none).
    pub token: String,
    /// The tenant, by name, that a node's or an operator's token acts for (empty: its own
    /// name).
    pub tenant: String,
    /// The largest reply payload taken (by default [`DEFAULT_MAX_REPLY_PAYLOAD`]); a request
    /// that determines its reply's size bounds it further ([`ClientConn::request_within`]). A
    /// larger one is refused before anything is allocated for it: the request fails with
    /// [`ClientError::ReplyTooLarge`] and the connection is closed.
    pub max_reply_payload: u64,
    /// Speak TLS to the node (whose certificate these roots must vouch for). Frames stay on
    /// TCP then unless `transport` asks for RDMA by name: RDMA is not encrypted.
    pub tls: Option<ClientTls>,
}

/// Every field but the token, which shows only whether there is one: options end up in logs.
impl std::fmt::Debug for ClientOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientOptions")
            .field("transport", &self.transport)
            .field("rdma_device", &self.rdma_device)
            .field("rdma", &self.rdma)
            .field("spin", &self.spin)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("limits", &self.limits)
            .field("pool_bytes", &self.pool_bytes)
            .field("token", &if self.token.is_empty() { "" } else { "<redacted>" })
            .field("tenant", &self.tenant)
            .field("max_reply_payload", &self.max_reply_payload)
            .field("tls", &self.tls)
            .finish()
    }
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            transport: Transport::default(),
            rdma_device: None,
            rdma: SessionConfig::default(),
            spin: Duration::from_micros(200),
            timeout: Some(Duration::from_secs(60)),
            connect_timeout: Duration::from_secs(5),
            limits: Limits::default(),
            pool_bytes: 1 << 30,
            token: String::new(),
            tenant: String::new(),
            max_reply_payload: DEFAULT_MAX_REPLY_PAYLOAD,
            tls: None,
        }
    }
}

/// The largest reply payload a client takes by default: the outputs of one execution (whose
/// size the request does not tell) up to 4 GiB.
pub const DEFAULT_MAX_REPLY_PAYLOAD: u64 = 4 << 30;

/// Reply memory from the pool, up to `bound` bytes. A larger payload is refused before anything
/// is allocated, and its announced length noted in `oversized` for the request to fail with.
struct PoolAlloc<'a> {
    pool: &'a BufferPool,
    bound: u64,
    oversized: &'a mut Option<u64>,
}

impl PayloadAlloc for PoolAlloc<'_> {
    fn alloc(&mut self, _message: &Message, len: usize) -> Result<Payload, Refusal> {
        if len as u64 > self.bound {
            *self.oversized = Some(len as u64);
            return Err(Refusal {
                code: ErrorCode::FrameTooLarge,
                message: format!("a reply payload of {len} bytes, where at most {} were expected", self.bound),
            });
        }
        Ok(Payload { buf: self.pool.take(len)?, reservation: None })
    }
}

/// A connection to one node.
pub struct ClientConn {
    stream: TcpStream,
    /// Set where the options ask for TLS: the stream's bytes are its records.
    tls: Option<TlsWire>,
    peer: SocketAddr,
    reader: FrameReader,
    pool: BufferPool,
    options: ClientOptions,
    head: Vec<u8>,
    next_id: u64,
    /// The largest reply payload the requests in flight may return (set by each request).
    reply_bound: u64,
    broken: bool,
    /// Set once frames go over RDMA.
    rdma: Option<RdmaPath>,
    bytes_sent: u64,
    bytes_received: u64,
}

impl std::fmt::Debug for ClientConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConn").field("peer", &self.peer).field("broken", &self.broken).finish()
    }
}

impl ClientConn {
    pub fn connect(addr: impl ToSocketAddrs, options: ClientOptions) -> Result<Self, ClientError> {
        let mut last = None;
        let addrs = addr.to_socket_addrs().map_err(|source| ClientError::Io { peer: unspecified(), source })?;
        for peer in addrs {
            let wait = options.timeout.map_or(options.connect_timeout, |t| t.min(options.connect_timeout));
            let connected = TcpStream::connect_timeout(&peer, wait);
            match connected {
                Ok(stream) => return Self::from_stream(stream, peer, options),
                Err(source) => last = Some(ClientError::Io { peer, source }),
            }
        }
        Err(last.unwrap_or(ClientError::Io {
            peer: unspecified(),
            source: io::Error::new(io::ErrorKind::InvalidInput, "address resolved to nothing"),
        }))
    }

    fn from_stream(stream: TcpStream, peer: SocketAddr, options: ClientOptions) -> Result<Self, ClientError> {
        let io_err = |source| ClientError::Io { peer, source };
        stream.set_nodelay(true).map_err(io_err)?;
        stream.set_nonblocking(true).map_err(io_err)?;
        let tls = match &options.tls {
            Some(tls) => Some(tls.connect(peer.ip()).map_err(|e| ClientError::Tls { peer, message: e.to_string() })?),
            None => None,
        };
        let mut conn = Self {
            stream,
            tls,
            peer,
            reader: FrameReader::new(options.limits),
            pool: BufferPool::new(options.pool_bytes, 64 * 1024),
            options,
            head: Vec::with_capacity(256),
            next_id: 1,
            reply_bound: 0,
            broken: false,
            rdma: None,
            bytes_sent: 0,
            bytes_received: 0,
        };
        conn.finish_handshake()?;
        Ok(conn)
    }

    /// With TLS, completes the handshake before any frame is written: a node that is not
    /// trusted is refused here, and no request waits on a handshake its own writes hold up.
    fn finish_handshake(&mut self) -> Result<(), ClientError> {
        let deadline = self.options.timeout.map(|t| Instant::now() + t);
        while let Some(tls) = &mut self.tls
            && tls.is_handshaking()
        {
            let step = match tls.flush(&mut &self.stream) {
                Ok(()) => tls.read_records(&mut &self.stream).map_err(|e| (e, libc::POLLIN)),
                Err(e) => Err((e, libc::POLLOUT)),
            };
            match step {
                Ok(()) => {}
                Err((e, events)) if e.kind() == io::ErrorKind::WouldBlock => self.wait(events, deadline)?,
                Err((e, _)) if e.kind() == io::ErrorKind::Interrupted => {}
                Err((source, _)) => return Err(ClientError::Io { peer: self.peer, source }),
            }
        }
        Ok(())
    }

    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    pub fn bytes_received(&self) -> u64 {
        self.bytes_received
    }

    /// Sends `ours` and returns the peer's hello; a peer speaking another protocol version is
    /// refused with an error naming both versions.
    pub fn hello(&mut self, ours: Hello) -> Result<Hello, ClientError> {
        let reply = self.request(&Message::Data(DataMessage::Hello(ours)), &[])?;
        let Message::Data(DataMessage::HelloAck(theirs)) = reply.message else {
            return Err(ClientError::UnexpectedReply {
                peer: self.peer,
                request_id: reply.request_id,
                kind: reply.message.kind().name(),
            });
        };
        if theirs.protocol_version != PROTOCOL_VERSION {
            let source = ProtocolError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: theirs.protocol_version };
            return Err(ClientError::Protocol { peer: self.peer, source });
        }
        Ok(theirs)
    }

    /// False once the connection failed; a new one is needed.
    pub fn is_usable(&self) -> bool {
        !self.broken
    }

    /// Sends `message` with the bytes of its tensors and waits for the reply. An `Error` reply
    /// becomes [`ClientError::Remote`].
    pub fn request(&mut self, message: &Message, tensors: &[&[u8]]) -> Result<Frame, ClientError> {
        self.request_within(message, tensors, u64::MAX)
    }

    /// [`Self::request`] for a request whose reply payload is at most `bound` bytes (a kept
    /// tensor's size, say): a larger one (or one over `max_reply_payload`) fails the request
    /// with [`ClientError::ReplyTooLarge`] before anything is allocated for it.
    pub fn request_within(&mut self, message: &Message, tensors: &[&[u8]], bound: u64) -> Result<Frame, ClientError> {
        if self.broken {
            return Err(ClientError::Closed { peer: self.peer });
        }
        self.reply_bound = bound.min(self.options.max_reply_payload);
        let request_id = self.next_id;
        self.next_id += 1;
        let result = if self.rdma.is_some() {
            self.request_rdma(request_id, &[(message, tensors)]).and_then(|()| self.take_rdma_reply())
        } else {
            self.send(request_id, message, tensors).and_then(|()| self.receive(request_id))
        };
        if let Err(e) = &result {
            // A refused request leaves the stream in step; anything else may not.
            if !matches!(e, ClientError::Remote { .. } | ClientError::Request(_)) {
                self.broken = true;
            }
        }
        result
    }

    /// Sends `first`, a request without payload, and `then` without waiting between them, and
    /// returns both outcomes: two requests that must go in order in one round trip over TCP,
    /// where `first`'s reply is small, so writing `then` cannot stall on it. Over RDMA they go
    /// one after the other: the node takes memory for a request's payload as it arrives, before
    /// it has acted on the request before it (a hello that changes what this connection may
    /// do). Over TCP, an error that ends the connection while the two are sent is the error.
    pub fn request_two(
        &mut self,
        first: &Message,
        then: (&Message, &[&[u8]]),
    ) -> Result<(Outcome, Outcome), ClientError> {
        if self.rdma.is_some() {
            let one = self.request(first, &[]);
            let two = match self.is_usable() {
                true => self.request(then.0, then.1),
                false => Err(ClientError::Closed { peer: self.peer }),
            };
            return Ok((one, two));
        }
        if self.broken {
            return Err(ClientError::Closed { peer: self.peer });
        }
        self.reply_bound = self.options.max_reply_payload;
        let (id1, id2) = (self.next_id, self.next_id + 1);
        self.next_id += 2;
        let sent = self.send(id1, first, &[]).and_then(|()| self.send(id2, then.0, then.1));
        let result = match sent {
            // The peer may have refused the first and closed: its answer says why.
            Err(e) => match self.receive(id1) {
                Err(refused @ ClientError::Remote { .. }) => Ok((Err(refused), Err(e))),
                _ => Err(e),
            },
            Ok(()) => {
                let one = self.receive(id1);
                let two = self.receive(id2);
                Ok((one, two))
            }
        };
        let fine = |r: &Result<Frame, ClientError>| matches!(r, Ok(_) | Err(ClientError::Remote { .. }));
        if !matches!(&result, Ok((a, b)) if fine(a) && fine(b)) {
            self.broken = true;
        }
        result
    }

    /// Sends every request of `batch` before waiting for the first reply, so that they are in
    /// flight together, and returns each one's outcome in order. Over TCP they go one after
    /// the other (a stream of large requests written before any reply is read could fill both
    /// directions' buffers and stall). An error that ends the connection ends the batch. Each
    /// reply's payload is at most `bound` bytes, as for [`Self::request_within`].
    pub fn request_batch(
        &mut self,
        batch: &[(&Message, &[&[u8]])],
        bound: u64,
    ) -> Result<Vec<Result<Frame, ClientError>>, ClientError> {
        if self.rdma.is_none() {
            let mut out = Vec::with_capacity(batch.len());
            for (message, tensors) in batch {
                match self.request_within(message, tensors, bound) {
                    Err(e) if !self.is_usable() => return Err(e),
                    outcome => out.push(outcome),
                }
            }
            return Ok(out);
        }
        if self.broken {
            return Err(ClientError::Closed { peer: self.peer });
        }
        self.reply_bound = bound.min(self.options.max_reply_payload);
        let first = self.next_id;
        self.next_id += batch.len() as u64;
        let result = self.request_rdma(first, batch);
        if result.is_err() {
            self.broken = true;
        }
        result?;
        let peer = self.peer;
        let replies = self.rdma.as_mut().map(|path| path.replies.drain(..)).into_iter().flatten();
        Ok(replies.map(|r| r.unwrap_or(Err(ClientError::Closed { peer }))).collect())
    }
}

/// The outcome of a request from the event that answers it.
fn reply_of(peer: SocketAddr, request_id: u64, event: RecvEvent) -> Result<Frame, ClientError> {
    match event {
        RecvEvent::Frame(Frame {
            message: Message::Data(DataMessage::Error { code, message }),
            request_id: id,
            ..
        }) if id == request_id || id == 0 => Err(ClientError::Remote { peer, code, message }),
        RecvEvent::Frame(frame) if frame.request_id == request_id => Ok(frame),
        RecvEvent::Frame(frame) => {
            Err(ClientError::UnexpectedReply { peer, request_id: frame.request_id, kind: frame.message.kind().name() })
        }
        RecvEvent::Rejected { refusal, .. } => {
            Err(ClientError::Protocol { peer, source: ProtocolError::MalformedMeta(refusal.message) })
        }
        RecvEvent::Fatal(source) => Err(ClientError::Protocol { peer, source }),
    }
}

fn unspecified() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_names_no_token() {
        let options = ClientOptions { token: "s3cret-token".into(), ..ClientOptions::default() };
        let shown = format!("{options:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("<redacted>") && shown.contains("timeout"), "{shown}");
        assert!(format!("{:?}", ClientOptions::default()).contains("token: \"\""));
    }
}
