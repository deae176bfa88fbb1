//! The node's core: the seam between the node's transports and what serves requests. It does no
//! I/O and holds no libtorch, so each side can be built, tested and (later) run in a process of
//! its own.
//!
//! - [`Service`]: what a transport (`djinn-dataplane`'s poller) hands each request to, on its
//!   own thread, and what it tells of connections closing and of time passing.
//! - [`Reply`], [`ReplyTo`], [`Replier`]: an answer, the request it answers, and the way to send
//!   one from another thread (an executor worker) back to the poller.
//! - [`NodeCore`]: the [`Service`] of a node. It routes each request once, by what it asks:
//!   named tensors (`store.rs`), registrations in progress and the records of kept tensors
//!   (`kept.rs`) are its own; the rest goes to the [`Executor`] as a typed [`Job`] of plain
//!   data and the payload it arrived in, a session's one at a time in the order they came
//!   (`sessions.rs`), with parked requests checked against its records (`parked.rs`). The
//!   executor's answers come back through the core
//!   ([`Answer::Executed`], [`Service::complete`]).
//! - [`LocalNode`]: the node's own requests (its membership agent, /metrics, drain), served by
//!   the poller in process, with no socket and no frame.
//! - [`Peers`]: the node's way to other nodes (pushes, session moves), which the node provides
//!   (`djinn-node`'s mover): what serves requests opens no connection of its own.

mod admission;
#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
mod grants;
mod jobs;
mod kept;
pub mod link;
mod local;
mod node;
mod parked;
mod peers;
mod reply;
mod service;
mod sessions;
mod store;
mod upload;

pub use admission::Admission;
pub use grants::Delivery;
pub use jobs::{CallInputs, Executor, Job, TenantNames};
pub use kept::HandleError;
pub use local::{LocalError, LocalNode, LocalRequest};
pub use node::{CoreOptions, MAX_ARCHIVE_READ, NodeCore, tenant_budget};
pub use parked::{Ended, ParkedError};
pub use peers::{MovedSession, PeerError, Peers, PushedTensor};
pub use reply::{Answer, Executed, Replier, Reply, ReplyTo};
pub use service::Service;
pub use sessions::{MAX_QUEUED_OPS, SessionError};
pub use upload::{Scope, Upload};

/// What a named or kept tensor is charged besides its bytes, and what a parked request is
/// charged at least: its bookkeeping, so that objects of no bytes still count against the
/// budget and the tenant's quota.
pub const MIN_CHARGE: u64 = 4096;
/// Most named tensors, and most kept tensors, one tenant holds on a node.
pub const MAX_OBJECTS_PER_TENANT: usize = 65_536;
/// Most sessions, and most parked requests, one tenant holds on a node.
pub const MAX_SESSIONS_PER_TENANT: usize = 4096;
/// Most registrations one tenant has in progress on a node at once.
pub const MAX_UPLOADS_PER_TENANT: usize = 16;
/// The most sessions or kept tensors one list answers (its metadata stays well under the
/// frame's limit); the rest come on later pages.
pub const LIST_PAGE: usize = 1024;

/// How often the core sweeps for what lapses after `ttl` (kept tensors unused, requests
/// parked): a few times per limit, so nothing outlives it by more than a quarter.
fn sweep_every(ttl: std::time::Duration) -> std::time::Duration {
    use std::time::Duration;
    (ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(10))
}

/// The page of `ids` after `after`, in order (at most [`LIST_PAGE`]), and whether more remain.
pub fn list_page(ids: impl Iterator<Item = u64>, after: u64) -> (Vec<u64>, bool) {
    let mut ids: Vec<u64> = ids.filter(|&id| id > after).collect();
    ids.sort_unstable();
    let more = ids.len() > LIST_PAGE;
    ids.truncate(LIST_PAGE);
    (ids, more)
}
