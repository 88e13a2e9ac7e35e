//! Real-time priorities of the engine's threads.

/// Gives the calling engine thread a low real-time priority, so that when a doorbell or a
/// frame wakes it, it preempts busy-polling applications at once instead of waiting for the
/// scheduler's next tick (milliseconds on a loaded host). The threads sleep whenever there
/// is no work, so they never hold a core; without the privilege this is skipped.
///
/// Threads that follow their work's CPU (`affinity`) share CPUs, and there readers
/// ([`reader_priority`]) rank above the doorbell thread ([`DOORBELL_PRIORITY`]): a frame
/// received while a doorbell thread sends on the reader's CPU (the softirq of a simulated
/// host's send runs in the sender's `sendmsg`) is delivered as soon as the softirq is done,
/// not after the doorbell thread's whole pass (docs/measurements.md has the figures). Unpinned, equal
/// priorities are better: a reader of higher priority woken on a CPU where the doorbell
/// thread runs preempts it there instead of running on the other CPU at once.
pub(crate) fn realtime_thread(priority: i32) {
    let p = libc::sched_param { sched_priority: priority };
    // SAFETY: changes the calling thread's scheduling policy; no memory is involved.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &p) } != 0 {
        log::debug!("engine: no real-time priority: {}", std::io::Error::last_os_error());
    }
}

/// Real-time priority of the doorbell thread.
pub(crate) const DOORBELL_PRIORITY: i32 = 1;

/// Real-time priority of connection readers (see [`realtime_thread`]).
pub(crate) fn reader_priority(follow_cpu: bool) -> i32 {
    if follow_cpu {
        DOORBELL_PRIORITY + 1
    } else {
        DOORBELL_PRIORITY
    }
}
