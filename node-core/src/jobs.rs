//! What the core asks of the executor, typed once from the request that asked for it.

use djinn_auth::TenantId;
use djinn_proto::{Breakpoint, Fingerprint, Handle, Payload, Refusal, Signal, TensorDesc, Value};

use crate::{Replier, Reply, ReplyTo, Upload};

/// A call's inputs as they came: the argument values, the tensors they name (descriptors, in
/// the order of their bytes) and the payload those bytes arrived in.
#[derive(Debug)]
pub struct CallInputs {
    pub values: Vec<Value>,
    pub tensors: Vec<TensorDesc>,
    pub payload: Option<Payload>,
}

/// A request for the executor: its models, kept tensors, sessions and parked runs. Plain data
/// and the payload the request arrived in; whose request it is comes beside it ([`ReplyTo`]).
#[derive(Debug)]
pub enum Job {
    /// Loads a model whose archives arrived whole.
    Load {
        upload: Upload,
    },
    Unregister {
        fingerprint: Fingerprint,
    },
    /// The caller's models, or every tenant's (`all`).
    ListModels {
        all: bool,
    },
    /// Bytes of a model's archives, read back (at most [`crate::MAX_ARCHIVE_READ`]).
    ReadArchives {
        fingerprint: Fingerprint,
        offset: u64,
        len: u64,
    },
    Execute {
        fingerprint: Fingerprint,
        inputs: CallInputs,
        keep: bool,
        until: Option<Breakpoint>,
    },
    /// Keeps a received tensor in device memory.
    Keep {
        tensor: TensorDesc,
        payload: Option<Payload>,
    },
    /// A kept tensor's bytes (the handle is one the core holds for the request's tenant).
    Fetch {
        handle: Handle,
    },
    /// Opens a session of a model, from the state given (none: the graph's own initial state).
    OpenSession {
        fingerprint: Fingerprint,
        state: Vec<TensorDesc>,
        payload: Option<Payload>,
        reserve: u64,
    },
    Step {
        session: Handle,
        inputs: CallInputs,
        until: Option<Breakpoint>,
    },
    Signal {
        session: Handle,
        signal: Signal,
    },
    /// Moves a session to the node at `to` on its `grant`, for the tenant named `tenant` there.
    Move {
        session: Handle,
        to: String,
        grant: String,
        tenant: String,
    },
    Close {
        session: Handle,
    },
    /// A page of the sessions after `after`: the caller's, or every tenant's (`all`).
    ListSessions {
        all: bool,
        after: u64,
    },
    /// Runs a parked request on, from the activation given (none: the parked one).
    Resume {
        parked: Handle,
        tensors: Vec<TensorDesc>,
        activation: Option<Value>,
        payload: Option<Payload>,
        until: Option<Breakpoint>,
    },
    /// A parked request's activation.
    Inspect {
        parked: Handle,
    },
    Abort {
        parked: Handle,
    },
}

/// What runs models and holds what they keep on the device, behind the node's core. Called on
/// the poller's thread: it must not block (work goes to its own threads, which answer through
/// the replier with [`Replier::executed`]).
///
/// The tensors it keeps (a `Keep`, an execution's outputs kept) are its own, by the ids of the
/// handles it answers with; whose each is, what it is charged and how long it stays is the
/// core's record, which tells the executor when to free them.
pub trait Executor {
    /// Answers `job`, a request of `to`'s, now (`Some`) or later through `replier` (`None`).
    fn run(&mut self, job: Job, to: ReplyTo, replier: &Replier) -> Option<Reply>;
    /// Claims a model for `tenant` ahead of its upload: `true` when the node holds it already
    /// (now the tenant's too), `false` when its archives must come, or why it is refused.
    fn claim(
        &mut self,
        tenant: TenantId,
        fingerprint: &Fingerprint,
        public: bool,
        torchscript: bool,
    ) -> Result<bool, Refusal>;
    /// The life of this executor: what the handles of the tensors it keeps carry as their
    /// epoch (a handle of another life names nothing here).
    fn epoch(&self) -> u64;
    /// Frees the kept tensors of these ids (released, expired, moved away, or refused by the
    /// core when it recorded them). Ids it does not hold are skipped.
    fn free_kept(&mut self, ids: &[u64]);
    /// Appends the executor's counters to a stats reply.
    fn stats(&self, out: &mut Vec<(String, u64)>);
}
