//! `djinn node` (and `djinn up`): the data plane's poller in front of the executor.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use djinn_auth::Authenticator;
use djinn_dataplane::client::Transport;
use djinn_dataplane::rdma::{RdmaChannel, RdmaContext};
use djinn_dataplane::tcp::{Backend, Server, ServerConfig};
use djinn_executor::{Device, ExecutorOptions, HandleSpace, Policy, Quotas, SessionOptions, TorchExecutor};
use djinn_node_core::{CoreOptions, Executor, NodeCore, tenant_budget};
use djinn_proto::Limits;
use djinn_proto::rdma::SessionConfig;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use djinn_executor::tch;
use djinn_memory::ByteSize;

use crate::auth::AuthArgs;
use djinn_node::mover::{ListNodes, Mover, PeerLimits, PushPeers};
use djinn_node::own_node::OwnNode;
use djinn_node::{membership, rates};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum TcpBackend {
    /// epoll through mio (the default: measured faster on this kind of machine, see bench/RESULTS.md).
    Mio,
    /// io_uring.
    Uring,
}

#[derive(Args, Debug)]
pub struct NodeArgs {
    /// The log filter it was started with (`--log`), passed on to its executor processes.
    #[arg(skip)]
    pub log: String,
    /// Address to listen on, HOST:PORT (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: String,
    /// Memory the node may hold for tensors (and later weights, the ring buffer, sessions),
    /// per device; on a host without CUDA, host memory. Default: half of physical memory.
    #[arg(long)]
    device_memory_budget: Option<ByteSize>,
    /// Host memory the node may hold for model archives being registered and for the weights
    /// of blocks streamed through the ring. Default: half of physical memory.
    #[arg(long)]
    host_memory_budget: Option<ByteSize>,
    /// Host memory one tenant's registrations in progress and requests' inputs may hold at
    /// once, where its quota names no `host_memory`. Default: half of the host memory budget.
    #[arg(long)]
    tenant_host_memory: Option<ByteSize>,
    /// Serve TLS on every TCP connection with this certificate chain (PEM); needs --tls-key and
    /// the mio backend. Frames a client moves to RDMA are not covered.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Speak TLS to the nodes this one pushes tensors to, trusting these roots (PEM).
    #[arg(long)]
    peer_tls_roots: Option<PathBuf>,
    /// Seconds a registration may go without a chunk before it is dropped with what it holds.
    #[arg(long, default_value_t = 60.0)]
    upload_timeout: f64,
    /// Largest payload of one frame; larger frames are refused before anything is allocated.
    #[arg(long, default_value = "16GiB")]
    max_payload: ByteSize,
    /// Largest metadata section of one frame.
    #[arg(long, default_value = "1MiB")]
    max_meta: ByteSize,
    /// Free receive buffers kept for reuse (fresh pages cost five times reused ones).
    #[arg(long, default_value = "1GiB")]
    buffer_pool: ByteSize,
    /// Unsent reply bytes per connection before the node stops reading from it.
    #[arg(long, default_value = "64MiB")]
    max_queued: ByteSize,
    /// Unsent reply bytes over all connections before the node stops reading from any of them.
    #[arg(long, default_value = "1GiB")]
    max_queued_total: ByteSize,
    /// Microseconds the poller keeps polling after its last work before it blocks.
    #[arg(long, default_value_t = 50)]
    spin_us: u64,
    /// TCP backend of the poller.
    #[arg(long, value_enum, default_value = "mio")]
    tcp_backend: TcpBackend,
    /// Where models run: `auto` (the first GPU if CUDA is present, else the CPU), `cpu` or
    /// `cuda:N`.
    #[arg(long, default_value = "auto", value_parser = djinn_executor::parse_device)]
    device: Device,
    /// Executor worker threads (models run on these, never on the poller).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Run each tenant's models in an executor process of its own (`djinn executor`, started
    /// by the tenant's first request and again after it ends), so that a crash in one
    /// tenant's kernels costs only that tenant. Each process has --workers workers and the
    /// whole device budget (one budget over them all is still to come); a new one loads the
    /// tenant's models again from archives the node keeps.
    #[arg(long)]
    executor_processes: bool,
    /// The most memory one executor process may hold resident before the node kills it (its
    /// requests answered ExecutorLost). Default: the device budget on a CPU node, the host
    /// budget, and 1 GiB for libtorch itself.
    #[arg(long, requires = "executor_processes")]
    executor_memory_limit: Option<ByteSize>,
    /// libtorch's threads inside one operation, per worker.
    #[arg(long, default_value_t = 1)]
    intra_op_threads: i32,
    /// Transports offered: `auto` (RDMA too when this host has an active RDMA port), `rdma`
    /// (fail without one) or `tcp`.
    #[arg(long, default_value = "auto")]
    transport: Transport,
    /// The RDMA device to use (the first active one by default).
    #[arg(long)]
    rdma_device: Option<String>,
    /// The control plane to join, http://HOST:PORT: the node registers its inventory and
    /// renews its lease there. Several control processes that share an etcd, separated by
    /// commas: the node goes on to the next when one fails, and its lease lives on.
    #[arg(long)]
    pub control: Option<String>,
    /// The node's name in the cluster. Default: HOSTNAME-PORT.
    #[arg(long)]
    name: Option<String>,
    /// The address clients are told to reach this node at. Default: the bound address.
    #[arg(long)]
    advertise: Option<String>,
    /// FLOP/s reported to the control plane, and the rate a step planned past what is left of
    /// --execute-deadline is weighed at. Default: measured at start (a float matrix product).
    #[arg(long)]
    flops: Option<f64>,
    /// Device-memory bytes read per second, reported to the control plane (what a decode step
    /// runs at). Default: measured at start (a copy within the device).
    #[arg(long)]
    memory_bandwidth: Option<f64>,
    /// Host-to-device bytes per second reported to the control plane. Default: measured at start.
    #[arg(long)]
    host_to_device: Option<f64>,
    /// Bytes per second between clients and this node, reported to the control plane.
    #[arg(long, default_value_t = 12.5e9)]
    link_bandwidth: f64,
    /// Serve Prometheus /metrics on this address, HOST:PORT.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Seconds a tensor kept on the node (a model's output kept for the next call, an uploaded
    /// or pushed tensor) may lie unused before it is freed.
    #[arg(long, default_value_t = 600.0)]
    handle_ttl: f64,
    /// Nodes this node may push tensors to, HOST:PORT, comma-separated (as tenants name
    /// them), besides the live nodes of its --control. Pushes go nowhere else.
    #[arg(long, value_delimiter = ',')]
    push_peers: Vec<String>,
    /// Connections to peer nodes each tenant's pushes keep open (the least recently used goes
    /// first), and seconds an unused one stays open.
    #[arg(long, default_value_t = 16)]
    push_connections: usize,
    #[arg(long, default_value_t = 60.0)]
    push_connection_idle: f64,
    /// Seconds a push to another node may wait on it before failing.
    #[arg(long, default_value_t = 30.0)]
    push_timeout: f64,
    /// Seconds a connection may sit in the middle of a frame, or with replies it does not
    /// read, moving less than 64 KiB, before it is closed (slow or stuck clients).
    #[arg(long, default_value_t = 10.0)]
    stall_timeout: f64,
    /// Seconds a connection may stay open without a good hello, where clients need tokens.
    #[arg(long, default_value_t = 5.0)]
    hello_timeout: f64,
    /// Seconds a connection with nothing under way may go without a frame before it is
    /// closed (clients reconnect by themselves).
    #[arg(long, default_value_t = 600.0)]
    idle_timeout: f64,
    /// Connections at once. Each holds a file descriptor: the open-files limit is raised to
    /// fit, or this is lowered to what the hard limit allows (with a warning).
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// Connections without a good hello yet (where clients need tokens), in all.
    #[arg(long, default_value_t = 256)]
    max_unauthenticated: usize,
    /// Connections without a good hello yet from one source address.
    #[arg(long, default_value_t = 32)]
    max_unauthenticated_per_source: usize,
    /// Which session's state leaves the device when another needs room: `semantic` (sessions
    /// whose agent said IO_WAIT first, swapped out at the signal and restored ahead of the
    /// expected resume; then the least recently used) or `lru` (recency only, on pressure).
    #[arg(long, default_value = "semantic")]
    session_policy: Policy,
    /// Device memory that session state (KV caches) may take, within the device budget.
    /// Default: a quarter of the device budget.
    #[arg(long)]
    session_budget: Option<ByteSize>,
    /// Host memory that swapped-out session state may take. Default: a quarter of the host
    /// budget.
    #[arg(long)]
    session_host_pool: Option<ByteSize>,
    /// Seconds a session may lie untouched before it is closed and its state freed (its client
    /// is presumed gone).
    #[arg(long, default_value_t = 600.0)]
    session_idle_timeout: f64,
    /// Seconds a request paused at a breakpoint may wait to be resumed before it is released
    /// (its activation freed; a session's step ends with the state it had before).
    #[arg(long, default_value_t = 300.0)]
    parked_ttl: f64,
    /// Seconds one execution (an execute, a session step, a resume) may run before it is ended
    /// between two operators with a DeadlineExceeded error and its memory freed; 0 for no limit.
    #[arg(long, default_value_t = 300.0)]
    execute_deadline: f64,
    /// The most memory one graph run may hold at once (its intermediates and outputs, as its
    /// plan on the meta device counts them before it runs); a run planned over it is refused.
    /// Default: the device-memory budget.
    #[arg(long)]
    max_run_memory: Option<ByteSize>,
    /// The price of an hour of this node (any currency the cluster agrees on), for minimize_cost.
    #[arg(long, default_value_t = 1.0)]
    cost_per_hour: f64,
    #[command(flatten)]
    pub auth: AuthArgs,
}

/// Completion queue entries of the node's RDMA context (shared by every RDMA connection).
const RDMA_CQE: u32 = 8192;

/// The RDMA context to offer, after `--transport` and what the host has.
fn rdma_context(args: &NodeArgs) -> Result<Option<Arc<RdmaContext>>> {
    if args.transport == Transport::Tcp {
        return Ok(None);
    }
    let port = match djinn_dataplane::rdma::find_port(args.rdma_device.as_deref()) {
        Ok(port) => port,
        Err(e) if args.transport == Transport::Auto => {
            tracing::info!("{e}: the data plane speaks TCP");
            return Ok(None);
        }
        Err(e) => bail!("--transport rdma: {e}"),
    };
    if matches!(args.tcp_backend, TcpBackend::Uring) {
        if args.transport == Transport::Rdma {
            bail!("--transport rdma needs --tcp-backend mio");
        }
        tracing::info!(%port, "RDMA is offered with the mio backend only: the data plane speaks TCP");
        return Ok(None);
    }
    let ctx = RdmaContext::new(&port, RDMA_CQE).with_context(|| format!("cannot use RDMA port {port}"))?;
    tracing::info!(%port, "offering RDMA");
    Ok(Some(ctx))
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it or fails.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let name = if ok { std::ffi::CStr::from_bytes_until_nul(&buf).ok().and_then(|c| c.to_str().ok()) } else { None };
    name.filter(|n| !n.is_empty()).unwrap_or("node").to_owned()
}

/// Lists the live nodes of the control plane at `control`, as this node (its token).
fn live_nodes(control: &str, token: &str) -> ListNodes {
    let control = djinn_client::ControlClient::new(control, Duration::from_secs(5)).with_token(token);
    Box::new(move || control.live_nodes().map_err(|e| e.to_string()))
}

/// Descriptors a node needs besides its connections: the listener, the poller, RDMA devices
/// and their completion channels, files, the control plane's connection.
const SPARE_DESCRIPTORS: u64 = 256;

/// Raises the open-files limit to what `max_connections` needs; where the hard limit does not
/// allow that, the connections it does allow (with a warning).
fn fit_open_files(max_connections: usize) -> Result<usize> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a valid rlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        bail!("getrlimit(RLIMIT_NOFILE): {}", std::io::Error::last_os_error());
    }
    let want = max_connections as u64 + SPARE_DESCRIPTORS;
    if limit.rlim_cur < want {
        let raised = libc::rlimit { rlim_cur: want.min(limit.rlim_max), rlim_max: limit.rlim_max };
        // SAFETY: a valid rlimit, within the hard limit.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            bail!("setrlimit(RLIMIT_NOFILE, {}): {}", raised.rlim_cur, std::io::Error::last_os_error());
        }
        limit = raised;
    }
    let fits = limit.rlim_cur.saturating_sub(SPARE_DESCRIPTORS) as usize;
    if fits < max_connections {
        tracing::warn!(
            max_connections,
            open_files = limit.rlim_cur,
            "the open-files hard limit allows fewer connections: --max-connections lowered to {fits}"
        );
        return Ok(fits.max(1));
    }
    Ok(max_connections)
}

fn physical_memory() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    (pages.max(0) as u64).saturating_mul(page.max(0) as u64)
}

/// Serves until SIGINT or SIGTERM; with `auth` (the principals of `--auth-file` or `--auth-etcd`),
/// only for them.
pub fn run(args: NodeArgs, auth: Option<Arc<Authenticator>>) -> Result<()> {
    args.auth.principals.check_exposure(&args.listen, auth.is_some())?;
    let max_connections = fit_open_files(args.max_connections)?;
    let max_meta = u32::try_from(args.max_meta.0).context("--max-meta must be under 4 GiB")?;
    let limits = Limits { max_meta, max_payload: args.max_payload.0, ..Limits::default() };
    let device_limit = args.device_memory_budget.map_or(physical_memory() / 2, |b| b.0);
    let budget = tenant_budget(device_limit, auth.as_ref(), |q| q.device_memory);
    let torch = djinn_executor::libtorch::check()?;
    tracing::info!("{torch}");
    match djinn_gpudirect::cuda_devices() {
        Ok(devices) if devices.is_empty() => tracing::info!("no CUDA driver: device memory is host memory"),
        Ok(devices) => {
            for d in devices {
                tracing::info!(ordinal = d.ordinal, name = %d.name, memory = %ByteSize(d.total_memory), pci = %d.pci_bus_id, numa_node = ?d.numa_node, "CUDA device");
            }
        }
        Err(e) => tracing::warn!(error = %e, "CUDA driver present but unusable: device memory is host memory"),
    }
    let device = args.device;
    if let Device::Cuda(n) = device
        && !(tch::Cuda::is_available() && (n as i64) < tch::Cuda::device_count())
    {
        bail!("--device cuda:{n}: libtorch sees {} CUDA devices", tch::Cuda::device_count());
    }
    let rdma = rdma_context(&args)?;
    let transports = if rdma.is_some() { vec!["rdma".to_owned(), "tcp".to_owned()] } else { vec!["tcp".to_owned()] };
    tch::set_num_threads(args.intra_op_threads.max(1));
    let host_limit = args.host_memory_budget.map_or(physical_memory() / 2, |b| b.0);
    let share = args.tenant_host_memory.map_or(host_limit / 2, |b| b.0);
    let host_budget = tenant_budget(host_limit, auth.as_ref(), move |q| Some(q.host_memory.unwrap_or(share)));
    let token = args.auth.token()?;
    let peer_tls = match &args.peer_tls_roots {
        Some(path) => {
            let roots = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
            Some(djinn_dataplane::tcp::ClientTls::trusting(&roots).context("--peer-tls-roots")?)
        }
        None => None,
    };
    // The device's rate, for the control plane's cost model and the executor's deadline checks.
    let flops = args.flops.unwrap_or_else(|| rates::measure_flops(device));
    let peers: Arc<dyn djinn_node_core::Peers> = Arc::new(Mover::new(
        seconds("--push-timeout", args.push_timeout)?,
        rdma.as_ref().map(|ctx| ctx.port().clone()),
        Arc::new(PushPeers::new(args.push_peers.clone(), args.control.as_deref().map(|c| live_nodes(c, &token)))),
        PeerLimits {
            max: args.push_connections.max(1),
            idle: seconds("--push-connection-idle", args.push_connection_idle)?,
        },
        peer_tls.clone(),
    ));
    let options = ExecutorOptions {
        device,
        workers: args.workers,
        intra_op_threads: args.intra_op_threads.max(1) as usize,
        host_budget: host_budget.clone(),
        sessions: SessionOptions {
            policy: args.session_policy,
            budget: args.session_budget.map_or(budget.limit() / 4, |b| b.0),
            host_pool: args.session_host_pool.map_or(host_limit / 4, |b| b.0),
        },
        execute_deadline: match args.execute_deadline {
            0.0 => None,
            limit => Some(seconds("--execute-deadline", limit)?),
        },
        max_run_memory: args.max_run_memory.map(|b| b.0),
        flops_per_second: Some(flops),
        quotas: auth.clone().map(Quotas::Principals),
        handles: HandleSpace::fresh(),
    };
    let executor: Box<dyn Executor + Send> = if args.executor_processes {
        Box::new(crate::executor::tenant_processes(
            &options,
            device_limit,
            host_limit,
            args.executor_memory_limit.map(|b| b.0),
            auth.clone(),
            &args.log,
        )?)
    } else {
        Box::new(TorchExecutor::new(budget.clone(), options).context("cannot start the executor")?)
    };
    let core = CoreOptions {
        pool_bytes: args.buffer_pool.0,
        max_meta,
        host_budget,
        upload_timeout: seconds("--upload-timeout", args.upload_timeout)?,
        keep_in_place: device == Device::Cpu,
        auth: auth.clone(),
        peers,
        handle_ttl: seconds("--handle-ttl", args.handle_ttl)?,
        parked_ttl: seconds("--parked-ttl", args.parked_ttl)?,
        session_idle_ttl: seconds("--session-idle-timeout", args.session_idle_timeout)?,
    };
    let service = NodeCore::new(budget.clone(), core, executor);
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            let read = |path: &PathBuf| std::fs::read(path).with_context(|| format!("cannot read {}", path.display()));
            Some(djinn_dataplane::tcp::tls_server_config(&read(cert)?, &read(key)?).context("--tls-cert, --tls-key")?)
        }
        _ => None,
    };
    let backend = match args.tcp_backend {
        TcpBackend::Mio => Backend::Mio { rdma, tls },
        TcpBackend::Uring if tls.is_some() => {
            bail!("--tls-cert needs --tcp-backend mio: the io_uring backend does not speak TLS")
        }
        // rdma_context() offers none with io_uring.
        TcpBackend::Uring => Backend::Uring,
    };
    let config = ServerConfig {
        limits,
        spin: Duration::from_micros(args.spin_us),
        max_queued_bytes: args.max_queued.0,
        max_queued_total: args.max_queued_total.0,
        backend,
        rdma_connections: (RDMA_CQE / RdmaChannel::completion_entries(&SessionConfig::default())) as usize,
        auth,
        stall_timeout: seconds("--stall-timeout", args.stall_timeout)?,
        hello_timeout: seconds("--hello-timeout", args.hello_timeout)?,
        idle_timeout: seconds("--idle-timeout", args.idle_timeout)?,
        max_connections,
        max_unauthenticated: args.max_unauthenticated,
        max_unauthenticated_per_source: args.max_unauthenticated_per_source,
        ..ServerConfig::default()
    };
    let agent = concat!("djinn-node/", env!("CARGO_PKG_VERSION"));
    let server = Server::bind(&args.listen, config, service, agent)
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = server.local_addr();
    let own = OwnNode::new(server.local_node());
    if let Some(listen) = &args.metrics_listen {
        let metrics = djinn_node::metrics::serve(listen, own.clone())?;
        tracing::info!(%metrics, "serving /metrics");
    }
    let agent = match &args.control {
        Some(control) => {
            let me = membership::Static {
                name: args.name.clone().unwrap_or_else(|| format!("{}-{}", hostname(), addr.port())),
                addr: args.advertise.clone().unwrap_or_else(|| addr.to_string()),
                device: djinn_executor::device_name(device),
                transports,
                flops,
                memory_bandwidth: args.memory_bandwidth.unwrap_or_else(|| rates::measure_memory_bandwidth(device)),
                host_to_device: args.host_to_device.unwrap_or_else(|| rates::measure_host_to_device(device)),
                link_bandwidth: args.link_bandwidth,
                cost_per_hour: args.cost_per_hour,
            };
            if addr.ip().is_unspecified() && args.advertise.is_none() {
                tracing::warn!(%addr, "listening on every interface: give --advertise HOST:PORT so clients can reach the node");
            }
            Some(membership::Agent::start(control, &token, me, own, peer_tls)?)
        }
        None => None,
    };
    let shutdown = server.shutdown_handle();
    let mut signals = Signals::new([SIGINT, SIGTERM]).context("cannot install signal handlers")?;
    std::thread::Builder::new().name("djinn-signals".into()).spawn(move || {
        if let Some(signal) = signals.forever().next() {
            tracing::info!(signal, "shutting down");
            shutdown.shutdown();
        }
    })?;
    // The first line of stdout is the bound address: scripts and tests read it (no port races).
    println!("djinn node listening on {addr}");
    std::io::stdout().flush()?;
    let tls = args.tls_cert.is_some();
    tracing::info!(%addr, backend = ?args.tcp_backend, tls, ?device, budget = %ByteSize(budget.limit()), "node serving");
    let counters = server.run().context("poller failed");
    if let Some(agent) = agent {
        agent.stop();
    }
    let counters = counters?;
    tracing::info!(?counters, budget_used = budget.used(), "node stopped");
    Ok(())
}

fn seconds(flag: &str, value: f64) -> Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("{flag} {value}: not a positive number of seconds"))
}
