//! The fixed frame header: 32 bytes, little-endian, defined with zerocopy so that parsing it is a
//! bounds check and a cast.
//!
//! ```text
//! 0      4        6     8      12           20         24            32
//! | magic | version | kind | flags | request id | meta len | payload len |
//! ```
//! A frame is the header, `meta_len` bytes of metadata (the message's fields), then
//! `payload_len` bytes of tensor data laid out by [`crate::payload_layout`].

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::error::ProtocolError;
use super::limits::Limits;

pub const MAGIC: [u8; 4] = *b"DJNN";
/// 2: tensors kept on the node (handles, keep, fetch, release, push); 3: sessions; 4:
/// breakpoints.
pub const PROTOCOL_VERSION: u16 = 7;
pub const HEADER_LEN: usize = size_of::<FrameHeader>();

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
pub struct FrameHeader {
    pub magic: [u8; 4],
    pub version: U16,
    pub kind: U16,
    /// No flags are defined in version 1; any bit set is an error, so a later version can give
    /// them meaning without being misread.
    pub flags: U32,
    pub request_id: U64,
    pub meta_len: U32,
    pub payload_len: U64,
}

const _: () = assert!(HEADER_LEN == 32);

impl FrameHeader {
    pub fn new(kind: Kind, request_id: u64, meta_len: u32, payload_len: u64) -> Self {
        Self {
            magic: MAGIC,
            version: PROTOCOL_VERSION.into(),
            kind: kind.to_wire().into(),
            flags: 0.into(),
            request_id: request_id.into(),
            meta_len: meta_len.into(),
            payload_len: payload_len.into(),
        }
    }

    /// Parses the first [`HEADER_LEN`] bytes of `bytes`, which must hold at least that many.
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        Self::read_from_prefix(bytes).ok().map(|(header, _)| header)
    }

    /// Checks everything that would make the rest of the stream unreadable. The kind is not
    /// checked here: a frame of unknown kind can still be skipped.
    pub fn validate(&self, limits: &Limits) -> Result<(), ProtocolError> {
        if self.magic != MAGIC {
            return Err(ProtocolError::BadMagic { found: self.magic });
        }
        if self.version.get() != PROTOCOL_VERSION {
            return Err(ProtocolError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: self.version.get() });
        }
        if self.flags.get() != 0 {
            return Err(ProtocolError::BadFlags { flags: self.flags.get() });
        }
        if self.meta_len.get() > limits.max_meta {
            return Err(ProtocolError::MetaTooLarge { len: self.meta_len.get().into(), limit: limits.max_meta.into() });
        }
        if self.payload_len.get() > limits.max_payload {
            return Err(ProtocolError::FrameTooLarge { len: self.payload_len.get(), limit: limits.max_payload });
        }
        Ok(())
    }
}

macro_rules! kinds {
    ($($(#[$doc:meta])* $name:ident = $code:literal,)*) => {
        /// Message kinds. 0x0001..0x00ff belong to the data plane; 0x0100..0x01ff are kept for
        /// the executor's kinds (register, execute, sessions, breakpoints).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Kind { $($(#[$doc])* $name,)* }

        impl Kind {
            pub fn to_wire(self) -> u16 {
                match self { $(Kind::$name => $code,)* }
            }

            pub fn from_wire(code: u16) -> Option<Self> {
                match code { $($code => Some(Kind::$name),)* _ => None }
            }

            pub fn name(self) -> &'static str {
                match self { $(Kind::$name => stringify!($name),)* }
            }
        }
    };
}

kinds! {
    Hello = 0x01,
    HelloAck = 0x02,
    Ping = 0x03,
    Pong = 0x04,
    Put = 0x05,
    PutAck = 0x06,
    Get = 0x07,
    GetReply = 0x08,
    Delete = 0x09,
    DeleteAck = 0x0a,
    List = 0x0b,
    ListReply = 0x0c,
    Stats = 0x0d,
    StatsReply = 0x0e,
    Error = 0x0f,
    RdmaConnect = 0x10,
    RdmaAccept = 0x11,
    RegisterBegin = 0x101,
    RegisterReady = 0x102,
    RegisterChunk = 0x103,
    RegisterProgress = 0x104,
    RegisterCommit = 0x105,
    Registered = 0x106,
    Execute = 0x107,
    ExecuteReply = 0x108,
    Unregister = 0x109,
    UnregisterAck = 0x10a,
    ListModels = 0x10b,
    ModelList = 0x10c,
    Keep = 0x10d,
    Kept = 0x10e,
    Fetch = 0x10f,
    Release = 0x110,
    Released = 0x111,
    Push = 0x112,
    Pushed = 0x113,
    SessionOpen = 0x114,
    SessionOpened = 0x115,
    SessionStep = 0x116,
    SessionSignal = 0x117,
    SessionSignaled = 0x118,
    SessionClose = 0x119,
    SessionClosed = 0x11a,
    Paused = 0x11b,
    Resume = 0x11c,
    Inspect = 0x11d,
    Abort = 0x11e,
    Aborted = 0x11f,
    PushGrant = 0x120,
    PushGranted = 0x121,
}
