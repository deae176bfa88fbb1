//! Graphs sent by the Rust client to a node, as a tenant without the TorchScript right: a
//! hand-written graph runs through the dispatcher and gives what libtorch gives here; graphs
//! naming operators off the allowlist, or writing a weight, are refused with a typed error
//! naming the operator, and the node goes on serving.

mod support;

use std::collections::BTreeMap;

use djinn_client::{Client, ClientOptions, DType, ErrorCode, TensorRef, Value};
use djinn_executor::tch::{Kind, Tensor};
use djinn_graph::format::FORMAT;
use djinn_graph::{Arg, DimRange, Input, Node as GraphNode, Program, Weight};
use support::Node;

const TOKEN: &str = "graphs-tenant-token-0123456789";

/// A node with one tenant, which has no right to TorchScript, and its client.
fn tenant_node(dir: &std::path::Path) -> (Node, Client) {
    let file = dir.join("tokens.json");
    std::fs::write(&file, format!(r#"{{"principals": [{{"name": "graphs", "tokens": ["{TOKEN}"]}}]}}"#)).unwrap();
    let node = Node::start("mio", &["--auth-file", file.to_str().unwrap()]);
    let client = Client::connect_with(node.addr, ClientOptions { token: TOKEN.into(), ..Default::default() }).unwrap();
    (node, client)
}

fn op(name: &str, overload: &str, args: Vec<Arg>, outputs: Vec<u32>) -> GraphNode {
    GraphNode { op: name.into(), overload: overload.into(), args, kwargs: BTreeMap::new(), outputs }
}

/// `x` (value 0: f32, 1 to 8 rows of 4) and the weight `w` (value 1: 4 × 4), then `nodes`.
fn program(nodes: Vec<GraphNode>, out: u32) -> Program {
    Program {
        format: FORMAT,
        inputs: vec![Input {
            name: "x".into(),
            value: 0,
            dtype: "float32".into(),
            dims: vec![DimRange { min: 1, max: 8 }, DimRange { min: 4, max: 4 }],
            state: false,
        }],
        weights: vec![Weight { name: "w".into(), value: 1, dtype: "float32".into(), shape: vec![4, 4], offset: 0 }],
        nodes,
        outputs: vec![Arg::Value(out)],
        state: vec![],
        entries: vec![],
    }
}

fn weight() -> Vec<f32> {
    (0..16).map(|i| i as f32 / 8.0 - 1.0).collect()
}

fn container(p: &Program) -> Vec<u8> {
    let w: Vec<u8> = weight().iter().flat_map(|v| v.to_le_bytes()).collect();
    djinn_graph::encode(p, &[&w]).unwrap()
}

#[test]
fn a_hand_written_graph_runs_through_the_dispatcher_for_every_size_its_ranges_allow() {
    let dir = tempfile::tempdir().unwrap();
    let (_node, mut client) = tenant_node(dir.path());
    // relu(linear(x, w)) * (rows of x): an operator, a size and the runner's arithmetic.
    let graph = program(
        vec![
            op("aten::linear", "", vec![Arg::Value(0), Arg::Value(1), Arg::None], vec![2]),
            op("aten::relu", "", vec![Arg::Value(2)], vec![3]),
            op("native::size", "", vec![Arg::Value(0), Arg::Int(0)], vec![4]),
            op("aten::mul", "Tensor", vec![Arg::Value(3), Arg::Value(4)], vec![5]),
        ],
        5,
    );
    let model = client.register_model(&[container(&graph)], |_, _| {}).unwrap().fingerprint;
    let w = Tensor::from_slice(&weight()).reshape([4, 4]);
    for rows in [1usize, 3, 8] {
        let x: Vec<f32> = (0..rows * 4).map(|i| (i as f32 * 0.37).sin()).collect();
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let input = [TensorRef { dtype: DType::F32, shape: &[rows as u64, 4], bytes: &bytes }];
        let out = client.execute(&model, &[Value::Tensor(0)], &input).unwrap();
        let local = (Tensor::from_slice(&x).reshape([rows as i64, 4]).linear::<Tensor>(&w, None).relu() * rows as f64)
            .to_kind(Kind::Float);
        let mut want = vec![0f32; rows * 4];
        local.copy_data(&mut want, rows * 4);
        let want: Vec<u8> = want.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(out.tensor_bytes(0), &want[..], "{rows} rows");
    }
    // Nine rows are outside the input's range: refused before anything runs.
    let bytes = vec![0u8; 9 * 16];
    let e = client
        .execute(&model, &[Value::Tensor(0)], &[TensorRef { dtype: DType::F32, shape: &[9, 4], bytes: &bytes }])
        .unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::ExecutionFailed), "{e}");
    assert!(e.to_string().contains("\"x\"") && e.to_string().contains("1..=8"), "{e}");
}

#[test]
fn graphs_off_the_allowlist_or_writing_a_weight_are_refused_by_name_and_the_node_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    let (_node, mut client) = tenant_node(dir.path());
    let cases = [
        (
            op("aten::from_file", "", vec![Arg::Str("/etc/passwd".into()), Arg::Bool(false), Arg::Int(4096)], vec![2]),
            "aten::from_file",
        ),
        (op("aten::save", "", vec![Arg::Value(1), Arg::Str("/tmp/stolen".into())], vec![]), "aten::save"),
        (op("aten::copy_", "", vec![Arg::Value(1), Arg::Value(0)], vec![2]), "a weight"),
        (
            op("aten::native_dropout", "", vec![Arg::Value(0), Arg::Float("0.5".into()), Arg::Bool(true)], vec![2, 3]),
            "aten::native_dropout",
        ),
    ];
    for (node, why) in cases {
        let graph = program(vec![node], 2);
        let e = client.register_model(&[container(&graph)], |_, _| {}).unwrap_err();
        assert_eq!(e.remote_code(), Some(ErrorCode::GraphRefused), "{e}");
        assert!(e.to_string().contains(why), "{e} (expected {why:?})");
    }
    // Bytes that are neither a graph nor allowed TorchScript.
    let e = client.register_model(&[b"DJINNGR1\xff\xff".to_vec()], |_, _| {}).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::BadArchive), "{e}");
    let e = client.register_model(&[support::archive("identity")], |_, _| {}).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::Forbidden), "{e}");
    assert!(e.to_string().contains("djinn.register"), "the refusal says how to move: {e}");
    // Still serving, the same connection.
    let good = program(vec![op("aten::relu", "", vec![Arg::Value(0)], vec![2])], 2);
    let model = client.register_model(&[container(&good)], |_, _| {}).unwrap().fingerprint;
    let bytes: Vec<u8> = [-1f32, 2.0, -3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let out = client
        .execute(&model, &[Value::Tensor(0)], &[TensorRef { dtype: DType::F32, shape: &[1, 4], bytes: &bytes }])
        .unwrap();
    let want: Vec<u8> = [0f32, 2.0, 0.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(out.tensor_bytes(0), &want[..]);
}

/// A hand-written graph with session state: `total` (f32 [1, 4]) is written in place with
/// `index_copy_` at row 0 with `total + x`, and the step returns it (`x`: the input).
fn accumulator(state_shape: Vec<i64>) -> Program {
    let mut p = program(
        vec![
            op("aten::add", "Tensor", vec![Arg::Value(9), Arg::Value(0)], vec![2]),
            op("aten::zeros", "", vec![Arg::List(vec![Arg::Int(1)])], vec![3]),
            op("aten::_to_copy", "", vec![Arg::Value(3)], vec![4]),
            op("aten::index_copy_", "", vec![Arg::Value(9), Arg::Int(0), Arg::Value(4), Arg::Value(2)], vec![5]),
        ],
        5,
    );
    p.inputs[0].dims[0] = DimRange { min: 1, max: 1 };
    p.nodes[2].kwargs.insert("dtype".into(), Arg::Dtype("int64".into()));
    let dims = state_shape.iter().map(|&n| DimRange { min: n, max: n }).collect();
    p.inputs.push(Input { name: "total".into(), value: 9, dtype: "float32".into(), dims, state: true });
    p.state =
        vec![djinn_graph::State { name: "total".into(), dtype: "float32".into(), shape: state_shape, offset: None }];
    p.outputs.push(Arg::Value(5));
    p
}

#[test]
fn a_graph_with_state_keeps_it_in_sessions_written_in_place_and_bounded_before_it_is_made() {
    let dir = tempfile::tempdir().unwrap();
    let (_node, mut client) = tenant_node(dir.path());
    let model = client.register_model(&[container(&accumulator(vec![1, 4]))], |_, _| {}).unwrap().fingerprint;
    let x = |v: f32| -> Vec<u8> { [v; 4].iter().flat_map(|v| v.to_le_bytes()).collect() };
    // A model with state runs in sessions only.
    let e = client
        .execute(&model, &[Value::Tensor(0)], &[TensorRef { dtype: DType::F32, shape: &[1, 4], bytes: &x(1.0) }])
        .unwrap_err();
    assert!(e.to_string().contains("session"), "{e}");
    // The node makes the state (zeros) at open; each step adds its input to it, in place.
    let session = client.session_open(&model, &[], 0).unwrap();
    for (i, v) in [1.0f32, 2.0, 3.5].into_iter().enumerate() {
        let step = [TensorRef { dtype: DType::F32, shape: &[1, 4], bytes: &x(v) }];
        let out = client.session_step(session, &[Value::Tensor(0)], &step).unwrap();
        let want = [1.0f32, 3.0, 6.5][i];
        assert_eq!(out.tensor_bytes(0), &x(want)[..], "step {i}");
    }
    let stats: std::collections::HashMap<String, u64> = client.stats().unwrap().into_iter().collect();
    assert_eq!(stats["session_state_bytes_in_place"], 3 * 16, "{stats:?}");
    assert_eq!(stats["session_state_bytes_replaced"], 0, "{stats:?}");
    // A state given by the client must be shaped as the program's.
    let wrong = [TensorRef { dtype: DType::F32, shape: &[2, 4], bytes: &[0u8; 32] }];
    let e = client.session_open(&model, &wrong, 0).unwrap_err();
    assert!(e.to_string().contains("\"total\""), "{e}");
    // A state of 4 TiB is refused before any of it is made; the node serves on.
    let huge = client.register_model(&[container(&accumulator(vec![1 << 38, 4]))], |_, _| {}).unwrap().fingerprint;
    let e = client.session_open(&huge, &[], 0).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::OverBudget), "{e}");
    let step = [TensorRef { dtype: DType::F32, shape: &[1, 4], bytes: &x(1.0) }];
    assert_eq!(client.session_step(session, &[Value::Tensor(0)], &step).unwrap().tensor_bytes(0), &x(7.5)[..]);
    // A graph whose new state would be its weight (then written by the next step) is refused.
    let mut sly = accumulator(vec![1, 4]);
    *sly.outputs.last_mut().unwrap() = Arg::Value(1);
    sly.inputs[1].dims = vec![DimRange { min: 4, max: 4 }, DimRange { min: 4, max: 4 }];
    sly.state[0].shape = vec![4, 4];
    sly.nodes.truncate(1);
    sly.outputs[0] = Arg::Value(2);
    let e = client.register_model(&[container(&sly)], |_, _| {}).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::GraphRefused), "{e}");
    assert!(e.to_string().contains("new value of state"), "{e}");
}

/// Models are counted per tenant on a node and each hold is charged a page of host memory,
/// however small the model, besides its program's: past 4,096 distinct graphs of no weights,
/// more are refused (`QuotaExceeded`) while another tenant registers as before; unregistering
/// makes room, and the charges come back.
#[test]
fn a_tenant_holds_a_bounded_number_of_models_each_charged_its_bookkeeping() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.json");
    let other = "graphs-other-tenant-token-0123";
    std::fs::write(
        &file,
        format!(r#"{{"principals": [{{"name": "graphs", "tokens": ["{TOKEN}"]}}, {{"name": "other", "tokens": ["{other}"]}}]}}"#),
    )
    .unwrap();
    let node = Node::start("mio", &["--auth-file", file.to_str().unwrap()]);
    let connect = |token: &str| {
        Client::connect_with(node.addr, ClientOptions { token: token.into(), ..Default::default() }).unwrap()
    };
    let (mut client, mut other) = (connect(TOKEN), connect(other));
    // x * k: a graph of no weights, a new fingerprint for each k.
    let scaled = |k: i64| {
        let mut p = program(vec![op("aten::mul", "Scalar", vec![Arg::Value(0), Arg::Int(k)], vec![2])], 2);
        p.weights.clear();
        djinn_graph::encode(&p, &[]).unwrap()
    };
    let before = node.stat(&mut client, "host_budget_used_bytes");
    let mut models = Vec::new();
    let mut refused = 0;
    for k in 0..4_100 {
        match client.register_model(&[scaled(k)], |_, _| {}) {
            Ok(info) => models.push(info.fingerprint),
            Err(e) => {
                assert_eq!(e.remote_code(), Some(ErrorCode::QuotaExceeded), "{e}");
                assert!(e.to_string().contains("4096 models"), "{e}");
                refused += 1;
            }
        }
        if k % 1000 == 0 {
            other.register_model(&[scaled(-k)], |_, _| {}).expect("the other tenant registers its own");
        }
    }
    assert_eq!((models.len(), refused), (4096, 4));
    // A page for each hold, and the program's host memory: twice its text and 3 KiB a node.
    let charge = |k: i64| 4096 + 2 * djinn_graph::decode(&scaled(k)).unwrap().weights_start as u64 + 3072;
    let others: u64 = (0..5).map(|i| charge(-1000 * i)).sum();
    let charged = node.stat(&mut client, "host_budget_used_bytes") - before;
    assert_eq!(charged, (0..4096).map(charge).sum::<u64>() + others, "the other tenant's five included");
    client.unregister_model(&models[0]).unwrap();
    let again = client.register_model(&[scaled(5000)], |_, _| {}).expect("room after an unregistration").fingerprint;
    let x: Vec<u8> = [1.5f32, 2.0, -1.0, 0.25].iter().flat_map(|v| v.to_le_bytes()).collect();
    let out =
        client.execute(&again, &[Value::Tensor(0)], &[TensorRef { dtype: DType::F32, shape: &[1, 4], bytes: &x }]);
    let want: Vec<u8> = [7500f32, 10000.0, -5000.0, 1250.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(out.unwrap().tensor_bytes(0), &want[..]);
    for m in models.iter().skip(1).chain([&again]) {
        client.unregister_model(m).unwrap();
    }
    assert_eq!(node.stat(&mut client, "host_budget_used_bytes") - before, others, "only the other tenant's");
}

/// Registers `graph` and runs it on `x` (f32, `rows` × 4): what the node says.
fn try_graph(client: &mut Client, graph: &Program, x: &[f32]) -> Result<Vec<u8>, djinn_client::ClientError> {
    let model = client.register_model(&[container(graph)], |_, _| {})?.fingerprint;
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let shape = [(x.len() / 4) as u64, 4];
    let out =
        client.execute(&model, &[Value::Tensor(0)], &[TensorRef { dtype: DType::F32, shape: &shape, bytes: &bytes }]);
    Ok(out?.tensor_bytes(0).to_vec())
}

/// The node is alive and serving: relu of a row, on a connection of its own.
fn serves(node: &Node) {
    let mut client = Client::connect_with(node.addr, ClientOptions { token: TOKEN.into(), ..Default::default() })
        .expect("the node still takes connections");
    let out = try_graph(
        &mut client,
        &program(vec![op("aten::relu", "", vec![Arg::Value(0)], vec![2])], 2),
        &[-1.0, 2.0, -3.0, 4.0],
    );
    let want: Vec<u8> = [0f32, 2.0, 0.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(out.expect("the node still serves"), want);
}

/// Hand-written graphs that crashed the node (in its meta kernels or libtorch's), read memory
/// another tenant had freed (an output left unwritten), wrote a weight through an operator
/// whose output can be its input, or reached a kernel with an index or a distribution that is
/// a device-side assert on a GPU: each is refused with a typed error naming why, and the node
/// serves on after every one.
#[test]
fn hostile_graphs_are_refused_typed_and_the_node_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    let (node, mut client) = tenant_node(dir.path());
    let (v, int, float, ints) = (
        Arg::Value,
        Arg::Int,
        |f: &str| Arg::Float(f.into()),
        |xs: &[i64]| Arg::List(xs.iter().map(|&x| Arg::Int(x)).collect()),
    );
    let x: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();

    // var over dimension 0 of a 0-dim tensor: a SIGSEGV in the node's meta kernel. Now as
    // libtorch computes it (one element, corrected: NaN).
    let var = program(
        vec![op("aten::sum", "", vec![v(0)], vec![2]), op("aten::var", "correction", vec![v(2), ints(&[0])], vec![3])],
        3,
    );
    let out = try_graph(&mut client, &var, &x).expect("var of a 0-dim tensor runs");
    assert!(f32::from_le_bytes(out[..4].try_into().unwrap()).is_nan(), "{out:?}");

    // A 5-d convolution with stride, padding and dilation of two entries: a SIGFPE in the meta
    // kernel. libtorch refuses it, typed.
    let mut conv = program(
        vec![
            op("aten::view", "", vec![v(0), ints(&[1, 1, 2, 2, 2])], vec![2]),
            op("aten::view", "", vec![v(1), ints(&[2, 1, 2, 2, 2])], vec![3]),
            op(
                "aten::convolution",
                "",
                vec![
                    v(2),
                    v(3),
                    Arg::None,
                    ints(&[1, 1]),
                    ints(&[0, 0]),
                    ints(&[1, 1]),
                    Arg::Bool(false),
                    ints(&[0, 0]),
                    int(1),
                ],
                vec![4],
            ),
        ],
        4,
    );
    conv.inputs[0].dims[0] = DimRange { min: 2, max: 2 };
    let e = try_graph(&mut client, &conv, &x).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::ExecutionFailed), "{e}");

    // Nearest upsampling of uint8 by a scale of 1e-20: a SIGSEGV in libtorch's kernel. And a
    // batch norm told to use running statistics it was not given: the same. Refused with the
    // graph, by the allowlist's rules.
    let upsample = |scale: &str| {
        let mut p = program(
            vec![
                op("aten::_to_copy", "", vec![v(0)], vec![2]),
                op("aten::view", "", vec![v(2), ints(&[1, 1, -1, 4])], vec![3]),
                op("aten::upsample_nearest2d", "", vec![v(3), ints(&[4, 4]), float(scale), float(scale)], vec![4]),
            ],
            4,
        );
        p.nodes[0].kwargs.insert("dtype".into(), Arg::Dtype("uint8".into()));
        p
    };
    let e = try_graph(&mut client, &upsample("1e-20"), &x).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::GraphRefused), "{e}");
    assert!(e.to_string().contains("scales_h") && e.to_string().contains("finite"), "{e}");
    try_graph(&mut client, &upsample("2.0"), &x).expect("a scale a model would use");
    let no_stats = program(
        vec![op(
            "aten::_native_batch_norm_legit",
            "no_stats",
            vec![v(0), Arg::None, Arg::None, Arg::Bool(false), float("0.1"), float("1e-5")],
            vec![2, 3, 4],
        )],
        2,
    );
    let e = try_graph(&mut client, &no_stats, &x).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::GraphRefused), "{e}");
    assert!(e.to_string().contains("training"), "{e}");

    // A grid sampler with an interpolation or padding mode past libtorch's enum left its output
    // unwritten (another tenant's freed memory): refused as a constant, and as a value the run
    // computes (2 + 3), before the kernel.
    let sampler = |mode: Arg, padding: Arg| {
        program(
            vec![
                op("aten::view", "", vec![v(0), ints(&[1, 1, -1, 4])], vec![2]),
                op("aten::zeros", "", vec![ints(&[1, 2, 2, 2])], vec![3]),
                op("native::add", "", vec![int(2), int(3)], vec![4]),
                op("aten::grid_sampler_2d", "", vec![v(2), v(3), mode, padding, Arg::Bool(false)], vec![5]),
            ],
            5,
        )
    };
    for (mode, padding) in [(int(5), int(0)), (int(0), int(3)), (int(0), int(100))] {
        let e = try_graph(&mut client, &sampler(mode, padding), &x).unwrap_err();
        assert_eq!(e.remote_code(), Some(ErrorCode::GraphRefused), "{e}");
        assert!(e.to_string().contains("one of 0, 1, 2"), "{e}");
    }
    let e = try_graph(&mut client, &sampler(v(4), int(0)), &x).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::ExecutionFailed), "{e}");
    assert!(e.to_string().contains("is not one of 0, 1, 2"), "{e}");
    try_graph(&mut client, &sampler(int(1), int(2)), &x).expect("a valid mode");

    // type_as(w, w), dropout(w, 0, False), _unsafe_view(w) and to(w) are w: a masked_fill_ on
    // them wrote the weight every tenant of the public model shares.
    let through = |view: GraphNode| {
        program(
            vec![
                view,
                op("aten::gt", "Scalar", vec![v(1), int(-100)], vec![3]),
                op("aten::masked_fill_", "Scalar", vec![v(2), v(3), int(-5)], vec![4]),
                op("aten::add", "Tensor", vec![v(0), v(4)], vec![5]),
            ],
            5,
        )
    };
    for view in [
        op("aten::type_as", "", vec![v(1), v(1)], vec![2]),
        op("aten::dropout", "", vec![v(1), float("0.0"), Arg::Bool(false)], vec![2]),
        op("aten::_unsafe_view", "", vec![v(1), ints(&[4, 4])], vec![2]),
        op("aten::to", "prim_dtype", vec![v(1), Arg::None], vec![2]),
    ] {
        let name = view.op.clone();
        let e = try_graph(&mut client, &through(view), &x).unwrap_err();
        assert_eq!(e.remote_code(), Some(ErrorCode::GraphRefused), "{name}: {e}");
        assert!(e.to_string().contains("a weight"), "{name}: {e}");
    }

    // x[mask, [100]]: the check of indices stopped at the mask, and on a GPU the kernel's
    // out-of-range index is a device-side assert. Now each index is checked against the
    // dimension it indexes.
    let index = |i: i64| {
        program(
            vec![
                op("aten::select", "int", vec![v(0), int(1), int(0)], vec![2]),
                op("aten::gt", "Scalar", vec![v(2), int(-100)], vec![3]),
                op("aten::full", "", vec![ints(&[1]), int(i)], vec![4]),
                op("aten::index", "Tensor", vec![v(0), Arg::List(vec![v(3), v(4)])], vec![5]),
            ],
            5,
        )
    };
    let long = |p: Program| {
        let mut p = p;
        p.nodes[2].kwargs.insert("dtype".into(), Arg::Dtype("int64".into()));
        p
    };
    let e = try_graph(&mut client, &long(index(100)), &x).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::ExecutionFailed), "{e}");
    assert!(e.to_string().contains("index 100 is out of range for dimension 1"), "{e}");
    let out = try_graph(&mut client, &long(index(3)), &x).expect("an index in range");
    let want: Vec<u8> = [x[3], x[7]].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(out, want);

    // Drawing with replacement from a distribution with a negative entry: a device-side assert
    // on a GPU, refused before the kernel on every device.
    let draw = program(vec![op("aten::multinomial", "", vec![v(0), int(4), Arg::Bool(true)], vec![2])], 2);
    let e = try_graph(&mut client, &draw, &x).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::ExecutionFailed), "{e}");
    assert!(e.to_string().contains("negative, infinite or NaN"), "{e}");
    try_graph(&mut client, &draw, &[0.1, 0.2, 0.3, 0.4]).expect("a distribution");
    serves(&node);
}

const SMALL: &str = "graphs-small-tenant-token-0123";
const METERED: &str = "graphs-metered-tenant-token-01";

/// Beside the test's tenant, one with a memory quota of 32 MiB (`SMALL`) and one of 10⁶
/// operations a second (`METERED`), on a node that lets one run hold 64 MiB and one execution
/// take 2 s.
fn bounded_node(dir: &std::path::Path) -> Node {
    bounded_node_with(dir, &[])
}

fn bounded_node_with(dir: &std::path::Path, extra: &[&str]) -> Node {
    let file = dir.join("tokens.json");
    std::fs::write(
        &file,
        format!(
            r#"{{"principals": [{{"name": "graphs", "tokens": ["{TOKEN}"]}},
                {{"name": "small", "tokens": ["{SMALL}"], "quota": {{"device_memory": 33554432}}}},
                {{"name": "metered", "tokens": ["{METERED}"], "quota": {{"flops_per_second": 1e6}}}}]}}"#
        ),
    )
    .unwrap();
    let auth = ["--auth-file", file.to_str().unwrap()];
    Node::start("mio", &[&auth[..], &["--max-run-memory", "64MiB", "--execute-deadline", "2"], extra].concat())
}

/// A tenant whose models run in an executor process of its own is held to the same quotas
/// there: its memory quota (32 MiB) as its process allocates, its compute quota (10⁶
/// operations a second) as its process's runs are charged; the tenant without quotas runs the
/// same graphs in its own process.
#[test]
fn a_tenants_quotas_hold_in_its_executor_process() {
    let dir = tempfile::tempdir().unwrap();
    let node = bounded_node_with(dir.path(), &["--executor-processes"]);
    let (mut client, mut small, mut metered) = (connect(&node, TOKEN), connect(&node, SMALL), connect(&node, METERED));
    let (v, ints) = (Arg::Value, |xs: &[i64]| Arg::List(xs.iter().map(|&x| Arg::Int(x)).collect()));
    let x: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
    // ones(n) after a nonzero (where plans stop): 48 MiB of f32 past the small tenant's 32 MiB.
    let ones = |n: i64| {
        program(
            vec![
                op("aten::nonzero", "", vec![v(0)], vec![2]),
                op("aten::ones", "", vec![ints(&[n])], vec![3]),
                op("aten::sum", "", vec![v(3)], vec![4]),
            ],
            4,
        )
    };
    let e = try_graph(&mut small, &ones(12 << 20), &x).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::QuotaExceeded), "{e}");
    assert!(try_graph(&mut small, &ones(4 << 20), &x).is_ok(), "within its quota");
    assert!(try_graph(&mut client, &ones(12 << 20), &x).is_ok(), "a tenant without a memory quota");
    // 2·256³ operations past a nonzero, over a burst of 10⁶.
    let product = program(
        vec![
            op("aten::nonzero", "", vec![v(0)], vec![2]),
            op("aten::ones", "", vec![ints(&[256, 256])], vec![3]),
            op("aten::mm", "", vec![v(3), v(3)], vec![4]),
            op("aten::sum", "", vec![v(4)], vec![5]),
        ],
        5,
    );
    let e = try_graph(&mut metered, &product, &x).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::QuotaExceeded), "{e}");
    assert!(e.to_string().contains("compute"), "{e}");
    assert!(try_graph(&mut client, &product, &x).is_ok(), "a tenant without a compute quota");
    let stats = client.stats().unwrap();
    assert!(stats.contains(&("executor_processes".to_owned(), 3)), "each tenant in its own process: {stats:?}");
}

fn connect(node: &Node, token: &str) -> Client {
    Client::connect_with(node.addr, ClientOptions { token: token.into(), ..Default::default() }).unwrap()
}

/// Memory a run's plan does not see is counted as it is allocated, by the node's allocator:
/// after a `nonzero` (where plans stop), inside an operator (attention on 3-d inputs takes
/// libtorch's math path, whose score matrix the plan has no part of), after the run (an
/// expanded output made contiguous to be sent). Each is refused with a typed error as it
/// allocates (`OverBudget` past the run's bound, `QuotaExceeded` past a tenant's quota) where
/// it was served before, the same graphs at sizes within the bounds run, and the node serves
/// on with the quota given back.
#[test]
fn memory_a_plan_cannot_see_is_bounded_as_it_is_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let node = bounded_node(dir.path());
    let (mut client, mut small) = (connect(&node, TOKEN), connect(&node, SMALL));
    let (v, ints) = (Arg::Value, |xs: &[i64]| Arg::List(xs.iter().map(|&x| Arg::Int(x)).collect()));
    let x: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
    let refused = |e: djinn_client::ClientError, code: ErrorCode| {
        assert_eq!(e.remote_code(), Some(code), "{e}");
        assert!(e.to_string().contains("allocation of"), "{e}");
    };
    // ones(n) after a nonzero: 256 MiB of f32 past the run's 64 MiB.
    let after_nonzero = |n: i64| {
        program(
            vec![
                op("aten::nonzero", "", vec![v(0)], vec![2]),
                op("aten::ones", "", vec![ints(&[n])], vec![3]),
                op("aten::sum", "", vec![v(3)], vec![4]),
            ],
            4,
        )
    };
    refused(try_graph(&mut client, &after_nonzero(1 << 26), &x).unwrap_err(), ErrorCode::OverBudget);
    let out = try_graph(&mut client, &after_nonzero(1 << 20), &x).expect("4 MiB after a nonzero");
    assert_eq!(f32::from_le_bytes(out[..4].try_into().unwrap()), (1 << 20) as f32);
    // Attention over 3-d inputs of 8,192 queries and keys: libtorch's math path holds a
    // 256 MiB score matrix the plan does not see (its output is 128 KiB).
    let attention = |n: i64| {
        program(
            vec![
                op("aten::view", "", vec![v(0), ints(&[1, -1, 4])], vec![2]),
                op("aten::expand", "", vec![v(2), ints(&[1, n, 4])], vec![3]),
                op("aten::scaled_dot_product_attention", "", vec![v(3), v(3), v(3)], vec![4]),
            ],
            4,
        )
    };
    let row = &x[..4];
    refused(try_graph(&mut client, &attention(8192), row).unwrap_err(), ErrorCode::OverBudget);
    try_graph(&mut client, &attention(1024), row).expect("a 4 MiB score matrix");
    // An output that is a 256 MiB expansion of one row, made contiguous after the run to be
    // sent: refused as that copy allocates.
    let expanded = |n: i64| program(vec![op("aten::expand", "", vec![v(0), ints(&[n, 4])], vec![2])], 2);
    refused(try_graph(&mut client, &expanded(1 << 24), row).unwrap_err(), ErrorCode::OverBudget);
    assert_eq!(try_graph(&mut client, &expanded(4), row).unwrap().len(), 4 * 16);
    // A tenant's quota bounds what its jobs hold, its plans' unseen memory included: 48 MiB
    // after a nonzero is within the run's bound and over its 32 MiB quota.
    refused(try_graph(&mut small, &after_nonzero(12 << 20), &x).unwrap_err(), ErrorCode::QuotaExceeded);
    assert!(try_graph(&mut small, &after_nonzero(4 << 20), &x).is_ok(), "the quota is given back after a refusal");
    assert_eq!(node.stat(&mut client, "allocations_refused"), 4);
    serves(&node);
}

/// An operator whose only tensor is a number (`repeat` of a wrapped number) is planned on the
/// meta device like the rest: a 512 MiB repetition is refused by its plan before it allocates
/// (not by the allocator while it computes, which a GPU node's host memory would not have), and
/// a small one runs.
#[test]
fn an_operator_over_numbers_only_is_planned_without_memory() {
    let dir = tempfile::tempdir().unwrap();
    let node = bounded_node(dir.path());
    let mut client = connect(&node, TOKEN);
    let ints = |xs: &[i64]| Arg::List(xs.iter().map(|&x| Arg::Int(x)).collect());
    let repeated = |n: i64| {
        program(
            vec![
                op("aten::repeat", "", vec![Arg::Int(1), ints(&[n])], vec![2]),
                op("aten::sum", "", vec![Arg::Value(2)], vec![3]),
                op("aten::add", "Tensor", vec![Arg::Value(0), Arg::Value(3)], vec![4]),
            ],
            4,
        )
    };
    let x = [0f32; 8];
    let e = try_graph(&mut client, &repeated(1 << 26), &x).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::OverBudget), "{e}");
    assert!(e.to_string().contains("would hold 5368709"), "refused by its plan: {e}");
    let out = try_graph(&mut client, &repeated(1000), &x).expect("a repetition of 1,000");
    assert_eq!(f32::from_le_bytes(out[..4].try_into().unwrap()), 1000.0);
    assert_eq!(node.stat(&mut client, "allocations_refused"), 0);
    serves(&node);
}

/// Time and operations past what a plan saw: a pooling step planned at 10¹² operations (a
/// 1,000 × 1,000 window over a 2,048² image) is refused before it runs, as it would take longer
/// than the node's 2 s limit on an execution at the node's rate, and another tenant is served
/// at once meanwhile; a product past a `nonzero` (where plans stop) is charged to the tenant's
/// compute quota as it runs, and the run ends there, typed, where it was served before.
#[test]
fn long_steps_and_unplanned_operations_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let node = bounded_node(dir.path());
    let (mut client, mut metered) = (connect(&node, TOKEN), connect(&node, METERED));
    let (v, ints) = (Arg::Value, |xs: &[i64]| Arg::List(xs.iter().map(|&x| Arg::Int(x)).collect()));
    let x: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
    let pooling = |window: i64| {
        program(
            vec![
                op("aten::ones", "", vec![ints(&[1, 1, 2048, 2048])], vec![2]),
                op("aten::avg_pool2d", "", vec![v(2), ints(&[window, window]), ints(&[1, 1])], vec![3]),
                op("aten::sum", "", vec![v(3)], vec![4]),
            ],
            4,
        )
    };
    let e = try_graph(&mut client, &pooling(1000), &x).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::DeadlineExceeded), "{e}");
    assert!(e.to_string().contains("aten::avg_pool2d is planned at"), "{e}");
    serves(&node);
    assert!(try_graph(&mut client, &pooling(2), &x).is_ok(), "a small window runs");
    // 2·256³ operations past a nonzero, over a burst of 10⁶.
    let after_nonzero = program(
        vec![
            op("aten::nonzero", "", vec![v(0)], vec![2]),
            op("aten::ones", "", vec![ints(&[256, 256])], vec![3]),
            op("aten::mm", "", vec![v(3), v(3)], vec![4]),
            op("aten::sum", "", vec![v(4)], vec![5]),
        ],
        5,
    );
    let before = node.stat(&mut client, "runs_refused_by_plan");
    let e = try_graph(&mut metered, &after_nonzero, &x).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::QuotaExceeded), "{e}");
    assert!(e.to_string().contains("compute"), "{e}");
    assert_eq!(node.stat(&mut client, "runs_refused_by_plan"), before + 1);
    let out = try_graph(&mut client, &after_nonzero, &x).expect("a tenant without a compute quota");
    assert_eq!(f32::from_le_bytes(out[..4].try_into().unwrap()), 256f32 * 256.0 * 256.0);
}

/// What a tenant leaves on a node is charged for the memory it keeps alive, not for the view
/// it names: twelve kept 4-byte slices of 64 MiB intermediates held 770 MiB against charges of
/// 4 bytes each, and are copies of their own now; a session's state or a parked activation
/// that is a slice of a 64 MiB intermediate is charged the 64 MiB it keeps; and a model's
/// program and prepared calls
/// are charged to the tenant's host memory by their size (a graph of 20,000 nodes is not a
/// page), at least what the node's memory grows by.
#[test]
fn what_is_kept_is_charged_for_the_memory_it_keeps_alive() {
    let dir = tempfile::tempdir().unwrap();
    let (node, mut client) = tenant_node(dir.path());
    let (v, int, ints) = (Arg::Value, Arg::Int, |xs: &[i64]| Arg::List(xs.iter().map(|&x| Arg::Int(x)).collect()));
    // A row of a 64 MiB tensor of ones, plus x.
    let slice = program(
        vec![
            op("aten::ones", "", vec![ints(&[1 << 22, 4])], vec![2]),
            op("aten::slice", "Tensor", vec![v(2), int(0), int(0), int(1)], vec![3]),
            op("aten::add", "Tensor", vec![v(0), v(3)], vec![4]),
            op("aten::slice", "Tensor", vec![v(2), int(0), int(5), int(6)], vec![5]),
        ],
        5,
    );
    let model = client.register_model(&[container(&slice)], |_, _| {}).unwrap().fingerprint;
    let x = [0f32; 4].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let input = [TensorRef { dtype: DType::F32, shape: &[1, 4], bytes: &x }];
    let before = node.rss();
    let mut kept = Vec::new();
    for _ in 0..12 {
        let out = client.execute_keep(&model, &[Value::Tensor(0)], &input).unwrap();
        kept.push(out.kept[0].handle);
    }
    let grown = node.rss().saturating_sub(before);
    assert!(grown < 64 << 20, "twelve kept rows hold {grown} bytes: each should hold its own 16");
    let ones: Vec<u8> = [1f32; 4].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(client.fetch(kept[11]).unwrap().bytes(), &ones[..]);
    client.release(&kept).unwrap();

    // The same row as a session's new state: charged for the 64 MiB it keeps alive.
    let mut stateful = slice.clone();
    stateful.inputs.push(Input {
        name: "row".into(),
        value: 9,
        dtype: "float32".into(),
        dims: vec![DimRange { min: 1, max: 1 }, DimRange { min: 4, max: 4 }],
        state: true,
    });
    stateful.inputs[0].dims[0] = DimRange { min: 1, max: 1 };
    stateful.state =
        vec![djinn_graph::State { name: "row".into(), dtype: "float32".into(), shape: vec![1, 4], offset: None }];
    stateful.outputs = vec![v(4), v(5)];
    let model = client.register_model(&[container(&stateful)], |_, _| {}).unwrap().fingerprint;
    let session = client.session_open(&model, &[], 0).unwrap();
    client.session_step(session, &[Value::Tensor(0)], &input).unwrap();
    let held = node.stat(&mut client, "session_device_bytes");
    assert!(held >= 64 << 20, "a state row of a 64 MiB tensor is charged {held} bytes");
    client.session_close(session).unwrap();

    // The same row as a parked request's activation (block 0 of two, stopped after it): charged
    // for the 64 MiB it keeps alive.
    let mut first = slice.clone();
    first.outputs = vec![v(5)];
    let mut second = program(vec![op("aten::relu", "", vec![v(0)], vec![2])], 2);
    second.inputs[0].dims[0] = DimRange { min: 1, max: 1 };
    second.weights.clear();
    let blocks = [container(&first), djinn_graph::encode(&second, &[]).unwrap()];
    let model = client.register_model(&blocks, |_, _| {}).unwrap().fingerprint;
    let until = djinn_client::Breakpoint { block: 0, send_activation: false };
    let paused = client.execute_until(&model, &[Value::Tensor(0)], &input, false, until).unwrap();
    let parked = node.stat(&mut client, "parked_bytes");
    assert!(parked >= 64 << 20, "a parked row of a 64 MiB tensor is charged {parked} bytes");
    client.abort(paused.parked).unwrap();
    assert_eq!(node.stat(&mut client, "parked_bytes"), 0);

    // 20,000 nodes: charged 3 KiB each and twice the program's text.
    let mut long = program(
        (0..20_000).map(|i| op("aten::relu", "", vec![v(if i == 0 { 0 } else { i + 1 })], vec![i + 2])).collect(),
        20_001,
    );
    long.weights.clear();
    let bytes = djinn_graph::encode(&long, &[]).unwrap();
    let text = djinn_graph::decode(&bytes).unwrap().weights_start as u64;
    let (rss, used) = (node.rss(), node.stat(&mut client, "host_budget_used_bytes"));
    let model = client.register_model(&[bytes], |_, _| {}).unwrap().fingerprint;
    let charged = node.stat(&mut client, "host_budget_used_bytes") - used;
    assert_eq!(charged, 4096 + 2 * text + 20_000 * 3072);
    let grown = node.rss().saturating_sub(rss);
    assert!(grown <= charged, "the node grew {grown} bytes for a program charged {charged}");
    client.unregister_model(&model).unwrap();
    assert_eq!(node.stat(&mut client, "host_budget_used_bytes"), used);
}
