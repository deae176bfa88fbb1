//! Tensors as the wire describes them: a libtorch dtype's wire dtype, a tensor's descriptor and
//! its bytes. The bottom of the executor: it imports nothing of the crate but its error.

use djinn_proto::{DType, TensorDesc};
use tch::{Kind, Tensor};

use crate::error::ExecError;

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

pub fn describe(tensor: &Tensor) -> Result<TensorDesc, ExecError> {
    let dtype = dtype_of(tensor.kind())?;
    let shape = tensor.size().iter().map(|&d| d as u64).collect();
    TensorDesc::new(dtype, shape).map_err(|e| ExecError::Unsupported(e.to_string()))
}

pub(crate) fn tensor_bytes(t: &Tensor) -> u64 {
    t.numel() as u64 * t.kind().elt_size_in_bytes() as u64
}
