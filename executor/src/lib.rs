//! The node side of Djinn: what a node holds and answers. For now that is the named-tensor
//! store served over the data plane; every byte it holds is taken from the node's one
//! device-memory budget.

mod store;

pub use store::{StoreStats, TensorStore};
