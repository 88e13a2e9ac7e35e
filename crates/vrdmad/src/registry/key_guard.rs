//! Remote keys a vNIC names that are not its peers' MRs: counted, logged once per interval,
//! and, past a rate, answered with EAGAIN for the rest of the interval (rkeys are random 32-bit
//! values; guessing one must cost time, as on a NIC where each wrong key costs a round trip
//! and breaks the QP).

use std::time::{Duration, Instant};

/// The interval over which bad keys are counted.
pub(super) const INTERVAL: Duration = Duration::from_secs(1);
/// Bad keys a vNIC may name per interval before its peer-MR requests are refused.
pub(super) const BAD_KEYS_PER_INTERVAL: u64 = 256;

/// One vNIC's bad-key rate.
#[derive(Debug, Default)]
pub(super) struct KeyGuard {
    /// Start of the current interval (`None`: no bad key yet).
    since: Option<Instant>,
    /// Bad keys within the current interval.
    bad: u64,
}

/// What the caller should log about a bad key just recorded.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum BadKeyNote {
    /// The first bad key of an interval.
    First,
    /// The bad key that started throttling.
    Throttling,
    /// Nothing (already said this interval).
    Quiet,
}

impl KeyGuard {
    /// `Err(milliseconds left)` while the vNIC is throttled at `now`.
    pub(super) fn admit(&mut self, now: Instant) -> Result<(), u64> {
        match self.since {
            Some(s) if now.duration_since(s) < INTERVAL && self.bad >= BAD_KEYS_PER_INTERVAL => {
                Err((INTERVAL - now.duration_since(s)).as_millis() as u64 + 1)
            }
            _ => Ok(()),
        }
    }

    /// Records a bad key at `now`.
    pub(super) fn record_bad(&mut self, now: Instant) -> BadKeyNote {
        if self.since.is_none_or(|s| now.duration_since(s) >= INTERVAL) {
            self.since = Some(now);
            self.bad = 0;
        }
        self.bad += 1;
        match self.bad {
            1 => BadKeyNote::First,
            n if n == BAD_KEYS_PER_INTERVAL => BadKeyNote::Throttling,
            _ => BadKeyNote::Quiet,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttles_past_the_rate_until_the_interval_ends() {
        let mut g = KeyGuard::default();
        let t0 = Instant::now();
        assert_eq!(g.record_bad(t0), BadKeyNote::First);
        for _ in 1..BAD_KEYS_PER_INTERVAL - 1 {
            assert_eq!(g.admit(t0), Ok(()));
            assert_eq!(g.record_bad(t0), BadKeyNote::Quiet);
        }
        assert_eq!(g.admit(t0), Ok(()));
        assert_eq!(g.record_bad(t0), BadKeyNote::Throttling);
        assert!(g.admit(t0 + INTERVAL / 2).is_err());
        assert_eq!(g.admit(t0 + INTERVAL), Ok(()));
        assert_eq!(g.record_bad(t0 + INTERVAL), BadKeyNote::First);
        assert_eq!(g.admit(t0 + INTERVAL), Ok(()));
    }
}
