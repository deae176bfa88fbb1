//! A call's run: its entry graph (see `inputs.rs`) admitted against its plan, then run step by
//! step under the deadline, each operator's operands checked before it runs (index bounds,
//! probabilities, the rules the allowlist has, writes to a weight or the caller's input).

use std::collections::HashSet;

use djinn_graph::Step;
use tch::Tensor;

use super::ffi::{self, RequestGenerator};
use super::plan::{sizes_read, step_flops, tensors_of};
use super::steps::{native, run_call, value_of};
use super::{GraphModule, Prepared, RtValue};
use crate::error::ExecError;
use crate::tensors::storage_of;

impl GraphModule {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::fixtures::node;
    use djinn_graph::format::FORMAT;
    use djinn_graph::{Allowlist, Arg, DimRange, Input, Node, Program, Weight};
    use tch::Device;

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
}
