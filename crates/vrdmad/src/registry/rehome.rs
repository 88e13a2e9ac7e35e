//! Taking MRs back from peers that lost the right to them while the MR stays registered:
//! their QP (or the owner's QP they reached it through) was destroyed, their session ended,
//! or a tenant rule was withdrawn.
//!
//! vrdmad remembers which requester QP was handed which MR's descriptors, and through
//! which of the owner's QPs ([`Grant`]). When a grant stops being valid, the MR's key is queued
//! for its owner and the owner's eventfd (sent with the `Hello` reply) is signalled; the
//! owner's library moves the MR onto new memfd pages (`RehomeMr`), and only peers that still
//! may access the MR get those (their cached mappings go stale with the MR epoch).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use vrdma_abi::control::{MrChunk, Reply, MAX_KEYS};
use vrdma_abi::fd::{new_eventfd, signal_eventfd};

use super::{Registry, ReplyFds, RequestError};

/// Whether MR `m` can move to new pages: it lives on memfds, or it was registered in place
/// (copied through its owner's memory, which the owner may move onto memfds).
fn movable(m: &super::mr::MrRec) -> bool {
    !m.chunks.is_empty() || m.proc_mem.is_some()
}

/// The pages of `[addr, addr+length)`: what the owner moves.
pub(super) fn page_span(addr: u64, length: u64) -> (u64, u64) {
    let page = vrdma_abi::ring::PAGE as u64;
    let start = addr & !(page - 1);
    (start, addr.saturating_add(length).div_ceil(page) * page - start)
}

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

/// Sessions' pending re-homes, and which MRs each QP holds or gave grants of.
#[derive(Default)]
pub(super) struct Rehoming {
    sessions: HashMap<u64, Rehomes>,
    /// MR keys by the QPs of their grants (requester and `via`): what to check again when
    /// one of them goes. Entries may outlive their MRs (checked and dropped then).
    by_qp: HashMap<u32, HashSet<u32>>,
}

impl Registry {
    /// The eventfd the owner's library waits on (sent with the `Hello` reply); `None` if
    /// none could be made (MRs are then not re-homed, as before).
    pub(super) fn rehome_eventfd(&mut self, session: u64) -> Option<Arc<OwnedFd>> {
        // Forget sessions that closed since (no hook in session teardown).
        let sessions = &self.sessions;
        self.rehomes.sessions.retain(|s, _| sessions.contains_key(s));
        let fd = Arc::new(new_eventfd().ok()?);
        self.rehomes.sessions.insert(session, Rehomes { eventfd: fd.clone(), pending: BTreeSet::new() });
        Some(fd)
    }

    /// Records that MR `key`'s descriptors were handed out under `grant`.
    pub(super) fn record_grant(&mut self, key: u32, grant: Grant) {
        if let Some(m) = self.mrs.get_mut(&key) {
            m.granted.insert(grant);
            for qpn in [grant.requester, grant.via] {
                self.rehomes.by_qp.entry(qpn).or_default().insert(key);
            }
        }
    }

    /// Whether `g` still entitles its requester to the MRs of the session of `g.via`'s PD.
    fn grant_valid(&self, g: Grant) -> bool {
        let (Some(req), Some(via)) = (self.qps.get(&g.requester), self.qps.get(&g.via)) else { return false };
        let connected = req.connected_to == Some(g.via) && via.connected_to == Some(g.requester);
        let reached = connected || req.ud_peers.contains(&g.via);
        reached && self.tenant_of(req.session).zip(self.tenant_of(via.session)).is_none_or(|(a, b)| self.cluster.may_connect(a, b))
    }

    /// [`Registry::revalidate_grants`] for the MRs whose grants involve QP `qpn` (destroyed
    /// or reset).
    pub(super) fn revalidate_grants_of(&mut self, qpn: u32) {
        if let Some(keys) = self.rehomes.by_qp.remove(&qpn) {
            self.revalidate(keys.into_iter().collect());
        }
    }

    /// Drops the grants that are no longer valid and queues their MRs for re-homing by their
    /// owners (called after the cluster's rules change: every MR with grants is checked).
    pub fn revalidate_grants(&mut self) {
        let keys: Vec<u32> = self.mrs.iter().filter(|(_, m)| !m.granted.is_empty()).map(|(k, _)| *k).collect();
        self.revalidate(keys);
    }

    fn revalidate(&mut self, keys: Vec<u32>) {
        let mut revoked: Vec<(u64, u32)> = Vec::new();
        for key in keys {
            let Some(m) = self.mrs.get(&key) else { continue };
            let granted: Vec<Grant> = m.granted.iter().copied().collect();
            let stale: Vec<Grant> = granted.into_iter().filter(|g| !self.grant_valid(*g)).collect();
            if stale.is_empty() {
                continue;
            }
            let Some(m) = self.mrs.get_mut(&key) else { continue };
            stale.iter().for_each(|g| {
                m.granted.remove(g);
            });
            if !m.chunks.is_empty() {
                revoked.push((m.session, key));
            }
        }
        for (session, key) in revoked {
            log::info!("session {session}: MR {key:#x} must move to new pages (a peer that mapped it lost its right)");
            if let Some(r) = self.rehomes.sessions.get_mut(&session) {
                r.pending.insert(key);
                signal_eventfd(r.eventfd.as_fd());
            }
        }
    }

    /// Queues MR `key`, registered in place, for its owner to move onto memfds (once): peers
    /// use it again and again, and copying each access through vrdmad costs them far more
    /// than mapping it.
    /// The owner's library tells the two kinds of queued keys apart (it knows which of its
    /// MRs are in place) and moves it at its next verb call, not from another thread.
    pub(super) fn ask_to_share(&mut self, key: u32) {
        let Some(m) = self.mrs.get_mut(&key) else { return };
        if m.share_asked || !m.chunks.is_empty() || m.proc_mem.is_none() {
            return;
        }
        m.share_asked = true;
        let session = m.session;
        if let Some(r) = self.rehomes.sessions.get_mut(&session) {
            r.pending.insert(key);
            signal_eventfd(r.eventfd.as_fd());
        }
    }

    /// `TakeRehomes`: the session's MRs to re-home (those still registered).
    pub(super) fn take_rehomes(&mut self, session: u64) -> Result<Reply, RequestError> {
        let Some(r) = self.rehomes.sessions.get_mut(&session) else { return Ok(Reply::Keys { keys: Vec::new() }) };
        let keys: Vec<u32> = r.pending.iter().copied().take(MAX_KEYS).collect();
        keys.iter().for_each(|k| {
            r.pending.remove(k);
        });
        let mrs = &self.mrs;
        Ok(Reply::Keys { keys: keys.into_iter().filter(|k| mrs.get(k).is_some_and(|m| m.session == session)).collect() })
    }

    /// `BeginRehome`: peers asking for MR `key` of `session` wait (EBUSY) until its
    /// `RehomeMr`, and stop using their mappings (the owner's MR epoch moves on).
    ///
    /// An MR registered in place (copied through the owner's memory) may be moved onto memfds
    /// the same way: copy requests are refused (EBUSY) from here on, and while some are still
    /// under way the answer is EBUSY too; the owner asks again until none is, so that no
    /// copied write lands in pages it has already copied.
    pub(super) fn begin_rehome(&mut self, session: u64, key: u32) -> Result<Reply, RequestError> {
        let busy = match self.mrs.get_mut(&key) {
            Some(m) if m.session == session && movable(m) => {
                // Only an MR still copied through its owner's memory has copies to wait for
                // (one moved onto memfds before is not copied any more).
                let (start, len) = page_span(m.addr, m.length);
                let busy = m.chunks.is_empty() && m.proc_mem.as_ref().is_some_and(|p| !p.begin_move(start, len));
                // Busy: nothing changes (the owner asks again, or gives up and leaves no
                // move behind that peers' copies would wait for).
                m.moving = !busy;
                busy
            }
            _ => return Err(RequestError::NotYourMr { key }),
        };
        if busy {
            return Err(RequestError::MrMoving { key });
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
            Some(m) if m.session == session && movable(m) => {
                m.moving = false;
                if let (true, Some(p)) = (m.chunks.is_empty(), &m.proc_mem) {
                    let (start, len) = page_span(m.addr, m.length);
                    p.end_move(start, len);
                }
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
        let m = self.mrs.get_mut(&key).ok_or(RequestError::NotYourMr { key })?;
        m.chunks = chunks;
        m.peer_fds = peer_fds;
        m.granted.clear();
        self.offer_to_engine(key);
        self.bump_mr_epoch(session);
        Ok((Reply::Ok, Vec::new()))
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use vrdma_abi::control::{QpCaps, Request, VERSION};
    use vrdma_abi::fd::drain_eventfd;
    use vrdma_abi::shm;

    use super::*;
    use crate::registry::gid_of;
    use crate::registry::tests::{handle, rec};
    use crate::store::RuleRecord;

    /// A session with a PD and an RC QP: (session, pd, qpn).
    fn side(r: &mut Registry, vnic: &str) -> (u64, u32, u32) {
        let s = r.open_session(vnic, None).unwrap();
        let pd = handle(r, s, Request::AllocPd);
        let cq = handle(r, s, Request::CreateCq { cqe: 16 });
        let caps = QpCaps { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let qp = handle(r, s, Request::CreateQp { pd, send_cq: cq, recv_cq: cq, srq: 0, qp_type: 2, caps });
        (s, pd, qp)
    }

    fn errno(r: Result<(Reply, ReplyFds), RequestError>) -> i32 {
        r.map(|(reply, _)| panic!("expected an error, got {reply:?}")).unwrap_err().errno()
    }

    /// A withdrawn rule ends the peer's grant: its MR is queued for the owner (whose eventfd
    /// fires), the peer is refused; while the owner moves it, entitled peers get EBUSY; after
    /// `RehomeMr` they get the new memfd.
    #[test]
    fn lost_rights_queue_a_rehome_and_moves_make_peers_wait() {
        let mut r = Registry::default();
        r.cluster_mut().local_host = "h1".into();
        for v in [rec("own", "red", 2, "h1"), rec("evil", "blue", 3, "h1")] {
            r.cluster_mut().vnics.insert(v.name.clone(), v.clone());
            r.add_vnic(v);
        }
        r.cluster_mut().rules.insert(RuleRecord::new("blue", "red"));
        let (so, pd, qo) = side(&mut r, "own");
        let (se, _, qe) = side(&mut r, "evil");
        let (_, fds) = r.handle_request(so, Request::Hello { version: u32::from(VERSION) }, vec![]).unwrap();
        let eventfd = fds.into_iter().next().expect("an eventfd with Hello");
        let gid = |ip: u8| gid_of(Ipv4Addr::new(198, 18, 0, ip));
        r.handle_request(so, Request::ConnectQp { qpn: qo, dgid: gid(3), dest_qpn: qe }, vec![]).unwrap();
        r.handle_request(se, Request::ConnectQp { qpn: qe, dgid: gid(2), dest_qpn: qo }, vec![]).unwrap();

        let chunk = MrChunk { mr_offset: 0, len: 4096, fd_offset: 0 };
        let memfd = shm::create_memfd("rehome-test", 4096, true).unwrap();
        let req = Request::RegMr { pd, addr: 0x10000, length: 4096, access: 0xf, chunks: vec![chunk] };
        let key = match r.handle_request(so, req, vec![memfd]).unwrap().0 {
            Reply::Mr { lkey, .. } => lkey,
            other => panic!("{other:?}"),
        };
        let (_, fds) = r.handle_request(se, Request::MapPeerMr { qpn: qe, key }, vec![]).unwrap();
        assert_eq!(fds.len(), 1);
        assert!(matches!(r.take_rehomes(so).unwrap(), Reply::Keys { keys } if keys.is_empty()));

        r.cluster_mut().rules.clear();
        r.revalidate_grants();
        assert_eq!(drain_eventfd(&*eventfd), 1, "the owner is told");
        assert!(matches!(r.take_rehomes(so).unwrap(), Reply::Keys { keys } if keys == vec![key]));
        assert_eq!(errno(r.handle_request(se, Request::MapPeerMr { qpn: qe, key }, vec![])), libc::ECONNREFUSED);

        // The rule back: the peer is entitled again; while the owner moves the MR it waits.
        r.cluster_mut().rules.insert(RuleRecord::new("blue", "red"));
        r.handle_request(so, Request::BeginRehome { key }, vec![]).unwrap();
        assert_eq!(errno(r.handle_request(se, Request::MapPeerMr { qpn: qe, key }, vec![])), libc::EBUSY);
        let memfd = shm::create_memfd("rehome-test-2", 4096, true).unwrap();
        r.handle_request(so, Request::RehomeMr { key, chunks: vec![chunk] }, vec![memfd]).unwrap();
        let (_, fds) = r.handle_request(se, Request::MapPeerMr { qpn: qe, key }, vec![]).unwrap();
        assert_eq!(fds.len(), 1);
        assert_eq!(r.status().iter().find(|v| v.record.name == "evil").unwrap().counters.bad_keys, 0);

        // The owner resets its QP: the connection is over, the peer's grant too.
        let reset = vrdma_abi::verbs::QpState::Reset as u8;
        r.handle_request(so, Request::SetQpState { qpn: qo, state: reset }, vec![]).unwrap();
        assert!(matches!(r.take_rehomes(so).unwrap(), Reply::Keys { keys } if keys == vec![key]));
        assert_eq!(errno(r.handle_request(se, Request::MapPeerMr { qpn: qe, key }, vec![])), libc::ENOTCONN);
        r.close_session(se);
        r.close_session(so);
    }
}
