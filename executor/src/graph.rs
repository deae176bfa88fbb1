//! Graphs run through libtorch's dispatcher (csrc/dispatch.cpp): a checked program
//! ([`djinn_graph::Checked`]) prepared once per model (each node's operator found by name, its
//! schema compared with the allowlist's, its constants set), then run node by node per call.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::ptr::NonNull;

use djinn_graph::format::{DimRange, dtype};
use djinn_graph::schema::Type;
use djinn_graph::{Arg, Checked, Native, Step};
use tch::{Device, Kind, Tensor};

use crate::error::ExecError;

mod ffi {
    use std::ffi::{c_char, c_int, c_void};

    #[repr(C)]
    pub struct Call {
        _private: [u8; 0],
    }

    pub const OUT_NONE: i32 = 0;
    pub const OUT_TENSOR: i32 = 1;
    pub const OUT_INT: i32 = 2;
    pub const OUT_DOUBLE: i32 = 3;
    pub const OUT_BOOL: i32 = 4;
    pub const OUT_LIST: i32 = 5;

    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct Out {
        pub tag: i32,
        pub i: i64,
        pub d: f64,
        pub tensor: *mut c_void,
    }

    pub const ARG_NONE: i32 = 0;
    pub const ARG_INT: i32 = 1;
    pub const ARG_DOUBLE: i32 = 2;
    pub const ARG_BOOL: i32 = 3;
    pub const ARG_TENSOR: i32 = 4;
    pub const ARG_INT_LIST: i32 = 5;
    pub const ARG_DOUBLE_LIST: i32 = 6;
    pub const ARG_TENSOR_LIST: i32 = 7;
    pub const ARG_OPT_TENSOR_LIST: i32 = 8;
    pub const ARG_WRAPPED_INT: i32 = 9;
    pub const ARG_WRAPPED_DOUBLE: i32 = 10;
    pub const ARG_WRAPPED_BOOL: i32 = 11;
    pub const ARG_GENERATOR: i32 = 12;

    #[repr(C)]
    pub struct VaryingArg {
        pub index: usize,
        pub kind: i32,
        pub i: i64,
        pub d: f64,
        pub tensor: *const c_void,
        pub ints: *const i64,
        pub doubles: *const f64,
        pub tensors: *const *const c_void,
        pub len: usize,
        pub generator: *const c_void,
    }

    unsafe extern "C" {
        pub fn djinn_free_message(message: *mut c_char);
        pub fn djinn_generator_new(kind: i32, index: i32, seed: u64, err: *mut *mut c_char) -> *mut c_void;
        pub fn djinn_generator_free(generator: *mut c_void);
        pub fn djinn_call_new(
            name: *const c_char,
            overload: *const c_char,
            schema: *mut *mut c_char,
            err: *mut *mut c_char,
        ) -> *mut Call;
        pub fn djinn_call_free(call: *mut Call);
        pub fn djinn_call_set_none(call: *mut Call, i: usize);
        pub fn djinn_call_set_int(call: *mut Call, i: usize, v: i64);
        pub fn djinn_call_set_double(call: *mut Call, i: usize, v: f64);
        pub fn djinn_call_set_bool(call: *mut Call, i: usize, v: bool);
        pub fn djinn_call_set_wrapped_int(call: *mut Call, i: usize, v: i64);
        pub fn djinn_call_set_wrapped_double(call: *mut Call, i: usize, v: f64);
        pub fn djinn_call_set_wrapped_bool(call: *mut Call, i: usize, v: bool);
        pub fn djinn_call_set_device(call: *mut Call, i: usize, kind: i32, index: i32);
        pub fn djinn_call_set_string(call: *mut Call, i: usize, s: *const c_char);
        pub fn djinn_call_set_int_list(call: *mut Call, i: usize, v: *const i64, n: usize);
        pub fn djinn_call_set_double_list(call: *mut Call, i: usize, v: *const f64, n: usize);
        pub fn djinn_call_set_bool_list(call: *mut Call, i: usize, v: *const bool, n: usize);
        pub fn djinn_call_run(
            call: *const Call,
            varying: *const VaryingArg,
            n_varying: usize,
            outs: *mut Out,
            cap: usize,
            n: *mut usize,
            err: *mut *mut c_char,
        ) -> c_int;
    }
}

/// Takes a message the shim allocated.
fn take_message(message: *mut c_char) -> String {
    if message.is_null() {
        return "unknown error".into();
    }
    // SAFETY: a NUL-terminated string from the shim's `copy_message`, freed once, here.
    let text = unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned();
    // SAFETY: as above.
    unsafe { ffi::djinn_free_message(message) };
    text
}

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

/// One request's generator: random operators draw from it and from nothing shared.
struct RequestGenerator(NonNull<c_void>);

impl RequestGenerator {
    fn new(device: Device) -> Result<Self, ExecError> {
        let (kind, index) = match device {
            Device::Cuda(n) => (1, n as i32),
            _ => (0, -1),
        };
        let mut err: *mut c_char = std::ptr::null_mut();
        // SAFETY: plain values in; a new generator or an error message out.
        let raw = unsafe { ffi::djinn_generator_new(kind, index, fresh_seed(), &mut err) };
        NonNull::new(raw).map(Self).ok_or_else(|| ExecError::Execution(format!("a generator: {}", take_message(err))))
    }
}

impl Drop for RequestGenerator {
    fn drop(&mut self) {
        // SAFETY: made by `djinn_generator_new`, freed once.
        unsafe { ffi::djinn_generator_free(self.0.as_ptr()) };
    }
}

/// A seed no other request can predict: from the kernel's random source.
fn fresh_seed() -> u64 {
    let mut seed = [0u8; 8];
    // SAFETY: getrandom writes at most the 8 bytes of `seed`.
    let n = unsafe { libc::getrandom(seed.as_mut_ptr().cast(), seed.len(), 0) };
    if n != seed.len() as isize {
        // No getrandom (very old kernels): the clock and the address of a stack slot.
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        return now.as_nanos() as u64 ^ (&seed as *const _ as u64).rotate_left(32);
    }
    u64::from_le_bytes(seed)
}

/// One operator call, prepared: its constants set, its varying arguments listed by slot.
struct PreparedCall {
    raw: NonNull<ffi::Call>,
    varying: Vec<(usize, Type, Arg)>,
    /// The slot of its generator argument (a random operator's).
    generator: Option<usize>,
    /// The most flattened outputs it can give (list returns are not bounded by the schema).
    cap: usize,
    name: String,
    /// Index operands to check before it runs.
    bounds: Option<crate::index_bounds::IndexBounds>,
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

/// Collapses whitespace, so schemas compare as text.
fn normalise(schema: &str) -> String {
    schema.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A graph ready to run on one device.
pub struct GraphModule {
    checked: Checked,
    /// Per graph of the program, per node: its prepared call (`None` for a native step).
    calls: Vec<Vec<Option<PreparedCall>>>,
    weights: Vec<(u32, Tensor)>,
    /// The initial values of a session's state, in host memory (`None`: zeros).
    state: Vec<Option<Tensor>>,
    device: Device,
}

// SAFETY: runs read its prepared calls (see `PreparedCall`) and take new references to its
// weights (`shallow_clone`, an atomic reference count in libtorch); no run writes a weight (the
// checker refuses graphs that would). The one change after `load` is a streamed block's weights
// re-pointed at its ring slot (stream.rs), which happens with the model's streamer locked, as
// every run of a streamed model is.
unsafe impl Sync for GraphModule {}

impl std::fmt::Debug for GraphModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphModule")
            .field("graphs", &self.calls.len())
            .field("weights", &self.weights.len())
            .field("state", &self.state.len())
            .finish()
    }
}

fn kind_of(name: &str) -> Option<Kind> {
    Some(match name {
        "uint8" => Kind::Uint8,
        "int8" => Kind::Int8,
        "int16" => Kind::Int16,
        "int32" => Kind::Int,
        "int64" => Kind::Int64,
        "float16" => Kind::Half,
        "float32" => Kind::Float,
        "float64" => Kind::Double,
        "bool" => Kind::Bool,
        "bfloat16" => Kind::BFloat16,
        _ => return None,
    })
}

fn bad(why: impl Into<String>) -> ExecError {
    ExecError::BadArchive(why.into())
}

impl GraphModule {
    /// Decodes, checks and prepares the graph container `bytes` on `device`, its weights
    /// copied out of `bytes`.
    pub fn load(bytes: &[u8], device: Device) -> Result<Self, ExecError> {
        let decoded = djinn_graph::decode(bytes).map_err(|e| bad(format!("not a valid graph: {e}")))?;
        let checked = djinn_graph::check(decoded.program, djinn_graph::allowlist())
            .map_err(|e| ExecError::Refused(format!("the graph is refused: {e}")))?;
        let mut weights = Vec::with_capacity(checked.program.weights.len());
        for w in &checked.program.weights {
            let kind = kind_of(&w.dtype).ok_or_else(|| bad(format!("weight {:?}: dtype {}", w.name, w.dtype)))?;
            let start = decoded.weights_start + w.offset as usize;
            let (size, _) = dtype(&w.dtype).ok_or_else(|| bad("dtype"))?;
            let len = w.shape.iter().product::<i64>() as usize * size as usize;
            let data = bytes.get(start..start + len).ok_or_else(|| bad(format!("weight {:?} is truncated", w.name)))?;
            // Copied: the upload's memory goes once the model is loaded.
            let t = Tensor::f_from_data_size(data, &w.shape, kind)?;
            let t = if device == Device::Cpu { t } else { t.f_to_device(device)? };
            weights.push((w.value, t));
        }
        let mut state = Vec::with_capacity(checked.program.state.len());
        for s in &checked.program.state {
            let kind = kind_of(&s.dtype).ok_or_else(|| bad(format!("state {:?}: dtype {}", s.name, s.dtype)))?;
            state.push(match s.offset {
                None => None,
                Some(offset) => {
                    let len = djinn_graph::tensor_len(&s.dtype, &s.shape).ok_or_else(|| bad("a state's shape"))?;
                    let start = decoded.weights_start + offset as usize;
                    let data = bytes.get(start..start + len as usize).ok_or_else(|| bad("a state is truncated"))?;
                    Some(Tensor::f_from_data_size(data, &s.shape, kind)?)
                }
            });
        }
        let calls = checked
            .graphs
            .iter()
            .zip(checked.program.graphs())
            .map(|(graph, g)| {
                graph
                    .steps
                    .iter()
                    .zip(g.nodes)
                    .map(|(step, node)| match step {
                        Step::Native { .. } => Ok(None),
                        Step::Op { schema, args, generator } => prepare(&node.op, &node.overload, schema, args, device)
                            .map(|mut call| {
                                call.generator = *generator;
                                Some(call)
                            }),
                    })
                    .collect::<Result<Vec<_>, ExecError>>()
            })
            .collect::<Result<Vec<_>, ExecError>>()?;
        Ok(Self { checked, calls, weights, state, device })
    }

    /// Tensors of a session's state (0 for a graph without).
    pub fn state_len(&self) -> usize {
        self.state.len()
    }

    /// Device bytes the session state takes.
    pub fn state_bytes(&self) -> u64 {
        self.checked.program.state.iter().filter_map(|s| djinn_graph::tensor_len(&s.dtype, &s.shape)).sum()
    }

    /// A new session's state on the model's device: a copy of the initial values.
    pub fn initial_state(&self) -> Result<Vec<Tensor>, ExecError> {
        let specs = &self.checked.program.state;
        specs
            .iter()
            .zip(&self.state)
            .map(|(spec, stored)| {
                Ok(match stored {
                    None => {
                        let kind = kind_of(&spec.dtype).ok_or_else(|| bad("a state's dtype"))?;
                        Tensor::f_zeros(spec.shape.as_slice(), (kind, self.device))?
                    }
                    Some(t) if self.device == Device::Cpu => t.f_detach_copy()?,
                    Some(t) => t.f_to_device(self.device)?,
                })
            })
            .collect()
    }

    /// Checks a state a client gave for a new session: the program's tensors, dtypes and shapes.
    pub fn check_state(&self, state: &[Tensor]) -> Result<(), ExecError> {
        let specs = &self.checked.program.state;
        if state.len() != specs.len() {
            return Err(ExecError::BadInput(format!(
                "{} state tensors; the model's state has {}",
                state.len(),
                specs.len()
            )));
        }
        for (t, spec) in state.iter().zip(specs) {
            let dims: Vec<DimRange> = spec.shape.iter().map(|&n| DimRange { min: n, max: n }).collect();
            check_input(&spec.name, &spec.dtype, &dims, t)?;
        }
        Ok(())
    }

    /// The first graph whose inputs `inputs` fit.
    fn select(&self, inputs: &[Tensor]) -> Result<usize, ExecError> {
        let mut why = Vec::new();
        for (i, g) in self.checked.program.graphs().enumerate() {
            let fits = if inputs.len() != g.inputs.len() {
                Err(ExecError::BadInput(format!("{} inputs; the graph takes {}", inputs.len(), g.inputs.len())))
            } else {
                g.inputs
                    .iter()
                    .zip(inputs)
                    .try_for_each(|(spec, t)| check_input(&spec.name, &spec.dtype, &spec.dims, t))
            };
            match fits {
                Ok(()) => return Ok(i),
                Err(e) => why.push(e),
            }
        }
        Err(match why.len() {
            1 => why.remove(0),
            n => ExecError::BadInput(format!(
                "the inputs fit none of the model's {n} graphs: {}",
                why.iter().enumerate().map(|(i, e)| format!("graph {i}: {e}")).collect::<Vec<_>>().join("; ")
            )),
        })
    }

    /// Handles on its weights (the tensors its runs read), named as in the program.
    pub fn weights(&self) -> Vec<(String, Tensor)> {
        let names = &self.checked.program.weights;
        names.iter().zip(&self.weights).map(|(w, (_, t))| (w.name.clone(), t.shallow_clone())).collect()
    }

    /// Runs the first graph of the program whose inputs `inputs` fit (on the model's device),
    /// returning its flattened outputs.
    pub fn run(&self, inputs: Vec<Tensor>) -> Result<Vec<RtValue>, ExecError> {
        let index = self.select(&inputs)?;
        let (Some(program), Some(checked), Some(calls)) =
            (self.checked.program.graph(index), self.checked.graphs.get(index), self.calls.get(index))
        else {
            return Err(ExecError::Internal(format!("graph {index} is not prepared")));
        };
        let mut env: Vec<Option<RtValue>> = (0..checked.values).map(|_| None).collect();
        for (spec, t) in program.inputs.iter().zip(inputs) {
            let t = if t.device() == self.device { t } else { t.f_to_device(self.device)? };
            env[spec.value as usize] = Some(RtValue::Tensor(t));
        }
        for (id, w) in &self.weights {
            env[*id as usize] = Some(RtValue::Tensor(w.shallow_clone()));
        }
        let mut outs: Vec<ffi::Out> = Vec::new();
        // Made at the first random operator of the run.
        let mut generator: Option<RequestGenerator> = None;
        for ((step, call), node) in checked.steps.iter().zip(calls).zip(program.nodes) {
            crate::deadline::check()?;
            match (step, call) {
                (Step::Native { op, args }, _) => {
                    let v = native(*op, args, &env).map_err(|e| ExecError::Execution(format!("{}: {e}", node.op)))?;
                    env[node.outputs[0] as usize] = Some(v);
                }
                (Step::Op { .. }, Some(call)) => {
                    if let Some(bounds) = &call.bounds {
                        crate::index_bounds::check(bounds, |arg| value_of(arg, &env))
                            .map_err(|e| ExecError::Execution(format!("{}: {e}", call.name)))?;
                    }
                    let request_generator = match (call.generator, &mut generator) {
                        (None, _) => None,
                        (Some(_), Some(g)) => Some(&*g),
                        (Some(_), slot @ None) => Some(&*slot.insert(RequestGenerator::new(self.device)?)),
                    };
                    let results = run_call(call, &env, request_generator, &mut outs)?;
                    if results.len() != node.outputs.len() {
                        return Err(ExecError::Execution(format!("{} returned {} values", call.name, results.len())));
                    }
                    for (id, v) in node.outputs.iter().zip(results) {
                        env[*id as usize] = Some(v);
                    }
                }
                (Step::Op { .. }, None) => return Err(ExecError::Internal("an operator without its call".into())),
            }
        }
        program.outputs.iter().map(|arg| value_of(arg, &env).map_err(ExecError::Execution)).collect()
    }
}

fn check_input(name: &str, dtype_name: &str, dims: &[DimRange], t: &Tensor) -> Result<(), ExecError> {
    let want = kind_of(dtype_name).ok_or_else(|| ExecError::Internal(format!("dtype {dtype_name}")))?;
    if t.kind() != want {
        return Err(ExecError::BadInput(format!("input {name:?} is {:?}; the graph takes {dtype_name}", t.kind())));
    }
    let size = t.size();
    let fits = size.len() == dims.len() && size.iter().zip(dims).all(|(s, d)| (d.min..=d.max).contains(s));
    if !fits {
        let ranges: Vec<String> = dims
            .iter()
            .map(|d| if d.min == d.max { d.min.to_string() } else { format!("{}..={}", d.min, d.max) })
            .collect();
        return Err(ExecError::BadInput(format!(
            "input {name:?} has shape {size:?}; the graph was exported for [{}]",
            ranges.join(", ")
        )));
    }
    Ok(())
}

/// A value argument's runtime value, or a constant's (a list of values and constants too).
fn value_of(arg: &Arg, env: &[Option<RtValue>]) -> Result<RtValue, String> {
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

fn native(op: Native, args: &[Arg], env: &[Option<RtValue>]) -> Result<RtValue, String> {
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

/// Whether an argument holds a value of the graph (so it is set per run).
fn varies(arg: &Arg) -> bool {
    match arg {
        Arg::Value(_) => true,
        Arg::List(items) => items.iter().any(varies),
        _ => false,
    }
}

fn prepare(
    op: &str,
    overload: &str,
    schema: &djinn_graph::schema::Schema,
    args: &[Option<Arg>],
    device: Device,
) -> Result<PreparedCall, ExecError> {
    let name = djinn_graph::schema::qualified(op, overload);
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
    let bounds = crate::index_bounds::of(&name, args);
    let mut call = PreparedCall { raw, varying: Vec::new(), generator: None, cap: 0, name: name.clone(), bounds };
    let dispatcher = take_message(schema_text);
    let expected = djinn_graph::allowlist().text(&name).unwrap_or_default();
    if normalise(&dispatcher) != normalise(expected) {
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
    for (i, (argument, given)) in schema.arguments.iter().zip(args).enumerate() {
        let Some(given) = given else { continue };
        if varies(given) {
            call.varying.push((i, argument.ty.clone(), given.clone()));
        } else {
            set_constant(&call, i, &argument.ty, given, device)?;
        }
    }
    Ok(call)
}

fn set_constant(call: &PreparedCall, i: usize, ty: &Type, arg: &Arg, device: Device) -> Result<(), ExecError> {
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
            (_, Arg::Device(_)) => match device {
                Device::Cuda(n) => ffi::djinn_call_set_device(raw, i, 1, n as i32),
                _ => ffi::djinn_call_set_device(raw, i, 0, -1),
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

/// Storage for the varying arguments of one run: the vectors their pointers point into.
#[derive(Default)]
struct Scratch {
    ints: Vec<Vec<i64>>,
    doubles: Vec<Vec<f64>>,
    tensors: Vec<Vec<*const c_void>>,
    held: Vec<Tensor>,
}

fn run_call(
    call: &PreparedCall,
    env: &[Option<RtValue>],
    generator: Option<&RequestGenerator>,
    outs: &mut Vec<ffi::Out>,
) -> Result<Vec<RtValue>, ExecError> {
    let mut scratch = Scratch::default();
    let mut varying = Vec::with_capacity(call.varying.len() + 1);
    let fail = |why: String| ExecError::Execution(format!("{}: {why}", call.name));
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
