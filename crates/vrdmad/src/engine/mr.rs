//! MRs as the engine reaches them: mapped from their memfds, or copied through their owner's memory.

use std::sync::Arc;

use vrdma_abi::shm::SharedMapping;
use vrdma_abi::verbs::WcStatus;
use vrdma_abi::wire::FrameHeader;
use vrdma_core::access::MrBounds;
use vrdma_core::sg::{self, Atomic};

use super::connection::{self, Conn};
use super::{Engine, MrGrant};
use crate::procmem::{Access, ProcMem, ProcMemError};

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

/// Bytes a copied MR moves per step between the socket and its owner's memory.
const COPY_STEP: usize = 256 * 1024;

/// The owner of a copied MR is moving the range onto shared memory (`BeginRehome`). The
/// engine never waits for that: its threads (the doorbell, a connection's reader) serve every
/// vNIC, and a hostile owner that begins a move and never ends it held each of them for the
/// move's 5 s time-out per access. A request into the range is answered "not ready" instead
/// (the requester tries again until its transport timeout); reads go on (see
/// [`ProcMem::read_now`]).
pub(crate) struct Moving;

/// A range of an MR held for a write: a copied MR's range is kept out of its owner's moves
/// (and checked writable) while this lives.
pub(crate) enum Held<'a> {
    /// A mapped MR: nothing to hold.
    Mapped,
    /// A copied MR's range, or why it cannot be written.
    Copied(Result<Access<'a>, ProcMemError>),
}

impl MappedMr {
    /// Reads `buf.len()` bytes at `off`.
    pub(crate) fn read(&self, off: usize, buf: &mut [u8]) -> Result<(), WcStatus> {
        match &self.mem {
            MrMemory::Mapped(m) => m.region().read_into(off, buf).map_err(|_| WcStatus::LocProtErr),
            MrMemory::Copied(p) => p.read_now(self.span_start + off as u64, buf).map_err(|_| WcStatus::LocProtErr),
        }
    }

    /// Writes `data` at `off`.
    pub(crate) fn write(&self, off: usize, data: &[u8]) -> Result<(), WcStatus> {
        match &self.mem {
            MrMemory::Mapped(m) => m.region().write_from(off, data).map_err(|_| WcStatus::LocProtErr),
            MrMemory::Copied(p) => p.write_now(self.span_start + off as u64, data).map_err(|_| WcStatus::LocProtErr),
        }
    }

    /// An RDMA atomic on the 8 bytes at `off`; `Err(Moving)` (nothing done) while the owner
    /// of a copied MR moves them.
    pub(crate) fn atomic(&self, off: usize, op: Atomic) -> Result<Result<u64, WcStatus>, Moving> {
        match &self.mem {
            MrMemory::Mapped(m) => Ok(sg::atomic(m.region(), off, op)),
            MrMemory::Copied(p) => match p.atomic_now(self.span_start + off as u64, op) {
                Ok(v) => Ok(Ok(v)),
                Err(ProcMemError::Moving { .. }) => Err(Moving),
                Err(ProcMemError::Misaligned { .. }) => Ok(Err(WcStatus::RemInvReqErr)),
                Err(_) => Ok(Err(WcStatus::RemAccessErr)),
            },
        }
    }

    /// Holds `[off, off+len)` for a write (see [`Held`]); `Err(Moving)` while the owner of a
    /// copied MR moves it.
    pub(crate) fn hold(&self, off: usize, len: usize) -> Result<Held<'_>, Moving> {
        match &self.mem {
            MrMemory::Mapped(_) => Ok(Held::Mapped),
            MrMemory::Copied(p) => match p.try_access(self.span_start + off as u64, len as u64, true) {
                Err(ProcMemError::Moving { .. }) => Err(Moving),
                r => Ok(Held::Copied(r)),
            },
        }
    }

    /// Sends frame `h` followed by `len` bytes at `off`.
    pub(crate) fn send(&self, c: &Conn, h: &FrameHeader, off: usize, len: usize) -> std::io::Result<()> {
        match &self.mem {
            MrMemory::Mapped(m) => c.send_region(h, m.region(), off, len),
            MrMemory::Copied(p) => c.send_streamed(h, len, COPY_STEP, |at, buf| {
                // The owner unmapped registered memory (breaking the verbs contract): zeros go out.
                if p.read_now(self.span_start + (off + at) as u64, buf).is_err() {
                    buf.fill(0);
                }
            }),
        }
    }

    /// One non-blocking send of `head` and then `len` bytes at `off` on socket `fd`: the
    /// bytes the socket took (of `head`, then of the MR), 0 when it is full.
    pub(crate) fn try_send(&self, fd: std::os::fd::BorrowedFd<'_>, head: &[u8], off: usize, len: usize) -> std::io::Result<usize> {
        match &self.mem {
            MrMemory::Mapped(m) => m.region().try_send_to_socket(fd, head, off, len),
            MrMemory::Copied(p) => {
                let mut buf = Vec::with_capacity(head.len() + len.min(COPY_STEP));
                buf.extend_from_slice(head);
                let at = buf.len();
                buf.resize(at + len.min(COPY_STEP), 0);
                // The owner unmapped registered memory (breaking the verbs contract): zeros go out.
                if p.read_now(self.span_start + off as u64, &mut buf[at..]).is_err() {
                    buf[at..].fill(0);
                }
                connection::try_send(fd, &buf)
            }
        }
    }

    /// Reads `len` bytes from the socket into `off`. `Ok(false)`: the bytes were consumed but
    /// could not be stored (a copied MR's owner unmapped it, or is moving it).
    pub(crate) fn receive(&self, c: &Conn, off: usize, len: usize) -> std::io::Result<bool> {
        match self.hold(off, len) {
            Ok(held) => self.receive_held(c, &held, off, len),
            Err(Moving) => c.discard(len as u64).map(|()| false),
        }
    }

    /// [`MappedMr::receive`] into a range held by [`MappedMr::hold`].
    pub(crate) fn receive_held(&self, c: &Conn, held: &Held<'_>, off: usize, len: usize) -> std::io::Result<bool> {
        match (&self.mem, held) {
            (MrMemory::Mapped(m), _) => c.read_region(m.region(), off, len).map(|()| true),
            (MrMemory::Copied(_), Held::Copied(access)) => {
                let mut buf = vec![0u8; len.min(COPY_STEP)];
                let (mut at, mut ok) = (0, true);
                while at < len {
                    let n = (len - at).min(COPY_STEP);
                    c.read_exact(&mut buf[..n])?;
                    ok &= access.as_ref().is_ok_and(|a| a.write_at(at as u64, &buf[..n]).is_ok());
                    at += n;
                }
                Ok(ok)
            }
            (MrMemory::Copied(_), Held::Mapped) => c.discard(len as u64).map(|()| false),
        }
    }
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
        assert_eq!(mr.atomic(page + 8, Atomic::FetchAdd { add: 3 }).ok(), Some(Ok(5)));
        assert_eq!(mr.atomic(page + 8, Atomic::CmpSwap { compare: 8, swap: 1 }).ok(), Some(Ok(8)));
        assert_eq!(mr.atomic(page + 8, Atomic::FetchAdd { add: 0 }).ok(), Some(Ok(1)));
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
