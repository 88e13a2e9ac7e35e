//! Engine threads run where their work comes from.
//!
//! A woken real-time thread runs on the CPU it last ran on, or, if a real-time thread of
//! its priority runs there, the scheduler pushes it to another CPU. Either way, when that
//! is not the CPU that woke it (the application that rang the doorbell, the CPU whose
//! softirq received the peer's frame), every wakeup is an inter-processor interrupt, which
//! in a VM is an exit to the hypervisor, and the thread runs beside the waker instead of in
//! its place. So a thread that keeps being woken from one other CPU pins itself there (the
//! kernel migrates it at once) and from then on wakes locally, after the work in hand on
//! that CPU rather than in parallel to it; it moves again when its wakeups move.
//!
//! Local wakeups cut a small message's latency between hosts (docs/measurements.md).
//! The thread stays pinned after the move: following without pinning (the allowed set given
//! back after the move) was slower than not following at all, because the scheduler pushed
//! each wakeup away from the thread of equal priority sending on that CPU, and the thread
//! migrated back, on nearly every wakeup.
//!
//! A thread moves only when two wakeups in a row came from the same other CPU, and at most
//! once a millisecond, so a thread serving wakers on several CPUs does not migrate back and
//! forth. It only ever pins itself to a CPU of the set it was allowed when it started.
//!
//! A reader that is busy most of the time (a bulk stream's receiver, reading and opening)
//! follows nobody: a wakeup's interrupt is nothing beside its work, and following would put
//! it on the CPU of the very thread that feeds it (the receive softirq runs in the sending
//! doorbell thread's own `send`), one priority above it, so the two would take turns on one
//! CPU while the other ran only the application's polling loop. Such a reader gives back the
//! CPUs it was allowed and lets the scheduler spread it; it follows again once a window of
//! [`DUTY_WINDOW`] finds it idle at least half the time. The doorbell thread, which every
//! vNIC's sends share, keeps following however busy it is ([`CpuFollower::always`]): unpinned
//! beside a bulk stream, it left other vNICs' small messages waiting behind it (Husky's large
//! WRITEs case, docs/measurements.md).

use std::mem::size_of;
use std::time::{Duration, Instant};

/// Moves are at least this far apart.
const MOVE_INTERVAL: Duration = Duration::from_millis(1);

/// The wall time over which a thread's share of its CPU is measured (see the module docs).
const DUTY_WINDOW: Duration = Duration::from_millis(2);

/// Moves the calling thread to the CPU its wakeups come from (see the module docs).
pub(crate) struct CpuFollower {
    /// The thread's allowed CPUs when it started (None: disabled).
    allowed: Option<CpuSet>,
    /// A CPU a wakeup came from last time, not the one we ran on.
    pending: Option<usize>,
    last_move: Option<Instant>,
    /// How many times this thread moved.
    moves: u64,
    /// Whether it is pinned to one CPU now.
    pinned: bool,
    /// The current duty window: when it began, and the thread's CPU time then.
    window: Option<(Instant, Duration)>,
    /// The last full window found the thread busy at least half the time: it follows nobody.
    busy: bool,
    /// Whether a busy thread stops following.
    spreads: bool,
}

impl CpuFollower {
    /// A follower for the calling thread (`enabled` false: one that never moves it).
    pub(crate) fn new(enabled: bool) -> CpuFollower {
        let allowed = if enabled { CpuSet::of_thread().filter(|s| s.count() > 1) } else { None };
        CpuFollower { allowed, pending: None, last_move: None, moves: 0, pinned: false, window: None, busy: false, spreads: true }
    }

    /// A follower that keeps following however busy its thread is (the doorbell thread).
    pub(crate) fn always(enabled: bool) -> CpuFollower {
        CpuFollower { spreads: false, ..CpuFollower::new(enabled) }
    }

    /// Whether the last full duty window found the thread busy (so it follows nobody).
    #[cfg(test)]
    pub(crate) fn busy(&self) -> bool {
        self.busy
    }

    /// Ends the duty window if it is over: a thread busy at least half of it stops following
    /// and is unpinned; one idle at least half of it follows again.
    fn measure_duty(&mut self) {
        let now = Instant::now();
        // (The thread's CPU time is a system call: asked once a window.)
        let wall = self.window.map(|(start, _)| now.saturating_duration_since(start));
        if wall.is_some_and(|w| w < DUTY_WINDOW) {
            return;
        }
        let Some(cpu) = thread_cpu_time() else { return };
        let (Some(wall), Some((_, cpu_then))) = (wall, self.window) else {
            self.window = Some((now, cpu));
            return;
        };
        self.busy = cpu.saturating_sub(cpu_then) * 2 >= wall;
        self.window = Some((now, cpu));
        if self.busy && self.pinned {
            if let Some(allowed) = &self.allowed {
                if allowed.apply() {
                    self.pinned = false;
                    self.pending = None;
                }
            }
        }
    }

    /// How many times the thread moved.
    #[cfg(test)]
    pub(crate) fn moves(&self) -> u64 {
        self.moves
    }

    /// A wakeup came from the CPU `cpu()` names (None: unknown). `cpu` is not called when
    /// the follower is disabled (a reader's lookup is a system call).
    pub(crate) fn woken_from(&mut self, cpu: impl FnOnce() -> Option<usize>) {
        if self.allowed.is_none() {
            return;
        }
        if self.spreads {
            self.measure_duty();
        }
        if self.busy {
            return;
        }
        let Some(allowed) = &self.allowed else { return };
        let Some(cpu) = cpu() else { return };
        if current_cpu() == Some(cpu) || !allowed.contains(cpu) {
            self.pending = None;
            return;
        }
        if self.pending != Some(cpu) {
            self.pending = Some(cpu);
            return;
        }
        if self.last_move.is_some_and(|t| t.elapsed() < MOVE_INTERVAL) {
            return;
        }
        self.pending = None;
        let mut only = CpuSet::empty();
        only.insert(cpu);
        if only.apply() {
            self.moves += 1;
            self.pinned = true;
            self.last_move = Some(Instant::now());
        }
    }
}

/// A CPU set as the affinity syscalls take it (the kernel's bitmap of `CPUS` bits).
#[derive(Clone, PartialEq, Eq, Debug)]
struct CpuSet([u64; CPUS / 64]);

const CPUS: usize = 1024;

impl CpuSet {
    fn empty() -> CpuSet {
        CpuSet([0; CPUS / 64])
    }
    fn of_thread() -> Option<CpuSet> {
        let mut s = CpuSet::empty();
        // SAFETY: the calling thread (0), and a buffer of the size given, live for the call.
        let r = unsafe { libc::sched_getaffinity(0, size_of::<CpuSet>(), (&mut s.0 as *mut [u64; CPUS / 64]).cast()) };
        (r == 0).then_some(s)
    }
    /// Makes this the calling thread's set (which migrates it if it runs elsewhere).
    fn apply(&self) -> bool {
        // SAFETY: the calling thread (0), and a buffer of the size given, live for the call.
        unsafe { libc::sched_setaffinity(0, size_of::<CpuSet>(), (&self.0 as *const [u64; CPUS / 64]).cast()) == 0 }
    }
    fn contains(&self, cpu: usize) -> bool {
        cpu < CPUS && self.0[cpu / 64] & (1 << (cpu % 64)) != 0
    }
    fn insert(&mut self, cpu: usize) {
        if cpu < CPUS {
            self.0[cpu / 64] |= 1 << (cpu % 64);
        }
    }
    fn count(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }
    #[cfg(test)]
    fn cpus(&self) -> Vec<usize> {
        (0..CPUS).filter(|&c| self.contains(c)).collect()
    }
}

/// The CPU the calling thread runs on.
pub(crate) fn current_cpu() -> Option<usize> {
    // SAFETY: no arguments; returns a CPU number or -1.
    let c = unsafe { libc::sched_getcpu() };
    usize::try_from(c).ok()
}

/// The CPU time the calling thread has used.
fn thread_cpu_time() -> Option<Duration> {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a timespec of ours, live for the call.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    (r == 0).then(|| Duration::new(t.tv_sec as u64, t.tv_nsec as u32))
}

/// The CPU whose network stack last received data for `fd` (`SO_INCOMING_CPU`).
pub(crate) fn incoming_cpu(fd: std::os::fd::BorrowedFd<'_>) -> Option<usize> {
    use std::os::fd::AsRawFd;
    let mut cpu: libc::c_int = -1;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a live fd, and an int-sized buffer with its length, both live for the call.
    let r = unsafe {
        libc::getsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_INCOMING_CPU, (&mut cpu as *mut libc::c_int).cast(), &mut len)
    };
    if r != 0 {
        return None;
    }
    usize::try_from(cpu).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed_cpus() -> Vec<usize> {
        CpuSet::of_thread().expect("sched_getaffinity").cpus()
    }

    #[test]
    fn follows_two_wakeups_from_the_same_cpu_within_the_allowed_set() {
        std::thread::spawn(|| {
            let cpus = allowed_cpus();
            if cpus.len() < 2 {
                vrdma_test_support::skip(
                    "follows_two_wakeups_from_the_same_cpu_within_the_allowed_set",
                    "one CPU allowed, nowhere to move",
                );
                return;
            }
            let here = current_cpu().expect("sched_getcpu");
            let there = *cpus.iter().find(|&&c| c != here).expect("another CPU");
            let mut f = CpuFollower::new(true);
            f.woken_from(|| Some(there));
            assert_eq!(f.moves(), 0, "one wakeup from elsewhere does not move");
            f.woken_from(|| Some(there));
            assert_eq!(f.moves(), 1);
            assert_eq!(current_cpu(), Some(there), "moved at once");
            assert_eq!(allowed_cpus(), vec![there], "and stays");
            // Back, within the set it started with (not just the one CPU it is pinned to),
            // but not within a millisecond of the last move.
            f.woken_from(|| Some(here));
            f.woken_from(|| Some(here));
            assert_eq!(f.moves(), 1, "too soon");
            std::thread::sleep(MOVE_INTERVAL);
            f.woken_from(|| Some(here));
            f.woken_from(|| Some(here));
            assert_eq!(f.moves(), 2);
            assert_eq!((current_cpu(), allowed_cpus()), (Some(here), vec![here]));
            // Alternating wakers never move it.
            std::thread::sleep(MOVE_INTERVAL);
            for _ in 0..10 {
                f.woken_from(|| Some(here));
                f.woken_from(|| Some(there));
            }
            assert_eq!(f.moves(), 2);
            // Disabled, unknown or disallowed CPUs: nothing.
            let mut d = CpuFollower::new(false);
            d.woken_from(|| Some(there));
            d.woken_from(|| Some(there));
            let mut u = CpuFollower::new(true);
            u.woken_from(|| None);
            u.woken_from(|| None);
            u.woken_from(|| Some(CPUS + 1));
            u.woken_from(|| Some(CPUS + 1));
            assert_eq!(d.moves() + u.moves(), 0);
            assert_eq!(allowed_cpus(), vec![here]);
        })
        .join()
        .expect("test thread");
    }

    /// Spins about three duty windows, telling `f` of wakeups from the CPU it runs on.
    fn spin_windows(f: &mut CpuFollower) {
        let t = Instant::now();
        while t.elapsed() < DUTY_WINDOW * 3 {
            let spin = Instant::now();
            while spin.elapsed() < Duration::from_micros(100) {
                std::hint::spin_loop();
            }
            f.woken_from(current_cpu);
        }
    }

    /// Runs `body(allowed CPUs, the CPU it starts on, another one)` on a thread of its own
    /// (it changes its affinity), unless only one CPU is allowed.
    fn on_two_cpus(test: &str, body: impl FnOnce(Vec<usize>, usize, usize) + Send + 'static) {
        let test = test.to_string();
        std::thread::spawn(move || {
            let cpus = allowed_cpus();
            if cpus.len() < 2 {
                vrdma_test_support::skip(&test, "one CPU allowed, nowhere to move");
                return;
            }
            let here = current_cpu().expect("sched_getcpu");
            let there = *cpus.iter().find(|&&c| c != here).expect("another CPU");
            body(cpus, here, there);
        })
        .join()
        .expect("test thread");
    }

    /// The doorbell thread's follower stays pinned however busy its thread is.
    #[test]
    fn an_always_follower_stays_pinned_when_busy() {
        on_two_cpus("an_always_follower_stays_pinned_when_busy", |_, _, there| {
            let mut f = CpuFollower::always(true);
            f.woken_from(|| Some(there));
            f.woken_from(|| Some(there));
            spin_windows(&mut f);
            assert!(!f.busy());
            assert_eq!((f.moves(), allowed_cpus()), (1, vec![there]));
        });
    }

    /// A thread busy most of a window stops following and gives back its CPUs (a bulk
    /// stream's reader must not stay on its sender's CPU); idle again, it follows again.
    #[test]
    fn a_busy_thread_is_unpinned_and_follows_again_when_idle() {
        on_two_cpus("a_busy_thread_is_unpinned_and_follows_again_when_idle", |cpus, here, there| {
            let mut f = CpuFollower::new(true);
            f.woken_from(|| Some(there));
            f.woken_from(|| Some(there));
            assert_eq!((f.moves(), allowed_cpus()), (1, vec![there]), "pinned by its wakeups");
            // Busy: wakeups keep coming while the thread works.
            let busy = |f: &mut CpuFollower| {
                let t = Instant::now();
                while !f.busy() && t.elapsed() < Duration::from_secs(5) {
                    let spin = Instant::now();
                    while spin.elapsed() < Duration::from_micros(100) {
                        std::hint::spin_loop();
                    }
                    f.woken_from(current_cpu);
                }
                assert!(f.busy(), "a thread spinning for {:?} was not found busy", t.elapsed());
            };
            busy(&mut f);
            assert_eq!(allowed_cpus(), cpus, "a busy thread gets back the CPUs it was allowed");
            // (A window may end between the two wakeups, and this thread, descheduled by other
            // tests, then be found idle: only a window that still finds it busy counts.)
            let mut checked = false;
            for _ in 0..100 {
                busy(&mut f);
                let moves = f.moves();
                f.woken_from(|| Some(here));
                f.woken_from(|| Some(here));
                if f.busy() {
                    assert_eq!(f.moves(), moves, "a busy thread follows nobody");
                    checked = true;
                    break;
                }
            }
            assert!(checked, "never busy through two wakeups");
            let moves = f.moves();
            // Idle for a few windows: it follows again.
            std::thread::sleep(DUTY_WINDOW * 3);
            f.woken_from(|| None);
            assert!(!f.busy(), "idle again");
            let other = *cpus.iter().find(|&&c| Some(c) != current_cpu()).expect("another CPU");
            f.woken_from(|| Some(other));
            f.woken_from(|| Some(other));
            assert_eq!((f.moves(), allowed_cpus()), (moves + 1, vec![other]), "following again");
        });
    }
}
