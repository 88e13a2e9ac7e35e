//! The control channel: a `SOCK_SEQPACKET` Unix socket carrying one message per datagram
//! and file descriptors with `SCM_RIGHTS`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::Path;

use crate::control::{MAX_FDS, MAX_MESSAGE};

/// Channel failures, classified for the caller: `Closed` (peer went away) vs I/O errors.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// Connecting to a control socket failed (no daemon, or no permission).
    #[error("connecting to {path}: {source}")]
    Connect {
        /// The socket's path.
        path: String,
        /// The `connect` error.
        source: std::io::Error,
    },
    /// Listening on a control socket's path failed.
    #[error("binding {path}: {source}")]
    Bind {
        /// The socket's path.
        path: String,
        /// The `bind` or `listen` error.
        source: std::io::Error,
    },
    /// `sendmsg` failed.
    #[error("sending a {len}-byte message with {fds} fds: {source}")]
    Send {
        /// Bytes of the message.
        len: usize,
        /// Descriptors passed with it.
        fds: usize,
        /// The `sendmsg` error.
        source: std::io::Error,
    },
    /// `recvmsg` failed.
    #[error("receiving a message: {source}")]
    Recv {
        /// The `recvmsg` error.
        source: std::io::Error,
    },
    /// The peer closed its end (end of file, or a reset connection).
    #[error("the peer closed the channel")]
    Closed,
    /// A message arrived cut short (`MSG_TRUNC`) or with more descriptors than fit
    /// (`MSG_CTRUNC`).
    #[error("a message or its fds were truncated")]
    Truncated,
}

/// One end of a control channel.
#[derive(Debug)]
pub struct Channel {
    fd: OwnedFd,
}

fn cvt(rc: libc::c_int) -> std::io::Result<libc::c_int> {
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn sockaddr(path: &Path) -> std::io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: sockaddr_un is plain data; zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(std::io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    Ok((addr, std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t))
}

fn seqpacket_socket() -> std::io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call.
    let fd = cvt(unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: fd is new and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Channel {
    /// Connects to the listener at `path`.
    pub fn connect(path: &Path) -> Result<Channel, ChannelError> {
        let err = |source| ChannelError::Connect { path: path.display().to_string(), source };
        let fd = seqpacket_socket().map_err(err)?;
        let (addr, len) = sockaddr(path).map_err(err)?;
        // SAFETY: addr is a valid sockaddr_un of len bytes.
        cvt(unsafe { libc::connect(fd.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, len) }).map_err(err)?;
        Ok(Channel { fd })
    }

    /// A connected pair (tests).
    pub fn pair() -> std::io::Result<(Channel, Channel)> {
        let mut fds = [0; 2];
        // SAFETY: fds is a valid out array of two ints.
        cvt(unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) })?;
        // SAFETY: both fds are new and owned by us.
        Ok(unsafe { (Channel { fd: OwnedFd::from_raw_fd(fds[0]) }, Channel { fd: OwnedFd::from_raw_fd(fds[1]) }) })
    }

    /// Sends one message with `fds`.
    pub fn send(&self, msg: &[u8], fds: &[RawFd]) -> Result<(), ChannelError> {
        let err = |source| ChannelError::Send { len: msg.len(), fds: fds.len(), source };
        let mut iov = libc::iovec { iov_base: msg.as_ptr() as *mut libc::c_void, iov_len: msg.len() };
        let fd_bytes = std::mem::size_of_val(fds);
        // SAFETY: CMSG_SPACE is a pure computation.
        let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
        let mut cbuf = vec![0u64; space.div_ceil(8)];
        // SAFETY: msghdr is plain data.
        let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
        mh.msg_iov = &mut iov;
        mh.msg_iovlen = 1;
        if !fds.is_empty() {
            mh.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
            mh.msg_controllen = space as _;
            // SAFETY: msg_control points at a buffer of CMSG_SPACE(fd_bytes) bytes, so the
            // first header and its data fit.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&mh);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
                std::ptr::copy_nonoverlapping(fds.as_ptr() as *const u8, libc::CMSG_DATA(c), fd_bytes);
            }
        }
        loop {
            // SAFETY: mh points at live buffers for the duration of the call.
            match cvt(unsafe { libc::sendmsg(self.fd.as_raw_fd(), &mh, libc::MSG_NOSIGNAL) as libc::c_int }) {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => return Err(ChannelError::Closed),
                Err(e) => return Err(err(e)),
            }
        }
    }

    /// Receives one message and its fds. Messages longer than [`MAX_MESSAGE`] or carrying
    /// more than [`MAX_FDS`] fds are reported as [`ChannelError::Truncated`] (any fds that
    /// did arrive are closed).
    pub fn recv(&self) -> Result<(Vec<u8>, Vec<OwnedFd>), ChannelError> {
        // Not zeroed first (the kernel fills what it received; the rest is never read).
        let mut buf: Vec<u8> = Vec::with_capacity(MAX_MESSAGE + 1);
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: MAX_MESSAGE + 1 };
        // SAFETY: pure computation.
        let space = unsafe { libc::CMSG_SPACE((MAX_FDS * 4) as u32) } as usize;
        let mut cbuf = vec![0u64; space.div_ceil(8)];
        // SAFETY: msghdr is plain data.
        let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
        mh.msg_iov = &mut iov;
        mh.msg_iovlen = 1;
        mh.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        mh.msg_controllen = space as _;
        let n = loop {
            // SAFETY: mh points at live buffers for the duration of the call.
            match unsafe { libc::recvmsg(self.fd.as_raw_fd(), &mut mh, libc::MSG_CMSG_CLOEXEC) } {
                n if n >= 0 => break n as usize,
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    if e.raw_os_error() == Some(libc::ECONNRESET) {
                        return Err(ChannelError::Closed);
                    }
                    return Err(ChannelError::Recv { source: e });
                }
            }
        };
        let mut fds = Vec::new();
        // SAFETY: walking the control buffer the kernel filled, with the libc CMSG macros
        // that bound every header by msg_controllen.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&mh);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c);
                    let len = (*c).cmsg_len as usize - (data as usize - c as usize);
                    for i in 0..len / 4 {
                        let mut fd: RawFd = 0;
                        std::ptr::copy_nonoverlapping(data.add(i * 4), &mut fd as *mut RawFd as *mut u8, 4);
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
                c = libc::CMSG_NXTHDR(&mh, c);
            }
        }
        if n == 0 && fds.is_empty() {
            return Err(ChannelError::Closed);
        }
        if mh.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 || n > MAX_MESSAGE {
            return Err(ChannelError::Truncated);
        }
        // SAFETY: recvmsg wrote n bytes (n <= MAX_MESSAGE, within the capacity) at the
        // start of the buffer.
        unsafe { buf.set_len(n) };
        Ok((buf, fds))
    }

    /// Raw fd (for poll).
    pub fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Binds a `SOCK_SEQPACKET` listener at `path` (replacing a stale socket file).
pub fn listen(path: &Path) -> Result<UnixListener, ChannelError> {
    let err = |source| ChannelError::Bind { path: path.display().to_string(), source };
    let _ = std::fs::remove_file(path);
    let fd = seqpacket_socket().map_err(err)?;
    let (addr, len) = sockaddr(path).map_err(err)?;
    // SAFETY: addr is a valid sockaddr_un of len bytes.
    cvt(unsafe { libc::bind(fd.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, len) }).map_err(err)?;
    // SAFETY: plain listen(2) on our socket.
    cvt(unsafe { libc::listen(fd.as_raw_fd(), 128) }).map_err(err)?;
    Ok(UnixListener::from(fd))
}

impl From<OwnedFd> for Channel {
    fn from(fd: OwnedFd) -> Self {
        Channel { fd }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn message_and_fds_cross() {
        let (a, b) = Channel::pair().unwrap();
        let memfd = crate::shm::create_memfd("x", 4096, true).unwrap();
        a.send(b"hello", &[memfd.as_raw_fd()]).unwrap();
        let (m, fds) = b.recv().unwrap();
        assert_eq!(m, b"hello");
        assert_eq!(fds.len(), 1);
        assert!(crate::shm::check_sealed(fds[0].as_fd(), 4096).is_ok());
        drop(a);
        assert!(matches!(b.recv(), Err(ChannelError::Closed)));
    }
}
