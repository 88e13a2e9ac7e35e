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
                    // again (the responder answers a duplicate READ), as after "not ready",
                    // for the rest of its response from the part that was not stored.
                    ReadPart::Again(at) => {
                        st.progressed |= resume_from(&mut st.inflight[i], at);
                        retry_later(e, &q, st, i, None)
                    }
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
        Some(Nak::Rnr) => {
            // (An answer: the transport timer starts again, as a NIC's does; the RNR retries
            // have their own count.)
            st.progressed = true;
            retry_later(e, &q, st, i, Some(h.arg1 as u8))
        }
        Some(Nak::NotReady) => {
            // (A WRITE or SEND stopped at a later segment goes again from that one: where
            // its earlier ones are stored, the NAK says. A READ asks for the rest of its
            // response: its parts came in order before the NAK, and those stored stay.)
            let f = &mut st.inflight[i];
            match f.read_err.filter(|_| f.opcode == WrOpcode::RdmaRead) {
                // A part it could not store for good (LOC_PROT_ERR): it ends with that
                // error, as a NIC's READ does, rather than ask for the rest past that part
                // (and complete successfully without those bytes).
                Some(err) => Some(err),
                None => {
                    let at = match f.opcode {
                        WrOpcode::RdmaRead => f.read_again.unwrap_or(f.read_done),
                        WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => 0,
                        _ if h.arg2 < u64::from(f.len) => h.arg2 as u32,
                        _ => 0,
                    };
                    st.progressed |= resume_from(f, at);
                    retry_later(e, &q, st, i, None)
                }
            }
        }
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
        st.progressed |= s == WcStatus::Success;
    }
    q.retire_and_kick(e, guard);
    Ok(())
}

/// Request `f`, answered "not ready" (or a READ whose response could not all be stored),
/// goes again from its data byte `at` (see `InFlight::resume_at`). Whether that is further
/// on than it ever was: progress, from which its retries count (as a NIC's do from a packet
/// acknowledged).
fn resume_from(f: &mut InFlight, at: u32) -> bool {
    f.resume_at = at;
    if at == 0 {
        // (From its start again: the responder lost what it held, or never held any.)
        f.resumed_high = 0;
    }
    if at <= f.resumed_high {
        return false;
    }
    f.resumed_high = at;
    true
}

/// A request answered RNR (`rnr`: the responder's timer code) or "not ready": sent again
/// from it after the wait, unless its retries are spent (its final status then).
fn retry_later(e: &Engine, q: &MedQp, st: &mut ReqState, i: usize, rnr: Option<u8>) -> Option<WcStatus> {
    let (rnr_retry, retry_cnt, timeout) = q.retry_attrs();
    let now = Instant::now();
    if std::mem::take(&mut st.progressed) {
        st.progress_at = Some(now);
    }
    let f = &mut st.inflight[i];
    let psn = f.psn;
    let give_up = if rnr.is_some() {
        f.rnr_tries += 1;
        q.meter.rnr();
        rnr_retry != timers::RNR_RETRY_INFINITE && f.rnr_tries > u32::from(rnr_retry)
    } else {
        // (From its first send, or the QP's latest progress (a request executed, or a message
        // resumed further on than before): a request that waited behind others for a slow
        // peer, answered "not ready" meanwhile, has not timed out.)
        let since = st.progress_at.map_or(f.first_sent, |p| p.max(f.first_sent));
        timers::retry_limit(timeout, retry_cnt).is_some_and(|l| now.duration_since(since) > l)
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
        if f.psn != psn || rnr.is_some() {
            // (From its start: getting as far again is progress again.)
            (f.resume_at, f.resumed_high) = (0, 0);
        }
        if f.opcode == WrOpcode::RdmaRead {
            // Its response comes again from where it is resumed; parts of the answer under
            // way (the responder's answerer may still be sending them) are dropped meanwhile.
            (f.read_done, f.read_err, f.read_again, f.read_restarted) = (f.resume_at, None, None, true);
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
    /// The last part came, but not all of the response could be stored now: from this
    /// offset on.
    Again(u32),
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
            Ok((mr, off)) if f.read_err.is_none() && f.read_again.is_none() => match mr.receive(c, who, off, n as usize)? {
                Stored::Yes => {}
                Stored::Unstorable => f.read_err = Some(WcStatus::LocProtErr),
                // (The parts before this one are stored.)
                Stored::NotNow => f.read_again = Some(h.arg2 as u32),
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
        (false, Some(at)) => ReadPart::Again(at),
        (false, None) => ReadPart::Last(f.read_err.unwrap_or(WcStatus::Success)),
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

    /// A QP has at most `MAX_RD_ATOMIC` READs outstanding (its initiator depth): the READs
    /// posted beyond it, and a SEND behind them, wait in the send ring until one completes
    /// (any one, not only the oldest), then go. Before, every READ posted went at once (`vrdma perf read_bw` posts 128),
    /// and a responder, which takes that many of a QP's large READs at a time, answered
    /// the rest "not ready" (a lone 8 MiB READ stream lost about 15% to the resends).
    #[test]
    fn reads_beyond_the_initiator_depth_wait_for_one_to_complete() {
        use crate::engine::qp::requester::MAX_RD_ATOMIC;
        use crate::engine::testing::nothing_sent;
        let t = engine();
        let _mr = t.broker.register_mr(KEY, ADDR, 1 << 20, access::LOCAL_WRITE);
        let (mut peer, c) = connection();
        let (q, _side) = crate::engine::testing::deep_mediated_qp(&t, 0x11, 0x22, &c, 64);
        let mut head = 0;
        for i in 0..MAX_RD_ATOMIC {
            assert!(q.sq.push(&read_wr(i as u64, ADDR + 4096 * i as u64, 4096, KEY), &mut head).unwrap());
        }
        q.pump(&t.e, &mut Budget::new(1000, 1 << 30));
        for psn in 0..MAX_RD_ATOMIC as u32 {
            let (h, _) = read_frame(&mut peer);
            assert_eq!((h.kind, h.psn), (Kind::ReadReq, psn));
        }
        for i in MAX_RD_ATOMIC..MAX_RD_ATOMIC + 2 {
            assert!(q.sq.push(&read_wr(i as u64, ADDR + 4096 * i as u64, 4096, KEY), &mut head).unwrap());
        }
        assert!(q.sq.push(&SqEntry { wr_id: 100, opcode: WrOpcode::Send as u32, ..SqEntry::default() }, &mut head).unwrap());
        q.pump(&t.e, &mut Budget::new(1000, 1 << 30));
        std::thread::sleep(Duration::from_millis(50));
        assert!(nothing_sent(&peer), "a READ beyond the initiator depth went");

        // A READ's response completes it (not the oldest's: any READ done makes room, and
        // the first version waited for the oldest to retire): the next READ goes.
        let mut h = FrameHeader::new(Kind::ReadResp);
        (h.dst_qpn, h.src_qpn, h.psn, h.data_len) = (0x11, 0x22, 5, 4096);
        let mut b = h.encode().to_vec();
        b.extend_from_slice(&[5u8; 4096]);
        peer.write_all(&b).unwrap();
        let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
        handle_response(&t.e, &c, &h).unwrap();
        let (next, _) = read_frame(&mut peer);
        assert_eq!((next.kind, next.psn), (Kind::ReadReq, MAX_RD_ATOMIC as u32), "the next READ after one completed");
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

    /// The header of the part at `at` of READ `psn`'s response of `total` bytes (QP 0x22's
    /// to our 0x11): a segment at most, more to follow unless it is the last.
    fn read_part(psn: u32, at: usize, total: usize) -> FrameHeader {
        let n = (total - at).min(wire::SEGMENT as usize);
        let mut h = FrameHeader::new(Kind::ReadResp);
        (h.dst_qpn, h.src_qpn, h.psn, h.arg2, h.data_len) = (0x11, 0x22, psn, at as u64, n as u32);
        if at + n < total {
            h.flags |= wire::F_MORE;
        }
        h
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

    /// A WRITE in segments answered "not ready" at its second one (`arg2`: the bytes stored
    /// before it) is sent again from that segment (`wire::F_CONT | wire::F_RESUME`, its
    /// offset in `arg2`, its own remote address and bytes), then its later ones; a "not
    /// ready" whose `arg2` is beyond the message has it sent again from its start. Before,
    /// every resend began at its first segment.
    #[test]
    fn a_write_stopped_at_a_segment_is_sent_again_from_there() {
        const LEN: usize = 600_000;
        let t = engine();
        let mr = t.broker.register_mr(KEY, ADDR, 1 << 20, access::LOCAL_WRITE);
        let data: Vec<u8> = (0..LEN).map(|i| (i % 233) as u8).collect();
        mr.write(ADDR, &data);
        let (mut peer, c) = connection();
        let (q, _side) = mediated_qp(&t, 0x11, 0x22, &c);
        let seg = wire::SEGMENT as usize;
        let write = SqEntry {
            wr_id: 1,
            opcode: WrOpcode::RdmaWrite as u32,
            send_flags: send_flags::SIGNALED,
            rkey: 9,
            remote_addr: 0x4000_0000,
            sges: vec![Sge { addr: ADDR, length: LEN as u32, lkey: KEY }],
            ..SqEntry::default()
        };
        let nak = |arg2: u64| {
            let mut h = FrameHeader::new(Kind::Ack);
            (h.dst_qpn, h.src_qpn, h.psn, h.status, h.arg2) = (0x11, 0x22, 0, Nak::NotReady as u32, arg2);
            h.encode()
        };
        // Pumps until the WR's frames are all out (a segment a pump); returns them.
        let resent = |peer: &mut std::net::TcpStream| {
            let started = std::time::Instant::now();
            let mut frames = Vec::new();
            loop {
                std::thread::sleep(Duration::from_millis(1));
                q.pump(&t.e, &mut Budget::default());
                while waiting(peer) {
                    let f = read_frame(peer);
                    let last = f.0.flags & wire::F_MORE == 0;
                    frames.push(f);
                    if last {
                        return frames;
                    }
                }
                assert!(started.elapsed() < Duration::from_secs(5), "never sent again");
            }
        };
        assert!(q.sq.push(&write, &mut 0).unwrap());
        assert_eq!(resent(&mut peer).len(), LEN.div_ceil(seg), "sent in segments");

        peer.write_all(&nak(seg as u64)).unwrap();
        let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
        handle_response(&t.e, &c, &h).unwrap();
        // Off the wire's account, unless the doorbell thread (kicked by the answer) has
        // already sent the rest again (a loaded machine runs it before this line).
        let on_wire = q.wire_bytes.load(std::sync::atomic::Ordering::Relaxed);
        assert!(on_wire == 0 || on_wire == (LEN - seg) as u64, "off the wire's account: {on_wire}");
        let frames = resent(&mut peer);
        assert_eq!(q.wire_bytes.load(std::sync::atomic::Ordering::Relaxed), (LEN - seg) as u64, "what is left on the wire's account again");
        assert_eq!(frames.len(), 2, "from the second segment on");
        for (i, (h, bytes)) in frames.iter().enumerate() {
            let at = (i + 1) * seg;
            let resume = if i == 0 { wire::F_RESUME } else { 0 };
            assert_eq!((h.kind, h.psn, h.flags & (wire::F_CONT | wire::F_RESUME)), (Kind::Write, 0, wire::F_CONT | resume), "frame {i}");
            assert_eq!((h.arg2, h.remote_addr), (at as u64, 0x4000_0000 + at as u64), "frame {i}");
            assert!(bytes[..] == data[at..at + h.data_len as usize], "frame {i}'s bytes");
        }

        // Beyond the message: from its start.
        peer.write_all(&nak(LEN as u64)).unwrap();
        let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
        handle_response(&t.e, &c, &h).unwrap();
        let frames = resent(&mut peer);
        assert_eq!(frames.len(), LEN.div_ceil(seg));
        assert_eq!(frames[0].0.flags & (wire::F_CONT | wire::F_RESUME), 0, "its first segment");
        let mut ack = FrameHeader::new(Kind::Ack);
        (ack.dst_qpn, ack.src_qpn, ack.psn) = (0x11, 0x22, 0);
        peer.write_all(&ack.encode()).unwrap();
        let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
        handle_response(&t.e, &c, &h).unwrap();
        let ce = q.scomp.pop().unwrap().expect("a completion");
        assert_eq!((ce.wr_id, ce.status), (1, WcStatus::Success as u8));
    }

    /// A READ whose local buffer (a copied MR) stops answering at its response's second part
    /// is asked again for the rest, from that part (`wire::F_RESUME`, `arg2`), once its last
    /// part is in; the rest lands and completes it, every byte, once. Before, it was asked
    /// again whole, and a large READ into memory that stalled now and then started over at
    /// every stall.
    #[test]
    fn a_read_stopped_at_a_part_is_asked_again_for_the_rest() {
        const COPIED: u32 = 0x701;
        const LEN: usize = 600_000;
        let t = engine();
        let mr = t.broker.register_copied_mr(COPIED, 1 << 20, access::LOCAL_WRITE);
        let (mut peer, c) = connection();
        let (q, _side) = mediated_qp(&t, 0x11, 0x22, &c);
        let data: Vec<u8> = (0..LEN).map(|i| (i % 239) as u8).collect();
        let seg = wire::SEGMENT as usize;
        let part = |psn: u32, at: usize| {
            let h = read_part(psn, at, LEN);
            let mut b = h.encode().to_vec();
            b.extend_from_slice(&data[at..at + h.data_len as usize]);
            b
        };
        let take = |peer: &mut std::net::TcpStream, psn: u32, at: usize| {
            peer.write_all(&part(psn, at)).unwrap();
            let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
            let (done, handled) = std::sync::mpsc::channel();
            let (e, c2) = (t.e.clone(), c.clone());
            std::thread::spawn(move || {
                handle_response(&e, &c2, &h).unwrap();
                done.send(()).unwrap();
            });
            handled.recv_timeout(Duration::from_secs(3)).expect("the reader waited in the stalled memory");
        };
        // Answers the READ asked again, from where each ask says, until it completes: the
        // completion, and where the first ask began.
        let finish = |peer: &mut std::net::TcpStream| {
            let started = std::time::Instant::now();
            let mut first = None;
            loop {
                let again = loop {
                    std::thread::sleep(Duration::from_millis(1));
                    q.pump(&t.e, &mut Budget::default());
                    if waiting(peer) {
                        break read_frame(peer).0;
                    }
                    assert!(started.elapsed() < Duration::from_secs(5), "never asked again");
                };
                assert_eq!((again.kind, again.arg1), (Kind::ReadReq, LEN as u64));
                let from = if again.flags & wire::F_RESUME != 0 { again.arg2 as usize } else { 0 };
                first.get_or_insert(from);
                for at in (from..LEN).step_by(seg) {
                    take(peer, again.psn, at);
                }
                if let Some(ce) = q.scomp.pop().unwrap() {
                    return (ce, first.unwrap());
                }
            }
        };
        for wr_id in 1..=20 {
            assert!(q.sq.push(&read_wr(wr_id, mr.addr, LEN, COPIED), &mut 0).unwrap());
            q.pump(&t.e, &mut Budget::default());
            let (req, _) = read_frame(&mut peer);
            assert_eq!((req.kind, req.flags & wire::F_RESUME), (Kind::ReadReq, 0));
            take(&mut peer, req.psn, 0);
            // (Stored in time? The agent's first access of that memory may be slow.)
            let stored = q.req.lock().inflight.iter().all(|f| f.read_again.is_none());
            let stall = stored.then(|| mr.mem.stall.write());
            take(&mut peer, req.psn, seg);
            take(&mut peer, req.psn, 2 * seg);
            assert!(q.scomp.pop().unwrap().is_none(), "not complete");
            drop(stall);
            let (ce, from) = finish(&mut peer);
            assert_eq!((ce.wr_id, ce.status), (wr_id, WcStatus::Success as u8));
            assert!(mr.bytes()[..LEN] == data[..], "every byte of the READ");
            if stored {
                assert_eq!(from, seg, "asked again for the rest, from its second part");
                break;
            }
            assert!(wr_id < 20, "its first part never stored in time");
        }
        assert!(q.scomp.pop().unwrap().is_none(), "completed once");
    }

    /// A request that waited behind an earlier one (a slow peer took long to execute it) is
    /// answered "not ready" once the earlier one is acknowledged: it is retried, its time
    /// waiting not counted against its retries (they count from the QP's latest progress, as
    /// a NIC's do). Before, it failed RETRY_EXC_ERR at its first "not ready" if the earlier
    /// one had taken longer than the QP's timeout × retries (a slow owner's 1 MiB WRITEs:
    /// the second failed after the first took 0.7 s).
    #[test]
    fn a_request_that_waited_behind_a_slow_one_is_not_timed_out_by_the_wait() {
        let t = engine();
        let _mr = t.broker.register_mr(KEY, ADDR, 8192, access::LOCAL_WRITE);
        let (mut peer, c) = connection();
        let (q, _side) = mediated_qp(&t, 0x11, 0x22, &c);
        // Its owner's retry attributes: timeout 14 (67 ms), retry_cnt 7, rnr_retry 7.
        q.recv.qp_map.region().store_u64(vrdma_abi::ring::QP_RETRY, 0x0e_07_07).unwrap();
        let write = |wr_id| SqEntry {
            wr_id,
            opcode: WrOpcode::RdmaWrite as u32,
            send_flags: send_flags::SIGNALED,
            rkey: 9,
            remote_addr: 0x4000,
            sges: vec![Sge { addr: ADDR, length: 64, lkey: KEY }],
            ..SqEntry::default()
        };
        assert!(q.sq.push(&write(1), &mut 0).unwrap());
        assert!(q.sq.push(&write(2), &mut 0).unwrap());
        q.pump(&t.e, &mut Budget::default());
        read_frame(&mut peer);
        read_frame(&mut peer);
        // Both went 10 s ago (the default retries give up after 8 × 67 ms).
        for f in q.req.lock().inflight.iter_mut() {
            f.first_sent -= Duration::from_secs(10);
        }
        let answer = |psn: u32, status: u32| {
            let mut h = FrameHeader::new(Kind::Ack);
            (h.dst_qpn, h.src_qpn, h.psn, h.status) = (0x11, 0x22, psn, status);
            peer.try_clone().unwrap().write_all(&h.encode()).unwrap();
            let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
            handle_response(&t.e, &c, &h).unwrap();
        };
        answer(0, 0);
        answer(1, Nak::NotReady as u32);
        let ce = q.scomp.pop().unwrap().expect("the first completes");
        assert_eq!((ce.wr_id, ce.status), (1, WcStatus::Success as u8));
        assert!(q.scomp.pop().unwrap().is_none(), "the second is retried, not failed");
        assert!(q.req.lock().resend_from == Some(1));
    }

    /// A READ answered "not ready" after a part it could not store for good (its MR gone:
    /// LOC_PROT_ERR) ends with that error, as a NIC's does, rather than be asked again past
    /// that part (it completed successfully without those bytes); one whose memory never
    /// answers is given up (RETRY_EXC_ERR) once its retries are spent, the parts that keep
    /// coming not taken for progress.
    #[test]
    fn a_read_resumes_neither_past_an_error_nor_forever() {
        const COPIED: u32 = 0x701;
        const LEN: usize = 600_000;
        let t = engine();
        let seg = wire::SEGMENT as usize;
        let _mr = t.broker.register_mr(KEY, ADDR, 1 << 20, access::LOCAL_WRITE);
        let copied = t.broker.register_copied_mr(COPIED, 1 << 20, access::LOCAL_WRITE);
        let (mut peer, c) = connection();
        let (q, _side) = mediated_qp(&t, 0x11, 0x22, &c);
        // Its owner's retry attributes: timeout 14 (67 ms), retry_cnt 0.
        q.recv.qp_map.region().store_u64(vrdma_abi::ring::QP_RETRY, 0x0e_00_07).unwrap();
        let mut writer = peer.try_clone().unwrap();
        let mut frame = |h: FrameHeader, data: &[u8]| {
            writer.write_all(&h.encode()).unwrap();
            writer.write_all(data).unwrap();
            let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
            handle_response(&t.e, &c, &h).unwrap();
        };
        let part = |psn: u32, at: usize| {
            let h = read_part(psn, at, LEN);
            (h, vec![7u8; h.data_len as usize])
        };
        let asked = |peer: &mut std::net::TcpStream| {
            let started = std::time::Instant::now();
            loop {
                std::thread::sleep(Duration::from_millis(1));
                q.pump(&t.e, &mut Budget::default());
                if waiting(peer) {
                    return read_frame(peer).0;
                }
                assert!(started.elapsed() < Duration::from_secs(5), "never asked again");
            }
        };

        // Its MR goes after the READ is admitted, for its first two parts, and comes back
        // (registered again under its key: the error is not met past them).
        assert!(q.sq.push(&read_wr(1, ADDR, LEN, KEY), &mut 0).unwrap());
        q.pump(&t.e, &mut Budget::default());
        read_frame(&mut peer);
        t.e.forget_mr(KEY);
        let (h, d) = part(0, 0);
        frame(h, &d);
        let (h, d) = part(0, seg);
        frame(h, &d);
        let mut nak = FrameHeader::new(Kind::Ack);
        (nak.dst_qpn, nak.src_qpn, nak.psn, nak.status) = (0x11, 0x22, 0, Nak::NotReady as u32);
        frame(nak, &[]);
        let ce = q.scomp.pop().unwrap().expect("a completion");
        assert_eq!((ce.wr_id, ce.status), (1, WcStatus::LocProtErr as u8));
        assert!(!waiting(&peer), "not asked again");

        // A READ into memory that never answers: asked again and again, then given up.
        let (mut peer, c) = connection();
        let (q, _side) = mediated_qp(&t, 0x13, 0x24, &c);
        q.recv.qp_map.region().store_u64(vrdma_abi::ring::QP_RETRY, 0x0e_00_07).unwrap();
        let _stall = copied.mem.stall.write();
        assert!(q.sq.push(&read_wr(2, copied.addr, LEN, COPIED), &mut 0).unwrap());
        q.pump(&t.e, &mut Budget::default());
        let mut ask = read_frame(&mut peer).0;
        let started = std::time::Instant::now();
        let ce = loop {
            let from = if ask.flags & wire::F_RESUME != 0 { ask.arg2 as usize } else { 0 };
            for at in (from..LEN).step_by(seg) {
                let (mut h, d) = part(ask.psn, at);
                (h.dst_qpn, h.src_qpn) = (0x13, 0x24);
                peer.write_all(&h.encode()).unwrap();
                peer.write_all(&d).unwrap();
                let (h, _) = c.read_header(&PeerRx::new(), Duration::from_secs(5)).unwrap();
                handle_response(&t.e, &c, &h).unwrap();
            }
            if let Some(ce) = q.scomp.pop().unwrap() {
                break ce;
            }
            assert!(started.elapsed() < Duration::from_secs(5), "asked again and again for 5 s");
            ask = asked(&mut peer);
        };
        assert_eq!((ce.wr_id, ce.status), (2, WcStatus::RetryExcErr as u8));
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
