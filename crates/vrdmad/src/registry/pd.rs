//! Protection domains: a handle per PD, owned by the session that allocated it.

use vrdma_abi::control::Reply;

use super::{Registry, RequestError};

impl Registry {
    /// `AllocPd`, within the vNIC's PD limit.
    pub(super) fn alloc_pd(&mut self, session: u64) -> Result<Reply, RequestError> {
        let v = self.vnic_of(session)?;
        if v.usage.pds >= v.rec.limits.max_pd {
            return Err(RequestError::LimitReached { object: "PD", limit: v.rec.limits.max_pd });
        }
        v.usage.pds += 1;
        let h = self.handle();
        self.pds.insert(h, session);
        self.session(session)?.pds.insert(h);
        Ok(Reply::Handle { handle: h })
    }

    /// `DeallocPd`, refused while QPs, MRs or SRQs use the PD.
    pub(super) fn dealloc_pd(&mut self, session: u64, pd: u32) -> Result<Reply, RequestError> {
        self.own_pd(session, pd)?;
        let busy = self.qps.values().any(|q| q.pd == pd) || self.mrs.values().any(|m| m.pd == pd) || self.srqs.values().any(|s| s.pd == pd);
        if busy {
            return Err(RequestError::PdInUse { pd });
        }
        self.pds.remove(&pd);
        self.session(session)?.pds.remove(&pd);
        self.vnic_of(session)?.usage.pds -= 1;
        Ok(Reply::Ok)
    }

    /// Checks that `pd` is a PD of `session`.
    pub(super) fn own_pd(&self, session: u64, pd: u32) -> Result<(), RequestError> {
        match self.pds.get(&pd) {
            Some(s) if *s == session => Ok(()),
            _ => Err(RequestError::NotYourPd { pd }),
        }
    }
}
