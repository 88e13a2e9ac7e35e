//! Memory regions: the memfd chunks that back a client's buffer (shared with peers and the
//! engine), or, for memory that cannot be shared, the client's process memory to copy
//! through.

use std::collections::HashSet;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_abi::control::{MrChunk, Reply};
use vrdma_abi::verbs::access;
use vrdma_abi::{ring, shm};
use vrdma_core::access::MrBounds;

use super::rehome::Grant;
use super::{Registry, RequestError};
use crate::engine::MrGrant;
use crate::procmem::ProcMem;

/// A registered MR.
pub(super) struct MrRec {
    pub(super) session: u64,
    pub(super) pd: u32,
    pub(super) addr: u64,
    pub(super) length: u64,
    pub(super) access: u32,
    pub(super) chunks: Vec<(MrChunk, Arc<OwnedFd>)>,
    /// What a connected peer gets for each chunk (see [`Exposure`]): the chunk's memfd, a
    /// read-only descriptor of it, or nothing.
    pub(super) peer_fds: Vec<Arc<OwnedFd>>,
    pub(super) exposure: Exposure,
    /// Who was handed `peer_fds` (checked again when QPs go or rules change).
    pub(super) granted: HashSet<Grant>,
    /// Its owner is moving it to new pages: peers asking for it get EBUSY meanwhile.
    pub(super) moving: bool,
    /// Set for a copied MR (registered without chunks): its owner's memory. It stays set
    /// when the owner later moves the MR onto memfds (`RehomeMr` of an MR registered in
    /// place), so that copy requests already under way still find it.
    pub(super) proc_mem: Option<Arc<ProcMem>>,
    /// Its owner was asked to move it onto memfds (registered in place, and peers copied twice
    /// its length through it: see `Registry::count_copied`).
    pub(super) share_asked: bool,
    /// Bytes peers copied through `proc_mem` (see `Registry::count_copied`).
    pub(super) copied: u64,
}

/// What a connected peer may map of an MR on the direct path: what a NIC would let a remote
/// party do with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Exposure {
    /// Nothing: no remote access (a SEND into a receive buffer is staged in the responder
    /// QP's region and scattered by its owner, never written by the peer).
    None,
    /// Read-only descriptors (`REMOTE_READ` alone): a shared writable mapping of them fails.
    ReadOnly,
    /// The memfds themselves: `REMOTE_WRITE` or `REMOTE_ATOMIC`.
    ReadWrite,
}

impl Exposure {
    pub(super) fn of(acc: u32) -> Exposure {
        if acc & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0 {
            Exposure::ReadWrite
        } else if acc & access::REMOTE_READ != 0 {
            Exposure::ReadOnly
        } else {
            Exposure::None
        }
    }
}

/// A new read-only descriptor of the memfd `fd` (through `/proc/self/fd`, which opens the
/// file afresh instead of duplicating the read-write description).
///
/// Without waiting: the owner of the file may hold a write lease on it, and an open of a
/// leased file otherwise waits for the lease to be given up (up to
/// `/proc/sys/fs/lease-break-time`, 45 s by default) with the registry locked for every vNIC.
/// A leased memfd is refused (EWOULDBLOCK).
fn reopen_read_only(fd: &OwnedFd) -> Result<OwnedFd, RequestError> {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path).map(OwnedFd::from).map_err(|e| {
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            RequestError::ChunkLeased
        } else {
            RequestError::ReadOnlyReopen(e)
        }
    })
}

/// The owner (uid and gid) vrdmad gives MR memfds: one no client runs as.
const NO_CLIENTS_ID: u32 = u32::MAX - 1;

/// Makes `fd`'s memfd readable by its owner only, so that a peer holding a read-only
/// descriptor cannot open it again read-write through `/proc/self/fd` (unless it may
/// override file permissions: `CAP_DAC_OVERRIDE`), and gives it an owner no client is, so
/// that no client can make it writable again: `fchmod` needs only ownership, and every
/// container of `vrdma run` has the same uid on the host (root inside, `USERNS_BASE`
/// outside; or root), so a peer with a read-only descriptor changed the mode back and opened
/// the MR read-write.
fn restrict_reopen(fd: &OwnedFd) {
    // SAFETY: fchmod(2) and fchown(2) on a descriptor we hold.
    if unsafe { libc::fchmod(fd.as_raw_fd(), 0o400) } != 0 {
        log::debug!("fchmod of an MR memfd: {}", std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fchown(fd.as_raw_fd(), NO_CLIENTS_ID, NO_CLIENTS_ID) } != 0 {
        log::debug!("fchown of an MR memfd: {}", std::io::Error::last_os_error());
    }
}

/// `chunks` (one per fd of `fds`) if they tile the page span of `[addr, addr+length)`, each
/// backed by a sealed memfd long enough.
pub(super) fn checked_chunks(
    addr: u64,
    length: u64,
    chunks: Vec<MrChunk>,
    fds: Vec<OwnedFd>,
) -> Result<Vec<(MrChunk, Arc<OwnedFd>)>, RequestError> {
    let page = ring::PAGE as u64;
    let span_start = addr & !(page - 1);
    let end = addr.checked_add(length).ok_or(RequestError::MrWraps)?;
    let span_len = end.div_ceil(page) * page - span_start;
    let mut at = 0u64;
    for (c, fd) in chunks.iter().zip(&fds) {
        if c.mr_offset != at || c.len == 0 || c.len % page != 0 || c.fd_offset % page != 0 {
            return Err(RequestError::ChunkMisplaced { chunk: *c });
        }
        let fd_end = c.fd_offset.checked_add(c.len).ok_or(RequestError::ChunkOverflows)?;
        shm::check_sealed(fd.as_fd(), fd_end as usize).map_err(RequestError::ChunkUnsealed)?;
        // (Sparse memfds may be 2^63 bytes long: lengths that add up past 2^64 must not wrap
        // around to the span's.)
        at = at.checked_add(c.len).ok_or(RequestError::ChunkOverflows)?;
    }
    if at != span_len {
        return Err(RequestError::ChunksShort { covered: at, span: span_len });
    }
    let chunks: Vec<_> = chunks.into_iter().zip(fds.into_iter().map(Arc::new)).collect();
    chunks.iter().for_each(|(_, fd)| restrict_reopen(fd));
    Ok(chunks)
}

/// The descriptors a peer gets for `chunks` under `exposure`.
pub(super) fn peer_fds(chunks: &[(MrChunk, Arc<OwnedFd>)], exposure: Exposure) -> Result<Vec<Arc<OwnedFd>>, RequestError> {
    match exposure {
        Exposure::None => Ok(Vec::new()),
        Exposure::ReadWrite => Ok(chunks.iter().map(|(_, fd)| fd.clone()).collect()),
        Exposure::ReadOnly => chunks.iter().map(|(_, fd)| reopen_read_only(fd).map(Arc::new)).collect(),
    }
}

/// What `RegMr` asks for, besides its chunks.
pub(super) struct MrSpec {
    pub(super) pd: u32,
    pub(super) addr: u64,
    pub(super) length: u64,
    pub(super) access: u32,
}

impl Registry {
    /// `RegMr`: `chunks` (one per fd of `fds`) must tile the page span of the region, each
    /// backed by a sealed memfd; no chunks registers a copied MR.
    pub(super) fn reg_mr(&mut self, session: u64, spec: MrSpec, chunks: Vec<MrChunk>, fds: Vec<OwnedFd>) -> Result<Reply, RequestError> {
        let MrSpec { pd, addr, length, access } = spec;
        self.own_pd(session, pd)?;
        // (Its page span too: every page computation below, vrdmad's and peers', rounds the
        // end up to a page, which must not wrap past 2^64.)
        addr.checked_add(length).and_then(|end| end.checked_next_multiple_of(ring::PAGE as u64)).ok_or(RequestError::MrWraps)?;
        let proc_mem = if chunks.is_empty() { Some(self.copied_region(session, addr, length)?) } else { None };
        let chunks = if proc_mem.is_some() { Vec::new() } else { checked_chunks(addr, length, chunks, fds)? };
        let exposure = Exposure::of(access);
        let peer_fds = peer_fds(&chunks, exposure)?;
        let v = self.vnic_of(session)?;
        let l = v.rec.limits;
        if v.usage.mrs >= l.max_mr {
            return Err(RequestError::LimitReached { object: "MR", limit: l.max_mr });
        }
        if v.usage.mr_bytes.saturating_add(length) > l.max_mr_bytes {
            return Err(RequestError::MrBytesLimit { limit: l.max_mr_bytes });
        }
        v.usage.mrs += 1;
        v.usage.mr_bytes += length;
        if proc_mem.is_some() {
            v.counters.copied_mrs += 1;
        }
        // rkeys are random, never sequential (a peer must not guess another MR's key).
        let key = loop {
            let k: u32 = rand::random::<u32>() | 1;
            if !self.mrs.contains_key(&k) {
                break k;
            }
        };
        if proc_mem.is_some() {
            // (Debug level: libraries register large anonymous buffers in place this way, as
            // often as registration caches miss.)
            log::debug!("session {session}: MR {key:#x} ({length} bytes at {addr:#x}) is copied through the process's memory");
        }
        let granted = HashSet::new();
        let rec = MrRec {
            session,
            pd,
            addr,
            length,
            access,
            chunks,
            peer_fds,
            exposure,
            granted,
            moving: false,
            proc_mem,
            share_asked: false,
            copied: 0,
        };
        self.mrs.insert(key, rec);
        self.offer_to_engine(key);
        self.session(session)?.mrs.insert(key);
        Ok(Reply::Mr { lkey: key, rkey: key })
    }

    /// `DeregMr`: the engine forgets the MR, and the MR epoch of the session's QPs moves on
    /// (so their peers revalidate the remote keys they cached).
    pub(super) fn dereg_mr(&mut self, session: u64, key: u32) -> Result<Reply, RequestError> {
        let m = match self.mrs.remove(&key) {
            Some(m) if m.session == session => m,
            Some(other) => {
                self.mrs.insert(key, other);
                return Err(RequestError::NotYourMr { key });
            }
            None => return Err(RequestError::NotYourMr { key }),
        };
        // Deregistered between `BeginRehome` and `RehomeMr`: the move will not end, so copies
        // into its range must stop waiting for it.
        if let (true, true, Some(p)) = (m.moving, m.chunks.is_empty(), &m.proc_mem) {
            let (start, len) = super::rehome::page_span(m.addr, m.length);
            p.end_move(start, len);
        }
        if let Some(e) = &self.engine {
            e.forget_mr(key);
        }
        self.own_maps.forget(key);
        self.session(session)?.mrs.remove(&key);
        let u = &mut self.vnic_of(session)?.usage;
        u.mrs -= 1;
        u.mr_bytes -= m.length;
        self.bump_mr_epoch(session);
        Ok(Reply::Ok)
    }

    /// Tells the engine how it may reach MR `key` now (registered, or moved to new memfds).
    pub(super) fn offer_to_engine(&self, key: u32) {
        if let (Some(e), Some(g)) = (&self.engine, self.mr_grant(key)) {
            e.offer_mr(key, g);
        }
    }

    /// The MR `key`, for the engine.
    pub fn mr_grant(&self, key: u32) -> Option<MrGrant> {
        self.mrs.get(&key).map(|m| MrGrant {
            session: m.session,
            pd: m.pd,
            bounds: MrBounds { addr: m.addr, length: m.length, access: m.access },
            chunks: m.chunks.clone(),
            // An MR moved onto memfds after registration in place is mapped, not copied.
            proc_mem: if m.chunks.is_empty() { m.proc_mem.clone() } else { None },
        })
    }

    /// The session's process memory for a copied MR over `[addr, addr+length)`, which must
    /// be readable there.
    fn copied_region(&mut self, session: u64, addr: u64, length: u64) -> Result<Arc<ProcMem>, RequestError> {
        if length == 0 {
            return Err(RequestError::EmptyMr);
        }
        let mem = match &self.session(session)?.proc_mem {
            Some(Ok(m)) => m.clone(),
            Some(Err(why)) => return Err(RequestError::NoProcessMemory { why: why.clone() }),
            None => return Err(RequestError::CopyUnsupported),
        };
        // (The range was checked against the process's mappings before the registry lock was
        // taken, see `Daemon::check_copied_mr`, and every access checks again.)
        let _ = addr;
        Ok(mem)
    }

    pub(super) fn bump_mr_epoch(&self, session: u64) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        for q in s.qps.iter().filter_map(|n| self.qps.get(n)) {
            if let Ok(w) = q.mapping.region().atomic_u64(ring::QP_MR_EPOCH) {
                w.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer gets what the MR grants a remote party: writable for remote write or atomics
    /// (and local write: SENDs are written by the sender), read-only for remote read alone.
    #[test]
    fn exposure_follows_the_access_flags() {
        use access::*;
        assert_eq!(Exposure::of(0), Exposure::None);
        assert_eq!(Exposure::of(REMOTE_READ), Exposure::ReadOnly);
        assert_eq!(Exposure::of(LOCAL_WRITE), Exposure::None);
        assert_eq!(Exposure::of(LOCAL_WRITE | REMOTE_READ), Exposure::ReadOnly);
        assert_eq!(Exposure::of(LOCAL_WRITE | REMOTE_WRITE), Exposure::ReadWrite);
        assert_eq!(Exposure::of(LOCAL_WRITE | REMOTE_ATOMIC | REMOTE_READ), Exposure::ReadWrite);
    }

    /// The read-only descriptor of an MR's memfd maps read-only only, and writes fail.
    #[test]
    fn read_only_descriptors_refuse_writes() {
        let fd = Arc::new(shm::create_memfd("vrdma-ro-test", 4096, true).unwrap());
        let chunks = vec![(MrChunk { mr_offset: 0, len: 4096, fd_offset: 0 }, fd)];
        let ro = peer_fds(&chunks, Exposure::ReadOnly).unwrap();
        // SAFETY: mmap of a descriptor we hold; unmapped below if it succeeds.
        let p =
            unsafe { libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, ro[0].as_raw_fd(), 0) };
        assert_eq!(p, libc::MAP_FAILED);
        // SAFETY: pwrite from a live buffer on a descriptor we hold.
        assert_eq!(unsafe { libc::pwrite(ro[0].as_raw_fd(), [1u8].as_ptr().cast(), 1, 0) }, -1);
        assert!(peer_fds(&chunks, Exposure::None).unwrap().is_empty());
    }
}
