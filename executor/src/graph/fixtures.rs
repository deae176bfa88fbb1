//! Graphs the tests of this module's files share.

use djinn_graph::format::{FORMAT, WEIGHT_ALIGN};
use djinn_graph::{Arg, DimRange, Input, Node, Program, Weight};
use tch::{Device, Kind, Tensor};

use super::GraphModule;

pub(super) fn node(op: &str, args: Vec<Arg>, outputs: Vec<u32>) -> Node {
    Node { op: op.into(), overload: String::new(), args, kwargs: Default::default(), outputs }
}

/// `nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))` as a graph, as
/// export writes it (value 0 the input, 1..=4 the weights), for batches of 1 to 4096; and
/// its weights.
pub(super) fn mlp() -> (Vec<u8>, Vec<Tensor>) {
    let shapes: [&[i64]; 4] = [&[1024, 256], &[1024], &[256, 1024], &[256]];
    let weights: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, (Kind::Float, Device::Cpu))).collect();
    let mut offset = 0;
    let specs = shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let w = Weight {
                name: format!("w{i}"),
                value: i as u32 + 1,
                dtype: "float32".into(),
                shape: shape.to_vec(),
                offset,
            };
            offset += (shape.iter().product::<i64>() as u64 * 4).next_multiple_of(WEIGHT_ALIGN);
            w
        })
        .collect();
    let v = Arg::Value;
    let program = Program {
        format: FORMAT,
        inputs: vec![Input {
            name: "input".into(),
            value: 0,
            dtype: "float32".into(),
            dims: vec![DimRange { min: 1, max: 4096 }, DimRange { min: 256, max: 256 }],
            state: false,
        }],
        weights: specs,
        nodes: vec![
            node("aten::linear", vec![v(0), v(1), v(2)], vec![5]),
            node("aten::relu", vec![v(5)], vec![6]),
            node("aten::linear", vec![v(6), v(3), v(4)], vec![7]),
        ],
        outputs: vec![v(7)],
        state: vec![],
        entries: vec![],
    };
    let bytes: Vec<Vec<u8>> = weights
        .iter()
        .map(|w| {
            let mut b = vec![0u8; w.numel() * 4];
            w.copy_data_u8(&mut b, w.numel());
            b
        })
        .collect();
    let slices: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    (djinn_graph::encode(&program, &slices).unwrap(), weights)
}

fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Bool => "bool",
        Kind::Int => "int32",
        Kind::Int64 => "int64",
        Kind::Double => "float64",
        _ => "float32",
    }
}

/// A graph of the one operator `op` on `inputs` (values 0..) and the constants in `args`
/// (where `Arg::Value` names an input); its outputs, run on the CPU and over meta tensors
/// (the plan's calls), as (sizes, dtype) pairs.
pub(super) fn one_operator(
    op: &str,
    args: Vec<Arg>,
    kwargs: &[(&str, Arg)],
    inputs: &[Tensor],
    outputs: usize,
) -> GraphModule {
    let (name, overload) = op.split_once('.').unwrap_or((op, ""));
    let program = Program {
        format: FORMAT,
        inputs: inputs
            .iter()
            .enumerate()
            .map(|(i, t)| Input {
                name: format!("x{i}"),
                value: i as u32,
                dtype: dtype_name(t.kind()).into(),
                dims: t.size().iter().map(|&n| DimRange { min: n, max: n }).collect(),
                state: false,
            })
            .collect(),
        weights: vec![],
        nodes: vec![Node {
            op: name.into(),
            overload: overload.into(),
            args,
            kwargs: kwargs.iter().map(|(k, a)| (k.to_string(), a.clone())).collect(),
            outputs: (100..100 + outputs as u32).collect(),
        }],
        outputs: (100..100 + outputs as u32).map(Arg::Value).collect(),
        state: vec![],
        entries: vec![],
    };
    GraphModule::load(&djinn_graph::encode(&program, &[]).unwrap(), Device::Cpu).unwrap()
}
