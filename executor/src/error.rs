use djinn_dataplane::proto::ErrorCode;

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
    OverBudget(#[from] djinn_gpudirect::OverBudget),
    #[error(
        "block {block} needs {len} bytes of device memory and only {available} are available: it cannot run even streamed"
    )]
    BlockTooLarge { block: usize, len: u64, available: u64 },
    #[error(transparent)]
    Cuda(#[from] djinn_gpudirect::DeviceError),
    #[error(transparent)]
    Handle(#[from] crate::handles::HandleError),
    #[error(transparent)]
    Session(#[from] crate::sessions::SessionError),
    #[error(transparent)]
    Breakpoint(#[from] crate::parked::BreakpointError),
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
    /// The run's plan needs more memory at once than the node lets one run hold
    /// (`--max-run-memory`): refused before it runs.
    #[error(
        "the run's intermediates and outputs would hold {planned} bytes at once; the node lets one run hold {limit}"
    )]
    RunTooLarge { planned: u64, limit: u64 },
    /// The run's plan needs more memory than the tenant's quota has left: refused before it runs.
    #[error("the run's intermediates and outputs would hold {planned} bytes at once: {quota}")]
    RunOverQuota { planned: u64, quota: djinn_gpudirect::OverBudget },
    /// The run costs more operations than the tenant's compute quota has left.
    #[error("{0}")]
    ComputeQuota(String),
    /// The tenant holds as many objects of a kind as a node allows one tenant.
    #[error("{0}")]
    TooMany(String),
    #[error("internal error: {0}")]
    Internal(String),
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
            Self::DeadlineExceeded { .. } => ErrorCode::DeadlineExceeded,
            Self::Forbidden(_) => ErrorCode::Forbidden,
            Self::BadArchive(_) | Self::Io(_) => ErrorCode::BadArchive,
            Self::OverBudget(e) if e.tenant.is_some() => ErrorCode::QuotaExceeded,
            Self::OverBudget(_) | Self::BlockTooLarge { .. } => ErrorCode::OverBudget,
            Self::Handle(e) => e.code(),
            Self::Session(e) => e.code(),
            Self::Breakpoint(e) => e.code(),
            Self::Cuda(_) | Self::Internal(_) => ErrorCode::Internal,
        }
    }
}
