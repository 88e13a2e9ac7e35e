//! The direct data path: a send WR executed by this process against a peer on the same
//! host, copying between its own registered memory and the peer's MRs that grant remote
//! access (mapped from vrdmad's memfds). SENDs go through the peer's staging ring
//! (`staged.rs`), never into its receive buffers.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_abi::ring::{self, CompEntry, Sge};
use vrdma_abi::shm::MemRegion;
use vrdma_abi::verbs::{send_flags, wc_flags, QpState, WcOpcode, WcStatus, WrOpcode};
use vrdma_core::access::{check, Need};
use vrdma_core::sg::{self, Atomic, Span};

use super::{QpInner, QpMut, SendWr};
use crate::mr::LocalMr;
use crate::peer::Peer;

pub(super) enum Outcome {
    /// Executed (successfully or with an error completion already generated).
    Done,
    /// The responder had no receive posted.
    Rnr,
    /// The responder is not in RTR/RTS yet.
    NotReady,
    /// The QP's cap holds it back this many nanoseconds (nothing executed).
    Throttled(u64),
    /// The responder's staging ring is full (a SEND, maybe partly staged): retried once the
    /// responder polled.
    Busy,
}

/// The gather list of an inline WR as spans of the application's own buffers (read in
/// place; zero-length elements left out), and its total length.
///
/// # Safety
/// Each element's `addr` points to `length` readable bytes while the spans are used.
#[inline(always)]
pub(super) unsafe fn inline_spans(sges: &[Sge], out: &mut Vec<Span>) -> u64 {
    out.clear();
    let mut total = 0u64;
    for s in sges.iter().filter(|s| s.length > 0) {
        // SAFETY: the caller's contract.
        let mem = unsafe { MemRegion::from_raw(s.addr as *mut u8, s.length as usize) };
        out.push(Span { mem, offset: 0, len: s.length as usize });
        total += u64::from(s.length);
    }
    total
}

impl QpInner {
    pub(super) fn local_spans(&self, sges: &[Sge], need: Need, out: &mut Vec<Span>) -> Result<u64, WcStatus> {
        out.clear();
        let mrs = self.ctx.inner.mrs.read();
        let mut total = 0u64;
        for s in sges {
            if s.length == 0 {
                continue;
            }
            let mr = mrs.get(&s.lkey).ok_or(need.failure())?;
            let off = check(&mr.bounds, s.addr, u64::from(s.length), need)?;
            out.push(Span { mem: mr.mem, offset: off as usize, len: s.length as usize });
            total += u64::from(s.length);
        }
        Ok(total)
    }

    /// Executes one send WR against the connected peer, within the QP's cap if it has one
    /// (one predictable branch when it has none).
    #[inline(always)]
    pub(super) fn execute(&self, m: &mut QpMut, wr: &SendWr<'_>, inline: Option<&[u8]>) -> Outcome {
        if m.qos.bucket.is_some() {
            if let Some(wait) = self.pace(m, wr, inline) {
                return Outcome::Throttled(wait);
            }
            let outcome = self.execute_uncapped(m, wr, inline);
            if matches!(outcome, Outcome::Rnr | Outcome::NotReady | Outcome::Busy) {
                self.refund(m, wr, inline);
            }
            return outcome;
        }
        self.execute_uncapped(m, wr, inline)
    }

    /// [`QpInner::execute`] with no cap.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn execute_uncapped(&self, m: &mut QpMut, wr: &SendWr<'_>, inline: Option<&[u8]>) -> Outcome {
        let opcode = wr.opcode;
        if m.peer_gone {
            // Like a NIC's retries to a QP that no longer exists: RETRY_EXC_ERR once the
            // QP's retries are spent (timeout × (retry_cnt + 1); never with timeout 0), not at
            // once. A ping-pong peer that sent one message too many and finishes within that
            // time exits cleanly, as it does on hardware.
            return Outcome::NotReady;
        }
        let Some(peer) = m.peer.as_ref() else {
            self.fail(m, wr.wr_id, opcode, WcStatus::RetryExcErr);
            return Outcome::Done;
        };
        if !matches!(peer.state(), Some(QpState::Rtr | QpState::Rts | QpState::Sqd)) {
            return Outcome::NotReady;
        }
        if inline.is_none() && wr.sg_list.len() == 1 {
            match opcode {
                WrOpcode::RdmaWrite => return self.write_one(m, wr),
                WrOpcode::Send | WrOpcode::SendWithImm => return self.send_one(m, wr),
                _ => {}
            }
        }
        // Gather list: registered memory, or inline bytes (copied at post time if kept).
        let mut spans = std::mem::take(&mut m.spans);
        let total = if let Some(bytes) = inline {
            spans.clear();
            if !bytes.is_empty() {
                // SAFETY: `bytes` lives for this call; the region is only read.
                let mem = unsafe { MemRegion::from_raw(bytes.as_ptr() as *mut u8, bytes.len()) };
                spans.push(Span { mem, offset: 0, len: bytes.len() });
            }
            Ok(bytes.len() as u64)
        } else if wr.send_flags & send_flags::INLINE != 0 {
            // SAFETY: inline data pointers must be valid during post_send (verbs contract),
            // and inline WRs execute within post_send or are copied.
            Ok(unsafe { inline_spans(wr.sg_list, &mut spans) })
        } else {
            let need = if matches!(opcode, WrOpcode::RdmaRead | WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd) {
                Need::LocalWrite
            } else {
                Need::LocalRead
            };
            self.local_spans(wr.sg_list, need, &mut spans)
        };
        let outcome = match total {
            Err(st) => {
                self.fail(m, wr.wr_id, opcode, st);
                Outcome::Done
            }
            Ok(total) if matches!(opcode, WrOpcode::Send | WrOpcode::SendWithImm) => self.send_staged(m, wr, &spans, total),
            Ok(total) => self.execute_remote(m, wr, &spans, total),
        };
        m.spans = spans;
        outcome
    }

    /// The most common work request, an RDMA WRITE of one element, without the general
    /// scatter/gather machinery (same checks, same statuses).
    #[inline(always)]
    fn write_one(&self, m: &mut QpMut, wr: &SendWr<'_>) -> Outcome {
        let len = wr.sg_list[0].length as usize;
        let src = self.source_one(&mut m.last_mr, wr);
        let peer = m.peer.as_mut().expect("checked by execute");
        let result = src.and_then(|src| match peer.span_cached(wr.rkey, wr.remote_addr, len as u64, Need::RemoteWrite) {
            // A mapped MR: nothing is staged, nothing to flush.
            Some(dst) => {
                dst.and_then(|dst| dst.mem.copy_from_region(dst.offset, &src.mem, src.offset, len).map_err(|_| WcStatus::RemAccessErr))
            }
            None => self.write_one_uncached(peer, wr, &src),
        });
        match result {
            Ok(()) => {
                self.meter.sent(WrOpcode::RdmaWrite as u32, len as u64);
                if self.sq_sig_all || wr.send_flags & send_flags::SIGNALED != 0 {
                    self.send_cq.push_local_for(wr.wr_id, WcStatus::Success, WcOpcode::RdmaWrite, self.qpn, len as u32);
                }
            }
            Err(st) => self.fail(m, wr.wr_id, WrOpcode::RdmaWrite, st),
        }
        Outcome::Done
    }

    /// `write_one` to an MR not in the peer's one-entry cache (first use, copied MR,
    /// zero length): apart, so that the usual case's span never goes through memory.
    #[inline(never)]
    fn write_one_uncached(&self, peer: &mut Peer, wr: &SendWr<'_>, src: &Span) -> Result<(), WcStatus> {
        let len = src.len;
        if wr.send_flags & send_flags::INLINE == 0 {
            // A copied MR: vrdmad copies from our MR (see `peer::copy_path`).
            if let Some(r) = peer.copy_direct(&self.ctx, self.qpn, &wr.sg_list[..1], wr.rkey, wr.remote_addr, len as u64, Need::RemoteWrite)
            {
                return r;
            }
        }
        let dst = peer.span(&self.ctx, self.qpn, wr.rkey, wr.remote_addr, len as u64, Need::RemoteWrite)?;
        dst.mem.copy_from_region(dst.offset, &src.mem, src.offset, len).map_err(|_| WcStatus::RemAccessErr)?;
        peer.flush(&self.ctx, self.qpn, &[dst], len as u64)
    }

    /// The local source of a one-element WR: inline bytes or registered memory.
    #[inline(always)]
    fn source_one(&self, last_mr: &mut Option<(u32, Arc<LocalMr>)>, wr: &SendWr<'_>) -> Result<Span, WcStatus> {
        let s = wr.sg_list[0];
        let len = s.length as usize;
        if wr.send_flags & send_flags::INLINE != 0 {
            // SAFETY: inline data pointers must be valid during post_send (verbs contract);
            // this runs within post_send (kept WRs take the general path with a copy).
            return Ok(Span { mem: unsafe { MemRegion::from_raw(s.addr as *mut u8, len) }, offset: 0, len });
        }
        if len == 0 {
            return Ok(Span { mem: MemRegion::empty(), offset: 0, len: 0 });
        }
        if let Some((k, mr)) = last_mr.as_ref() {
            if *k == s.lkey && mr.valid.load(Ordering::Acquire) {
                return check(&mr.bounds, s.addr, u64::from(s.length), Need::LocalRead).map(|off| Span {
                    mem: mr.mem,
                    offset: off as usize,
                    len,
                });
            }
        }
        let mrs = self.ctx.inner.mrs.read();
        match mrs.get(&s.lkey) {
            Some(mr) => {
                *last_mr = Some((s.lkey, mr.clone()));
                check(&mr.bounds, s.addr, u64::from(s.length), Need::LocalRead).map(|off| Span { mem: mr.mem, offset: off as usize, len })
            }
            None => Err(WcStatus::LocProtErr),
        }
    }

    /// A SEND (or SEND_WITH_IMM) of one element, without the general gather walk.
    fn send_one(&self, m: &mut QpMut, wr: &SendWr<'_>) -> Outcome {
        match self.source_one(&mut m.last_mr, wr) {
            Ok(src) => self.send_staged(m, wr, &[src], src.len as u64),
            Err(st) => {
                self.fail(m, wr.wr_id, wr.opcode, st);
                Outcome::Done
            }
        }
    }

    fn execute_remote(&self, m: &mut QpMut, wr: &SendWr<'_>, spans: &[Span], total: u64) -> Outcome {
        let opcode = wr.opcode;
        let qpn = self.qpn;
        let ctx = &self.ctx;
        let mut rsges = std::mem::take(&mut m.rsges);
        let result: Result<u32, (WcStatus, bool)> = (|| {
            let peer = m.peer.as_mut().expect("checked by execute");
            match opcode {
                WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => {
                    let target = peer.span(ctx, qpn, wr.rkey, wr.remote_addr, total, Need::RemoteWrite).map_err(|s| (s, false))?;
                    let recv = if opcode == WrOpcode::RdmaWriteWithImm {
                        match peer.take_recv(&mut rsges) {
                            Some(r) => Some(r),
                            None => return Err((WcStatus::RnrRetryExcErr, true)),
                        }
                    } else {
                        None
                    };
                    sg::copy(&[target], spans).map_err(|_| (WcStatus::RemAccessErr, false))?;
                    peer.flush(ctx, qpn, &[target], total).map_err(|s| (s, false))?;
                    if let Some((recv_wr_id, srq)) = recv {
                        let flags = (if wr.send_flags & send_flags::SOLICITED != 0 { ring::COMP_SOLICITED } else { 0 })
                            | if srq { ring::COMP_FROM_SRQ } else { 0 };
                        let ce = CompEntry {
                            wr_id: recv_wr_id,
                            byte_len: total as u32,
                            imm: wr.imm_data,
                            opcode: WcOpcode::RecvRdmaWithImm as u8,
                            status: 0,
                            wc_flags: wc_flags::WITH_IMM as u8,
                            flags,
                            src_qp: qpn,
                        };
                        peer.complete(&ce);
                    }
                    Ok(total as u32)
                }
                WrOpcode::Send | WrOpcode::SendWithImm => unreachable!("SENDs are staged (send_staged)"),
                WrOpcode::RdmaRead => {
                    // A copied MR: vrdmad copies into our MR (see `peer::copy_path`).
                    if let Some(r) = peer.copy_direct(ctx, qpn, wr.sg_list, wr.rkey, wr.remote_addr, total, Need::RemoteRead) {
                        return r.map(|()| total as u32).map_err(|s| (s, false));
                    }
                    let src = peer.span(ctx, qpn, wr.rkey, wr.remote_addr, total, Need::RemoteRead).map_err(|s| (s, false))?;
                    let copied = sg::copy(spans, &[src]);
                    let _ = peer.flush(ctx, qpn, &[], 0); // releases a copied MR's staged bytes
                    copied.map_err(|_| (WcStatus::LocProtErr, false))?;
                    Ok(total as u32)
                }
                WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
                    if total != 8 || spans.len() != 1 {
                        return Err((WcStatus::LocLenErr, false));
                    }
                    let op = if opcode == WrOpcode::AtomicCmpAndSwp {
                        Atomic::CmpSwap { compare: wr.compare_add, swap: wr.swap }
                    } else {
                        Atomic::FetchAdd { add: wr.compare_add }
                    };
                    let old = peer.atomic(ctx, qpn, wr.rkey, wr.remote_addr, op).map_err(|s| (s, false))?;
                    let l = spans[0];
                    l.mem.write_from(l.offset, &old.to_ne_bytes()).map_err(|_| (WcStatus::LocProtErr, false))?;
                    Ok(8)
                }
            }
        })();
        m.rsges = rsges;
        match result {
            Ok(len) => {
                self.meter.sent(opcode as u32, u64::from(len));
                if self.sq_sig_all || wr.send_flags & send_flags::SIGNALED != 0 {
                    self.send_cq.push_local_for(wr.wr_id, WcStatus::Success, opcode.wc_opcode(), qpn, len);
                }
                Outcome::Done
            }
            Err((_, true)) => Outcome::Rnr,
            Err((st, false)) => {
                self.fail(m, wr.wr_id, opcode, st);
                Outcome::Done
            }
        }
    }
}
