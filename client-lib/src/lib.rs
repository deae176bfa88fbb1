//! The Djinn client: a connection to a node with typed operations on named tensors.
//!
//! ```no_run
//! use djinn_client::{Client, DType};
//! let mut client = Client::connect("127.0.0.1:7070").unwrap();
//! let bytes: Vec<u8> = (0..16u8).collect();
//! client.put("x", DType::F32, &[2, 2], &bytes).unwrap();
//! let x = client.get("x").unwrap();
//! assert_eq!(x.bytes(), &bytes[..]);
//! ```

pub mod cluster;
pub mod control;

use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

use djinn_dataplane::client::ClientConn;
pub use djinn_dataplane::client::{ClientError, ClientOptions, DEFAULT_MAX_REPLY_PAYLOAD, Transport};
pub use djinn_dataplane::rdma::Registrations;
pub use djinn_dataplane::tcp::ClientTls;
pub use djinn_proto::{
    Breakpoint, DType, ErrorCode, Fingerprint, Handle, HandleInfo, Hello, KeptEntry, ListEntry, ModelInfo,
    SessionEntry, Signal, TensorDesc, TensorSource, Value,
};
use djinn_proto::{
    BreakpointMessage, DataMessage, Frame, KeptMessage, Message, ModelMessage, Payload, SessionMessage, payload_layout,
    transports,
};

pub use cluster::{
    Archive, ClusterClient, ClusterError, ClusterStats, FailoverOptions, RemoteParked, RemoteSession, RemoteTensor,
    Target,
};
pub use control::{
    BlockEstimate, CA_ENV, ControlClient, ControlError, Forward, GraphAnnotations, LiveNode, ModelDescription, Moving,
    PlaceOptions, Placed,
};

/// A tensor received from a node: its descriptor and its bytes, in a buffer that goes back to
/// the client's pool when dropped.
#[derive(Debug)]
pub struct Tensor {
    pub desc: TensorDesc,
    data: Option<djinn_proto::Payload>,
}

impl Tensor {
    pub fn bytes(&self) -> &[u8] {
        self.data.as_ref().map_or(&[], |p| p.buf.as_slice())
    }
}

impl AsRef<[u8]> for Tensor {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

/// An input tensor: borrowed bytes, written to the socket from where they are.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    pub dtype: DType,
    pub shape: &'a [u64],
    pub bytes: &'a [u8],
}

/// A model's output: a value whose `Value::Tensor(i)` name `tensor(i)`, all in one received
/// buffer (returned to the client's pool when this is dropped), and whose `Value::Handle`s
/// name tensors kept on the node, described in `kept`.
#[derive(Debug)]
pub struct Output {
    pub value: Value,
    pub tensors: Vec<TensorDesc>,
    pub kept: Vec<HandleInfo>,
    offsets: Vec<u64>,
    payload: Option<Payload>,
}

impl Output {
    /// The bytes of output tensor `i`.
    pub fn tensor_bytes(&self, i: usize) -> &[u8] {
        let (Some(desc), Some(&offset)) = (self.tensors.get(i), self.offsets.get(i)) else { return &[] };
        let start = offset as usize;
        self.payload.as_ref().map_or(&[], |p| &p.buf.as_slice()[start..start + desc.byte_len as usize])
    }
}

/// A run stopped at a breakpoint: its handle on the node (for [`Client::resume`],
/// [`Client::inspect`] and [`Client::abort`]), the block it stopped after, and that block's
/// output when it was asked for.
#[derive(Debug)]
pub struct Paused {
    pub parked: Handle,
    pub block: u32,
    pub activation: Option<Output>,
}

/// How far a resumed run went: to the end, or to a later breakpoint.
#[derive(Debug)]
pub enum Resumed {
    Done(Output),
    Paused(Paused),
}

/// What `register_model` did.
#[derive(Debug, Clone)]
pub struct Registration {
    pub fingerprint: Fingerprint,
    /// The node's account of the model, when this call uploaded it; `None` when the node
    /// already held it (nothing was sent but the fingerprint).
    pub uploaded: Option<ModelInfo>,
}

/// Bytes per registration chunk.
pub const REGISTER_CHUNK: usize = 16 << 20;

/// Most pages one listing ([`Client::list`], [`Client::list_kept`], [`Client::list_sessions`])
/// reads, and most entries it gathers: a node's pages hold up to a thousand entries, and a node
/// holds far fewer than this many. A node that answers "more" past these (or with a page that
/// does not advance) ends the listing with an error, so a client's memory stays bounded.
pub const MAX_LIST_PAGES: usize = 1024;
/// See [`MAX_LIST_PAGES`].
pub const MAX_LIST_ENTRIES: usize = 1 << 20;
/// Entries asked for per page of [`Client::list`] (the node may send fewer).
const LIST_PAGE: u32 = 1024;

/// Byte and request counts of one client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientStats {
    pub requests: u64,
    pub errors: u64,
    pub reconnects: u64,
}

pub struct Client {
    conn: ClientConn,
    node: Hello,
    addrs: Vec<std::net::SocketAddr>,
    options: ClientOptions,
    stats: ClientStats,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("peer", &self.conn.peer()).field("node", &self.node.agent).finish()
    }
}

impl Client {
    pub fn connect(addr: impl ToSocketAddrs) -> Result<Self, ClientError> {
        Self::connect_with(addr, ClientOptions::default())
    }

    /// Connects and exchanges hellos; a node speaking another protocol version is refused with
    /// an error naming both versions.
    pub fn connect_with(addr: impl ToSocketAddrs, options: ClientOptions) -> Result<Self, ClientError> {
        let addrs: Vec<_> =
            addr.to_socket_addrs().map_err(|source| ClientError::Io { peer: unspecified(), source })?.collect();
        let (conn, node) = Self::open(&addrs, &options)?;
        Ok(Self { conn, node, addrs, options, stats: ClientStats::default() })
    }

    /// Connects and exchanges hellos; a node speaking another protocol version is refused with
    /// an error naming both versions.
    fn open(addrs: &[std::net::SocketAddr], options: &ClientOptions) -> Result<(ClientConn, Hello), ClientError> {
        let limits = options.limits;
        let mut conn = ClientConn::connect(addrs, options.clone())?;
        // With TLS, frames stay on TCP unless RDMA (which TLS does not cover) is asked for.
        let tcp_only =
            options.transport == Transport::Tcp || (options.transport == Transport::Auto && options.tls.is_some());
        let port = match tcp_only {
            true => Err(djinn_dataplane::rdma::NoRdma::NoDevice(None)),
            false => djinn_dataplane::rdma::find_port(options.rdma_device.as_deref()),
        };
        let ours = if port.is_ok() { transports::TCP | transports::RDMA } else { transports::TCP };
        let hello = Hello {
            token: options.token.clone(),
            tenant: options.tenant.clone(),
            ..Hello::new(&limits, ours, concat!("djinn-client/", env!("CARGO_PKG_VERSION")))
        };
        let node = conn.hello(hello)?;
        let offered = node.transports & transports::RDMA != 0;
        match (options.transport, port, offered) {
            _ if tcp_only => {}
            (_, Ok(port), true) => match conn.upgrade_to_rdma(&port, options.rdma) {
                Ok(()) => tracing::info!(%port, "frames go over RDMA"),
                Err(e) if options.transport == Transport::Rdma => return Err(e),
                Err(e) => {
                    tracing::info!(error = %e, "RDMA set-up failed; using TCP");
                    let options = ClientOptions { transport: Transport::Tcp, ..options.clone() };
                    return Self::open(addrs, &options);
                }
            },
            (Transport::Rdma, Err(e), _) => return Err(ClientError::NoRdma(e.to_string())),
            (Transport::Rdma, Ok(_), false) => return Err(ClientError::NoRdma("the node does not offer RDMA".into())),
            (_, Err(e), _) => tracing::debug!("{e}: using TCP"),
            (_, Ok(_), false) => tracing::debug!("the node does not offer RDMA: using TCP"),
        }
        Ok((conn, node))
    }

    /// The transport frames go over: "rdma" or "tcp".
    pub fn transport(&self) -> &'static str {
        self.conn.transport()
    }

    /// Sends a request; when the connection is found broken (the node restarted, a network
    /// blip), connects again once and repeats it. Every request that goes through here is
    /// safe to repeat.
    fn call(&mut self, message: &Message, tensors: &[&[u8]]) -> Result<Frame, ClientError> {
        self.call_within(message, tensors, u64::MAX)
    }

    /// [`Self::call`] for a request whose reply payload is at most `bound` bytes (and at most
    /// the options' `max_reply_payload`): a larger one is refused before it is allocated.
    fn call_within(&mut self, message: &Message, tensors: &[&[u8]], bound: u64) -> Result<Frame, ClientError> {
        self.stats.requests += 1;
        if !self.conn.is_usable() {
            self.reconnect()?;
        }
        let result = match self.conn.request_within(message, tensors, bound) {
            Err(e) if !self.conn.is_usable() && is_connection_loss(&e) => {
                tracing::info!(error = %e, "connection lost; reconnecting");
                self.reconnect()?;
                self.conn.request_within(message, tensors, bound)
            }
            other => other,
        };
        if result.is_err() {
            self.stats.errors += 1;
        }
        result
    }

    fn reconnect(&mut self) -> Result<(), ClientError> {
        let (conn, node) = Self::open(&self.addrs, &self.options)?;
        self.conn = conn;
        self.node = node;
        self.stats.reconnects += 1;
        Ok(())
    }

    /// How often the memory this client received replies into over RDMA was registered with
    /// the device, and how often a registration was kept from an earlier reply (its reply
    /// buffers are recycled, so a buffer is registered once). Counted since the last
    /// (re)connection.
    pub fn rdma_registrations(&self) -> Registrations {
        self.conn.rdma_registrations()
    }

    /// Bytes moved and requests made by this client.
    pub fn client_stats(&self) -> (ClientStats, u64, u64) {
        (self.stats, self.conn.bytes_sent(), self.conn.bytes_received())
    }

    /// Uploads a model (its blocks' TorchScript archives, in execution order) unless this
    /// tenant already holds one with the same fingerprint on the node; `progress(sent, total)`
    /// follows the upload. The model is the tenant's alone.
    pub fn register_model<B: AsRef<[u8]>>(
        &mut self,
        blocks: &[B],
        progress: impl FnMut(u64, u64),
    ) -> Result<Registration, ClientError> {
        self.register_model_as(Fingerprint::of_blocks(blocks), blocks, false, progress)
    }

    /// Registers public weights: held once on the node for every tenant that registers the same
    /// bytes as public (nothing is uploaded when another already did).
    pub fn register_public_model<B: AsRef<[u8]>>(
        &mut self,
        blocks: &[B],
        progress: impl FnMut(u64, u64),
    ) -> Result<Registration, ClientError> {
        self.register_model_as(Fingerprint::of_blocks(blocks), blocks, true, progress)
    }

    /// [`Self::register_model`] with the blocks' fingerprint computed already.
    pub(crate) fn register_model_as<B: AsRef<[u8]>>(
        &mut self,
        fingerprint: Fingerprint,
        blocks: &[B],
        public: bool,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<Registration, ClientError> {
        let lens: Vec<u64> = blocks.iter().map(|b| b.as_ref().len() as u64).collect();
        let Some(upload) = self.register_begin(fingerprint, &lens, public)? else {
            return Ok(Registration { fingerprint, uploaded: None });
        };
        let total: u64 = lens.iter().sum();
        let mut offset = 0u64;
        for block in blocks {
            for chunk in block.as_ref().chunks(REGISTER_CHUNK) {
                offset = self.register_chunk(upload, offset, chunk)?;
                progress(offset, total);
            }
        }
        self.register_commit(fingerprint, upload)
    }

    /// Registers the model `fingerprint` whose archives are `lens` long, reading them in
    /// chunks of at most `chunk` bytes from `read(offset, len)` (another node's copy, say) as
    /// they are sent: nothing is read when the node holds the model already.
    pub fn register_streamed<C: AsRef<[u8]>, E: From<ClientError>>(
        &mut self,
        fingerprint: Fingerprint,
        lens: &[u64],
        public: bool,
        chunk: u64,
        mut read: impl FnMut(u64, u64) -> Result<C, E>,
    ) -> Result<Registration, E> {
        let Some(upload) = self.register_begin(fingerprint, lens, public)? else {
            return Ok(Registration { fingerprint, uploaded: None });
        };
        let total: u64 = lens.iter().sum();
        let mut offset = 0u64;
        while offset < total {
            let bytes = read(offset, chunk.max(1).min(total - offset))?;
            offset = self.register_chunk(upload, offset, bytes.as_ref())?;
        }
        Ok(self.register_commit(fingerprint, upload)?)
    }

    /// Starts a registration: its upload's number, or `None` when the node holds the model.
    fn register_begin(
        &mut self,
        fingerprint: Fingerprint,
        lens: &[u64],
        public: bool,
    ) -> Result<Option<u64>, ClientError> {
        let begin = ModelMessage::RegisterBegin { fingerprint, blocks: lens.to_vec(), public };
        let reply = self.call(&Message::Model(begin), &[])?;
        match reply.message {
            Message::Model(ModelMessage::RegisterReady { registered: true, .. }) => Ok(None),
            Message::Model(ModelMessage::RegisterReady { upload, .. }) => Ok(Some(upload)),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Sends the upload's bytes at `offset`; how many the node has received.
    fn register_chunk(&mut self, upload: u64, offset: u64, chunk: &[u8]) -> Result<u64, ClientError> {
        let desc = TensorDesc::new(DType::U8, vec![chunk.len() as u64]).map_err(ClientError::Request)?;
        let message = Message::Model(ModelMessage::RegisterChunk { upload, offset, chunk: desc });
        // An upload belongs to its connection: chunks go without the reconnecting retry.
        let reply = self.conn.request(&message, &[chunk])?;
        match reply.message {
            Message::Model(ModelMessage::RegisterProgress { received, .. }) => Ok(received),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    fn register_commit(&mut self, fingerprint: Fingerprint, upload: u64) -> Result<Registration, ClientError> {
        let reply = self.conn.request(&Message::Model(ModelMessage::RegisterCommit { upload }), &[])?;
        match reply.message {
            Message::Model(ModelMessage::Registered { model }) => {
                Ok(Registration { fingerprint, uploaded: Some(model) })
            }
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Runs a registered model on positional `inputs`, whose `Value::Tensor(i)` name
    /// `tensors[i]` and whose `Value::Handle`s name tensors kept on this node.
    pub fn execute(
        &mut self,
        fingerprint: &Fingerprint,
        inputs: &[Value],
        tensors: &[TensorRef<'_>],
    ) -> Result<Output, ClientError> {
        self.run(fingerprint, inputs, tensors, false)
    }

    /// [`Self::execute`], with the output tensors kept on the node: they come back as handles.
    pub fn execute_keep(
        &mut self,
        fingerprint: &Fingerprint,
        inputs: &[Value],
        tensors: &[TensorRef<'_>],
    ) -> Result<Output, ClientError> {
        self.run(fingerprint, inputs, tensors, true)
    }

    fn run(
        &mut self,
        fingerprint: &Fingerprint,
        inputs: &[Value],
        tensors: &[TensorRef<'_>],
        keep: bool,
    ) -> Result<Output, ClientError> {
        let (descs, bytes) = describe(tensors)?;
        let message = Message::Model(ModelMessage::Execute {
            fingerprint: *fingerprint,
            tensors: descs,
            inputs: inputs.to_vec(),
            keep,
            until: None,
        });
        let reply = self.call(&message, &bytes)?;
        self.output(reply)
    }

    fn output(&self, reply: Frame) -> Result<Output, ClientError> {
        match reply.message {
            Message::Model(ModelMessage::ExecuteReply { tensors, output, kept }) => {
                output_of(tensors, output, kept, reply.payload)
            }
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    fn paused(&self, reply: Frame) -> Result<Paused, ClientError> {
        match reply.message {
            Message::Breakpoint(BreakpointMessage::Paused { parked, block, tensors, activation }) => {
                let activation = activation.map(|v| output_of(tensors, v, Vec::new(), reply.payload)).transpose()?;
                Ok(Paused { parked, block, activation })
            }
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    fn resumed(&self, reply: Frame) -> Result<Resumed, ClientError> {
        match reply.message {
            Message::Model(ModelMessage::ExecuteReply { .. }) => self.output(reply).map(Resumed::Done),
            _ => self.paused(reply).map(Resumed::Paused),
        }
    }

    /// Runs a registered model up to the breakpoint `until` (blocks `0..=until.block`) and
    /// parks the request on the node, its activation kept there (and sent back when
    /// `until.send_activation`). `keep`: the outputs of the run, once resumed to its end, stay
    /// on the node.
    pub fn execute_until(
        &mut self,
        fingerprint: &Fingerprint,
        inputs: &[Value],
        tensors: &[TensorRef<'_>],
        keep: bool,
        until: Breakpoint,
    ) -> Result<Paused, ClientError> {
        let (descs, bytes) = describe(tensors)?;
        let message = Message::Model(ModelMessage::Execute {
            fingerprint: *fingerprint,
            tensors: descs,
            inputs: inputs.to_vec(),
            keep,
            until: Some(until),
        });
        let reply = self.call(&message, &bytes)?;
        self.paused(reply)
    }

    /// Runs a parked request on from the block after its breakpoint, on its activation or on
    /// `activation` (a value naming `tensors`, of the parked activation's structure, shapes
    /// and dtypes), to the end or to the later breakpoint `until`.
    pub fn resume(
        &mut self,
        parked: Handle,
        activation: Option<(&Value, &[TensorRef<'_>])>,
        until: Option<Breakpoint>,
    ) -> Result<Resumed, ClientError> {
        let (value, tensors) = activation.map_or((None, &[][..]), |(v, t)| (Some(v.clone()), t));
        let (descs, bytes) = describe(tensors)?;
        let reply = self.call(
            &Message::Breakpoint(BreakpointMessage::Resume { parked, tensors: descs, activation: value, until }),
            &bytes,
        )?;
        self.resumed(reply)
    }

    /// A parked request's activation.
    pub fn inspect(&mut self, parked: Handle) -> Result<Paused, ClientError> {
        let reply = self.call(&Message::Breakpoint(BreakpointMessage::Inspect { parked }), &[])?;
        self.paused(reply)
    }

    /// Drops a parked request (a session step parked ends with the state it had before).
    pub fn abort(&mut self, parked: Handle) -> Result<(), ClientError> {
        let reply = self.call(&Message::Breakpoint(BreakpointMessage::Abort { parked }), &[])?;
        match reply.message {
            Message::Breakpoint(BreakpointMessage::Aborted) => Ok(()),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Opens a session of a registered model whose initial state is `state` (see docs/python.md's
    /// contract for stateful models); the state stays on the node between steps. `reserve` is
    /// the state's expected size at its largest, in bytes.
    pub fn session_open(
        &mut self,
        fingerprint: &Fingerprint,
        state: &[TensorRef<'_>],
        reserve: u64,
    ) -> Result<Handle, ClientError> {
        let (descs, bytes) = describe(state)?;
        let reply = self.call(
            &Message::Session(SessionMessage::Open { fingerprint: *fingerprint, state: descs, reserve }),
            &bytes,
        )?;
        match reply.message {
            Message::Session(SessionMessage::Opened { session }) => Ok(session),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// One step of a session: its model runs on `inputs` followed by the session's state.
    pub fn session_step(
        &mut self,
        session: Handle,
        inputs: &[Value],
        tensors: &[TensorRef<'_>],
    ) -> Result<Output, ClientError> {
        let (descs, bytes) = describe(tensors)?;
        let message =
            Message::Session(SessionMessage::Step { session, tensors: descs, inputs: inputs.to_vec(), until: None });
        let reply = self.call(&message, &bytes)?;
        self.output(reply)
    }

    /// A session step stopped at the breakpoint `until`: the session's later requests wait
    /// until it is resumed to its end (the state is updated then) or aborted (it stays as it
    /// was).
    pub fn session_step_until(
        &mut self,
        session: Handle,
        inputs: &[Value],
        tensors: &[TensorRef<'_>],
        until: Breakpoint,
    ) -> Result<Paused, ClientError> {
        let (descs, bytes) = describe(tensors)?;
        let message = Message::Session(SessionMessage::Step {
            session,
            tensors: descs,
            inputs: inputs.to_vec(),
            until: Some(until),
        });
        let reply = self.call(&message, &bytes)?;
        self.paused(reply)
    }

    /// Tells the node what the session's agent does next (it takes effect after the session's
    /// earlier requests; the node answers at once).
    pub fn session_signal(&mut self, session: Handle, signal: Signal) -> Result<(), ClientError> {
        let reply = self.call(&Message::Session(SessionMessage::Signal { session, signal }), &[])?;
        match reply.message {
            Message::Session(SessionMessage::Signaled) => Ok(()),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// A one-time grant for another node to move a session of the model `fingerprint` here,
    /// for this client's tenant (given to that node in [`Self::session_move`]).
    pub fn grant_session(&mut self, fingerprint: &Fingerprint) -> Result<String, ClientError> {
        let reply = self.call(&Message::Session(SessionMessage::ReceiveGrant { fingerprint: *fingerprint }), &[])?;
        match reply.message {
            Message::Kept(KeptMessage::PushGranted { grant }) => Ok(grant),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Moves the session to the node at `to` (as this node reaches it), on that node's
    /// `grant` ([`Self::grant_session`]), after the session's earlier requests: where it is
    /// then, and its handle there (another node, if it had moved already). The state goes
    /// node to node; if the move fails, the session stays here, whole.
    pub fn session_move(&mut self, session: Handle, to: &str, grant: &str) -> Result<(String, Handle), ClientError> {
        let message = Message::Session(SessionMessage::Move { session, to: to.to_owned(), grant: grant.to_owned() });
        let reply = self.call(&message, &[])?;
        match reply.message {
            Message::Session(SessionMessage::Moved { to, session }) => Ok((to, session)),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Frees the session's state on the node.
    pub fn session_close(&mut self, session: Handle) -> Result<(), ClientError> {
        let reply = self.call(&Message::Session(SessionMessage::Close { session }), &[])?;
        match reply.message {
            Message::Session(SessionMessage::Closed) => Ok(()),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Uploads a tensor to be kept in the node's device memory.
    pub fn keep(&mut self, tensor: TensorRef<'_>) -> Result<HandleInfo, ClientError> {
        let desc = TensorDesc::new(tensor.dtype, tensor.shape.to_vec()).map_err(ClientError::Request)?;
        let reply = self.call(&Message::Kept(KeptMessage::Keep { tensor: desc }), &[tensor.bytes])?;
        match reply.message {
            Message::Kept(KeptMessage::Kept { kept }) => Ok(kept),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// The bytes of a tensor kept on the node, of any size the node takes (see
    /// [`Self::fetch_as`] when its descriptor is known).
    pub fn fetch(&mut self, handle: Handle) -> Result<Tensor, ClientError> {
        let reply = self.call_within(&Message::Kept(KeptMessage::Fetch { handle }), &[], self.node.max_payload)?;
        match reply.message {
            Message::Data(DataMessage::GetReply { tensor }) => Ok(Tensor { desc: tensor, data: reply.payload }),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// The bytes of the tensor kept on the node as `handle`, which `desc` describes (as the node
    /// said when it kept it): a reply larger than `desc` fails with
    /// [`ClientError::ReplyTooLarge`] before it is read, one of another descriptor with
    /// [`ClientError::WrongTensor`].
    pub fn fetch_as(&mut self, handle: Handle, desc: &TensorDesc) -> Result<Tensor, ClientError> {
        let reply = self.call_within(&Message::Kept(KeptMessage::Fetch { handle }), &[], desc.byte_len)?;
        match reply.message {
            Message::Data(DataMessage::GetReply { tensor }) if tensor == *desc => {
                Ok(Tensor { desc: tensor, data: reply.payload })
            }
            Message::Data(DataMessage::GetReply { tensor }) => {
                let (expected, got) = (Box::new(desc.clone()), Box::new(tensor));
                Err(ClientError::WrongTensor { peer: self.conn.peer(), expected, got })
            }
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Frees tensors kept on the node; returns how many it held.
    pub fn release(&mut self, handles: &[Handle]) -> Result<u32, ClientError> {
        let reply = self.call(&Message::Kept(KeptMessage::Release { handles: handles.to_vec() }), &[])?;
        match reply.message {
            Message::Kept(KeptMessage::Released { released }) => Ok(released),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Has the node copy one of its tensors into the device memory of the node at `to`, where
    /// it is kept; returns the handle there and the path the bytes took.
    /// Has this node copy `source` into the memory of the node at `to` (one of its cluster's
    /// nodes), on `grant`, which that node gave for it ([`Self::grant_push`]): the copy is this
    /// tenant's there. Returns its handle there and the path its bytes took.
    pub fn push(&mut self, source: TensorSource, to: &str, grant: &str) -> Result<(HandleInfo, String), ClientError> {
        let message = Message::Kept(KeptMessage::Push { source, to: to.to_owned(), grant: grant.to_owned() });
        let reply = self.call(&message, &[])?;
        match reply.message {
            Message::Kept(KeptMessage::Pushed { kept, path }) => Ok((kept, path)),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Asks this node for a one-time grant to receive `tensor` for this tenant, pushed by
    /// another node ([`Self::push`] there); good for a minute.
    pub fn grant_push(&mut self, tensor: &TensorDesc) -> Result<String, ClientError> {
        let reply = self.call(&Message::Kept(KeptMessage::PushGrant { tensor: tensor.clone() }), &[])?;
        match reply.message {
            Message::Kept(KeptMessage::PushGranted { grant }) => Ok(grant),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    pub fn unregister_model(&mut self, fingerprint: &Fingerprint) -> Result<(), ClientError> {
        let reply = self.call(&Message::Model(ModelMessage::Unregister { fingerprint: *fingerprint }), &[])?;
        match reply.message {
            Message::Model(ModelMessage::UnregisterAck) => Ok(()),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    pub fn list_models(&mut self) -> Result<Vec<ModelInfo>, ClientError> {
        let reply = self.call(&Message::Model(ModelMessage::ListModels), &[])?;
        match reply.message {
            Message::Model(ModelMessage::ModelList { models }) => Ok(models),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Bytes `offset..offset + len` of a model's archives, read back from the node: the
    /// archives' lengths, whether the node holds the model as public, and the bytes.
    pub fn read_archives(
        &mut self,
        fingerprint: &Fingerprint,
        offset: u64,
        len: u64,
    ) -> Result<(Vec<u64>, bool, Tensor), ClientError> {
        let message = Message::Model(ModelMessage::ReadArchives { fingerprint: *fingerprint, offset, len });
        let reply = self.call_within(&message, &[], len)?;
        match reply.message {
            Message::Model(ModelMessage::ArchiveBytes { blocks, public, chunk }) => {
                Ok((blocks, public, Tensor { desc: chunk, data: reply.payload }))
            }
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// The sessions on the node: this tenant's, or, for a node's or an operator's token, every
    /// tenant's (by name). Bounded as [`MAX_LIST_PAGES`] says.
    pub fn list_sessions(&mut self) -> Result<Vec<SessionEntry>, ClientError> {
        self.list_pages(
            "sessions",
            |client, after| {
                let message = Message::Session(SessionMessage::List { after: after.copied().unwrap_or(0) });
                let reply = client.call_within(&message, &[], 0)?;
                match reply.message {
                    Message::Session(SessionMessage::SessionList { sessions, more }) => Ok((sessions, more)),
                    _ => Err(unexpected(&client.conn, reply)),
                }
            },
            |e| e.session.id,
        )
    }

    /// The tensors kept on the node: this tenant's, or, for a node's or an operator's token,
    /// every tenant's (by name). Bounded as [`MAX_LIST_PAGES`] says.
    pub fn list_kept(&mut self) -> Result<Vec<KeptEntry>, ClientError> {
        self.list_pages(
            "kept tensors",
            |client, after| {
                let message = Message::Kept(KeptMessage::List { after: after.copied().unwrap_or(0) });
                let reply = client.call_within(&message, &[], 0)?;
                match reply.message {
                    Message::Kept(KeptMessage::KeptList { tensors, more }) => Ok((tensors, more)),
                    _ => Err(unexpected(&client.conn, reply)),
                }
            },
            |e| e.kept.handle.id,
        )
    }

    /// Reads a listing page by page: `page(client, after)` fetches the entries that follow the
    /// key `after` (from the start when `None`) and whether more follow; `key` is an entry's
    /// place in the listing's order. Each page must hold entries in strictly increasing order
    /// past the previous page's last, so the cursor always advances; and the listing ends
    /// within [`MAX_LIST_PAGES`] pages and [`MAX_LIST_ENTRIES`] entries.
    fn list_pages<E, K: Ord>(
        &mut self,
        what: &'static str,
        mut page: impl FnMut(&mut Self, Option<&K>) -> Result<(Vec<E>, bool), ClientError>,
        key: impl Fn(&E) -> K,
    ) -> Result<Vec<E>, ClientError> {
        let mut all = Vec::new();
        let mut after: Option<K> = None;
        for pages in 1..=MAX_LIST_PAGES {
            let (entries, more) = page(self, after.as_ref())?;
            let bad = |problem| ClientError::BadListPage { peer: self.conn.peer(), what, problem };
            if more && entries.is_empty() {
                return Err(bad("is empty but says more follow"));
            }
            for entry in &entries {
                let k = key(entry);
                if after.as_ref().is_some_and(|last| k <= *last) {
                    return Err(bad("does not come after the entries listed before it"));
                }
                after = Some(k);
            }
            if all.len() + entries.len() > MAX_LIST_ENTRIES {
                return Err(ClientError::ListTooLong { peer: self.conn.peer(), what, pages, entries: all.len() });
            }
            all.extend(entries);
            if !more {
                return Ok(all);
            }
        }
        Err(ClientError::ListTooLong { peer: self.conn.peer(), what, pages: MAX_LIST_PAGES, entries: all.len() })
    }

    /// Says that the tensor under `handle` is kept at the node at `to` now, as `kept` (pushed
    /// there): the node frees it and answers requests that name it with where it went.
    pub fn forward(&mut self, handle: Handle, to: &str, kept: &HandleInfo) -> Result<(), ClientError> {
        let message = Message::Kept(KeptMessage::Forward { handle, to: to.to_owned(), kept: kept.clone() });
        let reply = self.call(&message, &[])?;
        match reply.message {
            Message::Kept(KeptMessage::Forwarded) => Ok(()),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Whether the connection can still carry requests (not broken, not closed).
    pub fn is_usable(&self) -> bool {
        self.conn.is_usable()
    }

    /// What the node announced: its version, transports and limits.
    pub fn node(&self) -> &Hello {
        &self.node
    }

    /// One round trip; returns its duration.
    pub fn ping(&mut self) -> Result<Duration, ClientError> {
        let start = Instant::now();
        let reply = self.call(&Message::Data(DataMessage::Ping), &[])?;
        match reply.message {
            Message::Data(DataMessage::Pong) => Ok(start.elapsed()),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Stores `bytes` as tensor `name`; returns whether it replaced one. The bytes are written
    /// to the socket from `bytes` itself.
    pub fn put(&mut self, name: &str, dtype: DType, shape: &[u64], bytes: &[u8]) -> Result<bool, ClientError> {
        let tensor = TensorDesc::new(dtype, shape.to_vec()).map_err(ClientError::Request)?;
        let message = Message::Data(DataMessage::Put { name: name.to_owned(), tensor });
        let reply = self.call(&message, &[bytes])?;
        match reply.message {
            Message::Data(DataMessage::PutAck { replaced }) => Ok(replaced),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// The named tensor `name`: at most as large as the node takes a tensor (and the options'
    /// `max_reply_payload`).
    pub fn get(&mut self, name: &str) -> Result<Tensor, ClientError> {
        let message = Message::Data(DataMessage::Get { name: name.to_owned() });
        let reply = self.call_within(&message, &[], self.node.max_payload)?;
        match reply.message {
            Message::Data(DataMessage::GetReply { tensor }) => Ok(Tensor { desc: tensor, data: reply.payload }),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Fetches several tensors with the requests in flight together (over RDMA; one after the
    /// other over TCP), in the order of `names`. The first failure is returned.
    pub fn get_many(&mut self, names: &[&str]) -> Result<Vec<Tensor>, ClientError> {
        self.stats.requests += names.len() as u64;
        if !self.conn.is_usable() {
            self.reconnect()?;
        }
        let messages: Vec<Message> =
            names.iter().map(|name| Message::Data(DataMessage::Get { name: (*name).to_owned() })).collect();
        let batch: Vec<(&Message, &[&[u8]])> = messages.iter().map(|m| (m, &[][..])).collect();
        let replies = self.conn.request_batch(&batch, self.node.max_payload).inspect_err(|_| self.stats.errors += 1)?;
        let mut out = Vec::with_capacity(replies.len());
        for reply in replies {
            let reply = reply.inspect_err(|_| self.stats.errors += 1)?;
            match reply.message {
                Message::Data(DataMessage::GetReply { tensor }) => {
                    out.push(Tensor { desc: tensor, data: reply.payload })
                }
                _ => return Err(unexpected(&self.conn, reply)),
            }
        }
        Ok(out)
    }

    pub fn delete(&mut self, name: &str) -> Result<(), ClientError> {
        let reply = self.call(&Message::Data(DataMessage::Delete { name: name.to_owned() }), &[])?;
        match reply.message {
            Message::Data(DataMessage::DeleteAck) => Ok(()),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Every tensor on the node, in name order (fetched page by page, bounded as
    /// [`MAX_LIST_PAGES`] says).
    pub fn list(&mut self) -> Result<Vec<ListEntry>, ClientError> {
        self.list_pages(
            "tensors",
            |client, after: Option<&String>| {
                let message = Message::Data(DataMessage::List { after: after.cloned(), limit: LIST_PAGE });
                let reply = client.call_within(&message, &[], 0)?;
                match reply.message {
                    Message::Data(DataMessage::ListReply { entries, .. }) if entries.len() > LIST_PAGE as usize => {
                        let problem = "holds more entries than were asked for";
                        Err(ClientError::BadListPage { peer: client.conn.peer(), what: "tensors", problem })
                    }
                    Message::Data(DataMessage::ListReply { entries, more }) => Ok((entries, more)),
                    _ => Err(unexpected(&client.conn, reply)),
                }
            },
            |e| e.name.clone(),
        )
    }

    /// The node's counters, by name.
    pub fn stats(&mut self) -> Result<Vec<(String, u64)>, ClientError> {
        let reply = self.call(&Message::Data(DataMessage::Stats), &[])?;
        match reply.message {
            Message::Data(DataMessage::StatsReply { counters }) => Ok(counters),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }
}

fn output_of(
    tensors: Vec<TensorDesc>,
    value: Value,
    kept: Vec<HandleInfo>,
    payload: Option<Payload>,
) -> Result<Output, ClientError> {
    let (offsets, _) = payload_layout(&tensors).map_err(ClientError::Request)?;
    Ok(Output { value, tensors, kept, offsets, payload })
}

/// A reply that is not the one asked for: where a session went (see
/// [`ClientError::SessionMoved`]), or an error.
fn unexpected(conn: &ClientConn, reply: Frame) -> ClientError {
    match reply.message {
        Message::Session(SessionMessage::Moved { to, session }) => ClientError::SessionMoved { to, session },
        Message::Kept(KeptMessage::Moved { to, kept }) => ClientError::TensorMoved { to, kept },
        other => {
            ClientError::UnexpectedReply { peer: conn.peer(), request_id: reply.request_id, kind: other.kind().name() }
        }
    }
}

fn unspecified() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([0, 0, 0, 0], 0))
}

/// The connection itself failed (as opposed to the node refusing the request).
fn is_connection_loss(e: &ClientError) -> bool {
    matches!(e, ClientError::Io { .. } | ClientError::Closed { .. })
}

/// The descriptors and bytes of tensors to send.
fn describe<'a>(tensors: &[TensorRef<'a>]) -> Result<(Vec<TensorDesc>, Vec<&'a [u8]>), ClientError> {
    let descs = tensors
        .iter()
        .map(|t| TensorDesc::new(t.dtype, t.shape.to_vec()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(ClientError::Request)?;
    Ok((descs, tensors.iter().map(|t| t.bytes).collect()))
}
