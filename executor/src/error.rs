use djinn_dataplane::proto::ErrorCode;

/// Why a model could not be registered or run. Each maps to the error code the client sees.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
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
    #[error("internal error: {0}")]
    Internal(String),
}

impl ExecError {
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Torch(_) | Self::Unsupported(_) => ErrorCode::ExecutionFailed,
            Self::BadArchive(_) => ErrorCode::BadArchive,
            Self::OverBudget(e) if e.tenant.is_some() => ErrorCode::QuotaExceeded,
            Self::OverBudget(_) | Self::BlockTooLarge { .. } => ErrorCode::OverBudget,
            Self::Handle(e) => e.code(),
            Self::Session(e) => e.code(),
            Self::Breakpoint(e) => e.code(),
            Self::Cuda(_) | Self::Internal(_) => ErrorCode::Internal,
        }
    }
}
