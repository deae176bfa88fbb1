//! Principals and their tokens kept in the metadata store (an etcd key), so that every control
//! process and node of a cluster reads the same tokens and a rotation is one write: the key
//! holds the token file's JSON document, and each process watches it.
//!
//! A change that does not parse, or the key's deletion, leaves the principals as they were
//! (with a warning), as a broken token file does: a typo must not lock everyone out, nor let
//! everyone in. When the store cannot be reached, the principals also stay, and the watch
//! starts again from the key's current value once it can.

use std::sync::Arc;
use std::time::Duration;

use djinn_auth::{Authenticator, LoadError, Origin};

use crate::store::{EtcdStore, Event, Store, StoreError};

/// Where the principals are kept unless told otherwise.
pub const DEFAULT_KEY: &str = "/djinn/auth/principals";

/// How long a watch that failed waits before it starts again, at first and at most.
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum PrincipalsError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("no principals at {key:?} in the store: write them there first (`djinn tokens put`)")]
    Missing { key: String },
    #[error(transparent)]
    Invalid(#[from] LoadError),
    #[error("cannot start the thread that watches the principals: {0}")]
    Thread(std::io::Error),
}

fn origin(key: &str) -> Origin {
    Origin::Elsewhere(format!("the store's key {key:?}"))
}

/// The principals at `key` now.
pub async fn load(store: &impl Store, key: &str) -> Result<Arc<Authenticator>, PrincipalsError> {
    let document = store.get(key).await?.ok_or_else(|| PrincipalsError::Missing { key: key.to_owned() })?;
    Ok(Authenticator::from_json(origin(key), &document)?)
}

/// Writes the principals of `document` (a token file's JSON) at `key`, if they are valid:
/// what every process watching the key will verify tokens against.
pub async fn put(store: &impl Store, key: &str, document: Vec<u8>) -> Result<(), PrincipalsError> {
    Authenticator::from_json(origin(key), &document)?;
    store.put(key, document, None).await?;
    Ok(())
}

/// Keeps `auth` equal to the principals at `key` for as long as it runs (cancel it by dropping
/// the future).
pub async fn keep_updated(store: &impl Store, key: &str, auth: &Authenticator) {
    let mut retry = RETRY_FIRST;
    loop {
        // Another key may start with this one; only the key itself is read.
        let ended = match store.watch(key).await {
            Ok((snapshot, mut watch)) => {
                retry = RETRY_FIRST;
                match snapshot.entries.iter().find(|(k, _)| k == key) {
                    Some((_, document)) => apply(auth, key, document),
                    None => tracing::warn!(key, "the principals' key is absent: the previous principals stay"),
                }
                loop {
                    match watch.recv().await {
                        Some(Ok((_, Event::Put { key: k, value }))) if k == key => apply(auth, key, &value),
                        Some(Ok((_, Event::Delete { key: k }))) if k == key => {
                            tracing::warn!(key, "the principals' key was deleted: the previous principals stay");
                        }
                        Some(Ok(_)) => {}
                        Some(Err(e)) => break e,
                        None => break StoreError::Backend("the watch's sender went away".into()),
                    }
                }
            }
            Err(e) => e,
        };
        tracing::warn!(key, error = %ended, retry_in = ?retry, "cannot watch the principals: the current ones stay");
        tokio::time::sleep(retry).await;
        retry = (retry * 2).min(RETRY_MAX);
    }
}

fn apply(auth: &Authenticator, key: &str, document: &[u8]) {
    match auth.update(document) {
        Ok(true) => tracing::info!(key, "principals reloaded"),
        Ok(false) => {}
        Err(e) => tracing::warn!(error = %e, "principals not reloaded: the previous ones stay"),
    }
}

/// The principals kept in etcd, watched on a thread of its own (with its own runtime, so a
/// process without one, a node, can have them) until this is dropped.
pub struct EtcdPrincipals {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for EtcdPrincipals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdPrincipals").finish_non_exhaustive()
    }
}

impl EtcdPrincipals {
    /// Connects to etcd at `endpoints`, reads the principals at `key` (an error if they are
    /// absent or invalid), and keeps them up to date.
    pub fn start(endpoints: Vec<String>, key: String) -> Result<(Arc<Authenticator>, Self), PrincipalsError> {
        let (loaded_tx, loaded_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("djinn-principals".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = loaded_tx.send(Err(PrincipalsError::Thread(e)));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let loaded = async {
                        let store = EtcdStore::connect(&endpoints).await?;
                        let auth = load(&store, &key).await?;
                        Ok::<_, PrincipalsError>((store, auth))
                    };
                    let (store, auth) = match loaded.await {
                        Ok(loaded) => loaded,
                        Err(e) => {
                            let _ = loaded_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = loaded_tx.send(Ok(Arc::clone(&auth)));
                    tokio::select! {
                        () = keep_updated(&store, &key, &auth) => {}
                        _ = stopped => {}
                    }
                });
            })
            .map_err(PrincipalsError::Thread)?;
        let watch = Self { stop: Some(stop), thread: Some(thread) };
        match loaded_rx.recv() {
            Ok(Ok(auth)) => Ok((auth, watch)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(PrincipalsError::Thread(std::io::Error::other("the principals' thread ended early"))),
        }
    }
}

impl Drop for EtcdPrincipals {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use djinn_auth::AuthError;

    use super::*;
    use crate::store::EmbeddedStore;
    use crate::store::local_etcd::LocalEtcd;

    const KEY: &str = "/djinn/auth/principals";

    fn document(tokens: &[(&str, &str)]) -> Vec<u8> {
        let principals: Vec<_> =
            tokens.iter().map(|(name, token)| serde_json::json!({"name": name, "tokens": [token]})).collect();
        serde_json::to_vec(&serde_json::json!({ "principals": principals })).unwrap()
    }

    async fn until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "{what}: not within 10 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Rotation, a broken document, a deletion and a neighbouring key, on one store.
    async fn principals_follow_the_key(store: &impl Store) {
        assert!(matches!(load(store, KEY).await, Err(PrincipalsError::Missing { .. })));
        assert!(matches!(put(store, KEY, b"{}".to_vec()).await, Err(PrincipalsError::Invalid(_))));
        assert_eq!(store.get(KEY).await.unwrap(), None, "an invalid document is not written");
        put(store, KEY, document(&[("alice", "alice-secret-0001")])).await.unwrap();
        let auth = load(store, KEY).await.unwrap();
        let alice = auth.verify("alice-secret-0001").unwrap().tenant;
        let keeper = keep_updated(store, KEY, &auth);
        let steps = async {
            put(store, KEY, document(&[("alice", "alice-secret-0002")])).await.unwrap();
            until("the rotation", || auth.verify("alice-secret-0002").is_ok()).await;
            assert_eq!(auth.verify("alice-secret-0001"), Err(AuthError::Invalid));
            assert_eq!(auth.verify("alice-secret-0002").unwrap().tenant, alice);
            // Written behind `put`'s back: refused by the watcher, the principals stay.
            store.put(KEY, b"not json".to_vec(), None).await.unwrap();
            store.delete(KEY).await.unwrap();
            store.put(&format!("{KEY}-old"), document(&[("mallory", "mallory-secret-01")]), None).await.unwrap();
            put(store, KEY, document(&[("alice", "alice-secret-0002"), ("bob", "bob-secret-000001")])).await.unwrap();
            until("bob's arrival", || auth.verify("bob-secret-000001").is_ok()).await;
            assert_eq!(auth.verify("alice-secret-0002").unwrap().tenant, alice);
            assert_eq!(auth.verify("mallory-secret-01"), Err(AuthError::Invalid));
        };
        tokio::select! {
            () = keeper => unreachable!("keep_updated runs until dropped"),
            () = steps => {}
        }
    }

    #[tokio::test]
    async fn principals_follow_the_key_in_the_embedded_store() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&dir.path().join("store.redb")).unwrap();
        principals_follow_the_key(&store).await;
    }

    #[tokio::test]
    async fn principals_follow_the_key_in_etcd() {
        let etcd = LocalEtcd::start();
        let store = EtcdStore::connect(std::slice::from_ref(&etcd.url)).await.unwrap();
        principals_follow_the_key(&store).await;
    }

    /// The thread-backed watcher: absent principals fail the start; present ones are kept up
    /// to date, also across an etcd restart.
    #[test]
    fn etcd_principals_survive_an_etcd_restart() {
        let mut etcd = LocalEtcd::start();
        let endpoints = vec![etcd.url.clone()];
        let e = EtcdPrincipals::start(endpoints.clone(), KEY.into()).unwrap_err();
        assert!(matches!(e, PrincipalsError::Missing { .. }), "{e}");
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let write = |tokens: &[(&str, &str)]| {
            runtime.block_on(async {
                let store = EtcdStore::connect(&endpoints).await.unwrap();
                put(&store, KEY, document(tokens)).await.unwrap();
            });
        };
        write(&[("alice", "alice-secret-0001")]);
        let (auth, watch) = EtcdPrincipals::start(endpoints.clone(), KEY.into()).unwrap();
        assert!(auth.verify("alice-secret-0001").is_ok());
        etcd.restart();
        write(&[("alice", "alice-secret-0003")]);
        let deadline = Instant::now() + Duration::from_secs(20);
        while auth.verify("alice-secret-0003").is_err() {
            assert!(Instant::now() < deadline, "the change after the restart was not picked up");
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(watch);
    }
}
