//! Responses on our connections: completions, READ data scattered, atomics' results, RNR and
//! not-ready retries scheduled.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_abi::verbs::{WcStatus, WrOpcode};
use vrdma_abi::wire::{self, FrameHeader, Kind, Nak};
use vrdma_core::access::Need;
use vrdma_core::timers;

use super::completion::mark_acked;
use super::requester::ReqState;
use super::{sge_pieces, Fs, InFlight, MedQp};
use crate::engine::connection::Conn;
use crate::engine::mr::Stored;
use crate::engine::Engine;

/// A reader streaming a READ response into a QP (see [`MedQp::defer_while_receiving`]):
/// when it ends, however it ends, a pump the doorbell thread skipped meanwhile is requested.
struct Receiving<'a> {
    e: &'a Engine,
    q: &'a MedQp,
}

impl<'a> Receiving<'a> {
    fn start(e: &'a Engine, q: &'a MedQp) -> Receiving<'a> {
        q.receiving.store(true, Ordering::SeqCst);
        Receiving { e, q }
    }
}

impl Drop for Receiving<'_> {
    fn drop(&mut self) {
        self.q.receiving.store(false, Ordering::SeqCst);
        // SeqCst store, then swap (the doorbell thread: store, then load): either it saw
        // `receiving` clear, or we see its deferral here. (`retire_and_kick` may have taken
        // the deferral already, and kicked.)
        if self.q.pump_deferred.swap(false, Ordering::SeqCst) {
            self.q.wants_pump.store(true, Ordering::Release);
            self.e.kick();
        }
    }
}

/// A response on one of our connections: completes (or schedules the retry of) the request,
/// and (acknowledgements being cumulative) every SEND and WRITE before it.
pub(crate) fn handle_response(e: &Arc<Engine>, c: &Conn, h: &FrameHeader) -> std::io::Result<()> {
    let data = u64::from(h.data_len);
    let q = e.qps.read().get(&h.dst_qpn).cloned();
    let Some(q) = q.filter(|q| q.remote == c.peer && q.remote_qpn == h.src_qpn) else {
        return c.discard(data);
    };
    // A READ response is streamed into memory under the QP's lock, as long as it takes on a
    // slow link: marked before the lock is taken, so that a doorbell thread finding the lock
    // held always knows to skip the QP rather than wait (the reader kicks it when done).
    let _receiving = (h.kind == Kind::ReadResp).then(|| Receiving::start(e, &q));
    let mut guard = q.req.lock();
    let st = &mut *guard;
    q.adopt(e, st);
    // Every response but "not ready" and "gone" comes from the responder executing in order
    // at this PSN, so everything before it was executed.
    let in_order = !matches!(Nak::from_u32(h.status), Some(Nak::NotReady | Nak::Gone));
    let earlier_done = in_order && mark_acked(st, h.psn.wrapping_sub(1));
    let Some(i) = st.inflight.iter().position(|f| f.psn == h.psn && f.state == Fs::Sent) else {
        if earlier_done {
            q.retire_and_kick(e, guard);
        }
        return c.discard(data);
    };
    let mut consumed = false;
    let new_state = match Nak::from_u32(h.status) {
        None if h.status != 0 => Some(WcStatus::GeneralErr),
        None => match h.kind {
            Kind::ReadResp => {
                consumed = true;
                let r = scatter_read(e, &q, c, &mut st.inflight[i], h);
                // (The data is in: a pump may wait for the lock the little time left.)
                q.receiving.store(false, Ordering::SeqCst);
                match r? {
                    ReadPart::More => None,
                    ReadPart::Last(status) => Some(status),
                    // Our own memory did not answer (engine::mr::NotNow): the READ is asked
                    // again (the responder answers a duplicate READ), as after "not ready".
                    ReadPart::Again => retry_later(e, &q, st, i, None),
                }
            }
            Kind::AtomicResp => {
                st.inflight[i].atomic_owed = Some(h.arg1);
                let stored = q.store_atomic_result(e, &mut st.inflight[i]);
                if stored.is_none() {
                    st.atomics_owed = true;
                    q.wait_for_data(e, st);
                }
                stored
            }
            _ => Some(WcStatus::Success),
        },
        Some(Nak::Rnr) => retry_later(e, &q, st, i, Some(h.arg1 as u8)),
        Some(Nak::NotReady) => retry_later(e, &q, st, i, None),
        Some(Nak::RemoteAccess) => Some(WcStatus::RemAccessErr),
        Some(Nak::InvalidRequest) => Some(WcStatus::RemInvReqErr),
        Some(Nak::RemoteOperation) => Some(WcStatus::RemOpErr),
        Some(Nak::Gone) => {
            // The responder no longer has our peer: retries would go unanswered, and the
            // pump fails the WR when they are spent.
            q.peer_gone.store(true, Ordering::Release);
            q.want_send_side();
            q.pump_deferred.store(true, Ordering::SeqCst);
            None
        }
    };
    if !consumed {
        c.discard(data)?;
    }
    if let Some(s) = new_state {
        st.inflight[i].state = Fs::Done(s);
    }
    q.retire_and_kick(e, guard);
    Ok(())
}

/// A request answered RNR (`rnr`: the responder's timer code) or "not ready": sent again
/// from it after the wait, unless its retries are spent (its final status then).
fn retry_later(e: &Engine, q: &MedQp, st: &mut ReqState, i: usize, rnr: Option<u8>) -> Option<WcStatus> {
    let (rnr_retry, retry_cnt, timeout) = q.retry_attrs();
    let now = Instant::now();
    let f = &mut st.inflight[i];
    let psn = f.psn;
    let give_up = if rnr.is_some() {
        f.rnr_tries += 1;
        q.meter.rnr();
        rnr_retry != timers::RNR_RETRY_INFINITE && f.rnr_tries > u32::from(rnr_retry)
    } else {
        timers::retry_limit(timeout, retry_cnt).is_some_and(|l| now.duration_since(f.first_sent) > l)
    };
    if give_up {
        return Some(if rnr.is_some() { WcStatus::RnrRetryExcErr } else { WcStatus::RetryExcErr });
    }
    let wait = match rnr {
        Some(code) => timers::rnr_wait(code, f.rnr_tries),
        None => Duration::from_micros(200),
    };
    let at = now + wait;
    st.wait_until = Some(st.wait_until.map_or(at, |w| w.max(at)));
    // (A resend already due from an earlier PSN covers this one.)
    if st.resend_from.is_none_or(|r| psn.wrapping_sub(r) as i32 <= 0) {
        st.resend_from = Some(psn);
    }
    st.probe = None;
    // The responder dropped this request and drops every later one until the resend: none
    // of their data is on the wire any more. Counted there, WRs that wait out RNR timers
    // without end (a peer that posts no receive) would fill the host's bounded wire and hold
    // every other vNIC back. (Nor is any more of their segments sent: they go again from
    // their start; a READ's response comes again from its start.)
    // (An atomic whose result is in, waiting to be stored, is not sent again: it was done.)
    for f in st.inflight.iter_mut().filter(|f| f.state == Fs::Sent && f.psn.wrapping_sub(psn) as i32 >= 0 && f.atomic_owed.is_none()) {
        q.wire_bytes.fetch_sub(u64::from(std::mem::take(&mut f.on_wire)), Ordering::Relaxed);
        f.next_byte = None;
        if f.opcode == WrOpcode::RdmaRead {
            // Its response comes again from the start; parts of the answer under way (the
            // responder's answerer may still be sending them) are dropped meanwhile.
            (f.read_done, f.read_err, f.read_again, f.read_restarted) = (0, None, false, true);
        }
    }
    // The resend is the engine's: the client stops sending meanwhile.
    q.want_send_side();
    e.add_timer(at, q.qpn);
    None
}

/// Where a READ's response is after one of its parts.
enum ReadPart {
    /// More parts are to come.
    More,
    /// The last part is in: the READ's status.
    Last(WcStatus),
    /// The last part came, but not all of the response could be stored now.
    Again,
}

/// Reads a part of READ `f`'s response (`h`: `h.data_len` bytes at offset `h.arg2` of the
/// READ, more to follow if [`wire::F_MORE`]) into the WR's local scatter list. The WR's
/// status once its last part is in, `None` before. Parts come in order on one connection
/// (the responder sends them one after the other); one out of place, short or too long
/// fails the WR (REM_OP_ERR), and the rest of its parts find no WR waiting.
fn scatter_read(e: &Engine, q: &MedQp, c: &Conn, f: &mut InFlight, h: &FrameHeader) -> std::io::Result<ReadPart> {
    let len = u64::from(h.data_len);
    let more = h.flags & wire::F_MORE != 0;
    let end = u64::from(f.read_done) + len;
    if h.arg2 != u64::from(f.read_done) || end > u64::from(f.len) || (!more && end != u64::from(f.len)) {
        c.discard(len)?;
        if f.read_restarted && h.arg2 != u64::from(f.read_done) {
            // A part of an earlier answer to this READ, asked again since.
            return Ok(ReadPart::More);
        }
        return Ok(ReadPart::Last(WcStatus::RemOpErr));
    }
    // Past what earlier parts filled.
    let mut left = len;
    let who = q.as_requester(f.psn);
    for (addr, lkey, n) in sge_pieces(&f.wr.sges, u64::from(f.read_done), len) {
        match q.local_span(e, lkey, addr, n, Need::LocalWrite) {
            Ok((mr, off)) if f.read_err.is_none() && !f.read_again => match mr.receive(c, who, off, n as usize)? {
                Stored::Yes => {}
                Stored::Unstorable => f.read_err = Some(WcStatus::LocProtErr),
                Stored::NotNow => f.read_again = true,
            },
            Ok(_) => c.discard(n)?,
            Err(st) => {
                f.read_err.get_or_insert(st);
                c.discard(n)?;
            }
        }
        left -= n;
    }
    if left > 0 {
        c.discard(left)?;
    }
    f.read_done = end as u32;
    Ok(match (more, f.read_again) {
        (true, _) => ReadPart::More,
        (false, true) => ReadPart::Again,
        (false, false) => ReadPart::Last(f.read_err.unwrap_or(WcStatus::Success)),
    })
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::Duration;

    use vrdma_abi::ring::{Sge, SqEntry};
    use vrdma_abi::verbs::{access, send_flags, WcStatus, WrOpcode};
    use vrdma_abi::wire::{self, FrameHeader, Kind, Nak};

    use super::handle_response;
    use crate::engine::connection::PeerRx;
    use crate::engine::qos::Budget;
    use crate::engine::testing::{connection, engine, mediated_qp, read_frame};

    const KEY: u32 = 0x700;
    const ADDR: u64 = 0x10_0000;

    /// A READ's response in parts (`F_MORE`, each with its offset) lands whole in the WR's
    /// memory and completes it once, at its last part; a part out of place fails the WR.
    #[test]
    fn a_read_response_in_parts_lands_whole() {
        const LEN: usize = 600_000;
        let t = engine();
        let mr = t.broker.register_mr(KEY, ADDR, 1 << 20, access::LOCAL_WRITE);
        let (mut peer, c) = connection();
        let (q, _side) = mediated_qp(&t, 0x11, 0x22, &c);
        let read = |wr_id| read_wr(wr_id, ADDR, LEN, KEY);
        let data: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
        let part = |psn: u32, at: usize, len: usize, more: bool| {
            let mut h = FrameHeader::new(Kind::ReadResp);
            (h.dst_qpn, h.src_qpn, h.psn, h.arg2, h.data_len) = (0x11, 0x22, psn, at as u64, len as u32);
            if more {
                h.flags |= wire::F_MORE;
            }
            let mut b = h.encode().to_vec();
            b.extend_from_slice(&data[at..at + len]);
            b
        };
        let mut head = 0;
        assert!(q.sq.push(&read(1), &mut head).unwrap());
        q.pump(&t.e, &mut Budget::default());
        let (req, _) = read_frame(&mut peer);
        assert_eq!((req.kind, req.arg1), (Kind::ReadReq, LEN as u64));

        let seg = wire::SEGMENT as usize;
        let mut frames = Vec::new();
        let mut at = 0;
        while at < LEN {
            let n = (LEN - at).min(seg);
            frames.push(part(0, at, n, at + n < LEN));
            at += n;
        }
        let w = std::thread::spawn(move || {
            for f in frames {
                peer.write_all(&f).unwrap();
            }
            peer
        });
        for i in 0..LEN.div_ceil(seg) {
            let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
            handle_response(&t.e, &c, &h).unwrap();
            let ce = q.scomp.pop().unwrap();
            assert_eq!(ce.is_some(), i + 1 == LEN.div_ceil(seg), "completed at its last part only");
            if let Some(ce) = ce {
                assert_eq!((ce.wr_id, ce.status, ce.byte_len), (1, WcStatus::Success as u8, LEN as u32));
            }
        }
        assert!(mr.read(ADDR, LEN) == data, "every byte in place");
        let mut peer = w.join().unwrap();

        // A part out of place (its offset is not where the last one ended): REM_OP_ERR.
        assert!(q.sq.push(&read(2), &mut head).unwrap());
        q.pump(&t.e, &mut Budget::default());
        read_frame(&mut peer);
        peer.write_all(&part(1, 0, seg, true)).unwrap();
        let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
        handle_response(&t.e, &c, &h).unwrap();
        assert!(q.scomp.pop().unwrap().is_none());
        peer.write_all(&part(1, 2 * seg, LEN - 2 * seg, false)).unwrap();
        let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
        handle_response(&t.e, &c, &h).unwrap();
        let ce = q.scomp.pop().unwrap().expect("a completion");
        assert_eq!((ce.wr_id, ce.status), (2, WcStatus::RemOpErr as u8));
    }

    /// A signaled READ of `len` bytes of the peer's 0x4000 into `addr` (`lkey`).
    fn read_wr(wr_id: u64, addr: u64, len: usize, lkey: u32) -> SqEntry {
        SqEntry {
            wr_id,
            opcode: WrOpcode::RdmaRead as u32,
            send_flags: send_flags::SIGNALED,
            rkey: 9,
            remote_addr: 0x4000,
            sges: vec![Sge { addr, length: len as u32, lkey }],
            ..SqEntry::default()
        }
    }

    /// Whether bytes wait at `s` (left there).
    fn waiting(s: &std::net::TcpStream) -> bool {
        s.set_nonblocking(true).unwrap();
        let r = s.peek(&mut [0u8; 1]);
        s.set_nonblocking(false).unwrap();
        matches!(r, Ok(n) if n > 0)
    }

    /// A READ whose local buffer is a copied MR whose owner's memory does not answer (the
    /// test's stall) is taken off the connection's reader without waiting, and asked again
    /// once its response is in: the READ's second response lands and completes it, with
    /// its bytes, once. Before, the reader (which serves every QP of the host) waited in
    /// that memory.
    #[test]
    fn a_read_into_a_stalled_copied_mr_is_asked_again() {
        const COPIED: u32 = 0x701;
        const LEN: usize = 5000;
        let t = engine();
        let mr = t.broker.register_copied_mr(COPIED, 8192, access::LOCAL_WRITE);
        let (mut peer, c) = connection();
        let (q, _side) = mediated_qp(&t, 0x11, 0x22, &c);
        let read = read_wr(1, mr.addr, LEN, COPIED);
        let data: Vec<u8> = (0..LEN).map(|i| (i % 253) as u8).collect();
        let response = |h: &FrameHeader| {
            let mut r = FrameHeader::new(Kind::ReadResp);
            (r.dst_qpn, r.src_qpn, r.psn, r.data_len) = (0x11, 0x22, h.psn, LEN as u32);
            let mut b = r.encode().to_vec();
            b.extend_from_slice(&data);
            b
        };
        assert!(q.sq.push(&read, &mut 0).unwrap());
        q.pump(&t.e, &mut Budget::default());
        let (req, _) = read_frame(&mut peer);
        assert_eq!(req.kind, Kind::ReadReq);

        let stall = mr.mem.stall.write();
        peer.write_all(&response(&req)).unwrap();
        let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
        let (done, handled) = std::sync::mpsc::channel();
        let (e, c2, h2) = (t.e.clone(), c.clone(), h);
        std::thread::spawn(move || {
            handle_response(&e, &c2, &h2).unwrap();
            done.send(()).unwrap();
        });
        handled.recv_timeout(Duration::from_secs(3)).expect("the reader waited in the stalled memory");
        assert!(q.scomp.pop().unwrap().is_none(), "not complete");
        drop(stall);

        // Asked again (after the not-ready wait), answered again: complete, with its bytes.
        let started = std::time::Instant::now();
        let again = loop {
            std::thread::sleep(Duration::from_millis(1));
            q.pump(&t.e, &mut Budget::default());
            if waiting(&peer) {
                break read_frame(&mut peer).0;
            }
            assert!(started.elapsed() < Duration::from_secs(5), "never asked again");
        };
        assert_eq!((again.kind, again.psn, again.arg1), (Kind::ReadReq, req.psn, LEN as u64));
        peer.write_all(&response(&again)).unwrap();
        let started = std::time::Instant::now();
        let ce = loop {
            let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
            handle_response(&t.e, &c, &h).unwrap();
            if let Some(ce) = q.scomp.pop().unwrap() {
                break ce;
            }
            // (Its memory may still be slow to answer the first time: asked again.)
            assert!(started.elapsed() < Duration::from_secs(5), "never completed");
            let next = loop {
                std::thread::sleep(Duration::from_millis(1));
                q.pump(&t.e, &mut Budget::default());
                if waiting(&peer) {
                    break read_frame(&mut peer).0;
                }
            };
            peer.write_all(&response(&next)).unwrap();
        };
        assert_eq!((ce.wr_id, ce.status), (1, WcStatus::Success as u8));
        assert!(mr.bytes()[..LEN] == data[..], "the READ's bytes");
        assert!(q.scomp.pop().unwrap().is_none(), "completed once");
    }

    /// A READ asked again (answered "not ready" after some of its parts, as the responder's
    /// answerer does when its memory does not answer) drops the parts of the earlier answer
    /// still on the way, rather than fail, and completes with the new answer's bytes; the
    /// responder's stream of accesses changes at a reset, so a result kept for a request of
    /// before is never taken by one of after.
    #[test]
    fn a_read_asked_again_drops_the_earlier_answers_parts() {
        const LEN: usize = 600_000;
        let t = engine();
        let mr = t.broker.register_mr(KEY, ADDR, 1 << 20, access::LOCAL_WRITE);
        let (mut peer, c) = connection();
        let (q, _side) = mediated_qp(&t, 0x11, 0x22, &c);
        let read = read_wr(1, ADDR, LEN, KEY);
        let data: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
        let seg = wire::SEGMENT as usize;
        let part = |at: usize, len: usize, more: bool| {
            let mut h = FrameHeader::new(Kind::ReadResp);
            (h.dst_qpn, h.src_qpn, h.psn, h.arg2, h.data_len) = (0x11, 0x22, 0, at as u64, len as u32);
            if more {
                h.flags |= wire::F_MORE;
            }
            let mut b = h.encode().to_vec();
            b.extend_from_slice(&data[at..at + len]);
            b
        };
        let mut not_ready = FrameHeader::new(Kind::Ack);
        (not_ready.dst_qpn, not_ready.src_qpn, not_ready.psn, not_ready.status) = (0x11, 0x22, 0, Nak::NotReady as u32);
        assert!(q.sq.push(&read, &mut 0).unwrap());
        q.pump(&t.e, &mut Budget::default());
        read_frame(&mut peer);

        // The first part, "not ready", then the earlier answer's second part.
        let mut frames = part(0, seg, true);
        frames.extend_from_slice(&not_ready.encode());
        frames.extend_from_slice(&part(seg, seg, true));
        // The new answer, whole.
        let mut at = 0;
        while at < LEN {
            let n = (LEN - at).min(seg);
            frames.extend_from_slice(&part(at, n, at + n < LEN));
            at += n;
        }
        let w = std::thread::spawn(move || {
            peer.write_all(&frames).unwrap();
            peer
        });
        for _ in 0..3 + LEN.div_ceil(seg) {
            let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
            handle_response(&t.e, &c, &h).unwrap();
        }
        let ce = q.scomp.pop().unwrap().expect("a completion");
        assert_eq!((ce.wr_id, ce.status), (1, WcStatus::Success as u8), "not failed by the earlier answer's part");
        assert!(mr.read(ADDR, LEN) == data);
        drop(w.join().unwrap());

        let before = q.as_responder(7).stream;
        t.e.reset_responder(0x11);
        assert_ne!(q.as_responder(7).stream, before, "a new stream after a reset");
    }
}
