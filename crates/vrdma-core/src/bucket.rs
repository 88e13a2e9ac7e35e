//! A token bucket over bytes and WRs, for the caps of a vNIC (`vrdma_abi::control::Qos`):
//! the library keeps one per directly connected QP, vrdmad's engine one per QP it took over
//! from a vNIC that exceeded its caps. Pure: the caller passes the clock (nanoseconds), so
//! tests run on a fake one.
//!
//! A WR goes when both buckets hold something (a level above zero), and is then charged in
//! full: a WR larger than the burst goes and leaves the bucket in debt, so every WR fits a
//! cap however small, and the long-run rate is the cap. The burst is [`BURST_NS`] of the
//! rate, so that vrdmad's check over a second (110% of the cap) never mistakes an obedient QP
//! for one that ignores it.

/// The burst a bucket holds: this many nanoseconds of its rate (50 ms). Large enough that a
/// poller late by a scheduler's time slice loses nothing of its rate; small enough that
/// over vrdmad's one-second check an obedient QP stays under 105% of its cap.
pub const BURST_NS: u64 = 50_000_000;

const NS_PER_S: u128 = 1_000_000_000;

/// One rate. Its level is `base` (as of the last refill, in units × 1e9, so refills are
/// exact) less what was charged since (`spent`, in units), so that a charge needs neither the
/// clock nor wide arithmetic: while `spent < budget` (the units `base` covers) the level is
/// above zero (see [`TokenBucket::try_charge`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rate {
    /// Units per second; 0: uncapped.
    per_s: u64,
    /// Level at the last refill, in units × 1e9.
    base: i128,
    /// Units charged since the last refill.
    spent: u64,
    /// Units `base` covers (rounded up; `u64::MAX` when uncapped).
    budget: u64,
}

impl Rate {
    fn new(per_s: u64) -> Rate {
        let mut r = Rate { per_s, base: Self::cap_of(per_s), spent: 0, budget: u64::MAX };
        r.set_budget();
        r
    }

    /// The most a bucket of `per_s` holds: its burst, at least one unit.
    fn cap_of(per_s: u64) -> i128 {
        (u128::from(per_s) * u128::from(BURST_NS)).max(NS_PER_S) as i128
    }

    fn set_budget(&mut self) {
        if self.per_s != 0 {
            self.budget = if self.base > 0 { u64::try_from((self.base as u128).div_ceil(NS_PER_S)).unwrap_or(u64::MAX) } else { 0 };
        }
    }

    /// Whether a WR may go (uncapped, or the level is above zero).
    #[inline]
    fn open(&self) -> bool {
        self.spent < self.budget
    }

    /// The level, in units × 1e9.
    fn level(&self) -> i128 {
        self.base - i128::from(self.spent) * NS_PER_S as i128
    }

    /// Adds `elapsed_ns` of the rate, as if every charge since the last refill came after the
    /// bucket filled up (`min(burst, base + rate·t) - spent`): never more than a bucket
    /// refilled continuously would hold.
    fn refill(&mut self, elapsed_ns: u64) {
        if self.per_s == 0 {
            return;
        }
        let add = i128::try_from(u128::from(self.per_s) * u128::from(elapsed_ns)).unwrap_or(i128::MAX);
        let spent = i128::from(self.spent) * NS_PER_S as i128;
        self.base = self.base.saturating_add(add).min(Self::cap_of(self.per_s)).saturating_sub(spent);
        self.spent = 0;
        self.set_budget();
    }

    /// Nanoseconds until the level is above zero (0: now).
    fn wait_ns(&self) -> u64 {
        if self.open() {
            return 0;
        }
        // Smallest t with level + per_s·t > 0.
        let need = (-self.level()) as u128 + 1;
        u64::try_from(need.div_ceil(u128::from(self.per_s))).unwrap_or(u64::MAX)
    }

    #[inline]
    fn charge(&mut self, units: u64) {
        self.spent = self.spent.saturating_add(units);
    }

    fn charge_back(&mut self, units: u64) {
        let from_spent = units.min(self.spent);
        self.spent -= from_spent;
        let rest = units - from_spent;
        if rest > 0 && self.per_s != 0 {
            // Folded into `base` by a refill since it was charged.
            self.base = self.base.saturating_add(i128::from(rest) * NS_PER_S as i128).min(Self::cap_of(self.per_s));
            self.set_budget();
        }
    }
}

/// Caps on bytes and WRs per second, and their levels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBucket {
    bytes: Rate,
    wrs: Rate,
    /// When the levels were last brought up to date (the caller's clock, ns).
    last_ns: u64,
}

impl TokenBucket {
    /// A full bucket for `max_bw` bytes/s and `max_rate` WRs/s (0: that one uncapped), at
    /// time `now_ns`; None when neither is capped (nothing to keep).
    pub fn new(max_bw: u64, max_rate: u64, now_ns: u64) -> Option<TokenBucket> {
        (max_bw != 0 || max_rate != 0).then(|| TokenBucket { bytes: Rate::new(max_bw), wrs: Rate::new(max_rate), last_ns: now_ns })
    }

    /// The caps (bytes/s, WRs/s).
    pub fn caps(&self) -> (u64, u64) {
        (self.bytes.per_s, self.wrs.per_s)
    }

    fn refill(&mut self, now_ns: u64) {
        let elapsed = now_ns.saturating_sub(self.last_ns);
        self.last_ns = self.last_ns.max(now_ns);
        self.bytes.refill(elapsed);
        self.wrs.refill(elapsed);
    }

    /// Nanoseconds until a WR may go (0: now), without charging anything.
    pub fn wait_ns(&mut self, now_ns: u64) -> u64 {
        self.refill(now_ns);
        self.bytes.wait_ns().max(self.wrs.wait_ns())
    }

    /// Charges a WR of `bytes` that went.
    pub fn charge(&mut self, bytes: u64) {
        self.bytes.charge(bytes);
        self.wrs.charge(1);
    }

    /// Gives back the charge of a WR of `bytes` that was taken but did not go (it is tried
    /// again, and charged then).
    pub fn refund(&mut self, bytes: u64) {
        self.bytes.charge_back(bytes);
        self.wrs.charge_back(1);
    }

    /// A WR of `bytes` charged without reading the clock, if both levels are above zero
    /// (the common case of a cap that does not bind); false: nothing charged, ask
    /// [`TokenBucket::take`] with the time.
    #[inline]
    pub fn try_charge(&mut self, bytes: u64) -> bool {
        if self.bytes.open() && self.wrs.open() {
            self.charge(bytes);
            return true;
        }
        false
    }

    /// A WR of `bytes` at `now_ns`: charged and `Ok` if it may go now, else how many
    /// nanoseconds until it may (nothing charged).
    pub fn take(&mut self, now_ns: u64, bytes: u64) -> Result<(), u64> {
        match self.wait_ns(now_ns) {
            0 => {
                self.charge(bytes);
                Ok(())
            }
            wait => Err(wait),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// Bytes a QP sending `wr` bytes per WR as fast as the bucket lets it moves in `ns`.
    fn drain(b: &mut TokenBucket, wr: u64, ns: u64) -> (u64, u64) {
        let (mut now, mut bytes, mut wrs) = (0u64, 0u64, 0u64);
        while now < ns {
            match b.take(now, wr) {
                Ok(()) => {
                    bytes += wr;
                    wrs += 1;
                }
                Err(w) => now += w,
            }
        }
        (bytes, wrs)
    }

    /// As `drain`, but charging without the clock whenever the bucket allows, as the library
    /// does.
    fn drain_lazily(b: &mut TokenBucket, wr: u64, ns: u64) -> u64 {
        let (mut now, mut bytes) = (0u64, 0u64);
        while now < ns {
            if b.try_charge(wr) {
                bytes += wr;
                continue;
            }
            match b.take(now, wr) {
                Ok(()) => bytes += wr,
                Err(w) => now += w,
            }
        }
        bytes
    }

    #[test]
    fn charging_without_the_clock_keeps_the_rate() {
        let cap = 200_000_000;
        let mut b = TokenBucket::new(cap, 0, 0).unwrap();
        let bytes = drain_lazily(&mut b, 65536, 1000 * MS);
        assert!(bytes >= cap - 65536 && bytes <= cap + cap / 20 + 65536, "{bytes}");
    }

    #[test]
    fn an_idle_bucket_charged_lazily_never_gives_more_than_its_burst() {
        let mut b = TokenBucket::new(1_000_000, 0, 0).unwrap();
        // Full (50 000 bytes) at 0; idle for an hour; then as much as it lets through at once.
        let mut sent = 0;
        while b.try_charge(1000) {
            sent += 1000;
        }
        let t = 3_600_000 * MS;
        while b.take(t, 1000).is_ok() {
            sent += 1000;
        }
        assert!(sent <= 50_000 + 1000, "{sent}");
    }

    #[test]
    fn uncapped_keeps_nothing() {
        assert!(TokenBucket::new(0, 0, 5).is_none());
    }

    #[test]
    fn byte_cap_holds_over_a_second_within_the_burst() {
        let cap = 200_000_000;
        let mut b = TokenBucket::new(cap, 0, 0).unwrap();
        let (bytes, _) = drain(&mut b, 65536, 1000 * MS);
        // The cap, plus at most the burst and one WR.
        assert!(bytes >= cap - 65536 && bytes <= cap + cap / 20 + 65536, "{bytes}");
    }

    #[test]
    fn message_rate_cap_holds() {
        let mut b = TokenBucket::new(0, 1000, 0).unwrap();
        let (_, wrs) = drain(&mut b, 8, 1000 * MS);
        assert!((1000..=1051).contains(&wrs), "{wrs}");
    }

    #[test]
    fn a_wr_larger_than_the_burst_goes_and_leaves_debt() {
        let mut b = TokenBucket::new(1000, 0, 0).unwrap();
        assert_eq!(b.take(0, 1_000_000), Ok(()));
        // 1e6 bytes at 1000 B/s: about 1000 s of debt (less what the burst held).
        let w = b.take(0, 1).unwrap_err();
        assert!(w > 999 * 1000 * MS && w <= 1000 * 1000 * MS, "{w}");
        assert_eq!(b.take(w, 1), Ok(()));
    }

    #[test]
    fn refill_stops_at_the_burst() {
        let mut b = TokenBucket::new(1_000_000, 0, 0).unwrap();
        // After an idle hour, only 50 ms of rate (50 000 bytes) goes at once.
        let mut sent = 0;
        let t = 3_600_000 * MS;
        while b.take(t, 1000).is_ok() {
            sent += 1000;
        }
        assert_eq!(sent, 50_000);
    }

    #[test]
    fn a_refund_gives_the_charge_back() {
        let mut b = TokenBucket::new(1000, 10, 0).unwrap();
        assert_eq!(b.take(0, 5000), Ok(()));
        assert!(b.take(0, 1).is_err());
        b.refund(5000);
        assert_eq!(b.take(0, 5000), Ok(()));
    }

    #[test]
    fn the_clock_going_back_adds_nothing() {
        let mut b = TokenBucket::new(0, 1, 10 * MS).unwrap();
        assert_eq!(b.take(10 * MS, 0), Ok(()));
        assert!(b.take(5 * MS, 0).is_err());
        assert!(b.take(10 * MS, 0).is_err());
    }
}
