//! `ibv_modify_qp` (transitions and attribute masks checked like hardware, via
//! `vrdma-core`), and entering ERR: from a fatal completion, an error request of the peer or
//! vrdmad, or vrdmad going away.

use std::sync::atomic::Ordering;

use vrdma_abi::control::Request;
use vrdma_abi::ring::{self, Take};
use vrdma_abi::verbs::{qp_attr, QpState, WcOpcode, WcStatus, WrOpcode};
use vrdma_core::qp_state::{check_modify, QpType};

use super::{Qp, QpAttr, QpInner, QpMut};
use crate::error::{invalid, Error};
use crate::mediated::MedChannel;
use crate::peer::{Connection, Peer};

impl QpInner {
    pub(super) fn publish_state(&self, s: QpState, min_rnr_timer: u8, med: Option<&MedChannel>) {
        let r = self.region.region();
        if let Ok(w) = r.atomic_u64(ring::QP_RESERVED) {
            w.store(u64::from(min_rnr_timer), Ordering::Release);
        }
        if let Ok(w) = r.atomic_u64(ring::QP_OWNER_STATE) {
            w.store(s as u64, Ordering::Release);
        }
        if let Some(c) = med {
            // The engine acts on state changes (ERR: flush what it holds).
            c.shared.ring();
        }
        self.state_hint.store(s as u8, Ordering::Release);
    }

    /// Applies an error request from the peer or vrdmad (peer gone, remote fatal error);
    /// whether the QP entered ERR.
    pub(super) fn check_error_request(&self, m: &mut QpMut) -> bool {
        let Ok(w) = self.region.region().atomic_u64(ring::QP_ERROR_REQUEST) else {
            return false;
        };
        let v = w.load(Ordering::Acquire);
        if v != 0 {
            w.store(0, Ordering::Release);
            if !matches!(m.state, QpState::Err | QpState::Reset) {
                if v == ring::QP_ERR_PEER_GONE && self.ctx.inner.hw_peer_loss.load(Ordering::Relaxed) {
                    m.peer_gone = true;
                } else {
                    self.enter_error(m);
                    return true;
                }
            }
        }
        false
    }

    /// Moves to ERR unless already there (or in RESET): a fatal completion was just polled.
    pub(crate) fn enter_error_if_live(&self) {
        let mut m = self.m.lock();
        if !matches!(m.state, QpState::Err | QpState::Reset) {
            self.enter_error(&mut m);
        }
    }

    /// vrdmad is gone (its control socket hung up): a mediated QP's engine went with it.
    /// The engine's unpolled completions are kept, every WR it had not retired completes
    /// with WR_FLUSH_ERR, and the QP moves to ERR (receives flush), so nothing waits for an
    /// engine that will never answer. Direct QPs keep working (shared memory).
    pub(crate) fn daemon_gone(&self) {
        let mut m = self.m.lock();
        let Some(ch) = m.med.take() else { return };
        self.send_cq.remove_mediated(&ch.shared);
        while let Some(e) = ch.shared.pop() {
            self.send_cq.push_local(crate::cq::comp_to_wc(&e, self.qpn));
        }
        for (wr_id, opcode) in ch.unretired() {
            let op = WrOpcode::from_u32(opcode).map(|o| o.wc_opcode()).unwrap_or(WcOpcode::Send);
            self.send_cq.push_local_for(wr_id, WcStatus::WrFlushErr, op, self.qpn, 0);
        }
        if !matches!(m.state, QpState::Err | QpState::Reset) {
            self.enter_error(&mut m);
            if let Some(ev) = &self.events {
                ev.raise(crate::AsyncEvent { kind: crate::AsyncEventKind::QpFatal, qpn: self.qpn });
            }
        }
    }

    /// Moves to ERR: every outstanding send WR completes with WR_FLUSH_ERR, and receives
    /// are flushed by the next poll of the receive CQ (after completions already delivered).
    fn enter_error(&self, m: &mut QpMut) {
        m.state = QpState::Err;
        self.publish_state(QpState::Err, m.attr.min_rnr_timer, m.med.as_ref());
        while let Some(p) = m.pending.pop_front() {
            self.send_cq.push_local_for(p.wr_id, WcStatus::WrFlushErr, p.opcode.wc_opcode(), self.qpn, 0);
        }
        m.staged_tx.abandon();
        if self.srq.is_none() {
            self.flush_recv.store(1, Ordering::Release);
        } else if let Some(ev) = &self.events {
            // Its receives come from the SRQ, and it takes no more of them.
            ev.raise(crate::AsyncEvent { kind: crate::AsyncEventKind::QpLastWqeReached, qpn: self.qpn });
        }
        // Wake a sleeper on the receive CQ so it polls the flushes.
        crate::cq::maybe_notify(self.recv_cq.region(), self.recv_cq.eventfd(), true);
    }

    /// Completes `wr_id` with an error and moves the QP to ERR.
    pub(super) fn fail(&self, m: &mut QpMut, wr_id: u64, opcode: WrOpcode, st: WcStatus) {
        self.send_cq.push_local_for(wr_id, st, opcode.wc_opcode(), self.qpn, 0);
        self.meter.add(vrdma_abi::ring::meter_status(st as u8), 1);
        self.enter_error(m);
    }
}

impl Qp {
    /// `ibv_modify_qp`: validates the transition and its attribute mask like hardware
    /// (EINVAL otherwise); RESET→…→RTR connects through vrdmad, which may refuse (tenant
    /// rules: ECONNREFUSED; unknown GID: EHOSTUNREACH).
    pub fn modify(&self, attr: &QpAttr, mask: u32) -> Result<(), Error> {
        let q = &self.inner;
        let mut m = q.m.lock();
        q.check_error_request(&mut m);
        let to_state = QpState::from_u32(attr.qp_state).ok_or_else(|| invalid("modify_qp", "bad qp_state"))?;
        let cur_given = QpState::from_u32(attr.cur_qp_state).unwrap_or(m.state);
        let from = m.state;
        let to = check_modify(q.qp_type, from, mask, to_state, cur_given)?;
        let op = "modify_qp";
        if mask & qp_attr::PORT != 0 && attr.port_num != 1 {
            return Err(invalid(op, format!("port {} does not exist", attr.port_num)));
        }
        if mask & qp_attr::PATH_MTU != 0 && !(1..=5).contains(&attr.path_mtu) {
            return Err(invalid(op, format!("path_mtu {} invalid", attr.path_mtu)));
        }
        if mask & qp_attr::MIN_RNR_TIMER != 0 && attr.min_rnr_timer > 31 {
            return Err(invalid(op, "min_rnr_timer > 31"));
        }
        if mask & qp_attr::TIMEOUT != 0 && attr.timeout > 31 {
            return Err(invalid(op, "timeout > 31"));
        }
        if mask & qp_attr::RETRY_CNT != 0 && attr.retry_cnt > 7 {
            return Err(invalid(op, "retry_cnt > 7"));
        }
        if mask & qp_attr::RNR_RETRY != 0 && attr.rnr_retry > 7 {
            return Err(invalid(op, "rnr_retry > 7"));
        }
        if mask & (qp_attr::MAX_QP_RD_ATOMIC) != 0 && attr.max_rd_atomic > 16 {
            return Err(invalid(op, "max_rd_atomic > 16"));
        }
        if mask & (qp_attr::MAX_DEST_RD_ATOMIC) != 0 && attr.max_dest_rd_atomic > 16 {
            return Err(invalid(op, "max_dest_rd_atomic > 16"));
        }
        if mask & qp_attr::AV != 0 {
            if !attr.is_global {
                return Err(invalid(op, "RoCE address vectors need a GRH (is_global) with the destination GID"));
            }
            if usize::from(attr.sgid_index) >= q.ctx.gids().len() {
                return Err(invalid(op, format!("sgid_index {} out of range", attr.sgid_index)));
            }
        }
        if from == QpState::Init && to == QpState::Rtr && q.qp_type == QpType::Rc {
            match Peer::connect(&q.ctx, q.qpn, q.me.clone(), attr.dgid, attr.dest_qp_num)? {
                Connection::Direct(peer) => m.peer = Some(peer),
                Connection::Mediated(c) => {
                    crate::mr::note_engine_peer();
                    q.send_cq.add_mediated(c.shared.clone());
                    m.med = Some(c);
                    q.ctx.watch_daemon(q.me.clone());
                }
            }
            m.peer_gone = false;
        }
        let a = &mut m.attr;
        macro_rules! set {
            ($bit:expr, $($f:ident),+) => { if mask & $bit != 0 { $(a.$f = attr.$f;)+ } };
        }
        set!(qp_attr::ACCESS_FLAGS, qp_access_flags);
        set!(qp_attr::PKEY_INDEX, pkey_index);
        set!(qp_attr::PORT, port_num);
        set!(qp_attr::QKEY, qkey);
        set!(qp_attr::AV, is_global, dgid, sgid_index, hop_limit);
        set!(qp_attr::PATH_MTU, path_mtu);
        set!(qp_attr::TIMEOUT, timeout);
        set!(qp_attr::RETRY_CNT, retry_cnt);
        set!(qp_attr::RNR_RETRY, rnr_retry);
        set!(qp_attr::RQ_PSN, rq_psn);
        set!(qp_attr::SQ_PSN, sq_psn);
        set!(qp_attr::MAX_QP_RD_ATOMIC, max_rd_atomic);
        set!(qp_attr::MAX_DEST_RD_ATOMIC, max_dest_rd_atomic);
        set!(qp_attr::MIN_RNR_TIMER, min_rnr_timer);
        set!(qp_attr::DEST_QPN, dest_qp_num);
        if mask & qp_attr::QKEY != 0 {
            if let Ok(w) = q.region.region().atomic_u64(ring::QP_QKEY) {
                w.store(u64::from(attr.qkey), Ordering::Release);
            }
        }
        match to {
            QpState::Err if from != QpState::Err => q.enter_error(&mut m),
            QpState::Reset => {
                // vrdmad first: once it answered, its engine pushes no completion of this
                // connection and no peer is connected any more, so what is emptied below
                // stays empty for the next connection.
                let _ = q.ctx.inner.ctl.call(op, &Request::SetQpState { qpn: q.qpn, state: QpState::Reset as u8 }, &[]);
                // Back to a clean QP: nothing outstanding, no peer, no completions.
                m.pending.clear();
                m.staged_tx.abandon();
                m.peer = None;
                // A former peer's staged SENDs are not for the next connection.
                q.staged_rx.lock().reset();
                let _ = q.staging.clear();
                if let Some(c) = m.med.take() {
                    q.send_cq.remove_mediated(&c.shared);
                }
                m.peer_gone = false;
                while let Ok(Some(_)) = q.comp.pop() {}
                if let Some(rq) = &q.rq {
                    while let Ok(Take::Entry(_)) = rq.take() {}
                }
                q.posted.lock().clear();
                q.rq_polled.store(m.rq_posted, Ordering::Release);
                q.flush_recv.store(0, Ordering::Release);
            }
            _ => {}
        }
        m.state = to;
        if let Ok(w) = q.region.region().atomic_u64(ring::QP_RETRY) {
            let a = &m.attr;
            w.store(u64::from(a.rnr_retry) | u64::from(a.retry_cnt) << 8 | u64::from(a.timeout) << 16, Ordering::Release);
        }
        q.publish_state(to, m.attr.min_rnr_timer, m.med.as_ref());
        Ok(())
    }
}
