//! The receive side: posting receives to the QP's ring, and polling the completions its
//! peers write (a staged SEND's payload scattered into its receive buffer first, see
//! `staged.rs`; then the flushes of a QP in ERR).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_abi::ring::{self, Take};
use vrdma_abi::verbs::{QpState, WcOpcode, WcStatus};

use super::posted::{Claim, Named};
use super::{Qp, QpInner, RecvWr};
use crate::cq::{comp_to_wc, Wc};
use crate::error::{invalid, Error};

impl QpInner {
    /// Whether [`QpInner::poll_inbound`] would find anything: a completion in the ring, an
    /// error request to act on, receives to flush. Only loads (the CQ's check without its
    /// lock, `recv_list.rs`); keep it in step with `poll_inbound`.
    #[inline]
    pub(crate) fn inbound_pending(&self) -> bool {
        !self.comp.is_empty()
            || !self.staging.is_empty()
            || self.flush_recv.load(Ordering::Acquire) != 0
            || (self.state_hint.load(Ordering::Acquire) != QpState::Err as u8
                && self.region.region().atomic_u64(ring::QP_ERROR_REQUEST).is_ok_and(|w| w.load(Ordering::Relaxed) != 0))
    }

    /// Hands inbound completions of this QP to `put` as completions `n..max` (called by the
    /// receive CQ's poll); the new count.
    pub(crate) fn poll_inbound<P: FnMut(usize, Wc)>(&self, mut n: usize, max: usize, put: &mut P) -> usize {
        let hint = self.state_hint.load(Ordering::Acquire);
        if hint != QpState::Err as u8 {
            if let Ok(w) = self.region.region().atomic_u64(ring::QP_ERROR_REQUEST) {
                if w.load(Ordering::Relaxed) != 0 {
                    let mut m = self.m.lock();
                    if self.check_error_request(&mut m) && m.med.is_some() && Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
                        // The engine wrote the fatal completion before asking for ERR, but
                        // this poll may have passed the engine's ring before it did: the
                        // receives flush on the next poll, after that completion (as a NIC
                        // reports the error before the flushes it causes). enter_error woke
                        // a sleeper on this CQ, so that poll comes.
                        return n;
                    }
                }
            }
        }
        // Staged payloads move into their receive buffers as they come (a SEND larger than
        // the ring arrives in parts, each waiting for room), before their completions.
        // Its lock only when there is something staged (a poll of RDMA WRITE completions, or
        // of nothing, costs one load more).
        let mut rx: Option<crate::spin::SpinGuard<'_, super::staged::StagedRx>> = None;
        if !self.staging.is_empty() {
            self.drain_staged(rx.insert(self.staged_rx.lock()));
        }
        let (mut responder_error, mut failed) = (false, false);
        while n < max {
            let Ok(Some(mut e)) = self.comp.pop() else { break };
            let mut claim = None;
            if e.flags & ring::COMP_STAGED != 0 {
                let (verdict, claimed) = self.staged_verdict(rx.get_or_insert_with(|| self.staged_rx.lock()));
                claim = claimed;
                if let Err(st) = verdict {
                    e.status = st as u8;
                    e.byte_len = 0;
                    responder_error = true;
                }
            }
            if !self.use_up_receive(&mut e, claim) {
                // It names no receive this process posted (a hostile peer wrote it): not
                // reported under a name the application never gave, and the QP fails.
                failed = true;
                continue;
            }
            if let Some(s) = &self.srq {
                s.consumed();
            } else {
                self.rq_polled.fetch_add(1, Ordering::AcqRel);
            }
            put(n, comp_to_wc(&e, self.qpn));
            n += 1;
            if e.status != WcStatus::Success as u8 && e.status != WcStatus::WrFlushErr as u8 {
                failed = true;
            }
        }
        drop(rx);
        if failed {
            // A responder-side error: the QP is in ERR by the time the owner sees it (after
            // the staged state's lock: modify takes them the other way round).
            self.enter_error_if_live();
        }
        if responder_error {
            // This side found the receive buffer bad (the requester could not check it): the
            // requester's QP fails too, as after a NAK.
            if let Some(peer) = self.m.lock().peer.as_ref() {
                peer.request_error();
            }
        }
        if self.flush_recv.load(Ordering::Acquire) != 0 && self.comp.is_empty() {
            self.flush_recv.store(0, Ordering::Release);
            if let Some(rq) = &self.rq {
                while let Ok(Take::Entry(_)) = rq.take() {}
                // Flushed under the names they were posted with (the ring's copies are the
                // peer's to rewrite), every one not completed.
                let ids = self.posted.lock().take_all();
                self.rq_polled.fetch_add(ids.len() as u64, Ordering::AcqRel);
                for id in ids {
                    let wc = Wc::new(id, WcStatus::WrFlushErr, WcOpcode::Recv, self.qpn);
                    if n < max {
                        put(n, wc);
                        n += 1;
                    } else {
                        self.recv_cq.push_local(wc);
                    }
                }
            }
        }
        n
    }
}

impl QpInner {
    /// The receives posted to this QP's queue, or to its SRQ's.
    pub(super) fn posted_recvs(&self) -> crate::spin::SpinGuard<'_, super::posted::PostedRecvs> {
        match &self.srq {
            Some(s) => s.copy.lock(),
            None => self.posted.lock(),
        }
    }

    /// Uses up the posted receive completion `e` names (`claim`: the one its staged message
    /// was scattered into), in this QP's queue or its SRQ's. A completion that names another
    /// is an error under the claimed receive's name; one that names none, under the oldest
    /// receive's. False: no receive is posted at all, nothing to report.
    fn use_up_receive(&self, e: &mut ring::CompEntry, claim: Option<Claim>) -> bool {
        let mut posted = self.posted_recvs();
        let named = match claim {
            Some(c) => posted.complete_claimed(c, e.wr_id),
            None if posted.complete(e.wr_id) => Named::Posted,
            None => Named::Nothing,
        };
        match named {
            Named::Posted => return true,
            Named::Other(name) => e.wr_id = name,
            Named::Nothing => {
                let Some(id) = posted.take_oldest() else { return false };
                e.wr_id = id;
            }
        }
        e.status = WcStatus::LocProtErr as u8;
        e.byte_len = 0;
        true
    }
}

impl Qp {
    /// `ibv_post_recv` of one WR.
    pub fn post_recv(&self, wr: &RecvWr<'_>) -> Result<(), Error> {
        self.post_recv_list(std::slice::from_ref(wr)).map_err(|(_, e)| e)
    }

    /// `ibv_post_recv` of a list: posts in order under one lock; on failure returns the index
    /// of the first WR not posted (`bad_wr`) with the error.
    pub fn post_recv_list(&self, wrs: &[RecvWr<'_>]) -> Result<(), (usize, Error)> {
        let q = &self.inner;
        let op = "post_recv";
        let Some(rq) = &q.rq else {
            return Err((0, invalid(op, "QP uses an SRQ")));
        };
        // Receive buffers registered in place move onto shared memory first (mr.rs).
        wrs.iter().for_each(|wr| crate::mr::share_receive_buffers(&q.ctx, wr.sg_list));
        let mut m = q.m.lock();
        for (i, wr) in wrs.iter().enumerate() {
            if m.state == QpState::Reset {
                return Err((i, invalid(op, "QP is in RESET")));
            }
            if wr.sg_list.len() > q.cap.max_recv_sge as usize {
                return Err((i, invalid(op, format!("{} SGEs exceed max_recv_sge {}", wr.sg_list.len(), q.cap.max_recv_sge))));
            }
            if m.state == QpState::Err {
                q.recv_cq.push_local_for(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, q.qpn, 0);
                continue;
            }
            if m.rq_posted - q.rq_polled.load(Ordering::Acquire) >= q.rq_capacity {
                return Err((i, Error::QueueFull { op }));
            }
            let flags = super::staged::receive_flags(&q.ctx, wr.sg_list, &mut m.last_recv_mr);
            match super::posted::post(&q.posted, rq, wr.wr_id, wr.sg_list, flags) {
                Ok(true) => m.rq_posted += 1,
                Ok(false) => return Err((i, Error::QueueFull { op })),
                Err(source) => return Err((i, Error::Shm { op, source })),
            }
        }
        Ok(())
    }
}
