//! Tensors kept on the node (remote handles): a model's output kept for the next call without
//! crossing the network, uploads kept once, node-to-node pushes, and what happens to handles
//! that are released, expire, outlive their node or come from an earlier life of it.

mod support;

use std::thread;
use std::time::Duration;

use djinn_client::{
    Client, ClientOptions, ClusterClient, ClusterError, DType, ErrorCode, FailoverOptions, Handle, TensorDesc,
    TensorRef, TensorSource, Value,
};
use djinn_executor::tch;
use support::{Node, f32_bytes, pattern, register};

/// Bytes sent and received by `client` while `f` runs.
fn moved<T>(client: &mut Client, f: impl FnOnce(&mut Client) -> T) -> (T, u64, u64) {
    let (_, sent, received) = client.client_stats();
    let out = f(client);
    let (_, sent_after, received_after) = client.client_stats();
    (out, sent_after - sent, received_after - received)
}

fn code(e: &djinn_client::ClientError) -> Option<ErrorCode> {
    e.remote_code()
}

#[test]
fn a_kept_output_feeds_the_next_call_without_crossing_the_network() {
    let node = Node::start("mio", &[]);
    let mut client = node.client();
    let first = register(&mut client, &["mlp.block0"]);
    let rest = register(&mut client, &["mlp.block1", "mlp.block2"]);
    let whole = register(&mut client, &["mlp"]);
    let x = f32_bytes(64 * 256, 3);
    let input = [TensorRef { dtype: DType::F32, shape: &[64, 256], bytes: &x }];

    // Kept: 64 × 1024 floats (256 KiB) stay on the node; only their description comes back.
    let (kept, _, received) = moved(&mut client, |c| c.execute_keep(&first, &[Value::Tensor(0)], &input).unwrap());
    assert!(kept.tensors.is_empty(), "no tensor bytes in the reply");
    let [info] = &kept.kept[..] else { panic!("one kept tensor, got {:?}", kept.kept) };
    assert_eq!(kept.value, Value::Handle(info.handle));
    assert_eq!(
        (info.tensor.dtype, info.tensor.shape.as_slice(), info.tensor.byte_len),
        (DType::F32, &[64, 1024][..], 256 << 10)
    );
    assert!(received < 1024, "{received} bytes came back for a kept 256 KiB output");
    assert_eq!(node.stat(&mut client, "handles"), 1);
    assert_eq!(node.stat(&mut client, "handle_bytes"), 256 << 10);

    // Fed to the next call by handle: only the handle goes out.
    let (out, sent, _) = moved(&mut client, |c| c.execute(&rest, &[Value::Handle(info.handle)], &[]).unwrap());
    assert!(sent < 1024, "{sent} bytes went out to use a kept 256 KiB tensor");
    let straight = client.execute(&whole, &[Value::Tensor(0)], &input).unwrap();
    assert_eq!(out.tensor_bytes(0), straight.tensor_bytes(0), "kept and fed back equals the whole model's output");

    // The kept tensor is the first block's output, byte for byte.
    let plain = client.execute(&first, &[Value::Tensor(0)], &input).unwrap();
    let fetched = client.fetch(info.handle).unwrap();
    assert_eq!(fetched.desc, info.tensor);
    assert_eq!(fetched.bytes(), plain.tensor_bytes(0));

    // Kept inputs mix with sent ones, and the same handle may appear twice.
    let halves = register(&mut client, &["halves"]);
    let idx = 3i64.to_le_bytes();
    let mixed = client
        .execute(
            &halves,
            &[Value::Handle(info.handle), Value::Tensor(0)],
            &[TensorRef { dtype: DType::I64, shape: &[], bytes: &idx }],
        )
        .unwrap();
    assert_eq!(mixed.tensors.len(), 2);
}

#[test]
fn released_and_idle_kept_tensors_give_their_memory_back() {
    let node = Node::start("mio", &["--handle-ttl", "0.3"]);
    let mut client = node.client();
    let before = node.stat(&mut client, "budget_used_bytes");
    let bytes = pattern(1 << 20, 9);
    let t = TensorRef { dtype: DType::U8, shape: &[1 << 20], bytes: &bytes };

    let a = client.keep(t).unwrap();
    // Its bytes and a page of bookkeeping.
    assert_eq!(node.stat(&mut client, "budget_used_bytes"), before + (1 << 20) + 4096);
    assert_eq!(client.fetch(a.handle).unwrap().bytes(), &bytes[..]);
    assert_eq!(client.release(&[a.handle]).unwrap(), 1);
    assert_eq!(client.release(&[a.handle]).unwrap(), 0, "releasing twice is harmless");
    assert_eq!(node.stat(&mut client, "budget_used_bytes"), before);
    let e = client.fetch(a.handle).unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::NotFound), "{e}");

    // Unused past --handle-ttl: freed by the node itself.
    let b = client.keep(t).unwrap();
    node.wait_for_stat(&mut client, "handles_expired", 1);
    assert_eq!(node.stat(&mut client, "budget_used_bytes"), before);
    let e = client.fetch(b.handle).unwrap_err();
    assert!(code(&e) == Some(ErrorCode::NotFound) && e.to_string().contains("expired"), "{e}");
}

#[test]
fn kept_outputs_over_the_budget_are_refused_and_nothing_is_held() {
    let node = Node::start("mio", &["--device-memory-budget", "1MiB"]);
    let mut client = node.client();
    let identity = register(&mut client, &["identity"]);
    let x = pattern(600 << 10, 4);
    let input = [TensorRef { dtype: DType::U8, shape: &[600 << 10], bytes: &x }];
    let kept = client.execute_keep(&identity, &[Value::Tensor(0)], &input).unwrap();
    // The identity's output is a view of the request's buffer: kept, it is a copy of its own.
    assert_eq!(client.fetch(kept.kept[0].handle).unwrap().bytes(), &x[..]);
    let e = client.execute_keep(&identity, &[Value::Tensor(0)], &input).unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::OverBudget), "{e}");
    assert_eq!(node.stat(&mut client, "handles"), 1);
    // Its bytes and a page of bookkeeping.
    assert_eq!(node.stat(&mut client, "budget_used_bytes"), (600 << 10) + 4096);
    let e = client.keep(input[0]).unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::OverBudget), "{e}");
    assert_eq!(node.stat(&mut client, "budget_used_bytes"), (600 << 10) + 4096);
    client.ping().expect("the node still serves");
}

#[test]
fn a_handle_whose_node_died_or_restarted_gets_a_clear_error() {
    let node = Node::start("mio", &[]);
    let addr = node.addr.to_string();
    let options = ClientOptions { timeout: Some(Duration::from_secs(5)), ..ClientOptions::default() };
    let mut cluster = ClusterClient::open(&addr, options, FailoverOptions::default()).unwrap();
    let bytes = pattern(4096, 5);
    let kept = cluster.keep(None, TensorRef { dtype: DType::U8, shape: &[4096], bytes: &bytes }).unwrap();
    assert_eq!(kept.node, addr);
    assert_eq!(cluster.fetch(&kept).unwrap().bytes(), &bytes[..]);

    node.kill();
    match cluster.fetch(&kept) {
        Err(e @ ClusterError::HandleLost { .. }) => assert!(e.to_string().contains("lost"), "{e}"),
        other => panic!("expected HandleLost, got {other:?}"),
    }

    // Restarted on the same address: the handle is of its earlier life.
    let _node = Node::start_at(&addr, "mio", &[]);
    match cluster.fetch(&kept) {
        Err(ClusterError::Node(e)) => {
            assert_eq!(code(&e), Some(ErrorCode::StaleHandle), "{e}");
            assert!(e.to_string().contains("earlier life"), "{e}");
        }
        other => panic!("expected a stale handle, got {other:?}"),
    }
    let fresh = cluster.keep(None, TensorRef { dtype: DType::U8, shape: &[4096], bytes: &bytes }).unwrap();
    assert_ne!(fresh.info.handle.epoch, kept.info.handle.epoch, "a new life, a new epoch");
}

#[test]
fn a_node_pushes_a_tensor_into_another_nodes_memory() {
    let b = Node::start("uring", &[]);
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let stranger = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    stranger.set_nonblocking(true).unwrap();
    let peers = format!("{},{dead}", b.addr);
    let a = Node::start("mio", &["--push-timeout", "5", "--push-peers", &peers]);
    let mut on_a = a.client();
    let mut on_b = b.client();
    let to_b = b.addr.to_string();
    for (i, len) in [0usize, 1024, 1 << 20, 64 << 20].into_iter().enumerate() {
        let bytes = pattern(len, 40 + i as u64);
        let kept = on_a.keep(TensorRef { dtype: DType::U8, shape: &[len as u64], bytes: &bytes }).unwrap();
        let grant = on_b.grant_push(&kept.tensor).unwrap();
        let ((pushed, path), sent, received) =
            moved(&mut on_a, |c| c.push(TensorSource::Handle(kept.handle), &to_b, &grant).unwrap());
        assert_eq!(path, "staging-tcp");
        assert!(sent + received < 1024, "{} bytes of a {len}-byte push went through the client", sent + received);
        assert_eq!(pushed.tensor, kept.tensor);
        assert!(on_b.fetch(pushed.handle).unwrap().bytes() == bytes.as_slice(), "{len} bytes arrive exactly");
        on_b.release(&[pushed.handle]).unwrap();
    }

    // A named tensor goes the same way, and what arrives feeds a model on the peer.
    let x = f32_bytes(8, 6);
    on_a.put("x", DType::F32, &[8], &x).unwrap();
    let x_desc = TensorDesc::new(DType::F32, vec![8]).unwrap();
    let grant = on_b.grant_push(&x_desc).unwrap();
    let (pushed, _) = on_a.push(TensorSource::Named("x".into()), &to_b, &grant).unwrap();
    let identity = register(&mut on_b, &["identity"]);
    let out = on_b.execute(&identity, &[Value::Handle(pushed.handle)], &[]).unwrap();
    assert_eq!(out.tensor_bytes(0), &x[..]);

    // Failures are typed and the node goes on serving.
    let e = on_a.push(TensorSource::Named("missing".into()), &to_b, "unused").unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::NotFound), "{e}");
    let e = on_a.push(TensorSource::Handle(Handle { id: 999, epoch: 1 }), &to_b, "unused").unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::StaleHandle), "{e}");
    let e = on_a.push(TensorSource::Named("x".into()), &dead, "unused").unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::PeerUnreachable), "{e}");
    let e = on_a.push(TensorSource::Named("x".into()), "not an address", "unused").unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::Forbidden), "{e}");

    // A listener that is not one of the node's peers gets nothing: no connection, so no token
    // and no byte of the tensor, and the error is the same whether anything listens there.
    let grant = on_b.grant_push(&x_desc).unwrap();
    let e =
        on_a.push(TensorSource::Named("x".into()), &stranger.local_addr().unwrap().to_string(), &grant).unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::Forbidden), "{e}");
    assert!(e.to_string().contains("not a node of this cluster"), "{e}");
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let e2 = on_a.push(TensorSource::Named("x".into()), &closed, &grant).unwrap_err();
    assert_eq!(code(&e2), Some(ErrorCode::Forbidden), "{e2}");
    thread::sleep(Duration::from_millis(200));
    assert!(matches!(stranger.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock), "nothing connected");

    // The peer restarted since the last push: the connection is opened again.
    let b_addr = to_b.clone();
    drop(on_b);
    b.kill();
    let b = Node::start_at(&b_addr, "mio", &[]);
    let grant = b.client().grant_push(&x_desc).unwrap();
    let (pushed, _) = on_a.push(TensorSource::Named("x".into()), &to_b, &grant).unwrap();
    assert_eq!(b.client().fetch(pushed.handle).unwrap().bytes(), &x[..]);
    on_a.ping().unwrap();
}

/// On a GPU node a kept tensor is device memory: uploads land there, outputs stay there, and
/// pushes go device → host → TCP → host → device. Needs a GPU: gpu-suite.sh runs it.
#[test]
#[ignore = "needs a CUDA device: run by gpu-suite.sh (cargo test -- --ignored on a GPU host)"]
fn kept_tensors_live_in_gpu_memory_on_a_gpu_node() {
    assert!(tch::Cuda::is_available(), "libtorch sees no CUDA device");
    let b = Node::start("mio", &["--device", "cuda:0"]);
    let a = Node::start("mio", &["--device", "cuda:0", "--push-peers", &b.addr.to_string()]);
    let mut on_a = a.client();
    let mut on_b = b.client();
    let identity = register(&mut on_a, &["identity"]);
    for (i, len) in [1usize << 10, 1 << 20, 256 << 20, 1 << 30].into_iter().enumerate() {
        let bytes = pattern(len, 70 + i as u64);
        let kept = on_a.keep(TensorRef { dtype: DType::U8, shape: &[len as u64], bytes: &bytes }).unwrap();
        assert!(on_a.fetch(kept.handle).unwrap().bytes() == bytes.as_slice(), "{len} bytes through device memory");
        let out = on_a.execute_keep(&identity, &[Value::Handle(kept.handle)], &[]).unwrap();
        let grant = on_b.grant_push(&out.kept[0].tensor).unwrap();
        let (pushed, path) = on_a.push(TensorSource::Handle(out.kept[0].handle), &b.addr.to_string(), &grant).unwrap();
        assert_eq!(path, "staging-tcp");
        assert!(on_b.fetch(pushed.handle).unwrap().bytes() == bytes.as_slice(), "{len} bytes pushed GPU to GPU");
        on_a.release(&[kept.handle, out.kept[0].handle]).unwrap();
        on_b.release(&[pushed.handle]).unwrap();
    }
}

/// A peer answers a push with what it was asked for, a handle: a reply carrying a payload is
/// refused before anything is allocated for it. (A real node cannot be made to send one: the
/// peer here is a listener that speaks just enough of the protocol.)
#[test]
fn a_peers_reply_is_bounded_by_what_a_push_asked_for() {
    use djinn_proto::{DataKind, DataMessage, FrameHeader, Hello, KeptMessage, Kind, Limits, Message, transports};
    use std::io::Write;
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let fake_addr = fake.local_addr().unwrap().to_string();
    let a = Node::start("mio", &["--push-peers", &fake_addr, "--push-timeout", "5"]);
    // Memory taken for a reply shows in the node's address space at once, touched or not.
    let pid = a.pid();
    let vm_size = move || {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let kib: u64 =
            status.lines().find_map(|l| l.strip_prefix("VmSize:")?.split_whitespace().next()?.parse().ok()).unwrap();
        kib << 10
    };
    let mut on_a = a.client();
    on_a.put("x", DType::U8, &[4], &[1, 2, 3, 4]).unwrap();
    let before = vm_size();
    let peer = thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        let (header, hello, _) = support::read_reply(&mut s);
        assert!(matches!(hello, Message::Data(DataMessage::Hello(_))), "{hello:?}");
        let mut out = Vec::new();
        let ack = Message::Data(DataMessage::HelloAck(Hello::new(&Limits::default(), transports::TCP, "fake")));
        djinn_proto::encode_head(&mut out, header.request_id.get(), &ack).unwrap();
        s.write_all(&out).unwrap();
        let (header, keep, _) = support::read_reply(&mut s);
        assert!(matches!(keep, Message::Kept(KeptMessage::Keep { .. })), "{keep:?}");
        // A 1 GiB tensor in reply, announced, begun and never finished.
        let reply = Message::Data(DataMessage::GetReply { tensor: TensorDesc::new(DType::U8, vec![1 << 30]).unwrap() });
        let mut meta = Vec::new();
        reply.encode(&mut meta);
        let head =
            FrameHeader::new(Kind::Data(DataKind::GetReply), header.request_id.get(), meta.len() as u32, 1 << 30);
        s.write_all(zerocopy::IntoBytes::as_bytes(&head)).unwrap();
        s.write_all(&meta).unwrap();
        s.write_all(&[0u8; 4096]).unwrap();
        thread::sleep(Duration::from_millis(500));
        vm_size()
    });
    let e = on_a.push(TensorSource::Named("x".into()), &fake_addr, "any").unwrap_err();
    let during = peer.join().unwrap();
    assert_eq!(code(&e), Some(ErrorCode::PeerUnreachable), "{e}");
    // (The push thread and its allocator arena take well under 512 MiB of address space.)
    assert!(during < before + (512 << 20), "address space {during} with the reply under way, {before} before");
    on_a.ping().unwrap();
}

/// A node keeps few connections to its peers, per tenant: past `--push-connections` the least
/// recently used is closed, and any unused for `--push-connection-idle` seconds.
#[test]
fn connections_to_peers_are_bounded_and_closed_when_idle() {
    let (b, c) = (Node::start("mio", &[]), Node::start("mio", &[]));
    let peers = format!("{},{}", b.addr, c.addr);
    let args = ["--push-peers", &peers, "--push-connections", "1", "--push-connection-idle", "1"];
    let a = Node::start("mio", &args);
    let (mut on_a, mut on_b, mut on_c) = (a.client(), b.client(), c.client());
    on_a.put("x", DType::U8, &[3], &[1, 2, 3]).unwrap();
    let desc = TensorDesc::new(DType::U8, vec![3]).unwrap();
    let mut push = |to: &mut Client, addr: std::net::SocketAddr| {
        let grant = to.grant_push(&desc).unwrap();
        on_a.push(TensorSource::Named("x".into()), &addr.to_string(), &grant).unwrap();
    };
    push(&mut on_b, b.addr);
    b.wait_for_stat(&mut on_b, "connections_open", 2);
    push(&mut on_c, c.addr);
    c.wait_for_stat(&mut on_c, "connections_open", 2);
    b.wait_for_stat(&mut on_b, "connections_open", 1);
    c.wait_for_stat(&mut on_c, "connections_open", 1);
}
