//! The CUDA pieces that weight streaming (and later GPUDirect) build on: a device's primary
//! context (the one libtorch's runtime uses, so pointers and events are shared with it), pinned
//! host memory, a copy stream and events. Driver API through cudarc, loaded dynamically; every
//! call binds the context first, since the calling thread (an executor worker) may not have.
//!
//! libtorch runs a node's forwards on the legacy default stream (the node never sets another
//! stream), so "torch's stream" here is the null stream.

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{result, sys};

use crate::device::DeviceError;

fn failed(during: &'static str) -> impl FnOnce(result::DriverError) -> DeviceError {
    move |source| DeviceError { during, source }
}

/// A device's primary context, retained for as long as this lives.
#[derive(Debug)]
pub struct CudaContext {
    device: sys::CUdevice,
    context: sys::CUcontext,
}

// SAFETY: a CUcontext handle may be made current on any thread.
unsafe impl Send for CudaContext {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for CudaContext {}

impl CudaContext {
    /// The primary context of device `ordinal`; an error (never a panic) without a driver.
    pub fn primary(ordinal: i32) -> Result<Arc<Self>, DeviceError> {
        // SAFETY: only probes whether the driver library can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err(DeviceError {
                during: "loading libcuda",
                source: result::DriverError(sys::cudaError_enum::CUDA_ERROR_NO_DEVICE),
            });
        }
        result::init().map_err(failed("cuInit"))?;
        let device = result::device::get(ordinal).map_err(failed("cuDeviceGet"))?;
        // SAFETY: `device` was returned by cuDeviceGet.
        let context = unsafe { result::primary_ctx::retain(device) }.map_err(failed("cuDevicePrimaryCtxRetain"))?;
        Ok(Arc::new(Self { device, context }))
    }

    pub(crate) fn device(&self) -> sys::CUdevice {
        self.device
    }

    pub(crate) fn bind(&self) -> Result<(), DeviceError> {
        // SAFETY: the context is retained until `self` drops.
        unsafe { result::ctx::set_current(self.context) }.map_err(failed("cuCtxSetCurrent"))
    }
}

impl Drop for CudaContext {
    fn drop(&mut self) {
        // SAFETY: retained once in `primary`, released once here.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

/// Page-locked host memory, zeroed: the source of copies that run at the link's full rate and
/// asynchronously to the host.
pub struct PinnedBuf {
    ptr: NonNull<u8>,
    len: usize,
    context: Arc<CudaContext>,
}

// SAFETY: the unique owner of its memory.
unsafe impl Send for PinnedBuf {}
// SAFETY: shared access only reads.
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    pub fn zeroed(context: &Arc<CudaContext>, len: usize) -> Result<Self, DeviceError> {
        context.bind()?;
        // SAFETY: a plain allocation (flags 0); its contents are zeroed below before any read.
        let ptr = unsafe { result::malloc_host(len.max(1), 0) }.map_err(failed("cuMemHostAlloc"))?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(DeviceError {
            during: "cuMemHostAlloc",
            source: result::DriverError(sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY),
        })?;
        // SAFETY: `len` bytes (at least) were just allocated.
        unsafe { ptr.as_ptr().write_bytes(0, len) };
        Ok(Self { ptr, len, context: Arc::clone(context) })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.context.bind().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc in `zeroed`; no copy reads it any more (its
            // owners wait for their copies before dropping it).
            let _ = unsafe { result::free_host(self.ptr.as_ptr().cast()) };
        }
    }
}

impl std::fmt::Debug for PinnedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuf").field("len", &self.len).finish()
    }
}

/// A point in a stream's work; complete once everything queued before it is.
#[derive(Debug)]
pub struct Event {
    event: sys::CUevent,
    context: Arc<CudaContext>,
}

// SAFETY: event handles may be used from any thread with their context bound.
unsafe impl Send for Event {}

impl Event {
    fn record(context: &Arc<CudaContext>, stream: sys::CUstream) -> Result<Self, DeviceError> {
        context.bind()?;
        let event =
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(failed("cuEventCreate"))?;
        let event = Self { event, context: Arc::clone(context) };
        // SAFETY: a live event and a live (or the null) stream of the bound context.
        unsafe { result::event::record(event.event, stream) }.map_err(failed("cuEventRecord"))?;
        Ok(event)
    }

    /// Recorded now on libtorch's stream: complete once the work torch has queued so far is.
    pub fn on_torch_stream(context: &Arc<CudaContext>) -> Result<Self, DeviceError> {
        Self::record(context, result::stream::null())
    }

    /// Blocks the calling thread until the event is complete.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.context.bind()?;
        // SAFETY: a live event.
        unsafe { result::event::synchronize(self.event) }.map_err(failed("cuEventSynchronize"))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.context.bind().is_ok() {
            // SAFETY: created in `record`; destroying a pending event is allowed (its resources
            // go when it completes).
            let _ = unsafe { result::event::destroy(self.event) };
        }
    }
}

/// A stream of host-to-device copies that runs beside libtorch's compute, ordered against it
/// only through events.
#[derive(Debug)]
pub struct CopyStream {
    stream: sys::CUstream,
    context: Arc<CudaContext>,
}

// SAFETY: stream handles may be used from any thread with their context bound.
unsafe impl Send for CopyStream {}

impl CopyStream {
    pub fn new(context: &Arc<CudaContext>) -> Result<Self, DeviceError> {
        context.bind()?;
        let stream =
            result::stream::create(result::stream::StreamKind::NonBlocking).map_err(failed("cuStreamCreate"))?;
        Ok(Self { stream, context: Arc::clone(context) })
    }

    /// Queues a copy of `len` bytes from `src` to device address `dst`; the returned event
    /// completes with it.
    ///
    /// # Safety
    /// `src` must be pinned host memory valid for `len` bytes, and `dst` device memory of this
    /// context valid for `len` bytes, both until the event completes; nothing may read `dst`
    /// before then, nor write `src`.
    pub unsafe fn copy_to_device(&self, dst: u64, src: *const u8, len: usize) -> Result<Event, DeviceError> {
        self.context.bind()?;
        // SAFETY: the caller's contract.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.stream) }
            .result()
            .map_err(failed("cuMemcpyHtoDAsync"))?;
        Event::record(&self.context, self.stream)
    }

    /// Work queued on this stream from now on starts only after `event` completes (the host
    /// does not wait).
    pub fn wait_for(&self, event: &Event) -> Result<(), DeviceError> {
        self.context.bind()?;
        // SAFETY: a live stream and a live event of the same context.
        unsafe { result::stream::wait_event(self.stream, event.event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(failed("cuStreamWaitEvent"))
    }
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        if self.context.bind().is_ok() {
            // SAFETY: created in `new`. Copies still queued finish first: their memory is only
            // released by owners that outlive this stream.
            unsafe {
                let _ = result::stream::synchronize(self.stream);
                let _ = result::stream::destroy(self.stream);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A round trip through pinned memory, the copy stream and an event.
    #[test]
    #[ignore = "needs a CUDA device: run by gpu-suite.sh (cargo test -- --ignored on a GPU host)"]
    fn a_copy_through_pinned_memory_reaches_the_device() {
        let context = CudaContext::primary(0).unwrap();
        let stream = CopyStream::new(&context).unwrap();
        let mut src = PinnedBuf::zeroed(&context, 1 << 20).unwrap();
        for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        context.bind().unwrap();
        // SAFETY: a fresh allocation of the bound context, freed below.
        let dst = unsafe { result::malloc_sync(src.len()) }.unwrap();
        // SAFETY: both ranges are 1 MiB and live until the event has completed.
        let done = unsafe { stream.copy_to_device(dst, src.as_slice().as_ptr(), src.len()) }.unwrap();
        done.synchronize().unwrap();
        let mut back = vec![0u8; src.len()];
        // SAFETY: `dst` holds `back.len()` bytes.
        unsafe { result::memcpy_dtoh_sync(&mut back, dst) }.unwrap();
        assert_eq!(back, src.as_slice());
        // SAFETY: allocated above, no work pending on it.
        unsafe { result::free_sync(dst) }.unwrap();
    }
}
