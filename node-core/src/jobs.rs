//! What the core asks of the executor, typed once from the request that asked for it.

use std::collections::BTreeMap;

use djinn_auth::TenantId;
use djinn_proto::{Breakpoint, Fingerprint, Handle, Payload, Signal, TensorDesc, Value};

use crate::{PeerError, Replier, ReplyTo, Upload};

/// The node's tenants' names, by tenant: what an operator's lists name holders by.
pub type TenantNames = BTreeMap<TenantId, String>;

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
    /// Claims a model for the tenant ahead of its upload: answered `RegisterReady` with
    /// `registered` when the node holds it already (now the tenant's too, `public` as asked),
    /// without when its archives must come (the core then opens the upload), or why it is
    /// refused (a TorchScript model for a principal without the right).
    Claim {
        fingerprint: Fingerprint,
        public: bool,
    },
    /// Loads a model whose archives arrived whole.
    Load {
        upload: Upload,
    },
    Unregister {
        fingerprint: Fingerprint,
    },
    /// The caller's models (`all` none), or every tenant's, each holder named as `all` names it
    /// (one it does not name is left out).
    ListModels {
        all: Option<TenantNames>,
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
    /// A session's requests (a step, a signal, a move, its end, a close) come one at a time, in
    /// the order they were sent; the core has checked that the session is the tenant's.
    Step {
        session: Handle,
        inputs: CallInputs,
        until: Option<Breakpoint>,
    },
    Signal {
        session: Handle,
        signal: Signal,
    },
    /// Readies a session's move to another node, in the session's turn: answered with its
    /// state as the `session.Open` that makes it a session there (the tensors' bytes beside
    /// it), which the core sends through [`crate::Peers`]. The state stays here, unchanged,
    /// until [`Job::EndMove`].
    Move {
        session: Handle,
    },
    /// Ends a session's move: it is at the node and handle `moved` names now (its state here is
    /// freed), or the peer refused it (it stays here, as it was). Answered `session.Moved`, or
    /// the peer's refusal.
    EndMove {
        session: Handle,
        moved: Result<(String, Handle), PeerError>,
    },
    Close {
        session: Handle,
    },
    /// A page of the sessions after `after`: the caller's (`all` none), or every tenant's, each
    /// session's tenant named as `all` names it (empty where it names none).
    ListSessions {
        all: Option<TenantNames>,
        after: u64,
    },
    /// Runs a parked request on, from the activation given (none: the parked one). The core
    /// has ended its record; the answer says when the request is parked still
    /// ([`crate::Executed::still_parked`]).
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
    /// Drops a parked request: answered `Aborted` once a session step it stopped has ended (its
    /// state as before the step), so that the session's next request comes after.
    Abort {
        parked: Handle,
    },
    /// The executor's counters: answered `StatsReply`.
    Stats,
}

/// What runs models and holds what they keep on the device, behind the node's core. Called on
/// the poller's thread: it must not block. Every job is answered later, once, with
/// [`Replier::executed`] (from the executor's own threads, or at once from the caller's): the
/// core and the executor share no object and call each other back for nothing, so the two
/// could sit on either side of a process boundary.
///
/// The tensors it keeps (a `Keep`, an execution's outputs kept), the sessions it opens and the
/// requests it parks at breakpoints are its own, by the ids of the handles it answers with
/// (all of one epoch, [`Executor::epoch`]); whose each is and how long it stays is the core's
/// record, which tells the executor when to free them (and, for kept tensors, what they are
/// charged).
pub trait Executor {
    /// Takes `job`, a request of `to`'s, to answer through `replier`.
    fn run(&mut self, job: Job, to: ReplyTo, replier: &Replier);
    /// The life of this executor: what the handles of the tensors it keeps, the sessions it
    /// opens and the requests it parks carry as their epoch (a handle of another life names
    /// nothing here). Read once, when the core starts.
    fn epoch(&self) -> u64;
    /// Frees the kept tensors of these ids (released, expired, moved away, or refused by the
    /// core when it recorded them). Ids it does not hold are skipped.
    fn free_kept(&mut self, ids: &[u64]);
    /// Frees the parked requests of these ids, released after the core's time limit (none is a
    /// session's step: those the core aborts, in the session's turn). Ids it does not hold are
    /// skipped.
    fn free_parked(&mut self, ids: &[u64]);
    /// Frees the sessions of these ids, idle past the core's time limit (nothing of theirs runs
    /// or waits). Ids it does not hold are skipped.
    fn free_sessions(&mut self, ids: &[u64]);
}

/// An executor chosen when the node starts (in process, or in processes of their own).
impl<E: Executor + ?Sized> Executor for Box<E> {
    fn run(&mut self, job: Job, to: ReplyTo, replier: &Replier) {
        (**self).run(job, to, replier);
    }
    fn epoch(&self) -> u64 {
        (**self).epoch()
    }
    fn free_kept(&mut self, ids: &[u64]) {
        (**self).free_kept(ids);
    }
    fn free_parked(&mut self, ids: &[u64]) {
        (**self).free_parked(ids);
    }
    fn free_sessions(&mut self, ids: &[u64]) {
        (**self).free_sessions(ids);
    }
}
