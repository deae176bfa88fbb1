//! Operands libtorch's kernels take unchecked, in graphs run through the runner as a node runs
//! them: each ends in a typed error, the plan and the run alike, never a crash or a panic
//! (graph_exec's findings; their inputs are in fuzz/regressions/graph_exec/).

use djinn_executor::ExecError;
use djinn_executor::graph::GraphModule;
use djinn_executor::tch::{Device, Tensor};
use djinn_graph::format::FORMAT;
use djinn_graph::{Arg, DimRange, Input, Node, Program};

/// A graph of `op` on a float32 input of `sizes` (value 0), returning its output (value 1).
fn one_operator(op: &str, overload: &str, args: Vec<Arg>, sizes: &[i64]) -> GraphModule {
    typed_operator(op, overload, args, "float32", sizes, 1)
}

/// A graph of `op` on an input of `dtype` and `sizes` (value 0), returning its first output
/// (value 1) of `outputs`.
fn typed_operator(op: &str, overload: &str, args: Vec<Arg>, dtype: &str, sizes: &[i64], outputs: u32) -> GraphModule {
    let program = Program {
        format: FORMAT,
        inputs: vec![Input {
            name: "x".into(),
            value: 0,
            dtype: dtype.into(),
            dims: sizes.iter().map(|&n| DimRange { min: n, max: n }).collect(),
            state: false,
        }],
        weights: vec![],
        nodes: vec![Node {
            op: op.into(),
            overload: overload.into(),
            args,
            kwargs: Default::default(),
            outputs: (1..=outputs).collect(),
        }],
        outputs: vec![Arg::Value(1)],
        state: vec![],
        entries: vec![],
    };
    GraphModule::load(&djinn_graph::encode(&program, &[]).unwrap(), Device::Cpu).unwrap()
}

fn ints(xs: &[i64]) -> Arg {
    Arg::List(xs.iter().map(|&x| Arg::Int(x)).collect())
}

/// Plans and runs `graph` on `x`: the plan stops at its operator, and the run fails, typed,
/// saying `why`.
fn refused(graph: &GraphModule, x: &Tensor, why: &str) {
    let plan = graph.estimate_run(std::slice::from_ref(x)).expect("a plan");
    assert!(plan.stopped_at.is_some(), "the plan's call fails too: {plan:?}");
    let e = graph.run(vec![x.shallow_clone()]).unwrap_err();
    assert!(matches!(e, ExecError::Execution(_)) && e.to_string().contains(why), "{e}");
}

/// c10 takes a size at or below -2^62 for a pointer to a symbolic one, and libtorch unpacks
/// SymInt[] arguments from int lists unchecked: as_strided's meta kernel made a tensor of
/// "symbolic" sizes from [-2^63], whose sizes then threw where the plan read them (a panic).
#[test]
fn a_size_libtorch_would_take_for_a_pointer_never_reaches_a_kernel() {
    let x = Tensor::from_slice(&[1f32, 2.0, 3.0, 4.0]);
    let v = Arg::Value(0);
    for size in [i64::MIN, -(1 << 62) - 1] {
        let strided = one_operator("aten::as_strided", "", vec![v.clone(), ints(&[size]), ints(&[1])], &[4]);
        refused(&strided, &x, "is not a size");
        let viewed = one_operator("aten::view", "", vec![v.clone(), ints(&[size])], &[4]);
        refused(&viewed, &x, "is not a size");
        // A single SymInt too (select's index).
        let selected = one_operator("aten::select", "int", vec![v.clone(), Arg::Int(0), Arg::Int(size)], &[4]);
        refused(&selected, &x, "is not a size");
    }
    // -2^62 is an int c10 holds: libtorch's own checks answer.
    let viewed = one_operator("aten::view", "", vec![v.clone(), ints(&[-(1 << 62)])], &[4]);
    let e = viewed.run(vec![x.shallow_clone()]).unwrap_err();
    assert!(!e.to_string().contains("is not a size"), "{e}");
    // Plain ints are not sizes: an out-of-range dimension is libtorch's error as before.
    let summed = one_operator("aten::sum", "dim_IntList", vec![v, ints(&[i64::MIN])], &[4]);
    assert!(summed.run(vec![x]).is_err());
}

/// native_group_norm's statistics are [N, group] from its arguments: the node's meta kernel took
/// a group of 2^63 - 1 on a uint8 input, and made two statistics of 2^63 bytes each, whose sum
/// overflowed the plan's count (a panic in a build with overflow checks). Its arguments are now
/// checked as libtorch checks them, N * C * HxW without overflow.
#[test]
fn group_norm_statistics_are_planned_from_checked_arguments() {
    let x = Tensor::from_slice(&[1u8, 2]).reshape([1, 2]);
    let (v, int) = (Arg::Value(0), Arg::Int);
    let norm = |n: i64, c: i64, hxw: i64, group: i64| {
        typed_operator(
            "aten::native_group_norm",
            "",
            vec![v.clone(), Arg::None, Arg::None, int(n), int(c), int(hxw), int(group), Arg::Float("0.5".into())],
            "uint8",
            &[1, 2],
            3,
        )
    };
    for (n, c, hxw, group) in [(i64::MAX, i64::MAX, i64::MAX, i64::MAX), (1, 2, 1, 0), (1, 2, 1, 3), (1, 2, 2, 1)] {
        let graph = norm(n, c, hxw, group);
        let plan = graph.estimate_run(std::slice::from_ref(&x)).expect("a plan");
        assert_eq!(plan.stopped_at.as_deref(), Some("aten::native_group_norm"), "{n} {c} {hxw} {group}");
        assert!(graph.run(vec![x.shallow_clone()]).is_err(), "{n} {c} {hxw} {group}");
    }
    // Consistent arguments are planned through ([N, group] statistics).
    let f = Tensor::from_slice(&[1f32, 2.0, 3.0, 4.0]).reshape([1, 2, 2]);
    let graph = typed_operator(
        "aten::native_group_norm",
        "",
        vec![v, Arg::None, Arg::None, int(1), int(2), int(2), int(2), Arg::Float("1e-05".into())],
        "float32",
        &[1, 2, 2],
        3,
    );
    assert_eq!(graph.estimate_run(std::slice::from_ref(&f)).unwrap().stopped_at, None);
    graph.run(vec![f]).unwrap();
}
