//! A checked range of a process's memory, for copies of many bytes (`PeerMrCopy`): the
//! process and its mappings are verified once for the whole range, and the range is kept out
//! of moves (`gate`) while the access lives, so that the copy itself is plain reads
//! (`process_vm_readv`, each confirmed) and `pwrite`s of `/proc/PID/mem` from and into
//! vrdmad's buffers and mappings.

use std::os::fd::AsRawFd;

use vrdma_abi::shm::MemRegion;

use super::gate::Pass;
use super::{ProcMem, ProcMemError};

/// Bytes moved per step between a process's memory and vrdmad's (small enough to stay in a
/// CPU's cache between the read and the write).
pub const BOUNCE: usize = 256 * 1024;

thread_local! {
    static BUFFER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's bounce buffer of [`BOUNCE`] bytes (made once per thread, not
/// allocated, zeroed and faulted in again for every copy).
pub fn with_bounce<T>(f: impl FnOnce(&mut [u8]) -> T) -> T {
    BUFFER.with(|b| {
        let mut b = b.borrow_mut();
        if b.len() < BOUNCE {
            b.resize(BOUNCE, 0);
        }
        f(&mut b[..BOUNCE])
    })
}

/// `[addr, addr+len)` of a process, checked readable (and writable if asked) when made.
pub struct Access<'a> {
    mem: &'a ProcMem,
    addr: u64,
    len: u64,
    _pass: Pass<'a>,
}

impl ProcMem {
    /// Admits an access to `[addr, addr+len)` (waiting for a move of it, see `gate`) and
    /// checks the process and its mappings for it, once: what [`ProcMem::read`] and
    /// [`ProcMem::write`] check on each call.
    pub fn access(&self, addr: u64, len: u64, write: bool) -> Result<Access<'_>, ProcMemError> {
        let pass = self.gate.pass(addr, len).ok_or(ProcMemError::Moving { pid: self.pid, addr })?;
        self.check_range(addr, len, write)?;
        Ok(Access { mem: self, addr, len, _pass: pass })
    }

    /// As [`ProcMem::access`], but `Moving` at once instead of waiting for a move of the range.
    pub fn try_access(&self, addr: u64, len: u64, write: bool) -> Result<Access<'_>, ProcMemError> {
        let pass = self.gate.try_pass(addr, len).ok_or(ProcMemError::Moving { pid: self.pid, addr })?;
        self.check_range(addr, len, write)?;
        Ok(Access { mem: self, addr, len, _pass: pass })
    }
}

impl Access<'_> {
    /// The absolute address of `[off, off+n)` of the range, if it lies within it.
    fn at(&self, off: u64, n: usize) -> Result<u64, ProcMemError> {
        match off.checked_add(n as u64) {
            Some(end) if end <= self.len => Ok(self.addr + off),
            _ => Err(ProcMemError::Unmapped { pid: self.mem.pid, addr: self.addr.wrapping_add(off), len: n as u64, write: false }),
        }
    }

    /// Reads `buf.len()` bytes at offset `off` of the range.
    pub fn read_at(&self, off: u64, buf: &mut [u8]) -> Result<(), ProcMemError> {
        self.mem.read_unchecked(self.at(off, buf.len())?, buf)
    }

    /// Writes `data` at offset `off` of the range.
    pub fn write_at(&self, off: u64, data: &[u8]) -> Result<(), ProcMemError> {
        self.mem.write_unchecked(self.at(off, data.len())?, data)
    }

    /// Reads the whole range into `dst` (vrdmad's own memory, e.g. its mapping of another
    /// client's memfds), the kernel copying straight from the process's pages.
    pub fn read_into_region(&self, dst: &MemRegion) -> Result<(), ProcMemError> {
        self.transfer(dst, false)
    }

    /// Writes the whole range from `src` (vrdmad's own memory), through `/proc/PID/mem`: a
    /// write cannot be confirmed after the fact, so it goes through the file bound to the
    /// address space, never by PID.
    pub fn write_from_region(&self, src: &MemRegion) -> Result<(), ProcMemError> {
        self.transfer(src, true)
    }

    fn transfer(&self, region: &MemRegion, write: bool) -> Result<(), ProcMemError> {
        let len = self.len as usize;
        let (pid, addr) = (self.mem.pid, self.addr);
        let fail =
            |source| if write { ProcMemError::Write { pid, addr, len, source } } else { ProcMemError::Read { pid, addr, len, source } };
        if region.len() != len {
            return Err(fail(std::io::Error::from_raw_os_error(libc::EINVAL)));
        }
        if !write {
            // Through a buffer of our own: `region` may be seen by another client at once,
            // and a read by PID is confirmed only after it (`ProcMem::read_unchecked`).
            return with_bounce(|bounce| {
                let mut at = 0usize;
                while at < len {
                    let b = &mut bounce[..(len - at).min(BOUNCE)];
                    self.mem.read_unchecked(addr + at as u64, b)?;
                    region.write_from(at, b).map_err(|e| fail(std::io::Error::other(e.to_string())))?;
                    at += b.len();
                }
                Ok(())
            });
        }
        let fd = self.mem.file.as_raw_fd();
        let mut done = 0usize;
        while done < len {
            let buf = (region.addr() + done) as *mut libc::c_void;
            let at = (addr + done as u64) as libc::off_t;
            let n = if write {
                // SAFETY: `[done, len)` of the region is valid readable memory (MemRegion's
                // contract); pwrite(2) only reads it.
                unsafe { libc::pwrite(fd, buf, len - done, at) }
            } else {
                // SAFETY: `[done, len)` of the region is valid writable memory (MemRegion's
                // contract for write accessors); pread(2) stores into it only.
                unsafe { libc::pread(fd, buf, len - done, at) }
            };
            match n {
                n if n > 0 => done += n as usize,
                0 => return Err(fail(std::io::ErrorKind::UnexpectedEof.into())),
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(fail(e));
                    }
                }
            }
        }
        Ok(())
    }
}
