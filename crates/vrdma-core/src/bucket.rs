//! A token bucket over bytes and WRs, for the caps of a vNIC or tenant
//! (`vrdma_abi::control::Qos`), the one implementation both enforcers use: the library keeps
//! one per directly connected QP ([`TokenBucket::new`], [`BURST_NS`] deep), vrdmad's egress
//! scheduler one per vNIC and per tenant ([`TokenBucket::with_depth`], shallower). Pure: the
//! caller passes the clock (nanoseconds), so tests run on a fake one.
//!
//! A WR goes when both buckets hold something (a level above zero), and is then charged in
//! full: a WR larger than the burst goes and leaves the bucket in debt, so every WR fits a
//! cap however small, and the long-run rate is the cap. Over any window a bucket lets through
//! at most `rate × window + depth + one WR`.

/// The burst a library's bucket holds: this many nanoseconds of its rate (50 ms). Large
/// enough that a poller late by a scheduler's time slice loses nothing of its rate; small
/// enough that over vrdmad's one-second check an obedient QP stays under 105% of its cap.
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
    /// How much it holds: this many nanoseconds of its rate.
    depth_ns: u64,
    /// Level at the last refill, in units × 1e9.
    base: i128,
    /// Units charged since the last refill.
    spent: u64,
    /// Units `base` covers (rounded up; `u64::MAX` when uncapped).
    budget: u64,
}

impl Rate {
    fn new(per_s: u64, depth_ns: u64) -> Rate {
        let mut r = Rate { per_s, depth_ns, base: 0, spent: 0, budget: u64::MAX };
        r.base = r.cap();
        r.set_budget();
        r
    }

    /// The most it holds: its depth, at least one unit.
    fn cap(&self) -> i128 {
        (u128::from(self.per_s) * u128::from(self.depth_ns)).max(NS_PER_S) as i128
    }

    fn set_budget(&mut self) {
        self.budget = if self.per_s == 0 {
            u64::MAX
        } else if self.base > 0 {
            u64::try_from((self.base as u128).div_ceil(NS_PER_S)).unwrap_or(u64::MAX)
        } else {
            0
        };
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
    /// bucket filled up (`min(depth, base + rate·t) - spent`): never more than a bucket
    /// refilled continuously would hold.
    fn refill(&mut self, elapsed_ns: u64) {
        if self.per_s == 0 {
            return;
        }
        let add = i128::try_from(u128::from(self.per_s) * u128::from(elapsed_ns)).unwrap_or(i128::MAX);
        let spent = i128::from(self.spent) * NS_PER_S as i128;
        self.base = self.base.saturating_add(add).min(self.cap()).saturating_sub(spent);
        self.spent = 0;
        self.set_budget();
    }

    /// Folds what was charged into the level (the caller knows the charge came now, after
    /// a refill: later refills then add to what is left, exactly).
    fn settle(&mut self) {
        if self.per_s != 0 {
            self.base = self.level();
            self.spent = 0;
            self.set_budget();
        }
    }

    /// A new rate, keeping the level (capped to the new depth; a debt too); from uncapped:
    /// full. Call after a refill.
    fn set(&mut self, per_s: u64) {
        if per_s == self.per_s {
            return;
        }
        self.settle();
        let was_uncapped = self.per_s == 0;
        self.per_s = per_s;
        self.spent = 0;
        self.base = if was_uncapped { self.cap() } else { self.base.min(self.cap()) };
        self.set_budget();
    }

    /// Whole units available now (0 in debt; `u64::MAX` uncapped).
    fn available(&self) -> u64 {
        if self.per_s == 0 {
            return u64::MAX;
        }
        u64::try_from((self.level() / NS_PER_S as i128).max(0)).unwrap_or(u64::MAX)
    }

    /// Nanoseconds until the level is above zero (0: now).
    fn wait_ns(&self) -> u64 {
        if self.per_s == 0 || self.open() {
            return 0;
        }
        // Smallest t with level + per_s·t > 0.
        let need = (-self.level()) as u128 + 1;
        u64::try_from(need.div_ceil(u128::from(self.per_s))).unwrap_or(u64::MAX)
    }

    #[inline]
    fn charge(&mut self, units: u64) {
        // (Uncapped: `budget` is `u64::MAX`, which a saturated `spent` would reach.)
        self.spent = self.spent.saturating_add(units).min(u64::MAX - 1);
    }

    fn charge_back(&mut self, units: u64) {
        let from_spent = units.min(self.spent);
        self.spent -= from_spent;
        let rest = units - from_spent;
        if rest > 0 && self.per_s != 0 {
            // Folded into `base` by a refill since it was charged.
            self.base = self.base.saturating_add(i128::from(rest) * NS_PER_S as i128).min(self.cap());
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
    /// A full bucket for `max_bw` bytes/s and `max_rate` WRs/s (0: that one uncapped),
    /// [`BURST_NS`] deep, at time `now_ns`; None when neither is capped (nothing to keep).
    pub fn new(max_bw: u64, max_rate: u64, now_ns: u64) -> Option<TokenBucket> {
        (max_bw != 0 || max_rate != 0).then(|| TokenBucket::with_depth(max_bw, max_rate, BURST_NS, now_ns))
    }

    /// A full bucket `depth_ns` deep, kept even when uncapped (its caps may change:
    /// [`TokenBucket::set_caps`]).
    pub fn with_depth(max_bw: u64, max_rate: u64, depth_ns: u64, now_ns: u64) -> TokenBucket {
        TokenBucket { bytes: Rate::new(max_bw, depth_ns), wrs: Rate::new(max_rate, depth_ns), last_ns: now_ns }
    }

    /// The caps (bytes/s, WRs/s).
    pub fn caps(&self) -> (u64, u64) {
        (self.bytes.per_s, self.wrs.per_s)
    }

    /// Whether it limits anything.
    pub fn is_limited(&self) -> bool {
        self.bytes.per_s != 0 || self.wrs.per_s != 0
    }

    /// New caps from `now_ns` on: what was earned so far at the old rate is kept (capped to
    /// the new depth), a debt too; a rate that was uncapped starts full.
    pub fn set_caps(&mut self, max_bw: u64, max_rate: u64, now_ns: u64) {
        self.refill(now_ns);
        self.bytes.set(max_bw);
        self.wrs.set(max_rate);
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

    /// When (at the earliest) a WR may go: `now_ns` if it may now.
    pub fn ready_at(&mut self, now_ns: u64) -> u64 {
        now_ns.saturating_add(self.wait_ns(now_ns))
    }

    /// Whole (WRs, bytes) available at `now_ns` (0 in debt; `u64::MAX` uncapped).
    pub fn available(&mut self, now_ns: u64) -> (u64, u64) {
        self.refill(now_ns);
        (self.wrs.available(), self.bytes.available())
    }

    /// Charges a WR of `bytes` that went.
    pub fn charge(&mut self, bytes: u64) {
        self.bytes.charge(bytes);
        self.wrs.charge(1);
    }

    /// Charges `wrs` WRs of `bytes` in all that went at `now_ns` (refills up to then first,
    /// so that later refills add to exactly what is left).
    pub fn charge_at(&mut self, now_ns: u64, wrs: u64, bytes: u64) {
        self.refill(now_ns);
        self.bytes.charge(bytes);
        self.wrs.charge(wrs);
        self.bytes.settle();
        self.wrs.settle();
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

    // As vrdmad's scheduler uses it: 10 ms deep, charged after the fact at a known time.

    #[test]
    fn unlimited_never_limits() {
        let mut b = TokenBucket::with_depth(0, 0, 10 * MS, 0);
        assert!(!b.is_limited());
        b.charge_at(0, u64::MAX, u64::MAX);
        assert_eq!(b.available(5), (u64::MAX, u64::MAX));
        assert_eq!(b.ready_at(7), 7);
    }

    #[test]
    fn starts_full_and_refills_at_its_rate_up_to_its_depth() {
        // 1000 bytes/s, 10 ms deep: 10 bytes.
        let mut b = TokenBucket::with_depth(1000, 0, 10 * MS, 0);
        assert_eq!(b.available(0).1, 10);
        b.charge_at(0, 1, 10);
        assert_eq!(b.available(0).1, 0);
        assert!(b.ready_at(0) > 0);
        assert_eq!(b.available(3 * MS).1, 3);
        assert_eq!(b.available(1000 * MS).1, 10, "never more than its depth");
    }

    #[test]
    fn debt_is_paid_before_the_next_item_goes() {
        let mut b = TokenBucket::with_depth(0, 1000, 10 * MS, 0);
        b.charge_at(0, 30, 0); // 10 held, 20 owed
                               // 20 WRs at 1000/s: 20 ms, and a token more.
        let at = b.ready_at(0);
        assert!((20 * MS..=20 * MS + 1).contains(&at), "{at}");
        assert!(b.ready_at(at - 1) > at - 1);
        assert_eq!(b.ready_at(at), at);
    }

    /// Charged after each send at the time it went, a refill adds exactly the time since:
    /// nothing earned is lost while the bucket is below its depth.
    #[test]
    fn charges_at_a_known_time_lose_nothing() {
        let mut b = TokenBucket::with_depth(1_000_000, 0, 10 * MS, 0);
        b.charge_at(0, 1, 10_000); // 10 000 bytes held, all spent
        assert_eq!(b.available(5 * MS).1, 5_000);
        b.charge_at(5 * MS, 1, 1_000);
        assert_eq!(b.available(6 * MS).1, 5_000);
    }

    /// Over a second of sending as fast as the bucket allows, in any window what went is the
    /// rate times the window, plus at most the depth and one WR.
    #[test]
    fn a_greedy_sender_gets_the_rate() {
        let (rate, wr) = (200_000_000u64, 65_536u64);
        let mut b = TokenBucket::with_depth(rate, 0, 10 * MS, 0);
        let (mut now, mut sent) = (0u64, Vec::new());
        while now < 1_000 * MS {
            if b.ready_at(now) == now {
                b.charge_at(now, 1, wr);
                sent.push(now);
            } else {
                now = b.ready_at(now).max(now + MS / 10);
            }
        }
        let bytes = |from: u64, to: u64| sent.iter().filter(|t| (from..to).contains(*t)).count() as u64 * wr;
        let total = bytes(0, 1_000 * MS);
        assert!(total.abs_diff(rate) <= rate / 100 + 2 * wr, "{total}");
        for start in (0..900).step_by(50) {
            let w = bytes(start * MS, (start + 100) * MS);
            assert!(w <= rate / 10 + rate / 100 + wr, "window at {start} ms: {w}");
            assert!(w + 2 * wr >= rate / 10 - rate / 100, "window at {start} ms: {w}");
        }
    }

    #[test]
    fn new_caps_apply_from_now() {
        let mut b = TokenBucket::with_depth(1000, 0, 10 * MS, 0);
        b.charge_at(0, 1, 10);
        b.set_caps(2000, 0, 0);
        assert_eq!(b.available(5 * MS).1, 10);
        b.set_caps(0, 0, 5 * MS);
        assert_eq!(b.available(5 * MS).1, u64::MAX);
        b.set_caps(1000, 0, 6 * MS);
        assert_eq!(b.available(6 * MS).1, 10, "uncapped to capped: a full bucket");
    }
}
