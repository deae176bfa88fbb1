//! `djinn bench tcp`: put and get through a node process against raw blocking sockets.
//!
//! Baselines, each between this process and a child process, unpinned, on loopback:
//! - put of S bytes against a raw one-way send of S bytes into a reused buffer, answered by an
//!   8-byte acknowledgement;
//! - get of S bytes against an 8-byte request answered by S bytes from a reused buffer;
//! - the 64-byte round trip against a raw 64-byte ping-pong.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use djinn_client::{Client, ClientOptions, DType};
use djinn_gpudirect::ByteSize;

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

const HEADER: &str = "| size | operation | p50 µs | p99 µs | p999 µs | GB/s at p50 | raw p50 µs | raw p99 µs | raw p999 µs | raw GB/s | p50 ratio (djinn/raw) |\n|---|---|---|---|---|---|---|---|---|---|---|";

pub fn run(args: TcpArgs) -> Result<()> {
    let iters = |size: u64| (args.volume.0 / size.max(1)).clamp(args.min_iters, args.max_iters);
    let mut nodes = Vec::new();
    for backend in &args.backends {
        let node = Spawned::start(&["node", "--listen", "127.0.0.1:0", "--tcp-backend", backend, "--log", "warn"])?;
        let client = Client::connect_with(node.addr, ClientOptions::default())?;
        nodes.push((backend.clone(), node, client));
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

    if let Some(path) = &args.results {
        let table: Vec<String> = std::iter::once(HEADER.to_owned()).chain(rows.iter().map(Row::line)).collect();
        append_section(path, "tcp", &[], &table.join("\n"))?;
    }
    Ok(())
}
