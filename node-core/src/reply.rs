//! Replies, and where they go.

use std::fmt;
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use djinn_auth::TenantId;
use djinn_proto::{ErrorCode, Message, SharedBytes};

/// The node's answer to one request.
pub struct Reply {
    pub message: Message,
    /// The bytes of `message.tensors()`, in order.
    pub tensors: Vec<SharedBytes>,
}

impl Reply {
    pub fn message(message: impl Into<Message>) -> Self {
        Self { message: message.into(), tensors: Vec::new() }
    }

    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::message(Message::error(code, message))
    }
}

impl fmt::Debug for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reply").field("message", &self.message).field("tensors", &self.tensors.len()).finish()
    }
}

/// Where a deferred reply goes: a connection (by its slot in the transport's table and by a
/// number never reused, so a reply for a connection that closed is dropped, not delivered to its
/// slot's next tenant) and the request it answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReplyTo {
    /// The connection's slot in the transport's table.
    pub slot: usize,
    /// The connection's number, unique for the transport's life.
    pub conn_id: u64,
    pub request_id: u64,
    /// Whose request it is: what the service namespaces its answer by.
    pub tenant: TenantId,
    /// A node or an operator in its own name (or anyone, where no token is needed): it may see
    /// every tenant's entries listed.
    pub operator: bool,
    /// The principal may register TorchScript (see [`djinn_auth::Right::Torchscript`]).
    pub torchscript: bool,
}

impl ReplyTo {
    /// The connection the request came on (unique for the transport's life).
    pub fn connection(&self) -> u64 {
        self.conn_id
    }
}

/// What another thread sends the poller for a request answered later.
#[derive(Debug)]
pub enum Answer {
    /// The reply, to send as it is (a peer's answer to a push).
    Reply(Reply),
    /// The executor's answer to a job, which the core completes before it goes (see
    /// [`crate::Service::complete`]): it records what the answer says is kept or parked.
    Executed(Executed),
}

/// The executor's answer to a job: the reply, and what the reply alone does not tell the core.
#[derive(Debug)]
pub struct Executed {
    pub reply: Reply,
    /// A resume's parked request is parked still: its activation was refused, or its blocks
    /// failed before they ran, and it may be resumed again.
    pub still_parked: bool,
}

impl From<Reply> for Executed {
    fn from(reply: Reply) -> Self {
        Self { reply, still_parked: false }
    }
}

/// Sends answers to the poller from other threads (executor workers, pushes) and wakes it.
#[derive(Clone)]
pub struct Replier {
    tx: Sender<(ReplyTo, Answer)>,
    wake: Arc<dyn Fn() + Send + Sync>,
}

impl Replier {
    /// A replier, and the receiving end the poller drains; `wake` makes the poller return from a
    /// blocking wait.
    pub fn new(wake: Arc<dyn Fn() + Send + Sync>) -> (Self, Receiver<(ReplyTo, Answer)>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        (Self { tx, wake }, rx)
    }

    /// Sends `reply` to the request `to` as it is.
    pub fn send(&self, to: ReplyTo, reply: Reply) {
        self.answer(to, Answer::Reply(reply));
    }

    /// Sends the executor's answer to the request `to`, for the core to complete.
    pub fn executed(&self, to: ReplyTo, answer: impl Into<Executed>) {
        self.answer(to, Answer::Executed(answer.into()));
    }

    fn answer(&self, to: ReplyTo, answer: Answer) {
        // The receiver lives as long as the poller; after it stops, replies have nowhere to go.
        if self.tx.send((to, answer)).is_ok() {
            (self.wake)();
        }
    }
}

impl fmt::Debug for Replier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Replier").field("queued", &self.tx.len()).finish()
    }
}
