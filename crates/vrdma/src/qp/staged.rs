//! SENDs through the responder's staging ring (`vrdma_abi::ring::StagingRing`): a peer
//! never writes a receive buffer itself, since a receive MR usually grants no remote access
//! and vrdmad maps no such MR for a peer. The requester copies the payload into the
//! responder QP's staging ring (in parts, waiting for room, when it is larger than the ring
//! can hold), then writes the completion; the responder's library scatters the payload into
//! its own receive buffer when it polls, before it reports that completion: the receive the
//! record names only if this process posted it and no other message used it (`posted`).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_abi::ring::{self, CompEntry, Sge, StagingRing, STAGED_LAST, STAGED_MAX_SGE};
use vrdma_abi::shm::MemRegion;
use vrdma_abi::verbs::{send_flags, wc_flags, WcOpcode, WcStatus, WrOpcode};
use vrdma_core::access::{check, Need};
use vrdma_core::sg::{self, Span};

use super::direct::Outcome;
use super::posted::Claim;
use super::{QpInner, QpMut, SendWr};
use crate::device::Context;
use crate::mr::LocalMr;
use crate::peer::Peer;

/// The requester's SEND under way (its receive taken, part of its payload staged), resumed
/// by the next try of the same WR (the head of the retry queue).
#[derive(Default)]
pub(super) struct StagedTx {
    active: bool,
    recv_wr_id: u64,
    srq: bool,
    sges: Vec<Sge>,
    sent: u64,
    /// Scratch: the part of the gather list staged by one record.
    part: Vec<Span>,
}

impl StagedTx {
    /// Whether a SEND is under way (part of it staged): it must finish here.
    pub(super) fn is_active(&self) -> bool {
        self.active
    }

    /// Forgets the SEND under way (its WR was flushed, or the QP reset).
    pub(super) fn abandon(&mut self) {
        self.active = false;
    }
}

/// The responder's side: what it drained of its staging ring.
#[derive(Default)]
pub(crate) struct StagedRx {
    sges: Vec<Sge>,
    spans: Vec<Span>,
    part: Vec<Span>,
    /// Whether every part of the message being drained reached its receive buffer.
    current_ok: bool,
    /// Whether a message is being drained (a part without [`STAGED_LAST`] came).
    in_message: bool,
    /// The receive the message being drained claimed (`posted`), and its elements: every
    /// part goes there, whatever later parts name.
    claim: Option<Claim>,
    target: Vec<Sge>,
    /// The outcome of each message drained whose completion is not reported yet, and the
    /// receive it claimed.
    verdicts: VecDeque<(Result<(), WcStatus>, Option<Claim>)>,
}

impl StagedRx {
    /// Forgets what was drained (the QP reset).
    pub(super) fn reset(&mut self) {
        self.in_message = false;
        self.claim = None;
        self.verdicts.clear();
    }
}

/// `[skip, skip+len)` of the byte sequence `spans` as spans, into `out`.
fn sub_spans(spans: &[Span], mut skip: usize, mut len: usize, out: &mut Vec<Span>) {
    out.clear();
    for s in spans {
        if len == 0 {
            break;
        }
        if skip >= s.len {
            skip -= s.len;
            continue;
        }
        let n = (s.len - skip).min(len);
        out.push(Span { mem: s.mem, offset: s.offset + skip, len: n });
        len -= n;
        skip = 0;
    }
}

impl QpInner {
    /// A SEND (or SEND_WITH_IMM) of `total` bytes (`spans`) to the connected peer.
    pub(super) fn send_staged(&self, m: &mut QpMut, wr: &SendWr<'_>, spans: &[Span], total: u64) -> Outcome {
        let failed = match self.stage_send(m, wr, spans, total) {
            Ok(outcome) => return outcome,
            Err(st) => st,
        };
        m.staged_tx.active = false;
        self.fail(m, wr.wr_id, wr.opcode, failed);
        Outcome::Done
    }

    /// [`QpInner::send_staged`] up to its failure, if it fails.
    fn stage_send(&self, m: &mut QpMut, wr: &SendWr<'_>, spans: &[Span], total: u64) -> Result<Outcome, WcStatus> {
        let QpMut { peer, staged_tx: tx, rsges, .. } = &mut *m;
        let peer = peer.as_mut().expect("checked by execute");
        if !tx.active {
            // No receive is taken while the ring has no room for a first part: the WR waits
            // whole (and may still move onto the engine, see `apply_qos_keeping_order`).
            if !peer.staging().can_push(STAGED_MAX_SGE, total as usize) {
                peer.wake();
                return Ok(Outcome::Busy);
            }
            let Some((recv_wr_id, srq, writable)) = peer.take_recv_flagged(rsges) else { return Ok(Outcome::Rnr) };
            rsges.retain(|s| s.length > 0);
            let room: u64 = rsges.iter().map(|s| u64::from(s.length)).sum();
            if room < total || rsges.len() > STAGED_MAX_SGE {
                // The receive is too small: its LOC_LEN_ERR, our REM_INV_REQ_ERR.
                let mut ce = recv_entry(wr, recv_wr_id, srq, self.qpn, 0);
                ce.status = WcStatus::LocLenErr as u8;
                ce.flags &= !ring::COMP_STAGED;
                peer.complete(&ce);
                peer.request_error();
                return Err(WcStatus::RemInvReqErr);
            }
            // A receive whose MRs grant REMOTE_WRITE is written directly (zero-copy), as an
            // RDMA WRITE could write it anyway; the others are staged.
            if writable {
                match write_receive(self, peer, rsges, spans, total, &mut tx.part) {
                    Ok(()) => {
                        let mut ce = recv_entry(wr, recv_wr_id, srq, self.qpn, total);
                        ce.flags &= !ring::COMP_STAGED;
                        peer.complete(&ce);
                        self.sent(wr, total);
                        return Ok(Outcome::Done);
                    }
                    // Not what the flag said (its owner deregistered the MR meanwhile, or
                    // lied): staged after all, and this peer's flags no longer trusted.
                    Err(_) => peer.refuse_zero_copy(),
                }
            }
            std::mem::swap(&mut tx.sges, rsges);
            (tx.active, tx.recv_wr_id, tx.srq, tx.sent) = (true, recv_wr_id, srq, 0);
        }
        if !stage_parts(peer.staging(), tx, spans, total)? {
            // Room comes when the responder polls: wake it if it sleeps on its channel.
            peer.wake();
            return Ok(Outcome::Busy);
        }
        tx.active = false;
        peer.complete(&recv_entry(wr, tx.recv_wr_id, tx.srq, self.qpn, total));
        self.sent(wr, total);
        Ok(Outcome::Done)
    }

    /// A SEND of `total` bytes done: metered, and completed if signaled.
    fn sent(&self, wr: &SendWr<'_>, total: u64) {
        self.meter.sent(wr.opcode as u32, total);
        if self.sq_sig_all || wr.send_flags & send_flags::SIGNALED != 0 {
            self.send_cq.push_local_for(wr.wr_id, WcStatus::Success, WcOpcode::Send, self.qpn, total as u32);
        }
    }

    /// [`QpInner::drain_staged`] now, if anything is staged (outside a poll: its
    /// completions are reported by the next poll).
    pub(crate) fn drain_staged_now(&self) {
        if !self.staging.is_empty() {
            self.drain_staged(&mut self.staged_rx.lock());
        }
    }

    /// The responder: scatters every record waiting in this QP's staging ring into its
    /// receive buffers, noting each message's outcome in `rx`.
    pub(crate) fn drain_staged(&self, rx: &mut StagedRx) {
        loop {
            let rec = match self.staging.peek(&mut rx.sges) {
                Ok(Some(rec)) => rec,
                Ok(None) => return,
                Err(_) => {
                    // The peer wrote garbage: what it staged is lost, its message fails.
                    let _ = self.staging.clear();
                    let claim = if rx.in_message && rx.current_ok { rx.claim } else { None };
                    rx.in_message = false;
                    rx.verdicts.push_back((Err(WcStatus::LocProtErr), claim));
                    return;
                }
            };
            if !rx.in_message || rec.msg_offset == 0 {
                if rx.in_message && rx.current_ok {
                    // The last message never ended: it failed.
                    rx.verdicts.push_back((Err(WcStatus::LocProtErr), rx.claim));
                }
                rx.in_message = true;
                // Only into a receive this process posted and no message used yet: the
                // elements came through shared memory the peer can write.
                rx.claim = self.claim_receive(&rx.sges);
                rx.current_ok = rx.claim.is_some();
                rx.target.clear();
                if rx.current_ok {
                    rx.target.extend(rx.sges.iter().filter(|s| s.length > 0));
                } else {
                    rx.verdicts.push_back((Err(WcStatus::LocProtErr), None));
                }
            }
            if rx.current_ok {
                let StagedRx { target, spans, part, .. } = &mut *rx;
                if let Err(st) = self.scatter(target, rec.msg_offset, &rec.payload, spans, part) {
                    rx.current_ok = false;
                    rx.verdicts.push_back((Err(st), rx.claim));
                }
            }
            let _ = self.staging.release(&rec);
            if rec.flags & STAGED_LAST != 0 {
                if rx.current_ok {
                    rx.verdicts.push_back((Ok(()), rx.claim));
                }
                rx.in_message = false;
            }
        }
    }

    /// Claims the posted receive whose elements are `sges` (its SRQ's, if it has one).
    fn claim_receive(&self, sges: &[Sge]) -> Option<Claim> {
        self.posted_recvs().claim(sges)
    }

    /// Copies `payload` to `[offset, offset+len)` of the receive buffer `sges` (this
    /// process's own MRs, checked like any local key).
    fn scatter(&self, sges: &[Sge], offset: u64, payload: &MemRegion, spans: &mut Vec<Span>, part: &mut Vec<Span>) -> Result<(), WcStatus> {
        let room = self.local_spans(sges, Need::LocalWrite, spans).map_err(|_| WcStatus::LocProtErr)?;
        let len = payload.len() as u64;
        if offset.checked_add(len).is_none_or(|end| end > room) {
            return Err(WcStatus::LocLenErr);
        }
        if len == 0 {
            return Ok(());
        }
        sub_spans(spans, offset as usize, len as usize, part);
        sg::copy(part, &[Span { mem: *payload, offset: 0, len: len as usize }]).map(|_| ()).map_err(|_| WcStatus::LocProtErr)
    }

    /// The outcome of the next staged message (drained now if need be), and the receive it
    /// claimed: its completion was just read, so all of its parts are in the ring or
    /// drained already.
    pub(crate) fn staged_verdict(&self, rx: &mut StagedRx) -> (Result<(), WcStatus>, Option<Claim>) {
        if rx.verdicts.is_empty() {
            self.drain_staged(rx);
        }
        rx.verdicts.pop_front().unwrap_or((Err(WcStatus::LocProtErr), None))
    }
}

/// Writes a SEND's `total` bytes (`spans`) straight into the receive `rsges` (with room for
/// them) of MRs that grant REMOTE_WRITE, mapped like an RDMA WRITE's target (`dst`: scratch).
fn write_receive(q: &QpInner, peer: &mut Peer, rsges: &[Sge], spans: &[Span], total: u64, dst: &mut Vec<Span>) -> Result<(), WcStatus> {
    dst.clear();
    for s in rsges {
        dst.push(peer.span(&q.ctx, q.qpn, s.lkey, s.addr, u64::from(s.length), Need::RemoteWrite)?);
    }
    sg::copy(dst, spans).map_err(|_| WcStatus::RemAccessErr)?;
    peer.flush(&q.ctx, q.qpn, dst, total)
}

/// The flags of a receive of `sges` posted by this process: `RECV_REMOTE_WRITABLE` when
/// every (non-empty) element lies in one of its MRs that grants REMOTE_WRITE. `last` keeps
/// the MR of the previous one-element receive (while it is registered): a QP reposting into
/// one MR spares the context's MR table (a read lock and a hash) on every post.
pub(crate) fn receive_flags(ctx: &Context, sges: &[Sge], last: &mut Option<(u32, Arc<LocalMr>)>) -> u32 {
    let writable = |mr: &LocalMr, s: &Sge| check(&mr.bounds, s.addr, u64::from(s.length), Need::RemoteWrite).is_ok();
    if let [s] = sges {
        if s.length == 0 {
            return 0;
        }
        if let Some((k, mr)) = last.as_ref() {
            if *k == s.lkey && mr.valid.load(Ordering::Acquire) {
                return if writable(mr, s) { ring::RECV_REMOTE_WRITABLE } else { 0 };
            }
        }
        let Some(mr) = ctx.inner.mrs.read().get(&s.lkey).cloned() else { return 0 };
        let ok = writable(&mr, s);
        *last = Some((s.lkey, mr));
        return if ok { ring::RECV_REMOTE_WRITABLE } else { 0 };
    }
    let mrs = ctx.inner.mrs.read();
    let mut any = false;
    for s in sges.iter().filter(|s| s.length > 0) {
        any = true;
        if !mrs.get(&s.lkey).is_some_and(|mr| writable(mr, s)) {
            return 0;
        }
    }
    if any {
        ring::RECV_REMOTE_WRITABLE
    } else {
        0
    }
}

/// Stages what is left of the SEND `tx` (`spans`, `total` bytes): `Ok(true)` once all of it
/// is, `Ok(false)` when the ring is full.
fn stage_parts(staging: &StagingRing, tx: &mut StagedTx, spans: &[Span], total: u64) -> Result<bool, WcStatus> {
    loop {
        let at = tx.sent as usize;
        let left = (total - tx.sent) as usize;
        let part = &mut tx.part;
        let pushed = staging.push(tx.sent, left, true, &tx.sges, |dst, len| {
            let d = [Span { mem: *dst, offset: 0, len }];
            if len == 0 {
                return Ok(());
            }
            if at == 0 && len as u64 == total {
                return sg::copy(&d, spans).map(|_| ());
            }
            sub_spans(spans, at, len, part);
            sg::copy(&d, part).map(|_| ())
        });
        match pushed {
            Ok(Some(n)) => {
                tx.sent += n as u64;
                if tx.sent == total {
                    return Ok(true);
                }
            }
            Ok(None) => return Ok(false),
            // The responder's ring is corrupt (or our gather list vanished).
            Err(_) => return Err(WcStatus::RemOpErr),
        }
    }
}

/// The responder's completion of a staged SEND of `len` bytes from `qpn` into receive `wr_id`.
fn recv_entry(wr: &SendWr<'_>, recv_wr_id: u64, srq: bool, qpn: u32, len: u64) -> CompEntry {
    let with_imm = wr.opcode == WrOpcode::SendWithImm;
    let mut flags = ring::COMP_STAGED;
    if wr.send_flags & send_flags::SOLICITED != 0 {
        flags |= ring::COMP_SOLICITED;
    }
    if srq {
        flags |= ring::COMP_FROM_SRQ;
    }
    CompEntry {
        wr_id: recv_wr_id,
        byte_len: len as u32,
        imm: if with_imm { wr.imm_data } else { 0 },
        opcode: WcOpcode::Recv as u8,
        status: 0,
        wc_flags: if with_imm { wc_flags::WITH_IMM as u8 } else { 0 },
        flags,
        src_qp: qpn,
    }
}

/// Stages a datagram of `total` bytes (`spans`) after its GRH `grh` for the receive `sges`,
/// whole or not at all (false: the ring has no room, the datagram is lost, as UD may).
pub(super) fn stage_datagram(staging: &StagingRing, sges: &[Sge], grh: Span, spans: &[Span], total: usize) -> bool {
    let want = grh.len + total;
    if want > StagingRing::max_part(sges.len()) {
        return false;
    }
    let pushed = staging.push(0, want, true, sges, |dst, len| {
        let d = [Span { mem: *dst, offset: 0, len }];
        let mut src = Vec::with_capacity(spans.len() + 1);
        src.push(grh);
        src.extend_from_slice(spans);
        sg::copy(&d, &src).map(|_| ())
    });
    matches!(pushed, Ok(Some(n)) if n == want)
}
