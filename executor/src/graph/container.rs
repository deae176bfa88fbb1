//! The graph container: a module loaded from it (the program decoded, checked and prepared, its
//! weights and state copied out), and the container read back byte for byte from what the module
//! keeps.

use std::collections::HashMap;
use std::sync::Mutex;

use djinn_graph::format::dtype;
use djinn_graph::{Allowlist, Step};
use tch::{Device, Kind, Tensor};

use super::ffi::{meta_like, register_meta_kernels};
use super::plan::dies_after;
use super::prepare::{Target, prepare};
use super::{GraphModule, bad, kind_of};
use crate::error::ExecError;
use crate::tensors::tensor_bytes;

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
pub(super) struct Container {
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

impl GraphModule {
    /// Decodes, checks and prepares the graph container `bytes` on `device`, its weights
    /// copied out of `bytes`.
    pub fn load(bytes: &[u8], device: Device) -> Result<Self, ExecError> {
        Self::load_with(bytes, device, djinn_graph::allowlist())
    }

    /// [`Self::load`] against `allowlist` (tests take rules out of it to reach the walls behind).
    pub(super) fn load_with(bytes: &[u8], device: Device, allowlist: &Allowlist) -> Result<Self, ExecError> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::fixtures::mlp;

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
}
