//! Taking MRs back from peers that lost the right to them while the MR stays registered:
//! their QP (or the owner's QP they reached it through) was destroyed, their session ended,
//! or a tenant rule was withdrawn.
//!
//! vrdmad remembers which requester QP was handed which MR's descriptors, and through
//! which of the owner's QPs ([`Grant`]). When a grant stops being valid, the MR's key is queued
//! for its owner and the owner's eventfd (sent with the `Hello` reply) is signalled; the
//! owner's library moves the MR onto new memfd pages (`RehomeMr`), and only peers that still
//! may access the MR get those (their cached mappings go stale with the MR epoch).

use std::collections::{BTreeSet, HashMap};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use vrdma_abi::control::{MrChunk, Reply, MAX_KEYS};
use vrdma_abi::fd::{new_eventfd, signal_eventfd};

use super::{Registry, ReplyFds, RequestError};

/// A requester QP was handed an MR's descriptors, reaching it through the owner's QP `via`
/// (the QP it is connected to, or a UD destination it resolved).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(super) struct Grant {
    pub(super) requester: u32,
    pub(super) via: u32,
}

/// A session's MRs to re-home, and how it is told.
pub(super) struct Rehomes {
    eventfd: Arc<OwnedFd>,
    pending: BTreeSet<u32>,
}

/// Sessions' pending re-homes, by session.
pub(super) type RehomeTable = HashMap<u64, Rehomes>;

impl Registry {
    /// The eventfd the owner's library waits on (sent with the `Hello` reply); `None` if
    /// none could be made (MRs are then not re-homed, as before).
    pub(super) fn rehome_eventfd(&mut self, session: u64) -> Option<Arc<OwnedFd>> {
        // Forget sessions that closed since (no hook in session teardown).
        let sessions = &self.sessions;
        self.rehomes.retain(|s, _| sessions.contains_key(s));
        let fd = Arc::new(new_eventfd().ok()?);
        self.rehomes.insert(session, Rehomes { eventfd: fd.clone(), pending: BTreeSet::new() });
        Some(fd)
    }

    /// Whether `g` still entitles its requester to the MRs of the session of `g.via`'s PD.
    fn grant_valid(&self, g: Grant) -> bool {
        let (Some(req), Some(via)) = (self.qps.get(&g.requester), self.qps.get(&g.via)) else { return false };
        let reached = req.connected_to == Some(g.via) || req.ud_peers.contains(&g.via);
        reached && self.tenant_of(req.session).zip(self.tenant_of(via.session)).is_none_or(|(a, b)| self.cluster.may_connect(a, b))
    }

    /// Drops the grants that are no longer valid and queues their MRs for re-homing by their
    /// owners (called after a QP is destroyed and after the cluster's rules change).
    pub fn revalidate_grants(&mut self) {
        let mut revoked: Vec<(u64, u32)> = Vec::new();
        let keys: Vec<u32> = self.mrs.iter().filter(|(_, m)| !m.granted.is_empty()).map(|(k, _)| *k).collect();
        for key in keys {
            let granted: Vec<Grant> = self.mrs[&key].granted.iter().copied().collect();
            let stale: Vec<Grant> = granted.into_iter().filter(|g| !self.grant_valid(*g)).collect();
            if stale.is_empty() {
                continue;
            }
            let m = self.mrs.get_mut(&key).expect("listed above");
            stale.iter().for_each(|g| {
                m.granted.remove(g);
            });
            if !m.chunks.is_empty() {
                revoked.push((m.session, key));
            }
        }
        for (session, key) in revoked {
            log::info!("session {session}: MR {key:#x} must move to new pages (a peer that mapped it lost its right)");
            if let Some(r) = self.rehomes.get_mut(&session) {
                r.pending.insert(key);
                signal_eventfd(r.eventfd.as_fd());
            }
        }
    }

    /// `TakeRehomes`: the session's MRs to re-home (those still registered).
    pub(super) fn take_rehomes(&mut self, session: u64) -> Result<Reply, RequestError> {
        let Some(r) = self.rehomes.get_mut(&session) else { return Ok(Reply::Keys { keys: Vec::new() }) };
        let keys: Vec<u32> = r.pending.iter().copied().take(MAX_KEYS).collect();
        keys.iter().for_each(|k| {
            r.pending.remove(k);
        });
        let mrs = &self.mrs;
        Ok(Reply::Keys { keys: keys.into_iter().filter(|k| mrs.get(k).is_some_and(|m| m.session == session)).collect() })
    }

    /// `BeginRehome`: peers asking for MR `key` of `session` wait (EBUSY) until its
    /// `RehomeMr`, and stop using their mappings (the owner's MR epoch moves on).
    pub(super) fn begin_rehome(&mut self, session: u64, key: u32) -> Result<Reply, RequestError> {
        match self.mrs.get_mut(&key) {
            Some(m) if m.session == session && !m.chunks.is_empty() => m.moving = true,
            _ => return Err(RequestError::NotYourMr { key }),
        }
        self.bump_mr_epoch(session);
        Ok(Reply::Ok)
    }

    /// `RehomeMr`: MR `key` of `session` now lives on `chunks`; every grant ends (peers that
    /// may still access it map it again), the engine maps it afresh, and the owner's MR epoch
    /// moves on. No chunks: the move was given up, the MR stays where it was.
    pub(super) fn rehome_mr(
        &mut self,
        session: u64,
        key: u32,
        chunks: Vec<MrChunk>,
        fds: Vec<OwnedFd>,
    ) -> Result<(Reply, ReplyFds), RequestError> {
        let (addr, length, exposure) = match self.mrs.get_mut(&key) {
            Some(m) if m.session == session && !m.chunks.is_empty() => {
                m.moving = false;
                (m.addr, m.length, m.exposure)
            }
            _ => return Err(RequestError::NotYourMr { key }),
        };
        if chunks.is_empty() {
            self.bump_mr_epoch(session);
            return Ok((Reply::Ok, Vec::new()));
        }
        let chunks = super::mr::checked_chunks(addr, length, chunks, fds)?;
        let peer_fds = super::mr::peer_fds(&chunks, exposure)?;
        let m = self.mrs.get_mut(&key).expect("checked above");
        m.chunks = chunks;
        m.peer_fds = peer_fds;
        m.granted.clear();
        if let Some(e) = &self.engine {
            e.forget_mr(key);
        }
        self.bump_mr_epoch(session);
        Ok((Reply::Ok, Vec::new()))
    }
}
