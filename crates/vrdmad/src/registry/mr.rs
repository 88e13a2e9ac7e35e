//! Memory regions: the memfd chunks that back a client's buffer (shared with peers and the
//! engine), or, for memory that cannot be shared, the client's process memory to copy
//! through.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_abi::control::{MrChunk, Reply};
use vrdma_abi::{ring, shm};
use vrdma_core::access::MrBounds;

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
    /// Set for a copied MR (registered without chunks): its owner's memory.
    pub(super) proc_mem: Option<Arc<ProcMem>>,
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
        let page = ring::PAGE as u64;
        let span_start = addr & !(page - 1);
        let end = addr.checked_add(length).ok_or(RequestError::MrWraps)?;
        let proc_mem = if chunks.is_empty() { Some(self.copied_region(session, addr, length)?) } else { None };
        let span_len = end.div_ceil(page) * page - span_start;
        let mut at = 0u64;
        for (c, fd) in chunks.iter().zip(&fds) {
            if c.mr_offset != at || c.len == 0 || c.len % page != 0 || c.fd_offset % page != 0 {
                return Err(RequestError::ChunkMisplaced { chunk: *c });
            }
            let fd_end = c.fd_offset.checked_add(c.len).ok_or(RequestError::ChunkOverflows)?;
            shm::check_sealed(fd.as_fd(), fd_end as usize).map_err(RequestError::ChunkUnsealed)?;
            at += c.len;
        }
        if at != span_len && proc_mem.is_none() {
            return Err(RequestError::ChunksShort { covered: at, span: span_len });
        }
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
        let chunks = chunks.into_iter().zip(fds.into_iter().map(Arc::new)).collect();
        if proc_mem.is_some() {
            log::info!("session {session}: MR {key:#x} ({length} bytes at {addr:#x}) is copied through the process's memory");
        }
        self.mrs.insert(key, MrRec { session, pd, addr, length, access, chunks, proc_mem });
        self.session(session)?.mrs.insert(key);
        Ok(Reply::Mr { lkey: key, rkey: key })
    }

    /// `DeregMr`: the engine forgets the MR, and the MR epoch of the session's QPs moves on
    /// (so their peers revalidate the remote keys they cached).
    pub(super) fn dereg_mr(&mut self, session: u64, key: u32) -> Result<Reply, RequestError> {
        match self.mrs.get(&key) {
            Some(m) if m.session == session => {}
            _ => return Err(RequestError::NotYourMr { key }),
        }
        let m = self.mrs.remove(&key).expect("checked above");
        if let Some(e) = &self.engine {
            e.forget_mr(key);
        }
        self.session(session)?.mrs.remove(&key);
        let u = &mut self.vnic_of(session)?.usage;
        u.mrs -= 1;
        u.mr_bytes -= m.length;
        self.bump_mr_epoch(session);
        Ok(Reply::Ok)
    }

    /// The MR `key`, for the engine.
    pub fn mr_grant(&self, key: u32) -> Option<MrGrant> {
        self.mrs.get(&key).map(|m| MrGrant {
            session: m.session,
            pd: m.pd,
            bounds: MrBounds { addr: m.addr, length: m.length, access: m.access },
            chunks: m.chunks.clone(),
            proc_mem: m.proc_mem.clone(),
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

    fn bump_mr_epoch(&self, session: u64) {
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
