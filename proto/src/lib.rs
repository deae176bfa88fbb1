//! Djinn's wire protocol, with no I/O in it: the header, the messages, tensor descriptors,
//! framing and the send queue; and [`rdma`], the session core that carries frames and payloads
//! over RDMA queue pairs. The transports (`djinn-dataplane`) move the bytes these produce.

mod archives;
mod codec;
mod error;
mod header;
mod limits;
mod message;
pub mod rdma;
mod tensor;
mod value;

pub use archives::{ArchiveError, Archives, BlockReader};
pub use codec::{
    Frame, FrameReader, OutFrame, Payload, PayloadAlloc, ReadTarget, RecvEvent, Refusal, STAGING_LEN, SendQueue,
    SharedBytes, ZEROS, append_head, decode_body, encode_head, unsent_slices,
};
pub use error::{ErrorCode, ProtocolError};
pub use header::{FrameHeader, HEADER_LEN, MAGIC, PROTOCOL_VERSION};
pub use limits::{Limits, MAX_META_BEFORE_HELLO};
pub use message::breakpoints::{Breakpoint, BreakpointKind, BreakpointMessage};
pub use message::data::{DataKind, DataMessage, Hello, ListEntry, RdmaParams, transports};
pub use message::kept::{HandleInfo, KeptEntry, KeptKind, KeptMessage, TensorSource};
pub use message::models::{Fingerprint, ModelInfo, ModelKind, ModelMessage};
pub use message::sessions::{SessionEntry, SessionKind, SessionMessage, Signal};
pub use message::{Kind, Message};

/// The protocol's field encodings, for codecs built on its types (the node's link to its
/// executor processes).
pub mod fields {
    pub use crate::message::wire::{Reader, Writer};
}
pub use tensor::{DType, TENSOR_ALIGN, TensorDesc, check_tensor_lens, paddings, payload_layout, payload_len};
pub use value::{Handle, MAX_VALUE_DEPTH, Value};

#[cfg(test)]
mod strategies;
#[cfg(test)]
mod tests;
