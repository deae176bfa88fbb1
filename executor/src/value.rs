//! The values a graph run computes: tensors, numbers, lists of them.

use tch::Tensor;

/// A runtime value of the graph.
#[derive(Debug)]
pub enum RtValue {
    None,
    Tensor(Tensor),
    Int(i64),
    Float(f64),
    Bool(bool),
    List(Vec<RtValue>),
}

impl RtValue {
    pub(crate) fn shallow_clone(&self) -> RtValue {
        match self {
            RtValue::None => RtValue::None,
            RtValue::Tensor(t) => RtValue::Tensor(t.shallow_clone()),
            RtValue::Int(i) => RtValue::Int(*i),
            RtValue::Float(f) => RtValue::Float(*f),
            RtValue::Bool(b) => RtValue::Bool(*b),
            RtValue::List(items) => RtValue::List(items.iter().map(RtValue::shallow_clone).collect()),
        }
    }

    pub(crate) fn int(&self) -> Option<i64> {
        match self {
            RtValue::Int(i) => Some(*i),
            RtValue::Bool(b) => Some(i64::from(*b)),
            _ => None,
        }
    }
}
