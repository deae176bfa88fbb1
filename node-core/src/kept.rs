//! The records of tensors kept on the node between requests, named by handles: a model's
//! outputs kept for the next call, tensors uploaded once, tensors pushed here by another node.
//! The tensors themselves are the executor's (by the id of their handle); what the core keeps
//! is whose each is, what it is charged, when it was last used and where it went. Each is
//! charged to the node's device-memory budget until it is released or lies unused for the idle
//! time limit. A handle names a tensor only for the tenant that kept it: to anyone else it is
//! unknown.

use std::collections::HashMap;
use std::collections::hash_map::Entry as Slot;
use std::time::{Duration, Instant};

use djinn_auth::TenantId;
use djinn_memory::{MemoryBudget, Reservation};
use djinn_proto::{ErrorCode, Handle, HandleInfo, Refusal, TensorDesc};

use crate::{MAX_OBJECTS_PER_TENANT, MIN_CHARGE};

/// Why a handle names nothing a request may use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandleError {
    #[error(
        "handle {handle} is from an earlier life of this node (its epoch is now {current:016x}): the node restarted and what it kept is gone"
    )]
    Stale { handle: Handle, current: u64 },
    #[error(
        "no tensor is kept under handle {handle} on this node: it was released, or expired after {idle_ttl:?} unused"
    )]
    Unknown { handle: Handle, idle_ttl: Duration },
    /// Checked when the request came, freed (released, expired) while it waited to run.
    #[error("the tensor under handle {handle} was released while a request that names it waited to run")]
    Released { handle: Handle },
    /// Answered with a `kept.Moved` reply, which clients follow.
    #[error("the tensor under handle {handle} is kept at {to} now, as {}", kept.handle)]
    Moved { handle: Handle, to: String, kept: HandleInfo },
}

impl HandleError {
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Stale { .. } => ErrorCode::StaleHandle,
            Self::Unknown { .. } | Self::Released { .. } | Self::Moved { .. } => ErrorCode::NotFound,
        }
    }
}

struct Record {
    tenant: TenantId,
    desc: TensorDesc,
    last_used: Instant,
    /// What pays for the tensor's memory: a reservation of its own, or none for a CPU tensor
    /// over the payload it arrived in, which holds its charge (made when it was allocated) as
    /// long as the tensor lives.
    _reservation: Option<Reservation>,
    /// The record's own charge ([`MIN_CHARGE`]), whatever its bytes.
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

/// The kept tensors of one life of the executor (its epoch), by the ids of their handles.
pub(crate) struct KeptTable {
    epoch: u64,
    records: HashMap<u64, Record>,
    budget: MemoryBudget,
    idle_ttl: Duration,
    bytes: u64,
    counters: Counters,
    /// Tensors that went to other nodes, by the id of their handle here: requests naming them
    /// are told where they went. Counted in `held` like the records they replaced.
    moved: HashMap<u64, Forwarded>,
    /// Records and forwards per tenant, each at most [`MAX_OBJECTS_PER_TENANT`].
    held: HashMap<TenantId, usize>,
    /// When the next sweep for what lies unused is due.
    next_sweep: Instant,
}

impl std::fmt::Debug for KeptTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeptTable")
            .field("epoch", &format_args!("{:016x}", self.epoch))
            .field("kept", &self.records.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl KeptTable {
    pub fn new(epoch: u64, budget: MemoryBudget, idle_ttl: Duration, now: Instant) -> Self {
        Self {
            epoch,
            records: HashMap::new(),
            budget,
            idle_ttl,
            bytes: 0,
            counters: Counters::default(),
            moved: HashMap::new(),
            held: HashMap::new(),
            next_sweep: now + crate::sweep_every(idle_ttl),
        }
    }

    /// Records the tensors the executor now keeps for `tenant` (`kept`), each charged to the
    /// budget (its bytes too, unless `in_place`: a tensor over the payload it arrived in,
    /// which carries its charge). All or none: on a refusal nothing is recorded.
    pub fn record(
        &mut self,
        tenant: TenantId,
        kept: &[HandleInfo],
        in_place: bool,
        now: Instant,
    ) -> Result<(), Refusal> {
        let held = self.held.get(&tenant).copied().unwrap_or(0);
        if held + kept.len() > MAX_OBJECTS_PER_TENANT {
            return Err(Refusal {
                code: ErrorCode::QuotaExceeded,
                message: format!(
                    "this tenant keeps {held} tensors on the node, the most one tenant may: release some first"
                ),
            });
        }
        let mut records = HashMap::with_capacity(kept.len());
        for info in kept {
            if info.handle.epoch != self.epoch
                || self.records.contains_key(&info.handle.id)
                || records.contains_key(&info.handle.id)
            {
                return Err(Refusal {
                    code: ErrorCode::Internal,
                    message: format!("the executor kept {} twice or in another life", info.handle),
                });
            }
            let reservation = match in_place {
                true => None,
                false => Some(self.budget.try_reserve_for(tenant, info.tensor.byte_len)?),
            };
            let bookkeeping = self.budget.try_reserve_for(tenant, MIN_CHARGE)?;
            let record = Record {
                tenant,
                desc: info.tensor.clone(),
                last_used: now,
                _reservation: reservation,
                _bookkeeping: bookkeeping,
            };
            records.insert(info.handle.id, record);
        }
        *self.held.entry(tenant).or_default() += records.len();
        self.counters.kept += records.len() as u64;
        for (id, record) in records {
            self.bytes += record.desc.byte_len;
            self.records.insert(id, record);
        }
        Ok(())
    }

    fn forget(held: &mut HashMap<TenantId, usize>, tenant: TenantId) {
        if let Slot::Occupied(mut n) = held.entry(tenant) {
            *n.get_mut() -= 1;
            if *n.get() == 0 {
                n.remove();
            }
        }
    }

    /// The descriptor of the tensor `handle` names, when `tenant` kept it; used at `now`.
    pub fn get(&mut self, tenant: TenantId, handle: Handle, now: Instant) -> Result<&TensorDesc, HandleError> {
        if handle.epoch != self.epoch {
            return Err(HandleError::Stale { handle, current: self.epoch });
        }
        if let Some(record) = self.records.get_mut(&handle.id).filter(|r| r.tenant == tenant) {
            record.last_used = now;
            return Ok(&record.desc);
        }
        match self.moved.get_mut(&handle.id).filter(|m| m.tenant == tenant) {
            Some(m) => {
                m.last_used = now;
                Err(HandleError::Moved { handle, to: m.to.clone(), kept: m.kept.clone() })
            }
            None => Err(HandleError::Unknown { handle, idle_ttl: self.idle_ttl }),
        }
    }

    /// The tensor under `handle` is kept at the node at `to` now, as `kept`: its record goes
    /// (the caller frees the tensor), and requests that name it are told where it went until it
    /// is released here or lies unasked for the idle time limit.
    pub fn forward(
        &mut self,
        tenant: TenantId,
        handle: Handle,
        to: String,
        kept: HandleInfo,
        now: Instant,
    ) -> Result<(), HandleError> {
        self.get(tenant, handle, now)?;
        if let Some(record) = self.records.remove(&handle.id) {
            self.bytes -= record.desc.byte_len;
        }
        self.counters.moved_out += 1;
        self.moved.insert(handle.id, Forwarded { tenant, to, kept, last_used: now });
        Ok(())
    }

    /// The kept tensors (`tenant`'s only, when given) whose ids come after `after`, in order, a
    /// page of [`crate::LIST_PAGE`] at most: whose, by handle; and whether more remain.
    pub fn list(&self, tenant: Option<TenantId>, after: u64) -> (Vec<(TenantId, HandleInfo)>, bool) {
        let theirs = self.records.iter().filter(|(_, r)| tenant.is_none_or(|t| r.tenant == t));
        let (ids, more) = crate::list_page(theirs.map(|(&id, _)| id), after);
        let listed = ids
            .into_iter()
            .filter_map(|id| self.records.get(&id).map(|r| (id, r)))
            .map(|(id, r)| (r.tenant, HandleInfo { handle: Handle { id, epoch: self.epoch }, tensor: r.desc.clone() }))
            .collect();
        (listed, more)
    }

    /// Forgets the handles this table holds for `tenant`: the ids of the tensors to free.
    /// Others (stale, unknown, another tenant's, repeated) are skipped: releasing is idempotent.
    pub fn release(&mut self, tenant: TenantId, handles: &[Handle]) -> Vec<u64> {
        let mut released = Vec::new();
        for h in handles.iter().filter(|h| h.epoch == self.epoch) {
            if let Slot::Occupied(slot) = self.records.entry(h.id)
                && slot.get().tenant == tenant
            {
                let record = slot.remove();
                self.bytes -= record.desc.byte_len;
                Self::forget(&mut self.held, tenant);
                released.push(h.id);
            } else if let Slot::Occupied(slot) = self.moved.entry(h.id)
                && slot.get().tenant == tenant
            {
                // The forward goes; the tensor where it went stays until released there.
                slot.remove();
                Self::forget(&mut self.held, tenant);
            }
        }
        self.counters.released += released.len() as u64;
        released
    }

    /// True when nothing is kept here and no forward is remembered.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty() && self.moved.is_empty()
    }

    /// When [`Self::expire`] is next due.
    pub fn next_sweep(&self) -> Instant {
        self.next_sweep
    }

    /// Forgets what has not been used for the idle time limit by `now`, once a sweep is due:
    /// the ids of the tensors to free.
    pub fn expire(&mut self, now: Instant) -> Vec<u64> {
        if now < self.next_sweep {
            return Vec::new();
        }
        self.next_sweep = now + crate::sweep_every(self.idle_ttl);
        let ttl = self.idle_ttl;
        let mut expired = Vec::new();
        let mut freed = 0;
        let held = &mut self.held;
        self.records.retain(|&id, r| {
            let keep = now.saturating_duration_since(r.last_used) < ttl;
            if !keep {
                freed += r.desc.byte_len;
                expired.push(id);
                Self::forget(held, r.tenant);
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
        self.bytes -= freed;
        self.counters.expired += expired.len() as u64;
        if !expired.is_empty() {
            tracing::info!(expired = expired.len(), bytes = freed, "kept tensors expired unused");
        }
        expired
    }

    pub fn stats(&self, out: &mut Vec<(String, u64)>) {
        out.extend(
            [
                ("handles", self.records.len() as u64),
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

#[cfg(test)]
mod tests {
    use super::*;
    use djinn_proto::DType;

    const T: TenantId = TenantId(1);
    const EPOCH: u64 = 7;

    fn table(limit: u64, ttl: Duration) -> (KeptTable, Instant) {
        let now = Instant::now();
        (KeptTable::new(EPOCH, MemoryBudget::new(limit), ttl, now), now)
    }

    /// The executor's answer for a tensor of `n` f32s it keeps as `id`.
    fn kept(id: u64, n: u64) -> HandleInfo {
        HandleInfo { handle: Handle { id, epoch: EPOCH }, tensor: TensorDesc::new(DType::F32, vec![n]).unwrap() }
    }

    #[test]
    fn kept_tensors_are_charged_until_released() {
        let (mut t, now) = table(1 << 20, Duration::from_secs(60));
        let info = kept(1, 256);
        t.record(T, std::slice::from_ref(&info), false, now).unwrap();
        assert_eq!(t.budget.used(), 1024 + MIN_CHARGE, "its bytes and its bookkeeping");
        assert_eq!(t.get(T, info.handle, now).unwrap(), &info.tensor);
        assert_eq!(t.release(T, &[info.handle, info.handle]), [1], "a second release is a no-op");
        assert_eq!(t.budget.used(), 0);
        assert!(matches!(t.get(T, info.handle, now), Err(HandleError::Unknown { .. })));
    }

    #[test]
    fn a_tensor_over_its_payload_is_charged_its_bookkeeping_alone() {
        let (mut t, now) = table(1 << 20, Duration::from_secs(60));
        t.record(T, &[kept(1, 256)], true, now).unwrap();
        assert_eq!((t.budget.used(), t.bytes), (MIN_CHARGE, 1024));
    }

    #[test]
    fn a_refused_record_keeps_nothing_of_the_answer() {
        let (mut t, now) = table(1024 + 2 * MIN_CHARGE, Duration::from_secs(60));
        let e = t.record(T, &[kept(1, 1), kept(2, 256)], false, now).unwrap_err();
        assert_eq!(e.code, ErrorCode::OverBudget);
        assert_eq!((t.records.len(), t.budget.used(), t.bytes, t.held.get(&T)), (0, 0, 0, None));
        let twice = t.record(T, &[kept(3, 1), kept(3, 1)], false, now).unwrap_err();
        assert_eq!(twice.code, ErrorCode::Internal, "an id is the executor's once");
        let other_life = HandleInfo { handle: Handle { id: 4, epoch: EPOCH + 1 }, ..kept(4, 1) };
        assert_eq!(t.record(T, &[other_life], false, now).unwrap_err().code, ErrorCode::Internal);
        assert_eq!(t.budget.used(), 0);
    }

    #[test]
    fn a_forwarded_handle_says_where_its_tensor_went_until_released_or_expired() {
        let (mut t, now) = table(1 << 20, Duration::from_millis(100));
        let info = kept(1, 256);
        t.record(T, std::slice::from_ref(&info), false, now).unwrap();
        let there = HandleInfo { handle: Handle { id: 9, epoch: 3 }, tensor: info.tensor.clone() };
        let other = t.forward(TenantId(2), info.handle, "b:1".into(), there.clone(), now);
        assert!(matches!(other, Err(HandleError::Unknown { .. })), "only its tenant forwards it");
        t.forward(T, info.handle, "b:1".into(), there.clone(), now).unwrap();
        assert_eq!((t.budget.used(), t.bytes), (0, 0), "freed here");
        let moved = HandleError::Moved { handle: info.handle, to: "b:1".into(), kept: there.clone() };
        assert_eq!(t.get(T, info.handle, now).unwrap_err(), moved);
        assert!(matches!(t.get(TenantId(2), info.handle, now), Err(HandleError::Unknown { .. })));
        assert!(t.list(None, 0).0.is_empty(), "nothing is kept here");
        assert_eq!(t.held.get(&T), Some(&1), "a forward counts toward the tenant's objects");
        assert!(t.release(T, &[info.handle]).is_empty(), "nothing was held here to free");
        assert!(matches!(t.get(T, info.handle, now), Err(HandleError::Unknown { .. })));
        assert_eq!(t.held.get(&T), None);
        // Unasked for the idle time limit, a forward goes.
        let info = kept(2, 256);
        t.record(T, std::slice::from_ref(&info), false, now).unwrap();
        t.forward(T, info.handle, "b:1".into(), there, now).unwrap();
        assert!(t.expire(now + Duration::from_millis(200)).is_empty(), "no tensor to free");
        assert!(matches!(t.get(T, info.handle, now), Err(HandleError::Unknown { .. })));
        assert_eq!(t.held.get(&T), None);
    }

    #[test]
    fn a_list_comes_in_pages_of_the_tenants_own_in_order() {
        let (mut t, now) = table(u64::MAX / 2, Duration::from_secs(60));
        let other = TenantId(2);
        let mut mine = Vec::new();
        let mut id = 0;
        for i in 0..crate::LIST_PAGE + 5 {
            id += 1;
            t.record(T, &[kept(id, 1)], false, now).unwrap();
            mine.push(Handle { id, epoch: EPOCH });
            if i % 500 == 0 {
                id += 1;
                t.record(other, &[kept(id, 1)], false, now).unwrap();
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
        let (mut t, now) = table(1 << 20, Duration::from_secs(60));
        let info = kept(1, 4);
        t.record(T, std::slice::from_ref(&info), false, now).unwrap();
        let other = TenantId(2);
        let e = t.get(other, info.handle, now).unwrap_err();
        assert_eq!(e, HandleError::Unknown { handle: info.handle, idle_ttl: Duration::from_secs(60) });
        assert!(t.release(other, &[info.handle]).is_empty());
        assert!(t.get(T, info.handle, now).is_ok(), "another tenant's release left it kept");
    }

    #[test]
    fn a_handle_of_another_epoch_is_stale_not_unknown() {
        let (mut t, now) = table(1 << 20, Duration::from_secs(60));
        let info = kept(1, 4);
        t.record(T, std::slice::from_ref(&info), false, now).unwrap();
        let old = Handle { epoch: 6, ..info.handle };
        let e = t.get(T, old, now).unwrap_err();
        assert_eq!(e.code(), ErrorCode::StaleHandle);
        assert!(e.to_string().contains("earlier life"), "{e}");
        assert!(t.release(T, &[old]).is_empty(), "a stale handle frees nothing of this life");
        assert!(t.get(T, info.handle, now).is_ok());
    }

    #[test]
    fn unused_tensors_expire_at_the_next_sweep_and_used_ones_stay() {
        let (mut t, now) = table(1 << 20, Duration::from_millis(100));
        t.record(T, &[kept(1, 4), kept(2, 4)], false, now).unwrap();
        let a = Handle { id: 1, epoch: EPOCH };
        let b = Handle { id: 2, epoch: EPOCH };
        assert_eq!(t.next_sweep(), now + Duration::from_millis(25), "four sweeps per idle time limit");
        assert!(t.expire(now + Duration::from_millis(10)).is_empty(), "no sweep is due");
        let later = now + Duration::from_millis(60);
        assert!(t.expire(later).is_empty());
        t.get(T, b, later).unwrap();
        assert_eq!(t.expire(later + Duration::from_millis(60)), [1]);
        assert!(matches!(t.get(T, a, later), Err(HandleError::Unknown { .. })));
        assert_eq!(t.budget.used(), 16 + MIN_CHARGE);
        assert_eq!(t.held.get(&T), Some(&1));
    }

    #[test]
    fn empty_tensors_are_charged_and_counted() {
        let (mut t, now) = table(3 * MIN_CHARGE, Duration::from_secs(60));
        let kept_empty: Vec<HandleInfo> = (1..=4).map(|id| kept(id, 0)).collect();
        t.record(T, &kept_empty[..3], false, now).unwrap();
        let e = t.record(T, &kept_empty[3..], false, now).unwrap_err();
        assert_eq!(e.code, ErrorCode::OverBudget, "a page each, however empty");
        let handles: Vec<Handle> = kept_empty.iter().map(|k| k.handle).collect();
        assert_eq!(t.release(T, &handles).len(), 3);
        assert_eq!((t.budget.used(), t.held.get(&T)), (0, None));

        let (mut t, now) = table(u64::MAX / 2, Duration::from_secs(60));
        let many: Vec<HandleInfo> = (1..=MAX_OBJECTS_PER_TENANT as u64).map(|id| kept(id, 0)).collect();
        t.record(T, &many, false, now).unwrap();
        let one_more = kept(MAX_OBJECTS_PER_TENANT as u64 + 1, 0);
        let e = t.record(T, std::slice::from_ref(&one_more), false, now).unwrap_err();
        assert_eq!(e.code, ErrorCode::QuotaExceeded, "{}", e.message);
        assert!(t.record(TenantId(2), &[one_more], false, now).is_ok(), "another tenant's count is its own");
    }

    /// What a sequence of requests does to the table, as the test reads it.
    #[derive(Debug, Clone)]
    enum Op {
        /// The executor kept tensors of these element counts for the tenant.
        Record {
            tenant: u32,
            sizes: Vec<u64>,
            in_place: bool,
        },
        Release {
            tenant: u32,
            pick: usize,
        },
        Forward {
            tenant: u32,
            pick: usize,
        },
        Use {
            tenant: u32,
            pick: usize,
        },
        /// Time passes (ms), then the table is swept when a sweep is due.
        Wait {
            ms: u64,
        },
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            (0u32..3, prop::collection::vec(0u64..2048, 0..4), any::<bool>())
                .prop_map(|(tenant, sizes, in_place)| Op::Record { tenant, sizes, in_place }),
            (0u32..3, any::<usize>()).prop_map(|(tenant, pick)| Op::Release { tenant, pick }),
            (0u32..3, any::<usize>()).prop_map(|(tenant, pick)| Op::Forward { tenant, pick }),
            (0u32..3, any::<usize>()).prop_map(|(tenant, pick)| Op::Use { tenant, pick }),
            (0u64..80).prop_map(|ms| Op::Wait { ms }),
        ]
    }

    proptest::proptest! {
        /// Whatever the executor keeps and the tenants release, forward, use or leave idle: the
        /// budget holds exactly what the live records are charged (a page each, their bytes
        /// unless in place), each tenant's count is its records and forwards, and every id the
        /// table gives back to free was recorded, is freed once, and names no record after.
        #[test]
        fn the_budget_and_the_counts_follow_the_live_records(ops in proptest::collection::vec(op(), 1..80)) {
            let ttl = Duration::from_millis(100);
            let (mut t, mut now) = table(64 * 1024, ttl);
            // id -> (tenant, bytes, in place, last used); forwards: id -> tenant.
            let mut live: HashMap<u64, (TenantId, u64, bool, Instant)> = HashMap::new();
            let mut forwards: HashMap<u64, (TenantId, Instant)> = HashMap::new();
            let mut freed = std::collections::HashSet::new();
            let mut next_id = 1;
            let pick = |live: &HashMap<u64, (TenantId, u64, bool, Instant)>, pick: usize| {
                let mut ids: Vec<u64> = live.keys().copied().collect();
                ids.sort_unstable();
                (!ids.is_empty()).then(|| ids[pick % ids.len()])
            };
            for op in ops {
                let mut given_back = Vec::new();
                match op {
                    Op::Record { tenant, sizes, in_place } => {
                        let tenant = TenantId(tenant);
                        let kept: Vec<HandleInfo> = sizes.iter().map(|&n| { next_id += 1; kept(next_id, n) }).collect();
                        let before = (t.budget.used(), t.records.len(), t.bytes);
                        match t.record(tenant, &kept, in_place, now) {
                            Ok(()) => {
                                for k in &kept {
                                    live.insert(k.handle.id, (tenant, k.tensor.byte_len, in_place, now));
                                }
                            }
                            Err(e) => {
                                proptest::prop_assert_eq!(e.code, ErrorCode::OverBudget);
                                proptest::prop_assert_eq!(before, (t.budget.used(), t.records.len(), t.bytes));
                            }
                        }
                    }
                    Op::Release { tenant, pick: p } => {
                        if let Some(id) = pick(&live, p) {
                            let handle = Handle { id, epoch: EPOCH };
                            given_back = t.release(TenantId(tenant), &[handle]);
                            if live[&id].0 == TenantId(tenant) {
                                proptest::prop_assert_eq!(&given_back, &vec![id]);
                                live.remove(&id);
                            } else {
                                proptest::prop_assert!(given_back.is_empty(), "another tenant's");
                            }
                        }
                    }
                    Op::Forward { tenant, pick: p } => {
                        if let Some(id) = pick(&live, p) {
                            let handle = Handle { id, epoch: EPOCH };
                            let there = kept(id, 1);
                            let owner = live[&id].0;
                            let forwarded = t.forward(TenantId(tenant), handle, "b:1".into(), there, now);
                            proptest::prop_assert_eq!(forwarded.is_ok(), owner == TenantId(tenant));
                            if forwarded.is_ok() {
                                live.remove(&id);
                                forwards.insert(id, (owner, now));
                                given_back.push(id);
                            }
                        }
                    }
                    Op::Use { tenant, pick: p } => {
                        if let Some(id) = pick(&live, p) {
                            let used = t.get(TenantId(tenant), Handle { id, epoch: EPOCH }, now).is_ok();
                            let entry = live.get_mut(&id).expect("picked from the live ones");
                            proptest::prop_assert_eq!(used, entry.0 == TenantId(tenant));
                            if used {
                                entry.3 = now;
                            }
                        }
                    }
                    Op::Wait { ms } => {
                        now += Duration::from_millis(ms);
                        if now >= t.next_sweep() {
                            let idle = |last: Instant| now.saturating_duration_since(last) >= ttl;
                            let mut due: Vec<u64> = live.iter().filter(|(_, r)| idle(r.3)).map(|(&id, _)| id).collect();
                            due.sort_unstable();
                            let mut expired = t.expire(now);
                            expired.sort_unstable();
                            proptest::prop_assert_eq!(&expired, &due);
                            live.retain(|_, r| !idle(r.3));
                            forwards.retain(|_, f| !idle(f.1));
                            given_back = expired;
                        } else {
                            proptest::prop_assert!(t.expire(now).is_empty(), "no sweep is due");
                        }
                    }
                }
                for id in given_back {
                    proptest::prop_assert!(freed.insert(id), "{} is freed once", id);
                    proptest::prop_assert!(!t.records.contains_key(&id));
                }
                let charged: u64 = live.values().map(|&(_, bytes, in_place, _)| MIN_CHARGE + if in_place { 0 } else { bytes }).sum();
                proptest::prop_assert_eq!(t.budget.used(), charged);
                proptest::prop_assert_eq!(t.bytes, live.values().map(|r| r.1).sum::<u64>());
                for tenant in (0..3).map(TenantId) {
                    let count = live.values().filter(|r| r.0 == tenant).count()
                        + forwards.values().filter(|f| f.0 == tenant).count();
                    proptest::prop_assert_eq!(t.held.get(&tenant).copied().unwrap_or(0), count);
                }
            }
        }
    }
}
