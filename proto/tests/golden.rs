//! Golden wire bytes: one hand-written message of every kind, and the exact bytes of its frame
//! head (header and metadata, as `append_head` writes them) in `tests/golden/messages.txt`, one
//! `KIND_NAME HEX` line per kind. The bytes were recorded at commit 613b2b5; a peer built from
//! any commit since must read and write them unchanged.
//!
//! The test encodes each message and compares with its line, decodes each line and compares
//! with the message, and checks that every kind has exactly one line.
//!
//! Regenerate the file only together with a deliberate protocol version change (a new
//! `PROTOCOL_VERSION`), never to make this test pass:
//!
//! ```text
//! DJINN_GOLDEN_WRITE=1 cargo test -p djinn-proto --test golden
//! ```
//!
//! The messages are written out by hand, not drawn from the property-test strategies, so that
//! changing a strategy cannot change the golden.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::PathBuf;

use djinn_proto::{
    Breakpoint, BreakpointMessage, DType, DataMessage, ErrorCode, Fingerprint, FrameHeader, HEADER_LEN, Handle,
    HandleInfo, Hello, KeptEntry, KeptMessage, Kind, Limits, ListEntry, Message, ModelInfo, ModelMessage,
    PROTOCOL_VERSION, RdmaParams, SessionEntry, SessionMessage, Signal, TensorDesc, TensorSource, Value, append_head,
    payload_len, transports,
};

const REQUEST_ID: u64 = 0x0102_0304_0506_0708;

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/messages.txt")
}

fn t(dtype: DType, shape: &[u64]) -> TensorDesc {
    TensorDesc::new(dtype, shape.to_vec()).expect("a fixed descriptor")
}

fn h(id: u64, epoch: u64) -> Handle {
    Handle { id, epoch }
}

/// 32 distinct bytes from `seed` (an odd step, so no two positions repeat).
fn fp(seed: u8) -> Fingerprint {
    Fingerprint(std::array::from_fn(|i| seed.wrapping_add((i as u8).wrapping_mul(37))))
}

fn s(text: &str) -> Value {
    Value::Str(text.to_owned())
}

fn hello(agent: &str, memory_path: &str, token: &str, tenant: &str) -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        transports: transports::TCP | transports::RDMA,
        max_meta: 1 << 20,
        max_payload: 16 << 30,
        agent: agent.to_owned(),
        memory_path: memory_path.to_owned(),
        token: token.to_owned(),
        tenant: tenant.to_owned(),
    }
}

fn rdma(qp_number: u32, gid_seed: u8) -> RdmaParams {
    RdmaParams {
        qp_number,
        psn: 0x00ab_cdef,
        gid: std::array::from_fn(|i| gid_seed ^ (i as u8)),
        mtu: 4096,
        slots: 64,
        slot_size: 65_536,
    }
}

/// One message of every kind, in the order the families declare them.
fn messages() -> Vec<Message> {
    let data = [
        DataMessage::Hello(hello("djinn-client/0.9", "", "tok_live_5f3a", "")),
        DataMessage::HelloAck(hello("djinn-node/0.9", "staging", "", "acme-research")),
        DataMessage::Ping,
        DataMessage::Pong,
        DataMessage::Put { name: "layers/0/attn.qkv é".into(), tensor: t(DType::F16, &[3, 4, 5]) },
        DataMessage::PutAck { replaced: true },
        DataMessage::Get { name: "embeddings.weight".into() },
        DataMessage::GetReply { tensor: t(DType::BF16, &[2, 7]) },
        DataMessage::Delete { name: "scratch/tmp-17".into() },
        DataMessage::DeleteAck,
        DataMessage::List { after: Some("layers/3".into()), limit: 250 },
        DataMessage::ListReply {
            entries: vec![
                ListEntry { name: "a".into(), tensor: t(DType::F32, &[]) },
                ListEntry { name: "b/empty".into(), tensor: t(DType::I8, &[4, 0, 2]) },
                ListEntry { name: "c.mask".into(), tensor: t(DType::Bool, &[9]) },
            ],
            more: true,
        },
        DataMessage::Stats,
        DataMessage::StatsReply {
            counters: vec![("frames_in".into(), 12_345), ("bytes_out".into(), 1 << 40), ("errors".into(), 0)],
        },
        DataMessage::Error { code: ErrorCode::StaleHandle, message: "handle 7@00000000deadbeef is stale".into() },
        DataMessage::RdmaConnect(rdma(0x11, 0xfe)),
        DataMessage::RdmaAccept(rdma(0x2a2a, 0x80)),
    ];
    let models = [
        ModelMessage::RegisterBegin { fingerprint: fp(1), blocks: vec![4096, 123_456_789, 7], public: true },
        ModelMessage::RegisterReady { upload: 0x55, registered: false },
        ModelMessage::RegisterChunk { upload: 0x55, offset: 1 << 33, chunk: t(DType::U8, &[300]) },
        ModelMessage::RegisterProgress { received: 8_589_934_892, total: 9_000_000_000 },
        ModelMessage::RegisterCommit { upload: 0x55 },
        ModelMessage::Registered {
            model: ModelInfo {
                fingerprint: fp(2),
                blocks: 3,
                weight_bytes: 497_759_232,
                device: "cuda:1".into(),
                executions: 0,
                owners: vec!["acme".into(), "globex".into()],
            },
        },
        ModelMessage::Execute {
            fingerprint: fp(3),
            tensors: vec![t(DType::I64, &[1, 16]), t(DType::F32, &[1, 16, 8])],
            // Every kind of value, nested.
            inputs: vec![
                Value::Tensor(0),
                Value::Dict(vec![
                    (s("mask"), Value::Tensor(1)),
                    (Value::Int(-42), Value::Float(-0.375)),
                    (s("opts"), Value::Tuple(vec![Value::Bool(true), Value::None, Value::Bool(false)])),
                ]),
                Value::List(vec![Value::Handle(h(9, 0x0bad_cafe)), s("é✓"), Value::List(vec![])]),
                Value::Float(6.022_140_76e23),
            ],
            keep: true,
            until: Some(Breakpoint { block: 3, send_activation: false }),
        },
        ModelMessage::ExecuteReply {
            tensors: vec![t(DType::F32, &[1, 16, 50_257]), t(DType::F16, &[2, 1, 12, 16, 64])],
            output: Value::Tuple(vec![
                Value::Tensor(0),
                Value::Dict(vec![
                    (s("past"), Value::Tensor(1)),
                    (s("kept"), Value::Handle(h(31, 0x1234_5678_9abc_def0))),
                ]),
                Value::Int(i64::MIN),
            ]),
            kept: vec![
                HandleInfo { handle: h(31, 0x1234_5678_9abc_def0), tensor: t(DType::I32, &[5, 5]) },
                HandleInfo { handle: h(32, 0x1234_5678_9abc_def0), tensor: t(DType::F64, &[]) },
            ],
        },
        ModelMessage::Unregister { fingerprint: fp(4) },
        ModelMessage::UnregisterAck,
        ModelMessage::ListModels,
        ModelMessage::ModelList {
            models: vec![
                ModelInfo {
                    fingerprint: fp(5),
                    blocks: 1,
                    weight_bytes: 1024,
                    device: "cpu".into(),
                    executions: 77,
                    owners: vec![],
                },
                ModelInfo {
                    fingerprint: fp(6),
                    blocks: 24,
                    weight_bytes: 14 << 30,
                    device: "cuda:0".into(),
                    executions: u64::MAX,
                    owners: vec!["initech".into()],
                },
            ],
        },
        ModelMessage::ReadArchives { fingerprint: fp(7), offset: 65_536, len: 1 << 20 },
        ModelMessage::ArchiveBytes { blocks: vec![10, 20, 30], public: false, chunk: t(DType::U8, &[64]) },
    ];
    let kept = [
        KeptMessage::Keep { tensor: t(DType::I16, &[8, 2]) },
        KeptMessage::Kept { kept: HandleInfo { handle: h(100, 0xaaaa), tensor: t(DType::I16, &[8, 2]) } },
        KeptMessage::Fetch { handle: h(101, 0xbbbb) },
        KeptMessage::Release { handles: vec![h(1, 2), h(3, 4), h(u64::MAX, 0)] },
        KeptMessage::Released { released: 2 },
        KeptMessage::Push {
            source: TensorSource::Handle(h(102, 0xcccc)),
            to: "10.0.0.7:7070".into(),
            grant: "g-1f2e".into(),
        },
        KeptMessage::Pushed {
            kept: HandleInfo { handle: h(5, 0xdddd), tensor: t(DType::BF16, &[128]) },
            path: "rdma".into(),
        },
        KeptMessage::PushGrant { tensor: t(DType::F64, &[3, 3]) },
        KeptMessage::PushGranted { grant: "grant:0123456789abcdef".into() },
        KeptMessage::List { after: 99 },
        KeptMessage::KeptList {
            tensors: vec![
                KeptEntry {
                    tenant: "acme".into(),
                    kept: HandleInfo { handle: h(7, 0xeeee), tensor: t(DType::U8, &[0]) },
                },
                KeptEntry {
                    tenant: String::new(),
                    kept: HandleInfo { handle: h(8, 0xeeee), tensor: t(DType::Bool, &[2, 2]) },
                },
            ],
            more: false,
        },
        KeptMessage::Forward {
            handle: h(11, 0xf00d),
            to: "node-b.internal:7070".into(),
            kept: HandleInfo { handle: h(12, 0xbeef), tensor: t(DType::F32, &[6]) },
        },
        KeptMessage::Forwarded,
        KeptMessage::Moved {
            to: "node-c.internal:7070".into(),
            kept: HandleInfo { handle: h(13, 0xc0de), tensor: t(DType::I8, &[1, 1, 1]) },
        },
    ];
    let sessions = [
        SessionMessage::Open {
            fingerprint: fp(8),
            state: vec![t(DType::F16, &[2, 8, 64]), t(DType::F16, &[2, 8, 64]), t(DType::I64, &[])],
            reserve: 3 << 20,
        },
        SessionMessage::Opened { session: h(200, 0x5e55) },
        SessionMessage::Step {
            session: h(200, 0x5e55),
            tensors: vec![t(DType::I64, &[1, 1])],
            inputs: vec![Value::Tensor(0), Value::Int(17)],
            until: None,
        },
        SessionMessage::Signal { session: h(200, 0x5e55), signal: Signal::IoWait { resume_in_ms: Some(1500) } },
        SessionMessage::Signaled,
        SessionMessage::Close { session: h(201, 0x5e55) },
        SessionMessage::Closed,
        SessionMessage::Move { session: h(202, 0x5e55), to: "[::1]:7071".into(), grant: "mv-9".into() },
        SessionMessage::Moved { to: "[::1]:7071".into(), session: h(3, 0x7777) },
        SessionMessage::ReceiveGrant { fingerprint: fp(9) },
        SessionMessage::List { after: 0 },
        SessionMessage::SessionList {
            sessions: vec![
                SessionEntry { tenant: "acme".into(), session: h(1, 0x10), fingerprint: fp(10), state_bytes: 4096 },
                SessionEntry { tenant: "globex".into(), session: h(2, 0x20), fingerprint: fp(11), state_bytes: 0 },
            ],
            more: true,
        },
    ];
    let breakpoints = [
        BreakpointMessage::Paused {
            parked: h(300, 0x9a4c),
            block: 5,
            tensors: vec![t(DType::BF16, &[1, 16, 768]), t(DType::I32, &[16])],
            activation: Some(Value::Tuple(vec![Value::Tensor(0), Value::Tensor(1), Value::None])),
        },
        BreakpointMessage::Resume {
            parked: h(300, 0x9a4c),
            tensors: vec![],
            activation: None,
            until: Some(Breakpoint { block: 7, send_activation: true }),
        },
        BreakpointMessage::Inspect { parked: h(301, 0x9a4c) },
        BreakpointMessage::Abort { parked: h(302, 0x9a4c) },
        BreakpointMessage::Aborted,
    ];
    data.into_iter()
        .map(Message::from)
        .chain(models.into_iter().map(Message::from))
        .chain(kept.into_iter().map(Message::from))
        .chain(sessions.into_iter().map(Message::from))
        .chain(breakpoints.into_iter().map(Message::from))
        .collect()
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::with_capacity(2 * bytes.len()), |mut out, b| {
        let _ = write!(out, "{b:02x}");
        out
    })
}

fn from_hex(text: &str) -> Result<Vec<u8>, String> {
    if !text.len().is_multiple_of(2) || !text.is_ascii() {
        return Err(format!("{} characters of hex", text.len()));
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).map_err(|e| format!("{:?}: {e}", &text[i..i + 2])))
        .collect()
}

/// The frame head of `message`: what the golden holds.
fn head(message: &Message) -> Vec<u8> {
    let mut out = Vec::new();
    append_head(&mut out, REQUEST_ID, message).expect("a fixed message encodes");
    out
}

/// The golden's lines by kind name; a name on two lines is an error.
fn parse_golden(text: &str) -> BTreeMap<String, Vec<u8>> {
    let mut lines = BTreeMap::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let (name, hex) = line.split_once(' ').unwrap_or_else(|| panic!("golden line {}: not `KIND HEX`", n + 1));
        let bytes = from_hex(hex.trim()).unwrap_or_else(|e| panic!("golden line {} ({name}): bad hex: {e}", n + 1));
        assert!(lines.insert(name.to_owned(), bytes).is_none(), "golden line {}: {name} appears twice", n + 1);
    }
    lines
}

/// Reads a golden frame head back: the header, then the message from its metadata.
fn decode(name: &str, bytes: &[u8]) -> Message {
    let limits = Limits::default();
    let header = FrameHeader::parse(bytes).unwrap_or_else(|| panic!("{name}: shorter than a header"));
    header.validate(&limits).unwrap_or_else(|e| panic!("{name}: bad header: {e}"));
    assert_eq!(header.request_id.get(), REQUEST_ID, "{name}: request id");
    assert_eq!(header.meta_len.get() as usize, bytes.len() - HEADER_LEN, "{name}: metadata length");
    let kind =
        Kind::from_wire(header.kind.get()).unwrap_or_else(|| panic!("{name}: unknown kind {:#x}", header.kind.get()));
    assert_eq!(kind.name(), name, "{name}: the header's kind");
    let message = Message::decode(kind, &bytes[HEADER_LEN..], &limits).unwrap_or_else(|e| panic!("{name}: {e}"));
    let payload = payload_len(message.tensors()).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(header.payload_len.get(), payload, "{name}: payload length");
    message
}

#[test]
fn every_message_keeps_its_wire_bytes() {
    let messages = messages();

    // Every kind exactly once among the hand-written messages.
    let mut written = BTreeSet::new();
    for m in &messages {
        assert!(written.insert(m.kind().name()), "{} is written twice", m.kind().name());
    }
    let all: BTreeSet<_> = Kind::all().map(Kind::name).collect();
    let missing: Vec<_> = all.difference(&written).collect();
    assert!(missing.is_empty(), "no golden message of {missing:?}: write one in `messages()`");

    let path = golden_path();
    if std::env::var("DJINN_GOLDEN_WRITE").as_deref() == Ok("1") {
        let text: String = messages.iter().map(|m| format!("{} {}\n", m.kind().name(), to_hex(&head(m)))).collect();
        std::fs::create_dir_all(path.parent().expect("the golden is in a folder")).expect("golden folder");
        std::fs::write(&path, text).expect("golden written");
        eprintln!("wrote {}", path.display());
    }

    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let golden = parse_golden(&text);
    let in_golden: BTreeSet<_> = golden.keys().map(String::as_str).collect();
    assert_eq!(in_golden, all, "the golden's kinds are not every kind");

    let mut failures = Vec::new();
    for m in &messages {
        let name = m.kind().name();
        let expected = &golden[name];
        let actual = head(m);
        if &actual != expected {
            failures.push(format!("{name}\n  golden:  {}\n  encoded: {}", to_hex(expected), to_hex(&actual)));
        }
    }
    assert!(
        failures.is_empty(),
        "the encoding of {} kind(s) differs from {}:\n{}\n\nThe wire protocol must not change without a new \
         PROTOCOL_VERSION; with one, regenerate the golden: DJINN_GOLDEN_WRITE=1 cargo test -p djinn-proto --test golden",
        failures.len(),
        path.display(),
        failures.join("\n"),
    );

    // The other direction: what an older peer sent still reads as the same message.
    for m in &messages {
        let name = m.kind().name();
        assert_eq!(&decode(name, &golden[name]), m, "{name}: the golden bytes decode to another message");
    }
}

/// The forms the one message per kind above leaves out, pinned by hand: each error code's number
/// (stable on the wire), the other signals, and a push from a named tensor.
#[test]
fn other_variants_keep_their_wire_bytes() {
    let codes = [
        (ErrorCode::BadMagic, 1),
        (ErrorCode::VersionMismatch, 2),
        (ErrorCode::BadFlags, 3),
        (ErrorCode::FrameTooLarge, 4),
        (ErrorCode::MetaTooLarge, 5),
        (ErrorCode::Truncated, 6),
        (ErrorCode::UnknownKind, 7),
        (ErrorCode::MalformedMeta, 8),
        (ErrorCode::BadDescriptor, 9),
        (ErrorCode::PayloadMismatch, 10),
        (ErrorCode::NotFound, 11),
        (ErrorCode::OverBudget, 12),
        (ErrorCode::Unexpected, 13),
        (ErrorCode::OutOfMemory, 14),
        (ErrorCode::Internal, 15),
        (ErrorCode::UnknownModel, 16),
        (ErrorCode::BadArchive, 17),
        (ErrorCode::ExecutionFailed, 18),
        (ErrorCode::Busy, 19),
        (ErrorCode::StaleHandle, 20),
        (ErrorCode::PeerUnreachable, 21),
        (ErrorCode::BadBreakpoint, 22),
        (ErrorCode::Unauthenticated, 23),
        (ErrorCode::Forbidden, 24),
        (ErrorCode::QuotaExceeded, 25),
        (ErrorCode::GraphRefused, 26),
        (ErrorCode::DeadlineExceeded, 27),
        (ErrorCode::Other(0x7fff), 0x7fff),
    ];
    for (code, wire) in codes {
        assert_eq!(code.to_wire(), wire, "{code:?}");
        assert_eq!(ErrorCode::from_wire(wire), code, "{wire}");
        let message = Message::error(code, "x");
        let meta = &head(&message)[HEADER_LEN..];
        let mut expected = wire.to_le_bytes().to_vec();
        expected.extend_from_slice(&[1, 0, b'x']);
        assert_eq!(meta, expected, "{code:?}");
    }

    let session = h(0x0102, 0x0a0b);
    let handle_bytes = [0x0102u64.to_le_bytes(), 0x0a0bu64.to_le_bytes()].concat();
    let cases: [(Message, Vec<u8>); 3] = [
        // The handle, signal tag 0 (I/O wait), no resume time.
        (
            SessionMessage::Signal { session, signal: Signal::IoWait { resume_in_ms: None } }.into(),
            [handle_bytes.as_slice(), &[0, 0]].concat(),
        ),
        // The handle, signal tag 1 (compute).
        (SessionMessage::Signal { session, signal: Signal::Compute }.into(), [handle_bytes.as_slice(), &[1]].concat()),
        // Source tag 0 (a named tensor) and its name, the address, an empty grant.
        (
            KeptMessage::Push { source: TensorSource::Named("w".into()), to: "n:1".into(), grant: String::new() }
                .into(),
            vec![0, 1, 0, b'w', 3, 0, b'n', b':', b'1', 0, 0],
        ),
    ];
    for (message, expected) in cases {
        let name = message.kind().name();
        let bytes = head(&message);
        assert_eq!(&bytes[HEADER_LEN..], expected, "{name}");
        assert_eq!(decode(name, &bytes), message, "{name}");
    }
}
