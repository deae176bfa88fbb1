//! Server-resident sessions: state that stays on the node between steps, IO_WAIT and COMPUTE
//! signals that move it between the device and the host pool, a state budget that many sessions
//! share under either policy, and what happens to sessions that are closed, expire or come from
//! an earlier life of the node.

mod support;

use std::time::Duration;

use djinn_client::{Client, DType, ErrorCode, Fingerprint, Handle, Signal, TensorRef, Value};
use support::{Node, archive};

fn register(client: &mut Client, name: &str) -> Fingerprint {
    client.register_model(&[archive(name)], |_, _| {}).expect("register").fingerprint
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Small integers as floats: sums of them are exact in any order, so the node's sums and ours
/// compare with `==`.
fn row(width: usize, session: usize, step: usize) -> Vec<f32> {
    (0..width).map(|i| ((i * 7 + session * 13 + step * 5) % 17) as f32).collect()
}

/// One step of `growing_cache` (its state is every row so far): returns the sum of the rows.
fn step_rows(client: &mut Client, session: Handle, rows: usize, x: &[f32]) -> Vec<f32> {
    let width = x.len() / rows;
    let bytes = f32_bytes(x);
    let input = [TensorRef { dtype: DType::F32, shape: &[rows as u64, width as u64], bytes: &bytes }];
    let out = client.session_step(session, &[Value::Tensor(0)], &input).expect("step");
    assert_eq!(out.value, Value::Tensor(0));
    f32s(out.tensor_bytes(0))
}

/// Opens a `growing_cache` session whose state starts empty (0 rows of `width`).
fn open_cache(client: &mut Client, model: &Fingerprint, width: u64, reserve: u64) -> Result<Handle, ErrorCode> {
    let empty = [TensorRef { dtype: DType::F32, shape: &[0, width], bytes: &[] }];
    client.session_open(model, &empty, reserve).map_err(|e| e.remote_code().unwrap_or(ErrorCode::Internal))
}

fn bytes_moved<T>(client: &mut Client, f: impl FnOnce(&mut Client) -> T) -> (T, u64, u64) {
    let (_, sent, received) = client.client_stats();
    let out = f(client);
    let (_, sent_after, received_after) = client.client_stats();
    (out, sent_after - sent, received_after - received)
}

#[test]
fn a_sessions_state_stays_on_the_node_between_steps() {
    let node = Node::start("mio", &[]);
    let mut client = node.client();
    let model = register(&mut client, "growing_cache");
    let (width, rows) = (256usize, 64usize);
    let session = open_cache(&mut client, &model, width as u64, 0).expect("open");
    let mut expected = vec![0f32; width];
    for step in 0..8 {
        let x: Vec<f32> = (0..rows).flat_map(|r| row(width, r, step)).collect();
        for (i, e) in expected.iter_mut().enumerate() {
            *e += (0..rows).map(|r| x[r * width + i]).sum::<f32>();
        }
        let (sum, sent, received) = bytes_moved(&mut client, |c| step_rows(c, session, rows, &x));
        assert_eq!(sum, expected, "step {step}");
        // The input (64 KiB) goes out and the sum (1 KiB) comes back; the state, 64 KiB more
        // at every step, never crosses.
        assert!(sent < (rows * width * 4 + 1024) as u64, "step {step}: {sent} bytes sent");
        assert!(received < (width * 4 + 1024) as u64, "step {step}: {received} bytes received");
    }
    let state = (8 * rows * width * 4) as u64;
    assert_eq!(node.stat(&mut client, "sessions"), 1);
    assert_eq!(node.stat(&mut client, "session_steps"), 8);
    assert_eq!(node.stat(&mut client, "session_device_bytes"), state, "the state is charged as it grows");
    client.session_close(session).expect("close");
    assert_eq!(node.stat(&mut client, "sessions"), 0);
    assert_eq!(node.stat(&mut client, "session_device_bytes"), 0);
    let err = client.session_step(session, &[], &[]).unwrap_err();
    assert_eq!(err.remote_code(), Some(ErrorCode::NotFound), "{err}");
}

#[test]
fn a_model_with_two_state_tensors_returns_its_outputs_as_a_tuple() {
    let node = Node::start("mio", &[]);
    let mut client = node.client();
    let model = register(&mut client, "counter");
    let (zeros, zero) = (f32_bytes(&[0.0; 3]), 0i64.to_le_bytes());
    let state = [
        TensorRef { dtype: DType::F32, shape: &[3], bytes: &zeros },
        TensorRef { dtype: DType::I64, shape: &[], bytes: &zero },
    ];
    let session = client.session_open(&model, &state, 0).expect("open");
    let mut total = [0f32; 3];
    for step in 1..=5i64 {
        let x = [step as f32, 1.0, -2.0];
        total.iter_mut().zip(x).for_each(|(t, v)| *t += v);
        let bytes = f32_bytes(&x);
        let out = client
            .session_step(session, &[Value::Tensor(0)], &[TensorRef { dtype: DType::F32, shape: &[3], bytes: &bytes }])
            .expect("step");
        assert_eq!(out.value, Value::Tuple(vec![Value::Tensor(0), Value::Tensor(1)]));
        assert_eq!(f32s(out.tensor_bytes(0)), total.map(|t| t * 2.0));
        assert_eq!(out.tensor_bytes(1), (step * 10).to_le_bytes());
    }
}

#[test]
fn io_wait_swaps_the_state_out_and_it_comes_back_for_the_next_step() {
    let node = Node::start("mio", &["--session-policy", "semantic"]);
    let mut client = node.client();
    let model = register(&mut client, "growing_cache");
    let session = open_cache(&mut client, &model, 4, 0).expect("open");
    let mut expected = vec![0f32; 4];
    let mut step = |client: &mut Client, n: usize| {
        let x = row(4, 0, n);
        expected.iter_mut().zip(&x).for_each(|(e, v)| *e += v);
        assert_eq!(step_rows(client, session, 1, &x), expected, "step {n}");
    };
    step(&mut client, 0);

    // IO_WAIT with no resume time: out at once (in the background), back at the next step.
    client.session_signal(session, Signal::IoWait { resume_in_ms: None }).expect("io_wait");
    node.wait_for_stat(&mut client, "sessions_on_host", 1);
    assert_eq!(node.stat(&mut client, "session_swaps_out"), 1);
    assert_eq!(node.stat(&mut client, "session_device_bytes"), 0);
    assert_eq!(node.stat(&mut client, "session_host_bytes"), 16);
    step(&mut client, 1);
    assert_eq!(node.stat(&mut client, "session_swaps_in"), 1);
    assert_eq!(node.stat(&mut client, "sessions_on_device"), 1);

    // COMPUTE brings it back without a step.
    client.session_signal(session, Signal::IoWait { resume_in_ms: None }).expect("io_wait");
    client.session_signal(session, Signal::Compute).expect("compute");
    node.wait_for_stat(&mut client, "session_swaps_in", 2);
    assert_eq!(node.stat(&mut client, "sessions_on_device"), 1);
    step(&mut client, 2);

    // With a resume time the node restores it ahead, unasked.
    client.session_signal(session, Signal::IoWait { resume_in_ms: Some(100) }).expect("io_wait");
    node.wait_for_stat(&mut client, "session_swaps_out", 3);
    node.wait_for_stat(&mut client, "session_restores_ahead", 1);
    assert_eq!(node.stat(&mut client, "sessions_on_device"), 1);
    step(&mut client, 3);
    assert_eq!(node.stat(&mut client, "session_swaps_in"), 3, "the step found the state on the device");
}

#[test]
fn under_lru_signals_move_nothing() {
    let node = Node::start("mio", &["--session-policy", "lru"]);
    let mut client = node.client();
    let model = register(&mut client, "growing_cache");
    let session = open_cache(&mut client, &model, 4, 0).expect("open");
    client.session_signal(session, Signal::IoWait { resume_in_ms: Some(1) }).expect("io_wait");
    // The step after the signal is served after it: by then it has taken effect.
    assert_eq!(step_rows(&mut client, session, 1, &[1.0, 2.0, 3.0, 4.0]), [1.0, 2.0, 3.0, 4.0]);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(node.stat(&mut client, "session_swaps_out"), 0);
    assert_eq!(node.stat(&mut client, "session_restores_ahead"), 0);
    assert_eq!(node.stat(&mut client, "sessions_on_device"), 1);
}

#[test]
fn two_hundred_sessions_go_through_a_budget_that_holds_twenty() {
    const SESSIONS: usize = 200;
    const STEPS: usize = 5;
    const WIDTH: usize = 256;
    // Each session's state ends at STEPS rows of WIDTH floats; the budget holds twenty of them.
    let reserve = (STEPS * WIDTH * 4) as u64;
    for policy in ["semantic", "lru"] {
        let budget = (20 * reserve).to_string();
        let node = Node::start("mio", &["--session-policy", policy, "--session-budget", &budget]);
        let mut client = node.client();
        let model = register(&mut client, "growing_cache");
        let sessions: Vec<Handle> =
            (0..SESSIONS).map(|_| open_cache(&mut client, &model, WIDTH as u64, reserve).expect("open")).collect();
        // Four clients, each stepping its fifty sessions in turn: every step needs its state
        // back on the device and another's out.
        std::thread::scope(|scope| {
            for (c, mine) in sessions.chunks(SESSIONS / 4).enumerate() {
                let node = &node;
                scope.spawn(move || {
                    let mut client = node.client();
                    let mut sums = vec![vec![0f32; WIDTH]; mine.len()];
                    for step in 0..STEPS {
                        for (i, (&session, sum)) in mine.iter().zip(&mut sums).enumerate() {
                            let x = row(WIDTH, c * 1000 + i, step);
                            sum.iter_mut().zip(&x).for_each(|(s, v)| *s += v);
                            assert_eq!(
                                &step_rows(&mut client, session, 1, &x),
                                sum,
                                "{policy}: session {i} step {step}"
                            );
                            if step % 2 == 1 {
                                client.session_signal(session, Signal::IoWait { resume_in_ms: None }).expect("io_wait");
                            }
                        }
                    }
                });
            }
        });
        assert_eq!(node.stat(&mut client, "sessions"), SESSIONS as u64);
        assert_eq!(node.stat(&mut client, "session_steps"), (SESSIONS * STEPS) as u64);
        assert!(node.stat(&mut client, "sessions_on_device") <= 20, "{policy}");
        assert!(node.stat(&mut client, "session_device_bytes") <= 20 * reserve, "{policy}");
        assert!(node.stat(&mut client, "session_swaps_out") >= (SESSIONS * (STEPS - 1)) as u64 / 2, "{policy}");
        assert_eq!(node.stat(&mut client, "session_swaps_refused"), 0, "{policy}");
        for session in sessions {
            client.session_close(session).expect("close");
        }
        assert_eq!(node.stat(&mut client, "session_device_bytes"), 0, "{policy}");
        assert_eq!(node.stat(&mut client, "session_host_bytes"), 0, "{policy}");
    }
}

#[test]
fn a_dead_clients_sessions_are_closed_after_the_idle_timeout() {
    let node = Node::start("mio", &["--session-idle-timeout", "0.3"]);
    let mut client = node.client();
    let model = register(&mut client, "growing_cache");
    let session = open_cache(&mut client, &model, 4, 1 << 20).expect("open");
    step_rows(&mut client, session, 1, &[1.0; 4]);
    assert_eq!(node.stat(&mut client, "session_device_bytes"), 1 << 20, "the reservation is charged");
    drop(client);
    let mut other = node.client();
    node.wait_for_stat(&mut other, "sessions", 0);
    assert_eq!(node.stat(&mut other, "sessions_expired"), 1);
    assert_eq!(node.stat(&mut other, "session_device_bytes"), 0);
    let err = other.session_step(session, &[], &[]).unwrap_err();
    assert_eq!(err.remote_code(), Some(ErrorCode::NotFound), "{err}");
    assert!(err.to_string().contains("expired"), "{err}");
}

#[test]
fn bad_session_requests_get_clear_errors_and_the_session_goes_on() {
    let node = Node::start("mio", &["--session-budget", "1MiB"]);
    let mut client = node.client();
    let model = register(&mut client, "growing_cache");
    let session = open_cache(&mut client, &model, 4, 0).expect("open");

    // Unknown id, earlier epoch, unknown model, a reservation over the budget.
    let unknown = Handle { id: session.id + 100, epoch: session.epoch };
    let err = client.session_signal(unknown, Signal::Compute).unwrap_err();
    assert_eq!(err.remote_code(), Some(ErrorCode::NotFound), "{err}");
    let stale = Handle { id: session.id, epoch: session.epoch ^ 1 };
    let err = client.session_step(stale, &[], &[]).unwrap_err();
    assert_eq!(err.remote_code(), Some(ErrorCode::StaleHandle), "{err}");
    assert_eq!(open_cache(&mut client, &Fingerprint([7; 32]), 4, 0), Err(ErrorCode::UnknownModel));
    assert_eq!(open_cache(&mut client, &model, 4, 2 << 20), Err(ErrorCode::OverBudget));

    // A step the model cannot take (a row of the wrong width) fails, and the state is as it was.
    step_rows(&mut client, session, 1, &[1.0; 4]);
    let bytes = f32_bytes(&[1.0; 5]);
    let err = client
        .session_step(session, &[Value::Tensor(0)], &[TensorRef { dtype: DType::F32, shape: &[1, 5], bytes: &bytes }])
        .unwrap_err();
    assert_eq!(err.remote_code(), Some(ErrorCode::ExecutionFailed), "{err}");
    assert_eq!(step_rows(&mut client, session, 1, &[1.0; 4]), [2.0; 4]);

    // A closed session is gone.
    client.session_close(session).expect("close");
    let err = client.session_close(session).unwrap_err();
    assert_eq!(err.remote_code(), Some(ErrorCode::NotFound), "{err}");
    assert_eq!(node.stat(&mut client, "sessions"), 0);
}
