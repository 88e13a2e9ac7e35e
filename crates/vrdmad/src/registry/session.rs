//! Client sessions: one per connection to a vNIC's control socket, owning every object it
//! created until it closes.

use std::collections::HashSet;
use std::sync::Arc;

use vrdma_abi::control::Usage;

use super::vnic::VnicState;
use super::{Registry, RequestError};
use crate::procmem::ProcMem;

/// What one client holds.
#[derive(Default)]
pub(super) struct Session {
    pub(super) vnic: String,
    pub(super) pds: HashSet<u32>,
    pub(super) cqs: HashSet<u32>,
    pub(super) srqs: HashSet<u32>,
    pub(super) qps: HashSet<u32>,
    pub(super) mrs: HashSet<u32>,
    /// The client's memory for the copying fallback, opened when it connected (so a PID
    /// reused later can never name another process), or why it could not be.
    pub(super) proc_mem: Option<Result<Arc<ProcMem>, String>>,
    /// Its staging buffer for staged direct copies, once asked for (`CopyStaging`).
    pub(super) staging: Option<super::staging::Staging>,
}

impl Registry {
    /// Opens a client session on `vnic`; `proc_mem` is the client's memory (bound to the
    /// process at the other end of its socket when it connected; needed only to register
    /// copied MRs). Fails when the vNIC is gone (`VnicDeleted`) or has `max_sessions` open
    /// (`SessionLimit`, counted).
    pub fn open_session(&mut self, vnic: &str, proc_mem: Option<Result<Arc<ProcMem>, String>>) -> Result<u64, RequestError> {
        let v = self.vnics.get_mut(vnic).ok_or(RequestError::VnicDeleted)?;
        if v.usage.clients >= v.rec.limits.max_sessions {
            v.counters.refused_by_limits += 1;
            return Err(RequestError::SessionLimit { limit: v.rec.limits.max_sessions });
        }
        v.usage.clients += 1;
        self.next_session += 1;
        let id = self.next_session;
        self.sessions.insert(id, Session { vnic: vnic.to_string(), proc_mem, ..Default::default() });
        Ok(id)
    }

    /// The memory of `session`'s process, for the copying fallback (`None` where the
    /// session has none).
    pub fn session_memory(&self, session: u64) -> Option<Result<Arc<ProcMem>, String>> {
        self.sessions.get(&session)?.proc_mem.clone()
    }

    /// Sessions open on `vnic`.
    pub fn sessions_of(&self, vnic: &str) -> Vec<u64> {
        self.sessions.iter().filter(|(_, s)| s.vnic == vnic).map(|(id, _)| *id).collect()
    }

    /// Counts a malformed message from `session`.
    pub fn count_bad_input(&mut self, session: u64) {
        if let Some(v) = self.sessions.get(&session).and_then(|s| self.vnics.get_mut(&s.vnic)) {
            v.counters.bad_requests += 1;
        }
    }

    /// Counts a connection the peer daemon refused.
    pub fn count_refused(&mut self, session: u64) {
        if let Ok(v) = self.vnic_of(session) {
            v.counters.refused_connections += 1;
        }
    }

    /// The vNIC `session` is open on.
    pub(super) fn vnic_of(&mut self, session: u64) -> Result<&mut VnicState, RequestError> {
        let name = &self.sessions.get(&session).ok_or(RequestError::NoSession)?.vnic;
        self.vnics.get_mut(name).ok_or(RequestError::VnicDeleted)
    }

    pub(super) fn session(&mut self, id: u64) -> Result<&mut Session, RequestError> {
        self.sessions.get_mut(&id).ok_or(RequestError::NoSession)
    }

    /// Releases everything a session holds (client exited or was killed).
    pub fn close_session(&mut self, session: u64) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        let qps: Vec<u32> = s.qps.iter().copied().collect();
        for q in qps {
            self.destroy_qp(q);
        }
        let descriptors = self.session_descriptors(session);
        self.charge_descriptors(session, -(descriptors as i64));
        let Some(s) = self.sessions.remove(&session) else {
            return;
        };
        for k in &s.mrs {
            self.mrs.remove(k);
            self.own_maps.forget(*k);
            if let Some(e) = &self.engine {
                e.forget_mr(*k);
            }
        }
        let mut ring_bytes = if s.staging.is_some() { super::staging::STAGING_BYTES } else { 0 };
        for h in &s.srqs {
            ring_bytes += self.srqs.remove(h).map_or(0, |q| q.ring_bytes);
        }
        for h in &s.cqs {
            ring_bytes += self.cqs.remove(h).map_or(0, |c| c.ring_bytes);
        }
        for h in &s.pds {
            self.pds.remove(h);
        }
        if let Some(v) = self.vnics.get_mut(&s.vnic) {
            v.uncharge_ring(ring_bytes);
            v.usage = Usage { clients: v.usage.clients.saturating_sub(1), ..Usage::default() };
            // Other sessions of the same vNIC keep their objects: recount from the tables.
            let others: Vec<u64> = self.sessions.iter().filter(|(_, o)| o.vnic == s.vnic).map(|(id, _)| *id).collect();
            for id in others {
                let o = &self.sessions[&id];
                v.usage.pds += o.pds.len() as u32;
                v.usage.cqs += o.cqs.len() as u32;
                v.usage.qps += o.qps.len() as u32;
                v.usage.srqs += o.srqs.len() as u32;
                v.usage.mrs += o.mrs.len() as u32;
                v.usage.mr_bytes += o.mrs.iter().filter_map(|k| self.mrs.get(k)).map(|m| m.length).sum::<u64>();
            }
        }
    }
}
