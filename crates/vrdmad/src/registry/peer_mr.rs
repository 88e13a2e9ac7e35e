//! A peer's MRs: mapping the MRs of a connected (or resolved UD) QP's PD, and copying
//! through a peer's copied MR.

use std::sync::Arc;

use vrdma_abi::control::{Reply, Request};
use vrdma_core::access::{check, MrBounds, Need};
use vrdma_core::sg::Atomic;

use super::mr::MrRec;
use super::{Registry, ReplyFds, RequestError};
use crate::procmem::ProcMem;

impl Registry {
    /// The MR `key` of the PD of `qpn`'s peer — its connected QP, or (`ud_dest`) a UD QP it
    /// resolved before — if there is one.
    fn peer_mr(&self, session: u64, qpn: u32, ud_dest: Option<u32>, key: u32) -> Result<Option<&MrRec>, RequestError> {
        let q = self.own_qp(session, qpn)?;
        let peer = match ud_dest {
            None => q.connected_to.and_then(|p| self.qps.get(&p)).ok_or(RequestError::NotConnected { qpn })?,
            Some(dest_qpn) => {
                if !q.ud_peers.contains(&dest_qpn) {
                    return Err(RequestError::UdDestNotResolved { qpn, dest_qpn });
                }
                self.qps.get(&dest_qpn).ok_or(RequestError::UdDestGone { qpn: dest_qpn })?
            }
        };
        Ok(self.mrs.get(&key).filter(|m| m.session == peer.session && m.pd == peer.pd))
    }

    /// `MapPeerMr` / `MapUdPeerMr`: the client gets the memfds of the peer's MR `key`.
    pub(super) fn map_peer_mr(&self, session: u64, qpn: u32, ud_dest: Option<u32>, key: u32) -> Result<(Reply, ReplyFds), RequestError> {
        let mr = self.peer_mr(session, qpn, ud_dest, key)?.ok_or(RequestError::NotPeerMr { key })?;
        let fds = mr.chunks.iter().map(|(_, fd)| fd.clone()).collect();
        let chunks = mr.chunks.iter().map(|(c, _)| *c).collect();
        Ok((Reply::PeerMr { addr: mr.addr, length: mr.length, access: mr.access, chunks }, fds))
    }

    /// The memory a copy request (`PeerMrWrite`, `PeerMrRead`, `PeerMrAtomic`) may access,
    /// after checking the QP, the peer's MR and its bounds and access rights. The copy itself
    /// ([`copy_access`]) needs no registry lock.
    pub fn copy_target(&self, session: u64, req: &Request) -> Result<Arc<ProcMem>, RequestError> {
        match *req {
            Request::PeerMrWrite { qpn, dest_qpn, key, addr, need_remote, ref data } => {
                let need = if need_remote { Need::RemoteWrite } else { Need::LocalWrite };
                self.copied_peer_mr(session, qpn, dest_qpn, key, addr, data.len() as u64, need)
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
        &self,
        session: u64,
        qpn: u32,
        dest_qpn: u32,
        key: u32,
        addr: u64,
        len: u64,
        need: Need,
    ) -> Result<Arc<ProcMem>, RequestError> {
        let mr = self.peer_mr(session, qpn, (dest_qpn != 0).then_some(dest_qpn), key)?.ok_or(RequestError::NotPeerMr { key })?;
        let mem = mr.proc_mem.clone().ok_or(RequestError::NotCopiedMr { key })?;
        check(&MrBounds { addr: mr.addr, length: mr.length, access: mr.access }, addr, len, need).map_err(|_| RequestError::MrDenies {
            key,
            need,
            len,
            addr,
        })?;
        Ok(mem)
    }
}

/// Performs a copy request on the memory [`Registry::copy_target`] checked. Errors: EFAULT
/// when the owner's memory is no longer there, EINVAL for a misaligned atomic.
pub fn copy_access(mem: &ProcMem, req: &Request) -> Result<Reply, RequestError> {
    match *req {
        Request::PeerMrWrite { addr, ref data, .. } => mem.write(addr, data).map(|()| Reply::Ok).map_err(RequestError::Copy),
        Request::PeerMrRead { addr, len, .. } => {
            let mut data = vec![0u8; len as usize];
            mem.read(addr, &mut data).map_err(RequestError::Copy)?;
            Ok(Reply::Bytes { data })
        }
        Request::PeerMrAtomic { addr, cmp_swap, compare_add, swap, .. } => {
            let op = if cmp_swap { Atomic::CmpSwap { compare: compare_add, swap } } else { Atomic::FetchAdd { add: compare_add } };
            mem.atomic(addr, op).map(|old| Reply::Atomic { old }).map_err(RequestError::Copy)
        }
        _ => Err(RequestError::NotCopyRequest),
    }
}
