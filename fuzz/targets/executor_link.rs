//! Decodes arbitrary bytes as a message of the executor link (`djinn_node_core::link`): an
//! executor's answer, as the node reads it from a ring an executor process may have written
//! anything into, or a job, as an executor reads it. Bulk bytes lie in a small shared memory
//! that the spans are checked against. Whatever decodes must encode (its bulk bytes placed
//! afresh) to bytes that decode again to a message that encodes to the very same bytes and
//! bulk bytes.
//!
//! Input layout: byte 0 = the direction (even: from an executor, odd: to one); the rest = the
//! message.

use djinn_memory::HostBuf;
use djinn_node_core::link::{Bulk, FromExecutor, LinkError, Span, ToExecutor};
use djinn_proto::{Limits, SharedBytes};

/// The shared memory: bytes placed are appended; spans taken must lie within.
struct Shared(Vec<u8>);

impl Bulk for Shared {
    fn place(&mut self, bytes: SharedBytes) -> Result<Span, LinkError> {
        let offset = self.0.len() as u64;
        self.0.extend_from_slice((*bytes).as_ref());
        Ok(Span { offset, len: self.0.len() as u64 - offset })
    }

    fn take(&mut self, span: Span) -> Result<HostBuf, LinkError> {
        let outside = || LinkError::Bulk { span, reason: "outside the shared memory".into() };
        let range = span.range_in(self.0.len()).ok_or_else(outside)?;
        HostBuf::copy_from(&self.0[range]).map_err(|e| LinkError::Bulk { span, reason: e.to_string() })
    }
}

fn limits() -> Limits {
    Limits { max_payload: 1 << 20, max_meta: 1 << 16, ..Default::default() }
}

/// A shared memory of 256 bytes, each its own offset.
fn shared() -> Shared {
    Shared((0..=255).collect())
}

enum Link {
    From(FromExecutor),
    To(ToExecutor),
}

fn decode(to_executor: bool, bytes: &[u8], bulk: &mut Shared) -> Result<Link, LinkError> {
    let limits = limits();
    if to_executor {
        ToExecutor::decode(bytes, &limits, bulk).map(Link::To)
    } else {
        FromExecutor::decode(bytes, &limits, bulk).map(Link::From)
    }
}

fn encode(message: Link) -> (Vec<u8>, Vec<u8>) {
    let (mut out, mut bulk) = (Vec::new(), Shared(Vec::new()));
    match message {
        Link::From(m) => m.encode(&mut out, &mut bulk),
        Link::To(m) => m.encode(&mut out, &mut bulk),
    }
    .unwrap_or_else(|e| panic!("a decoded message does not encode: {e}"));
    (out, bulk.0)
}

pub fn run(data: &[u8]) {
    let Some((&direction, bytes)) = data.split_first() else { return };
    let to_executor = direction & 1 == 1;
    let Ok(message) = decode(to_executor, bytes, &mut shared()) else { return };
    let (encoded, bulk) = encode(message);
    let again = decode(to_executor, &encoded, &mut Shared(bulk.clone()))
        .unwrap_or_else(|e| panic!("a re-encoded message does not decode: {e}"));
    let (encoded_again, bulk_again) = encode(again);
    assert_eq!(encoded_again, encoded, "the message changed through encode → decode");
    assert_eq!(bulk_again, bulk, "its bulk bytes changed through encode → decode");
}
