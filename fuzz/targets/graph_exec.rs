//! Graphs written from the allowlist's schemas with hostile values wherever a schema allows
//! them, planned and run through the node's runner (`djinn_executor::graph::GraphModule`) on
//! the CPU, as a node runs a tenant's graph. The input's bytes are choices (past their end
//! every choice is the plainest, and no more operators come): 1 to 3 inputs (any dtype of the graph format, ranks 0 to 6,
//! sizes mostly 0 to 5, some not contiguous), maybe a weight, then 1 to 6 operators of the
//! allowlist with arguments of their schemas' types: tensors of the graph (or numbers where a
//! tensor goes), ints from a pool of hostile ones (0, -1, `i64::MAX`, `1 << 40`, ...) or in
//! range for what they index, int lists empty or long, floats NaN, ±inf, 1e-300, 1e300, enum
//! ints in and out of their rules, strings libtorch takes and junk, index lists mixing masks
//! and integer indices, sizes the runner computes (`native::size`, `native::mul`). Most
//! operators have a recipe that shapes their tensors for them (ranks matched for products, 4-d
//! images for pooling, masks shaped as what they mask) that the choices follow or ignore.
//!
//! What is a finding (a panic here, or a signal or abort in libtorch):
//! - the process dies (a signal, an abort, a C++ exception escaping);
//! - a run of a program without a random operator gives outputs that differ between a run whose
//!   every allocation was filled with 0xA5 and one filled with 0x5A (`fill_allocations`), or
//!   succeeds once and fails once: it read memory it never wrote, which on a node is another
//!   tenant's freed memory;
//! - a run changes its caller's inputs or the graph's weights (shared across tenants);
//! - a run on inputs laid out other than contiguously gives other integer or bool outputs than
//!   a run on the same values laid out contiguously: a kernel read its operands past their
//!   strides (floats are not compared: their last bits follow the order of a sum). Not for
//!   programs that read strides (`as_strided`, `sym_stride`) or order ties (`sort`, `topk`).
//!
//! Not findings: a graph the check refuses, a plan over the bounds below (the node refuses the
//! run), a typed error from the run, an allocation the node's allocator refuses (it is the bound
//! by design). Each run happens under a `JobMemory` bounded as the node bounds a run, the plan
//! under one of 1 MiB (a plan over meta tensors needs no real memory; one that does is counted,
//! see `plans_on_real_memory` below). Runs are single-threaded (`tch::set_num_threads(1)`), as
//! the node runs one thread per operation.
//!
//! Input layout: choices, as above; or, for an input that starts with `{`, a case written out
//! (what the regression cases are, so that they mean the same whatever the generator becomes):
//! `{"program": PROGRAM, "inputs": [VALUES, ...], "weights": [VALUES, ...]}`, the program as
//! docs/graph-format.md has it, each input shaped and typed as the program declares it (each
//! dimension's `min`), VALUES a list of numbers (or "NaN", "inf", "-inf") repeated to fill it,
//! `{"values": VALUES, "layout": "transposed" | "expanded" | "strided"}` for an input laid out
//! otherwise (its last two dimensions swapped, its first broadcast from 1, or every other
//! element of a first dimension twice as long: VALUES fill that).
//!
//! With `DJINN_FUZZ_PRINT` set, each program is printed (JSON) before it runs, with its inputs'
//! sizes and strides, and how it ended: run the binary on one input to see what it does.
//!
//! With `DJINN_FUZZ_OP=aten::OP.OVERLOAD` set, every operator the generator writes is that one.
//!
//! With `DJINN_FUZZ_STATS=PATH` set, the counts of executions, outcomes and, per operator, how
//! often it ran, failed (a typed error at run time) or was refused, go to PATH (JSON) every
//! 1000 executions.

use std::collections::BTreeMap;
use std::sync::{Mutex, Once, OnceLock};

use djinn_auth::TenantId;
use djinn_executor::allocator::{JobMemory, fill_allocations};
use djinn_executor::graph::{GraphModule, RtValue};
use djinn_executor::tch::{self, Device, Kind, Tensor};
use djinn_graph::format::{DTYPES, FORMAT, WEIGHT_ALIGN};
use djinn_graph::schema::{Argument, Schema, Type};
use djinn_graph::{Arg, DimRange, Input, Node, Program, ValueRule, Weight, allowlist};
use djinn_memory::MemoryBudget;

/// The most bytes a run may plan to hold, and the allocator's bound on each run.
const LIMIT: u64 = 256 << 20;
/// The most bytes of real memory a plan may allocate (it runs over meta tensors).
const PLAN_LIMIT: u64 = 1 << 20;
/// The most operations a run may plan (a node's compute quota refuses past it).
const MAX_FLOPS: u64 = 2_000_000_000;
/// The most inputs a graph takes (recipes add inputs shaped for their operator).
const MAX_INPUTS: usize = 8;
/// The most nodes, with those added before an operator (a copy an in-place operator writes, a
/// complex tensor, a size the run computes).
const MAX_NODES: usize = 24;
/// The most elements of one input.
const MAX_NUMEL: i64 = 1 << 16;

const HOSTILE_INTS: &[i64] = &[
    0,
    1,
    -1,
    2,
    3,
    5,
    100,
    -100,
    i64::MAX,
    i64::MIN,
    i64::MAX - 1,
    i64::MIN + 1,
    1 << 31,
    (1 << 31) - 1,
    -(1 << 31),
    1 << 32,
    1 << 40,
    -(1 << 40),
    1 << 62,
    65536,
    -65537,
];
const FLOATS: &[&str] = &[
    "0", "1", "-1", "0.5", "2", "-0.0", "NaN", "inf", "-inf", "1e-300", "1e300", "1e-20", "1e20", "3.5", "-2.5",
    "1e-05", "0.1", "65504.0", "70000.0", "5e-324",
];
const TENSOR_FLOATS: &[f64] = &[
    0.0,
    1.0,
    -1.0,
    0.5,
    2.0,
    -2.0,
    3.0,
    -0.0,
    f64::NAN,
    f64::INFINITY,
    f64::NEG_INFINITY,
    1e-300,
    1e300,
    1e-20,
    1e20,
    65504.0,
    7.0,
    100.0,
    -100.0,
    0.25,
];
const TENSOR_INTS: &[i64] = &[
    0,
    1,
    -1,
    2,
    3,
    4,
    5,
    7,
    100,
    -100,
    127,
    -128,
    255,
    256,
    32767,
    -32768,
    i32::MAX as i64,
    i32::MIN as i64,
    i64::MAX,
    i64::MIN,
    1 << 40,
    63,
    64,
];
const JUNK_STRINGS: &[&str] = &["", "bogus", "none", "sum", "ij->ji", "a\u{0}b", "\u{1F600}", "NONE", "mean "];
const MEMORY_FORMATS: &[&str] = &["contiguous", "preserve", "channels_last", "channels_last_3d"];
const NATIVE_INT_OPS: &[&str] = &["add", "sub", "mul", "floordiv", "mod", "min", "max"];
const NATIVE_COMPARISONS: &[&str] = &["eq", "ne", "lt", "le", "gt", "ge"];
/// Operators whose output has their first tensor argument's sizes (and dtype, for the second
/// list too): what the generator knows of a value it did not make.
const SAME_SHAPE: &[&str] = &[
    "abs",
    "acos",
    "acosh",
    "asin",
    "asinh",
    "atan",
    "atanh",
    "ceil",
    "clone",
    "contiguous",
    "cos",
    "cosh",
    "detach",
    "alias",
    "erf",
    "exp",
    "expm1",
    "floor",
    "log",
    "log10",
    "log1p",
    "log2",
    "neg",
    "reciprocal",
    "relu",
    "round",
    "rsqrt",
    "sigmoid",
    "sign",
    "silu",
    "sin",
    "sinh",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
    "gelu",
    "elu",
    "leaky_relu",
    "hardtanh",
    "clamp",
    "clamp_min",
    "bitwise_not",
    "logical_not",
    "isnan",
    "isinf",
    "softmax",
    "log_softmax",
    "_softmax",
    "_log_softmax",
    "_safe_softmax",
    "cumsum",
    "tril",
    "triu",
    "flip",
    "zeros_like",
    "ones_like",
    "full_like",
    "fill",
    "fill_",
    "zero_",
    "copy_",
    "masked_fill",
    "masked_fill_",
    "index_copy",
    "index_copy_",
    "scatter",
    "scatter_add",
    "scatter_reduce",
    "dropout",
    "_to_copy",
    "to",
    "type_as",
    "rand_like",
    "randn_like",
    "randint_like",
    "bernoulli",
    "uniform",
    "copy",
    "masked_scatter",
    "select_scatter",
    "slice_scatter",
    "index_put",
];
const SAME_DTYPE: &[&str] = &[
    "abs",
    "ceil",
    "clone",
    "contiguous",
    "detach",
    "alias",
    "floor",
    "neg",
    "relu",
    "round",
    "sign",
    "trunc",
    "clamp",
    "hardtanh",
    "tril",
    "triu",
    "flip",
    "zeros_like",
    "ones_like",
    "fill",
    "fill_",
    "zero_",
    "copy_",
    "masked_fill",
    "masked_fill_",
    "index_copy",
    "index_copy_",
    "scatter",
    "scatter_add",
    "dropout",
    "copy",
    "masked_scatter",
    "select_scatter",
    "slice_scatter",
    "index_put",
    "cumsum",
];

/// Reads choices from the input; past its end every choice is the first.
struct Choices<'a> {
    data: &'a [u8],
    at: usize,
}

impl Choices<'_> {
    fn byte(&mut self) -> u8 {
        let b = self.data.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        b
    }

    /// `0..n` (0 for `n` of 0 or 1).
    fn below(&mut self, n: usize) -> usize {
        match n {
            0 | 1 => 0,
            2..=256 => self.byte() as usize % n,
            _ => u16::from_le_bytes([self.byte(), self.byte()]) as usize % n,
        }
    }

    /// True `in256` times in 256; false past the input's end (where every choice is the
    /// plainest).
    fn chance(&mut self, in256: u32) -> bool {
        256 - (self.byte() as u32) <= in256
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// `low..=high`.
    fn range(&mut self, low: i64, high: i64) -> i64 {
        if high <= low {
            return low;
        }
        low + self.below((high - low + 1).min(1 << 16) as usize) as i64
    }
}

/// What the generator knows of a tensor value of the graph.
#[derive(Debug, Clone)]
struct Tv {
    id: u32,
    dtype: Option<&'static str>,
    shape: Option<Vec<i64>>,
}

impl Tv {
    fn rank(&self) -> Option<i64> {
        self.shape.as_ref().map(|s| s.len() as i64)
    }

    fn size(&self, dim: i64) -> Option<i64> {
        let shape = self.shape.as_ref()?;
        let d = if dim < 0 { dim + shape.len() as i64 } else { dim };
        shape.get(usize::try_from(d).ok()?).copied()
    }
}

/// What an input's values are.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Values {
    Any,
    /// Indices into a dimension of this size (some out of it).
    Index(i64),
    /// Offsets into this many indices, from 0, increasing.
    Offsets(i64),
    Probabilities,
    NonNegative,
}

/// A tensor a recipe wants.
#[derive(Debug, Clone)]
struct TSpec {
    dtype: &'static str,
    shape: Vec<i64>,
    values: Values,
    /// The graph's own (a copy), for an in-place operator to write.
    own: bool,
    /// A complex tensor (an FFT of a real one the graph takes).
    complex: bool,
}

fn spec(dtype: &'static str, shape: Vec<i64>) -> TSpec {
    TSpec { dtype, shape, values: Values::Any, own: false, complex: false }
}

fn index_spec(shape: Vec<i64>, bound: i64) -> TSpec {
    TSpec { values: Values::Index(bound), ..spec("int64", shape) }
}

/// An argument a recipe fixes.
#[derive(Debug, Clone)]
enum Fixed {
    T(TSpec),
    TList(Vec<TSpec>),
    Int(i64),
    Ints(Vec<i64>),
    Float(String),
    Floats(Vec<String>),
    Bool(bool),
    Str(&'static str),
    None,
}

/// Whether a recipe's argument has a type the schema's argument takes (recipes are per
/// operator, and overloads differ: `masked_fill.Scalar`'s value is a number).
fn fits(fixed: &Fixed, ty: &Type) -> bool {
    let list_of = |t: &Type| match ty.required() {
        Type::List(inner) => inner.as_ref() == t,
        _ => false,
    };
    match fixed {
        Fixed::T(_) => *ty.required() == Type::Tensor,
        Fixed::TList(_) => list_of(&Type::Tensor),
        Fixed::Int(_) => matches!(ty.required(), Type::Int | Type::SymInt | Type::Scalar),
        Fixed::Ints(_) => list_of(&Type::Int) || list_of(&Type::SymInt),
        Fixed::Float(_) => matches!(ty.required(), Type::Float | Type::Scalar),
        Fixed::Floats(_) => list_of(&Type::Float),
        Fixed::Bool(_) => matches!(ty.required(), Type::Bool | Type::Scalar),
        Fixed::Str(_) => *ty.required() == Type::Str,
        Fixed::None => matches!(ty, Type::Optional(_)),
    }
}

/// Per argument of the operator being written, what the arguments before it were.
#[derive(Debug, Default)]
struct Ctx {
    /// The first tensor argument.
    first: Option<Tv>,
    /// The last dimension argument.
    dim: Option<i64>,
}

impl Ctx {
    fn rank(&self) -> i64 {
        self.first.as_ref().and_then(Tv::rank).unwrap_or(2)
    }

    /// The size of the first tensor at the last dimension argument.
    fn dim_size(&self) -> Option<i64> {
        self.first.as_ref()?.size(self.dim.unwrap_or(0))
    }
}

/// A program and its inputs.
struct Case {
    program: Program,
    weights: Vec<Vec<u8>>,
    inputs: Vec<Tensor>,
    /// Whether an operator draws random numbers (its outputs differ from run to run).
    random: bool,
}

struct Gen<'a> {
    c: Choices<'a>,
    next: u32,
    inputs: Vec<Input>,
    input_tensors: Vec<Tensor>,
    weights: Vec<Weight>,
    weight_bytes: Vec<Vec<u8>>,
    tensors: Vec<Tv>,
    ints: Vec<u32>,
    bools: Vec<u32>,
    tensor_lists: Vec<u32>,
    int_lists: Vec<u32>,
    nodes: Vec<Node>,
    random: bool,
    /// How often (in 256) an argument ignores its recipe or rule.
    wild: u32,
}

/// The graph dtype's libtorch kind (the names come from the format's DTYPES).
fn kind_of(name: &str) -> Kind {
    djinn_executor::graph::kind_of(name).unwrap_or(Kind::Float)
}

fn numel(shape: &[i64]) -> i64 {
    shape.iter().fold(1i64, |n, &d| n.saturating_mul(d.max(0)))
}

/// The elements of `shape` were its zero sizes ones.
fn volume(shape: &[i64]) -> i64 {
    shape.iter().fold(1i64, |n, &d| n.saturating_mul(d.max(1)))
}

/// The allowlist's operators, in order.
fn operators() -> &'static [&'static str] {
    static NAMES: OnceLock<Vec<&'static str>> = OnceLock::new();
    NAMES.get_or_init(|| {
        let mut names: Vec<&'static str> = allowlist().names().collect();
        names.sort_unstable();
        names
    })
}

/// `DJINN_FUZZ_OP`: every operator the generator writes is this one (to see how it fares).
fn only_operator() -> Option<&'static str> {
    static ONLY: OnceLock<Option<&'static str>> = OnceLock::new();
    *ONLY.get_or_init(|| {
        let name = std::env::var("DJINN_FUZZ_OP").ok()?;
        operators().iter().copied().find(|op| *op == name)
    })
}

/// `N` of an argument declared `int[N] name` in `op`'s schema.
fn fixed_len(op: &str, arg: &str) -> Option<usize> {
    let text = allowlist().text(op)?;
    let args = text.split_once('(')?.1.rsplit_once(") ->")?.0;
    for part in args.split(',') {
        let decl = part.split('=').next().unwrap_or("").trim();
        if let Some((ty, name)) = decl.rsplit_once(' ')
            && name.trim_end_matches(')') == arg
        {
            let inside = ty.split_once('[')?.1.split_once(']')?.0;
            return inside.parse().ok();
        }
    }
    None
}

fn base_name(op: &str) -> &str {
    let name = op.strip_prefix("aten::").unwrap_or(op);
    name.split_once('.').map_or(name, |(n, _)| n)
}

fn float_text(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 { "inf".into() } else { "-inf".into() }
    } else {
        format!("{f:?}")
    }
}

impl<'a> Gen<'a> {
    fn new(data: &'a [u8]) -> Self {
        let mut c = Choices { data, at: 0 };
        let wild = [8, 24, 48, 96][c.below(4)];
        Self {
            c,
            next: 0,
            inputs: Vec::new(),
            input_tensors: Vec::new(),
            weights: Vec::new(),
            weight_bytes: Vec::new(),
            tensors: Vec::new(),
            ints: Vec::new(),
            bools: Vec::new(),
            tensor_lists: Vec::new(),
            int_lists: Vec::new(),
            nodes: Vec::new(),
            random: false,
            wild,
        }
    }

    fn fresh(&mut self) -> u32 {
        self.next += 1;
        self.next - 1
    }

    fn wild(&mut self) -> bool {
        let w = self.wild;
        self.c.chance(w)
    }

    /// A size of a dimension: mostly 1 to 4, sometimes 0, 5 or larger.
    fn dim(&mut self) -> i64 {
        match self.c.byte() {
            b @ 0..=183 => 1 + i64::from(b % 4),
            184..=199 => 0,
            200..=239 => 5,
            _ => self.c.pick(&[7, 16, 33, 64, 300]),
        }
    }

    /// A size of a dimension that is not 0.
    fn dim1(&mut self) -> i64 {
        1 + self.c.below(4) as i64
    }

    fn shape(&mut self, rank: usize) -> Vec<i64> {
        let mut shape: Vec<i64> = (0..rank).map(|_| self.dim()).collect();
        while volume(&shape) > MAX_NUMEL {
            for d in shape.iter_mut() {
                *d = (*d).min(5);
            }
        }
        shape
    }

    /// A shape of `low..=high` dimensions.
    fn shape_between(&mut self, low: usize, high: usize) -> Vec<i64> {
        let rank = low + self.c.below(high - low + 1);
        self.shape(rank)
    }

    fn any_shape(&mut self) -> Vec<i64> {
        let rank = self.rank();
        self.shape(rank)
    }

    fn rank(&mut self) -> usize {
        match self.c.byte() {
            0..=79 => 1,
            80..=159 => 2,
            160..=183 => 0,
            184..=215 => 3,
            216..=243 => 4,
            244..=251 => 5,
            _ => 6,
        }
    }

    fn dtype(&mut self) -> &'static str {
        if self.c.chance(128) { DTYPES[self.c.below(DTYPES.len())].0 } else { "float32" }
    }

    fn float_dtype(&mut self) -> &'static str {
        match self.c.byte() {
            0..=199 => "float32",
            200..=223 => "float64",
            224..=239 => "float16",
            _ => "bfloat16",
        }
    }

    fn int_dtype(&mut self) -> &'static str {
        self.c.pick(&["int64", "int64", "int32", "int16", "int8", "uint8", "bool"])
    }

    /// `n` values for a tensor of `kind`.
    fn values(&mut self, kind: Kind, n: usize, how: Values) -> Option<Tensor> {
        let float = matches!(kind, Kind::Half | Kind::Float | Kind::Double | Kind::BFloat16);
        let t = match how {
            Values::Index(bound) | Values::Offsets(bound) => {
                let mut v = Vec::with_capacity(n);
                let mut at = 0i64;
                for i in 0..n {
                    let x = if self.c.chance(6) {
                        self.c.pick(&[bound, -1, -bound - 1, i64::MAX, i64::MIN, bound + 1])
                    } else if let Values::Offsets(_) = how {
                        if i > 0 {
                            at = (at + self.c.below(3) as i64).min(bound);
                        }
                        at
                    } else if bound > 0 {
                        self.c.below(bound as usize) as i64
                    } else {
                        0
                    };
                    v.push(x);
                }
                Tensor::f_from_slice(&v).ok()?
            }
            Values::Probabilities | Values::NonNegative => {
                let pool: &[f64] = if how == Values::Probabilities {
                    &[0.5, 0.25, 1.0, 0.0, 0.75]
                } else {
                    &[0.5, 0.0, 1.0, 2.0, 1e-20, 3.0]
                };
                let hostile = [f64::NAN, -1.0, 2.0, f64::INFINITY, -0.0];
                let len = 1 + self.c.below(6);
                let pattern: Vec<f64> = (0..len)
                    .map(|_| if self.c.chance(8) { self.c.pick(&hostile) } else { self.c.pick(pool) })
                    .collect();
                let v: Vec<f64> = (0..n).map(|i| pattern[i % len]).collect();
                Tensor::f_from_slice(&v).ok()?
            }
            Values::Any => {
                let mode = self.c.below(4);
                let len = 1 + self.c.below(8);
                if float {
                    let pattern: Vec<f64> = (0..len).map(|_| self.c.pick(TENSOR_FLOATS)).collect();
                    let v: Vec<f64> = (0..n)
                        .map(|i| match mode {
                            0 => 0.0,
                            1 => pattern[i % len],
                            2 => i as f64 * 0.37 - 1.0,
                            _ => pattern[i % len] + (i % 5) as f64,
                        })
                        .collect();
                    Tensor::f_from_slice(&v).ok()?
                } else {
                    let pattern: Vec<i64> = (0..len).map(|_| self.c.pick(TENSOR_INTS)).collect();
                    let v: Vec<i64> = (0..n)
                        .map(|i| match mode {
                            0 => 0,
                            1 => pattern[i % len],
                            2 => i as i64 - 2,
                            _ => pattern[i % len].wrapping_add((i % 5) as i64),
                        })
                        .collect();
                    Tensor::f_from_slice(&v).ok()?
                }
            }
        };
        t.f_to_kind(kind).ok()
    }

    /// A new input of `dtype` and `shape`, sometimes laid out other than contiguously.
    fn new_input(&mut self, dtype: &'static str, shape: Vec<i64>, how: Values) -> Option<Tv> {
        // Bounded with its zero sizes taken for ones: the layouts below make it with a size of 1
        // or twice a size.
        if self.inputs.len() >= MAX_INPUTS || volume(&shape) > MAX_NUMEL || shape.len() > 6 {
            return None;
        }
        let kind = kind_of(dtype);
        let rank = shape.len();
        let t = match self.c.below(8) {
            // Transposed: made with two sizes swapped.
            0 if rank >= 2 => {
                let (a, b) = (self.c.below(rank), self.c.below(rank));
                let mut made = shape.clone();
                made.swap(a, b);
                let t = self.values(kind, numel(&made) as usize, how)?.f_reshape(made.as_slice()).ok()?;
                t.f_transpose(a as i64, b as i64).ok()?
            }
            // Expanded: a dimension of size 1 broadcast (stride 0).
            1 if rank >= 1 => {
                let d = self.c.below(rank);
                let mut made = shape.clone();
                made[d] = 1;
                let t = self.values(kind, numel(&made) as usize, how)?.f_reshape(made.as_slice()).ok()?;
                t.f_expand(shape.as_slice(), false).ok()?
            }
            // Every other element of a dimension twice as long.
            2 if rank >= 1 => {
                let d = self.c.below(rank);
                let mut made = shape.clone();
                made[d] *= 2;
                let t = self.values(kind, numel(&made) as usize, how)?.f_reshape(made.as_slice()).ok()?;
                t.f_slice(d as i64, 0, made[d], 2).ok()?
            }
            _ => self.values(kind, numel(&shape) as usize, how)?.f_reshape(shape.as_slice()).ok()?,
        };
        if t.size() != shape {
            return None;
        }
        let id = self.fresh();
        let dims = shape
            .iter()
            .map(|&n| {
                if self.c.chance(32) {
                    DimRange { min: 0, max: n + self.c.below(4) as i64 }
                } else {
                    DimRange { min: n, max: n }
                }
            })
            .collect();
        self.inputs.push(Input {
            name: format!("x{}", self.inputs.len()),
            value: id,
            dtype: dtype.into(),
            dims,
            state: false,
        });
        self.input_tensors.push(t);
        let tv = Tv { id, dtype: Some(dtype), shape: Some(shape) };
        self.tensors.push(tv.clone());
        Some(tv)
    }

    fn random_input(&mut self) -> Option<Tv> {
        let dtype = self.dtype();
        let rank = self.rank();
        let shape = self.shape(rank);
        self.new_input(dtype, shape, Values::Any)
    }

    fn weight(&mut self) {
        let dtype = self.dtype();
        let rank = 1 + self.c.below(2);
        let shape: Vec<i64> = (0..rank).map(|_| self.dim1()).collect();
        let Some(t) = self.values(kind_of(dtype), numel(&shape) as usize, Values::Any) else { return };
        let len = numel(&shape) as usize * kind_of(dtype).elt_size_in_bytes();
        let mut bytes = vec![0u8; len];
        if t.f_copy_data_u8(&mut bytes, numel(&shape) as usize).is_err() {
            return;
        }
        let id = self.fresh();
        self.weights.push(Weight {
            name: "w0".into(),
            value: id,
            dtype: dtype.into(),
            shape: shape.clone(),
            offset: 0,
        });
        self.weight_bytes.push(bytes);
        self.tensors.push(Tv { id, dtype: Some(dtype), shape: Some(shape) });
    }

    fn any_tensor(&mut self) -> Option<Tv> {
        if !self.tensors.is_empty() && (self.inputs.len() >= MAX_INPUTS || !self.c.chance(40)) {
            let i = self.c.below(self.tensors.len());
            return Some(self.tensors[i].clone());
        }
        self.random_input().or_else(|| self.tensors.first().cloned())
    }

    fn node(&mut self, op: &str, overload: &str, args: Vec<Arg>, outputs: usize) -> Vec<u32> {
        let outputs: Vec<u32> = (0..outputs).map(|_| self.fresh()).collect();
        self.nodes.push(Node {
            op: op.into(),
            overload: overload.into(),
            args,
            kwargs: BTreeMap::new(),
            outputs: outputs.clone(),
        });
        outputs
    }

    /// A tensor as `spec` asks: one of the graph's of that dtype and shape, or a new input.
    fn tensor_for(&mut self, spec: &TSpec) -> Option<Tv> {
        if spec.complex {
            // An FFT of a real input whose last dimension gives `spec`'s.
            let mut real = spec.shape.clone();
            let last = real.last().copied().unwrap_or(1).max(1);
            if let Some(l) = real.last_mut() {
                *l = 2 * (last - 1) + self.c.below(2) as i64;
            }
            let x = self.new_input("float32", real, Values::Any)?;
            let last_dim = spec.shape.len() as i64 - 1;
            let [out] = self.node(
                "aten::_fft_r2c",
                "",
                vec![Arg::Value(x.id), Arg::List(vec![Arg::Int(last_dim)]), Arg::Int(0), Arg::Bool(true)],
                1,
            )[..] else {
                return None;
            };
            let tv = Tv { id: out, dtype: None, shape: Some(spec.shape.clone()) };
            self.tensors.push(tv.clone());
            return Some(tv);
        }
        let reuse = spec.values == Values::Any && self.c.chance(96);
        let existing = self
            .tensors
            .iter()
            .filter(|t| t.dtype == Some(spec.dtype) && t.shape.as_ref() == Some(&spec.shape))
            .cloned()
            .collect::<Vec<_>>();
        let tv = match reuse && !existing.is_empty() {
            true => existing[self.c.below(existing.len())].clone(),
            false => match self.new_input(spec.dtype, spec.shape.clone(), spec.values) {
                Some(tv) => tv,
                None => existing.first().cloned().or_else(|| self.any_tensor())?,
            },
        };
        if spec.own && self.nodes.len() < MAX_NODES {
            let [copy] = self.node("aten::clone", "", vec![Arg::Value(tv.id)], 1)[..] else { return None };
            let own = Tv { id: copy, ..tv };
            self.tensors.push(own.clone());
            return Some(own);
        }
        Some(tv)
    }

    fn realize(&mut self, fixed: &Fixed, ctx: &mut Ctx) -> Option<Arg> {
        Some(match fixed {
            Fixed::T(spec) => {
                let tv = self.tensor_for(spec)?;
                if ctx.first.is_none() {
                    ctx.first = Some(tv.clone());
                }
                Arg::Value(tv.id)
            }
            Fixed::TList(specs) => {
                let mut items = Vec::new();
                for s in specs {
                    let tv = self.tensor_for(s)?;
                    if ctx.first.is_none() {
                        ctx.first = Some(tv.clone());
                    }
                    items.push(Arg::Value(tv.id));
                }
                Arg::List(items)
            }
            Fixed::Int(i) => {
                ctx.dim = Some(*i);
                Arg::Int(*i)
            }
            Fixed::Ints(v) => Arg::List(v.iter().map(|&i| Arg::Int(i)).collect()),
            Fixed::Float(f) => Arg::Float(f.clone()),
            Fixed::Floats(v) => Arg::List(v.iter().map(|f| Arg::Float(f.clone())).collect()),
            Fixed::Bool(b) => Arg::Bool(*b),
            Fixed::Str(s) => Arg::Str((*s).into()),
            Fixed::None => Arg::None,
        })
    }

    fn hostile_int(&mut self) -> i64 {
        self.c.pick(HOSTILE_INTS)
    }

    fn small_int(&mut self) -> i64 {
        self.c.range(-2, 5)
    }

    fn number(&mut self) -> Arg {
        match self.c.below(8) {
            0..=3 => Arg::Int(self.small_int()),
            4 => Arg::Int(self.hostile_int()),
            5 | 6 => Arg::Float(self.c.pick(FLOATS).into()),
            _ => Arg::Bool(self.c.chance(128)),
        }
    }

    fn int_arg(&mut self, name: &str, ctx: &mut Ctx) -> Arg {
        if !self.ints.is_empty() && self.c.chance(20) {
            let v = self.ints[self.c.below(self.ints.len())];
            return Arg::Value(v);
        }
        if self.wild() {
            return Arg::Int(self.hostile_int());
        }
        let rank = ctx.rank();
        let v = match name {
            "dim" | "dim0" | "dim1" | "dim2" | "start_dim" | "end_dim" => {
                let d = if rank == 0 { self.c.range(-1, 0) } else { self.c.range(-rank, rank - 1) };
                ctx.dim = Some(d);
                d
            }
            "index" => {
                let size = ctx.dim_size().unwrap_or(2).max(1);
                self.c.range(-size, size - 1)
            }
            "k" => self.c.range(0, ctx.dim_size().unwrap_or(2)),
            "diagonal" | "offset" => self.c.range(-2, 2),
            "split_size" | "step" | "groups" | "group" => self.c.range(1, 3),
            "n" | "m" | "steps" | "num_samples" | "high" | "N" | "C" | "HxW" | "last_dim_size" => self.c.range(1, 5),
            "low" => self.c.range(-1, 1),
            "padding_idx" => -1,
            "storage_offset" => self.c.range(0, 2),
            "decimals" => self.c.range(-1, 3),
            "start" | "end" => self.c.range(-4, 4),
            _ => self.small_int(),
        };
        Arg::Int(v)
    }

    fn float_arg(&mut self, name: &str) -> Arg {
        if !self.wild() {
            let f = match name {
                "p" | "dropout_p" => self.c.pick(&["0.0", "0.5", "1.0", "0.25"]),
                "eps" => "1e-05",
                "momentum" => "0.1",
                "std" => self.c.pick(&["1.0", "0.0", "2.5"]),
                "base" => self.c.pick(&["10.0", "2.0", "0.5"]),
                "from" => "0.0",
                "to" => "1.0",
                "scale" => "0.5",
                _ => self.c.pick(FLOATS),
            };
            return Arg::Float(f.into());
        }
        if !self.ints.is_empty() && self.c.chance(40) {
            return Arg::Value(self.ints[self.c.below(self.ints.len())]);
        }
        Arg::Float(self.c.pick(FLOATS).into())
    }

    fn bool_arg(&mut self, name: &str) -> Arg {
        if !self.bools.is_empty() && self.c.chance(20) {
            return Arg::Value(self.bools[self.c.below(self.bools.len())]);
        }
        match name {
            "train" | "sparse" | "scale_grad_by_freq" | "half_to_float" | "non_blocking" | "cudnn_enabled"
            | "cudnn_enable" | "sparse_grad" | "implicit" | "enable_gqa" | "pin_memory"
                if !self.wild() =>
            {
                Arg::Bool(false)
            }
            _ => Arg::Bool(self.c.chance(128)),
        }
    }

    fn string_arg(&mut self, name: &str) -> String {
        if self.wild() {
            return self.c.pick(JUNK_STRINGS).into();
        }
        let pool: &[&str] = match name {
            "approximate" => &["none", "tanh"],
            "rounding_mode" => &["trunc", "floor"],
            "reduce" => &["sum", "prod", "mean", "amax", "amin", "add", "multiply"],
            "padding" => &["valid", "same"],
            _ => JUNK_STRINGS,
        };
        self.c.pick(pool).into()
    }

    /// A tensor argument without a recipe: the first is any tensor, later ones shaped as it.
    fn tensor_arg(&mut self, name: &str, ctx: &mut Ctx) -> Option<Arg> {
        if ctx.first.is_some() && self.c.chance(16) {
            return Some(self.number());
        }
        if !self.ints.is_empty() && self.c.chance(4) {
            return Some(Arg::Value(self.ints[self.c.below(self.ints.len())]));
        }
        let first = ctx.first.clone();
        let tv = match (first, name) {
            (first, "mask" | "condition") if !self.wild() => {
                let shape = match first.and_then(|f| f.shape) {
                    Some(s) => s,
                    None => {
                        let r = self.rank();
                        self.shape(r)
                    }
                };
                self.tensor_for(&spec("bool", shape))?
            }
            (Some(first), "index" | "indices") if !self.wild() => {
                let bound = ctx.dim_size().unwrap_or(2);
                let shape = match (&first.shape, self.c.below(2)) {
                    (Some(s), 0) => s.iter().map(|&n| self.c.range(0, n)).collect(),
                    _ => vec![self.dim()],
                };
                self.tensor_for(&index_spec(shape, bound))?
            }
            (Some(first), _) if !self.wild() => match (&first.shape, first.dtype, self.c.below(4)) {
                (_, _, 0) => first.clone(),
                (Some(s), Some(d), 1 | 2) => self.tensor_for(&spec(d, s.clone()))?,
                (Some(s), _, _) => {
                    let d = self.dtype();
                    self.tensor_for(&spec(d, s.clone()))?
                }
                _ => first.clone(),
            },
            _ => self.any_tensor()?,
        };
        if ctx.first.is_none() {
            ctx.first = Some(tv.clone());
        }
        Some(Arg::Value(tv.id))
    }

    /// A list of sizes for `op`'s `name`, from what the generator knows of its first tensor.
    fn sizes(&mut self, op: &str, name: &str, ctx: &mut Ctx) -> Vec<i64> {
        let shape = ctx.first.as_ref().and_then(|f| f.shape.clone());
        let base = base_name(op);
        let rank = ctx.rank().max(0) as usize;
        let fixed = fixed_len(op, name);
        match (base, name, shape) {
            ("view" | "reshape" | "_unsafe_view", _, Some(s)) => {
                let n = numel(&s);
                match self.c.below(6) {
                    0 => vec![n],
                    1 => vec![-1],
                    2 => s.iter().rev().copied().collect(),
                    3 if n % 2 == 0 && n > 0 => vec![2, -1],
                    4 => {
                        let mut v = s.clone();
                        v.push(1);
                        v
                    }
                    _ => vec![1, n],
                }
            }
            ("expand", _, Some(s)) => {
                let mut v: Vec<i64> = (0..self.c.below(2)).map(|_| self.dim1()).collect();
                for &d in &s {
                    v.push(match (d, self.c.below(3)) {
                        (1, 0) => self.dim1(),
                        (_, 1) => -1,
                        _ => d,
                    });
                }
                v
            }
            ("unflatten", _, Some(_)) => {
                let size = ctx.dim_size().unwrap_or(1);
                match self.c.below(3) {
                    0 if size % 2 == 0 => vec![2, size / 2],
                    1 => vec![size, 1],
                    _ => vec![-1],
                }
            }
            ("permute", _, Some(s)) => {
                let mut v: Vec<i64> = (0..s.len() as i64).collect();
                for i in (1..v.len()).rev() {
                    let j = self.c.below(i + 1);
                    v.swap(i, j);
                }
                v
            }
            ("repeat", _, Some(s)) => {
                let n = s.len() + self.c.below(2);
                self.smalls(n, 1, 3)
            }
            ("split" | "split_with_sizes", _, Some(_)) => {
                let mut left = ctx.dim_size().unwrap_or(1);
                let mut v = Vec::new();
                while left > 0 {
                    let part = self.c.range(1, left);
                    v.push(part);
                    left -= part;
                }
                v
            }
            ("layer_norm" | "native_layer_norm", _, Some(s)) => {
                let k = self.c.below(s.len().min(3) + 1);
                s[s.len() - k..].to_vec()
            }
            ("constant_pad_nd", _, _) => {
                let n = 2 * self.c.range(0, rank.min(3) as i64) as usize;
                self.smalls(n, -1, 2)
            }
            ("as_strided", "size", _) => {
                let n = self.c.below(4);
                self.smalls(n, 0, 3)
            }
            ("as_strided", "stride", _) => {
                let n = self.c.below(4);
                self.smalls(n, -1, 3)
            }
            (_, "dims" | "dim", Some(s)) => {
                let n = self.c.below(s.len() + 1);
                (0..n).map(|i| if self.c.chance(64) { i as i64 - s.len() as i64 } else { i as i64 }).collect()
            }
            (_, "kernel_size", _) => self.smalls(fixed.unwrap_or(2), 1, 3),
            (_, "stride", _) => match self.c.below(3) {
                0 => vec![],
                _ => self.smalls(fixed.unwrap_or(2), 1, 2),
            },
            (_, "padding" | "output_padding", _) => self.smalls(fixed.unwrap_or(2), 0, 1),
            (_, "dilation", _) => self.smalls(fixed.unwrap_or(2), 1, 2),
            (_, "output_size", _) => self.smalls(fixed.unwrap_or(2), 1, 4),
            _ => {
                let n = fixed.unwrap_or_else(|| self.c.below(5));
                (0..n).map(|_| self.dim()).collect()
            }
        }
    }

    fn smalls(&mut self, n: usize, low: i64, high: i64) -> Vec<i64> {
        (0..n).map(|_| self.c.range(low, high)).collect()
    }

    fn list_arg(&mut self, op: &str, name: &str, inner: &Type, ctx: &mut Ctx) -> Option<Arg> {
        match inner {
            Type::Int | Type::SymInt => {
                if !self.int_lists.is_empty() && self.c.chance(16) {
                    return Some(Arg::Value(self.int_lists[self.c.below(self.int_lists.len())]));
                }
                let mut v: Vec<Arg> = if self.wild() {
                    (0..self.c.below(7)).map(|_| Arg::Int(self.hostile_int())).collect()
                } else {
                    self.sizes(op, name, ctx).into_iter().map(Arg::Int).collect()
                };
                if !self.ints.is_empty() && !v.is_empty() && self.c.chance(24) {
                    let at = self.c.below(v.len());
                    v[at] = Arg::Value(self.ints[self.c.below(self.ints.len())]);
                }
                Some(Arg::List(v))
            }
            Type::Float => {
                let n = if self.wild() { self.c.below(4) } else { 2 };
                Some(Arg::List((0..n).map(|_| Arg::Float(self.c.pick(&["2.0", "1.5", "0.5", "1.0"]).into())).collect()))
            }
            Type::Bool => Some(Arg::List((0..self.c.below(4)).map(|_| Arg::Bool(self.c.chance(128))).collect())),
            Type::Tensor => {
                if !self.tensor_lists.is_empty() && self.c.chance(48) {
                    return Some(Arg::Value(self.tensor_lists[self.c.below(self.tensor_lists.len())]));
                }
                let n = if self.wild() { self.c.below(4) } else { 1 + self.c.below(3) };
                let mut items = Vec::new();
                for _ in 0..n {
                    let Some(Arg::Value(id)) = self.tensor_arg(name, ctx) else {
                        continue;
                    };
                    items.push(Arg::Value(id));
                }
                Some(Arg::List(items))
            }
            Type::Optional(t) if **t == Type::Tensor => {
                let first = ctx.first.clone();
                Some(self.index_list(first.as_ref()))
            }
            _ => Some(Arg::List(vec![])),
        }
    }

    /// Indices for `aten::index` and `index_put`: masks, integer indices and Nones mixed.
    fn index_list(&mut self, source: Option<&Tv>) -> Arg {
        let shape = source.and_then(|s| s.shape.clone()).unwrap_or_else(|| vec![3, 3]);
        let mut items = Vec::new();
        let mut dim = 0usize;
        let len = if self.wild() { self.c.below(shape.len() + 2) } else { 1 + self.c.below(shape.len().max(1)) };
        let rows = self.dim1();
        for _ in 0..len {
            let left = shape.len().saturating_sub(dim);
            let item = match self.c.below(4) {
                3 => {
                    dim += 1;
                    Some(Arg::None)
                }
                2 if left > 0 => {
                    let k = 1 + self.c.below(left.min(2));
                    let mut mask = shape[dim..dim + k].to_vec();
                    if self.wild() {
                        mask[0] += 1;
                    }
                    dim += k;
                    let dtype = self.c.pick(&["bool", "bool", "uint8"]);
                    self.tensor_for(&spec(dtype, mask)).map(|t| Arg::Value(t.id))
                }
                _ => {
                    let bound = shape.get(dim).copied().unwrap_or(1);
                    dim += 1;
                    let index_shape = if self.c.chance(64) { vec![rows, 1] } else { vec![rows] };
                    self.tensor_for(&index_spec(index_shape, bound)).map(|t| Arg::Value(t.id))
                }
            };
            if let Some(item) = item {
                items.push(item);
            }
        }
        Arg::List(items)
    }

    fn typed(&mut self, op: &str, name: &str, ty: &Type, ctx: &mut Ctx) -> Option<Arg> {
        Some(match ty {
            Type::Tensor => return self.tensor_arg(name, ctx),
            Type::Int | Type::SymInt => self.int_arg(name, ctx),
            Type::Float => self.float_arg(name),
            Type::Bool => self.bool_arg(name),
            Type::Scalar => {
                if !self.ints.is_empty() && self.c.chance(16) {
                    Arg::Value(self.ints[self.c.below(self.ints.len())])
                } else {
                    self.number()
                }
            }
            Type::ScalarType => Arg::Dtype(DTYPES[self.c.below(DTYPES.len())].0.into()),
            Type::Layout => Arg::Layout("strided".into()),
            Type::Device => Arg::Device("node".into()),
            Type::MemoryFormat => Arg::MemoryFormat(self.c.pick(MEMORY_FORMATS).into()),
            Type::Str => Arg::Str(self.string_arg(name)),
            Type::List(inner) => return self.list_arg(op, name, inner, ctx),
            Type::Optional(inner) => return self.typed(op, name, inner, ctx),
            Type::Other(_) => Arg::None,
        })
    }

    fn arg(&mut self, op: &str, a: &Argument, ctx: &mut Ctx) -> Option<Arg> {
        match &a.ty {
            Type::Optional(_) if self.c.chance(80) => Some(Arg::None),
            ty => self.typed(op, &a.name, ty, ctx),
        }
    }

    /// A value an argument under `rule` may take (or, wild, one it may not, or one the run
    /// computes).
    fn ruled(&mut self, rule: &ValueRule, ty: &Type) -> Arg {
        let list = matches!(ty.required(), Type::List(_));
        let base = match ty.required() {
            Type::List(inner) => inner.required().clone(),
            other => other.clone(),
        };
        let ints = matches!(base, Type::Int | Type::SymInt);
        let one = match rule {
            ValueRule::OneOf(values) if !self.wild() => Arg::Int(self.c.pick(values)),
            // Sizes under a rule (`col2im`'s): ints in it.
            ValueRule::Within { low, high } if ints && !self.wild() => {
                Arg::Int([*low as i64, 1, 2, *high as i64][self.c.below(4)])
            }
            ValueRule::Within { low, high } if !self.wild() => {
                let f = [*low, *high, 1.0, 2.0, 0.5, 1.5][self.c.below(6)];
                Arg::Float(float_text(f))
            }
            _ if !self.ints.is_empty() && self.c.chance(128) => Arg::Value(self.ints[self.c.below(self.ints.len())]),
            ValueRule::Within { .. } if !ints => Arg::Float(self.c.pick(FLOATS).into()),
            _ => Arg::Int(self.hostile_int()),
        };
        match (list, ty.required(), one) {
            (true, _, one) => Arg::List(vec![one.clone(), one]),
            // A bool under a rule (`training`): as a bool, true for 1.
            (false, Type::Bool, Arg::Int(i)) => Arg::Bool(i == 1),
            (false, _, one) => one,
        }
    }

    /// A size the run computes: `native::size` of a tensor, or arithmetic on such sizes and
    /// constants (hostile ones too), or a comparison of them.
    fn native(&mut self) {
        let int = |g: &mut Self| {
            if !g.ints.is_empty() && g.c.chance(160) {
                Arg::Value(g.ints[g.c.below(g.ints.len())])
            } else if g.c.chance(64) {
                Arg::Int(g.hostile_int())
            } else {
                Arg::Int(g.small_int())
            }
        };
        match self.c.below(4) {
            0 | 1 => {
                let Some(t) = self.any_tensor() else { return };
                let dim = if self.wild() { self.hostile_int() } else { self.c.range(-2, 2) };
                let [out] = self.node("native::size", "", vec![Arg::Value(t.id), Arg::Int(dim)], 1)[..] else { return };
                self.ints.push(out);
            }
            2 => {
                let op = self.c.pick(NATIVE_INT_OPS);
                let (a, b) = (int(self), int(self));
                let args = if self.c.chance(16) { vec![a] } else { vec![a, b] };
                let op = if args.len() == 1 { "neg" } else { op };
                let [out] = self.node(&format!("native::{op}"), "", args, 1)[..] else { return };
                self.ints.push(out);
            }
            _ => {
                let op = self.c.pick(NATIVE_COMPARISONS);
                let (a, b) = (int(self), int(self));
                let [out] = self.node(&format!("native::{op}"), "", vec![a, b], 1)[..] else { return };
                self.bools.push(out);
            }
        }
    }

    /// One operator of the allowlist, its arguments written per its schema (and recipe).
    fn operator(&mut self) -> Option<Vec<u32>> {
        let ops = operators();
        let mut name = ops[self.c.below(ops.len())];
        if let Some(only) = only_operator() {
            name = only;
        }
        let schema: &Schema = allowlist().get(name)?;
        let recipe = if self.c.chance(32) { Vec::new() } else { self.recipe(name) };
        let mut ctx = Ctx::default();
        let mut args: Vec<Option<Arg>> = vec![None; schema.arguments.len()];
        for (slot, a) in schema.arguments.iter().enumerate() {
            if matches!(a.ty.required(), Type::Other(t) if t == "Generator") {
                self.random = true;
                continue;
            }
            if let Some((_, fixed)) = recipe.iter().find(|(n, _)| *n == a.name)
                && fits(fixed, &a.ty)
                && !self.wild()
            {
                args[slot] = Some(self.realize(fixed, &mut ctx)?);
                continue;
            }
            if a.has_default && self.c.chance(96) {
                continue;
            }
            args[slot] = Some(self.arg(name, a, &mut ctx)?);
        }
        for (slot, rule) in allowlist().rules(name) {
            // Mostly what the recipe or the arguments' own choices wrote, where the rule admits it.
            let admitted = args[*slot].as_ref().is_some_and(|given| rule.check(given).is_ok());
            if let Some(a) = schema.arguments.get(*slot)
                && (!matches!(args[*slot], None | Some(Arg::None)) || !a.has_default)
                && (!admitted || self.wild())
            {
                args[*slot] = Some(self.ruled(rule, &a.ty));
            }
        }
        let (op, overload) = name.split_once('.').unwrap_or((name, ""));
        let outputs: Vec<u32> = (0..schema.returns.len()).map(|_| self.fresh()).collect();
        // Positional up to the first argument left out (or keyword-only), by keyword after it;
        // sometimes all by keyword.
        let mut node =
            Node { op: op.into(), overload: overload.into(), args: vec![], kwargs: BTreeMap::new(), outputs };
        let mut positional = !self.c.chance(16);
        for (a, given) in schema.arguments.iter().zip(args) {
            match given {
                None => positional = false,
                Some(arg) if positional && !a.kwarg_only => node.args.push(arg),
                Some(arg) => {
                    positional = false;
                    node.kwargs.insert(a.name.clone(), arg);
                }
            }
        }
        let outputs = node.outputs.clone();
        self.nodes.push(node);
        let base = base_name(name);
        for (ret, &id) in schema.returns.iter().zip(&outputs) {
            match ret.ty.required() {
                Type::Tensor => {
                    let known = SAME_SHAPE.contains(&base) && outputs.len() == 1;
                    let first = ctx.first.as_ref();
                    let shape = first.and_then(|f| f.shape.clone()).filter(|_| known);
                    let dtype = first.and_then(|f| f.dtype).filter(|_| known && SAME_DTYPE.contains(&base));
                    self.tensors.push(Tv { id, dtype, shape });
                }
                Type::Int | Type::SymInt => self.ints.push(id),
                Type::Bool => self.bools.push(id),
                Type::List(t) if **t == Type::Tensor => self.tensor_lists.push(id),
                Type::List(_) => self.int_lists.push(id),
                _ => {}
            }
        }
        Some(outputs)
    }

    fn generate(mut self) -> Option<Case> {
        let inputs = 1 + self.c.below(3);
        for _ in 0..inputs {
            self.random_input();
        }
        if self.c.chance(48) {
            self.weight();
        }
        let count = 1 + self.c.below(6);
        let mut last = Vec::new();
        for n in 0..count {
            // Past the input's end every choice is the first: the first operator, again and
            // again. One operator at least, then no more.
            if self.nodes.len() >= MAX_NODES || (n > 0 && self.c.at >= self.c.data.len()) {
                break;
            }
            if self.c.chance(40) {
                self.native();
            }
            last = self.operator()?;
            // An item of a list an operator gave.
            if !self.tensor_lists.is_empty() && self.c.chance(96) {
                let list = self.tensor_lists[self.c.below(self.tensor_lists.len())];
                let at = if self.wild() { self.hostile_int() } else { self.c.range(-1, 2) };
                let [item] = self.node("native::getitem", "", vec![Arg::Value(list), Arg::Int(at)], 1)[..] else {
                    return None;
                };
                self.tensors.push(Tv { id: item, dtype: None, shape: None });
            }
        }
        let mut outputs: Vec<Arg> = last.into_iter().map(Arg::Value).collect();
        if self.c.chance(48)
            && let Some(t) = self.tensors.last()
        {
            outputs.push(Arg::Value(t.id));
        }
        let program = Program {
            format: FORMAT,
            inputs: self.inputs,
            weights: self.weights,
            nodes: self.nodes,
            outputs,
            state: vec![],
            entries: vec![],
        };
        debug_assert!(program.weights.iter().all(|w| w.offset % WEIGHT_ALIGN == 0));
        Some(Case { program, weights: self.weight_bytes, inputs: self.input_tensors, random: self.random })
    }
}

// Recipes: per operator, tensors shaped for it and the arguments that go with them.
impl Gen<'_> {
    fn image(&mut self, spatial: usize) -> Vec<i64> {
        let mut s = vec![self.dim1(), self.dim1()];
        if spatial > 0 && self.c.chance(32) {
            s.remove(0);
        }
        for _ in 0..spatial {
            s.push(2 + self.c.below(5) as i64);
        }
        s
    }

    fn recipe(&mut self, name: &str) -> Vec<(&'static str, Fixed)> {
        use Fixed::*;
        let f = self.float_dtype();
        let (m, k, n, b) = (self.dim1(), self.dim1(), self.dim1(), self.dim1());
        let t = |shape: Vec<i64>| T(spec(f, shape));
        match base_name(name) {
            "mm" => vec![("self", t(vec![m, k])), ("mat2", t(vec![k, n]))],
            "bmm" => vec![("self", t(vec![b, m, k])), ("mat2", t(vec![b, k, n]))],
            "addmm" => vec![
                ("self", t(if self.c.chance(128) { vec![m, n] } else { vec![n] })),
                ("mat1", t(vec![m, k])),
                ("mat2", t(vec![k, n])),
            ],
            "baddbmm" => {
                vec![("self", t(vec![b, m, n])), ("batch1", t(vec![b, m, k])), ("batch2", t(vec![b, k, n]))]
            }
            "matmul" => {
                let (l, r) = match self.c.below(5) {
                    0 => (vec![k], vec![k]),
                    1 => (vec![m, k], vec![k, n]),
                    2 => (vec![b, m, k], vec![k, n]),
                    3 => (vec![k], vec![b, k, n]),
                    _ => (vec![2, b, m, k], vec![b, k, n]),
                };
                vec![("self", t(l)), ("other", t(r))]
            }
            "linear" => {
                let mut x: Vec<i64> = (0..self.c.below(3)).map(|_| self.dim1()).collect();
                x.push(k);
                vec![
                    ("input", t(x)),
                    ("weight", t(vec![n, k])),
                    ("bias", if self.c.chance(128) { t(vec![n]) } else { None }),
                ]
            }
            "conv2d" | "convolution" => {
                let spatial = if name == "aten::convolution" && self.c.chance(64) { 1 } else { 2 };
                let mut x = self.image(spatial);
                if x.len() == spatial + 1 {
                    x.insert(0, 1);
                }
                let groups = if self.c.chance(48) { x[1].max(1) } else { 1 };
                let c = x[1];
                let out = groups * self.dim1();
                let kernel: Vec<i64> = x[2..].iter().map(|&s| self.c.range(1, s.min(3))).collect();
                let transposed = name == "aten::convolution" && self.c.chance(64);
                let mut w = if transposed { vec![c, out / groups] } else { vec![out, c / groups] };
                w.extend(&kernel);
                let stride: Vec<i64> = (0..spatial).map(|_| self.c.range(1, 2)).collect();
                let mut v = vec![
                    ("input", t(x)),
                    ("weight", t(w)),
                    ("bias", if self.c.chance(128) { t(vec![out]) } else { None }),
                    ("stride", Ints(stride)),
                    ("dilation", Ints(vec![1; spatial])),
                    ("groups", Int(groups)),
                ];
                if name == "aten::conv2d.padding" {
                    v.push(("padding", Str(self.c.pick(&["valid", "same"]))));
                    v[3] = ("stride", Ints(vec![1; spatial]));
                } else {
                    v.push(("padding", Ints((0..spatial).map(|_| self.c.range(0, 1)).collect())));
                }
                if name == "aten::convolution" {
                    v.push(("transposed", Bool(transposed)));
                    v.push(("output_padding", Ints(vec![0; spatial])));
                }
                v
            }
            "_adaptive_avg_pool2d" | "adaptive_avg_pool2d" => {
                vec![("self", t(self.image(2))), ("output_size", Ints(vec![self.dim1(), self.dim1()]))]
            }
            "_adaptive_avg_pool3d" => {
                vec![("self", t(self.image(3))), ("output_size", Ints(vec![self.dim1(), self.dim1(), self.dim1()]))]
            }
            "avg_pool2d" | "max_pool2d" | "max_pool2d_with_indices" | "avg_pool3d" | "max_pool3d_with_indices" => {
                let spatial = if name.contains("3d") { 3 } else { 2 };
                let x = self.image(spatial);
                let kernel: Vec<i64> = x[x.len() - spatial..].iter().map(|&s| self.c.range(1, s.min(3))).collect();
                let padding: Vec<i64> = kernel.iter().map(|&k| self.c.range(0, k / 2)).collect();
                let stride =
                    if self.c.chance(96) { vec![] } else { (0..spatial).map(|_| self.c.range(1, 2)).collect() };
                vec![
                    ("self", t(x)),
                    ("kernel_size", Ints(kernel)),
                    ("stride", Ints(stride)),
                    ("padding", Ints(padding)),
                    ("dilation", Ints(vec![1; spatial])),
                    ("ceil_mode", Bool(self.c.chance(64))),
                ]
            }
            "reflection_pad1d" | "reflection_pad2d" | "reflection_pad3d" | "replication_pad2d"
            | "replication_pad3d" => {
                let spatial = fixed_len(name, "padding").unwrap_or(2) / 2;
                let x = self.image(spatial);
                let mut pad = Vec::new();
                for d in (x.len() - spatial..x.len()).rev() {
                    let most = if name.contains("reflection") { x[d] - 1 } else { 3 };
                    pad.push(self.c.range(0, most));
                    pad.push(self.c.range(0, most));
                }
                vec![("self", t(x)), ("padding", Ints(pad))]
            }
            "upsample_nearest2d" | "upsample_bilinear2d" => {
                let x = self.image(2);
                if name.ends_with(".vec") {
                    match self.c.chance(128) {
                        true => vec![
                            ("input", t(x)),
                            ("output_size", Ints(vec![self.dim1(), self.dim1()])),
                            ("scale_factors", None),
                        ],
                        false => vec![
                            ("input", t(x)),
                            ("output_size", None),
                            ("scale_factors", Floats(vec!["2.0".into(), "1.5".into()])),
                        ],
                    }
                } else {
                    vec![("self", t(x)), ("output_size", Ints(vec![self.dim1(), self.dim1()]))]
                }
            }
            "grid_sampler_2d" => {
                let x = self.image(2);
                let grid = [x[0], self.dim1(), self.dim1(), 2];
                let x = if x.len() == 3 { vec![1, x[0], x[1], x[2]] } else { x };
                vec![("input", t(x.clone())), ("grid", t(vec![x[0], grid[1], grid[2], 2]))]
            }
            "col2im" => {
                let (kh, kw) = (self.c.range(1, 2), self.c.range(1, 2));
                let (h, w) = (kh + self.c.range(0, 3), kw + self.c.range(0, 3));
                let blocks = (h - kh + 1) * (w - kw + 1);
                vec![
                    ("self", t(vec![self.dim1(), self.dim1() * kh * kw, blocks])),
                    ("output_size", Ints(vec![h, w])),
                    ("kernel_size", Ints(vec![kh, kw])),
                    ("dilation", Ints(vec![1, 1])),
                    ("padding", Ints(vec![0, 0])),
                    ("stride", Ints(vec![1, 1])),
                ]
            }
            "layer_norm" | "native_layer_norm" => {
                let x = self.shape_between(1, 3);
                let normalized = x[x.len() - 1..].to_vec();
                vec![
                    ("input", t(x)),
                    ("normalized_shape", Ints(normalized.clone())),
                    ("weight", t(normalized.clone())),
                    ("bias", t(normalized)),
                    ("eps", Float("1e-05".into())),
                ]
            }
            "batch_norm" | "_native_batch_norm_legit" | "_native_batch_norm_legit_no_training" => {
                let spatial = self.c.below(3);
                let x = self.image(spatial);
                let c = x[1];
                let stats = TSpec { values: Values::NonNegative, ..spec(f, vec![c]) };
                vec![
                    ("input", t(x)),
                    ("weight", t(vec![c])),
                    ("bias", t(vec![c])),
                    ("running_mean", t(vec![c])),
                    ("running_var", T(stats)),
                    ("momentum", Float("0.1".into())),
                    ("eps", Float("1e-05".into())),
                ]
            }
            "native_group_norm" => {
                let mut x = self.image(2);
                if x.len() == 3 {
                    x.insert(0, 1);
                }
                let group = if x[1] % 2 == 0 && self.c.chance(128) { 2 } else { 1 };
                vec![
                    ("input", t(x.clone())),
                    ("weight", t(vec![x[1]])),
                    ("bias", t(vec![x[1]])),
                    ("N", Int(x[0])),
                    ("C", Int(x[1])),
                    ("HxW", Int(x[2] * x[3])),
                    ("group", Int(group)),
                    ("eps", Float("1e-05".into())),
                ]
            }
            "embedding" => {
                let v = self.dim1() + 2;
                let indices = self.shape_between(1, 2);
                vec![("weight", t(vec![v, k])), ("indices", T(index_spec(indices, v)))]
            }
            "_embedding_bag" => {
                let v = self.dim1() + 2;
                let count = self.dim();
                let bags = self.dim1();
                let mode = self.c.range(0, 2);
                vec![
                    ("weight", t(vec![v, k])),
                    ("indices", T(index_spec(vec![count], v))),
                    ("offsets", T(TSpec { values: Values::Offsets(count), ..spec("int64", vec![bags]) })),
                    ("mode", Int(mode)),
                    ("per_sample_weights", if mode == 0 && self.c.chance(96) { t(vec![count]) } else { None }),
                    ("include_last_offset", Bool(self.c.chance(64))),
                ]
            }
            "scaled_dot_product_attention" => {
                let (h, l, s, e) = (self.dim1(), self.dim1(), self.dim1(), self.dim1());
                let mask = match self.c.below(3) {
                    0 => None,
                    1 => T(spec("bool", vec![l, s])),
                    _ => t(vec![l, s]),
                };
                vec![
                    ("query", t(vec![b, h, l, e])),
                    ("key", t(vec![b, h, s, e])),
                    ("value", t(vec![b, h, s, self.dim1()])),
                    ("attn_mask", mask),
                    ("dropout_p", Float("0.0".into())),
                ]
            }
            "_cdist_forward" => vec![
                ("x1", t(vec![m, k])),
                ("x2", t(vec![n, k])),
                ("p", Float(self.c.pick(&["2.0", "1.0", "0.0", "inf", "1.5"]).into())),
            ],
            "_pdist_forward" => {
                vec![("self", t(vec![m + 1, k])), ("p", Float(self.c.pick(&["2.0", "1.0", "0.0", "inf"]).into()))]
            }
            "_fft_r2c" => {
                let x = self.shape_between(1, 2);
                let last = x.len() as i64 - 1;
                vec![("self", T(spec("float32", x))), ("dim", Ints(vec![last]))]
            }
            "_fft_c2r" => {
                let mut s = self.shape_between(1, 2);
                if let Some(l) = s.last_mut() {
                    *l = (*l).max(2);
                }
                let last = s.last().copied().unwrap_or(2);
                let last_dim = s.len() as i64 - 1;
                vec![
                    ("self", T(TSpec { complex: true, ..spec("float32", s) })),
                    ("dim", Ints(vec![last_dim])),
                    ("last_dim_size", Int(2 * (last - 1))),
                ]
            }
            "gather" | "scatter" | "scatter_add" | "scatter_reduce" => {
                let x = self.shape_between(1, 3);
                let dim = self.c.range(0, x.len() as i64 - 1);
                let index: Vec<i64> = x.iter().map(|&s| self.c.range(0, s)).collect();
                let bound = x[dim as usize];
                let reduce = if base_name(name) == "scatter_reduce" {
                    self.c.pick(&["sum", "prod", "mean", "amax", "amin"])
                } else {
                    self.c.pick(&["add", "multiply"])
                };
                vec![
                    ("self", t(x.clone())),
                    ("dim", Int(dim)),
                    ("index", T(index_spec(index, bound))),
                    ("src", t(x)),
                    ("reduce", Str(reduce)),
                ]
            }
            "index_select" | "index_copy" | "index_copy_" => {
                let x = self.shape_between(1, 3);
                let dim = self.c.range(0, x.len() as i64 - 1);
                let count = self.c.range(0, x[dim as usize]);
                let mut source = x.clone();
                source[dim as usize] = count;
                vec![
                    ("self", T(TSpec { own: name.ends_with('_'), ..spec(f, x.clone()) })),
                    ("dim", Int(dim)),
                    ("index", T(index_spec(vec![count], x[dim as usize]))),
                    ("source", t(source)),
                ]
            }
            "index" | "index_put" => {
                // The generic `Tensor?[] indices` mixes masks and integer indices over `self`.
                let x = self.shape_between(1, 3);
                let mut v = vec![("self", t(x.clone())), ("values", t(vec![]))];
                if name.ends_with("hacked_twin") {
                    let rows = self.dim1();
                    let count = 1 + self.c.below(x.len().min(2));
                    v.push(("indices", TList(x[..count].iter().map(|&s| index_spec(vec![rows], s)).collect())));
                }
                v
            }
            "masked_fill" | "masked_fill_" | "masked_scatter" => {
                let x = self.any_shape();
                let own = name.contains("masked_fill_");
                vec![
                    ("self", T(TSpec { own, ..spec(f, x.clone()) })),
                    ("mask", T(spec("bool", x.clone()))),
                    ("source", t(x)),
                    ("value", t(vec![])),
                ]
            }
            "where" => {
                let x = self.any_shape();
                vec![("condition", T(spec("bool", x.clone()))), ("self", t(x.clone())), ("other", t(x))]
            }
            "cat" | "stack" => {
                let x = self.shape_between(1, 3);
                let n = 1 + self.c.below(3);
                vec![("tensors", TList(vec![spec(f, x); n])), ("dim", Int(0))]
            }
            "eq" | "ne" if name.ends_with("Tensor_list") => {
                let x = self.any_shape();
                vec![("a", TList(vec![spec(f, x.clone())])), ("b", TList(vec![spec(f, x)]))]
            }
            "multinomial" => {
                let probs = TSpec { values: Values::Probabilities, ..spec(f, vec![m, n + 1]) };
                vec![("self", T(probs)), ("num_samples", Int(self.c.range(1, n + 1)))]
            }
            "bernoulli" => {
                let x = self.any_shape();
                let probs = TSpec { values: Values::Probabilities, ..spec(f, x.clone()) };
                vec![("self", T(probs.clone())), ("p", T(probs))]
            }
            "normal" => {
                let x = self.any_shape();
                vec![("mean", t(x.clone())), ("std", T(TSpec { values: Values::NonNegative, ..spec(f, x) }))]
            }
            "copy_" | "zero_" => {
                let x = self.any_shape();
                vec![("self", T(TSpec { own: true, ..spec(f, x.clone()) })), ("src", t(x.clone())), ("other", t(x))]
            }
            "linspace" | "logspace" => {
                vec![("start", t(vec![])), ("end", t(vec![])), ("steps", Int(self.c.range(0, 6)))]
            }
            "select_scatter" | "slice_scatter" => {
                let x = self.shape_between(1, 3);
                let dim = self.c.range(0, x.len() as i64 - 1);
                let size = x[dim as usize];
                let mut src = x.clone();
                if base_name(name) == "select_scatter" {
                    src.remove(dim as usize);
                    vec![
                        ("self", t(x)),
                        ("src", t(src)),
                        ("dim", Int(dim)),
                        ("index", Int(self.c.range(-size, size - 1))),
                    ]
                } else {
                    let start = self.c.range(0, size);
                    let end = self.c.range(start, size);
                    src[dim as usize] = end - start;
                    vec![
                        ("self", t(x)),
                        ("src", t(src)),
                        ("dim", Int(dim)),
                        ("start", Int(start)),
                        ("end", Int(end)),
                        ("step", Int(1)),
                    ]
                }
            }
            "diff" => {
                let x = self.shape_between(1, 3);
                vec![("self", t(x.clone())), ("dim", Int(-1)), ("prepend", t(x.clone())), ("append", t(x))]
            }
            "isin" => vec![("elements", t(self.any_shape())), ("test_elements", t(self.shape(1)))],
            "tril" | "triu" | "t" => vec![("self", t(self.shape_between(2, 3)))],
            "__and__" | "__or__" | "__xor__" | "__lshift__" | "__rshift__" | "bitwise_and" | "bitwise_or"
            | "bitwise_xor" | "bitwise_not" => {
                let x = self.any_shape();
                let d = self.int_dtype();
                vec![("self", T(spec(d, x.clone()))), ("other", T(spec(d, x)))]
            }
            "dropout" => vec![("input", t(self.any_shape())), ("train", Bool(false))],
            "fill" | "fill_" => {
                let x = self.any_shape();
                vec![("self", T(TSpec { own: name.contains("fill_"), ..spec(f, x) })), ("value", t(vec![]))]
            }
            "diagonal" => {
                let x = self.shape_between(2, 3);
                vec![("self", t(x)), ("offset", Int(self.c.range(-1, 1))), ("dim1", Int(0)), ("dim2", Int(1))]
            }
            "as_strided" => {
                let size = self.shape_between(0, 3);
                let stride: Vec<i64> = size.iter().map(|_| self.c.range(0, 2)).collect();
                vec![
                    ("self", t(vec![self.dim1() * 4])),
                    ("size", Ints(size)),
                    ("stride", Ints(stride)),
                    ("storage_offset", Int(self.c.range(0, 1))),
                ]
            }
            "arange" => vec![
                ("start", Int(self.c.range(-2, 2))),
                ("end", Int(self.c.range(3, 9))),
                ("step", Float(self.c.pick(&["1.0", "2.0", "0.5"]).into())),
            ],
            "randint_like" => {
                let x = self.any_shape();
                vec![("self", t(x)), ("high", T(spec("int64", vec![])))]
            }
            // Operators on floating-point tensors: the first a float tensor.
            _ => {
                let x = self.any_shape();
                vec![("self", t(x.clone())), ("input", t(x))]
            }
        }
    }
}

/// An output as bytes, to compare two runs' bit for bit.
#[derive(Debug, PartialEq)]
enum Digest {
    None,
    Tensor { kind: Option<Kind>, sizes: Vec<i64>, bytes: Vec<u8> },
    Int(i64),
    Float(u64),
    Bool(bool),
    List(Vec<Digest>),
}

impl Digest {
    /// The same output, as far as layouts cannot change it: integers and bools of the same
    /// sizes exactly (a float's last bits follow the order a kernel sums in, which follows the
    /// layout; and an auxiliary output's sizes can follow the kernel's path, which follows the
    /// layout too: `_embedding_bag`'s offset2bag is empty on its fast path, for contiguous
    /// weights only).
    fn same_exact_parts(&self, other: &Digest) -> bool {
        match (self, other) {
            (Digest::Tensor { kind: a, sizes: sa, bytes: ba }, Digest::Tensor { kind: b, sizes: sb, bytes: bb }) => {
                let exact =
                    matches!(a, Some(Kind::Uint8 | Kind::Int8 | Kind::Int16 | Kind::Int | Kind::Int64 | Kind::Bool));
                a == b && (sa != sb || !exact || ba == bb)
            }
            (Digest::Float(_), Digest::Float(_)) => true,
            (Digest::List(a), Digest::List(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.same_exact_parts(y))
            }
            (a, b) => a == b,
        }
    }
}

fn digest(v: &RtValue) -> Digest {
    match v {
        RtValue::None => Digest::None,
        RtValue::Int(i) => Digest::Int(*i),
        RtValue::Float(f) => Digest::Float(f.to_bits()),
        RtValue::Bool(b) => Digest::Bool(*b),
        RtValue::List(items) => Digest::List(items.iter().map(digest).collect()),
        RtValue::Tensor(t) => Digest::Tensor { kind: t.f_kind().ok(), sizes: t.size(), bytes: bytes_of(t) },
    }
}

/// A tensor's number of elements. tch multiplies its sizes, which overflows for an empty tensor
/// whose other sizes are huge (`new_zeros([2^62, 2, 0])`); libtorch refuses any other tensor
/// whose elements overflow.
fn elements(t: &Tensor) -> usize {
    let sizes = t.size();
    if sizes.contains(&0) { 0 } else { sizes.iter().fold(1usize, |n, &d| n.saturating_mul(d as usize)) }
}

/// A tensor's elements, in order, as bytes (empty where they cannot be read).
fn bytes_of(t: &Tensor) -> Vec<u8> {
    let (Ok(kind), Ok(t)) = (t.f_kind(), t.f_contiguous()) else { return Vec::new() };
    let n = elements(&t);
    let mut out = vec![0u8; n * kind.elt_size_in_bytes()];
    if t.f_copy_data_u8(&mut out, n).is_err() {
        out.clear();
    }
    out
}

/// How one operator fared, over the campaign.
#[derive(Debug, Default, Clone, Copy)]
struct OpStats {
    /// Ran, and gave its outputs.
    ok: u64,
    /// Failed at run time with a typed error (its own or a check before it).
    failed: u64,
    /// The graph was refused for this node.
    refused: u64,
}

#[derive(Debug, Default)]
struct Stats {
    executions: u64,
    generated: u64,
    refused: u64,
    plans_failed: u64,
    plans_over_bounds: u64,
    plans_stopped: u64,
    plans_on_real_memory: u64,
    runs_ok: u64,
    runs_failed: u64,
    allocations_refused: u64,
    compared: u64,
    compared_layouts: u64,
    operators: BTreeMap<String, OpStats>,
}

static STATS: Mutex<Option<Stats>> = Mutex::new(None);

fn stats<T>(f: impl FnOnce(&mut Stats) -> T) -> T {
    let mut guard = STATS.lock().unwrap_or_else(|e| e.into_inner());
    f(guard.get_or_insert_with(Stats::default))
}

fn write_stats(s: &Stats) {
    let Some(path) = std::env::var_os("DJINN_FUZZ_STATS") else { return };
    let list = allowlist();
    let ran = |min: u64| list.names().filter(|n| s.operators.get(*n).is_some_and(|o| o.ok >= min)).count();
    let never: Vec<&str> = {
        let mut v: Vec<&str> = list.names().filter(|n| s.operators.get(*n).is_none_or(|o| o.ok == 0)).collect();
        v.sort_unstable();
        v
    };
    let operators: serde_json::Map<String, serde_json::Value> = s
        .operators
        .iter()
        .filter(|(name, _)| counted(name))
        .map(|(name, o)| (name.clone(), serde_json::json!({"ok": o.ok, "failed": o.failed, "refused": o.refused})))
        .collect();
    let json = serde_json::json!({
        "executions": s.executions,
        "programs": s.generated,
        "refused": s.refused,
        "plans_failed": s.plans_failed,
        "plans_over_bounds": s.plans_over_bounds,
        "plans_stopped": s.plans_stopped,
        "plans_on_real_memory": s.plans_on_real_memory,
        "runs_ok": s.runs_ok,
        "runs_failed": s.runs_failed,
        "allocations_refused": s.allocations_refused,
        "compared": s.compared,
        "compared_layouts": s.compared_layouts,
        "allowlist": list.len(),
        "operators_ran_1": ran(1),
        "operators_ran_100": ran(100),
        "never_ran": never,
        "operators": operators,
    });
    let tmp = std::path::PathBuf::from(format!("{}.tmp", path.to_string_lossy()));
    if std::fs::write(&tmp, serde_json::to_vec_pretty(&json).unwrap_or_default()).is_ok() {
        let _ = std::fs::rename(&tmp, &path);
    }
}

/// Whether the stats count `name` (a written-out case can name any operator).
fn counted(name: &str) -> bool {
    name.starts_with("native::") || allowlist().get(name).is_some()
}

fn qualified(node: &Node) -> String {
    if node.overload.is_empty() { node.op.clone() } else { format!("{}.{}", node.op, node.overload) }
}

/// The node a run's error names (its operator's qualified name comes first), if any.
fn failing_node(nodes: &[Node], message: &str) -> Option<usize> {
    let (name, _) = message.split_once(": ")?;
    nodes.iter().position(|n| qualified(n) == name)
}

/// A budget without quotas: accounts are bounded per run only.
fn budget() -> &'static MemoryBudget {
    static BUDGET: OnceLock<MemoryBudget> = OnceLock::new();
    BUDGET.get_or_init(|| MemoryBudget::new(1 << 40))
}

/// One run under an account bounded as the node bounds a run, every allocation filled with
/// `fill`: its outputs' digests, or its error and whether the allocator refused it.
fn run_once(graph: &GraphModule, inputs: &[Tensor], fill: u8) -> Result<Vec<Digest>, (String, bool)> {
    let memory = JobMemory::open(TenantId(1), budget(), LIMIT);
    fill_allocations(Some(fill));
    let result = memory.charging(|| {
        memory.begin_run();
        graph.run(inputs.iter().map(Tensor::shallow_clone).collect())
    });
    fill_allocations(None);
    match result {
        Ok(values) => Ok(values.iter().map(digest).collect()),
        Err(e) => Err((e.to_string(), memory.refusal().is_some())),
    }
}

/// A number of a written-out case: a JSON number, or "NaN", "inf", "-inf".
fn number_of(v: &serde_json::Value) -> Option<f64> {
    match v {
        serde_json::Value::String(s) => s.parse().ok(),
        v => v.as_f64(),
    }
}

/// A tensor of `dtype` and `shape` holding `values` (repeated; zeros for none), laid out as
/// `layout` says.
fn literal_tensor(dtype: &str, shape: &[i64], values: &[serde_json::Value], layout: &str) -> Option<Tensor> {
    let kind = kind_of(dtype);
    let mut made = shape.to_vec();
    match layout {
        "transposed" if made.len() >= 2 => {
            let n = made.len();
            made.swap(n - 2, n - 1);
        }
        "expanded" if !made.is_empty() => made[0] = 1,
        "strided" if !made.is_empty() => made[0] *= 2,
        _ => {}
    }
    let n = usize::try_from(numel(&made)).ok()?;
    let t = if matches!(kind, Kind::Half | Kind::Float | Kind::Double | Kind::BFloat16) {
        let v: Vec<f64> =
            (0..n).map(|i| values.get(i % values.len().max(1)).and_then(number_of).unwrap_or(0.0)).collect();
        Tensor::f_from_slice(&v).ok()?
    } else {
        let v: Vec<i64> = (0..n)
            .map(|i| {
                values
                    .get(i % values.len().max(1))
                    .and_then(|v| v.as_i64().or_else(|| number_of(v).map(|f| f as i64)))
                    .unwrap_or(0)
            })
            .collect();
        Tensor::f_from_slice(&v).ok()?
    };
    let t = t.f_to_kind(kind).ok()?.f_reshape(made.as_slice()).ok()?;
    match layout {
        "transposed" if made.len() >= 2 => t.f_transpose(-2, -1).ok(),
        "expanded" if !made.is_empty() => t.f_expand(shape, false).ok(),
        "strided" if !made.is_empty() => t.f_slice(0, 0, made[0], 2).ok(),
        _ => Some(t),
    }
}

/// A case written out as JSON (see the module's documentation).
fn literal(data: &[u8]) -> Option<Case> {
    let doc: serde_json::Value = serde_json::from_slice(data).ok()?;
    let program: Program = serde_json::from_value(doc.get("program")?.clone()).ok()?;
    let none = Vec::new();
    let values = |v: Option<&serde_json::Value>| -> (Vec<serde_json::Value>, String) {
        match v {
            Some(serde_json::Value::Array(items)) => (items.clone(), String::new()),
            Some(serde_json::Value::Object(o)) => (
                o.get("values").and_then(|v| v.as_array()).cloned().unwrap_or_default(),
                o.get("layout").and_then(|l| l.as_str()).unwrap_or("").to_owned(),
            ),
            _ => (Vec::new(), String::new()),
        }
    };
    let given = doc.get("inputs").and_then(|v| v.as_array()).unwrap_or(&none);
    let mut inputs = Vec::new();
    for (i, input) in program.inputs.iter().enumerate() {
        let shape: Vec<i64> = input.dims.iter().map(|d| d.min).collect();
        let (v, layout) = values(given.get(i));
        inputs.push(literal_tensor(&input.dtype, &shape, &v, &layout)?);
    }
    let given = doc.get("weights").and_then(|v| v.as_array()).unwrap_or(&none);
    let mut weights = Vec::new();
    for (i, w) in program.weights.iter().enumerate() {
        let (v, _) = values(given.get(i));
        let t = literal_tensor(&w.dtype, &w.shape, &v, "")?;
        let mut bytes = vec![0u8; elements(&t) * kind_of(&w.dtype).elt_size_in_bytes()];
        t.f_copy_data_u8(&mut bytes, elements(&t)).ok()?;
        weights.push(bytes);
    }
    let random = program.nodes.iter().any(|n| {
        allowlist()
            .get(&qualified(n))
            .is_some_and(|s| s.arguments.iter().any(|a| matches!(a.ty.required(), Type::Other(t) if t == "Generator")))
    });
    Some(Case { program, weights, inputs, random })
}

pub fn run(data: &[u8]) {
    static SETUP: Once = Once::new();
    // The node runs one thread per operation.
    SETUP.call_once(|| tch::set_num_threads(1));
    let case = if data.first() == Some(&b'{') { literal(data) } else { Gen::new(data).generate() };
    let Some(case) = case else { return };
    let Case { program, weights, inputs, random } = case;
    let slices: Vec<&[u8]> = weights.iter().map(Vec::as_slice).collect();
    let Ok(bytes) = djinn_graph::encode(&program, &slices) else { return };
    let names: Vec<String> = program.nodes.iter().map(qualified).collect();
    if std::env::var_os("DJINN_FUZZ_PRINT").is_some() {
        let shapes: Vec<(Vec<i64>, Vec<i64>)> = inputs.iter().map(|t| (t.size(), t.stride())).collect();
        eprintln!(
            "graph_exec: {}\n  inputs (sizes, strides): {shapes:?}",
            serde_json::to_string(&program).unwrap_or_default()
        );
    }
    let executions = stats(|s| {
        s.executions += 1;
        s.generated += 1;
        s.executions
    });
    if executions % 1000 == 1 {
        stats(|s| write_stats(s));
    }
    let graph = match GraphModule::load(&bytes, Device::Cpu) {
        Ok(graph) => graph,
        Err(e) => {
            let message = e.to_string();
            if std::env::var_os("DJINN_FUZZ_PRINT").is_some() {
                eprintln!("graph_exec: refused: {message}");
            }
            // "... node N (op): why"
            let node = message
                .split_once("node ")
                .and_then(|(_, rest)| rest.split_once(' '))
                .and_then(|(n, _)| n.parse::<usize>().ok());
            stats(|s| {
                s.refused += 1;
                if let Some(name) = node.and_then(|n| names.get(n)) {
                    s.operators.entry(name.clone()).or_default().refused += 1;
                }
            });
            return;
        }
    };
    // The plan under an account too, as a CPU node plans (its worker's account is current), bounded
    // to what a plan over meta tensors needs of real memory: next to nothing. An operator whose
    // tensors are all numbers (wrapped, on the CPU) computes for real in the plan, which a GPU
    // node does not bound: counted (`plans_on_real_memory`), not a finding here (graph/plan.rs).
    let plan_memory = JobMemory::open(TenantId(2), budget(), PLAN_LIMIT);
    let estimate = plan_memory.charging(|| {
        plan_memory.begin_run();
        graph.estimate_run(&inputs)
    });
    if plan_memory.refusal().is_some() {
        stats(|s| s.plans_on_real_memory += 1);
        if std::env::var_os("DJINN_FUZZ_PRINT").is_some() {
            eprintln!("graph_exec: the plan allocated more than {PLAN_LIMIT} bytes of real memory");
        }
    }
    let estimate = match estimate {
        Ok(estimate) => estimate,
        Err(e) => {
            let message = e.to_string();
            assert!(
                !matches!(e, djinn_executor::ExecError::BadInput(_)),
                "graph_exec's own fault: the inputs do not fit the graph it wrote: {message}"
            );
            stats(|s| s.plans_failed += 1);
            return;
        }
    };
    if estimate.peak_bytes > LIMIT || estimate.flops > MAX_FLOPS {
        stats(|s| s.plans_over_bounds += 1);
        return;
    }
    if estimate.stopped_at.is_some() {
        stats(|s| s.plans_stopped += 1);
    }
    let inputs_before: Vec<Vec<u8>> = inputs.iter().map(bytes_of).collect();
    let weights_before: Vec<Vec<u8>> = graph.weights().iter().map(|(_, w)| bytes_of(w)).collect();
    let first = run_once(&graph, &inputs, 0xA5);
    let second = run_once(&graph, &inputs, 0x5A);
    if std::env::var_os("DJINN_FUZZ_PRINT").is_some() {
        match &first {
            Ok(outputs) => eprintln!("graph_exec: ran: {} outputs", outputs.len()),
            Err((message, _)) => eprintln!("graph_exec: failed: {message}"),
        }
    }
    let program_text = || serde_json::to_string(&program).unwrap_or_default();
    for (i, (t, before)) in inputs.iter().zip(&inputs_before).enumerate() {
        assert!(&bytes_of(t) == before, "a run wrote its caller's input {i}: {}", program_text());
    }
    for (i, ((_, w), before)) in graph.weights().iter().zip(&weights_before).enumerate() {
        assert!(&bytes_of(w) == before, "a run wrote the graph's weight {i}: {}", program_text());
    }
    if !random {
        stats(|s| s.compared += 1);
        match (&first, &second) {
            (Ok(a), Ok(b)) => {
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    assert!(
                        x == y,
                        "output {i} differs between a run whose allocations were filled with 0xA5 and one filled \
                         with 0x5A: it holds memory its operators never wrote\n  first:  {x:?}\n  second: {y:?}\n  \
                         program: {}",
                        program_text()
                    );
                }
            }
            (Err(_), Err(_)) => {}
            (a, b) => panic!(
                "a run with allocations filled with 0xA5 and one with 0x5A ended differently ({:?} / {:?}): \
                 one read memory it never wrote\n  program: {}",
                a.as_ref().err(),
                b.as_ref().err(),
                program_text()
            ),
        }
        // The same run on the same values laid out contiguously: what a kernel computes must
        // not depend on its operands' strides (an embedding bag read expanded indices as if
        // they were contiguous, past their memory). Not for programs that read strides, nor
        // those that order ties as their kernel's path has it (an unstable sort of an expanded
        // tensor, whose elements are all ties, gave other indices than of its copy).
        let reads_layout = names.iter().any(|n| {
            matches!(
                n.as_str(),
                "aten::as_strided"
                    | "aten::sym_stride"
                    | "aten::sym_stride.int"
                    | "aten::sort"
                    | "aten::sort.stable"
                    | "aten::topk"
            )
        });
        if let Ok(a) = &first
            && !reads_layout
            && inputs.iter().any(|t| !t.is_contiguous())
        {
            let contiguous: Vec<Tensor> = inputs.iter().filter_map(|t| t.f_contiguous().ok()).collect();
            if contiguous.len() == inputs.len()
                && let Ok(c) = run_once(&graph, &contiguous, 0xA5)
            {
                stats(|s| s.compared_layouts += 1);
                for (i, (x, y)) in a.iter().zip(&c).enumerate() {
                    assert!(
                        x.same_exact_parts(y),
                        "output {i} differs between a run on inputs as laid out and one on the same values \
                         laid out contiguously: a kernel read its operands other than through their strides\n  \
                         as given:   {x:?}\n  contiguous: {y:?}\n  program: {}",
                        program_text()
                    );
                }
            }
        }
    }
    stats(|s| match &first {
        Ok(_) => {
            s.runs_ok += 1;
            for name in &names {
                s.operators.entry(name.clone()).or_default().ok += 1;
            }
        }
        Err((message, refused)) => {
            s.runs_failed += 1;
            s.allocations_refused += u64::from(*refused);
            if let Some(at) = failing_node(&program.nodes, message) {
                for name in &names[..at] {
                    s.operators.entry(name.clone()).or_default().ok += 1;
                }
                s.operators.entry(names[at].clone()).or_default().failed += 1;
            }
        }
    });
}
