//! TCP around the protocol core: TLS, for both sides; and, with the feature `server`, the
//! node's poller on mio or io_uring. The client's connection is in
//! [`crate::client`].

#[cfg(feature = "server")]
mod accept;
#[cfg(all(test, feature = "server"))]
mod core_tests;
#[cfg(feature = "server")]
mod listener;
#[cfg(feature = "server")]
mod mio_backend;
#[cfg(feature = "server")]
mod server;
mod tls;
#[cfg(feature = "server")]
mod uring_backend;

#[cfg(feature = "server")]
pub use listener::Server;
#[cfg(feature = "server")]
pub use server::{Backend, ServerConfig, ServerCounters, ShutdownHandle};
pub use tls::{ClientTls, TlsError, TlsWire, server_config as tls_server_config};
