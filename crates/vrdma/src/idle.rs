//! Polling that shares its CPU: when a run of empty polls gives the CPU away.
//!
//! Applications (UCX's progress loop, perftest, MPI's waits) spin on `ibv_poll_cq`. With the
//! peer on another core that is the fastest way to wait; with the peer on the *same* core
//! (containers with CPU quotas, ranks pinned together, more ranks than cores) every spin
//! burns time the peer needs to produce the completion, and the wait lasts until the
//! scheduler preempts the poller, a whole time slice (milliseconds) per message. So a CQ
//! counts its consecutive empty polls and, past [`YIELD_AFTER_EMPTY_POLLS`], each further
//! empty poll calls `sched_yield`: a runnable peer on this CPU gets to run at once, and with
//! nobody else runnable the call returns in well under a microsecond (the syscall).
//!
//! The count is a plain load and store (no read-modify-write: the fast path's cost is its
//! locked instructions), per CQ; polls from several threads make it approximate, which only
//! moves the moment of the first yield.

use std::sync::atomic::{AtomicU32, Ordering};

/// Consecutive empty polls of one CQ before each further empty poll yields the CPU.
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

/// The run of empty polls of one CQ.
pub(crate) struct EmptyPolls {
    run: AtomicU32,
    /// Empty polls in a row before they yield (`u32::MAX`: never).
    limit: u32,
}

impl EmptyPolls {
    /// A run that yields after `limit` empty polls in a row.
    pub(crate) fn new(limit: u32) -> EmptyPolls {
        EmptyPolls { run: AtomicU32::new(0), limit }
    }

    /// Records a poll that found `found` completions; yields the CPU when this one ends a
    /// long enough run of empty polls.
    #[inline(always)]
    pub(crate) fn record(&self, found: usize) {
        let run = self.run.load(Ordering::Relaxed);
        if found != 0 {
            if run != 0 {
                self.run.store(0, Ordering::Relaxed);
            }
            return;
        }
        if run >= self.limit {
            if self.limit != u32::MAX {
                give_cpu_away();
            }
        } else {
            self.run.store(run + 1, Ordering::Relaxed);
        }
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
            e.record(0);
        }
        assert_eq!(e.run(), 10);
        e.record(3);
        assert_eq!(e.run(), 0);
    }

    #[test]
    fn stays_in_yield_mode_until_a_completion() {
        let e = EmptyPolls::new(20);
        for _ in 0..120 {
            e.record(0);
        }
        // Saturated at the threshold: every further empty poll yields, none overflows.
        assert_eq!(e.run(), 20);
        e.record(1);
        assert_eq!(e.run(), 0);
    }

    #[test]
    fn never_saturates_without_yielding() {
        let e = EmptyPolls::new(u32::MAX);
        for _ in 0..1000 {
            e.record(0);
        }
        assert_eq!(e.run(), 1000);
    }
}
