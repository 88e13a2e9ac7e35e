//! Direct copies (`PeerMrCopy`): an RDMA READ or WRITE between a peer's copied MR and the
//! requester's own MR, performed by vrdmad without carrying the bytes through the control
//! socket (docs/architecture.md, "Direct copies").
//!
//! The peer's side is checked exactly as for `PeerMrRead`/`PeerMrWrite` (connected QP or
//! resolved UD destination, tenant rule, key, bounds, rights, a move under way, bad keys
//! counted and throttled; the bytes are counted towards sharing the MR). The requester's side
//! must be its own MR in the PD of the QP it names, covering the range with the rights the
//! access needs there (LOCAL_WRITE to receive a READ's bytes). vrdmad then reaches the
//! requester's bytes through its own mapping of the MR's memfds (one copy: the kernel copies
//! between the owner's pages and the mapping) or, for an MR registered in place, through the
//! requester's own process memory (two copies through a small buffer in vrdmad), or, for a
//! staged READ, into the session's staging buffer (`staging`), which the requester's library
//! copies into its MR itself. Both processes' memory is checked (identity, mappings) once
//! per request, not per piece.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use vrdma_abi::control::{MrChunk, Request};
use vrdma_abi::shm::SharedMapping;
use vrdma_core::access::{check, MrBounds, Need};

use super::{Registry, RequestError};
use crate::procmem::{with_bounce, ProcMem, ProcMemError, BOUNCE};

/// Why a direct copy was refused on the requester's side, or failed.
#[derive(Debug, thiserror::Error)]
pub enum CopyIntoError {
    /// `lkey` is not an MR of the requester in the PD of its QP.
    #[error("key {lkey:#x} is not the requester's MR in the PD of QP {qpn}")]
    NotOwnMr {
        /// The requester's QP.
        qpn: u32,
        /// The key it named as its own.
        lkey: u32,
    },
    /// The range is not within the requester's MR, or the MR lacks the rights it needs.
    #[error("{len} bytes at {addr:#x} of the requester's MR {lkey:#x} do not allow {need:?}")]
    OwnMrDenies {
        /// The requester's MR.
        lkey: u32,
        /// Start of the range.
        addr: u64,
        /// Bytes.
        len: u64,
        /// The access needed.
        need: Need,
    },
    /// The requester's MR is being moved to new pages: ask again.
    #[error("the requester's MR {lkey:#x} is moving")]
    OwnMrMoving {
        /// The requester's MR.
        lkey: u32,
    },
    /// vrdmad cannot reach the requester's MR (its memfds could not be mapped here): the
    /// requester copies through the socket instead.
    #[error("the requester's MR {lkey:#x} cannot be reached here: {why}")]
    Unreachable {
        /// The requester's MR.
        lkey: u32,
        /// Why.
        why: String,
    },
    /// A staged copy without a staging buffer (`CopyStaging` first), or of a WRITE.
    #[error("a staged copy needs the session's staging buffer, and is a READ")]
    NoStaging,
    /// Reading or writing the requester's memory failed.
    #[error("the requester's memory: {0}")]
    Own(#[source] ProcMemError),
    /// Reading or writing the peer's memory failed.
    #[error("the peer's memory: {0}")]
    Peer(#[source] ProcMemError),
}

impl CopyIntoError {
    /// The errno the requester gets: EPERM for its own side (its library completes the work
    /// request with a local protection error), EACCES/EFAULT for the peer's, EBUSY to ask
    /// again, EOPNOTSUPP to fall back on the copies through the socket.
    pub fn errno(&self) -> i32 {
        match self {
            CopyIntoError::OwnMrMoving { .. } | CopyIntoError::Own(ProcMemError::Moving { .. }) => libc::EBUSY,
            CopyIntoError::NotOwnMr { .. } | CopyIntoError::OwnMrDenies { .. } | CopyIntoError::Own(_) => libc::EPERM,
            CopyIntoError::NoStaging => libc::EINVAL,
            CopyIntoError::Unreachable { .. } => libc::EOPNOTSUPP,
            CopyIntoError::Peer(ProcMemError::Moving { .. }) => libc::EBUSY,
            CopyIntoError::Peer(_) => libc::EFAULT,
        }
    }

    /// Whether the request named what is not the requester's (counted as bad input).
    pub fn is_bad_input(&self) -> bool {
        matches!(self, CopyIntoError::NotOwnMr { .. } | CopyIntoError::NoStaging)
    }
}

/// The requester's memory, as vrdmad reaches it.
enum OwnMemory {
    /// Its MR's memfds mapped here; `offset` of the range within the mapping.
    Mapped { mapping: Arc<SharedMapping>, offset: usize },
    /// Its process memory (an MR registered in place); `addr` of the range there.
    Process { mem: Arc<ProcMem>, addr: u64 },
}

/// A checked direct copy, to perform without the registry lock ([`DirectCopy::run`]).
pub struct DirectCopy {
    owner: Arc<ProcMem>,
    addr: u64,
    own: OwnMemory,
    len: usize,
    to_peer: bool,
}

/// vrdmad's mappings of requesters' MRs, by key, each with the memfds it maps: an MR moved
/// to new memfds since (`RehomeMr`) is mapped again, a deregistered one dropped.
#[derive(Default)]
pub(super) struct OwnMaps {
    by_key: HashMap<u32, (Vec<Arc<OwnedFd>>, Arc<SharedMapping>)>,
}

/// Most MR mappings kept (each costs only address space; their pages are the MRs' own).
const MAX_MAPS: usize = 256;

impl OwnMaps {
    /// The mapping of MR `key` over `chunks` (its span starting at a page boundary).
    fn get(&mut self, key: u32, span_len: usize, chunks: &[(MrChunk, Arc<OwnedFd>)]) -> Result<Arc<SharedMapping>, String> {
        if let Some((fds, m)) = self.by_key.get(&key) {
            if fds.len() == chunks.len() && fds.iter().zip(chunks).all(|(a, (_, b))| Arc::ptr_eq(a, b)) {
                return Ok(m.clone());
            }
        }
        let mapping = SharedMapping::reserve(span_len).map_err(|e| e.to_string())?;
        for (c, fd) in chunks {
            mapping.place_fd(c.mr_offset as usize, fd.as_fd(), c.fd_offset as usize, c.len as usize, true).map_err(|e| e.to_string())?;
        }
        let mapping = Arc::new(mapping);
        if self.by_key.len() >= MAX_MAPS {
            self.by_key.clear();
        }
        self.by_key.insert(key, (chunks.iter().map(|(_, f)| f.clone()).collect(), mapping.clone()));
        Ok(mapping)
    }

    /// Drops the mapping of MR `key` (deregistered).
    pub(super) fn forget(&mut self, key: u32) {
        self.by_key.remove(&key);
    }
}

impl Registry {
    /// Checks a `PeerMrCopy` of `session`: the requester's MR first (refusals there are not
    /// counted as bad remote keys), then the peer's MR as a copy request does.
    pub fn direct_copy(&mut self, session: u64, req: &Request) -> Result<DirectCopy, RequestError> {
        let Request::PeerMrCopy { qpn, dest_qpn, key, addr, lkey, local_addr, len, to_peer, need_remote, staged } = *req else {
            return Err(RequestError::NotCopyRequest);
        };
        let own = self.own_copy_memory(session, qpn, lkey, local_addr, u64::from(len), to_peer, staged)?;
        let need = match (to_peer, need_remote) {
            (false, _) => Need::RemoteRead,
            (true, true) => Need::RemoteWrite,
            (true, false) => Need::LocalWrite,
        };
        let owner = self.copied_peer_mr(session, qpn, dest_qpn, key, addr, u64::from(len), need)?;
        Ok(DirectCopy { owner, addr, own, len: len as usize, to_peer })
    }

    /// The requester's own memory for `[addr, addr+len)` of its MR `lkey` (in the PD of its
    /// QP `qpn`), which the copy reads (`to_peer`) or writes; with `staged`, the session's
    /// staging buffer instead, the MR checked all the same (its library copies into it).
    #[allow(clippy::too_many_arguments)]
    fn own_copy_memory(
        &mut self,
        session: u64,
        qpn: u32,
        lkey: u32,
        addr: u64,
        len: u64,
        to_peer: bool,
        staged: bool,
    ) -> Result<OwnMemory, RequestError> {
        let pd = self.own_qp(session, qpn)?.pd;
        let m = self.mrs.get(&lkey).filter(|m| m.session == session && m.pd == pd).ok_or(CopyIntoError::NotOwnMr { qpn, lkey })?;
        let need = if to_peer { Need::LocalRead } else { Need::LocalWrite };
        if check(&MrBounds { addr: m.addr, length: m.length, access: m.access }, addr, len, need).is_err() {
            return Err(CopyIntoError::OwnMrDenies { lkey, addr, len, need }.into());
        }
        // (A staged READ does not touch the MR: a move of it need not hold the copy up.)
        if staged {
            let mapping = self.staging_of(session).filter(|_| !to_peer).ok_or(CopyIntoError::NoStaging)?;
            return Ok(OwnMemory::Mapped { mapping, offset: 0 });
        }
        if m.moving {
            return Err(CopyIntoError::OwnMrMoving { lkey }.into());
        }
        if m.chunks.is_empty() {
            let mem = m.proc_mem.clone().ok_or_else(|| CopyIntoError::Unreachable { lkey, why: "no process memory".into() })?;
            return Ok(OwnMemory::Process { mem, addr });
        }
        let page = vrdma_abi::ring::PAGE as u64;
        let span_start = m.addr & !(page - 1);
        let span_len = (m.addr + m.length).div_ceil(page) * page - span_start;
        let chunks = m.chunks.clone();
        let mapping = self.own_maps.get(lkey, span_len as usize, &chunks).map_err(|why| CopyIntoError::Unreachable { lkey, why })?;
        Ok(OwnMemory::Mapped { mapping, offset: (addr - span_start) as usize })
    }
}

impl DirectCopy {
    /// Performs the copy. Errors say whose memory failed.
    pub fn run(&self) -> Result<(), CopyIntoError> {
        if self.len == 0 {
            return Ok(());
        }
        let len = self.len as u64;
        match &self.own {
            OwnMemory::Mapped { mapping, offset } => {
                let peer = self.owner.try_access(self.addr, len, self.to_peer).map_err(CopyIntoError::Peer)?;
                let region = mapping
                    .region()
                    .subregion(*offset, self.len)
                    .map_err(|e| CopyIntoError::Unreachable { lkey: 0, why: e.to_string() })?;
                if self.to_peer { peer.write_from_region(&region) } else { peer.read_into_region(&region) }.map_err(CopyIntoError::Peer)
            }
            OwnMemory::Process { mem, addr } => {
                // Neither range is waited for if it is moving (EBUSY, asked again): see
                // `copy_access`.
                let peer = self.owner.try_access(self.addr, len, self.to_peer).map_err(CopyIntoError::Peer)?;
                let own = mem.try_access(*addr, len, !self.to_peer).map_err(CopyIntoError::Own)?;
                with_bounce(|buf| {
                    let mut at = 0u64;
                    while at < len {
                        let n = (len - at).min(BOUNCE as u64) as usize;
                        let b = &mut buf[..n];
                        if self.to_peer {
                            own.read_at(at, b).map_err(CopyIntoError::Own)?;
                            peer.write_at(at, b).map_err(CopyIntoError::Peer)?;
                        } else {
                            peer.read_at(at, b).map_err(CopyIntoError::Peer)?;
                            own.write_at(at, b).map_err(CopyIntoError::Own)?;
                        }
                        at += n as u64;
                    }
                    Ok(())
                })
            }
        }
    }
}

#[cfg(test)]
mod tests;
