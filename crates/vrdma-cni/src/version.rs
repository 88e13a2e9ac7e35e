//! CNI spec versions: which we speak, and what each changes in our output.

use crate::error::CniError;

/// The versions VERSION reports. 0.3.x results have no CHECK; 1.1.0 adds STATUS and GC.
pub const SUPPORTED: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// The newest: what errors say when the request's version is unknown.
pub const LATEST: &str = "1.1.0";

/// A `major.minor.patch` version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u32, pub u32, pub u32);

impl Version {
    /// Parses `a.b.c` (each a decimal number).
    pub fn parse(s: &str) -> Option<Version> {
        let mut parts = s.split('.').map(|p| if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) { None } else { p.parse().ok() });
        let v = Version(parts.next()??, parts.next()??, parts.next()??);
        parts.next().is_none().then_some(v)
    }

    /// The version of a configuration, which must be one of [`SUPPORTED`]. A configuration
    /// without `cniVersion` is a 0.1.0 one (as libcni reads it), which we do not speak.
    pub fn of_config(v: Option<&str>) -> Result<Version, CniError> {
        let text = v.unwrap_or("0.1.0");
        let incompatible = |reason: &str| CniError::IncompatibleVersion { version: text.to_string(), reason: reason.to_string() };
        let parsed = Version::parse(text).ok_or_else(|| incompatible("not a version"))?;
        if !SUPPORTED.contains(&text) {
            return Err(incompatible(&format!("this plugin supports {}", SUPPORTED.join(", "))));
        }
        Ok(parsed)
    }

    /// Result `ips` entries carry `"version": "4"` (before 1.0.0).
    pub fn ips_carry_version(self) -> bool {
        self < Version(1, 0, 0)
    }

    /// CHECK exists (0.4.0 on).
    pub fn has_check(self) -> bool {
        self >= Version(0, 4, 0)
    }

    /// STATUS, GC and `socketPath` exist (1.1.0 on).
    pub fn has_status_and_gc(self) -> bool {
        self >= Version(1, 1, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_order() {
        assert_eq!(Version::parse("1.0.0"), Some(Version(1, 0, 0)));
        assert_eq!(Version::parse("1.0"), None);
        assert_eq!(Version::parse("1.0.0.0"), None);
        assert_eq!(Version::parse("1.x.0"), None);
        assert_eq!(Version::parse("-1.0.0"), None);
        assert!(Version(0, 4, 0) < Version(1, 0, 0));
    }

    #[test]
    fn configs_need_a_supported_version() {
        assert_eq!(Version::of_config(Some("1.1.0")).unwrap(), Version(1, 1, 0));
        assert_eq!(Version::of_config(Some("0.3.1")).unwrap(), Version(0, 3, 1));
        for bad in [None, Some("0.2.0"), Some("2.0.0"), Some("one")] {
            assert_eq!(Version::of_config(bad).unwrap_err().code(), 1, "{bad:?}");
        }
        assert!(!Version(0, 3, 1).has_check());
        assert!(Version(0, 3, 1).ips_carry_version() && !Version(1, 0, 0).ips_carry_version());
    }
}
