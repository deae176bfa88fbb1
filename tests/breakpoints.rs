//! Breakpoints: a run stopped after block k and parked on the node, its activation inspected,
//! replaced or left alone, then resumed to the end or to a later breakpoint, or aborted; what a
//! parked request holds and how it is released; a parked session step.

mod support;

use std::time::{Duration, Instant};

use djinn_client::{Breakpoint, Client, DType, ErrorCode, Fingerprint, Handle, Output, Resumed, TensorRef, Value};
use support::{Node, archive};

const STACK: usize = 8;

fn register(client: &mut Client, blocks: &[Vec<u8>]) -> Fingerprint {
    client.register_model(blocks, |_, _| {}).expect("register").fingerprint
}

fn stack_blocks() -> Vec<Vec<u8>> {
    (0..STACK).map(|i| archive(&format!("stack.block{i}"))).collect()
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// `rows` × 512 floats in [-1, 1), different for each seed.
fn input(rows: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..rows * 512)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn stop(block: u32) -> Breakpoint {
    Breakpoint { block, send_activation: true }
}

/// The one output tensor of a run, as floats.
fn floats(output: &Output) -> Vec<f32> {
    assert_eq!(output.value, Value::Tensor(0), "one tensor");
    f32s(output.tensor_bytes(0))
}

fn run(client: &mut Client, model: &Fingerprint, x: &[f32]) -> Vec<f32> {
    let bytes = f32_bytes(x);
    let t = [TensorRef { dtype: DType::F32, shape: &[(x.len() / 512) as u64, 512], bytes: &bytes }];
    floats(&client.execute(model, &[Value::Tensor(0)], &t).expect("execute"))
}

fn run_until(client: &mut Client, model: &Fingerprint, x: &[f32], until: Breakpoint) -> djinn_client::Paused {
    let bytes = f32_bytes(x);
    let t = [TensorRef { dtype: DType::F32, shape: &[(x.len() / 512) as u64, 512], bytes: &bytes }];
    client.execute_until(model, &[Value::Tensor(0)], &t, false, until).expect("execute until")
}

fn done(resumed: Resumed) -> Output {
    match resumed {
        Resumed::Done(output) => output,
        Resumed::Paused(p) => panic!("paused again after block {}", p.block),
    }
}

fn code(e: djinn_client::ClientError) -> ErrorCode {
    e.remote_code().unwrap_or_else(|| panic!("not a node's refusal: {e}"))
}

#[test]
fn pausing_after_any_block_and_resuming_gives_the_straight_output() {
    let node = Node::start("mio", &[]);
    let mut client = node.client();
    let blocks = stack_blocks();
    let model = register(&mut client, &blocks);
    let x = input(4, 1);
    let straight = run(&mut client, &model, &x);
    for k in 0..STACK - 1 {
        // The activation is what the first k + 1 blocks, as a model of their own, return.
        let head = register(&mut client, &blocks[..=k]);
        let paused = run_until(&mut client, &model, &x, stop(k as u32));
        assert_eq!(paused.block, k as u32);
        let activation = paused.activation.as_ref().expect("the activation was asked for");
        assert_eq!(floats(activation), run(&mut client, &head, &x), "the activation after block {k}");
        let out = done(client.resume(paused.parked, None, None).expect("resume"));
        assert_eq!(floats(&out), straight, "paused after block {k}");
    }
    // Stopping twice: after block 1, then after block 5.
    let paused = run_until(&mut client, &model, &x, Breakpoint { block: 1, send_activation: false });
    assert!(paused.activation.is_none(), "not asked for: it stays on the node");
    let again = match client.resume(paused.parked, None, Some(stop(5))).expect("resume to block 5") {
        Resumed::Paused(p) => p,
        Resumed::Done(_) => panic!("ran past the breakpoint"),
    };
    assert_eq!(again.block, 5);
    let inspected = client.inspect(again.parked).expect("inspect");
    let head = register(&mut client, &blocks[..=5]);
    assert_eq!(floats(inspected.activation.as_ref().expect("inspect sends it")), run(&mut client, &head, &x));
    assert_eq!(floats(&done(client.resume(again.parked, None, None).expect("resume"))), straight);
    assert_eq!(node.stat(&mut client, "parked"), 0);
    assert_eq!(node.stat(&mut client, "parked_bytes"), 0);
}

#[test]
fn a_replaced_activation_gives_what_the_remaining_blocks_give_on_it() {
    let node = Node::start("mio", &[]);
    let mut client = node.client();
    let blocks = stack_blocks();
    let model = register(&mut client, &blocks);
    let x = input(4, 2);
    for k in [0, 3, STACK - 2] {
        let paused = run_until(&mut client, &model, &x, stop(k as u32));
        let nudged: Vec<f32> = floats(paused.activation.as_ref().expect("activation"))
            .iter()
            .enumerate()
            .map(|(i, v)| v + if i % 3 == 0 { 0.25 } else { -0.125 })
            .collect();
        let bytes = f32_bytes(&nudged);
        let t = [TensorRef { dtype: DType::F32, shape: &[4, 512], bytes: &bytes }];
        let out = done(client.resume(paused.parked, Some((&Value::Tensor(0), &t)), None).expect("resume"));
        let tail = register(&mut client, &blocks[k + 1..]);
        assert_eq!(floats(&out), run(&mut client, &tail, &nudged), "replaced after block {k}");
    }
}

#[test]
fn bad_breakpoints_and_resumes_get_clear_errors_and_leave_the_request_parked() {
    let node = Node::start("mio", &[]);
    let mut client = node.client();
    let model = register(&mut client, &stack_blocks());
    let x = input(4, 3);
    let bytes = f32_bytes(&x);
    let t = [TensorRef { dtype: DType::F32, shape: &[4, 512], bytes: &bytes }];
    let past = client.execute_until(&model, &[Value::Tensor(0)], &t, false, stop(STACK as u32 - 1)).unwrap_err();
    assert_eq!(code(past), ErrorCode::BadBreakpoint);
    let one_block = register(&mut client, &[archive("stack.block0")]);
    let e = client.execute_until(&one_block, &[Value::Tensor(0)], &t, false, stop(0)).unwrap_err();
    assert!(e.to_string().contains("one block has no breakpoints"), "{e}");

    let paused = run_until(&mut client, &model, &x, stop(2));
    let wrong = |client: &mut Client, dtype: DType, shape: &[u64], value: Value| {
        let bytes = vec![0u8; (shape.iter().product::<u64>() * dtype.size()) as usize];
        let t = [TensorRef { dtype, shape, bytes: &bytes }];
        client.resume(paused.parked, Some((&value, &t)), None).unwrap_err()
    };
    let e = wrong(&mut client, DType::F32, &[4, 256], Value::Tensor(0));
    assert!(e.to_string().contains("activation is a f32[4, 256] tensor where a f32[4, 512] tensor was parked"), "{e}");
    assert_eq!(code(e), ErrorCode::BadBreakpoint);
    let e = wrong(&mut client, DType::F16, &[4, 512], Value::Tensor(0));
    assert!(e.to_string().contains("f16[4, 512]"), "{e}");
    let e = wrong(&mut client, DType::F32, &[4, 512], Value::Tuple(vec![Value::Tensor(0), Value::Int(1)]));
    assert!(e.to_string().contains("a tuple where"), "{e}");
    let e = client.resume(paused.parked, None, Some(stop(1))).unwrap_err();
    assert!(e.to_string().contains("this run starts at block 3"), "{e}");

    // None of that touched the parked request: it resumes as if nothing happened.
    let out = done(client.resume(paused.parked, None, None).expect("resume"));
    assert_eq!(floats(&out), run(&mut client, &model, &x));
    let twice = client.resume(paused.parked, None, None).unwrap_err();
    assert!(twice.to_string().contains("was already resumed"), "{twice}");
    assert_eq!(code(twice), ErrorCode::NotFound);
    let unknown = Handle { id: 999, ..paused.parked };
    assert_eq!(code(client.resume(unknown, None, None).unwrap_err()), ErrorCode::NotFound);
    let stale = Handle { epoch: paused.parked.epoch ^ 1, ..paused.parked };
    assert_eq!(code(client.resume(stale, None, None).unwrap_err()), ErrorCode::StaleHandle);

    let aborted = run_until(&mut client, &model, &x, stop(4));
    client.abort(aborted.parked).expect("abort");
    let e = client.resume(aborted.parked, None, None).unwrap_err();
    assert!(e.to_string().contains("was already aborted"), "{e}");
    assert_eq!(code(client.abort(aborted.parked).unwrap_err()), ErrorCode::NotFound);
    assert_eq!(node.stat(&mut client, "parked"), 0);
}

#[test]
fn parked_requests_hold_no_worker_and_sixteen_clients_are_served_meanwhile() {
    let node = Node::start("mio", &["--workers", "2"]);
    let mut client = node.client();
    let model = register(&mut client, &stack_blocks());
    // More parked requests than workers: none of them holds one.
    let parked: Vec<_> = (0..4).map(|i| (i, run_until(&mut client, &model, &input(4, 10 + i), stop(3)))).collect();
    let expected: Vec<Vec<f32>> = (0..16).map(|c| run(&mut client, &model, &input(2, 100 + c))).collect();
    std::thread::scope(|scope| {
        for (c, expected) in expected.iter().enumerate() {
            let node = &node;
            scope.spawn(move || {
                let mut client = node.client();
                for _ in 0..20 {
                    assert_eq!(&run(&mut client, &model, &input(2, 100 + c as u64)), expected, "client {c}");
                }
            });
        }
    });
    for (i, p) in parked {
        let out = done(client.resume(p.parked, None, None).expect("resume"));
        assert_eq!(floats(&out), run(&mut client, &model, &input(4, 10 + i)));
    }
}

#[test]
fn parked_activations_count_against_the_budget_and_are_released_after_the_time_limit() {
    // 8 MiB of weights and room for two 4 MiB activations, not three.
    let node = Node::start("mio", &["--device-memory-budget", "17MiB", "--parked-ttl", "1"]);
    let mut client = node.client();
    let model = register(&mut client, &stack_blocks());
    let before = node.stat(&mut client, "budget_used_bytes");
    let x = input(2048, 5);
    let a = run_until(&mut client, &model, &x, Breakpoint { block: 2, send_activation: false });
    let b = run_until(&mut client, &model, &x, Breakpoint { block: 4, send_activation: false });
    assert_eq!(node.stat(&mut client, "parked_bytes"), 2 * 2048 * 512 * 4);
    assert_eq!(node.stat(&mut client, "budget_used_bytes"), before + 2 * 2048 * 512 * 4);
    let bytes = f32_bytes(&x);
    let t = [TensorRef { dtype: DType::F32, shape: &[2048, 512], bytes: &bytes }];
    let over = client.execute_until(&model, &[Value::Tensor(0)], &t, false, stop(1)).unwrap_err();
    assert_eq!(code(over), ErrorCode::OverBudget);
    client.abort(b.parked).expect("abort");
    assert_eq!(node.stat(&mut client, "budget_used_bytes"), before + 2048 * 512 * 4);

    // Left alone, `a` is released after its second, with its memory.
    std::thread::sleep(Duration::from_millis(1200));
    node.wait_for_stat(&mut client, "parked", 0);
    assert_eq!(node.stat(&mut client, "parked_expired"), 1);
    assert_eq!(node.stat(&mut client, "budget_used_bytes"), before);
    let e = client.resume(a.parked, None, None).unwrap_err();
    assert!(e.to_string().contains("released after its time limit"), "{e}");
}

/// The two-block stateful model: block 0 doubles its input and passes the state (total, steps)
/// on; block 1 adds that to the total, returns it and the new state.
fn stateful_session(client: &mut Client) -> Handle {
    let blocks = [archive("stateful.block0"), archive("stateful.block1")];
    let model = register(client, &blocks);
    let zeros = f32_bytes(&[0.0; 4]);
    let steps = 0i64.to_le_bytes();
    let state = [
        TensorRef { dtype: DType::F32, shape: &[4], bytes: &zeros },
        TensorRef { dtype: DType::I64, shape: &[], bytes: &steps },
    ];
    client.session_open(&model, &state, 0).expect("open")
}

fn step_input(v: f32) -> Vec<u8> {
    f32_bytes(&[v; 4])
}

#[test]
fn a_parked_session_step_holds_the_sessions_later_requests_until_it_ends() {
    let node = Node::start("mio", &[]);
    let mut client = node.client();
    let session = stateful_session(&mut client);
    let one = step_input(1.0);
    let t = [TensorRef { dtype: DType::F32, shape: &[4], bytes: &one }];
    let total = |out: &Output| f32s(out.tensor_bytes(0));
    assert_eq!(total(&client.session_step(session, &[Value::Tensor(0)], &t).expect("step")), [2.0; 4]);

    // Stopped after block 0: the activation is (2x, total, steps); only 2x is charged (at
    // least a page, what any parked request is charged), the state is charged to the session
    // already.
    let paused = client.session_step_until(session, &[Value::Tensor(0)], &t, stop(0)).expect("step until");
    let activation = paused.activation.as_ref().expect("activation");
    let Value::Tuple(items) = &activation.value else { panic!("{:?}", activation.value) };
    assert_eq!(items.len(), 3);
    assert_eq!(node.stat(&mut client, "parked_bytes"), 4096);
    let steps = node.stat(&mut client, "session_steps");

    // A step sent meanwhile waits for the parked one.
    let addr = node.addr;
    let waiting = std::thread::spawn(move || {
        let mut other = Client::connect(addr).expect("connect");
        let three = step_input(3.0);
        let t = [TensorRef { dtype: DType::F32, shape: &[4], bytes: &three }];
        let out = other.session_step(session, &[Value::Tensor(0)], &t).expect("step");
        f32s(out.tensor_bytes(0))
    });
    // The node has the later step (a request handed on and not answered) and holds it: no step
    // of the session ran, and no answer came.
    node.wait_for_stat(&mut client, "requests_in_flight", 1);
    assert_eq!(node.stat(&mut client, "session_steps"), steps, "the later step ran before the parked one ended");
    assert!(!waiting.is_finished(), "the later step was answered before the parked one ended");

    // Resumed with 2x replaced by 10 and the total passed through by 0: the total is 10; then
    // the waiting step adds 6.
    let ten = f32_bytes(&[10.0; 4]);
    let zeros = f32_bytes(&[0.0; 4]);
    let steps = 0i64.to_le_bytes();
    let t = [
        TensorRef { dtype: DType::F32, shape: &[4], bytes: &ten },
        TensorRef { dtype: DType::F32, shape: &[4], bytes: &zeros },
        TensorRef { dtype: DType::I64, shape: &[], bytes: &steps },
    ];
    let replacement = Value::Tuple(vec![Value::Tensor(0), Value::Tensor(1), Value::Tensor(2)]);
    let out = done(client.resume(paused.parked, Some((&replacement, &t)), None).expect("resume"));
    assert_eq!(total(&out), [10.0; 4], "0 (the replaced total) + 10");
    // (The waiting client's own timeout, a minute, guards against a hang.)
    assert_eq!(waiting.join().expect("the waiting step"), [16.0; 4]);

    // Aborted: the state stays as it was, and the session goes on.
    let paused = client.session_step_until(session, &[Value::Tensor(0)], &t[..1], stop(0)).expect("step until");
    client.abort(paused.parked).expect("abort");
    let one = step_input(1.0);
    let t = [TensorRef { dtype: DType::F32, shape: &[4], bytes: &one }];
    assert_eq!(total(&client.session_step(session, &[Value::Tensor(0)], &t).expect("step")), [18.0; 4]);
    client.session_close(session).expect("close");
}

/// Signals and steps sent to a session whose step is parked wait for it, up to
/// `MAX_QUEUED_OPS` (256): past that each is refused with `Busy`, however many come, and once
/// the parked step ends the session takes requests again.
#[test]
fn requests_waiting_on_a_parked_session_step_are_bounded() {
    let node = Node::start("mio", &[]);
    let mut client = node.client();
    let session = stateful_session(&mut client);
    let one = step_input(1.0);
    let t = [TensorRef { dtype: DType::F32, shape: &[4], bytes: &one }];
    let paused = client.session_step_until(session, &[Value::Tensor(0)], &t, stop(0)).expect("step until");
    let mut refused = 0;
    for _ in 0..10_000 {
        match client.session_signal(session, djinn_client::Signal::Compute) {
            Ok(()) => {}
            Err(e) => {
                assert_eq!(code(e), ErrorCode::Busy);
                refused += 1;
            }
        }
    }
    assert_eq!(refused, 10_000 - 256, "256 signals wait, the rest are refused");
    let e = client.session_step(session, &[Value::Tensor(0)], &t).expect_err("a step past the bound");
    assert_eq!(code(e), ErrorCode::Busy);
    client.abort(paused.parked).expect("abort");
    // The waiting signals run; then the session steps as before (state 0 + 2·1). The abort's
    // reply can come before they have run: until then a step is still refused, as above.
    let deadline = Instant::now() + Duration::from_secs(10);
    let out = loop {
        match client.session_step(session, &[Value::Tensor(0)], &t) {
            Err(e) if Instant::now() < deadline => {
                assert_eq!(code(e), ErrorCode::Busy);
                std::thread::sleep(Duration::from_millis(1));
            }
            out => break out.expect("step"),
        }
    };
    assert_eq!(f32s(out.tensor_bytes(0)), [2.0; 4]);
    client.session_close(session).expect("close");
}
