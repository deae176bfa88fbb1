//! Arbitrary requests to the control plane's HTTP API, served in process by the real router
//! over the embedded store (no socket): JSON bodies, path segments and query strings as the
//! fuzzer makes them. Checks that:
//! - nothing panics, and no request gets a 500;
//! - every error is the API's JSON error body (`{"error": {"kind", "message"}}`), and no
//!   malformed request reaches the store as a store failure;
//! - a model description that was accepted reads back unchanged.
//!
//! Input layout: byte 0 picks the endpoint (its low 4 bits: 8–13 a node's drain, a session's
//! move and the forwards of a drain, the rest by the low 3 bits); byte 1 is the length of the path
//! segment (a node's name or a fingerprint) that follows, percent-encoded into the URI; the rest
//! is the body (or, for a node leaving, the query string).

use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use djinn_control::service::{ControlConfig, ControlPlane, ModelRecord};
use djinn_control::store::EmbeddedStore;
use tower::ServiceExt;

struct Api {
    runtime: tokio::runtime::Runtime,
    router: Router,
    _dir: tempfile::TempDir,
}

fn api() -> &'static Api {
    static API: OnceLock<Api> = OnceLock::new();
    API.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&dir.path().join("control.redb")).unwrap();
        let control = runtime.block_on(ControlPlane::start(store, ControlConfig::default())).unwrap();
        let router = djinn_control::http::router(Arc::clone(&control), None);
        Api { runtime, router, _dir: dir }
    })
}

/// `bytes` as one path segment: unreserved ASCII as is, the rest percent-encoded.
fn segment(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => char::from(b).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

async fn send(router: &Router, method: &str, uri: &str, body: Vec<u8>) -> (StatusCode, Vec<u8>) {
    let request = Request::builder().method(method).uri(uri).body(Body::from(body)).unwrap();
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
    (status, bytes.to_vec())
}

pub fn run(data: &[u8]) {
    let [pick, len, rest @ ..] = data else { return };
    let (name, body) = rest.split_at(usize::from(*len).min(rest.len()));
    let name = segment(name);
    let (method, uri, body) = match pick & 15 {
        8 => ("POST", format!("/v1/nodes/{name}/drain"), Vec::new()),
        9 => ("GET", format!("/v1/nodes/{name}/drain"), Vec::new()),
        10 => ("DELETE", format!("/v1/nodes/{name}/drain"), Vec::new()),
        11 => ("PUT", format!("/v1/sessions/{name}"), body.to_vec()),
        12 => ("POST", format!("/v1/nodes/{name}/forwards"), body.to_vec()),
        13 => {
            // The body's bytes as the rest of the path, split at its slashes.
            let rest: Vec<String> = body.split(|b| *b == b'/').map(segment).collect();
            ("GET", format!("/v1/forwards/{name}/{}", rest.join("/")), Vec::new())
        }
        _ => match pick & 7 {
            0 => ("POST", "/v1/nodes".to_owned(), body.to_vec()),
            1 => ("PUT", format!("/v1/nodes/{name}/lease"), body.to_vec()),
            2 => ("DELETE", format!("/v1/nodes/{name}?{}", segment(body)), Vec::new()),
            3 => ("PUT", format!("/v1/models/{name}"), body.to_vec()),
            4 => ("GET", format!("/v1/models/{name}"), Vec::new()),
            5 => ("POST", "/v1/placements".to_owned(), body.to_vec()),
            6 => ("GET", "/v1/cluster".to_owned(), Vec::new()),
            _ => ("GET", "/metrics".to_owned(), Vec::new()),
        },
    };
    let api = api();
    api.runtime.block_on(async {
        let (status, answer) = send(&api.router, method, &uri, body.clone()).await;
        assert_ne!(status, StatusCode::INTERNAL_SERVER_ERROR, "{method} {uri}");
        if status.is_client_error() || status.is_server_error() {
            let error: serde_json::Value = serde_json::from_slice(&answer)
                .unwrap_or_else(|e| panic!("{method} {uri}: {status} with a body that is not JSON ({e})"));
            let kind = error["error"]["kind"].as_str().unwrap_or_else(|| panic!("{method} {uri}: {error}"));
            assert!(error["error"]["message"].is_string(), "{method} {uri}: {error}");
            assert_ne!(kind, "store_unavailable", "{method} {uri}: {error}");
        }
        if pick & 15 == 3 && status.is_success() {
            let sent: ModelRecord = serde_json::from_slice(&body).expect("an accepted description parses");
            let (status, stored) = send(&api.router, "GET", &uri, Vec::new()).await;
            assert_eq!(status, StatusCode::OK);
            let stored: ModelRecord = serde_json::from_slice(&stored).unwrap();
            assert_eq!(stored, sent, "the description changed on its way through the store");
        }
    });
}
