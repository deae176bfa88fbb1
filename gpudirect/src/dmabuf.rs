//! Device memory owned outright (not libtorch's allocator) and its export as a dma-buf: the
//! file descriptor a NIC registers (`ibv_reg_dmabuf_mr`) to read and write GPU memory without
//! a host copy. Registration itself is not built yet (see `djinn_dataplane::MEMORY_PATH`); what is here
//! lets a host say whether its driver and kernel can do the first half.

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::{result, sys};

use crate::cuda::CudaContext;
use crate::device::DeviceError;

/// `len` bytes of device memory from `cuMemAlloc`, freed on drop.
#[derive(Debug)]
pub struct DeviceBuf {
    ptr: sys::CUdeviceptr,
    len: usize,
    context: Arc<CudaContext>,
}

impl DeviceBuf {
    pub fn alloc(context: &Arc<CudaContext>, len: usize) -> Result<Self, DeviceError> {
        context.bind()?;
        // SAFETY: a plain allocation in the bound context; freed once, in `drop`.
        let ptr = unsafe { result::malloc_sync(len.max(1)) }
            .map_err(|source| DeviceError { during: "cuMemAlloc", source })?;
        Ok(Self { ptr, len, context: Arc::clone(context) })
    }

    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` to the start of the buffer (synchronous, pageable).
    pub fn write(&mut self, src: &[u8]) -> Result<(), DeviceError> {
        assert!(src.len() <= self.len, "{} bytes into a {}-byte buffer", src.len(), self.len);
        self.context.bind()?;
        // SAFETY: the buffer holds at least `src.len()` bytes and is not read meanwhile.
        unsafe { result::memcpy_htod_sync(self.ptr, src) }
            .map_err(|source| DeviceError { during: "cuMemcpyHtoD", source })
    }

    /// Copies the start of the buffer into `dst` (synchronous, pageable).
    pub fn read(&self, dst: &mut [u8]) -> Result<(), DeviceError> {
        assert!(dst.len() <= self.len, "{} bytes from a {}-byte buffer", dst.len(), self.len);
        self.context.bind()?;
        // SAFETY: as in `write`, the other way.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr) }
            .map_err(|source| DeviceError { during: "cuMemcpyDtoH", source })
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        if self.context.bind().is_ok() {
            // SAFETY: allocated in `alloc`; synchronous copies only, none pending.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Why a device allocation could not be exported as a dma-buf.
#[derive(Debug, thiserror::Error)]
pub enum DmaBufError {
    /// The driver or the kernel cannot (the device attribute says so, or the call does): an
    /// old kernel, a sandbox such as gVisor, or a driver without the feature.
    #[error("dma-buf export is unsupported here: {0}")]
    Unsupported(String),
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// Exports all of `buf` as a dma-buf file descriptor (closed when the result drops).
pub fn export_dmabuf(buf: &DeviceBuf) -> Result<OwnedFd, DmaBufError> {
    buf.context.bind()?;
    // SAFETY: `device` is the context's own device.
    let supported = unsafe {
        result::device::get_attribute(
            buf.context.device(),
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
        )
    }
    .map_err(|source| DeviceError { during: "cuDeviceGetAttribute", source })?;
    if supported == 0 {
        return Err(DmaBufError::Unsupported("the device reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0".into()));
    }
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: `buf` is one live allocation of `len` bytes (cuMemAlloc aligns it to the
    // allocation granularity, which dma-buf export needs); `fd` receives an int.
    let rc = unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut std::ffi::c_int).cast(),
            buf.ptr,
            buf.len,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    };
    match rc {
        sys::cudaError_enum::CUDA_SUCCESS if fd >= 0 => {
            // SAFETY: a descriptor the driver just opened for us and nothing else owns.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        }
        sys::cudaError_enum::CUDA_ERROR_NOT_SUPPORTED => {
            Err(DmaBufError::Unsupported(format!("cuMemGetHandleForAddressRange: {rc:?}")))
        }
        other => {
            Err(DeviceError { during: "cuMemGetHandleForAddressRange", source: result::DriverError(other) }.into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[ignore = "needs a CUDA device: run by gpu-suite.sh (cargo test -- --ignored on a GPU host)"]
    fn device_memory_round_trips_and_exports_as_a_dmabuf_where_the_platform_can() {
        let context = CudaContext::primary(0).unwrap();
        let mut buf = DeviceBuf::alloc(&context, 2 << 20).unwrap();
        let bytes: Vec<u8> = (0..buf.len()).map(|i| (i % 253) as u8).collect();
        buf.write(&bytes).unwrap();
        let mut back = vec![0u8; bytes.len()];
        buf.read(&mut back).unwrap();
        assert_eq!(back, bytes);
        match export_dmabuf(&buf) {
            Ok(fd) => {
                // A real descriptor: fstat answers for it.
                let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
                // SAFETY: a descriptor we own and a buffer of the size fstat writes.
                let rc = unsafe { libc::fstat(std::os::fd::AsRawFd::as_raw_fd(&fd), stat.as_mut_ptr()) };
                assert_eq!(rc, 0, "fstat on the dma-buf: {}", std::io::Error::last_os_error());
            }
            // gVisor and old kernels: a property of the host, reported by gpu-check.
            Err(DmaBufError::Unsupported(why)) => eprintln!("dma-buf unsupported here: {why}"),
            Err(e) => panic!("{e}"),
        }
    }
}
