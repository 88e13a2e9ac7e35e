//! Socket calls of the engine's connections: non-blocking sends, receives with kernel
//! timestamps, socket options.

use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Duration;

use crate::engine::trace;

/// One non-blocking send of `bytes` on socket `fd`: how many it took, 0 when full.
pub(crate) fn try_send(fd: std::os::fd::BorrowedFd<'_>, bytes: &[u8]) -> std::io::Result<usize> {
    let iov = [libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() }];
    // SAFETY: the iovec describes `bytes`, live for the call.
    unsafe { vrdma_abi::shm::try_sendmsg(fd, &iov) }
}

pub(crate) fn tune(s: &TcpStream, timeout: Duration) {
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(timeout));
    let ms = timeout.as_millis().min(u32::MAX as u128) as libc::c_uint;
    // Bounded send stalls on a cut link become errors instead of hangs.
    let _ = set_socket_option(s.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, &ms);
    if trace::enabled() {
        let on: libc::c_int = 1;
        let _ = set_socket_option(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, &on);
    }
}

/// recv(2) into `buf` with `flags`.
pub(crate) fn recv_into(fd: i32, buf: &mut [u8], flags: libc::c_int) -> std::io::Result<usize> {
    // SAFETY: at most buf.len() bytes into the live, writable `buf`.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// A read (with recv(2)'s `flags`) that also returns when the kernel received the data
/// (CLOCK_MONOTONIC ns), for tracing (the socket has `SO_TIMESTAMPNS`, see `tune`).
pub(crate) fn read_stamped(fd: i32, buf: &mut [u8], flags: libc::c_int) -> std::io::Result<(usize, Option<u64>)> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut control = [0u64; 16];
    // SAFETY: msghdr is plain C data; all-zero is its empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: msg points at one iovec over `buf` and at `control`, all live for the call.
    let n = unsafe { libc::recvmsg(fd, &mut msg, flags) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut at = None;
    // SAFETY: the kernel filled `control` up to msg_controllen; the CMSG macros stay within
    // it, and a SCM_TIMESTAMPNS message's data is a timespec (read unaligned).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_TIMESTAMPNS {
                let ts: libc::timespec = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast());
                at = Some(trace::monotonic_of_realtime(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64));
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n as usize, at))
}

/// Disconnects TCP socket `fd` (`connect(2)` to `AF_UNSPEC`, which no cgroup BPF program
/// sees): it is reset if connected and closed at once, queued data dropped, so no `close` of
/// it can wait for a linger time, whatever options its other holders set.
pub(crate) fn disconnect(fd: std::os::fd::RawFd) -> std::io::Result<()> {
    // SAFETY: `sockaddr` is plain C data; all-zero is a valid value, its family AF_UNSPEC.
    let mut sa: libc::sockaddr = unsafe { std::mem::zeroed() };
    sa.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
    // SAFETY: a live sockaddr of the size given, only read; a bad descriptor is an error.
    let rc = unsafe { libc::connect(fd, &sa, std::mem::size_of::<libc::sockaddr>() as libc::socklen_t) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Socket option values: plain C data that setsockopt(2) reads as bytes.
pub(crate) trait SocketOptionValue: Copy {}
impl SocketOptionValue for libc::c_int {}
impl SocketOptionValue for libc::c_uint {}
impl SocketOptionValue for libc::linger {}

/// setsockopt(2) of `value` (its size is the option's length).
pub(crate) fn set_socket_option<T: SocketOptionValue>(
    fd: std::os::fd::RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: &T,
) -> std::io::Result<()> {
    // SAFETY: `value` is a live, plain C value of size_of::<T>() bytes, only read; a bad
    // descriptor or option is an error return, not undefined behaviour.
    let rc = unsafe { libc::setsockopt(fd, level, name, (value as *const T).cast(), std::mem::size_of::<T>() as libc::socklen_t) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
