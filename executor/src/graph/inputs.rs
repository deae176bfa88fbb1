//! What a call gives a graph: the entry graph its inputs fit (the first of the program's), and a
//! session's state (the inputs a session keeps between its calls): its initial values, checked.

use djinn_graph::format::DimRange;
use tch::{Device, Tensor};

use super::{GraphModule, bad, kind_of};
use crate::error::ExecError;

impl GraphModule {
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
    pub(super) fn select(&self, inputs: &[Tensor]) -> Result<usize, ExecError> {
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
