//! What the runner checks of an operator's operands before its kernel runs, beyond indices
//! (index_bounds.rs): values the run computed where the allowlist has a rule on them (the
//! checker held the constants), and the probabilities a random operator draws from (on CUDA a
//! negative or non-finite one is a device-side assert, which ends every tenant's calls).

use djinn_graph::{Arg, ValueRule};
use tch::Tensor;

use crate::value::RtValue;

/// Whether `value` holds to `rule` (a list's items each; an optional left out does).
pub(crate) fn admitted(rule: &ValueRule, value: &RtValue) -> bool {
    match value {
        RtValue::None => true,
        RtValue::Int(i) => rule.admits_int(*i),
        RtValue::Bool(b) => rule.admits_int(i64::from(*b)),
        RtValue::Float(f) => rule.admits_float(*f),
        RtValue::List(items) => items.iter().all(|v| admitted(rule, v)),
        RtValue::Tensor(_) => false,
    }
}

/// Which operand of an operator holds probabilities, and what they must be.
#[derive(Debug, Clone)]
pub(crate) struct Probabilities {
    operand: Arg,
    /// Each row sums above zero (a distribution to draw categories from), rather than each
    /// entry at most one (a probability of its own).
    rows: bool,
}

/// The probabilities to check before `name` (`aten::op.overload`) runs with `args`.
pub(crate) fn probabilities_of(name: &str, args: &[Option<Arg>]) -> Option<Probabilities> {
    let arg = |i: usize| args.get(i).cloned().flatten();
    match name {
        "aten::multinomial" => Some(Probabilities { operand: arg(0)?, rows: true }),
        "aten::bernoulli" => Some(Probabilities { operand: arg(0)?, rows: false }),
        "aten::bernoulli.Tensor" => Some(Probabilities { operand: arg(1)?, rows: false }),
        _ => None,
    }
}

/// Every entry finite and not negative; with `rows`, each row (of the last dimension) sums
/// above zero, else each entry is at most one.
pub(crate) fn check_probabilities(
    p: &Probabilities,
    value: impl Fn(&Arg) -> Result<RtValue, String>,
) -> Result<(), String> {
    let RtValue::Tensor(t) = value(&p.operand)? else { return Ok(()) };
    if t.numel() == 0 || !t.is_floating_point() {
        return Ok(());
    }
    let fails = |e: tch::TchError| e.to_string();
    let all = |t: Tensor| t.f_all().and_then(|t| t.f_int64_value(&[])).map_err(fails);
    if all(t.f_isfinite().map_err(fails)?)? == 0 || all(t.f_ge(0.0).map_err(fails)?)? == 0 {
        return Err("a probability that is negative, infinite or NaN".into());
    }
    if p.rows {
        let sums = t.f_sum_dim_intlist(-1, false, tch::Kind::Double).map_err(fails)?;
        if all(sums.f_gt(0.0).map_err(fails)?)? == 0 {
            return Err("a distribution whose probabilities sum to zero".into());
        }
    } else if all(t.f_le(1.0).map_err(fails)?)? == 0 {
        return Err("a probability over one".into());
    }
    Ok(())
}
