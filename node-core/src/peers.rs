//! The node's way to other nodes.

use std::fmt;

use djinn_proto::{ErrorCode, Fingerprint, SharedBytes, TensorDesc};

use crate::{Replier, ReplyTo};

/// Why a push or a move to another node failed: the code and message the tenant gets.
pub type PeerError = (ErrorCode, String);

/// A tensor to push: its descriptor and its bytes, in host memory.
pub struct PushedTensor {
    pub desc: TensorDesc,
    pub bytes: SharedBytes,
}

/// A session on its way to another node: its model, its state (each tensor's description and
/// bytes, in host memory) and the device memory to reserve for it there.
pub struct MovedSession {
    pub fingerprint: Fingerprint,
    pub state: Vec<TensorDesc>,
    pub bytes: Vec<SharedBytes>,
    pub reserve: u64,
}

impl fmt::Debug for MovedSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MovedSession")
            .field("fingerprint", &self.fingerprint)
            .field("state", &self.state.len())
            .field("reserve", &self.reserve)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for PushedTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PushedTensor").field("desc", &self.desc).finish_non_exhaustive()
    }
}

/// Pushes and session moves to other nodes, by the address a tenant names. Only the nodes of
/// this node's cluster are reached; anywhere else is refused with nothing sent.
pub trait Peers: Send + Sync + fmt::Debug {
    /// Pushes `tensor` to the node at `to` on its `grant`, for `tenant` (by name, empty where
    /// nodes need no token), in that tenant's turn; the reply (`kept.Pushed` or an error) goes
    /// to `reply_to` through `replier`.
    fn push(
        &self,
        tensor: PushedTensor,
        to: String,
        grant: String,
        tenant: String,
        reply_to: ReplyTo,
        replier: &Replier,
    );

    /// Opens, on the node at `to` and on its `grant`, a session for `tenant` (by name) from
    /// `session`'s state, in that tenant's turn. The peer's answer (`session.Opened` with the
    /// session's handle there, or an error) goes to `reply_to` through
    /// [`Replier::executed`]: the core completes it, ending the move here.
    fn open_session(
        &self,
        session: MovedSession,
        to: String,
        grant: String,
        tenant: String,
        reply_to: ReplyTo,
        replier: &Replier,
    );
}
