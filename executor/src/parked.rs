//! Requests parked at a breakpoint: a run stopped after block k, its activation (block k's
//! output) kept in device memory until the client resumes it, possibly with a replacement, or
//! aborts it. The table holds no worker: other requests are served while any number are parked.
//!
//! Each parked request is charged to the node's device budget for its activation. Whose it is,
//! whether it ended and when it lapses is the node core's record, checked before a job names
//! it here: the core says when to free one.

use crate::kept::HandleSpace;
use std::collections::HashMap;
use std::sync::Arc;

use djinn_auth::TenantId;
use djinn_memory::{MemoryBudget, Reservation};
use djinn_proto::{Handle, TensorDesc, Value};

use crate::error::{BreakpointError, ExecError};
use crate::models::Model;
use crate::tensors::dtype_of;
use crate::tensors::held_bytes;
use crate::value::ModelValue;

/// Checks that a run over blocks `first..` of a model of `blocks` blocks may stop after `block`:
/// at `first` or later, and before the last block (after it, the run is over).
pub fn check_breakpoint(block: u32, first: usize, blocks: usize) -> Result<usize, BreakpointError> {
    let b = block as usize;
    let why = if blocks < 2 {
        "a model of one block has no breakpoints".to_owned()
    } else if b + 1 >= blocks {
        format!("the model has {blocks} blocks and stopping after the last is the end of the run")
    } else if b < first {
        format!("this run starts at block {first}")
    } else {
        return Ok(b);
    };
    Err(BreakpointError::BadBlock { block, why })
}

/// A session step stopped at a breakpoint: its session, and how many state tensors its model's
/// last outputs are.
#[derive(Debug, Clone, Copy)]
pub struct SessionStep {
    pub id: u64,
    pub state: usize,
}

/// What a stopped run leaves on the node.
pub struct Parked {
    /// Whose run it is (its session's turn, and its charge).
    pub tenant: TenantId,
    pub model: Arc<Model>,
    /// The block that ran last; a resume starts at the next one.
    pub block: usize,
    pub activation: ModelValue,
    /// Whether the run's final outputs stay on the node (the execute asked to keep them).
    pub keep: bool,
    pub session: Option<SessionStep>,
    charge: Reservation,
}

impl std::fmt::Debug for Parked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parked").field("model", &self.model.fingerprint).field("block", &self.block).finish()
    }
}

/// A run stopped after `block`, to be parked.
pub struct Stopped {
    pub tenant: TenantId,
    pub model: Arc<Model>,
    pub block: usize,
    pub activation: ModelValue,
    pub keep: bool,
    pub session: Option<SessionStep>,
    /// Tensors the activation may share that are charged elsewhere (a session's state, passed
    /// through the blocks): not charged again.
    pub charged: Vec<usize>,
}

/// The parked requests of one life of the executor (its epoch), by the ids of their handles.
pub struct ParkedTable {
    epoch: u64,
    next_id: u64,
    parked: HashMap<u64, Parked>,
    budget: MemoryBudget,
}

impl std::fmt::Debug for ParkedTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParkedTable").field("parked", &self.parked.len()).finish()
    }
}

impl ParkedTable {
    /// `budget`: the node's device budget, which activations are charged to; `space`: the
    /// executor's handles.
    pub fn new(budget: MemoryBudget, space: HandleSpace) -> Self {
        Self { epoch: space.epoch, next_id: space.first_id, parked: HashMap::new(), budget }
    }

    /// Parks a stopped run, charging its activation to the device budget.
    pub fn park(&mut self, stopped: Stopped) -> Result<Handle, ExecError> {
        let held = self.parked.values().filter(|p| p.tenant == stopped.tenant).count();
        if held >= crate::MAX_SESSIONS_PER_TENANT {
            return Err(ExecError::TooMany(format!(
                "this tenant has {held} requests parked, the most one tenant may: resume or abort some first"
            )));
        }
        // The storages the activation keeps alive (a slice keeps its whole tensor), each once.
        let mut held = Vec::new();
        stopped.activation.for_each_tensor(&mut |t| {
            if !stopped.charged.contains(&(t.data_ptr() as usize)) {
                held.push(t.shallow_clone());
            }
        });
        let bytes = held_bytes(&held);
        // At least `MIN_CHARGE`: a request parked on nothing (a scalar) still counts.
        let charge = self.budget.try_reserve_for(stopped.tenant, bytes.max(crate::MIN_CHARGE))?;
        let id = self.next_id;
        self.next_id += 1;
        let Stopped { tenant, model, block, activation, keep, session, .. } = stopped;
        self.parked.insert(id, Parked { tenant, model, block, activation, keep, session, charge });
        Ok(Handle { id, epoch: self.epoch })
    }

    /// Takes a parked request out to resume it, after checking that `activation` (its tensors
    /// described by `tensors`), when given, matches the parked one; a mismatch leaves it parked.
    pub fn take_for_resume(
        &mut self,
        id: u64,
        activation: Option<&Value>,
        tensors: &[TensorDesc],
    ) -> Result<Parked, ExecError> {
        let parked = self.parked.get(&id).ok_or_else(|| missing(id))?;
        if let Some(value) = activation {
            parked.activation.check(value, tensors, &mut String::from("activation"))?;
        }
        self.parked.remove(&id).ok_or_else(|| missing(id))
    }

    /// Parks again, under its old id, a request whose resume failed before its blocks ran.
    pub fn put_back(&mut self, id: u64, request: Parked) {
        self.parked.insert(id, request);
    }

    /// Whether the request `id` is parked here.
    pub fn holds(&self, id: u64) -> bool {
        self.parked.contains_key(&id)
    }

    pub fn abort(&mut self, id: u64) -> Result<Parked, ExecError> {
        self.parked.remove(&id).ok_or_else(|| missing(id))
    }

    /// A copy of the parked activation, and the block it is the output of.
    pub fn activation(&self, id: u64) -> Result<(ModelValue, usize), ExecError> {
        let p = self.parked.get(&id).ok_or_else(|| missing(id))?;
        Ok((p.activation.shallow_clone(), p.block))
    }

    /// Takes out the requests of these ids (a session's step must end); ids not here are
    /// skipped.
    pub fn free(&mut self, ids: &[u64]) -> Vec<Parked> {
        ids.iter().filter_map(|id| self.parked.remove(id)).collect()
    }

    pub fn stats(&self, out: &mut Vec<(String, u64)>) {
        let bytes = self.parked.values().map(|p| p.charge.bytes()).sum();
        out.push(("parked_bytes".to_owned(), bytes));
    }
}

/// A request the core's records hold and this table does not: a bug, said as one.
fn missing(id: u64) -> ExecError {
    ExecError::Internal(format!("parked request {id} is recorded but not parked in the executor"))
}

/// Refuses a block output that holds a dict: a replacement could not be checked against it.
pub fn check_parkable(activation: &ModelValue) -> Result<(), ExecError> {
    match activation {
        ModelValue::Dict(_) => {
            Err(ExecError::Unsupported(format!("a block output of {activation:?} cannot be parked")))
        }
        ModelValue::Tuple(items) | ModelValue::List(items) => items.iter().try_for_each(check_parkable),
        _ => Ok(()),
    }
}

/// A parked activation, checked against the replacement a resume gives.
impl ModelValue {
    fn describe(&self) -> String {
        match self {
            Self::Tensor(t) => match dtype_of(t.kind()) {
                Ok(dtype) => format!("a {}{:?} tensor", dtype.name(), t.size()),
                Err(_) => format!("a {:?}{:?} tensor", t.kind(), t.size()),
            },
            Self::Tuple(items) => format!("a tuple of {}", items.len()),
            Self::List(items) => format!("a list of {}", items.len()),
            Self::Int(_) => "an int".into(),
            Self::Float(_) => "a float".into(),
            Self::Bool(_) => "a bool".into(),
            Self::Str(_) => "a string".into(),
            Self::Dict(items) => format!("a dict of {}", items.len()),
            Self::None => "None".into(),
        }
    }

    /// Checks that `value` (a replacement, its tensors described by `tensors`) has this
    /// activation's structure, dtypes and shapes; `path` names the part being checked.
    fn check(&self, value: &Value, tensors: &[TensorDesc], path: &mut String) -> Result<(), BreakpointError> {
        let mismatch = |got: String, path: &str| {
            BreakpointError::Mismatch(format!("{path} is {got} where {} was parked", self.describe()))
        };
        let items = |parked: &[ModelValue], values: &[Value], path: &mut String| {
            if parked.len() != values.len() {
                return Err(mismatch(format!("{} of {}", value_kind(value), values.len()), path));
            }
            for (i, (a, v)) in parked.iter().zip(values).enumerate() {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                a.check(v, tensors, path)?;
                path.truncate(len);
            }
            Ok(())
        };
        match (self, value) {
            (Self::Tensor(t), Value::Tensor(i)) => {
                let shape: Vec<u64> = t.size().iter().map(|&d| d as u64).collect();
                match tensors.get(*i as usize) {
                    Some(d) if dtype_of(t.kind()).is_ok_and(|k| k == d.dtype) && d.shape == shape => Ok(()),
                    Some(d) => Err(mismatch(format!("a {}{:?} tensor", d.dtype.name(), d.shape), path)),
                    None => Err(mismatch(format!("tensor {i}, which the request does not carry"), path)),
                }
            }
            (Self::Tensor(_), Value::Handle(_)) => {
                Err(mismatch("a kept tensor (a replacement's tensors travel with the resume)".into(), path))
            }
            (Self::Tuple(parked), Value::Tuple(values)) | (Self::List(parked), Value::List(values)) => {
                items(parked, values, path)
            }
            (Self::Int(_), Value::Int(_))
            | (Self::Float(_), Value::Float(_))
            | (Self::Bool(_), Value::Bool(_))
            | (Self::Str(_), Value::Str(_))
            | (Self::None, Value::None) => Ok(()),
            (_, other) => Err(mismatch(value_kind(other).into(), path)),
        }
    }
}

fn value_kind(v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Tensor(_) | Value::Handle(_) => "a tensor",
        Value::Int(_) => "an int",
        Value::Float(_) => "a float",
        Value::Bool(_) => "a bool",
        Value::Str(_) => "a string",
        Value::Tuple(_) => "a tuple",
        Value::List(_) => "a list",
        Value::Dict(_) => "a dict",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use djinn_proto::DType;

    fn desc(dtype: DType, shape: &[u64]) -> TensorDesc {
        TensorDesc::new(dtype, shape.to_vec()).unwrap()
    }

    /// A (f32[2, 3] tensor, int) activation.
    fn parked_tuple() -> ModelValue {
        let t = tch::Tensor::zeros([2, 3], (tch::Kind::Float, tch::Device::Cpu));
        ModelValue::Tuple(vec![ModelValue::Tensor(t), ModelValue::Int(4)])
    }

    #[test]
    fn breakpoints_lie_between_the_first_block_run_and_the_last() {
        assert_eq!(check_breakpoint(0, 0, 4).unwrap(), 0);
        assert_eq!(check_breakpoint(2, 0, 4).unwrap(), 2);
        assert!(check_breakpoint(3, 0, 4).unwrap_err().to_string().contains("the last"));
        assert!(check_breakpoint(1, 2, 4).unwrap_err().to_string().contains("starts at block 2"));
        assert!(check_breakpoint(0, 0, 1).unwrap_err().to_string().contains("one block"));
    }

    #[test]
    fn a_replacement_must_have_the_parked_structure_shapes_and_dtypes() {
        let parked = parked_tuple();
        let check = |value: &Value, tensors: &[TensorDesc]| parked.check(value, tensors, &mut "activation".into());
        let good = Value::Tuple(vec![Value::Tensor(0), Value::Int(9)]);
        check(&good, &[desc(DType::F32, &[2, 3])]).unwrap();
        let e = check(&good, &[desc(DType::F32, &[3, 2])]).unwrap_err().to_string();
        assert!(e.contains("activation[0] is a f32[3, 2] tensor where a f32[2, 3] tensor was parked"), "{e}");
        let e = check(&good, &[desc(DType::F16, &[2, 3])]).unwrap_err().to_string();
        assert!(e.contains("f16"), "{e}");
        let e = check(&Value::Tensor(0), &[desc(DType::F32, &[2, 3])]).unwrap_err().to_string();
        assert!(e.contains("activation is a tensor where a tuple of 2 was parked"), "{e}");
        let e = check(&Value::Tuple(vec![Value::Tensor(0)]), &[desc(DType::F32, &[2, 3])]).unwrap_err().to_string();
        assert!(e.contains("activation is a tuple of 1 where a tuple of 2 was parked"), "{e}");
        let e = check(&Value::Tuple(vec![Value::Tensor(0), Value::Float(1.0)]), &[desc(DType::F32, &[2, 3])])
            .unwrap_err()
            .to_string();
        assert!(e.contains("activation[1] is a float where an int was parked"), "{e}");
    }

    #[test]
    fn a_block_output_holding_a_dict_is_not_parked() {
        check_parkable(&parked_tuple()).unwrap();
        let dict = ModelValue::Tuple(vec![ModelValue::Dict(vec![(ModelValue::Str("k".into()), ModelValue::Int(1))])]);
        let e = check_parkable(&dict).unwrap_err().to_string();
        assert!(e.contains(r#"a block output of Dict([(Str("k"), Int(1))]) cannot be parked"#), "{e}");
    }
}
