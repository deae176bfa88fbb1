//! What a node runs beside the data plane's poller (`djinn-dataplane`), its core
//! (`djinn-node-core`) and its executor: its membership in a control plane ([`membership`]),
//! with the device rates it reports ([`rates`]) and the moves of what it holds when it is
//! drained ([`drain`]); its Prometheus endpoint ([`metrics`]); each asks the node in process
//! ([`own_node`]), sharing no state with the poller. Its way to other nodes ([`mover`]: pushes
//! and session moves, the `Peers` the core and executor are given); and the checks of this
//! host's GPUs that `djinn gpu-check` prints ([`gpu_check`]). The `djinn` binary parses flags
//! and assembles these.

pub mod drain;
pub mod gpu_check;
pub mod membership;
pub mod metrics;
pub mod mover;
pub mod own_node;
pub mod rates;
