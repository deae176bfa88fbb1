//! Preparing a node's operator call, once per model: the operator found by name in libtorch's
//! dispatcher, its schema compared with the allowlist's, its constants set and its varying
//! arguments listed, for the model's device or for the meta device (a plan's calls).

use std::ffi::{CString, c_char};
use std::ptr::NonNull;

use djinn_graph::format::dtype;
use djinn_graph::schema::Type;
use djinn_graph::{Allowlist, Arg, ValueRule};
use tch::Device;

use super::bad;
use super::ffi::{self, take_message};
use crate::error::ExecError;

/// One operator call, prepared: its constants set, its varying arguments listed by slot.
pub(super) struct PreparedCall {
    pub(super) raw: NonNull<ffi::Call>,
    pub(super) varying: Vec<(usize, Type, Arg)>,
    /// The slot of its generator argument (a random operator's).
    pub(super) generator: Option<usize>,
    /// The most flattened outputs it can give (list returns are not bounded by the schema).
    pub(super) cap: usize,
    pub(super) name: String,
    /// Index operands to check before it runs.
    pub(super) bounds: Option<crate::index_bounds::IndexBounds>,
    /// Probabilities to check before it runs.
    pub(super) probabilities: Option<crate::operands::Probabilities>,
    /// Varying arguments the allowlist has a rule on.
    pub(super) rules: Vec<(Arg, ValueRule)>,
    /// The arguments it writes (an in-place operator's target).
    pub(super) writes: Vec<Arg>,
}

// SAFETY: a prepared call is not changed after preparation; runs copy its arguments.
unsafe impl Send for PreparedCall {}
// SAFETY: as above: `djinn_call_run` only reads it, and the dispatcher is thread-safe.
unsafe impl Sync for PreparedCall {}

impl Drop for PreparedCall {
    fn drop(&mut self) {
        // SAFETY: made by `djinn_call_new`, freed once.
        unsafe { ffi::djinn_call_free(self.raw.as_ptr()) };
    }
}

/// Where a prepared call's device arguments point: the model's device, or the meta device
/// (a run's plan: shapes without memory).
#[derive(Debug, Clone, Copy)]
pub(super) enum Target {
    Device(Device),
    Meta,
}

/// Collapses whitespace, so schemas compare as text.
fn normalise(schema: &str) -> String {
    schema.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Whether an argument holds a value of the graph (so it is set per run).
fn varies(arg: &Arg) -> bool {
    match arg {
        Arg::Value(_) => true,
        Arg::List(items) => items.iter().any(varies),
        _ => false,
    }
}

pub(super) fn prepare(
    op: &str,
    overload: &str,
    schema: &djinn_graph::schema::Schema,
    args: &[Option<Arg>],
    target: Target,
    allowlist: &Allowlist,
) -> Result<PreparedCall, ExecError> {
    let name = djinn_graph::schema::qualified(op, overload);
    // A plan runs `view` as `reshape` (the same arguments): a view of a meta tensor whose
    // strides differ from the real one's (a kernel's output layout) may fail where the run's
    // does not, and the plan needs only its sizes; reshape views where it can.
    let in_plan_as_reshape = matches!(target, Target::Meta) && name == "aten::view";
    let (op, overload) = if in_plan_as_reshape { ("aten::reshape", "") } else { (op, overload) };
    let c_name = CString::new(op).map_err(|_| bad("an operator name with a NUL"))?;
    let c_overload = CString::new(overload).map_err(|_| bad("an overload name with a NUL"))?;
    let mut schema_text: *mut c_char = std::ptr::null_mut();
    let mut err: *mut c_char = std::ptr::null_mut();
    // SAFETY: NUL-terminated names; the out-pointers are written on success or failure.
    let raw = unsafe { ffi::djinn_call_new(c_name.as_ptr(), c_overload.as_ptr(), &mut schema_text, &mut err) };
    let Some(raw) = NonNull::new(raw) else {
        return Err(ExecError::Refused(format!(
            "{name}: this node's libtorch has no such operator: {}",
            take_message(err)
        )));
    };
    let rules = allowlist
        .rules(&name)
        .iter()
        .filter_map(|(slot, rule)| Some((args.get(*slot)?.clone().filter(varies)?, rule.clone())))
        .collect();
    let writes = (schema.arguments.iter().zip(args))
        .filter(|(a, _)| a.alias.as_ref().is_some_and(|alias| alias.write))
        .filter_map(|(_, given)| given.clone())
        .collect();
    let mut call = PreparedCall {
        raw,
        varying: Vec::new(),
        generator: None,
        cap: 0,
        name: name.clone(),
        bounds: crate::index_bounds::of(&name, args),
        probabilities: crate::operands::probabilities_of(&name, args),
        rules,
        writes,
    };
    let dispatcher = take_message(schema_text);
    let expected = allowlist.text(&name).unwrap_or_default();
    if normalise(&dispatcher) != normalise(expected) && !in_plan_as_reshape {
        return Err(ExecError::Refused(format!(
            "{name}: this node's libtorch has another schema for it ({dispatcher}) than the allowlist ({expected})"
        )));
    }
    call.cap = schema
        .returns
        .iter()
        .map(|r| if matches!(r.ty.required(), Type::List(_)) { 4096 } else { 1 })
        .sum::<usize>()
        .max(1);
    if matches!(target, Target::Meta) {
        // SAFETY: a live prepared call not yet shared.
        unsafe { ffi::djinn_call_plan_on_meta(call.raw.as_ptr()) };
    }
    for (i, (argument, given)) in schema.arguments.iter().zip(args).enumerate() {
        // A factory (`ones`, `arange`, ...) left to its default device makes a CPU tensor: in a
        // plan it must make a meta one, or the plan would allocate, and compute on, real memory.
        if matches!(target, Target::Meta)
            && *argument.ty.required() == Type::Device
            && matches!(given, None | Some(Arg::None))
        {
            // SAFETY: a live prepared call not yet shared; `i` is within the schema's arguments.
            unsafe { ffi::djinn_call_set_device(call.raw.as_ptr(), i, 2, -1) };
            continue;
        }
        let Some(given) = given else { continue };
        // A list of tensors is passed per run even when it holds none (`index` with `[None]`):
        // its items are set as tensors or absent, which a constant's setters do not carry.
        let tensor_list = matches!(argument.ty.required(), Type::List(inner) if *inner.required() == Type::Tensor);
        if varies(given) || tensor_list {
            call.varying.push((i, argument.ty.clone(), given.clone()));
        } else {
            set_constant(&call, i, &argument.ty, given, target)?;
        }
    }
    Ok(call)
}

fn set_constant(call: &PreparedCall, i: usize, ty: &Type, arg: &Arg, target: Target) -> Result<(), ExecError> {
    let raw = call.raw.as_ptr();
    let float = |f: &str| f.parse::<f64>().map_err(|_| bad(format!("{f:?} is not a float")));
    // SAFETY: every call below gets `raw`, a live prepared call not yet shared, and `i`, within
    // its schema's arguments (the checker bound the arguments to them); pointers and lengths
    // are of vectors and strings that live through the call (the shim copies them).
    unsafe {
        match (ty.required(), arg) {
            (_, Arg::None) => ffi::djinn_call_set_none(raw, i),
            // A number where the schema has a tensor: Python passes it as a wrapped number.
            (Type::Tensor, Arg::Int(v)) => ffi::djinn_call_set_wrapped_int(raw, i, *v),
            (Type::Tensor, Arg::Float(f)) => ffi::djinn_call_set_wrapped_double(raw, i, float(f)?),
            (Type::Tensor, Arg::Bool(b)) => ffi::djinn_call_set_wrapped_bool(raw, i, *b),
            (Type::Float, Arg::Int(v)) => ffi::djinn_call_set_double(raw, i, *v as f64),
            (_, Arg::Int(v)) => ffi::djinn_call_set_int(raw, i, *v),
            (_, Arg::Float(f)) => ffi::djinn_call_set_double(raw, i, float(f)?),
            (_, Arg::Bool(b)) => ffi::djinn_call_set_bool(raw, i, *b),
            (_, Arg::Str(s)) => {
                let s = CString::new(s.as_str()).map_err(|_| bad("a string with a NUL"))?;
                ffi::djinn_call_set_string(raw, i, s.as_ptr());
            }
            (_, Arg::Dtype(name)) => {
                ffi::djinn_call_set_int(raw, i, i64::from(dtype(name).ok_or_else(|| bad("dtype"))?.1))
            }
            (_, Arg::Layout(_)) => ffi::djinn_call_set_int(raw, i, 0),
            (_, Arg::MemoryFormat(m)) => ffi::djinn_call_set_int(
                raw,
                i,
                match m.as_str() {
                    "contiguous" => 0,
                    "preserve" => 1,
                    "channels_last" => 2,
                    _ => 3,
                },
            ),
            (_, Arg::Device(_)) => match target {
                Target::Device(Device::Cuda(n)) => ffi::djinn_call_set_device(raw, i, 1, n as i32),
                Target::Device(_) => ffi::djinn_call_set_device(raw, i, 0, -1),
                Target::Meta => ffi::djinn_call_set_device(raw, i, 2, -1),
            },
            (Type::List(inner), Arg::List(items)) => match inner.required() {
                Type::Float => {
                    let v = items
                        .iter()
                        .map(|a| match a {
                            Arg::Float(f) => float(f),
                            Arg::Int(i) => Ok(*i as f64),
                            _ => Err(bad("a float list")),
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    ffi::djinn_call_set_double_list(raw, i, v.as_ptr(), v.len());
                }
                Type::Bool => {
                    let v = items.iter().map(|a| matches!(a, Arg::Bool(true))).collect::<Vec<_>>();
                    ffi::djinn_call_set_bool_list(raw, i, v.as_ptr(), v.len());
                }
                _ => {
                    let v = items
                        .iter()
                        .map(|a| match a {
                            Arg::Int(i) => Ok(*i),
                            _ => Err(bad("an integer list")),
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    ffi::djinn_call_set_int_list(raw, i, v.as_ptr(), v.len());
                }
            },
            (_, other) => return Err(bad(format!("{}: cannot pass {other:?} as a constant", call.name))),
        }
    }
    Ok(())
}
