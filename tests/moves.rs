//! Sessions that move between nodes: the state goes node to node and never through the client,
//! the session goes on at the other node from where it was, requests sent during a move wait
//! for it and are answered with where the session went (which a cluster client follows), and a
//! move that fails, for whatever reason, leaves the session where it was, whole.

mod support;

use djinn_client::{
    Breakpoint, Client, ClientError, ClientOptions, ClusterClient, ClusterError, DType, ErrorCode, FailoverOptions,
    Fingerprint, Handle, RemoteSession, Signal, TensorRef, Value,
};
use djinn_dataplane::client::ClientConn;
use djinn_proto::{Hello, Limits, Message, SessionMessage, transports};
use std::time::Duration;
use support::{Counter, Node, archive};

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn register(client: &mut Client, blocks: &[&str]) -> Fingerprint {
    let archives: Vec<Vec<u8>> = blocks.iter().map(|b| archive(b)).collect();
    client.register_model(&archives, |_, _| {}).expect("register").fingerprint
}

/// A session of `counter` (state: a running total of three floats and a step count).
fn open_counter(client: &mut Client, model: &Fingerprint) -> Handle {
    let (zeros, zero) = (f32_bytes(&[0.0; 3]), 0i64.to_le_bytes());
    let state = [
        TensorRef { dtype: DType::F32, shape: &[3], bytes: &zeros },
        TensorRef { dtype: DType::I64, shape: &[], bytes: &zero },
    ];
    client.session_open(model, &state, 0).expect("open")
}

/// Steps the session of `counter` on `client` and checks the outputs against the state so far.
fn step(counter: &mut Counter, client: &mut Client, session: Handle) {
    let bytes = counter.input();
    let t = [TensorRef { dtype: DType::F32, shape: &[3], bytes: &bytes }];
    let out = client.session_step(session, &[Value::Tensor(0)], &t).expect("step");
    counter.check(&out);
}

fn traffic(client: &Client) -> u64 {
    let (_, sent, received) = client.client_stats();
    sent + received
}

fn code(e: &ClientError) -> Option<ErrorCode> {
    e.remote_code()
}

#[test]
fn a_session_moves_to_another_node_and_goes_on_there() {
    let b = Node::start("uring", &[]);
    let a = Node::start("mio", &["--push-peers", &b.addr.to_string()]);
    let (mut on_a, mut on_b) = (a.client(), b.client());
    let model = register(&mut on_a, &["counter"]);
    assert_eq!(register(&mut on_b, &["counter"]), model);
    let session = open_counter(&mut on_a, &model);
    let mut counter = Counter::new();
    for _ in 0..3 {
        step(&mut counter, &mut on_a, session);
    }

    let to_b = b.addr.to_string();
    let grant = on_b.grant_session(&model).expect("grant");
    let before = traffic(&on_a);
    let (to, moved) = on_a.session_move(session, &to_b, &grant).expect("move");
    assert_eq!(to, to_b);
    assert!(traffic(&on_a) - before < 1024, "the state went through the client");
    assert_eq!(a.stat(&mut on_a, "sessions"), 0);
    assert_eq!(a.stat(&mut on_a, "sessions_moved_out"), 1);
    assert_eq!(a.stat(&mut on_a, "session_device_bytes"), 0, "A freed the state");
    assert_eq!(b.stat(&mut on_b, "sessions"), 1);

    // At A, the session's requests are answered with where it went.
    let e = on_a.session_signal(session, Signal::Compute).unwrap_err();
    assert!(matches!(&e, ClientError::SessionMoved { to, session } if *to == to_b && *session == moved), "{e}");
    // At B it goes on from where it was.
    for _ in 0..3 {
        step(&mut counter, &mut on_b, moved);
    }
    on_b.session_close(moved).expect("close at B");
    assert_eq!(b.stat(&mut on_b, "sessions"), 0);
    assert_eq!(b.stat(&mut on_b, "session_device_bytes"), 0);
}

/// A 16 MiB state (every row a step appended) arrives whole: the sums after the move include
/// every row sent before it.
#[test]
fn a_large_state_arrives_whole() {
    let b = Node::start("mio", &[]);
    let a = Node::start("mio", &["--push-peers", &b.addr.to_string()]);
    let (mut on_a, mut on_b) = (a.client(), b.client());
    let model = register(&mut on_a, &["growing_cache"]);
    register(&mut on_b, &["growing_cache"]);
    let width = 1024u64;
    let empty = [TensorRef { dtype: DType::F32, shape: &[0, width], bytes: &[] }];
    let session = on_a.session_open(&model, &empty, 0).expect("open");
    let rows = 1024u64;
    let mut expected = vec![0f32; width as usize];
    let mut step = |client: &mut Client, session: Handle, seed: u64| -> Vec<f32> {
        let x: Vec<f32> = (0..rows * width).map(|i| ((i * 7 + seed * 13) % 17) as f32).collect();
        for (i, e) in expected.iter_mut().enumerate() {
            *e += (0..rows as usize).map(|r| x[r * width as usize + i]).sum::<f32>();
        }
        let bytes = f32_bytes(&x);
        let t = [TensorRef { dtype: DType::F32, shape: &[rows, width], bytes: &bytes }];
        let out = client.session_step(session, &[Value::Tensor(0)], &t).expect("step");
        assert_eq!(f32s(out.tensor_bytes(0)), expected, "step {seed}");
        f32s(out.tensor_bytes(0))
    };
    for seed in 0..4 {
        step(&mut on_a, session, seed);
    }
    let grant = on_b.grant_session(&model).expect("grant");
    let before = traffic(&on_a);
    let (_, moved) = on_a.session_move(session, &b.addr.to_string(), &grant).expect("move");
    assert!(traffic(&on_a) - before < 1024, "16 MiB of state went through the client");
    assert_eq!(b.stat(&mut on_b, "session_device_bytes"), 4 * rows * width * 4);
    step(&mut on_b, moved, 4);
}

#[test]
fn a_move_that_fails_leaves_the_session_whole() {
    let b = Node::start("mio", &[]);
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let a = Node::start("mio", &["--push-peers", &format!("{},{dead}", b.addr), "--push-timeout", "5"]);
    let (mut on_a, mut on_b) = (a.client(), b.client());
    let model = register(&mut on_a, &["counter"]);
    let session = open_counter(&mut on_a, &model);
    let mut counter = Counter::new();
    step(&mut counter, &mut on_a, session);
    let to_b = b.addr.to_string();

    // The node there lacks the model; the node is not one of A's peers; the node is down.
    let grant = on_b.grant_session(&model).expect("grant");
    let e = on_a.session_move(session, &to_b, &grant).unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::UnknownModel), "{e}");
    let stranger = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let e = on_a.session_move(session, &stranger, &grant).unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::Forbidden), "{e}");
    let e = on_a.session_move(session, &dead, &grant).unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::PeerUnreachable), "{e}");
    // After each, the session is at A as it was, and goes on.
    assert_eq!(a.stat(&mut on_a, "session_moves_failed"), 3);
    assert_eq!(a.stat(&mut on_a, "sessions"), 1);
    assert_eq!(b.stat(&mut on_b, "sessions"), 0, "B keeps nothing of a failed move");
    step(&mut counter, &mut on_a, session);

    // With the model there, the same session moves.
    register(&mut on_b, &["counter"]);
    let grant = on_b.grant_session(&model).expect("grant");
    let (_, moved) = on_a.session_move(session, &to_b, &grant).expect("move");
    step(&mut counter, &mut on_b, moved);
}

/// A step and a signal sent right behind a move (on one connection, before its answer) wait for
/// it and are answered with where the session went; a cluster client that still names the old
/// node follows, and its step applies at the new node in order.
#[test]
fn requests_sent_during_a_move_wait_for_it_and_follow_it() {
    let b = Node::start("mio", &[]);
    let a = Node::start("mio", &["--push-peers", &b.addr.to_string()]);
    let (mut on_a, mut on_b) = (a.client(), b.client());
    let model = register(&mut on_a, &["counter"]);
    register(&mut on_b, &["counter"]);
    let to_b = b.addr.to_string();
    let mut conn = ClientConn::connect(a.addr, ClientOptions::default()).expect("connect");
    conn.hello(Hello::new(&Limits::default(), transports::TCP, "test")).expect("hello");

    let session = open_counter(&mut on_a, &model);
    let mut counter = Counter::new();
    step(&mut counter, &mut on_a, session);
    let grant = on_b.grant_session(&model).expect("grant");
    let x = counter.input();
    let step = Message::Session(SessionMessage::Step {
        session,
        tensors: vec![djinn_proto::TensorDesc::new(DType::F32, vec![3]).unwrap()],
        inputs: vec![Value::Tensor(0)],
        until: None,
    });
    let go = Message::Session(SessionMessage::Move { session, to: to_b.clone(), grant });
    let (moved, stepped) = conn.request_two(&go, (&step, &[&x])).expect("two requests");
    let Message::Session(SessionMessage::Moved { to, session: there }) = moved.expect("move").message else {
        panic!("the move was not answered with where the session went")
    };
    assert_eq!(to, to_b);
    let answer = stepped.expect("step").message;
    assert_eq!(answer, Message::Session(SessionMessage::Moved { to: to.clone(), session: there }), "the step waited");

    // A client given node A alone follows no node (tests/trust.rs): it is told where the
    // session went and stays. At B the step runs (once: it did not run at A).
    let options = ClientOptions::default();
    let mut cluster = ClusterClient::open(&a.addr.to_string(), options, FailoverOptions::default()).expect("cluster");
    let mut remote = RemoteSession { node: a.addr.to_string(), session, fingerprint: model, key: None };
    let t = [TensorRef { dtype: DType::F32, shape: &[3], bytes: &x }];
    let refused = cluster.session_step(&mut remote, &[Value::Tensor(0)], &t).unwrap_err();
    assert!(matches!(&refused, ClusterError::UntrustedAddress { to, .. } if *to == to_b), "{refused}");
    assert_eq!(remote.node, a.addr.to_string());
    let out = on_b.session_step(there, &[Value::Tensor(0)], &t).expect("step at B");
    counter.check(&out);

    // A signal behind a move waits for it too (it is not acknowledged before the move ends).
    let second = open_counter(&mut on_a, &model);
    let grant = on_b.grant_session(&model).expect("grant");
    let go = Message::Session(SessionMessage::Move { session: second, to: to_b.clone(), grant });
    let signal = Message::Session(SessionMessage::Signal { session: second, signal: Signal::Compute });
    let (moved, signaled) = conn.request_two(&go, (&signal, &[])).expect("two requests");
    let moved = moved.expect("move").message;
    assert!(matches!(moved, Message::Session(SessionMessage::Moved { .. })), "{moved:?}");
    assert_eq!(signaled.expect("signal").message, moved);
}

/// A move waits for no parked step: it is refused until the step is resumed or aborted.
#[test]
fn a_session_with_a_parked_step_moves_once_the_step_ends() {
    let b = Node::start("mio", &[]);
    let a = Node::start("mio", &["--push-peers", &b.addr.to_string()]);
    let (mut on_a, mut on_b) = (a.client(), b.client());
    let blocks = ["stateful.block0", "stateful.block1"];
    let model = register(&mut on_a, &blocks);
    register(&mut on_b, &blocks);
    let (zeros, zero) = (f32_bytes(&[0.0; 4]), 0i64.to_le_bytes());
    let state = [
        TensorRef { dtype: DType::F32, shape: &[4], bytes: &zeros },
        TensorRef { dtype: DType::I64, shape: &[], bytes: &zero },
    ];
    let session = on_a.session_open(&model, &state, 0).expect("open");
    let one = f32_bytes(&[1.0; 4]);
    let t = [TensorRef { dtype: DType::F32, shape: &[4], bytes: &one }];
    let paused = on_a
        .session_step_until(session, &[Value::Tensor(0)], &t, Breakpoint { block: 0, send_activation: false })
        .expect("step until");
    let grant = on_b.grant_session(&model).expect("grant");
    let e = on_a.session_move(session, &b.addr.to_string(), &grant).unwrap_err();
    assert_eq!(code(&e), Some(ErrorCode::Busy), "{e}");
    assert!(e.to_string().contains("resume or abort it first"), "{e}");

    let resumed = on_a.resume(paused.parked, None, None).expect("resume");
    let djinn_client::Resumed::Done(out) = resumed else { panic!("the step parked again") };
    assert_eq!(f32s(out.tensor_bytes(0)), [2.0; 4]);
    let (_, moved) = on_a.session_move(session, &b.addr.to_string(), &grant).expect("move");
    let out = on_b.session_step(moved, &[Value::Tensor(0)], &t).expect("step at B");
    assert_eq!(f32s(out.tensor_bytes(0)), [4.0; 4], "the resumed step's state moved");
}

/// A move whose client went away before its answer still ends: one whose peer never answers
/// fails at the node's push timeout, and the request that waited behind it (on another
/// connection) then runs here, on the session as it was.
#[test]
fn a_move_ends_after_its_client_went_away_and_what_waited_then_runs() {
    // Accepts nothing: the mover's hello is never answered.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let to = silent.local_addr().unwrap().to_string();
    let a = Node::start("mio", &["--push-peers", &to, "--push-timeout", "2"]);
    let mut on_a = a.client();
    let model = register(&mut on_a, &["counter"]);
    let session = open_counter(&mut on_a, &model);
    let mut counter = Counter::new();
    step(&mut counter, &mut on_a, session);

    let options = ClientOptions { timeout: Some(Duration::from_millis(300)), ..ClientOptions::default() };
    let mut conn = ClientConn::connect(a.addr, options).expect("connect");
    conn.hello(Hello::new(&Limits::default(), transports::TCP, "test")).expect("hello");
    let go = Message::Session(SessionMessage::Move { session, to, grant: "g".into() });
    let unanswered = conn.request(&go, &[]);
    assert!(unanswered.is_err(), "the move was answered before its peer could: {unanswered:?}");
    drop(conn);

    step(&mut counter, &mut on_a, session);
    assert_eq!(a.stat(&mut on_a, "session_moves_failed"), 1);
    assert_eq!(a.stat(&mut on_a, "sessions"), 1);
}
