//! Polling that shares its CPU: when a run of empty polls gives the CPU away.
//!
//! Applications (UCX's progress loop, perftest, MPI's waits) spin on `ibv_poll_cq`. With the
//! peer on another core that is the fastest way to wait; with the peer on the *same* core
//! (containers with CPU quotas, ranks pinned together, more ranks than cores) every spin
//! burns time the peer needs to produce the completion, and the wait lasts until the
//! scheduler preempts the poller, a whole time slice (milliseconds) per message. So a CQ
//! counts its consecutive empty polls and every [`YIELD_AFTER_EMPTY_POLLS`]-th of a run
//! calls `sched_yield`: a runnable peer on this CPU gets to run at once, and with
//! nobody else runnable the call returns in well under a microsecond (the syscall).
//!
//! The count is a plain load and store (no read-modify-write: the fast path's cost is its
//! locked instructions), per CQ; polls from several threads make it approximate, which only
//! moves the moment of the first yield.

use std::sync::atomic::{AtomicU32, Ordering};

/// Every this many consecutive empty polls of one CQ, a poll yields the CPU.
///
/// Competitive spinning: spin about as long as giving the CPU away and getting it back
/// costs, then give it away. On the development VM (release build) an 8-byte send
/// ping-pong with both processes on one CPU and a yield on every empty poll takes 0.73 µs
/// one way, a handoff and back, while an empty poll in a loop costs about 6 ns: hence 128
/// (1.5 µs one way on one CPU, against 3.6 µs with 512 and 8 ms without yielding). Between
/// two cores the same ping-pong waits a few dozen polls (0.24 µs one way), and its median
/// is the same with 64, 128, 512 or no yield at all. Figures and commands:
/// docs/measurements.md, "Sharing a CPU".
pub(crate) const YIELD_AFTER_EMPTY_POLLS: u32 = 128;

/// The environment variable that overrides [`YIELD_AFTER_EMPTY_POLLS`] for the CQs a process
/// creates afterwards: a number of empty polls, or `never` (pure spinning, as before).
pub(crate) const YIELD_AFTER_ENV: &str = "VRDMA_POLL_YIELD_AFTER";

/// The threshold for a new CQ: the environment's, else the default.
pub(crate) fn yield_after() -> u32 {
    match std::env::var(YIELD_AFTER_ENV) {
        Ok(v) if v == "never" => u32::MAX,
        Ok(v) => v.parse().unwrap_or(YIELD_AFTER_EMPTY_POLLS),
        Err(_) => YIELD_AFTER_EMPTY_POLLS,
    }
}

/// The run of empty polls of one CQ (since its last completion or yield).
pub(crate) struct EmptyPolls {
    run: AtomicU32,
    /// Empty polls in a row that end with a yield (`u32::MAX`: never).
    limit: u32,
}

impl EmptyPolls {
    /// A run that yields after `limit` empty polls in a row.
    pub(crate) fn new(limit: u32) -> EmptyPolls {
        EmptyPolls { run: AtomicU32::new(0), limit }
    }

    /// Records a poll that found `found` completions; every `limit`-th empty poll in a row
    /// yields the CPU (and says so). Once every `limit`, not on every poll past it: a
    /// program that polls between pieces of its own work pays at most one `sched_yield` per
    /// `limit` polls, while a spinning waiter on a shared CPU still hands it over within
    /// `limit` polls of each return.
    #[inline(always)]
    pub(crate) fn record(&self, found: usize) -> bool {
        let run = self.run.load(Ordering::Relaxed);
        if found != 0 {
            if run != 0 {
                self.run.store(0, Ordering::Relaxed);
            }
            return false;
        }
        let run = run.wrapping_add(1);
        if run >= self.limit && self.limit != u32::MAX {
            self.run.store(0, Ordering::Relaxed);
            give_cpu_away();
            return true;
        }
        self.run.store(run, Ordering::Relaxed);
        false
    }

    /// Consecutive empty polls so far (for tests).
    #[cfg(test)]
    pub(crate) fn run(&self) -> u32 {
        self.run.load(Ordering::Relaxed)
    }
}

/// Lets another runnable thread of this CPU run (`sched_yield`); returns at once when there
/// is none.
#[cold]
#[inline(never)]
pub(crate) fn give_cpu_away() {
    std::thread::yield_now();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_empty_polls_and_resets_on_a_completion() {
        let e = EmptyPolls::new(YIELD_AFTER_EMPTY_POLLS);
        for _ in 0..10 {
            assert!(!e.record(0));
        }
        assert_eq!(e.run(), 10);
        assert!(!e.record(3));
        assert_eq!(e.run(), 0);
    }

    #[test]
    fn every_limit_th_empty_poll_in_a_row_yields() {
        let e = EmptyPolls::new(20);
        let yielded: Vec<usize> = (1..=70).filter(|_| e.record(0)).collect();
        assert_eq!(yielded, vec![20, 40, 60]);
        assert_eq!(e.run(), 10);
        // A completion starts the count again.
        assert!(!e.record(1));
        assert!((1..20).all(|_| !e.record(0)));
        assert!(e.record(0));
    }

    #[test]
    fn a_limit_of_zero_or_one_yields_on_every_empty_poll() {
        for limit in [0, 1] {
            let e = EmptyPolls::new(limit);
            assert!((0..5).all(|_| e.record(0)));
        }
    }

    #[test]
    fn never_yields_with_the_limit_off() {
        let e = EmptyPolls::new(u32::MAX);
        assert!((0..1000).all(|_| !e.record(0)));
        assert_eq!(e.run(), 1000);
    }
}
