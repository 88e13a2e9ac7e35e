//! Large READs' responses on a connection QPs share, sent by a thread of their own as the
//! scheduler lets them go.
//!
//! The reader of a peer daemon's connection executes every request of that host's QPs in
//! turn. Answering a READ of up to 2 GiB itself, it sent every part before it read the next
//! request, so one tenant's READ held every other tenant's requests to this host (seconds
//! on a 10 Gbit/s link), however the requester's scheduler shared the wire. A READ of more
//! than a segment is handed to the connection's answerer instead: it sends a segment of each
//! READ in turn, and the reader goes on. A QP's responses may then arrive out of PSN order
//! (an ACK of a later WRITE before a READ's data), which the requester allows: READs wait
//! for their own responses, ACKs are cumulative for SENDs and WRITEs only.
//!
//! The parts are this host's egress, so the answerer sends only those the doorbell thread's
//! scheduler granted the READ's QP (`qp::ReadGrants`): the responding vNIC's caps and fair
//! share hold for what peers read from it as for what it writes. A part stays on the wire's
//! account of its QP (`MedQp::wire_bytes`) until TCP has it acknowledged, as a WRITE's data
//! stays until the peer acknowledges it: the socket's buffer is no queue outside the
//! scheduler's bound.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use vrdma_abi::wire::{self, FrameHeader, Kind, Nak};

use super::{respond, send_read_part};
use crate::engine::connection::Conn;
use crate::engine::qp::{Grant, MedQp, ReadSender};
use crate::engine::{Engine, MappedMr};

/// Most READs waiting for the answerer.
const MAX_JOBS: usize = 1024;

/// How soon an answerer with parts TCP has not acknowledged looks again while it has
/// nothing to send, at first and at most (doubling while nothing was acknowledged: a peer
/// that stops reading costs a wakeup a millisecond, not a spin; the parts' QPs wait for
/// room on the wire meanwhile, so longer waits cost their streams).
const UNACKED_POLL: (Duration, Duration) = (Duration::from_micros(250), Duration::from_millis(1));

/// A READ's response being sent: `len` bytes of `mr` at `off`, from `at` on.
struct Job {
    q: Arc<MedQp>,
    h: FrameHeader,
    mr: Arc<MappedMr>,
    off: usize,
    len: usize,
    at: usize,
    /// The responder's resets when it was taken: a (re)connection of the QP since ends it.
    resets: u64,
    /// What the scheduler lets go of it.
    grant: Arc<Grant>,
}

impl Job {
    /// Its next part's length.
    fn part(&self) -> usize {
        (self.len - self.at).min(wire::SEGMENT as usize)
    }

    /// Whether the answerer has something to do with it: send its next part (granted), or
    /// drop it (its QP went).
    fn ready(&self) -> bool {
        self.grant.allows(self.part()) || self.grant.has_ended() || self.q.detached.load(Ordering::Acquire)
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // (Sent, ended or dropped with its connection: what was granted and not sent leaves
        // the wire's account.)
        self.grant.end(&self.q.wire_bytes);
    }
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    worker: bool,
    closed: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    work: Condvar,
}

impl ReadSender for Shared {
    fn wake(&self) {
        // (Under the lock: the answerer looks at the grants under it before it waits.)
        let _s = self.state.lock();
        self.work.notify_one();
    }
}

/// The answerer of one connection's large READs (see the module); owned by its reader,
/// and ended when that ends.
pub(crate) struct ReadAnswers {
    conn: Arc<Conn>,
    engine: Weak<Engine>,
    shared: Arc<Shared>,
}

impl ReadAnswers {
    pub(crate) fn new(conn: Arc<Conn>, engine: Weak<Engine>) -> ReadAnswers {
        ReadAnswers { conn, engine, shared: Arc::default() }
    }

    /// Takes READ `h` of `q` (executed: its PSN consumed), `len` bytes of `mr` at `off`, to
    /// answer from byte `at` on; false if it cannot (its thread did not start): the caller
    /// answers it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn take(&self, q: &Arc<MedQp>, h: &FrameHeader, mr: Arc<MappedMr>, off: usize, len: usize, at: usize, resets: u64) -> bool {
        let mut s = self.shared.state.lock();
        if s.jobs.len() >= MAX_JOBS {
            // (A peer that asks faster than the answerer sends: the reader answers this one
            // itself, and reads no more requests meanwhile.)
            return false;
        }
        if !s.worker {
            let (shared, conn, engine) = (self.shared.clone(), self.conn.clone(), self.engine.clone());
            let spawned = std::thread::Builder::new().name("engine-read-answers".into()).spawn(move || answer(&shared, &conn, &engine));
            if let Err(err) = spawned {
                log::warn!("engine: starting the READ answerer of {}: {err}", self.conn.peer);
                return false;
            }
            s.worker = true;
        }
        let sender: Arc<dyn ReadSender> = self.shared.clone();
        let grant = Grant::new(len - at, Arc::downgrade(&sender));
        q.reads.add(grant.clone());
        s.jobs.push_back(Job { q: q.clone(), h: *h, mr, off, len, at, resets, grant });
        drop(s);
        // The doorbell thread grants it its first parts.
        vrdma_abi::fd::signal_eventfd(&*q.doorbell);
        true
    }
}

impl Drop for ReadAnswers {
    fn drop(&mut self) {
        self.shared.state.lock().closed = true;
        self.shared.work.notify_all();
    }
}

/// Parts the answerer sent that TCP has not acknowledged yet: on their QPs' wire account.
struct Unacked<'a> {
    conn: &'a Conn,
    engine: &'a Weak<Engine>,
    /// Bytes the answerer wrote to the connection.
    written: u64,
    /// Each part: its QP, its bytes, and `written` after it.
    parts: VecDeque<(Arc<MedQp>, u64, u64)>,
    poll: Duration,
}

impl Unacked<'_> {
    fn sent(&mut self, q: &Arc<MedQp>, n: usize) {
        self.written += (wire::HEADER_LEN + n) as u64;
        self.parts.push_back((q.clone(), n as u64, self.written));
    }

    /// Takes off the wire's account the parts TCP has acknowledged: those written before
    /// what the socket still holds (`SIOCOUTQ`; it also holds other frames, so a part may
    /// be taken off later than it was acknowledged, never sooner). Then QPs waiting for
    /// room on the wire are served again.
    fn retire(&mut self) {
        if self.parts.is_empty() {
            return;
        }
        let mut queued: libc::c_int = 0;
        // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one int to the pointer, live for the call; a
        // closed socket only makes it fail.
        let r = unsafe { libc::ioctl(self.conn.raw_fd(), libc::TIOCOUTQ, &mut queued) };
        // (A socket that failed is done with: everything leaves the account.)
        let queued = if r < 0 { 0 } else { u64::try_from(queued).unwrap_or(0) };
        let acked = self.written.saturating_sub(queued);
        let mut retired = false;
        while let Some((q, n, _)) = self.parts.front().filter(|p| p.2 <= acked) {
            q.wire_bytes.fetch_sub(*n, Ordering::Relaxed);
            self.parts.pop_front();
            retired = true;
        }
        if retired {
            self.poll = UNACKED_POLL.0;
            if let Some(e) = self.engine.upgrade().filter(|e| e.qos_wire_waiting()) {
                e.kick();
            }
        } else {
            self.poll = (self.poll * 2).min(UNACKED_POLL.1);
        }
    }

    /// The connection is done with: nothing of it is on the wire any more.
    fn forget(&mut self) {
        for (q, n, _) in self.parts.drain(..) {
            q.wire_bytes.fetch_sub(n, Ordering::Relaxed);
        }
    }
}

/// The answerer's thread: a granted segment of each READ in turn, until its reader ends.
fn answer(shared: &Shared, conn: &Conn, engine: &Weak<Engine>) {
    let mut unacked = Unacked { conn, engine, written: 0, parts: VecDeque::new(), poll: UNACKED_POLL.0 };
    loop {
        let job = {
            let mut s = shared.state.lock();
            loop {
                if s.closed {
                    s.jobs.clear();
                    s.worker = false;
                    drop(s);
                    return unacked.forget();
                }
                if let Some(j) = s.jobs.iter().position(Job::ready).and_then(|at| s.jobs.remove(at)) {
                    break Some(j);
                }
                if unacked.parts.is_empty() {
                    shared.work.wait(&mut s);
                } else if shared.work.wait_for(&mut s, unacked.poll).timed_out() {
                    break None;
                }
            }
        };
        let Some(mut job) = job else {
            unacked.retire();
            continue;
        };
        if job.grant.has_ended() {
            continue;
        }
        // Under the QP's responder lock: a reset (a reconnection starts PSNs again) ends the
        // READ, and none of its parts follow; so does the QP's end. (A fatal error of a later
        // request does not: the READ was executed before it, as a NIC's response would have
        // gone before the NAK.)
        let rs = job.q.resp.lock();
        if rs.resets != job.resets || job.q.detached.load(std::sync::atomic::Ordering::Acquire) {
            continue;
        }
        let sent = match send_read_part(conn, &job.h, &job.q, &job.mr, job.off, job.len, job.at) {
            // A copied MR whose owner's memory did not answer (engine::mr::NotNow): not
            // ready, and the requester asks again (a duplicate READ, answered again).
            Ok(None) => respond(conn, &job.h, Kind::Ack, Nak::NotReady as u32, 0, 0).map(|()| None),
            r => r,
        };
        drop(rs);
        match sent {
            Ok(Some(n)) => {
                job.at += n;
                unacked.sent(&job.q, n);
                if job.grant.sent(n) {
                    vrdma_abi::fd::signal_eventfd(&*job.q.doorbell);
                }
                unacked.retire();
                if job.at < job.len {
                    shared.state.lock().jobs.push_back(job);
                }
            }
            Ok(None) => {}
            // The connection failed: its reader ends too.
            Err(_) => {
                unacked.forget();
                return end(shared);
            }
        }
    }
}

fn end(shared: &Shared) {
    let mut s = shared.state.lock();
    s.jobs.clear();
    s.worker = false;
}

/// Whether a READ of `len` bytes goes to the answerer (more than one segment).
pub(crate) fn is_large(len: u64) -> bool {
    len > u64::from(wire::SEGMENT)
}
