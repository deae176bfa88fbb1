//! What clients ask the control plane (`djinn control`, HTTP/JSON): describe a model, place
//! it, read the cluster; and what a node's membership agent asks: join, renew its lease, leave.
//! Only the fields a client acts on are read from a decision; the whole of it is kept as JSON,
//! for people.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use djinn_proto::{Fingerprint, Handle};

/// One block of a model as the control plane's cost model sees it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BlockEstimate {
    pub weight_bytes: u64,
    /// FLOPs of one call of the block, counted on the example inputs.
    pub flops: f64,
}

/// What the control plane is told about a model before it is placed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelDescription {
    pub blocks: Vec<BlockEstimate>,
    /// Bytes of one call's inputs and outputs.
    pub io_bytes: u64,
    /// `prefill` (compute-bound) or `decode` (bound by reading the weights), when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// For a graph captured by the Python package: what its semantic graph says of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph: Option<GraphAnnotations>,
}

/// A captured graph's annotations, found by pattern recognition on its operations.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GraphAnnotations {
    /// `prefill`, `decode`, `vision` or `forward`.
    pub phase: String,
    /// `text`, `vision`, `multimodal` or `tensor`.
    pub modality: String,
    pub operations: u64,
    /// Attention blocks recognised.
    pub attention: u64,
    pub flops: f64,
    /// Bytes of the graph's inputs by residency.
    pub weight_bytes: u64,
    pub kv_cache_bytes: u64,
    pub activation_bytes: u64,
}

/// Where the control plane put a model (or a session), and its explanation.
#[derive(Debug, Clone, PartialEq)]
pub struct Placed {
    pub node: String,
    /// The node's data-plane address.
    pub addr: String,
    /// The rule that decided: `session`, `shared`, `streamed` or `policy`.
    pub rule: String,
    /// The whole decision as the control plane returned it (cost by part, runner-up, ...).
    pub decision: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("control plane {url} unreachable: {message}")]
    Unreachable { url: String, message: String },
    #[error("control plane {url} refused ({status} {kind}): {message}")]
    Refused { url: String, status: u16, kind: String, message: String },
    #[error("control plane {url} gave an unreadable answer: {message}")]
    BadAnswer { url: String, message: String },
}

impl ControlError {
    /// The control plane's name for the refusal (`unknown_model`, `no_nodes`, ...).
    pub fn kind(&self) -> Option<&str> {
        match self {
            Self::Refused { kind, .. } => Some(kind),
            _ => None,
        }
    }

    /// Worth asking again shortly: the control plane or every node is away for a moment.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Unreachable { .. } => true,
            Self::Refused { status, .. } => *status == 503,
            Self::BadAnswer { .. } => false,
        }
    }
}

#[derive(Deserialize)]
struct Refusal {
    error: RefusalBody,
}

#[derive(Deserialize)]
struct RefusalBody {
    kind: String,
    message: String,
}

#[derive(Deserialize)]
struct DecisionFields {
    node: String,
    addr: String,
    rule: String,
}

/// Names a PEM file of the certificates an `https` control plane's certificate must chain to
/// (by default, the web's public roots).
pub const CA_ENV: &str = "DJINN_CONTROL_CA";

/// What a placement asks besides the model: see [`ControlClient::place_with`].
#[derive(Debug, Clone, Default)]
pub struct PlaceOptions<'a> {
    pub session: Option<&'a str>,
    pub policy: Option<&'a str>,
    /// `prefill` or `decode`, where the calls differ from the model's description.
    pub phase: Option<&'a str>,
    pub moving: Option<Moving<'a>>,
    /// The tenant, by name, whose model it is: for a node or an operator placing on a tenant's
    /// behalf (a tenant's own models are its own without it).
    pub tenant: Option<&'a str>,
}

/// Where a session or a kept tensor of a drained node went: the node at `to`, as the handle
/// `to_id`/`to_epoch` there (`POST /v1/nodes/{name}/forwards`, `GET /v1/forwards/...`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Forward {
    /// `session` or `kept`.
    pub kind: String,
    pub tenant: String,
    pub id: u64,
    pub epoch: u64,
    pub to: String,
    pub to_id: u64,
    pub to_epoch: u64,
}

/// A live node, as `GET /v1/nodes` lists it.
#[derive(Debug, Clone, Deserialize)]
pub struct LiveNode {
    pub name: String,
    pub addr: String,
    /// Being drained: nothing new goes there.
    #[serde(default)]
    pub draining: bool,
    /// Device memory free, less what placements promised.
    #[serde(default)]
    pub memory_free: u64,
}

/// A session on the node at `from` with `state_bytes` of state, whose move is paid over
/// `calls` calls.
#[derive(Debug, Clone)]
pub struct Moving<'a> {
    pub from: &'a str,
    pub state_bytes: u64,
    pub calls: u32,
}

/// A blocking HTTP client of a control plane: of one control process, or of several that
/// share a store (etcd), as etcd's own clients take a list of endpoints. A request goes to the
/// endpoint that last answered; one that cannot be reached, or whose store is away (503), sends
/// the request on to the next, so no one control process is a single point of failure.
#[derive(Clone)]
pub struct ControlClient {
    http: ureq::Agent,
    /// The endpoints (never empty) and the one that last answered, shared by the clones.
    urls: Arc<[String]>,
    current: Arc<AtomicUsize>,
    /// `Bearer TOKEN`, when the client has a token.
    authorization: Option<String>,
    /// Why the client cannot be used (a CA file that does not load): every request says so.
    broken: Option<String>,
}

/// The token shows only whether there is one.
impl std::fmt::Debug for ControlClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlClient")
            .field("urls", &self.urls)
            .field("authorization", &self.authorization.as_ref().map(|_| "Bearer <redacted>"))
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl ControlClient {
    /// `url`: `http://HOST:PORT` or `https://HOST:PORT` (a bare `HOST:PORT` is taken as http),
    /// or several, separated by commas: control processes that share a store. An https control
    /// plane's certificate must chain to the certificates of the file that [`CA_ENV`] names,
    /// when it is set. `timeout` bounds each request to one endpoint.
    pub fn new(url: &str, timeout: Duration) -> Self {
        let roots = std::env::var_os(CA_ENV).map(|path| {
            std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|pem| certificates(&pem))
                .map_err(|e| format!("{CA_ENV}={}: {e}", path.to_string_lossy()))
        });
        match roots {
            Some(Err(e)) => Self { broken: Some(e), ..Self::build(url, timeout, None) },
            Some(Ok(roots)) => Self::build(url, timeout, Some(roots)),
            None => Self::build(url, timeout, None),
        }
    }

    /// A client that trusts only the certificates of `pem` for an https control plane.
    pub fn with_roots(url: &str, timeout: Duration, pem: &[u8]) -> Result<Self, ControlError> {
        let roots = certificates(pem).map_err(|message| ControlError::Unreachable { url: url.to_owned(), message })?;
        Ok(Self::build(url, timeout, Some(roots)))
    }

    fn build(urls: &str, timeout: Duration, roots: Option<Vec<ureq::tls::Certificate<'static>>>) -> Self {
        let normal = |url: &str| {
            let url = url.trim().trim_end_matches('/');
            if url.contains("://") { url.to_owned() } else { format!("http://{url}") }
        };
        let list: Vec<String> = urls.split(',').filter(|u| !u.trim().is_empty()).map(normal).collect();
        let broken = list.is_empty().then(|| format!("no control plane address in {urls:?}"));
        let urls: Arc<[String]> = if list.is_empty() { Arc::from([urls.to_owned()]) } else { list.into() };
        let mut config = ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(timeout));
        if let Some(roots) = roots {
            let roots = ureq::tls::RootCerts::Specific(std::sync::Arc::new(roots));
            config = config.tls_config(ureq::tls::TlsConfig::builder().root_certs(roots).build());
        }
        Self { http: config.build().into(), urls, current: Arc::default(), authorization: None, broken }
    }

    /// Presents `token` with every request (none when empty).
    pub fn with_token(mut self, token: &str) -> Self {
        self.authorization = (!token.is_empty()).then(|| format!("Bearer {token}"));
        self
    }

    /// `request` with the token, when there is one.
    fn authorized<B>(&self, request: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.authorization {
            Some(a) => request.header("Authorization", a),
            None => request,
        }
    }

    /// The endpoint requests go to first: the one that last answered.
    pub fn url(&self) -> &str {
        &self.urls[self.current.load(Ordering::Relaxed) % self.urls.len()]
    }

    /// Sends the request `make` builds for an endpoint's base URL: to the endpoint that last
    /// answered, then, while an endpoint is unreachable or its store away, to the next. The
    /// answer's body when the status is 2xx, the control plane's typed refusal otherwise.
    fn send(
        &self,
        make: impl Fn(&str) -> Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<String, ControlError> {
        if let Some(why) = &self.broken {
            return Err(ControlError::Unreachable { url: self.url().to_owned(), message: why.clone() });
        }
        let first = self.current.load(Ordering::Relaxed);
        let mut outcome = Err(ControlError::Unreachable { url: String::new(), message: "no endpoint".into() });
        for i in 0..self.urls.len() {
            let at = (first + i) % self.urls.len();
            let url = &self.urls[at];
            outcome = send_to(url, make(url));
            match &outcome {
                Err(e) if e.is_transient() && self.urls.len() > 1 => {
                    tracing::warn!(control = %url, error = %e, "control plane endpoint failed: trying the next");
                }
                _ => {
                    self.current.store(at, Ordering::Relaxed);
                    break;
                }
            }
        }
        outcome
    }

    fn parse<T: DeserializeOwned>(&self, body: &str) -> Result<T, ControlError> {
        serde_json::from_str(body)
            .map_err(|e| ControlError::BadAnswer { url: self.url().to_owned(), message: e.to_string() })
    }

    pub fn describe_model(&self, fingerprint: &Fingerprint, model: &ModelDescription) -> Result<(), ControlError> {
        self.describe_model_of(None, fingerprint, model)
    }

    /// [`Self::describe_model`] for `tenant`'s model (by a node or an operator).
    pub fn describe_model_of(
        &self,
        tenant: Option<&str>,
        fingerprint: &Fingerprint,
        model: &ModelDescription,
    ) -> Result<(), ControlError> {
        let path = format!("/v1/models/{}", path_segment(&model_key(tenant, fingerprint)));
        self.send(|base| self.authorized(self.http.put(format!("{base}{path}"))).send_json(model)).map(drop)
    }

    /// Asks where to run a described model (for `session`, when given) under `policy` (the
    /// control plane's default when `None`).
    pub fn place(
        &self,
        fingerprint: &Fingerprint,
        session: Option<&str>,
        policy: Option<&str>,
    ) -> Result<Placed, ControlError> {
        self.place_with(fingerprint, &PlaceOptions { session, policy, ..PlaceOptions::default() })
    }

    /// [`Self::place`] with every option the control plane takes: the calls' phase, and a
    /// session that would move to the node chosen (its move's cost is weighed in).
    pub fn place_with(&self, fingerprint: &Fingerprint, options: &PlaceOptions<'_>) -> Result<Placed, ControlError> {
        let mut body = serde_json::json!({ "fingerprint": model_key(options.tenant, fingerprint) });
        if let Some(session) = options.session {
            body["session"] = session.into();
        }
        if let Some(policy) = options.policy {
            body["policy"] = policy.into();
        }
        if let Some(phase) = options.phase {
            body["phase"] = phase.into();
        }
        if let Some(m) = &options.moving {
            body["moving"] = serde_json::json!({ "from": m.from, "state_bytes": m.state_bytes, "calls": m.calls });
        }
        let decision =
            self.send(|base| self.authorized(self.http.post(format!("{base}/v1/placements"))).send_json(&body))?;
        let fields: DecisionFields = self.parse(&decision)?;
        Ok(Placed { node: fields.node, addr: fields.addr, rule: fields.rule, decision })
    }

    /// Says that the placed session `session` moved to the node at `addr`, so that its later
    /// placements go there; the answer is that node's name.
    pub fn session_moved(&self, session: &str, addr: &str) -> Result<String, ControlError> {
        #[derive(Deserialize)]
        struct Moved {
            node: String,
        }
        let path = format!("/v1/sessions/{}", path_segment(session));
        let body = serde_json::json!({ "addr": addr });
        let answer = self.send(|base| self.authorized(self.http.put(format!("{base}{path}"))).send_json(&body))?;
        Ok(self.parse::<Moved>(&answer)?.node)
    }

    /// Admits node `name` with its inventory; the answer is its lease.
    pub fn register_node<T: DeserializeOwned>(
        &self,
        name: &str,
        inventory: &impl Serialize,
    ) -> Result<T, ControlError> {
        let body = serde_json::json!({ "name": name, "inventory": inventory });
        let answer = self.send(|base| self.authorized(self.http.post(format!("{base}/v1/nodes"))).send_json(&body))?;
        self.parse(&answer)
    }

    /// Renews node `name`'s lease, with its inventory now; whether the node is being drained.
    pub fn renew_lease(&self, name: &str, lease: u64, inventory: &impl Serialize) -> Result<bool, ControlError> {
        #[derive(Deserialize)]
        struct Renewed {
            draining: bool,
        }
        let body = serde_json::json!({ "lease": lease, "inventory": inventory });
        let answer =
            self.send(|base| self.authorized(self.http.put(format!("{base}/v1/nodes/{name}/lease"))).send_json(&body))?;
        Ok(self.parse::<Renewed>(&answer)?.draining)
    }

    /// Starts draining node `name` (an operator's call), or with `draining` false stops; the
    /// drain's status, as JSON.
    pub fn drain(&self, name: &str, draining: bool) -> Result<String, ControlError> {
        let url = |base: &str| format!("{base}/v1/nodes/{}/drain", path_segment(name));
        match draining {
            true => self.send(|base| self.authorized(self.http.post(url(base))).send_empty()),
            false => self.send(|base| self.authorized(self.http.delete(url(base))).call()),
        }
    }

    /// Records where the draining node `name`'s sessions and kept tensors went.
    pub fn put_forwards(&self, name: &str, forwards: &[Forward]) -> Result<(), ControlError> {
        let url = format!("/v1/nodes/{}/forwards", path_segment(name));
        let body = serde_json::json!({ "forwards": forwards });
        self.send(|base| self.authorized(self.http.post(format!("{base}{url}"))).send_json(&body)).map(drop)
    }

    /// Where the caller's `kind` (`session` or `kept`) under `handle` at the node that served
    /// at `from` went, when the control plane knows (the node was drained); `None` when not.
    pub fn forward(&self, kind: &str, from: &str, handle: Handle) -> Result<Option<(String, Handle)>, ControlError> {
        let url = format!("/v1/forwards/{kind}/{}/{:016x}/{}", path_segment(from), handle.epoch, handle.id);
        match self.send(|base| self.authorized(self.http.get(format!("{base}{url}"))).call()) {
            Ok(answer) => {
                let f: Forward = self.parse(&answer)?;
                Ok(Some((f.to, Handle { id: f.to_id, epoch: f.to_epoch })))
            }
            Err(e) if e.kind() == Some("unknown_forward") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// What node `name`, being drained, still holds, as JSON.
    pub fn drain_status(&self, name: &str) -> Result<String, ControlError> {
        let url = format!("/v1/nodes/{}/drain", path_segment(name));
        self.send(|base| self.authorized(self.http.get(format!("{base}{url}"))).call())
    }

    /// Ends node `name`'s lease now.
    pub fn leave(&self, name: &str, lease: u64) -> Result<(), ControlError> {
        self.send(|base| self.authorized(self.http.delete(format!("{base}/v1/nodes/{name}?lease={lease}"))).call())
            .map(drop)
    }

    /// Whom the token names: `{"name", "role"}` (the anonymous operator where no token is
    /// needed). A cheap check that the control plane is there and takes the token.
    pub fn whoami(&self) -> Result<String, ControlError> {
        self.send(|base| self.authorized(self.http.get(format!("{base}/v1/whoami"))).call())
    }

    /// The addresses of the live nodes (any principal may ask).
    pub fn live_nodes(&self) -> Result<Vec<String>, ControlError> {
        Ok(self.nodes()?.into_iter().map(|n| n.addr).collect())
    }

    /// The live nodes (any principal may ask: tenants' clients follow nodes only to them).
    pub fn nodes(&self) -> Result<Vec<LiveNode>, ControlError> {
        #[derive(Deserialize)]
        struct Nodes {
            nodes: Vec<LiveNode>,
        }
        let answer = self.send(|base| self.authorized(self.http.get(format!("{base}/v1/nodes"))).call())?;
        Ok(self.parse::<Nodes>(&answer)?.nodes)
    }

    /// The cluster's nodes, models and sessions, as JSON.
    pub fn cluster(&self) -> Result<String, ControlError> {
        self.send(|base| self.authorized(self.http.get(format!("{base}/v1/cluster"))).call())
    }
}

/// A model's key at the control plane: its fingerprint, after its tenant's name where a node or
/// an operator names the tenant.
fn model_key(tenant: Option<&str>, fingerprint: &Fingerprint) -> String {
    match tenant.filter(|t| !t.is_empty()) {
        Some(tenant) => format!("{tenant}/{}", fingerprint.to_hex()),
        None => fingerprint.to_hex(),
    }
}

/// `s` as one segment of a URL's path: every byte but the unreserved ones percent-encoded.
fn path_segment(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One endpoint's answer: its body when the status is 2xx, the control plane's typed refusal
/// otherwise.
fn send_to(url: &str, request: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Result<String, ControlError> {
    let unreachable =
        |e: &dyn std::fmt::Display| ControlError::Unreachable { url: url.to_owned(), message: e.to_string() };
    let mut response = request.map_err(|e| unreachable(&e))?;
    let status = response.status().as_u16();
    let body = response.body_mut().read_to_string().map_err(|e| unreachable(&e))?;
    if (200..300).contains(&status) {
        return Ok(body);
    }
    let (kind, message) = match serde_json::from_str::<Refusal>(&body) {
        Ok(Refusal { error }) => (error.kind, error.message),
        Err(_) => ("unknown".to_owned(), body),
    };
    Err(ControlError::Refused { url: url.to_owned(), status, kind, message })
}

/// The certificates of a PEM file (anything else in it is ignored).
fn certificates(pem: &[u8]) -> Result<Vec<ureq::tls::Certificate<'static>>, String> {
    let mut certs = Vec::new();
    for item in ureq::tls::parse_pem(pem) {
        if let ureq::tls::PemItem::Certificate(cert) = item.map_err(|e| e.to_string())? {
            certs.push(cert);
        }
    }
    if certs.is_empty() {
        return Err("no PEM certificate in it".into());
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_names_no_token() {
        let client = ControlClient::new("127.0.0.1:7000", Duration::from_secs(1)).with_token("s3cret-token");
        let shown = format!("{client:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("Bearer <redacted>") && shown.contains("127.0.0.1:7000"), "{shown}");
    }

    /// Answers each request of one connection with `status` and `body`, then closes.
    fn serve(status: &str, body: &'static str) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let status = status.to_owned();
        std::thread::spawn(move || {
            use std::io::{BufRead, Write};
            for stream in listener.incoming().flatten() {
                let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                // The request's head, up to its blank line (these requests have no body).
                while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                    line.clear();
                }
                let answer =
                    format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
                let _ = (&stream).write_all(answer.as_bytes());
            }
        });
        addr
    }

    /// Several endpoints: one that is down and one whose store is away are passed over, and
    /// the one that answered is asked first from then on; a refusal is the answer.
    #[test]
    fn a_request_goes_on_to_the_next_endpoint() {
        let down = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        let away = serve("503 Service Unavailable", r#"{"error":{"kind":"store","message":"etcd is away"}}"#);
        let up = serve("200 OK", r#"{"name":"ops","role":"admin"}"#);
        let client = ControlClient::new(&format!("{down}, http://{away}/,{up}"), Duration::from_secs(2));
        assert!(client.url().ends_with(&down));
        assert!(client.whoami().unwrap().contains("ops"));
        assert_eq!(client.url(), format!("http://{up}"));
        let refusing = serve("403 Forbidden", r#"{"error":{"kind":"forbidden","message":"no"}}"#);
        let client = ControlClient::new(&format!("{refusing},{up}"), Duration::from_secs(2));
        assert_eq!(client.whoami().unwrap_err().kind(), Some("forbidden"), "a refusal is not passed over");
        let nothing = ControlClient::new(" , ", Duration::from_secs(2));
        assert!(matches!(nothing.whoami(), Err(ControlError::Unreachable { .. })));
    }
}
