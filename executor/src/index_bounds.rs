//! Index operands checked before the operator that takes them runs. libtorch checks them on
//! the CPU, but on CUDA an index out of range is a device-side assert, which leaves the
//! process's CUDA context unusable for every tenant until the node restarts. So the runner
//! checks every index operand against what it indexes first, on every device, and a bad one is
//! an `Execution` error for that request alone. (On a GPU, reading an index's smallest and
//! largest entries waits for the work queued before it: a synchronisation per indexing
//! operator.)

use djinn_graph::Arg;
use tch::{Kind, Tensor};

use crate::graph::RtValue;

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
            // A mask (bool or uint8) covers as many dimensions as it has: what follows it is
            // matched by libtorch, which turns masks into indices itself.
            for (k, item) in items.iter().enumerate() {
                match item {
                    RtValue::Tensor(t) if is_mask(t) => break,
                    RtValue::Tensor(t) => within(t, size_of(k as i64)?, bounds.negative, &format!("dimension {k}"))?,
                    _ => {}
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
