//! Byte sizes on the command line: `1073741824`, `512MiB`, `8GiB`, `1G` (binary units).

use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (digits, unit) = s.split_at(split);
        let n: u64 = digits.parse().map_err(|_| format!("{s:?} is not a size (e.g. 512MiB, 8GiB, 4096)"))?;
        let shift = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 0,
            "k" | "kib" | "kb" => 10,
            "m" | "mib" | "mb" => 20,
            "g" | "gib" | "gb" => 30,
            "t" | "tib" | "tb" => 40,
            other => return Err(format!("unknown size unit {other:?} (use KiB, MiB, GiB or TiB)")),
        };
        n.checked_mul(1 << shift).map(ByteSize).ok_or_else(|| format!("{s:?} overflows 64 bits"))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let units = ["B", "KiB", "MiB", "GiB", "TiB"];
        let mut value = self.0 as f64;
        let mut unit = 0;
        while value >= 1024.0 && unit < units.len() - 1 {
            value /= 1024.0;
            unit += 1;
        }
        if unit == 0 { write!(f, "{} B", self.0) } else { write!(f, "{value:.1} {}", units[unit]) }
    }
}

#[cfg(test)]
mod tests {
    use super::ByteSize;

    #[test]
    fn parses_units() {
        assert_eq!("4096".parse(), Ok(ByteSize(4096)));
        assert_eq!("512MiB".parse(), Ok(ByteSize(512 << 20)));
        assert_eq!("8G".parse(), Ok(ByteSize(8 << 30)));
        assert!("8XB".parse::<ByteSize>().is_err());
        assert!("99999999999T".parse::<ByteSize>().is_err());
    }
}
