//! A node's Prometheus /metrics (`djinn node --metrics-listen ADDR`): its counters, asked of
//! the node in process as `djinn stats` asks for them, so the poller shares no state with the
//! HTTP server.

use std::net::SocketAddr;

use anyhow::{Context, Result};
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::own_node::OwnNode;

/// Counters whose names end so are gauges; the rest only grow.
const GAUGE_SUFFIXES: [&str; 7] = ["_open", "_bytes", "_queued", "_in_flight", "models", "uploads", "store_tensors"];

fn exposition(counters: &[(String, u64)]) -> String {
    let mut out = String::new();
    for (name, value) in counters {
        let gauge = GAUGE_SUFFIXES.iter().any(|s| name.ends_with(s));
        let (kind, suffix) = if gauge { ("gauge", "") } else { ("counter", "_total") };
        out.push_str(&format!("# TYPE djinn_node_{name}{suffix} {kind}\ndjinn_node_{name}{suffix} {value}\n"));
    }
    out
}

async fn metrics(State(node): State<OwnNode>) -> Response {
    let read = tokio::task::spawn_blocking(move || node.stats()).await;
    match read {
        Ok(Ok(counters)) => {
            ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], exposition(&counters)).into_response()
        }
        Ok(Err(e)) => (StatusCode::SERVICE_UNAVAILABLE, format!("the node's counters: {e:#}\n")).into_response(),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "the metrics reader failed\n").into_response(),
    }
}

/// Serves /metrics on `listen` from a thread of its own; returns the bound address.
pub fn serve(listen: &str, node: OwnNode) -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind(listen).with_context(|| format!("--metrics-listen {listen}"))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    std::thread::Builder::new().name("djinn-metrics".into()).spawn(move || {
        runtime.block_on(async move {
            let served = match tokio::net::TcpListener::from_std(listener) {
                Ok(listener) => {
                    let app = Router::new().route("/metrics", get(metrics)).with_state(node);
                    axum::serve(listener, app).await.map_err(anyhow::Error::from)
                }
                Err(e) => Err(e.into()),
            };
            if let Err(e) = served {
                tracing::error!(error = %e, "the metrics server stopped");
            }
        })
    })?;
    Ok(addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_gauges_are_told_apart() {
        let text = exposition(&[
            ("frames_in".into(), 3),
            ("connections_open".into(), 1),
            ("budget_used_bytes".into(), 9),
            ("requests_in_flight".into(), 2),
        ]);
        assert_eq!(
            text,
            "# TYPE djinn_node_frames_in_total counter\ndjinn_node_frames_in_total 3\n\
             # TYPE djinn_node_connections_open gauge\ndjinn_node_connections_open 1\n\
             # TYPE djinn_node_budget_used_bytes gauge\ndjinn_node_budget_used_bytes 9\n\
             # TYPE djinn_node_requests_in_flight gauge\ndjinn_node_requests_in_flight 2\n"
        );
    }
}
