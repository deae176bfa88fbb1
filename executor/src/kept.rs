//! The tensors kept on the node between requests (a model's outputs kept for the next call,
//! tensors uploaded once or pushed here by another node), by the ids of their handles. Whose
//! each is, what it is charged and how long it stays is the core's record
//! (`djinn-node-core`'s `kept.rs`), which says when to free them: a handle reaches the executor
//! only once the core has checked it is the tenant's.

use std::collections::HashMap;
use std::hash::BuildHasher;

use djinn_node_core::HandleError;
use djinn_proto::{Handle, HandleInfo};
use tch::Tensor;

use crate::error::ExecError;
use crate::tensors::describe;

pub(crate) struct KeptTensors {
    /// This executor's life: what its handles carry.
    epoch: u64,
    next_id: u64,
    tensors: HashMap<u64, Tensor>,
}

impl std::fmt::Debug for KeptTensors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeptTensors")
            .field("epoch", &format_args!("{:016x}", self.epoch))
            .field("kept", &self.tensors.len())
            .finish()
    }
}

impl KeptTensors {
    /// None kept yet; handles of `space`.
    pub fn new(space: HandleSpace) -> Self {
        Self { epoch: space.epoch, next_id: space.first_id, tensors: HashMap::new() }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Keeps `tensor`: its handle and descriptor, for the core to record.
    pub fn keep(&mut self, tensor: Tensor) -> Result<HandleInfo, ExecError> {
        let desc = describe(&tensor)?;
        let handle = Handle { id: self.next_id, epoch: self.epoch };
        self.next_id += 1;
        self.tensors.insert(handle.id, tensor);
        Ok(HandleInfo { handle, tensor: desc })
    }

    /// The kept tensor (sharing its memory).
    pub fn get(&self, handle: Handle) -> Result<Tensor, HandleError> {
        if handle.epoch != self.epoch {
            return Err(HandleError::Stale { handle, current: self.epoch });
        }
        // The core checked the handle when the request came; it was freed while the request
        // waited for a worker.
        self.tensors.get(&handle.id).map(Tensor::shallow_clone).ok_or(HandleError::Released { handle })
    }

    pub fn free(&mut self, ids: &[u64]) {
        for id in ids {
            self.tensors.remove(id);
        }
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }
}

/// The handles an executor makes (kept tensors, sessions, parked requests): their epoch, and
/// the first id of each kind. A node with one executor draws a fresh space; a node with an
/// executor per tenant gives each its own range of ids under the node's one epoch, so that no
/// two executors' handles are the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandleSpace {
    pub epoch: u64,
    pub first_id: u64,
}

impl HandleSpace {
    /// A fresh random epoch, ids from 1.
    pub fn fresh() -> Self {
        Self { epoch: fresh_epoch(), first_id: 1 }
    }
}

/// A random nonzero epoch: what tells this life of the executor's handles (kept tensors,
/// sessions, parked requests) from those of an earlier one. RandomState is keyed from the OS's
/// randomness once per process and differs per instance; the time and pid make two nodes
/// started together differ all the more.
pub(crate) fn fresh_epoch() -> u64 {
    let seed = (std::time::SystemTime::now(), std::process::id());
    std::collections::hash_map::RandomState::new().hash_one(seed).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use djinn_proto::ErrorCode;
    use tch::{Device, Kind};

    #[test]
    fn a_kept_tensor_is_shared_until_freed() {
        let mut kept = KeptTensors::new(HandleSpace::fresh());
        let info = kept.keep(Tensor::ones([256], (Kind::Float, Device::Cpu))).unwrap();
        assert_eq!((info.tensor.byte_len, info.handle.epoch), (1024, kept.epoch()));
        assert_eq!(kept.get(info.handle).unwrap().sum(Kind::Float).double_value(&[]), 256.0);
        let other_life = Handle { epoch: kept.epoch() ^ 1, ..info.handle };
        assert_eq!(kept.get(other_life).unwrap_err().code(), ErrorCode::StaleHandle);
        kept.free(&[info.handle.id, info.handle.id, 99]);
        assert_eq!(kept.get(info.handle).unwrap_err(), HandleError::Released { handle: info.handle });
        assert_eq!(kept.len(), 0);
    }
}
