//! `djinn up`: the control plane and one node in one process, for one machine. The control
//! plane serves on a thread of its own; the node joins it over loopback like any other node.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Result, anyhow, bail};
use clap::Args;
use djinn_control::store::EmbeddedStore;

use crate::control::{self, Api};
use crate::node::{self, NodeArgs};

#[derive(Args, Debug)]
#[command(mut_arg("control", |a| a.hide(true)))]
pub struct UpArgs {
    #[command(flatten)]
    pub node: NodeArgs,
    /// Address of the control plane's HTTP API, HOST:PORT (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:7000")]
    control_listen: String,
    /// The control plane's embedded store file. Default: `control.redb` in the state directory
    /// (see `djinn control --help`).
    #[arg(long)]
    store: Option<PathBuf>,
    /// How long a node's lease lasts without a renewal (`3s`, `1500ms`).
    #[arg(long, default_value = "3s", value_parser = control::parse_duration)]
    lease_ttl: Duration,
    /// A model record that no node has held for this long is deleted (`600s`, `1500ms`).
    #[arg(long, default_value = "600s", value_parser = control::parse_duration)]
    model_record_ttl: Duration,
}

/// Serves until SIGINT or SIGTERM: the node stops first (it leaves the control plane), then the
/// control plane.
pub fn run(mut args: UpArgs) -> Result<()> {
    if args.node.control.is_some() {
        bail!("`djinn up` runs its own control plane: --control is for `djinn node`");
    }
    let config = control::config(args.lease_ttl, args.model_record_ttl, "/djinn/")?;
    // The control plane and the node share one watch of the principals.
    let auth = args.node.auth.principals.authenticator()?;
    if auth.is_some() && args.node.auth.token()?.is_empty() {
        bail!(
            "when tokens are required, the node needs a node's token to join its control plane: --token-file or DJINN_TOKEN"
        );
    }
    args.node.auth.principals.check_exposure(&args.control_listen, auth.is_some())?;
    let authenticator = auth.as_ref().map(|(a, _)| Arc::clone(a));
    let node_auth = authenticator.clone();
    let (bound, addr) = mpsc::channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let store = match args.store {
        Some(path) => path,
        None => EmbeddedStore::default_path()?,
    };
    let listen = args.control_listen;
    let thread = std::thread::Builder::new().name("djinn-control".into()).spawn(move || {
        crate::runtime()?.block_on(async {
            let api = Api::bind(EmbeddedStore::open(&store)?, config, authenticator, &listen).await?;
            let _ = bound.send(api.addr());
            // The node's own signal handler stops the node; the control plane waits for it.
            let stop = async {
                let _ = stopped.await;
            };
            api.serve(None, Default::default(), stop).await;
            anyhow::Ok(())
        })
    })?;
    let Ok(addr) = addr.recv() else {
        join(thread)?;
        bail!("the control plane stopped before it listened");
    };
    // A node cannot connect to the unspecified address on every system: use loopback instead.
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => Ipv4Addr::LOCALHOST.into(),
        IpAddr::V6(ip) if ip.is_unspecified() => Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    args.node.control = Some(format!("http://{}", SocketAddr::new(ip, addr.port())));
    let node = node::run(args.node, node_auth);
    let _ = stop.send(());
    let control = join(thread);
    node.and(control)
}

fn join(thread: JoinHandle<Result<()>>) -> Result<()> {
    thread.join().map_err(|_| anyhow!("the control plane's thread panicked"))?
}
