//! The records of the sessions the executor holds: whose each is, the requests waiting their
//! turn, and where a session that moved went. The sessions' state (and where it lives, device or
//! host memory) is the executor's, by the ids of their handles.
//!
//! A session's requests (steps, signals, a move, a close) reach the executor one at a time, in
//! the order they came: the next goes once the executor has answered the one before. A step
//! parked at a breakpoint holds the ones after it until it ends (resumed to its end, aborted, or
//! lapsed), and a move holds them until the peer has answered; after a move they are answered
//! with where the session went, which clients follow.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use djinn_auth::TenantId;
use djinn_proto::{ErrorCode, Handle};

use crate::{Job, ReplyTo};

/// Requests (steps, signals, a move, a close) one session may have waiting: past it, more are
/// refused with `Busy` until the session catches up, so a parked step cannot make a queue of
/// them grow.
pub const MAX_QUEUED_OPS: usize = 256;

/// Why a session request names nothing its tenant may use now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    #[error(
        "session {session} is from an earlier life of this node (its epoch is now {current:016x}): the node restarted and the session's state is gone"
    )]
    Stale { session: Handle, current: u64 },
    #[error("no session {session} on this node: it was closed, or expired after {idle_ttl:?} idle")]
    Unknown { session: Handle, idle_ttl: Duration },
    #[error(
        "session {session} has {queued} requests waiting (its step parked, or still running): send more once they are done"
    )]
    Busy { session: Handle, queued: usize },
    /// Not an error to the client: the answer is `sessions.Moved`, which it follows.
    #[error("session moved to the node at {to}, where it is {session}")]
    Moved { to: String, session: Handle },
    #[error("session {session} cannot move now: {why}")]
    CannotMove { session: Handle, why: &'static str },
}

impl SessionError {
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Stale { .. } => ErrorCode::StaleHandle,
            Self::Unknown { .. } | Self::Moved { .. } => ErrorCode::NotFound,
            Self::Busy { .. } | Self::CannotMove { .. } => ErrorCode::Busy,
        }
    }
}

/// A request for the executor and whose it is.
pub(crate) type Queued = (Job, ReplyTo);

struct Record {
    tenant: TenantId,
    waiting: VecDeque<Queued>,
    /// One of its requests is with the executor (or, for a move, with the peer).
    running: bool,
    /// Its step is parked at a breakpoint: the requests after it wait until it ends.
    paused: bool,
    /// A move is waiting or under way: signals wait for it too.
    moving: bool,
    /// When a request last came or was answered.
    last_used: Instant,
}

impl Record {
    /// The next request to hand the executor, when none runs and the session is not parked.
    fn next(&mut self) -> Option<Queued> {
        if self.running || self.paused {
            return None;
        }
        let next = self.waiting.pop_front()?;
        self.running = true;
        Some(next)
    }
}

/// Where a session went.
struct MovedTo {
    tenant: TenantId,
    to: String,
    session: Handle,
    at: Instant,
}

/// The sessions of one life of the executor (its epoch), by the ids of their handles.
pub(crate) struct SessionRecords {
    epoch: u64,
    idle_ttl: Duration,
    sessions: HashMap<u64, Record>,
    /// Sessions that moved to other nodes, kept for an idle timeout so that their requests
    /// here are answered with where they went.
    moved: HashMap<u64, MovedTo>,
    next_sweep: Instant,
    expired: u64,
}

impl std::fmt::Debug for SessionRecords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionRecords").field("sessions", &self.sessions.len()).finish()
    }
}

impl SessionRecords {
    pub fn new(epoch: u64, idle_ttl: Duration, now: Instant) -> Self {
        Self {
            epoch,
            idle_ttl,
            sessions: HashMap::new(),
            moved: HashMap::new(),
            next_sweep: now + crate::sweep_every(idle_ttl),
            expired: 0,
        }
    }

    /// Records a session the executor opened for `tenant` (a `session.Opened` answer). A
    /// handle of another life changes nothing.
    pub fn opened(&mut self, tenant: TenantId, session: Handle, now: Instant) {
        if session.epoch != self.epoch {
            return;
        }
        let record =
            Record { tenant, waiting: VecDeque::new(), running: false, paused: false, moving: false, last_used: now };
        self.sessions.insert(session.id, record);
    }

    /// The id of `tenant`'s session; another tenant's is unknown to it.
    pub fn check(&self, tenant: TenantId, session: Handle) -> Result<u64, SessionError> {
        if session.epoch != self.epoch {
            return Err(SessionError::Stale { session, current: self.epoch });
        }
        if self.sessions.get(&session.id).is_some_and(|r| r.tenant == tenant) {
            return Ok(session.id);
        }
        match self.moved.get(&session.id) {
            Some(m) if m.tenant == tenant => Err(SessionError::Moved { to: m.to.clone(), session: m.session }),
            _ => Err(SessionError::Unknown { session, idle_ttl: self.idle_ttl }),
        }
    }

    /// Whether a move of `tenant`'s session is waiting or under way.
    pub fn is_moving(&self, tenant: TenantId, session: Handle) -> bool {
        self.check(tenant, session).ok().and_then(|id| self.sessions.get(&id)).is_some_and(|r| r.moving)
    }

    /// Queues `tenant`'s request `job` on its session: the request to hand the executor now,
    /// if it is this one's turn.
    pub fn submit(
        &mut self,
        tenant: TenantId,
        session: Handle,
        job: Job,
        to: ReplyTo,
        now: Instant,
    ) -> Result<Option<Queued>, SessionError> {
        let id = self.check(tenant, session)?;
        let idle_ttl = self.idle_ttl;
        let r = self.sessions.get_mut(&id).ok_or(SessionError::Unknown { session, idle_ttl })?;
        if r.waiting.len() >= MAX_QUEUED_OPS {
            return Err(SessionError::Busy { session, queued: r.waiting.len() });
        }
        if let Job::Move { .. } = job {
            // A move waits for no parked step (its client could not resume it while waiting)
            // and for no other move.
            if r.moving {
                return Err(SessionError::CannotMove { session, why: "it is moving already" });
            }
            if r.paused {
                let why = "a step of it is parked at a breakpoint: resume or abort it first";
                return Err(SessionError::CannotMove { session, why });
            }
            r.moving = true;
        }
        r.last_used = now;
        r.waiting.push_back((job, to));
        Ok(r.next())
    }

    /// The executor answered the session's running request: the next to hand it, if any.
    pub fn answered(&mut self, id: u64, now: Instant) -> Option<Queued> {
        let r = self.sessions.get_mut(&id)?;
        r.running = false;
        r.last_used = now;
        r.next()
    }

    /// The running step parked at a breakpoint: the requests after it wait for [`Self::unpause`].
    pub fn pause(&mut self, id: u64, now: Instant) {
        if let Some(r) = self.sessions.get_mut(&id) {
            r.running = false;
            r.paused = true;
            r.last_used = now;
        }
    }

    /// The parked step ended: the next request to hand the executor, if any.
    pub fn unpause(&mut self, id: u64, now: Instant) -> Option<Queued> {
        let r = self.sessions.get_mut(&id)?;
        r.paused = false;
        r.last_used = now;
        r.next()
    }

    /// The move failed, or never began: the session stays, and the next request goes on.
    pub fn move_failed(&mut self, id: u64, now: Instant) -> Option<Queued> {
        let r = self.sessions.get_mut(&id)?;
        r.moving = false;
        r.running = false;
        r.last_used = now;
        r.next()
    }

    /// The session is on the node at `to` now, as `session`: its record here goes, and its
    /// requests are answered with where it went until it idles out. Returns the requests that
    /// waited behind the move.
    pub fn moved_out(&mut self, id: u64, to: String, session: Handle, now: Instant) -> VecDeque<Queued> {
        let Some(r) = self.sessions.remove(&id) else { return VecDeque::new() };
        let tenant = r.tenant;
        // Each tenant keeps as many forwarding entries as it may have sessions: the oldest go.
        let mut theirs: Vec<(u64, Instant)> =
            self.moved.iter().filter(|(_, m)| m.tenant == tenant).map(|(&id, m)| (id, m.at)).collect();
        if theirs.len() >= crate::MAX_SESSIONS_PER_TENANT {
            theirs.sort_by_key(|&(_, at)| at);
            for (old, _) in &theirs[..=theirs.len() - crate::MAX_SESSIONS_PER_TENANT] {
                self.moved.remove(old);
            }
        }
        self.moved.insert(id, MovedTo { tenant, to, session, at: now });
        r.waiting
    }

    /// The session closed: its record goes. Returns the requests queued after the close.
    pub fn closed(&mut self, id: u64) -> VecDeque<Queued> {
        self.sessions.remove(&id).map(|r| r.waiting).unwrap_or_default()
    }

    /// Whose session `id` is.
    pub fn tenant(&self, id: u64) -> Option<TenantId> {
        self.sessions.get(&id).map(|r| r.tenant)
    }

    /// When [`Self::expire`] is next due, while a session is open or a move remembered.
    pub fn next_sweep(&self) -> Option<Instant> {
        (!self.sessions.is_empty() || !self.moved.is_empty()).then_some(self.next_sweep)
    }

    /// Ends, once a sweep is due, the sessions idle past the time limit by `now` (nothing of
    /// theirs running, parked, moving or waiting; their clients are presumed gone): the ids of
    /// the sessions to free. Where moved sessions went is forgotten after the same time.
    pub fn expire(&mut self, now: Instant) -> Vec<u64> {
        if now < self.next_sweep {
            return Vec::new();
        }
        self.next_sweep = now + crate::sweep_every(self.idle_ttl);
        let ttl = self.idle_ttl;
        let idle = |r: &Record| {
            !r.running
                && !r.paused
                && !r.moving
                && r.waiting.is_empty()
                && now.saturating_duration_since(r.last_used) >= ttl
        };
        let gone: Vec<u64> = self.sessions.iter().filter(|(_, r)| idle(r)).map(|(&id, _)| id).collect();
        for id in &gone {
            self.sessions.remove(id);
        }
        self.moved.retain(|_, m| now.saturating_duration_since(m.at) < ttl);
        self.expired += gone.len() as u64;
        if !gone.is_empty() {
            tracing::info!(expired = gone.len(), "sessions closed after {ttl:?} idle");
        }
        gone
    }

    pub fn stats(&self, out: &mut Vec<(String, u64)>) {
        let waiting: usize = self.sessions.values().map(|r| r.waiting.len()).sum();
        out.extend(
            [
                ("sessions", self.sessions.len() as u64),
                ("sessions_expired", self.expired),
                ("session_requests_waiting", waiting as u64),
            ]
            .map(|(k, v)| (k.to_owned(), v)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use djinn_proto::Signal;

    const ANN: TenantId = TenantId(1);
    const BEN: TenantId = TenantId(2);
    const TTL: Duration = Duration::from_secs(60);

    fn to(request_id: u64) -> ReplyTo {
        ReplyTo { slot: 0, conn_id: 1, request_id, tenant: ANN, operator: false, torchscript: false }
    }

    fn signal(session: Handle) -> Job {
        Job::Signal { session, signal: Signal::Compute }
    }

    #[test]
    fn a_sessions_requests_are_its_tenants_bounded_and_handed_on_one_at_a_time_in_order() {
        let now = Instant::now();
        let mut s = SessionRecords::new(7, TTL, now);
        let session = Handle { id: 3, epoch: 7 };
        s.opened(ANN, session, now);
        assert!(matches!(s.submit(BEN, session, signal(session), to(1), now), Err(SessionError::Unknown { .. })));
        let stale = Handle { id: 3, epoch: 8 };
        assert!(matches!(s.submit(ANN, stale, signal(stale), to(1), now), Err(SessionError::Stale { .. })));
        let first = s.submit(ANN, session, signal(session), to(1), now).unwrap();
        assert_eq!(first.map(|(_, to)| to.request_id), Some(1), "the first goes at once");
        for i in 0..MAX_QUEUED_OPS as u64 {
            assert!(s.submit(ANN, session, signal(session), to(2 + i), now).unwrap().is_none(), "the rest wait");
        }
        let busy = s.submit(ANN, session, signal(session), to(9999), now).unwrap_err();
        assert_eq!(busy.code(), ErrorCode::Busy);
        let order: Vec<u64> = std::iter::from_fn(|| s.answered(3, now)).map(|(_, to)| to.request_id).collect();
        assert_eq!(order, (2..2 + MAX_QUEUED_OPS as u64).collect::<Vec<_>>());
    }

    #[test]
    fn a_parked_step_holds_what_came_after_it_and_a_move_waits_for_none() {
        let now = Instant::now();
        let mut s = SessionRecords::new(7, TTL, now);
        let session = Handle { id: 3, epoch: 7 };
        s.opened(ANN, session, now);
        assert!(s.submit(ANN, session, signal(session), to(1), now).unwrap().is_some());
        s.pause(3, now);
        assert!(s.submit(ANN, session, signal(session), to(2), now).unwrap().is_none(), "it waits for the step");
        let refused = s.submit(ANN, session, Job::Move { session }, to(3), now).unwrap_err();
        assert!(matches!(refused, SessionError::CannotMove { .. }), "{refused}");
        assert_eq!(s.expire(now + 2 * TTL), Vec::<u64>::new(), "a parked session is not idle");
        assert_eq!(s.unpause(3, now).map(|(_, to)| to.request_id), Some(2));
        assert!(s.answered(3, now).is_none());
        assert_eq!(s.closed(3).len(), 0);
        assert!(matches!(s.check(ANN, session), Err(SessionError::Unknown { .. })));
    }

    /// Where moved sessions went is kept per tenant up to the number of sessions a tenant may
    /// have (the oldest go first), for an idle timeout, and told to that tenant alone.
    #[test]
    fn where_moved_sessions_went_is_bounded_per_tenant_and_forgotten() {
        let now = Instant::now();
        let mut s = SessionRecords::new(7, TTL, now);
        let here = |id| Handle { id, epoch: 7 };
        let there = |id| Handle { id, epoch: 9 };
        let total = crate::MAX_SESSIONS_PER_TENANT as u64 + 10;
        for id in 0..total {
            s.opened(ANN, here(id), now);
            assert!(s.moved_out(id, "b:1".into(), there(id), now + Duration::from_millis(id)).is_empty());
        }
        s.opened(BEN, here(total), now);
        s.moved_out(total, "b:1".into(), there(total), now);
        assert_eq!(s.moved.len(), crate::MAX_SESSIONS_PER_TENANT + 1);
        assert!(matches!(s.check(ANN, here(0)), Err(SessionError::Unknown { .. })), "the oldest went");
        let last = here(total - 1);
        assert!(matches!(s.check(ANN, last), Err(SessionError::Moved { session, .. }) if session == there(total - 1)));
        assert!(matches!(s.check(BEN, last), Err(SessionError::Unknown { .. })), "another tenant's");
        assert!(s.next_sweep().is_some());
        s.expire(now + 2 * TTL);
        assert!(s.moved.is_empty());
        assert_eq!(s.next_sweep(), None);
    }

    #[test]
    fn idle_sessions_expire_within_a_quarter_past_their_time_limit_and_only_then() {
        let start = Instant::now();
        let mut s = SessionRecords::new(7, TTL, start);
        s.opened(ANN, Handle { id: 1, epoch: 7 }, start);
        s.opened(ANN, Handle { id: 2, epoch: 7 }, start);
        let two = Handle { id: 2, epoch: 7 };
        // A request keeps session 2 in use for as long as it runs.
        assert!(s.submit(ANN, two, signal(two), to(1), start + TTL / 2).unwrap().is_some());
        assert_eq!(s.expire(start + TTL - Duration::from_millis(1)), Vec::<u64>::new());
        assert_eq!(s.expire(start + TTL + TTL / 4), vec![1]);
        assert_eq!(s.expire(start + 3 * TTL), Vec::<u64>::new(), "running: not idle");
        assert!(s.answered(2, start + 3 * TTL).is_none());
        assert_eq!(s.expire(start + 4 * TTL + TTL / 4), vec![2]);
        let mut stats = Vec::new();
        s.stats(&mut stats);
        assert!(stats.contains(&("sessions_expired".into(), 2)), "{stats:?}");
    }

    /// What a test does to the records next.
    #[derive(Debug, Clone)]
    enum Step {
        /// A request for session `session` (a move when `moves`).
        Submit { session: u64, moves: bool },
        /// The executor answers the session's running request: as a close (`closes`), a step
        /// that parked (`parks`), or any other answer; a move's answer ends it, as `moved` says.
        Answer { session: u64, parks: bool, closes: bool, moved: bool },
        /// The session's parked step ends.
        Unpause { session: u64 },
        /// Time passes (ms), then the records are swept when a sweep is due.
        Wait { ms: u64 },
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (0u64..2, proptest::bool::weighted(0.2)).prop_map(|(session, moves)| Step::Submit { session, moves }),
            4 => (0u64..2, proptest::bool::weighted(0.2), proptest::bool::weighted(0.05), any::<bool>())
                .prop_map(|(session, parks, closes, moved)| Step::Answer { session, parks, closes, moved }),
            1 => (0u64..2).prop_map(|session| Step::Unpause { session }),
            1 => (0u64..200).prop_map(|ms| Step::Wait { ms }),
        ]
    }

    proptest::proptest! {
        /// Whatever comes and however the executor answers: a session has one request with the
        /// executor at most, its requests reach it in the order they came, and every request is
        /// handed on, refused when it came, or given back when the session goes (closed, moved,
        /// expired with nothing waiting): none is lost or handed on twice.
        #[test]
        fn a_sessions_requests_go_one_at_a_time_in_order_and_none_is_lost(
            steps in proptest::collection::vec(step(), 1..120)
        ) {
            let ttl = Duration::from_millis(300);
            let mut now = Instant::now();
            let mut s = SessionRecords::new(7, ttl, now);
            let handle = |id| Handle { id, epoch: 7 };
            for id in 0..2 {
                s.opened(ANN, handle(id), now);
            }
            // What the test holds of each session: its running request (id, a move), whether it
            // is parked, and the last request id handed on.
            let mut running: [Option<(u64, bool)>; 2] = [None; 2];
            let mut parked = [false; 2];
            let mut last_handed = [0u64; 2];
            let (mut submitted, mut handed, mut refused, mut given_back) = (0usize, 0usize, 0usize, 0usize);
            let mut next_request = 1;
            let mut hand = |session: usize, next: Option<Queued>, running: &mut [Option<(u64, bool)>; 2]| {
                if let Some((job, to)) = next {
                    proptest::prop_assert!(running[session].is_none(), "two requests of one session at once");
                    proptest::prop_assert!(to.request_id > last_handed[session], "handed on out of order");
                    last_handed[session] = to.request_id;
                    running[session] = Some((to.request_id, matches!(job, Job::Move { .. })));
                    handed += 1;
                }
                Ok(())
            };
            for step in steps {
                match step {
                    Step::Submit { session, moves } => {
                        let h = handle(session);
                        let job = if moves { Job::Move { session: h } } else { signal(h) };
                        submitted += 1;
                        let request = to(next_request);
                        next_request += 1;
                        match s.submit(ANN, h, job, request, now) {
                            Ok(next) => hand(session as usize, next, &mut running)?,
                            Err(_) => refused += 1,
                        }
                    }
                    Step::Answer { session, parks, closes, moved } => {
                        let i = session as usize;
                        let Some((_, moving)) = running[i].take() else { continue };
                        if moving && moved {
                            given_back += s.moved_out(session, "b:1".into(), handle(session + 10), now).len();
                        } else if moving {
                            let next = s.move_failed(session, now);
                            hand(i, next, &mut running)?;
                        } else if closes {
                            given_back += s.closed(session).len();
                        } else if parks {
                            s.pause(session, now);
                            parked[i] = true;
                        } else {
                            let next = s.answered(session, now);
                            hand(i, next, &mut running)?;
                        }
                    }
                    Step::Unpause { session } => {
                        let i = session as usize;
                        if std::mem::take(&mut parked[i]) {
                            let next = s.unpause(session, now);
                            hand(i, next, &mut running)?;
                        }
                    }
                    Step::Wait { ms } => {
                        now += Duration::from_millis(ms);
                        for id in s.expire(now) {
                            let i = id as usize;
                            proptest::prop_assert!(running[i].is_none() && !parked[i], "session {id} expired in use");
                        }
                    }
                }
            }
            let waiting: usize = s.sessions.values().map(|r| r.waiting.len()).sum();
            proptest::prop_assert_eq!(submitted, handed + refused + given_back + waiting);
        }
    }
}
