//! The CUDA pieces of Djinn nodes: device discovery that treats "no GPU" as a normal state, never
//! a panic; what streaming builds on (pinned memory, a copy stream, events); dma-buf export.
//! Host memory, the budget and the ring are in `djinn-memory`.

pub mod cuda;
pub mod device;
pub mod dmabuf;

pub use cuda::{CopyStream, CudaContext, Event, PinnedBuf};
pub use device::{CudaDevice, DeviceError, cuda_devices};
pub use dmabuf::{DeviceBuf, DmaBufError, export_dmabuf};
