//! Which process a session's memory is: the one that connected, bound by a pidfd (never by a
//! PID, which a process that exits hands on), with the credentials it connected with.
//!
//! The pidfd comes from the socket itself (`SO_PEERPIDFD`, Linux 6.5) where the kernel has
//! it; older kernels get `pidfd_open` of the `SO_PEERCRED` PID, then the process found there
//! must still have the socket's credentials. `/proc/PID` is opened as a directory and the
//! pidfd checked alive *after* that: a `/proc/PID` directory stays bound to the process it
//! was opened for, so every later file opened through it (`mem`, `maps`, `stat`, `status`)
//! is that process's or fails.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use super::ProcMemError;

/// `SO_PEERPIDFD` (asm-generic; the value on every architecture vrdmad builds for).
const SO_PEERPIDFD: libc::c_int = 77;

/// What must stay true of the process for vrdmad to keep accessing its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Identity {
    /// Real, effective, saved and filesystem UIDs: a set-user-ID exec changes them.
    pub(super) uids: [u32; 4],
    /// The same GIDs.
    pub(super) gids: [u32; 4],
    /// Whether the process is dumpable (its /proc files are owned by its effective UID, not
    /// root): a set-ID exec or `PR_SET_DUMPABLE` 0 clears it, and then vrdmad, like
    /// `ptrace`, keeps out.
    pub(super) dumpable: bool,
}

/// A process held by pidfd, with its `/proc/PID` directory.
#[derive(Debug)]
pub(super) struct Bound {
    pub(super) pid: i32,
    pidfd: OwnedFd,
    pub(super) dir: OwnedFd,
}

fn last_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// The peer of Unix socket `sock`: its pidfd and the (effective) UID and GID it connected
/// with.
pub(super) fn peer_of(sock: BorrowedFd<'_>) -> Result<(OwnedFd, u32, u32), ProcMemError> {
    peer_with(sock, true)
}

/// [`peer_of`], with `SO_PEERPIDFD` tried only if `peer_pidfd` (tests take the older
/// kernels' way too).
pub(super) fn peer_with(sock: BorrowedFd<'_>, peer_pidfd: bool) -> Result<(OwnedFd, u32, u32), ProcMemError> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt(2) with an out-buffer of exactly `len` bytes.
    let rc = unsafe {
        libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len)
    };
    if rc != 0 || cred.pid <= 0 {
        return Err(ProcMemError::NoPeer { source: last_error() });
    }
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    let rc = if peer_pidfd {
        // SAFETY: getsockopt(2) with an out-buffer of exactly `len` bytes.
        unsafe { libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, SO_PEERPIDFD, (&mut fd as *mut libc::c_int).cast(), &mut len) }
    } else {
        -1
    };
    let pidfd = if rc == 0 && fd >= 0 {
        // SAFETY: the kernel just created this descriptor for us.
        unsafe { OwnedFd::from_raw_fd(fd) }
    } else {
        // An older kernel: the PID's process now, checked against the socket's credentials by
        // the caller (`bind`).
        pidfd_open(cred.pid)?
    };
    Ok((pidfd, cred.uid, cred.gid))
}

/// `pidfd_open(2)`.
pub(super) fn pidfd_open(pid: i32) -> Result<OwnedFd, ProcMemError> {
    // SAFETY: pidfd_open takes a PID and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(ProcMemError::Gone { pid, source: last_error() });
    }
    // SAFETY: a new descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

/// The PID (in vrdmad's PID namespace) of the process `pidfd` refers to, from its fdinfo.
fn pid_of(pidfd: &OwnedFd) -> Option<i32> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", pidfd.as_raw_fd())).ok()?;
    let pid: i32 = info.lines().find_map(|l| l.strip_prefix("Pid:"))?.trim().parse().ok()?;
    // (-1: exited; 0: in a PID namespace vrdmad cannot see.)
    (pid > 0).then_some(pid)
}

impl Bound {
    /// Binds `pidfd`'s process: its `/proc/PID`, opened while the pidfd shows it alive.
    pub(super) fn new(pidfd: OwnedFd) -> Result<Bound, ProcMemError> {
        let gone = |pid| ProcMemError::Gone { pid, source: std::io::Error::from_raw_os_error(libc::ESRCH) };
        let pid = pid_of(&pidfd).ok_or(gone(0))?;
        let path = std::ffi::CString::new(format!("/proc/{pid}")).map_err(|_| gone(pid))?;
        // SAFETY: open(2) of a NUL-terminated path.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(ProcMemError::Gone { pid, source: last_error() });
        }
        // SAFETY: a new descriptor owned by nobody else.
        let dir = unsafe { OwnedFd::from_raw_fd(fd) };
        let b = Bound { pid, pidfd, dir };
        // Alive after the open: the directory is this process's, not a successor's.
        b.alive()?;
        Ok(b)
    }

    /// Whether the process still runs (a signal 0 through the pidfd).
    pub(super) fn alive(&self) -> Result<(), ProcMemError> {
        // SAFETY: pidfd_send_signal with signal 0 (nothing is delivered), no siginfo.
        let rc = unsafe { libc::syscall(libc::SYS_pidfd_send_signal, self.pidfd.as_raw_fd(), 0, std::ptr::null::<libc::siginfo_t>(), 0) };
        if rc != 0 {
            return Err(ProcMemError::Gone { pid: self.pid, source: last_error() });
        }
        Ok(())
    }

    /// Opens `name` in the process's `/proc/PID` directory.
    pub(super) fn open(&self, name: &str, write: bool) -> Result<File, ProcMemError> {
        let c = std::ffi::CString::new(name)
            .map_err(|_| ProcMemError::Open { pid: self.pid, source: std::io::Error::from_raw_os_error(libc::EINVAL) })?;
        let mode = if write { libc::O_RDWR } else { libc::O_RDONLY };
        // SAFETY: openat(2) relative to our live directory descriptor, NUL-terminated name.
        let fd = unsafe { libc::openat(self.dir.as_raw_fd(), c.as_ptr(), mode | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(ProcMemError::Open { pid: self.pid, source: last_error() });
        }
        // SAFETY: a new descriptor owned by nobody else.
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    /// The process's effective UID and GID now, and whether it is dumpable, from the owners
    /// the kernel gives its `/proc/PID` directory (always the effective IDs) and its `mem`
    /// (root of its user namespace once it is not dumpable), both computed afresh: two
    /// system calls, where [`Bound::identity`] reads a file. This is what every access
    /// checks. (Root's loss of dumpability does not show; nor does it keep root's `ptrace`
    /// out.)
    pub(super) fn effective(&self) -> Result<([u32; 2], bool), ProcMemError> {
        let owner = |name: &std::ffi::CStr| {
            // SAFETY: an all-zero stat is a valid out-parameter.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fstatat(2) relative to our live directory descriptor, a NUL-terminated
            // name, into `st`, which lives for the call.
            if unsafe { libc::fstatat(self.dir.as_raw_fd(), name.as_ptr(), &mut st, libc::AT_EMPTY_PATH) } != 0 {
                return Err(ProcMemError::Gone { pid: self.pid, source: last_error() });
            }
            Ok([st.st_uid, st.st_gid])
        };
        let ids = owner(c"")?;
        Ok((ids, owner(c"mem")? == ids))
    }

    /// The process's identity now.
    pub(super) fn identity(&self) -> Result<Identity, ProcMemError> {
        let bad = |what: &str| ProcMemError::Unparsable { pid: self.pid, what: what.to_string() };
        let read = |name: &str| -> Result<(String, libc::uid_t), ProcMemError> {
            let mut f = self.open(name, false)?;
            let owner = std::os::unix::fs::MetadataExt::uid(&f.metadata().map_err(|source| ProcMemError::Open { pid: self.pid, source })?);
            // (`status` fits: read in one system call, not a dozen doubling ones.)
            let mut s = String::with_capacity(4096);
            f.read_to_string(&mut s).map_err(|source| ProcMemError::Open { pid: self.pid, source })?;
            Ok((s, owner))
        };
        let (status, owner) = read("status")?;
        let ids = |key: &str| -> Result<[u32; 4], ProcMemError> {
            let line = status.lines().find_map(|l| l.strip_prefix(key)).ok_or_else(|| bad(key))?;
            let v: Vec<u32> = line.split_whitespace().filter_map(|s| s.parse().ok()).collect();
            v.try_into().map_err(|_| bad(key))
        };
        let uids = ids("Uid:")?;
        Ok(Identity { uids, gids: ids("Gid:")?, dumpable: owner == uids[1] })
    }
}
