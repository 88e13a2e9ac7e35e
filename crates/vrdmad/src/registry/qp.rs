//! Queue pairs: their shared region (receive ring and completion ring), their state in the
//! daemon (connection, mediated peers, UD destinations) and their teardown.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_abi::control::{QpCaps, Reply, Request};
use vrdma_abi::ring::{self, QpRegionLayout, RecvRing, RecvRingLayout};
use vrdma_abi::shm::SharedMapping;
use vrdma_abi::verbs::QpState;

use super::{make_region, signal_eventfd, Registry, ReplyFds, RequestError, MAX_INLINE, MAX_QUEUE_DEPTH, MAX_SGE, QPT_RC, QPT_UD};
use crate::engine::RecvSideSetup;

/// A QP as the daemon knows it.
pub(super) struct QpRec {
    pub(super) session: u64,
    pub(super) pd: u32,
    pub(super) send_cq: u32,
    pub(super) recv_cq: u32,
    pub(super) srq: u32,
    pub(super) region: Arc<OwnedFd>,
    pub(super) mapping: SharedMapping,
    /// Its own receive ring (entries, max SGE), unless it uses an SRQ.
    pub(super) rq: Option<(u32, u32)>,
    pub(super) comp_entries: u32,
    /// The same-host QP it is connected to directly.
    pub(super) connected_to: Option<u32>,
    /// 2 = RC, 4 = UD (`ibv_qp_type`).
    pub(super) qp_type: u8,
    /// UD QPs this (UD) QP resolved as destinations (it may map their receive MRs).
    pub(super) ud_peers: HashSet<u32>,
    pub(super) caps: QpCaps,
    /// Connected through the engine to this (daemon address, QPN).
    pub(super) remote: Option<(SocketAddr, u32)>,
    /// QPs of other daemons (or of this one, mediated) connected to this QP.
    pub(super) remote_peers: Vec<(SocketAddr, u32)>,
    /// A UD QP's datagram socket to the engine (client's end), once it resolved a
    /// destination on another host.
    pub(super) ud_socket: Option<Arc<OwnedFd>>,
    /// Highest counters seen (see `metering`).
    pub(super) meter_seen: vrdma_abi::ring::MeterWords,
    /// What the engine counted for it before it last let go of it (reset, reconnected).
    pub(super) engine_meter_kept: vrdma_abi::ring::MeterWords,
    /// Bytes of its region, charged to its vNIC's `max_ring_bytes`.
    pub(super) ring_bytes: u64,
    /// Whether it holds one of its vNIC's lanes.
    pub(super) lane: bool,
}

/// What `CreateQp` asks for.
pub(super) struct QpSpec {
    pub(super) pd: u32,
    pub(super) send_cq: u32,
    pub(super) recv_cq: u32,
    /// 0: none (the QP gets its own receive ring).
    pub(super) srq: u32,
    pub(super) qp_type: u8,
    pub(super) caps: QpCaps,
}

/// A QP being created: checked, and its queue memory charged to its vNIC, under the
/// registry lock; its region made without the lock ([`QpPlan::make_region`]: up to about
/// 40 MB initialised), then recorded under it again ([`Registry::finish_qp`]).
pub struct QpPlan {
    session: u64,
    spec: QpSpec,
    rq: Option<RecvRingLayout>,
    layout: QpRegionLayout,
    ring_bytes: u64,
}

/// A QP's region: its memfd and the daemon's mapping of it.
pub type QpRegion = (OwnedFd, SharedMapping);

impl QpPlan {
    /// Makes and initialises the QP's region (new memory, nobody else's: no lock needed).
    pub fn make_region(&self) -> Result<QpRegion, RequestError> {
        let (rq, layout) = (self.rq, self.layout);
        make_region(layout.size(), |m| match rq {
            Some(r) => RecvRing::new(m.region().subregion(layout.rq_offset(), r.size())?, r)?.init(),
            None => Ok(()),
        })
    }
}

impl Registry {
    /// `CreateQp`: the client gets the QP's region (receive and completion rings).
    pub(super) fn create_qp(&mut self, session: u64, spec: QpSpec) -> Result<(Reply, ReplyFds), RequestError> {
        let plan = self.prepare_qp(session, spec)?;
        let region = plan.make_region();
        self.finish_qp(plan, region)
    }

    /// The first step of `CreateQp` (see [`QpPlan`]); `req` must be a `CreateQp`.
    pub fn prepare_create_qp(&mut self, session: u64, req: Request) -> Result<QpPlan, RequestError> {
        let Request::CreateQp { pd, send_cq, recv_cq, srq, qp_type, caps } = req else {
            return Err(RequestError::NotCreateQp);
        };
        self.prepare_qp(session, QpSpec { pd, send_cq, recv_cq, srq, qp_type, caps })
    }

    fn prepare_qp(&mut self, session: u64, spec: QpSpec) -> Result<QpPlan, RequestError> {
        let QpSpec { pd, send_cq, recv_cq, srq, qp_type, caps } = spec;
        self.own_pd(session, pd)?;
        self.own_cq(session, send_cq)?;
        self.own_cq(session, recv_cq)?;
        if qp_type != QPT_RC && qp_type != QPT_UD {
            return Err(RequestError::QpTypeUnsupported { qp_type });
        }
        if caps.max_send_wr > MAX_QUEUE_DEPTH
            || caps.max_recv_wr > MAX_QUEUE_DEPTH
            || caps.max_send_sge > MAX_SGE
            || caps.max_recv_sge > MAX_SGE
            || caps.max_inline_data > MAX_INLINE
        {
            return Err(RequestError::QpCapsTooLarge { caps });
        }
        let srq_ring = if srq != 0 {
            match self.srqs.get(&srq) {
                Some(s) if s.session == session => Some((s.entries, s.max_sge)),
                _ => return Err(RequestError::NotYourSrq { srq }),
            }
        } else {
            None
        };
        let v = self.vnic_of(session)?;
        if v.usage.qps >= v.rec.limits.max_qp {
            return Err(RequestError::LimitReached { object: "QP", limit: v.rec.limits.max_qp });
        }
        let rq = if srq_ring.is_none() {
            Some(RecvRingLayout::with_headroom(caps.max_recv_wr.max(1) as usize, caps.max_recv_sge.max(1) as usize))
        } else {
            None
        };
        let comp_entries = match (rq, srq_ring) {
            (Some(r), _) => r.capacity,
            (None, Some((e, _))) => e as usize,
            (None, None) => 1,
        };
        let layout = QpRegionLayout::new(rq, comp_entries);
        // Queue memory is the daemon's, so it is charged to the vNIC, like registered bytes
        // (now: another request of the vNIC's sees it while the region is being made).
        let ring_bytes = layout.size() as u64;
        v.charge_ring(ring_bytes)?;
        Ok(QpPlan { session, spec: QpSpec { pd, send_cq, recv_cq, srq, qp_type, caps }, rq, layout, ring_bytes })
    }

    /// The last step of `CreateQp`: records the QP with its region, or gives back what
    /// [`Registry::prepare_create_qp`] charged.
    pub fn finish_qp(&mut self, plan: QpPlan, region: Result<QpRegion, RequestError>) -> Result<(Reply, ReplyFds), RequestError> {
        let QpPlan { session, spec, rq, layout, ring_bytes } = plan;
        let uncharge = |reg: &mut Registry| {
            if let Ok(v) = reg.vnic_of(session) {
                v.uncharge_ring(ring_bytes);
            }
        };
        let (region, mapping) = match region {
            Ok(r) => r,
            Err(e) => {
                uncharge(self);
                return Err(e);
            }
        };
        // (The session's own objects cannot have changed meanwhile: its requests are
        // handled one at a time. Its vNIC may be gone, or other sessions may have made QPs.)
        let checked = self.session(session).map(|_| ()).and_then(|()| {
            let v = self.vnic_of(session)?;
            if v.usage.qps >= v.rec.limits.max_qp {
                return Err(RequestError::LimitReached { object: "QP", limit: v.rec.limits.max_qp });
            }
            v.usage.qps += 1;
            Ok(())
        });
        if let Err(e) = checked {
            uncharge(self);
            return Err(e);
        }
        let QpSpec { pd, send_cq, recv_cq, srq, qp_type, caps } = spec;
        let qpn = self.new_qpn();
        let region = Arc::new(region);
        let rq_pair = rq.map(|r| (r.capacity as u32, r.max_sge as u32));
        let comp_entries = layout.comp.capacity as u32;
        self.qps.insert(
            qpn,
            QpRec {
                session,
                pd,
                send_cq,
                recv_cq,
                srq,
                region: region.clone(),
                mapping,
                rq: rq_pair,
                comp_entries,
                connected_to: None,
                qp_type,
                ud_peers: HashSet::new(),
                caps,
                remote: None,
                remote_peers: Vec::new(),
                ud_socket: None,
                meter_seen: [0; vrdma_abi::ring::METER_WORDS],
                engine_meter_kept: [0; vrdma_abi::ring::METER_WORDS],
                ring_bytes,
                lane: false,
            },
        );
        self.session(session)?.qps.insert(qpn);
        let (rq_entries, max_recv_sge) = rq_pair.unwrap_or((0, 0));
        Ok((Reply::Qp { qpn, rq_entries, max_recv_sge, comp_entries }, vec![region]))
    }

    /// A free 24-bit QPN; 0-15 are reserved (QP0, QP1 and friends).
    fn new_qpn(&mut self) -> u32 {
        loop {
            self.next_qpn = (self.next_qpn + 1) & 0x00ff_ffff;
            if self.next_qpn >= 16 && !self.qps.contains_key(&self.next_qpn) {
                return self.next_qpn;
            }
        }
    }

    /// `SetQpState`: only RESET matters to the daemon (it ends the QP's connection).
    pub(super) fn set_qp_state(&mut self, session: u64, qpn: u32, state: u8) -> Result<Reply, RequestError> {
        self.own_qp(session, qpn)?;
        if QpState::from_u32(u32::from(state)).is_none() {
            return Err(RequestError::BadQpState { state });
        }
        if state == QpState::Reset as u8 {
            self.disconnect_remote(qpn);
            if let Some(q) = self.qps.get_mut(&qpn) {
                q.connected_to = None;
            }
            self.revalidate_grants_of(qpn);
        }
        Ok(Reply::Ok)
    }

    /// `DestroyQp` of one of the session's QPs.
    pub(super) fn destroy_own_qp(&mut self, session: u64, qpn: u32) -> Result<Reply, RequestError> {
        self.own_qp(session, qpn)?;
        self.destroy_qp(qpn);
        Ok(Reply::Ok)
    }

    /// Destroys a QP: its peers are told, the engine lets go of it, its vNIC's count drops.
    pub(super) fn destroy_qp(&mut self, qpn: u32) {
        self.fold_qp_meter(qpn);
        self.notify_peers_gone(qpn);
        self.disconnect_remote(qpn);
        if let (Some(e), Some(QPT_UD)) = (&self.engine, self.qps.get(&qpn).map(|q| q.qp_type)) {
            e.detach_ud(qpn);
        }
        if let Some(q) = self.qps.remove(&qpn) {
            if let Some(s) = self.sessions.get_mut(&q.session) {
                s.qps.remove(&qpn);
                let vnic = s.vnic.clone();
                if let Some(v) = self.vnics.get_mut(&vnic) {
                    v.usage.qps -= 1;
                    v.uncharge_ring(q.ring_bytes);
                    if q.lane {
                        v.counters.lanes = v.counters.lanes.saturating_sub(1);
                    }
                }
            }
        }
        self.revalidate_grants_of(qpn);
    }

    /// Takes one of the vNIC's lanes for `session`'s QP `qpn`, unless it has `max_lanes`
    /// (refusals are counted; the QP then goes without a lane).
    pub fn reserve_lane(&mut self, session: u64, qpn: u32) -> bool {
        match self.own_qp(session, qpn) {
            Ok(q) if q.lane => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
        let Ok(v) = self.vnic_of(session) else { return false };
        if v.counters.lanes >= v.rec.limits.max_lanes {
            v.counters.refused_by_limits += 1;
            return false;
        }
        v.counters.lanes += 1;
        if let Some(q) = self.qps.get_mut(&qpn) {
            q.lane = true;
        }
        true
    }

    /// Gives back the lane [`Registry::reserve_lane`] took for `qpn` (none was opened).
    pub fn release_lane(&mut self, session: u64, qpn: u32) {
        let had = self.qps.get_mut(&qpn).filter(|q| q.session == session).is_some_and(|q| std::mem::replace(&mut q.lane, false));
        if had {
            if let Ok(v) = self.vnic_of(session) {
                v.counters.lanes = v.counters.lanes.saturating_sub(1);
            }
        }
    }

    /// The QP `qpn` of `session`.
    pub(super) fn own_qp(&self, session: u64, qpn: u32) -> Result<&QpRec, RequestError> {
        match self.qps.get(&qpn) {
            Some(q) if q.session == session => Ok(q),
            _ => Err(RequestError::NotYourQp { qpn }),
        }
    }

    /// The QP `qpn` of `session`, to change.
    pub(super) fn own_qp_mut(&mut self, session: u64, qpn: u32) -> Result<&mut QpRec, RequestError> {
        match self.qps.get_mut(&qpn) {
            Some(q) if q.session == session => Ok(q),
            _ => Err(RequestError::NotYourQp { qpn }),
        }
    }

    /// `q`'s receiving side, for the engine (`None` if its SRQ is gone).
    pub(super) fn recv_side(&self, q: &QpRec) -> Option<RecvSideSetup> {
        let srq = match q.srq {
            0 => None,
            h => {
                let s = self.srqs.get(&h)?;
                Some((s.region.clone(), RecvRingLayout::new(s.entries as usize, s.max_sge as usize)))
            }
        };
        Some(RecvSideSetup {
            qp_region: q.region.clone(),
            rq: q.rq.map(|(e, s)| RecvRingLayout::new(e as usize, s as usize)),
            comp_entries: q.comp_entries,
            srq,
        })
    }

    /// Tells every QP connected to `qpn` that its peer is gone.
    fn notify_peers_gone(&self, qpn: u32) {
        for q in self.qps.values().filter(|q| q.connected_to == Some(qpn)) {
            self.flag_peer_gone(q);
        }
    }

    /// Asks `q`'s owner to move it to ERR and flush (its peer is gone), waking it through
    /// its CQs' eventfds.
    pub(super) fn flag_peer_gone(&self, q: &QpRec) {
        if let Ok(w) = q.mapping.region().atomic_u64(ring::QP_ERROR_REQUEST) {
            w.store(ring::QP_ERR_PEER_GONE, Ordering::SeqCst);
        }
        for cq in [q.send_cq, q.recv_cq] {
            if let Some(c) = self.cqs.get(&cq) {
                signal_eventfd(&c.eventfd);
            }
        }
    }
}
