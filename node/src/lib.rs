//! What a node runs beside the data plane's poller (`djinn-dataplane`) and the executor
//! (`djinn-executor`), each a client of the node's own data plane so that none shares state
//! with the poller: its membership in a control plane ([`membership`]), with the device rates
//! it reports ([`rates`]) and the moves of what it holds when it is drained ([`drain`]); its Prometheus endpoint ([`metrics`]); and the checks of this host's
//! GPUs that `djinn gpu-check` prints ([`gpu_check`]). The `djinn` binary parses flags and
//! assembles these.

pub mod drain;
pub mod gpu_check;
pub mod membership;
pub mod metrics;
pub mod mover;
pub mod rates;
