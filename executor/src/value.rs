//! The values a graph run computes (tensors, numbers, lists of them), and the values models
//! take and return.

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

/// What a model's blocks take and return, and what a run stopped at a breakpoint keeps: the
/// wire's values with tensors in place of tensor indices and handles. A TorchScript block
/// converts to and from libtorch's `IValue` at its own edge (`torchscript.rs`); an `IValue`
/// cannot be sent to another thread, this can.
#[derive(Debug)]
pub enum ModelValue {
    None,
    Tensor(Tensor),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Tuple(Vec<ModelValue>),
    List(Vec<ModelValue>),
    Dict(Vec<(ModelValue, ModelValue)>),
}

impl ModelValue {
    /// A value sharing the tensors' memory.
    pub fn shallow_clone(&self) -> ModelValue {
        let items = |items: &[ModelValue]| items.iter().map(ModelValue::shallow_clone).collect();
        match self {
            ModelValue::None => ModelValue::None,
            ModelValue::Tensor(t) => ModelValue::Tensor(t.shallow_clone()),
            ModelValue::Int(i) => ModelValue::Int(*i),
            ModelValue::Float(f) => ModelValue::Float(*f),
            ModelValue::Bool(b) => ModelValue::Bool(*b),
            ModelValue::Str(s) => ModelValue::Str(s.clone()),
            ModelValue::Tuple(v) => ModelValue::Tuple(items(v)),
            ModelValue::List(v) => ModelValue::List(items(v)),
            ModelValue::Dict(entries) => {
                ModelValue::Dict(entries.iter().map(|(k, v)| (k.shallow_clone(), v.shallow_clone())).collect())
            }
        }
    }

    /// The value with each tensor passed through `f` (to copy what must not be shared).
    pub fn map_tensors<E>(self, f: &mut impl FnMut(Tensor) -> Result<Tensor, E>) -> Result<ModelValue, E> {
        let mut items = |items: Vec<ModelValue>| items.into_iter().map(|v| v.map_tensors(f)).collect::<Result<_, _>>();
        Ok(match self {
            ModelValue::Tensor(t) => ModelValue::Tensor(f(t)?),
            ModelValue::Tuple(v) => ModelValue::Tuple(items(v)?),
            ModelValue::List(v) => ModelValue::List(items(v)?),
            ModelValue::Dict(entries) => ModelValue::Dict(
                entries
                    .into_iter()
                    .map(|(k, v)| Ok((k.map_tensors(f)?, v.map_tensors(f)?)))
                    .collect::<Result<_, E>>()?,
            ),
            scalar => scalar,
        })
    }

    pub fn for_each_tensor(&self, f: &mut impl FnMut(&Tensor)) {
        match self {
            ModelValue::Tensor(t) => f(t),
            ModelValue::Tuple(items) | ModelValue::List(items) => items.iter().for_each(|v| v.for_each_tensor(f)),
            ModelValue::Dict(entries) => entries.iter().for_each(|(k, v)| {
                k.for_each_tensor(f);
                v.for_each_tensor(f);
            }),
            _ => {}
        }
    }
}

impl From<RtValue> for ModelValue {
    /// A list the graph computed is returned as a tuple.
    fn from(v: RtValue) -> Self {
        match v {
            RtValue::None => ModelValue::None,
            RtValue::Tensor(t) => ModelValue::Tensor(t),
            RtValue::Int(i) => ModelValue::Int(i),
            RtValue::Float(f) => ModelValue::Float(f),
            RtValue::Bool(b) => ModelValue::Bool(b),
            RtValue::List(items) => ModelValue::Tuple(items.into_iter().map(ModelValue::from).collect()),
        }
    }
}
