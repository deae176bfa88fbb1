//! A node's executor: what it holds and computes, behind the node's core (`djinn-node-core`),
//! which hands it typed jobs ([`TorchExecutor`] is its `Executor`). Kept tensors live under the
//! node's memory budget; a model is an ordered list of blocks, each a checked graph run
//! through libtorch's dispatcher (`graph/`; TorchScript only from principals with the right),
//! loaded once per fingerprint onto the node's device and run by worker threads, each run
//! planned and charged to its tenant before it runs (`cost.rs`). Sessions keep state between
//! steps, breakpoints park runs between blocks, and models larger than the budget stream
//! through a ring (`stream.rs`).

// One libtorch binding, chosen by feature (tch checks the torch version it is built against).
#[cfg(all(feature = "torch-2-13", feature = "torch-2-11"))]
compile_error!(
    "features torch-2-13 and torch-2-11 exclude each other: build with --no-default-features --features torch-2-11"
);
#[cfg(not(any(feature = "torch-2-13", feature = "torch-2-11")))]
compile_error!("choose the torch to build against: feature torch-2-13 (the default) or torch-2-11");
/// The libtorch binding this crate was built with, for the crates above it.
#[cfg(all(feature = "torch-2-11", not(feature = "torch-2-13")))]
pub extern crate tch_0_24 as tch;
#[cfg(feature = "torch-2-13")]
pub use ::tch;

mod convert;
pub mod cost;

pub use djinn_node_core::MAX_SESSIONS_PER_TENANT;
pub(crate) use djinn_node_core::{MIN_CHARGE, list_page as page};

/// Most models one tenant holds on a node (as the control plane's default cap per tenant).
pub const MAX_MODELS_PER_TENANT: usize = 4096;
pub mod allocator;
mod deadline;
mod error;
mod fair;
pub mod graph;
mod index_bounds;
mod kept;
pub mod libtorch;
mod models;
mod operands;
mod parked;
mod sessions;
pub mod stream;
mod tensors;
mod torch_executor;
mod torchscript;
mod value;
mod workers;

pub use error::{BreakpointError, ExecError, SessionError};
pub use kept::HandleSpace;
pub use models::{Model, ModelStore, Unregistered, device_name, load, parse_device};
pub use sessions::{Policy, SessionOptions, SessionTable};
pub use tch::Device;
pub use torch_executor::{ExecutorOptions, Quotas, TorchExecutor};
pub use value::ModelValue;
