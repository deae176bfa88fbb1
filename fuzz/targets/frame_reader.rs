//! Feeds arbitrary bytes to a `FrameReader` in arbitrary read sizes, exactly as a driver does, and
//! checks that:
//! - the reader never asks the allocator for more than `limits.max_payload` bytes;
//! - it always offers room for the next read while the stream is open;
//! - every decoded message survives `Message::encode` → `Message::decode` unchanged;
//! - the events it reports (frames with their payload bytes, refusals, fatal errors, the error at
//!   end of stream) are those of a one-shot reference parser over the whole stream, whatever the
//!   read sizes.
//!
//! Input layout:
//! - byte 0: bits 0..4 = number of read-size bytes minus one (1..=16 of them); bit 5 = the
//!   stream starts before a hello: the first frame is held to the node's 4 KiB metadata limit
//!   (and the reader's staging sized for it), later ones to the full limits, as a node switches
//!   after a good hello; bit 6 = metadata limit of 128 KiB instead of 64 KiB (larger than the
//!   staging buffer, so it must grow); bit 7 = the allocator refuses every other allocation (to
//!   exercise the discard path);
//! - the read-size bytes, cycled: 0 = as much as the reader offers, 1..=191 = that many bytes,
//!   192..=255 = (b - 191) × 512 bytes (512 B to 32 KiB);
//! - the rest: the byte stream.

use djinn_memory::HostBuf;
use djinn_proto::{
    ErrorCode, FrameHeader, FrameReader, HEADER_LEN, Kind, Limits, Message, Payload, PayloadAlloc, ProtocolError,
    RecvEvent, Refusal, payload_layout,
};

fn limits(large_meta: bool) -> Limits {
    let max_meta = if large_meta { 1 << 17 } else { 1 << 16 };
    Limits { max_payload: 1 << 20, max_meta, ..Default::default() }
}

/// The limits of the first frame: before a hello, the node's own bound on metadata.
fn first_limits(limits: Limits, before_hello: bool) -> Limits {
    if before_hello { limits.before_hello() } else { limits }
}

/// What a reader reports, in a form that can be compared.
#[derive(Debug, PartialEq)]
enum Seen {
    Frame {
        request_id: u64,
        /// The message's kind and encoding (compared as bytes: a NaN float value is not equal
        /// to itself).
        message: (Kind, Vec<u8>),
        payload: Option<Vec<u8>>,
    },
    Rejected {
        request_id: u64,
        refusal: Refusal,
    },
    Fatal(ProtocolError),
    /// The result of `on_eof`, after the whole stream was read.
    Eof(Option<ProtocolError>),
}

/// Allocates with `HostBuf::zeroed`, asserting the limit; when `refuse_odd`, refuses every other
/// request (the 2nd, 4th, ...).
struct FuzzAlloc {
    limits: Limits,
    refuse_odd: bool,
    calls: u64,
}

impl FuzzAlloc {
    fn decide(&mut self, len: usize) -> Result<(), Refusal> {
        assert!(
            len as u64 <= self.limits.max_payload,
            "asked to allocate {len} bytes, over max_payload {}",
            self.limits.max_payload
        );
        assert!(len > 0, "asked to allocate an empty payload");
        let call = self.calls;
        self.calls += 1;
        if self.refuse_odd && call % 2 == 1 {
            return Err(Refusal { code: ErrorCode::OverBudget, message: format!("fuzz refusal #{call}") });
        }
        Ok(())
    }
}

impl PayloadAlloc for FuzzAlloc {
    fn alloc(&mut self, _message: &Message, len: usize) -> Result<Payload, Refusal> {
        self.decide(len)?;
        Ok(Payload { buf: HostBuf::zeroed(len)?, reservation: None })
    }
}

/// Checks that `message` survives encode → decode; returns its kind and encoding.
fn round_trip(message: &Message, limits: &Limits) -> (Kind, Vec<u8>) {
    let mut meta = Vec::new();
    message.encode(&mut meta);
    let again = Message::decode(message.kind(), &meta, limits)
        .unwrap_or_else(|e| panic!("re-encoded {message:?} does not decode: {e}"));
    let mut meta_again = Vec::new();
    again.encode(&mut meta_again);
    assert_eq!(meta_again, meta, "message changed through encode → decode: {message:?} became {again:?}");
    (message.kind(), meta)
}

fn read_size(b: u8) -> usize {
    match b {
        0 => usize::MAX,
        1..=191 => b as usize,
        _ => (b as usize - 191) * 512,
    }
}

/// Drives a `FrameReader` over `stream` with reads of `sizes` (cycled).
fn drive(stream: &[u8], sizes: &[usize], refuse_odd: bool, large_meta: bool, before_hello: bool) -> Vec<Seen> {
    let limits = limits(large_meta);
    let mut reader = FrameReader::new(first_limits(limits, before_hello));
    let mut switched = !before_hello;
    let mut alloc = FuzzAlloc { limits, refuse_odd, calls: 0 };
    let mut seen = Vec::new();
    let mut pos = 0;
    let mut size = sizes.iter().cycle();
    loop {
        loop {
            if !switched && !seen.is_empty() {
                reader.set_limits(limits);
                switched = true;
            }
            let Some(event) = reader.next_event(&mut alloc) else { break };
            match event {
                RecvEvent::Frame(frame) => {
                    let message = round_trip(&frame.message, &limits);
                    let payload = frame.payload.map(|p| p.buf.as_slice().to_vec());
                    seen.push(Seen::Frame { request_id: frame.request_id, message, payload });
                }
                RecvEvent::Rejected { request_id, refusal } => seen.push(Seen::Rejected { request_id, refusal }),
                RecvEvent::Fatal(e) => {
                    assert!(e.is_fatal(), "non-fatal error reported as fatal: {e:?}");
                    // A driver reports it and closes the connection.
                    seen.push(Seen::Fatal(e));
                    return seen;
                }
            }
        }
        if pos == stream.len() {
            break;
        }
        let want = *size.next().unwrap();
        let target = reader.read_target();
        let room = target.payload.len() + target.staging.len();
        assert!(room > 0, "read_target offers no room with {} bytes still to come", stream.len() - pos);
        let n = want.min(room).min(stream.len() - pos);
        let src = &stream[pos..pos + n];
        let into_payload = n.min(target.payload.len());
        target.payload[..into_payload].copy_from_slice(&src[..into_payload]);
        target.staging[..n - into_payload].copy_from_slice(&src[into_payload..]);
        reader.on_read(n);
        pos += n;
    }
    let idle = reader.is_idle();
    let eof = reader.on_eof();
    assert_eq!(idle, eof.is_none(), "is_idle disagrees with on_eof: {eof:?}");
    if let Some(e) = &eof {
        assert!(e.is_fatal(), "end-of-stream error is not fatal: {e:?}");
    }
    seen.push(Seen::Eof(eof));
    seen
}

/// The same protocol, parsed in one pass over the whole stream.
fn reference(stream: &[u8], refuse_odd: bool, large_meta: bool, before_hello: bool) -> Vec<Seen> {
    let full = limits(large_meta);
    let limits_of = |seen: &Vec<Seen>| if seen.is_empty() { first_limits(full, before_hello) } else { full };
    let mut alloc = FuzzAlloc { limits: full, refuse_odd, calls: 0 };
    let mut seen = Vec::new();
    let mut rest = stream;
    let truncated = |part, received: usize, expected: u64| {
        Seen::Eof(Some(ProtocolError::Truncated { part, received: received as u64, expected }))
    };
    loop {
        if rest.is_empty() {
            seen.push(Seen::Eof(None));
            return seen;
        }
        if rest.len() < HEADER_LEN {
            seen.push(truncated("header", rest.len(), HEADER_LEN as u64));
            return seen;
        }
        let limits = limits_of(&seen);
        let header = FrameHeader::parse(rest).unwrap();
        rest = &rest[HEADER_LEN..];
        if let Err(e) = header.validate(&limits) {
            seen.push(Seen::Fatal(e));
            return seen;
        }
        let request_id = header.request_id.get();
        let meta_len = header.meta_len.get() as usize;
        let payload_len = header.payload_len.get();
        // Skips `len` bytes then reports `refusal`, or reports the truncation.
        let discard = |rest: &mut &[u8], len: u64, refusal: Refusal, seen: &mut Vec<Seen>| -> bool {
            if (rest.len() as u64) < len {
                seen.push(truncated("payload", 0, len - rest.len() as u64));
                return false;
            }
            *rest = &rest[len as usize..];
            seen.push(Seen::Rejected { request_id, refusal });
            true
        };
        let Some(kind) = Kind::from_wire(header.kind.get()) else {
            let refusal = ProtocolError::UnknownKind { kind: header.kind.get() }.into();
            if !discard(&mut rest, meta_len as u64 + payload_len, refusal, &mut seen) {
                return seen;
            }
            continue;
        };
        if rest.len() < meta_len {
            seen.push(truncated("metadata", rest.len(), meta_len as u64));
            return seen;
        }
        let meta = &rest[..meta_len];
        rest = &rest[meta_len..];
        let decoded = Message::decode(kind, meta, &limits).and_then(|message| {
            let (_, expected) = payload_layout(message.tensors())?;
            if expected == payload_len {
                Ok(message)
            } else {
                Err(ProtocolError::PayloadMismatch { announced: payload_len, expected })
            }
        });
        let message = match decoded {
            Ok(message) => message,
            Err(e) => {
                if !discard(&mut rest, payload_len, e.into(), &mut seen) {
                    return seen;
                }
                continue;
            }
        };
        // Accepted metadata is in canonical form: encoding it again gives the same bytes.
        let mut again = Vec::new();
        message.encode(&mut again);
        assert_eq!(again, meta, "{message:?} encodes differently from the metadata it was decoded from");
        let message = (message.kind(), again);
        if payload_len == 0 {
            seen.push(Seen::Frame { request_id, message, payload: None });
            continue;
        }
        if let Err(refusal) = alloc.decide(payload_len as usize) {
            if !discard(&mut rest, payload_len, refusal, &mut seen) {
                return seen;
            }
            continue;
        }
        if (rest.len() as u64) < payload_len {
            seen.push(truncated("payload", rest.len(), payload_len));
            return seen;
        }
        let payload = rest[..payload_len as usize].to_vec();
        rest = &rest[payload_len as usize..];
        seen.push(Seen::Frame { request_id, message, payload: Some(payload) });
    }
}

pub fn run(data: &[u8]) {
    let Some((&control, data)) = data.split_first() else { return };
    let count = (control & 0x0f) as usize + 1;
    let refuse_odd = control & 0x80 != 0;
    let large_meta = control & 0x40 != 0;
    let before_hello = control & 0x20 != 0;
    if data.len() < count {
        return;
    }
    let (size_bytes, stream) = data.split_at(count);
    let sizes: Vec<usize> = size_bytes.iter().copied().map(read_size).collect();

    let got = drive(stream, &sizes, refuse_odd, large_meta, before_hello);
    let want = reference(stream, refuse_odd, large_meta, before_hello);
    assert_eq!(got, want, "reader events differ from the one-shot parse (read sizes {sizes:?})");
}
