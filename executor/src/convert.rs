//! Between the wire's values and tensors and the executor's (model values over libtorch's
//! tensors). Input tensors are views over the received payload (no copy on CPU); output tensors
//! are sent from their own memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use djinn_proto::{DType, Handle, HandleInfo, Payload, TensorDesc, Value, payload_layout};
use tch::{Device, Kind, Tensor};

use crate::error::ExecError;
use crate::kept::KeptTensors;
use crate::tensors::{held_bytes, owned_view, tensor_bytes};
use crate::value::ModelValue;
use djinn_sync::Locked;

pub fn kind_of(dtype: DType) -> Kind {
    match dtype {
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
        DType::I8 => Kind::Int8,
        DType::I16 => Kind::Int16,
        DType::I32 => Kind::Int,
        DType::I64 => Kind::Int64,
        DType::U8 => Kind::Uint8,
        DType::Bool => Kind::Bool,
    }
}

/// Tensors over the bytes of `payload`, laid out as `descs` say, moved to `device` when it is
/// not the CPU. The views hold `payload`: it lives as long as any tensor over it.
pub fn input_tensors(
    descs: &[TensorDesc],
    payload: Option<&Arc<Payload>>,
    device: Device,
) -> Result<Vec<Tensor>, ExecError> {
    let (offsets, _) = payload_layout(descs).map_err(|e| ExecError::Internal(e.to_string()))?;
    descs
        .iter()
        .zip(offsets)
        .map(|(desc, offset)| {
            let shape: Vec<i64> = desc.shape.iter().map(|&d| d as i64).collect();
            let kind = kind_of(desc.dtype);
            let tensor = match payload {
                Some(payload) if desc.byte_len > 0 => {
                    // SAFETY: the frame reader checked that the payload holds every tensor at
                    // its offset with its byte length.
                    let data = unsafe { payload.buf.as_ptr().add(offset as usize) };
                    // SAFETY: those bytes are the payload's, whose buffer never moves while it
                    // lives, and they are what `kind` and `shape` take.
                    unsafe { owned_view(Arc::clone(payload), data, desc.byte_len as usize, &shape, kind)? }
                }
                _ => Tensor::f_zeros(&shape, (kind, Device::Cpu))?,
            };
            Ok(if device == Device::Cpu { tensor } else { tensor.f_to_device(device)? })
        })
        .collect()
}

/// The tensors an execute's inputs name by handle (checked by the core), looked up once.
pub fn kept_inputs(inputs: &[Value], table: &Mutex<KeptTensors>) -> Result<HashMap<Handle, Tensor>, ExecError> {
    let mut found = HashMap::new();
    let mut handles = Vec::new();
    inputs.iter().for_each(|v| v.for_each_handle(&mut |h| handles.push(*h)));
    if handles.is_empty() {
        return Ok(found);
    }
    let table = table.locked();
    for h in handles {
        if let std::collections::hash_map::Entry::Vacant(slot) = found.entry(h) {
            slot.insert(table.get(h)?);
        }
    }
    Ok(found)
}

/// The model value of a wire value; tensors by index into `tensors`, or by handle in `kept`.
pub fn model_value(value: &Value, tensors: &[Tensor], kept: &HashMap<Handle, Tensor>) -> Result<ModelValue, ExecError> {
    let model_value = |v: &Value| model_value(v, tensors, kept);
    let items = |items: &[Value]| items.iter().map(model_value).collect::<Result<_, _>>();
    Ok(match value {
        Value::None => ModelValue::None,
        Value::Tensor(i) => ModelValue::Tensor(
            tensors.get(*i as usize).ok_or_else(|| ExecError::Internal(format!("no tensor {i}")))?.shallow_clone(),
        ),
        Value::Handle(h) => ModelValue::Tensor(
            kept.get(h).ok_or_else(|| ExecError::Internal(format!("handle {h} not looked up")))?.shallow_clone(),
        ),
        Value::Int(v) => ModelValue::Int(*v),
        Value::Float(v) => ModelValue::Float(*v),
        Value::Bool(v) => ModelValue::Bool(*v),
        Value::Str(s) => ModelValue::Str(s.clone()),
        Value::Tuple(v) => ModelValue::Tuple(items(v)?),
        Value::List(v) => ModelValue::List(items(v)?),
        Value::Dict(entries) => ModelValue::Dict(
            entries.iter().map(|(k, v)| Ok((model_value(k)?, model_value(v)?))).collect::<Result<_, ExecError>>()?,
        ),
    })
}

/// An output tensor, contiguous on the CPU, sent straight from its memory. It also holds the
/// request's payload, which an output may alias (a model that returns its input).
pub struct OutputTensor {
    /// Keeps the memory at `addr` alive.
    _tensor: Tensor,
    addr: usize,
    len: usize,
    _inputs: Option<Arc<Payload>>,
}

impl AsRef<[u8]> for OutputTensor {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the memory of a contiguous CPU tensor of `len` bytes that `self` keeps alive
        // and that nothing writes once it is built.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

// SAFETY: the tensor is only read (through `as_ref`) once built, and dropped once.
unsafe impl Sync for OutputTensor {}

impl OutputTensor {
    /// `t`'s bytes, contiguous on the CPU (copied there from a GPU), and their descriptor.
    /// `inputs` is the request's payload when `t` may be a view of it.
    pub fn new(t: Tensor, inputs: Option<Arc<Payload>>) -> Result<(Self, TensorDesc), ExecError> {
        let t = if t.device() == Device::Cpu { t } else { t.f_to_device(Device::Cpu)? };
        let t = if t.is_contiguous() { t } else { t.f_contiguous()? };
        let desc = crate::tensors::describe(&t)?;
        let addr = t.data_ptr() as usize;
        Ok((Self { len: desc.byte_len as usize, addr, _tensor: t, _inputs: inputs }, desc))
    }
}

/// Turns a model's output into a wire value and the tensors it names: sent back, or kept on the
/// node when `keep` is given.
pub struct Outputs<'a> {
    pub descs: Vec<TensorDesc>,
    pub tensors: Vec<OutputTensor>,
    pub kept: Vec<HandleInfo>,
    inputs: Option<Arc<Payload>>,
    /// Where output tensors are kept (the core records whose they are from the reply); `None`:
    /// they are sent.
    keep: Option<&'a Mutex<KeptTensors>>,
}

impl<'a> Outputs<'a> {
    pub fn new(inputs: Option<Arc<Payload>>, keep: Option<&'a Mutex<KeptTensors>>) -> Self {
        Self { descs: Vec::new(), tensors: Vec::new(), kept: Vec::new(), inputs, keep }
    }

    /// Frees what was kept so far (the output could not be built whole).
    pub fn release_kept(&mut self) {
        if let Some(table) = self.keep {
            let ids: Vec<u64> = self.kept.drain(..).map(|k| k.handle.id).collect();
            table.locked().free(&ids);
        }
    }

    pub fn value(&mut self, value: ModelValue) -> Result<Value, ExecError> {
        let items =
            |s: &mut Self, items: Vec<ModelValue>| items.into_iter().map(|v| s.value(v)).collect::<Result<_, _>>();
        Ok(match value {
            ModelValue::None => Value::None,
            ModelValue::Tensor(t) => self.tensor(t)?,
            ModelValue::Float(v) => Value::Float(v),
            ModelValue::Int(v) => Value::Int(v),
            ModelValue::Bool(v) => Value::Bool(v),
            ModelValue::Str(s) => Value::Str(s),
            ModelValue::Tuple(v) => Value::Tuple(items(self, v)?),
            ModelValue::List(v) => Value::List(items(self, v)?),
            ModelValue::Dict(entries) => {
                Value::Dict(entries.into_iter().map(|(k, v)| Ok((self.value(k)?, self.value(v)?))).collect::<Result<
                    _,
                    ExecError,
                >>(
                )?)
            }
        })
    }

    fn tensor(&mut self, t: Tensor) -> Result<Value, ExecError> {
        if let Some(table) = self.keep {
            return self.kept_tensor(t, table);
        }
        let (bytes, desc) = OutputTensor::new(t, self.inputs.clone())?;
        let index = self.descs.len() as u32;
        self.tensors.push(bytes);
        self.descs.push(desc);
        Ok(Value::Tensor(index))
    }

    /// Keeps `t` where it is; a CPU output that is a view of the request's payload (a model
    /// returning its input, see [`aliases`]) or of a storage larger than itself (a slice, kept
    /// by a handle charged for the slice alone) is copied first.
    fn kept_tensor(&mut self, t: Tensor, table: &Mutex<KeptTensors>) -> Result<Value, ExecError> {
        let views_more = held_bytes([&t]) > tensor_bytes(&t);
        let t = match (aliases(&t, self.inputs.as_ref()) || views_more, t.is_contiguous()) {
            (true, _) => t.f_contiguous()?.f_detach_copy()?,
            (false, false) => t.f_contiguous()?,
            (false, true) => t,
        };
        let info = table.locked().keep(t)?;
        let value = Value::Handle(info.handle);
        self.kept.push(info);
        Ok(value)
    }
}

/// True when `t` is a view of the request's payload (a model that returns its input). The view
/// holds the payload, so it is safe to keep; a tensor kept past the request is copied out of it
/// all the same, to be charged as what it is while the payload's buffer and its charge as a
/// request's input go back with the request.
pub fn aliases(t: &Tensor, payload: Option<&Arc<Payload>>) -> bool {
    payload.is_some_and(|p| {
        let start = p.buf.as_ptr() as usize;
        (start..start + p.buf.len()).contains(&(t.data_ptr() as usize))
    })
}
