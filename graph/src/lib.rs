//! Models as data. A graph is what `torch.export` makes of a model, written in Djinn's own
//! format (docs/graph-format.md): operators by schema name, constants, the runner's integer
//! operations, inputs with their size ranges, and weights in the payload layout. This crate
//! decodes and checks it, with no libtorch: the executor runs what passes, through libtorch's
//! dispatcher.

pub mod check;
pub mod format;
pub mod rules;
pub mod schema;

pub use check::{Allowlist, CheckError, Checked, CheckedGraph, Kind, Native, Step, allowlist, check};
pub use format::{
    Arg, DecodeError, Decoded, DimRange, Entry, Graph, Input, Node, Program, State, Weight, decode, encode, is_graph,
    tensor_len,
};
pub use rules::ValueRule;
