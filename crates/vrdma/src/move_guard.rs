//! Write protection of pages while they move between private memory and memfds.
//!
//! A move ([`crate::mr::share_gap`], [`crate::unshare`]) copies pages and then maps the copy
//! over the same addresses. A store by another thread of this process between the copy and
//! the remap would land in the old pages and be lost (malloc's bookkeeping of a heap
//! neighbour sharing the page, for instance). So the pages are read-only for that window: a
//! thread storing into them takes a SIGSEGV, which [`on_fault`] turns into a wait for the
//! move's end, after which the store is executed again, on the new mapping.
//!
//! The handler is installed at a move when it is not the current one, and passes every other
//! fault to the handler it found there (so an application or runtime that installs its own
//! later is chained again at the next move). A store by the kernel into the pages during the
//! window (`read(2)` into a buffer being registered) fails with EFAULT instead of being lost.
//! One move is protected at a time; the handler reads only atomics and makes only
//! async-signal-safe system calls.

use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

/// One protected move at a time: the handler knows one range.
static ONE_MOVE: Mutex<()> = Mutex::new(());
/// The range of the current (or last) move.
static START: AtomicUsize = AtomicUsize::new(0);
static END: AtomicUsize = AtomicUsize::new(0);
/// Odd while a move is under way; faulting threads wait on it (a futex word).
static SEQ: AtomicU32 = AtomicU32::new(0);
/// When the last move ended (CLOCK_MONOTONIC, ns).
static LAST_END_NS: AtomicU64 = AtomicU64::new(0);
/// The thread doing the current move: a fault of its own must not wait for itself.
static MOVER_TID: AtomicI32 = AtomicI32::new(0);
/// The SIGSEGV disposition found when ours was installed.
static PREV_ACTION: AtomicUsize = AtomicUsize::new(libc::SIG_DFL);
static PREV_FLAGS: AtomicUsize = AtomicUsize::new(0);

/// How long after a move's end a fault in its range is still taken for one of its own (the
/// fault came during the move, its signal was handled after): the store is tried again.
const LATE_FAULT_NS: u64 = 10_000_000;

/// `si_code` of a fault on a page mapped without the right (asm-generic/siginfo.h).
const SEGV_ACCERR: libc::c_int = 2;

/// Runs `f`, which copies `[start, start+len)` and maps the copy over it, with those pages
/// read-only to every thread until `f` returns. If `f` fails the pages are made writable
/// again. If protection cannot be set up, `f` runs unprotected (as moves did before).
pub(crate) fn while_protected<T, E>(start: usize, len: usize, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    if !enabled() {
        return f();
    }
    let _one = ONE_MOVE.lock();
    if !install_handler() {
        return f();
    }
    START.store(start, Ordering::Relaxed);
    END.store(start + len, Ordering::Relaxed);
    MOVER_TID.store(gettid(), Ordering::Relaxed);
    // No asynchronous signal on the moving thread during the window: an application's
    // handler storing into the read-only pages would fault on the thread that must end the
    // move. (Synchronous faults cannot be blocked and are not asked to be.)
    // SAFETY: sigset_t is plain data filled by sigfillset/sigdelset; pthread_sigmask only
    // changes this thread's mask, restored below.
    let mut old_mask: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        for sync in [libc::SIGSEGV, libc::SIGBUS, libc::SIGFPE, libc::SIGILL, libc::SIGTRAP] {
            libc::sigdelset(&mut all, sync);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old_mask);
    }
    SEQ.fetch_add(1, Ordering::SeqCst); // odd: a move is under way
                                        // SAFETY: changes only the protection of pages the caller is about to move (mapped,
                                        // page-aligned); their content and mapping stay.
    let protected = unsafe { libc::mprotect(start as *mut libc::c_void, len, libc::PROT_READ) } == 0;
    let result = f();
    if protected && result.is_err() {
        // SAFETY: as above; the move did not happen, the pages are the application's again.
        unsafe { libc::mprotect(start as *mut libc::c_void, len, libc::PROT_READ | libc::PROT_WRITE) };
    }
    LAST_END_NS.store(now_ns(), Ordering::Relaxed);
    SEQ.fetch_add(1, Ordering::SeqCst); // even: over
    futex_wake_all(&SEQ);
    // SAFETY: restores the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old_mask, std::ptr::null_mut()) };
    result
}

/// Whether moves are write-protected: on unless `VRDMA_MOVE_GUARD=0`.
pub(crate) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    cfg!(test) || *ON.get_or_init(|| std::env::var("VRDMA_MOVE_GUARD").map_or(true, |v| v.trim() != "0"))
}

/// Makes [`on_fault`] the SIGSEGV handler if it is not; false if it cannot be.
fn install_handler() -> bool {
    // SAFETY: a zeroed sigaction is a valid value for sigaction(2) to fill in.
    let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: reads the current disposition into `current`.
    if unsafe { libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut current) } != 0 {
        return false;
    }
    let ours = on_fault as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) as libc::sighandler_t;
    if current.sa_sigaction == ours {
        return true;
    }
    PREV_FLAGS.store(current.sa_flags as usize, Ordering::SeqCst);
    PREV_ACTION.store(current.sa_sigaction, Ordering::SeqCst);
    // SAFETY: as above.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = ours;
    // SA_ONSTACK: a thread with an alternate signal stack (Rust threads have one) keeps its
    // stack-overflow reporting.
    sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
    // SAFETY: installs a handler that only reads atomics and makes async-signal-safe calls.
    unsafe {
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGSEGV, &sa, std::ptr::null_mut()) == 0
    }
}

/// The SIGSEGV handler: a store into pages being moved waits for the move to end and is then
/// executed again; anything else goes to the handler found before ours.
extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, uctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    let mut waited = false;
    while code == SEGV_ACCERR && START.load(Ordering::SeqCst) <= addr && addr < END.load(Ordering::SeqCst) {
        let seq = SEQ.load(Ordering::SeqCst);
        if seq & 1 == 0 {
            if waited || now_ns().saturating_sub(LAST_END_NS.load(Ordering::SeqCst)) < LATE_FAULT_NS {
                return; // the move is over: store again
            }
            break;
        }
        if MOVER_TID.load(Ordering::SeqCst) == gettid() {
            break; // the mover itself stored there: a bug, not a wait
        }
        futex_wait(&SEQ, seq);
        waited = true;
    }
    if waited {
        return;
    }
    chain(sig, info, uctx);
}

/// Hands the signal to the disposition found before ours.
fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, uctx: *mut libc::c_void) {
    let action = PREV_ACTION.load(Ordering::SeqCst);
    let flags = PREV_FLAGS.load(Ordering::SeqCst) as libc::c_int;
    // SAFETY: as in `on_fault`.
    let sent = unsafe { (*info).si_code } <= 0; // by kill(2) or sigqueue(3), not a fault
    if action == libc::SIG_IGN && sent {
        return;
    }
    if action == libc::SIG_DFL || action == libc::SIG_IGN {
        // SAFETY: restores the default action; a fault then repeats under it when this
        // handler returns, a sent signal is raised again (pending until we return).
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGSEGV, &dfl, std::ptr::null_mut());
            if sent {
                libc::raise(libc::SIGSEGV);
            }
        }
        return;
    }
    if flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the previous handler was installed with SA_SIGINFO, so it has this type.
        let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = unsafe { std::mem::transmute(action) };
        handler(sig, info, uctx);
    } else {
        // SAFETY: the previous handler was installed without SA_SIGINFO: a plain handler.
        let handler: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(action) };
        handler(sig);
    }
}

fn gettid() -> i32 {
    // SAFETY: gettid(2) has no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime(2) writes into `ts`; async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Sleeps while `word` holds `value` (1 ms at most: the caller looks again).
fn futex_wait(word: &AtomicU32, value: u32) {
    let timeout = libc::timespec { tv_sec: 0, tv_nsec: 1_000_000 };
    // SAFETY: FUTEX_WAIT on a live atomic of this process, with a valid timeout.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG, value, &timeout) };
}

fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a live atomic of this process.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, i32::MAX) };
}

#[cfg(test)]
mod tests;
