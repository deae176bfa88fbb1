//! Djinn's data plane: the sans-IO wire protocol ([`proto`]) and the TCP drivers around it
//! ([`tcp`]): a node-side poller on mio or io_uring, and a blocking client connection.

pub mod proto;
pub mod rdma;
pub mod tcp;
