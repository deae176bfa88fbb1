//! RDMA verbs (on sideway): finding a usable port, reliable-connected queue pairs, and the
//! channel that carries frames over them by driving `djinn_proto::rdma`'s session core (eager
//! SENDs, rendezvous WRITEs with immediate, credits).

mod channel;
mod device;
mod verbs;

pub use channel::{ChannelError, RdmaChannel, Registrations, connection_key};
pub use device::{NoRdma, RdmaPort, find_port, mtu_bytes, mtu_of_bytes};
pub use verbs::{
    Completion, CompletionKind, Domain, EndpointInfo, QueueDepths, RcEndpoint, RdmaContext, RdmaError, Registered,
};
