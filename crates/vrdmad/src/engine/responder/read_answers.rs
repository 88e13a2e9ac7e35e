//! READs' responses on a connection QPs share, sent by a thread of their own as the
//! scheduler lets them go: every READ of more than a segment, and every READ of a vNIC with
//! a QoS policy (`ReadGrants::schedules`), whether it came on the connection or on a lane
//! whose answers take it.
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
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use vrdma_abi::wire::{self, FrameHeader, Kind, Nak};

use super::{respond, send_read_part};
use crate::engine::connection::Conn;
use crate::engine::qp::{Grant, MedQp, ReadSender};
use crate::engine::{Engine, MappedMr};

/// How soon an answerer with parts TCP has not acknowledged looks again while it has
/// nothing to send, at first and at most (doubling while nothing was acknowledged: a peer
/// that stops reading costs a wakeup a millisecond, not a spin; the parts' QPs wait for
/// room on the wire meanwhile, so longer waits cost their streams).
const UNACKED_POLL: (Duration, Duration) = (Duration::from_micros(250), Duration::from_millis(1));

/// How long the answerer waits for a READ's QP's responder lock before it serves other
/// READs, and how soon it looks at that READ again then.
const BUSY_QP_WAIT: Duration = Duration::from_micros(30);
const BUSY_QP_POLL: Duration = Duration::from_micros(200);

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
    /// Its QP's responder lock was held when its part was due (see [`answer`]): when to
    /// look again.
    busy_until: Option<Instant>,
}

impl Job {
    /// Its next part's length.
    fn part(&self) -> usize {
        (self.len - self.at).min(wire::SEGMENT as usize)
    }

    /// Whether the answerer has something to do with it: send its next part (granted), or
    /// drop it (its QP went).
    fn ready(&self, now: Instant) -> bool {
        self.busy_until.is_none_or(|t| now >= t)
            && (self.grant.allows(self.part()) || self.grant.has_ended() || self.q.detached.load(Ordering::Acquire))
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // (Sent, ended or dropped with its connection: what was granted and not sent leaves
        // the wire's account.)
        self.q.reads.end(&self.grant, &self.q.wire_bytes);
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

/// The answerer of one connection's READs (see the module): its reader's, shared with the
/// lanes whose answers take that connection, and closed when the reader ends
/// ([`ClosedOnDrop`]).
pub(crate) struct ReadAnswers {
    conn: Arc<Conn>,
    engine: Weak<Engine>,
    shared: Arc<Shared>,
}

impl ReadAnswers {
    pub(crate) fn new(conn: Arc<Conn>, engine: Weak<Engine>) -> ReadAnswers {
        ReadAnswers { conn, engine, shared: Arc::default() }
    }

    /// Its connection is done with: it takes no more READs, and its thread drops what it
    /// had and ends.
    pub(crate) fn close(&self) {
        self.shared.state.lock().closed = true;
        self.shared.work.notify_all();
    }

    /// Takes READ `h` of `q`, `len` bytes of `mr` at `off`, to answer from byte `at` on;
    /// false if it cannot: `q` has as many READs waiting as a requester may have
    /// outstanding (`qp::MAX_READS_PER_QP`), `q` went, the connection's reader ended
    /// ([`ReadAnswers::close`]), or the answerer's thread did not start. The caller answers
    /// it "not ready" then (never itself: a READ of up to 2 GiB sent by the reader would
    /// hold every QP's requests behind it, outside the scheduler).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn take(&self, q: &Arc<MedQp>, h: &FrameHeader, mr: Arc<MappedMr>, off: usize, len: usize, at: usize, resets: u64) -> bool {
        let mut s = self.shared.state.lock();
        if s.closed {
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
        let grant = Grant::new(h.psn, len - at, Arc::downgrade(&sender));
        if !q.reads.add(grant.clone()) {
            return false;
        }
        s.jobs.push_back(Job { q: q.clone(), h: *h, mr, off, len, at, resets, grant, busy_until: None });
        self.shared.work.notify_one();
        drop(s);
        // The doorbell thread grants it its first parts.
        vrdma_abi::fd::signal_eventfd(&*q.doorbell);
        true
    }
}

/// An answerer others share, closed when this handle goes (its connection's reader holds
/// it).
pub(crate) struct ClosedOnDrop(pub(crate) Arc<ReadAnswers>);

impl Drop for ClosedOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

impl Drop for ReadAnswers {
    fn drop(&mut self) {
        self.close();
    }
}

/// Parts the answerer sent that TCP has not acknowledged yet: on their QPs' wire account.
struct Unacked<'a> {
    conn: &'a Conn,
    engine: &'a Weak<Engine>,
    /// Each part: its QP, its bytes, and where it ends in the connection's byte stream.
    parts: VecDeque<(Arc<MedQp>, u64, u64)>,
    poll: Duration,
}

/// Bytes TCP had acknowledged of socket `fd`'s stream (`tcpi_bytes_acked`); None if it
/// cannot say (a failed socket, or a kernel before 4.1).
fn bytes_acked(fd: std::os::fd::RawFd) -> Option<u64> {
    // SAFETY: `tcp_info` is plain data, valid zeroed.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: TCP_INFO writes at most `len` bytes to `info`, live for the call.
    let r = unsafe { libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, (&raw mut info).cast(), &mut len) };
    let needed = std::mem::offset_of!(libc::tcp_info, tcpi_bytes_acked) + std::mem::size_of::<u64>();
    (r == 0 && len as usize >= needed).then_some(info.tcpi_bytes_acked)
}

/// Bytes socket `fd` holds that TCP has not had acknowledged (`SIOCOUTQ`); None if it
/// cannot say.
fn bytes_queued(fd: std::os::fd::RawFd) -> Option<u64> {
    let mut queued: libc::c_int = 0;
    // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one int to the pointer, live for the call.
    let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut queued) };
    (r == 0).then(|| u64::try_from(queued).unwrap_or(0))
}

impl Unacked<'_> {
    /// `n` bytes of `q`'s READ were just written: they end no later than every byte the
    /// socket took so far (acknowledged, or still held), other threads' frames included.
    fn sent(&mut self, q: &Arc<MedQp>, n: usize) {
        let fd = self.conn.raw_fd();
        // (What the socket holds first: bytes acknowledged between the two calls then make
        // the sum larger, never smaller, than where the part ends.)
        match bytes_queued(fd).zip(bytes_acked(fd)) {
            Some((queued, acked)) => self.parts.push_back((q.clone(), n as u64, acked + queued)),
            // (The socket cannot say: the part is taken as acknowledged.)
            None => {
                q.wire_bytes.fetch_sub(n as u64, Ordering::Relaxed);
            }
        }
    }

    /// Takes off the wire's account the parts TCP has acknowledged. Then QPs waiting for
    /// room on the wire are served again.
    fn retire(&mut self) {
        if self.parts.is_empty() {
            return;
        }
        let acked = bytes_acked(self.conn.raw_fd()).unwrap_or(u64::MAX);
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
    let mut unacked = Unacked { conn, engine, parts: VecDeque::new(), poll: UNACKED_POLL.0 };
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
                let now = Instant::now();
                if let Some(j) = s.jobs.iter().position(|j| j.ready(now)).and_then(|at| s.jobs.remove(at)) {
                    break Some(j);
                }
                // (A job whose look is due but that has no grant waits for its grant's wakeup.)
                let busy = s.jobs.iter().filter_map(|j| j.busy_until.filter(|t| *t > now)).min().map(|t| t - now);
                if unacked.parts.is_empty() && busy.is_none() {
                    shared.work.wait(&mut s);
                } else if shared.work.wait_for(&mut s, busy.map_or(unacked.poll, |b| b.min(unacked.poll))).timed_out() {
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
        // gone before the NAK.) Waited for only a moment (the connection's reader holds it
        // briefly for each request): a lane's server holds it while it reads a request's
        // data, at the pace the lane's client writes it (minutes for a large WRITE trickled
        // to its deadline), and this thread answers every QP of the connection; a job whose
        // QP stays busy waits for the next look, the others go on.
        let Some(rs) = job.q.resp.try_lock_for(BUSY_QP_WAIT) else {
            job.busy_until = Some(Instant::now() + BUSY_QP_POLL);
            shared.state.lock().jobs.push_back(job);
            continue;
        };
        job.busy_until = None;
        if rs.resets != job.resets || job.q.detached.load(std::sync::atomic::Ordering::Acquire) {
            continue;
        }
        let sent = match send_read_part(conn, &job.h, &job.q, &job.mr, job.off, job.len, job.at) {
            // A copied MR whose owner's memory did not answer (engine::mr::NotNow): not
            // ready, and the requester asks again (a duplicate READ, answered again).
            Ok(None) => respond(conn, &job.h, Kind::Ack, Nak::NotReady as u32, 0, 0).map(|()| None),
            r => r,
        };
        // (Before the responder's lock goes: once the last part is out, the requester may
        // complete the READ and send its next, which must find this one's slot free.)
        let ask_more = matches!(sent, Ok(Some(n)) if job.grant.sent(n));
        drop(rs);
        match sent {
            Ok(Some(n)) => {
                job.at += n;
                unacked.sent(&job.q, n);
                if ask_more {
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
