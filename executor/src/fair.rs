//! Work queued by tenant and served in turn: each tenant with work queued gets one job per
//! round, its own jobs in the order they came. A tenant that floods the node waits behind its
//! own jobs, never in front of another tenant's. As in FQ-CoDel's new flows, a tenant that had
//! nothing queued is served before the tenants that stay busy (then joins their round if it
//! has more), so a tenant sending one request at a time waits only for the job running. No
//! I/O and no locks here; the workers hold it under a mutex (`workers.rs`).

use std::collections::{HashMap, VecDeque};

use djinn_auth::TenantId;

#[derive(Debug)]
pub struct FairQueue<T> {
    queues: HashMap<TenantId, VecDeque<T>>,
    /// Tenants that had nothing queued, in the order their work came: served first.
    new: VecDeque<TenantId>,
    /// Tenants with work still queued after a turn, in the order they are served next.
    old: VecDeque<TenantId>,
    len: usize,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        Self { queues: HashMap::new(), new: VecDeque::new(), old: VecDeque::new(), len: 0 }
    }
}

impl<T> FairQueue<T> {
    pub fn push(&mut self, tenant: TenantId, job: T) {
        let queue = self.queues.entry(tenant).or_default();
        if queue.is_empty() {
            self.new.push_back(tenant);
        }
        queue.push_back(job);
        self.len += 1;
    }

    /// The next job: the oldest of the tenant whose turn it is, which then goes to the back of
    /// the busy tenants' round if it has more.
    pub fn pop(&mut self) -> Option<(TenantId, T)> {
        let tenant = self.new.pop_front().or_else(|| self.old.pop_front())?;
        let queue = self.queues.get_mut(&tenant)?;
        let job = queue.pop_front()?;
        if queue.is_empty() {
            self.queues.remove(&tenant);
        } else {
            self.old.push_back(tenant);
        }
        self.len -= 1;
        Some((tenant, job))
    }
}

#[cfg(test)]
impl<T> FairQueue<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Jobs `tenant` has queued.
    pub fn queued(&self, tenant: TenantId) -> usize {
        self.queues.get(&tenant).map_or(0, VecDeque::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_flood_waits_behind_itself() {
        let (flood, other, third) = (TenantId(1), TenantId(2), TenantId(3));
        let mut q = FairQueue::default();
        for i in 0..100 {
            q.push(flood, i);
        }
        q.push(other, 1000);
        assert_eq!(q.pop(), Some((flood, 0)));
        q.push(other, 1001);
        q.push(third, 2000);
        assert_eq!(q.pop(), Some((other, 1000)), "served first, not after a hundred of the flood's");
        assert_eq!(q.pop(), Some((third, 2000)), "a tenant with nothing queued before goes before the busy ones");
        assert_eq!(q.pop(), Some((flood, 1)), "then the busy ones take turns");
        assert_eq!(q.pop(), Some((other, 1001)));
        assert_eq!(q.queued(flood), 98);
        assert!((2..100).all(|i| q.pop() == Some((flood, i))));
        assert!(q.is_empty() && q.pop().is_none());
    }

    proptest! {
        /// Whatever the pushes and pops: nothing is lost or duplicated, each tenant's jobs come
        /// out in the order they went in, and while a tenant waits with jobs queued no other
        /// tenant is served twice unless it ran out of work in between (a tenant that stays
        /// busy gets one job per round).
        #[test]
        fn every_job_once_in_order_and_in_turn(steps in proptest::collection::vec((0u32..4, any::<bool>()), 0..300)) {
            let mut q = FairQueue::default();
            let mut pushed = 0u64;
            let mut next_of: HashMap<TenantId, Vec<u64>> = HashMap::new();
            // Per waiting tenant: the busy tenants served since it queued or was last served.
            let mut served_while_waiting: HashMap<TenantId, Vec<TenantId>> = HashMap::new();
            for (tenant, is_push) in steps {
                let tenant = TenantId(tenant);
                if is_push {
                    if q.queued(tenant) == 0 {
                        served_while_waiting.insert(tenant, Vec::new());
                        // Out of work in between: a fresh start in everyone's record.
                        served_while_waiting.values_mut().for_each(|s| s.retain(|t| *t != tenant));
                    }
                    q.push(tenant, pushed);
                    next_of.entry(tenant).or_default().push(pushed);
                    pushed += 1;
                } else if let Some((t, job)) = q.pop() {
                    let expected = next_of.get_mut(&t).expect("a tenant that pushed").remove(0);
                    prop_assert_eq!(job, expected);
                    for (waiting, served) in served_while_waiting.iter_mut() {
                        if *waiting == t {
                            served.clear();
                        } else if q.queued(*waiting) > 0 {
                            prop_assert!(!served.contains(&t), "{:?} served twice while {:?} waited", t, waiting);
                            served.push(t);
                        }
                    }
                }
                prop_assert_eq!(q.len(), next_of.values().map(Vec::len).sum::<usize>());
            }
        }
    }
}
