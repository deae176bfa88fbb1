//! A bound node server: the listener and the backend that drives it.

use std::io;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::time::Instant;

use super::server::{Backend, Core, ServerConfig, ServerCounters, ShutdownHandle};
use super::{mio_backend, uring_backend};
use djinn_node_core::{LocalNode, Service};

/// A bound node server; [`Server::run`] drives it on the calling thread until shut down.
pub struct Server<S> {
    local_addr: SocketAddr,
    backend: BackendServer<S>,
}

enum BackendServer<S> {
    Mio(Box<mio_backend::MioServer<S>>),
    Uring(Box<uring_backend::UringServer<S>>),
}

impl<S> std::fmt::Debug for Server<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("local_addr", &self.local_addr).finish()
    }
}

impl<S: Service> Server<S> {
    /// Binds `addr` (port 0 picks a free port) with the configured backend.
    pub fn bind(addr: impl ToSocketAddrs, config: ServerConfig, service: S, agent: &str) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let local_addr = listener.local_addr()?;
        let uring = matches!(config.backend, Backend::Uring);
        let make_core = |wake| Core::new(service, config, agent, wake, Instant::now());
        let backend = if uring {
            BackendServer::Uring(Box::new(uring_backend::UringServer::new(listener, make_core)?))
        } else {
            BackendServer::Mio(Box::new(mio_backend::MioServer::new(listener, make_core)?))
        };
        Ok(Self { local_addr, backend })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The way in for the node's own requests (its membership agent, /metrics, drain): served
    /// in the poller's turns, with no socket.
    pub fn local_node(&self) -> LocalNode {
        match &self.backend {
            BackendServer::Mio(s) => s.local_node(),
            BackendServer::Uring(s) => s.local_node(),
        }
    }

    pub fn shutdown_handle(&self) -> ShutdownHandle {
        match &self.backend {
            BackendServer::Mio(s) => s.shutdown_handle(),
            BackendServer::Uring(s) => s.shutdown_handle(),
        }
    }

    /// Serves until [`ShutdownHandle::shutdown`]; returns the final counters.
    pub fn run(self) -> io::Result<ServerCounters> {
        match self.backend {
            BackendServer::Mio(s) => s.run(),
            BackendServer::Uring(s) => s.run(),
        }
    }
}
