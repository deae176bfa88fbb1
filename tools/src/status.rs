//! `djinn status`: what a control plane knows about its cluster (`GET /v1/cluster`).

use std::fmt::Write;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use djinn_client::ControlClient;
use djinn_control::ClusterStatus;
use djinn_memory::ByteSize;

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// The control plane, http://HOST:PORT (or HOST:PORT), or several, separated by commas.
    #[arg(long, default_value = "http://127.0.0.1:7000")]
    control: String,
    /// Print the control plane's JSON as it came.
    #[arg(long)]
    json: bool,
}

pub fn run(args: StatusArgs) -> Result<()> {
    let control = ControlClient::new(&args.control, Duration::from_secs(5)).with_token(&crate::auth::token(None)?);
    let body = control.cluster()?;
    if args.json {
        println!("{body}");
        return Ok(());
    }
    let cluster: ClusterStatus =
        serde_json::from_str(&body).with_context(|| format!("unexpected answer from {}", control.url()))?;
    print!("{}", render(control.url(), &cluster));
    Ok(())
}

fn render(url: &str, cluster: &ClusterStatus) -> String {
    let mut out = format!("control plane {url}, revision {}\n", cluster.revision);
    let header = [
        "NODE",
        "ADDRESS",
        "DEVICE",
        "MEMORY USED",
        "HOST FREE",
        "TRANSPORTS",
        "MEMORY PATH",
        "QUEUE",
        "MODELS",
        "PROMISED",
        "KERNELS RUN",
    ];
    let mut nodes = vec![row(header)];
    for node in &cluster.nodes {
        let inv = &node.inventory;
        let used = ByteSize(inv.memory_total.saturating_sub(inv.memory_free));
        nodes.push(vec![
            if node.draining { format!("{} (draining)", node.name) } else { node.name.clone() },
            inv.addr.clone(),
            inv.device.clone(),
            format!("{used} / {}", ByteSize(inv.memory_total)),
            ByteSize(inv.host_memory_free).to_string(),
            inv.transports.join(","),
            inv.memory_path.clone(),
            inv.queue_depth.to_string(),
            inv.models.len().to_string(),
            ByteSize(node.promised_bytes).to_string(),
            if inv.sandbox.is_empty() { "-".into() } else { inv.sandbox.clone() },
        ]);
    }
    section(&mut out, "nodes", nodes);
    let mut models = vec![row(["MODEL", "BLOCKS", "WEIGHTS", "NODES"])];
    for model in &cluster.models {
        let fingerprint = model.fingerprint.get(..16).unwrap_or(&model.fingerprint);
        let weights = ByteSize(model.weight_bytes).to_string();
        models.push(vec![fingerprint.into(), model.blocks.to_string(), weights, model.nodes.join(",")]);
    }
    section(&mut out, "models", models);
    let mut sessions = vec![row(["SESSION", "NODE"])];
    sessions.extend(cluster.sessions.iter().map(|(id, node)| vec![id.clone(), node.clone()]));
    section(&mut out, "sessions", sessions);
    out
}

fn row<const N: usize>(cells: [&str; N]) -> Vec<String> {
    cells.map(str::to_owned).into()
}

/// A blank line, then `no NAME` or the rows (the first is the header) in left-aligned columns.
fn section(out: &mut String, name: &str, rows: Vec<Vec<String>>) {
    out.push('\n');
    if rows.len() == 1 {
        let _ = writeln!(out, "no {name}");
        return;
    }
    let mut widths = vec![0; rows[0].len()];
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    for row in &rows {
        let mut line = String::new();
        for (width, cell) in widths.iter().zip(row) {
            let _ = write!(line, "{cell:<width$}  ");
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
}
