//! Small descriptor helpers shared by the library and the daemon: eventfds (the doorbells
//! and completion-channel wakeups of both sides) and `O_NONBLOCK`.
//!
//! They live here, beside [`crate::shm`], because both sides of a ring use the same
//! wakeup primitive and must agree on how it is written and drained.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

/// A new non-blocking, close-on-exec eventfd with a count of 0.
pub fn new_eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain eventfd(2) call with integer arguments.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds 1 to an eventfd's count, waking whoever sleeps on it. A full counter (which a
/// sleeper that never drains could cause) or a closed peer is not an error worth
/// reporting: the wakeup is pending either way.
pub fn signal_eventfd(fd: impl AsFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64 to a descriptor the caller holds.
    unsafe { libc::write(fd.as_fd().as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
}

/// Resets a non-blocking eventfd's count to 0 and returns what it was (0 when nothing
/// was pending).
pub fn drain_eventfd(fd: impl AsFd) -> u64 {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a live u64 from a descriptor the caller holds.
    let n = unsafe { libc::read(fd.as_fd().as_raw_fd(), &mut v as *mut u64 as *mut libc::c_void, 8) };
    if n == 8 {
        v
    } else {
        0
    }
}

/// Sets or clears `O_NONBLOCK` on a descriptor.
pub fn set_nonblocking(fd: impl AsFd, on: bool) -> io::Result<()> {
    let raw = fd.as_fd().as_raw_fd();
    // SAFETY: fcntl with integer arguments on a descriptor the caller holds.
    let flags = unsafe { libc::fcntl(raw, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    let flags = if on { flags | libc::O_NONBLOCK } else { flags & !libc::O_NONBLOCK };
    // SAFETY: as above.
    if unsafe { libc::fcntl(raw, libc::F_SETFL, flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_eventfd_counts_signals_until_drained() {
        let fd = new_eventfd().unwrap();
        assert_eq!(drain_eventfd(&fd), 0, "a new eventfd has nothing pending");
        signal_eventfd(&fd);
        signal_eventfd(&fd);
        assert_eq!(drain_eventfd(&fd), 2);
        assert_eq!(drain_eventfd(&fd), 0, "draining resets the count");
    }

    #[test]
    fn nonblocking_is_set_and_cleared() {
        let fd = new_eventfd().unwrap();
        let flags = || {
            // SAFETY: F_GETFL on a descriptor we hold.
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) }
        };
        set_nonblocking(&fd, false).unwrap();
        assert_eq!(flags() & libc::O_NONBLOCK, 0);
        set_nonblocking(&fd, true).unwrap();
        assert_ne!(flags() & libc::O_NONBLOCK, 0);
    }
}
