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
use super::message::Kind;

pub const MAGIC: [u8; 4] = *b"DJNN";
/// 2: tensors kept on the node (handles, keep, fetch, release, push); 3: sessions; 4:
/// breakpoints.
pub const PROTOCOL_VERSION: u16 = 9;
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
