//! Bandwidths and rates as operators write them: `10Gbit`, `400MB`, `1.5GiB` (per second),
//! `2M` WRs per second; and back, for listings.

/// Why a quantity does not parse.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum UnitError {
    /// Not a number followed by a known unit.
    #[error("{0:?}: expected a number and a unit: bits (bit, kbit, Mbit, Gbit, Tbit), bytes (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), each per second; 0 or none for no cap")]
    Bandwidth(String),
    /// Not a number with an optional k, M or G.
    #[error("{0:?}: expected a number with an optional k, M or G (per second); 0 or none for no cap")]
    Rate(String),
    /// Too large to count.
    #[error("{0:?} is too large")]
    TooLarge(String),
}

/// Splits `s` into its number and the rest (a unit), dropping a trailing `/s` or `ps`-less
/// per-second mark.
fn split(s: &str) -> (&str, &str) {
    let s = s.trim();
    let s = s.strip_suffix("/s").unwrap_or(s);
    let at = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    (&s[..at], s[at..].trim())
}

/// `number × factor`, exactly for whole numbers, rounded to the nearest unit otherwise.
fn scale(orig: &str, number: &str, factor: u64, bad: impl Fn(String) -> UnitError) -> Result<u64, UnitError> {
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') || number.matches('.').count() > 1 {
        return Err(bad(orig.to_string()));
    }
    if let Ok(n) = number.parse::<u64>() {
        return n.checked_mul(factor).ok_or_else(|| UnitError::TooLarge(orig.to_string()));
    }
    let x: f64 = number.parse().map_err(|_| bad(orig.to_string()))?;
    let v = (x * factor as f64).round();
    if !v.is_finite() || v >= u64::MAX as f64 {
        return Err(UnitError::TooLarge(orig.to_string()));
    }
    Ok(v as u64)
}

fn is_none(s: &str) -> bool {
    matches!(s.trim().to_ascii_lowercase().as_str(), "none" | "unlimited" | "off")
}

/// A bandwidth in bytes per second: bits (`bit`, `kbit`, `Mbit`, `Gbit`, `Tbit`; any case),
/// decimal bytes (`B`, `kB`/`KB`, `MB`, `GB`, `TB`) or binary bytes (`KiB`, `MiB`, `GiB`,
/// `TiB`); a bare number is bytes. `none` is 0 (no cap). Bits round down to whole bytes.
pub(crate) fn parse_bandwidth(s: &str) -> Result<u64, UnitError> {
    if is_none(s) {
        return Ok(0);
    }
    let (number, unit) = split(s);
    let lower = unit.to_ascii_lowercase();
    let bits = |f: u64| -> Option<(u64, bool)> { Some((f, true)) };
    let (factor, in_bits) = match lower.as_str() {
        "bit" => bits(1),
        "kbit" => bits(1_000),
        "mbit" => bits(1_000_000),
        "gbit" => bits(1_000_000_000),
        "tbit" => bits(1_000_000_000_000),
        _ => match unit {
            "" | "B" => Some((1, false)),
            "kB" | "KB" => Some((1_000, false)),
            "MB" => Some((1_000_000, false)),
            "GB" => Some((1_000_000_000, false)),
            "TB" => Some((1_000_000_000_000, false)),
            "KiB" => Some((1 << 10, false)),
            "MiB" => Some((1 << 20, false)),
            "GiB" => Some((1 << 30, false)),
            "TiB" => Some((1 << 40, false)),
            _ => None,
        },
    }
    .ok_or_else(|| UnitError::Bandwidth(s.to_string()))?;
    let v = scale(s, number, factor, UnitError::Bandwidth)?;
    Ok(if in_bits { v / 8 } else { v })
}

/// A rate per second: a number with an optional `k`/`K`, `M` or `G` (decimal); `none` is 0.
pub(crate) fn parse_rate(s: &str) -> Result<u64, UnitError> {
    if is_none(s) {
        return Ok(0);
    }
    let (number, unit) = split(s);
    let factor = match unit {
        "" => 1,
        "k" | "K" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        _ => return Err(UnitError::Rate(s.to_string())),
    };
    scale(s, number, factor, UnitError::Rate)
}

/// A bandwidth cap as listings show it (`-`: none).
pub(crate) fn format_bandwidth(bytes_per_s: u64) -> String {
    format_scaled(bytes_per_s, "B/s")
}

/// A rate cap as listings show it (`-`: none).
pub(crate) fn format_rate(per_s: u64) -> String {
    format_scaled(per_s, "/s")
}

fn format_scaled(v: u64, unit: &str) -> String {
    if v == 0 {
        return "-".into();
    }
    for (f, p) in [(1_000_000_000_000u64, "T"), (1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k")] {
        if v >= f {
            let x = v as f64 / f as f64;
            return if v.is_multiple_of(f) { format!("{}{p}{unit}", v / f) } else { format!("{x:.1}{p}{unit}") };
        }
    }
    format!("{v}{unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidths_in_bits_and_bytes() {
        for (s, want) in [
            ("10Gbit", 1_250_000_000),
            ("10gbit", 1_250_000_000),
            ("1Mbit", 125_000),
            ("8bit", 1),
            ("1kbit", 125),
            ("400MB", 400_000_000),
            ("400 MB", 400_000_000),
            ("400MB/s", 400_000_000),
            ("200MB", 200_000_000),
            ("1MiB", 1_048_576),
            ("1.5GiB", 1_610_612_736),
            ("2KiB", 2048),
            ("3kB", 3000),
            ("3KB", 3000),
            ("1TB", 1_000_000_000_000),
            ("12345", 12345),
            ("12345B", 12345),
            ("0", 0),
            ("none", 0),
            ("2.5Gbit", 312_500_000),
        ] {
            assert_eq!(parse_bandwidth(s), Ok(want), "{s}");
        }
        for bad in ["", "MB", "10Mb", "10mB", "10 MBit/x", "1.2.3MB", ".5MB", "5.MB", "-1MB", "10Xbit", "10bps"] {
            assert!(matches!(parse_bandwidth(bad), Err(UnitError::Bandwidth(_))), "{bad}");
        }
        assert!(matches!(parse_bandwidth("99999999999TB"), Err(UnitError::TooLarge(_))));
    }

    #[test]
    fn rates() {
        for (s, want) in
            [("2M", 2_000_000), ("100k", 100_000), ("100K", 100_000), ("1G", 1_000_000_000), ("1.5M", 1_500_000), ("7", 7), ("none", 0)]
        {
            assert_eq!(parse_rate(s), Ok(want), "{s}");
        }
        for bad in ["", "M", "2m", "2Mi", "x", "-5"] {
            assert!(parse_rate(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn listings() {
        assert_eq!(format_bandwidth(0), "-");
        assert_eq!(format_bandwidth(200_000_000), "200MB/s");
        assert_eq!(format_bandwidth(1_250_000_000), "1.2GB/s");
        assert_eq!(format_rate(2_000_000), "2M/s");
        assert_eq!(format_rate(999), "999/s");
    }
}
