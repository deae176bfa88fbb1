//! The one way Djinn's crates take a mutex.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks a mutex, taking its data as it is when a thread panicked holding it: what these locks
/// guard is consistent between statements, so a poisoned lock carries no news, and one
/// panicking request must not stop every later one.
pub trait Locked<T> {
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T> Locked<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mutex_poisoned_by_a_panic_is_still_taken_with_its_data() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let held = std::sync::Arc::clone(&m);
        let _ = std::thread::spawn(move || {
            let mut g = held.locked();
            *g = 2;
            panic!("a request panics holding the lock");
        })
        .join();
        assert!(m.is_poisoned());
        assert_eq!(*m.locked(), 2);
    }
}
