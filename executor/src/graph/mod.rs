//! Graphs run through libtorch's dispatcher (csrc/dispatch.cpp): a checked program
//! ([`djinn_graph::Checked`]) prepared once per model (each node's operator found by name, its
//! schema compared with the allowlist's, its constants set), then run node by node per call.
//!
//! - `ffi.rs`: the shim's C ABI and the safe pieces over it (messages, request generators, meta
//!   kernels and meta tensors);
//! - `prepare.rs`: a node's operator call prepared (found by name, schema compared, constants set);
//! - `container.rs`: a module loaded from its container (weights and state copied out, calls
//!   prepared), and the container read back;
//! - `inputs.rs`: the entry graph a call's inputs fit, and a session's state;
//! - `steps.rs`: one step run (a native step, or a prepared call through the shim);
//! - `plan.rs`: a run's plan over meta tensors (operations, peak memory), the values each node
//!   is the last to read, and one step's operations;
//! - `run.rs`: a call's run, step by step, with its checks;
//! - `fixtures.rs`: graphs the tests share;
//! - here: [`GraphModule`], what it holds, and [`kind_of`].

use std::sync::Mutex;

use djinn_graph::Checked;
use tch::{Device, Kind, Tensor};

use crate::error::ExecError;
pub use crate::value::RtValue;

mod container;
mod ffi;
#[cfg(test)]
mod fixtures;
mod inputs;
mod plan;
mod prepare;
mod run;
mod steps;

use container::Container;
use plan::Plans;
use prepare::PreparedCall;

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
    /// Handles on its weights (the tensors its runs read), named as in the program.
    pub fn weights(&self) -> Vec<(String, Tensor)> {
        let names = &self.checked.program.weights;
        names.iter().zip(&self.weights).map(|(w, (_, t))| (w.name.clone(), t.shallow_clone())).collect()
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
}

/// One graph of a module, ready to run (or to plan).
struct Prepared<'a> {
    program: djinn_graph::Graph<'a>,
    checked: &'a djinn_graph::CheckedGraph,
    calls: &'a [Option<PreparedCall>],
    dies_after: &'a [Vec<u32>],
}
