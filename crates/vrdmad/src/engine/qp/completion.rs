//! Send completions: acknowledgements (cumulative, carried, or as tokens) complete WRs in
//! order; errors flush what follows.

use std::sync::atomic::Ordering;
use std::time::Instant;

use vrdma_abi::ring::{self, CompEntry, SqEntry};
use vrdma_abi::verbs::{send_flags, WcStatus, WrOpcode};

use super::{Fs, InFlight, MedQp, ReqState};
use crate::engine::Engine;

impl MedQp {
    /// The peer acknowledged (cumulatively) every SEND and WRITE up to `through`, on a
    /// request of its own ([`vrdma_abi::wire::F_ACKS`]): complete them.
    pub(crate) fn ack_through(&self, e: &Engine, through: u32) {
        let guard = self.req.lock();
        self.acked_through(e, guard, through);
    }

    /// [`MedQp::ack_through`] for an ACK token, on the lane reader of the peer's requests,
    /// which must not wait for a READ response streaming into this QP (for as long as a slow
    /// link takes): then the token is dropped, and the peer's daemon acknowledges by itself
    /// within [`TOKEN_TRUST`](crate::engine::lane::tokens::TOKEN_TRUST), on the connection the response takes, after it.
    pub(crate) fn ack_token_through(&self, e: &Engine, through: u32) {
        let guard = match self.req.try_lock() {
            Some(g) => g,
            None if self.receiving.load(Ordering::SeqCst) => return,
            None => self.req.lock(),
        };
        self.acked_through(e, guard, through);
    }

    pub(crate) fn acked_through(&self, e: &Engine, mut guard: parking_lot::MutexGuard<'_, ReqState>, through: u32) {
        let st = &mut *guard;
        self.adopt(e, st);
        if !mark_acked(st, through) {
            return;
        }
        self.retire_and_kick(e, guard);
    }

    /// Completes what finished and, if that freed room while the send ring holds more,
    /// has the doorbell thread pump again (after releasing the lock).
    pub(crate) fn retire_and_kick(&self, e: &Engine, mut guard: parking_lot::MutexGuard<'_, ReqState>) {
        let before = guard.inflight.len();
        self.retire(&mut guard);
        // (A READ or atomic done anywhere lets one held at the initiator depth go.)
        let depth_freed = guard.depth_held && !self.reads_at_depth(&guard);
        if depth_freed {
            guard.depth_held = false;
        }
        let freed = guard.inflight.len() < before || depth_freed;
        // A probe answered: what it held back goes now (see `ReqState::probe`).
        let probe_answered = guard.probe.is_some_and(|p| guard.unanswered(p).is_none());
        drop(guard);
        let deferred = self.pump_deferred.swap(false, Ordering::SeqCst);
        // (A QP parked behind its connection's backlog is pumped when that is sent.)
        if (deferred || probe_answered || (freed && self.has_unsent())) && !self.is_parked() {
            self.wants_pump.store(true, Ordering::Release);
            e.kick();
        } else if freed && e.qos_wire_waiting() {
            // Room on the wire for the QPs the scheduler left waiting for it.
            e.kick();
        }
    }

    /// Completes finished WRs in order.
    pub(crate) fn retire(&self, st: &mut ReqState) {
        let mut notify = None;
        let retired_before = st.retired;
        while let Some(f) = st.inflight.front() {
            let Fs::Done(status) = f.state else { break };
            let signaled = f.wr.send_flags & send_flags::SIGNALED != 0;
            let fatal = status != WcStatus::Success && status != WcStatus::WrFlushErr;
            self.meter.completed(f.opcode, status, f.len);
            if status != WcStatus::Success || signaled {
                let ce = CompEntry {
                    wr_id: f.wr.wr_id,
                    byte_len: if status == WcStatus::Success { f.len } else { 0 },
                    imm: 0,
                    opcode: f.opcode.wc_opcode() as u8,
                    status: status as u8,
                    wc_flags: 0,
                    flags: 0,
                    src_qp: self.qpn,
                };
                if !self.scomp.push_cached(&ce, &mut st.comp_head_cache).unwrap_or(false) {
                    self.chan_ctl.store_u64(ring::MED_STALLED, 1).ok();
                    break;
                }
                notify = Some(notify.unwrap_or(false) | (status != WcStatus::Success));
            }
            if f.on_wire != 0 {
                self.wire_bytes.fetch_sub(u64::from(f.on_wire), Ordering::Relaxed);
            }
            st.inflight.pop_front();
            st.retired += 1;
            if fatal {
                // After the completion: the library moves the QP to ERR when it polls the
                // error itself; this word covers an owner that never polls.
                self.set_error_request();
                st.errored = true;
                for g in st.inflight.iter_mut() {
                    g.state = Fs::Done(WcStatus::WrFlushErr);
                }
            }
        }
        if st.retired != retired_before {
            self.chan_ctl.store_u64(ring::MED_RETIRED, st.retired).ok();
        }
        if let Some(err) = notify {
            self.send_cq.notify(err);
        }
    }

    /// ERR: every WR in flight and in the send ring completes with WR_FLUSH_ERR.
    pub(crate) fn flush(&self, st: &mut ReqState) {
        st.wait_until = None;
        st.resend_from = None;
        st.probe = None;
        for f in st.inflight.iter_mut() {
            if f.state == Fs::Sent {
                f.state = Fs::Done(WcStatus::WrFlushErr);
            }
        }
        loop {
            self.retire(st);
            if !st.inflight.is_empty() || self.stalled(st) {
                if self.stalled(st) {
                    self.chan_ctl.store_u64(ring::MED_STALLED, 1).ok();
                }
                return;
            }
            let mut wr = SqEntry::default();
            if !self.sq.pop_into(&mut wr).unwrap_or(false) {
                return;
            }
            let opcode = WrOpcode::from_u32(wr.opcode).unwrap_or(WrOpcode::Send);
            let psn = st.next_psn;
            st.next_psn = psn.wrapping_add(1);
            st.inflight.push_back(InFlight::new(psn, wr, opcode, Fs::Done(WcStatus::WrFlushErr), Instant::now()));
        }
    }
}

/// Marks every SEND and WRITE sent up to PSN `through` (wrapping) done: the responder
/// executes in PSN order, so an acknowledgement covers everything before it. READs and
/// atomics wait for their own responses. Whether anything changed.
pub(crate) fn mark_acked(st: &mut ReqState, through: u32) -> bool {
    let mut any = false;
    for f in st.inflight.iter_mut() {
        if through.wrapping_sub(f.psn) as i32 <= -1 {
            break;
        }
        let plain = matches!(f.opcode, WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm);
        if plain && f.state == Fs::Sent {
            f.state = Fs::Done(WcStatus::Success);
            any = true;
        }
    }
    // (The QP moves: its requests' retries count from here, see `ReqState::progressed`.)
    st.progressed |= any;
    any
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(first_psn: u32, ops: &[WrOpcode]) -> ReqState {
        let mut st = ReqState::new(first_psn);
        for &opcode in ops {
            let psn = st.next_psn;
            st.next_psn = psn.wrapping_add(1);
            st.inflight.push_back(InFlight::new(psn, SqEntry::default(), opcode, Fs::Sent, Instant::now()));
        }
        st
    }

    fn done(st: &ReqState) -> Vec<bool> {
        st.inflight.iter().map(|f| f.state != Fs::Sent).collect()
    }

    #[test]
    fn a_cumulative_ack_completes_sends_and_writes_up_to_its_psn_only() {
        use WrOpcode::*;
        let mut st = state(10, &[Send, RdmaRead, RdmaWrite, AtomicFetchAndAdd, SendWithImm, RdmaWriteWithImm]);
        assert!(mark_acked(&mut st, 12));
        // READ and atomics wait for their own responses; nothing past 12 is touched.
        assert_eq!(done(&st), [true, false, true, false, false, false]);
        assert!(!mark_acked(&mut st, 12), "acknowledging again changes nothing");
        assert!(!mark_acked(&mut st, 9), "an older acknowledgement changes nothing");
        assert!(mark_acked(&mut st, 15));
        assert_eq!(done(&st), [true, false, true, false, true, true]);
    }

    #[test]
    fn a_cumulative_ack_works_across_psn_wrap() {
        use WrOpcode::*;
        let mut st = state(u32::MAX - 1, &[Send, Send, Send, Send]);
        assert!(mark_acked(&mut st, 0)); // u32::MAX - 1, u32::MAX, 0
        assert_eq!(done(&st), [true, true, true, false]);
    }

    #[test]
    fn an_ack_before_the_first_psn_in_flight_changes_nothing() {
        let mut st = state(100, &[WrOpcode::Send]);
        assert!(!mark_acked(&mut st, 99));
        assert!(!mark_acked(&mut st, 100u32.wrapping_sub(1 << 30)));
        assert_eq!(done(&st), [false]);
    }
}
