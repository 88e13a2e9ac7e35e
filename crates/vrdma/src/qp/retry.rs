//! The retry queue: send WRs kept while the responder is not ready (not yet in RTR, or its
//! process gone), has no receive posted (RNR) or no room in its staging ring, retried in order from polls of the send
//! CQ until they execute or their retries are spent.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vrdma_abi::ring::{self, Sge};
use vrdma_abi::shm::MemRegion;
use vrdma_abi::verbs::{send_flags, WcStatus, WrOpcode};
use vrdma_core::timers;

use super::direct::Outcome;
use super::{QpInner, QpMut, SendWr};

/// A send WR kept for later (responder not ready): owns its lists and inline bytes.
pub(super) struct PendingWr {
    pub(super) wr_id: u64,
    pub(super) opcode: WrOpcode,
    send_flags: u32,
    sges: Vec<Sge>,
    inline: Vec<u8>,
    imm_data: u32,
    remote_addr: u64,
    rkey: u32,
    compare_add: u64,
    swap: u64,
    first_try: Instant,
    next_try: Instant,
    rnr_tries: u32,
}

impl QpInner {
    pub(super) fn keep(&self, m: &mut QpMut, wr: &SendWr<'_>, inline: Option<Vec<u8>>) {
        let now = Instant::now();
        let inline = inline.unwrap_or_else(|| {
            if wr.send_flags & send_flags::INLINE == 0 {
                return Vec::new();
            }
            let mut v = Vec::new();
            for s in wr.sg_list {
                // SAFETY: inline pointers are valid during post_send; copied now so the WR
                // can run later.
                let mem = unsafe { MemRegion::from_raw(s.addr as *mut u8, s.length as usize) };
                let mut b = vec![0u8; s.length as usize];
                let _ = mem.read_into(0, &mut b);
                v.extend_from_slice(&b);
            }
            v
        });
        m.pending.push_back(PendingWr {
            wr_id: wr.wr_id,
            opcode: wr.opcode,
            send_flags: wr.send_flags,
            sges: if wr.send_flags & send_flags::INLINE != 0 { Vec::new() } else { wr.sg_list.to_vec() },
            inline,
            imm_data: wr.imm_data,
            remote_addr: wr.remote_addr,
            rkey: wr.rkey,
            compare_add: wr.compare_add,
            swap: wr.swap,
            first_try: now,
            next_try: now,
            rnr_tries: 0,
        });
        if !m.waiting_registered {
            m.waiting_registered = true;
            self.send_cq.waiting_qps.lock().push(self.me.clone());
            self.send_cq.waiting.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Takes what vrdmad published for the QP ([`QpInner::apply_qos`]); when that is the
    /// order to move onto the engine while WRs wait here (SENDs wait for room in the
    /// responder's staging ring for as long as the responder takes to poll, so a busy QP
    /// always has some), they go onto the engine first, in order. A SEND partly staged
    /// finishes here first (the move waits for it).
    pub(super) fn apply_qos_keeping_order(&self, m: &mut QpMut) {
        let (_, w) = self.qos.read();
        let ordered_off = w.flags & ring::QP_QOS_DEMOTE != 0 && m.med.is_none() && m.peer.is_some();
        if !ordered_off || m.pending.is_empty() || m.staged_tx.is_active() {
            return self.apply_qos(m);
        }
        let waiting = std::mem::take(&mut m.pending);
        self.apply_qos(m);
        let Some(c) = m.med.as_mut() else {
            m.pending = waiting; // not moved (yet): they stay here
            return;
        };
        let mut failed = Vec::new();
        for p in waiting {
            let inline_sge;
            let sg_list = if p.send_flags & send_flags::INLINE != 0 {
                inline_sge = [Sge { addr: p.inline.as_ptr() as u64, length: p.inline.len() as u32, lkey: 0 }];
                &inline_sge[..]
            } else {
                &p.sges[..]
            };
            let wr = SendWr {
                wr_id: p.wr_id,
                opcode: p.opcode,
                send_flags: p.send_flags,
                sg_list,
                imm_data: p.imm_data,
                remote_addr: p.remote_addr,
                rkey: p.rkey,
                compare_add: p.compare_add,
                swap: p.swap,
            };
            // The engine's ring holds the QP's whole send queue: never full here.
            if !matches!(c.post(&wr, self.sq_sig_all, None), Ok(true)) {
                failed.push((p.wr_id, p.opcode));
            }
        }
        for (wr_id, opcode) in failed {
            self.send_cq.push_local_for(wr_id, WcStatus::WrFlushErr, opcode.wc_opcode(), self.qpn, 0);
        }
    }

    /// Retries waiting WRs whose time has come.
    pub(crate) fn progress(&self) {
        let mut m = self.m.lock();
        self.check_error_request(&mut m);
        // What peers staged for this QP lands in its receive buffers now, not only when its
        // receive CQ is polled (as on a NIC): an application that waits for its own sends
        // before it polls its receives does not hold up a peer that does the same.
        self.drain_staged_now();
        let now = Instant::now();
        while let Some(p) = m.pending.pop_front() {
            let responder_ready_again = p.rnr_tries > 0 && m.peer.as_ref().is_some_and(|peer| peer.has_recv());
            if p.next_try > now && !responder_ready_again {
                m.pending.push_front(p);
                break;
            }
            let wr = SendWr {
                wr_id: p.wr_id,
                opcode: p.opcode,
                send_flags: p.send_flags & !send_flags::INLINE,
                sg_list: &p.sges,
                imm_data: p.imm_data,
                remote_addr: p.remote_addr,
                rkey: p.rkey,
                compare_add: p.compare_add,
                swap: p.swap,
            };
            let inline = (p.send_flags & send_flags::INLINE != 0).then_some(&p.inline[..]);
            match self.execute(&mut m, &wr, inline) {
                Outcome::Done => {}
                Outcome::Rnr => {
                    self.meter.add(vrdma_abi::ring::METER_RNR, 1);
                    let rnr_retry = m.attr.rnr_retry;
                    let mut p = p;
                    p.rnr_tries += 1;
                    if rnr_retry != timers::RNR_RETRY_INFINITE && p.rnr_tries > u32::from(rnr_retry) {
                        self.fail(&mut m, p.wr_id, p.opcode, WcStatus::RnrRetryExcErr);
                        break;
                    }
                    let wait =
                        m.peer.as_ref().map_or(Duration::from_micros(640), |peer| timers::rnr_wait(peer.min_rnr_timer(), p.rnr_tries));
                    p.next_try = now + wait;
                    m.pending.push_front(p);
                    break;
                }
                Outcome::Busy => {
                    // Flow control, not an error: tried again at the next poll (or by the
                    // backstop), for as long as the responder takes to drain its ring.
                    m.pending.push_front(p);
                    self.wait_for_room();
                    break;
                }
                Outcome::Throttled(wait) => {
                    let mut p = p;
                    p.next_try = now + Duration::from_nanos(wait);
                    m.pending.push_front(p);
                    break;
                }
                Outcome::NotReady => {
                    let limit = timers::retry_limit(m.attr.timeout, m.attr.retry_cnt);
                    if limit.is_some_and(|l| now.duration_since(p.first_try) > l) {
                        self.fail(&mut m, p.wr_id, p.opcode, WcStatus::RetryExcErr);
                        break;
                    }
                    let mut p = p;
                    p.next_try = now + Duration::from_micros(100);
                    m.pending.push_front(p);
                    break;
                }
            }
        }
        if m.pending.is_empty() && m.waiting_registered {
            m.waiting_registered = false;
            let me = self.me.clone();
            self.send_cq.waiting_qps.lock().retain(|w| !w.ptr_eq(&me));
            self.send_cq.waiting.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
