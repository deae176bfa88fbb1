//! The node side of Djinn: what a node holds and computes. Named tensors live in host memory
//! under the node's budget; models are ordered lists of TorchScript blocks, loaded once per
//! fingerprint onto the node's device (libtorch through `tch`) and run by worker threads that
//! the data plane's poller feeds.

mod convert;
mod error;
mod handles;
mod models;
mod mover;
mod parked;
mod service;
mod sessions;
mod store;
pub mod stream;
mod workers;

pub use error::ExecError;
pub use handles::{HandleError, HandleTable};
pub use models::{Model, ModelStore, Scope, Unregistered, Upload, device_name, load, parse_device};
pub use mover::{ListNodes, PeerLimits, PushPeers};
pub use parked::{BreakpointError, Ended};
pub use service::{NodeOptions, NodeService, tenant_budget};
pub use sessions::{Policy, SessionError, SessionOptions, SessionTable};
pub use store::TensorStore;
pub use tch::Device;
