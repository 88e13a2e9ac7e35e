//! The control load of one vNIC's sessions, shared by their threads without the registry
//! lock: how many requests are being handled (at most `max_pending`, beyond: EAGAIN), and
//! how much CPU time vrdmad spent on them lately (at most `max_control_cpu_percent` of one
//! CPU; beyond, the vNIC's next requests wait, on their own session threads, until its share
//! is free again). So one vNIC's flood of requests costs the daemon a bounded share of a CPU,
//! whatever its rate.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use vrdma_abi::control::Limits;

/// The accounting window of the CPU share.
const WINDOW: Duration = Duration::from_millis(100);

#[derive(Debug, Default)]
struct Load {
    in_progress: AtomicU32,
    max_pending: AtomicU32,
    cpu_percent: AtomicU32,
    /// Start (µs after [`epoch`]) of the current window, and the CPU time (µs) spent in it.
    window_start_us: AtomicU64,
    used_us: AtomicU64,
}

/// A vNIC's control load, shared by its session threads.
#[derive(Clone, Debug, Default)]
pub struct PendingGauge(Arc<Load>);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_us() -> u64 {
    epoch().elapsed().as_micros() as u64
}

/// CPU time this thread has used (µs).
fn thread_cpu_us() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime into a valid timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as u64 * 1_000_000 + t.tv_nsec as u64 / 1000
}

impl PendingGauge {
    pub(super) fn new(limits: &Limits) -> PendingGauge {
        let g = PendingGauge::default();
        g.set_limits(limits);
        g
    }

    /// Takes the vNIC's (possibly changed) limits.
    pub(super) fn set_limits(&self, limits: &Limits) {
        self.0.max_pending.store(limits.max_pending, Ordering::Relaxed);
        self.0.cpu_percent.store(limits.max_control_cpu_percent, Ordering::Relaxed);
    }

    /// Starts a request, unless `max_pending` are in progress (`Err(max_pending)`). Waits
    /// first while the vNIC has used its CPU share of the current window.
    pub fn begin(&self) -> Result<PendingRequest, u32> {
        let l = &self.0;
        let limit = l.max_pending.load(Ordering::Relaxed);
        l.in_progress.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < limit).then_some(n + 1)).map_err(|_| limit)?;
        // (From here the slot is freed on every path, waiting included.)
        let mut request = PendingRequest { load: self.0.clone(), cpu_at_start: 0 };
        let window = WINDOW.as_micros() as u64;
        loop {
            let now = now_us();
            let start = l.window_start_us.load(Ordering::Acquire);
            if now.saturating_sub(start) >= window {
                // A new window: this thread opens it (or another did just now).
                if l.window_start_us.compare_exchange(start, now, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    l.used_us.store(0, Ordering::Release);
                }
                continue;
            }
            let share = window * u64::from(l.cpu_percent.load(Ordering::Relaxed)) / 100;
            if l.used_us.load(Ordering::Acquire) < share.max(1) {
                break;
            }
            std::thread::sleep(Duration::from_micros(start + window - now));
        }
        request.cpu_at_start = thread_cpu_us();
        Ok(request)
    }
}

/// A request in progress: its CPU time is charged and its slot freed when dropped.
pub struct PendingRequest {
    load: Arc<Load>,
    cpu_at_start: u64,
}

impl Drop for PendingRequest {
    fn drop(&mut self) {
        if self.cpu_at_start > 0 {
            self.load.used_us.fetch_add(thread_cpu_us().saturating_sub(self.cpu_at_start), Ordering::AcqRel);
        }
        self.load.in_progress.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Requests beyond `max_pending` are refused; a vNIC that used its CPU share waits for
    /// the next window.
    #[test]
    fn bounds_requests_in_progress_and_their_cpu_share() {
        let g = PendingGauge::new(&Limits { max_pending: 2, max_control_cpu_percent: 10, ..Limits::default() });
        let (a, b) = (g.begin().unwrap(), g.begin().unwrap());
        assert_eq!(g.begin().err(), Some(2));
        drop((a, b));
        // Burn this window's share (10 ms of CPU in 100 ms) inside one request.
        let r = g.begin().unwrap();
        let t = thread_cpu_us();
        while thread_cpu_us() - t < 12_000 {
            std::hint::black_box(0u64);
        }
        drop(r);
        let started = Instant::now();
        drop(g.begin().unwrap());
        assert!(started.elapsed() > Duration::from_millis(1), "waited for the next window");
        assert!(started.elapsed() < WINDOW * 2);
    }
}
