//! The one way this crate takes its mutexes.

/// Locks a mutex, taking its data as it is when a thread panicked holding it: what these locks
/// guard is consistent between statements, so a poisoned lock carries no news, and one
/// panicking request must not stop every later one.
pub(crate) trait Locked<T> {
    fn locked(&self) -> std::sync::MutexGuard<'_, T>;
}

impl<T> Locked<T> for std::sync::Mutex<T> {
    fn locked(&self) -> std::sync::MutexGuard<'_, T> {
        self.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
