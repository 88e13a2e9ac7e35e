//! What must hold of the registry between any two requests, whatever clients sent: checked
//! by the stateful fuzz target and by tests after hostile sequences.

use std::collections::HashMap;

use super::Registry;

impl Registry {
    /// Checks the registry's own bookkeeping: every object belongs to a live session and is
    /// listed by it, each vNIC's usage equals what its sessions hold, and its charged queue
    /// memory equals its queues'. (Limits are not checked here: lowered under live objects,
    /// they apply to new allocations only.)
    /// Err: the first inconsistency found.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        for (id, s) in &self.sessions {
            let listed =
                |what: &str, ok: bool, h: u32| if ok { Ok(()) } else { Err(format!("session {id} lists {what} {h} it does not own")) };
            for &h in &s.pds {
                listed("PD", self.pds.get(&h) == Some(id), h)?;
            }
            for &h in &s.cqs {
                listed("CQ", self.cqs.get(&h).is_some_and(|c| c.session == *id), h)?;
            }
            for &h in &s.srqs {
                listed("SRQ", self.srqs.get(&h).is_some_and(|q| q.session == *id), h)?;
            }
            for &h in &s.qps {
                listed("QP", self.qps.get(&h).is_some_and(|q| q.session == *id), h)?;
            }
            for &h in &s.mrs {
                listed("MR", self.mrs.get(&h).is_some_and(|m| m.session == *id), h)?;
            }
        }
        let owner = |what: &str, h: u32, session: u64| -> Result<(), String> {
            if self.sessions.contains_key(&session) {
                Ok(())
            } else {
                Err(format!("{what} {h} outlived its session {session}"))
            }
        };
        for (&h, &s) in &self.pds {
            owner("PD", h, s)?;
        }
        for (&h, c) in &self.cqs {
            owner("CQ", h, c.session)?;
        }
        for (&h, q) in &self.srqs {
            owner("SRQ", h, q.session)?;
            if !self.sessions[&q.session].pds.contains(&q.pd) {
                return Err(format!("SRQ {h} is of PD {} its session does not hold", q.pd));
            }
        }
        for (&h, q) in &self.qps {
            owner("QP", h, q.session)?;
            if let Some(peer) = q.connected_to {
                if self.qps.get(&peer).is_some_and(|p| p.connected_to.is_some_and(|back| back != h)) {
                    return Err(format!("QP {h} is connected to {peer}, which is connected elsewhere"));
                }
            }
        }
        for (&k, m) in &self.mrs {
            owner("MR", k, m.session)?;
        }
        let fds: u64 = self.mrs.values().map(|m| m.descriptors()).sum();
        if fds != self.descriptors_held {
            return Err(format!("{} descriptors charged in all, the MRs hold {fds}", self.descriptors_held));
        }

        let mut ring: HashMap<&str, u64> = HashMap::new();
        let vnic_of = |session: u64| self.sessions.get(&session).map(|s| s.vnic.as_str());
        let charged = self.qps.values().map(|q| (q.session, q.ring_bytes));
        let charged = charged.chain(self.srqs.values().map(|q| (q.session, q.ring_bytes)));
        let charged = charged.chain(self.cqs.values().map(|c| (c.session, c.ring_bytes)));
        let staging = self.sessions.iter().filter(|(_, s)| s.staging.is_some());
        for (session, bytes) in charged.chain(staging.map(|(&id, _)| (id, super::staging::STAGING_BYTES))) {
            if let Some(v) = vnic_of(session) {
                *ring.entry(v).or_default() += bytes;
            }
        }
        for (name, v) in &self.vnics {
            let mine: Vec<_> = self.sessions.values().filter(|s| &s.vnic == name).collect();
            let count = |f: &dyn Fn(&super::session::Session) -> usize| mine.iter().map(|s| f(s)).sum::<usize>() as u32;
            let held = (
                count(&|s| s.pds.len()),
                count(&|s| s.cqs.len()),
                count(&|s| s.srqs.len()),
                count(&|s| s.qps.len()),
                count(&|s| s.mrs.len()),
            );
            let usage = (v.usage.pds, v.usage.cqs, v.usage.srqs, v.usage.qps, v.usage.mrs);
            if held != usage {
                return Err(format!("vNIC {name}: usage (pd, cq, srq, qp, mr) {usage:?}, sessions hold {held:?}"));
            }
            if v.usage.clients as usize != mine.len() {
                return Err(format!("vNIC {name}: {} clients counted, {} sessions", v.usage.clients, mine.len()));
            }
            let fds: u64 = mine.iter().flat_map(|s| &s.mrs).filter_map(|k| self.mrs.get(k)).map(|m| m.descriptors()).sum();
            if v.counters.descriptors != fds {
                return Err(format!("vNIC {name}: {} descriptors charged, its MRs hold {fds}", v.counters.descriptors));
            }
            let want = ring.get(name.as_str()).copied().unwrap_or(0);
            if v.counters.ring_bytes != want {
                return Err(format!("vNIC {name}: {} ring bytes charged, its queues hold {want}", v.counters.ring_bytes));
            }
        }
        Ok(())
    }

    /// What of `vnic` its limits bound, with the limits: (what, amount, limit).
    #[doc(hidden)]
    pub fn limited_amounts(&self, vnic: &str) -> Vec<(&'static str, u64, u64)> {
        let Some(v) = self.vnics.get(vnic) else { return Vec::new() };
        let l = &v.rec.limits;
        vec![
            ("PDs", u64::from(v.usage.pds), u64::from(l.max_pd)),
            ("CQs", u64::from(v.usage.cqs), u64::from(l.max_cq)),
            ("QPs", u64::from(v.usage.qps), u64::from(l.max_qp)),
            ("MRs", u64::from(v.usage.mrs), u64::from(l.max_mr)),
            ("SRQs", u64::from(v.usage.srqs), u64::from(l.max_srq)),
            ("registered bytes", v.usage.mr_bytes, l.max_mr_bytes),
            ("ring bytes", v.counters.ring_bytes, l.max_ring_bytes),
            ("descriptors", v.counters.descriptors, u64::from(l.max_fds)),
        ]
    }
}
