//! One step of a graph: a native step (Python's integer arithmetic, `getitem`, `size`), or an
//! operator's prepared call through the shim (its varying arguments converted, its outputs
//! read back), and the values of the run's environment the steps read.

use std::ffi::{c_char, c_int, c_void};

use djinn_graph::schema::Type;
use djinn_graph::{Arg, Native};
use tch::Tensor;

use super::RtValue;
use super::ffi::{self, RequestGenerator, take_message};
use super::prepare::PreparedCall;
use crate::error::ExecError;

/// A value argument's runtime value, or a constant's (a list of values and constants too).
pub(super) fn value_of(arg: &Arg, env: &[Option<RtValue>]) -> Result<RtValue, String> {
    Ok(match arg {
        Arg::Value(id) => env
            .get(*id as usize)
            .and_then(Option::as_ref)
            .map(RtValue::shallow_clone)
            .ok_or_else(|| format!("value {id} has not been computed"))?,
        Arg::None => RtValue::None,
        Arg::Int(i) => RtValue::Int(*i),
        Arg::Bool(b) => RtValue::Bool(*b),
        Arg::Float(f) => RtValue::Float(f.parse().map_err(|_| format!("{f:?} is not a float"))?),
        Arg::List(items) => RtValue::List(items.iter().map(|a| value_of(a, env)).collect::<Result<_, _>>()?),
        other => return Err(format!("{other:?} is not a value")),
    })
}

pub(super) fn native(op: Native, args: &[Arg], env: &[Option<RtValue>]) -> Result<RtValue, String> {
    let a = value_of(&args[0], env)?;
    if op == Native::GetItem {
        let Arg::Int(index) = args[1] else { return Err("getitem's index".into()) };
        let RtValue::List(mut items) = a else { return Err("getitem of a non-list".into()) };
        let len = items.len() as i64;
        let at = if index < 0 { index + len } else { index };
        if !(0..len).contains(&at) {
            return Err(format!("index {index} of a list of {len}"));
        }
        return Ok(items.swap_remove(at as usize));
    }
    if op == Native::Size {
        let RtValue::Tensor(t) = a else { return Err("size of a non-tensor".into()) };
        let dim = value_of(&args[1], env)?.int().ok_or("size's dimension")?;
        let size = t.size();
        let rank = size.len() as i64;
        let at = if dim < 0 { dim + rank } else { dim };
        return size
            .get(usize::try_from(at).map_err(|_| "dimension")?)
            .copied()
            .map(RtValue::Int)
            .ok_or(format!("dimension {dim} of rank {rank}"));
    }
    let x = a.int().ok_or("an integer")?;
    if op == Native::Neg {
        return x.checked_neg().map(RtValue::Int).ok_or_else(|| "overflow".into());
    }
    let y = value_of(&args[1], env)?.int().ok_or("an integer")?;
    let overflow = || "integer overflow".to_owned();
    Ok(match op {
        Native::Add => RtValue::Int(x.checked_add(y).ok_or_else(overflow)?),
        Native::Sub => RtValue::Int(x.checked_sub(y).ok_or_else(overflow)?),
        Native::Mul => RtValue::Int(x.checked_mul(y).ok_or_else(overflow)?),
        // Python's: rounded towards negative infinity, the remainder with the divisor's sign.
        Native::FloorDiv => RtValue::Int(
            x.checked_div_euclid(y)
                .map(|q| if y < 0 && x.rem_euclid(y) != 0 { q + 1 } else { q })
                .ok_or("division by zero")?,
        ),
        Native::Mod => RtValue::Int(
            x.checked_rem(y).map(|r| if r != 0 && (r < 0) != (y < 0) { r + y } else { r }).ok_or("division by zero")?,
        ),
        Native::Min => RtValue::Int(x.min(y)),
        Native::Max => RtValue::Int(x.max(y)),
        Native::Eq => RtValue::Bool(x == y),
        Native::Ne => RtValue::Bool(x != y),
        Native::Lt => RtValue::Bool(x < y),
        Native::Le => RtValue::Bool(x <= y),
        Native::Gt => RtValue::Bool(x > y),
        Native::Ge => RtValue::Bool(x >= y),
        Native::Neg | Native::GetItem | Native::Size => unreachable!("handled above"),
    })
}

/// Storage for the varying arguments of one run: the vectors their pointers point into.
#[derive(Default)]
struct Scratch {
    ints: Vec<Vec<i64>>,
    doubles: Vec<Vec<f64>>,
    tensors: Vec<Vec<*const c_void>>,
    held: Vec<Tensor>,
}

pub(super) fn run_call(
    call: &PreparedCall,
    env: &[Option<RtValue>],
    generator: Option<&RequestGenerator>,
    outs: &mut Vec<ffi::Out>,
) -> Result<Vec<RtValue>, ExecError> {
    let mut scratch = Scratch::default();
    let mut varying = Vec::with_capacity(call.varying.len() + 1);
    let fail = |why: String| ExecError::Execution(format!("{}: {why}", call.name));
    for (arg, rule) in &call.rules {
        if !crate::operands::admitted(rule, &value_of(arg, env).map_err(fail)?) {
            return Err(fail(format!("an argument the run computed ({arg:?}) is not {rule}")));
        }
    }
    for (index, ty, arg) in &call.varying {
        let value = value_of(arg, env).map_err(fail)?;
        varying.push(to_varying(*index, ty, value, &mut scratch).map_err(fail)?);
    }
    if let (Some(index), Some(generator)) = (call.generator, generator) {
        let mut arg = to_varying(index, &Type::Other("Generator".into()), RtValue::None, &mut scratch).map_err(fail)?;
        arg.kind = ffi::ARG_GENERATOR;
        arg.generator = generator.0.as_ptr();
        varying.push(arg);
    }
    // Grown once per run to the largest call's room; the shim writes every entry it counts, and
    // only those are read, so what earlier calls left past them needs no clearing.
    if outs.len() < call.cap {
        outs.resize(call.cap, ffi::Out { tag: ffi::OUT_NONE, i: 0, d: 0.0, tensor: std::ptr::null_mut() });
    }
    let mut n = 0usize;
    let mut err: *mut c_char = std::ptr::null_mut();
    // SAFETY: the varying arguments point into `scratch` and `env`'s tensors, which live past the
    // call; `outs` has room for `cap` entries.
    let rc: c_int = unsafe {
        ffi::djinn_call_run(
            call.raw.as_ptr(),
            varying.as_ptr(),
            varying.len(),
            outs.as_mut_ptr(),
            call.cap,
            &mut n,
            &mut err,
        )
    };
    drop(scratch);
    if rc != 0 {
        return Err(ExecError::Execution(format!("{}: {}", call.name, take_message(err))));
    }
    let mut items = outs[..n].iter();
    let mut results = Vec::new();
    while let Some(v) = read_out(&mut items) {
        results.push(v);
    }
    Ok(results)
}

/// One output value from the flattened list (a list takes its items with it).
fn read_out<'a>(items: &mut impl Iterator<Item = &'a ffi::Out>) -> Option<RtValue> {
    let o = items.next()?;
    Some(match o.tag {
        // SAFETY: a new at::Tensor from the shim, owned from here (tch frees it on drop).
        ffi::OUT_TENSOR => RtValue::Tensor(unsafe { Tensor::from_ptr(o.tensor.cast()) }),
        ffi::OUT_INT => RtValue::Int(o.i),
        ffi::OUT_DOUBLE => RtValue::Float(o.d),
        ffi::OUT_BOOL => RtValue::Bool(o.i != 0),
        ffi::OUT_LIST => RtValue::List((0..o.i).filter_map(|_| read_out(items)).collect()),
        _ => RtValue::None,
    })
}

fn to_varying(index: usize, ty: &Type, value: RtValue, scratch: &mut Scratch) -> Result<ffi::VaryingArg, String> {
    let mut arg = ffi::VaryingArg {
        index,
        kind: ffi::ARG_NONE,
        i: 0,
        d: 0.0,
        tensor: std::ptr::null(),
        ints: std::ptr::null(),
        doubles: std::ptr::null(),
        tensors: std::ptr::null(),
        len: 0,
        generator: std::ptr::null(),
    };
    match (ty.required(), value) {
        (_, RtValue::None) => {}
        (_, RtValue::Tensor(t)) => {
            arg.kind = ffi::ARG_TENSOR;
            arg.tensor = t.as_ptr().cast();
            scratch.held.push(t);
        }
        (Type::Tensor, RtValue::Int(i)) => {
            arg.kind = ffi::ARG_WRAPPED_INT;
            arg.i = i;
        }
        (Type::Tensor, RtValue::Float(f)) => {
            arg.kind = ffi::ARG_WRAPPED_DOUBLE;
            arg.d = f;
        }
        (Type::Tensor, RtValue::Bool(b)) => {
            arg.kind = ffi::ARG_WRAPPED_BOOL;
            arg.i = i64::from(b);
        }
        (Type::Float, RtValue::Int(i)) => {
            arg.kind = ffi::ARG_DOUBLE;
            arg.d = i as f64;
        }
        (_, RtValue::Int(i)) => {
            arg.kind = ffi::ARG_INT;
            arg.i = i;
        }
        (_, RtValue::Float(f)) => {
            arg.kind = ffi::ARG_DOUBLE;
            arg.d = f;
        }
        (_, RtValue::Bool(b)) => {
            arg.kind = ffi::ARG_BOOL;
            arg.i = i64::from(b);
        }
        (Type::List(inner), RtValue::List(items)) => match inner.as_ref() {
            Type::Tensor | Type::Optional(_) => {
                let optional = matches!(inner.as_ref(), Type::Optional(_));
                let mut ptrs = Vec::with_capacity(items.len());
                for item in items {
                    match item {
                        RtValue::Tensor(t) => {
                            ptrs.push(t.as_ptr().cast::<c_void>());
                            scratch.held.push(t);
                        }
                        RtValue::None if optional => ptrs.push(std::ptr::null()),
                        other => return Err(format!("{other:?} in a list of tensors")),
                    }
                }
                arg.kind = if optional { ffi::ARG_OPT_TENSOR_LIST } else { ffi::ARG_TENSOR_LIST };
                arg.tensors = ptrs.as_ptr();
                arg.len = ptrs.len();
                scratch.tensors.push(ptrs);
            }
            Type::Float => {
                let v = items
                    .iter()
                    .map(|x| match x {
                        RtValue::Float(f) => Ok(*f),
                        other => other.int().map(|i| i as f64).ok_or("a float"),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                arg.kind = ffi::ARG_DOUBLE_LIST;
                arg.doubles = v.as_ptr();
                arg.len = v.len();
                scratch.doubles.push(v);
            }
            _ => {
                let v = items.iter().map(|x| x.int().ok_or("an integer")).collect::<Result<Vec<_>, _>>()?;
                arg.kind = ffi::ARG_INT_LIST;
                arg.ints = v.as_ptr();
                arg.len = v.len();
                scratch.ints.push(v);
            }
        },
        (ty, other) => return Err(format!("{other:?} where the schema has {ty}")),
    }
    Ok(arg)
}
