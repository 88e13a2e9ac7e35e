//! Shared receive queues: a receive ring in shared memory that several QPs of one PD take
//! receive buffers from.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use vrdma_abi::control::Reply;
use vrdma_abi::ring::{self, RecvRing, RecvRingLayout};

use super::{make_region, Registry, ReplyFds, RequestError, MAX_QUEUE_DEPTH, MAX_SGE};

/// An SRQ's ring.
pub(super) struct SrqRec {
    pub(super) session: u64,
    pub(super) pd: u32,
    pub(super) region: Arc<OwnedFd>,
    pub(super) entries: u32,
    pub(super) max_sge: u32,
    /// Bytes of its region, charged to its vNIC's `max_ring_bytes`.
    pub(super) ring_bytes: u64,
}

impl Registry {
    /// `CreateSrq`: the client gets the ring's memfd and its actual size.
    pub(super) fn create_srq(&mut self, session: u64, pd: u32, max_wr: u32, max_sge: u32) -> Result<(Reply, ReplyFds), RequestError> {
        self.own_pd(session, pd)?;
        if max_wr == 0 || max_wr > MAX_QUEUE_DEPTH || max_sge == 0 || max_sge > MAX_SGE {
            return Err(RequestError::SrqOutOfRange { max_wr, max_sge });
        }
        let v = self.vnic_of(session)?;
        if v.usage.srqs >= v.rec.limits.max_srq {
            return Err(RequestError::LimitReached { object: "SRQ", limit: v.rec.limits.max_srq });
        }
        let layout = RecvRingLayout::new(max_wr as usize, max_sge as usize);
        // The ring is the daemon's memory, charged like a QP's (up to ~37 MB at the largest
        // depth and SGE count).
        let ring_bytes = ring::srq_region_size(layout) as u64;
        v.charge_ring(ring_bytes)?;
        let made =
            make_region(ring::srq_region_size(layout), |m| RecvRing::new(m.region().subregion(ring::PAGE, layout.size())?, layout)?.init());
        let v = self.vnic_of(session)?;
        let region = match made {
            Ok((region, _map)) => region,
            Err(e) => {
                v.uncharge_ring(ring_bytes);
                return Err(e);
            }
        };
        v.usage.srqs += 1;
        let h = self.handle();
        let region = Arc::new(region);
        let (entries, max_sge) = (layout.capacity as u32, layout.max_sge as u32);
        self.srqs.insert(h, SrqRec { session, pd, region: region.clone(), entries, max_sge, ring_bytes });
        self.session(session)?.srqs.insert(h);
        Ok((Reply::Srq { srq: h, entries, max_sge }, vec![region]))
    }

    /// `DestroySrq`, refused while QPs use the SRQ.
    pub(super) fn destroy_srq(&mut self, session: u64, srq: u32) -> Result<Reply, RequestError> {
        match self.srqs.get(&srq) {
            Some(s) if s.session == session => {}
            _ => return Err(RequestError::NotYourSrq { srq }),
        }
        if self.qps.values().any(|q| q.srq == srq) {
            return Err(RequestError::SrqInUse { srq });
        }
        let ring_bytes = self.srqs.remove(&srq).map_or(0, |s| s.ring_bytes);
        self.session(session)?.srqs.remove(&srq);
        let v = self.vnic_of(session)?;
        v.usage.srqs -= 1;
        v.uncharge_ring(ring_bytes);
        Ok(Reply::Ok)
    }
}
