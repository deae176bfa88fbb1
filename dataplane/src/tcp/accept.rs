//! When to accept again after `accept` failed. Out of descriptors (EMFILE, ENFILE) or memory
//! (ENOBUFS, ENOMEM), the connection stays in the listener's backlog and the listener stays
//! ready, so accepting again at once would spin the poller; a connection that went away before
//! it was taken (ECONNABORTED, EPROTO, EPERM) is no reason to wait.

use std::io;
use std::time::{Duration, Instant};

const FIRST_DELAY: Duration = Duration::from_millis(10);
const LONGEST_DELAY: Duration = Duration::from_secs(1);

/// The backoff of one listener: no I/O, the time passed in.
#[derive(Debug, Default)]
pub(crate) struct AcceptBackoff {
    delay: Duration,
    retry_at: Option<Instant>,
}

/// Whether an accept error is one connection's, to be passed over at once.
pub(crate) fn lost_before_taken(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::Interrupted
    ) || matches!(error.raw_os_error(), Some(libc::EPROTO | libc::EPERM))
}

impl AcceptBackoff {
    /// A connection was taken: the next failure waits the shortest time again.
    pub fn accepted(&mut self) {
        self.delay = Duration::ZERO;
    }

    /// Accept failed with `error` at `now`: true when the listener should be tried again at
    /// once, else it waits until [`Self::retry_at`] (twice as long as last time, up to a second).
    pub fn failed(&mut self, error: &io::Error, now: Instant) -> bool {
        if lost_before_taken(error) {
            return true;
        }
        self.delay = (self.delay * 2).clamp(FIRST_DELAY, LONGEST_DELAY);
        self.retry_at = Some(now + self.delay);
        tracing::warn!(error = %error, retry_in = ?self.delay, "accept failed: new connections wait");
        false
    }

    /// When the listener is to be tried again, while it waits.
    pub fn retry_at(&self) -> Option<Instant> {
        self.retry_at
    }

    /// True (once) when the wait is over at `now`.
    pub fn due(&mut self, now: Instant) -> bool {
        if self.retry_at.is_some_and(|at| at <= now) {
            self.retry_at = None;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emfile() -> io::Error {
        io::Error::from_raw_os_error(libc::EMFILE)
    }

    #[test]
    fn out_of_descriptors_waits_longer_each_time_up_to_a_second() {
        let (mut backoff, start) = (AcceptBackoff::default(), Instant::now());
        let mut waits = Vec::new();
        let mut now = start;
        for _ in 0..10 {
            assert!(!backoff.failed(&emfile(), now));
            let at = backoff.retry_at().unwrap();
            assert!(!backoff.due(at - Duration::from_millis(1)), "not before its time");
            assert!(backoff.due(at));
            assert!(!backoff.due(at), "due once");
            waits.push(at - now);
            now = at;
        }
        assert_eq!(waits[0], FIRST_DELAY);
        assert!(waits.windows(2).all(|w| w[1] == (w[0] * 2).min(LONGEST_DELAY)), "{waits:?}");
        assert_eq!(*waits.last().unwrap(), LONGEST_DELAY);
        backoff.accepted();
        assert!(!backoff.failed(&io::Error::from_raw_os_error(libc::ENFILE), now));
        assert_eq!(backoff.retry_at().unwrap() - now, FIRST_DELAY, "a connection taken starts again short");
    }

    #[test]
    fn a_connection_lost_before_it_was_taken_is_passed_over_at_once() {
        // A fake clock's reading, not a measurement: the backoff is told the time.
        let (mut backoff, now) = (AcceptBackoff::default(), Instant::now());
        for errno in [libc::ECONNABORTED, libc::EPROTO, libc::EPERM, libc::EINTR] {
            assert!(backoff.failed(&io::Error::from_raw_os_error(errno), now), "errno {errno}");
            assert_eq!(backoff.retry_at(), None);
        }
    }
}
