//! Completion queues: a shared ring (written by whoever completes work) and an eventfd to
//! wake the owner.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use vrdma_abi::control::Reply;
use vrdma_abi::fd::new_eventfd;
use vrdma_abi::{ring, shm};

use super::{Registry, ReplyFds, RequestError, MAX_QUEUE_DEPTH};

/// A CQ's shared memory and wakeup.
pub(super) struct CqRec {
    pub(super) session: u64,
    pub(super) region: Arc<OwnedFd>,
    pub(super) eventfd: Arc<OwnedFd>,
    /// Bytes of its region, charged to its vNIC's `max_ring_bytes`.
    pub(super) ring_bytes: u64,
}

impl Registry {
    /// `CreateCq`: the client gets the ring's memfd and the eventfd.
    pub(super) fn create_cq(&mut self, session: u64, cqe: u32) -> Result<(Reply, ReplyFds), RequestError> {
        if cqe == 0 || cqe > 4 * MAX_QUEUE_DEPTH {
            return Err(RequestError::CqeOutOfRange { cqe });
        }
        let v = self.vnic_of(session)?;
        if v.usage.cqs >= v.rec.limits.max_cq {
            return Err(RequestError::LimitReached { object: "CQ", limit: v.rec.limits.max_cq });
        }
        // The CQ page is the daemon's memory, charged like a QP's rings.
        let ring_bytes = ring::CQ_REGION_SIZE as u64;
        v.charge_ring(ring_bytes)?;
        let made = shm::create_memfd("vrdma-cq", ring::CQ_REGION_SIZE, true)
            .map_err(RequestError::QueueMemory)
            .and_then(|region| Ok((region, new_eventfd().map_err(RequestError::Eventfd)?)));
        let v = self.vnic_of(session)?;
        let (region, eventfd) = match made {
            Ok(m) => m,
            Err(e) => {
                v.uncharge_ring(ring_bytes);
                return Err(e);
            }
        };
        v.usage.cqs += 1;
        let h = self.handle();
        let rec = CqRec { session, region: Arc::new(region), eventfd: Arc::new(eventfd), ring_bytes };
        let fds = vec![rec.region.clone(), rec.eventfd.clone()];
        self.cqs.insert(h, rec);
        self.session(session)?.cqs.insert(h);
        Ok((Reply::Cq { cq: h }, fds))
    }

    /// `DestroyCq`, refused while QPs use the CQ.
    pub(super) fn destroy_cq(&mut self, session: u64, cq: u32) -> Result<Reply, RequestError> {
        self.own_cq(session, cq)?;
        if self.qps.values().any(|q| q.send_cq == cq || q.recv_cq == cq) {
            return Err(RequestError::CqInUse { cq });
        }
        let ring_bytes = self.cqs.remove(&cq).map_or(0, |c| c.ring_bytes);
        self.session(session)?.cqs.remove(&cq);
        let v = self.vnic_of(session)?;
        v.usage.cqs -= 1;
        v.uncharge_ring(ring_bytes);
        Ok(Reply::Ok)
    }

    /// The CQ `cq` of `session`.
    pub(super) fn own_cq(&self, session: u64, cq: u32) -> Result<&CqRec, RequestError> {
        match self.cqs.get(&cq) {
            Some(c) if c.session == session => Ok(c),
            _ => Err(RequestError::NotYourCq { cq }),
        }
    }
}
