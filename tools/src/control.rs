//! `djinn control`: the control plane's process (membership, placement, the HTTP API) over the
//! embedded store or etcd.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use djinn_auth::Authenticator;
use djinn_control::http::ConnectionLimits;
use djinn_control::store::{EmbeddedStore, EtcdStore, Store};
use djinn_control::{ControlConfig, ControlPlane};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::auth::PrincipalsArgs;

#[derive(Args, Debug, Clone)]
pub struct ControlArgs {
    /// Address of the HTTP API, HOST:PORT (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:7000")]
    pub listen: String,
    /// The embedded store's file (used unless --etcd is given). Default: `control.redb` in the
    /// state directory, `$DJINN_STATE_DIR`, else `$XDG_STATE_HOME/djinn`, else
    /// `~/.local/state/djinn`.
    #[arg(long)]
    pub store: Option<PathBuf>,
    /// etcd endpoints, comma-separated (http://HOST:PORT): several control processes share
    /// one cluster state there.
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Prefix of every key this control plane writes (several clusters can share one etcd).
    #[arg(long, default_value = "/djinn/")]
    pub prefix: String,
    /// How long a node's lease lasts without a renewal (`3s`, `1500ms`): a node that dies is
    /// gone from placement this long after its last renewal, at most.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub lease_ttl: Duration,
    /// A model record that no live node's inventory has listed for this long is deleted
    /// (`600s`, `1500ms`): a model placed but never loaded expires too.
    #[arg(long, default_value = "600s", value_parser = parse_duration)]
    pub model_record_ttl: Duration,
    #[command(flatten)]
    pub principals: PrincipalsArgs,
    /// Serve the API over TLS with this certificate chain (PEM); needs --tls-key. Clients
    /// trust it through the system's roots, or the PEM file named by DJINN_CONTROL_CA.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Model records one tenant may keep; more are refused (429, quota_exceeded).
    #[arg(long, default_value_t = 4096)]
    pub max_models_per_tenant: usize,
    /// Sessions one tenant may have placed at once; more are refused (429, quota_exceeded).
    #[arg(long, default_value_t = 16384)]
    pub max_sessions_per_tenant: usize,
    /// Authenticated connections to the API at once (a tenant may hold 64, nodes and operators
    /// keep 128 of them); a request past them is refused (503) and its connection closed. Apart
    /// from them, 256 connections (32 per source address) may wait for their first request to
    /// authenticate, 3 s at most.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// A connection that sends no whole next request head this long after its last answer, idle
    /// ones included, is closed (`10s`, `1500ms`); the time to authenticate is at most this.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub header_timeout: Duration,
    /// A request not answered this long after its head gets a 408, its body included.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub request_timeout: Duration,
}

impl ControlArgs {
    fn limits(&self) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: self.max_connections.max(1),
            header_timeout: self.header_timeout,
            request_timeout: self.request_timeout,
            ..ConnectionLimits::default()
        }
    }
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (number, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = number.parse().map_err(|_| format!("{s:?} is not a duration: give e.g. 3s or 1500ms"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        _ => Err(format!("{s:?} is not a duration: give e.g. 3s or 1500ms")),
    }
}

/// Serves until SIGINT or SIGTERM.
pub fn run(args: ControlArgs) -> Result<()> {
    let mut config = config(args.lease_ttl, args.model_record_ttl, &args.prefix)?;
    config.max_models_per_tenant = args.max_models_per_tenant;
    config.max_sessions_per_tenant = args.max_sessions_per_tenant;
    let limits = args.limits();
    let auth = args.principals.authenticator()?;
    args.principals.check_exposure(&args.listen, auth.is_some())?;
    let authenticator = auth.as_ref().map(|(a, _)| Arc::clone(a));
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(tls_acceptor(cert, key)?),
        _ => None,
    };
    crate::runtime()?.block_on(async {
        let api = if args.etcd.is_empty() {
            let path = match &args.store {
                Some(path) => path.clone(),
                None => EmbeddedStore::default_path()?,
            };
            let store = EmbeddedStore::open(&path)?;
            tracing::info!(store = %path.display(), "embedded store");
            Api::bind(store, config, authenticator, &args.listen).await?
        } else {
            let store = EtcdStore::connect(&args.etcd).await?;
            tracing::info!(endpoints = ?args.etcd, "etcd store");
            Api::bind(store, config, authenticator, &args.listen).await?
        };
        api.serve(tls, limits, shutdown()).await;
        Ok(())
    })
}

/// TLS 1.2 and 1.3 with `cert` (a PEM chain, leaf first) and `key` (PEM), on rustls's ring
/// provider.
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("--tls-cert {}: not a PEM certificate chain", cert.display()))?;
    if chain.is_empty() {
        bail!("--tls-cert {}: no certificate in it", cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("--tls-key {}: not a PEM private key", key.display()))?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("the TLS key does not go with the certificate")?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

pub fn config(lease_ttl: Duration, model_record_ttl: Duration, prefix: &str) -> Result<ControlConfig> {
    if lease_ttl < Duration::from_millis(100) {
        bail!("--lease-ttl must be at least 100ms");
    }
    Ok(ControlConfig { lease_ttl, model_record_ttl, prefix: prefix.to_owned(), ..ControlConfig::default() })
}

/// The control plane's HTTP API, bound to its address but not serving yet.
pub struct Api {
    listener: tokio::net::TcpListener,
    router: axum::Router,
    addr: SocketAddr,
}

impl Api {
    /// Loads the cluster state, binds `listen` and prints the bound address.
    /// With `auth`, requests need a token of its file.
    pub async fn bind<S: Store>(
        store: S,
        config: ControlConfig,
        auth: Option<Arc<Authenticator>>,
        listen: &str,
    ) -> Result<Self> {
        let control = ControlPlane::start(store, config).await.context("cannot load the cluster state")?;
        let listener =
            tokio::net::TcpListener::bind(listen).await.with_context(|| format!("cannot listen on {listen}"))?;
        let addr = listener.local_addr()?;
        // The first line of stdout is the bound address: scripts and tests read it.
        println!("djinn control listening on {addr}");
        std::io::stdout().flush()?;
        Ok(Self { listener, router: djinn_control::http::router(control, auth), addr })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves (over TLS with `tls`) until `stop` completes, then finishes the requests in flight.
    pub async fn serve(self, tls: Option<TlsAcceptor>, limits: ConnectionLimits, stop: impl Future<Output = ()>) {
        tracing::info!(addr = %self.addr, tls = tls.is_some(), "control plane serving");
        djinn_control::http::serve(self.listener, self.router, tls, limits, stop).await;
        tracing::info!("control plane stopped");
    }
}

async fn shutdown() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) else {
        tracing::warn!("cannot install signal handlers: stop the control plane with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
}
