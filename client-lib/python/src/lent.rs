//! The tensors a call sends, lent by Python through DLPack. Each is held by its DLPack capsule,
//! which keeps the tensor's memory alive until it is dropped: the call owns its inputs for as
//! long as any byte of them may be read, whatever Python does with its own references
//! meanwhile (the GIL is released during the call).

use std::ffi::c_void;

use djinn_client::{DType, TensorRef};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyType};

// dlpack.h (v0.8, the unversioned capsule every producer still offers).
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

const DL_CPU: i32 = 1;

/// The wire dtype of a DLPack dtype, if it has one.
fn wire_dtype(dt: &DlDataType) -> Option<DType> {
    const INT: u8 = 0;
    const UINT: u8 = 1;
    const FLOAT: u8 = 2;
    const BFLOAT: u8 = 4;
    const BOOL: u8 = 6;
    if dt.lanes != 1 {
        return None;
    }
    Some(match (dt.code, dt.bits) {
        (FLOAT, 16) => DType::F16,
        (BFLOAT, 16) => DType::BF16,
        (FLOAT, 32) => DType::F32,
        (FLOAT, 64) => DType::F64,
        (INT, 8) => DType::I8,
        (INT, 16) => DType::I16,
        (INT, 32) => DType::I32,
        (INT, 64) => DType::I64,
        (UINT, 8) => DType::U8,
        (BOOL, 8) => DType::Bool,
        _ => return None,
    })
}

/// Whether `strides` (in elements) lay `shape` out densely in row-major order. Dimensions of
/// size 1 may have any stride, and an empty tensor any layout.
fn row_major(shape: &[u64], strides: &[i64]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut expected: u64 = 1;
    for (&size, &stride) in shape.iter().zip(strides).rev() {
        if size != 1 && u64::try_from(stride).ok() != Some(expected) {
            return false;
        }
        expected = expected.saturating_mul(size);
    }
    true
}

/// One tensor lent to a call: its capsule, and what it describes.
pub struct LentTensor {
    /// Never consumed: while it lives, the DLPack tensor (and the memory it points at) does; its
    /// destructor calls the producer's deleter.
    _capsule: Py<PyCapsule>,
    dtype: DType,
    shape: Vec<u64>,
    data: *const u8,
    len: usize,
}

// SAFETY: `data` is only read, and its memory belongs to the capsule, which this holds (a `Py`
// may move between threads).
unsafe impl Send for LentTensor {}
// SAFETY: as above; nothing here is mutated after construction.
unsafe impl Sync for LentTensor {}

impl LentTensor {
    /// Takes `tensor`'s DLPack capsule (`tensor.__dlpack__()`): a contiguous CPU tensor of a
    /// wire dtype.
    pub fn lend(tensor: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = tensor.py();
        // torch's own exporter takes a fraction of the time of its `__dlpack__` (checks written
        // in Python), which is for any other producer.
        static TORCH_TENSOR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
        static TO_DLPACK: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let capsule = if tensor.is_instance(TORCH_TENSOR.import(py, "torch", "Tensor")?)? {
            TO_DLPACK.import(py, "torch.utils.dlpack", "to_dlpack")?.call1((tensor,))?
        } else {
            tensor.call_method0(intern!(py, "__dlpack__"))?
        };
        let capsule = capsule.cast_into::<PyCapsule>()?;
        let pointer = capsule.pointer_checked(Some(c"dltensor"))?;
        // SAFETY: a capsule named "dltensor" holds a DLManagedTensor, which starts with its
        // DLTensor, valid and unchanged until the capsule is consumed or destroyed; this holds
        // it unconsumed.
        let t = unsafe { &*pointer.as_ptr().cast::<DlTensor>() };
        if t.device.device_type != DL_CPU {
            return Err(PyValueError::new_err(format!(
                "a tensor lent to a call must be in CPU memory (DLPack device type {}, id {})",
                t.device.device_type, t.device.device_id
            )));
        }
        let dtype = wire_dtype(&t.dtype).ok_or_else(|| {
            PyTypeError::new_err(format!(
                "DLPack dtype (code {}, {} bits, {} lanes) has no wire dtype",
                t.dtype.code, t.dtype.bits, t.dtype.lanes
            ))
        })?;
        let ndim = usize::try_from(t.ndim).map_err(|_| PyValueError::new_err("negative DLPack ndim"))?;
        let (dims, strides): (&[i64], &[i64]) = if ndim == 0 {
            (&[], &[])
        } else {
            // SAFETY: DLPack's shape (and strides, when not null) hold `ndim` entries, owned
            // by the managed tensor.
            unsafe {
                (
                    std::slice::from_raw_parts(t.shape, ndim),
                    if t.strides.is_null() { &[] } else { std::slice::from_raw_parts(t.strides, ndim) },
                )
            }
        };
        let shape = dims
            .iter()
            .map(|&d| u64::try_from(d).map_err(|_| PyValueError::new_err(format!("negative dimension {d}"))))
            .collect::<PyResult<Vec<u64>>>()?;
        if !strides.is_empty() && !row_major(&shape, strides) {
            return Err(PyValueError::new_err(format!(
                "a tensor lent to a call must be contiguous (shape {shape:?}, strides {strides:?})"
            )));
        }
        let len = shape
            .iter()
            .try_fold(dtype.size(), |n, &d| n.checked_mul(d))
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| PyValueError::new_err(format!("a tensor of shape {shape:?} is too large")))?;
        let data = if len == 0 {
            std::ptr::null()
        } else {
            let offset =
                usize::try_from(t.byte_offset).map_err(|_| PyValueError::new_err("DLPack offset too large"))?;
            if t.data.is_null() {
                return Err(PyValueError::new_err("a DLPack tensor with bytes but no data pointer"));
            }
            t.data.cast::<u8>().cast_const().wrapping_add(offset)
        };
        Ok(Self { _capsule: capsule.unbind(), dtype, shape, data, len })
    }

    /// The tensor as the client sends it, borrowed from this (which keeps its memory alive).
    pub fn tensor_ref(&self) -> TensorRef<'_> {
        let bytes = if self.len == 0 {
            &[][..]
        } else {
            // SAFETY: `data..data + len` is the tensor's memory (checked contiguous above),
            // owned by the capsule this holds for at least the borrow's length.
            unsafe { std::slice::from_raw_parts(self.data, self.len) }
        };
        TensorRef { dtype: self.dtype, shape: &self.shape, bytes }
    }
}

/// Lends every tensor of a call (see [`LentTensor::lend`]).
pub fn lend_all(tensors: &[Bound<'_, PyAny>]) -> PyResult<Vec<LentTensor>> {
    tensors.iter().map(LentTensor::lend).collect()
}

/// The client's view of lent tensors.
pub fn refs(lent: &[LentTensor]) -> Vec<TensorRef<'_>> {
    lent.iter().map(LentTensor::tensor_ref).collect()
}
