//! Decodes arbitrary bytes as a message of the executor link (`djinn_node_core::link`): an
//! executor's answer, as the node reads it from a ring an executor process may have written
//! anything into, or a job, as an executor reads it. Bulk bytes lie in a small shared memory
//! that the spans are checked against. Whatever decodes must encode (its bulk bytes placed
//! afresh) to bytes that decode again to a message that encodes to the very same bytes and
//! bulk bytes.
//!
//! Input layout: byte 0 = the direction (even: from an executor, odd: to one); the rest = the
//! message.

use djinn_node_core::link::{FromExecutor, LinkError, ToExecutor, VecBulk};
use djinn_proto::Limits;

fn limits() -> Limits {
    Limits { max_payload: 1 << 20, max_meta: 1 << 16, ..Default::default() }
}

/// A shared memory of 256 bytes, each its own offset.
fn shared() -> VecBulk {
    VecBulk((0..=255).collect())
}

enum Link {
    From(FromExecutor),
    To(ToExecutor),
}

fn decode(to_executor: bool, bytes: &[u8], bulk: &mut VecBulk) -> Result<Link, LinkError> {
    let limits = limits();
    if to_executor {
        ToExecutor::decode(bytes, &limits, bulk).map(Link::To)
    } else {
        FromExecutor::decode(bytes, &limits, bulk).map(Link::From)
    }
}

fn encode(message: Link) -> (Vec<u8>, Vec<u8>) {
    let (mut out, mut bulk) = (Vec::new(), VecBulk::default());
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
    let again = decode(to_executor, &encoded, &mut VecBulk(bulk.clone()))
        .unwrap_or_else(|e| panic!("a re-encoded message does not decode: {e}"));
    let (encoded_again, bulk_again) = encode(again);
    assert_eq!(encoded_again, encoded, "the message changed through encode → decode");
    assert_eq!(bulk_again, bulk, "its bulk bytes changed through encode → decode");
}
