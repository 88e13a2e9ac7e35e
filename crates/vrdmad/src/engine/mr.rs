//! MRs as the engine reaches them: mapped from their memfds, or copied through their owner's memory.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vrdma_abi::shm::SharedMapping;
use vrdma_abi::verbs::WcStatus;
use vrdma_abi::wire::FrameHeader;
use vrdma_core::access::MrBounds;
use vrdma_core::sg::{self, Atomic};

use super::connection::Conn;
use super::{Engine, MrGrant};
use crate::procmem::{Key, ProcMem, ProcMemError, Slow, What, ENGINE_WAIT};

/// How the engine reaches an MR's bytes.
pub(crate) enum MrMemory {
    /// Its memfds, mapped into vrdmad.
    Mapped(SharedMapping),
    /// Copied through its owner's memory.
    Copied(Arc<ProcMem>),
}

/// An MR as the engine accesses it. Offsets are from the page below its first byte.
pub(crate) struct MappedMr {
    pub(crate) mem: MrMemory,
    pub(crate) span_start: u64,
    pub(crate) bounds: MrBounds,
    pub(crate) session: u64,
    pub(crate) pd: u32,
}

/// Bytes a copied MR moves per access of its owner's memory.
pub(crate) const COPY_STEP: usize = 256 * 1024;

/// A copied MR's owner cannot be reached now: it is moving the range onto shared memory
/// (`BeginRehome`), or its memory did not answer within [`procmem::ENGINE_WAIT`] (the access
/// goes on on its agent, see `procmem::agent`). The engine's threads (the doorbell, a
/// connection's reader) serve every vNIC and never wait for that: a request is answered
/// "not ready" (the requester tries again until its transport timeout), a frame to send
/// waits for a later pump. Before, an owner that held its memory-map lock (a loop of
/// `mprotect` over gigabytes) held them for as long as each access waited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NotNow;

/// Who accesses an MR, so that an access of a copied MR that outlasts the wait is
/// collected by the same request when it comes again (never done twice): a request (PSN) of
/// a stream (one side of an engine QP, see [`new_stream`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Asker {
    pub(crate) stream: u64,
    pub(crate) psn: u32,
}

static NEXT_STREAM: AtomicU64 = AtomicU64::new(1);

/// A stream number never used before in this daemon.
pub(crate) fn new_stream() -> u64 {
    NEXT_STREAM.fetch_add(1, Ordering::Relaxed)
}

/// What became of bytes received for an MR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stored {
    Yes,
    /// Consumed, but not stored: a copied MR's owner unmapped it (breaking the verbs
    /// contract).
    Unstorable,
    /// Consumed, not (all) stored: see [`NotNow`].
    NotNow,
}

impl MappedMr {
    /// Whether its bytes are reached through its owner's memory (see [`NotNow`]).
    pub(crate) fn is_copied(&self) -> bool {
        matches!(self.mem, MrMemory::Copied(_))
    }

    fn key(&self, who: Asker, off: usize, len: usize, what: What) -> Key {
        Key { stream: who.stream, psn: who.psn, addr: self.span_start + off as u64, len: len as u64, what }
    }

    /// Reads `buf.len()` bytes at `off` (a mapped MR's only: test and sealing helper).
    pub(crate) fn read(&self, off: usize, buf: &mut [u8]) -> Result<(), WcStatus> {
        match &self.mem {
            MrMemory::Mapped(m) => m.region().read_into(off, buf).map_err(|_| WcStatus::LocProtErr),
            MrMemory::Copied(_) => Err(WcStatus::LocProtErr),
        }
    }

    /// Reads `buf.len()` bytes at `off` for `who`.
    pub(crate) fn read_for(&self, who: Asker, off: usize, buf: &mut [u8]) -> Result<Result<(), WcStatus>, NotNow> {
        match &self.mem {
            MrMemory::Mapped(m) => Ok(m.region().read_into(off, buf).map_err(|_| WcStatus::LocProtErr)),
            MrMemory::Copied(_) => Ok(self.read_owned_for(who, off, buf.len())?.map(|b| buf.copy_from_slice(&b))),
        }
    }

    /// `len` bytes at `off` for `who`, in a buffer of their own (a copied MR's: the one its
    /// owner's agent read them into).
    pub(crate) fn read_owned_for(&self, who: Asker, off: usize, len: usize) -> Result<Result<Vec<u8>, WcStatus>, NotNow> {
        match &self.mem {
            MrMemory::Mapped(m) => {
                let mut b = vec![0u8; len];
                Ok(m.region().read_into(off, &mut b).map(|()| b).map_err(|_| WcStatus::LocProtErr))
            }
            MrMemory::Copied(p) => match p.read_on_agent(self.key(who, off, len, What::Read), ENGINE_WAIT) {
                Err(Slow) => Err(NotNow),
                Ok(r) => Ok(r.map_err(|_| WcStatus::LocProtErr)),
            },
        }
    }

    /// Writes `data` at `off` for `who`.
    pub(crate) fn write_for(&self, who: Asker, off: usize, data: &[u8]) -> Result<Result<(), WcStatus>, NotNow> {
        match &self.mem {
            MrMemory::Mapped(m) => Ok(m.region().write_from(off, data).map_err(|_| WcStatus::LocProtErr)),
            MrMemory::Copied(p) => match p.write_on_agent(self.key(who, off, data.len(), What::Write), data.to_vec(), ENGINE_WAIT) {
                Err(Slow) | Ok(Err(ProcMemError::Moving { .. })) => Err(NotNow),
                Ok(r) => Ok(r.map_err(|_| WcStatus::LocProtErr)),
            },
        }
    }

    /// Writes `data` at `off` (a mapped MR's; a copied one's for a datagram, which is
    /// dropped rather than wait: `who` a stream of its own).
    pub(crate) fn write(&self, off: usize, data: &[u8]) -> Result<(), WcStatus> {
        match &self.mem {
            MrMemory::Mapped(m) => m.region().write_from(off, data).map_err(|_| WcStatus::LocProtErr),
            MrMemory::Copied(_) => {
                let who = Asker { stream: new_stream(), psn: 0 };
                self.write_for(who, off, data).unwrap_or(Err(WcStatus::LocProtErr))
            }
        }
    }

    /// An RDMA atomic on the 8 bytes at `off` for `who`.
    pub(crate) fn atomic(&self, who: Asker, off: usize, op: Atomic) -> Result<Result<u64, WcStatus>, NotNow> {
        match &self.mem {
            MrMemory::Mapped(m) => Ok(sg::atomic(m.region(), off, op)),
            MrMemory::Copied(p) => match p.atomic_on_agent(self.key(who, off, 8, What::Atomic), op, ENGINE_WAIT) {
                Err(Slow) | Ok(Err(ProcMemError::Moving { .. })) => Err(NotNow),
                Ok(Ok(v)) => Ok(Ok(v)),
                Ok(Err(ProcMemError::Misaligned { .. })) => Ok(Err(WcStatus::RemInvReqErr)),
                Ok(Err(_)) => Ok(Err(WcStatus::RemAccessErr)),
            },
        }
    }

    /// Sends frame `h` followed by `len` bytes at `off` (a mapped MR: a copied one's bytes
    /// are read first, [`MappedMr::read_for`], and sent as bytes).
    pub(crate) fn send(&self, c: &Conn, h: &FrameHeader, off: usize, len: usize) -> std::io::Result<()> {
        match &self.mem {
            MrMemory::Mapped(m) => c.send_region(h, m.region(), off, len),
            MrMemory::Copied(_) => Err(by_reference()),
        }
    }

    /// One non-blocking send of `head` and then `len` bytes at `off` on socket `fd`: the
    /// bytes the socket took (of `head`, then of the MR), 0 when it is full. A mapped MR's.
    pub(crate) fn try_send(&self, fd: std::os::fd::BorrowedFd<'_>, head: &[u8], off: usize, len: usize) -> std::io::Result<usize> {
        match &self.mem {
            MrMemory::Mapped(m) => m.region().try_send_to_socket(fd, head, off, len),
            MrMemory::Copied(_) => Err(by_reference()),
        }
    }

    /// Reads `len` bytes from the socket into `off`, for `who`.
    pub(crate) fn receive(&self, c: &Conn, who: Asker, off: usize, len: usize) -> std::io::Result<Stored> {
        let p = match &self.mem {
            MrMemory::Mapped(m) => return c.read_region(m.region(), off, len).map(|()| Stored::Yes),
            MrMemory::Copied(p) => p,
        };
        let (mut at, mut stored) = (0, Stored::Yes);
        while at < len {
            let n = (len - at).min(COPY_STEP);
            // (A buffer per step: it goes to the agent, which may keep it past the wait.)
            let mut chunk = vec![0u8; n];
            c.read_exact(&mut chunk)?;
            let key = self.key(who, off + at, n, What::Write);
            stored = match p.write_on_agent(key, chunk, ENGINE_WAIT) {
                Ok(Ok(())) => Stored::Yes,
                Err(Slow) | Ok(Err(ProcMemError::Moving { .. })) => Stored::NotNow,
                Ok(Err(_)) => Stored::Unstorable,
            };
            at += n;
            if stored != Stored::Yes {
                c.discard((len - at) as u64)?;
                break;
            }
        }
        Ok(stored)
    }
}

/// A copied MR's bytes are never sent by reference (they are read on its owner's agent
/// first): an engine bug, the connection fails rather than block on the owner.
fn by_reference() -> std::io::Error {
    std::io::Error::other("a copied MR's bytes sent by reference")
}

impl Engine {
    /// MR `key` may be reached as `grant` says (registered, or changed: a mapping made
    /// before is dropped).
    pub fn offer_mr(&self, key: u32, grant: MrGrant) {
        self.grants.lock().insert(key, grant);
        self.mrs.lock().remove(&key);
    }

    /// The MR `key` went away: drop the grant and the mapping.
    pub fn forget_mr(&self, key: u32) {
        self.grants.lock().remove(&key);
        self.mrs.lock().remove(&key);
    }

    /// The mapping of MR `key` if it belongs to `session`'s `pd`.
    pub(crate) fn mr(&self, key: u32, session: u64, pd: u32) -> Option<Arc<MappedMr>> {
        let cached = self.mrs.lock().get(&key).cloned();
        let m = match cached {
            Some(m) => m,
            None => {
                let g = self.grants.lock().get(&key).cloned()?;
                let m = Arc::new(map_mr(g)?);
                self.mrs.lock().insert(key, m.clone());
                m
            }
        };
        (m.session == session && m.pd == pd).then_some(m)
    }
}

fn map_mr(g: MrGrant) -> Option<MappedMr> {
    let page = vrdma_abi::ring::PAGE as u64;
    let span_start = g.bounds.addr & !(page - 1);
    let span_len = g.bounds.addr.checked_add(g.bounds.length)?.div_ceil(page) * page - span_start;
    let mem = match g.proc_mem {
        Some(p) => MrMemory::Copied(p),
        None => {
            let mapping = SharedMapping::reserve(span_len as usize).ok()?;
            for (c, fd) in &g.chunks {
                mapping.place_fd(c.mr_offset as usize, std::os::fd::AsFd::as_fd(&**fd), c.fd_offset as usize, c.len as usize, true).ok()?;
            }
            MrMemory::Mapped(mapping)
        }
    };
    Some(MappedMr { mem, span_start, bounds: g.bounds, session: g.session, pd: g.pd })
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use vrdma_abi::control::MrChunk;
    use vrdma_abi::shm::create_memfd;
    use vrdma_abi::verbs::access;

    use super::*;
    use crate::engine::testing::{engine, PD, SESSION};

    /// An MR whose pages are two memfds is one span: bytes written across the chunk boundary
    /// land in both, in order, and atomics work on its words.
    #[test]
    fn an_mr_of_two_chunks_is_one_span_of_memory() {
        let page = vrdma_abi::ring::PAGE;
        let (a, b) = (Arc::new(create_memfd("mr-a", page, true).unwrap()), Arc::new(create_memfd("mr-b", page, true).unwrap()));
        let chunk = |mr_offset: usize| MrChunk { mr_offset: mr_offset as u64, len: page as u64, fd_offset: 0 };
        // Starts half-way into its first page.
        let addr = 0x40_0000 + page as u64 / 2;
        let bounds = MrBounds { addr, length: page as u64, access: access::LOCAL_WRITE };
        let g = MrGrant { session: SESSION, pd: PD, bounds, chunks: vec![(chunk(0), a.clone()), (chunk(page), b.clone())], proc_mem: None };
        let mr = map_mr(g).unwrap();
        assert_eq!(mr.span_start, 0x40_0000);

        let data: Vec<u8> = (0..64u8).collect();
        let at = page - 32;
        mr.write(at, &data).unwrap();
        let (ma, mb) =
            (SharedMapping::map_sealed(a.as_fd(), page, false).unwrap(), SharedMapping::map_sealed(b.as_fd(), page, false).unwrap());
        let (mut end_of_a, mut start_of_b) = ([0u8; 32], [0u8; 32]);
        ma.region().read_into(page - 32, &mut end_of_a).unwrap();
        mb.region().read_into(0, &mut start_of_b).unwrap();
        assert_eq!((&end_of_a[..], &start_of_b[..]), (&data[..32], &data[32..]));
        let mut back = vec![0u8; 64];
        mr.read(at, &mut back).unwrap();
        assert_eq!(back, data);

        mr.write(page + 8, &5u64.to_ne_bytes()).unwrap();
        let who = |psn| Asker { stream: 1, psn };
        assert_eq!(mr.atomic(who(0), page + 8, Atomic::FetchAdd { add: 3 }).ok(), Some(Ok(5)));
        assert_eq!(mr.atomic(who(1), page + 8, Atomic::CmpSwap { compare: 8, swap: 1 }).ok(), Some(Ok(8)));
        assert_eq!(mr.atomic(who(2), page + 8, Atomic::FetchAdd { add: 0 }).ok(), Some(Ok(1)));
    }

    /// The engine reaches an MR only for its own session and PD, maps it once, again once it
    /// changed, and not once it is gone.
    #[test]
    fn an_mr_is_reached_only_by_its_own_session_and_pd() {
        let t = engine();
        let _mr = t.broker.register_mr(7, 0x10_0000, 4096, access::LOCAL_WRITE);
        let first = t.e.mr(7, SESSION, PD).expect("its own session and PD");
        assert!(Arc::ptr_eq(&first, &t.e.mr(7, SESSION, PD).unwrap()), "mapped once");
        assert!(t.e.mr(7, SESSION + 1, PD).is_none());
        assert!(t.e.mr(7, SESSION, PD + 1).is_none());
        assert!(t.e.mr(8, SESSION, PD).is_none(), "no such key");
        // Changed (moved to new memfds): offered again, mapped again.
        let _moved = t.broker.register_mr(7, 0x10_0000, 4096, access::LOCAL_WRITE);
        assert!(!Arc::ptr_eq(&first, &t.e.mr(7, SESSION, PD).unwrap()), "mapped again after it changed");
        t.e.forget_mr(7);
        assert!(t.e.mr(7, SESSION, PD).is_none(), "gone once deregistered");
    }
}
