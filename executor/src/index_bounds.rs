//! Index operands checked before the operator that takes them runs. libtorch checks them on
//! the CPU, but on CUDA an index out of range is a device-side assert, which leaves the
//! process's CUDA context unusable for every tenant until the node restarts. So the runner
//! checks every index operand against what it indexes first, on every device, and a bad one is
//! an `Execution` error for that request alone. (On a GPU, reading an index's smallest and
//! largest entries waits for the work queued before it: a synchronisation per indexing
//! operator.) Lists of dimensions that an operator takes as given, unwrapped and unchecked (the
//! FFTs', which torch's Python wrappers wrap and dedupe first), are checked here too: an FFT
//! over dimension 2^31 of a 0-dim tensor wrote far out of bounds (SIGSEGV), over -1 one
//! element before its sizes.

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
    /// The index is a list of dimensions of the tensor, at least one, each in `0..rank` and
    /// none twice (`_fft_r2c`, `_fft_c2r`, which libtorch indexes its sizes with unchecked).
    Dimensions,
    /// The index is the tensor itself, whose dimension 1 (its channels, where it has two
    /// dimensions or more) indexes each of the per-channel tensors in [`IndexBounds::per_channel`].
    Channels,
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
    /// `_fft_c2r`'s `last_dim_size`: the real output's size along the last of its dimensions,
    /// whose complex input must have `last_dim_size / 2 + 1` entries there (as torch.fft.irfft
    /// makes it). With 3 entries for an output of 2, the kernel wrote past its output (the
    /// process died: graph_exec's finding).
    last_dim_size: Option<Arg>,
    /// An embedding bag's `include_last_offset`: when true, its offsets end with the number
    /// of indices (CSR's layout, as torch documents it). With offsets `[0]` (no bag) and
    /// indices, the max mode wrote a bag that is not there (SIGSEGV: graph_exec's finding).
    include_last_offset: Option<Arg>,
    /// Tensors the kernel reads one entry of per channel of the source (a batch norm's weight,
    /// bias and running statistics): each must have as many. `_native_batch_norm_legit.no_stats`
    /// and `_native_batch_norm_legit_no_training` check none of them, and read past a weight of
    /// 2 for an input of 4 channels (graph_exec's finding: another allocation's bytes in the
    /// output).
    per_channel: Vec<Arg>,
}

/// The bounds to check before `name` (`aten::op.overload`) runs with `args`, when it takes
/// indices.
pub(crate) fn of(name: &str, args: &[Option<Arg>]) -> Option<IndexBounds> {
    let op = name.split_once('.').map_or(name, |(op, _)| op);
    let arg = |i: usize| args.get(i).cloned().flatten();
    let last_dim_size = if op == "aten::_fft_c2r" { arg(3) } else { None };
    let include_last_offset = if op == "aten::_embedding_bag" { arg(7) } else { None };
    let mut per_channel = Vec::new();
    let (source, index, dim, negative, offsets) = match op {
        "aten::_native_batch_norm_legit" | "aten::_native_batch_norm_legit_no_training" => {
            // (input, weight?, bias?, running_mean, running_var, ...) or (input, weight?, bias?,
            // training, ...): the tensors among arguments 1 to 4.
            per_channel = (1..=4).filter_map(arg).collect();
            (arg(0)?, arg(0)?, Dim::Channels, false, None)
        }
        "aten::embedding" => (arg(0)?, arg(1)?, Dim::First, false, None),
        "aten::_embedding_bag" => (arg(0)?, arg(1)?, Dim::First, false, arg(2)),
        "aten::index" | "aten::index_put" | "aten::index_put_" => (arg(0)?, arg(1)?, Dim::InOrder, true, None),
        "aten::_fft_r2c" | "aten::_fft_c2r" => (arg(0)?, arg(1)?, Dim::Dimensions, false, None),
        "aten::gather"
        | "aten::index_select"
        | "aten::index_copy"
        | "aten::index_copy_"
        | "aten::scatter"
        | "aten::scatter_add"
        | "aten::scatter_reduce" => (arg(0)?, arg(2)?, Dim::Given(arg(1)?), false, None),
        _ => return None,
    };
    Some(IndexBounds { source, index, dim, negative, offsets, last_dim_size, include_last_offset, per_channel })
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
        (Dim::Dimensions, RtValue::List(items)) => {
            let mut seen = Vec::with_capacity(items.len());
            for item in &items {
                let d = item.int().ok_or("a dimension that is not an int")?;
                if !(0..sizes.len() as i64).contains(&d) || seen.contains(&d) {
                    return Err(format!(
                        "dimensions {:?} of a tensor of {} dimensions: each must be in 0..{} and given once",
                        items.iter().map(RtValue::int).collect::<Vec<_>>(),
                        sizes.len(),
                        sizes.len()
                    ));
                }
                seen.push(d);
            }
            let Some(&last) = seen.last() else { return Err("an empty list of dimensions".into()) };
            if let Some(n) = &bounds.last_dim_size {
                let n = value(n)?.int().ok_or("a last_dim_size that is not an int")?;
                let given = sizes[last as usize];
                if n < 1 || given != n / 2 + 1 {
                    return Err(format!(
                        "a real output of {n} along dimension {last} takes {} complex entries there, not {given}",
                        n.max(0) / 2 + 1
                    ));
                }
            }
        }
        (Dim::Dimensions, _) => return Err("dimensions that are not a list".into()),
        // Below two dimensions libtorch refuses the input itself.
        (Dim::Channels, _) if sizes.len() >= 2 => {
            for arg in &bounds.per_channel {
                if let RtValue::Tensor(t) = value(arg)?
                    && (t.dim() != 1 || t.size()[0] != sizes[1])
                {
                    return Err(format!(
                        "a tensor of sizes {:?} per channel of an input of {} channels (sizes {sizes:?})",
                        t.size(),
                        sizes[1]
                    ));
                }
            }
        }
        _ => {}
    }
    if let (Some(offsets), RtValue::Tensor(index)) = (&bounds.offsets, value(&bounds.index)?)
        && let RtValue::Tensor(offsets) = value(offsets)?
    {
        // libtorch's embedding bag reads its indices and offsets as if they were contiguous:
        // an expanded or strided one was read past its memory (the values checked here are
        // not those it used; its errors quoted what it read there, a heap address among them,
        // and offsets read there placed its writes: graph_exec's finding).
        for (t, what) in [(&index, "indices"), (&offsets, "offsets")] {
            if !t.is_contiguous() {
                return Err(format!(
                    "the {what} of an embedding bag must be contiguous (sizes {:?}, strides {:?})",
                    t.size(),
                    t.stride()
                ));
            }
        }
        within(&offsets, index.numel() as i64 + 1, false, "the indices (as offsets)")?;
        let last_is_count = match &bounds.include_last_offset {
            Some(flag) => value(flag)?.int() == Some(1),
            None => false,
        };
        if last_is_count {
            let last = match offsets.numel() {
                0 => None,
                n => offsets
                    .f_reshape([-1])
                    .and_then(|o| o.f_select(0, n as i64 - 1))
                    .and_then(|o| o.f_int64_value(&[]))
                    .ok(),
            };
            if last != Some(index.numel() as i64) {
                return Err(format!(
                    "with include_last_offset, the offsets end with the number of indices, {}; the last is {last:?}",
                    index.numel()
                ));
            }
        }
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
        fn value(arg: &Arg, values: &[RtValue]) -> Result<RtValue, String> {
            match arg {
                Arg::Value(i) => Ok(values[*i as usize].shallow_clone()),
                Arg::Int(i) => Ok(RtValue::Int(*i)),
                Arg::Bool(b) => Ok(RtValue::Bool(*b)),
                Arg::None => Ok(RtValue::None),
                Arg::List(items) => items.iter().map(|a| value(a, values)).collect::<Result<_, _>>().map(RtValue::List),
                other => Err(format!("{other:?}")),
            }
        }
        check(&bounds, |arg| value(arg, &values))
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
            // With include_last_offset, the offsets end with the number of indices (offsets
            // [0] and two indices in max mode: a SIGSEGV).
            (
                "aten::_embedding_bag",
                vec![v(0), v(1), v(2), Arg::Bool(false), Arg::Int(2), Arg::Bool(false), Arg::None, Arg::Bool(true)],
                vec![rows(&[10, 4]), ints(&[1, 2]), ints(&[0])],
                Some("the offsets end with the number of indices, 2; the last is Some(0)"),
            ),
            (
                "aten::_embedding_bag",
                vec![v(0), v(1), v(2), Arg::Bool(false), Arg::Int(2), Arg::Bool(false), Arg::None, Arg::Bool(true)],
                vec![rows(&[10, 4]), ints(&[1, 2]), ints(&[])],
                Some("the last is None"),
            ),
            (
                "aten::_embedding_bag",
                vec![v(0), v(1), v(2), Arg::Bool(false), Arg::Int(2), Arg::Bool(false), Arg::None, Arg::Bool(true)],
                vec![rows(&[10, 4]), ints(&[1, 2]), ints(&[0, 1, 2])],
                None,
            ),
            // Indices and offsets contiguous: the kernel reads them as if they were (an expanded
            // one was read past its memory).
            (
                "aten::_embedding_bag",
                vec![v(0), v(1), v(2)],
                vec![rows(&[10, 4]), RtValue::Tensor(Tensor::from_slice(&[1i64]).expand([3], false)), ints(&[0, 1])],
                Some("the indices of an embedding bag must be contiguous (sizes [3], strides [0])"),
            ),
            (
                "aten::_embedding_bag",
                vec![v(0), v(1), v(2)],
                vec![
                    rows(&[10, 4]),
                    ints(&[1, 2, 3]),
                    RtValue::Tensor(Tensor::from_slice(&[0i64, 9, 1, 9]).slice(0, 0, 4, 2)),
                ],
                Some("the offsets of an embedding bag must be contiguous (sizes [2], strides [2])"),
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
        // A batch norm's weight, bias and running statistics have one entry per channel (a
        // weight of 2 for 4 channels was read past: graph_exec's finding).
        let norm = |name: &str, params: Vec<RtValue>| {
            let n = params.len() as u32;
            let mut args: Vec<Arg> = (0..=n).map(Arg::Value).collect();
            args.insert(3.min(args.len()), Arg::Bool(true));
            let mut values = vec![rows(&[2, 4, 3])];
            values.extend(params);
            run(name, args, values)
        };
        let (four, two) = (|| rows(&[4]), || rows(&[2]));
        assert_eq!(norm("aten::_native_batch_norm_legit.no_stats", vec![four(), four()]), Ok(()));
        let e = norm("aten::_native_batch_norm_legit.no_stats", vec![two(), four()]).unwrap_err();
        assert!(e.contains("sizes [2] per channel of an input of 4 channels"), "{e}");
        let e = norm("aten::_native_batch_norm_legit.no_stats", vec![four(), rows(&[4, 1])]).unwrap_err();
        assert!(e.contains("sizes [4, 1] per channel"), "{e}");
        let no_training = |mean: RtValue| {
            run(
                "aten::_native_batch_norm_legit_no_training",
                vec![Arg::Value(0), Arg::None, Arg::None, Arg::Value(1), Arg::Value(2)],
                vec![rows(&[2, 4]), mean, four()],
            )
        };
        assert_eq!(no_training(four()), Ok(()));
        assert!(no_training(two()).unwrap_err().contains("sizes [2] per channel of an input of 4 channels"));
        // The FFTs' dimensions (graph_exec's finding: an FFT over dimension 2^31 of a 0-dim
        // tensor was a SIGSEGV, over -1 a write before its sizes).
        let dims = |ds: &[i64]| Arg::List(ds.iter().map(|&d| Arg::Int(d)).collect());
        for (name, ds, sizes, refused) in [
            ("aten::_fft_r2c", &[1][..], &[3, 4][..], None),
            ("aten::_fft_c2r", &[0, 1], &[3, 4], None),
            ("aten::_fft_r2c", &[1 << 31], &[], Some("each must be in 0..0")),
            ("aten::_fft_r2c", &[-1], &[3, 4], Some("each must be in 0..2")),
            ("aten::_fft_c2r", &[2], &[3, 4], Some("each must be in 0..2")),
            ("aten::_fft_c2r", &[1, 1], &[3, 4], Some("given once")),
            ("aten::_fft_r2c", &[], &[3, 4], Some("an empty list")),
        ] {
            let got = run(name, vec![Arg::Value(0), dims(ds), Arg::Int(0), Arg::Int(6)], vec![rows(sizes)]);
            match (got, refused) {
                (Ok(()), None) => {}
                (Err(e), Some(part)) => assert!(e.contains(part), "{name} {ds:?}: {e:?} does not say {part:?}"),
                (got, want) => panic!("{name} {ds:?} on {sizes:?}: {got:?}, expected a refusal saying {want:?}"),
            }
        }
        // The complex input of _fft_c2r has last_dim_size / 2 + 1 entries along its last
        // dimension (3 entries for an output of 2 wrote past the output: the process died).
        for (last_dim_size, refused) in [
            (4, None),
            (5, None),
            (2, Some("takes 2 complex entries there, not 3")),
            (0, Some("takes 1")),
            (-4, Some("of -4")),
        ] {
            let got = run(
                "aten::_fft_c2r",
                vec![Arg::Value(0), dims(&[0]), Arg::Int(0), Arg::Int(last_dim_size)],
                vec![rows(&[3])],
            );
            match (got, refused) {
                (Ok(()), None) => {}
                (Err(e), Some(part)) => assert!(e.contains(part), "{last_dim_size}: {e:?} does not say {part:?}"),
                (got, want) => panic!("last_dim_size {last_dim_size}: {got:?}, expected a refusal saying {want:?}"),
            }
        }
        // Empty indices index nothing.
        assert_eq!(run("aten::embedding", vec![Arg::Value(0), Arg::Value(1)], vec![rows(&[0, 4]), ints(&[])]), Ok(()));
    }
}
