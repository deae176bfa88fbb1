//! Work queued by tenant and served in turn: each tenant with work queued gets one job per
//! round, its own jobs in the order they came. A tenant that floods the node waits behind its
//! own jobs, never in front of another tenant's: another tenant's job waits for at most one
//! job of each other tenant with work. No I/O and no locks here; the workers hold it under a
//! mutex (`workers.rs`).

use std::collections::{HashMap, VecDeque};

use djinn_auth::TenantId;

#[derive(Debug)]
pub struct FairQueue<T> {
    queues: HashMap<TenantId, VecDeque<T>>,
    /// The tenants with jobs queued, in the order they are served next.
    turns: VecDeque<TenantId>,
    len: usize,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        Self { queues: HashMap::new(), turns: VecDeque::new(), len: 0 }
    }
}

impl<T> FairQueue<T> {
    pub fn push(&mut self, tenant: TenantId, job: T) {
        let queue = self.queues.entry(tenant).or_default();
        if queue.is_empty() {
            // A tenant that had nothing queued takes the last turn of the round.
            self.turns.push_back(tenant);
        }
        queue.push_back(job);
        self.len += 1;
    }

    /// The next job: the oldest of the tenant whose turn it is, which then goes to the back.
    pub fn pop(&mut self) -> Option<(TenantId, T)> {
        let tenant = self.turns.pop_front()?;
        let queue = self.queues.get_mut(&tenant)?;
        let job = queue.pop_front()?;
        if queue.is_empty() {
            self.queues.remove(&tenant);
        } else {
            self.turns.push_back(tenant);
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
        let (flood, other) = (TenantId(1), TenantId(2));
        let mut q = FairQueue::default();
        for i in 0..100 {
            q.push(flood, i);
        }
        q.push(other, 1000);
        assert_eq!(q.pop(), Some((flood, 0)));
        assert_eq!(q.pop(), Some((other, 1000)), "served after one of the flood's jobs, not a hundred");
        assert_eq!(q.queued(flood), 99);
        assert!((1..100).all(|i| q.pop() == Some((flood, i))));
        assert!(q.is_empty() && q.pop().is_none());
    }

    proptest! {
        /// Whatever the pushes and pops: nothing is lost or duplicated, each tenant's jobs come
        /// out in the order they went in, and while a tenant waits with jobs queued no other
        /// tenant is served twice.
        #[test]
        fn every_job_once_in_order_and_in_turn(steps in proptest::collection::vec((0u32..4, any::<bool>()), 0..300)) {
            let mut q = FairQueue::default();
            let mut pushed = 0u64;
            let mut next_of: HashMap<TenantId, Vec<u64>> = HashMap::new();
            // Per waiting tenant: the tenants served since it last was (or since it queued).
            let mut served_while_waiting: HashMap<TenantId, Vec<TenantId>> = HashMap::new();
            for (tenant, is_push) in steps {
                let tenant = TenantId(tenant);
                if is_push {
                    if q.queued(tenant) == 0 {
                        served_while_waiting.insert(tenant, Vec::new());
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
                        } else if q.queued(*waiting) > 0 || next_of.get(waiting).is_some_and(|v| !v.is_empty()) {
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
