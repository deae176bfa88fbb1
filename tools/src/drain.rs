//! `djinn drain NODE`: an operator's drain of a node (`POST /v1/nodes/{name}/drain`). The
//! control plane places nothing new there; the node moves its sessions to other nodes, node to
//! node, while its running requests finish. This waits, printing what the node still holds as
//! it changes, until it holds nothing (or, with `--no-wait`, returns at once).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use djinn_client::ControlClient;
use djinn_control::DrainStatus;

#[derive(Args, Debug)]
pub struct DrainArgs {
    /// The node, by name (as `djinn status` lists it).
    node: String,
    /// The control plane, http://HOST:PORT (or HOST:PORT), or several, separated by commas.
    #[arg(long, default_value = "http://127.0.0.1:7000")]
    control: String,
    /// Stop draining the node: placements may go there again (what moved stays where it went).
    #[arg(long)]
    cancel: bool,
    /// Return once the drain has started, without waiting for the node to hold nothing.
    #[arg(long)]
    no_wait: bool,
    /// Seconds to wait for the node to hold nothing; the drain goes on after.
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
}

pub fn run(args: DrainArgs) -> Result<()> {
    let control = ControlClient::new(&args.control, Duration::from_secs(5)).with_token(&crate::auth::token(None)?);
    let status = |body: String| -> Result<DrainStatus> {
        serde_json::from_str(&body).with_context(|| format!("unexpected answer from {}", control.url()))
    };
    let mut last = status(control.drain(&args.node, !args.cancel)?)?;
    if args.cancel {
        println!("node {} is no longer draining", args.node);
        return Ok(());
    }
    println!("draining node {}: {}", args.node, holds(&last));
    if args.no_wait {
        return Ok(());
    }
    let deadline = Instant::now() + Duration::try_from_secs_f64(args.timeout).context("--timeout")?;
    while !last.drained {
        if Instant::now() > deadline {
            bail!("node {} still holds {} after {}s; the drain goes on", args.node, holds(&last), args.timeout);
        }
        std::thread::sleep(Duration::from_millis(250));
        let now = match control.drain_status(&args.node) {
            Ok(body) => status(body)?,
            Err(e) if e.kind() == Some("unknown_node") => bail!("node {} left before it was drained: {e}", args.node),
            Err(e) => return Err(e.into()),
        };
        if holds(&now) != holds(&last) {
            println!("node {}: {}", args.node, holds(&now));
        }
        last = now;
    }
    println!("node {} is drained: it holds nothing", args.node);
    Ok(())
}

/// What the node still holds, in words.
fn holds(s: &DrainStatus) -> String {
    format!(
        "{} sessions, {} kept tensors, {} parked requests, {} requests running or queued",
        s.sessions, s.kept, s.parked, s.requests
    )
}
