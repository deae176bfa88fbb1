//! The node's core: the seam between the node's transports and what serves requests. It does no
//! I/O and holds no libtorch, so each side can be built, tested and (later) run in a process of
//! its own.
//!
//! - [`Service`]: what a transport (`djinn-dataplane`'s poller) hands each request to, on its
//!   own thread, and what it tells of connections closing and of time passing.
//! - [`Reply`], [`ReplyTo`], [`Replier`]: an answer, the request it answers, and the way to send
//!   one from another thread (an executor worker) back to the poller.
//! - [`Peers`]: the node's way to other nodes (pushes, session moves), which the node provides
//!   (`djinn-node`'s mover): what serves requests opens no connection of its own.

mod peers;
mod reply;
mod service;

pub use peers::{PeerError, Peers, PushSource};
pub use reply::{Replier, Reply, ReplyTo};
pub use service::Service;
