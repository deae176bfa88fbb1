//! Authenticated clients and isolated tenants: a node or control plane with a token file lets in
//! only the tokens it names, rotates them without a restart, and keeps each tenant's models,
//! tensors, handles, sessions and parked requests out of every other tenant's reach.

mod support;

use std::io::Write;
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use djinn_client::{Breakpoint, Client, ClientError, ClientOptions, DType, ErrorCode, TensorRef, TensorSource, Value};
use djinn_proto::{
    DataKind, DataMessage, FrameHeader, Hello, Kind, Limits, Message, ModelMessage, SessionMessage, TensorDesc,
    encode_head, transports,
};
use support::{Node, archive, f32_bytes, read_reply, register, spawn_listening};

const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-0123456789ab";
const NODES: &str = "node-token-0123456789a";
const OPS: &str = "ops-token-0123456789ab";
/// A tenant without the right to register TorchScript.
const MALLORY: &str = "mallory-token-012345678";

fn token_file(dir: &Path, alice: &str) -> std::path::PathBuf {
    let path = dir.join("tokens.json");
    let json = serde_json::json!({ "principals": [
        { "name": "alice", "tokens": [alice], "rights": ["torchscript"] },
        { "name": "bob", "tokens": [BOB], "rights": ["torchscript"] },
        { "name": "mallory", "tokens": [MALLORY] },
        { "name": "nodes", "role": "node", "tokens": [NODES] },
        { "name": "ops", "role": "admin", "tokens": [OPS] },
    ]});
    // Written whole and renamed: the watcher never reads half a file.
    let tmp = dir.join("tokens.json.tmp");
    std::fs::write(&tmp, json.to_string()).expect("write the token file");
    std::fs::rename(&tmp, &path).expect("install the token file");
    path
}

fn node_with_auth(file: &Path) -> Node {
    Node::start("mio", &["--auth-file", file.to_str().expect("utf-8 path")])
}

fn connect(node: &Node, token: &str) -> Result<Client, ClientError> {
    let options =
        ClientOptions { token: token.to_owned(), timeout: Some(Duration::from_secs(10)), ..Default::default() };
    Client::connect_with(node.addr, options)
}

fn code<T: std::fmt::Debug>(result: Result<T, ClientError>) -> ErrorCode {
    result.expect_err("refused").remote_code().expect("a typed refusal from the node")
}

#[test]
fn only_known_tokens_get_in() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_auth(&token_file(dir.path(), ALICE));
    assert_eq!(code(connect(&node, "")), ErrorCode::Unauthenticated);
    assert_eq!(code(connect(&node, "alice-token-0123456788")), ErrorCode::Unauthenticated);
    let mut alice = connect(&node, ALICE).expect("alice's token");
    alice.put("x", DType::U8, &[3], &[1, 2, 3]).expect("put");

    // Before a hello, a request is refused and its payload never allocated; the connection
    // stays, and a hello with a valid token opens it.
    let mut raw = TcpStream::connect(node.addr).unwrap();
    let frame = |id, message: &Message, payload: &[u8]| {
        let mut wire = Vec::new();
        encode_head(&mut wire, id, message).unwrap();
        wire.extend_from_slice(payload);
        wire
    };
    let desc = TensorDesc::new(DType::U8, vec![1 << 20]).unwrap();
    raw.write_all(&frame(7, &Message::Data(DataMessage::Put { name: "y".into(), tensor: desc }), &vec![0u8; 1 << 20]))
        .unwrap();
    let (header, reply, _) = read_reply(&mut raw);
    assert_eq!(header.request_id.get(), 7);
    assert!(matches!(reply, Message::Data(DataMessage::Error { code: ErrorCode::Unauthenticated, .. })), "{reply:?}");
    let hello = Hello { token: BOB.into(), ..Hello::new(&Limits::default(), transports::TCP, "raw") };
    raw.write_all(&frame(8, &Message::Data(DataMessage::Hello(hello)), &[])).unwrap();
    assert!(matches!(read_reply(&mut raw).1, Message::Data(DataMessage::HelloAck(_))));
    raw.write_all(&frame(9, &Message::Data(DataMessage::Get { name: "x".into() }), &[])).unwrap();
    assert!(
        matches!(read_reply(&mut raw).1, Message::Data(DataMessage::Error { code: ErrorCode::NotFound, .. })),
        "bob does not see alice's tensor"
    );

    assert_eq!(node.stat(&mut alice, "auth_failures"), 2);
    assert_eq!(node.stat(&mut alice, "store_tensors"), 1, "the refused put stored nothing");
    assert_eq!(alice.get("x").expect("still served").bytes(), &[1, 2, 3]);
}

#[test]
fn a_tenant_cannot_reach_another_tenants_entries() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_auth(&token_file(dir.path(), ALICE));
    let mut alice = connect(&node, ALICE).unwrap();
    let mut bob = connect(&node, BOB).unwrap();

    // Named tensors: the same name is two tensors.
    alice.put("w", DType::U8, &[2], &[1, 2]).unwrap();
    assert_eq!(code(bob.get("w")), ErrorCode::NotFound);
    assert!(bob.list().unwrap().is_empty());
    assert_eq!(code(bob.delete("w")), ErrorCode::NotFound);
    bob.put("w", DType::U8, &[1], &[9]).unwrap();
    assert_eq!(alice.get("w").unwrap().bytes(), &[1, 2]);
    assert_eq!(alice.list().unwrap().len(), 1);

    // Models, by fingerprint.
    let mlp = register(&mut alice, &["mlp.block0", "mlp.block1", "mlp.block2"]);
    let x = f32_bytes(4 * 256, 1);
    let input = [TensorRef { dtype: DType::F32, shape: &[4, 256], bytes: &x }];
    assert_eq!(code(bob.execute(&mlp, &[Value::Tensor(0)], &input)), ErrorCode::UnknownModel);
    assert_eq!(code(bob.unregister_model(&mlp)), ErrorCode::UnknownModel);
    assert!(bob.list_models().unwrap().is_empty());
    assert_eq!(code(bob.session_open(&mlp, &[], 0)), ErrorCode::UnknownModel);

    // Kept tensors, by handle: fetch, release, use as an input, push.
    let kept = alice.execute_keep(&mlp, &[Value::Tensor(0)], &input).unwrap().kept[0].handle;
    assert_eq!(code(bob.fetch(kept)), ErrorCode::NotFound);
    assert_eq!(bob.release(&[kept]).unwrap(), 0);
    let _bob_model = register(&mut bob, &["mlp.block0", "mlp.block1", "mlp.block2"]);
    assert_eq!(code(bob.execute(&mlp, &[Value::Handle(kept)], &[])), ErrorCode::NotFound);
    assert_eq!(code(bob.push(TensorSource::Handle(kept), &node.addr.to_string(), "unused")), ErrorCode::NotFound);
    assert_eq!(code(bob.push(TensorSource::Named("w".into()), "127.0.0.1:1", "unused")), ErrorCode::Forbidden);
    assert_eq!(alice.fetch(kept).unwrap().desc.shape, vec![4, 256]);

    // Parked requests, by handle.
    let until = Breakpoint { block: 0, send_activation: false };
    let paused = alice.execute_until(&mlp, &[Value::Tensor(0)], &input, false, until).unwrap();
    assert_eq!(code(bob.inspect(paused.parked)), ErrorCode::NotFound);
    assert_eq!(code(bob.abort(paused.parked)), ErrorCode::NotFound);
    assert_eq!(code(bob.resume(paused.parked, None, None)), ErrorCode::NotFound);
    alice.abort(paused.parked).expect("alice's own parked request");

    // Sessions, by handle.
    let counter = register(&mut alice, &["counter"]);
    let zero = 0i64.to_le_bytes();
    let state = [
        TensorRef { dtype: DType::F32, shape: &[3], bytes: &[0u8; 12] },
        TensorRef { dtype: DType::I64, shape: &[], bytes: &zero },
    ];
    let session = alice.session_open(&counter, &state, 0).unwrap();
    let step = [TensorRef { dtype: DType::F32, shape: &[3], bytes: &[0u8; 12] }];
    assert_eq!(code(bob.session_step(session, &[Value::Tensor(0)], &step)), ErrorCode::NotFound);
    assert_eq!(code(bob.session_close(session)), ErrorCode::NotFound);
    alice.session_step(session, &[Value::Tensor(0)], &step).expect("alice's own session");
    alice.session_close(session).unwrap();
}

#[test]
fn public_weights_are_held_once_and_private_ones_once_per_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_auth(&token_file(dir.path(), ALICE));
    let mut alice = connect(&node, ALICE).unwrap();
    let mut bob = connect(&node, BOB).unwrap();
    let mlp = vec![archive("mlp")];

    let a = alice.register_model(&mlp, |_, _| {}).unwrap();
    let b = bob.register_model(&mlp, |_, _| {}).unwrap();
    assert!(a.uploaded.is_some() && b.uploaded.is_some(), "a private registration never finds another tenant's");
    let weight_bytes = a.uploaded.as_ref().unwrap().weight_bytes;
    assert_eq!(node.stat(&mut alice, "models"), 2);
    assert_eq!(node.stat(&mut alice, "model_bytes"), 2 * weight_bytes);

    let shared = vec![archive("mlp.block0")];
    let a = alice.register_public_model(&shared, |_, _| {}).unwrap();
    let b = bob.register_public_model(&shared, |_, _| {}).unwrap();
    assert!(a.uploaded.is_some());
    assert!(b.uploaded.is_none(), "bob's public registration finds alice's public copy: nothing is sent");
    assert_eq!(node.stat(&mut alice, "models"), 3);
    let x = f32_bytes(4 * 256, 2);
    let input = [TensorRef { dtype: DType::F32, shape: &[4, 256], bytes: &x }];
    let from_alice = alice.execute(&a.fingerprint, &[Value::Tensor(0)], &input).unwrap();
    let from_bob = bob.execute(&a.fingerprint, &[Value::Tensor(0)], &input).unwrap();
    assert_eq!(from_alice.tensor_bytes(0), from_bob.tensor_bytes(0));

    // The copy stays while a tenant holds it.
    alice.unregister_model(&a.fingerprint).unwrap();
    assert_eq!(code(alice.execute(&a.fingerprint, &[Value::Tensor(0)], &input)), ErrorCode::UnknownModel);
    bob.execute(&a.fingerprint, &[Value::Tensor(0)], &input).expect("bob still holds it");
    assert_eq!(node.stat(&mut alice, "models"), 3);
    bob.unregister_model(&a.fingerprint).unwrap();
    node.wait_for_stat(&mut alice, "models", 2);
}

/// A TorchScript archive is code that runs on the node: only a principal given the right
/// registers one, even bytes the node holds already (public ones included); without it the
/// tenant is refused, typed, and served otherwise. A node without a token file trusts its user.
#[test]
fn only_principals_given_the_right_register_torchscript() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_auth(&token_file(dir.path(), ALICE));
    let mut alice = connect(&node, ALICE).unwrap();
    let mut mallory = connect(&node, MALLORY).unwrap();
    let mlp = vec![archive("mlp.block0")];
    let public = alice.register_public_model(&mlp, |_, _| {}).expect("alice has the right");
    for result in [mallory.register_model(&mlp, |_, _| {}), mallory.register_public_model(&mlp, |_, _| {})] {
        let err = result.expect_err("mallory has no right to register TorchScript");
        assert_eq!(err.remote_code(), Some(ErrorCode::Forbidden), "{err}");
        assert!(err.to_string().contains(r#"the right "torchscript""#), "{err}");
    }
    let x = f32_bytes(4 * 256, 2);
    let input = [TensorRef { dtype: DType::F32, shape: &[4, 256], bytes: &x }];
    assert_eq!(code(mallory.execute(&public.fingerprint, &[Value::Tensor(0)], &input)), ErrorCode::UnknownModel);
    mallory.put("x", DType::U8, &[3], &[1, 2, 3]).expect("mallory is served otherwise");
    assert_eq!(node.stat(&mut alice, "models"), 1);

    let open = Node::start("mio", &[]);
    register(&mut open.client(), &["mlp"]);
}

#[test]
fn quotas_hold_each_tenant_to_its_own() {
    const CAROL: &str = "carol-token-0123456789";
    const DAVE: &str = "dave-token-0123456789a";
    const ERIN: &str = "erin-token-0123456789a";
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.json");
    let json = serde_json::json!({ "principals": [
        { "name": "alice", "tokens": [ALICE], "rights": ["torchscript"], "quota": { "device_memory": 1 << 20 } },
        { "name": "bob", "tokens": [BOB], "rights": ["torchscript"] },
        { "name": "carol", "tokens": [CAROL], "rights": ["torchscript"], "quota": { "requests_per_second": 0.1, "burst": 3 } },
        { "name": "dave", "tokens": [DAVE], "rights": ["torchscript"], "quota": { "concurrent_requests": 1 } },
        { "name": "erin", "tokens": [ERIN], "rights": ["torchscript"], "quota": { "host_swap": 64 } },
    ]});
    std::fs::write(&file, json.to_string()).unwrap();
    let node = Node::start("mio", &["--auth-file", file.to_str().unwrap(), "--session-policy", "semantic"]);
    let mut alice = connect(&node, ALICE).unwrap();
    let mut bob = connect(&node, BOB).unwrap();

    // Device memory: alice's second tensor does not fit her quota, and is refused before its
    // bytes are stored; bob, without a quota, stores more than that on the same node.
    let k768 = vec![7u8; 768 << 10];
    alice.put("a", DType::U8, &[k768.len() as u64], &k768).unwrap();
    assert_eq!(code(alice.put("b", DType::U8, &[512 << 10], &[0u8; 512 << 10])), ErrorCode::QuotaExceeded);
    // A model's weights count too.
    let refused = alice.register_model(&[archive("mlp")], |_, _| {});
    assert_eq!(code(refused), ErrorCode::QuotaExceeded);
    bob.put("a", DType::U8, &[k768.len() as u64], &k768).unwrap();
    bob.put("b", DType::U8, &[k768.len() as u64], &k768).unwrap();
    register(&mut bob, &["mlp.block0", "mlp.block1", "mlp.block2"]);
    alice.delete("a").unwrap();
    alice.put("b", DType::U8, &[512 << 10], &[0u8; 512 << 10]).expect("room again once her tensor is gone");

    // Request rate: a burst of 3, then one request per 10 s.
    let mut carol = connect(&node, CAROL).unwrap();
    for _ in 0..2 {
        carol.list().expect("within the burst (the hello took none of it)");
    }
    carol.put("c", DType::U8, &[4], &[1, 2, 3, 4]).expect("within the burst");
    assert_eq!(code(carol.list()), ErrorCode::QuotaExceeded);
    assert_eq!(code(carol.put("d", DType::U8, &[4], &[1, 2, 3, 4])), ErrorCode::QuotaExceeded);
    bob.list().expect("another tenant's rate is its own");

    // Requests at once: three lists of sessions written together; the first goes to a worker,
    // the two others find dave's one request in flight.
    let mut raw = TcpStream::connect(node.addr).unwrap();
    let frame = |id, message: &Message| {
        let mut wire = Vec::new();
        encode_head(&mut wire, id, message).unwrap();
        wire
    };
    let hello = Hello { token: DAVE.into(), ..Hello::new(&Limits::default(), transports::TCP, "raw") };
    raw.write_all(&frame(1, &Message::Data(DataMessage::Hello(hello)))).unwrap();
    assert!(matches!(read_reply(&mut raw).1, Message::Data(DataMessage::HelloAck(_))));
    let list = Message::Session(SessionMessage::List { after: 0 });
    raw.write_all(&[frame(2, &list), frame(3, &list), frame(4, &list)].concat()).unwrap();
    let mut replies: Vec<(u64, Message)> = (0..3)
        .map(|_| {
            let (header, reply, _) = read_reply(&mut raw);
            (header.request_id.get(), reply)
        })
        .collect();
    replies.sort_by_key(|r| r.0);
    assert!(matches!(replies[0].1, Message::Session(SessionMessage::SessionList { .. })), "{:?}", replies[0]);
    for (_, reply) in &replies[1..] {
        assert!(matches!(reply, Message::Data(DataMessage::Error { code: ErrorCode::QuotaExceeded, .. })), "{reply:?}");
    }
    raw.write_all(&frame(5, &list)).unwrap();
    assert!(
        !matches!(read_reply(&mut raw).1, Message::Data(DataMessage::Error { code: ErrorCode::QuotaExceeded, .. })),
        "answered: the next one is let in"
    );
    assert_eq!(node.stat(&mut bob, "quota_refusals"), 4);

    // Host swap: erin's 128 bytes of session state do not fit her 64 in the host pool, so
    // IO_WAIT leaves them on the device; bob's go out.
    let mut erin = connect(&node, ERIN).unwrap();
    let rows = f32_bytes(8 * 4, 4);
    for (client, swapped) in [(&mut erin, 0), (&mut bob, 1)] {
        let cache = register(client, &["growing_cache"]);
        let empty = [TensorRef { dtype: DType::F32, shape: &[0, 4], bytes: &[] }];
        let session = client.session_open(&cache, &empty, 0).unwrap();
        let x = [TensorRef { dtype: DType::F32, shape: &[8, 4], bytes: &rows }];
        client.session_step(session, &[Value::Tensor(0)], &x).unwrap();
        client.session_signal(session, djinn_client::Signal::IoWait { resume_in_ms: None }).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while node.stat(client, "session_swaps_out") + node.stat(client, "session_swaps_refused") < 1 + swapped {
            assert!(Instant::now() < deadline, "the signal was not applied");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(node.stat(client, "session_swaps_out"), swapped);
        assert_eq!(node.stat(client, "session_swaps_refused"), 1);
        // Either way the session goes on.
        client.session_step(session, &[Value::Tensor(0)], &x).unwrap();
    }
}

#[test]
fn another_tenants_sessions_are_swapped_out_only_within_the_fair_share() {
    let dir = tempfile::tempdir().unwrap();
    let file = token_file(dir.path(), ALICE);
    let node = Node::start("mio", &["--auth-file", file.to_str().unwrap(), "--session-budget", "4KiB"]);
    let mut alice = connect(&node, ALICE).unwrap();
    let mut bob = connect(&node, BOB).unwrap();
    let open = |client: &mut Client, reserve: u64| {
        let cache = register(client, &["growing_cache"]);
        let empty = [TensorRef { dtype: DType::F32, shape: &[0, 4], bytes: &[] }];
        client.session_open(&cache, &empty, reserve).unwrap()
    };
    for _ in 0..3 {
        open(&mut alice, 1024);
    }
    // 1.5 KiB for bob: within his half of the 4 KiB, so one of alice's idle sessions goes to
    // the host pool.
    open(&mut bob, 1536);
    assert_eq!(node.stat(&mut bob, "session_swaps_out"), 1);
    // 3 KiB would be beyond his half: bob's own session makes room, not alice's.
    open(&mut bob, 1536);
    assert_eq!(node.stat(&mut bob, "session_swaps_out"), 2);
    assert_eq!(node.stat(&mut bob, "sessions_on_device"), 3, "alice keeps two on the device, bob one");
    // Nothing of his own left to swap and beyond his share: refused, alice's stay.
    let cache = register(&mut bob, &["growing_cache"]);
    let empty = [TensorRef { dtype: DType::F32, shape: &[0, 4], bytes: &[] }];
    assert_eq!(code(bob.session_open(&cache, &empty, 3072)), ErrorCode::OverBudget);
    assert_eq!(node.stat(&mut bob, "sessions_on_device"), 3);
}

#[test]
fn tokens_rotate_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let file = token_file(dir.path(), ALICE);
    let node = node_with_auth(&file);
    let mut before = connect(&node, ALICE).unwrap();
    before.put("t", DType::U8, &[1], &[5]).unwrap();

    let rotated = "alice-token-rotated-000";
    token_file(dir.path(), rotated);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut after = loop {
        match connect(&node, rotated) {
            Ok(client) => break client,
            Err(e) => {
                assert_eq!(e.remote_code(), Some(ErrorCode::Unauthenticated), "{e}");
                assert!(Instant::now() < deadline, "the new token was not taken within 10 s");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    assert_eq!(code(connect(&node, ALICE)), ErrorCode::Unauthenticated, "the old token is revoked");
    assert_eq!(after.get("t").unwrap().bytes(), &[5], "the same tenant under its new token");
    // A connection opened under the old token keeps its tenant until it closes.
    assert_eq!(before.get("t").unwrap().bytes(), &[5]);

    // A broken file leaves the tokens as they were: checked once the node has tried it (and
    // counted it refused).
    let refused = node.stat(&mut after, "token_reload_failures");
    std::fs::write(&file, "{ not json").unwrap();
    node.wait_for_stat_at_least(&mut after, "token_reload_failures", refused + 1);
    connect(&node, rotated).expect("the last good tokens stay");
    assert_eq!(code(connect(&node, ALICE)), ErrorCode::Unauthenticated, "and the old token stays revoked");
}

/// Two nodes of the token file `file`, each the other's push peer, and their addresses.
/// Neither has a node's token: a push or a move needs none, only the peer's grant.
fn peers_with_auth(file: &Path) -> ((support::Killed, String), (support::Killed, String)) {
    let (a_addr, b_addr) = (support::free_addr(), support::free_addr());
    let start = |listen: &str, peer: &str| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_djinn"));
        command.args(["node", "--listen", listen, "--push-peers", peer, "--log", "error", "--auth-file"]).arg(file);
        command.env_remove("DJINN_TOKEN");
        let (child, addr) = spawn_listening(command, "djinn node listening on ");
        (support::Killed(child), addr)
    };
    (start(&a_addr, &b_addr), start(&b_addr, &a_addr))
}

#[test]
fn a_push_lands_in_the_same_tenants_namespace_on_the_peer() {
    let dir = tempfile::tempdir().unwrap();
    let ((_a, a_addr), (_b, b_addr)) = peers_with_auth(&token_file(dir.path(), ALICE));
    let options = |token: &str| ClientOptions { token: token.to_owned(), ..Default::default() };
    let mut alice_a = Client::connect_with(a_addr.as_str(), options(ALICE)).unwrap();
    let mut alice_b = Client::connect_with(b_addr.as_str(), options(ALICE)).unwrap();
    let mut bob_b = Client::connect_with(b_addr.as_str(), options(BOB)).unwrap();

    let bytes = f32_bytes(64, 3);
    let kept = alice_a.keep(TensorRef { dtype: DType::F32, shape: &[64], bytes: &bytes }).unwrap();
    let first = alice_b.grant_push(&kept.tensor).unwrap();
    let (on_b, _path) = alice_a.push(TensorSource::Handle(kept.handle), &b_addr, &first).expect("push");
    assert_eq!(alice_b.fetch(on_b.handle).unwrap().bytes(), &bytes[..]);
    assert_eq!(code(bob_b.fetch(on_b.handle)), ErrorCode::NotFound);

    // And back.
    let mut alice_on_b = Client::connect_with(b_addr.as_str(), options(ALICE)).unwrap();
    let kept_b = alice_on_b.keep(TensorRef { dtype: DType::F32, shape: &[64], bytes: &bytes }).unwrap();
    let grant = alice_a.grant_push(&kept_b.tensor).unwrap();
    let (on_a, _) = alice_on_b.push(TensorSource::Handle(kept_b.handle), &a_addr, &grant).expect("push back");
    assert_eq!(alice_a.fetch(on_a.handle).unwrap().bytes(), &bytes[..]);

    // A grant is good once, for the tensor it names: a spent one, a made-up one and one for
    // another tensor are refused by the peer, in its words.
    let e = alice_a.push(TensorSource::Handle(kept.handle), &b_addr, &first).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::Unauthenticated), "a spent grant: {e}");
    assert!(e.to_string().contains("refused the push's grant"), "{e}");
    assert_eq!(
        code(alice_a.push(TensorSource::Handle(kept.handle), &b_addr, &"0".repeat(64))),
        ErrorCode::Unauthenticated
    );
    let other = alice_b.grant_push(&TensorDesc::new(DType::F32, vec![65]).unwrap()).unwrap();
    assert_eq!(code(alice_a.push(TensorSource::Handle(kept.handle), &b_addr, &other)), ErrorCode::Forbidden);

    // A grant is the tenant's: bob, holding alice's grant, cannot push into her memory.
    let mut bob_a = Client::connect_with(a_addr.as_str(), options(BOB)).unwrap();
    let bobs = bob_a.keep(TensorRef { dtype: DType::F32, shape: &[64], bytes: &bytes }).unwrap();
    let alices = alice_b.grant_push(&bobs.tensor).unwrap();
    assert_eq!(code(bob_a.push(TensorSource::Handle(bobs.handle), &b_addr, &alices)), ErrorCode::Unauthenticated);
}

/// A session moves only on a grant of its own tenant's, for its model, once; the node it moves
/// to opens it in that tenant's namespace, and the grant lets the moving node do nothing else.
#[test]
fn a_session_moves_only_on_its_tenants_grant_for_its_model() {
    let dir = tempfile::tempdir().unwrap();
    let ((_a, a_addr), (_b, b_addr)) = peers_with_auth(&token_file(dir.path(), ALICE));
    let options = |token: &str| ClientOptions { token: token.to_owned(), ..Default::default() };
    let client = |addr: &str, token: &str| Client::connect_with(addr, options(token)).unwrap();
    let (mut alice_a, mut alice_b, mut bob_a, mut bob_b) =
        (client(&a_addr, ALICE), client(&b_addr, ALICE), client(&a_addr, BOB), client(&b_addr, BOB));
    let model = register(&mut alice_a, &["counter"]);
    register(&mut alice_b, &["counter"]);
    register(&mut bob_a, &["counter"]);
    register(&mut bob_b, &["counter"]);
    let other_model = register(&mut alice_b, &["identity"]);
    let (zeros, zero) = (f32_bytes(3, 0), 0i64.to_le_bytes());
    let state = [
        TensorRef { dtype: DType::F32, shape: &[3], bytes: &zeros },
        TensorRef { dtype: DType::I64, shape: &[], bytes: &zero },
    ];
    let alices = alice_a.session_open(&model, &state, 0).unwrap();
    let bobs = bob_a.session_open(&model, &state, 0).unwrap();

    // Refused by B, in its words, and each time the session stays at A: bob's grant, a grant
    // for another model, a made-up one.
    let bobs_grant = bob_b.grant_session(&model).unwrap();
    assert_eq!(code(alice_a.session_move(alices, &b_addr, &bobs_grant)), ErrorCode::Unauthenticated);
    let for_identity = alice_b.grant_session(&other_model).unwrap();
    assert_eq!(code(alice_a.session_move(alices, &b_addr, &for_identity)), ErrorCode::Forbidden);
    assert_eq!(code(alice_a.session_move(alices, &b_addr, &"0".repeat(64))), ErrorCode::Unauthenticated);

    // Her own grant moves it, into her namespace there: bob cannot step it at B.
    let grant = alice_b.grant_session(&model).unwrap();
    let (_, moved) = alice_a.session_move(alices, &b_addr, &grant).expect("move");
    let x = f32_bytes(3, 1);
    let t = [TensorRef { dtype: DType::F32, shape: &[3], bytes: &x }];
    assert_eq!(code(bob_b.session_step(moved, &[Value::Tensor(0)], &t)), ErrorCode::NotFound);
    alice_b.session_step(moved, &[Value::Tensor(0)], &t).expect("alice steps it at B");
    // Bob is not told where alice's session went.
    assert_eq!(code(bob_a.session_step(alices, &[Value::Tensor(0)], &t)), ErrorCode::NotFound);
    // The grant is spent.
    assert_eq!(code(bob_a.session_move(bobs, &b_addr, &grant)), ErrorCode::Unauthenticated);
}

#[test]
fn the_control_plane_needs_tokens_and_the_right_role() {
    let dir = tempfile::tempdir().unwrap();
    let file = token_file(dir.path(), ALICE);
    let mut command = Command::new(env!("CARGO_BIN_EXE_djinn"));
    command
        .args(["control", "--listen", "127.0.0.1:0", "--log", "error", "--store"])
        .arg(dir.path().join("control.redb"))
        .args(["--max-models-per-tenant", "3", "--max-sessions-per-tenant", "2", "--auth-file"])
        .arg(&file);
    let (control, addr) = spawn_listening(command, "djinn control listening on ");
    let _control = support::Killed(control);
    let url = format!("http://{addr}");
    let http = ureq::Agent::config_builder().http_status_as_error(false).build().new_agent();
    let status = |method: &str, path: &str, token: Option<&str>| {
        let uri = format!("{url}{path}");
        let mut request = ureq::http::Request::builder().method(method).uri(uri);
        if let Some(t) = token {
            request = request.header("Authorization", format!("Bearer {t}"));
        }
        let body = if method == "GET" { String::new() } else { "{}".into() };
        let response = http.run(request.body(body).unwrap()).expect("the control plane answers");
        response.status().as_u16()
    };
    assert_eq!(status("GET", "/v1/whoami", None), 401);
    assert_eq!(status("GET", "/v1/whoami", Some("not-a-token-at-all")), 401);
    assert_eq!(status("GET", "/v1/whoami", Some(ALICE)), 200);
    assert_eq!(status("GET", "/v1/cluster", Some(ALICE)), 403, "a tenant does not see the whole cluster");
    assert_eq!(status("GET", "/metrics", Some(NODES)), 403);
    assert_eq!(status("GET", "/v1/cluster", Some(OPS)), 200);
    assert_eq!(status("POST", "/v1/nodes", Some(ALICE)), 403, "a tenant cannot join as a node");
    assert_eq!(status("POST", "/v1/nodes", Some(NODES)), 400, "a node may (this body is empty)");

    // A node with a node's token joins; the client reaches it through the control plane.
    let mut node = Command::new(env!("CARGO_BIN_EXE_djinn"));
    node.args(["node", "--listen", "127.0.0.1:0", "--log", "error", "--control", &url, "--flops", "1e12"])
        .args(["--memory-bandwidth", "1e11", "--host-to-device", "1e10", "--auth-file"])
        .arg(&file)
        .env("DJINN_TOKEN", NODES);
    let (node, _) = spawn_listening(node, "djinn node listening on ");
    let _node = support::Killed(node);
    let ops = djinn_client::ControlClient::new(&url, Duration::from_secs(5)).with_token(OPS);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ops.cluster().unwrap().contains("\"addr\"") {
        assert!(Instant::now() < deadline, "the node did not join");
        std::thread::sleep(Duration::from_millis(100));
    }
    let options = ClientOptions { token: ALICE.into(), ..Default::default() };
    let failover = djinn_client::FailoverOptions::default();
    let mut cluster = djinn_client::ClusterClient::open(&url, options, failover).expect("alice through the control");
    let registered = cluster.register_model(vec![archive("halves").into()], None, None, false, |_, _| {}).unwrap();
    assert!(registered.uploaded.is_some());

    // Model records are per tenant: bob does not see alice's description of the fingerprint,
    // and his own does not touch hers. The node reports alice's model under her name, so her
    // next placement goes to the node that holds it.
    let fp = registered.fingerprint;
    let key = format!("alice/{}", fp.to_hex());
    while !ops.cluster().unwrap().contains(&key) {
        assert!(Instant::now() < deadline, "the node did not report alice's model");
        std::thread::sleep(Duration::from_millis(100));
    }
    let as_alice = djinn_client::ControlClient::new(&url, Duration::from_secs(5)).with_token(ALICE);
    let as_bob = djinn_client::ControlClient::new(&url, Duration::from_secs(5)).with_token(BOB);
    assert_eq!(as_alice.place(&fp, None, None).unwrap().rule, "shared");
    let unknown = as_bob.place(&fp, None, None).unwrap_err();
    assert_eq!(unknown.kind(), Some("unknown_model"), "{unknown}");
    assert_eq!(status("GET", &format!("/v1/models/{}", fp.to_hex()), Some(BOB)), 404);
    assert_eq!(status("GET", &format!("/v1/models/{}", fp.to_hex()), Some(ALICE)), 200);
    assert_eq!(status("GET", &format!("/v1/models/bob%2F{}", fp.to_hex()), Some(ALICE)), 400);
    let options = ClientOptions { token: "wrong-token-0123456789".into(), ..Default::default() };
    let refused = djinn_client::ClusterClient::open(&url, options, djinn_client::FailoverOptions::default());
    assert!(refused.unwrap_err().to_string().contains("401"));

    // Records are capped per tenant (429, quota_exceeded): alice's full quota leaves bob's
    // alone, and a record or session she has may be described or placed again.
    let description = djinn_client::ModelDescription {
        blocks: vec![djinn_client::BlockEstimate { weight_bytes: 1024, flops: 1e6 }],
        io_bytes: 64,
        phase: None,
        graph: None,
    };
    let others: Vec<_> = (0..3u8).map(|i| djinn_client::Fingerprint::of_blocks(&[[i]])).collect();
    as_alice.describe_model(&others[0], &description).expect("alice's second record");
    as_alice.describe_model(&others[1], &description).expect("alice's third record");
    let over = as_alice.describe_model(&others[2], &description).unwrap_err();
    assert_eq!(over.kind(), Some("quota_exceeded"), "{over}");
    assert!(over.to_string().contains("429"), "{over}");
    as_alice.describe_model(&others[1], &description).expect("a record she has, described again");
    for i in 0..3u8 {
        as_bob.describe_model(&others[usize::from(i)], &description).expect("bob's records are his own");
    }
    as_alice.place(&fp, Some("s1"), None).expect("alice's first session");
    as_alice.place(&fp, Some("s2"), None).expect("alice's second session");
    let over = as_alice.place(&fp, Some("s3"), None).unwrap_err();
    assert_eq!(over.kind(), Some("quota_exceeded"), "{over}");
    as_alice.place(&fp, Some("s1"), None).expect("a session she has, placed again");
    as_bob.place(&others[0], Some("s1"), None).expect("bob's sessions are his own");
    as_bob.place(&others[0], Some("s2"), None).expect("bob's second session");

    // A record is bounded too (413, too_large): 512 blocks of the largest numbers are taken,
    // 513 are not, nor a body over 64 KiB, whatever it holds.
    let most = djinn_client::BlockEstimate { weight_bytes: u64::MAX / 512, flops: f64::MAX };
    let mut blocks = djinn_client::ModelDescription { blocks: vec![most; 512], ..description };
    as_bob.describe_model(&others[0], &blocks).expect("512 blocks");
    blocks.blocks.push(most);
    let over = as_bob.describe_model(&others[0], &blocks).unwrap_err();
    assert_eq!(over.kind(), Some("too_large"), "{over}");
    assert!(over.to_string().contains("413") && over.to_string().contains("513 blocks"), "{over}");
    let padded = format!(r#"{{"blocks": [{{"weight_bytes": 1, "flops": 1}}], "io_bytes": 0{}}}"#, " ".repeat(64 << 10));
    let uri = format!("{url}/v1/models/{}", others[0].to_hex());
    let request =
        ureq::http::Request::builder().method("PUT").uri(uri).header("Authorization", format!("Bearer {BOB}"));
    let response = http.run(request.body(padded).unwrap()).expect("the control plane answers");
    assert_eq!(response.status().as_u16(), 413);
}

/// A drain under a token file: only an operator starts one; the node moves each tenant's
/// sessions and kept tensors as that tenant (its model registered there in her name, her
/// rights checked), and each tenant finds her own where they went, and only her own.
#[test]
fn a_drain_moves_each_tenants_sessions_and_tensors_as_that_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let file = token_file(dir.path(), ALICE);
    let mut command = Command::new(env!("CARGO_BIN_EXE_djinn"));
    command
        .args(["control", "--listen", "127.0.0.1:0", "--log", "error", "--lease-ttl", "1s", "--store"])
        .arg(dir.path().join("control.redb"))
        .arg("--auth-file")
        .arg(&file);
    let (control, addr) = spawn_listening(command, "djinn control listening on ");
    let _control = support::Killed(control);
    let url = format!("http://{addr}");
    let nodes: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|name| {
            let mut node = Command::new(env!("CARGO_BIN_EXE_djinn"));
            node.args(["node", "--listen", "127.0.0.1:0", "--log", "error", "--control", &url, "--name", name])
                .args(["--flops", "1e12", "--memory-bandwidth", "1e11", "--host-to-device", "1e10", "--auth-file"])
                .arg(&file)
                .env("DJINN_TOKEN", NODES);
            let (node, addr) = spawn_listening(node, "djinn node listening on ");
            (support::Killed(node), addr)
        })
        .collect();
    let ops = djinn_client::ControlClient::new(&url, Duration::from_secs(5)).with_token(OPS);
    let deadline = Instant::now() + Duration::from_secs(20);
    while ops.live_nodes().unwrap().len() < 2 {
        assert!(Instant::now() < deadline, "the nodes did not join");
        std::thread::sleep(Duration::from_millis(50));
    }
    let victim = &nodes[0].1;
    let counter = archive("counter");
    let (zeros, zero) = ([0u8; 12], 0i64.to_le_bytes());
    let state = [
        TensorRef { dtype: DType::F32, shape: &[3], bytes: &zeros },
        TensorRef { dtype: DType::I64, shape: &[], bytes: &zero },
    ];
    // Alice and bob each keep a session of the same bytes (each a private model) and a tensor
    // on the node to drain.
    let tenants: Vec<_> = [ALICE, BOB]
        .into_iter()
        .enumerate()
        .map(|(i, token)| {
            let options = ClientOptions { token: token.into(), ..Default::default() };
            let mut client =
                djinn_client::ClusterClient::open(&url, options, djinn_client::FailoverOptions::default()).unwrap();
            let fp = client.register_model(vec![counter.clone().into()], None, None, false, |_, _| {}).unwrap();
            let mut session = client.session_open_on(victim, &fp.fingerprint, &state, 0).expect("open");
            let mut steps = support::Counter::new();
            let x = steps.input();
            let t = [TensorRef { dtype: DType::F32, shape: &[3], bytes: &x }];
            steps.check(&client.session_step(&mut session, &[Value::Tensor(0)], &t).unwrap());
            let bytes = f32_bytes(64, i as u64);
            let kept = client.keep(Some(victim), TensorRef { dtype: DType::F32, shape: &[64], bytes: &bytes });
            (client, session, steps, kept.expect("keep"), bytes)
        })
        .collect();

    let drain = |token: &str| {
        Command::new(env!("CARGO_BIN_EXE_djinn"))
            .args(["drain", "a", "--control", &url, "--timeout", "30"])
            .env("DJINN_TOKEN", token)
            .output()
            .expect("djinn drain")
    };
    let alices_session = tenants[0].1.session;
    let refused = drain(ALICE);
    assert!(!refused.status.success() && String::from_utf8_lossy(&refused.stderr).contains("403"), "{refused:?}");
    let drained = drain(OPS);
    assert!(drained.status.success(), "{}", String::from_utf8_lossy(&drained.stderr));

    let mut victim_client = connect_to(victim, NODES);
    let stats: std::collections::HashMap<String, u64> = victim_client.stats().unwrap().into_iter().collect();
    assert_eq!((stats["sessions"], stats["handles"]), (0, 0), "{stats:?}");
    assert_eq!((stats["sessions_moved_out"], stats["handles_moved_out"]), (2, 2), "{stats:?}");
    let mut tenants = tenants;
    let bobs_kept = tenants[1].3.clone();
    for (client, session, steps, kept, bytes) in &mut tenants {
        let x = steps.input();
        let t = [TensorRef { dtype: DType::F32, shape: &[3], bytes: &x }];
        steps.check(&client.session_step(session, &[Value::Tensor(0)], &t).expect("a step where it went"));
        assert_ne!(session.node, *victim);
        assert_eq!(client.fetch(kept).expect("the tensor where it went").bytes(), &bytes[..]);
    }
    // The control plane tells alice where her session went, and bob nothing of it.
    let as_tenant = |token: &str| djinn_client::ControlClient::new(&url, Duration::from_secs(5)).with_token(token);
    let hers = as_tenant(ALICE).forward("session", victim, alices_session).unwrap();
    assert_eq!(hers, Some((tenants[0].1.node.clone(), tenants[0].1.session)));
    assert_eq!(as_tenant(BOB).forward("session", victim, alices_session).unwrap(), None);
    // Alice is not led to bob's tensor through its old handle.
    let e = tenants[0].0.fetch(&bobs_kept).unwrap_err();
    assert!(matches!(&e, djinn_client::ClusterError::Node(ce) if ce.remote_code() == Some(ErrorCode::NotFound)), "{e}");
}

fn connect_to(addr: &str, token: &str) -> Client {
    let options = ClientOptions { token: token.to_owned(), ..Default::default() };
    Client::connect_with(addr, options).expect("connect")
}

/// Tokens kept in etcd: `djinn tokens put` checks a file before it writes it, a node and a
/// control plane started with `--auth-etcd` refuse to start without principals there, and both
/// take a rotation up without a restart.
#[test]
fn tokens_kept_in_etcd_rotate_on_every_process_at_once() {
    let etcd = djinn_control::store::local_etcd::LocalEtcd::start();
    let dir = tempfile::tempdir().unwrap();
    let djinn = || {
        let mut command = Command::new(env!("CARGO_BIN_EXE_djinn"));
        command.args(["--log", "error"]);
        command
    };
    let put = |file: &Path| djinn().args(["tokens", "put", "--etcd", &etcd.url]).arg(file).output().unwrap();
    let auth = ["--auth-etcd", etcd.url.as_str()];

    let refused = djinn().args(["node", "--listen", "127.0.0.1:0"]).args(auth).output().unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("no principals at"), "{refused:?}");
    let broken = dir.path().join("broken.json");
    std::fs::write(&broken, r#"{"principals": [{"name": "alice", "tokens": ["short"]}]}"#).unwrap();
    let out = put(&broken);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("shorter than"), "{out:?}");

    let out = put(&token_file(dir.path(), ALICE));
    assert!(out.status.success(), "{out:?}");
    let node = Node::start("mio", &auth);
    let mut control = djinn();
    control.args(["control", "--listen", "127.0.0.1:0", "--store"]).arg(dir.path().join("c.redb")).args(auth);
    let (control, addr) = spawn_listening(control, "djinn control listening on ");
    let _control = support::Killed(control);
    let whoami = |token: &str| {
        djinn_client::ControlClient::new(&format!("http://{addr}"), Duration::from_secs(5)).with_token(token).whoami()
    };
    connect(&node, ALICE).expect("alice's token at the node");
    assert_eq!(code(connect(&node, "alice-token-9999999999")), ErrorCode::Unauthenticated);
    whoami(ALICE).expect("alice's token at the control plane");

    let rotated = "alice-token-rotated-000";
    assert!(put(&token_file(dir.path(), rotated)).status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while connect(&node, rotated).is_err() || whoami(rotated).is_err() {
        assert!(Instant::now() < deadline, "the rotation did not reach both processes");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(code(connect(&node, ALICE)), ErrorCode::Unauthenticated, "the old token is revoked");
    assert!(whoami(ALICE).unwrap_err().to_string().contains("401"));
}

/// `djinn bench soak` runs end to end on a short run and checks its criteria: no wrong result,
/// every failure typed, memory back. Not the share of valid requests that succeed: on a loaded
/// machine requests time out (typed failures), so the test asks only that some succeeded.
#[test]
fn a_short_soak_passes() {
    let out = Command::new(env!("CARGO_BIN_EXE_djinn"))
        .args(["--log", "error", "bench", "soak", "--duration", "6", "--clients", "4", "--min-success", "0"])
        .output()
        .expect("run djinn bench soak");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("| wrong results | **0** |"), "{stdout}");
    assert!(stdout.contains("| failures that were not a typed error | **0** |"), "{stdout}");
    assert!(stdout.contains("restarted it after"), "{stdout}");
    // "| valid requests to the steady node | SENT sent, OK succeeded (**P%**) |"
    let succeeded = stdout
        .lines()
        .find_map(|l| l.strip_prefix("| valid requests to the steady node | "))
        .and_then(|row| row.split(" sent, ").nth(1)?.split(' ').next()?.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no count of valid requests to the steady node: {stdout}"));
    assert!(succeeded > 0, "no valid request to the steady node succeeded: {stdout}");
}

/// A connection from `source` to `to` (every 127.x.y.z address is this host's loopback, so
/// one host can play many sources).
fn connect_from(source: std::net::Ipv4Addr, to: std::net::SocketAddr) -> std::io::Result<TcpStream> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    socket.bind(&std::net::SocketAddr::from((source, 0)).into())?;
    socket.connect(&to.into())?;
    Ok(socket.into())
}

/// Strangers hold nothing for long: 2,000 connections, 1,000 that never say a good hello (silent,
/// or part-way through a frame head of a few KiB, or announcing 1 MiB of metadata) from 25
/// addresses, and 1,000 that say hello and go idle, are closed within their timeouts; more than
/// a source's share without a hello are refused at once; a client is served throughout, a new
/// one connects at any time, and the node's memory comes back. What closed each connection
/// shows in the node's counters: a refusal, a protocol failure (the metadata, at once), a hello
/// timeout or an idle one.
#[test]
fn connections_before_a_hello_and_idle_ones_are_bounded_and_closed() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid rlimits; the soft limit is raised within the hard one for the sockets below.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        limit.rlim_cur = limit.rlim_max.min(8192);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
    }
    assert!(limit.rlim_cur >= 4096, "this test needs 4096 open files, the hard limit is {}", limit.rlim_max);
    let dir = tempfile::tempdir().unwrap();
    let file = token_file(dir.path(), ALICE);
    let node = Node::start(
        "mio",
        &[
            "--auth-file",
            file.to_str().unwrap(),
            // Long enough that a source's 40 connections without a hello are still open when
            // its 41st comes (made right after them); no longer than the idle timeout, so that
            // the silent ones are closed (and counted) for want of a hello, not as idle.
            "--hello-timeout",
            "3",
            "--idle-timeout",
            "3",
            "--max-connections",
            "3000",
            "--max-unauthenticated",
            "1100",
            "--max-unauthenticated-per-source",
            "40",
        ],
    );
    let mut observer = connect(&node, OPS).unwrap();
    let mut alice = connect(&node, ALICE).unwrap();
    alice.put("x", DType::U8, &[4096], &vec![7u8; 4096]).unwrap();
    let baseline = node.rss();

    let stop = Arc::new(AtomicBool::new(false));
    let served = {
        let (stop, addr) = (Arc::clone(&stop), node.addr);
        thread::spawn(move || {
            let mut requests = 0;
            while !stop.load(Ordering::Relaxed) {
                assert_eq!(alice.get("x").expect("served throughout").bytes().len(), 4096);
                requests += 1;
                if requests % 20 == 0 {
                    let options = ClientOptions { token: ALICE.into(), ..Default::default() };
                    let mut new = Client::connect_with(addr, options).expect("a new client gets in");
                    new.get("x").expect("and is served");
                }
                thread::sleep(Duration::from_millis(20));
            }
            requests
        })
    };

    // A source over its share: refused at once.
    let crowd: Vec<TcpStream> =
        (0..40).map(|_| connect_from(std::net::Ipv4Addr::new(127, 0, 2, 1), node.addr).unwrap()).collect();
    let mut over = connect_from(std::net::Ipv4Addr::new(127, 0, 2, 1), node.addr).unwrap();
    node.wait_for_stat(&mut observer, "unauthenticated_refused", 1);
    support::read_until_closed(&mut over, "the 41st connection of one source is refused");

    let protocol_failures = node.stat(&mut observer, "protocol_failures");
    let (mut silent, mut partial, mut announcing) = (Vec::new(), Vec::new(), Vec::new());
    let mut head = Vec::new();
    encode_head(&mut head, 1, &Message::Data(DataMessage::Get { name: "x".repeat(1000) })).unwrap();
    let too_large = zerocopy::IntoBytes::as_bytes(&FrameHeader::new(Kind::Data(DataKind::Get), 1, 1 << 20, 0)).to_vec();
    for i in 0..1000u32 {
        let source = std::net::Ipv4Addr::new(127, 0, 1, 1 + (i % 25) as u8);
        let mut stream = connect_from(source, node.addr).unwrap();
        match i % 3 {
            0 => silent.push(stream),
            1 => {
                stream.write_all(&head[..head.len() - 10]).unwrap();
                partial.push(stream);
            }
            _ => {
                stream.write_all(&too_large).unwrap();
                announcing.push(stream);
            }
        }
    }
    let idle: Vec<Client> = (0..1000).map(|_| connect(&node, BOB).expect("bob gets in")).collect();
    let held = node.rss();

    // 1 MiB of metadata before a hello is a protocol failure, closed at once (not by the hello
    // timeout: those are counted apart, below).
    node.wait_for_stat(&mut observer, "protocol_failures", protocol_failures + announcing.len() as u64);
    for stream in &mut announcing {
        support::read_until_closed(stream, "1 MiB of metadata before a hello");
    }
    let timed_out = (silent.len() + partial.len() + crowd.len()) as u64;
    node.wait_for_stat(&mut observer, "hello_timeouts", timed_out);
    for stream in silent.iter_mut().chain(&mut partial) {
        support::read_until_closed(stream, "no hello within the hello timeout");
    }
    // The idle ones go after their timeout; the observer and alice's client stay (they move).
    node.wait_for_stat(&mut observer, "connections_open", 2);
    // (The observer's own connection may have idled too while the clients were made: it
    // reconnects, as every client does.)
    assert!(node.stat(&mut observer, "idle_closed") >= idle.len() as u64);
    assert_eq!(node.stat(&mut observer, "unauthenticated_refused"), 1);
    assert_eq!(node.stat(&mut observer, "hello_timeouts"), timed_out, "only those without a hello timed out");
    assert_eq!(node.stat(&mut observer, "protocol_failures"), protocol_failures + announcing.len() as u64);
    stop.store(true, Ordering::Relaxed);
    let requests = served.join().expect("the client was served throughout");
    assert!(requests > 100, "{requests} requests");
    // The node gives the memory back on a timeout tick (every three quarters of a second here)
    // a second after the burst of closes.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut after = node.rss();
    while after >= baseline + (16 << 20) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
        after = node.rss();
    }
    eprintln!("RSS: {} MiB before, {} MiB with 2,000 strangers, {} MiB after", baseline >> 20, held >> 20, after >> 20);
    assert!(after < baseline + (16 << 20), "RSS {after} after, {baseline} before");
    drop(idle);
}

/// Without tokens, a node, a control plane and `djinn up` serve loopback only, unless told
/// `--insecure`; with tokens they serve any address.
#[test]
fn without_tokens_only_loopback_is_served_unless_insecure() {
    let refuses = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_djinn")).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains("--insecure"), "{args:?}: {stderr}");
    };
    refuses(&["node", "--listen", "0.0.0.0:0", "--log", "error"]);
    refuses(&["control", "--listen", "0.0.0.0:0", "--log", "error"]);
    refuses(&["up", "--listen", "127.0.0.1:0", "--control-listen", "0.0.0.0:0", "--log", "error"]);
    let node = Node::start_at("0.0.0.0:0", "mio", &["--insecure"]);
    node.client().put("x", DType::U8, &[1], &[1]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = token_file(dir.path(), ALICE);
    let node = Node::start_at("0.0.0.0:0", "mio", &["--auth-file", file.to_str().unwrap()]);
    connect(&node, ALICE).unwrap().put("x", DType::U8, &[1], &[1]).unwrap();
}

/// One tenant's pushes wait on no other's: alice's push to a node that stopped answering holds
/// her push thread until its timeout, while bob's push to a live node goes through meanwhile.
#[test]
fn a_tenants_push_to_a_stuck_peer_holds_up_no_other_tenants_pushes() {
    let dir = tempfile::tempdir().unwrap();
    let file = token_file(dir.path(), ALICE);
    let b = node_with_auth(&file);
    let c = node_with_auth(&file);
    let peers = format!("{},{}", b.addr, c.addr);
    // The push timeout is the margin bob's push has to go through while alice's is held.
    let a =
        Node::start("mio", &["--auth-file", file.to_str().unwrap(), "--push-peers", &peers, "--push-timeout", "10"]);
    // Alice waits for her push's answer longer than the node waits for the stuck peer.
    let patient = ClientOptions { token: ALICE.into(), timeout: Some(Duration::from_secs(60)), ..Default::default() };
    let (mut alice_a, mut bob_a) = (Client::connect_with(a.addr, patient).unwrap(), connect(&a, BOB).unwrap());
    let mut observer = connect(&a, OPS).unwrap();
    let bytes = f32_bytes(1024, 5);
    let tensor = TensorRef { dtype: DType::F32, shape: &[1024], bytes: &bytes };
    let (alices, bobs) = (alice_a.keep(tensor).unwrap(), bob_a.keep(tensor).unwrap());
    let grant_c = connect(&c, ALICE).unwrap().grant_push(&alices.tensor).unwrap();
    let grant_b = connect(&b, BOB).unwrap().grant_push(&bobs.tensor).unwrap();

    // SAFETY: stopping and continuing our own child.
    assert_eq!(unsafe { libc::kill(c.pid(), libc::SIGSTOP) }, 0);
    let to_c = c.addr.to_string();
    let stuck = thread::spawn(move || alice_a.push(TensorSource::Handle(alices.handle), &to_c, &grant_c).map(drop));
    // Alice's push is under way: node a handed it to her push thread and has not answered it.
    a.wait_for_stat(&mut observer, "requests_in_flight", 1);
    let (on_b, _) = bob_a.push(TensorSource::Handle(bobs.handle), &b.addr.to_string(), &grant_b).expect("bob's push");
    // Bob's push went through while alice's was still held by the stopped peer.
    assert_eq!(a.stat(&mut observer, "requests_in_flight"), 1, "alice's push is still under way");
    assert!(!stuck.is_finished(), "alice's push ended before bob's did: nothing shows bob's did not wait on it");
    let alices_result = stuck.join().unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(c.pid(), libc::SIGCONT) }, 0);
    assert_eq!(connect(&b, BOB).unwrap().fetch(on_b.handle).unwrap().bytes(), &bytes[..]);
    assert_eq!(code(alices_result), ErrorCode::PeerUnreachable, "alice's push ends at its timeout");
    assert_eq!(a.stat(&mut observer, "requests_in_flight"), 0);
}

/// Push grants are memory a node holds for whoever asks: a tenant holds at most 64 unused at
/// once (more are refused, typed, and another tenant is not held to that), and a grant used
/// by a push makes room for another.
#[test]
fn a_tenant_holds_a_bounded_number_of_push_grants() {
    let dir = tempfile::tempdir().unwrap();
    let file = token_file(dir.path(), ALICE);
    let b = node_with_auth(&file);
    let a = Node::start("mio", &["--auth-file", file.to_str().unwrap(), "--push-peers", &b.addr.to_string()]);
    let (mut alice_a, mut alice_b, mut bob_b) =
        (connect(&a, ALICE).unwrap(), connect(&b, ALICE).unwrap(), connect(&b, BOB).unwrap());
    let bytes = f32_bytes(16, 7);
    let kept = alice_a.keep(TensorRef { dtype: DType::F32, shape: &[16], bytes: &bytes }).unwrap();
    let grants: Vec<String> = (0..64).map(|_| alice_b.grant_push(&kept.tensor).expect("within the bound")).collect();
    assert_eq!(code(alice_b.grant_push(&kept.tensor)), ErrorCode::QuotaExceeded);
    bob_b.grant_push(&kept.tensor).expect("bob is not held to alice's grants");
    let (on_b, _) = alice_a.push(TensorSource::Handle(kept.handle), &b.addr.to_string(), &grants[0]).unwrap();
    assert_eq!(alice_b.fetch(on_b.handle).unwrap().bytes(), &bytes[..]);
    alice_b.grant_push(&kept.tensor).expect("the used grant made room");
    assert_eq!(code(alice_b.grant_push(&kept.tensor)), ErrorCode::QuotaExceeded);
}

#[test]
fn a_refused_hello_logs_a_bounded_line_of_the_agent_it_named() {
    let dir = tempfile::tempdir().unwrap();
    let file = token_file(dir.path(), ALICE);
    let log = dir.path().join("node.log");
    let mut command = Command::new(support::djinn_binary());
    command.args(["node", "--listen", "127.0.0.1:0", "--log", "info", "--auth-file"]).arg(&file);
    command.stderr(std::fs::File::create(&log).unwrap());
    let (mut child, addr) = spawn_listening(command, "djinn node listening on ");

    // Agents with a line that pretends to be the node's own after each newline: as much as a
    // stranger's first frame may carry (4 KiB of metadata), and 60 KiB in a second hello on a
    // connection that had a good one (64 KiB of metadata).
    let line = "evil\nERROR forged: the node is compromised\n";
    let refused_hello = |raw: &mut TcpStream, agent: String| {
        let hello = Hello { token: "not-a-token".into(), ..Hello::new(&Limits::default(), transports::TCP, agent) };
        let mut wire = Vec::new();
        encode_head(&mut wire, 1, &Message::Data(DataMessage::Hello(hello))).unwrap();
        raw.write_all(&wire).unwrap();
        let reply = read_reply(raw).1;
        assert!(
            matches!(reply, Message::Data(DataMessage::Error { code: ErrorCode::Unauthenticated, .. })),
            "{reply:?}"
        );
    };
    let stranger = line.repeat(80);
    refused_hello(&mut TcpStream::connect(&addr).unwrap(), stranger.clone());
    let mut raw = TcpStream::connect(&addr).unwrap();
    let hello = Hello { token: ALICE.into(), ..Hello::new(&Limits::default(), transports::TCP, "raw") };
    let mut wire = Vec::new();
    encode_head(&mut wire, 2, &Message::Data(DataMessage::Hello(hello))).unwrap();
    raw.write_all(&wire).unwrap();
    assert!(matches!(read_reply(&mut raw).1, Message::Data(DataMessage::HelloAck(_))));
    let tenant = line.repeat(1400);
    refused_hello(&mut raw, tenant.clone());
    let mut alice = Client::connect_with(addr.as_str(), ClientOptions { token: ALICE.into(), ..Default::default() })
        .expect("still serving");
    alice.ping().expect("ping");
    child.kill().ok();
    child.wait().ok();

    let text = std::fs::read_to_string(&log).unwrap();
    let refused: Vec<&str> = text.lines().filter(|l| l.contains("hello refused")).collect();
    assert_eq!(refused.len(), 2, "{text}");
    for (logged, agent) in refused.iter().zip([&stranger, &tenant]) {
        assert!(logged.len() < 512, "{logged}");
        assert!(logged.contains(r"evil\nERROR forged") && logged.contains(&format!("({} bytes)", agent.len())));
    }
    assert!(!text.lines().any(|l| l.starts_with("ERROR forged")), "a newline of the agent's started a line");
    assert!(text.len() < 8192, "the node logged {} bytes", text.len());
}

/// One worker, one tenant flooding it from six connections with executes of ~10 ms: another
/// tenant's execute, sent one at a time, waits for the one running (a tenant with nothing
/// queued goes before the busy ones), not for every request queued before it (a single queue
/// makes it wait for six).
#[test]
fn a_flooding_tenant_does_not_make_another_wait_behind_its_queue() {
    let dir = tempfile::tempdir().unwrap();
    let file = token_file(dir.path(), ALICE);
    let node = Node::start("mio", &["--auth-file", file.to_str().unwrap(), "--workers", "1"]);
    let mut alice = connect(&node, ALICE).unwrap();
    let mut bob = connect(&node, BOB).unwrap();
    let mlp = register(&mut alice, &["mlp.block0", "mlp.block1", "mlp.block2"]);
    register(&mut bob, &["mlp.block0", "mlp.block1", "mlp.block2"]);
    let big = f32_bytes(512 * 256, 7);
    let small = f32_bytes(256, 8);

    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let flood: Vec<_> = (0..6)
        .map(|_| {
            let (stop, done, big) = (Arc::clone(&stop), Arc::clone(&done), big.clone());
            let mut client = connect(&node, ALICE).unwrap();
            thread::spawn(move || {
                let input = [TensorRef { dtype: DType::F32, shape: &[512, 256], bytes: &big }];
                while !stop.load(Ordering::Relaxed) {
                    client.execute(&mlp, &[Value::Tensor(0)], &input).expect("the flood is served too");
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // The flood's queue fills.
    while done.load(Ordering::Relaxed) < 12 {
        thread::sleep(Duration::from_millis(5));
    }
    let input = [TensorRef { dtype: DType::F32, shape: &[1, 256], bytes: &small }];
    let mut waited = Vec::new();
    for _ in 0..10 {
        let before = done.load(Ordering::Relaxed);
        bob.execute(&mlp, &[Value::Tensor(0)], &input).expect("bob is served");
        waited.push(done.load(Ordering::Relaxed) - before);
        thread::sleep(Duration::from_millis(15));
    }
    stop.store(true, Ordering::Relaxed);
    flood.into_iter().for_each(|t| t.join().unwrap());
    // The running job of alice's finishes while bob waits (a completion counted a moment late
    // may add one).
    assert!(waited.iter().all(|&n| n <= 2), "alice's executes done while bob waited: {waited:?}");
    assert!(node.stat(&mut alice, "executions") >= 22);
}

/// Request payloads are received into pooled buffers that later requests get again: what a
/// tenant kept from one (an identity's output, a named tensor) stays as it was however many
/// requests of another tenant's go through the same buffers, and each of those gets back its
/// own bytes.
#[test]
fn what_a_tenant_kept_stays_as_it_was_while_others_reuse_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_auth(&token_file(dir.path(), ALICE));
    let mut alice = connect(&node, ALICE).unwrap();
    let mut bob = connect(&node, BOB).unwrap();
    let identity = register(&mut alice, &["identity"]);
    register(&mut bob, &["identity"]);
    const LEN: usize = 1 << 20;
    let x = support::pattern(LEN * 4, 1);
    let shape = [LEN as u64];
    let kept = alice
        .execute_keep(&identity, &[Value::Tensor(0)], &[TensorRef { dtype: DType::F32, shape: &shape, bytes: &x }])
        .unwrap()
        .kept[0]
        .handle;
    alice.put("named", DType::F32, &shape, &x).unwrap();
    for i in 0..200 {
        let y = support::pattern(LEN * 4, 100 + i);
        let input = [TensorRef { dtype: DType::F32, shape: &shape, bytes: &y }];
        let out = bob.execute(&identity, &[Value::Tensor(0)], &input).unwrap();
        assert!(out.tensor_bytes(0) == y.as_slice(), "bob's request {i} got back other bytes");
    }
    assert!(alice.fetch(kept).unwrap().bytes() == x.as_slice(), "the kept tensor changed");
    assert!(alice.get("named").unwrap().bytes() == x.as_slice(), "the named tensor changed");
}

/// Objects of no bytes are charged a page each (their bookkeeping) and counted: a tenant
/// making 100,000 empty named tensors, or 100,000 empty kept tensors, is refused past 65,536 of
/// either (`QuotaExceeded`, nothing received for a refused put), and another tenant is served
/// throughout; deleting makes room again.
#[test]
fn empty_objects_are_charged_and_capped_per_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_auth(&token_file(dir.path(), ALICE));
    let mut alice = connect(&node, ALICE).unwrap();
    let mut bob = connect(&node, BOB).unwrap();
    let mut refused = 0;
    for i in 0..100_000 {
        match alice.put(&format!("t{i}"), DType::F32, &[0], &[]) {
            Ok(_) => {}
            Err(e) => {
                assert_eq!(e.remote_code(), Some(ErrorCode::QuotaExceeded), "{e}");
                refused += 1;
            }
        }
        if i % 10_000 == 0 {
            bob.put("still", DType::U8, &[1], &[7]).expect("bob is served while alice floods");
        }
    }
    assert_eq!(refused, 100_000 - 65_536);
    let used = node.stat(&mut alice, "budget_used_bytes");
    assert!(used >= 65_536 * 4096, "each empty tensor is charged its bookkeeping: {used} bytes in use");
    alice.delete("t0").unwrap();
    alice.put("again", DType::F32, &[0], &[]).expect("room after a delete");

    let mut kept = Vec::new();
    let mut refused = 0;
    for _ in 0..70_000 {
        match alice.keep(TensorRef { dtype: DType::F32, shape: &[0], bytes: &[] }) {
            Ok(info) => kept.push(info.handle),
            Err(e) => {
                assert_eq!(e.remote_code(), Some(ErrorCode::QuotaExceeded), "{e}");
                refused += 1;
            }
        }
    }
    assert_eq!((kept.len(), refused), (65_536, 70_000 - 65_536));
    assert_eq!(bob.get("still").unwrap().bytes(), &[7]);
    let released: u32 = kept.chunks(10_000).map(|c| alice.release(c).unwrap()).sum();
    assert_eq!(released, 65_536);
    assert_eq!(node.stat(&mut alice, "handles"), 0);
}

/// Sessions and parked requests are counted per tenant too: past 4,096 of either, more are
/// refused (`QuotaExceeded`) while another tenant opens and parks as before; closing and
/// aborting make room. A session of no state is charged its bookkeeping, a page, which goes
/// with it.
#[test]
fn sessions_and_parked_requests_are_capped_per_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_auth(&token_file(dir.path(), ALICE));
    let mut alice = connect(&node, ALICE).unwrap();
    let mut bob = connect(&node, BOB).unwrap();
    let cache = register(&mut alice, &["growing_cache"]);
    register(&mut bob, &["growing_cache"]);
    let empty = [TensorRef { dtype: DType::F32, shape: &[0, 4], bytes: &[] }];
    let before = node.stat(&mut alice, "budget_used_bytes");
    let mut opened = Vec::new();
    let mut refused = 0;
    for _ in 0..4_200 {
        match alice.session_open(&cache, &empty, 0) {
            Ok(s) => opened.push(s),
            Err(e) => {
                assert_eq!(e.remote_code(), Some(ErrorCode::QuotaExceeded), "{e}");
                refused += 1;
            }
        }
    }
    assert_eq!((opened.len(), refused), (4096, 104));
    assert_eq!(node.stat(&mut alice, "budget_used_bytes") - before, 4096 * 4096, "a page each");
    bob.session_open(&cache, &empty, 0).expect("bob opens his own");
    alice.session_close(opened[0]).unwrap();
    let again = alice.session_open(&cache, &empty, 0).expect("room after a close");
    for s in opened.iter().skip(1).chain([&again]) {
        alice.session_close(*s).unwrap();
    }
    assert_eq!(node.stat(&mut alice, "budget_used_bytes") - before, 4096, "only bob's is left");

    let stack = register(&mut alice, &["stack.block0", "stack.block1"]);
    register(&mut bob, &["stack.block0", "stack.block1"]);
    let x = f32_bytes(4 * 512, 3);
    let input = [TensorRef { dtype: DType::F32, shape: &[4, 512], bytes: &x }];
    let until = Breakpoint { block: 0, send_activation: false };
    let mut parked = Vec::new();
    let mut refused = 0;
    for _ in 0..4_200 {
        match alice.execute_until(&stack, &[Value::Tensor(0)], &input, false, until) {
            Ok(p) => parked.push(p.parked),
            Err(e) => {
                assert_eq!(e.remote_code(), Some(ErrorCode::QuotaExceeded), "{e}");
                refused += 1;
            }
        }
    }
    assert_eq!((parked.len(), refused), (4096, 104));
    let theirs = bob.execute_until(&stack, &[Value::Tensor(0)], &input, false, until).expect("bob parks his own");
    bob.abort(theirs.parked).unwrap();
    alice.abort(parked[0]).unwrap();
    alice.execute_until(&stack, &[Value::Tensor(0)], &input, false, until).expect("room after an abort");
}

/// Registrations in progress hold only what their tenant may: the host memory of a tenant's
/// uploads and inputs is bounded by its share (another tenant's inputs are served beside a
/// full one), block lengths and each chunk are charged a page of bookkeeping, a tenant has at
/// most 16 registrations in progress, and one that goes without a chunk for the upload timeout
/// is dropped with all it held.
#[test]
fn uploads_are_bounded_per_tenant_and_dropped_when_quiet() {
    use djinn_dataplane::client::ClientConn;
    let dir = tempfile::tempdir().unwrap();
    let file = token_file(dir.path(), ALICE);
    let node = Node::start(
        "mio",
        &[
            "--auth-file",
            file.to_str().unwrap(),
            "--host-memory-budget",
            "64MiB",
            "--tenant-host-memory",
            "16MiB",
            "--upload-timeout",
            "1",
        ],
    );
    let mut alice = connect(&node, ALICE).unwrap();
    let halves = register(&mut alice, &["halves"]);
    let mut mallory = ClientConn::connect(node.addr, ClientOptions::default()).unwrap();
    mallory.hello(Hello { token: MALLORY.into(), ..Hello::new(&Limits::default(), transports::TCP, "raw") }).unwrap();
    let begin = |conn: &mut ClientConn, seed: u8, blocks: usize| {
        let fingerprint = djinn_client::Fingerprint::of_blocks(&[[seed]]);
        let message =
            Message::Model(ModelMessage::RegisterBegin { fingerprint, blocks: vec![1 << 30; blocks], public: false });
        match conn.request(&message, &[]).map(|reply| reply.message) {
            Ok(Message::Model(ModelMessage::RegisterReady { upload, registered: false })) => Ok(upload),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e.remote_code()),
        }
    };
    let chunk = |conn: &mut ClientConn, upload: u64, offset: u64, bytes: &[u8]| {
        let message = Message::Model(ModelMessage::RegisterChunk {
            upload,
            offset,
            chunk: TensorDesc::new(DType::U8, vec![bytes.len() as u64]).unwrap(),
        });
        conn.request(&message, &[bytes]).map(drop).map_err(|e| e.remote_code())
    };
    // Alice's model is charged a page of bookkeeping.
    let used = |client: &mut Client| node.stat(client, "host_budget_used_bytes") - 4096;

    // 1,000 block lengths: 8,000 bytes and a page, held while the upload is.
    let first = begin(&mut mallory, 0, 1000).unwrap();
    assert_eq!(used(&mut alice), 8000 + 4096);
    // Chunks of a byte cost a page each.
    for offset in 0..10 {
        chunk(&mut mallory, first, offset, &[7]).unwrap();
    }
    assert_eq!(used(&mut alice), 8000 + 4096 + 10 * 4097);
    // 4 MiB chunks until mallory's share of 16 MiB is full.
    let four = vec![1u8; 4 << 20];
    let mut offset = 10;
    let refused = loop {
        match chunk(&mut mallory, first, offset, &four) {
            Ok(()) => offset += four.len() as u64,
            Err(code) => break code,
        }
    };
    assert_eq!(refused, Some(ErrorCode::QuotaExceeded));
    assert_eq!(offset - 10, 3 * (4 << 20), "three chunks and the bookkeeping fill 16 MiB");
    // Alice's 8 MiB inputs are served beside it, again and again.
    let x = f32_bytes(2 << 20, 1);
    let idx = 3i64.to_le_bytes();
    let inputs = [
        TensorRef { dtype: DType::F32, shape: &[2 << 20], bytes: &x },
        TensorRef { dtype: DType::I64, shape: &[1], bytes: &idx },
    ];
    for _ in 0..4 {
        let out = alice.execute(&halves, &[Value::Tensor(0), Value::Tensor(1)], &inputs).expect("alice is served");
        assert_eq!(out.tensor_bytes(1), 4i64.to_le_bytes());
    }
    // At most 16 registrations in progress.
    for seed in 1..16 {
        begin(&mut mallory, seed, 1).unwrap();
    }
    assert_eq!(begin(&mut mallory, 16, 1), Err(Some(ErrorCode::QuotaExceeded)));
    assert_eq!(node.stat(&mut alice, "uploads"), 16);
    // Quiet for the upload timeout: dropped, and all they held is back.
    node.wait_for_stat(&mut alice, "uploads", 0);
    assert_eq!(used(&mut alice), 0);
    assert_eq!(chunk(&mut mallory, first, offset, &[7]), Err(Some(ErrorCode::NotFound)));
    begin(&mut mallory, 17, 1).expect("room for a new one");
}
