use djinn_node_core::HandleError;
use djinn_proto::ErrorCode;

/// Why a model could not be registered or run. Each maps to the error code the client sees.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("reading an archive: {0}")]
    Io(#[from] std::io::Error),
    #[error("archive rejected: {0}")]
    BadArchive(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    OverBudget(#[from] djinn_memory::OverBudget),
    #[error(
        "block {block} needs {len} bytes of device memory and only {available} are available: it cannot run even streamed"
    )]
    BlockTooLarge { block: usize, len: u64, available: u64 },
    #[error(transparent)]
    Cuda(#[from] djinn_gpudirect::DeviceError),
    #[error(transparent)]
    Handle(#[from] HandleError),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Breakpoint(#[from] BreakpointError),
    /// A session's move to another node failed there or on the way (the peer's code, or
    /// `PeerUnreachable`); the session stays here.
    #[error("{message}")]
    Moving { code: ErrorCode, message: String },
    /// The principal may not do this (TorchScript without the right).
    #[error("{0}")]
    Forbidden(String),
    /// A graph the node will not run (the check's or the dispatcher's reason).
    #[error("{0}")]
    Refused(String),
    /// A call's inputs do not fit the graph (count, dtype, or sizes outside export's ranges).
    #[error("{0}")]
    BadInput(String),
    /// An operator of a graph failed (its name and libtorch's message).
    #[error("{0}")]
    Execution(String),
    /// The run went past the node's limit on one execution (`--execute-deadline`) and was ended
    /// between two operators (or blocks); what it had computed is freed.
    #[error("the execution ran past the node's limit of {limit:?} and was ended")]
    DeadlineExceeded { limit: std::time::Duration },
    /// A step planned to take longer, at the node's rate, than what is left of the deadline:
    /// refused before it runs.
    #[error(
        "{op} is planned at {flops} operations, {seconds:.1} s at the node's rate: more than the {left:?} left of the node's limit of {limit:?} on one execution"
    )]
    WouldOverrun { op: String, flops: u64, seconds: f64, left: std::time::Duration, limit: std::time::Duration },
    /// The run's plan needs more memory at once than the node lets one run hold
    /// (`--max-run-memory`): refused before it runs.
    #[error(
        "the run's intermediates and outputs would hold {planned} bytes at once; the node lets one run hold {limit}"
    )]
    RunTooLarge { planned: u64, limit: u64 },
    /// The run's plan needs more memory than the tenant's quota has left: refused before it runs.
    #[error("the run's intermediates and outputs would hold {planned} bytes at once: {quota}")]
    RunOverQuota { planned: u64, quota: djinn_memory::OverBudget },
    /// An allocation refused as it happened (the node's CPU allocator): past the run's bound
    /// (`run_limit`, `--max-run-memory`) or over the tenant's memory quota.
    #[error("{}", allocation_refused(*asked, *held, *run_limit, *quota))]
    AllocationRefused { asked: u64, held: u64, run_limit: Option<u64>, quota: Option<u64> },
    /// The run costs more operations than the tenant's compute quota has left.
    #[error("{0}")]
    ComputeQuota(String),
    /// The tenant holds as many objects of a kind as a node allows one tenant.
    #[error("{0}")]
    TooMany(String),
    #[error("internal error: {0}")]
    Internal(String),
}

fn allocation_refused(asked: u64, held: u64, run_limit: Option<u64>, quota: Option<u64>) -> String {
    match (run_limit, quota) {
        (Some(limit), _) => format!(
            "an allocation of {asked} bytes was refused: the run had added {held} bytes, and the node lets one run \
             hold {limit}"
        ),
        (None, quota) => format!(
            "an allocation of {asked} bytes was refused: the job held {held} bytes, and the tenant's memory quota \
             ({}) has no room for more",
            quota.map_or_else(|| "none".to_owned(), |q| format!("{q} bytes"))
        ),
    }
}

impl ExecError {
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Torch(_) | Self::Unsupported(_) | Self::BadInput(_) | Self::Execution(_) => {
                ErrorCode::ExecutionFailed
            }
            Self::Refused(_) => ErrorCode::GraphRefused,
            Self::TooMany(_) | Self::ComputeQuota(_) | Self::RunOverQuota { .. } => ErrorCode::QuotaExceeded,
            Self::RunTooLarge { .. } => ErrorCode::OverBudget,
            Self::AllocationRefused { run_limit: Some(_), .. } => ErrorCode::OverBudget,
            Self::AllocationRefused { run_limit: None, .. } => ErrorCode::QuotaExceeded,
            Self::DeadlineExceeded { .. } | Self::WouldOverrun { .. } => ErrorCode::DeadlineExceeded,
            Self::Forbidden(_) => ErrorCode::Forbidden,
            Self::BadArchive(_) | Self::Io(_) => ErrorCode::BadArchive,
            Self::OverBudget(e) if e.tenant.is_some() => ErrorCode::QuotaExceeded,
            Self::OverBudget(_) | Self::BlockTooLarge { .. } => ErrorCode::OverBudget,
            Self::Handle(e) => e.code(),
            Self::Session(e) => e.code(),
            Self::Breakpoint(e) => e.code(),
            Self::Moving { code, .. } => *code,
            Self::Cuda(_) | Self::Internal(_) => ErrorCode::Internal,
        }
    }
}

/// Why a session's state could not be placed or replaced (whose each session is, and what
/// waits on it, is the node core's: `djinn_node_core::SessionError`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    #[error("no room for session state: {0}")]
    Full(String),
    #[error(
        "a step of a session with {state} state tensors must return a tuple of its outputs then its new state: {got}"
    )]
    BadStep { state: usize, got: String },
}

impl SessionError {
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Full(_) => ErrorCode::OverBudget,
            Self::BadStep { .. } => ErrorCode::ExecutionFailed,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BreakpointError {
    #[error("the replacement activation does not match the parked one: {0}")]
    Mismatch(String),
    #[error("cannot stop after block {block}: {why}")]
    BadBlock { block: u32, why: String },
}

impl BreakpointError {
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Mismatch(_) | Self::BadBlock { .. } => ErrorCode::BadBreakpoint,
        }
    }
}
