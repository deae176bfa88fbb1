//! The wire protocol, with no I/O in it: header, messages, tensor descriptors, framing.

mod archives;
mod codec;
mod error;
mod header;
mod limits;
mod message;
mod tensor;
mod value;

pub use archives::{ArchiveError, Archives, BlockReader};
pub use codec::{
    Frame, FrameReader, OutFrame, Payload, PayloadAlloc, ReadTarget, RecvEvent, Refusal, STAGING_LEN, SendQueue,
    SharedBytes, ZEROS, append_head, decode_body, encode_head,
};
pub use error::{ErrorCode, ProtocolError};
pub use header::{FrameHeader, HEADER_LEN, Kind, MAGIC, PROTOCOL_VERSION};
pub use limits::Limits;
pub use message::{
    Breakpoint, Fingerprint, HandleInfo, Hello, ListEntry, Message, ModelInfo, RdmaParams, Signal, TensorSource,
    transports,
};
pub use tensor::{DType, TENSOR_ALIGN, TensorDesc, check_tensor_lens, paddings, payload_layout, payload_len};
pub use value::{Handle, MAX_VALUE_DEPTH, Value};

#[cfg(test)]
mod tests;
