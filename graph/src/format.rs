//! The graph container and the program it holds (docs/graph-format.md).
//!
//! ```text
//! magic "DJINNGR1" | u64 LE length of the program | the program (JSON, UTF-8)
//! | zeros up to a multiple of 64 | the weights: each tensor at its offset (a multiple of 64)
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub const MAGIC: &[u8; 8] = b"DJINNGR1";
/// The program's format version.
pub const FORMAT: u32 = 1;
/// Where each weight starts, from the start of the weights.
pub const WEIGHT_ALIGN: u64 = 64;
/// Bounds on what a program may hold, checked before anything is built from it.
pub const MAX_PROGRAM_BYTES: u64 = 64 << 20;
pub const MAX_VALUES: usize = 1 << 20;
pub const MAX_LIST: usize = 1 << 16;
pub const MAX_RANK: usize = 16;
pub const MAX_ENTRIES: usize = 16;

/// Whether `bytes` start like a graph container (rather than, say, a TorchScript zip).
pub fn is_graph(bytes: &[u8]) -> bool {
    bytes.starts_with(MAGIC)
}

/// A model as data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Program {
    pub format: u32,
    /// The caller's tensors, in call order.
    pub inputs: Vec<Input>,
    /// Parameters, buffers and constants, in the container's weights.
    pub weights: Vec<Weight>,
    pub nodes: Vec<Node>,
    /// What a call returns, flattened (the client rebuilds the structure).
    pub outputs: Vec<Arg>,
    /// What a session of the model keeps between steps (a KV cache), with its initial values.
    /// Every graph of the program takes the state as its last inputs (flagged `state`), may
    /// write them in place, and gives the new state as its last outputs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state: Vec<State>,
    /// More graphs over the same weights (a decode step beside a prefill): a call runs the
    /// first graph, the program's own then these, whose inputs it fits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entries: Vec<Entry>,
}

impl Program {
    /// The program's graphs: its own, then its entries'.
    pub fn graphs(&self) -> impl Iterator<Item = Graph<'_>> {
        std::iter::once(Graph { inputs: &self.inputs, nodes: &self.nodes, outputs: &self.outputs })
            .chain(self.entries.iter().map(|e| Graph { inputs: &e.inputs, nodes: &e.nodes, outputs: &e.outputs }))
    }

    /// The program's graph `i` (0: its own).
    pub fn graph(&self, i: usize) -> Option<Graph<'_>> {
        self.graphs().nth(i)
    }

    /// Where the tensors with bytes in the container start: the weights', then those of the
    /// state's initial values that are not zeros.
    pub fn stored_offsets(&self) -> impl Iterator<Item = u64> + '_ {
        self.weights.iter().map(|w| w.offset).chain(self.state.iter().filter_map(|s| s.offset))
    }
}

/// One graph of a program: its inputs, nodes and outputs, over the program's weights.
#[derive(Debug, Clone, Copy)]
pub struct Graph<'a> {
    pub inputs: &'a [Input],
    pub nodes: &'a [Node],
    pub outputs: &'a [Arg],
}

/// A graph beside the program's own, over the same weights and state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub inputs: Vec<Input>,
    pub nodes: Vec<Node>,
    pub outputs: Vec<Arg>,
}

/// One tensor of a session's state: its initial value is zeros, or the bytes at `offset` in
/// the container's weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Input {
    pub name: String,
    pub value: u32,
    /// torch's name for it: `float32`, `int64`, ...
    pub dtype: String,
    /// One per dimension: the sizes a call may give it (export's range constraints).
    pub dims: Vec<DimRange>,
    /// A tensor of the session's state (the graph may write it in place), not the caller's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub state: bool,
}

/// Sizes `min..=max` (equal for a static dimension).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DimRange {
    pub min: i64,
    pub max: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Weight {
    pub name: String,
    pub value: u32,
    pub dtype: String,
    pub shape: Vec<i64>,
    /// From the start of the weights; a multiple of [`WEIGHT_ALIGN`].
    pub offset: u64,
}

/// One call: an operator of the allowlist (`aten::linear`, overload `""`) or one of the
/// runner's own integer and list operations (`native::add`, `native::getitem`, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Node {
    pub op: String,
    #[serde(default)]
    pub overload: String,
    #[serde(default)]
    pub args: Vec<Arg>,
    #[serde(default)]
    pub kwargs: BTreeMap<String, Arg>,
    /// One value per return of the operator.
    #[serde(default)]
    pub outputs: Vec<u32>,
}

/// An argument: a value of the graph or a constant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Arg {
    #[serde(rename = "none")]
    None,
    /// A value: an input, a weight or a node's output.
    #[serde(rename = "v")]
    Value(u32),
    #[serde(rename = "i")]
    Int(i64),
    /// As Python's `repr` writes it (`0.5`, `inf`, `nan`): JSON has no infinities.
    #[serde(rename = "f")]
    Float(String),
    #[serde(rename = "b")]
    Bool(bool),
    #[serde(rename = "s")]
    Str(String),
    #[serde(rename = "dtype")]
    Dtype(String),
    /// Always `node`: whatever device the node runs the model on.
    #[serde(rename = "device")]
    Device(String),
    #[serde(rename = "layout")]
    Layout(String),
    #[serde(rename = "memory_format")]
    MemoryFormat(String),
    #[serde(rename = "list")]
    List(Vec<Arg>),
}

/// torch's dtypes that graphs may name, with their element sizes and c10::ScalarType codes.
pub const DTYPES: &[(&str, u64, i32)] = &[
    ("uint8", 1, 0),
    ("int8", 1, 1),
    ("int16", 2, 2),
    ("int32", 4, 3),
    ("int64", 8, 4),
    ("float16", 2, 5),
    ("float32", 4, 6),
    ("float64", 8, 7),
    ("bool", 1, 11),
    ("bfloat16", 2, 15),
];

pub fn dtype(name: &str) -> Option<(u64, i32)> {
    DTYPES.iter().find(|(n, ..)| *n == name).map(|&(_, size, code)| (size, code))
}

/// A container's parts: the program, and where the weights start in the container's bytes.
#[derive(Debug)]
pub struct Decoded {
    pub program: Program,
    pub weights_start: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("not a graph container (no {MAGIC:?} magic)")]
    NotAGraph,
    #[error("the container is truncated: {0}")]
    Truncated(&'static str),
    #[error("the program is {0} bytes, over the limit of {MAX_PROGRAM_BYTES}")]
    ProgramTooLarge(u64),
    #[error("the program is not valid: {0}")]
    Program(#[from] serde_json::Error),
    #[error("program format {0}; this node reads format {FORMAT}")]
    Format(u32),
    #[error("weight {name:?}: {why}")]
    Weight { name: String, why: String },
    #[error("{0} entries, over the limit of {MAX_ENTRIES}")]
    Entries(usize),
}

/// Bytes of a tensor of `dtype` and `shape`; `None` for an unknown dtype, a negative size, a
/// rank over [`MAX_RANK`] or a size past `u64`.
pub fn tensor_len(dtype_name: &str, shape: &[i64]) -> Option<u64> {
    let (size, _) = dtype(dtype_name)?;
    if shape.len() > MAX_RANK {
        return None;
    }
    shape.iter().try_fold(size, |acc, &d| u64::try_from(d).ok().and_then(|d| acc.checked_mul(d)))
}

/// Encodes a container: `program` with `weights`, the bytes of each tensor of
/// [`Program::stored_offsets`] (each at the offset the program gives it).
pub fn encode(program: &Program, weights: &[&[u8]]) -> Result<Vec<u8>, serde_json::Error> {
    let json = serde_json::to_vec(program)?;
    let mut out = Vec::with_capacity(16 + json.len() + 64);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out.resize(out.len().next_multiple_of(WEIGHT_ALIGN as usize), 0);
    let start = out.len();
    // Weights in any order of their offsets (a zero-length one may share another's).
    let end = program.stored_offsets().zip(weights).map(|(o, b)| o as usize + b.len()).max().unwrap_or(0);
    out.resize(start + end, 0);
    for (offset, bytes) in program.stored_offsets().zip(weights) {
        let at = start + offset as usize;
        out[at..at + bytes.len()].copy_from_slice(bytes);
    }
    Ok(out)
}

/// Decodes a container and checks its weights' layout: known dtypes, shapes whose bytes fit
/// the container at aligned offsets that do not overlap. The program's graph is checked by
/// [`crate::check`].
pub fn decode(bytes: &[u8]) -> Result<Decoded, DecodeError> {
    if !is_graph(bytes) {
        return Err(DecodeError::NotAGraph);
    }
    let len_bytes: [u8; 8] =
        bytes.get(8..16).and_then(|b| b.try_into().ok()).ok_or(DecodeError::Truncated("no program length"))?;
    let len = u64::from_le_bytes(len_bytes);
    if len > MAX_PROGRAM_BYTES {
        return Err(DecodeError::ProgramTooLarge(len));
    }
    let end = 16 + len as usize;
    let json = bytes.get(16..end).ok_or(DecodeError::Truncated("the program"))?;
    let program: Program = serde_json::from_slice(json)?;
    if program.format != FORMAT {
        return Err(DecodeError::Format(program.format));
    }
    if program.entries.len() > MAX_ENTRIES {
        return Err(DecodeError::Entries(program.entries.len()));
    }
    let weights_start = end.next_multiple_of(WEIGHT_ALIGN as usize);
    let available = bytes.len().saturating_sub(weights_start) as u64;
    let mut spans: Vec<(u64, u64, &str)> = Vec::with_capacity(program.weights.len());
    let stored = program.weights.iter().map(|w| (&w.name, &w.dtype, &w.shape, Some(w.offset)));
    let state = program.state.iter().map(|s| (&s.name, &s.dtype, &s.shape, s.offset));
    for (name, dtype_name, shape, offset) in stored.chain(state) {
        let fail = |why: String| DecodeError::Weight { name: name.clone(), why };
        if dtype(dtype_name).is_none() {
            return Err(fail(format!("unknown dtype {dtype_name:?}")));
        }
        if shape.len() > MAX_RANK {
            return Err(fail(format!("rank {} over {MAX_RANK}", shape.len())));
        }
        let len =
            tensor_len(dtype_name, shape).ok_or_else(|| fail(format!("shape {shape:?} is negative or too large")))?;
        // A state of zeros has no bytes in the container.
        let Some(offset) = offset else { continue };
        if !offset.is_multiple_of(WEIGHT_ALIGN) {
            return Err(fail(format!("offset {offset} is not a multiple of {WEIGHT_ALIGN}")));
        }
        let stop = offset.checked_add(len).filter(|&s| s <= available);
        let stop = stop.ok_or_else(|| fail(format!("{len} bytes at {offset} pass the container's end")))?;
        spans.push((offset, stop, name));
    }
    spans.sort_unstable();
    for pair in spans.windows(2) {
        if pair[1].0 < pair[0].1 {
            return Err(DecodeError::Weight { name: pair[1].2.to_owned(), why: format!("overlaps {:?}", pair[0].2) });
        }
    }
    Ok(Decoded { program, weights_start })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn program(weights: Vec<Weight>) -> Program {
        Program {
            format: FORMAT,
            inputs: vec![],
            weights,
            nodes: vec![],
            outputs: vec![],
            state: vec![],
            entries: vec![],
        }
    }

    #[test]
    fn arguments_are_written_as_the_format_says() {
        let args = vec![
            Arg::None,
            Arg::Value(3),
            Arg::Int(-2),
            Arg::Float("inf".into()),
            Arg::Dtype("float32".into()),
            Arg::List(vec![Arg::Int(1), Arg::Value(4)]),
        ];
        let json = serde_json::to_string(&args).unwrap();
        assert_eq!(json, r#"["none",{"v":3},{"i":-2},{"f":"inf"},{"dtype":"float32"},{"list":[{"i":1},{"v":4}]}]"#);
        assert_eq!(serde_json::from_str::<Vec<Arg>>(&json).unwrap(), args);
    }

    #[test]
    fn weights_out_of_bounds_misaligned_or_overlapping_are_refused() {
        let w = |name: &str, shape: Vec<i64>, offset| Weight {
            name: name.into(),
            value: 0,
            dtype: "float32".into(),
            shape,
            offset,
        };
        let ok = program(vec![w("a", vec![4], 0), w("b", vec![2, 2], 64)]);
        let bytes = encode(&ok, &[&[1u8; 16], &[2u8; 16]]).unwrap();
        let decoded = decode(&bytes).unwrap();
        assert_eq!(&bytes[decoded.weights_start + 64..decoded.weights_start + 80], &[2u8; 16]);
        for (bad, why) in [
            (program(vec![w("a", vec![4], 32)]), "not a multiple"),
            (program(vec![w("a", vec![4], 0), w("b", vec![20], 0)]), "overlaps"),
            (program(vec![w("a", vec![-1], 0)]), "negative"),
            (program(vec![w("a", vec![i64::MAX, 4], 0)]), "too large"),
            (program(vec![w("a", vec![1 << 20], 0)]), "end"),
        ] {
            let mut bytes = encode(&program(vec![]), &[]).unwrap();
            // The bad program, over the same 128 bytes of weights.
            let json = serde_json::to_vec(&bad).unwrap();
            bytes.truncate(8);
            bytes.extend_from_slice(&(json.len() as u64).to_le_bytes());
            bytes.extend_from_slice(&json);
            bytes.resize(bytes.len().next_multiple_of(64) + 128, 0);
            let e = decode(&bytes).unwrap_err().to_string();
            assert!(e.contains(why), "{e} (expected {why:?})");
        }
    }

    #[test]
    fn truncated_and_foreign_bytes_are_refused() {
        assert!(matches!(decode(b"PK\x03\x04rest"), Err(DecodeError::NotAGraph)));
        assert!(matches!(decode(MAGIC), Err(DecodeError::Truncated(_))));
        let mut huge = MAGIC.to_vec();
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(decode(&huge), Err(DecodeError::ProgramTooLarge(_))));
        let bytes = encode(&program(vec![]), &[]).unwrap();
        assert!(matches!(decode(&bytes[..20]), Err(DecodeError::Truncated(_))));
    }

    /// Found by fuzz/fuzz_targets/graph_decode.rs: an empty weight at the offset of another,
    /// listed after it, cut the other's bytes when the program was written again.
    #[test]
    fn weights_are_written_whatever_the_order_of_their_offsets() {
        let w = |name: &str, len: i64, offset| Weight {
            name: name.into(),
            value: 0,
            dtype: "uint8".into(),
            shape: vec![len],
            offset,
        };
        let p = program(vec![w("late", 8, 64), w("early", 4, 0), w("empty", 0, 64)]);
        let bytes = encode(&p, &[&[7u8; 8], &[9u8; 4], &[]]).unwrap();
        let decoded = decode(&bytes).unwrap();
        let at = decoded.weights_start;
        assert_eq!(&bytes[at..at + 4], &[9u8; 4]);
        assert_eq!(&bytes[at + 64..at + 72], &[7u8; 8]);
    }

    proptest! {
        /// Whatever the weights, a container decodes to the program it was made from, each
        /// weight's bytes where the program says.
        #[test]
        fn containers_round_trip(lens in proptest::collection::vec(0usize..300, 0..6)) {
            let mut offset = 0u64;
            let mut weights = Vec::new();
            let data: Vec<Vec<u8>> = lens.iter().enumerate().map(|(i, &n)| vec![i as u8 + 1; n]).collect();
            for (i, &n) in lens.iter().enumerate() {
                weights.push(Weight { name: format!("w{i}"), value: i as u32, dtype: "uint8".into(), shape: vec![n as i64], offset });
                offset = (offset + n as u64).next_multiple_of(WEIGHT_ALIGN);
            }
            let p = program(weights);
            let slices: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
            let bytes = encode(&p, &slices).unwrap();
            let decoded = decode(&bytes).unwrap();
            prop_assert_eq!(&decoded.program, &p);
            for (w, d) in p.weights.iter().zip(&data) {
                let at = decoded.weights_start + w.offset as usize;
                prop_assert_eq!(&bytes[at..at + d.len()], d.as_slice());
            }
        }
    }
}
