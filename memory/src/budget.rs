//! The node's one device-memory budget. Everything that holds device memory for a while (stored
//! tensors, weights, session state, parked requests) takes a [`Reservation`] first, so no
//! feature can starve another unseen. On a host without CUDA the "device" is host memory and the
//! same budget applies.
//!
//! A reservation may also be charged to a tenant, whose quota bounds its charges; a tenant's
//! share of weights other tenants hold too is a charge alone (the bytes are in the budget once).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use djinn_auth::TenantId;

use djinn_sync::Locked;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {requested} bytes asked for, {used} of {limit} in use", match tenant {
    Some(t) => format!("over {t}'s memory quota"),
    None => "over the memory budget".to_owned(),
})]
pub struct OverBudget {
    pub requested: u64,
    pub used: u64,
    pub limit: u64,
    /// Set when it is this tenant's quota that is full, not the node's budget.
    pub tenant: Option<TenantId>,
}

/// Each tenant's bound on a budget (`None`: only the budget's own limit).
pub type TenantQuota = Arc<dyn Fn(TenantId) -> Option<u64> + Send + Sync>;

#[derive(Clone)]
pub struct MemoryBudget {
    inner: Arc<Inner>,
}

struct Inner {
    limit: u64,
    used: AtomicU64,
    /// Bytes charged to each tenant (an entry goes when it falls to zero).
    tenants: Mutex<HashMap<TenantId, u64>>,
    quota: Option<TenantQuota>,
}

impl Inner {
    fn tenants(&self) -> MutexGuard<'_, HashMap<TenantId, u64>> {
        self.tenants.locked()
    }

    fn uncharge(&self, tenant: TenantId, bytes: u64) {
        let mut tenants = self.tenants();
        if let Some(used) = tenants.get_mut(&tenant) {
            *used -= bytes;
            if *used == 0 {
                tenants.remove(&tenant);
            }
        }
    }
}

impl MemoryBudget {
    pub fn new(limit: u64) -> Self {
        Self::build(limit, None)
    }

    /// A budget in which each tenant may also hold no more than `quota` says.
    pub fn with_quotas(limit: u64, quota: TenantQuota) -> Self {
        Self::build(limit, Some(quota))
    }

    fn build(limit: u64, quota: Option<TenantQuota>) -> Self {
        Self { inner: Arc::new(Inner { limit, used: AtomicU64::new(0), tenants: Mutex::default(), quota }) }
    }

    pub fn limit(&self) -> u64 {
        self.inner.limit
    }

    /// Bytes held by live reservations.
    pub fn used(&self) -> u64 {
        self.inner.used.load(Ordering::Acquire)
    }

    /// Bytes charged to `tenant`.
    pub fn used_by(&self, tenant: TenantId) -> u64 {
        self.inner.tenants().get(&tenant).copied().unwrap_or(0)
    }

    /// `tenant`'s quota, if it has one.
    pub fn quota(&self, tenant: TenantId) -> Option<u64> {
        self.inner.quota.as_ref().and_then(|q| q(tenant))
    }

    /// What `tenant` may hold while others want memory too: the limit split evenly between
    /// the tenants holding some (`tenant` counted among them).
    pub fn fair_share(&self, tenant: TenantId) -> u64 {
        let tenants = self.inner.tenants();
        let holders = tenants.len() as u64 + u64::from(!tenants.contains_key(&tenant));
        self.inner.limit / holders
    }

    /// Takes `bytes` from the budget, charged to nobody, until the returned reservation is
    /// dropped.
    pub fn try_reserve(&self, bytes: u64) -> Result<Reservation, OverBudget> {
        self.take_global(bytes)?;
        Ok(Reservation { budget: Arc::clone(&self.inner), bytes, tenant: None })
    }

    /// Takes `bytes` from the budget and from `tenant`'s quota.
    pub fn try_reserve_for(&self, tenant: TenantId, bytes: u64) -> Result<Reservation, OverBudget> {
        self.take_for(tenant, bytes, true)?;
        Ok(Reservation { budget: Arc::clone(&self.inner), bytes, tenant: Some(tenant) })
    }

    /// Charges `bytes` to `tenant`'s quota without taking them from the budget: its share of
    /// memory someone else already reserved (weights it holds with other tenants).
    pub fn charge(&self, tenant: TenantId, bytes: u64) -> Result<Charge, OverBudget> {
        self.take_for(tenant, bytes, false)?;
        Ok(Charge { budget: Arc::clone(&self.inner), tenant, bytes })
    }

    /// Charges `bytes` to `tenant`, and takes them from the budget too when `global`.
    fn take_for(&self, tenant: TenantId, bytes: u64, global: bool) -> Result<(), OverBudget> {
        let inner = &self.inner;
        // Held across both checks, so two reservations of one tenant cannot both pass the
        // quota check.
        let mut tenants = inner.tenants();
        let used = tenants.get(&tenant).copied().unwrap_or(0);
        if let Some(quota) = self.quota(tenant)
            && used.checked_add(bytes).is_none_or(|total| total > quota)
        {
            return Err(OverBudget { requested: bytes, used, limit: quota, tenant: Some(tenant) });
        }
        if global {
            self.take_global(bytes)?;
        }
        *tenants.entry(tenant).or_default() += bytes;
        Ok(())
    }

    fn take_global(&self, bytes: u64) -> Result<(), OverBudget> {
        let inner = &self.inner;
        inner
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= inner.limit)
            })
            .map(drop)
            .map_err(|used| OverBudget { requested: bytes, used, limit: inner.limit, tenant: None })
    }
}

impl fmt::Debug for MemoryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryBudget").field("limit", &self.limit()).field("used", &self.used()).finish()
    }
}

/// Bytes taken from a [`MemoryBudget`] (and charged to a tenant, when it has one); given back
/// on drop.
pub struct Reservation {
    budget: Arc<Inner>,
    bytes: u64,
    tenant: Option<TenantId>,
}

impl Reservation {
    /// Bytes taken from the budget.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation").field("bytes", &self.bytes).field("tenant", &self.tenant).finish()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(tenant) = self.tenant {
            self.budget.uncharge(tenant, self.bytes);
        }
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Bytes charged to a tenant's quota alone (see [`MemoryBudget::charge`]); given back on drop.
pub struct Charge {
    budget: Arc<Inner>,
    tenant: TenantId,
    bytes: u64,
}

impl fmt::Debug for Charge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Charge").field("tenant", &self.tenant).field("bytes", &self.bytes).finish()
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.uncharge(self.tenant, self.bytes);
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

        /// With tenants: each tenant's charge is the sum of its live reservations and charges
        /// and stays within its quota; the budget counts only reservations.
        #[test]
        fn tenant_charges_stay_within_quotas(ops in prop::collection::vec((0u8..4, 0u32..3, 0u64..400), 0..64)) {
            let quota: TenantQuota = Arc::new(|t: TenantId| (t.0 != 0).then_some(300 * u64::from(t.0)));
            let budget = MemoryBudget::with_quotas(1000, quota);
            // A reservation, or a charge alone.
            let mut live: Vec<(u32, bool, u64, Result<Reservation, Charge>)> = Vec::new();
            for (op, tenant, n) in ops {
                let t = TenantId(tenant);
                match op {
                    0 | 1 => {
                        let global = op == 0;
                        let before = (budget.used(), budget.used_by(t));
                        let got = if global { budget.try_reserve_for(t, n).map(Ok) } else { budget.charge(t, n).map(Err) };
                        match got {
                            Ok(r) => live.push((tenant, global, n, r)),
                            Err(e) => {
                                let over_quota = tenant != 0 && before.1 + n > 300 * u64::from(tenant);
                                prop_assert_eq!(e.tenant.is_some(), over_quota);
                                prop_assert!(over_quota || (global && before.0 + n > 1000));
                            }
                        }
                    }
                    2 => if !live.is_empty() { drop(live.swap_remove(n as usize % live.len())); },
                    _ => if let Ok(r) = budget.try_reserve(n) { live.push((u32::MAX, true, n, Ok(r))) },
                }
                prop_assert_eq!(budget.used(), live.iter().filter(|l| l.1).map(|l| l.2).sum::<u64>());
                prop_assert!(budget.used() <= 1000);
                for t in 0..3u32 {
                    let charged = live.iter().filter(|l| l.0 == t).map(|l| l.2).sum::<u64>();
                    prop_assert_eq!(budget.used_by(TenantId(t)), charged);
                    prop_assert!(t == 0 || charged <= 300 * u64::from(t));
                }
            }
        }
    }

    #[test]
    fn the_fair_share_splits_the_limit_between_holders() {
        let budget = MemoryBudget::new(900);
        let (a, b, c) = (TenantId(1), TenantId(2), TenantId(3));
        assert_eq!(budget.fair_share(a), 900);
        let ra = budget.try_reserve_for(a, 10).unwrap();
        assert_eq!(budget.fair_share(a), 900);
        assert_eq!(budget.fair_share(b), 450);
        let _rb = budget.try_reserve_for(b, 10).unwrap();
        assert_eq!(budget.fair_share(c), 300);
        drop(ra);
        assert_eq!(budget.fair_share(a), 450);
        assert_eq!(budget.used_by(a), 0);
    }
}
