//! The node's own requests, in process: its membership agent, /metrics and drain ask the node
//! as a client would, with no socket and no frame. A request goes to the transport's poller
//! through a channel and is served in the poller's turn like any connection's, through the
//! same dispatch (the data plane's own kinds, then the core); the answer comes back as the
//! reply itself, its tensors' bytes shared, not copied.

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use djinn_proto::{DataMessage, ErrorCode, Message};

use crate::Reply;

/// A request of the node's own, on its way to the poller.
#[derive(Debug)]
pub struct LocalRequest {
    /// Whom it acts for: a tenant by name, or the node itself (empty).
    pub tenant: String,
    pub message: Message,
    pub answer: Sender<Reply>,
}

/// Why a request of the node's own got no answer, or what the node answered instead.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("the node's poller stopped")]
    Stopped,
    #[error("no answer from the node within {0:?}")]
    TimedOut(Duration),
    #[error("the node answered {code:?}: {message}")]
    Refused { code: ErrorCode, message: String },
}

/// The way in for the node's own requests; clones share the one channel to the poller.
#[derive(Clone)]
pub struct LocalNode {
    tx: Sender<LocalRequest>,
    wake: Arc<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for LocalNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalNode").field("queued", &self.tx.len()).finish()
    }
}

impl LocalNode {
    /// A handle, and the end the poller drains; `wake` makes the poller return from a wait.
    pub fn new(wake: Arc<dyn Fn() + Send + Sync>) -> (Self, Receiver<LocalRequest>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        (Self { tx, wake }, rx)
    }

    /// Asks the node, as the node itself (`tenant` empty) or for the tenant of that name, and
    /// waits for the answer at most `timeout`. An error reply is [`LocalError::Refused`].
    pub fn request(&self, tenant: &str, message: impl Into<Message>, timeout: Duration) -> Result<Reply, LocalError> {
        let (answer, answered) = crossbeam_channel::bounded(1);
        let request = LocalRequest { tenant: tenant.to_owned(), message: message.into(), answer };
        self.tx.send(request).map_err(|_| LocalError::Stopped)?;
        (self.wake)();
        let reply = answered.recv_timeout(timeout).map_err(|e| match e {
            crossbeam_channel::RecvTimeoutError::Timeout => LocalError::TimedOut(timeout),
            crossbeam_channel::RecvTimeoutError::Disconnected => LocalError::Stopped,
        })?;
        match reply.message {
            Message::Data(DataMessage::Error { code, message }) => Err(LocalError::Refused { code, message }),
            _ => Ok(reply),
        }
    }
}
