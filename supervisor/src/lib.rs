//! Executors in processes of their own, with no libtorch: the node's side
//! ([`ProcessExecutor`], an [`djinn_node_core::Executor`] whose jobs run in a child process)
//! and the child's ([`serve`], any executor served over the link). The two speak
//! `djinn_node_core::link` through rings in a memfd region (`djinn-shm`) the child inherits at
//! [`LINK_FD`].
//!
//! [`TenantExecutors`] runs one such process per tenant, started by its first request and
//! started again after it ends (the tenant's models loaded there again; a tenant whose
//! processes keep ending waits longer each time, [`restarts`]). Still to come (issue
//! 52): processes stopped when idle, one device budget over them all, the payload arenas the
//! node's reader fills in place. Each process is confined in the layers of [`sandbox`].

mod channel;
mod process;
pub mod restarts;
pub mod sandbox;
mod serve;
mod tenants;

pub use channel::LinkSizes;
pub use process::{BeforeSend, FirstJob, ProcessExecutor, Supervision};
pub use serve::serve;
pub use tenants::{Launch, TenantExecutors};

/// Where an executor process finds its link's region.
pub const LINK_FD: i32 = 3;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SupervisorError {
    #[error(transparent)]
    Shm(#[from] djinn_shm::ShmError),
    #[error("the link's rings: {0}")]
    Ring(#[from] djinn_shm::RingError),
    #[error(transparent)]
    Link(#[from] djinn_node_core::link::LinkError),
    #[error("a link of {0:?} does not fit the address space")]
    Sizes(LinkSizes),
    #[error("the region is not a link's: {0}")]
    Layout(&'static str),
    #[error("cannot start the executor process: {0}")]
    Start(std::io::Error),
    #[error("cannot start a thread: {0}")]
    Thread(std::io::Error),
    #[error("the executor process ended before it was ready: {0}")]
    Ended(String),
    #[error("the executor process was not ready within {0:?}")]
    NotReady(std::time::Duration),
    #[error("the executor process broke the link: {0}")]
    Protocol(&'static str),
}
