//! RDMA READ and WRITE between this process's registered memory and a peer's copied MR
//! (one registered in place, which peers cannot map), moved by vrdmad itself
//! (`PeerMrCopy`, docs/architecture.md "Direct copies"): vrdmad copies between the peer's
//! memory and our MR (its mapping of our memfds, or our memory registered in place), and no
//! byte crosses the control socket. This is how a rendezvous on a freshly registered
//! buffer (UCX's `get_zcopy`/`put_zcopy`) reaches memory speed.
//!
//! When vrdmad cannot reach our MR (EOPNOTSUPP), the caller stages the bytes through the
//! socket as before (`Peer::span` of a copied MR); `VRDMA_DIRECT_COPY=0` makes it always do
//! so (to compare the two, or to step around a fault in the new path).

use vrdma_abi::control::{Reply, Request, MAX_DIRECT_COPY};
use vrdma_abi::ring::Sge;
use vrdma_abi::verbs::WcStatus;
use vrdma_core::access::{check, Need};

use std::sync::OnceLock;

use super::{copy_call, Peer};
use crate::device::Context;
use crate::error::Error;

impl Peer {
    /// Moves the bytes of a work request between the local scatter/gather list `sges`
    /// (registered memory, already checked by the caller for the access it needs) and
    /// `[addr, addr+total)` of peer MR `key` (`need`: `RemoteRead` for a READ, else a write
    /// into the peer) if that MR is copied: `Some` outcome. `None`: the MR is mapped (the
    /// caller copies between spans), or vrdmad cannot reach our memory (the caller stages).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn copy_direct(
        &mut self,
        ctx: &Context,
        my_qpn: u32,
        sges: &[Sge],
        key: u32,
        addr: u64,
        total: u64,
        need: Need,
    ) -> Option<Result<(), WcStatus>> {
        if total < DIRECT_COPY_MIN_BYTES || !enabled() {
            return None;
        }
        let epoch = self.mr_epoch();
        // A mapped MR used last: the usual case, answered without a call.
        if self.cached(epoch, key, addr, total, need).is_some() {
            return None;
        }
        let m = match self.peer_mr(ctx, my_qpn, key, epoch) {
            Ok(m) => m,
            Err(st) => return Some(Err(st)),
        };
        if m.mapping.is_some() {
            return None;
        }
        if let Err(st) = check(&m.bounds, addr, total, need) {
            return Some(Err(st));
        }
        let to_peer = need != Need::RemoteRead;
        let dest_qpn = self.ud_dest.unwrap_or(0);
        let mut at = addr;
        for s in sges.iter().filter(|s| s.length > 0) {
            let mut done = 0u64;
            let len = u64::from(s.length).min(addr + total - at);
            while done < len {
                let n = (len - done).min(MAX_DIRECT_COPY as u64);
                let req = Request::PeerMrCopy {
                    qpn: my_qpn,
                    dest_qpn,
                    key,
                    addr: at,
                    lkey: s.lkey,
                    local_addr: s.addr + done,
                    len: n as u32,
                    to_peer,
                    need_remote: need == Need::RemoteWrite,
                };
                match copy_call(ctx, "RDMA READ/WRITE (direct copy)", &req) {
                    Ok((Reply::Ok, _)) => {}
                    // vrdmad cannot reach our MR: the whole request goes through the socket
                    // (bytes moved already are moved again, the same).
                    Err(Error::Refused { errno: libc::EOPNOTSUPP, .. }) => return None,
                    Err(Error::Refused { errno: libc::EPERM, .. }) => return Some(Err(WcStatus::LocProtErr)),
                    _ => return Some(Err(WcStatus::RemAccessErr)),
                }
                done += n;
                at += n;
            }
            if at == addr + total {
                break;
            }
        }
        Some(Ok(()))
    }
}

/// Smallest work request moved by a direct copy. Below it one staged request (the bytes in
/// the request or its reply) is quicker, as vrdmad then checks one process, not two
/// (docs/measurements.md, "Direct copies by default").
const DIRECT_COPY_MIN_BYTES: u64 = 32 << 10;

/// Whether direct copies are on: unless `VRDMA_DIRECT_COPY=0` (read once).
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("VRDMA_DIRECT_COPY").map_or(true, |v| v.trim() != "0"))
}
