//! Tensors kept on the node between requests, named by handles: a model's outputs kept for the
//! next call, tensors uploaded once, tensors pushed here by another node. Each is charged to the
//! node's device-memory budget until it is released or lies unused for the idle time limit.
//! A handle names a tensor only for the tenant that kept it: to anyone else it is unknown.

use std::collections::HashMap;
use std::collections::hash_map::Entry as Slot;
use std::hash::BuildHasher;
use std::time::{Duration, Instant};

use djinn_auth::TenantId;
use djinn_memory::{MemoryBudget, Reservation};
use djinn_proto::{Handle, HandleInfo, TensorDesc};
use tch::Tensor;

use crate::error::{ExecError, HandleError};
use crate::tensors::describe;

struct Entry {
    tenant: TenantId,
    tensor: Tensor,
    desc: TensorDesc,
    last_used: Instant,
    /// What pays for the tensor's memory: a reservation of its own, or none for a CPU tensor
    /// over the received payload, which holds the payload and its charge (made when it was
    /// allocated) as long as any tensor over it lives.
    _reservation: Option<Reservation>,
    /// The entry's own charge (`MIN_CHARGE`), whatever its bytes.
    _bookkeeping: Reservation,
}

/// Where a tensor that was kept here went (pushed to another node and forwarded there).
struct Forwarded {
    tenant: TenantId,
    to: String,
    kept: HandleInfo,
    /// When it was last asked for: it is forgotten after the idle time limit.
    last_used: Instant,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counters {
    kept: u64,
    released: u64,
    expired: u64,
    moved_out: u64,
}

pub struct HandleTable {
    epoch: u64,
    next_id: u64,
    entries: HashMap<u64, Entry>,
    budget: MemoryBudget,
    idle_ttl: Duration,
    bytes: u64,
    counters: Counters,
    /// Tensors that went to other nodes, by the id of their handle here: requests naming them
    /// are told where they went. Counted in `held` like the entries they replaced.
    moved: HashMap<u64, Forwarded>,
    /// Entries and forwards per tenant, each at most `MAX_OBJECTS_PER_TENANT`.
    held: HashMap<TenantId, usize>,
}

impl std::fmt::Debug for HandleTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandleTable")
            .field("epoch", &format_args!("{:016x}", self.epoch))
            .field("kept", &self.entries.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl HandleTable {
    /// A table with a fresh random epoch.
    pub fn new(budget: MemoryBudget, idle_ttl: Duration) -> Self {
        Self::with_epoch(fresh_epoch(), budget, idle_ttl)
    }

    pub fn with_epoch(epoch: u64, budget: MemoryBudget, idle_ttl: Duration) -> Self {
        Self {
            epoch,
            next_id: 1,
            entries: HashMap::new(),
            budget,
            idle_ttl,
            bytes: 0,
            counters: Counters::default(),
            moved: HashMap::new(),
            held: HashMap::new(),
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Keeps `tensor` for `tenant`, charging its bytes to the budget.
    pub fn keep(&mut self, tenant: TenantId, tensor: Tensor) -> Result<HandleInfo, ExecError> {
        let desc = describe(&tensor)?;
        let reservation = self.budget.try_reserve_for(tenant, desc.byte_len)?;
        self.insert(tenant, tensor, desc, Some(reservation))
    }

    /// Keeps a CPU tensor over a received payload, whose reservation pays for it.
    pub fn keep_view(&mut self, tenant: TenantId, tensor: Tensor) -> Result<HandleInfo, ExecError> {
        let desc = describe(&tensor)?;
        self.insert(tenant, tensor, desc, None)
    }

    fn insert(
        &mut self,
        tenant: TenantId,
        tensor: Tensor,
        desc: TensorDesc,
        reservation: Option<Reservation>,
    ) -> Result<HandleInfo, ExecError> {
        let held = self.held.get(&tenant).copied().unwrap_or(0);
        if held >= crate::MAX_OBJECTS_PER_TENANT {
            return Err(ExecError::TooMany(format!(
                "this tenant keeps {held} tensors on the node, the most one tenant may: release some first"
            )));
        }
        let bookkeeping = self.budget.try_reserve_for(tenant, crate::MIN_CHARGE)?;
        *self.held.entry(tenant).or_default() += 1;
        let handle = Handle { id: self.next_id, epoch: self.epoch };
        self.next_id += 1;
        self.bytes += desc.byte_len;
        self.counters.kept += 1;
        let entry = Entry {
            tenant,
            tensor,
            desc: desc.clone(),
            last_used: Instant::now(),
            _reservation: reservation,
            _bookkeeping: bookkeeping,
        };
        self.entries.insert(handle.id, entry);
        Ok(HandleInfo { handle, tensor: desc })
    }

    fn forget(held: &mut HashMap<TenantId, usize>, tenant: TenantId) {
        if let Slot::Occupied(mut n) = held.entry(tenant) {
            *n.get_mut() -= 1;
            if *n.get() == 0 {
                n.remove();
            }
        }
    }

    /// The kept tensor (sharing its memory) and its descriptor, when `tenant` kept it.
    pub fn get(&mut self, tenant: TenantId, handle: Handle) -> Result<(Tensor, TensorDesc), HandleError> {
        if handle.epoch != self.epoch {
            return Err(HandleError::Stale { handle, current: self.epoch });
        }
        if let Some(entry) = self.entries.get_mut(&handle.id).filter(|e| e.tenant == tenant) {
            entry.last_used = Instant::now();
            return Ok((entry.tensor.shallow_clone(), entry.desc.clone()));
        }
        match self.moved.get_mut(&handle.id).filter(|m| m.tenant == tenant) {
            Some(m) => {
                m.last_used = Instant::now();
                Err(HandleError::Moved { handle, to: m.to.clone(), kept: m.kept.clone() })
            }
            None => Err(HandleError::Unknown { handle, idle_ttl: self.idle_ttl }),
        }
    }

    /// The tensor under `handle` is kept at the node at `to` now, as `kept`: it is freed here,
    /// and requests that name it are told where it went until it is released here or lies
    /// unasked for the idle time limit.
    pub fn forward(
        &mut self,
        tenant: TenantId,
        handle: Handle,
        to: String,
        kept: HandleInfo,
    ) -> Result<(), HandleError> {
        drop(self.get(tenant, handle)?);
        if let Some(entry) = self.entries.remove(&handle.id) {
            self.bytes -= entry.desc.byte_len;
        }
        self.counters.moved_out += 1;
        self.moved.insert(handle.id, Forwarded { tenant, to, kept, last_used: Instant::now() });
        Ok(())
    }

    /// The kept tensors (`tenant`'s only, when given) whose ids come after `after`, in order, a
    /// page of [`crate::LIST_PAGE`] at most: whose, by handle; and whether more remain.
    pub fn list(&self, tenant: Option<TenantId>, after: u64) -> (Vec<(TenantId, HandleInfo)>, bool) {
        let theirs = self.entries.iter().filter(|(_, e)| tenant.is_none_or(|t| e.tenant == t));
        let (ids, more) = crate::page(theirs.map(|(&id, _)| id), after);
        let listed = ids
            .into_iter()
            .filter_map(|id| self.entries.get(&id).map(|e| (id, e)))
            .map(|(id, e)| (e.tenant, HandleInfo { handle: Handle { id, epoch: self.epoch }, tensor: e.desc.clone() }))
            .collect();
        (listed, more)
    }

    /// Frees the handles this table holds for `tenant`; returns how many. Others (stale,
    /// unknown, another tenant's, repeated) are skipped: releasing is idempotent.
    pub fn release(&mut self, tenant: TenantId, handles: &[Handle]) -> u32 {
        let mut released = 0;
        for h in handles.iter().filter(|h| h.epoch == self.epoch) {
            if let Slot::Occupied(slot) = self.entries.entry(h.id)
                && slot.get().tenant == tenant
            {
                let entry = slot.remove();
                self.bytes -= entry.desc.byte_len;
                Self::forget(&mut self.held, tenant);
                released += 1;
            } else if let Slot::Occupied(slot) = self.moved.entry(h.id)
                && slot.get().tenant == tenant
            {
                // The forward goes; the tensor where it went stays until released there.
                slot.remove();
                Self::forget(&mut self.held, tenant);
            }
        }
        self.counters.released += u64::from(released);
        released
    }

    /// Frees what has not been used for the idle time limit; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let ttl = self.idle_ttl;
        let before = self.entries.len();
        let mut freed = 0;
        let held = &mut self.held;
        self.entries.retain(|_, e| {
            let keep = now.saturating_duration_since(e.last_used) < ttl;
            if !keep {
                freed += e.desc.byte_len;
                Self::forget(held, e.tenant);
            }
            keep
        });
        self.moved.retain(|_, m| {
            let keep = now.saturating_duration_since(m.last_used) < ttl;
            if !keep {
                Self::forget(held, m.tenant);
            }
            keep
        });
        let expired = before - self.entries.len();
        self.bytes -= freed;
        self.counters.expired += expired as u64;
        if expired > 0 {
            tracing::info!(expired, bytes = freed, "kept tensors expired unused");
        }
        expired
    }

    pub fn idle_ttl(&self) -> Duration {
        self.idle_ttl
    }

    pub fn stats(&self, out: &mut Vec<(String, u64)>) {
        out.extend(
            [
                ("handles", self.entries.len() as u64),
                ("handle_bytes", self.bytes),
                ("handles_kept", self.counters.kept),
                ("handles_released", self.counters.released),
                ("handles_expired", self.counters.expired),
                ("handles_moved_out", self.counters.moved_out),
            ]
            .map(|(k, v)| (k.to_owned(), v)),
        );
    }
}

/// A random nonzero epoch: what tells this life of the node's handles (kept tensors, sessions)
/// from those of an earlier one. RandomState is keyed from the OS's randomness once per process
/// and differs per instance; the time and pid make two nodes started together differ all the
/// more.
pub(crate) fn fresh_epoch() -> u64 {
    let seed = (std::time::SystemTime::now(), std::process::id());
    std::collections::hash_map::RandomState::new().hash_one(seed).max(1)
}

/// The wire descriptor of a tensor (its dtype and shape; contiguous bytes).
#[cfg(test)]
mod tests {
    use super::*;
    use djinn_proto::ErrorCode;
    use tch::{Device, Kind};

    const T: TenantId = TenantId(1);

    fn table(limit: u64, ttl: Duration) -> HandleTable {
        HandleTable::with_epoch(7, MemoryBudget::new(limit), ttl)
    }

    #[test]
    fn kept_tensors_are_charged_until_released() {
        let mut t = table(1 << 20, Duration::from_secs(60));
        let info = t.keep(T, Tensor::ones([256], (Kind::Float, Device::Cpu))).unwrap();
        assert_eq!(info.tensor.byte_len, 1024);
        assert_eq!(t.budget.used(), 1024 + crate::MIN_CHARGE, "its bytes and its bookkeeping");
        let (tensor, desc) = t.get(T, info.handle).unwrap();
        assert_eq!(desc, info.tensor);
        assert_eq!(tensor.sum(Kind::Float).double_value(&[]), 256.0);
        assert_eq!(t.release(T, &[info.handle, info.handle]), 1, "a second release is a no-op");
        assert_eq!(t.budget.used(), 0);
        assert!(matches!(t.get(T, info.handle), Err(HandleError::Unknown { .. })));
    }

    #[test]
    fn a_forwarded_handle_says_where_its_tensor_went_until_released_or_expired() {
        let mut t = table(1 << 20, Duration::from_millis(100));
        let ones = || Tensor::ones([256], (Kind::Float, Device::Cpu));
        let info = t.keep(T, ones()).unwrap();
        let there = HandleInfo { handle: Handle { id: 9, epoch: 3 }, tensor: info.tensor.clone() };
        let other = t.forward(TenantId(2), info.handle, "b:1".into(), there.clone());
        assert!(matches!(other, Err(HandleError::Unknown { .. })), "only its tenant forwards it");
        t.forward(T, info.handle, "b:1".into(), there.clone()).unwrap();
        assert_eq!((t.budget.used(), t.bytes), (0, 0), "freed here");
        let moved = HandleError::Moved { handle: info.handle, to: "b:1".into(), kept: there.clone() };
        assert_eq!(t.get(T, info.handle).unwrap_err(), moved);
        assert!(matches!(t.get(TenantId(2), info.handle), Err(HandleError::Unknown { .. })));
        assert!(t.list(None, 0).0.is_empty(), "nothing is kept here");
        assert_eq!(t.held.get(&T), Some(&1), "a forward counts toward the tenant's objects");
        assert_eq!(t.release(T, &[info.handle]), 0, "nothing was held here to free");
        assert!(matches!(t.get(T, info.handle), Err(HandleError::Unknown { .. })));
        assert_eq!(t.held.get(&T), None);
        // Unasked for the idle time limit, a forward goes.
        let info = t.keep(T, ones()).unwrap();
        t.forward(T, info.handle, "b:1".into(), there).unwrap();
        t.expire(Instant::now() + Duration::from_millis(200));
        assert!(matches!(t.get(T, info.handle), Err(HandleError::Unknown { .. })));
        assert_eq!(t.held.get(&T), None);
    }

    #[test]
    fn a_list_comes_in_pages_of_the_tenants_own_in_order() {
        let mut t = table(1 << 30, Duration::from_secs(60));
        let one = || Tensor::ones([1], (Kind::Float, Device::Cpu));
        let other = TenantId(2);
        let mut mine = Vec::new();
        for i in 0..crate::LIST_PAGE + 5 {
            mine.push(t.keep(T, one()).unwrap().handle);
            if i % 500 == 0 {
                t.keep(other, one()).unwrap();
            }
        }
        let (first, more) = t.list(Some(T), 0);
        assert!(more && first.len() == crate::LIST_PAGE);
        let (rest, more) = t.list(Some(T), first.last().unwrap().1.handle.id);
        assert!(!more && rest.len() == 5);
        let listed: Vec<Handle> = first.iter().chain(&rest).map(|(_, k)| k.handle).collect();
        assert_eq!(listed, mine, "all of the tenant's, each once, in order");
        let (all, _) = t.list(None, 0);
        assert_eq!(all.iter().filter(|(owner, _)| *owner == other).count(), 3, "an operator's list has every tenant's");
    }

    #[test]
    fn another_tenants_handle_is_unknown_to_it() {
        let mut t = table(1 << 20, Duration::from_secs(60));
        let info = t.keep(T, Tensor::ones([4], (Kind::Float, Device::Cpu))).unwrap();
        let other = TenantId(2);
        let e = t.get(other, info.handle).unwrap_err();
        assert_eq!(e, HandleError::Unknown { handle: info.handle, idle_ttl: Duration::from_secs(60) });
        assert_eq!(t.release(other, &[info.handle]), 0);
        assert!(t.get(T, info.handle).is_ok(), "another tenant's release left it kept");
    }

    #[test]
    fn a_handle_of_another_epoch_is_stale_not_unknown() {
        let mut t = table(1 << 20, Duration::from_secs(60));
        let info = t.keep(T, Tensor::ones([4], (Kind::Float, Device::Cpu))).unwrap();
        let old = Handle { epoch: 6, ..info.handle };
        let e = t.get(T, old).unwrap_err();
        assert_eq!(e.code(), ErrorCode::StaleHandle);
        assert!(e.to_string().contains("earlier life"), "{e}");
        assert_eq!(t.release(T, &[old]), 0, "a stale handle frees nothing of this life");
        assert!(t.get(T, info.handle).is_ok());
    }

    #[test]
    fn over_the_budget_is_refused_and_nothing_is_kept() {
        let mut t = table(1000, Duration::from_secs(60));
        let e = t.keep(T, Tensor::ones([256], (Kind::Float, Device::Cpu))).unwrap_err();
        assert_eq!(e.code(), ErrorCode::OverBudget);
        assert_eq!((t.entries.len(), t.budget.used(), t.bytes), (0, 0, 0));
    }

    #[test]
    fn unused_tensors_expire_and_used_ones_stay() {
        let mut t = table(1 << 20, Duration::from_millis(100));
        let a = t.keep(T, Tensor::ones([4], (Kind::Float, Device::Cpu))).unwrap();
        let b = t.keep(T, Tensor::ones([4], (Kind::Float, Device::Cpu))).unwrap();
        let later = Instant::now() + Duration::from_millis(60);
        assert_eq!(t.expire(later), 0);
        t.entries.get_mut(&b.handle.id).unwrap().last_used = later;
        assert_eq!(t.expire(later + Duration::from_millis(60)), 1);
        assert!(matches!(t.get(T, a.handle), Err(HandleError::Unknown { .. })));
        assert!(t.get(T, b.handle).is_ok());
        assert_eq!(t.budget.used(), 16 + crate::MIN_CHARGE);
        assert_eq!(t.held.get(&T), Some(&1));
    }

    #[test]
    fn empty_tensors_are_charged_and_counted() {
        let mut t = table(3 * crate::MIN_CHARGE, Duration::from_secs(60));
        let empty = || Tensor::zeros([0], (Kind::Float, Device::Cpu));
        let kept: Vec<_> = (0..3).map(|_| t.keep(T, empty()).unwrap().handle).collect();
        assert_eq!(t.keep(T, empty()).unwrap_err().code(), ErrorCode::OverBudget, "a page each, however empty");
        assert_eq!(t.release(T, &kept), 3);
        assert_eq!((t.budget.used(), t.held.get(&T)), (0, None));

        let mut t = table(u64::MAX / 2, Duration::from_secs(60));
        for _ in 0..crate::MAX_OBJECTS_PER_TENANT {
            t.keep(T, empty()).unwrap();
        }
        let e = t.keep(T, empty()).unwrap_err();
        assert_eq!(e.code(), ErrorCode::QuotaExceeded, "{e}");
        assert!(t.keep(TenantId(2), empty()).is_ok(), "another tenant's count is its own");
    }
}
