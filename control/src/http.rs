//! The control plane's HTTP/JSON API and its Prometheus /metrics.
//!
//! | method and path | body | answer |
//! |---|---|---|
//! | `POST /v1/nodes` | `{"name", "inventory"}` | 201 `{"lease", "ttl_ms"}`; 409 a live node has the name |
//! | `PUT /v1/nodes/{name}/lease` | `{"lease", "inventory"?}` | `{"draining"}`; 404 unknown or lapsed; 409 stale lease |
//! | `POST /v1/nodes/{name}/drain` | | the drain's status: nothing new is placed on the node, which moves what it holds to other nodes |
//! | `GET /v1/nodes/{name}/drain` | | `{"node", "draining", "sessions", "kept", "parked", "requests", "placed_sessions", "drained"}` |
//! | `DELETE /v1/nodes/{name}/drain` | | the status: the drain stops (what moved stays where it went) |
//! | `POST /v1/nodes/{name}/forwards` | `{"forwards": [{"kind", "tenant", "id", "epoch", "to", "to_id", "to_epoch"}]}` | 204: where the draining node's sessions (`kind` `session`) and kept tensors (`kept`) went, kept for an hour (`ControlConfig::forward_ttl`); only from the node (the principal that registered it) or an operator, 403 `forbidden`; each `to` another live node's address, 400 `unknown_destination` |
//! | `GET /v1/forwards/{kind}/{from}/{epoch}/{id}` | | `{"to", "to_id", "to_epoch", ...}`: where the caller's session or kept tensor of the node that served at `from` went; 404 `unknown_forward` |
//! | `DELETE /v1/nodes/{name}?lease=N` | | 204: the node leaves now |
//! | `PUT /v1/models/{fingerprint}` | `{"blocks": [{"weight_bytes", "flops"}], "io_bytes", "phase"?}` | 204; 413 past 512 blocks or 64 KiB |
//! | `GET /v1/models/{fingerprint}` | | the description; 404 unknown |
//! | `POST /v1/placements` | `{"fingerprint", "session"?, "policy"?, "phase"?, "moving"?: {"from", "state_bytes", "calls"?}}` | the decision and its cost breakdown (`move_s`: a moving session's state over the link, paid over `calls`) |
//! | `PUT /v1/sessions/{session}` | `{"addr"}` | `{"node"}`: the placed session moved to the node at `addr`; 404 `unknown_session`, `unknown_address` |
//! | `GET /v1/cluster` | | nodes, models, sessions |
//! | `GET /v1/whoami` | | `{"name", "role"}`: whom the token names |
//! | `GET /metrics` | | Prometheus text |
//!
//! Errors are `{"error": {"kind", "message"}}` with a status that says whose fault it is.
//!
//! [`serve`] bounds what connections hold: how many are open before authentication (overall and
//! per source address) and after (overall, per tenant, with a reserve for nodes and operators),
//! how long one may take to authenticate (its TLS handshake and first request head) or to send
//! a next request's head (idle keep-alive included), how long a request may take, and how large
//! its body may be, how soon it must come and how many bytes of bodies a tenant may have in
//! flight; /metrics counts the connections and requests those bounds ended
//! ([`ConnectionCounters`]). See the `admission` module.
//!
//! With a token file, every request carries `Authorization: Bearer TOKEN`: a missing or unknown
//! token gets 401, a role without the right 403. Nodes (and operators) manage memberships;
//! operators drain nodes and read the whole cluster (`/v1/cluster`, `/metrics`); every principal describes
//! models, asks for placements, lists the live nodes (`GET /v1/nodes`) and asks `whoami`. A
//! tenant's model records and session ids are its own: two tenants may both describe a
//! fingerprint or name a session `s1`, and neither sees the other's.

use std::fmt::Write as _;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Extension, Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Router, middleware};
use djinn_auth::{AuthError, Authenticator, Principal, Role};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::cluster::{PlaceError, Rule};
use crate::membership::{Inventory, LeaseId, MembershipError};
use crate::service::{
    ControlError, ControlPlane, DrainStatus, Forward, ForwardKind, MAX_RECORD_BYTES, ModelRecord, Placement, Renewed,
};
use crate::store::{Store, StoreError};

mod admission;

use admission::{Admission, ConnectionSlot};

impl ControlError {
    fn status(&self) -> (StatusCode, &'static str) {
        match self {
            Self::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            Self::Membership(MembershipError::AlreadyRegistered(_)) => (StatusCode::CONFLICT, "already_registered"),
            Self::Membership(MembershipError::UnknownNode(_)) => (StatusCode::NOT_FOUND, "unknown_node"),
            Self::Membership(MembershipError::StaleLease { .. }) => (StatusCode::CONFLICT, "stale_lease"),
            Self::UnknownModel(_) => (StatusCode::NOT_FOUND, "unknown_model"),
            Self::Place(PlaceError::NoBlocks) => (StatusCode::BAD_REQUEST, "no_blocks"),
            Self::Place(PlaceError::NoNodes) => (StatusCode::SERVICE_UNAVAILABLE, "no_nodes"),
            Self::Place(PlaceError::FitsNowhere { .. }) => (StatusCode::UNPROCESSABLE_ENTITY, "fits_nowhere"),
            Self::NodeLeft(_) => (StatusCode::SERVICE_UNAVAILABLE, "node_left"),
            Self::QuotaExceeded(_) => (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded"),
            Self::UnknownSession(_) => (StatusCode::NOT_FOUND, "unknown_session"),
            Self::UnknownAddress(_) => (StatusCode::NOT_FOUND, "unknown_address"),
            Self::UnknownForward(_) => (StatusCode::NOT_FOUND, "unknown_forward"),
            Self::Store(StoreError::LeaseNotFound(_)) => (StatusCode::SERVICE_UNAVAILABLE, "lease_not_found"),
            Self::Store(StoreError::Backend(_)) => (StatusCode::SERVICE_UNAVAILABLE, "store_unavailable"),
            Self::TooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            Self::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            Self::UnknownDestination(_) => (StatusCode::BAD_REQUEST, "unknown_destination"),
        }
    }
}

impl IntoResponse for ControlError {
    fn into_response(self) -> Response {
        let (status, kind) = self.status();
        if status.is_server_error() {
            tracing::warn!(error = %self, "request failed");
        }
        error_response(status, kind, self.to_string())
    }
}

/// `{"error": {"kind", "message"}}` with `status`; a 401 names the scheme it wants.
fn error_response(status: StatusCode, kind: &str, message: String) -> Response {
    let body = serde_json::json!({ "error": { "kind": kind, "message": message } });
    let mut response = (status, axum::Json(body)).into_response();
    if status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
    }
    response
}

/// The body as JSON, or a 400 that says what is wrong with it (serde's line and column).
fn body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ControlError> {
    serde_json::from_slice(bytes).map_err(|e| ControlError::BadRequest(format!("malformed JSON body: {e}")))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RegisterBody {
    name: String,
    inventory: Inventory,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RenewBody {
    lease: LeaseId,
    #[serde(default)]
    inventory: Option<Inventory>,
}

/// The path's one parameter (a node's name, a fingerprint); one that is not UTF-8 once
/// percent-decoded is a 400 in the API's own error body, like every other bad request.
struct Segment(String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Segment {
    type Rejection = ControlError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ControlError> {
        match Path::<String>::from_request_parts(parts, state).await {
            Ok(Path(segment)) => Ok(Self(segment)),
            Err(e) => Err(ControlError::BadRequest(e.body_text())),
        }
    }
}

#[derive(Deserialize)]
struct LeaveQuery {
    lease: LeaseId,
}

type Control<S> = State<Arc<ControlPlane<S>>>;

async fn register<S: Store>(
    State(control): Control<S>,
    Extension(caller): Extension<Principal>,
    bytes: Bytes,
) -> Result<Response, ControlError> {
    let RegisterBody { name, inventory } = body(&bytes)?;
    // A node principal registers as itself: what ties its forwards to it.
    let registrant = (caller.role == Role::Node).then_some(&*caller.name);
    let registered = control.register(&name, inventory, registrant).await?;
    Ok((StatusCode::CREATED, axum::Json(registered)).into_response())
}

async fn renew<S: Store>(
    State(control): Control<S>,
    Segment(name): Segment,
    bytes: Bytes,
) -> Result<axum::Json<Renewed>, ControlError> {
    let RenewBody { lease, inventory } = body(&bytes)?;
    control.renew(&name, lease, inventory).await.map(axum::Json)
}

async fn drain<S: Store>(
    State(control): Control<S>,
    Segment(name): Segment,
) -> Result<(StatusCode, axum::Json<DrainStatus>), ControlError> {
    Ok((StatusCode::ACCEPTED, axum::Json(control.drain(&name, true).await?)))
}

async fn drain_status<S: Store>(
    State(control): Control<S>,
    Segment(name): Segment,
) -> Result<axum::Json<DrainStatus>, ControlError> {
    control.drain_status(&name).map(axum::Json)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForwardsBody {
    forwards: Vec<Forward>,
}

async fn put_forwards<S: Store>(
    State(control): Control<S>,
    Extension(caller): Extension<Principal>,
    Segment(name): Segment,
    bytes: Bytes,
) -> Result<StatusCode, ControlError> {
    let ForwardsBody { forwards } = body(&bytes)?;
    // Only the node itself, or an operator for it.
    let node = (caller.role != Role::Admin).then_some(&*caller.name);
    control.put_forwards(&name, node, forwards).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn forward<S: Store>(
    State(control): Control<S>,
    Extension(caller): Extension<Principal>,
    path: Result<Path<(String, String, String, String)>, axum::extract::rejection::PathRejection>,
) -> Result<axum::Json<Forward>, ControlError> {
    let Path((kind, from, epoch, id)) = path.map_err(|e| ControlError::BadRequest(e.body_text()))?;
    let id: u64 = id.parse().map_err(|_| ControlError::BadRequest(format!("handle id {id:?}")))?;
    let kind = match kind.as_str() {
        "session" => ForwardKind::Session,
        "kept" => ForwardKind::Kept,
        other => return Err(ControlError::BadRequest(format!("{other:?} is neither session nor kept"))),
    };
    let epoch = u64::from_str_radix(&epoch, 16).map_err(|_| ControlError::BadRequest(format!("epoch {epoch:?}")))?;
    // A tenant finds its own only; a node or an operator any.
    let tenant = (caller.role == Role::Tenant).then_some(&*caller.name);
    control.forward(&from, kind, epoch, id, tenant).await.map(axum::Json)
}

async fn undrain<S: Store>(
    State(control): Control<S>,
    Segment(name): Segment,
) -> Result<axum::Json<DrainStatus>, ControlError> {
    control.drain(&name, false).await.map(axum::Json)
}

async fn leave<S: Store>(
    State(control): Control<S>,
    Segment(name): Segment,
    query: Result<Query<LeaveQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<StatusCode, ControlError> {
    let Query(LeaveQuery { lease }) = query.map_err(|e| ControlError::BadRequest(e.body_text()))?;
    control.leave(&name, lease).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The key of `caller`'s record of a model: a tenant's records are its own (its name, then the
/// fingerprint), so no tenant reads, changes or learns of another's by its fingerprint. Nodes
/// report the models they hold under the same keys.
fn scoped(caller: &Principal, fingerprint: &str) -> Result<String, ControlError> {
    if caller.role != Role::Tenant || caller.name.is_empty() {
        return Ok(fingerprint.to_owned());
    }
    if fingerprint.contains('/') {
        return Err(ControlError::BadRequest(format!("{fingerprint:?} is not a model fingerprint: 64 hex digits")));
    }
    Ok(format!("{}/{fingerprint}", caller.name))
}

async fn describe_model<S: Store>(
    State(control): Control<S>,
    Extension(caller): Extension<Principal>,
    Segment(fingerprint): Segment,
    bytes: Bytes,
) -> Result<StatusCode, ControlError> {
    if bytes.len() > MAX_RECORD_BYTES {
        return Err(ControlError::TooLarge(format!(
            "a model record of {} bytes: at most {MAX_RECORD_BYTES}",
            bytes.len()
        )));
    }
    let record: ModelRecord = body(&bytes)?;
    control.describe_model(&scoped(&caller, &fingerprint)?, record).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn model<S: Store>(
    State(control): Control<S>,
    Extension(caller): Extension<Principal>,
    Segment(fingerprint): Segment,
) -> Result<axum::Json<ModelRecord>, ControlError> {
    control.model(&scoped(&caller, &fingerprint)?).map(axum::Json)
}

async fn place<S: Store>(
    State(control): Control<S>,
    Extension(caller): Extension<Principal>,
    bytes: Bytes,
) -> Result<Response, ControlError> {
    let mut placement: Placement = body(&bytes)?;
    placement.fingerprint = scoped(&caller, &placement.fingerprint)?;
    // A tenant's session ids are its own.
    if caller.role == Role::Tenant
        && let Some(session) = &mut placement.session
    {
        *session = format!("{}/{session}", caller.name);
    }
    let decision = control.place(placement).await?;
    Ok(axum::Json(decision).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MovedBody {
    addr: String,
}

async fn move_session<S: Store>(
    State(control): Control<S>,
    Extension(caller): Extension<Principal>,
    Segment(session): Segment,
    bytes: Bytes,
) -> Result<Response, ControlError> {
    let moved: MovedBody = body(&bytes)?;
    // A tenant's session ids are its own (as in a placement).
    let session = if caller.role == Role::Tenant { format!("{}/{session}", caller.name) } else { session };
    let node = control.move_session(&session, &moved.addr).await?;
    Ok(axum::Json(serde_json::json!({ "node": node })).into_response())
}

/// The live nodes, by name and address: what a node may push tensors to.
async fn nodes<S: Store>(State(control): Control<S>) -> Response {
    let nodes: Vec<_> = control
        .status()
        .nodes
        .into_iter()
        .map(|n| {
            let free = n.inventory.memory_free.saturating_sub(n.promised_bytes);
            serde_json::json!({ "name": n.name, "addr": n.inventory.addr, "draining": n.draining, "memory_free": free })
        })
        .collect();
    axum::Json(serde_json::json!({ "nodes": nodes })).into_response()
}

async fn cluster<S: Store>(State(control): Control<S>) -> Response {
    axum::Json(control.status()).into_response()
}

async fn metrics<S: Store>(
    State(control): Control<S>,
    connections: Option<Extension<Arc<ConnectionCounters>>>,
) -> Response {
    let status = control.status();
    let c = &control.counters;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "{name}{labels} {value}");
        }
    };
    let one = |v: f64| vec![(String::new(), v)];
    metric("djinn_control_nodes", "gauge", "Live nodes.", &one(status.nodes.len() as f64));
    metric("djinn_control_models", "gauge", "Models described.", &one(status.models.len() as f64));
    metric("djinn_control_sessions", "gauge", "Sessions placed on live nodes.", &one(status.sessions.len() as f64));
    metric(
        "djinn_control_revision",
        "gauge",
        "The store revision this process has applied.",
        &one(status.revision as f64),
    );
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64;
    metric(
        "djinn_control_registration_requests_total",
        "counter",
        "Registrations asked for, admitted or not.",
        &one(load(&c.registration_requests)),
    );
    metric("djinn_control_registrations_total", "counter", "Nodes admitted.", &one(load(&c.registrations)));
    metric(
        "djinn_control_leases_lapsed_total",
        "counter",
        "Nodes gone because their lease lapsed (they stopped renewing without leaving).",
        &one(load(&c.leases_lapsed)),
    );
    metric("djinn_control_renewals_total", "counter", "Leases renewed.", &one(load(&c.renewals)));
    let rules = [Rule::Session, Rule::Shared, Rule::Streamed, Rule::Policy];
    let by_rule: Vec<(String, f64)> = rules
        .iter()
        .map(|&rule| (format!("{{rule=\"{}\"}}", rule.name()), load(&c.placements[rule as usize])))
        .collect();
    metric("djinn_control_placements_total", "counter", "Placements, by the rule that decided.", &by_rule);
    metric("djinn_control_placement_errors_total", "counter", "Placements refused.", &one(load(&c.placement_errors)));
    metric(
        "djinn_control_model_records_expired_total",
        "counter",
        "Model records deleted because no node held them for --model-record-ttl.",
        &one(load(&c.records_expired)),
    );
    // Served by [`serve`] (not by the router alone, as in the fuzz target): what its bounds ended.
    if let Some(Extension(connections)) = connections {
        let counted = [
            (
                "djinn_control_connections_refused_total",
                "Requests answered 503 or 429 too_many_connections and their connections closed: the \
                 principal's share of --max-connections was in use.",
                &connections.refused,
            ),
            (
                "djinn_control_connections_unauthenticated_evicted_total",
                "Unauthenticated connections closed to make room for a newer one (of their source, or of \
                 the source that held the most).",
                &connections.unauthenticated_evicted,
            ),
            (
                "djinn_control_connections_header_timeouts_total",
                "Connections closed because they had not authenticated (TLS handshake and a request head) \
                 within 3 s (at most --header-timeout) of opening, or a next request's head was not whole \
                 within --header-timeout.",
                &connections.header_timeouts,
            ),
            (
                "djinn_control_connections_idle_closed_total",
                "Keep-alive connections closed because nothing of a next request came within --header-timeout \
                 of the last answer.",
                &connections.idle_closed,
            ),
            (
                "djinn_control_request_timeouts_total",
                "Requests answered 408: not complete within --request-timeout.",
                &connections.request_timeouts,
            ),
            (
                "djinn_control_accept_backoffs_total",
                "Accepts that failed (out of descriptors or memory) and were tried again after a wait.",
                &connections.accept_backoffs,
            ),
            (
                "djinn_control_body_timeouts_total",
                "Requests answered 408 body_timeout: their body was not whole within 5 s of their head.",
                &connections.body_timeouts,
            ),
            (
                "djinn_control_bodies_too_large_total",
                "Requests answered 413: a body over 1 MiB.",
                &connections.bodies_too_large,
            ),
            (
                "djinn_control_bodies_refused_total",
                "Requests answered 429 too_many_bodies: their tenant had its bytes of bodies in flight.",
                &connections.bodies_refused,
            ),
        ];
        for (name, help, count) in counted {
            metric(name, "counter", help, &one(load(count)));
        }
        let open = [
            (
                "djinn_control_connections_unauthenticated",
                "Connections open, not authenticated yet.",
                &connections.unauthenticated_open,
            ),
            (
                "djinn_control_connections_authenticated",
                "Connections open that authenticated.",
                &connections.authenticated_open,
            ),
            (
                "djinn_control_tenant_body_bytes",
                "Bytes of tenants' request bodies in flight, held against their budgets.",
                &connections.tenant_body_bytes,
            ),
        ];
        for (name, help, gauge) in open {
            metric(name, "gauge", help, &one(load(gauge)));
        }
    }
    metric(
        "djinn_control_placement_seconds_total",
        "counter",
        "Time spent placing, recording included.",
        &one(load(&c.placement_ns) / 1e9),
    );
    let node = |f: &dyn Fn(&Inventory) -> f64| -> Vec<(String, f64)> {
        status.nodes.iter().map(|n| (format!("{{node=\"{}\"}}", n.name), f(&n.inventory))).collect()
    };
    metric(
        "djinn_node_memory_total_bytes",
        "gauge",
        "A node's device-memory budget.",
        &node(&|i| i.memory_total as f64),
    );
    metric("djinn_node_memory_free_bytes", "gauge", "A node's free device memory.", &node(&|i| i.memory_free as f64));
    metric(
        "djinn_node_queue_depth",
        "gauge",
        "Requests queued or running on a node.",
        &node(&|i| i.queue_depth.into()),
    );
    metric("djinn_node_models", "gauge", "Models a node holds.", &node(&|i| i.models.len() as f64));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

async fn whoami(Extension(caller): Extension<Principal>) -> Response {
    axum::Json(serde_json::json!({ "name": &*caller.name, "role": caller.role.name() })).into_response()
}

/// The role a request needs: memberships are the nodes' business, the whole cluster the
/// operators'; the rest is every principal's.
fn needs(method: &axum::http::Method, path: &str) -> &'static [Role] {
    const NODES: &[Role] = &[Role::Node, Role::Admin];
    const OPERATORS: &[Role] = &[Role::Admin];
    const ANYONE: &[Role] = &[Role::Tenant, Role::Node, Role::Admin];
    match path {
        // The live nodes' addresses: clients follow moves and forwards only to them.
        "/v1/nodes" if method == axum::http::Method::GET => ANYONE,
        // Draining a node is an operator's decision; the node learns of it at its renewal.
        p if p.starts_with("/v1/nodes/") && p.ends_with("/drain") => OPERATORS,
        p if p.starts_with("/v1/nodes") => NODES,
        "/v1/cluster" | "/metrics" => OPERATORS,
        _ => ANYONE,
    }
}

/// Checks the bearer token and the role, and hands the principal to the handler. Without a
/// token file everyone is the anonymous operator. Under [`serve`], a known principal's request
/// moves its connection to the authenticated pool, and its body is read within its bounds
/// before the handler runs.
async fn authenticate(auth: State<Option<Arc<Authenticator>>>, mut request: Request, next: Next) -> Response {
    let principal = match &*auth {
        None => Principal::anonymous(),
        Some(auth) => {
            let token = request
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .unwrap_or("");
            match auth.verify(token) {
                Ok(p) => p,
                Err(e @ (AuthError::Missing | AuthError::Invalid)) => {
                    return error_response(StatusCode::UNAUTHORIZED, "unauthenticated", e.to_string());
                }
                Err(e) => return error_response(StatusCode::FORBIDDEN, "forbidden", e.to_string()),
            }
        }
    };
    let connection = request.extensions().get::<Arc<ConnectionSlot>>().cloned();
    if let Some(connection) = &connection
        && let Err(refused) = connection.authenticated(&principal)
    {
        return refused.into_response();
    }
    if !needs(request.method(), request.uri().path()).contains(&principal.role) {
        let message = format!(
            "{} (a {}) may not {} {}",
            principal.name,
            principal.role.name(),
            request.method(),
            request.uri().path()
        );
        return error_response(StatusCode::FORBIDDEN, "forbidden", message);
    }
    let mut budget = None;
    if let Some(connection) = connection {
        match connection.admission().read_body(&principal, request).await {
            Ok((read, held)) => (request, budget) = (read, held),
            Err(refused) => return refused.into_response(),
        }
    }
    request.extensions_mut().insert(principal);
    let response = next.run(request).await;
    // The body's bytes are held until the answer.
    drop(budget);
    response
}

async fn not_found(uri: axum::http::Uri) -> Response {
    error_response(StatusCode::NOT_FOUND, "no_endpoint", format!("no endpoint {uri}"))
}

/// The API; with `auth`, only for the principals of its token file.
pub fn router<S: Store>(control: Arc<ControlPlane<S>>, auth: Option<Arc<Authenticator>>) -> Router {
    Router::new()
        .route("/v1/nodes", post(register::<S>).get(nodes::<S>))
        .route("/v1/nodes/{name}/lease", put(renew::<S>))
        .route("/v1/nodes/{name}", axum::routing::delete(leave::<S>))
        .route("/v1/nodes/{name}/drain", post(drain::<S>).get(drain_status::<S>).delete(undrain::<S>))
        .route("/v1/nodes/{name}/forwards", post(put_forwards::<S>))
        .route("/v1/forwards/{kind}/{from}/{epoch}/{id}", get(forward::<S>))
        .route("/v1/models/{fingerprint}", put(describe_model::<S>).get(model::<S>))
        .route("/v1/placements", post(place::<S>))
        .route("/v1/sessions/{session}", put(move_session::<S>))
        .route("/v1/cluster", get(cluster::<S>))
        .route("/v1/whoami", get(whoami))
        .route("/metrics", get(metrics::<S>))
        .fallback(not_found)
        .with_state(control)
        .layer(middleware::from_fn_with_state(auth, authenticate))
}

/// What the API's connections may hold.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Authenticated connections served at once: a request that would take one more is answered
    /// 503 (`too_many_connections`) and its connection closed.
    pub max_connections: usize,
    /// Of `max_connections`, what one tenant may hold (past it, 429 `too_many_connections`).
    pub max_connections_per_tenant: usize,
    /// Of `max_connections`, what tenants together may not take: nodes and operators always
    /// find these (at most half of `max_connections`).
    pub reserved_for_nodes: usize,
    /// Connections not yet authenticated, overall and per source address: a connection past
    /// either closes the oldest unauthenticated one of its source, or of the source that holds
    /// the most.
    pub max_unauthenticated: usize,
    pub max_unauthenticated_per_source: usize,
    /// A connection that has not authenticated (sent a request whose token is known: any whole
    /// request head without a token file) this long after it opened, its TLS handshake
    /// included, is closed. At most `header_timeout`.
    pub auth_timeout: Duration,
    /// A connection that has not sent a whole request head this long after its last answer (an
    /// idle keep-alive connection too) is closed.
    pub header_timeout: Duration,
    /// A request not answered this long after its head came gets a 408 and its connection is
    /// closed.
    pub request_timeout: Duration,
    /// A request body not whole this long after its head gets a 408 (`body_timeout`) and its
    /// connection is closed.
    pub body_timeout: Duration,
    /// A request body over this gets a 413 (`too_large`) and its connection is closed.
    pub max_body_bytes: usize,
    /// Bytes of request bodies one tenant may have in flight at once (a body counts its
    /// Content-Length, or `max_body_bytes` when sent in chunks, from its head until its
    /// answer); past it, 429 `too_many_bodies`.
    pub max_body_bytes_per_tenant: usize,
}

/// The largest request body: the largest legitimate one is a draining node's batch of 1,024
/// forwards (`MAX_FORWARDS_AT_ONCE`), about 680 KiB with addresses and tenant names at their
/// 256-byte bound; a model record is at most 64 KiB.
pub const MAX_BODY_BYTES: usize = 1 << 20;

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_connections_per_tenant: 64,
            reserved_for_nodes: 128,
            // As the data plane's listener.
            max_unauthenticated: 256,
            max_unauthenticated_per_source: 32,
            auth_timeout: Duration::from_secs(3),
            header_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(5),
            max_body_bytes: MAX_BODY_BYTES,
            max_body_bytes_per_tenant: 4 * MAX_BODY_BYTES,
        }
    }
}

/// What [`serve`] counts of its connections and requests, for /metrics.
#[derive(Debug, Default)]
pub struct ConnectionCounters {
    /// Connections open now, not yet authenticated and authenticated.
    pub unauthenticated_open: AtomicU64,
    pub authenticated_open: AtomicU64,
    /// Bytes of tenants' request bodies in flight now (as reserved against their budgets).
    pub tenant_body_bytes: AtomicU64,
    /// Requests refused (503 or 429 `too_many_connections`), and their connections closed: the
    /// principal's share of `max_connections` was in use.
    pub refused: AtomicU64,
    /// Unauthenticated connections closed to make room for a newer one.
    pub unauthenticated_evicted: AtomicU64,
    /// Closed because the connection had not authenticated `auth_timeout` after it opened (its
    /// TLS handshake or a request head not whole), or because a next request's head was not
    /// whole `header_timeout` after the last answer once some of it had come.
    pub header_timeouts: AtomicU64,
    /// Closed because nothing of a next request came within `header_timeout` of the last answer.
    pub idle_closed: AtomicU64,
    /// Requests answered 408: not complete within `request_timeout`.
    pub request_timeouts: AtomicU64,
    /// Accepts that failed (out of descriptors or memory) and were tried again after a wait.
    pub accept_backoffs: AtomicU64,
    /// Requests answered 408 `body_timeout`, 413 `too_large`, 429 `too_many_bodies`.
    pub body_timeouts: AtomicU64,
    pub bodies_too_large: AtomicU64,
    pub bodies_refused: AtomicU64,
}

fn count(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

async fn within(
    State((limit, counters)): State<(Duration, Arc<ConnectionCounters>)>,
    request: Request,
    next: Next,
) -> Response {
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            count(&counters.request_timeouts);
            let mut response = error_response(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                format!("the request was not complete within {limit:?}"),
            );
            response.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
            response
        }
    }
}

/// What one connection has received, and how much of it before its last answer: a header
/// timeout with nothing received since that answer closed an idle connection.
#[derive(Debug)]
struct Received {
    bytes: AtomicU64,
    /// `bytes` when the last answer was ready; `u64::MAX` before the first.
    at_last_answer: AtomicU64,
}

impl Received {
    fn new() -> Arc<Self> {
        Arc::new(Self { bytes: AtomicU64::new(0), at_last_answer: AtomicU64::new(u64::MAX) })
    }

    fn answered(&self) {
        self.at_last_answer.store(self.bytes.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn idle(&self) -> bool {
        self.at_last_answer.load(Ordering::Relaxed) == self.bytes.load(Ordering::Relaxed)
    }
}

/// A connection's stream, counting the bytes read from it into [`Received`].
struct Counted<T> {
    stream: T,
    received: Arc<Received>,
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before);
        self.received.bytes.fetch_add(read as u64, Ordering::Relaxed);
        polled
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Counted<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The largest request head: hyper's read buffer, what an unauthenticated connection may make
/// the API hold (its default is about 400 KiB).
const MAX_HEAD_BYTES: usize = 64 << 10;

/// Serves one connection's requests with `router` under `limits`; counts in `counters` what
/// the header timeout ended. Each request carries the connection's `slot`.
async fn serve_connection<T>(
    stream: T,
    router: Router,
    limits: ConnectionLimits,
    counters: &ConnectionCounters,
    watcher: hyper_util::server::graceful::Watcher,
    slot: Arc<ConnectionSlot>,
) -> Result<(), hyper::Error>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let received = Received::new();
    let stream = Counted { stream, received: Arc::clone(&received) };
    let router = hyper_util::service::TowerToHyperService::new(router);
    let answers = Arc::clone(&received);
    let service = hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
        request.extensions_mut().insert(Arc::clone(&slot));
        let response = hyper::service::Service::call(&router, request);
        let answers = Arc::clone(&answers);
        async move {
            let response = response.await;
            answers.answered();
            response
        }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(MAX_HEAD_BYTES);
    let served = watcher.watch(http.serve_connection(hyper_util::rt::TokioIo::new(stream), service)).await;
    if let Err(e) = &served
        && e.is_timeout()
    {
        count(if received.idle() { &counters.idle_closed } else { &counters.header_timeouts });
    }
    served
}

/// Serves `router` on `listener` (over TLS with `tls`) within `limits` until `stop` completes;
/// then finishes the requests in flight (for at most `limits.request_timeout`).
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    limits: ConnectionLimits,
    stop: impl Future<Output = ()>,
) {
    let counters = Arc::new(ConnectionCounters::default());
    let admission = Admission::new(limits, Arc::clone(&counters));
    let router = router
        .layer(middleware::from_fn_with_state((limits.request_timeout, Arc::clone(&counters)), within))
        .layer(Extension(Arc::clone(&counters)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut stop = std::pin::pin!(stop);
    let mut backoff = Duration::ZERO;
    loop {
        let accepted = tokio::select! {
            () = &mut stop => break,
            accepted = listener.accept() => accepted,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => {
                backoff = Duration::ZERO;
                accepted
            }
            // The peer gave up before it was taken: nothing is wrong here.
            Err(e)
                if matches!(e.kind(), std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset) =>
            {
                continue;
            }
            // Out of descriptors or memory: the connection stays in the backlog and the listener
            // readable, so accepting again at once would spin. Wait, longer each time.
            Err(e) => {
                backoff = (backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                count(&counters.accept_backoffs);
                tracing::warn!(error = %e, retry_in = ?backoff, "accept failed");
                tokio::select! {
                    () = &mut stop => break,
                    () = tokio::time::sleep(backoff) => continue,
                }
            }
        };
        // Never refused here: the unauthenticated pool makes room (see `admission`).
        let (slot, evicted) = admission.admit(peer.ip());
        let _ = tcp.set_nodelay(true);
        let (router, tls, watcher, counters) = (router.clone(), tls.clone(), graceful.watcher(), Arc::clone(&counters));
        tokio::spawn(async move {
            let deadline = Arc::clone(&slot);
            let served = async {
                match tls {
                    None => serve_connection(tcp, router, limits, &counters, watcher, slot).await,
                    Some(tls) => match tls.accept(tcp).await {
                        Ok(stream) => serve_connection(stream, router, limits, &counters, watcher, slot).await,
                        Err(e) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            Ok(())
                        }
                    },
                }
            };
            // Dropping the connection's future closes it.
            tokio::select! {
                served = served => if let Err(e) = served {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                },
                Ok(()) = evicted => tracing::debug!(%peer, "unauthenticated connection closed to make room"),
                () = deadline.unauthenticated_for_too_long() => {
                    count(&counters.header_timeouts);
                    tracing::debug!(%peer, "connection closed: not authenticated in time");
                }
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.request_timeout, graceful.shutdown()).await.is_err() {
        tracing::warn!("requests still in flight when the control plane stopped");
    }
}
