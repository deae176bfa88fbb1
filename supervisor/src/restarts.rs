//! How often a tenant's executor process may be started again: a few restarts at once, then a
//! wait that doubles while its processes keep ending. No I/O and no clock: the router passes
//! the time.
//!
//! A tenant whose graph crashes its process on every call would otherwise have the node fork and
//! exec a process (and load libtorch, and its models) per request.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Ends within `WINDOW` that start again at once; past them, each start waits.
pub const FREE_RESTARTS: usize = 3;
/// How far back ends count.
pub const WINDOW: Duration = Duration::from_secs(60);
/// The first wait past the free restarts; each further end within the window doubles it.
pub const FIRST_WAIT: Duration = Duration::from_secs(1);
pub const LONGEST_WAIT: Duration = Duration::from_secs(60);

/// One tenant's recent process ends.
#[derive(Debug, Clone, Default)]
pub struct Restarts {
    /// When its processes ended, the oldest first, none older than `WINDOW`.
    ended: VecDeque<Instant>,
    /// No process starts before this.
    not_before: Option<Instant>,
    /// The wait the next end past the free ones sets.
    next_wait: Option<Duration>,
}

impl Restarts {
    /// A process of the tenant ended at `now`.
    pub fn ended(&mut self, now: Instant) {
        self.forget_before(now);
        self.ended.push_back(now);
        if self.ended.len() <= FREE_RESTARTS {
            self.next_wait = None;
            return;
        }
        let wait = self.next_wait.unwrap_or(FIRST_WAIT);
        self.not_before = Some(now + wait);
        self.next_wait = Some((wait * 2).min(LONGEST_WAIT));
    }

    /// How long before a process may start, if it may not at `now`: only while more than
    /// `FREE_RESTARTS` ends lie within the window.
    pub fn wait_at(&self, now: Instant) -> Option<Duration> {
        if self.recent(now) <= FREE_RESTARTS {
            return None;
        }
        self.not_before.filter(|&at| at > now).map(|at| at - now)
    }

    /// The ends within `WINDOW` of `now`.
    pub fn recent(&self, now: Instant) -> usize {
        self.ended.iter().filter(|&&at| now.saturating_duration_since(at) < WINDOW).count()
    }

    /// Whether it has nothing to remember at `now` (its record can go).
    pub fn is_idle(&self, now: Instant) -> bool {
        self.recent(now) == 0 && self.wait_at(now).is_none()
    }

    fn forget_before(&mut self, now: Instant) {
        while self.ended.front().is_some_and(|&at| now.saturating_duration_since(at) >= WINDOW) {
            self.ended.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn three_ends_start_again_at_once_then_the_wait_doubles_up_to_a_minute() {
        let t0 = Instant::now();
        let mut restarts = Restarts::default();
        for i in 0..FREE_RESTARTS as u64 {
            restarts.ended(t0 + Duration::from_millis(i));
            assert_eq!(restarts.wait_at(t0 + Duration::from_millis(i)), None, "end {i}");
        }
        // Ends as fast as processes start: each wait twice the last, up to a minute.
        let mut now = t0 + Duration::from_millis(10);
        for want in [1, 2, 4, 8, 16, 32, 60, 60] {
            restarts.ended(now);
            assert_eq!(restarts.wait_at(now), Some(Duration::from_secs(want)));
            assert_eq!(restarts.wait_at(now + Duration::from_secs(want)), None, "it may start once the wait is over");
            now += Duration::from_millis(1);
        }
    }

    #[test]
    fn a_process_that_lived_past_the_window_starts_the_count_again() {
        let t0 = Instant::now();
        let mut restarts = Restarts::default();
        for i in 0..=FREE_RESTARTS as u64 {
            restarts.ended(t0 + Duration::from_millis(i));
        }
        assert!(restarts.wait_at(t0 + Duration::from_millis(10)).is_some());
        let later = t0 + WINDOW + Duration::from_secs(1);
        assert!(restarts.is_idle(later));
        restarts.ended(later);
        assert_eq!((restarts.wait_at(later), restarts.recent(later)), (None, 1));
    }

    proptest! {
        /// Whatever the ends, and whenever asked, a wait is never longer than a minute, none
        /// while at most `FREE_RESTARTS` ends lie within the window, and one after each end
        /// past them.
        #[test]
        fn waits_are_bounded_and_only_past_the_free_restarts(
            gaps_ms in proptest::collection::vec((0u64..90_000, 0u64..90_000), 1..40),
        ) {
            let mut now = Instant::now();
            let mut restarts = Restarts::default();
            for (gap, asked_after) in gaps_ms {
                now += Duration::from_millis(gap);
                restarts.ended(now);
                prop_assert_eq!(restarts.wait_at(now).is_some(), restarts.recent(now) > FREE_RESTARTS);
                let asked = now + Duration::from_millis(asked_after);
                let wait = restarts.wait_at(asked);
                prop_assert!(wait.is_none_or(|w| w <= LONGEST_WAIT));
                if restarts.recent(asked) <= FREE_RESTARTS {
                    prop_assert!(wait.is_none(), "{} recent ends wait {wait:?}", restarts.recent(asked));
                }
            }
        }
    }
}
