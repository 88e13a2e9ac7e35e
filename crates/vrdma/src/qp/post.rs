//! Posting sends: the checks every post makes first (state, capabilities), and the RC
//! post, which hands the WR to vrdmad's engine (mediated) or executes it (direct).

use vrdma_abi::verbs::{send_flags, QpState, WcStatus, WrOpcode};
use vrdma_core::qp_state::QpType;

use super::direct::Outcome;
use super::{Qp, QpInner, QpMut, SendWr};
use crate::error::{invalid, Error};
use crate::mediated::MedChannel;
use crate::spin::SpinGuard;

impl QpInner {
    /// What every `post_send` checks first (RC and UD alike): an error request is applied, a
    /// QP before RTS refuses the WR (EINVAL), a QP in ERR flushes it (`Ok(false)`), and the
    /// list and inline sizes must fit the QP's capabilities.
    #[inline(always)]
    pub(super) fn admit_send(&self, m: &mut QpMut, wr: &SendWr<'_>, op: &'static str) -> Result<bool, Error> {
        self.check_error_request(m);
        self.state_admits_send(m, op)?;
        // A mediated QP's older WRs are flushed by the engine: this one follows them.
        if m.state == QpState::Err && m.med.is_none() {
            self.send_cq.push_local_for(wr.wr_id, WcStatus::WrFlushErr, wr.opcode.wc_opcode(), self.qpn, 0);
            return Ok(false);
        }
        self.wr_fits(wr, op)?;
        Ok(true)
    }

    /// The start of every `post_send`: a QP of type `qp_type` (else EINVAL saying
    /// `wrong_type`) is locked and [admits](Self::admit_send) `wr`; `None` when the WR was
    /// flushed instead.
    #[inline(always)]
    pub(super) fn lock_for_send(
        &self,
        wr: &SendWr<'_>,
        op: &'static str,
        qp_type: QpType,
        wrong_type: &'static str,
    ) -> Result<Option<SpinGuard<'_, QpMut>>, Error> {
        if self.qp_type != qp_type {
            return Err(invalid(op, wrong_type));
        }
        let mut m = self.m.lock();
        if !self.admit_send(&mut m, wr, op)? {
            return Ok(None);
        }
        Ok(Some(m))
    }

    /// A send may be posted in any state from RTS on (in ERR it is flushed).
    #[inline(always)]
    fn state_admits_send(&self, m: &QpMut, op: &'static str) -> Result<(), Error> {
        match m.state {
            QpState::Reset | QpState::Init | QpState::Rtr => Err(invalid(op, format!("QP is in {:?}", m.state))),
            _ => Ok(()),
        }
    }

    /// The WR's gather list and inline data fit the QP's capabilities.
    #[inline(always)]
    fn wr_fits(&self, wr: &SendWr<'_>, op: &'static str) -> Result<(), Error> {
        if wr.sg_list.len() > self.cap.max_send_sge as usize {
            return Err(invalid(op, format!("{} SGEs exceed max_send_sge {}", wr.sg_list.len(), self.cap.max_send_sge)));
        }
        if wr.send_flags & send_flags::INLINE != 0 {
            let len: u64 = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
            if len > u64::from(self.cap.max_inline_data) {
                return Err(invalid(op, format!("{len} inline bytes exceed max_inline_data {}", self.cap.max_inline_data)));
            }
        }
        Ok(())
    }
}

impl Qp {
    /// `ibv_post_send` of one WR. Errors are immediate (EINVAL, ENOMEM) only for WRs that
    /// could not be posted; everything else completes with a status.
    pub fn post_send(&self, wr: &SendWr<'_>) -> Result<(), Error> {
        let q = &self.inner;
        let op = "post_send";
        let Some(mut m) = q.lock_for_send(wr, op, QpType::Rc, "a UD QP needs a destination (post_send_ud)")? else {
            return Ok(());
        };
        if q.qos_changed(&m) {
            q.apply_qos_keeping_order(&mut m);
        }
        if m.med.is_some() {
            let on_lane = if m.state == QpState::Rts && m.med.as_ref().is_some_and(MedChannel::has_lane) {
                q.lane_len(&mut m.last_mr, wr)
            } else {
                None
            };
            let c = m.med.as_mut().expect("checked");
            return if c.post(wr, q.sq_sig_all, on_lane)? { Ok(()) } else { Err(Error::QueueFull { op }) };
        }
        if !m.pending.is_empty() {
            if m.pending.len() >= q.cap.max_send_wr as usize {
                return Err(Error::QueueFull { op });
            }
            q.keep(&mut m, wr, None);
            return Ok(());
        }
        match q.execute(&mut m, wr, None) {
            Outcome::Done => {}
            Outcome::Rnr => {
                q.meter.add(vrdma_abi::ring::METER_RNR, 1);
                q.keep(&mut m, wr, None)
            }
            Outcome::NotReady | Outcome::Throttled(_) => q.keep(&mut m, wr, None),
            Outcome::Busy => {
                q.keep(&mut m, wr, None);
                q.wait_for_room();
            }
        }
        Ok(())
    }

    /// Whether [`Qp::post_send`] (or, on a UD QP, [`Qp::post_send_ud`]) would refuse `wr`
    /// now, without posting it: the checks that make a post fail (the QP's type and state,
    /// the gather list and inline data against its capabilities, a UD QP's opcodes), none
    /// of a post's effects. A batch that must be posted entirely or not at all (the drop-in's
    /// `ibv_wr_complete`) checks every WR with it first. A full send queue is not foreseen.
    pub fn check_send(&self, wr: &SendWr<'_>) -> Result<(), Error> {
        let q = &self.inner;
        let op = "post_send";
        let mut m = q.m.lock();
        q.check_error_request(&mut m);
        q.state_admits_send(&m, op)?;
        if m.state == QpState::Err && m.med.is_none() {
            return Ok(());
        }
        q.wr_fits(wr, op)?;
        if q.qp_type == QpType::Ud && !matches!(wr.opcode, WrOpcode::Send | WrOpcode::SendWithImm) {
            return Err(invalid(op, format!("{:?} on a UD QP (UD only sends)", wr.opcode)));
        }
        Ok(())
    }
}
