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

use std::mem::size_of;
use std::time::{Duration, Instant};

/// Moves are at least this far apart.
const MOVE_INTERVAL: Duration = Duration::from_millis(1);

/// Moves the calling thread to the CPU its wakeups come from (see the module docs).
pub(crate) struct CpuFollower {
    /// The thread's allowed CPUs when it started (None: disabled).
    allowed: Option<CpuSet>,
    /// A CPU a wakeup came from last time, not the one we ran on.
    pending: Option<usize>,
    last_move: Option<Instant>,
    /// How many times this thread moved.
    moves: u64,
}

impl CpuFollower {
    /// A follower for the calling thread (`enabled` false: one that never moves it).
    pub(crate) fn new(enabled: bool) -> CpuFollower {
        let allowed = if enabled { CpuSet::of_thread().filter(|s| s.count() > 1) } else { None };
        CpuFollower { allowed, pending: None, last_move: None, moves: 0 }
    }

    /// How many times the thread moved.
    #[cfg(test)]
    pub(crate) fn moves(&self) -> u64 {
        self.moves
    }

    /// A wakeup came from the CPU `cpu()` names (None: unknown). `cpu` is not called when
    /// the follower is disabled (a reader's lookup is a system call).
    pub(crate) fn woken_from(&mut self, cpu: impl FnOnce() -> Option<usize>) {
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
}
