//! The metadata store: a key-value store with leases, as etcd is one. The control plane keeps
//! everything it must not lose or must share with other control processes here (nodes and
//! their leases, models, sessions, which node was given which model) and mirrors it in memory
//! from a watch, so every control process on one store decides from the same state.
//!
//! Two backends: [`embedded::EmbeddedStore`] (one redb file: `djinn up` and single-control
//! deployments) and [`etcd::EtcdStore`] (several control processes on one etcd cluster).

use std::future::Future;

use tokio::sync::mpsc;

pub mod embedded;
pub mod etcd;
#[cfg(any(test, feature = "local-etcd"))]
pub mod local_etcd;

pub use embedded::EmbeddedStore;
pub use etcd::EtcdStore;

/// A lease in the store. Keys put with a lease are deleted when it lapses or is revoked.
pub type StoreLease = u64;

/// The store's logical clock: every change has a larger revision than the one before.
pub type Revision = u64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Put { key: String, value: Vec<u8> },
    Delete { key: String },
}

/// Everything under a prefix at one revision.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub revision: Revision,
    pub entries: Vec<(String, Vec<u8>)>,
}

/// The changes after a snapshot, in revision order. An `Err` ends the stream: the watcher
/// must start again from a new snapshot.
pub type Watch = mpsc::UnboundedReceiver<Result<(Revision, Event), StoreError>>;

/// The outcome of [`Store::create`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Created {
    Created(Revision),
    /// The key was there already, with this value (left unchanged).
    Exists(Vec<u8>),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("lease {0} has lapsed or was never granted")]
    LeaseNotFound(StoreLease),
    #[error("metadata store: {0}")]
    Backend(String),
}

/// A key-value store with leases. Keys are UTF-8 paths; values are opaque bytes. Writes are
/// linearizable: a write's revision is larger than every revision a watcher saw before it.
pub trait Store: Send + Sync + 'static {
    /// Every key under `prefix` now, and every change under it after that snapshot.
    fn watch(&self, prefix: &str) -> impl Future<Output = Result<(Snapshot, Watch), StoreError>> + Send;

    /// A new lease lasting `ttl_ms` unless kept alive (etcd rounds up to whole seconds).
    fn grant(&self, ttl_ms: u64) -> impl Future<Output = Result<StoreLease, StoreError>> + Send;

    /// Restarts the lease's time to live; `LeaseNotFound` once it has lapsed.
    fn keep_alive(&self, lease: StoreLease) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Ends a lease now, deleting its keys. Revoking a lapsed lease is not an error.
    fn revoke(&self, lease: StoreLease) -> impl Future<Output = Result<(), StoreError>> + Send;

    fn get(&self, key: &str) -> impl Future<Output = Result<Option<Vec<u8>>, StoreError>> + Send;

    fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<StoreLease>,
    ) -> impl Future<Output = Result<Revision, StoreError>> + Send;

    /// Puts `key` only if it is absent (compare-and-swap on its existence).
    fn create(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<StoreLease>,
    ) -> impl Future<Output = Result<Created, StoreError>> + Send;

    /// Deletes `key` if present; the revision is the store's current one if it was absent.
    fn delete(&self, key: &str) -> impl Future<Output = Result<Revision, StoreError>> + Send;
}

#[cfg(test)]
pub(crate) mod tests {
    //! The behaviour every backend must have, run against each.

    use std::time::Duration;

    use super::*;

    async fn next(watch: &mut Watch) -> (Revision, Event) {
        tokio::time::timeout(Duration::from_secs(10), watch.recv())
            .await
            .expect("no event within 10 s")
            .expect("the watch ended")
            .expect("the watch failed")
    }

    /// Puts, creates and deletes show in the watch in order, with growing revisions.
    pub async fn changes_are_watched_in_order(store: &impl Store, prefix: &str) {
        let (snapshot, mut watch) = store.watch(prefix).await.unwrap();
        assert!(snapshot.entries.is_empty(), "{snapshot:?}");
        let a = format!("{prefix}a");
        let r1 = store.put(&a, b"1".to_vec(), None).await.unwrap();
        assert!(r1 > snapshot.revision);
        assert_eq!(store.create(&a, b"2".to_vec(), None).await.unwrap(), Created::Exists(b"1".to_vec()));
        let b = format!("{prefix}b");
        let Created::Created(r2) = store.create(&b, b"3".to_vec(), None).await.unwrap() else { panic!("{b} existed") };
        assert_eq!(store.get(&b).await.unwrap(), Some(b"3".to_vec()));
        let r3 = store.delete(&a).await.unwrap();
        assert_eq!(store.get(&a).await.unwrap(), None);
        store.put("elsewhere/x", b"4".to_vec(), None).await.unwrap();
        assert_eq!(next(&mut watch).await, (r1, Event::Put { key: a.clone(), value: b"1".to_vec() }));
        assert_eq!(next(&mut watch).await, (r2, Event::Put { key: b.clone(), value: b"3".to_vec() }));
        assert_eq!(next(&mut watch).await, (r3, Event::Delete { key: a }));
        assert!(r1 < r2 && r2 < r3);
        let (snapshot, _) = store.watch(prefix).await.unwrap();
        assert_eq!(snapshot.entries, vec![(b, b"3".to_vec())]);
        assert!(snapshot.revision >= r3);
    }

    /// A lease's keys go when it lapses (or is revoked), and a lapsed lease cannot be renewed
    /// or written with.
    pub async fn leased_keys_go_with_their_lease(store: &impl Store, prefix: &str, ttl_ms: u64) {
        let (_, mut watch) = store.watch(prefix).await.unwrap();
        let kept = store.grant(ttl_ms).await.unwrap();
        let lapsing = store.grant(ttl_ms).await.unwrap();
        let revoked = store.grant(ttl_ms).await.unwrap();
        for (name, lease) in [("kept", kept), ("lapsing", lapsing), ("revoked", revoked)] {
            store.put(&format!("{prefix}{name}"), vec![], Some(lease)).await.unwrap();
            next(&mut watch).await;
        }
        store.revoke(revoked).await.unwrap();
        assert_eq!(next(&mut watch).await.1, Event::Delete { key: format!("{prefix}revoked") });
        // A hang guard: the lease lapses seconds after it was granted (`ttl_ms`; etcd makes a
        // lease last 2 s at least).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let lapsed = loop {
            store.keep_alive(kept).await.unwrap();
            let event = tokio::time::timeout(Duration::from_millis(ttl_ms / 4), watch.recv()).await;
            if let Ok(event) = event {
                break event.unwrap().unwrap().1;
            }
            assert!(tokio::time::Instant::now() < deadline, "the lease did not lapse");
        };
        assert_eq!(lapsed, Event::Delete { key: format!("{prefix}lapsing") });
        assert_eq!(store.keep_alive(lapsing).await, Err(StoreError::LeaseNotFound(lapsing)));
        assert_eq!(
            store.put(&format!("{prefix}late"), vec![], Some(lapsing)).await,
            Err(StoreError::LeaseNotFound(lapsing))
        );
        let (snapshot, _) = store.watch(prefix).await.unwrap();
        let keys: Vec<&str> = snapshot.entries.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, vec![format!("{prefix}kept")]);
    }
}
