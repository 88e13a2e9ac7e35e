//! The copying fallback of memory registration (docs/architecture.md, "Memory registration").
//!
//! A client registers ordinary private anonymous memory zero-copy, by moving it onto a sealed
//! memfd that peers map. Memory that cannot move that way — file-backed mappings (private or
//! shared), hugetlb pages, memory shared with other processes — is registered without
//! chunks instead, and vrdmad performs every remote access to it by reading and writing the
//! client's address space through `/proc/PID/mem`: the peer's library (direct path) asks
//! vrdmad for each access, and the mediated engine copies between its socket and the client.
//!
//! `/proc/PID/mem` is opened once per client session, when it registers its first such MR.
//! The open file keeps referring to that process's address space, so a PID reused after the
//! client exits can never be written by mistake: accesses then fail (EIO/ESRCH), and the
//! session's MRs are reclaimed anyway when its socket closes.

use std::fs::File;
use std::os::unix::fs::FileExt;

use parking_lot::Mutex;
use vrdma_core::sg::Atomic;

/// Errors of the copying fallback.
#[derive(Debug, thiserror::Error)]
pub enum ProcMemError {
    /// Opening the client's `/proc/PID/mem` failed (vrdmad needs CAP_SYS_PTRACE, as root has).
    #[error("opening /proc/{pid}/mem: {source}")]
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
    /// An atomic's target is not 8-byte aligned.
    #[error("atomic at {addr:#x} is not 8-byte aligned")]
    Misaligned {
        /// Address in the client.
        addr: u64,
    },
}

/// A client process's address space, as vrdmad reads and writes it.
pub struct ProcMem {
    pid: i32,
    file: File,
    /// Serialises RDMA atomics on this process's copied MRs (from every QP and path), so they
    /// are atomic against each other, as a NIC's are.
    atomics: Mutex<()>,
}

impl std::fmt::Debug for ProcMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcMem").field("pid", &self.pid).finish()
    }
}

impl ProcMem {
    /// Opens process `pid`'s memory for reading and writing.
    pub fn open(pid: i32) -> Result<ProcMem, ProcMemError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/mem"))
            .map_err(|source| ProcMemError::Open { pid, source })?;
        Ok(ProcMem { pid, file, atomics: Mutex::new(()) })
    }

    /// The process's PID.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Reads `buf.len()` bytes at `addr` of the process.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ProcMemError> {
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
        if !addr.is_multiple_of(8) {
            return Err(ProcMemError::Misaligned { addr });
        }
        let _g = self.atomics.lock();
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        let old = u64::from_ne_bytes(b);
        let new = match op {
            Atomic::CmpSwap { compare, swap } => (old == compare).then_some(swap),
            Atomic::FetchAdd { add } => Some(old.wrapping_add(add)),
        };
        if let Some(v) = new {
            self.write(addr, &v.to_ne_bytes())?;
        }
        Ok(old)
    }
}

/// The PID (in vrdmad's PID namespace) of the process at the other end of a Unix socket.
pub fn peer_pid(fd: std::os::fd::BorrowedFd<'_>) -> Option<i32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt(2) with an out-buffer of exactly `len` bytes.
    let rc = unsafe {
        libc::getsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, &mut cred as *mut libc::ucred as *mut libc::c_void, &mut len)
    };
    (rc == 0 && cred.pid > 0).then_some(cred.pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_writes_and_atomics_on_own_memory() {
        let mut buf = vec![0u64; 4];
        let addr = buf.as_mut_ptr() as u64;
        let m = ProcMem::open(std::process::id() as i32).expect("own /proc/self/mem");
        m.write(addr, &7u64.to_ne_bytes()).unwrap();
        let mut b = [0u8; 8];
        m.read(addr, &mut b).unwrap();
        assert_eq!(u64::from_ne_bytes(b), 7);
        assert_eq!(m.atomic(addr, Atomic::FetchAdd { add: 5 }).unwrap(), 7);
        assert_eq!(m.atomic(addr, Atomic::CmpSwap { compare: 12, swap: 1 }).unwrap(), 12);
        assert_eq!(m.atomic(addr, Atomic::CmpSwap { compare: 12, swap: 2 }).unwrap(), 1);
        assert!(matches!(m.atomic(addr + 4, Atomic::FetchAdd { add: 1 }), Err(ProcMemError::Misaligned { .. })));
        // SAFETY: reading our own vector after the kernel wrote it.
        assert_eq!(unsafe { std::ptr::read_volatile(buf.as_ptr()) }, 1);
        // Unmapped memory is an error, not a crash.
        assert!(m.read(8, &mut b).is_err());
        assert!(m.write(8, &b).is_err());
    }
}
