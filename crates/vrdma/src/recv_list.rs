//! The QPs whose inbound completions a CQ polls, and the check of them without a lock.
//!
//! Polling the QPs' inbound rings takes the list's lock: it makes the poller the rings' only
//! consumer and keeps the list (and the QPs' mappings) alive. That lock's exchange was most
//! of an empty poll's cost (70% of its samples; 8.7 ns a poll under the lock, 5.4 ns with
//! this check, docs/measurements.md), and applications spin on empty polls. So the CQ's polling thread first checks, without the lock, whether any
//! ring has something; only then does it take the lock.
//!
//! How the check reads the list safely: the writers (a QP attaching or detaching, rare)
//! publish an immutable snapshot of the list and free the previous one only once no check
//! can still be reading it. A check announces itself with plain stores to a flag (no
//! read-modify-write); a writer makes those stores visible with `membarrier(2)` (an
//! expedited barrier on every CPU running this process: it costs the writer a few
//! microseconds, the reader nothing), then waits for the flag to drop. One flag serves one
//! reader, so only one thread per CQ, the first that polls it (its *owner*), checks without
//! the lock; others poll under the lock as before. Without `membarrier` (old kernels,
//! seccomp), every poll takes the lock. Where the wait cannot be known to end (the barrier
//! fails later, or a check never ends: a fork while another thread was checking), the old
//! snapshot is never freed and the CQ's checks stop: a leak in a corner case, never a
//! use-after-free or a hang.
//!
//! No completion is lost: a completion published before the check reads its ring's slot is
//! seen (the slot's sequence word is read with Acquire, as the locked poll reads it), and
//! one published after it is seen by the next poll.

use std::sync::atomic::{compiler_fence, AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::qp::QpInner;
use crate::spin::{SpinGuard, SpinLock};

/// What a check reads: the list as it was when a writer published it.
struct Snapshot {
    qps: Vec<Arc<QpInner>>,
}

/// A CQ's receive QPs.
pub(crate) struct RecvQps {
    /// The list itself. Holding this lock is also what makes the poller the single consumer
    /// of the QPs' completion rings. (QPs remove themselves when destroyed, which breaks the
    /// QP→CQ→QP reference cycle.)
    list: SpinLock<Vec<Arc<QpInner>>>,
    count: AtomicUsize,
    /// The list for the owner's checks (never null).
    snapshot: AtomicPtr<Snapshot>,
    /// Set by the owner while it reads `snapshot`.
    checking: AtomicBool,
    /// The polling thread that checks without the lock (`pthread_self`), 0 until one polls;
    /// `NO_OWNER` when checks without the lock are off.
    owner: AtomicUsize,
    /// Whether checks without the lock were on at creation (`membarrier` registered): then
    /// a snapshot is freed only after [`RecvQps::quiesce`], even once they are off, since a
    /// check that began before may still be reading.
    lock_free: bool,
}

/// `owner` when the lock-free check is off for this CQ.
const NO_OWNER: usize = usize::MAX;

impl RecvQps {
    pub(crate) fn new() -> RecvQps {
        let snapshot = Box::into_raw(Box::new(Snapshot { qps: Vec::new() }));
        let lock_free = membarrier::available();
        RecvQps {
            lock_free,
            list: SpinLock::new(Vec::new()),
            count: AtomicUsize::new(0),
            snapshot: AtomicPtr::new(snapshot),
            checking: AtomicBool::new(false),
            owner: AtomicUsize::new(if lock_free { 0 } else { NO_OWNER }),
        }
    }

    /// Starts polling `qp`'s inbound completions.
    pub(crate) fn attach(&self, qp: Arc<QpInner>) {
        let mut list = self.list.lock();
        list.push(qp);
        self.count.store(list.len(), Ordering::Release);
        self.publish(list);
    }

    /// Stops polling `qp`'s inbound completions.
    pub(crate) fn detach(&self, qp: &Arc<QpInner>) {
        let mut list = self.list.lock();
        list.retain(|q| !Arc::ptr_eq(q, qp));
        self.count.store(list.len(), Ordering::Release);
        self.publish(list);
    }

    /// Replaces the checks' snapshot with the list as `list` holds it, then frees the old one
    /// once no check reads it.
    fn publish(&self, list: SpinGuard<'_, Vec<Arc<QpInner>>>) {
        let new = Box::into_raw(Box::new(Snapshot { qps: list.clone() }));
        let old = self.snapshot.swap(new, Ordering::AcqRel);
        drop(list);
        if self.lock_free && !self.quiesce() {
            // A check may still read the old snapshot: it is never freed (nor its QPs' mappings),
            // and this CQ's checks stop.
            self.owner.store(NO_OWNER, Ordering::Release);
            return;
        }
        // SAFETY: `old` came from Box::into_raw, is no longer published, and the barrier and
        // the flag above show that no check still reads it.
        drop(unsafe { Box::from_raw(old) });
    }

    /// Waits until no check can still read a snapshot that was replaced before this call;
    /// false if that cannot be known: no barrier (a kernel that refuses it now), or a check
    /// that does not end within a second (its flag was set when this process forked from one
    /// whose polling thread was in a check: that thread does not exist here). Never a hang.
    fn quiesce(&self) -> bool {
        if !membarrier::run() {
            return false;
        }
        let deadline = Instant::now() + Duration::from_secs(1);
        while self.checking.load(Ordering::Acquire) {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::yield_now();
        }
        true
    }

    /// Whether no QP is attached (a plain load).
    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.count.load(Ordering::Acquire) == 0
    }

    /// True only when none of the QPs has anything to poll (inbound completions, a pending
    /// error, receives to flush), checked without the lock; false when unsure (the caller
    /// is not the CQ's owner thread).
    #[inline(always)]
    pub(crate) fn surely_idle(&self) -> bool {
        let owner = self.owner.load(Ordering::Relaxed);
        // SAFETY: pthread_self has no preconditions.
        let me = unsafe { libc::pthread_self() } as usize;
        if owner != me && !self.claim(owner, me) {
            return false;
        }
        self.checking.store(true, Ordering::Relaxed);
        // Orders the flag before the snapshot's load for this thread; writers' membarrier
        // makes it so for theirs.
        compiler_fence(Ordering::SeqCst);
        let snap = self.snapshot.load(Ordering::Acquire);
        // SAFETY: a published snapshot is freed only after `checking` is seen false, past a
        // membarrier that made this thread's `checking = true` visible (module docs).
        let busy = unsafe { &*snap }.qps.iter().any(|q| q.inbound_pending());
        self.checking.store(false, Ordering::Release);
        !busy
    }

    /// The first thread to poll becomes the owner.
    #[cold]
    fn claim(&self, owner: usize, me: usize) -> bool {
        owner == 0 && self.owner.compare_exchange(0, me, Ordering::AcqRel, Ordering::Relaxed).is_ok()
    }

    /// How many QPs the checks see (tests).
    #[cfg(test)]
    pub(crate) fn snapshot_len(&self) -> usize {
        let _list = self.list.lock();
        // SAFETY: the list's lock keeps writers from publishing (and freeing) meanwhile.
        unsafe { &*self.snapshot.load(Ordering::Acquire) }.qps.len()
    }

    /// The list, locked: for polling its QPs' rings.
    #[inline(always)]
    pub(crate) fn lock(&self) -> SpinGuard<'_, Vec<Arc<QpInner>>> {
        self.list.lock()
    }
}

impl Drop for RecvQps {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no check runs; the snapshot came from Box::into_raw.
        drop(unsafe { Box::from_raw(*self.snapshot.get_mut()) });
    }
}

/// `membarrier(2)`'s expedited private barrier, registered once per process.
mod membarrier {
    use std::sync::atomic::{AtomicU32, Ordering};

    const CMD_PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
    const CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

    /// The process that registered (a forked child must register again).
    static REGISTERED_BY: AtomicU32 = AtomicU32::new(0);

    fn sys(cmd: libc::c_long) -> bool {
        // SAFETY: membarrier with a command and no flags touches no memory of ours.
        unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as libc::c_long, 0 as libc::c_long) == 0 }
    }

    /// Registers this process if it has not (idempotent in the kernel); false when the
    /// kernel refuses.
    pub(super) fn available() -> bool {
        let pid = std::process::id();
        if REGISTERED_BY.load(Ordering::Acquire) == pid {
            return true;
        }
        if !sys(CMD_REGISTER_PRIVATE_EXPEDITED) {
            return false;
        }
        REGISTERED_BY.store(pid, Ordering::Release);
        true
    }

    /// A full memory barrier on every CPU running a thread of this process.
    pub(super) fn run() -> bool {
        sys(CMD_PRIVATE_EXPEDITED)
    }
}

#[cfg(test)]
pub(crate) mod tests;
