//! The node's one device-memory budget. Everything that holds device memory for a while (stored
//! tensors now; weights, the ring buffer, session state and parked requests later) takes a
//! [`Reservation`] first, so no feature can starve another unseen. On a host without CUDA the
//! "device" is host memory and the same budget applies.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("over the device-memory budget: {requested} bytes asked for, {used} of {limit} in use")]
pub struct OverBudget {
    pub requested: u64,
    pub used: u64,
    pub limit: u64,
}

#[derive(Clone)]
pub struct MemoryBudget {
    inner: Arc<Inner>,
}

struct Inner {
    limit: u64,
    used: AtomicU64,
}

impl MemoryBudget {
    pub fn new(limit: u64) -> Self {
        Self { inner: Arc::new(Inner { limit, used: AtomicU64::new(0) }) }
    }

    pub fn limit(&self) -> u64 {
        self.inner.limit
    }

    /// Bytes held by live reservations.
    pub fn used(&self) -> u64 {
        self.inner.used.load(Ordering::Acquire)
    }

    /// Takes `bytes` from the budget until the returned reservation is dropped.
    pub fn try_reserve(&self, bytes: u64) -> Result<Reservation, OverBudget> {
        let inner = &self.inner;
        inner
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= inner.limit)
            })
            .map(|_| Reservation { budget: Arc::clone(inner), bytes })
            .map_err(|used| OverBudget { requested: bytes, used, limit: inner.limit })
    }
}

impl fmt::Debug for MemoryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryBudget").field("limit", &self.limit()).field("used", &self.used()).finish()
    }
}

/// Bytes taken from a [`MemoryBudget`]; given back on drop.
pub struct Reservation {
    budget: Arc<Inner>,
    bytes: u64,
}

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation").field("bytes", &self.bytes).finish()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the order of reservations and releases, `used` is the sum of the live ones
        /// and never exceeds the limit.
        #[test]
        fn used_is_the_sum_of_live_reservations(ops in prop::collection::vec((any::<bool>(), 0u64..400), 0..64)) {
            let budget = MemoryBudget::new(1000);
            let mut live: Vec<Reservation> = Vec::new();
            for (reserve, n) in ops {
                if reserve {
                    let before = budget.used();
                    match budget.try_reserve(n) {
                        Ok(r) => live.push(r),
                        Err(e) => prop_assert!(before + n > 1000 && e.used == before),
                    }
                } else if !live.is_empty() {
                    live.swap_remove(n as usize % live.len());
                }
                prop_assert_eq!(budget.used(), live.iter().map(Reservation::bytes).sum::<u64>());
                prop_assert!(budget.used() <= 1000);
            }
        }
    }
}
