//! The records of requests parked at a breakpoint: whose each is, and how long it may wait. The
//! runs themselves (their activations, charged to the device budget) are the executor's, by the
//! ids of their handles; the core checks every resume, inspection and abort against these
//! records before the executor sees it, and tells the executor which to free when they lapse.
//!
//! A handle is used once: a resume or an abort ends it, and a handle that ended is told apart
//! from one that never existed (the last [`ENDED_REMEMBERED`] are remembered).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use djinn_auth::TenantId;
use djinn_proto::{ErrorCode, Handle};

/// Why a parked request's handle names nothing a request may use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParkedError {
    #[error(
        "parked request {parked} is from an earlier life of this node (its epoch is now {current:016x}): the node restarted and the request is gone"
    )]
    Stale { parked: Handle, current: u64 },
    #[error("no parked request {parked} on this node (parked requests are released after {ttl:?})")]
    Unknown { parked: Handle, ttl: Duration },
    #[error("parked request {parked} was already {how}: a parked request is resumed or aborted once")]
    Ended { parked: Handle, how: Ended },
}

impl ParkedError {
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Stale { .. } => ErrorCode::StaleHandle,
            Self::Unknown { .. } | Self::Ended { .. } => ErrorCode::NotFound,
        }
    }
}

/// How a parked request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Resumed,
    Aborted,
    Expired,
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Resumed => "resumed",
            Self::Aborted => "aborted",
            Self::Expired => "released after its time limit",
        })
    }
}

/// Ended handles remembered, so that a second resume is told "already resumed".
pub const ENDED_REMEMBERED: usize = 4096;

struct Record {
    tenant: TenantId,
    /// When it was parked: it is released a time limit later.
    parked_at: Instant,
    /// The session whose step it is, if it is one (the session's later requests wait for it).
    session: Option<u64>,
}

/// A parked request's record as a resume takes it: put back as it was when the request is
/// parked still.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Taken {
    pub parked_at: Instant,
    pub session: Option<u64>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counters {
    parked: u64,
    resumed: u64,
    aborted: u64,
    expired: u64,
}

/// The parked requests of one life of the executor (its epoch), by the ids of their handles.
pub(crate) struct ParkedRecords {
    epoch: u64,
    ttl: Duration,
    records: HashMap<u64, Record>,
    ended: HashMap<u64, (Ended, TenantId)>,
    ended_order: VecDeque<u64>,
    counters: Counters,
    /// When the next sweep for lapsed requests is due.
    next_sweep: Instant,
}

impl std::fmt::Debug for ParkedRecords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParkedRecords").field("parked", &self.records.len()).finish()
    }
}

impl ParkedRecords {
    pub fn new(epoch: u64, ttl: Duration, now: Instant) -> Self {
        Self {
            epoch,
            ttl,
            records: HashMap::new(),
            ended: HashMap::new(),
            ended_order: VecDeque::new(),
            counters: Counters::default(),
            next_sweep: now + crate::sweep_every(ttl),
        }
    }

    /// Records a request the executor parked for `tenant` (a `Paused` answer to an execution,
    /// a step of `session` or a resume). A handle of another life, or one recorded already,
    /// changes nothing.
    pub fn record(&mut self, tenant: TenantId, parked: Handle, session: Option<u64>, now: Instant) {
        if parked.epoch != self.epoch || self.records.contains_key(&parked.id) {
            return;
        }
        self.records.insert(parked.id, Record { tenant, parked_at: now, session });
        self.counters.parked += 1;
    }

    /// The id of `tenant`'s parked request; another tenant's is unknown to it.
    pub fn check(&self, tenant: TenantId, parked: Handle) -> Result<u64, ParkedError> {
        if parked.epoch != self.epoch {
            return Err(ParkedError::Stale { parked, current: self.epoch });
        }
        if self.records.get(&parked.id).is_some_and(|r| r.tenant == tenant) {
            return Ok(parked.id);
        }
        match self.ended.get(&parked.id) {
            Some(&(how, owner)) if owner == tenant => Err(ParkedError::Ended { parked, how }),
            _ => Err(ParkedError::Unknown { parked, ttl: self.ttl }),
        }
    }

    /// Ends `tenant`'s parked request as it is resumed or aborted: a second resume or abort is
    /// told how it ended. What its record was.
    pub fn end(&mut self, tenant: TenantId, parked: Handle, how: Ended) -> Result<Taken, ParkedError> {
        let id = self.check(tenant, parked)?;
        let taken = self.records.get(&id).map(|r| Taken { parked_at: r.parked_at, session: r.session });
        self.forget(id, how);
        taken.ok_or(ParkedError::Unknown { parked, ttl: self.ttl })
    }

    /// A resume left the request parked (its activation was refused, or its blocks failed
    /// before they ran): it may be resumed again, within the time limit it had.
    pub fn put_back(&mut self, tenant: TenantId, parked: Handle, taken: Taken) {
        if self.ended.remove(&parked.id).is_some() {
            self.ended_order.retain(|&id| id != parked.id);
            self.counters.resumed = self.counters.resumed.saturating_sub(1);
        }
        let Taken { parked_at, session } = taken;
        self.records.insert(parked.id, Record { tenant, parked_at, session });
    }

    /// The epoch of the handles it records.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// When [`Self::expire`] is next due, while anything is parked.
    pub fn next_sweep(&self) -> Option<Instant> {
        (!self.records.is_empty()).then_some(self.next_sweep)
    }

    /// Ends the requests parked past the time limit by `now`, once a sweep is due: the ids of
    /// the runs to free, each with the session whose step it is, if it is one.
    pub fn expire(&mut self, now: Instant) -> Vec<(u64, Option<u64>)> {
        if now < self.next_sweep {
            return Vec::new();
        }
        self.next_sweep = now + crate::sweep_every(self.ttl);
        let ttl = self.ttl;
        let lapsed: Vec<(u64, Option<u64>)> = self
            .records
            .iter()
            .filter(|(_, r)| now.saturating_duration_since(r.parked_at) >= ttl)
            .map(|(&id, r)| (id, r.session))
            .collect();
        for &(id, _) in &lapsed {
            self.forget(id, Ended::Expired);
        }
        if !lapsed.is_empty() {
            tracing::info!(expired = lapsed.len(), "parked requests released after {:?}", self.ttl);
        }
        lapsed
    }

    fn forget(&mut self, id: u64, how: Ended) {
        let Some(record) = self.records.remove(&id) else { return };
        match how {
            Ended::Resumed => self.counters.resumed += 1,
            Ended::Aborted => self.counters.aborted += 1,
            Ended::Expired => self.counters.expired += 1,
        }
        self.ended.insert(id, (how, record.tenant));
        self.ended_order.push_back(id);
        while self.ended_order.len() > ENDED_REMEMBERED {
            if let Some(old) = self.ended_order.pop_front() {
                self.ended.remove(&old);
            }
        }
    }

    pub fn stats(&self, out: &mut Vec<(String, u64)>) {
        let c = &self.counters;
        out.extend(
            [
                ("parked", self.records.len() as u64),
                ("parked_total", c.parked),
                ("parked_resumed", c.resumed),
                ("parked_aborted", c.aborted),
                ("parked_expired", c.expired),
            ]
            .map(|(k, v)| (k.to_owned(), v)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALICE: TenantId = TenantId(1);
    const BOB: TenantId = TenantId(2);
    const TTL: Duration = Duration::from_secs(60);

    fn handle(id: u64) -> Handle {
        Handle { epoch: 7, id }
    }

    #[test]
    fn a_parked_request_is_its_tenants_used_once_and_told_apart_once_ended() {
        let now = Instant::now();
        let mut p = ParkedRecords::new(7, TTL, now);
        p.record(ALICE, handle(1), Some(9), now);
        assert_eq!(p.check(ALICE, handle(1)), Ok(1));
        assert_eq!(p.check(BOB, handle(1)), Err(ParkedError::Unknown { parked: handle(1), ttl: TTL }));
        assert!(matches!(p.check(ALICE, Handle { epoch: 8, id: 1 }), Err(ParkedError::Stale { current: 7, .. })));
        assert_eq!(p.end(BOB, handle(1), Ended::Aborted).unwrap_err().code(), ErrorCode::NotFound);
        let taken = p.end(ALICE, handle(1), Ended::Resumed).unwrap();
        assert_eq!(taken, Taken { parked_at: now, session: Some(9) });
        let again = p.end(ALICE, handle(1), Ended::Aborted).unwrap_err();
        assert_eq!(again, ParkedError::Ended { parked: handle(1), how: Ended::Resumed });
        assert!(again.to_string().contains("already resumed"), "{again}");
        // To another tenant an ended handle is as unknown as ever.
        assert!(matches!(p.check(BOB, handle(1)), Err(ParkedError::Unknown { .. })));

        // A resume that left it parked: resumable again, and counted once.
        p.put_back(ALICE, handle(1), taken);
        assert_eq!(p.end(ALICE, handle(1), Ended::Resumed), Ok(taken));
        let mut stats = Vec::new();
        p.stats(&mut stats);
        assert!(stats.contains(&("parked_resumed".into(), 1)) && stats.contains(&("parked".into(), 0)), "{stats:?}");
    }

    #[test]
    fn parked_requests_lapse_within_a_quarter_past_their_time_limit_and_only_then() {
        let start = Instant::now();
        let mut p = ParkedRecords::new(7, TTL, start);
        assert_eq!(p.next_sweep(), None, "nothing parked: no sweep to wake for");
        p.record(ALICE, handle(1), None, start);
        p.record(BOB, handle(2), Some(4), start + TTL / 2);
        assert_eq!(p.expire(start + TTL / 8), [], "no sweep due yet");
        assert_eq!(p.expire(start + TTL - Duration::from_millis(1)), []);
        let at = p.next_sweep().expect("a sweep due");
        assert!(at <= start + TTL + TTL / 4, "{:?} after the start", at - start);
        assert_eq!(p.expire(start + TTL + TTL / 4), [(1, None)]);
        assert_eq!(p.check(ALICE, handle(1)), Err(ParkedError::Ended { parked: handle(1), how: Ended::Expired }));
        assert_eq!(p.check(BOB, handle(2)), Ok(2));
        assert_eq!(p.expire(start + 2 * TTL), [(2, Some(4))]);
        assert_eq!(p.next_sweep(), None);
    }

    #[test]
    fn ended_handles_are_remembered_up_to_a_bound() {
        let now = Instant::now();
        let mut p = ParkedRecords::new(7, TTL, now);
        let n = ENDED_REMEMBERED as u64 + 10;
        for id in 1..=n {
            p.record(ALICE, handle(id), None, now);
            p.end(ALICE, handle(id), Ended::Aborted).unwrap();
        }
        assert_eq!(p.ended.len(), ENDED_REMEMBERED);
        assert!(matches!(p.check(ALICE, handle(1)), Err(ParkedError::Unknown { .. })), "the oldest forgotten");
        assert!(matches!(p.check(ALICE, handle(n)), Err(ParkedError::Ended { how: Ended::Aborted, .. })));
    }
}
