//! TorchScript's edge: a module takes and returns libtorch `IValue`s, converted here from and
//! to [`ModelValue`]s (nothing else in the executor holds an `IValue`).

use tch::jit::{CModule, IValue};

use crate::error::ExecError;
use crate::value::ModelValue;

/// Runs `module` on `args`. An output with no wire form (an object, a device) is an error.
pub(crate) fn forward(module: &CModule, args: Vec<ModelValue>) -> Result<ModelValue, ExecError> {
    let args: Vec<IValue> = args.into_iter().map(to_ivalue).collect();
    from_ivalue(module.forward_is(&args)?)
}

fn to_ivalue(value: ModelValue) -> IValue {
    let items = |items: Vec<ModelValue>| items.into_iter().map(to_ivalue).collect::<Vec<_>>();
    match value {
        ModelValue::None => IValue::None,
        ModelValue::Tensor(t) => IValue::Tensor(t),
        ModelValue::Int(v) => IValue::Int(v),
        ModelValue::Float(v) => IValue::Double(v),
        ModelValue::Bool(v) => IValue::Bool(v),
        ModelValue::Str(s) => IValue::String(s),
        ModelValue::Tuple(v) => IValue::Tuple(items(v)),
        // TorchScript wants typed lists (List[Tensor], List[int], ...) where it can have them.
        ModelValue::List(v) => typed_list(items(v)),
        ModelValue::Dict(entries) => {
            IValue::GenericDict(entries.into_iter().map(|(k, v)| (to_ivalue(k), to_ivalue(v))).collect())
        }
    }
}

fn typed_list(values: Vec<IValue>) -> IValue {
    macro_rules! all {
        ($variant:ident, $list:ident) => {
            if !values.is_empty() && values.iter().all(|v| matches!(v, IValue::$variant(_))) {
                return IValue::$list(
                    values
                        .into_iter()
                        .filter_map(|v| if let IValue::$variant(x) = v { Some(x) } else { None })
                        .collect(),
                );
            }
        };
    }
    all!(Tensor, TensorList);
    all!(Int, IntList);
    all!(Double, DoubleList);
    all!(Bool, BoolList);
    all!(String, StringList);
    IValue::GenericList(values)
}

fn from_ivalue(value: IValue) -> Result<ModelValue, ExecError> {
    let items = |items: Vec<IValue>| items.into_iter().map(from_ivalue).collect::<Result<Vec<_>, _>>();
    Ok(match value {
        IValue::None => ModelValue::None,
        IValue::Tensor(t) => ModelValue::Tensor(t),
        IValue::Double(v) => ModelValue::Float(v),
        IValue::Int(v) => ModelValue::Int(v),
        IValue::Bool(v) => ModelValue::Bool(v),
        IValue::String(s) => ModelValue::Str(s),
        IValue::Tuple(v) => ModelValue::Tuple(items(v)?),
        IValue::IntList(v) => ModelValue::List(v.into_iter().map(ModelValue::Int).collect()),
        IValue::DoubleList(v) => ModelValue::List(v.into_iter().map(ModelValue::Float).collect()),
        IValue::BoolList(v) => ModelValue::List(v.into_iter().map(ModelValue::Bool).collect()),
        IValue::StringList(v) => ModelValue::List(v.into_iter().map(ModelValue::Str).collect()),
        IValue::TensorList(v) => ModelValue::List(v.into_iter().map(ModelValue::Tensor).collect()),
        IValue::GenericList(v) => ModelValue::List(items(v)?),
        IValue::GenericDict(entries) => ModelValue::Dict(
            entries
                .into_iter()
                .map(|(k, v)| Ok((from_ivalue(k)?, from_ivalue(v)?)))
                .collect::<Result<_, ExecError>>()?,
        ),
        other => {
            return Err(ExecError::Unsupported(format!("the model returned {other:?}, which has no wire form")));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn lists_go_to_torchscript_typed_where_they_can() {
        let list = |items: Vec<ModelValue>| to_ivalue(ModelValue::List(items));
        assert!(matches!(list(vec![ModelValue::Int(1), ModelValue::Int(2)]), IValue::IntList(v) if v == [1, 2]));
        let t = || ModelValue::Tensor(Tensor::zeros([2], (Kind::Float, Device::Cpu)));
        assert!(matches!(list(vec![t(), t()]), IValue::TensorList(v) if v.len() == 2));
        assert!(matches!(list(vec![t(), ModelValue::Int(1)]), IValue::GenericList(v) if v.len() == 2));
        assert!(matches!(list(Vec::new()), IValue::GenericList(v) if v.is_empty()));
    }

    #[test]
    fn what_torchscript_returns_comes_back_without_ivalues() {
        let out = IValue::Tuple(vec![IValue::IntList(vec![3, 4]), IValue::String("s".into()), IValue::Double(0.5)]);
        let ModelValue::Tuple(items) = from_ivalue(out).unwrap() else { panic!("not a tuple") };
        assert!(matches!(&items[0], ModelValue::List(v) if matches!(v[..], [ModelValue::Int(3), ModelValue::Int(4)])));
        assert!(matches!(&items[1], ModelValue::Str(s) if s == "s"));
        assert!(matches!(items[2], ModelValue::Float(0.5)));
        let e = from_ivalue(IValue::Tuple(vec![IValue::Device(Device::Cpu)])).unwrap_err().to_string();
        assert!(e.contains("the model returned Device(Cpu), which has no wire form"), "{e}");
    }
}
