//! A run's plan (its [`Estimate`]): the graph run over meta tensors, once per input sizes and
//! strides, counting each step's operations and the peak of new storage live; the values each
//! node is the last to read (which a run drops after it), and the operations of one step.

use std::collections::{HashMap, HashSet};

use djinn_graph::{Arg, Step};
use tch::Tensor;

use super::ffi::{self, meta_like};
use super::prepare::PreparedCall;
use super::steps::{native, run_call, value_of};
use super::{GraphModule, Prepared, RtValue};
use crate::cost::Estimate;
use crate::error::ExecError;
use crate::tensors::storage_of;
use djinn_sync::Locked;

/// One graph's plans, by its inputs' sizes and strides.
pub(super) type Plans = HashMap<Vec<(Vec<i64>, Vec<i64>)>, Estimate>;

impl GraphModule {
    /// What a run on `inputs` will take (see [`crate::cost`]), without running it.
    pub fn estimate_run(&self, inputs: &[Tensor]) -> Result<Estimate, ExecError> {
        self.estimate(self.select(inputs)?, inputs)
    }

    /// What graph `index` will take at `inputs`' shapes: planned once per sizes and strides.
    pub(super) fn estimate(&self, index: usize, inputs: &[Tensor]) -> Result<Estimate, ExecError> {
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
pub(super) fn tensors_of(v: &RtValue) -> Box<dyn Iterator<Item = &Tensor> + '_> {
    match v {
        RtValue::Tensor(t) => Box::new(std::iter::once(t)),
        RtValue::List(items) => Box::new(items.iter().flat_map(tensors_of)),
        _ => Box::new(std::iter::empty()),
    }
}

/// The sizes of the tensors a call reads, in its arguments' order.
pub(super) fn sizes_read(call: &PreparedCall, env: &[Option<RtValue>]) -> Vec<Vec<i64>> {
    call.varying
        .iter()
        .filter_map(|(_, _, arg)| value_of(arg, env).ok())
        .flat_map(|v| tensors_of(&v).map(Tensor::size).collect::<Vec<_>>())
        .collect()
}

/// The operations of one call that read tensors of `read` sizes and gave `results`
/// (`aliases`: views of what it read); a pooling operator's from its window (`args`, as bound).
pub(super) fn step_flops(
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
pub(super) fn dies_after(
    steps: &[Step],
    nodes: &[djinn_graph::format::Node],
    outputs: &[Arg],
    values: usize,
) -> Vec<Vec<u32>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::fixtures::{mlp, one_operator};
    use tch::{Device, Kind};

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
