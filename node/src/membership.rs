//! A node's membership in a control plane (`djinn node --control URL`): a thread that
//! registers the node with its inventory and renews its lease with a fresh inventory a third
//! of the way through each lease; re-registers when the control plane has lost it; tries
//! again, backing off, whatever fails; says goodbye when the node stops.
//!
//! The inventory is asked of the node in process (its stats and model list), as any client
//! would ask, so the agent shares no state with the poller.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Result;
use djinn_client::ControlClient;
use djinn_control::{Inventory, Registered};
use djinn_dataplane::tcp::ClientTls;

use crate::drain::{DrainConfig, Drainer};
use crate::own_node::OwnNode;

/// What the node knows about itself that its stats do not say.
#[derive(Debug, Clone)]
pub struct Static {
    pub name: String,
    /// Where clients reach the data plane.
    pub addr: String,
    pub device: String,
    pub transports: Vec<String>,
    pub flops: f64,
    pub memory_bandwidth: f64,
    pub host_to_device: f64,
    pub link_bandwidth: f64,
    pub cost_per_hour: f64,
}

#[derive(Debug)]
pub struct Agent {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

struct Membership {
    control: ControlClient,
    me: Static,
    node: OwnNode,
    drainer: Drainer,
}

impl Membership {
    fn inventory(&mut self) -> Result<Inventory> {
        let stats: std::collections::HashMap<String, u64> = self.node.stats()?.into_iter().collect();
        let stat = |k: &str| stats.get(k).copied().unwrap_or(0);
        // Under a token file, a model is known to the control plane by its holders' names: each
        // tenant's records are its own (see the control plane's `scoped`).
        let models = self
            .node
            .list_models("")?
            .into_iter()
            .flat_map(|m| {
                let fingerprint = m.fingerprint.to_string();
                match m.owners.is_empty() {
                    true => vec![fingerprint],
                    false => m.owners.iter().map(|owner| format!("{owner}/{fingerprint}")).collect(),
                }
            })
            .collect();
        Ok(Inventory {
            addr: self.me.addr.clone(),
            device: self.me.device.clone(),
            memory_total: stat("budget_limit_bytes"),
            memory_free: stat("budget_limit_bytes").saturating_sub(stat("budget_used_bytes")),
            host_memory_free: stat("host_budget_limit_bytes").saturating_sub(stat("host_budget_used_bytes")),
            host_to_device: self.me.host_to_device,
            flops: self.me.flops,
            memory_bandwidth: self.me.memory_bandwidth,
            link_bandwidth: self.me.link_bandwidth,
            transports: self.me.transports.clone(),
            memory_path: djinn_dataplane::MEMORY_PATH.into(),
            queue_depth: u32::try_from(stat("jobs_queued")).unwrap_or(u32::MAX),
            cost_per_hour: self.me.cost_per_hour,
            models,
            sessions: stat("sessions"),
            kept: stat("handles"),
            parked: stat("parked"),
            unrecorded: self.drainer.unrecorded(),
            sandbox: sandbox(&stats),
        })
    }

    /// Registers; `None` while an earlier lease of this name is still live.
    fn register(&mut self) -> Result<Option<Registered>> {
        let inventory = self.inventory()?;
        match self.control.register_node(&self.me.name, &inventory) {
            Ok(registered) => {
                // A drain's mark goes with the lease it was given under.
                self.drainer.set(false);
                Ok(Some(registered))
            }
            Err(e) if e.kind() == Some("already_registered") => {
                tracing::info!(error = %e, "an earlier lease of this name is live: registering again when it lapses");
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Renews, and tells the drain whether the node is draining; false when the lease is gone
    /// and the node must register again.
    fn renew(&mut self, lease: u64) -> Result<bool> {
        let inventory = self.inventory()?;
        match self.control.renew_lease(&self.me.name, lease, &inventory) {
            Ok(draining) => {
                self.drainer.set(draining);
                Ok(true)
            }
            Err(e) if matches!(e.kind(), Some("unknown_node" | "stale_lease")) => {
                tracing::warn!(error = %e, "the lease is gone: registering again");
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// Where the node runs tenants' kernels, from its counters: in its own process (no executor
/// processes' counters), or in executor processes and the layers every live one is in.
fn sandbox(stats: &std::collections::HashMap<String, u64>) -> String {
    let Some(&processes) = stats.get("executor_processes") else {
        return "in the node".into();
    };
    if processes == 0 {
        return "executor processes (none live)".into();
    }
    let mut layers: Vec<String> = stats
        .iter()
        .filter(|&(_, &count)| count == processes)
        .filter_map(|(name, _)| name.strip_prefix("executor_sandbox_"))
        .map(|layer| layer.replace('_', "-"))
        .collect();
    layers.sort();
    match layers.is_empty() {
        true => "executor processes, unconfined".into(),
        false => format!("executor processes: {}", layers.join(",")),
    }
}

impl Agent {
    /// Starts the agent for `node` (answered once the node's poller runs).
    /// `token` is the node's, for the control plane and for peers; `peer_tls`, the roots for
    /// peers' TLS, where a drain sends them what the node holds.
    pub fn start(control: &str, token: &str, me: Static, node: OwnNode, peer_tls: Option<ClientTls>) -> Result<Self> {
        let control = ControlClient::new(control, Duration::from_secs(5)).with_token(token);
        let drainer = Drainer::start(DrainConfig {
            control: control.clone(),
            name: me.name.clone(),
            token: token.to_owned(),
            node: node.clone(),
            advertised: me.addr.clone(),
            peer_tls,
        })?;
        let (stop, stopped) = mpsc::channel();
        let thread = std::thread::Builder::new().name("djinn-membership".into()).spawn(move || {
            let mut membership = Membership { control, me, node, drainer };
            membership.run(&stopped);
            membership.drainer.stop();
        })?;
        Ok(Self { stop, thread })
    }

    /// Leaves the control plane (the lease ends now) and stops the thread.
    pub fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

impl Membership {
    /// Registers and renews until the node stops. A failure (the control plane unreachable or
    /// refusing, its store away, the node's own counters unreadable) is tried again after a
    /// delay that doubles up to `MAX_BACKOFF`: the node joins as soon as it can, whatever
    /// happened in between.
    fn run(&mut self, stopped: &mpsc::Receiver<()>) {
        const RETRY: Duration = Duration::from_millis(500);
        const MAX_BACKOFF: Duration = Duration::from_secs(30);
        let mut lease: Option<Registered> = None;
        let mut backoff = RETRY;
        let mut next = Instant::now();
        // Until the node stops (a message, or the sender dropped).
        while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(next.saturating_duration_since(Instant::now()))
        {
            let step = match &lease {
                None => self.register().map(|r| {
                    r.inspect(|r| {
                        tracing::info!(control = self.control.url(), name = %self.me.name, lease = r.lease, "joined the control plane");
                    })
                }),
                Some(r) => self.renew(r.lease).map(|kept| kept.then_some(*r)),
            };
            next = Instant::now()
                + match step {
                    Ok(now) => {
                        lease = now;
                        backoff = RETRY;
                        lease.as_ref().map_or(RETRY, |r| Duration::from_millis(r.ttl_ms / 3))
                    }
                    Err(e) => {
                        let wait = backoff;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                        match lease {
                            None => tracing::warn!(error = %format!("{e:#}"), retry_in = ?wait, "registration failed"),
                            Some(_) => tracing::warn!(error = %format!("{e:#}"), retry_in = ?wait, "renewal failed"),
                        }
                        // A renewal that failed is tried again within the lease: no longer
                        // than a third of it from now.
                        lease.as_ref().map_or(wait, |r| wait.min(Duration::from_millis(r.ttl_ms / 3)))
                    }
                };
        }
        if let Some(r) = lease
            && let Err(e) = self.control.leave(&self.me.name, r.lease)
        {
            tracing::warn!(error = %e, "leaving the control plane failed: the lease will lapse");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::sandbox;

    #[test]
    fn the_inventory_says_where_kernels_run_and_in_which_layers() {
        let stats = |pairs: &[(&str, u64)]| pairs.iter().map(|&(n, v)| (n.to_owned(), v)).collect();
        assert_eq!(sandbox(&stats(&[("jobs_queued", 0)])), "in the node");
        assert_eq!(
            sandbox(&stats(&[("executor_processes", 0), ("executor_sandbox_netns", 0)])),
            "executor processes (none live)"
        );
        // A layer only some live processes are in is not the node's.
        let two = stats(&[
            ("executor_processes", 2),
            ("executor_sandbox_seccomp", 2),
            ("executor_sandbox_netns", 2),
            ("executor_sandbox_landlock", 1),
        ]);
        assert_eq!(sandbox(&two), "executor processes: netns,seccomp");
        assert_eq!(
            sandbox(&stats(&[("executor_processes", 1), ("executor_sandbox_netns", 0)])),
            "executor processes, unconfined"
        );
    }
}
