//! Djinn's data plane: the sans-IO wire protocol ([`proto`]); the TCP drivers around it
//! ([`tcp`]): a node-side poller on mio or io_uring, optional TLS, and a blocking client
//! connection; and RDMA ([`rdma`]): the verbs bindings and a sans-IO session core that moves
//! frames and payloads over queue pairs, beside a TCP connection.

pub mod proto;
pub mod rdma;
pub mod tcp;
