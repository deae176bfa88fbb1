//! A client's connection to a node: one request at a time, written straight from the caller's
//! tensor memory, the reply read into a pooled buffer. While waiting for a reply it spins for a
//! short while before blocking in `poll(2)`: a short reply then costs no thread wake-up.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use std::sync::Arc;

use djinn_memory::BufferPool;

use super::tls::{ClientTls, TlsWire};
use crate::rdma::{ChannelError, Completion, RdmaChannel, RdmaContext, RdmaError, RdmaPort, Registrations};
use djinn_proto::rdma::SessionConfig;
use djinn_proto::{OutFrame, SharedBytes};

use djinn_proto::{
    ErrorCode, Frame, FrameReader, Hello, Limits, Message, PROTOCOL_VERSION, Payload, PayloadAlloc, ProtocolError,
    RecvEvent, Refusal, ZEROS, check_tensor_lens, encode_head, paddings,
};

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
    /// The largest reply payload taken; a larger one is refused before anything is allocated
    /// (its bytes are skipped) and the request fails.
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
            max_reply_payload: u64::MAX,
            tls: None,
        }
    }
}

/// Reply memory from the pool, up to the largest reply payload the options allow.
struct PoolAlloc<'a>(&'a BufferPool, u64);

impl PayloadAlloc for PoolAlloc<'_> {
    fn alloc(&mut self, _message: &Message, len: usize) -> Result<Payload, Refusal> {
        if len as u64 > self.1 {
            return Err(Refusal {
                code: ErrorCode::FrameTooLarge,
                message: format!("a reply payload of {len} bytes, where at most {} were expected", self.1),
            });
        }
        Ok(Payload { buf: self.0.take(len)?, reservation: None })
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
        let reply = self.request(&Message::Hello(ours), &[])?;
        let Message::HelloAck(theirs) = reply.message else {
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
        if self.broken {
            return Err(ClientError::Closed { peer: self.peer });
        }
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

    fn send(&mut self, request_id: u64, message: &Message, tensors: &[&[u8]]) -> Result<(), ClientError> {
        encode_head(&mut self.head, request_id, message).map_err(ClientError::Request)?;
        let descs = message.tensors();
        check_tensor_lens(descs, tensors.iter().map(|t| t.len())).map_err(ClientError::Request)?;
        let mut slices: Vec<&[u8]> = Vec::with_capacity(1 + 2 * tensors.len());
        slices.push(&self.head);
        for (padding, bytes) in paddings(descs).zip(tensors) {
            if padding > 0 {
                slices.push(&ZEROS[..padding]);
            }
            slices.push(bytes);
        }
        let deadline = self.options.timeout.map(|t| Instant::now() + t);
        let (mut index, mut skip) = (0, 0usize);
        while index < slices.len() {
            let mut iov = [IoSlice::new(&[]); 64];
            let rest = std::iter::once(&slices[index][skip..]).chain(slices[index + 1..].iter().copied());
            let mut count = 0;
            for (dst, src) in iov.iter_mut().zip(rest) {
                *dst = IoSlice::new(src);
                count += 1;
            }
            let sent = match &mut self.tls {
                None => send_vectored(&self.stream, &iov[..count]),
                Some(tls) => tls.write_vectored(&mut &self.stream, &iov[..count]),
            };
            match sent {
                Ok(mut n) => {
                    self.bytes_sent += n as u64;
                    while n > 0 {
                        let left = slices[index].len() - skip;
                        if n >= left {
                            n -= left;
                            index += 1;
                            skip = 0;
                        } else {
                            skip += n;
                            n = 0;
                        }
                    }
                    while index < slices.len() && slices[index].len() == skip {
                        index += 1;
                        skip = 0;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait(libc::POLLOUT, deadline)?,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    // The node may have closed after telling us why (a fatal protocol error).
                    return Err(self.error_reply_after_reset().unwrap_or(ClientError::Io { peer: self.peer, source }));
                }
            }
        }
        // TLS records made of the frame and not written yet go before the reply is awaited.
        while let Some(tls) = &mut self.tls {
            match tls.flush(&mut &self.stream) {
                Ok(()) => break,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait(libc::POLLOUT, deadline)?,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => return Err(ClientError::Io { peer: self.peer, source }),
            }
        }
        Ok(())
    }

    fn error_reply_after_reset(&mut self) -> Option<ClientError> {
        self.stream.set_nonblocking(true).ok()?;
        let old = self.options.timeout.replace(Duration::from_millis(100));
        let reply = self.receive(0).err();
        self.options.timeout = old;
        reply.filter(|e| matches!(e, ClientError::Remote { .. }))
    }

    fn receive(&mut self, request_id: u64) -> Result<Frame, ClientError> {
        let peer = self.peer;
        let deadline = self.options.timeout.map(|t| Instant::now() + t);
        let mut spin_until = Instant::now() + self.options.spin;
        loop {
            if let Some(event) = self.reader.next_event(&mut PoolAlloc(&self.pool, self.options.max_reply_payload)) {
                return reply_of(peer, request_id, event);
            }
            let target = self.reader.read_target();
            let mut iov = [IoSliceMut::new(target.payload), IoSliceMut::new(target.staging)];
            let iov = if iov[0].is_empty() { &mut iov[1..] } else { &mut iov[..] };
            let received = match &mut self.tls {
                None => recv_vectored(&self.stream, iov),
                Some(tls) => tls.read_vectored(&mut &self.stream, iov),
            };
            match received {
                Ok(0) => {
                    return Err(match self.reader.on_eof() {
                        Some(source) => ClientError::Protocol { peer, source },
                        None => ClientError::Closed { peer },
                    });
                }
                Ok(n) => {
                    self.bytes_received += n as u64;
                    self.reader.on_read(n);
                    spin_until = Instant::now() + self.options.spin;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // TLS records of ours that wait (a handshake's end) go out while we wait.
                    let unsent = self.tls.as_mut().is_some_and(|tls| {
                        let _ = tls.flush(&mut &self.stream);
                        tls.wants_write()
                    });
                    if Instant::now() >= spin_until {
                        self.wait(if unsent { libc::POLLIN | libc::POLLOUT } else { libc::POLLIN }, deadline)?;
                    } else {
                        // Give the core away while spinning: when the node shares it with us,
                        // a pure busy-wait would keep it from answering.
                        std::thread::yield_now();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => return Err(ClientError::Io { peer, source }),
            }
        }
    }

    /// Blocks until the socket is ready for `events` or the deadline passes.
    fn wait(&self, events: libc::c_short, deadline: Option<Instant>) -> Result<(), ClientError> {
        loop {
            let timeout_ms = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ClientError::Timeout {
                            peer: self.peer,
                            timeout: self.options.timeout.unwrap_or_default(),
                        });
                    }
                    left.as_millis().clamp(1, i32::MAX as u128) as i32
                }
            };
            let mut fd = libc::pollfd { fd: self.stream.as_raw_fd(), events, revents: 0 };
            // SAFETY: one valid pollfd for the duration of the call.
            let rc = unsafe { libc::poll(&mut fd, 1, timeout_ms) };
            if rc > 0 {
                return Ok(());
            }
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(ClientError::Io { peer: self.peer, source: e });
                }
            }
        }
    }
}

/// The outcome of a request from the event that answers it.
fn reply_of(peer: SocketAddr, request_id: u64, event: RecvEvent) -> Result<Frame, ClientError> {
    match event {
        RecvEvent::Frame(Frame { message: Message::Error { code, message }, request_id: id, .. })
            if id == request_id || id == 0 =>
        {
            Err(ClientError::Remote { peer, code, message })
        }
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

/// The client's RDMA path: its own context (one queue pair) and the channel.
struct RdmaPath {
    // The channel (queue pair) goes before the context.
    channel: RdmaChannel,
    ctx: Arc<RdmaContext>,
    completions: Vec<Result<Completion, RdmaError>>,
    /// The outcomes of the requests in flight, by request id from the first (kept between
    /// requests so that a single request allocates nothing here).
    replies: Vec<Option<Result<Frame, ClientError>>>,
}

/// Bytes the caller lends for the length of one request, as a frame's payload. The frame
/// lives in the RDMA path, which [`ClientConn::request_rdma`] holds as a local while the
/// request runs and puts back only once its session holds no frame any more (every reply in,
/// every WRITE complete, every announced transfer written or refused); on an error, a timeout
/// or a panic the path is dropped instead, its queue pair first. So no `Lent` outlives the
/// borrow it was made from, and the caller may free the memory as soon as the call returns.
struct Lent {
    ptr: *const u8,
    len: usize,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: see the type's comment.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

// SAFETY: read-only access to memory the caller keeps alive for the request.
unsafe impl Send for Lent {}
// SAFETY: as above.
unsafe impl Sync for Lent {}

impl ClientConn {
    /// How often the memory replies were received into over RDMA was registered, and how
    /// often a registration was kept from an earlier reply (none over TCP).
    pub fn rdma_registrations(&self) -> Registrations {
        self.rdma.as_ref().map(|path| path.channel.registrations()).unwrap_or_default()
    }

    /// "rdma" once frames go over RDMA, else "tcp".
    pub fn transport(&self) -> &'static str {
        if self.rdma.is_some() { "rdma" } else { "tcp" }
    }

    /// Moves this connection's frames to RDMA: sets up a queue pair on `port`, exchanges the
    /// two sides' parameters over TCP, connects. The TCP connection stays (it tells when the
    /// node goes away).
    pub fn upgrade_to_rdma(&mut self, port: &RdmaPort, config: SessionConfig) -> Result<(), ClientError> {
        let peer = self.peer;
        let rdma = |source: ChannelError| ClientError::Rdma { peer, source };
        let ctx = RdmaContext::new(port, RdmaChannel::completion_entries(&config)).map_err(|e| rdma(e.into()))?;
        let mut channel = RdmaChannel::new(&ctx, 0, config).map_err(rdma)?;
        // The context is this connection's alone, and the node may see what it sends here.
        channel.keep_registrations();
        let ask = channel.params();
        let reply = self.request(&Message::RdmaConnect(ask), &[])?;
        let Message::RdmaAccept(node) = reply.message else {
            return Err(ClientError::UnexpectedReply {
                peer,
                request_id: reply.request_id,
                kind: reply.message.kind().name(),
            });
        };
        if (node.slots, node.slot_size) != (ask.slots, ask.slot_size) {
            self.broken = true;
            return Err(ClientError::NoRdma(format!(
                "the node uses {} slots of {} bytes, not {} of {}",
                node.slots, node.slot_size, ask.slots, ask.slot_size
            )));
        }
        if let Err(e) = channel.connect(&node) {
            // The node already routes this connection's replies to RDMA: it is unusable now.
            self.broken = true;
            return Err(rdma(e));
        }
        self.rdma = Some(RdmaPath { channel, ctx, completions: Vec::new(), replies: Vec::new() });
        Ok(())
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
    /// directions' buffers and stall). An error that ends the connection ends the batch.
    pub fn request_batch(
        &mut self,
        batch: &[(&Message, &[&[u8]])],
    ) -> Result<Vec<Result<Frame, ClientError>>, ClientError> {
        if self.rdma.is_none() {
            let mut out = Vec::with_capacity(batch.len());
            for (message, tensors) in batch {
                match self.request(message, tensors) {
                    Err(e) if !self.is_usable() => return Err(e),
                    outcome => out.push(outcome),
                }
            }
            return Ok(out);
        }
        if self.broken {
            return Err(ClientError::Closed { peer: self.peer });
        }
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

    /// The outcome of the one request [`Self::request_rdma`] just completed.
    fn take_rdma_reply(&mut self) -> Result<Frame, ClientError> {
        let reply = self.rdma.as_mut().and_then(|path| path.replies.pop()).flatten();
        reply.unwrap_or(Err(ClientError::Closed { peer: self.peer }))
    }

    /// Sends `batch` over RDMA as requests `first..` and waits for all their replies, which it
    /// leaves in the path's `replies`, in order. The path comes back to the connection only
    /// when none of the batch's frames (which lend the caller's memory) is left in it; else it
    /// is dropped here, and the connection with it.
    fn request_rdma(&mut self, first: u64, batch: &[(&Message, &[&[u8]])]) -> Result<(), ClientError> {
        let Some(mut path) = self.rdma.take() else { return Err(ClientError::Closed { peer: self.peer }) };
        let result = self.exchange_rdma(&mut path, first, batch);
        if result.is_ok() && !path.channel.holds_frames() {
            self.rdma = Some(path);
        } else {
            // Dropping the path destroys the queue pair before the registrations and the
            // frames go: nothing reads the lent memory after this.
            self.broken = true;
        }
        result
    }

    fn exchange_rdma(
        &mut self,
        path: &mut RdmaPath,
        first: u64,
        batch: &[(&Message, &[&[u8]])],
    ) -> Result<(), ClientError> {
        let peer = self.peer;
        let rdma = |source| match source {
            ChannelError::Request(e) => ClientError::Request(e),
            source => ClientError::Rdma { peer, source },
        };
        for (request_id, (message, tensors)) in (first..).zip(batch) {
            // A small request is encoded straight into the session; a large one is written
            // from the caller's memory.
            let sent = match path.channel.send_message(request_id, message, tensors).map_err(rdma)? {
                Some(len) => len as u64,
                None => {
                    let lent = tensors
                        .iter()
                        .map(|t| Arc::new(Lent { ptr: t.as_ptr(), len: t.len() }) as SharedBytes)
                        .collect();
                    let frame = OutFrame::new(request_id, message, lent).map_err(ClientError::Request)?;
                    let len = frame.len();
                    path.channel.send_frame(frame).map_err(rdma)?;
                    len
                }
            };
            self.bytes_sent += sent;
        }
        let deadline = self.options.timeout.map(|t| Instant::now() + t);
        let mut spin_until = Instant::now() + self.options.spin;
        let replies = &mut path.replies;
        replies.clear();
        replies.resize_with(batch.len(), || None);
        let mut missing = batch.len();
        loop {
            if missing > 0
                && let Some(event) = path.channel.poll_event()
            {
                let id = match &event {
                    RecvEvent::Frame(frame) => frame.request_id,
                    RecvEvent::Rejected { request_id, .. } => *request_id,
                    RecvEvent::Fatal(_) => 0,
                };
                let Some(slot) =
                    id.checked_sub(first).and_then(|i| replies.get_mut(i as usize)).filter(|r| r.is_none())
                else {
                    // Not one of ours (or a connection-level error, id 0): the connection is done.
                    return Err(reply_of(peer, first, event).err().unwrap_or(ClientError::UnexpectedReply {
                        peer,
                        request_id: id,
                        kind: "reply",
                    }));
                };
                let outcome = reply_of(peer, id, event);
                if let Ok(frame) = &outcome {
                    self.bytes_received += frame.payload.as_ref().map_or(0, |p| p.buf.len() as u64);
                }
                *slot = Some(outcome);
                missing -= 1;
                continue;
            }
            // A node may answer before taking a large request's payload (a refusal): its
            // transfer is then refused or written before the request counts as done.
            if missing == 0 && path.channel.writes_done() && !path.channel.holds_frames() {
                return Ok(());
            }
            let mut completions = std::mem::take(&mut path.completions);
            path.ctx.poll(|c| completions.push(c)).map_err(|e| ClientError::Rdma { peer, source: e.into() })?;
            let progressed = !completions.is_empty();
            for c in completions.drain(..) {
                let c = c.map_err(|e| ClientError::Rdma { peer, source: e.into() })?;
                path.channel
                    .on_completion(c, &mut PoolAlloc(&self.pool, self.options.max_reply_payload))
                    .map_err(|source| ClientError::Rdma { peer, source })?;
            }
            path.completions = completions;
            if progressed {
                spin_until = Instant::now() + self.options.spin;
                continue;
            }
            if Instant::now() < spin_until {
                // Polling the completion queue is a memory read, no system call: spin on it
                // (the node is on another host, or at least another core).
                std::hint::spin_loop();
                continue;
            }
            // Sleep until a completion, or the node's end of the TCP connection moving (it
            // closes when the node goes away), or the deadline.
            path.ctx.arm().map_err(|e| ClientError::Rdma { peer, source: e.into() })?;
            let mut any = false;
            path.ctx
                .poll(|c| {
                    any = true;
                    path.completions.push(c);
                })
                .map_err(|e| ClientError::Rdma { peer, source: e.into() })?;
            if any {
                continue;
            }
            let mut fds = [
                libc::pollfd { fd: path.ctx.fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.stream.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            let timeout_ms = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ClientError::Timeout { peer, timeout: self.options.timeout.unwrap_or_default() });
                    }
                    left.as_millis().clamp(1, i32::MAX as u128) as i32
                }
            };
            // SAFETY: two valid pollfds for the duration of the call.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
            if rc > 0 {
                if fds[0].revents != 0 {
                    path.ctx.ack_events();
                }
                if fds[1].revents != 0 {
                    let mut byte = [0u8; 1];
                    // SAFETY: a one-byte read into a live buffer.
                    let n = unsafe { libc::recv(self.stream.as_raw_fd(), byte.as_mut_ptr().cast(), 1, libc::MSG_PEEK) };
                    if n == 0 || (n < 0 && io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock) {
                        return Err(ClientError::Closed { peer });
                    }
                }
            }
        }
    }
}

fn unspecified() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 0))
}

/// `sendmsg` with `MSG_NOSIGNAL`: a closed peer is an error, never a SIGPIPE (the Python
/// extension runs in processes that do not ignore it).
fn send_vectored(stream: &TcpStream, iov: &[IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: IoSlice is ABI-compatible with iovec; msghdr is zeroed then filled.
    let n = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = iov.len();
        libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

fn recv_vectored(stream: &TcpStream, iov: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
    // SAFETY: IoSliceMut is ABI-compatible with iovec and the slices outlive the call.
    let n = unsafe { libc::readv(stream.as_raw_fd(), iov.as_ptr() as *const libc::iovec, iov.len() as libc::c_int) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
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
