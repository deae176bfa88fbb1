//! Typed protocol errors and the codes that carry them over the wire.

/// The code of an `Error` frame. Stable on the wire; new codes may be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorCode {
    BadMagic,
    VersionMismatch,
    BadFlags,
    FrameTooLarge,
    MetaTooLarge,
    Truncated,
    UnknownKind,
    MalformedMeta,
    BadDescriptor,
    PayloadMismatch,
    NotFound,
    OverBudget,
    Unexpected,
    OutOfMemory,
    Internal,
    UnknownModel,
    BadArchive,
    ExecutionFailed,
    Busy,
    /// A handle from an earlier life of the node (its epoch is not the node's).
    StaleHandle,
    /// The node could not reach the peer it was asked to push to.
    PeerUnreachable,
    /// A breakpoint outside the run, or a replacement activation unlike the parked one.
    BadBreakpoint,
    /// No valid token: the hello presented none, or one the node does not know.
    Unauthenticated,
    /// The token is valid but does not allow this.
    Forbidden,
    /// The tenant's quota (memory, concurrent requests, request rate) does not allow this now.
    QuotaExceeded,
    /// A graph the node will not run: an operator off its allowlist, a write to a weight, ...
    GraphRefused,
    /// The request ran past the node's limit on one execution, and was ended.
    DeadlineExceeded,
    /// The executor process that held the request (and what the tenant kept on its device)
    /// ended before it answered: killed, crashed, or out of memory. The message says why.
    ExecutorLost,
    /// A code this build does not know (sent by a newer peer).
    Other(u16),
}

impl ErrorCode {
    pub fn to_wire(self) -> u16 {
        match self {
            Self::BadMagic => 1,
            Self::VersionMismatch => 2,
            Self::BadFlags => 3,
            Self::FrameTooLarge => 4,
            Self::MetaTooLarge => 5,
            Self::Truncated => 6,
            Self::UnknownKind => 7,
            Self::MalformedMeta => 8,
            Self::BadDescriptor => 9,
            Self::PayloadMismatch => 10,
            Self::NotFound => 11,
            Self::OverBudget => 12,
            Self::Unexpected => 13,
            Self::OutOfMemory => 14,
            Self::Internal => 15,
            Self::UnknownModel => 16,
            Self::BadArchive => 17,
            Self::ExecutionFailed => 18,
            Self::Busy => 19,
            Self::StaleHandle => 20,
            Self::PeerUnreachable => 21,
            Self::BadBreakpoint => 22,
            Self::Unauthenticated => 23,
            Self::Forbidden => 24,
            Self::QuotaExceeded => 25,
            Self::GraphRefused => 26,
            Self::DeadlineExceeded => 27,
            Self::ExecutorLost => 28,
            Self::Other(code) => code,
        }
    }

    pub fn from_wire(code: u16) -> Self {
        match code {
            1 => Self::BadMagic,
            2 => Self::VersionMismatch,
            3 => Self::BadFlags,
            4 => Self::FrameTooLarge,
            5 => Self::MetaTooLarge,
            6 => Self::Truncated,
            7 => Self::UnknownKind,
            8 => Self::MalformedMeta,
            9 => Self::BadDescriptor,
            10 => Self::PayloadMismatch,
            11 => Self::NotFound,
            12 => Self::OverBudget,
            13 => Self::Unexpected,
            14 => Self::OutOfMemory,
            15 => Self::Internal,
            16 => Self::UnknownModel,
            17 => Self::BadArchive,
            18 => Self::ExecutionFailed,
            19 => Self::Busy,
            20 => Self::StaleHandle,
            21 => Self::PeerUnreachable,
            22 => Self::BadBreakpoint,
            23 => Self::Unauthenticated,
            24 => Self::Forbidden,
            25 => Self::QuotaExceeded,
            26 => Self::GraphRefused,
            27 => Self::DeadlineExceeded,
            28 => Self::ExecutorLost,
            other => Self::Other(other),
        }
    }
}

/// What went wrong with a frame. `is_fatal` errors leave the byte stream unusable: the peer is
/// told and the connection closed. The others reject one request and the connection goes on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    #[error("bad magic {found:02x?}: not a Djinn frame")]
    BadMagic { found: [u8; 4] },
    #[error("protocol version mismatch: peer speaks version {theirs}, this side speaks version {ours}")]
    VersionMismatch { ours: u16, theirs: u16 },
    #[error("unknown header flags {flags:#x}")]
    BadFlags { flags: u32 },
    #[error("payload of {len} bytes is over the limit of {limit} bytes")]
    FrameTooLarge { len: u64, limit: u64 },
    #[error("metadata of {len} bytes is over the limit of {limit} bytes")]
    MetaTooLarge { len: u64, limit: u64 },
    #[error("connection closed in the middle of a frame ({received} of {expected} bytes of its {part})")]
    Truncated { part: &'static str, received: u64, expected: u64 },
    #[error("unknown message kind {kind:#06x}")]
    UnknownKind { kind: u16 },
    #[error("malformed metadata: {0}")]
    MalformedMeta(String),
    #[error("bad tensor descriptor: {0}")]
    BadDescriptor(String),
    #[error("header announces a payload of {announced} bytes but its tensors take {expected}")]
    PayloadMismatch { announced: u64, expected: u64 },
    #[error("unexpected {kind} frame here")]
    Unexpected { kind: &'static str },
}

impl ProtocolError {
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::BadMagic { .. } => ErrorCode::BadMagic,
            Self::VersionMismatch { .. } => ErrorCode::VersionMismatch,
            Self::BadFlags { .. } => ErrorCode::BadFlags,
            Self::FrameTooLarge { .. } => ErrorCode::FrameTooLarge,
            Self::MetaTooLarge { .. } => ErrorCode::MetaTooLarge,
            Self::Truncated { .. } => ErrorCode::Truncated,
            Self::UnknownKind { .. } => ErrorCode::UnknownKind,
            Self::MalformedMeta(_) => ErrorCode::MalformedMeta,
            Self::BadDescriptor(_) => ErrorCode::BadDescriptor,
            Self::PayloadMismatch { .. } => ErrorCode::PayloadMismatch,
            Self::Unexpected { .. } => ErrorCode::Unexpected,
        }
    }

    /// True when the stream can no longer be framed after this error.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Self::BadMagic { .. }
                | Self::VersionMismatch { .. }
                | Self::BadFlags { .. }
                | Self::FrameTooLarge { .. }
                | Self::MetaTooLarge { .. }
                | Self::Truncated { .. }
        )
    }
}
