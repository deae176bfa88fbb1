//! Between the wire's values and tensors and libtorch's. Input tensors are views over the
//! received payload (no copy on CPU); output tensors are sent from their own memory.

use std::sync::Arc;

use djinn_dataplane::proto::{DType, Payload, TensorDesc, Value, payload_layout};
use tch::jit::IValue;
use tch::{Device, Kind, Tensor};

use crate::error::ExecError;

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

pub fn dtype_of(kind: Kind) -> Result<DType, ExecError> {
    Ok(match kind {
        Kind::Half => DType::F16,
        Kind::BFloat16 => DType::BF16,
        Kind::Float => DType::F32,
        Kind::Double => DType::F64,
        Kind::Int8 => DType::I8,
        Kind::Int16 => DType::I16,
        Kind::Int => DType::I32,
        Kind::Int64 => DType::I64,
        Kind::Uint8 => DType::U8,
        Kind::Bool => DType::Bool,
        other => return Err(ExecError::Unsupported(format!("output dtype {other:?} has no wire dtype"))),
    })
}

/// Tensors over the bytes of `payload`, laid out as `descs` say, moved to `device` when it is
/// not the CPU. The views borrow `payload`: it must outlive them (the caller keeps the `Arc`).
pub fn input_tensors(
    descs: &[TensorDesc],
    payload: Option<&Arc<Payload>>,
    device: Device,
) -> Result<Vec<Tensor>, ExecError> {
    let (offsets, _) = payload_layout(descs).map_err(|e| ExecError::Internal(e.to_string()))?;
    let base = payload.map_or(std::ptr::null(), |p| p.buf.as_ptr());
    descs
        .iter()
        .zip(offsets)
        .map(|(desc, offset)| {
            let shape: Vec<i64> = desc.shape.iter().map(|&d| d as i64).collect();
            let kind = kind_of(desc.dtype);
            let tensor = if desc.byte_len == 0 || base.is_null() {
                Tensor::f_zeros(&shape, (kind, Device::Cpu))?
            } else {
                // SAFETY: the frame reader checked that the payload holds every tensor at its
                // offset with its byte length; the payload outlives the view (see above).
                unsafe { Tensor::f_from_blob(base.add(offset as usize), &shape, &[], kind, Device::Cpu)? }
            };
            Ok(if device == Device::Cpu { tensor } else { tensor.f_to_device(device)? })
        })
        .collect()
}

/// The libtorch value of a wire value; tensors by index into `tensors`.
pub fn to_ivalue(value: &Value, tensors: &[Tensor]) -> Result<IValue, ExecError> {
    Ok(match value {
        Value::None => IValue::None,
        Value::Tensor(i) => IValue::Tensor(
            tensors.get(*i as usize).ok_or_else(|| ExecError::Internal(format!("no tensor {i}")))?.shallow_clone(),
        ),
        Value::Int(v) => IValue::Int(*v),
        Value::Float(v) => IValue::Double(*v),
        Value::Bool(v) => IValue::Bool(*v),
        Value::Str(s) => IValue::String(s.clone()),
        Value::Tuple(items) => IValue::Tuple(items.iter().map(|v| to_ivalue(v, tensors)).collect::<Result<_, _>>()?),
        // TorchScript wants typed lists (List[Tensor], List[int], ...) where it can have them.
        Value::List(items) => {
            let values = items.iter().map(|v| to_ivalue(v, tensors)).collect::<Result<Vec<_>, _>>()?;
            typed_list(values)
        }
        Value::Dict(entries) => IValue::GenericDict(
            entries
                .iter()
                .map(|(k, v)| Ok((to_ivalue(k, tensors)?, to_ivalue(v, tensors)?)))
                .collect::<Result<_, ExecError>>()?,
        ),
    })
}

fn typed_list(values: Vec<IValue>) -> IValue {
    macro_rules! all {
        ($variant:ident, $list:ident) => {
            if !values.is_empty() && values.iter().all(|v| matches!(v, IValue::$variant(_))) {
                return IValue::$list(
                    values
                        .into_iter()
                        .filter_map(|v| if let IValue::$variant(x) = v { Some(x) } else { None })
                        .collect(),
                );
            }
        };
    }
    all!(Tensor, TensorList);
    all!(Int, IntList);
    all!(Double, DoubleList);
    all!(Bool, BoolList);
    all!(String, StringList);
    IValue::GenericList(values)
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

/// Turns a model's output into a wire value and the tensors it names.
pub struct Outputs {
    pub descs: Vec<TensorDesc>,
    pub tensors: Vec<OutputTensor>,
    inputs: Option<Arc<Payload>>,
}

impl Outputs {
    pub fn new(inputs: Option<Arc<Payload>>) -> Self {
        Self { descs: Vec::new(), tensors: Vec::new(), inputs }
    }

    pub fn value(&mut self, ivalue: IValue) -> Result<Value, ExecError> {
        let list = |s: &mut Self, items: Vec<IValue>| -> Result<Value, ExecError> {
            Ok(Value::List(items.into_iter().map(|v| s.value(v)).collect::<Result<_, _>>()?))
        };
        Ok(match ivalue {
            IValue::None => Value::None,
            IValue::Tensor(t) => self.tensor(t)?,
            IValue::Double(v) => Value::Float(v),
            IValue::Int(v) => Value::Int(v),
            IValue::Bool(v) => Value::Bool(v),
            IValue::String(s) => Value::Str(s),
            IValue::Tuple(items) => Value::Tuple(items.into_iter().map(|v| self.value(v)).collect::<Result<_, _>>()?),
            IValue::IntList(v) => Value::List(v.into_iter().map(Value::Int).collect()),
            IValue::DoubleList(v) => Value::List(v.into_iter().map(Value::Float).collect()),
            IValue::BoolList(v) => Value::List(v.into_iter().map(Value::Bool).collect()),
            IValue::StringList(v) => Value::List(v.into_iter().map(Value::Str).collect()),
            IValue::TensorList(v) => list(self, v.into_iter().map(IValue::Tensor).collect())?,
            IValue::GenericList(v) => list(self, v)?,
            IValue::GenericDict(entries) => {
                Value::Dict(entries.into_iter().map(|(k, v)| Ok((self.value(k)?, self.value(v)?))).collect::<Result<
                    _,
                    ExecError,
                >>(
                )?)
            }
            other => {
                return Err(ExecError::Unsupported(format!("the model returned {other:?}, which has no wire form")));
            }
        })
    }

    fn tensor(&mut self, t: Tensor) -> Result<Value, ExecError> {
        let dtype = dtype_of(t.kind())?;
        let t = if t.device() == Device::Cpu { t } else { t.f_to_device(Device::Cpu)? };
        let t = if t.is_contiguous() { t } else { t.f_contiguous()? };
        let shape: Vec<u64> = t.size().iter().map(|&d| d as u64).collect();
        let desc = TensorDesc::new(dtype, shape).map_err(|e| ExecError::Internal(e.to_string()))?;
        let index = self.descs.len() as u32;
        let addr = t.data_ptr() as usize;
        self.tensors.push(OutputTensor { len: desc.byte_len as usize, addr, _tensor: t, _inputs: self.inputs.clone() });
        self.descs.push(desc);
        Ok(Value::Tensor(index))
    }
}
