//! Property-test strategies for the types every message family uses; each family's file makes
//! its own messages from these (`arbitrary`).

use proptest::prelude::*;

use crate::tensor::{DType, TensorDesc};
use crate::value::{Handle, Value};

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL)
}

pub(crate) fn tensor() -> impl Strategy<Value = TensorDesc> {
    (dtype(), prop::collection::vec(0u64..6, 0..4)).prop_map(|(d, shape)| TensorDesc::new(d, shape).unwrap())
}

pub(crate) fn tensors() -> impl Strategy<Value = Vec<TensorDesc>> {
    prop::collection::vec(tensor(), 0..4)
}

pub(crate) fn name() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9_./é-]{0,24}"
}

/// A nested value whose tensor indices are below `tensors` (finite floats: NaN is not equal
/// to itself).
pub(crate) fn value(tensors: usize) -> impl Strategy<Value = Value> {
    let tensors = tensors as u32;
    let leaf = prop_oneof![
        Just(Value::None),
        any::<i64>().prop_map(Value::Int),
        (-1e300f64..1e300).prop_map(Value::Float),
        any::<bool>().prop_map(Value::Bool),
        ".{0,12}".prop_map(Value::Str),
        handle().prop_map(Value::Handle),
    ];
    let leaf =
        if tensors == 0 { leaf.boxed() } else { prop_oneof![leaf, (0..tensors).prop_map(Value::Tensor)].boxed() };
    leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Tuple),
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::List),
            prop::collection::vec((".{0,6}".prop_map(Value::Str), inner), 0..4).prop_map(Value::Dict),
        ]
    })
}

/// Values whose tensor indices are below `tensors`.
pub(crate) fn values(tensors: usize) -> impl Strategy<Value = Vec<Value>> {
    prop::collection::vec(value(tensors), 0..4)
}

pub(crate) fn handle() -> impl Strategy<Value = Handle> {
    (any::<u64>(), any::<u64>()).prop_map(|(id, epoch)| Handle { id, epoch })
}
