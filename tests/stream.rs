//! Models larger than the node's device-memory budget, streamed through the skip-end ring: the
//! outputs of nodes whose budgets hold one block up to the whole model equal, bit for bit,
//! those of a node that keeps the whole model resident.

mod support;

use djinn_client::{Client, DType, ErrorCode, TensorRef, Value};
use djinn_executor::stream::StreamedBlock;
use djinn_executor::tch;
use support::{Node, archive, pattern};

fn register(client: &mut Client, names: &[String]) -> djinn_client::Fingerprint {
    let blocks: Vec<Vec<u8>> = names.iter().map(|n| archive(n)).collect();
    client.register_model(&blocks, |_, _| {}).expect("register").fingerprint
}

fn blocks(model: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{model}.block{i}")).collect()
}

/// Output bytes of `model` on `client` for `input`, twice in a row (the second forward finds
/// the ring as the first left it).
fn run_twice(client: &mut Client, names: &[String], input: TensorRef<'_>) -> [Vec<u8>; 2] {
    let fingerprint = register(client, names);
    let mut out =
        || client.execute(&fingerprint, &[Value::Tensor(0)], &[input]).expect("execute").tensor_bytes(0).to_vec();
    [out(), out()]
}

struct Case {
    names: Vec<String>,
    input: Vec<u8>,
    dtype: DType,
    shape: Vec<u64>,
    /// Bytes of the largest block's parameters, and of all of them.
    largest: u64,
    total: u64,
}

fn cases() -> Vec<Case> {
    // 8 × (Linear(512, 512) + GELU): 512 × 512 + 512 floats each.
    let block = (512 * 512 + 512) * 4;
    let stack_input: Vec<u8> =
        pattern(4 * 512, 3).iter().flat_map(|&b| ((b as f32 - 128.0) / 64.0).to_le_bytes()).collect();
    // The tiny GPT (vocab 97, width 64, 2 layers): token ids in, logits out.
    let tokens: Vec<u8> = pattern(16, 5).iter().flat_map(|&b| i64::from(b % 97).to_le_bytes()).collect();
    let (gpt_largest, gpt_total) = gpt_sizes();
    vec![
        Case {
            names: blocks("stack", 8),
            input: stack_input,
            dtype: DType::F32,
            shape: vec![4, 512],
            largest: block,
            total: 8 * block,
        },
        Case {
            names: blocks("gpt", 4),
            input: tokens,
            dtype: DType::I64,
            shape: vec![1, 16],
            largest: gpt_largest,
            total: gpt_total,
        },
    ]
}

/// Slot bytes of the tiny GPT's largest block and of all four, from the archives.
fn gpt_sizes() -> (u64, u64) {
    let sizes: Vec<u64> = blocks("gpt", 4)
        .iter()
        .map(|name| {
            let m = tch::CModule::load(support::models_dir().join(format!("{name}.pt"))).expect("load");
            StreamedBlock::slot_len(&m.named_parameters().expect("parameters"))
        })
        .collect();
    (sizes.iter().copied().max().unwrap_or(0), sizes.iter().sum())
}

#[test]
fn streamed_outputs_equal_resident_outputs_bit_for_bit_for_every_budget() {
    let cases = cases();
    let resident = Node::start("mio", &[]);
    let mut client = resident.client();
    let expected: Vec<[Vec<u8>; 2]> = cases
        .iter()
        .map(|c| {
            let input = TensorRef { dtype: c.dtype, shape: &c.shape, bytes: &c.input };
            run_twice(&mut client, &c.names, input)
        })
        .collect();
    for (case, want) in cases.iter().zip(&expected) {
        assert_eq!(want[0], want[1], "{}: two resident forwards differ", case.names[0]);
        // From one block (one ring slot, nothing resident) to the whole model.
        let budgets = [
            case.largest,
            case.largest + case.largest / 2,
            2 * case.largest,
            3 * case.largest + 1024,
            case.total / 2 + case.largest,
            case.total.next_multiple_of(4096) + 4096,
        ];
        for budget in budgets {
            let node = Node::start("mio", &["--device-memory-budget", &budget.to_string()]);
            let mut client = node.client();
            let input = TensorRef { dtype: case.dtype, shape: &case.shape, bytes: &case.input };
            let got = run_twice(&mut client, &case.names, input);
            let what = format!("{} with a {budget}-byte budget", case.names[0]);
            assert!(got[0] == want[0] && got[1] == want[1], "{what}: streamed output differs from resident");
            let streamed = node.stat(&mut client, "streamed_models");
            let bytes = node.stat(&mut client, "stream_bytes");
            if budget < case.total {
                assert_eq!(streamed, 1, "{what}: not streamed");
                assert!(bytes > 0 && node.stat(&mut client, "ring_peak_bytes") <= budget, "{what}");
            } else {
                assert_eq!((streamed, bytes), (0, 0), "{what}: streamed though it fits");
            }
        }
    }
}

#[test]
fn a_block_larger_than_the_budget_is_refused_at_registration_and_the_node_goes_on() {
    let case = cases().remove(0);
    let node = Node::start("mio", &["--device-memory-budget", &(case.largest / 2).to_string()]);
    let mut client = node.client();
    let blocks: Vec<Vec<u8>> = case.names.iter().map(|n| archive(n)).collect();
    let err = client.register_model(&blocks, |_, _| {}).unwrap_err();
    assert_eq!(err.remote_code(), Some(ErrorCode::OverBudget), "{err}");
    assert!(err.to_string().contains("cannot run even streamed"), "{err}");
    // The node still serves, and still has the budget for a model that fits.
    let identity = register(&mut client, &["identity".to_owned()]);
    let one = [9u8];
    let out =
        client.execute(&identity, &[Value::Tensor(0)], &[TensorRef { dtype: DType::U8, shape: &[1], bytes: &one }]);
    assert_eq!(out.expect("execute").tensor_bytes(0), &one);
}

/// `djinn bench stream` runs end to end on a small stack (it checks itself that the streamed,
/// resident and naive outputs agree) and reports the streaming rate.
#[test]
fn the_stream_bench_runs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_djinn"))
        .args(["--log", "error", "bench", "stream", "--device", "cpu", "--blocks", "4", "--width", "256"])
        .args(["--iters", "3", "--python"])
        .arg(root.join(".venv/bin/python"))
        .output()
        .expect("run djinn bench stream");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("**streamed** through the ring") && stdout.contains("GB/s"), "{stdout}");
}
