//! Host memory for Djinn nodes and clients, with no CUDA in it: host buffers and their pool, the
//! node's device-memory budget and tenants' quotas, the skip-end ring's placement rules, byte
//! sizes. The wire protocol builds on these, so they stay free of any device or I/O dependency.

pub mod budget;
pub mod host;
pub mod ring;
mod size;

pub use budget::{Charge, MemoryBudget, OverBudget, Reservation, TenantQuota};
pub use host::{AllocError, BUFFER_ALIGN, BufferPool, HostBuf, PoolStats, align_for};
pub use ring::{BlockTooLarge, SLOT_ALIGN, SkipEndRing, Slot};
pub use size::ByteSize;
