//! Messages: the typed content of a frame's metadata section, and its binary encoding.
//!
//! Fields are little-endian; strings are a u16 length then UTF-8; a tensor descriptor is dtype
//! (u8), rank (u8), the dimensions (u64 each) and the byte length (u64). Decoding checks every
//! count against the bytes that remain before allocating, and rejects trailing bytes.

use super::error::{ErrorCode, ProtocolError};
use super::header::{Kind, PROTOCOL_VERSION};
use super::limits::Limits;
use super::tensor::{DType, TensorDesc};
use super::value::{Handle, Value};

/// A model's identity: BLAKE3 over its blocks' TorchScript archives (see
/// [`Fingerprint::of_blocks`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Hashes the number of blocks, then each block's length and bytes, so that no two
    /// different splits of the same bytes collide.
    pub fn of_blocks<B: AsRef<[u8]>>(blocks: &[B]) -> Self {
        let mut h = blake3::Hasher::new();
        h.update(&(blocks.len() as u64).to_le_bytes());
        for b in blocks {
            h.update(&(b.as_ref().len() as u64).to_le_bytes());
            h.update(b.as_ref());
        }
        Self(*h.finalize().as_bytes())
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 64 || !s.is_ascii() {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Self(out))
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..16])
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// One side of an RDMA connection, exchanged over the TCP connection: its queue pair and the
/// receive slots both sides use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaParams {
    pub qp_number: u32,
    pub psn: u32,
    pub gid: [u8; 16],
    /// Active MTU in bytes; both sides use the smaller.
    pub mtu: u32,
    pub slots: u32,
    pub slot_size: u32,
}

/// What a node says of a model it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    pub fingerprint: Fingerprint,
    pub blocks: u32,
    /// Bytes of parameters and buffers on the device (what the budget is charged).
    pub weight_bytes: u64,
    /// `cpu` or `cuda:N`.
    pub device: String,
    pub executions: u64,
    /// The tenants holding it, by name: listed to nodes and operators only (a tenant's own list
    /// leaves it empty, so it never learns who else holds a public model).
    pub owners: Vec<String>,
}

/// Transports a peer can speak, announced in the hello exchange.
pub mod transports {
    pub const TCP: u32 = 1 << 0;
    pub const RDMA: u32 = 1 << 1;
}

#[derive(Clone, PartialEq, Eq)]
pub struct Hello {
    pub protocol_version: u16,
    /// Bit set of [`transports`].
    pub transports: u32,
    /// The sender's limits: the peer must not send more than these.
    pub max_meta: u32,
    pub max_payload: u64,
    /// Software name and version, for logs.
    pub agent: String,
    /// How the sender's device memory meets the network (a node's: `staging`, through host
    /// memory); empty from a client.
    pub memory_path: String,
    /// The client's token (empty from a node, and where the node needs none).
    pub token: String,
    /// The tenant a node acts for when it moves that tenant's tensor to another node (empty
    /// otherwise); only a node's token may act for someone else.
    pub tenant: String,
}

impl std::fmt::Debug for Hello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hello")
            .field("protocol_version", &self.protocol_version)
            .field("transports", &self.transports)
            .field("max_meta", &self.max_meta)
            .field("max_payload", &self.max_payload)
            .field("agent", &self.agent)
            .field("memory_path", &self.memory_path)
            .field("token", &if self.token.is_empty() { "" } else { "<redacted>" })
            .field("tenant", &self.tenant)
            .finish()
    }
}

impl Hello {
    pub fn new(limits: &Limits, transports: u32, agent: impl Into<String>) -> Self {
        Self {
            protocol_version: PROTOCOL_VERSION,
            transports,
            max_meta: limits.max_meta,
            max_payload: limits.max_payload,
            agent: agent.into(),
            memory_path: String::new(),
            token: String::new(),
            tenant: String::new(),
        }
    }
}

/// A tensor kept on a node and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandleInfo {
    pub handle: Handle,
    pub tensor: TensorDesc,
}

/// A tensor a node holds: a named tensor of its store, or a kept one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TensorSource {
    Named(String),
    Handle(Handle),
}

/// What a session's client says of it between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// The agent waits on something else (a tool): its state may leave the device, to be back
    /// before `resume_in_ms` when given.
    IoWait { resume_in_ms: Option<u32> },
    /// The agent computes again soon: bring its state back to the device.
    Compute,
}

/// Where a run stops: after block `block` (blocks `0..=block` ran), with the request parked on
/// the node until it is resumed or aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breakpoint {
    pub block: u32,
    /// The reply carries the activation (block `block`'s output); else it stays on the node.
    pub send_activation: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListEntry {
    pub name: String,
    pub tensor: TensorDesc,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    Hello(Hello),
    HelloAck(Hello),
    Ping,
    Pong,
    /// Store a named tensor (its bytes are the payload), replacing one of the same name.
    Put {
        name: String,
        tensor: TensorDesc,
    },
    PutAck {
        replaced: bool,
    },
    Get {
        name: String,
    },
    /// The tensor's bytes are the payload.
    GetReply {
        tensor: TensorDesc,
    },
    Delete {
        name: String,
    },
    DeleteAck,
    /// Names in order, starting after `after`, at most `limit` of them.
    List {
        after: Option<String>,
        limit: u32,
    },
    /// `more` is true when names follow the last one returned.
    ListReply {
        entries: Vec<ListEntry>,
        more: bool,
    },
    Stats,
    StatsReply {
        counters: Vec<(String, u64)>,
    },
    Error {
        code: ErrorCode,
        message: String,
    },
    /// Asks to carry this connection's frames over RDMA from now on.
    RdmaConnect(RdmaParams),
    /// The node's side; after it, frames go over the queue pairs.
    RdmaAccept(RdmaParams),
    /// Starts uploading a model: the lengths of its blocks' archives, in execution order.
    /// A private model is the tenant's alone; a `public` one is held once on the node for
    /// every tenant that registers the same bytes as public.
    RegisterBegin {
        fingerprint: Fingerprint,
        blocks: Vec<u64>,
        public: bool,
    },
    /// `registered`: the node already holds this model and nothing needs uploading.
    RegisterReady {
        upload: u64,
        registered: bool,
    },
    /// Bytes `offset..offset + len` of the upload (the blocks' archives concatenated); the
    /// payload is the chunk, described as a u8 tensor.
    RegisterChunk {
        upload: u64,
        offset: u64,
        chunk: TensorDesc,
    },
    RegisterProgress {
        received: u64,
        total: u64,
    },
    /// Checks the fingerprint and loads the model on the node's device.
    RegisterCommit {
        upload: u64,
    },
    Registered {
        model: ModelInfo,
    },
    /// Runs a model on positional `inputs`; their tensors are the payload, or handles of
    /// tensors kept on the node. With `keep`, every output tensor stays on the node and comes
    /// back as a handle. With `until`, the run stops at that breakpoint (answered by `Paused`).
    Execute {
        fingerprint: Fingerprint,
        tensors: Vec<TensorDesc>,
        inputs: Vec<Value>,
        keep: bool,
        until: Option<Breakpoint>,
    },
    /// The output's `Value::Handle`s are described in `kept`.
    ExecuteReply {
        tensors: Vec<TensorDesc>,
        output: Value,
        kept: Vec<HandleInfo>,
    },
    Unregister {
        fingerprint: Fingerprint,
    },
    UnregisterAck,
    ListModels,
    ModelList {
        models: Vec<ModelInfo>,
    },
    /// Keeps the payload's tensor in the node's device memory.
    Keep {
        tensor: TensorDesc,
    },
    Kept {
        kept: HandleInfo,
    },
    /// Asks for a kept tensor's bytes; answered by a `GetReply`.
    Fetch {
        handle: Handle,
    },
    /// Frees kept tensors; handles the node does not hold are skipped.
    Release {
        handles: Vec<Handle>,
    },
    Released {
        released: u32,
    },
    /// Copies a tensor of this node into the device memory of the node at `to` (host:port),
    /// where it is kept. `grant` is what that node gave the tenant for it ([`Self::PushGrant`]):
    /// this node presents it there, in its hello, instead of any credential of its own.
    Push {
        source: TensorSource,
        to: String,
        grant: String,
    },
    /// Asks this node for a one-time capability to receive `tensor` for the caller's tenant,
    /// pushed from another node. Answered by `PushGranted`.
    PushGrant {
        tensor: TensorDesc,
    },
    PushGranted {
        grant: String,
    },
    /// `kept` is the handle on the peer; `path` says how the bytes went there.
    Pushed {
        kept: HandleInfo,
        path: String,
    },
    /// Opens a session of a registered model: the payload's tensors (`state`) are its initial
    /// state, which stays on the node between steps; `reserve` is the state's expected size at
    /// its largest (bytes), charged to the session budget while the state is on the device.
    SessionOpen {
        fingerprint: Fingerprint,
        state: Vec<TensorDesc>,
        reserve: u64,
    },
    SessionOpened {
        session: Handle,
    },
    /// Runs the session's model on `inputs` followed by its state tensors. The model returns
    /// a tuple whose last items are the new state (as many as the state has tensors); the rest
    /// comes back in an `ExecuteReply` (one item unwrapped). With `until`, the step stops at
    /// that breakpoint; the session's later requests wait until it is resumed or aborted.
    SessionStep {
        session: Handle,
        tensors: Vec<TensorDesc>,
        inputs: Vec<Value>,
        until: Option<Breakpoint>,
    },
    /// Takes effect after the session's earlier steps and signals, before its later ones.
    SessionSignal {
        session: Handle,
        signal: Signal,
    },
    SessionSignaled,
    /// Frees the session's state (after its earlier steps).
    SessionClose {
        session: Handle,
    },
    SessionClosed,
    /// A run stopped after `block`: `parked` names it on the node. `activation` (block
    /// `block`'s output, its tensors the payload) when it was asked for.
    Paused {
        parked: Handle,
        block: u32,
        tensors: Vec<TensorDesc>,
        activation: Option<Value>,
    },
    /// Runs a parked request on from the block after its breakpoint, on its activation or on
    /// `activation` (its tensors the payload; the same structure, shapes and dtypes), to the
    /// end (an `ExecuteReply`) or to a later breakpoint (a `Paused` with a new handle).
    Resume {
        parked: Handle,
        tensors: Vec<TensorDesc>,
        activation: Option<Value>,
        until: Option<Breakpoint>,
    },
    /// Asks for a parked request's activation; answered by a `Paused` that carries it.
    Inspect {
        parked: Handle,
    },
    /// Drops a parked request (a session's state stays as it was before the step).
    Abort {
        parked: Handle,
    },
    Aborted,
}

impl Message {
    pub fn kind(&self) -> Kind {
        match self {
            Self::Hello(_) => Kind::Hello,
            Self::HelloAck(_) => Kind::HelloAck,
            Self::Ping => Kind::Ping,
            Self::Pong => Kind::Pong,
            Self::Put { .. } => Kind::Put,
            Self::PutAck { .. } => Kind::PutAck,
            Self::Get { .. } => Kind::Get,
            Self::GetReply { .. } => Kind::GetReply,
            Self::Delete { .. } => Kind::Delete,
            Self::DeleteAck => Kind::DeleteAck,
            Self::List { .. } => Kind::List,
            Self::ListReply { .. } => Kind::ListReply,
            Self::Stats => Kind::Stats,
            Self::StatsReply { .. } => Kind::StatsReply,
            Self::Error { .. } => Kind::Error,
            Self::RdmaConnect(_) => Kind::RdmaConnect,
            Self::RdmaAccept(_) => Kind::RdmaAccept,
            Self::RegisterBegin { .. } => Kind::RegisterBegin,
            Self::RegisterReady { .. } => Kind::RegisterReady,
            Self::RegisterChunk { .. } => Kind::RegisterChunk,
            Self::RegisterProgress { .. } => Kind::RegisterProgress,
            Self::RegisterCommit { .. } => Kind::RegisterCommit,
            Self::Registered { .. } => Kind::Registered,
            Self::Execute { .. } => Kind::Execute,
            Self::ExecuteReply { .. } => Kind::ExecuteReply,
            Self::Unregister { .. } => Kind::Unregister,
            Self::UnregisterAck => Kind::UnregisterAck,
            Self::ListModels => Kind::ListModels,
            Self::ModelList { .. } => Kind::ModelList,
            Self::Keep { .. } => Kind::Keep,
            Self::Kept { .. } => Kind::Kept,
            Self::Fetch { .. } => Kind::Fetch,
            Self::Release { .. } => Kind::Release,
            Self::Released { .. } => Kind::Released,
            Self::Push { .. } => Kind::Push,
            Self::PushGrant { .. } => Kind::PushGrant,
            Self::PushGranted { .. } => Kind::PushGranted,
            Self::Pushed { .. } => Kind::Pushed,
            Self::SessionOpen { .. } => Kind::SessionOpen,
            Self::SessionOpened { .. } => Kind::SessionOpened,
            Self::SessionStep { .. } => Kind::SessionStep,
            Self::SessionSignal { .. } => Kind::SessionSignal,
            Self::SessionSignaled => Kind::SessionSignaled,
            Self::SessionClose { .. } => Kind::SessionClose,
            Self::SessionClosed => Kind::SessionClosed,
            Self::Paused { .. } => Kind::Paused,
            Self::Resume { .. } => Kind::Resume,
            Self::Inspect { .. } => Kind::Inspect,
            Self::Abort { .. } => Kind::Abort,
            Self::Aborted => Kind::Aborted,
        }
    }

    /// True for the kinds a node sends back; a node refuses them as requests.
    pub fn is_reply(&self) -> bool {
        matches!(
            self,
            Self::HelloAck(_)
                | Self::Pong
                | Self::PutAck { .. }
                | Self::GetReply { .. }
                | Self::DeleteAck
                | Self::ListReply { .. }
                | Self::StatsReply { .. }
                | Self::Error { .. }
                | Self::RdmaAccept(_)
                | Self::RegisterReady { .. }
                | Self::RegisterProgress { .. }
                | Self::Registered { .. }
                | Self::ExecuteReply { .. }
                | Self::UnregisterAck
                | Self::ModelList { .. }
                | Self::Kept { .. }
                | Self::Released { .. }
                | Self::Pushed { .. }
                | Self::PushGranted { .. }
                | Self::SessionOpened { .. }
                | Self::SessionSignaled
                | Self::SessionClosed
                | Self::Paused { .. }
                | Self::Aborted
        )
    }

    /// The tensors whose bytes make up this message's payload, in payload order.
    pub fn tensors(&self) -> &[TensorDesc] {
        match self {
            Self::Put { tensor, .. }
            | Self::GetReply { tensor }
            | Self::RegisterChunk { chunk: tensor, .. }
            | Self::Keep { tensor } => std::slice::from_ref(tensor),
            Self::Execute { tensors, .. }
            | Self::ExecuteReply { tensors, .. }
            | Self::SessionStep { tensors, .. }
            | Self::SessionOpen { state: tensors, .. }
            | Self::Paused { tensors, .. }
            | Self::Resume { tensors, .. } => tensors,
            _ => &[],
        }
    }

    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::Error { code, message: message.into() }
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut w = Writer(out);
        match self {
            Self::Hello(h) | Self::HelloAck(h) => {
                w.u16(h.protocol_version);
                w.u32(h.transports);
                w.u32(h.max_meta);
                w.u64(h.max_payload);
                w.str(&h.agent);
                w.str(&h.memory_path);
                w.str(&h.token);
                w.str(&h.tenant);
            }
            Self::Ping
            | Self::Pong
            | Self::DeleteAck
            | Self::Stats
            | Self::UnregisterAck
            | Self::ListModels
            | Self::SessionSignaled
            | Self::SessionClosed
            | Self::Aborted => {}
            Self::Put { name, tensor } => {
                w.str(name);
                w.tensor(tensor);
            }
            Self::PutAck { replaced } => w.u8(u8::from(*replaced)),
            Self::Get { name } | Self::Delete { name } => w.str(name),
            Self::GetReply { tensor } => w.tensor(tensor),
            Self::List { after, limit } => {
                match after {
                    Some(name) => {
                        w.u8(1);
                        w.str(name);
                    }
                    None => w.u8(0),
                }
                w.u32(*limit);
            }
            Self::ListReply { entries, more } => {
                w.u32(entries.len() as u32);
                for e in entries {
                    w.str(&e.name);
                    w.tensor(&e.tensor);
                }
                w.u8(u8::from(*more));
            }
            Self::StatsReply { counters } => {
                w.u32(counters.len() as u32);
                for (name, value) in counters {
                    w.str(name);
                    w.u64(*value);
                }
            }
            Self::Error { code, message } => {
                w.u16(code.to_wire());
                w.str(message);
            }
            Self::RdmaConnect(p) | Self::RdmaAccept(p) => {
                w.u32(p.qp_number);
                w.u32(p.psn);
                w.0.extend_from_slice(&p.gid);
                w.u32(p.mtu);
                w.u32(p.slots);
                w.u32(p.slot_size);
            }
            Self::RegisterBegin { fingerprint, blocks, public } => {
                w.fingerprint(fingerprint);
                w.u32(blocks.len() as u32);
                for &b in blocks {
                    w.u64(b);
                }
                w.u8(u8::from(*public));
            }
            Self::RegisterReady { upload, registered } => {
                w.u64(*upload);
                w.u8(u8::from(*registered));
            }
            Self::RegisterChunk { upload, offset, chunk } => {
                w.u64(*upload);
                w.u64(*offset);
                w.tensor(chunk);
            }
            Self::RegisterProgress { received, total } => {
                w.u64(*received);
                w.u64(*total);
            }
            Self::RegisterCommit { upload } => w.u64(*upload),
            Self::Registered { model } => w.model(model),
            Self::Execute { fingerprint, tensors, inputs, keep, until } => {
                w.fingerprint(fingerprint);
                w.u8(u8::from(*keep));
                w.tensors(tensors);
                w.values(inputs);
                w.breakpoint(until);
            }
            Self::ExecuteReply { tensors, output, kept } => {
                w.tensors(tensors);
                output.encode(w.0);
                w.u32(kept.len() as u32);
                for k in kept {
                    w.kept(k);
                }
            }
            Self::Unregister { fingerprint } => w.fingerprint(fingerprint),
            Self::ModelList { models } => {
                w.u32(models.len() as u32);
                for m in models {
                    w.model(m);
                }
            }
            Self::Keep { tensor } => w.tensor(tensor),
            Self::Kept { kept } => w.kept(kept),
            Self::Fetch { handle } => handle.encode(w.0),
            Self::Release { handles } => {
                w.u32(handles.len() as u32);
                for h in handles {
                    h.encode(w.0);
                }
            }
            Self::Released { released } => w.u32(*released),
            Self::Push { source, to, grant } => {
                match source {
                    TensorSource::Named(name) => {
                        w.u8(0);
                        w.str(name);
                    }
                    TensorSource::Handle(h) => {
                        w.u8(1);
                        h.encode(w.0);
                    }
                }
                w.str(to);
                w.str(grant);
            }
            Self::PushGrant { tensor } => w.tensor(tensor),
            Self::PushGranted { grant } => w.str(grant),
            Self::Pushed { kept, path } => {
                w.kept(kept);
                w.str(path);
            }
            Self::SessionOpen { fingerprint, state, reserve } => {
                w.fingerprint(fingerprint);
                w.tensors(state);
                w.u64(*reserve);
            }
            Self::SessionOpened { session } | Self::SessionClose { session } => session.encode(w.0),
            Self::SessionStep { session, tensors, inputs, until } => {
                session.encode(w.0);
                w.tensors(tensors);
                w.values(inputs);
                w.breakpoint(until);
            }
            Self::Paused { parked, block, tensors, activation } => {
                parked.encode(w.0);
                w.u32(*block);
                w.tensors(tensors);
                w.value(activation);
            }
            Self::Resume { parked, tensors, activation, until } => {
                parked.encode(w.0);
                w.tensors(tensors);
                w.value(activation);
                w.breakpoint(until);
            }
            Self::Inspect { parked } | Self::Abort { parked } => parked.encode(w.0),
            Self::SessionSignal { session, signal } => {
                session.encode(w.0);
                match signal {
                    Signal::IoWait { resume_in_ms } => {
                        w.u8(0);
                        match resume_in_ms {
                            Some(ms) => {
                                w.u8(1);
                                w.u32(*ms);
                            }
                            None => w.u8(0),
                        }
                    }
                    Signal::Compute => w.u8(1),
                }
            }
        }
    }

    pub fn decode(kind: Kind, meta: &[u8], limits: &Limits) -> Result<Self, ProtocolError> {
        let mut r = Reader { bytes: meta, limits };
        let message = match kind {
            Kind::Hello | Kind::HelloAck => {
                let hello = Hello {
                    protocol_version: r.u16("protocol version")?,
                    transports: r.u32("transports")?,
                    max_meta: r.u32("max meta")?,
                    max_payload: r.u64("max payload")?,
                    agent: r.string("agent")?,
                    memory_path: r.string("memory path")?,
                    token: r.string("token")?,
                    tenant: r.string("tenant")?,
                };
                if kind == Kind::Hello { Self::Hello(hello) } else { Self::HelloAck(hello) }
            }
            Kind::Ping => Self::Ping,
            Kind::Pong => Self::Pong,
            Kind::Put => Self::Put { name: r.name()?, tensor: r.tensor()? },
            Kind::PutAck => Self::PutAck { replaced: r.bool("replaced")? },
            Kind::Get => Self::Get { name: r.name()? },
            Kind::GetReply => Self::GetReply { tensor: r.tensor()? },
            Kind::Delete => Self::Delete { name: r.name()? },
            Kind::DeleteAck => Self::DeleteAck,
            Kind::List => {
                let after = if r.bool("has cursor")? { Some(r.name()?) } else { None };
                Self::List { after, limit: r.u32("limit")? }
            }
            Kind::ListReply => {
                // The smallest entry is an empty name (2) plus a rank-0 descriptor (10).
                let count = r.count("entries", 12)?;
                let mut entries = Vec::with_capacity(count);
                for _ in 0..count {
                    entries.push(ListEntry { name: r.name()?, tensor: r.tensor()? });
                }
                Self::ListReply { entries, more: r.bool("more")? }
            }
            Kind::Stats => Self::Stats,
            Kind::StatsReply => {
                let count = r.count("counters", 10)?;
                let mut counters = Vec::with_capacity(count);
                for _ in 0..count {
                    counters.push((r.string("counter name")?, r.u64("counter value")?));
                }
                Self::StatsReply { counters }
            }
            Kind::Error => Self::Error { code: ErrorCode::from_wire(r.u16("code")?), message: r.string("message")? },
            Kind::RdmaConnect | Kind::RdmaAccept => {
                let params = RdmaParams {
                    qp_number: r.u32("qp number")?,
                    psn: r.u32("psn")?,
                    gid: r.array("gid")?,
                    mtu: r.u32("mtu")?,
                    slots: r.u32("slots")?,
                    slot_size: r.u32("slot size")?,
                };
                if kind == Kind::RdmaConnect { Self::RdmaConnect(params) } else { Self::RdmaAccept(params) }
            }
            Kind::RegisterBegin => {
                let fingerprint = r.fingerprint()?;
                let n = r.count("blocks", 8)?;
                let mut blocks = Vec::with_capacity(n);
                for _ in 0..n {
                    blocks.push(r.u64("block length")?);
                }
                Self::RegisterBegin { fingerprint, blocks, public: r.bool("public")? }
            }
            Kind::RegisterReady => Self::RegisterReady { upload: r.u64("upload")?, registered: r.bool("registered")? },
            Kind::RegisterChunk => {
                Self::RegisterChunk { upload: r.u64("upload")?, offset: r.u64("offset")?, chunk: r.tensor()? }
            }
            Kind::RegisterProgress => Self::RegisterProgress { received: r.u64("received")?, total: r.u64("total")? },
            Kind::RegisterCommit => Self::RegisterCommit { upload: r.u64("upload")? },
            Kind::Registered => Self::Registered { model: r.model()? },
            Kind::Execute => {
                let fingerprint = r.fingerprint()?;
                let keep = r.bool("keep")?;
                let tensors = r.tensors()?;
                let inputs = r.values(tensors.len())?;
                Self::Execute { fingerprint, tensors, inputs, keep, until: r.breakpoint()? }
            }
            Kind::ExecuteReply => {
                let tensors = r.tensors()?;
                let output = Value::decode(&mut r.bytes, tensors.len())?;
                // The smallest entry: a handle and a rank-0 descriptor.
                let n = r.count("kept tensors", 16 + 10)?;
                let mut kept = Vec::with_capacity(n);
                for _ in 0..n {
                    kept.push(r.kept()?);
                }
                Self::ExecuteReply { tensors, output, kept }
            }
            Kind::Unregister => Self::Unregister { fingerprint: r.fingerprint()? },
            Kind::UnregisterAck => Self::UnregisterAck,
            Kind::ListModels => Self::ListModels,
            Kind::ModelList => {
                // The smallest entry: fingerprint, u32, u64, empty string, u64, no owner.
                let n = r.count("models", 32 + 4 + 8 + 2 + 8 + 4)?;
                let mut models = Vec::with_capacity(n);
                for _ in 0..n {
                    models.push(r.model()?);
                }
                Self::ModelList { models }
            }
            Kind::Keep => Self::Keep { tensor: r.tensor()? },
            Kind::Kept => Self::Kept { kept: r.kept()? },
            Kind::Fetch => Self::Fetch { handle: r.handle()? },
            Kind::Release => {
                let n = r.count("handles", 16)?;
                let mut handles = Vec::with_capacity(n);
                for _ in 0..n {
                    handles.push(r.handle()?);
                }
                Self::Release { handles }
            }
            Kind::Released => Self::Released { released: r.u32("released")? },
            Kind::Push => {
                let source = match r.u8("source")? {
                    0 => TensorSource::Named(r.name()?),
                    1 => TensorSource::Handle(r.handle()?),
                    v => return Err(ProtocolError::MalformedMeta(format!("tensor source {v} is neither 0 nor 1"))),
                };
                Self::Push { source, to: r.string("peer address")?, grant: r.string("grant")? }
            }
            Kind::PushGrant => Self::PushGrant { tensor: r.tensor()? },
            Kind::PushGranted => Self::PushGranted { grant: r.string("grant")? },
            Kind::Pushed => Self::Pushed { kept: r.kept()?, path: r.string("path")? },
            Kind::SessionOpen => {
                Self::SessionOpen { fingerprint: r.fingerprint()?, state: r.tensors()?, reserve: r.u64("reserve")? }
            }
            Kind::SessionOpened => Self::SessionOpened { session: r.handle()? },
            Kind::SessionStep => {
                let session = r.handle()?;
                let tensors = r.tensors()?;
                let inputs = r.values(tensors.len())?;
                Self::SessionStep { session, tensors, inputs, until: r.breakpoint()? }
            }
            Kind::SessionSignal => {
                let session = r.handle()?;
                let signal = match r.u8("signal")? {
                    0 => Signal::IoWait {
                        resume_in_ms: if r.bool("has resume time")? { Some(r.u32("resume in ms")?) } else { None },
                    },
                    1 => Signal::Compute,
                    v => return Err(ProtocolError::MalformedMeta(format!("signal {v} is neither 0 nor 1"))),
                };
                Self::SessionSignal { session, signal }
            }
            Kind::SessionSignaled => Self::SessionSignaled,
            Kind::SessionClose => Self::SessionClose { session: r.handle()? },
            Kind::SessionClosed => Self::SessionClosed,
            Kind::Paused => {
                let parked = r.handle()?;
                let block = r.u32("block")?;
                let tensors = r.tensors()?;
                let activation = r.value(tensors.len())?;
                Self::Paused { parked, block, tensors, activation }
            }
            Kind::Resume => {
                let parked = r.handle()?;
                let tensors = r.tensors()?;
                let activation = r.value(tensors.len())?;
                Self::Resume { parked, tensors, activation, until: r.breakpoint()? }
            }
            Kind::Inspect => Self::Inspect { parked: r.handle()? },
            Kind::Abort => Self::Abort { parked: r.handle()? },
            Kind::Aborted => Self::Aborted,
        };
        if !r.bytes.is_empty() {
            return Err(ProtocolError::MalformedMeta(format!(
                "{} bytes left over after a {} message",
                r.bytes.len(),
                kind.name()
            )));
        }
        Ok(message)
    }
}

struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// Strings longer than u16::MAX bytes are cut at a character boundary; names are bounded
    /// far below that by [`Limits::max_name`].
    fn str(&mut self, s: &str) {
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16);
        self.0.extend_from_slice(&s.as_bytes()[..end]);
    }
    fn fingerprint(&mut self, f: &Fingerprint) {
        self.0.extend_from_slice(&f.0);
    }
    fn tensors(&mut self, tensors: &[TensorDesc]) {
        self.u32(tensors.len() as u32);
        for t in tensors {
            self.tensor(t);
        }
    }
    fn model(&mut self, m: &ModelInfo) {
        self.fingerprint(&m.fingerprint);
        self.u32(m.blocks);
        self.u64(m.weight_bytes);
        self.str(&m.device);
        self.u64(m.executions);
        self.u32(m.owners.len() as u32);
        for owner in &m.owners {
            self.str(owner);
        }
    }
    fn kept(&mut self, k: &HandleInfo) {
        k.handle.encode(self.0);
        self.tensor(&k.tensor);
    }
    fn values(&mut self, values: &[Value]) {
        self.u32(values.len() as u32);
        for v in values {
            v.encode(self.0);
        }
    }
    fn value(&mut self, value: &Option<Value>) {
        match value {
            Some(v) => {
                self.u8(1);
                v.encode(self.0);
            }
            None => self.u8(0),
        }
    }
    /// A tag (0: none, 1: stop, 2: stop and send the activation), then the block.
    fn breakpoint(&mut self, until: &Option<Breakpoint>) {
        match until {
            Some(b) => {
                self.u8(if b.send_activation { 2 } else { 1 });
                self.u32(b.block);
            }
            None => self.u8(0),
        }
    }
    fn tensor(&mut self, t: &TensorDesc) {
        self.u8(t.dtype.to_wire());
        self.u8(t.shape.len() as u8);
        for &d in &t.shape {
            self.u64(d);
        }
        self.u64(t.byte_len);
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    limits: &'a Limits,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], ProtocolError> {
        if self.bytes.len() < n {
            return Err(ProtocolError::MalformedMeta(format!("{what}: needs {n} bytes, {} left", self.bytes.len())));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], ProtocolError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }
    fn u8(&mut self, what: &str) -> Result<u8, ProtocolError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, ProtocolError> {
        self.array(what).map(u16::from_le_bytes)
    }
    fn u32(&mut self, what: &str) -> Result<u32, ProtocolError> {
        self.array(what).map(u32::from_le_bytes)
    }
    fn u64(&mut self, what: &str) -> Result<u64, ProtocolError> {
        self.array(what).map(u64::from_le_bytes)
    }
    fn bool(&mut self, what: &str) -> Result<bool, ProtocolError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(ProtocolError::MalformedMeta(format!("{what}: {v} is not a boolean"))),
        }
    }
    fn string(&mut self, what: &str) -> Result<String, ProtocolError> {
        let len = self.u16(what)? as usize;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| ProtocolError::MalformedMeta(format!("{what} is not UTF-8")))
    }
    fn name(&mut self) -> Result<String, ProtocolError> {
        let name = self.string("name")?;
        if name.len() > self.limits.max_name {
            return Err(ProtocolError::MalformedMeta(format!(
                "name of {} bytes is over the limit of {}",
                name.len(),
                self.limits.max_name
            )));
        }
        Ok(name)
    }
    /// A u32 count of items at least `min_item` bytes each, checked against what remains.
    fn count(&mut self, what: &str, min_item: usize) -> Result<usize, ProtocolError> {
        let count = self.u32(what)? as usize;
        if count.saturating_mul(min_item) > self.bytes.len() {
            return Err(ProtocolError::MalformedMeta(format!(
                "{count} {what} cannot fit in the {} bytes left",
                self.bytes.len()
            )));
        }
        Ok(count)
    }
    fn fingerprint(&mut self) -> Result<Fingerprint, ProtocolError> {
        self.array("fingerprint").map(Fingerprint)
    }
    fn tensors(&mut self) -> Result<Vec<TensorDesc>, ProtocolError> {
        let n = self.count("tensors", 10)?;
        let mut tensors = Vec::with_capacity(n);
        for _ in 0..n {
            tensors.push(self.tensor()?);
        }
        Ok(tensors)
    }
    fn model(&mut self) -> Result<ModelInfo, ProtocolError> {
        Ok(ModelInfo {
            fingerprint: self.fingerprint()?,
            blocks: self.u32("blocks")?,
            weight_bytes: self.u64("weight bytes")?,
            device: self.string("device")?,
            executions: self.u64("executions")?,
            owners: {
                let n = self.count("owners", 2)?;
                (0..n).map(|_| self.string("owner")).collect::<Result<_, _>>()?
            },
        })
    }
    fn handle(&mut self) -> Result<Handle, ProtocolError> {
        Ok(Handle { id: self.u64("handle id")?, epoch: self.u64("handle epoch")? })
    }
    fn kept(&mut self) -> Result<HandleInfo, ProtocolError> {
        Ok(HandleInfo { handle: self.handle()?, tensor: self.tensor()? })
    }
    /// Values whose tensor indices are below `tensors`.
    fn values(&mut self, tensors: usize) -> Result<Vec<Value>, ProtocolError> {
        let n = self.count("inputs", 1)?;
        let mut values = Vec::with_capacity(n);
        for _ in 0..n {
            values.push(Value::decode(&mut self.bytes, tensors)?);
        }
        Ok(values)
    }
    fn value(&mut self, tensors: usize) -> Result<Option<Value>, ProtocolError> {
        Ok(if self.bool("has value")? { Some(Value::decode(&mut self.bytes, tensors)?) } else { None })
    }
    fn breakpoint(&mut self) -> Result<Option<Breakpoint>, ProtocolError> {
        let send_activation = match self.u8("breakpoint")? {
            0 => return Ok(None),
            1 => false,
            2 => true,
            v => return Err(ProtocolError::MalformedMeta(format!("breakpoint tag {v} is not 0, 1 or 2"))),
        };
        Ok(Some(Breakpoint { block: self.u32("breakpoint block")?, send_activation }))
    }
    fn tensor(&mut self) -> Result<TensorDesc, ProtocolError> {
        let code = self.u8("dtype")?;
        let dtype =
            DType::from_wire(code).ok_or_else(|| ProtocolError::BadDescriptor(format!("unknown dtype code {code}")))?;
        let rank = self.u8("rank")? as usize;
        if rank > self.limits.max_dims {
            return Err(ProtocolError::BadDescriptor(format!(
                "{rank} dimensions, more than the limit of {}",
                self.limits.max_dims
            )));
        }
        let mut shape = Vec::with_capacity(rank);
        for _ in 0..rank {
            shape.push(self.u64("dimension")?);
        }
        let tensor = TensorDesc { dtype, shape, byte_len: self.u64("byte length")? };
        tensor.validate(self.limits)?;
        Ok(tensor)
    }
}
