//! RDMA verbs (on sideway): finding a usable port, and reliable-connected queue pairs.
//! The transport that carries frames over them (eager SENDs, rendezvous WRITEs with immediate,
//! credits) builds on these.

mod channel;
mod device;
mod session;
mod verbs;

#[cfg(test)]
mod session_tests;

pub use channel::{ChannelError, RdmaChannel, Registrations, connection_key};
pub use device::{NoRdma, RdmaPort, find_port, mtu_bytes, mtu_of_bytes};
pub use session::{Action, MAX_XFER, RDMA_HEADER_LEN, Session, SessionConfig, SessionError};
pub use verbs::{
    Completion, CompletionKind, Domain, EndpointInfo, QueueDepths, RcEndpoint, RdmaContext, RdmaError, Registered,
};
