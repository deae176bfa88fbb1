//! `djinn executor`: one tenant's executor process, started by its node (`djinn node
//! --executor-processes`) with the link's region at descriptor 3; not for direct use.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use djinn_auth::{Authenticator, Quota};
use djinn_executor::{Device, ExecutorOptions, HandleSpace, Policy, Quotas, SessionOptions, TorchExecutor, tch};
use djinn_memory::{ByteSize, MemoryBudget};
use djinn_supervisor::{Launch, LinkSizes, Supervision, TenantExecutors};

/// What the node resolved from its own flags, for this tenant's process.
#[derive(Args, Debug, Clone)]
pub struct ExecutorArgs {
    #[arg(long, value_parser = djinn_executor::parse_device)]
    device: Device,
    #[arg(long)]
    workers: usize,
    #[arg(long)]
    intra_op_threads: usize,
    #[arg(long)]
    device_memory_budget: ByteSize,
    #[arg(long)]
    host_memory_budget: ByteSize,
    #[arg(long)]
    session_policy: Policy,
    #[arg(long)]
    session_budget: ByteSize,
    #[arg(long)]
    session_host_pool: ByteSize,
    /// Seconds; 0 for no limit.
    #[arg(long)]
    execute_deadline: f64,
    #[arg(long)]
    max_run_memory: Option<ByteSize>,
    #[arg(long)]
    flops: Option<f64>,
    /// The epoch of the handles this process makes.
    #[arg(long)]
    epoch: u64,
    /// The first id of its handles.
    #[arg(long)]
    first_id: u64,
    /// The tenant's quotas, as the token file writes them (JSON), when the node has one: its
    /// device and host memory, its compute and its part of the sessions' host pool hold in this
    /// process as they would in the node's (as they were when the process started).
    #[arg(long)]
    quota: Option<String>,
}

impl ExecutorArgs {
    /// The arguments that give a process these values (what the node passes).
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            "executor".to_owned(),
            format!("--device={}", device_arg(self.device)),
            format!("--workers={}", self.workers),
            format!("--intra-op-threads={}", self.intra_op_threads),
            format!("--device-memory-budget={}", self.device_memory_budget.0),
            format!("--host-memory-budget={}", self.host_memory_budget.0),
            format!("--session-policy={}", self.session_policy.name()),
            format!("--session-budget={}", self.session_budget.0),
            format!("--session-host-pool={}", self.session_host_pool.0),
            format!("--execute-deadline={}", self.execute_deadline),
            format!("--epoch={}", self.epoch),
            format!("--first-id={}", self.first_id),
        ];
        args.extend(self.max_run_memory.map(|b| format!("--max-run-memory={}", b.0)));
        args.extend(self.flops.map(|f| format!("--flops={f}")));
        args.extend(self.quota.as_ref().map(|q| format!("--quota={q}")));
        args
    }

    /// The values for a node's tenants' processes (each then gets its own `epoch` and
    /// `first_id`).
    pub fn of_node(options: &ExecutorOptions, device_budget: u64, host_budget: u64) -> Self {
        Self {
            device: options.device,
            workers: options.workers,
            intra_op_threads: options.intra_op_threads,
            device_memory_budget: ByteSize(device_budget),
            host_memory_budget: ByteSize(host_budget),
            session_policy: options.sessions.policy,
            session_budget: ByteSize(options.sessions.budget),
            session_host_pool: ByteSize(options.sessions.host_pool),
            execute_deadline: options.execute_deadline.map_or(0.0, |d| d.as_secs_f64()),
            max_run_memory: options.max_run_memory.map(ByteSize),
            flops: options.flops_per_second,
            epoch: 0,
            first_id: 0,
            quota: None,
        }
    }
}

/// One executor process per tenant, each `djinn executor` with the node's executor options,
/// its log filter and, with `auth`, the tenant's quotas, killed past `memory_limit` resident
/// (default: its budgets and [`LIBTORCH_MEMORY`]). The node keeps a copy of each model's
/// archives, charged to its tenant on `options.host_budget`.
pub fn tenant_processes(
    options: &ExecutorOptions,
    device_budget: u64,
    host_budget: u64,
    memory_limit: Option<u64>,
    auth: Option<Arc<Authenticator>>,
    log: &str,
) -> Result<TenantExecutors> {
    let exe = std::env::current_exe().context("cannot find the djinn binary to start executor processes")?;
    let template = ExecutorArgs::of_node(options, device_budget, host_budget);
    let log = log.to_owned();
    let launch: Launch = Box::new(move |tenant, epoch, first_id| {
        let quota = auth.as_ref().and_then(|auth| serde_json::to_string(&auth.quota(tenant)).ok());
        let mut command = std::process::Command::new(&exe);
        command.args(ExecutorArgs { epoch, first_id, quota, ..template.clone() }.to_args()).arg(format!("--log={log}"));
        command
    });
    let epoch = HandleSpace::fresh().epoch;
    // What the executor's own bounds let its tensors hold, and libtorch's own memory beside.
    let memory_limit = memory_limit.unwrap_or_else(|| {
        let tensors = if options.device == Device::Cpu { device_budget } else { 0 };
        tensors.saturating_add(host_budget).saturating_add(LIBTORCH_MEMORY)
    });
    let supervision = Supervision {
        ready_within: READY_WITHIN,
        run_deadline: options.execute_deadline,
        grace: Supervision::GRACE,
        memory_limit: Some(memory_limit),
    };
    TenantExecutors::new(launch, LinkSizes::default(), supervision, epoch, options.host_budget.clone())
        .context("cannot start the executor processes' router")
}

/// What an executor process holds resident beside its tensors: libtorch's code and data, its
/// threads' stacks and arenas, its allocator's cache (a CPU executor with a small model loaded holds about 400 MiB).
const LIBTORCH_MEMORY: u64 = 1 << 30;

/// How long a new executor process has to load libtorch (and initialise its device) before its
/// tenant's requests are answered `ExecutorLost`.
const READY_WITHIN: Duration = Duration::from_secs(120);

fn device_arg(device: Device) -> String {
    match device {
        Device::Cuda(n) => format!("cuda:{n}"),
        _ => "cpu".to_owned(),
    }
}

pub fn run(args: ExecutorArgs) -> Result<()> {
    if args.epoch == 0 {
        bail!("--epoch 0 names no executor's life");
    }
    // SAFETY: the node placed the link's region at this descriptor for this process to own,
    // and nothing else here uses it.
    let link = unsafe { djinn_shm::inherited(djinn_supervisor::LINK_FD) }
        .context("no link at descriptor 3: `djinn executor` is started by its node")?;
    tch::set_num_threads(args.intra_op_threads.max(1) as i32);
    let quota: Option<Quota> = match &args.quota {
        Some(json) => Some(serde_json::from_str(json).context("--quota")?),
        None => None,
    };
    // The one tenant's bounds on the node's budgets, as the node applies them.
    let bounded = |limit: u64, of: fn(&Quota) -> Option<u64>| match quota {
        Some(quota) => MemoryBudget::with_quotas(limit, Arc::new(move |_| of(&quota))),
        None => MemoryBudget::new(limit),
    };
    let options = ExecutorOptions {
        device: args.device,
        workers: args.workers,
        intra_op_threads: args.intra_op_threads,
        host_budget: bounded(args.host_memory_budget.0, |q| q.host_memory),
        sessions: SessionOptions {
            policy: args.session_policy,
            budget: args.session_budget.0,
            host_pool: args.session_host_pool.0,
        },
        execute_deadline: (args.execute_deadline > 0.0).then(|| Duration::from_secs_f64(args.execute_deadline)),
        max_run_memory: args.max_run_memory.map(|b| b.0),
        flops_per_second: args.flops,
        quotas: quota.map(Quotas::OneTenant),
        handles: HandleSpace { epoch: args.epoch, first_id: args.first_id },
    };
    let executor = TorchExecutor::new(bounded(args.device_memory_budget.0, |q| q.device_memory), options)
        .context("cannot start the executor")?;
    // Once the device is initialised (CUDA needs calls the filter refuses), before any job.
    if let Err(e) = djinn_supervisor::sandbox::restrict_syscalls() {
        tracing::warn!(error = %e, "cannot install this executor's system-call filter");
    }
    djinn_supervisor::serve(link, executor).context("the link to the node broke")
}
