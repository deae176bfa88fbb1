//! The node's way to other nodes.

use std::fmt;

use djinn_proto::{ErrorCode, Fingerprint, Handle, SharedBytes, TensorDesc};

use crate::{Replier, ReplyTo};

/// Why a push or a move to another node failed: the code and message the tenant gets.
pub type PeerError = (ErrorCode, String);

/// A tensor to push: its descriptor and its bytes, in host memory.
pub struct PushedTensor {
    pub desc: TensorDesc,
    pub bytes: SharedBytes,
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

    /// Opens, on the node at `to` and on its `grant`, a session of the model `fingerprint` for
    /// `tenant` (by name) whose state is `state` (each tensor's description and bytes), holding
    /// `reserve` bytes for it there. Blocks the caller: the handle the peer gives the session,
    /// and the path the state took.
    fn open_session(
        &self,
        to: &str,
        grant: &str,
        tenant: &str,
        fingerprint: Fingerprint,
        state: &[(TensorDesc, SharedBytes)],
        reserve: u64,
    ) -> Result<(Handle, &'static str), PeerError>;
}
