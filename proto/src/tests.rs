//! Property tests of the codec: every message kind survives encode → arbitrary chunking →
//! decode, and arbitrary bytes never panic the reader nor make it allocate beyond the limits.

use std::sync::Arc;

use djinn_memory::HostBuf;
use proptest::prelude::*;
use proptest::strategy::ValueTree;

use super::*;
use crate::message::{breakpoints, data, kept, models, sessions};

struct PlainAlloc {
    limits: Limits,
}

impl PayloadAlloc for PlainAlloc {
    fn alloc(&mut self, _message: &Message, len: usize) -> Result<Payload, Refusal> {
        assert!(len as u64 <= self.limits.max_payload, "allocation of {len} bytes beyond the limit");
        Ok(Payload { buf: HostBuf::zeroed(len)?, reservation: None })
    }
}

/// Feeds `bytes` to a reader in reads of the given sizes (cycled), then closes the stream.
fn feed(limits: Limits, bytes: &[u8], chunks: &[usize]) -> Vec<RecvEvent> {
    let mut reader = FrameReader::new(limits);
    let mut events = feed_into(&mut reader, limits, bytes, chunks);
    if !matches!(events.last(), Some(RecvEvent::Fatal(_)))
        && let Some(e) = reader.on_eof()
    {
        events.push(RecvEvent::Fatal(e));
    }
    events
}

/// Feeds `bytes` to `reader` in reads of the given sizes (cycled), up to a fatal error.
fn feed_into(reader: &mut FrameReader, limits: Limits, bytes: &[u8], chunks: &[usize]) -> Vec<RecvEvent> {
    let mut alloc = PlainAlloc { limits };
    let mut events = Vec::new();
    let mut pos = 0;
    let mut chunk = chunks.iter().cycle();
    while pos < bytes.len() {
        let want = (*chunk.next().unwrap()).max(1);
        let target = reader.read_target();
        let mut n = 0;
        for dst in [target.payload, target.staging] {
            let k = dst.len().min(want - n).min(bytes.len() - pos - n);
            dst[..k].copy_from_slice(&bytes[pos + n..pos + n + k]);
            n += k;
        }
        reader.on_read(n);
        pos += n;
        while let Some(event) = reader.next_event(&mut alloc) {
            let fatal = matches!(event, RecvEvent::Fatal(_));
            events.push(event);
            if fatal {
                return events;
            }
        }
    }
    events
}

/// Before its hello a connection's reader holds a few KiB, and refuses a larger metadata
/// section before allocating; after it, staging grown for a large section (up to the limit) is
/// given back once that frame is decoded.
#[test]
fn staging_fits_the_limits_and_shrinks_after_a_large_metadata_section() {
    let before_hello = Limits { max_meta: 4096, ..Limits::default() };
    let mut reader = FrameReader::new(before_hello);
    assert!(reader.staging_capacity() <= HEADER_LEN + 4096, "{}", reader.staging_capacity());
    let head = FrameHeader::new(Kind::Data(DataKind::Put), 1, 1 << 20, 0);
    let events = feed_into(&mut reader, before_hello, zerocopy::IntoBytes::as_bytes(&head), &[64]);
    assert!(matches!(events[..], [RecvEvent::Fatal(ProtocolError::MetaTooLarge { .. })]), "{events:?}");
    assert!(reader.staging_capacity() <= HEADER_LEN + 4096);

    let limits = Limits::default();
    let mut reader = FrameReader::new(before_hello);
    reader.set_limits(limits);
    assert_eq!(reader.staging_capacity(), STAGING_LEN);
    let meta_len = 300_000;
    let mut wire = zerocopy::IntoBytes::as_bytes(&FrameHeader::new(Kind::Data(DataKind::Put), 1, meta_len, 0)).to_vec();
    wire.resize(wire.len() + meta_len as usize, 0xff);
    let events = feed_into(&mut reader, limits, &wire, &[1 << 16]);
    assert!(matches!(events[..], [RecvEvent::Rejected { request_id: 1, .. }]), "{events:?}");
    assert!(reader.staging_capacity() >= meta_len as usize, "grown for the section");
    let _ = reader.read_target();
    assert_eq!(reader.staging_capacity(), STAGING_LEN, "given back");
}

fn frame_bytes(frame: &OutFrame) -> Vec<u8> {
    let mut queue = SendQueue::default();
    queue.push(frame.clone());
    let mut slices = vec![std::io::IoSlice::new(&[]); 1024];
    let n = queue.write_slices(&mut slices);
    slices[..n].iter().flat_map(|s| s.iter().copied()).collect()
}

/// Any message of any family; each family's file says how to make its own.
fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        data::arbitrary().prop_map(Message::Data),
        models::arbitrary().prop_map(Message::Model),
        kept::arbitrary().prop_map(Message::Kept),
        sessions::arbitrary().prop_map(Message::Session),
        breakpoints::arbitrary().prop_map(Message::Breakpoint),
    ]
}

/// Every kind can be made by [`message`], so the round trips below cover it.
#[test]
fn every_kind_is_generated() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = message();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..20_000 {
        seen.insert(strategy.new_tree(&mut runner).unwrap().current().kind());
    }
    let missing: Vec<_> = Kind::all().filter(|k| !seen.contains(k)).map(Kind::name).collect();
    assert!(missing.is_empty(), "no strategy makes {missing:?}");
}

/// The families' wire codes are one space: each kind has its own code, and reads back as itself.
#[test]
fn kinds_are_one_space() {
    let mut codes = std::collections::HashMap::new();
    for kind in Kind::all() {
        if let Some(other) = codes.insert(kind.to_wire(), kind) {
            panic!("{} and {} share the code {:#x}", other.name(), kind.name(), kind.to_wire());
        }
        assert_eq!(Kind::from_wire(kind.to_wire()), Some(kind));
    }
    assert!(Kind::from_wire(0).is_none());
}

/// A message with random bytes for each of its tensors.
fn message_with_payload() -> impl Strategy<Value = (Message, Vec<Vec<u8>>)> {
    message().prop_flat_map(|m| {
        let lens: Vec<usize> = m.tensors().iter().map(|t| t.byte_len as usize).collect();
        let payloads = lens.into_iter().map(|n| prop::collection::vec(any::<u8>(), n)).collect::<Vec<_>>();
        (Just(m), payloads)
    })
}

fn out_frame(id: u64, message: &Message, payloads: &[Vec<u8>]) -> OutFrame {
    let shared = payloads.iter().map(|p| Arc::new(p.clone()) as SharedBytes).collect();
    OutFrame::new(id, message, shared).unwrap()
}

fn check_frame(event: &RecvEvent, id: u64, message: &Message, payloads: &[Vec<u8>]) -> Result<(), TestCaseError> {
    let RecvEvent::Frame(frame) = event else {
        return Err(TestCaseError::fail(format!("expected a frame, got {event:?}")));
    };
    prop_assert_eq!(frame.request_id, id);
    prop_assert_eq!(&frame.message, message);
    let (offsets, total) = payload_layout(message.tensors()).unwrap();
    let bytes = frame.payload.as_ref().map_or(&[][..], |p| p.buf.as_slice());
    prop_assert_eq!(bytes.len() as u64, total);
    for (offset, expected) in offsets.iter().zip(payloads) {
        let offset = *offset as usize;
        prop_assert_eq!(&bytes[offset..offset + expected.len()], expected.as_slice());
    }
    Ok(())
}

proptest! {
    #[test]
    fn every_message_round_trips_through_any_chunking(
        frames in prop::collection::vec((any::<u64>(), message_with_payload()), 1..6),
        chunks in prop::collection::vec(1usize..200, 1..8),
    ) {
        let mut wire = Vec::new();
        for (id, (message, payloads)) in &frames {
            wire.extend(frame_bytes(&out_frame(*id, message, payloads)));
        }
        let events = feed(Limits::default(), &wire, &chunks);
        prop_assert_eq!(events.len(), frames.len());
        for (event, (id, (message, payloads))) in events.iter().zip(&frames) {
            check_frame(event, *id, message, payloads)?;
        }
    }

    #[test]
    fn send_queue_resumes_partial_writes(
        frames in prop::collection::vec((any::<u64>(), message_with_payload()), 1..5),
        writes in prop::collection::vec(1usize..97, 1..10),
        max_slices in 1usize..5,
    ) {
        let mut expected = Vec::new();
        let mut queue = SendQueue::default();
        for (id, (message, payloads)) in &frames {
            let frame = out_frame(*id, message, payloads);
            expected.extend(frame_bytes(&frame));
            queue.push(frame);
        }
        prop_assert_eq!(queue.queued_bytes(), expected.len() as u64);
        let mut written = Vec::new();
        let mut sizes = writes.iter().cycle();
        while !queue.is_empty() {
            let mut slices = vec![std::io::IoSlice::new(&[]); max_slices];
            let filled = queue.write_slices(&mut slices);
            slices.truncate(filled);
            let budget = *sizes.next().unwrap();
            let mut n = 0;
            for s in &slices {
                let k = s.len().min(budget - n);
                written.extend_from_slice(&s[..k]);
                n += k;
            }
            queue.on_written(n);
        }
        prop_assert_eq!(written, expected);
        prop_assert_eq!(queue.queued_bytes(), 0);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512), chunks in prop::collection::vec(1usize..64, 1..4)) {
        let limits = Limits { max_payload: 1 << 16, ..Limits::default() };
        feed(limits, &bytes, &chunks);
    }

    /// A valid header followed by garbage metadata is refused or decoded, never a panic, and the
    /// frame after it is still read.
    #[test]
    fn garbage_metadata_is_refused_and_the_stream_goes_on(kind in 1u16..0x20, meta in prop::collection::vec(any::<u8>(), 0..64)) {
        let header = FrameHeader::new(Kind::Data(DataKind::Ping), 9, meta.len() as u32, 0);
        let mut wire = zerocopy::IntoBytes::as_bytes(&header).to_vec();
        wire[6..8].copy_from_slice(&kind.to_le_bytes());
        wire.extend(&meta);
        wire.extend(frame_bytes(&out_frame(10, &Message::Data(DataMessage::Ping), &[])));
        let events = feed(Limits::default(), &wire, &[7]);
        match events.first() {
            Some(RecvEvent::Frame(f)) => prop_assert_eq!(f.request_id, 9),
            Some(RecvEvent::Rejected { request_id, .. }) => prop_assert_eq!(*request_id, 9),
            other => prop_assert!(false, "{:?}", other),
        }
        prop_assert_eq!(events.len(), 2);
        check_frame(&events[1], 10, &Message::Data(DataMessage::Ping), &[])?;
    }
}

fn header_bytes(header: FrameHeader) -> Vec<u8> {
    zerocopy::IntoBytes::as_bytes(&header).to_vec()
}

#[test]
fn bad_magic_and_version_are_fatal_and_named() {
    let mut wire = header_bytes(FrameHeader::new(Kind::Data(DataKind::Ping), 1, 0, 0));
    wire[0] = b'X';
    let events = feed(Limits::default(), &wire, &[100]);
    assert!(matches!(events.as_slice(), [RecvEvent::Fatal(ProtocolError::BadMagic { .. })]));

    let theirs = PROTOCOL_VERSION + 1;
    let mut header = FrameHeader::new(Kind::Data(DataKind::Ping), 1, 0, 0);
    header.version = theirs.into();
    let events = feed(Limits::default(), &header_bytes(header), &[100]);
    let [RecvEvent::Fatal(e)] = events.as_slice() else { panic!("{events:?}") };
    assert_eq!(e, &ProtocolError::VersionMismatch { ours: PROTOCOL_VERSION, theirs });
    let text = e.to_string();
    assert!(
        text.contains(&format!("version {theirs}")) && text.contains(&format!("version {PROTOCOL_VERSION}")),
        "{text}"
    );
}

#[test]
fn lengths_over_the_limits_are_refused_before_allocation() {
    let limits = Limits { max_payload: 1 << 20, max_meta: 256, ..Limits::default() };
    // PlainAlloc panics if asked for more than the limit.
    let events = feed(limits, &header_bytes(FrameHeader::new(Kind::Data(DataKind::Put), 1, 10, (1 << 20) + 1)), &[64]);
    assert!(matches!(events.as_slice(), [RecvEvent::Fatal(ProtocolError::FrameTooLarge { .. })]));
    let events = feed(limits, &header_bytes(FrameHeader::new(Kind::Data(DataKind::Put), 1, 257, 0)), &[64]);
    assert!(matches!(events.as_slice(), [RecvEvent::Fatal(ProtocolError::MetaTooLarge { .. })]));
}

#[test]
fn a_payload_of_exactly_the_limit_is_accepted() {
    let limits = Limits { max_payload: 1 << 16, ..Limits::default() };
    let tensor = TensorDesc::new(DType::U8, vec![1 << 16]).unwrap();
    let message = Message::Data(DataMessage::Put { name: "x".into(), tensor });
    let payload = vec![vec![3u8; 1 << 16]];
    let events = feed(limits, &frame_bytes(&out_frame(5, &message, &payload)), &[4096]);
    check_frame(&events[0], 5, &message, &payload).unwrap();
}

#[test]
fn wrong_descriptor_and_payload_mismatch_are_refused_and_skipped() {
    let good = TensorDesc::new(DType::F32, vec![2, 2]).unwrap();
    let bad = Message::Data(DataMessage::Put { name: "t".into(), tensor: TensorDesc { byte_len: 12, ..good.clone() } });
    let mut wire = Vec::new();
    // Encoding does not validate descriptors, so a lying one can be built; the payload matches it.
    let mut head = Vec::new();
    encode_head(&mut head, 1, &bad).unwrap();
    wire.extend(&head);
    wire.extend([0u8; 12]);
    // The header claims more payload than the tensor takes.
    let ok = Message::Data(DataMessage::Put { name: "t".into(), tensor: good });
    encode_head(&mut head, 2, &ok).unwrap();
    head[24..32].copy_from_slice(&20u64.to_le_bytes());
    wire.extend(&head);
    wire.extend([0u8; 20]);
    wire.extend(frame_bytes(&out_frame(3, &Message::Data(DataMessage::Ping), &[])));
    let events = feed(Limits::default(), &wire, &[5]);
    assert!(
        matches!(&events[0], RecvEvent::Rejected { request_id: 1, refusal } if refusal.code == ErrorCode::BadDescriptor),
        "{events:?}"
    );
    assert!(
        matches!(&events[1], RecvEvent::Rejected { request_id: 2, refusal } if refusal.code == ErrorCode::PayloadMismatch),
        "{events:?}"
    );
    assert!(matches!(&events[2], RecvEvent::Frame(f) if f.request_id == 3));
}

#[test]
fn unknown_kinds_are_skipped_with_their_body() {
    let mut wire = header_bytes(FrameHeader::new(Kind::Data(DataKind::Ping), 4, 3, 5));
    wire[6..8].copy_from_slice(&0x0150u16.to_le_bytes());
    wire.extend([1u8; 8]);
    wire.extend(frame_bytes(&out_frame(6, &Message::Data(DataMessage::Ping), &[])));
    let events = feed(Limits::default(), &wire, &[3]);
    assert!(
        matches!(&events[0], RecvEvent::Rejected { request_id: 4, refusal } if refusal.code == ErrorCode::UnknownKind),
        "{events:?}"
    );
    assert!(matches!(&events[1], RecvEvent::Frame(f) if f.request_id == 6));
}

#[test]
fn truncation_is_reported_with_the_part_cut() {
    let tensor = TensorDesc::new(DType::I64, vec![100]).unwrap();
    let message = Message::Data(DataMessage::Put { name: "t".into(), tensor });
    let wire = frame_bytes(&out_frame(1, &message, &[vec![0; 800]]));
    for (cut, part) in [(10, "header"), (HEADER_LEN + 2, "metadata"), (wire.len() - 1, "payload")] {
        let events = feed(Limits::default(), &wire[..cut], &[64]);
        assert!(
            matches!(&events[..], [RecvEvent::Fatal(ProtocolError::Truncated { part: p, .. })] if *p == part),
            "cut at {cut}: {events:?}"
        );
    }
    assert!(feed(Limits::default(), &wire, &[64]).len() == 1);
}

#[test]
fn values_nested_too_deep_are_refused() {
    let mut v = Value::Int(1);
    for _ in 0..=MAX_VALUE_DEPTH {
        v = Value::List(vec![v]);
    }
    let mut bytes = Vec::new();
    v.encode(&mut bytes);
    assert!(matches!(Value::decode(&mut &bytes[..], 0), Err(ProtocolError::MalformedMeta(m)) if m.contains("deeper")));
}

#[test]
fn tensor_indices_must_name_a_tensor_of_the_frame() {
    let mut bytes = Vec::new();
    Value::Tuple(vec![Value::Tensor(0), Value::Tensor(2)]).encode(&mut bytes);
    assert!(Value::decode(&mut &bytes[..], 2).is_err());
    assert!(Value::decode(&mut &bytes[..], 3).is_ok());
}

#[test]
fn fingerprints_separate_block_boundaries() {
    let whole = Fingerprint::of_blocks(&[b"abcd".as_slice()]);
    let split = Fingerprint::of_blocks(&[b"ab".as_slice(), b"cd".as_slice()]);
    assert_ne!(whole, split);
    assert_eq!(Fingerprint::from_hex(&whole.to_hex()), Some(whole));
}

/// Found by the message_decode fuzz target: a NaN output value. It round-trips bit for bit
/// (the comparison must be of the encoding: NaN is not equal to itself).
#[test]
fn a_nan_value_round_trips_bit_for_bit() {
    let message =
        Message::Model(ModelMessage::ExecuteReply { tensors: vec![], output: Value::Float(f64::NAN), kept: vec![] });
    let mut meta = Vec::new();
    message.encode(&mut meta);
    let again = Message::decode(Kind::Model(ModelKind::ExecuteReply), &meta, &Limits::default()).unwrap();
    let Message::Model(ModelMessage::ExecuteReply { output: Value::Float(v), .. }) = again else { panic!("{again:?}") };
    assert_eq!(v.to_bits(), f64::NAN.to_bits());
}

proptest! {
    /// What a writer that kept only a count of bytes written sends next: exactly the rest of
    /// the bytes, in order, whatever the slices and however many iovecs it has.
    #[test]
    fn unsent_slices_are_the_rest_of_the_bytes(
        slices in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 0..12),
        sent_fraction in 0.0f64..=1.0,
        iovecs in 1usize..6,
    ) {
        let all: Vec<u8> = slices.concat();
        let sent = (all.len() as f64 * sent_fraction) as u64;
        let mut out = [std::io::IoSlice::new(&[]); 16];
        let n = unsent_slices(slices.iter().map(Vec::as_slice), sent, &mut out[..iovecs]);
        let next: Vec<u8> = out[..n].iter().flat_map(|s| s.iter().copied()).collect();
        prop_assert!(out[..n].iter().all(|s| !s.is_empty()), "no empty iovec");
        prop_assert!(all[sent as usize..].starts_with(&next));
        if n < iovecs {
            prop_assert_eq!(next.as_slice(), &all[sent as usize..], "room left: everything unsent is there");
        }
    }
}
