//! Index operands checked before the operator that takes them runs. libtorch checks them on
//! the CPU, but on CUDA an index out of range is a device-side assert, which leaves the
//! process's CUDA context unusable for every tenant until the node restarts. So the runner
//! checks every index operand against what it indexes first, on every device, and a bad one is
//! an `Execution` error for that request alone. (On a GPU, reading an index's smallest and
//! largest entries waits for the work queued before it: a synchronisation per indexing
//! operator.)

use djinn_graph::Arg;
use tch::{Kind, Tensor};

use crate::value::RtValue;

/// Which dimensions of the indexed tensor the indices are into.
#[derive(Debug, Clone)]
enum Dim {
    /// The one this argument names (an int; negative counts from the end).
    Given(Arg),
    /// Dimension 0.
    First,
    /// A list of optional index tensors, the k-th into dimension k (`aten::index`).
    InOrder,
}

/// What one operator's indices index.
#[derive(Debug, Clone)]
pub(crate) struct IndexBounds {
    source: Arg,
    index: Arg,
    dim: Dim,
    /// Negative indices count from the end (`aten::index`); elsewhere they are errors.
    negative: bool,
    /// An embedding bag's offsets: into the indices, their count included.
    offsets: Option<Arg>,
}

/// The bounds to check before `name` (`aten::op.overload`) runs with `args`, when it takes
/// indices.
pub(crate) fn of(name: &str, args: &[Option<Arg>]) -> Option<IndexBounds> {
    let op = name.split_once('.').map_or(name, |(op, _)| op);
    let arg = |i: usize| args.get(i).cloned().flatten();
    let (source, index, dim, negative, offsets) = match op {
        "aten::embedding" => (arg(0)?, arg(1)?, Dim::First, false, None),
        "aten::_embedding_bag" => (arg(0)?, arg(1)?, Dim::First, false, arg(2)),
        "aten::index" | "aten::index_put" | "aten::index_put_" => (arg(0)?, arg(1)?, Dim::InOrder, true, None),
        "aten::gather"
        | "aten::index_select"
        | "aten::index_copy"
        | "aten::index_copy_"
        | "aten::scatter"
        | "aten::scatter_add"
        | "aten::scatter_reduce" => (arg(0)?, arg(2)?, Dim::Given(arg(1)?), false, None),
        _ => return None,
    };
    Some(IndexBounds { source, index, dim, negative, offsets })
}

/// Checks the indices of one call; `value` gives an argument's value in this run.
pub(crate) fn check(bounds: &IndexBounds, value: impl Fn(&Arg) -> Result<RtValue, String>) -> Result<(), String> {
    let RtValue::Tensor(source) = value(&bounds.source)? else { return Ok(()) };
    let sizes = source.size();
    let size_of = |dim: i64| -> Result<i64, String> {
        let d = if dim < 0 { dim + sizes.len() as i64 } else { dim };
        usize::try_from(d)
            .ok()
            .and_then(|d| sizes.get(d).copied())
            .ok_or_else(|| format!("dimension {dim} is out of range for a tensor of {} dimensions", sizes.len()))
    };
    match (&bounds.dim, value(&bounds.index)?) {
        (Dim::First, RtValue::Tensor(index)) => within(&index, size_of(0)?, bounds.negative, "dimension 0")?,
        (Dim::Given(dim), RtValue::Tensor(index)) => {
            let Some(dim) = value(dim)?.int() else { return Err("a dimension that is not an int".into()) };
            // A scalar tensor indexes a scalar too (gather, scatter).
            let size = if sizes.is_empty() && (dim == 0 || dim == -1) { 1 } else { size_of(dim)? };
            within(&index, size, bounds.negative, &format!("dimension {dim}"))?;
        }
        (Dim::InOrder, RtValue::List(items)) => {
            // Each index tensor is into the next dimension; a mask (bool or uint8) covers as
            // many as it has, and must match their sizes.
            let mut dim = 0usize;
            for item in &items {
                match item {
                    RtValue::Tensor(t) if is_mask(t) => {
                        let covered = sizes.get(dim..dim + t.dim()).ok_or_else(|| {
                            format!(
                                "a mask of {} dimensions from dimension {dim} of a tensor of {}",
                                t.dim(),
                                sizes.len()
                            )
                        })?;
                        if t.size() != covered {
                            return Err(format!("a mask of sizes {:?} over dimensions of sizes {covered:?}", t.size()));
                        }
                        dim += t.dim();
                    }
                    RtValue::Tensor(t) => {
                        within(t, size_of(dim as i64)?, bounds.negative, &format!("dimension {dim}"))?;
                        dim += 1;
                    }
                    _ => dim += 1,
                }
            }
        }
        _ => {}
    }
    if let (Some(offsets), RtValue::Tensor(index)) = (&bounds.offsets, value(&bounds.index)?)
        && let RtValue::Tensor(offsets) = value(offsets)?
    {
        within(&offsets, index.numel() as i64 + 1, false, "the indices (as offsets)")?;
    }
    Ok(())
}

fn is_mask(t: &Tensor) -> bool {
    matches!(t.kind(), Kind::Bool | Kind::Uint8)
}

/// Every entry of `index` (integers) in `0..size`, or in `-size..size` with `negative`.
fn within(index: &Tensor, size: i64, negative: bool, what: &str) -> Result<(), String> {
    if is_mask(index)
        || index.numel() == 0
        || !matches!(index.kind(), Kind::Int64 | Kind::Int | Kind::Int16 | Kind::Int8)
    {
        return Ok(());
    }
    let read = |t: Result<Tensor, tch::TchError>| t.and_then(|t| t.f_int64_value(&[])).map_err(|e| e.to_string());
    let (low, high) = (read(index.f_min())?, read(index.f_max())?);
    let first = if negative { -size } else { 0 };
    let bad = if low < first {
        low
    } else if high >= size {
        high
    } else {
        return Ok(());
    };
    Err(format!("index {bad} is out of range for {what}, of size {size}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the check of `name` on `values` (argument i is `Arg::Value(i)`, or the constant given).
    fn run(name: &str, args: Vec<Arg>, values: Vec<RtValue>) -> Result<(), String> {
        let args: Vec<Option<Arg>> = args.into_iter().map(Some).collect();
        let bounds = of(name, &args).ok_or("no bounds")?;
        check(&bounds, |arg| match arg {
            Arg::Value(i) => Ok(values[*i as usize].shallow_clone()),
            Arg::Int(i) => Ok(RtValue::Int(*i)),
            other => Err(format!("{other:?}")),
        })
    }

    fn ints(values: &[i64]) -> RtValue {
        RtValue::Tensor(Tensor::from_slice(values))
    }

    fn mask(values: &[bool]) -> RtValue {
        RtValue::Tensor(Tensor::from_slice(values))
    }

    fn rows(shape: &[i64]) -> RtValue {
        RtValue::Tensor(Tensor::zeros(shape, (Kind::Float, tch::Device::Cpu)))
    }

    /// An operator, its arguments, their values, and what its refusal says (`None`: accepted).
    type Case = (&'static str, Vec<Arg>, Vec<RtValue>, Option<&'static str>);

    #[test]
    fn every_indexing_operator_is_checked_against_the_dimension_it_indexes() {
        let v = Arg::Value;
        let dim1 = || vec![v(0), Arg::Int(1), v(1), v(2)];
        let cases: Vec<Case> = vec![
            ("aten::embedding", vec![v(0), v(1)], vec![rows(&[10, 4]), ints(&[0, 9])], None),
            (
                "aten::embedding",
                vec![v(0), v(1)],
                vec![rows(&[10, 4]), ints(&[0, 10])],
                Some("index 10 is out of range for dimension 0, of size 10"),
            ),
            ("aten::embedding", vec![v(0), v(1)], vec![rows(&[10, 4]), ints(&[-1])], Some("index -1")),
            ("aten::gather", vec![v(0), Arg::Int(-1), v(1)], vec![rows(&[3, 4]), ints(&[3])], None),
            (
                "aten::gather",
                vec![v(0), Arg::Int(-1), v(1)],
                vec![rows(&[3, 4]), ints(&[4])],
                Some("dimension -1, of size 4"),
            ),
            (
                "aten::index_select",
                vec![v(0), Arg::Int(0), v(1)],
                vec![rows(&[3, 4]), ints(&[3])],
                Some("dimension 0, of size 3"),
            ),
            ("aten::index_copy_", dim1(), vec![rows(&[3, 4]), ints(&[5]), rows(&[3, 1])], Some("index 5")),
            ("aten::scatter.src", dim1(), vec![rows(&[3, 4]), ints(&[4]), rows(&[1])], Some("index 4")),
            ("aten::scatter_add", dim1(), vec![rows(&[3, 4]), ints(&[3]), rows(&[1])], None),
            ("aten::scatter_reduce.two", dim1(), vec![rows(&[3, 4]), ints(&[-2]), rows(&[1])], Some("index -2")),
            // aten::index: the k-th index into dimension k, negative ones from the end.
            (
                "aten::index.Tensor",
                vec![v(0), v(1)],
                vec![rows(&[3, 4]), RtValue::List(vec![RtValue::None, ints(&[-4, 3])])],
                None,
            ),
            (
                "aten::index.Tensor",
                vec![v(0), v(1)],
                vec![rows(&[3, 4]), RtValue::List(vec![ints(&[-4])])],
                Some("index -4 is out of range for dimension 0, of size 3"),
            ),
            (
                "aten::index_put_",
                vec![v(0), v(1), v(2)],
                vec![rows(&[3, 4]), RtValue::List(vec![RtValue::None, ints(&[4])]), rows(&[1])],
                Some("dimension 1"),
            ),
            // A mask covers as many dimensions as it has, sized as they are; what follows it
            // indexes the next.
            (
                "aten::index.Tensor",
                vec![v(0), v(1)],
                vec![rows(&[3, 4]), RtValue::List(vec![mask(&[true, false, true]), ints(&[3])])],
                None,
            ),
            (
                "aten::index.Tensor",
                vec![v(0), v(1)],
                vec![rows(&[3, 4]), RtValue::List(vec![mask(&[true, false, true]), ints(&[100])])],
                Some("index 100 is out of range for dimension 1, of size 4"),
            ),
            (
                "aten::index.Tensor",
                vec![v(0), v(1)],
                vec![
                    rows(&[3, 4, 5]),
                    RtValue::List(vec![RtValue::Tensor(Tensor::from_slice(&[true; 12]).reshape([3, 4])), ints(&[5])]),
                ],
                Some("index 5 is out of range for dimension 2, of size 5"),
            ),
            (
                "aten::index.Tensor",
                vec![v(0), v(1)],
                vec![rows(&[3, 4]), RtValue::List(vec![mask(&[true, false])])],
                Some("a mask of sizes [2] over dimensions of sizes [3]"),
            ),
            (
                "aten::index.Tensor",
                vec![v(0), v(1)],
                vec![rows(&[3]), RtValue::List(vec![mask(&[true; 3]), mask(&[true])])],
                Some("a mask of 1 dimensions from dimension 1 of a tensor of 1"),
            ),
            // An embedding bag's offsets index its indices, their count included.
            (
                "aten::_embedding_bag",
                vec![v(0), v(1), v(2)],
                vec![rows(&[10, 4]), ints(&[1, 2, 3]), ints(&[0, 3])],
                None,
            ),
            (
                "aten::_embedding_bag",
                vec![v(0), v(1), v(2)],
                vec![rows(&[10, 4]), ints(&[1, 2, 3]), ints(&[0, 4])],
                Some("index 4 is out of range for the indices (as offsets)"),
            ),
        ];
        for (name, args, values, refused) in cases {
            match (run(name, args, values), refused) {
                (Ok(()), None) => {}
                (Err(e), Some(part)) => assert!(e.contains(part), "{name}: {e:?} does not say {part:?}"),
                (got, want) => panic!("{name}: {got:?}, expected a refusal saying {want:?}"),
            }
        }
        assert!(of("aten::add.Tensor", &[Some(Arg::Value(0)), Some(Arg::Value(1))]).is_none());
        // Empty indices index nothing.
        assert_eq!(run("aten::embedding", vec![Arg::Value(0), Arg::Value(1)], vec![rows(&[0, 4]), ints(&[])]), Ok(()));
    }
}
