//! Asynchronous events: what a NIC reports outside completions (`ibv_get_async_event`).
//!
//! An [`AsyncEvents`] is a queue of events and an eventfd in semaphore mode that is
//! readable while events wait, so applications can poll or epoll it (libibverbs'
//! `async_fd`). QPs created with one ([`crate::QpInitAttr::events`]) raise into it:
//!
//! - `QpLastWqeReached`: a QP attached to an SRQ entered ERR, so it takes no more receive
//!   WRs from the SRQ. Applications that share an SRQ between QPs (UCX's rc_verbs, MPI
//!   libraries) wait for it before destroying such a QP.
//! - `QpFatal`: a mediated QP entered ERR because vrdmad, whose engine carried it, went
//!   away (no completion can say so: its WRs flush).
//!
//! A context given one ([`crate::Context::watch_events`]) raises `DeviceFatal` into it when
//! vrdmad hangs up the vNIC's control socket.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::Error;

/// Events waiting beyond this many (an application that never reads them) are dropped.
const MAX_QUEUED: usize = 65536;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsyncEventKind {
    /// A QP attached to an SRQ entered ERR: it consumes no more of the SRQ's receive WRs.
    QpLastWqeReached,
    /// Fewer receives than the SRQ's armed limit are outstanding ([`crate::Srq::arm_limit`];
    /// `qpn` is the SRQ's handle). The limit is disarmed until armed again.
    SrqLimitReached,
    /// A QP entered ERR for a reason no completion reports (vrdmad, which ran its mediated
    /// engine, went away).
    QpFatal,
    /// vrdmad, which serves the vNIC, went away: no resource can be created or changed
    /// through this context any more (QPs on the direct path keep moving data). Close it
    /// and open the vNIC again once vrdmad is back.
    DeviceFatal,
}

/// One asynchronous event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AsyncEvent {
    /// What happened.
    pub kind: AsyncEventKind,
    /// The QP it happened to (0, which no QP has, for `DeviceFatal`; the SRQ's handle for
    /// `SrqLimitReached`).
    pub qpn: u32,
}

pub(crate) struct EventsInner {
    /// Semaphore eventfd: one count per event queued (and not since purged).
    fd: OwnedFd,
    queue: Mutex<VecDeque<AsyncEvent>>,
    /// Events dropped because `MAX_QUEUED` waited.
    dropped: AtomicU64,
}

/// A queue of asynchronous events with a pollable descriptor (see the module docs).
#[derive(Clone)]
pub struct AsyncEvents {
    pub(crate) inner: Arc<EventsInner>,
}

impl AsyncEvents {
    /// A new, empty queue.
    pub fn new() -> Result<AsyncEvents, Error> {
        // SAFETY: plain eventfd(2); the descriptor is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
        if fd < 0 {
            return Err(Error::Os { op: "create async event queue", source: std::io::Error::last_os_error() });
        }
        // SAFETY: fd is new and ours.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(AsyncEvents { inner: Arc::new(EventsInner { fd, queue: Mutex::new(VecDeque::new()), dropped: AtomicU64::new(0) }) })
    }

    /// The descriptor: readable while events wait. It blocks unless the application made it
    /// non-blocking (`O_NONBLOCK`), and [`AsyncEvents::next`] follows that choice.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.inner.fd.as_fd()
    }

    /// Takes the oldest event, waiting for one unless the descriptor is non-blocking (then
    /// `Error::Os` with `EAGAIN` when there is none). An interrupted wait is `EINTR`.
    pub fn next(&self) -> Result<AsyncEvent, Error> {
        loop {
            let mut v = 0u64;
            // SAFETY: reading 8 bytes into a live u64 from our eventfd.
            let n = unsafe { libc::read(self.inner.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
            if n < 0 {
                return Err(Error::Os { op: "get_async_event", source: std::io::Error::last_os_error() });
            }
            // One count taken. Its event may have been purged (its QP destroyed): then wait
            // for the next one, as there is no event to report.
            if let Some(e) = self.inner.queue.lock().pop_front() {
                return Ok(e);
            }
        }
    }

    /// Events waiting.
    pub fn pending(&self) -> usize {
        self.inner.queue.lock().len()
    }

    /// Events dropped because too many waited unread.
    pub fn dropped(&self) -> u64 {
        self.inner.dropped.load(Ordering::Relaxed)
    }

    /// Drops the waiting events of QP `qpn` (being destroyed: its number may be reused).
    /// An SRQ's events name its handle in the same field, from another number space: they
    /// stay.
    pub fn purge_qp(&self, qpn: u32) {
        self.inner.queue.lock().retain(|e| e.kind == AsyncEventKind::SrqLimitReached || e.qpn != qpn);
    }
}

impl EventsInner {
    /// Drops the waiting events of SRQ `handle` (being destroyed).
    pub(crate) fn purge_srq(&self, handle: u32) {
        self.queue.lock().retain(|e| e.kind != AsyncEventKind::SrqLimitReached || e.qpn != handle);
    }

    pub(crate) fn raise(&self, e: AsyncEvent) {
        let mut q = self.queue.lock();
        if q.len() >= MAX_QUEUED {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        q.push_back(e);
        drop(q);
        let one = 1u64;
        // SAFETY: writing a live u64 to our eventfd. It cannot overflow (at most MAX_QUEUED
        // counts beyond those read).
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nonblocking(e: &AsyncEvents) {
        let fd = e.fd().as_raw_fd();
        // SAFETY: fcntl on our live descriptor.
        unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK) };
    }

    fn readable(e: &AsyncEvents) -> bool {
        let mut p = libc::pollfd { fd: e.fd().as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one live pollfd, no wait.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    #[test]
    fn events_come_out_in_order_and_the_fd_is_readable_while_any_wait() {
        let e = AsyncEvents::new().unwrap();
        nonblocking(&e);
        assert!(!readable(&e));
        let ev = |qpn| AsyncEvent { kind: AsyncEventKind::QpLastWqeReached, qpn };
        e.inner.raise(ev(1));
        e.inner.raise(ev(2));
        e.inner.raise(ev(1));
        assert!(readable(&e));
        assert_eq!(e.next().unwrap(), ev(1));
        assert!(readable(&e), "one read takes one event");
        // QP 1 is destroyed: its waiting event is never reported.
        e.purge_qp(1);
        assert_eq!(e.next().unwrap(), ev(2));
        let err = e.next().unwrap_err();
        assert_eq!(err.errno(), libc::EAGAIN, "the purged event's count is skipped: {err}");
        assert!(!readable(&e));
        assert_eq!(e.pending(), 0);
    }

    #[test]
    fn destroying_a_qp_or_an_srq_drops_only_its_own_events() {
        let e = AsyncEvents::new().unwrap();
        nonblocking(&e);
        let qp = AsyncEvent { kind: AsyncEventKind::QpLastWqeReached, qpn: 5 };
        let srq = AsyncEvent { kind: AsyncEventKind::SrqLimitReached, qpn: 5 };
        for ev in [qp, srq, qp, srq] {
            e.inner.raise(ev);
        }
        // QP 5 and SRQ 5 are different objects (QPNs and handles are counted apart).
        e.purge_qp(5);
        assert_eq!(e.pending(), 2);
        e.inner.raise(qp);
        e.inner.purge_srq(5);
        assert_eq!(e.next().unwrap(), qp);
        assert_eq!(e.next().unwrap_err().errno(), libc::EAGAIN);
    }

    #[test]
    fn a_blocking_reader_wakes_when_an_event_comes() {
        let e = AsyncEvents::new().unwrap();
        let raiser = e.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            raiser.inner.raise(AsyncEvent { kind: AsyncEventKind::QpLastWqeReached, qpn: 7 });
        });
        assert_eq!(e.next().unwrap().qpn, 7);
        t.join().unwrap();
    }
}
