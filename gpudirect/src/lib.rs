//! Memory for Djinn nodes: host buffers and their pool, the node's device-memory budget, the
//! skip-end ring's placement rules, the CUDA pieces streaming builds on (pinned memory, a copy
//! stream, events), and CUDA device discovery that treats "no GPU" as a normal state, never a
//! panic.

pub mod budget;
pub mod cuda;
pub mod device;
pub mod dmabuf;
pub mod host;
pub mod ring;
mod size;

pub use budget::{Charge, MemoryBudget, OverBudget, Reservation, TenantQuota};
pub use cuda::{CopyStream, CudaContext, Event, PinnedBuf};
pub use device::{CudaDevice, DeviceError, cuda_devices};
pub use dmabuf::{DeviceBuf, DmaBufError, export_dmabuf};
pub use host::{AllocError, BUFFER_ALIGN, BufferPool, HostBuf, PoolStats, align_for};
pub use ring::{BlockTooLarge, SLOT_ALIGN, SkipEndRing, Slot};
pub use size::ByteSize;

/// How a node's device memory meets the network. Only one path is built: staging, where the
/// bytes of a device tensor go through host memory (copied there before a send, from there
/// after a receive; on a CPU-only node they are there already). Registering GPU memory with the
/// RDMA device (dma-buf, then nvidia-peermem) is not built yet, so no node reports it.
pub const MEMORY_PATH: &str = "staging";
