//! The embedded store: one redb file, for `djinn up` and a single control process. Leases are
//! kept in the file with their deadline on the wall clock, so a restarted control process
//! keeps its nodes for as long as their leases would have lasted; a thread deletes the keys of
//! lapsed leases.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition, WriteTransaction};
use tokio::sync::mpsc;

use super::{Created, Event, Revision, Snapshot, Store, StoreError, StoreLease, Watch};
use djinn_sync::Locked;

/// Key → the lease it is bound to (0 for none, 8 bytes little-endian), then the value.
const KV: TableDefinition<&str, &[u8]> = TableDefinition::new("kv");
/// Lease → (time to live, deadline), milliseconds (the deadline since the Unix epoch).
const LEASES: TableDefinition<u64, (u64, u64)> = TableDefinition::new("leases");
/// `revision` and `next_lease`.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

/// How often lapsed leases are looked for: the most a lease outlives its deadline.
const SWEEP_EVERY: Duration = Duration::from_millis(50);

#[derive(Debug, Clone)]
pub struct EmbeddedStore {
    inner: Arc<Inner>,
}

type Watcher = (String, mpsc::UnboundedSender<Result<(Revision, Event), StoreError>>);

struct Inner {
    db: Database,
    /// Watchers, by prefix. Writes send their events while holding this lock, so every
    /// watcher sees them in revision order.
    watchers: Mutex<Vec<Watcher>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore").finish_non_exhaustive()
    }
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn encode(lease: Option<StoreLease>, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + value.len());
    out.extend_from_slice(&lease.unwrap_or(0).to_le_bytes());
    out.extend_from_slice(value);
    out
}

/// The lease and value of a stored entry; `None` if the file holds something shorter than a
/// lease (a damaged file: reported, never a panic).
fn decode(stored: &[u8]) -> Option<(StoreLease, &[u8])> {
    let (lease, value) = stored.split_at_checked(8)?;
    Some((u64::from_le_bytes(lease.try_into().ok()?), value))
}

/// A write transaction with the revision it will commit at.
struct Write {
    txn: WriteTransaction,
    revision: Revision,
    events: Vec<(Revision, Event)>,
}

impl Write {
    fn next_revision(&mut self, event: Event) -> Revision {
        self.revision += 1;
        self.events.push((self.revision, event));
        self.revision
    }
}

impl Inner {
    fn watchers(&self) -> MutexGuard<'_, Vec<Watcher>> {
        self.watchers.locked()
    }

    /// Runs `f` in one write transaction and, once it commits, tells the watchers.
    fn write<T>(&self, f: impl FnOnce(&mut Write) -> Result<T, StoreError>) -> Result<T, StoreError> {
        let mut watchers = self.watchers();
        let txn = self.db.begin_write().map_err(backend)?;
        let revision =
            txn.open_table(META).map_err(backend)?.get("revision").map_err(backend)?.map_or(0, |v| v.value());
        let mut write = Write { txn, revision, events: Vec::new() };
        let out = f(&mut write)?;
        let Write { txn, revision, events } = write;
        txn.open_table(META).map_err(backend)?.insert("revision", revision).map_err(backend)?;
        txn.commit().map_err(backend)?;
        watchers.retain(|(prefix, tx)| {
            events
                .iter()
                .filter(|(_, e)| key_of(e).starts_with(prefix.as_str()))
                .all(|e| tx.send(Ok(e.clone())).is_ok())
        });
        Ok(out)
    }

    fn revision(&self) -> Result<Revision, StoreError> {
        let txn = self.db.begin_read().map_err(backend)?;
        match txn.open_table(META) {
            Ok(meta) => Ok(meta.get("revision").map_err(backend)?.map_or(0, |v| v.value())),
            Err(redb::TableError::TableDoesNotExist(_)) => Ok(0),
            Err(e) => Err(backend(e)),
        }
    }

    fn live_lease(write: &Write, lease: StoreLease, now: u64) -> Result<(u64, u64), StoreError> {
        let leases = write.txn.open_table(LEASES).map_err(backend)?;
        let found = leases.get(lease).map_err(backend)?.map(|v| v.value());
        found.filter(|&(_, deadline)| deadline > now).ok_or(StoreError::LeaseNotFound(lease))
    }

    fn put(
        &self,
        key: &str,
        value: &[u8],
        lease: Option<StoreLease>,
        only_if_absent: bool,
    ) -> Result<Created, StoreError> {
        self.write(|w| {
            if let Some(lease) = lease {
                Self::live_lease(w, lease, now_ms())?;
            }
            let mut kv = w.txn.open_table(KV).map_err(backend)?;
            if only_if_absent && let Some(existing) = kv.get(key).map_err(backend)? {
                let (_, value) =
                    decode(existing.value()).ok_or_else(|| backend(format!("entry {key:?} is damaged")))?;
                return Ok(Created::Exists(value.to_vec()));
            }
            kv.insert(key, encode(lease, value).as_slice()).map_err(backend)?;
            drop(kv);
            Ok(Created::Created(w.next_revision(Event::Put { key: key.to_owned(), value: value.to_vec() })))
        })
    }

    /// Deletes the leases that match `ending` (given a lease and its deadline) and the keys
    /// bound to them.
    fn end_leases(&self, ending: impl Fn(StoreLease, u64) -> bool) -> Result<(), StoreError> {
        // Most sweeps find nothing: look in a read transaction first, since a write one
        // commits (durably) even when it changes nothing.
        let read = self.db.begin_read().map_err(backend)?;
        if leases_matching(&read.open_table(LEASES).map_err(backend)?, &ending)?.is_empty() {
            return Ok(());
        }
        drop(read);
        self.write(|w| {
            let mut leases = w.txn.open_table(LEASES).map_err(backend)?;
            let ended = leases_matching(&leases, &ending)?;
            if ended.is_empty() {
                return Ok(());
            }
            for id in &ended {
                leases.remove(*id).map_err(backend)?;
            }
            drop(leases);
            let mut kv = w.txn.open_table(KV).map_err(backend)?;
            let keys: Vec<String> = kv
                .iter()
                .map_err(backend)?
                .filter_map(|entry| entry.ok())
                .filter(|(_, v)| decode(v.value()).is_some_and(|(lease, _)| ended.contains(&lease)))
                .map(|(k, _)| k.value().to_owned())
                .collect();
            for key in &keys {
                kv.remove(key.as_str()).map_err(backend)?;
            }
            drop(kv);
            for key in keys {
                w.next_revision(Event::Delete { key });
            }
            Ok(())
        })
    }
}

fn leases_matching(
    leases: &impl ReadableTable<u64, (u64, u64)>,
    ending: &impl Fn(StoreLease, u64) -> bool,
) -> Result<Vec<StoreLease>, StoreError> {
    Ok(leases
        .iter()
        .map_err(backend)?
        .filter_map(|entry| entry.ok())
        .filter(|(id, v)| ending(id.value(), v.value().1))
        .map(|(id, _)| id.value())
        .collect())
}

fn key_of(event: &Event) -> &str {
    match event {
        Event::Put { key, .. } | Event::Delete { key } => key,
    }
}

impl EmbeddedStore {
    /// Opens (or creates) the store at `path` and starts the thread that ends lapsed leases.
    /// The store `djinn control` and `djinn up` keep when given no `--store`: `control.redb` in
    /// the state directory, `$DJINN_STATE_DIR`, else `$XDG_STATE_HOME/djinn`, else
    /// `~/.local/state/djinn` (the XDG default), made readable by its owner only if missing;
    /// never the current directory.
    pub fn default_path() -> Result<PathBuf, StoreError> {
        let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        let dir = env("DJINN_STATE_DIR")
            .or_else(|| env("XDG_STATE_HOME").map(|d| d.join("djinn")))
            .or_else(|| env("HOME").map(|h| h.join(".local/state/djinn")))
            .ok_or_else(|| backend("no state directory: set DJINN_STATE_DIR or HOME, or give --store"))?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| backend(format!("cannot make the state directory {}: {e}", dir.display())))?;
        Ok(dir.join("control.redb"))
    }

    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let db = Database::create(path).map_err(|e| backend(format!("{}: {e}", path.display())))?;
        let inner = Arc::new(Inner { db, watchers: Mutex::new(Vec::new()) });
        // Create the tables, so readers never meet a missing one.
        inner.write(|w| {
            w.txn.open_table(KV).map_err(backend)?;
            w.txn.open_table(LEASES).map_err(backend)?;
            Ok(())
        })?;
        let weak: Weak<Inner> = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("djinn-store-leases".into())
            .spawn(move || {
                // A store that cannot write fails every sweep: said once, not every 50 ms.
                let mut failing = false;
                while let Some(inner) = weak.upgrade() {
                    let now = now_ms();
                    match inner.end_leases(|_, deadline| deadline <= now) {
                        Err(e) if !failing => {
                            failing = true;
                            tracing::warn!(error = %e, "cannot end lapsed leases (said once until they can be ended again)");
                        }
                        Err(_) => {}
                        Ok(()) if failing => {
                            failing = false;
                            tracing::info!("lapsed leases can be ended again");
                        }
                        Ok(()) => {}
                    }
                    drop(inner);
                    std::thread::sleep(SWEEP_EVERY);
                }
            })
            .map_err(backend)?;
        Ok(Self { inner })
    }

    /// Runs a blocking store operation off the async workers (a commit waits for the disk).
    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || f(&inner)).await.map_err(backend)?
    }
}

impl Store for EmbeddedStore {
    async fn watch(&self, prefix: &str) -> Result<(Snapshot, Watch), StoreError> {
        let prefix = prefix.to_owned();
        self.run(move |inner| {
            // Under the watchers' lock no write can commit between the snapshot and the
            // subscription.
            let mut watchers = inner.watchers();
            let revision = inner.revision()?;
            let txn = inner.db.begin_read().map_err(backend)?;
            let kv = txn.open_table(KV).map_err(backend)?;
            let mut entries = Vec::new();
            for entry in kv.range(prefix.as_str()..).map_err(backend)? {
                let (key, stored) = entry.map_err(backend)?;
                let key = key.value();
                if !key.starts_with(prefix.as_str()) {
                    break;
                }
                let (_, value) = decode(stored.value()).ok_or_else(|| backend(format!("entry {key:?} is damaged")))?;
                entries.push((key.to_owned(), value.to_vec()));
            }
            let (tx, rx) = mpsc::unbounded_channel();
            watchers.push((prefix, tx));
            Ok((Snapshot { revision, entries }, rx))
        })
        .await
    }

    async fn grant(&self, ttl_ms: u64) -> Result<StoreLease, StoreError> {
        self.run(move |inner| {
            inner.write(|w| {
                let mut meta = w.txn.open_table(META).map_err(backend)?;
                let id = meta.get("next_lease").map_err(backend)?.map_or(1, |v| v.value());
                meta.insert("next_lease", id + 1).map_err(backend)?;
                w.txn.open_table(LEASES).map_err(backend)?.insert(id, (ttl_ms, now_ms() + ttl_ms)).map_err(backend)?;
                Ok(id)
            })
        })
        .await
    }

    async fn keep_alive(&self, lease: StoreLease) -> Result<(), StoreError> {
        self.run(move |inner| {
            inner.write(|w| {
                let now = now_ms();
                let (ttl, _) = Inner::live_lease(w, lease, now)?;
                w.txn.open_table(LEASES).map_err(backend)?.insert(lease, (ttl, now + ttl)).map_err(backend)?;
                Ok(())
            })
        })
        .await
    }

    async fn revoke(&self, lease: StoreLease) -> Result<(), StoreError> {
        self.run(move |inner| inner.end_leases(|id, _| id == lease)).await
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let key = key.to_owned();
        self.run(move |inner| {
            let txn = inner.db.begin_read().map_err(backend)?;
            let kv = txn.open_table(KV).map_err(backend)?;
            let Some(stored) = kv.get(key.as_str()).map_err(backend)? else { return Ok(None) };
            let (_, value) = decode(stored.value()).ok_or_else(|| backend(format!("entry {key:?} is damaged")))?;
            Ok(Some(value.to_vec()))
        })
        .await
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<StoreLease>) -> Result<Revision, StoreError> {
        let key = key.to_owned();
        match self.run(move |inner| inner.put(&key, &value, lease, false)).await? {
            Created::Created(revision) => Ok(revision),
            Created::Exists(_) => Err(backend("a put found its key present")),
        }
    }

    async fn create(&self, key: &str, value: Vec<u8>, lease: Option<StoreLease>) -> Result<Created, StoreError> {
        let key = key.to_owned();
        self.run(move |inner| inner.put(&key, &value, lease, true)).await
    }

    async fn delete(&self, key: &str) -> Result<Revision, StoreError> {
        let key = key.to_owned();
        self.run(move |inner| {
            inner.write(|w| {
                let removed = w.txn.open_table(KV).map_err(backend)?.remove(key.as_str()).map_err(backend)?.is_some();
                Ok(if removed { w.next_revision(Event::Delete { key }) } else { w.revision })
            })
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn changes_are_watched_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&dir.path().join("control.redb")).unwrap();
        tests::changes_are_watched_in_order(&store, "/t/").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn leased_keys_go_with_their_lease() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&dir.path().join("control.redb")).unwrap();
        tests::leased_keys_go_with_their_lease(&store, "/t/", 400).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reopened_store_keeps_keys_revisions_and_live_leases() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.redb");
        let (lease, revision) = {
            let store = EmbeddedStore::open(&path).unwrap();
            let lease = store.grant(60_000).await.unwrap();
            store.put("/t/leased", b"a".to_vec(), Some(lease)).await.unwrap();
            (lease, store.put("/t/plain", b"b".to_vec(), None).await.unwrap())
        };
        // The sweeper thread holds only a weak reference: the file is closed once the store is
        // dropped and it wakes.
        std::thread::sleep(SWEEP_EVERY * 3);
        let store = EmbeddedStore::open(&path).unwrap();
        let (snapshot, _) = store.watch("/t/").await.unwrap();
        assert_eq!(snapshot.revision, revision);
        assert_eq!(snapshot.entries, vec![("/t/leased".into(), b"a".to_vec()), ("/t/plain".into(), b"b".to_vec())]);
        store.keep_alive(lease).await.unwrap();
        assert!(store.grant(1000).await.unwrap() > lease);
        assert!(store.put("/t/plain", b"c".to_vec(), None).await.unwrap() > revision);
    }
}
