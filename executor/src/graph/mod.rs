//! Graphs run through libtorch's dispatcher (csrc/dispatch.cpp): a checked program
//! ([`djinn_graph::Checked`]) prepared once per model (each node's operator found by name, its
//! schema compared with the allowlist's, its constants set), then run node by node per call.

use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::ptr::NonNull;
use std::sync::Mutex;

use djinn_graph::format::{DimRange, dtype};
use djinn_graph::schema::Type;
use djinn_graph::{Allowlist, Arg, Checked, Native, Step, ValueRule};
use tch::{Device, Kind, Tensor};

use crate::cost::Estimate;
use crate::error::ExecError;
use crate::tensors::{storage_of, tensor_bytes};
pub use crate::value::RtValue;
use djinn_sync::Locked;

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
        pub fn djinn_register_meta_kernels(err: *mut *mut c_char) -> c_int;
        pub fn djinn_generator_new(kind: i32, index: i32, seed: u64, err: *mut *mut c_char) -> *mut c_void;
        pub fn djinn_generator_free(generator: *mut c_void);
        pub fn djinn_call_new(
            name: *const c_char,
            overload: *const c_char,
            schema: *mut *mut c_char,
            err: *mut *mut c_char,
        ) -> *mut Call;
        pub fn djinn_call_free(call: *mut Call);
        pub fn djinn_meta_like(tensor: *const c_void, err: *mut *mut c_char) -> *mut c_void;
        pub fn djinn_call_set_none(call: *mut Call, i: usize);
        pub fn djinn_call_set_int(call: *mut Call, i: usize, v: i64);
        pub fn djinn_call_set_double(call: *mut Call, i: usize, v: f64);
        pub fn djinn_call_set_bool(call: *mut Call, i: usize, v: bool);
        pub fn djinn_call_set_wrapped_int(call: *mut Call, i: usize, v: i64);
        pub fn djinn_call_set_wrapped_double(call: *mut Call, i: usize, v: f64);
        pub fn djinn_call_set_wrapped_bool(call: *mut Call, i: usize, v: bool);
        pub fn djinn_call_plan_on_meta(call: *mut Call);
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
    /// Probabilities to check before it runs.
    probabilities: Option<crate::operands::Probabilities>,
    /// Varying arguments the allowlist has a rule on.
    rules: Vec<(Arg, ValueRule)>,
    /// The arguments it writes (an in-place operator's target).
    writes: Vec<Arg>,
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
enum Target {
    Device(Device),
    Meta,
}

/// Registers the shim's meta kernels (for the operators libtorch's C++ has none for), once per
/// process. Without them plans stop at those operators: a warning, not a failure.
fn register_meta_kernels() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut err: *mut c_char = std::ptr::null_mut();
        // SAFETY: an out-pointer for a message, written on failure.
        if unsafe { ffi::djinn_register_meta_kernels(&mut err) } != 0 {
            tracing::warn!(error = %take_message(err), "meta kernels not registered: plans stop at their operators");
        }
    });
}

/// A tensor on the meta device shaped as `t` (sizes, strides, dtype).
fn meta_like(t: &Tensor) -> Result<Tensor, ExecError> {
    let mut err: *mut c_char = std::ptr::null_mut();
    // SAFETY: `t` is a live tensor borrowed for the call; the result is a new at::Tensor.
    let raw = unsafe { ffi::djinn_meta_like(t.as_ptr().cast(), &mut err) };
    if raw.is_null() {
        return Err(ExecError::Internal(format!("a meta tensor: {}", take_message(err))));
    }
    // SAFETY: a new at::Tensor from the shim, owned from here (tch frees it on drop).
    Ok(unsafe { Tensor::from_ptr(raw.cast()) })
}

/// Collapses whitespace, so schemas compare as text.
fn normalise(schema: &str) -> String {
    schema.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// One graph's plans, by its inputs' sizes and strides.
type Plans = HashMap<Vec<(Vec<i64>, Vec<i64>)>, Estimate>;

/// A graph ready to run on one device.
pub struct GraphModule {
    checked: Checked,
    /// Per graph of the program, per node: its prepared call (`None` for a native step).
    calls: Vec<Vec<Option<PreparedCall>>>,
    /// The same on the meta device, for plans.
    plan_calls: Vec<Vec<Option<PreparedCall>>>,
    /// Per graph, per node: the values no later node reads (a run drops them after it).
    dies_after: Vec<Vec<Vec<u32>>>,
    weights: Vec<(u32, Tensor)>,
    /// The weights on the meta device, for plans.
    meta_weights: Vec<(u32, Tensor)>,
    /// Per graph: its plans.
    estimates: Mutex<Vec<Plans>>,
    /// The initial values of a session's state, in host memory (`None`: zeros).
    state: Vec<Option<Tensor>>,
    device: Device,
    /// What reads the container back; `None` where it cannot be.
    container: Option<Container>,
    /// Host memory the program and its prepared calls take (see [`Self::host_bytes`]).
    host_bytes: u64,
}

/// Host memory one node of a graph takes once loaded, at most: its part of the decoded program
/// and of the checked one, two prepared calls (the run's and the plan's, each an argument stack
/// of libtorch values) and what the run drops after it. Measured at about 1.9 KiB with torch
/// 2.13 (a node's growth for a graph of 20,000 nodes, tests/graphs.rs), charged with a margin.
const HOST_BYTES_PER_NODE: u64 = 3072;

/// What a graph's container holds besides the tensors the graph keeps, so that the container
/// can be read back byte for byte from them (a draining node sends it to another) without a
/// second copy of the weights: its length, the program, and the runs between tensors that are
/// not zeros. The node it goes to checks the bytes against the model's fingerprint.
#[derive(Debug)]
struct Container {
    len: u64,
    /// The magic and the program, up to the weights.
    head: Vec<u8>,
    /// Gaps between tensors that are not all zeros, by offset in the container.
    filler: Vec<(u64, Vec<u8>)>,
}

/// The most bytes of non-zero gaps kept for reading a container back: an encoder pads with
/// zeros, and a container padded otherwise is not kept twice.
const MAX_FILLER: usize = 1 << 20;

impl Container {
    /// `bytes`' head and filler, given the spans (offset, length) its tensors take past
    /// `weights_start`.
    fn of(bytes: &[u8], weights_start: usize, mut spans: Vec<(usize, usize)>) -> Option<Self> {
        spans.sort_unstable();
        let mut filler = Vec::new();
        let mut kept = 0;
        let mut at = weights_start;
        let gaps = spans.iter().map(|&(o, n)| (weights_start + o, weights_start + o + n)).chain([(bytes.len(), 0)]);
        for (start, end) in gaps {
            let gap = bytes.get(at..start.max(at))?;
            if gap.iter().any(|&b| b != 0) {
                kept += gap.len();
                filler.push((at as u64, gap.to_vec()));
            }
            at = at.max(end);
        }
        (kept <= MAX_FILLER).then(|| Self { len: bytes.len() as u64, head: bytes[..weights_start].to_vec(), filler })
    }
}

/// Copies the part of `src` (bytes at `at` in a container) that falls in `out` (bytes at
/// `offset`).
fn copy_overlap(out: &mut [u8], offset: u64, src: &[u8], at: u64) {
    let start = offset.max(at);
    let end = (offset + out.len() as u64).min(at + src.len() as u64);
    if start < end {
        out[(start - offset) as usize..(end - offset) as usize]
            .copy_from_slice(&src[(start - at) as usize..(end - at) as usize]);
    }
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

/// The libtorch dtype a graph's dtype name stands for (`None` for a name the format lacks).
pub fn kind_of(name: &str) -> Option<Kind> {
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
        Self::load_with(bytes, device, djinn_graph::allowlist())
    }

    /// [`Self::load`] against `allowlist` (tests take rules out of it to reach the walls behind).
    fn load_with(bytes: &[u8], device: Device, allowlist: &Allowlist) -> Result<Self, ExecError> {
        let decoded = djinn_graph::decode(bytes).map_err(|e| bad(format!("not a valid graph: {e}")))?;
        let checked = djinn_graph::check(decoded.program, allowlist)
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
        let prepare_all = |target: Target| {
            checked
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
                            Step::Op { schema, args, generator } => {
                                prepare(&node.op, &node.overload, schema, args, target, allowlist).map(|mut call| {
                                    call.generator = *generator;
                                    Some(call)
                                })
                            }
                        })
                        .collect::<Result<Vec<_>, ExecError>>()
                })
                .collect::<Result<Vec<_>, ExecError>>()
        };
        let calls = prepare_all(Target::Device(device))?;
        register_meta_kernels();
        let plan_calls = prepare_all(Target::Meta)?;
        let dies_after = checked
            .graphs
            .iter()
            .zip(checked.program.graphs())
            .map(|(graph, g)| dies_after(&graph.steps, g.nodes, g.outputs, graph.values))
            .collect();
        let meta_weights =
            weights.iter().map(|(id, w)| Ok((*id, meta_like(w)?))).collect::<Result<Vec<_>, ExecError>>()?;
        let estimates = Mutex::new(vec![HashMap::new(); checked.graphs.len()]);
        let spans = (checked.program.weights.iter().map(|w| (Some(w.offset), &w.dtype, &w.shape)))
            .chain(checked.program.state.iter().map(|s| (s.offset, &s.dtype, &s.shape)))
            .filter_map(|(offset, dtype, shape)| {
                Some((offset? as usize, djinn_graph::tensor_len(dtype, shape)? as usize))
            })
            .collect();
        let container = Container::of(bytes, decoded.weights_start, spans);
        let nodes: usize = checked.graphs.iter().map(|g| g.steps.len()).sum();
        // The program's text is kept (for reading the container back) beside what was decoded
        // from it.
        let host_bytes = (decoded.weights_start as u64).saturating_mul(2) + nodes as u64 * HOST_BYTES_PER_NODE;
        Ok(Self {
            checked,
            calls,
            plan_calls,
            dies_after,
            weights,
            meta_weights,
            estimates,
            state,
            device,
            container,
            host_bytes,
        })
    }

    /// Host memory the model's program and prepared calls take, charged to the tenants holding
    /// it (the weights are charged as device memory).
    pub fn host_bytes(&self) -> u64 {
        self.host_bytes
    }

    /// The container's length, where it can be read back.
    pub fn container_len(&self) -> Option<u64> {
        self.container.as_ref().map(|c| c.len)
    }

    /// Reads the container's bytes from `offset` into `out` (zeroed by the caller), from the
    /// program and the tensors the graph keeps.
    pub fn read_container(&self, offset: u64, out: &mut [u8]) -> Result<(), ExecError> {
        let Some(container) = &self.container else {
            return Err(ExecError::Unsupported("this graph's container cannot be read back".into()));
        };
        let weights_start = container.head.len() as u64;
        copy_overlap(out, offset, &container.head, 0);
        for (at, bytes) in &container.filler {
            copy_overlap(out, offset, bytes, *at);
        }
        let weights = self.checked.program.weights.iter().zip(&self.weights).map(|(w, (_, t))| (Some(w.offset), t));
        let state =
            self.checked.program.state.iter().zip(&self.state).filter_map(|(s, t)| Some((s.offset, t.as_ref()?)));
        let end = offset + out.len() as u64;
        for (stored, t) in weights.chain(state) {
            let Some(at) = stored.map(|o| weights_start + o) else { continue };
            let len = tensor_bytes(t);
            let (start, stop) = (offset.max(at), end.min(at + len));
            if start >= stop {
                continue;
            }
            // The tensor's bytes as a flat u8 tensor: the part wanted comes to the host alone.
            let flat = t.f_reshape([-1])?;
            let flat = if flat.kind() == Kind::Uint8 { flat } else { flat.f_view_dtype(Kind::Uint8)? };
            let part = flat.f_narrow(0, (start - at) as i64, (stop - start) as i64)?.f_to_device(Device::Cpu)?;
            let dst = &mut out[(start - offset) as usize..(stop - offset) as usize];
            part.f_contiguous()?.f_copy_data_u8(dst, dst.len())?;
        }
        Ok(())
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
        let estimate = if crate::cost::charged() { Some(self.estimate(index, &inputs)?) } else { None };
        // Held until the run ends: its planned peak against the tenant's memory quota.
        let _charge = match &estimate {
            Some(estimate) => crate::cost::admit(estimate)?,
            None => None,
        };
        // Long steps are weighed against the deadline before they run; steps past where the
        // plan stopped are charged to the compute quota after they run.
        let (planned, mut long_steps) = match &estimate {
            Some(e) => (e.planned_steps, e.long_steps.iter().peekable()),
            None => (usize::MAX, [].iter().peekable()),
        };
        let Prepared { program, checked, calls, dies_after } = self.prepared(index, &self.calls)?;
        let mut env: Vec<Option<RtValue>> = (0..checked.values).map(|_| None).collect();
        // What no operator may write, whatever the checker concluded of its aliases: the
        // weights' memory and the caller's inputs' (a session's state is the run's to write).
        let mut read_only = HashSet::new();
        for (spec, t) in program.inputs.iter().zip(inputs) {
            if !spec.state {
                read_only.insert(storage_of(&t).0);
            }
            let t = if t.device() == self.device { t } else { t.f_to_device(self.device)? };
            env[spec.value as usize] = Some(RtValue::Tensor(t));
        }
        for (id, w) in &self.weights {
            read_only.insert(storage_of(w).0);
            env[*id as usize] = Some(RtValue::Tensor(w.shallow_clone()));
        }
        read_only.remove(&0);
        let mut outs: Vec<ffi::Out> = Vec::new();
        // Made at the first random operator of the run.
        let mut generator: Option<RequestGenerator> = None;
        let steps = checked.steps.iter().zip(calls).zip(program.nodes).zip(dies_after);
        for (i, (((step, call), node), dead)) in steps.enumerate() {
            crate::deadline::check()?;
            if let (Some((_, flops)), Some(call)) = (long_steps.next_if(|(at, _)| *at == i), call) {
                crate::cost::fits_deadline(&call.name, *flops)?;
            }
            match (step, call) {
                (Step::Native { op, args }, _) => {
                    let v = native(*op, args, &env).map_err(|e| ExecError::Execution(format!("{}: {e}", node.op)))?;
                    env[node.outputs[0] as usize] = Some(v);
                }
                (Step::Op { args, .. }, Some(call)) => {
                    let fail = |e: String| ExecError::Execution(format!("{}: {e}", call.name));
                    if let Some(bounds) = &call.bounds {
                        crate::index_bounds::check(bounds, |arg| value_of(arg, &env)).map_err(fail)?;
                    }
                    if let Some(p) = &call.probabilities {
                        crate::operands::check_probabilities(p, |arg| value_of(arg, &env)).map_err(fail)?;
                    }
                    for target in &call.writes {
                        if let Ok(RtValue::Tensor(t)) = value_of(target, &env)
                            && read_only.contains(&storage_of(&t).0)
                        {
                            return Err(ExecError::Refused(format!(
                                "{}: writes the memory of a weight or of the caller's input",
                                call.name
                            )));
                        }
                    }
                    let request_generator = match (call.generator, &mut generator) {
                        (None, _) => None,
                        (Some(_), Some(g)) => Some(&*g),
                        (Some(_), slot @ None) => Some(&*slot.insert(RequestGenerator::new(self.device)?)),
                    };
                    let read = if i >= planned { sizes_read(call, &env) } else { Vec::new() };
                    let results = run_call(call, &env, request_generator, &mut outs)?;
                    if i >= planned {
                        let read_storages: HashSet<usize> = call
                            .varying
                            .iter()
                            .filter_map(|(_, _, arg)| value_of(arg, &env).ok())
                            .flat_map(|v| tensors_of(&v).map(|t| storage_of(t).0).collect::<Vec<_>>())
                            .collect();
                        let aliases =
                            results.iter().flat_map(tensors_of).all(|t| read_storages.contains(&storage_of(t).0));
                        crate::cost::charge_unplanned(step_flops(call, args, &env, &read, &results, aliases))?;
                    }
                    if results.len() != node.outputs.len() {
                        return Err(ExecError::Execution(format!("{} returned {} values", call.name, results.len())));
                    }
                    for (id, v) in node.outputs.iter().zip(results) {
                        env[*id as usize] = Some(v);
                    }
                }
                (Step::Op { .. }, None) => return Err(ExecError::Internal("an operator without its call".into())),
            }
            for v in dead {
                env[*v as usize] = None;
            }
        }
        program.outputs.iter().map(|arg| value_of(arg, &env).map_err(ExecError::Execution)).collect()
    }

    /// Graph `index` with `calls`' (the run's or the plan's) and the values each node drops.
    fn prepared<'a>(&'a self, index: usize, calls: &'a [Vec<Option<PreparedCall>>]) -> Result<Prepared<'a>, ExecError> {
        match (
            self.checked.program.graph(index),
            self.checked.graphs.get(index),
            calls.get(index),
            self.dies_after.get(index),
        ) {
            (Some(program), Some(checked), Some(calls), Some(dies_after)) => {
                Ok(Prepared { program, checked, calls, dies_after })
            }
            _ => Err(ExecError::Internal(format!("graph {index} is not prepared"))),
        }
    }

    /// What a run on `inputs` will take (see [`crate::cost`]), without running it.
    pub fn estimate_run(&self, inputs: &[Tensor]) -> Result<Estimate, ExecError> {
        self.estimate(self.select(inputs)?, inputs)
    }

    /// What graph `index` will take at `inputs`' shapes: planned once per sizes and strides.
    fn estimate(&self, index: usize, inputs: &[Tensor]) -> Result<Estimate, ExecError> {
        /// Plans kept per graph; a caller cycling through more shapes than this plans again.
        const KEPT: usize = 64;
        let key: Vec<(Vec<i64>, Vec<i64>)> = inputs.iter().map(|t| (t.size(), t.stride())).collect();
        let lock = || self.estimates.locked();
        if let Some(e) = lock().get(index).and_then(|plans| plans.get(&key)).cloned() {
            return Ok(e);
        }
        let estimate = self.plan(index, inputs)?;
        if let Some(plans) = lock().get_mut(index) {
            if plans.len() >= KEPT {
                plans.clear();
            }
            plans.insert(key, estimate.clone());
        }
        Ok(estimate)
    }

    /// Runs graph `index` over meta tensors shaped as `inputs`: every operator's operations,
    /// and the bytes of new storage live after each (each value dropped where the run drops it).
    fn plan(&self, index: usize, inputs: &[Tensor]) -> Result<Estimate, ExecError> {
        let Prepared { program, checked, calls, dies_after } = self.prepared(index, &self.plan_calls)?;
        let mut env: Vec<Option<RtValue>> = (0..checked.values).map(|_| None).collect();
        let mut held = Storages::default();
        for (spec, t) in program.inputs.iter().zip(inputs) {
            let t = meta_like(t)?;
            held.give(&t);
            env[spec.value as usize] = Some(RtValue::Tensor(t));
        }
        for (id, w) in &self.meta_weights {
            held.give(w);
            env[*id as usize] = Some(RtValue::Tensor(w.shallow_clone()));
        }
        let mut estimate = Estimate::default();
        let mut outs: Vec<ffi::Out> = Vec::new();
        let steps = checked.steps.iter().zip(calls).zip(program.nodes).zip(dies_after);
        for (i, (((step, call), node), dead)) in steps.enumerate() {
            // A plan takes about as long as the run's dispatching: under the same deadline.
            crate::deadline::check()?;
            let results = match (step, call) {
                (Step::Native { op, args }, _) => native(*op, args, &env).map(|v| vec![v]).ok(),
                (Step::Op { args, .. }, Some(call)) => {
                    let read = sizes_read(call, &env);
                    run_call(call, &env, None, &mut outs).ok().inspect(|results| {
                        let aliases =
                            call.name == "aten::view" || results.iter().flat_map(tensors_of).all(|t| held.holds(t));
                        let flops = step_flops(call, args, &env, &read, results, aliases);
                        if flops >= crate::cost::LONG_STEP {
                            estimate.long_steps.push((i, flops));
                        }
                        estimate.flops = estimate.flops.saturating_add(flops);
                    })
                }
                (Step::Op { .. }, None) => return Err(ExecError::Internal("an operator without its call".into())),
            };
            let Some(results) = results.filter(|r| r.len() == node.outputs.len()) else {
                // An output whose size depends on the data, or no meta kernel: the plan ends here.
                estimate.stopped_at = Some(call.as_ref().map_or_else(|| node.op.clone(), |c| c.name.clone()));
                break;
            };
            estimate.planned_steps = i + 1;
            for (id, v) in node.outputs.iter().zip(results) {
                tensors_of(&v).for_each(|t| held.acquire(t));
                if let Some(old) = env[*id as usize].replace(v) {
                    tensors_of(&old).for_each(|t| held.release(t));
                }
            }
            for v in dead {
                if let Some(old) = env[*v as usize].take() {
                    tensors_of(&old).for_each(|t| held.release(t));
                }
            }
        }
        estimate.peak_bytes = held.peak;
        Ok(estimate)
    }
}

/// One graph of a module, ready to run (or to plan).
struct Prepared<'a> {
    program: djinn_graph::Graph<'a>,
    checked: &'a djinn_graph::CheckedGraph,
    calls: &'a [Option<PreparedCall>],
    dies_after: &'a [Vec<u32>],
}

/// The storages a plan's values hold, counted once however many values view each.
#[derive(Default)]
struct Storages {
    /// Storages of the inputs and weights: already held, not the run's to count.
    given: HashSet<usize>,
    /// The inputs' and weights' meta tensors, held to the end of the plan: a storage freed
    /// early could give its address to a new one, which would then count as given.
    given_tensors: Vec<Tensor>,
    /// Bytes and the number of values holding each storage the run made.
    made: HashMap<usize, (u64, u32)>,
    live: u64,
    peak: u64,
}

impl Storages {
    fn give(&mut self, t: &Tensor) {
        self.given.insert(storage_of(t).0);
        self.given_tensors.push(t.shallow_clone());
    }

    /// Whether `t` views memory already held (an input, a weight, an earlier value).
    fn holds(&self, t: &Tensor) -> bool {
        let (id, _) = storage_of(t);
        self.given.contains(&id) || self.made.contains_key(&id)
    }

    fn acquire(&mut self, t: &Tensor) {
        let (id, bytes) = storage_of(t);
        if id == 0 || self.given.contains(&id) {
            return;
        }
        let (_, holders) = self.made.entry(id).or_insert_with(|| {
            self.live = self.live.saturating_add(bytes);
            self.peak = self.peak.max(self.live);
            (bytes, 0)
        });
        *holders += 1;
    }

    fn release(&mut self, t: &Tensor) {
        let (id, _) = storage_of(t);
        if let Some((bytes, holders)) = self.made.get_mut(&id) {
            *holders -= 1;
            if *holders == 0 {
                self.live -= *bytes;
                self.made.remove(&id);
            }
        }
    }
}

/// The tensors in a value (a list's, in order).
fn tensors_of(v: &RtValue) -> Box<dyn Iterator<Item = &Tensor> + '_> {
    match v {
        RtValue::Tensor(t) => Box::new(std::iter::once(t)),
        RtValue::List(items) => Box::new(items.iter().flat_map(tensors_of)),
        _ => Box::new(std::iter::empty()),
    }
}

/// The sizes of the tensors a call reads, in its arguments' order.
fn sizes_read(call: &PreparedCall, env: &[Option<RtValue>]) -> Vec<Vec<i64>> {
    call.varying
        .iter()
        .filter_map(|(_, _, arg)| value_of(arg, env).ok())
        .flat_map(|v| tensors_of(&v).map(Tensor::size).collect::<Vec<_>>())
        .collect()
}

/// The operations of one call that read tensors of `read` sizes and gave `results`
/// (`aliases`: views of what it read); a pooling operator's from its window (`args`, as bound).
fn step_flops(
    call: &PreparedCall,
    args: &[Option<Arg>],
    env: &[Option<RtValue>],
    read: &[Vec<i64>],
    results: &[RtValue],
    aliases: bool,
) -> u64 {
    let written: Vec<Vec<i64>> = results.iter().flat_map(|v| tensors_of(v).map(Tensor::size)).collect();
    let written: Vec<&[i64]> = written.iter().map(Vec::as_slice).collect();
    let pooling = ["aten::avg_pool", "aten::max_pool"].iter().any(|p| call.name.starts_with(p));
    let window = || match value_of(args.get(1)?.as_ref()?, env).ok()? {
        RtValue::List(sizes) => {
            sizes.iter().map(RtValue::int).try_fold(1u64, |n, k| Some(n.saturating_mul(k?.max(0) as u64)))
        }
        _ => None,
    };
    match pooling.then(window).flatten() {
        Some(window) => crate::cost::pooled_flops(&written, window),
        None => {
            let read: Vec<&[i64]> = read.iter().map(Vec::as_slice).collect();
            crate::cost::flops_of(&call.name, &read, &written, aliases)
        }
    }
}

/// Per node, the values that no later node reads and the graph does not return: the run drops
/// them after that node (an output nothing reads, after the node that made it).
fn dies_after(steps: &[Step], nodes: &[djinn_graph::format::Node], outputs: &[Arg], values: usize) -> Vec<Vec<u32>> {
    fn visit(arg: &Arg, f: &mut impl FnMut(usize)) {
        match arg {
            Arg::Value(v) => f(*v as usize),
            Arg::List(items) => items.iter().for_each(|a| visit(a, f)),
            _ => {}
        }
    }
    let mut last: Vec<Option<usize>> = vec![None; values];
    for (i, node) in nodes.iter().enumerate() {
        for v in &node.outputs {
            if let Some(slot) = last.get_mut(*v as usize) {
                *slot = Some(i);
            }
        }
    }
    for (i, step) in steps.iter().enumerate() {
        let args: Vec<&Arg> = match step {
            Step::Op { args, .. } => args.iter().flatten().collect(),
            Step::Native { args, .. } => args.iter().collect(),
        };
        for arg in args {
            visit(arg, &mut |v| {
                if let Some(slot) = last.get_mut(v) {
                    *slot = Some(slot.map_or(i, |l| l.max(i)));
                }
            });
        }
    }
    for arg in outputs {
        visit(arg, &mut |v| {
            if let Some(slot) = last.get_mut(v) {
                *slot = None;
            }
        });
    }
    let mut dies = vec![Vec::new(); steps.len()];
    for (v, at) in last.iter().enumerate() {
        if let Some(list) = at.and_then(|i| dies.get_mut(i)) {
            list.push(v as u32);
        }
    }
    dies
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

#[cfg(test)]
mod tests {
    use super::*;
    use djinn_graph::format::{FORMAT, WEIGHT_ALIGN};
    use djinn_graph::{DimRange, Input, Node, Program, Weight};

    fn node(op: &str, args: Vec<Arg>, outputs: Vec<u32>) -> Node {
        Node { op: op.into(), overload: String::new(), args, kwargs: Default::default(), outputs }
    }

    /// `nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))` as a graph, as
    /// export writes it (value 0 the input, 1..=4 the weights), for batches of 1 to 4096; and
    /// its weights.
    fn mlp() -> (Vec<u8>, Vec<Tensor>) {
        let shapes: [&[i64]; 4] = [&[1024, 256], &[1024], &[256, 1024], &[256]];
        let weights: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, (Kind::Float, Device::Cpu))).collect();
        let mut offset = 0;
        let specs = shapes
            .iter()
            .enumerate()
            .map(|(i, shape)| {
                let w = Weight {
                    name: format!("w{i}"),
                    value: i as u32 + 1,
                    dtype: "float32".into(),
                    shape: shape.to_vec(),
                    offset,
                };
                offset += (shape.iter().product::<i64>() as u64 * 4).next_multiple_of(WEIGHT_ALIGN);
                w
            })
            .collect();
        let v = Arg::Value;
        let program = Program {
            format: FORMAT,
            inputs: vec![Input {
                name: "input".into(),
                value: 0,
                dtype: "float32".into(),
                dims: vec![DimRange { min: 1, max: 4096 }, DimRange { min: 256, max: 256 }],
                state: false,
            }],
            weights: specs,
            nodes: vec![
                node("aten::linear", vec![v(0), v(1), v(2)], vec![5]),
                node("aten::relu", vec![v(5)], vec![6]),
                node("aten::linear", vec![v(6), v(3), v(4)], vec![7]),
            ],
            outputs: vec![v(7)],
            state: vec![],
            entries: vec![],
        };
        let bytes: Vec<Vec<u8>> = weights
            .iter()
            .map(|w| {
                let mut b = vec![0u8; w.numel() * 4];
                w.copy_data_u8(&mut b, w.numel());
                b
            })
            .collect();
        let slices: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
        (djinn_graph::encode(&program, &slices).unwrap(), weights)
    }

    fn dtype_name(kind: Kind) -> &'static str {
        match kind {
            Kind::Bool => "bool",
            Kind::Int => "int32",
            Kind::Int64 => "int64",
            Kind::Double => "float64",
            _ => "float32",
        }
    }

    /// A graph of the one operator `op` on `inputs` (values 0..) and the constants in `args`
    /// (where `Arg::Value` names an input); its outputs, run on the CPU and over meta tensors
    /// (the plan's calls), as (sizes, dtype) pairs.
    fn one_operator(
        op: &str,
        args: Vec<Arg>,
        kwargs: &[(&str, Arg)],
        inputs: &[Tensor],
        outputs: usize,
    ) -> GraphModule {
        let (name, overload) = op.split_once('.').unwrap_or((op, ""));
        let program = Program {
            format: FORMAT,
            inputs: inputs
                .iter()
                .enumerate()
                .map(|(i, t)| Input {
                    name: format!("x{i}"),
                    value: i as u32,
                    dtype: dtype_name(t.kind()).into(),
                    dims: t.size().iter().map(|&n| DimRange { min: n, max: n }).collect(),
                    state: false,
                })
                .collect(),
            weights: vec![],
            nodes: vec![Node {
                op: name.into(),
                overload: overload.into(),
                args,
                kwargs: kwargs.iter().map(|(k, a)| (k.to_string(), a.clone())).collect(),
                outputs: (100..100 + outputs as u32).collect(),
            }],
            outputs: (100..100 + outputs as u32).map(Arg::Value).collect(),
            state: vec![],
            entries: vec![],
        };
        GraphModule::load(&djinn_graph::encode(&program, &[]).unwrap(), Device::Cpu).unwrap()
    }

    fn on_cpu_and_meta(
        op: &str,
        args: Vec<Arg>,
        kwargs: &[(&str, Arg)],
        inputs: &[Tensor],
        outputs: usize,
    ) -> [Vec<(Vec<i64>, Kind)>; 2] {
        let graph = one_operator(op, args, kwargs, inputs, outputs);
        let described = |values: Vec<RtValue>| {
            values
                .iter()
                .map(|v| match v {
                    RtValue::Tensor(t) => (t.size(), t.kind()),
                    other => panic!("{op}: {other:?}"),
                })
                .collect::<Vec<_>>()
        };
        let real = described(graph.run(inputs.iter().map(Tensor::shallow_clone).collect()).unwrap());
        // The plan's path: meta inputs through the plan's calls.
        let mut env: Vec<Option<RtValue>> = (0..graph.checked.graphs[0].values).map(|_| None).collect();
        for (i, t) in inputs.iter().enumerate() {
            env[i] = Some(RtValue::Tensor(meta_like(t).unwrap()));
        }
        let call = graph.plan_calls[0][0].as_ref().unwrap();
        let meta = run_call(call, &env, None, &mut Vec::new()).unwrap_or_else(|e| panic!("{op} on meta: {e}"));
        [real, described(meta)]
    }

    #[test]
    fn the_nodes_meta_kernels_give_the_sizes_and_dtypes_libtorch_computes() {
        let f = |s: &[i64]| Tensor::randn(s, (Kind::Float, Device::Cpu));
        let int = |s: &[i64], k: Kind| Tensor::randint(7, s, (k, Device::Cpu)) + 1;
        let (v, i, fl, b) = (Arg::Value, Arg::Int, |x: &str| Arg::Float(x.into()), Arg::Bool);
        let ints = |xs: &[i64]| Arg::List(xs.iter().map(|&x| Arg::Int(x)).collect());
        let x = f(&[3, 4]);
        let image = f(&[2, 4, 9, 9]);
        let cases: Vec<(&str, Vec<Arg>, Vec<Tensor>, usize)> = vec![
            ("aten::relu", vec![v(0)], vec![x.shallow_clone()], 1),
            ("aten::hardtanh", vec![v(0), fl("-1.0"), fl("1.0")], vec![x.shallow_clone()], 1),
            ("aten::flip", vec![v(0), ints(&[0])], vec![x.shallow_clone()], 1),
            ("aten::isnan", vec![v(0)], vec![x.shallow_clone()], 1),
            (
                "aten::where.self",
                vec![v(0), v(1), v(2)],
                vec![f(&[3, 1]).gt(0.0), f(&[1, 4]), Tensor::randn([3, 4], (Kind::Double, Device::Cpu))],
                1,
            ),
            ("aten::__lshift__.Scalar", vec![v(0), i(2)], vec![int(&[3], Kind::Int)], 1),
            ("aten::__rshift__.Tensor", vec![v(0), v(1)], vec![int(&[3, 1], Kind::Int), int(&[4], Kind::Int64)], 1),
            ("aten::floor_divide", vec![v(0), v(1)], vec![f(&[3, 4]), f(&[4])], 1),
            ("aten::rsub.Tensor", vec![v(0), v(1)], vec![f(&[2, 1]), f(&[3])], 1),
            ("aten::remainder.Scalar_Tensor", vec![i(3), v(0)], vec![int(&[5], Kind::Int)], 1),
            ("aten::index_select", vec![v(0), i(1), v(1)], vec![f(&[5, 6]), Tensor::from_slice(&[0i64, 5, 2])], 1),
            ("aten::max", vec![v(0)], vec![x.shallow_clone()], 1),
            ("aten::min", vec![v(0)], vec![int(&[4], Kind::Int)], 1),
            ("aten::prod", vec![v(0)], vec![int(&[4], Kind::Int)], 1),
            ("aten::_adaptive_avg_pool2d", vec![v(0), ints(&[3, 2])], vec![image.shallow_clone()], 1),
            ("aten::_adaptive_avg_pool3d", vec![v(0), ints(&[1, 2, 3])], vec![f(&[2, 3, 4, 5, 6])], 1),
            ("aten::reflection_pad2d", vec![v(0), ints(&[1, 2, 3, 0])], vec![image.shallow_clone()], 1),
            (
                "aten::convolution",
                vec![v(0), v(1), v(2), ints(&[2, 1]), ints(&[1, 0]), ints(&[1, 2]), b(false), ints(&[0, 0]), i(2)],
                vec![image.shallow_clone(), f(&[6, 2, 3, 3]), f(&[6])],
                1,
            ),
            (
                "aten::convolution",
                vec![v(0), v(1), Arg::None, ints(&[2, 2]), ints(&[1, 1]), ints(&[1, 1]), b(true), ints(&[1, 0]), i(1)],
                vec![image.shallow_clone(), f(&[4, 3, 3, 3])],
                1,
            ),
            (
                "aten::convolution",
                vec![v(0), v(1), Arg::None, ints(&[1]), ints(&[2]), ints(&[1]), b(false), ints(&[0]), i(1)],
                vec![f(&[2, 4, 10]), f(&[5, 4, 3])],
                1,
            ),
            (
                "aten::native_layer_norm",
                vec![v(0), ints(&[8]), v(1), v(2), fl("1e-05")],
                vec![f(&[2, 3, 8]), f(&[8]), f(&[8])],
                3,
            ),
            (
                "aten::_native_batch_norm_legit_no_training",
                vec![v(0), v(1), v(2), v(3), v(4), fl("0.1"), fl("1e-05")],
                vec![image.shallow_clone(), f(&[4]), f(&[4]), f(&[4]), f(&[4]).abs()],
                3,
            ),
            (
                "aten::_native_batch_norm_legit.no_stats",
                vec![v(0), v(1), v(2), b(true), fl("0.1"), fl("1e-05")],
                vec![image.shallow_clone(), f(&[4]), f(&[4])],
                3,
            ),
            (
                "aten::native_group_norm",
                vec![v(0), v(1), v(2), i(2), i(4), i(81), i(2), fl("1e-05")],
                vec![image.shallow_clone(), f(&[4]), f(&[4])],
                3,
            ),
            (
                "aten::scaled_dot_product_attention",
                vec![v(0), v(1), v(2)],
                vec![f(&[2, 4, 5, 8]), f(&[2, 4, 7, 8]), f(&[2, 4, 7, 16])],
                1,
            ),
        ];
        for (op, args, inputs, outputs) in cases {
            let [real, meta] = on_cpu_and_meta(op, args, &[], &inputs, outputs);
            assert_eq!(meta, real, "{op}");
        }
        // Keyword arguments.
        for (op, args, kwargs, input) in [
            ("aten::prod", vec![v(0)], vec![("dtype", Arg::Dtype("float64".into()))], x),
            ("aten::var.correction", vec![v(0), ints(&[1])], vec![("correction", i(1))], f(&[3, 4, 5])),
            ("aten::var.correction", vec![v(0), ints(&[-1, 0])], vec![("keepdim", b(true))], f(&[3, 4, 5])),
            ("aten::var.correction", vec![v(0)], vec![], f(&[3, 4, 5])),
            // A 0-dim tensor over its dimension 0 or -1.
            ("aten::var.correction", vec![v(0), ints(&[0])], vec![], f(&[])),
            ("aten::var.correction", vec![v(0), ints(&[-1])], vec![("keepdim", b(true))], f(&[])),
        ] {
            let [real, meta] = on_cpu_and_meta(op, args, &kwargs, &[input], 1);
            assert_eq!(meta, real, "{op} {kwargs:?}");
        }
        // What libtorch refuses, the meta kernel refuses too, before its arithmetic (a zero
        // stride would divide by zero): the plan stops there and the run fails, typed.
        let conv = one_operator(
            "aten::convolution",
            vec![v(0), v(1), Arg::None, ints(&[0, 1]), ints(&[0, 0]), ints(&[1, 1]), b(false), ints(&[0, 0]), i(1)],
            &[],
            &[image.shallow_clone(), f(&[4, 4, 3, 3])],
            1,
        );
        let inputs = [image.shallow_clone(), f(&[4, 4, 3, 3])];
        assert_eq!(conv.estimate_run(&inputs).unwrap().stopped_at.as_deref(), Some("aten::convolution"));
        let e = conv.run(inputs.iter().map(Tensor::shallow_clone).collect()).unwrap_err();
        assert!(e.to_string().contains("stride"), "{e}");
        // Lists shorter than the spatial dimensions (which the kernel read past, then divided by
        // what it read).
        let pair = || ints(&[1, 1]);
        let volume = [f(&[1, 2, 3, 3, 3]), f(&[2, 2, 1, 1, 1])];
        let conv = one_operator(
            "aten::convolution",
            vec![v(0), v(1), Arg::None, pair(), ints(&[0, 0]), pair(), b(false), ints(&[0, 0]), i(1)],
            &[],
            &volume,
            1,
        );
        assert_eq!(conv.estimate_run(&volume).unwrap().stopped_at.as_deref(), Some("aten::convolution"));
        conv.run(volume.iter().map(Tensor::shallow_clone).collect()).unwrap_err();
    }

    /// The second wall: with the allowlist's knowledge that `type_as(w, w)` is `w` taken out,
    /// the checker passes a `masked_fill_` on it, and the runner refuses the write at run time,
    /// before it happens: to a weight, to the caller's input, and not to the graph's own.
    #[test]
    fn an_in_place_write_to_a_weight_or_an_input_is_refused_as_it_is_about_to_happen() {
        let forgetful = Allowlist::parse(
            &include_str!("../../../graph/allowlist.txt")
                .lines()
                .filter(|l| !l.starts_with("returns-input"))
                .collect::<Vec<_>>()
                .join("\n"),
        )
        .unwrap();
        let v = Arg::Value;
        let scalar =
            |op: &str, args: Vec<Arg>, out: u32| Node { overload: "Scalar".into(), ..node(op, args, vec![out]) };
        let write = |first: Node| {
            let program = Program {
                format: FORMAT,
                inputs: vec![Input {
                    name: "x".into(),
                    value: 0,
                    dtype: "float32".into(),
                    dims: vec![DimRange { min: 2, max: 2 }],
                    state: false,
                }],
                weights: vec![Weight {
                    name: "w".into(),
                    value: 1,
                    dtype: "float32".into(),
                    shape: vec![2],
                    offset: 0,
                }],
                nodes: vec![
                    first,
                    scalar("aten::gt", vec![v(1), Arg::Int(-100)], 3),
                    scalar("aten::masked_fill_", vec![v(2), v(3), Arg::Int(-5)], 4),
                ],
                outputs: vec![v(4)],
                state: vec![],
                entries: vec![],
            };
            let w: Vec<u8> = [1f32, 2.0].iter().flat_map(|f| f.to_le_bytes()).collect();
            GraphModule::load_with(&djinn_graph::encode(&program, &[&w]).unwrap(), Device::Cpu, &forgetful).unwrap()
        };
        let x = || vec![Tensor::from_slice(&[3f32, 4.0])];
        for target in [1, 0] {
            let graph = write(node("aten::type_as", vec![v(target), v(target)], vec![2]));
            let e = graph.run(x()).unwrap_err();
            assert!(matches!(e, ExecError::Refused(_)) && e.to_string().contains("writes the memory"), "{e}");
            assert_eq!(Vec::<f32>::try_from(&graph.weights()[0].1).unwrap(), [1.0, 2.0], "the weight is as it was");
        }
        // The graph's own memory is its to write.
        let out = write(node("aten::clone", vec![v(1)], vec![2])).run(x()).unwrap();
        let [RtValue::Tensor(out)] = &out[..] else { panic!("{out:?}") };
        assert_eq!(Vec::<f32>::try_from(out).unwrap(), [-5.0, -5.0]);
    }

    /// A container reads back byte for byte from the program and the weights the graph keeps,
    /// whatever the reads' bounds: with bytes past the last weight that are not zeros too.
    #[test]
    fn a_container_reads_back_as_it_came() {
        use proptest::prelude::*;
        let (mut bytes, _) = mlp();
        bytes.extend((0..300u32).map(|i| (i % 251) as u8 + 1));
        let graph = GraphModule::load(&bytes, Device::Cpu).unwrap();
        assert_eq!(graph.container_len(), Some(bytes.len() as u64));
        assert_eq!(graph.container.as_ref().map(|c| c.filler.len()), Some(1), "the trailing bytes are kept");
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(32));
        runner
            .run(&prop::collection::vec(1usize..300_000, 1..8), |chunks| {
                let mut read = Vec::with_capacity(bytes.len());
                for len in chunks.iter().cycle() {
                    let at = read.len();
                    if at == bytes.len() {
                        break;
                    }
                    let mut out = vec![0u8; (*len).min(bytes.len() - at)];
                    graph.read_container(at as u64, &mut out).unwrap();
                    read.extend(out);
                }
                prop_assert!(read == bytes, "read back differently in chunks of {chunks:?}");
                Ok(())
            })
            .unwrap();
        // Padding that is not zeros, past what is kept of it: the container is not read back.
        let mut padded = mlp().0;
        padded.extend(std::iter::repeat_n(1u8, MAX_FILLER + 1));
        assert_eq!(GraphModule::load(&padded, Device::Cpu).unwrap().container_len(), None);
    }

    #[test]
    fn a_plan_counts_operations_and_the_peak_of_values_still_read() {
        let (bytes, w) = mlp();
        let graph = GraphModule::load(&bytes, Device::Cpu).unwrap();
        assert_eq!(graph.dies_after[0], vec![vec![0, 1, 2], vec![5], vec![3, 4, 6]], "the output is never dropped");
        let per_row = (2 * 256 * 1024 + 1024) + 1024 + (2 * 1024 * 256 + 256);
        for rows in [4i64, 1, 4096] {
            let x = Tensor::randn([rows, 256], (Kind::Float, Device::Cpu));
            let e = graph.estimate_run(std::slice::from_ref(&x)).unwrap();
            // Two [rows, 1024] float32 values at once: the ReLU's input is freed once read.
            // The two products are long steps at 4,096 rows (2·4096·1024·256 operations each).
            let long_steps = if rows == 4096 { vec![(0, 2_151_677_952), (2, 2_148_532_224)] } else { vec![] };
            let want = Estimate {
                flops: rows as u64 * per_row,
                peak_bytes: rows as u64 * 8192,
                stopped_at: None,
                planned_steps: 3,
                long_steps,
            };
            assert_eq!(e, want);
            let want = x.linear(&w[0], Some(&w[1])).relu().linear(&w[2], Some(&w[3]));
            let RtValue::Tensor(got) = &graph.run(vec![x]).unwrap()[0] else { panic!("not a tensor") };
            assert!(got.allclose(&want, 1e-5, 1e-5, false), "the run frees values and still computes the same");
        }
        // A transposed input of the same sizes is planned alike; an expanded one reads less
        // memory but computes as much.
        let t = Tensor::randn([256, 4], (Kind::Float, Device::Cpu)).tr();
        assert_eq!(graph.estimate_run(&[t]).unwrap().flops, 4 * per_row);
        let expanded = Tensor::randn([1, 256], (Kind::Float, Device::Cpu)).expand([4096, 256], false);
        assert_eq!(graph.estimate_run(&[expanded]).unwrap().peak_bytes, 4096 * 8192);
        // A factory is planned on the meta device, whatever device it was left to: 4 TiB of
        // ones plan without a byte allocated.
        let x = Tensor::zeros([1, 1], (Kind::Float, Device::Cpu));
        let ones =
            one_operator("aten::ones", vec![Arg::List(vec![Arg::Int(1 << 40)])], &[], std::slice::from_ref(&x), 1);
        let e = ones.estimate_run(std::slice::from_ref(&x)).unwrap();
        assert_eq!((e.peak_bytes, e.stopped_at), (4 << 40, None));
        // So is an operator whose only tensor is a number: 8 TiB of a repeated wrapped int.
        let repeat = one_operator(
            "aten::repeat",
            vec![Arg::Int(1), Arg::List(vec![Arg::Int(1 << 40)])],
            &[],
            std::slice::from_ref(&x),
            1,
        );
        let e = repeat.estimate_run(std::slice::from_ref(&x)).unwrap();
        assert_eq!((e.peak_bytes >> 40, e.stopped_at), (8, None));
        // A list of tensors that holds none is passed as such, to libtorch's own refusal.
        let x = Tensor::randn([3, 2], (Kind::Float, Device::Cpu));
        let index = vec![Arg::Value(0), Arg::List(vec![Arg::None])];
        let whole = one_operator("aten::index.Tensor", index, &[], std::slice::from_ref(&x), 1);
        assert_eq!(whole.estimate_run(std::slice::from_ref(&x)).unwrap().stopped_at, None);
        let e = whole.run(vec![x]).unwrap_err();
        assert!(matches!(e, ExecError::Execution(_)), "{e}");
        // Plans are kept per shape, and a bounded number of them.
        for rows in 1..=200 {
            graph.estimate_run(&[Tensor::zeros([rows, 256], (Kind::Float, Device::Cpu))]).unwrap();
        }
        assert!(graph.estimates.lock().unwrap()[0].len() <= 64);
    }
}
