//! Models on a real node: registration (chunked, shared, evicted), execution with every kind of
//! input and output, bad requests, many clients, reconnection. Remote outputs are compared with
//! a local libtorch forward of the same archive.

mod support;

use std::sync::Arc;
use std::thread;

use djinn_client::{DType, ErrorCode, Fingerprint, TensorRef, Value};
use djinn_executor::tch;
use support::{Node, archive, f32_bytes, models_dir, pattern, register};
use tch::jit::{CModule, IValue};
use tch::{Kind, Tensor};

/// Bytes of a contiguous CPU tensor.
fn bytes_of(t: &Tensor) -> Vec<u8> {
    let t = t.contiguous();
    let n = t.numel() * t.kind().elt_size_in_bytes();
    // SAFETY: a contiguous CPU tensor of n bytes, alive for the copy.
    unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, n) }.to_vec()
}

fn local(name: &str) -> CModule {
    let mut m = CModule::load(models_dir().join(format!("{name}.pt"))).expect("local load");
    m.set_eval();
    m
}

#[test]
fn an_mlp_runs_remotely_exactly_as_locally_and_its_blocks_match_the_whole() {
    let node = Node::start("mio", &[]);
    let mut client = node.client();
    let mut sent = Vec::new();
    let whole = {
        let blocks = vec![archive("mlp")];
        let reg = client.register_model(&blocks, |s, t| sent.push((s, t))).unwrap();
        let info = reg.uploaded.expect("first registration uploads");
        assert_eq!(info.weight_bytes, (256 * 1024 + 1024 + 1024 * 256 + 256) * 4);
        assert_eq!(sent.last().copied(), Some((blocks[0].len() as u64, blocks[0].len() as u64)));
        reg.fingerprint
    };
    let split = register(&mut client, &["mlp.block0", "mlp.block1", "mlp.block2"]);
    let x = f32_bytes(4 * 256, 7);
    let input = TensorRef { dtype: DType::F32, shape: &[4, 256], bytes: &x };
    let expected = {
        let t = Tensor::from_data_size(&x, &[4, 256], Kind::Float);
        let _g = tch::no_grad_guard();
        bytes_of(&local("mlp").forward_ts(&[t]).unwrap())
    };
    for fingerprint in [whole, split] {
        let out = client.execute(&fingerprint, &[Value::Tensor(0)], &[input]).unwrap();
        assert_eq!(out.value, Value::Tensor(0));
        assert_eq!(out.tensors[0].dtype, DType::F32);
        assert_eq!(out.tensors[0].shape, vec![4, 256]);
        assert!(out.tensor_bytes(0) == expected.as_slice(), "remote output differs from the local forward");
    }
    let models = client.list_models().unwrap();
    assert_eq!(models.len(), 2);
    assert!(models.iter().any(|m| m.fingerprint == split && m.blocks == 3));
}

#[test]
fn nested_outputs_scalars_bf16_and_int64_come_back_faithfully() {
    let node = Node::start("uring", &[]);
    let mut client = node.client();
    let structured = register(&mut client, &["structured"]);
    let x = f32_bytes(6, 3);
    let out = client
        .execute(
            &structured,
            &[Value::Tensor(0), Value::Float(1.5), Value::Int(3)],
            &[TensorRef { dtype: DType::F32, shape: &[2, 3], bytes: &x }],
        )
        .unwrap();
    let Value::Dict(entries) = &out.value else { panic!("{:?}", out.value) };
    assert_eq!(entries.len(), 2);
    let scaled = entries.iter().find(|(k, _)| *k == Value::Str("scaled".into())).map(|(_, v)| v).unwrap();
    let Value::Tuple(parts) = scaled else { panic!("{scaled:?}") };
    let Value::Tensor(i) = parts[0] else { panic!() };
    assert_eq!(
        parts[1],
        Value::Tuple(vec![Value::Int(4), Value::Float(3.0), Value::Bool(true), Value::Str("ok".into())])
    );
    let local_x = Tensor::from_data_size(&x, &[2, 3], Kind::Float);
    assert_eq!(out.tensor_bytes(i as usize), bytes_of(&(local_x * 1.5)).as_slice());

    let halves = register(&mut client, &["halves"]);
    let xb: Vec<u8> = pattern(15 * 2, 4);
    let idx: Vec<u8> = (0..7i64).flat_map(|v| (v * 1_000_000_007).to_le_bytes()).collect();
    let out = client
        .execute(
            &halves,
            &[Value::Tensor(0), Value::Tensor(1)],
            &[
                TensorRef { dtype: DType::BF16, shape: &[3, 5], bytes: &xb },
                TensorRef { dtype: DType::I64, shape: &[7], bytes: &idx },
            ],
        )
        .unwrap();
    assert_eq!(out.value, Value::Tuple(vec![Value::Tensor(0), Value::Tensor(1)]));
    assert_eq!(out.tensors[0].dtype, DType::BF16);
    assert_eq!(out.tensors[1].dtype, DType::I64);
    let local_out = local("halves")
        .forward_is(&[
            IValue::Tensor(Tensor::from_data_size(&xb, &[3, 5], Kind::BFloat16)),
            IValue::Tensor(Tensor::from_data_size(&idx, &[7], Kind::Int64)),
        ])
        .unwrap();
    let IValue::Tuple(local_out) = local_out else { panic!() };
    let IValue::Tensor(a) = &local_out[0] else { panic!() };
    let IValue::Tensor(b) = &local_out[1] else { panic!() };
    assert_eq!(out.tensor_bytes(0), bytes_of(a).as_slice());
    assert_eq!(out.tensor_bytes(1), bytes_of(b).as_slice());
}

#[test]
fn a_64_mib_identity_round_trip_is_byte_exact() {
    let node = Node::start("mio", &[]);
    let mut client = node.client();
    let identity = register(&mut client, &["identity"]);
    let data = pattern(64 << 20, 11);
    let out = client
        .execute(&identity, &[Value::Tensor(0)], &[TensorRef { dtype: DType::U8, shape: &[64 << 20], bytes: &data }])
        .unwrap();
    assert!(out.tensor_bytes(0) == data.as_slice());
}

#[test]
fn bad_requests_get_typed_errors_and_the_node_keeps_serving() {
    let node = Node::start("mio", &[]);
    let mut client = node.client();
    let mlp = register(&mut client, &["mlp"]);
    let x = f32_bytes(4 * 256, 1);
    let good = TensorRef { dtype: DType::F32, shape: &[4, 256], bytes: &x };

    assert_eq!(
        code(client.execute(&Fingerprint([9; 32]), &[Value::Tensor(0)], &[good])),
        Some(ErrorCode::UnknownModel)
    );
    assert_eq!(code(client.register_model(&[b"not a zip archive".to_vec()], |_, _| {})), Some(ErrorCode::BadArchive));
    let mut truncated = archive("mlp");
    truncated.truncate(truncated.len() / 2);
    assert_eq!(code(client.register_model(&[truncated], |_, _| {})), Some(ErrorCode::BadArchive));
    // Too many inputs, the wrong dtype, the wrong shape.
    assert_eq!(
        code(client.execute(&mlp, &[Value::Tensor(0), Value::Tensor(0)], &[good])),
        Some(ErrorCode::ExecutionFailed)
    );
    let x64: Vec<u8> = x.iter().chain(x.iter()).copied().collect();
    let wrong_dtype = TensorRef { dtype: DType::F64, shape: &[4, 256], bytes: &x64 };
    assert_eq!(code(client.execute(&mlp, &[Value::Tensor(0)], &[wrong_dtype])), Some(ErrorCode::ExecutionFailed));
    let wrong_shape = TensorRef { dtype: DType::F32, shape: &[8, 128], bytes: &x };
    let err = client.execute(&mlp, &[Value::Tensor(0)], &[wrong_shape]).unwrap_err();
    assert_eq!(err.remote_code(), Some(ErrorCode::ExecutionFailed));
    assert!(err.to_string().contains("shapes cannot be multiplied"), "{err}");
    // An op that throws inside libtorch.
    let fails = register(&mut client, &["fails"]);
    assert_eq!(code(client.execute(&fails, &[Value::Tensor(0)], &[good])), Some(ErrorCode::ExecutionFailed));
    // Still serving, on the same connection.
    client.execute(&mlp, &[Value::Tensor(0)], &[good]).unwrap();
    assert_eq!(node.stat(&mut client, "execution_errors"), 4);
    assert_eq!(node.stat(&mut client, "model_load_errors"), 2);
}

#[test]
fn executions_that_fail_leak_nothing() {
    let node = Node::start("mio", &[]);
    let mut client = node.client();
    let mlp = register(&mut client, &["mlp"]);
    let x = f32_bytes(4 * 256, 1);
    let wrong_shape = TensorRef { dtype: DType::F32, shape: &[8, 128], bytes: &x };
    let fail = |client: &mut djinn_client::Client| {
        let e = client.execute(&mlp, &[Value::Tensor(0)], &[wrong_shape]).unwrap_err();
        assert_eq!(e.remote_code(), Some(ErrorCode::ExecutionFailed));
    };
    for _ in 0..2000 {
        fail(&mut client);
    }
    let before = node.rss();
    // tch 0.26 leaked the inputs of every forward that failed (about 370 bytes each here, and
    // a reference to each input's memory): 20,000 of them took 7 MiB (see vendor/tch).
    for _ in 0..20_000 {
        fail(&mut client);
    }
    let grown = node.rss().saturating_sub(before);
    assert!(grown < 3 << 20, "the node grew by {grown} bytes over 20,000 failed executions");
}

#[test]
fn the_same_model_is_loaded_once_for_every_client() {
    let node = Node::start("mio", &[]);
    let mut a = node.client();
    let mut b = node.client();
    let blocks = vec![archive("mlp")];
    let first = a.register_model(&blocks, |_, _| {}).unwrap();
    let second = b.register_model(&blocks, |_, _| {}).unwrap();
    assert_eq!(first.fingerprint, second.fingerprint);
    assert!(first.uploaded.is_some() && second.uploaded.is_none(), "the second client uploads nothing");
    assert_eq!(node.stat(&mut a, "models"), 1);
    assert_eq!(node.stat(&mut a, "model_bytes"), first.uploaded.unwrap().weight_bytes);
}

#[test]
fn idle_models_are_evicted_least_recently_used_first() {
    let node = Node::start("mio", &["--device-memory-budget", "4MiB"]);
    let mut client = node.client();
    let mlp = register(&mut client, &["mlp"]);
    let identity = register(&mut client, &["identity"]);
    let one = [1u8];
    let tiny = TensorRef { dtype: DType::U8, shape: &[1], bytes: &one };
    client.execute(&identity, &[Value::Tensor(0)], &[tiny]).unwrap();
    // The split MLP needs the room the whole one holds; the whole one is the least recently used.
    let split = register(&mut client, &["mlp.block0", "mlp.block1", "mlp.block2"]);
    let x = f32_bytes(4 * 256, 2);
    let input = TensorRef { dtype: DType::F32, shape: &[4, 256], bytes: &x };
    let err = client.execute(&mlp, &[Value::Tensor(0)], &[input]).unwrap_err();
    assert_eq!(err.remote_code(), Some(ErrorCode::UnknownModel));
    client.execute(&split, &[Value::Tensor(0)], &[input]).unwrap();
    client.execute(&identity, &[Value::Tensor(0)], &[tiny]).unwrap();
    assert_eq!(node.stat(&mut client, "model_evictions"), 1);
    // Registering again brings it back (evicting what is idle now).
    register(&mut client, &["mlp"]);
    client.execute(&mlp, &[Value::Tensor(0)], &[input]).unwrap();
}

#[test]
fn thirty_two_clients_executing_one_model_all_get_correct_results() {
    let node = Arc::new(Node::start("mio", &[]));
    let mlp = register(&mut node.client(), &["mlp"]);
    let workers: Vec<_> = (0..32u64)
        .map(|id| {
            let node = Arc::clone(&node);
            thread::spawn(move || {
                let mut client = node.client();
                let module = local("mlp");
                for i in 0..20 {
                    let x = f32_bytes(4 * 256, id * 100 + i);
                    let t = Tensor::from_data_size(&x, &[4, 256], Kind::Float);
                    let expected = bytes_of(&tch::no_grad(|| module.forward_ts(&[t]).unwrap()));
                    let input = TensorRef { dtype: DType::F32, shape: &[4, 256], bytes: &x };
                    let out = client.execute(&mlp, &[Value::Tensor(0)], &[input]).unwrap();
                    assert!(out.tensor_bytes(0) == expected.as_slice(), "client {id}, call {i}");
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a client failed");
    }
}

#[test]
fn the_client_reconnects_after_the_node_restarts() {
    let node = Node::start("mio", &[]);
    let addr = node.addr.to_string();
    let mut client = node.client();
    client.put("x", DType::U8, &[1], &[1]).unwrap();
    drop(node);
    let node = Node::start_at(&addr, "mio", &[]);
    assert_eq!(node.addr.to_string(), addr);
    client.ping().expect("the client reconnects");
    assert_eq!(client.client_stats().0.reconnects, 1);
    // A new node holds nothing: the model must be registered again.
    assert!(client.get("x").unwrap_err().remote_code() == Some(ErrorCode::NotFound));
}

fn code<T>(result: Result<T, djinn_client::ClientError>) -> Option<ErrorCode> {
    result.map(drop).unwrap_err().remote_code()
}
