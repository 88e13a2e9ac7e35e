//! The responder's side of the mediated path: requests from a peer daemon executed against
//! this host's QPs and MRs, in PSN order, exactly once; answers on the same connection.
//! Every field of a request is checked (QP pairing, PSN, rkey ownership, bounds, access)
//! before any byte of memory is touched; a refused request's data is read and dropped so the
//! stream stays framed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vrdma_abi::ring::{self, CompEntry};
use vrdma_abi::verbs::{wc_flags, QpState, WcOpcode, WcStatus};
use vrdma_abi::wire::{self, FrameHeader, Kind, Nak};
use vrdma_core::access::Need;
use vrdma_core::sg::Atomic;

use super::connection::Conn;
use super::mr::{NotNow, Stored};
use super::qp::{MedQp, Partial, RespState, ACK_BYTES, ACK_EVERY};
use super::{Engine, MappedMr};

mod fuzzing;
mod read_answers;
pub use fuzzing::{fuzz_responder, responder_seeds};
pub(crate) use read_answers::{ClosedOnDrop, ReadAnswers};

fn nak_for(st: WcStatus) -> Nak {
    match st {
        WcStatus::RemInvReqErr => Nak::InvalidRequest,
        _ => Nak::RemoteAccess,
    }
}

/// Handles one request frame (its data not yet read).
///
/// Returns the QP if it executed a SEND or WRITE whose ACK it deferred: the caller (the
/// connection's reader) sends that ACK before it waits for more, unless a request of the QP
/// carried it meanwhile.
///
/// A request on a lane carries the lane's `licence`: checked under the QP's responder lock,
/// so a request of a lane that a (re)connection replaced is dropped, never executed.
///
/// The request (and its data) is read from `c`; answers go on `out` (`c` itself, but for a
/// lane: the client shares the lane's far end, so its answers take a connection of the
/// peer daemon's own). A READ its QP schedules (`ReadGrants::schedules`: more than a
/// segment, or any while its vNIC has a policy) is answered by `answers`, the answerer of
/// `out` (see `read_answers`), where the caller has one.
pub(crate) fn handle_request(
    e: &Arc<Engine>,
    c: &Conn,
    out: &Conn,
    h: &FrameHeader,
    licence: Option<&AtomicBool>,
    lane_key: Option<[u64; 2]>,
    answers: Option<&ReadAnswers>,
) -> std::io::Result<Option<Arc<MedQp>>> {
    let data = u64::from(h.data_len);
    let q = e.qps.read().get(&h.dst_qpn).cloned();
    let Some(q) = q else {
        // Not (yet) connected here: like a QP before RTR, the requester retries until its
        // timeout.
        c.discard(data)?;
        return respond(out, h, Kind::Ack, Nak::NotReady as u32, 0, 0).map(|()| None);
    };
    if q.remote != c.peer || q.remote_qpn != h.src_qpn {
        e.refuse_claim(c.peer, format_args!("{:?} from its QP {} for our QP {}, paired otherwise", h.kind, h.src_qpn, h.dst_qpn));
        c.discard(data)?;
        return respond(out, h, Kind::Ack, Nak::Gone as u32, 0, 0).map(|()| None);
    }
    q.prefetch_for(h);
    if h.flags & wire::F_ACKS != 0 {
        // The peer's deferred ACK of our own requests, carried by this one: from its engine,
        // or on a lane (written by its client) as a token of its daemon's.
        if lane_key.is_none() {
            q.ack_through(e, h.status);
        } else if q.take_ack_token(h) {
            q.ack_token_through(e, h.status);
        }
    }
    execute(e, c, out, h, &q, licence, lane_key, answers)?;
    Ok(q.owes_ack().then_some(q))
}

/// Executes request `h` for `q` (paired with the sender) and answers it, or defers its ACK.
#[allow(clippy::too_many_arguments)]
fn execute(
    e: &Arc<Engine>,
    c: &Conn,
    out: &Conn,
    h: &FrameHeader,
    q_arc: &Arc<MedQp>,
    licence: Option<&AtomicBool>,
    lane_key: Option<[u64; 2]>,
    answers: Option<&ReadAnswers>,
) -> std::io::Result<()> {
    let data = u64::from(h.data_len);
    let q = &**q_arc;
    // A lane's READ of at most `LANE_READ_INLINE_MAX` bytes of a vNIC without a policy is
    // answered by the lane's server, a thread of this QP's alone, at once: the answerer's
    // hand-offs cost a 1 MiB READ across hosts about a third of its rate (docs/measurements.md,
    // "MPI exchanges across hosts"). A larger one goes to the answerer as on a shared
    // connection, so the server holds the QP's responder state (which a reconnection's
    // reset waits for) for at most that much sending.
    let lane_inline = h.kind == Kind::ReadReq
        && lane_key.is_some()
        && !q.reads.schedules_every_size()
        && h.arg1 - resumed_at(h) as u64 <= LANE_READ_INLINE_MAX;
    let answers = answers.filter(|_| !lane_inline);
    let mut rs = q.resp.lock();
    if rs.dead || licence.is_some_and(|l| !l.load(Ordering::Acquire)) {
        return c.discard(data);
    }
    let ahead = h.psn.wrapping_sub(rs.expected_psn) as i32;
    let (first, last) = segment_of(h);
    if ahead < 0 && h.kind == Kind::ReadReq {
        // A READ again, executed here before: its requester could not take the response
        // (its memory did not answer, see `qp::response`). Answered again, as IB responders
        // answer a duplicate READ (it changes nothing), its rights checked again.
        c.discard(data)?;
        let resets = rs.resets;
        drop(rs);
        return answer_read_again(e, out, h, q_arc, answers, resets);
    }
    if ahead < 0 {
        // A duplicate of something already executed: acknowledge (at its last segment),
        // never re-execute.
        c.discard(data)?;
        return if last { respond(out, h, Kind::Ack, 0, 0, 0) } else { Ok(()) };
    }
    if ahead > 0 {
        // After a NAK, until the requester resends the NAKed request.
        return c.discard(data);
    }
    // A later segment of a message continues what its earlier ones began, where they ended,
    // or is dropped: its message was answered already (the requester resends it from its
    // first segment, or from where it was stopped: `wire::F_RESUME`), or never began here.
    let resumed = !first && h.flags & wire::F_RESUME != 0;
    let earlier = match rs.partial.as_mut() {
        _ if first => {
            // (A message begun here, sent again from its start instead: its earlier
            // segments count again.)
            uncount_partial(q, &mut rs, h);
            0
        }
        Some(p) if p.psn == h.psn && p.kind == h.kind && p.done == h.arg2 && (if resumed { p.resumable } else { p.open }) => {
            (p.open, p.resumable) = (true, false);
            p.done
        }
        _ if resumed => {
            // Nothing to resume here (the QP was reset meanwhile, or the requester is
            // confused): the message comes again from its start.
            c.discard(data)?;
            uncount_partial(q, &mut rs, h);
            hold_partial(&mut rs);
            return respond(out, h, Kind::Ack, Nak::NotReady as u32, 0, 0);
        }
        _ => return c.discard(data),
    };
    if earlier + data > u64::from(wire::MAX_MESSAGE) {
        c.discard(data)?;
        fail_partial(q, &mut rs, h, WcStatus::LocLenErr);
        return error_nak(out, h, &mut rs, Nak::InvalidRequest);
    }
    if first && h.kind != Kind::Send && rs.partial.as_ref().is_some_and(|p| p.recv.is_some()) {
        // Another request at the PSN of a SEND begun in segments (only a broken or hostile
        // requester switches): the SEND's receive completes in error rather than vanish.
        c.discard(data)?;
        fail_partial(q, &mut rs, h, WcStatus::GeneralErr);
        return error_nak(out, h, &mut rs, Nak::InvalidRequest);
    }
    let owner = q.owner_state();
    if !matches!(owner, Some(QpState::Rtr | QpState::Rts | QpState::Sqd)) {
        c.discard(data)?;
        if owner == Some(QpState::Err) {
            flush_srq_receive(q, &mut rs);
        }
        if !first {
            // (Its earlier segments were counted: the message comes again, and counts then.)
            q.meter.received(h);
            q.meter.not_received(h, earlier);
        }
        hold_partial(&mut rs);
        return respond(out, h, Kind::Ack, Nak::NotReady as u32, 0, 0);
    }
    // No receive for it (`take_recv`): RNR, or "not ready" if the QP was detached meanwhile
    // (its owner reset it), as for a QP no longer here: an RNR would use up the requester's
    // RNR retries (RNR_RETRY_EXC_ERR at once with a retry count of 0) where a NIC's reset QP
    // answers nothing.
    let rnr = |q: &MedQp, earlier: u64| {
        q.meter.not_received(h, earlier); // it comes again
        if q.detached.load(Ordering::Acquire) {
            return respond(out, h, Kind::Ack, Nak::NotReady as u32, 0, 0);
        }
        respond(out, h, Kind::Ack, Nak::Rnr as u32, u64::from(q.min_rnr_timer()), 0)
    };
    q.meter.received(h);
    match h.kind {
        Kind::Write => {
            if first {
                // (A resend from its start: whatever an earlier attempt wrote is written again.)
                rs.partial = None;
            }
            // A zero-length WRITE names no memory: its R_Key and address are not checked (IB
            // spec C9-88); WRITE_WITH_IMM still consumes a receive.
            let target = if data == 0 { Ok(None) } else { q.local_span(e, h.rkey, h.remote_addr, data, Need::RemoteWrite).map(Some) };
            let target = match target {
                Ok(t) => t,
                Err(st) => {
                    c.discard(data)?;
                    return error_nak(out, h, &mut rs, nak_for(st));
                }
            };
            let stored = match &target {
                Some((mr, off)) => mr.receive(c, q.as_responder(h.psn), *off, data as usize)?,
                None => Stored::Yes,
            };
            if stored == Stored::NotNow {
                // A copied MR whose owner is moving it or whose memory does not answer: not
                // ready, as this thread serves every vNIC and waits for neither
                // (engine::mr::NotNow). The requester sends it again from this segment (what
                // it wrote is written again).
                return not_ready_from(out, h, q, &mut rs, earlier, None, Vec::new());
            }
            // WRITE_WITH_IMM consumes its receive with its last segment, once its data is in
            // (an RNR sends it again, and its bytes are written again).
            let recv = if h.flags & wire::F_IMM != 0 && last {
                match take_recv(q, &mut rs) {
                    Some(r) => Some(r),
                    None if stored == Stored::Yes => {
                        rs.partial = None;
                        return rnr(q, earlier);
                    }
                    None => None,
                }
            } else {
                None
            };
            let received = stored == Stored::Yes;
            if !received {
                // The owner of a copied MR unmapped it: the requester sees REM_ACCESS_ERR, the
                // receive it consumed (WRITE_WITH_IMM) completes in error.
                if let Some((wr_id, srq)) = recv {
                    let ce = CompEntry {
                        wr_id,
                        byte_len: 0,
                        imm: 0,
                        opcode: WcOpcode::RecvRdmaWithImm as u8,
                        status: WcStatus::LocProtErr as u8,
                        wc_flags: 0,
                        flags: flags_of(h, srq),
                        src_qp: h.src_qpn,
                    };
                    q.complete_recv(&mut rs, &ce);
                    q.request_error();
                }
                return error_nak(out, h, &mut rs, nak_for(WcStatus::RemAccessErr));
            }
            if !last {
                rs.partial = Some(Partial {
                    psn: h.psn,
                    kind: Kind::Write,
                    imm: h.flags & wire::F_IMM != 0,
                    done: earlier + data,
                    open: true,
                    resumable: false,
                    recv: None,
                    sges: Vec::new(),
                });
                return Ok(());
            }
            rs.partial = None;
            let total = earlier + data;
            // (A token only where a completion follows: a plain WRITE's owner sees the data
            // land, then answers, before the token could be published.)
            let defer = defer_ack(q, &mut rs, h, total, lane_key.filter(|_| recv.is_some()));
            if let Some((wr_id, srq)) = recv {
                let ce = CompEntry {
                    wr_id,
                    byte_len: total as u32,
                    imm: h.imm,
                    opcode: WcOpcode::RecvRdmaWithImm as u8,
                    status: 0,
                    wc_flags: wc_flags::WITH_IMM as u8,
                    flags: flags_of(h, srq),
                    src_qp: h.src_qpn,
                };
                q.complete_recv(&mut rs, &ce);
            }
            rs.expected_psn = rs.expected_psn.wrapping_add(1);
            ack_or_owe(out, h, q, &mut rs, defer)
        }
        Kind::Send => {
            // The receive: taken at the message's first segment, and kept for its later ones
            // and for a resend of it (the first attempt's, not another).
            let recv = match rs.partial.take() {
                Some(p) if p.kind == Kind::Send && p.psn == h.psn && (first || p.open) => {
                    rs.sges = p.sges;
                    p.recv
                }
                _ => take_recv(q, &mut rs),
            };
            let Some((wr_id, srq)) = recv else {
                c.discard(data)?;
                return rnr(q, 0);
            };
            let with_imm = h.flags & wire::F_IMM != 0;
            let mut ce = CompEntry {
                wr_id,
                byte_len: data as u32,
                imm: if with_imm { h.imm } else { 0 },
                opcode: WcOpcode::Recv as u8,
                status: 0,
                wc_flags: if with_imm { wc_flags::WITH_IMM as u8 } else { 0 },
                flags: flags_of(h, srq),
                src_qp: h.src_qpn,
            };
            // Resolve the whole scatter list before reading a byte.
            let sges = std::mem::take(&mut rs.sges);
            let mut spans = std::mem::take(&mut rs.spans);
            spans.clear();
            let mut room = 0u64;
            let mut bad = None;
            for s in sges.iter().filter(|s| s.length > 0) {
                match q.local_span(e, s.lkey, s.addr, u64::from(s.length), Need::LocalWrite) {
                    Ok(sp) => {
                        spans.push((sp, u64::from(s.length)));
                        room += u64::from(s.length);
                    }
                    Err(_) => {
                        bad = Some((WcStatus::LocProtErr, Nak::RemoteOperation));
                        break;
                    }
                }
            }
            rs.sges = sges;
            let total = earlier + data;
            if bad.is_none() && room < total {
                bad = Some((WcStatus::LocLenErr, Nak::InvalidRequest));
            }
            if let Some((theirs, nak)) = bad {
                // The responder's own receive is at fault: its error completion, its QP to
                // ERR, and the requester's REM_OP/REM_INV_REQ.
                c.discard(data)?;
                ce.status = theirs as u8;
                ce.byte_len = 0;
                q.complete_recv(&mut rs, &ce);
                q.request_error();
                return error_nak(out, h, &mut rs, nak);
            }
            // Past what earlier segments filled.
            let (mut skip, mut left) = (earlier, data);
            let mut stored = Stored::Yes;
            let who = q.as_responder(h.psn);
            for ((mr, off), len) in spans.drain(..) {
                if skip >= len {
                    skip -= len;
                    continue;
                }
                let n = (len - skip).min(left);
                if n == 0 || stored != Stored::Yes {
                    break;
                }
                stored = mr.receive(c, who, off + skip as usize, n as usize)?;
                skip = 0;
                left -= n;
            }
            rs.spans = spans;
            if left > 0 {
                c.discard(left)?;
            }
            if stored == Stored::NotNow {
                // A copied receive buffer whose owner's memory does not answer now: not ready,
                // the receive kept for the message when it comes again (see the WRITE above).
                let sges = std::mem::take(&mut rs.sges);
                return not_ready_from(out, h, q, &mut rs, earlier, Some((wr_id, srq)), sges);
            }
            if stored == Stored::Unstorable {
                // A copied receive buffer's owner unmapped it: as a bad receive buffer.
                ce.status = WcStatus::LocProtErr as u8;
                ce.byte_len = 0;
                q.complete_recv(&mut rs, &ce);
                q.request_error();
                return error_nak(out, h, &mut rs, Nak::RemoteOperation);
            }
            if !last {
                let sges = std::mem::take(&mut rs.sges);
                rs.partial = Some(Partial {
                    psn: h.psn,
                    kind: Kind::Send,
                    imm: h.flags & wire::F_IMM != 0,
                    done: total,
                    open: true,
                    resumable: false,
                    recv: Some((wr_id, srq)),
                    sges,
                });
                return Ok(());
            }
            ce.byte_len = total as u32;
            let defer = defer_ack(q, &mut rs, h, total, lane_key);
            q.complete_recv(&mut rs, &ce);
            rs.expected_psn = rs.expected_psn.wrapping_add(1);
            ack_or_owe(out, h, q, &mut rs, defer)
        }
        Kind::ReadReq => {
            let len = h.arg1;
            if len == 0 {
                // Zero-length: no memory named, nothing checked (C9-88).
                rs.expected_psn = rs.expected_psn.wrapping_add(1);
                return out.send(&reply(h, Kind::ReadResp), &[]);
            }
            match q.local_span(e, h.rkey, h.remote_addr, len, Need::RemoteRead) {
                Ok((mr, off)) => {
                    if answer_read(out, h, q_arc, mr, off, answers, rs.resets)? {
                        rs.expected_psn = rs.expected_psn.wrapping_add(1);
                    } else {
                        q.meter.not_received(h, 0); // it comes again
                    }
                    Ok(())
                }
                Err(st) => error_nak(out, h, &mut rs, nak_for(st)),
            }
        }
        Kind::AtomicReq => {
            let result = q.local_span(e, h.rkey, h.remote_addr, 8, Need::RemoteAtomic).map(|(mr, off)| {
                let op = if h.flags & wire::F_CMP_SWAP != 0 {
                    Atomic::CmpSwap { compare: h.arg1, swap: h.arg2 }
                } else {
                    Atomic::FetchAdd { add: h.arg1 }
                };
                mr.atomic(q.as_responder(h.psn), off, op)
            });
            let result = match result {
                Ok(Ok(r)) => r,
                Err(st) => Err(st),
                // Being moved by its owner, or its memory does not answer: not ready, as for a
                // WRITE (an atomic that goes on meanwhile is done once: its result is kept
                // for this request, see `procmem::agent`).
                Ok(Err(NotNow)) => {
                    q.meter.not_received(h, 0); // it comes again
                    return respond(out, h, Kind::Ack, Nak::NotReady as u32, 0, 0);
                }
            };
            match result {
                Ok(old) => {
                    rs.expected_psn = rs.expected_psn.wrapping_add(1);
                    respond(out, h, Kind::AtomicResp, 0, old, 0)
                }
                Err(st) => error_nak(out, h, &mut rs, nak_for(st)),
            }
        }
        _ => c.discard(data),
    }
}

/// Answers READ `h`, a duplicate (see [`execute`]), without changing the QP's state.
fn answer_read_again(
    e: &Arc<Engine>,
    out: &Conn,
    h: &FrameHeader,
    q: &Arc<MedQp>,
    answers: Option<&ReadAnswers>,
    resets: u64,
) -> std::io::Result<()> {
    // The requester starts over from this READ: what is still being answered from here
    // on is dropped on arrival, and takes no budget or slot any more.
    q.reads.end_from(Some(h.psn), &q.wire_bytes);
    let len = h.arg1;
    if len == 0 {
        return out.send(&reply(h, Kind::ReadResp), &[]);
    }
    match q.local_span(e, h.rkey, h.remote_addr, len, Need::RemoteRead) {
        Ok((mr, off)) => answer_read(out, h, q, mr, off, answers, resets).map(|_| ()),
        Err(st) => respond(out, h, Kind::ReadResp, nak_for(st) as u32, 0, 0),
    }
}

/// Answers READ `h` (rights checked) with `h.arg1` bytes of `mr` at `off` (from where a
/// resumed READ asks, [`resumed_at`]): by `answers` if the QP schedules the rest
/// (`ReadGrants::schedules`) and the caller has one, else here. False if it was answered
/// "not ready" instead (a copied MR whose owner's memory did not answer now,
/// `engine::mr::NotNow`: the READ comes again, resumed where the parts its requester
/// stored end).
fn answer_read(
    out: &Conn,
    h: &FrameHeader,
    q: &Arc<MedQp>,
    mr: Arc<MappedMr>,
    off: usize,
    answers: Option<&ReadAnswers>,
    resets: u64,
) -> std::io::Result<bool> {
    let len = h.arg1 as usize;
    let from = resumed_at(h);
    if let Some(a) = answers.filter(|_| q.reads.schedules((len - from) as u64)) {
        if a.take(q, h, mr, off, len, from, resets) {
            return Ok(true);
        }
        // (It comes again: see `ReadAnswers::take`.)
        return respond(out, h, Kind::Ack, Nak::NotReady as u32, 0, 0).map(|()| false);
    }
    if send_read_response(out, h, q, &mr, off, len, from)? {
        return Ok(true);
    }
    respond(out, h, Kind::Ack, Nak::NotReady as u32, 0, 0).map(|()| false)
}

/// Where READ `h`'s response begins: the offset it asks from (`wire::F_RESUME`: its
/// requester stored the parts before, and the rest of an earlier answer did not come or
/// could not be stored), else its start.
fn resumed_at(h: &FrameHeader) -> usize {
    if h.flags & wire::F_RESUME != 0 && h.arg2 < h.arg1 {
        h.arg2 as usize
    } else {
        0
    }
}

/// Sends READ `h`'s data (`len` bytes of `mr` at `off`) from its byte `from` on `out`, in
/// frames of at most [`wire::SEGMENT`] bytes, each written whole: `out` carries other QPs'
/// answers too (a lane's requests are answered on a connection of the peer daemon's, which
/// its reader answers every QP of that host on), and they go between the frames. Before, a
/// READ of up to 2 GiB (a 64-byte request a lane's client writes itself, however its vNIC
/// is capped) held that connection for as long as it took to send. A copied MR's bytes are
/// read on its owner's agent first; false if they are not there in time ([`NotNow`]): the
/// READ is answered "not ready" after the parts sent.
fn send_read_response(out: &Conn, h: &FrameHeader, q: &MedQp, mr: &MappedMr, off: usize, len: usize, from: usize) -> std::io::Result<bool> {
    let mut at = from;
    while at < len {
        match send_read_part(out, h, q, mr, off, len, at)? {
            Some(n) => at += n,
            None => return Ok(false),
        }
    }
    Ok(true)
}

/// Sends the part of READ `h`'s response (`len` bytes of `mr` at `off`) that begins at
/// byte `at`: its bytes, or `None` if they are in a copied MR whose owner's memory did not
/// give them now ([`NotNow`]).
fn send_read_part(
    out: &Conn,
    h: &FrameHeader,
    q: &MedQp,
    mr: &MappedMr,
    off: usize,
    len: usize,
    at: usize,
) -> std::io::Result<Option<usize>> {
    let n = (len - at).min(wire::SEGMENT as usize);
    let mut r = reply(h, Kind::ReadResp);
    r.data_len = n as u32;
    r.arg2 = at as u64;
    if at + n < len {
        r.flags |= wire::F_MORE;
    }
    if mr.is_copied() {
        let bytes = match mr.read_owned_for(q.as_responder(h.psn), off + at, n) {
            Err(NotNow) => return Ok(None),
            Ok(Ok(bytes)) => bytes,
            // Its owner unmapped registered memory (breaking the verbs contract): zeros.
            Ok(Err(_)) => vec![0u8; n],
        };
        out.send(&r, &bytes)?;
    } else {
        mr.send(out, &r, off + at, n)?;
    }
    Ok(Some(n))
}

/// Whether the ACK of SEND or WRITE `h`, executed but for its completion, is deferred, so
/// that the QP's next request carries it (the ping-pong of RDMA applications): yes unless
/// enough are deferred already. A request that came on a lane (with that lane's secret,
/// `lane_key`) gets its token published now, before the completion the owner answers is
/// written.
fn defer_ack(q: &MedQp, rs: &mut RespState, h: &FrameHeader, data: u64, lane_key: Option<[u64; 2]>) -> bool {
    if !q.owes_ack() {
        // The ACK deferred last went (carried by a request of the QP's own, or settled as a
        // token its owner carried): the count towards one of our own starts again.
        rs.unacked = 0;
        rs.unacked_bytes = 0;
    }
    rs.unacked += 1;
    rs.unacked_bytes += data;
    if rs.unacked >= ACK_EVERY || rs.unacked_bytes >= ACK_BYTES {
        rs.unacked = 0;
        rs.unacked_bytes = 0;
        return false;
    }
    if let Some(key) = lane_key {
        q.publish_ack_token(rs, h.psn, key);
    }
    true
}

/// Acknowledges `h` now, or owes its ACK (`defer`, from [`defer_ack`]).
fn ack_or_owe(c: &Conn, h: &FrameHeader, q: &MedQp, rs: &mut RespState, defer: bool) -> std::io::Result<()> {
    if defer {
        q.owe_ack(h.psn);
        return Ok(());
    }
    q.clear_owed_ack();
    MedQp::acked_by_us(rs);
    respond(c, h, Kind::Ack, 0, 0, 0)
}

/// Sends `q`'s deferred ACK, if it still owes one, on `c` (the connection its requests'
/// answers take): no request of its own carried it in time.
pub(crate) fn send_owed_ack(c: &Conn, q: &MedQp) -> std::io::Result<()> {
    let Some(psn) = q.take_owed_ack() else { return Ok(()) };
    {
        let mut rs = q.resp.lock();
        rs.unacked = 0;
        rs.unacked_bytes = 0;
        MedQp::acked_by_us(&mut rs);
    }
    send_ack(c, q, psn)
}

/// Sends an ACK of `q`'s requests through `psn` on `c`.
pub(crate) fn send_ack(c: &Conn, q: &MedQp, psn: u32) -> std::io::Result<()> {
    let mut r = FrameHeader::new(Kind::Ack);
    r.dst_qpn = q.remote_qpn;
    r.src_qpn = q.qpn;
    r.psn = psn;
    c.send(&r, &[])
}

/// Whether request `h` is the first segment of its message, and whether its last (both for
/// a message in one frame).
fn segment_of(h: &FrameHeader) -> (bool, bool) {
    if !matches!(h.kind, Kind::Write | Kind::Send) {
        return (true, true);
    }
    (h.flags & wire::F_CONT == 0, h.flags & wire::F_MORE == 0)
}

/// The message whose segments are arriving was answered "not ready": its later segments are
/// dropped until the requester sends it again from its first, which a SEND's kept receive
/// then takes.
fn hold_partial(rs: &mut RespState) {
    match &mut rs.partial {
        // (What it counted went with the "not ready": nothing of it is kept but the receive.)
        Some(p) if p.recv.is_some() => (p.open, p.resumable, p.done) = (false, false, 0),
        _ => rs.partial = None,
    }
}

/// The message of `h` whose segments `rs.partial` holds, if it is that one and still counts
/// (begun, or stopped and resumable), is to come again from its start: what it counted goes,
/// once (it is held, counting nothing, until then).
fn uncount_partial(q: &MedQp, rs: &mut RespState, h: &FrameHeader) {
    let Some(p) = rs.partial.as_mut().filter(|p| p.psn == h.psn && p.kind == h.kind && (p.open || p.resumable)) else { return };
    // (Under its own opcode's word, whatever `h` says.)
    let mut counted = *h;
    counted.flags = (h.flags & !wire::F_IMM) | if p.imm { wire::F_IMM } else { 0 };
    q.meter.message_not_received(&counted, p.done);
    (p.open, p.resumable, p.done) = (false, false, 0);
}

/// Segment `h` of a WRITE or SEND, after `earlier` bytes of its message that its earlier
/// segments stored, found memory that did not answer now (`engine::mr::NotNow`): answered
/// "not ready", and the message resumable from this segment (the NAK's `arg2`: where; its
/// later segments, under way, are dropped meanwhile). A SEND keeps its receive (`recv`, with
/// its scatter list) for it. Before, the message came again from its start: one whose
/// memory stalled now and then (its owner's `mmap` calls, a host short of CPU) started over
/// at every stall, and one of many segments failed RETRY_EXC_ERR.
fn not_ready_from(
    out: &Conn,
    h: &FrameHeader,
    q: &MedQp,
    rs: &mut RespState,
    earlier: u64,
    recv: Option<(u64, bool)>,
    sges: Vec<ring::Sge>,
) -> std::io::Result<()> {
    // (It comes again: from its start, counted then; from here, this segment's bytes.)
    if earlier == 0 {
        q.meter.not_received(h, 0);
    } else {
        q.meter.segment_not_received(h);
    }
    rs.partial = (earlier > 0 || recv.is_some()).then_some(Partial {
        psn: h.psn,
        kind: h.kind,
        imm: h.flags & wire::F_IMM != 0,
        done: earlier,
        open: false,
        resumable: earlier > 0,
        recv,
        sges,
    });
    respond(out, h, Kind::Ack, Nak::NotReady as u32, 0, earlier)
}

/// Ends the message whose segments were arriving, in error: a SEND's receive completes with
/// `status` and the QP fails, as for a bad receive.
fn fail_partial(q: &MedQp, rs: &mut RespState, h: &FrameHeader, status: WcStatus) {
    if end_partial(q, rs, h.src_qpn, status) {
        q.request_error();
    }
}

/// Drops the message whose segments were arriving (the QP is reset, or it failed): a SEND's
/// receive, taken at its first segment, completes with `status` rather than vanish. Whether
/// there was one.
pub(crate) fn end_partial(q: &MedQp, rs: &mut RespState, src_qp: u32, status: WcStatus) -> bool {
    let Some(Partial { recv: Some((wr_id, srq)), .. }) = rs.partial.take() else { return false };
    if !srq && q.owner_state() == Some(QpState::Err) {
        // The owner's library flushed every receive it posted when its QP entered ERR, this
        // one too: a second completion would use up a receive posted after it.
        return false;
    }
    let flags = if srq { ring::COMP_FROM_SRQ } else { 0 };
    let ce = CompEntry { wr_id, byte_len: 0, imm: 0, opcode: WcOpcode::Recv as u8, status: status as u8, wc_flags: 0, flags, src_qp };
    q.complete_recv(rs, &ce);
    true
}

/// The owner's QP is in ERR: a receive its SRQ lent to a SEND cut off between segments
/// completes flushed now, as a NIC flushes the WQE it was filling. The library flushes only
/// its own queue's receives at ERR, and a RESET or destroy after drops the QP's responder
/// unreported.
pub(crate) fn flush_srq_receive(q: &MedQp, rs: &mut RespState) {
    if rs.partial.as_ref().is_some_and(|p| matches!(p.recv, Some((_, true)))) {
        end_partial(q, rs, q.remote_qpn, WcStatus::WrFlushErr);
    }
}

fn flags_of(h: &FrameHeader, srq: bool) -> u8 {
    (if h.flags & wire::F_SOLICITED != 0 { ring::COMP_SOLICITED } else { 0 }) | if srq { ring::COMP_FROM_SRQ } else { 0 }
}

/// Takes the next receive WR (RQ or SRQ) into `rs.sges`. None once the QP is detached: a
/// reader that held it across its owner's reset would take a receive posted for the QP's
/// next connection (or another QP's, from an SRQ), whose completion `complete_recv` then
/// drops.
fn take_recv(q: &MedQp, rs: &mut RespState) -> Option<(u64, bool)> {
    let _gate = q.recv_gate.lock();
    if q.detached.load(Ordering::Acquire) {
        return None;
    }
    q.recv.take_recv(&mut rs.sges)
}

/// The largest READ a lane's server answers itself (see [`execute`]).
const LANE_READ_INLINE_MAX: u64 = 4 * wire::SEGMENT as u64;

fn reply(h: &FrameHeader, kind: Kind) -> FrameHeader {
    let mut r = FrameHeader::new(kind);
    r.dst_qpn = h.src_qpn;
    r.src_qpn = h.dst_qpn;
    r.psn = h.psn;
    r
}

fn respond(c: &Conn, h: &FrameHeader, kind: Kind, status: u32, arg1: u64, arg2: u64) -> std::io::Result<()> {
    let mut r = reply(h, kind);
    r.status = status;
    r.arg1 = arg1;
    r.arg2 = arg2;
    c.send(&r, &[])
}

/// A fatal NAK: the requester's QP goes to ERR, so its later requests are dropped here.
fn error_nak(c: &Conn, h: &FrameHeader, rs: &mut RespState, nak: Nak) -> std::io::Result<()> {
    rs.expected_psn = rs.expected_psn.wrapping_add(1);
    rs.dead = true;
    rs.partial = None;
    let kind = match h.kind {
        Kind::ReadReq => Kind::ReadResp,
        Kind::AtomicReq => Kind::AtomicResp,
        _ => Kind::Ack,
    };
    respond(c, h, kind, nak as u32, 0, 0)
}

#[cfg(test)]
mod tests;
