//! A token bucket on an explicit clock (nanoseconds), so it is tested without sleeping.
//!
//! Tokens may go negative: a WR is let through while the bucket holds any token and its
//! whole size is charged, so a cap never splits a WR and the debt is paid before the next one
//! goes. Over any window the bucket lets through at most `rate × window + depth + one WR`.

/// Nanoseconds per second: tokens are kept in units of 1/`NS` of an item, so a refill of
/// `rate` items per second over `dt` nanoseconds is exactly `rate × dt` units.
const NS: i128 = 1_000_000_000;

/// A token bucket of `rate` items per second (0: unlimited) holding at most `depth_ns` of
/// them (`rate × depth_ns / 1e9` items).
#[derive(Clone, Debug)]
pub(crate) struct TokenBucket {
    rate: u64,
    depth_ns: u64,
    /// Items × 1e9.
    tokens: i128,
    last_ns: u64,
}

impl TokenBucket {
    /// A full bucket at time `now_ns`.
    pub(crate) fn new(rate: u64, depth_ns: u64, now_ns: u64) -> TokenBucket {
        let mut b = TokenBucket { rate, depth_ns, tokens: 0, last_ns: now_ns };
        b.tokens = b.capacity();
        b
    }

    fn capacity(&self) -> i128 {
        i128::from(self.rate) * i128::from(self.depth_ns)
    }

    /// Whether it limits anything.
    pub(crate) fn is_limited(&self) -> bool {
        self.rate != 0
    }

    /// A new rate from `now_ns` on: what was earned so far at the old rate is kept (capped
    /// to the new depth), a debt too.
    pub(crate) fn set_rate(&mut self, rate: u64, now_ns: u64) {
        if rate == self.rate {
            return;
        }
        self.refill(now_ns);
        let was_unlimited = self.rate == 0;
        self.rate = rate;
        self.tokens = if was_unlimited { self.capacity() } else { self.tokens.min(self.capacity()) };
    }

    /// Adds what was earned since the last refill.
    pub(crate) fn refill(&mut self, now_ns: u64) {
        let dt = now_ns.saturating_sub(self.last_ns);
        self.last_ns = self.last_ns.max(now_ns);
        if self.rate == 0 {
            return;
        }
        self.tokens = (self.tokens + i128::from(self.rate) * i128::from(dt)).min(self.capacity());
    }

    /// Whole items available now (refilled first); `u64::MAX` when unlimited, 0 in debt.
    pub(crate) fn available(&mut self, now_ns: u64) -> u64 {
        self.refill(now_ns);
        if self.rate == 0 {
            return u64::MAX;
        }
        u64::try_from((self.tokens / NS).max(0)).unwrap_or(u64::MAX)
    }

    /// Whether anything may go now (any token left; unlimited: always).
    #[cfg(test)]
    pub(crate) fn may_send(&mut self, now_ns: u64) -> bool {
        self.refill(now_ns);
        self.rate == 0 || self.tokens > 0
    }

    /// Charges `n` items (sent).
    pub(crate) fn charge(&mut self, n: u64) {
        if self.rate != 0 {
            self.tokens -= i128::from(n) * NS;
        }
    }

    /// When (at the earliest) the bucket holds a token again; `now_ns` if it does now.
    pub(crate) fn ready_at(&mut self, now_ns: u64) -> u64 {
        self.refill(now_ns);
        if self.rate == 0 || self.tokens > 0 {
            return now_ns;
        }
        let missing = -self.tokens + 1;
        let rate = i128::from(self.rate);
        let dt = (missing + rate - 1) / rate;
        now_ns.saturating_add(u64::try_from(dt).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn unlimited_never_limits() {
        let mut b = TokenBucket::new(0, 10 * MS, 0);
        assert!(!b.is_limited());
        b.charge(u64::MAX);
        assert!(b.may_send(0));
        assert_eq!(b.available(5), u64::MAX);
        assert_eq!(b.ready_at(7), 7);
    }

    #[test]
    fn starts_full_and_refills_at_its_rate_up_to_its_depth() {
        // 1000 items/s, 10 ms deep: 10 items.
        let mut b = TokenBucket::new(1000, 10 * MS, 0);
        assert_eq!(b.available(0), 10);
        b.charge(10);
        assert_eq!(b.available(0), 0);
        assert!(!b.may_send(0));
        assert_eq!(b.available(3 * MS), 3);
        assert_eq!(b.available(1000 * MS), 10, "never more than its depth");
    }

    #[test]
    fn debt_is_paid_before_the_next_item_goes() {
        let mut b = TokenBucket::new(1000, 10 * MS, 0);
        b.charge(30); // 10 held, 20 owed
        assert!(!b.may_send(0));
        // 20 items at 1000/s: 20 ms, and a token more.
        let at = b.ready_at(0);
        assert!((20 * MS..=20 * MS + 1).contains(&at), "{at}");
        assert!(!b.may_send(at - 1));
        assert!(b.may_send(at));
    }

    /// Over a second of sending as fast as the bucket allows, in any window what went is the
    /// rate times the window, plus at most the depth and one WR.
    #[test]
    fn a_greedy_sender_gets_the_rate() {
        let (rate, wr) = (200_000_000u64, 65_536u64);
        let mut b = TokenBucket::new(rate, 10 * MS, 0);
        let (mut now, mut sent) = (0u64, Vec::new());
        while now < 1_000 * MS {
            if b.may_send(now) {
                b.charge(wr);
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
    fn a_new_rate_applies_from_now() {
        let mut b = TokenBucket::new(1000, 10 * MS, 0);
        b.charge(10);
        b.set_rate(2000, 0);
        assert_eq!(b.available(5 * MS), 10);
        b.set_rate(0, 5 * MS);
        assert_eq!(b.available(5 * MS), u64::MAX);
        b.set_rate(1000, 6 * MS);
        assert_eq!(b.available(6 * MS), 10, "uncapped to capped: a full bucket");
    }
}
