//! The control load of one vNIC's sessions, shared by their threads without the registry
//! lock: how many requests are being handled (at most `max_pending`, beyond: EAGAIN), and
//! how much CPU time vrdmad spent on them lately (at most `max_control_cpu_percent` of one
//! CPU; beyond, the vNIC's requests wait, on their own session threads and holding their
//! pending slots, until its share is free again). So one vNIC's flood of requests costs the daemon a bounded share of a CPU,
//! whatever its rate. Copies for the vNIC's copied MRs (the copying fallback's data path)
//! have a share of their own (`max_copy_cpu_percent`): data moved for memory that cannot be
//! shared is paced as data, not as control requests.
//!
//! A session thread serves one session only, so all of its CPU time is the vNIC's: reading
//! and decoding a request, refusing it, writing the reply. Charging only the handling left
//! the system calls around it free, and a flood of cheap requests spent most of a CPU on
//! them.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use vrdma_abi::control::Limits;

/// The accounting window of the CPU share.
const WINDOW: Duration = Duration::from_millis(100);

/// A CPU share: at most `percent` of one CPU per [`WINDOW`], what was used beyond it carried
/// into the next window.
#[derive(Debug, Default)]
struct Budget {
    percent: AtomicU32,
    /// Start (µs after [`epoch`]) of the current window, and the CPU time (µs) spent in it.
    window_start_us: AtomicU64,
    used_us: AtomicU64,
}

impl Budget {
    /// The CPU time (µs) a window grants.
    fn share_us(&self) -> u64 {
        WINDOW.as_micros() as u64 * u64::from(self.percent.load(Ordering::Relaxed)) / 100
    }

    /// Whether this window's share is used up (a new window may start first).
    fn used_up(&self) -> bool {
        self.used_us.load(Ordering::Acquire) >= self.share_us().max(1)
    }

    /// Waits while this window's share is used up.
    fn wait(&self) {
        let window = WINDOW.as_micros() as u64;
        loop {
            let now = now_us();
            let start = self.window_start_us.load(Ordering::Acquire);
            if now.saturating_sub(start) >= window {
                // A new window: this thread opens it (or another did just now). What was
                // used beyond the share is carried over, so a long request is paid for.
                if self.window_start_us.compare_exchange(start, now, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    let share = self.share_us();
                    let _ = self.used_us.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| Some(u.saturating_sub(share)));
                }
                continue;
            }
            if !self.used_up() {
                return;
            }
            std::thread::sleep(Duration::from_micros(start + window - now));
        }
    }
}

#[derive(Debug, Default)]
struct Load {
    in_progress: AtomicU32,
    max_pending: AtomicU32,
    /// Everything a session thread does but the copies below.
    control: Budget,
    /// Copies for copied MRs (`max_copy_cpu_percent`).
    copies: Budget,
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

thread_local! {
    /// This thread's CPU time (µs) when it was last charged to its vNIC.
    static CHARGED_UP_TO: Cell<Option<u64>> = const { Cell::new(None) };
}

/// CPU time this thread has used (µs).
fn thread_cpu_us() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime into a valid timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as u64 * 1_000_000 + t.tv_nsec as u64 / 1000
}

/// The calling thread's CPU time (µs) since its last charge (none at its first).
fn cpu_since_last_charge() -> u64 {
    let now_cpu = thread_cpu_us();
    CHARGED_UP_TO.with(|c| c.replace(Some(now_cpu))).map_or(0, |last| now_cpu.saturating_sub(last))
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
        self.0.control.percent.store(limits.max_control_cpu_percent, Ordering::Relaxed);
        self.0.copies.percent.store(limits.max_copy_cpu_percent, Ordering::Relaxed);
    }

    /// Charges the calling session thread's CPU time since its last charge to the vNIC,
    /// then waits while the vNIC has used its CPU share of the current window. Every
    /// message a session thread reads passes here: through [`Self::begin`], or directly
    /// when it is refused before (undecodable, or beyond `max_pending`).
    pub fn charge_and_wait(&self) {
        self.0.control.used_us.fetch_add(cpu_since_last_charge(), Ordering::AcqRel);
        self.0.control.wait();
    }

    /// Waits while the vNIC's copies used their CPU share of the current window (before a
    /// copy request is handled).
    pub fn wait_for_copy_share(&self) {
        self.0.copies.wait();
    }

    /// Charges the calling session thread's CPU time since its last charge (the copy request
    /// just handled) to the vNIC's copies rather than its control requests.
    pub fn charge_copy(&self) {
        self.0.copies.used_us.fetch_add(cpu_since_last_charge(), Ordering::AcqRel);
    }

    /// Starts a request, unless `max_pending` are in progress (`Err(max_pending)`), after
    /// waiting for the vNIC's CPU share; a waiting request holds its slot, so a throttled
    /// vNIC's surplus requests are refused rather than queued.
    pub fn begin(&self) -> Result<PendingRequest, u32> {
        let l = &self.0;
        let limit = l.max_pending.load(Ordering::Relaxed);
        if l.in_progress.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < limit).then_some(n + 1)).is_err() {
            self.charge_and_wait();
            return Err(limit);
        }
        let request = PendingRequest { load: self.0.clone() };
        self.charge_and_wait();
        Ok(request)
    }
}

/// A request in progress: its slot is freed when dropped.
pub struct PendingRequest {
    load: Arc<Load>,
}

impl Drop for PendingRequest {
    fn drop(&mut self) {
        self.load.in_progress.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Requests beyond `max_pending` are refused; a vNIC whose session thread used its CPU
    /// share, inside requests or between them, waits for the next window.
    #[test]
    fn bounds_requests_in_progress_and_their_cpu_share() {
        let g = PendingGauge::new(&Limits { max_pending: 2, max_control_cpu_percent: 10, ..Limits::default() });
        let (a, b) = (g.begin().unwrap(), g.begin().unwrap());
        assert_eq!(g.begin().err(), Some(2));
        drop((a, b));
        g.charge_and_wait();
        // Burn this window's share (10 ms of CPU in 100 ms) outside any request, as the
        // system calls that read and answer requests do. (The budgets are looked at, not
        // timed: on a loaded machine 12 ms of CPU may take longer than a window.)
        burn_cpu_ms(12);
        g.0.control.used_us.fetch_add(cpu_since_last_charge(), Ordering::AcqRel);
        assert!(g.0.control.used_up(), "the thread's CPU time is charged");
        let started = Instant::now();
        g.charge_and_wait();
        assert!(started.elapsed() < WINDOW * 2, "the next window comes");
        // What went beyond the share (2 ms or more) is carried over.
        assert!(g.0.control.used_us.load(Ordering::Acquire) >= 2_000);
    }

    fn burn_cpu_ms(ms: u64) {
        let t = thread_cpu_us();
        while thread_cpu_us() - t < ms * 1000 {
            std::hint::black_box(0u64);
        }
    }

    /// Copies are paced by their own share: a window's worth of copying leaves the control
    /// share whole, and a vNIC past its copy share waits before its next copy.
    #[test]
    fn copies_have_a_share_of_their_own() {
        let limits = Limits { max_control_cpu_percent: 10, max_copy_cpu_percent: 20, ..Limits::default() };
        let g = PendingGauge::new(&limits);
        g.charge_and_wait();
        g.wait_for_copy_share();
        burn_cpu_ms(15); // more than the control share (10 ms), less than the copies' (20 ms)
        g.charge_copy();
        assert!(!g.0.control.used_up(), "the control share is untouched");
        assert!(!g.0.copies.used_up(), "the copy share is not used up yet");
        burn_cpu_ms(10);
        g.charge_copy();
        assert!(g.0.copies.used_up(), "past the copy share");
        let started = Instant::now();
        g.wait_for_copy_share();
        assert!(started.elapsed() < WINDOW * 2, "the next window comes");
        assert!(!g.0.control.used_up(), "the control share is still untouched");
    }
}
