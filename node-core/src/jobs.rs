//! What the core asks of the executor, typed once from the request that asked for it.

use djinn_auth::TenantId;
use djinn_proto::{Breakpoint, Fingerprint, Handle, HandleInfo, Payload, Refusal, Signal, TensorDesc, Value};

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
    /// A kept tensor's bytes.
    Fetch {
        handle: Handle,
    },
    /// A page of the kept tensors after `after`: the caller's, or every tenant's (`all`).
    ListKept {
        all: bool,
        after: u64,
    },
    /// Says where a kept tensor went (a drain moved it to the node at `to`, as `kept`).
    Forward {
        handle: Handle,
        to: String,
        kept: HandleInfo,
    },
    Release {
        handles: Vec<Handle>,
    },
    /// Pushes a kept tensor to the node at `to` on its `grant`, for the tenant named `tenant`
    /// there.
    Push {
        handle: Handle,
        to: String,
        grant: String,
        tenant: String,
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
/// the replier).
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
    /// Appends the executor's counters to a stats reply.
    fn stats(&self, out: &mut Vec<(String, u64)>);
}
