//! A peer's MRs: mapping the MRs of a connected (or resolved UD) QP's PD, and copying
//! through a peer's copied MR.
//!
//! A peer gets what the MR grants a remote party ([`Exposure`]): the memfds of an MR it may
//! write, read-only descriptors of one it may only read, nothing otherwise: an MR with no
//! remote rights (a receive buffer with LOCAL_WRITE only) is refused like a wrong key, since
//! SENDs reach it through its owner's staging ring, never through the peer's hands. Every request
//! naming a key that is not the peer's MR (or exceeding its rights) is counted on the
//! requester's vNIC (`bad_keys`) and throttled ([`super::key_guard`]).

use std::sync::Arc;
use std::time::Instant;

use vrdma_abi::control::{Reply, Request};
use vrdma_core::access::{check, MrBounds, Need};
use vrdma_core::sg::Atomic;

use super::key_guard::BadKeyNote;
use super::mr::{Exposure, MrRec};
use super::rehome::Grant;
use super::{Registry, ReplyFds, RequestError};
use crate::procmem::ProcMem;

impl Registry {
    /// The MR `key` of the PD of `qpn`'s peer — its connected QP, or (`ud_dest`) a UD QP it
    /// resolved before — if there is one.
    fn peer_mr(&self, session: u64, qpn: u32, ud_dest: Option<u32>, key: u32) -> Result<Option<&MrRec>, RequestError> {
        let q = self.own_qp(session, qpn)?;
        let peer = match ud_dest {
            // Both ends connected to each other: a QP reset (or reconnected elsewhere) is no
            // longer its former peer's peer.
            None => q
                .connected_to
                .and_then(|p| self.qps.get(&p))
                .filter(|p| p.connected_to == Some(qpn))
                .ok_or(RequestError::NotConnected { qpn })?,
            Some(dest_qpn) => {
                if !q.ud_peers.contains(&dest_qpn) {
                    return Err(RequestError::UdDestNotResolved { qpn, dest_qpn });
                }
                self.qps.get(&dest_qpn).ok_or(RequestError::UdDestGone { qpn: dest_qpn })?
            }
        };
        // A tenant rule withdrawn since the connection was made ends access to the peer's
        // MRs (the connection itself stays, as its QPs were set up under the rule).
        let (mine, theirs) = (self.tenant_of(session), self.tenant_of(peer.session));
        if let (Some(a), Some(b)) = (mine, theirs) {
            if !self.cluster.may_connect(a, b) {
                return Err(RequestError::TenantsNotAllowed { from: a.to_string(), to: b.to_string() });
            }
        }
        Ok(self.mrs.get(&key).filter(|m| m.session == peer.session && m.pd == peer.pd))
    }

    /// The tenant of `session`'s vNIC.
    pub(super) fn tenant_of(&self, session: u64) -> Option<&str> {
        let vnic = &self.sessions.get(&session)?.vnic;
        self.vnics.get(vnic).map(|v| v.rec.tenant.as_str())
    }

    /// [`Registry::peer_mr`], refused with EAGAIN while the caller's vNIC is throttled;
    /// a key that is not the peer's MR is counted (and throttles past a rate).
    fn guarded_peer_mr(&mut self, session: u64, qpn: u32, ud_dest: Option<u32>, key: u32) -> Result<&MrRec, RequestError> {
        let now = Instant::now();
        let v = self.vnic_of(session)?;
        if let Err(retry_ms) = v.key_guard.admit(now) {
            v.counters.bad_keys += 1;
            return Err(RequestError::BadKeysThrottled { retry_ms });
        }
        if self.peer_mr(session, qpn, ud_dest, key)?.is_none() {
            self.count_bad_key(session, qpn, key, now);
        }
        self.peer_mr(session, qpn, ud_dest, key)?.ok_or(RequestError::NotPeerMr { key })
    }

    /// Counts a refused peer-MR request of `session` (QP `qpn`, key `key`) on its vNIC, and
    /// logs the first of each interval and the one that starts throttling.
    fn count_bad_key(&mut self, session: u64, qpn: u32, key: u32, now: Instant) {
        let Ok(v) = self.vnic_of(session) else { return };
        v.counters.bad_keys += 1;
        let name = &v.rec.name;
        match v.key_guard.record_bad(now) {
            BadKeyNote::First => {
                log::warn!("vNIC {name} QP {qpn}: key {key:#x} refused (not its peer's MR, or beyond its rights); more this second are counted, not logged")
            }
            BadKeyNote::Throttling => log::warn!(
                "vNIC {name}: {} bad remote keys within {:?}: its peer-MR requests are refused (EAGAIN) for the rest of it",
                super::key_guard::BAD_KEYS_PER_INTERVAL,
                super::key_guard::INTERVAL
            ),
            BadKeyNote::Quiet => {}
        }
    }

    /// `MapPeerMr` / `MapUdPeerMr`: the client gets descriptors of the peer's MR `key`, with
    /// the protection the MR grants a remote party (see [`Exposure`]).
    pub(super) fn map_peer_mr(
        &mut self,
        session: u64,
        qpn: u32,
        ud_dest: Option<u32>,
        key: u32,
    ) -> Result<(Reply, ReplyFds), RequestError> {
        let mr = self.guarded_peer_mr(session, qpn, ud_dest, key)?;
        if mr.exposure == Exposure::None {
            self.count_bad_key(session, qpn, key, Instant::now());
            return Err(RequestError::MrNotExposed { key });
        }
        if mr.moving {
            return Err(RequestError::MrMoving { key });
        }
        let fds = mr.peer_fds.clone();
        let chunks = mr.chunks.iter().map(|(c, _)| *c).collect();
        let reply = Reply::PeerMr { addr: mr.addr, length: mr.length, access: mr.access, chunks };
        // Who holds the descriptors, and through which of the owner's QPs (see `rehome`).
        let via = match ud_dest {
            Some(dest_qpn) => Some(dest_qpn),
            None => self.qps.get(&qpn).and_then(|q| q.connected_to),
        };
        if let (Some(via), false) = (via, fds.is_empty()) {
            self.record_grant(key, Grant { requester: qpn, via });
        }
        Ok((reply, fds))
    }

    /// The memory a copy request (`PeerMrWrite`, `PeerMrRead`, `PeerMrAtomic`) may access,
    /// after checking the QP, the peer's MR and its bounds and access rights. The copy itself
    /// ([`copy_access`]) needs no registry lock.
    pub fn copy_target(&mut self, session: u64, req: &Request) -> Result<Arc<ProcMem>, RequestError> {
        match *req {
            // A peer writes only what grants REMOTE_WRITE, whatever it claims (`need_remote`
            // false once meant a receive buffer; SENDs are staged now).
            Request::PeerMrWrite { qpn, dest_qpn, key, addr, ref data, .. } => {
                self.copied_peer_mr(session, qpn, dest_qpn, key, addr, data.len() as u64, Need::RemoteWrite)
            }
            Request::PeerMrRead { qpn, dest_qpn, key, addr, len } => {
                self.copied_peer_mr(session, qpn, dest_qpn, key, addr, u64::from(len), Need::RemoteRead)
            }
            Request::PeerMrAtomic { qpn, dest_qpn, key, addr, .. } => {
                self.copied_peer_mr(session, qpn, dest_qpn, key, addr, 8, Need::RemoteAtomic)
            }
            _ => Err(RequestError::NotCopyRequest),
        }
    }

    /// The copied MR `key` of `qpn`'s peer (its connected QP, or UD destination `dest_qpn`),
    /// if `[addr, addr+len)` of it grants `need`: the owner's memory to access.
    #[allow(clippy::too_many_arguments)]
    pub fn copied_peer_mr(
        &mut self,
        session: u64,
        qpn: u32,
        dest_qpn: u32,
        key: u32,
        addr: u64,
        len: u64,
        need: Need,
    ) -> Result<Arc<ProcMem>, RequestError> {
        let mr = self.guarded_peer_mr(session, qpn, (dest_qpn != 0).then_some(dest_qpn), key)?;
        let mem = mr.proc_mem.clone().ok_or(RequestError::NotCopiedMr { key })?;
        let moving = mr.moving;
        if check(&MrBounds { addr: mr.addr, length: mr.length, access: mr.access }, addr, len, need).is_err() {
            self.count_bad_key(session, qpn, key, Instant::now());
            return Err(RequestError::MrDenies { key, need, len, addr });
        }
        // Its owner is moving it onto memfds: the requester asks again once it is there
        // (a copy admitted before waits for the move in `ProcMem`'s gate).
        if moving {
            return Err(RequestError::MrMoving { key });
        }
        self.count_copied(key, len);
        Ok(mem)
    }

    /// Counts `len` bytes copied through MR `key`'s owner; once peers have copied twice the
    /// MR's length, its owner is asked to share it if it was registered in place
    /// ([`Registry::ask_to_share`]). Moving costs about one copy of the MR there and one back
    /// at deregistration: a buffer used once (a rendezvous on a fresh buffer) is cheaper
    /// copied, one used again and again cheaper mapped, and waiting for the second use never
    /// pays more than twice the better of the two. A request counts as at least
    /// [`REQUEST_WORTH`] bytes: small accesses to a large MR (a latency test's) pay mostly
    /// the request, so they bring its move forward.
    fn count_copied(&mut self, key: u32, len: u64) {
        let Some(m) = self.mrs.get_mut(&key) else { return };
        m.copied = m.copied.saturating_add(len.max(REQUEST_WORTH));
        if m.copied >= m.length.saturating_mul(2) && m.chunks.is_empty() && !m.share_asked {
            self.ask_to_share(key);
        }
    }
}

/// What one copy request costs beyond its bytes (a round trip to vrdmad and a system call on
/// the owner's memory, ~20-60 us), in bytes a copy moves in that time.
const REQUEST_WORTH: u64 = 32 * 1024;

/// Performs a copy request on the memory [`Registry::copy_target`] checked. Errors: EFAULT
/// when the owner's memory is no longer there, EINVAL for a misaligned atomic.
///
/// A range being moved is not waited for (EBUSY, the requester asks again): a request that
/// waited here would hold its requester's control socket, which the requester's own moves
/// need, so two processes copying from each other while both move would wait for each other.
pub fn copy_access(mem: &ProcMem, req: &Request) -> Result<Reply, RequestError> {
    match *req {
        Request::PeerMrWrite { addr, ref data, .. } => {
            let a = mem.try_access(addr, data.len() as u64, true).map_err(RequestError::Copy)?;
            a.write_at(0, data).map(|()| Reply::Ok).map_err(RequestError::Copy)
        }
        Request::PeerMrRead { addr, len, .. } => {
            let mut data = vec![0u8; len as usize];
            let a = mem.try_access(addr, u64::from(len), false).map_err(RequestError::Copy)?;
            a.read_at(0, &mut data).map_err(RequestError::Copy)?;
            Ok(Reply::Bytes { data })
        }
        Request::PeerMrAtomic { addr, cmp_swap, compare_add, swap, .. } => {
            let op = if cmp_swap { Atomic::CmpSwap { compare: compare_add, swap } } else { Atomic::FetchAdd { add: compare_add } };
            mem.atomic_now(addr, op).map(|old| Reply::Atomic { old }).map_err(RequestError::Copy)
        }
        _ => Err(RequestError::NotCopyRequest),
    }
}
