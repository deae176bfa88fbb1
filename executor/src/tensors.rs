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

unsafe extern "C" {
    fn djinn_owned_bytes(
        data: *mut std::ffi::c_void,
        nbytes: i64,
        context: *mut std::ffi::c_void,
        release: unsafe extern "C" fn(*mut std::ffi::c_void),
        err: *mut *mut std::ffi::c_char,
    ) -> *mut std::ffi::c_void;
    fn djinn_free_message(message: *mut std::ffi::c_char);
    fn djinn_tensor_storage(tensor: *const std::ffi::c_void, id: *mut usize, nbytes: *mut u64);
}

/// The storage `t` is a view of: its identity (0 for none) and its bytes.
pub(crate) fn storage_of(t: &Tensor) -> (usize, u64) {
    let (mut id, mut bytes) = (0usize, 0u64);
    // SAFETY: `t` is a live tensor borrowed for the call; the shim writes both out-values.
    unsafe { djinn_tensor_storage(t.as_ptr().cast(), &mut id, &mut bytes) };
    (id, bytes)
}

/// The bytes `tensors` keep alive: each storage they view once, whole (a 4-byte slice of a
/// 64 MiB tensor keeps 64 MiB), and a tensor without a storage by its own bytes.
pub(crate) fn held_bytes<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> u64 {
    let mut seen = std::collections::HashSet::new();
    tensors
        .into_iter()
        .map(|t| match storage_of(t) {
            (0, _) => tensor_bytes(t),
            (id, bytes) if seen.insert(id) => bytes.max(tensor_bytes(t)),
            _ => 0,
        })
        .sum()
}

/// Gives back the `Arc` that [`owned_view`] handed to libtorch.
unsafe extern "C" fn release_arc<T>(context: *mut std::ffi::c_void) {
    // SAFETY: `context` is the pointer `Arc::into_raw` made in `owned_view`, released once.
    drop(unsafe { std::sync::Arc::from_raw(context.cast_const().cast::<T>()) });
}

/// A CPU tensor of `kind` and `shape` over `len` bytes at `data`, memory that `owner` keeps.
/// The tensor's storage holds `owner`: the memory lives as long as any tensor over it (clones,
/// views, outputs that alias it), whoever drops `owner`'s other references meanwhile.
///
/// # Safety
/// `data..data + len` must be memory that stays valid and unmoved for as long as `owner`
/// lives, and `len` must be what `kind` and `shape` take.
pub unsafe fn owned_view<T: Send + Sync + 'static>(
    owner: std::sync::Arc<T>,
    data: *const u8,
    len: usize,
    shape: &[i64],
    kind: Kind,
) -> Result<Tensor, ExecError> {
    let context = std::sync::Arc::into_raw(owner).cast_mut().cast::<std::ffi::c_void>();
    let mut err = std::ptr::null_mut();
    // SAFETY: libtorch takes `context` and calls `release_arc` on it once; `data..data + len`
    // is valid as long as `context` is (the caller's promise).
    let raw = unsafe { djinn_owned_bytes(data.cast_mut().cast(), len as i64, context, release_arc::<T>, &mut err) };
    if raw.is_null() {
        let message = if err.is_null() {
            "no tensor over the payload".to_owned()
        } else {
            // SAFETY: a NUL-terminated message the shim allocated.
            let text = unsafe { std::ffi::CStr::from_ptr(err) }.to_string_lossy().into_owned();
            // SAFETY: that message, freed once, here.
            unsafe { djinn_free_message(err) };
            text
        };
        return Err(ExecError::Internal(message));
    }
    // SAFETY: a new `at::Tensor*` the shim made, which the `Tensor` owns from here.
    let bytes = unsafe { Tensor::from_ptr(raw.cast()) };
    Ok(bytes.f_view_dtype(kind)?.f_view(shape)?)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    static RELEASED: AtomicUsize = AtomicUsize::new(0);

    struct Owner(Vec<u8>);

    impl Drop for Owner {
        fn drop(&mut self) {
            RELEASED.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A view is charged for the storage it keeps alive, each storage once.
    #[test]
    fn tensors_hold_the_storages_they_view() {
        let big = Tensor::zeros([1 << 20], (Kind::Float, tch::Device::Cpu));
        let slice = big.narrow(0, 10, 1);
        assert_eq!(held_bytes([&slice]), 4 << 20);
        assert_eq!(held_bytes([&slice, &big, &big.narrow(0, 0, 2)]), 4 << 20, "one storage, counted once");
        let other = Tensor::zeros([3], (Kind::Int64, tch::Device::Cpu));
        assert_eq!(held_bytes([&slice, &other]), (4 << 20) + 24);
        assert_eq!(held_bytes([&big.f_contiguous().unwrap().f_detach_copy().unwrap().narrow(0, 0, 1)]), 4 << 20);
        assert_eq!(held_bytes([&slice.f_detach_copy().unwrap()]), 4, "a copy holds only itself");
    }

    /// The memory outlives every reference of its own owner's: the tensors over it keep it, and
    /// it goes, once, with the last of them.
    #[test]
    fn an_owned_view_keeps_its_memory_until_the_last_tensor_over_it_goes() {
        let bytes: Vec<u8> = [1.5f32, -2.0, 3.25, 4.0, 5.0, 6.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let owner = Arc::new(Owner(bytes));
        let data = owner.0.as_ptr();
        // SAFETY: the Vec's heap memory does not move while `owner` lives.
        let t = unsafe { owned_view(Arc::clone(&owner), data, 24, &[2, 3], Kind::Float) }.unwrap();
        let clone = t.shallow_clone();
        let row = t.get(1);
        drop(owner);
        drop(t);
        drop(clone);
        assert_eq!(RELEASED.load(Ordering::SeqCst), 0, "a view of it is still alive");
        assert_eq!(Vec::<f32>::try_from(&row).unwrap(), [4.0, 5.0, 6.0]);
        drop(row);
        assert_eq!(RELEASED.load(Ordering::SeqCst), 1);
    }
}
