//! MRs as the engine reaches them: mapped from their memfds, or copied through their owner's memory.

use std::sync::Arc;

use vrdma_abi::shm::SharedMapping;
use vrdma_abi::verbs::WcStatus;
use vrdma_abi::wire::FrameHeader;
use vrdma_core::access::MrBounds;
use vrdma_core::sg::{self, Atomic};

use super::connection::{self, Conn};
use super::{Engine, MrGrant};
use crate::procmem::{ProcMem, ProcMemError};

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

impl MappedMr {
    /// Reads `buf.len()` bytes at `off`.
    pub(crate) fn read(&self, off: usize, buf: &mut [u8]) -> Result<(), WcStatus> {
        match &self.mem {
            MrMemory::Mapped(m) => m.region().read_into(off, buf).map_err(|_| WcStatus::LocProtErr),
            MrMemory::Copied(p) => p.read(self.span_start + off as u64, buf).map_err(|_| WcStatus::LocProtErr),
        }
    }

    /// Writes `data` at `off`.
    pub(crate) fn write(&self, off: usize, data: &[u8]) -> Result<(), WcStatus> {
        match &self.mem {
            MrMemory::Mapped(m) => m.region().write_from(off, data).map_err(|_| WcStatus::LocProtErr),
            MrMemory::Copied(p) => p.write(self.span_start + off as u64, data).map_err(|_| WcStatus::LocProtErr),
        }
    }

    /// An RDMA atomic on the 8 bytes at `off`.
    pub(crate) fn atomic(&self, off: usize, op: Atomic) -> Result<u64, WcStatus> {
        match &self.mem {
            MrMemory::Mapped(m) => sg::atomic(m.region(), off, op),
            MrMemory::Copied(p) => p.atomic(self.span_start + off as u64, op).map_err(|e| match e {
                ProcMemError::Misaligned { .. } => WcStatus::RemInvReqErr,
                _ => WcStatus::RemAccessErr,
            }),
        }
    }

    /// Sends frame `h` followed by `len` bytes at `off`.
    pub(crate) fn send(&self, c: &Conn, h: &FrameHeader, off: usize, len: usize) -> std::io::Result<()> {
        match &self.mem {
            MrMemory::Mapped(m) => c.send_region(h, m.region(), off, len),
            MrMemory::Copied(p) => c.send_streamed(h, len, COPY_STEP, |at, buf| {
                // The owner unmapped registered memory (breaking the verbs contract): zeros go out.
                if p.read(self.span_start + (off + at) as u64, buf).is_err() {
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
                if p.read(self.span_start + off as u64, &mut buf[at..]).is_err() {
                    buf[at..].fill(0);
                }
                connection::try_send(fd, &buf)
            }
        }
    }

    /// Reads `len` bytes from the socket into `off`. `Ok(false)`: the bytes were consumed but
    /// could not be stored (a copied MR's owner unmapped it).
    pub(crate) fn receive(&self, c: &Conn, off: usize, len: usize) -> std::io::Result<bool> {
        match &self.mem {
            MrMemory::Mapped(m) => c.read_region(m.region(), off, len).map(|()| true),
            MrMemory::Copied(p) => {
                let mut buf = vec![0u8; len.min(COPY_STEP)];
                let (mut at, mut ok) = (0, true);
                while at < len {
                    let n = (len - at).min(COPY_STEP);
                    c.read_exact(&mut buf[..n])?;
                    ok &= p.write(self.span_start + (off + at) as u64, &buf[..n]).is_ok();
                    at += n;
                }
                Ok(ok)
            }
        }
    }
}

impl Engine {
    /// The MR `key` changed or went away: drop the mapping.
    pub fn forget_mr(&self, key: u32) {
        self.mrs.lock().remove(&key);
    }

    /// The mapping of MR `key` if it belongs to `session`'s `pd`.
    pub(crate) fn mr(&self, key: u32, session: u64, pd: u32) -> Option<Arc<MappedMr>> {
        let cached = self.mrs.lock().get(&key).cloned();
        let m = match cached {
            Some(m) => m,
            None => {
                let g = self.broker()?.mr(key)?;
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
