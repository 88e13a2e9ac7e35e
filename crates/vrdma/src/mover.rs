//! One long-lived thread per process that moves registered pages between private memory and
//! memfds ([`crate::mr`], [`crate::unshare`]).
//!
//! The pages being moved may hold the calling thread's own live stack frames (an MR on the
//! stack): the copy and the remap must run on another thread while the caller sleeps, so that
//! its stack does not change between them. One thread serves every call (instead of a thread
//! spawned per registration or deregistration); a forked child starts its own on first use.
//! Pages that cannot hold a stack move on the calling thread ([`run_off_stack`]).

use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{channel, sync_channel, Sender};

use parking_lot::Mutex;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// The mover thread's queue, and the process it was started in.
struct Mover {
    pid: u32,
    jobs: Sender<Job>,
}

static MOVER: Mutex<Option<Mover>> = Mutex::new(None);

/// Runs `f` on the mover thread and waits for it; `None` if it panicked or no thread could
/// run it.
pub(crate) fn run<R: Send>(f: impl FnOnce() -> R + Send) -> Option<R> {
    let (done, result) = sync_channel::<std::thread::Result<R>>(1);
    let job = move || {
        let r = std::panic::catch_unwind(AssertUnwindSafe(f));
        let _ = done.send(r);
    };
    let job: Box<dyn FnOnce() + Send + '_> = Box::new(job);
    // SAFETY: only the lifetime is changed. This function does not return before the job has
    // run to its end or been dropped unrun: `result.recv()` below returns only once the job
    // sent its result or its sender (owned by the job) was dropped. So whatever `f` borrows
    // outlives every use of it, as with a scoped thread.
    let job: Job = unsafe { std::mem::transmute::<Box<dyn FnOnce() + Send + '_>, Job>(job) };
    if let Err(unsent) = queue(job) {
        // No mover thread could start: run it on a thread of its own, waited for here.
        let job = unsent;
        std::thread::scope(|sc| {
            let _ = sc.spawn(job).join();
        });
    }
    match result.recv() {
        Ok(Ok(r)) => Some(r),
        _ => None,
    }
}

/// Runs `f` on the calling thread if the pages it moves cannot hold a thread's stack
/// (`on_a_stack` false: see [`crate::inplace::may_hold_a_stack`]), which saves the handoff's
/// two context switches; else on the mover thread, as [`run`]. `None` if it panicked.
pub(crate) fn run_off_stack<R: Send>(on_a_stack: bool, f: impl FnOnce() -> R + Send) -> Option<R> {
    if on_a_stack {
        return run(f);
    }
    std::panic::catch_unwind(AssertUnwindSafe(f)).ok()
}

/// Queues `job` for this process's mover thread (started now if there is none); gives the job
/// back if no thread could take it.
fn queue(job: Job) -> Result<(), Job> {
    let pid = std::process::id();
    let mut m = MOVER.lock();
    if m.as_ref().is_none_or(|m| m.pid != pid) {
        let (jobs, inbox) = channel::<Job>();
        let started = std::thread::Builder::new().name("vrdma-mover".into()).spawn(move || {
            while let Ok(job) = inbox.recv() {
                job();
            }
        });
        if started.is_err() {
            return Err(job);
        }
        *m = Some(Mover { pid, jobs });
    }
    let jobs = &m.as_ref().expect("set above").jobs;
    jobs.send(job).map_err(|e| e.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Jobs run on one other thread, borrow the caller's data, and a panic is reported as
    /// `None` without stopping the thread.
    #[test]
    fn jobs_run_on_one_other_thread() {
        let me = std::thread::current().id();
        let data = [1u8, 2, 3];
        let first = run(|| (std::thread::current().id(), data.iter().map(|x| u32::from(*x)).sum::<u32>())).unwrap();
        assert_ne!(first.0, me);
        assert_eq!(first.1, 6);
        assert!(run(|| panic!("on purpose")).is_none());
        let second = run(|| std::thread::current().id()).unwrap();
        assert_eq!(first.0, second, "the same thread serves every call");
    }
}
