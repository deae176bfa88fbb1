//! Djinn's transports, around the sans-IO protocol of `djinn-proto`: over TCP ([`tcp`]), the
//! node's poller on mio or io_uring and optional TLS; over RDMA ([`rdma`]), the verbs bindings
//! and the channel that drives the protocol's RDMA session core beside a TCP connection; and
//! [`client`], a client's connection over either.

pub mod client;
pub mod rdma;
pub mod tcp;

/// How a node's device memory meets the network. Only one path is built: staging, where the
/// bytes of a device tensor go through host memory (copied there before a send, from there
/// after a receive; on a CPU-only node they are there already). Registering GPU memory with the
/// RDMA device (dma-buf, then nvidia-peermem) is not built yet, so no node reports it.
pub const MEMORY_PATH: &str = "staging";
