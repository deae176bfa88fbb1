//! Decodes arbitrary metadata as a message of a chosen kind. Whatever decodes must survive
//! `Message::encode` → `Message::decode` unchanged, and encode back to the very bytes it was
//! decoded from (the decoder accepts one encoding per message).
//!
//! Input layout: bytes 0..2 = the kind's wire code (little-endian u16, as in the frame header);
//! the rest = the metadata.

use djinn_proto::{Kind, Limits, Message};

fn limits() -> Limits {
    Limits { max_payload: 1 << 20, max_meta: 1 << 16, ..Default::default() }
}

pub fn run(data: &[u8]) {
    let Some((code, meta)) = data.split_first_chunk::<2>() else { return };
    let Some(kind) = Kind::from_wire(u16::from_le_bytes(*code)) else { return };
    let limits = limits();
    let Ok(message) = Message::decode(kind, meta, &limits) else { return };
    assert_eq!(message.kind(), kind, "decoded as the wrong kind");

    let mut encoded = Vec::new();
    message.encode(&mut encoded);
    assert_eq!(encoded, meta, "{message:?} encodes differently from the metadata it was decoded from");
    let again = Message::decode(kind, &encoded, &limits)
        .unwrap_or_else(|e| panic!("re-encoded {message:?} does not decode: {e}"));
    // Compared by encoding, not with `==`: a NaN float value is not equal to itself.
    let mut encoded_again = Vec::new();
    again.encode(&mut encoded_again);
    assert_eq!(encoded_again, encoded, "message changed through encode → decode: {message:?} became {again:?}");
}
