//! The copying fallback of memory registration (docs/architecture.md, "Memory registration").
//!
//! A client registers ordinary private anonymous memory zero-copy, by moving it onto a sealed
//! memfd that peers map. Memory that cannot move that way — file-backed mappings (private or
//! shared), hugetlb pages, memory shared with other processes — is registered without
//! chunks instead, and vrdmad performs every remote access to it by reading and writing the
//! client's address space through `/proc/PID/mem`: the peer's library (direct path) asks
//! vrdmad for each access, and the mediated engine copies between its socket and the client.
//!
//! `/proc/PID/mem` is opened once per client session, when it connects, for the process at
//! the other end of its socket, held by pidfd (see `peer`): a PID reused after the client
//! exits never names another process, and the open file keeps referring to the address space
//! the client had then (after an exec, accesses fail). Every access re-verifies the process
//! (alive, same start time, same credentials, still dumpable: a set-user-ID exec is refused)
//! and that its mappings cover the whole range with the protection the access needs (see
//! `vrdma_abi::procmap`): nothing is read that the process could not read, nothing written that it could
//! not write.

mod access;
mod agent;
mod gate;
mod peer;

pub use access::{with_bounce, Access, BOUNCE};
pub use agent::{Done, Key, Slow, What, ENGINE_WAIT};

use std::fs::File;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;

use parking_lot::Mutex;
use vrdma_core::sg::Atomic;

use agent::Agent;
use gate::MoveGate;
use peer::{Bound, Identity};

/// Errors of the copying fallback.
#[derive(Debug, thiserror::Error)]
pub enum ProcMemError {
    /// The socket's peer could not be asked who it is.
    #[error("the client's socket has no peer process: {source}")]
    NoPeer {
        /// Cause.
        source: std::io::Error,
    },
    /// The process exited (or is in a PID namespace vrdmad cannot see).
    #[error("process {pid} is gone: {source}")]
    Gone {
        /// The client's PID (0: unknown).
        pid: i32,
        /// Cause.
        source: std::io::Error,
    },
    /// The process is not the one that connected any more, or changed credentials (a
    /// set-user-ID exec) or became undumpable.
    #[error("process {pid} changed: {what}")]
    Changed {
        /// Client PID.
        pid: i32,
        /// What changed.
        what: &'static str,
    },
    /// A `/proc/PID` file vrdmad reads did not have the expected form.
    #[error("process {pid}: cannot parse {what}")]
    Unparsable {
        /// Client PID.
        pid: i32,
        /// Which file or field.
        what: String,
    },
    /// The range is not (wholly) mapped with the protection the access needs.
    #[error("{len} bytes at {addr:#x} of process {pid} are not mapped {}", if *write { "writable" } else { "readable" })]
    Unmapped {
        /// Client PID.
        pid: i32,
        /// Address in the client.
        addr: u64,
        /// Bytes.
        len: u64,
        /// Whether write access was needed.
        write: bool,
    },
    /// Opening a file of the client's `/proc/PID` failed (vrdmad needs CAP_SYS_PTRACE, as
    /// root has).
    #[error("opening a file of /proc/{pid}: {source}")]
    Open {
        /// The client's PID (in vrdmad's PID namespace).
        pid: i32,
        /// Cause.
        source: std::io::Error,
    },
    /// Reading the client's memory failed (unmapped, or the client exited).
    #[error("reading {len} bytes at {addr:#x} of process {pid}: {source}")]
    Read {
        /// Client PID.
        pid: i32,
        /// Address in the client.
        addr: u64,
        /// Bytes.
        len: usize,
        /// Cause.
        source: std::io::Error,
    },
    /// Writing the client's memory failed.
    #[error("writing {len} bytes at {addr:#x} of process {pid}: {source}")]
    Write {
        /// Client PID.
        pid: i32,
        /// Address in the client.
        addr: u64,
        /// Bytes.
        len: usize,
        /// Cause.
        source: std::io::Error,
    },
    /// The process has been moving the range onto shared memory for too long.
    #[error("process {pid} is moving the memory at {addr:#x} (for too long)")]
    Moving {
        /// Client PID.
        pid: i32,
        /// Address in the client.
        addr: u64,
    },
    /// An atomic's target is not 8-byte aligned.
    #[error("atomic at {addr:#x} is not 8-byte aligned")]
    Misaligned {
        /// Address in the client.
        addr: u64,
    },
    /// The thread that accesses the process's memory could not be started.
    #[error("starting the thread for the memory of process {pid}: {source}")]
    Worker {
        /// Client PID.
        pid: i32,
        /// Cause.
        source: std::io::Error,
    },
    /// The operation did not produce what was asked (an internal mix-up, never expected).
    #[error("process {pid}: an access gave an unexpected result")]
    Mismatch {
        /// Client PID.
        pid: i32,
    },
}

/// A client process's address space, as vrdmad reads and writes it.
pub struct ProcMem {
    pid: i32,
    bound: Bound,
    /// The process as it was when bound.
    identity: Identity,
    file: File,
    /// Its `/proc/PID/maps`, opened with `file`: bound to the same address space.
    maps: File,
    /// Serialises RDMA atomics on this process's copied MRs (from every QP and path), so they
    /// are atomic against each other, as a NIC's are.
    atomics: Mutex<()>,
    /// Ranges the process is moving onto shared memory, and the accesses under way.
    gate: MoveGate,
    /// Accesses for callers that must not wait for the process (see `agent`).
    agent: Agent,
    /// Tests and fuzzing: every access waits while this is held for writing (an owner holding
    /// its memory-map lock).
    #[cfg(any(test, fuzzing))]
    pub(crate) stall: parking_lot::RwLock<()>,
}

impl std::fmt::Debug for ProcMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcMem").field("pid", &self.pid).finish()
    }
}

impl ProcMem {
    /// The memory of the process at the other end of Unix socket `sock`, if it still has the
    /// credentials it connected with.
    pub fn of_peer(sock: BorrowedFd<'_>) -> Result<ProcMem, ProcMemError> {
        let (pidfd, uid, gid) = peer::peer_of(sock)?;
        ProcMem::bind(pidfd, Some((uid, gid)))
    }

    /// Process `pid`'s memory as it is now (for tests and tools: clients are bound by their
    /// socket, [`ProcMem::of_peer`]).
    pub fn open(pid: i32) -> Result<ProcMem, ProcMemError> {
        ProcMem::bind(peer::pidfd_open(pid)?, None)
    }

    fn bind(pidfd: OwnedFd, creds: Option<(u32, u32)>) -> Result<ProcMem, ProcMemError> {
        let bound = Bound::new(pidfd)?;
        let pid = bound.pid;
        let identity = bound.identity()?;
        if creds.is_some_and(|(uid, gid)| identity.uids[1] != uid || identity.gids[1] != gid) {
            return Err(ProcMemError::Changed { pid, what: "its credentials are not those it connected with" });
        }
        if !identity.dumpable {
            return Err(ProcMemError::Changed { pid, what: "it is not dumpable" });
        }
        let file = bound.open("mem", true)?;
        let maps = bound.open("maps", false)?;
        let mem = ProcMem {
            pid,
            bound,
            identity,
            file,
            maps,
            atomics: Mutex::new(()),
            gate: MoveGate::default(),
            agent: Agent::new(pid),
            #[cfg(any(test, fuzzing))]
            stall: parking_lot::RwLock::new(()),
        };
        // (The address space opened is the bound process's as it was checked.)
        mem.verify()?;
        Ok(mem)
    }

    /// Whether the process is still the one bound, with the same effective credentials, and
    /// dumpable. Cheap, as every access asks: the pidfd says it runs (and `/proc/PID`, opened
    /// while it ran, is bound to it, not to a successor under its PID, whose start time would
    /// differ); the owners of its `/proc` entries give its effective IDs and dumpability
    /// ([`peer::Bound::effective`]). (A set-ID `exec` also replaces the address space, which
    /// the `mem` and `maps` files opened at binding keep referring to: their accesses fail
    /// from then on.)
    fn verify(&self) -> Result<(), ProcMemError> {
        self.bound.alive()?;
        let (ids, dumpable) = self.bound.effective()?;
        let what = if ids != [self.identity.uids[1], self.identity.gids[1]] {
            "its credentials changed (a set-ID exec?)"
        } else if !dumpable {
            "it is not dumpable any more"
        } else {
            return Ok(());
        };
        Err(ProcMemError::Changed { pid: self.pid, what })
    }

    /// Checks that the process is still the one bound and that `[addr, addr+len)` is mapped
    /// readable (and, with `write`, writable) there.
    pub fn check_range(&self, addr: u64, len: u64, write: bool) -> Result<(), ProcMemError> {
        #[cfg(any(test, fuzzing))]
        drop(self.stall.read());
        self.verify()?;
        let read_error = |source| ProcMemError::Read { pid: self.pid, addr, len: len as usize, source };
        let end = addr.checked_add(len).ok_or(ProcMemError::Unmapped { pid: self.pid, addr, len, write })?;
        let maps = vrdma_abi::procmap::mappings_around(&self.maps, addr, end).map_err(read_error)?;
        if !vrdma_abi::procmap::covers(&maps, addr, len, write) {
            return Err(ProcMemError::Unmapped { pid: self.pid, addr, len, write });
        }
        Ok(())
    }

    /// The process's PID.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Reads `buf.len()` bytes at `addr` of the process.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ProcMemError> {
        let _pass = self.gate.pass(addr, buf.len() as u64).ok_or(ProcMemError::Moving { pid: self.pid, addr })?;
        self.check_range(addr, buf.len() as u64, false)?;
        self.read_unchecked(addr, buf)
    }

    /// Reads `buf.len()` bytes at `addr` without waiting for a move of the range, for the
    /// mediated engine, whose threads serve every vNIC: a read during a move sees the same
    /// bytes in the old pages as in the new ones (the owner's own stores wait for its move), so
    /// only writes need keeping out of moves.
    pub fn read_now(&self, addr: u64, buf: &mut [u8]) -> Result<(), ProcMemError> {
        self.check_range(addr, buf.len() as u64, false)?;
        self.read_unchecked(addr, buf)
    }

    /// Writes `data` at `addr`, `Moving` at once (without waiting) while the process moves the
    /// range: for the mediated engine, see [`ProcMem::read_now`].
    pub fn write_now(&self, addr: u64, data: &[u8]) -> Result<(), ProcMemError> {
        self.try_access(addr, data.len() as u64, true)?.write_at(0, data)
    }

    /// [`ProcMem::atomic`], `Moving` at once (without waiting) while the process moves the
    /// range: for the mediated engine, see [`ProcMem::read_now`].
    pub fn atomic_now(&self, addr: u64, op: Atomic) -> Result<u64, ProcMemError> {
        self.atomic_gated(addr, op, false)
    }

    /// The process is moving `[addr, addr+len)` onto shared memory: accesses to it wait from
    /// now on until [`ProcMem::end_move`]; whether none is under way any more (the move may
    /// start; until then, ask again).
    pub fn begin_move(&self, addr: u64, len: u64) -> bool {
        self.gate.begin(addr, len)
    }

    /// The move of `[addr, addr+len)` is over (done or given up): waiting accesses go on.
    pub fn end_move(&self, addr: u64, len: u64) {
        self.gate.end(addr, len)
    }

    /// Reads `buf.len()` bytes at `addr` with `process_vm_readv(2)`, which copies straight from
    /// the process's pages (about twice as fast as `/proc/PID/mem`, which copies a page at a
    /// time through a kernel buffer), then confirms the bytes came from the bound process and
    /// address space ([`ProcMem::confirm_read`]); `/proc/PID/mem` where the system call is not
    /// allowed or finds no address space. On any error `buf` is zeroed.
    fn read_unchecked(&self, addr: u64, buf: &mut [u8]) -> Result<(), ProcMemError> {
        if buf.is_empty() {
            return Ok(());
        }
        let read = match self.read_vm(addr, buf) {
            Ok(()) => self.confirm_read(addr),
            // Not allowed, or no address space by PID (a thread-group leader that called
            // `pthread_exit` while its threads run): the file, bound to the address space.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM | libc::ENOSYS | libc::ESRCH)) => self.read_file(addr, buf),
            Err(source) => Err(ProcMemError::Read { pid: self.pid, addr, len: buf.len(), source }),
        };
        read.inspect_err(|_| buf.fill(0))
    }

    /// `process_vm_readv(2)` of `[addr, addr+buf.len())` of the bound PID into `buf`.
    fn read_vm(&self, addr: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let local = libc::iovec { iov_base: buf[done..].as_mut_ptr().cast(), iov_len: buf.len() - done };
            let remote = libc::iovec { iov_base: (addr + done as u64) as *mut libc::c_void, iov_len: buf.len() - done };
            // SAFETY: `local` is the unread tail of `buf`, writable memory we own for the
            // call; `remote` names the other process's memory, which the kernel checks.
            let n = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
            match n {
                n if n > 0 => done += n as usize,
                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// After a `process_vm_readv` by PID: the bound process has not exited (so its PID named
    /// no successor during the call), its address space is still the one bound (a read of
    /// `addr` through the `mem` file, which refers to that address space and gives nothing
    /// after an `exec` replaced it), and its credentials and dumpability are unchanged.
    fn confirm_read(&self, addr: u64) -> Result<(), ProcMemError> {
        self.bound.alive()?;
        let mut probe = [0u8; 1];
        if !matches!(self.file.read_at(&mut probe, addr), Ok(1)) {
            return Err(ProcMemError::Changed { pid: self.pid, what: "its address space was replaced (an exec?)" });
        }
        self.verify()
    }

    /// Reads through `/proc/PID/mem`, bound to the address space when opened.
    fn read_file(&self, addr: u64, buf: &mut [u8]) -> Result<(), ProcMemError> {
        let len = buf.len();
        let err = |source| ProcMemError::Read { pid: self.pid, addr, len, source };
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], addr + done as u64) {
                Ok(0) => return Err(err(std::io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(err(e)),
            }
        }
        Ok(())
    }

    /// Writes `data` at `addr` of the process.
    pub fn write(&self, addr: u64, data: &[u8]) -> Result<(), ProcMemError> {
        let _pass = self.gate.pass(addr, data.len() as u64).ok_or(ProcMemError::Moving { pid: self.pid, addr })?;
        self.check_range(addr, data.len() as u64, true)?;
        self.write_unchecked(addr, data)
    }

    fn write_unchecked(&self, addr: u64, data: &[u8]) -> Result<(), ProcMemError> {
        let err = |source| ProcMemError::Write { pid: self.pid, addr, len: data.len(), source };
        let mut done = 0;
        while done < data.len() {
            match self.file.write_at(&data[done..], addr + done as u64) {
                Ok(0) => return Err(err(std::io::ErrorKind::WriteZero.into())),
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(err(e)),
            }
        }
        Ok(())
    }

    /// Executes an RDMA atomic on the 8 bytes at `addr` (host order, as the direct path's
    /// atomics); returns the original value.
    pub fn atomic(&self, addr: u64, op: Atomic) -> Result<u64, ProcMemError> {
        self.atomic_gated(addr, op, true)
    }

    /// [`ProcMem::atomic`], waiting for a move of the range if `wait`.
    fn atomic_gated(&self, addr: u64, op: Atomic, wait: bool) -> Result<u64, ProcMemError> {
        if !addr.is_multiple_of(8) {
            return Err(ProcMemError::Misaligned { addr });
        }
        // (The pass first: an atomic that waits for a move holds no lock other atomics take.)
        let pass = if wait { self.gate.pass(addr, 8) } else { self.gate.try_pass(addr, 8) };
        let _pass = pass.ok_or(ProcMemError::Moving { pid: self.pid, addr })?;
        let _g = self.atomics.lock();
        self.check_range(addr, 8, true)?;
        let mut b = [0u8; 8];
        self.read_file(addr, &mut b)?;
        let old = u64::from_ne_bytes(b);
        let new = match op {
            Atomic::CmpSwap { compare, swap } => (old == compare).then_some(swap),
            Atomic::FetchAdd { add } => Some(old.wrapping_add(add)),
        };
        if let Some(v) = new {
            self.write_unchecked(addr, &v.to_ne_bytes())?;
        }
        Ok(old)
    }
}

#[cfg(test)]
mod tests;
