//! The etcd store: several control processes on one etcd cluster share their state through
//! it. Leases, revisions and watches are etcd's own; this is a thin mapping of [`Store`] onto
//! etcd's v3 API.

use std::future::Future;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, PutOptions, ResponseHeader, TxnOp,
    TxnOpResponse, WatchOptions, WatchStream,
};
use tokio::sync::mpsc;

use super::{Created, Event, Revision, Snapshot, Store, StoreError, StoreLease, Watch};

/// How long connecting may take before a wrong or dead address is reported as such (the
/// client's channel would otherwise wait for the endpoint forever).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one request may wait for etcd's answer. A partitioned member would otherwise leave
/// a caller (a lease keep-alive, say) waiting past the deadline it is racing.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// etcd's answer to a put, transaction or revoke naming a lease it does not have.
const LEASE_NOT_FOUND: &str = "requested lease not found";

type Sender = mpsc::UnboundedSender<Result<(Revision, Event), StoreError>>;

#[derive(Clone)]
pub struct EtcdStore {
    /// Cheap to clone: the clones share one channel to the cluster. etcd-client's calls take
    /// `&mut self`, so each call works on its own clone.
    client: Client,
    endpoints: Vec<String>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore").field("endpoints", &self.endpoints).finish_non_exhaustive()
    }
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

/// Whether etcd refused a request for naming a lease that has lapsed or never was.
fn lease_not_found(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(status) => status.message().ends_with(LEASE_NOT_FOUND),
        // What etcd-client makes of a keep-alive answered with a time to live of 0.
        etcd_client::Error::LeaseKeepAliveError(message) => message == "lease not found",
        _ => false,
    }
}

/// Runs one request under [`REQUEST_TIMEOUT`]. A lease-not-found refusal becomes
/// `LeaseNotFound(lease)` when the request named `lease`; everything else is `Backend`, saying
/// `what` failed.
async fn request<T>(
    what: &str,
    lease: Option<StoreLease>,
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(REQUEST_TIMEOUT, call).await {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(e)) => match lease {
            Some(lease) if lease_not_found(&e) => Err(StoreError::LeaseNotFound(lease)),
            _ => Err(backend(format!("{what}: {e}"))),
        },
        Err(_) => Err(backend(format!("{what}: etcd did not answer within {} s", REQUEST_TIMEOUT.as_secs()))),
    }
}

/// etcd's lease ids are positive `i64`s and 0 means "no lease": any other value cannot name a
/// lease etcd granted.
fn lease_id(lease: StoreLease) -> Result<i64, StoreError> {
    i64::try_from(lease).ok().filter(|&id| id > 0).ok_or(StoreError::LeaseNotFound(lease))
}

fn to_revision(revision: i64, what: &str) -> Result<Revision, StoreError> {
    Revision::try_from(revision).map_err(|_| backend(format!("{what}: etcd answered with revision {revision}")))
}

/// The store revision a response was applied at.
fn header_revision(header: Option<&ResponseHeader>, what: &str) -> Result<Revision, StoreError> {
    let header = header.ok_or_else(|| backend(format!("{what}: etcd answered without a header")))?;
    to_revision(header.revision(), what)
}

fn key_of(kv: &KeyValue) -> Result<String, StoreError> {
    kv.key_str().map(str::to_owned).map_err(|e| backend(format!("key {:?} is not UTF-8: {e}", kv.key())))
}

fn put_options(lease: Option<StoreLease>) -> Result<PutOptions, StoreError> {
    Ok(match lease {
        Some(lease) => PutOptions::new().with_lease(lease_id(lease)?),
        None => PutOptions::new(),
    })
}

/// One event of a watch response, at the revision that made it.
fn event(event: &etcd_client::Event) -> Result<(Revision, Event), StoreError> {
    let kv = event.kv().ok_or_else(|| backend("watch: an event without its key"))?;
    let key = key_of(kv)?;
    // A delete's `mod_revision` is the revision of the delete.
    let revision = to_revision(kv.mod_revision(), "watch")?;
    let event = match event.event_type() {
        EventType::Put => Event::Put { key, value: kv.value().to_vec() },
        EventType::Delete => Event::Delete { key },
    };
    Ok((revision, event))
}

/// Forwards a watch's events to `tx` until the watch fails (sent as one `Err`) or the receiver
/// is dropped. Dropping the stream at the end cancels the watch in etcd.
async fn forward(prefix: String, mut stream: WatchStream, tx: Sender) {
    let failure = 'watch: loop {
        let message = tokio::select! {
            message = stream.message() => message,
            () = tx.closed() => return,
        };
        let response = match message {
            Ok(Some(response)) => response,
            Ok(None) => break backend(format!("watch of {prefix:?}: etcd ended the stream")),
            Err(e) => break backend(format!("watch of {prefix:?}: {e}")),
        };
        if response.canceled() {
            break backend(format!(
                "watch of {prefix:?} cancelled by etcd (compacted to {}): {}",
                response.compact_revision(),
                response.cancel_reason()
            ));
        }
        for e in response.events() {
            let event = match event(e) {
                Ok(event) => event,
                Err(e) => break 'watch e,
            };
            if tx.send(Ok(event)).is_err() {
                return;
            }
        }
    };
    tracing::debug!(error = %failure, "etcd watch ended");
    let _ = tx.send(Err(failure));
}

impl EtcdStore {
    /// Connects to the etcd cluster at `endpoints` (`http://host:port`) and checks that it
    /// answers, so a wrong address fails here rather than hanging the first request.
    pub async fn connect(endpoints: &[String]) -> Result<Self, StoreError> {
        let options = ConnectOptions::new().with_connect_timeout(CONNECT_TIMEOUT);
        let what = format!("connecting to etcd at {endpoints:?}");
        let mut client =
            Client::connect(endpoints, Some(options)).await.map_err(|e| backend(format!("{what}: {e}")))?;
        match tokio::time::timeout(CONNECT_TIMEOUT, client.status()).await {
            Ok(Ok(_)) => Ok(Self { client, endpoints: endpoints.to_vec() }),
            Ok(Err(e)) => Err(backend(format!("{what}: {e}"))),
            Err(_) => Err(backend(format!("{what}: no answer within {} s", CONNECT_TIMEOUT.as_secs()))),
        }
    }
}

impl Store for EtcdStore {
    async fn watch(&self, prefix: &str) -> Result<(Snapshot, Watch), StoreError> {
        let mut client = self.client.clone();
        let what = format!("reading {prefix:?}");
        let got = request(&what, None, client.get(prefix, Some(GetOptions::new().with_prefix()))).await?;
        let revision = header_revision(got.header(), &what)?;
        let entries = got.kvs().iter().map(|kv| Ok((key_of(kv)?, kv.value().to_vec()))).collect::<Result<_, _>>()?;
        // Starting right after the snapshot, the watch misses nothing and repeats nothing.
        let start = i64::try_from(revision + 1).map_err(backend)?;
        let what = format!("watching {prefix:?}");
        let options = WatchOptions::new().with_prefix().with_start_revision(start);
        let mut stream = request(&what, None, client.watch(prefix, Some(options))).await?;
        // etcd first confirms the watch (or cancels it at once, e.g. if `start` was compacted
        // away): wait for that, so a watch that will never deliver fails here.
        let created = request(&what, None, stream.message()).await?;
        match created {
            Some(response) if response.created() && !response.canceled() => {}
            Some(response) => {
                return Err(backend(format!("{what}: etcd refused the watch: {}", response.cancel_reason())));
            }
            None => return Err(backend(format!("{what}: etcd ended the stream"))),
        }
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(forward(prefix.to_owned(), stream, tx));
        Ok((Snapshot { revision, entries }, rx))
    }

    async fn grant(&self, ttl_ms: u64) -> Result<StoreLease, StoreError> {
        // etcd counts whole seconds (and raises short leases to its minimum, 2 s by default).
        let ttl = i64::try_from(ttl_ms.div_ceil(1000).max(1)).map_err(backend)?;
        let mut client = self.client.clone();
        let granted = request("granting a lease", None, client.lease_grant(ttl, None)).await?;
        if !granted.error().is_empty() {
            return Err(backend(format!("granting a lease: {}", granted.error())));
        }
        StoreLease::try_from(granted.id()).map_err(|_| backend(format!("etcd granted lease {}", granted.id())))
    }

    async fn keep_alive(&self, lease: StoreLease) -> Result<(), StoreError> {
        let id = lease_id(lease)?;
        let mut client = self.client.clone();
        // Opening the keep-alive stream sends one keep-alive and reads etcd's answer, failing
        // if its time to live is 0 (the lease is gone): that is the whole round. The keeper
        // and the stream are dropped here, which closes the stream.
        let what = format!("keeping lease {lease} alive");
        let (_keeper, _stream) = request(&what, Some(lease), client.lease_keep_alive(id)).await?;
        Ok(())
    }

    async fn revoke(&self, lease: StoreLease) -> Result<(), StoreError> {
        let Ok(id) = lease_id(lease) else { return Ok(()) };
        let mut client = self.client.clone();
        match request(&format!("revoking lease {lease}"), Some(lease), client.lease_revoke(id)).await {
            Ok(_) | Err(StoreError::LeaseNotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let mut client = self.client.clone();
        let got = request(&format!("reading {key:?}"), None, client.get(key, None)).await?;
        Ok(got.kvs().first().map(|kv| kv.value().to_vec()))
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<StoreLease>) -> Result<Revision, StoreError> {
        let options = put_options(lease)?;
        let mut client = self.client.clone();
        let what = format!("putting {key:?}");
        let put = request(&what, lease, client.put(key, value, Some(options))).await?;
        header_revision(put.header(), &what)
    }

    async fn create(&self, key: &str, value: Vec<u8>, lease: Option<StoreLease>) -> Result<Created, StoreError> {
        let options = put_options(lease)?;
        // A key that was never created, or was deleted since, has create revision 0.
        let txn = etcd_client::Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, value, Some(options))])
            .or_else([TxnOp::get(key, None)]);
        let mut client = self.client.clone();
        let what = format!("creating {key:?}");
        let txn = request(&what, lease, client.txn(txn)).await?;
        if txn.succeeded() {
            return Ok(Created::Created(header_revision(txn.header(), &what)?));
        }
        match txn.op_responses().first() {
            Some(TxnOpResponse::Get(got)) => match got.kvs().first() {
                Some(kv) => Ok(Created::Exists(kv.value().to_vec())),
                None => Err(backend(format!("{what}: the key exists, yet reading it found nothing"))),
            },
            _ => Err(backend(format!("{what}: etcd answered the transaction without the key's value"))),
        }
    }

    async fn delete(&self, key: &str) -> Result<Revision, StoreError> {
        let mut client = self.client.clone();
        let what = format!("deleting {key:?}");
        let deleted = request(&what, None, client.delete(key, None)).await?;
        header_revision(deleted.header(), &what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::local_etcd::{LocalEtcd, free_port};
    use crate::store::tests;

    async fn start() -> (LocalEtcd, EtcdStore) {
        let etcd = LocalEtcd::start();
        let store = EtcdStore::connect(std::slice::from_ref(&etcd.url)).await;
        let store = store.unwrap_or_else(|e| panic!("a healthy etcd refused us ({e}):\n{}", etcd.log()));
        (etcd, store)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn changes_are_watched_in_order() {
        let (_etcd, store) = start().await;
        tests::changes_are_watched_in_order(&store, "/t/").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn leased_keys_go_with_their_lease() {
        let (_etcd, store) = start().await;
        tests::leased_keys_go_with_their_lease(&store, "/t/", 1000).await;
    }

    /// Nothing listening (refused at once), or a listener that never answers: either way
    /// connecting ends in an error, the second once its CONNECT_TIMEOUT has passed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wrong_address_is_an_error_not_a_hang() {
        // A hang guard, not a limit: connecting waits CONNECT_TIMEOUT for the connection, and as
        // long for etcd's answer.
        let connect = |url: String| async move {
            let endpoints = [url];
            let connecting = tokio::time::timeout(Duration::from_secs(30), EtcdStore::connect(&endpoints));
            let hung = || panic!("connecting to {} hung", endpoints[0]);
            connecting.await.unwrap_or_else(|_| hung()).unwrap_err().to_string()
        };
        let refused = connect(format!("http://127.0.0.1:{}", free_port())).await;
        assert!(refused.contains("connecting to etcd"), "{refused}");
        // The kernel completes its connections; nothing reads or answers them.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let unanswered = connect(format!("http://{}", silent.local_addr().unwrap())).await;
        assert!(unanswered.contains(&format!("no answer within {} s", CONNECT_TIMEOUT.as_secs())), "{unanswered}");
    }
}
