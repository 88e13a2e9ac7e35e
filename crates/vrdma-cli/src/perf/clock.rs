//! The clock of the latency loops.

use std::time::{Duration, Instant};

/// Per-iteration timestamps cheap enough not to distort sub-microsecond latencies: the
/// CPU's time-stamp counter (as perftest's get_cycles), calibrated against the monotonic
/// clock; `Instant` elsewhere.
pub(crate) struct Clock {
    #[cfg(target_arch = "x86_64")]
    us_per_tick: f64,
}

impl Clock {
    pub(crate) fn new() -> Clock {
        #[cfg(target_arch = "x86_64")]
        {
            let (t0, c0) = (Instant::now(), Self::ticks());
            std::thread::sleep(Duration::from_millis(20));
            let (t1, c1) = (Instant::now(), Self::ticks());
            Clock { us_per_tick: (t1 - t0).as_secs_f64() * 1e6 / (c1.wrapping_sub(c0).max(1)) as f64 }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Clock {}
    }

    #[cfg(target_arch = "x86_64")]
    pub(crate) fn ticks() -> u64 {
        // SAFETY: RDTSC has no memory effects and exists on every x86_64 CPU.
        unsafe { core::arch::x86_64::_rdtsc() }
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub(crate) fn ticks() -> u64 {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }

    pub(crate) fn us(&self, ticks: u64) -> f64 {
        #[cfg(target_arch = "x86_64")]
        {
            ticks as f64 * self.us_per_tick
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            ticks as f64 / 1000.0
        }
    }
}
