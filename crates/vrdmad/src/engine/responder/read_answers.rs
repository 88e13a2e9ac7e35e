//! Large READs' responses on a connection QPs share, sent by a thread of their own.
//!
//! The reader of a peer daemon's connection executes every request of that host's QPs in
//! turn. Answering a READ of up to 2 GiB itself, it sent every part before it read the next
//! request, so one tenant's READ held every other tenant's requests to this host (seconds
//! on a 10 Gbit/s link), however the requester's scheduler shared the wire. A READ of more
//! than a segment is handed to the connection's answerer instead: it sends a segment of each
//! READ waiting in turn, and the reader goes on. A QP's responses may then arrive out of PSN
//! order (an ACK of a later WRITE before a READ's data), which the requester allows: READs
//! wait for their own responses, ACKs are cumulative for SENDs and WRITEs only.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use vrdma_abi::wire::{self, FrameHeader, Kind, Nak};

use super::{respond, send_read_part};
use crate::engine::connection::Conn;
use crate::engine::qp::MedQp;
use crate::engine::MappedMr;

/// Most READs waiting for the answerer.
const MAX_JOBS: usize = 1024;

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

/// The answerer of one connection's large READs (see the module); owned by its reader,
/// and ended when that ends.
pub(crate) struct ReadAnswers {
    conn: Arc<Conn>,
    shared: Arc<Shared>,
}

impl ReadAnswers {
    pub(crate) fn new(conn: Arc<Conn>) -> ReadAnswers {
        ReadAnswers { conn, shared: Arc::default() }
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
            let (shared, conn) = (self.shared.clone(), self.conn.clone());
            let spawned = std::thread::Builder::new().name("engine-read-answers".into()).spawn(move || answer(&shared, &conn));
            if let Err(err) = spawned {
                log::warn!("engine: starting the READ answerer of {}: {err}", self.conn.peer);
                return false;
            }
            s.worker = true;
        }
        s.jobs.push_back(Job { q: q.clone(), h: *h, mr, off, len, at, resets });
        self.shared.work.notify_one();
        true
    }
}

impl Drop for ReadAnswers {
    fn drop(&mut self) {
        self.shared.state.lock().closed = true;
        self.shared.work.notify_all();
    }
}

/// The answerer's thread: a segment of each READ in turn, until its reader ends.
fn answer(shared: &Shared, conn: &Conn) {
    loop {
        let mut job = {
            let mut s = shared.state.lock();
            loop {
                if s.closed {
                    s.jobs.clear();
                    s.worker = false;
                    return;
                }
                if let Some(j) = s.jobs.pop_front() {
                    break j;
                }
                shared.work.wait(&mut s);
            }
        };
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
                if job.at < job.len {
                    shared.state.lock().jobs.push_back(job);
                }
            }
            Ok(None) => {}
            // The connection failed: its reader ends too.
            Err(_) => return end(shared),
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
