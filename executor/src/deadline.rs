//! The limit on one execution: a worker sets it on its thread for the job it runs, and a graph
//! run checks it between operators (a model between blocks), ending a run past it with
//! [`ExecError::DeadlineExceeded`]. What the run had computed is dropped with it.

use std::cell::Cell;
use std::time::{Duration, Instant};

use crate::error::ExecError;

thread_local! {
    /// When the run on this thread must end, and the limit it was given.
    static DEADLINE: Cell<Option<(Instant, Duration)>> = const { Cell::new(None) };
}

/// Runs `f` with `limit` (from now) as this thread's deadline; none for `None`.
pub(crate) fn within<T>(limit: Option<Duration>, f: impl FnOnce() -> T) -> T {
    /// Puts the deadline before back, however `f` ends (a panic is caught by the worker).
    struct Restore(Option<(Instant, Duration)>);
    impl Drop for Restore {
        fn drop(&mut self) {
            DEADLINE.set(self.0);
        }
    }
    let _restore = Restore(DEADLINE.replace(limit.map(|l| (Instant::now() + l, l))));
    f()
}

/// What is left of this thread's deadline, and the limit it was given; `None` without one.
pub(crate) fn left() -> Option<(Duration, Duration)> {
    DEADLINE.get().map(|(at, limit)| (at.saturating_duration_since(Instant::now()), limit))
}

/// `Err` once this thread's deadline has passed.
pub(crate) fn check() -> Result<(), ExecError> {
    match DEADLINE.get() {
        Some((at, limit)) if Instant::now() >= at => Err(ExecError::DeadlineExceeded { limit }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_holds_within_its_call_only() {
        assert!(check().is_ok());
        within(Some(Duration::ZERO), || {
            assert!(matches!(check(), Err(ExecError::DeadlineExceeded { .. })));
            within(None, || assert!(check().is_ok()));
            assert!(check().is_err(), "the outer deadline is back");
        });
        assert!(check().is_ok());
        let _ = std::panic::catch_unwind(|| within(Some(Duration::ZERO), || panic!("a failed run")));
        assert!(check().is_ok(), "put back after a panic");
        within(Some(Duration::from_secs(60)), || assert!(check().is_ok()));
    }
}
