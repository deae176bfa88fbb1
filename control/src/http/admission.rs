//! Who may hold the API's connections, and how much memory request bodies take.
//!
//! Every connection starts unauthenticated, in a pool bounded overall and per source address,
//! and has `auth_timeout` (its TLS handshake included) to send a request whose principal is
//! known. A newcomer is never refused: when its source holds its share of the pool, that
//! source's oldest unauthenticated connection is closed; when the whole pool is full, the
//! oldest of the source that holds the most. So a flooding source only ever evicts its own
//! connections, and a quiet source's newest connection keeps its time to authenticate.
//!
//! A connection whose request authenticated leaves that pool for the authenticated one:
//! `max_connections` in all, of which tenants together may hold all but the nodes' and
//! operators' reserve, and each tenant `max_connections_per_tenant`.
//!
//! A request's body is read before its handler runs: at most `max_body_bytes`, within
//! `body_timeout` of its head, and a tenant's bodies in flight at most
//! `max_body_bytes_per_tenant` together.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use djinn_auth::{Principal, Role};
use djinn_sync::Locked;
use tokio::sync::oneshot;

use super::{ConnectionCounters, ConnectionLimits, count, error_response};

/// Why a request was refused, its connection closed after the answer.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refusal {
    #[error("{tenant} has {max} connections to the API open: at most {max} per tenant")]
    TenantConnections { tenant: Arc<str>, max: usize },
    #[error("the API's connections for {0} are all in use: try again later")]
    Connections(&'static str),
    #[error("the connection is being closed: it did not authenticate in time")]
    Closing,
    #[error("a request body over {max} bytes")]
    BodyTooLarge { max: usize },
    #[error("the request body was not whole within {0:?} of its head")]
    BodyTimeout(Duration),
    #[error("{tenant} has {in_flight} bytes of request bodies in flight: at most {budget} at once")]
    Bodies { tenant: Arc<str>, in_flight: usize, budget: usize },
    #[error("the request body could not be read: {0}")]
    Unreadable(axum::Error),
}

impl Refusal {
    fn status(&self) -> (StatusCode, &'static str) {
        match self {
            Self::TenantConnections { .. } => (StatusCode::TOO_MANY_REQUESTS, "too_many_connections"),
            Self::Connections(_) | Self::Closing => (StatusCode::SERVICE_UNAVAILABLE, "too_many_connections"),
            Self::BodyTooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            Self::BodyTimeout(_) => (StatusCode::REQUEST_TIMEOUT, "body_timeout"),
            Self::Bodies { .. } => (StatusCode::TOO_MANY_REQUESTS, "too_many_bodies"),
            Self::Unreadable(_) => (StatusCode::BAD_REQUEST, "bad_request"),
        }
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let (status, kind) = self.status();
        let mut response = error_response(status, kind, self.to_string());
        // What is left of the request (its body) is not read: the connection cannot go on.
        response.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
        response
    }
}

/// The connections of one listener and the request bodies in flight on them.
pub(super) struct Admission {
    limits: ConnectionLimits,
    counters: Arc<ConnectionCounters>,
    pools: Mutex<Pools>,
}

#[derive(Default)]
struct Pools {
    next_id: u64,
    /// Unauthenticated connections by source, oldest first; sending on one's sender closes it.
    unauthenticated: HashMap<IpAddr, VecDeque<(u64, oneshot::Sender<()>)>>,
    unauthenticated_total: usize,
    authenticated: usize,
    /// Of `authenticated`, the tenants' (all of them, and each one's).
    tenants: usize,
    per_tenant: HashMap<Arc<str>, usize>,
    /// Bytes of request bodies each tenant has in flight.
    tenant_body_bytes: HashMap<Arc<str>, usize>,
}

impl Pools {
    /// Takes connection `id` of `source` out of the unauthenticated pool; its sender, if it was
    /// there (not evicted, not timed out, not authenticated already).
    fn remove_unauthenticated(&mut self, source: IpAddr, id: u64) -> Option<oneshot::Sender<()>> {
        let queue = self.unauthenticated.get_mut(&source)?;
        let (_, sender) = queue.remove(queue.iter().position(|(i, _)| *i == id)?)?;
        if queue.is_empty() {
            self.unauthenticated.remove(&source);
        }
        self.unauthenticated_total -= 1;
        Some(sender)
    }

    /// Closes the oldest unauthenticated connection of `source`.
    fn evict_oldest(&mut self, source: IpAddr) {
        let Some(queue) = self.unauthenticated.get_mut(&source) else { return };
        if let Some((_, sender)) = queue.pop_front() {
            let _ = sender.send(());
            self.unauthenticated_total -= 1;
        }
        if queue.is_empty() {
            self.unauthenticated.remove(&source);
        }
    }
}

impl Admission {
    pub(super) fn new(limits: ConnectionLimits, counters: Arc<ConnectionCounters>) -> Arc<Self> {
        Arc::new(Self { limits, counters, pools: Mutex::default() })
    }

    fn publish(&self, pools: &Pools) {
        self.counters.unauthenticated_open.store(pools.unauthenticated_total as u64, Ordering::Relaxed);
        self.counters.authenticated_open.store(pools.authenticated as u64, Ordering::Relaxed);
    }

    /// A connection just accepted from `source`, unauthenticated, and what says it was evicted
    /// (a sender dropped without a send: it left the pool otherwise).
    pub(super) fn admit(self: &Arc<Self>, source: IpAddr) -> (Arc<ConnectionSlot>, oneshot::Receiver<()>) {
        let mut pools = self.pools.locked();
        let from_source = pools.unauthenticated.get(&source).map_or(0, VecDeque::len);
        let evict_from = if from_source >= self.limits.max_unauthenticated_per_source.max(1) {
            Some(source)
        } else if pools.unauthenticated_total >= self.limits.max_unauthenticated.max(1) {
            pools.unauthenticated.iter().max_by_key(|(_, queue)| queue.len()).map(|(ip, _)| *ip)
        } else {
            None
        };
        if let Some(victim) = evict_from {
            pools.evict_oldest(victim);
            count(&self.counters.unauthenticated_evicted);
        }
        let id = pools.next_id;
        pools.next_id += 1;
        let (evict, evicted) = oneshot::channel();
        pools.unauthenticated.entry(source).or_default().push_back((id, evict));
        pools.unauthenticated_total += 1;
        self.publish(&pools);
        let slot = ConnectionSlot { id, source, admission: Arc::clone(self), held: Mutex::new(None) };
        (Arc::new(slot), evicted)
    }

    /// How long a connection has to authenticate after it was accepted.
    pub(super) fn auth_timeout(&self) -> Duration {
        self.limits.auth_timeout.min(self.limits.header_timeout)
    }

    /// Reads `request`'s body (of `principal`'s request) within the bounds, and holds it against
    /// a tenant's budget until the answer (drop the budget then).
    pub(super) async fn read_body(
        self: &Arc<Self>,
        principal: &Principal,
        request: Request,
    ) -> Result<(Request, Option<BodyBudget>), Refusal> {
        let (parts, body) = request.into_parts();
        if body.is_end_stream() {
            return Ok((Request::from_parts(parts, body), None));
        }
        let max = self.limits.max_body_bytes;
        // Content-Length, when the request has one.
        let announced = body.size_hint().exact();
        if announced.is_some_and(|n| n > max as u64) {
            count(&self.counters.bodies_too_large);
            return Err(Refusal::BodyTooLarge { max });
        }
        let budget = match principal.role {
            Role::Tenant => Some(self.reserve(&principal.name, announced.map_or(max, |n| n as usize))?),
            // Nodes and operators run the cluster; their bodies are bounded by size and time.
            Role::Node | Role::Admin => None,
        };
        match tokio::time::timeout(self.limits.body_timeout, collect(body, max)).await {
            Ok(Ok(bytes)) => Ok((Request::from_parts(parts, Body::from(bytes)), budget)),
            Ok(Err(refusal)) => {
                if matches!(refusal, Refusal::BodyTooLarge { .. }) {
                    count(&self.counters.bodies_too_large);
                }
                Err(refusal)
            }
            Err(_) => {
                count(&self.counters.body_timeouts);
                Err(Refusal::BodyTimeout(self.limits.body_timeout))
            }
        }
    }

    /// Counts `bytes` of body in flight against `tenant`'s budget.
    fn reserve(self: &Arc<Self>, tenant: &Arc<str>, bytes: usize) -> Result<BodyBudget, Refusal> {
        // One body of the largest size always fits.
        let budget = self.limits.max_body_bytes_per_tenant.max(self.limits.max_body_bytes);
        let mut pools = self.pools.locked();
        let in_flight = pools.tenant_body_bytes.get(tenant).copied().unwrap_or(0);
        if in_flight + bytes > budget {
            count(&self.counters.bodies_refused);
            return Err(Refusal::Bodies { tenant: Arc::clone(tenant), in_flight, budget });
        }
        *pools.tenant_body_bytes.entry(Arc::clone(tenant)).or_default() += bytes;
        self.counters.tenant_body_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(BodyBudget { admission: Arc::clone(self), tenant: Arc::clone(tenant), bytes })
    }
}

/// The body, up to `max` bytes.
async fn collect(body: Body, max: usize) -> Result<Bytes, Refusal> {
    let mut body = std::pin::pin!(body);
    let mut collected = Vec::new();
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        let Ok(data) = frame.map_err(Refusal::Unreadable)?.into_data() else { continue };
        if collected.len() + data.len() > max {
            return Err(Refusal::BodyTooLarge { max });
        }
        collected.extend_from_slice(&data);
    }
    Ok(collected.into())
}

/// A tenant's bytes of request body in flight, given back when dropped.
pub(super) struct BodyBudget {
    admission: Arc<Admission>,
    tenant: Arc<str>,
    bytes: usize,
}

impl Drop for BodyBudget {
    fn drop(&mut self) {
        let mut pools = self.admission.pools.locked();
        self.admission.counters.tenant_body_bytes.fetch_sub(self.bytes as u64, Ordering::Relaxed);
        if let Some(in_flight) = pools.tenant_body_bytes.get_mut(&self.tenant) {
            *in_flight = in_flight.saturating_sub(self.bytes);
            if *in_flight == 0 {
                pools.tenant_body_bytes.remove(&self.tenant);
            }
        }
    }
}

/// Where one connection counts once authenticated.
enum Held {
    /// A node's or an operator's: from the whole pool.
    Reserved,
    Tenant(Arc<str>),
}

/// One connection's place in the pools: unauthenticated until [`Self::authenticated`], and
/// out of them once dropped (its task and its requests hold it).
pub(super) struct ConnectionSlot {
    id: u64,
    source: IpAddr,
    admission: Arc<Admission>,
    held: Mutex<Option<Held>>,
}

impl ConnectionSlot {
    pub(super) fn admission(&self) -> &Arc<Admission> {
        &self.admission
    }

    /// `principal`'s request came on this connection: moves it to the authenticated pool (once),
    /// or refuses the request when the principal's share of that pool is in use.
    pub(super) fn authenticated(&self, principal: &Principal) -> Result<(), Refusal> {
        let mut held = self.held.locked();
        if held.is_some() {
            return Ok(());
        }
        let admission = &*self.admission;
        let limits = &admission.limits;
        let mut pools = admission.pools.locked();
        let refused = |refusal| {
            count(&admission.counters.refused);
            Err(refusal)
        };
        let taken = match principal.role {
            Role::Tenant => {
                let reserve = limits.reserved_for_nodes.min(limits.max_connections / 2);
                let own = pools.per_tenant.get(&principal.name).copied().unwrap_or(0);
                if own >= limits.max_connections_per_tenant {
                    return refused(Refusal::TenantConnections {
                        tenant: Arc::clone(&principal.name),
                        max: limits.max_connections_per_tenant,
                    });
                }
                if pools.tenants >= limits.max_connections - reserve || pools.authenticated >= limits.max_connections {
                    return refused(Refusal::Connections("tenants"));
                }
                Held::Tenant(Arc::clone(&principal.name))
            }
            Role::Node | Role::Admin => {
                if pools.authenticated >= limits.max_connections {
                    return refused(Refusal::Connections("nodes and operators"));
                }
                Held::Reserved
            }
        };
        // Evicted or timed out a moment ago: its task is closing it.
        if pools.remove_unauthenticated(self.source, self.id).is_none() {
            return Err(Refusal::Closing);
        }
        pools.authenticated += 1;
        if let Held::Tenant(name) = &taken {
            pools.tenants += 1;
            *pools.per_tenant.entry(Arc::clone(name)).or_default() += 1;
        }
        admission.publish(&pools);
        *held = Some(taken);
        Ok(())
    }

    /// Completes once the connection has had its time to authenticate and has not: it has
    /// left the pool then, and is to be closed. Never completes for one that authenticated.
    pub(super) async fn unauthenticated_for_too_long(&self) {
        tokio::time::sleep(self.admission.auth_timeout()).await;
        let timed_out = {
            let mut pools = self.admission.pools.locked();
            let timed_out = pools.remove_unauthenticated(self.source, self.id).is_some();
            self.admission.publish(&pools);
            timed_out
        };
        if !timed_out {
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let held = self.held.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        let mut pools = self.admission.pools.locked();
        pools.remove_unauthenticated(self.source, self.id);
        match held {
            None => {}
            Some(Held::Reserved) => pools.authenticated -= 1,
            Some(Held::Tenant(name)) => {
                pools.authenticated -= 1;
                pools.tenants -= 1;
                if let Some(n) = pools.per_tenant.get_mut(&name) {
                    *n -= 1;
                    if *n == 0 {
                        pools.per_tenant.remove(&name);
                    }
                }
            }
        }
        self.admission.publish(&pools);
    }
}
