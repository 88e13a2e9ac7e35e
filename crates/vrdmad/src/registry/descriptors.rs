//! Descriptors vrdmad holds for clients' MRs: every registration sends the memfds its pages
//! live in, and vrdmad keeps them (and makes read-only copies for peers) as long as the MR
//! lives. Without a bound, one tenant registering many small MRs would fill vrdmad's table of
//! open files and every other tenant's next session, queue or registration would fail. Each
//! vNIC is charged against its `max_fds`, and all of them together against a budget below
//! vrdmad's own open-files limit (what remains is for sessions, queues and the engine).

use std::sync::Arc;

use vrdma_abi::control::Reply;

use super::mr::MrRec;
use super::{Registry, ReplyFds, RequestError};

/// Descriptors kept out of the MRs' budget for everything else (sessions, queue memfds and
/// eventfds, the engine's sockets, the store).
pub const DESCRIPTOR_RESERVE: u64 = 4096;

impl MrRec {
    /// Descriptors this MR holds: its chunks' memfds and the read-only copies made for peers
    /// (a peer handed the chunk's own memfd costs nothing more).
    pub(super) fn descriptors(&self) -> u64 {
        let copies = self.peer_fds.iter().filter(|p| !self.chunks.iter().any(|(_, c)| Arc::ptr_eq(c, p)));
        (self.chunks.len() + copies.count()) as u64
    }
}

impl Registry {
    /// Sets the budget of descriptors for all MRs together (vrdmad: its open-files limit less
    /// [`DESCRIPTOR_RESERVE`]). Unbounded until set.
    pub fn set_descriptor_budget(&mut self, budget: u64) {
        self.descriptor_budget = Some(budget);
    }

    /// Runs a request that may change what `session`'s MR `key` (or, `None`, a new MR) holds,
    /// bringing `incoming` descriptors: refuses it first if they could pass a limit (a
    /// registration's chunks and as many read-only copies), then charges what it changed.
    pub(super) fn with_descriptors(
        &mut self,
        session: u64,
        key: Option<u32>,
        incoming: usize,
        request: impl FnOnce(&mut Registry) -> Result<(Reply, ReplyFds), RequestError>,
    ) -> Result<(Reply, ReplyFds), RequestError> {
        let want = 2 * incoming as u64;
        if want > 0 {
            let total = self.descriptors_held;
            let budget = self.descriptor_budget.unwrap_or(u64::MAX);
            let v = self.vnic_of(session)?;
            let (held, limit) = (v.counters.descriptors, u64::from(v.rec.limits.max_fds));
            let refusal = if held + want > limit {
                Some(RequestError::DescriptorLimit { limit, held, want })
            } else if total + want > budget {
                Some(RequestError::DescriptorLimit { limit: budget, held: total, want })
            } else {
                None
            };
            if let Some(e) = refusal {
                v.counters.refused_by_limits += 1;
                return Err(e);
            }
        }
        let held_by =
            |r: &Registry, key: Option<u32>| key.and_then(|k| r.mrs.get(&k)).filter(|m| m.session == session).map_or(0, MrRec::descriptors);
        let before = held_by(self, key);
        let result = request(self);
        let after = match &result {
            Ok((Reply::Mr { lkey, .. }, _)) => held_by(self, Some(*lkey)),
            _ => held_by(self, key),
        };
        self.charge_descriptors(session, after as i64 - before as i64);
        result
    }

    /// Charges (or, negative, gives back) descriptors to `session`'s vNIC and to the total.
    pub(super) fn charge_descriptors(&mut self, session: u64, delta: i64) {
        let apply = |n: &mut u64| *n = n.saturating_add_signed(delta);
        apply(&mut self.descriptors_held);
        if let Ok(v) = self.vnic_of(session) {
            apply(&mut v.counters.descriptors);
        }
    }

    /// Descriptors `session`'s MRs hold (given back when it closes).
    pub(super) fn session_descriptors(&self, session: u64) -> u64 {
        let Some(s) = self.sessions.get(&session) else { return 0 };
        s.mrs.iter().filter_map(|k| self.mrs.get(k)).map(MrRec::descriptors).sum()
    }
}
