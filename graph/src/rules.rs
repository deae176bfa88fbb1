//! Rules on argument values that libtorch's kernels trust: an int read as an enum (an
//! interpolation or padding mode, a reduction) is cast without a check, so a value outside its
//! set leaves an output unwritten or reads past a table; a float that scales a size is turned
//! into source indices, so a tiny one overflows them. The allowlist carries each such
//! argument's rule (`rule` lines, written by graph/allowlist.py); the checker holds a graph's
//! constants to it and the runner the values a run computes, before the operator runs.

use std::fmt;

use crate::format::Arg;

#[derive(Debug, Clone, PartialEq)]
pub enum ValueRule {
    /// An int that libtorch reads as an enum (or a bool it must be: 1 for true): one of these.
    OneOf(Vec<i64>),
    /// A float that scales a size: finite and in `low..=high`.
    Within { low: f64, high: f64 },
}

impl ValueRule {
    /// `one-of 0 1 2` or `within 0.0009765625 1024`.
    pub fn parse(words: &[&str]) -> Option<Self> {
        match words {
            ["one-of", values @ ..] if !values.is_empty() => {
                values.iter().map(|v| v.parse().ok()).collect::<Option<Vec<i64>>>().map(ValueRule::OneOf)
            }
            ["within", low, high] => {
                let (low, high) = (low.parse::<f64>().ok()?, high.parse::<f64>().ok()?);
                (low.is_finite() && high.is_finite() && low <= high).then_some(ValueRule::Within { low, high })
            }
            _ => None,
        }
    }

    pub fn admits_int(&self, v: i64) -> bool {
        match self {
            ValueRule::OneOf(values) => values.contains(&v),
            ValueRule::Within { .. } => self.admits_float(v as f64),
        }
    }

    pub fn admits_float(&self, v: f64) -> bool {
        match self {
            ValueRule::OneOf(_) => false,
            ValueRule::Within { low, high } => v.is_finite() && *low <= v && v <= *high,
        }
    }

    /// Holds a constant argument (a list's items each) to the rule: `Ok(true)` where it holds
    /// a value of the graph, which the runner checks when the run has computed it.
    pub fn check(&self, arg: &Arg) -> Result<bool, String> {
        let admitted = match arg {
            Arg::None => true,
            Arg::Value(_) => return Ok(true),
            Arg::Int(v) => self.admits_int(*v),
            Arg::Bool(b) => self.admits_int(i64::from(*b)),
            Arg::Float(f) => f.parse::<f64>().is_ok_and(|f| self.admits_float(f)),
            Arg::List(items) => {
                let mut deferred = false;
                for item in items {
                    deferred |= self.check(item)?;
                }
                return Ok(deferred);
            }
            _ => false,
        };
        if admitted { Ok(false) } else { Err(format!("{arg:?} is not {self}")) }
    }
}

impl fmt::Display for ValueRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueRule::OneOf(values) => {
                let values: Vec<String> = values.iter().map(i64::to_string).collect();
                write!(f, "one of {}", values.join(", "))
            }
            ValueRule::Within { low, high } => write!(f, "a finite number in [{low}, {high}]"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_parse_and_hold_constants() {
        let modes = ValueRule::parse(&["one-of", "0", "1", "2"]).unwrap();
        assert_eq!(modes.check(&Arg::Int(2)), Ok(false));
        assert!(modes.check(&Arg::Int(5)).unwrap_err().contains("one of 0, 1, 2"));
        assert!(modes.check(&Arg::Float("1".into())).is_err());
        assert_eq!(modes.check(&Arg::Value(3)), Ok(true), "a value of the graph is the runner's to check");
        let training = ValueRule::parse(&["one-of", "1"]).unwrap();
        assert!(training.check(&Arg::Bool(true)).is_ok() && training.check(&Arg::Bool(false)).is_err());
        let scale = ValueRule::parse(&["within", "0.0009765625", "1024"]).unwrap();
        for bad in ["1e-20", "NaN", "inf", "-inf", "-2", "1e300", "x"] {
            assert!(scale.check(&Arg::Float(bad.into())).is_err(), "{bad}");
        }
        assert_eq!(scale.check(&Arg::Float("2.0".into())), Ok(false));
        assert_eq!(scale.check(&Arg::None), Ok(false), "an optional scale left out");
        assert_eq!(scale.check(&Arg::Int(2)), Ok(false));
        let list = Arg::List(vec![Arg::Float("2".into()), Arg::Value(1)]);
        assert_eq!(scale.check(&list), Ok(true));
        assert!(scale.check(&Arg::List(vec![Arg::Value(1), Arg::Float("0".into())])).is_err());
        for bad in [&["one-of"][..], &["within", "1"], &["within", "2", "1"], &["within", "0", "inf"], &["nope"]] {
            assert!(ValueRule::parse(bad).is_none(), "{bad:?}");
        }
    }
}
