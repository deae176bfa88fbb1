//! Requests as the poller hands them to workers: decoded once, typed, so that a worker never
//! matches a frame's message again.

use djinn_proto::{Payload, TensorDesc, Value};

/// A call's inputs as they came: the argument values, the tensors they name (descriptors) and
/// the payload those tensors' bytes arrived in.
#[derive(Debug)]
pub struct CallInputs {
    pub values: Vec<Value>,
    pub tensors: Vec<TensorDesc>,
    pub payload: Option<Payload>,
}
