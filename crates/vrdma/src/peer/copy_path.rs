//! RDMA READ and WRITE between this process's registered memory and a peer's copied MR
//! (one registered in place, which peers cannot map), moved by vrdmad itself
//! (`PeerMrCopy`, docs/architecture.md "Direct copies"): vrdmad copies between the peer's
//! memory and our MR (its mapping of our memfds, or our memory registered in place), and no
//! byte crosses the control socket. This is how a rendezvous on a freshly registered
//! buffer (UCX's `get_zcopy`/`put_zcopy`) reaches memory speed.
//!
//! A READ into our own anonymous memory registered in place is *staged*: vrdmad reads the
//! peer's bytes into the session's staging buffer, which we map read-only, and we copy them into our MR
//! ourselves; vrdmad would otherwise write our memory through `/proc/PID/mem`, a page at a
//! time through a kernel page (it never writes a process by PID: docs/security.md).
//!
//! When vrdmad cannot reach our MR (EOPNOTSUPP), the caller stages the bytes through the
//! socket as before (`Peer::span` of a copied MR); `VRDMA_DIRECT_COPY=0` makes it always do
//! so (to compare the two, or to step around a fault in the new path).

use std::os::fd::AsFd;

use vrdma_abi::control::{Reply, Request, MAX_DIRECT_COPY};
use vrdma_abi::ring::Sge;
use vrdma_abi::shm::{MemRegion, SharedMapping};
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
            // Our MR, if registered in place, for a READ staged through the session's buffer.
            let in_place = if to_peer { None } else { own_in_place(ctx, s) };
            while done < len {
                let n = (len - done).min(MAX_DIRECT_COPY as u64);
                // The staging buffer is held from the request until its bytes are copied out.
                let mut staging = in_place.map(|_| ctx.inner.copy_staging.lock());
                let buffer = staging.as_mut().and_then(|s| s.buffer(ctx)).copied();
                let staged = in_place.zip(buffer).map(|((own, base), buffer)| (own, base + done as usize, buffer));
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
                    staged: staged.is_some(),
                };
                match copy_call(ctx, "RDMA READ/WRITE (direct copy)", &req) {
                    Ok((Reply::Ok, _)) => {}
                    // vrdmad cannot reach our MR: the whole request goes through the socket
                    // (bytes moved already are moved again, the same).
                    Err(Error::Refused { errno: libc::EOPNOTSUPP, .. }) => return None,
                    // It has no staging buffer of ours after all: the same, and no more
                    // staging.
                    Err(Error::Refused { errno: libc::EINVAL, .. }) if staged.is_some() => {
                        if let Some(s) = staging.as_mut() {
                            **s = CopyStaging::Unavailable;
                        }
                        return None;
                    }
                    Err(Error::Refused { errno: libc::EPERM, .. }) => return Some(Err(WcStatus::LocProtErr)),
                    _ => return Some(Err(WcStatus::RemAccessErr)),
                }
                if let Some((own, offset, buffer)) = staged {
                    if own.copy_from_region(offset, &buffer, 0, n as usize).is_err() {
                        return Some(Err(WcStatus::LocProtErr));
                    }
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

/// Our MR of `sge` if it is anonymous memory registered in place (not moved onto memfds)
/// and covers the element with LOCAL_WRITE: its memory and the element's offset in it
/// (vrdmad checks the same again). A READ into it is staged. (Not for memory that cannot
/// move, file-backed or hugetlb: vrdmad checks its mappings before writing it and answers a
/// truncated file or an unmapped range with an error, where our own copy would fault.)
/// Whether the MR moves meanwhile does not matter: our copy writes through its addresses.
fn own_in_place(ctx: &Context, sge: &Sge) -> Option<(MemRegion, usize)> {
    // (No other lock is taken under the map's: deregistration takes an MR's pieces, then
    // the map's lock.)
    let mr = ctx.inner.mrs.read().get(&sge.lkey).cloned()?;
    if !mr.in_place.load(std::sync::atomic::Ordering::Acquire) {
        return None;
    }
    let offset = check(&mr.bounds, sge.addr, u64::from(sge.length), Need::LocalWrite).ok()?;
    Some((mr.mem, offset as usize))
}

/// The session's staging buffer, asked for at its first use (`CopyStaging`).
#[derive(Default)]
pub(crate) enum CopyStaging {
    /// Not asked for yet.
    #[default]
    Unasked,
    /// vrdmad gives none (an older daemon): READs into memory in place are written by
    /// vrdmad.
    Unavailable,
    /// Mapped read-only.
    Mapped(SharedMapping),
}

impl CopyStaging {
    /// The buffer, asked for and mapped if not yet.
    fn buffer(&mut self, ctx: &Context) -> Option<&MemRegion> {
        if matches!(self, CopyStaging::Unasked) {
            *self = match copy_call(ctx, "copy staging buffer", &Request::CopyStaging) {
                Ok((Reply::Ok, fds)) if fds.len() == 1 => {
                    SharedMapping::map_sealed(fds[0].as_fd(), MAX_DIRECT_COPY, false).map_or(CopyStaging::Unavailable, CopyStaging::Mapped)
                }
                // A limit for now (queue memory, requests pending): asked again next time.
                Err(Error::Refused { errno: libc::ENOMEM | libc::EAGAIN, .. }) => return None,
                _ => CopyStaging::Unavailable,
            };
        }
        match self {
            CopyStaging::Mapped(m) => Some(m.region()),
            _ => None,
        }
    }
}
