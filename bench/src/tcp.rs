//! `djinn bench tcp`: put and get through a node process against raw blocking sockets.
//!
//! Baselines, each between this process and a child process, unpinned, on loopback:
//! - put of S bytes against a raw one-way send of S bytes into a reused buffer, answered by an
//!   8-byte acknowledgement;
//! - get of S bytes against an 8-byte request answered by S bytes from a reused buffer;
//! - the 64-byte round trip against a raw 64-byte ping-pong.
//!
//! With `--tls`, a mio node speaking TLS (a self-signed certificate made for the run) is
//! measured beside the others, and a second table gives its cost: TLS over plain mio, call
//! for call in the same run.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use djinn_client::{Client, ClientOptions, ClientTls, DType};
use djinn_memory::ByteSize;

use crate::Spawned;
use crate::report::{Stats, append_section, measure, raw};

#[derive(Args, Debug)]
pub struct TcpArgs {
    /// Payload sizes.
    #[arg(long, value_delimiter = ',', default_value = "8,64,512,4KiB,32KiB,256KiB,2MiB,16MiB,64MiB,256MiB")]
    sizes: Vec<ByteSize>,
    /// Node backends to measure.
    #[arg(long, value_delimiter = ',', default_value = "mio,uring")]
    backends: Vec<String>,
    /// Bytes moved per measurement (iterations = this / size, between --min-iters and
    /// --max-iters).
    #[arg(long, default_value = "4GiB")]
    volume: ByteSize,
    /// Fewest timed iterations of one measurement (the largest sizes).
    #[arg(long, default_value_t = 20)]
    min_iters: u64,
    /// Most timed iterations of one measurement (the smallest sizes).
    #[arg(long, default_value_t = 20000)]
    max_iters: u64,
    /// Also measure a mio node speaking TLS, against the plain mio node.
    #[arg(long)]
    tls: bool,
    /// Append the table, the command and the machine to this markdown file.
    #[arg(long)]
    results: Option<PathBuf>,
}

struct Row {
    what: String,
    size: u64,
    djinn: Stats,
    raw: Stats,
}

impl Row {
    fn line(&self) -> String {
        let gbps = |s: &Stats| self.size as f64 / (s.p50 * 1e3);
        format!(
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | {:.1} | {:.2} | **{:.2}** |",
            ByteSize(self.size),
            self.what,
            self.djinn.p50,
            self.djinn.p99,
            self.djinn.p999,
            gbps(&self.djinn),
            self.raw.p50,
            self.raw.p99,
            self.raw.p999,
            gbps(&self.raw),
            self.djinn.p50 / self.raw.p50,
        )
    }
}

const TLS_HEADER: &str = "| size | operation | plain p50 µs | TLS p50 µs | p50 ratio (TLS/plain) | plain p99 µs | TLS p99 µs | p99 ratio | TLS GB/s at p50 |\n|---|---|---|---|---|---|---|---|---|";

/// TLS's row against plain mio's for the same operation and size.
fn tls_line(plain: &Row, tls: &Row) -> String {
    format!(
        "| {} | {} | {:.1} | {:.1} | **{:.2}** | {:.1} | {:.1} | {:.2} | {:.2} |",
        ByteSize(plain.size),
        plain.what.trim_end_matches(" (mio)"),
        plain.djinn.p50,
        tls.djinn.p50,
        tls.djinn.p50 / plain.djinn.p50,
        plain.djinn.p99,
        tls.djinn.p99,
        tls.djinn.p99 / plain.djinn.p99,
        tls.size as f64 / (tls.djinn.p50 * 1e3),
    )
}

/// A node speaking TLS with a certificate made for the run, and a client trusting it.
fn tls_node(dir: &std::path::Path) -> Result<(Spawned, Client)> {
    let rcgen::CertifiedKey { cert, key_pair } = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()])?;
    let (cert_path, key_path) = (dir.join("node.pem"), dir.join("node.key"));
    std::fs::write(&cert_path, cert.pem())?;
    std::fs::write(&key_path, key_pair.serialize_pem())?;
    let (cert_arg, key_arg) = (cert_path.display().to_string(), key_path.display().to_string());
    let node = Spawned::start(&[
        "node",
        "--listen",
        "127.0.0.1:0",
        "--tcp-backend",
        "mio",
        "--log",
        "warn",
        "--tls-cert",
        &cert_arg,
        "--tls-key",
        &key_arg,
    ])?;
    let tls = ClientTls::trusting(cert.pem().as_bytes())?;
    let client = Client::connect_with(node.addr, ClientOptions { tls: Some(tls), ..ClientOptions::default() })?;
    Ok((node, client))
}

const HEADER: &str = "| size | operation | p50 µs | p99 µs | p999 µs | GB/s at p50 | raw p50 µs | raw p99 µs | raw p999 µs | raw GB/s | p50 ratio (djinn/raw) |\n|---|---|---|---|---|---|---|---|---|---|---|";

pub fn run(args: TcpArgs) -> Result<()> {
    let iters = |size: u64| (args.volume.0 / size.max(1)).clamp(args.min_iters, args.max_iters);
    let mut nodes = Vec::new();
    for backend in &args.backends {
        let node = Spawned::start(&["node", "--listen", "127.0.0.1:0", "--tcp-backend", backend, "--log", "warn"])?;
        let client = Client::connect_with(node.addr, ClientOptions::default())?;
        nodes.push((backend.clone(), node, client));
    }
    let certificates = tempfile::tempdir()?;
    if args.tls {
        let (node, client) = tls_node(certificates.path())?;
        nodes.push(("mio+tls".into(), node, client));
    }
    println!("{HEADER}");
    let mut rows = Vec::new();
    let mut emit = |row: Row| {
        println!("{}", row.line());
        rows.push(row);
    };

    // The 64-byte round trip against a 64-byte ping-pong.
    let n = iters(64);
    let pingpong = raw(64, 64, n)?;
    for (backend, _, client) in &mut nodes {
        client.put("bench-64", DType::U8, &[64], &[7u8; 64])?;
        let djinn = measure(n, || client.get("bench-64").map(drop).map_err(Into::into))?;
        emit(Row { what: format!("get vs 64 B ping-pong ({backend})"), size: 64, djinn, raw: pingpong });
    }

    for size in args.sizes.iter().map(|s| s.0) {
        let n = iters(size);
        let data = vec![5u8; size as usize];
        let name = format!("bench-{size}");
        let raw_put = raw(size as usize, 8, n)?;
        let raw_get = raw(8, size as usize, n)?;
        for (backend, _, client) in &mut nodes {
            let put = measure(n, || client.put(&name, DType::U8, &[size], &data).map(drop).map_err(Into::into))?;
            emit(Row { what: format!("put ({backend})"), size, djinn: put, raw: raw_put });
            let get = measure(n, || client.get(&name).map(drop).map_err(Into::into))?;
            emit(Row { what: format!("get ({backend})"), size, djinn: get, raw: raw_get });
            client.delete(&name)?;
        }
    }

    let mut table: Vec<String> = std::iter::once(HEADER.to_owned()).chain(rows.iter().map(Row::line)).collect();
    if args.tls {
        let with_tls = rows.iter().filter_map(|plain| {
            let what = plain.what.strip_suffix(" (mio)")?;
            let tls = rows.iter().find(|r| r.size == plain.size && r.what == format!("{what} (mio+tls)"))?;
            Some(tls_line(plain, tls))
        });
        let lines: Vec<String> = std::iter::once(TLS_HEADER.to_owned()).chain(with_tls).collect();
        println!("\nTLS against plain TCP (mio):\n{}", lines.join("\n"));
        table.push(String::new());
        table.extend(lines);
    }
    if let Some(path) = &args.results {
        append_section(path, "tcp", &[], &table.join("\n"))?;
    }
    Ok(())
}
