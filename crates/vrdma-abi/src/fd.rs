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

/// Adds 1 to an eventfd's count, waking whoever sleeps on it, without ever waiting. A full
/// counter (which a sleeper that never drains could cause) or a closed peer is not an error
/// worth reporting: the wakeup is pending either way.
///
/// Not with `write(2)`: whether a write to a full eventfd waits is the eventfd's `O_NONBLOCK`,
/// a flag of the open file, which every holder of a descriptor of it can clear, and vrdmad
/// shares its CQs' eventfds with their owners and their peers. A client that cleared it and
/// filled the counter made vrdmad's next wakeup wait until someone read the eventfd: under the
/// registry lock, every vNIC of the host waited for ever. The count is raised by the kernel
/// instead (in a process that asked for it, [`signal_from_kernel`]: vrdmad), as an
/// asynchronous I/O's completion (`IOCB_FLAG_RESFD`: a read of nothing from `/dev/null`,
/// complete at once), which never waits. Elsewhere (the library: an AIO context is a share of
/// the host's `fs.aio-max-nr`, which grows with the CPU count, and every process would take
/// one), or where AIO is not available, a write is made only when `poll` finds room, which
/// leaves a window between the two.
pub fn signal_eventfd(fd: impl AsFd) {
    let raw = fd.as_fd().as_raw_fd();
    if KERNEL_SIGNALS.load(std::sync::atomic::Ordering::Relaxed) {
        if let Some(s) = aio::signaller() {
            if s.signal(raw) {
                return;
            }
        }
    }
    let mut p = libc::pollfd { fd: raw, events: libc::POLLOUT, revents: 0 };
    // SAFETY: poll(2) on one live pollfd.
    if unsafe { libc::poll(&mut p, 1, 0) } != 1 || p.revents & libc::POLLOUT == 0 {
        return;
    }
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64 to a descriptor the caller holds.
    unsafe { libc::write(raw, &one as *const u64 as *const libc::c_void, 8) };
}

static KERNEL_SIGNALS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes [`signal_eventfd`] raise counts from the kernel side in this process, never waiting
/// (one AIO context for the process, made at the first wakeup).
pub fn signal_from_kernel() {
    KERNEL_SIGNALS.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Raising an eventfd's count from the kernel side: the completion of an asynchronous read of
/// nothing, with the eventfd as its result descriptor (see [`signal_eventfd`]).
mod aio {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
    use std::sync::{Mutex, OnceLock};

    /// `struct iocb` (linux/aio_abi.h, little-endian layout).
    #[repr(C)]
    #[derive(Default)]
    struct Iocb {
        aio_data: u64,
        aio_key: u32,
        aio_rw_flags: i32,
        aio_lio_opcode: u16,
        aio_reqprio: i16,
        aio_fildes: u32,
        aio_buf: u64,
        aio_nbytes: u64,
        aio_offset: i64,
        aio_reserved2: u64,
        aio_flags: u32,
        aio_resfd: u32,
    }

    /// `struct io_event`.
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct IoEvent {
        data: u64,
        obj: u64,
        res: i64,
        res2: i64,
    }

    const IOCB_CMD_PREAD: u16 = 0;
    const IOCB_FLAG_RESFD: u32 = 1;

    /// The process's AIO context (one: a context is a share of the host's `aio-max-nr`) and
    /// `/dev/null`, whose reads complete at once.
    pub(super) struct Signaller {
        ctx: Mutex<libc::c_ulong>,
        null: OwnedFd,
    }

    /// The process's signaller, set up at first use; `None` where AIO is not available.
    pub(super) fn signaller() -> Option<&'static Signaller> {
        static S: OnceLock<Option<Signaller>> = OnceLock::new();
        S.get_or_init(|| {
            if cfg!(target_endian = "big") {
                return None;
            }
            // SAFETY: open(2) of a NUL-terminated path.
            let null = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
            if null < 0 {
                return None;
            }
            // SAFETY: a descriptor open(2) just returned, owned by nobody else.
            let null = unsafe { OwnedFd::from_raw_fd(null) };
            let mut ctx: libc::c_ulong = 0;
            // SAFETY: io_setup(2) with a live out-parameter.
            if unsafe { libc::syscall(libc::SYS_io_setup, 16, &mut ctx) } != 0 {
                return None;
            }
            Some(Signaller { ctx: Mutex::new(ctx), null })
        })
        .as_ref()
    }

    impl Signaller {
        /// Raises `eventfd`'s count by one (saturating); whether it did.
        pub(super) fn signal(&self, eventfd: RawFd) -> bool {
            let Ok(resfd) = u32::try_from(eventfd) else { return false };
            let mut cb = Iocb {
                aio_lio_opcode: IOCB_CMD_PREAD,
                aio_fildes: self.null.as_raw_fd() as u32,
                aio_flags: IOCB_FLAG_RESFD,
                aio_resfd: resfd,
                ..Iocb::default()
            };
            let mut list = [&mut cb as *mut Iocb];
            let ctx = self.ctx.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: io_submit(2) of one live iocb on our context; the read is of no bytes
            // (no buffer is touched) and completes within the call.
            let n = unsafe { libc::syscall(libc::SYS_io_submit, *ctx, 1, list.as_mut_ptr()) };
            if n != 1 {
                return false;
            }
            // Reap its completion (and any left over), without waiting.
            let mut events = [IoEvent::default(); 16];
            let now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
            // SAFETY: io_getevents(2) into a live array of as many events as it says.
            unsafe { libc::syscall(libc::SYS_io_getevents, *ctx, 0, events.len(), events.as_mut_ptr(), &now) };
            true
        }
    }
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

    /// A wakeup never waits, even on an eventfd someone made blocking and filled: the count
    /// stays full (the wakeup is pending).
    #[test]
    fn a_full_blocking_eventfd_is_signalled_without_waiting() {
        signal_from_kernel();
        let fd = new_eventfd().unwrap();
        set_nonblocking(&fd, false).unwrap();
        let full: u64 = u64::MAX - 1;
        // SAFETY: write(2) of a live u64 to our eventfd.
        assert_eq!(unsafe { libc::write(fd.as_raw_fd(), (&full as *const u64).cast(), 8) }, 8);
        let t = std::time::Instant::now();
        signal_eventfd(&fd);
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
        set_nonblocking(&fd, true).unwrap();
        assert!(drain_eventfd(&fd) >= u64::MAX - 1);
        signal_eventfd(&fd);
        assert_eq!(drain_eventfd(&fd), 1, "a wakeup adds one");
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
