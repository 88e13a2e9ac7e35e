//! Host-to-host connections: several TCP connections per peer daemon, framed with
//! [`vrdma_abi::wire`], a HELLO exchange, heartbeats, and a reader thread per connection.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use vrdma_abi::shm::MemRegion;
use vrdma_abi::wire::{self, ConnectReq, FrameHeader, Kind, WireError, HEADER_LEN};

use super::affinity::{incoming_cpu, CpuFollower};
use super::token_timer::TokenTimer;
use super::trace::{self, Stage};
use super::{qp, responder, Engine, MappedMr};

/// Transport failures, classified: a `Retry` may succeed later as is, `Reconnect` needs a new
/// connection (the peer or the path failed), `Fatal` means the peer is not a compatible vrdmad.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("connecting to {addr}: {source}")]
    Connect { addr: SocketAddr, source: std::io::Error },
    #[error("HELLO with {addr}: {reason}")]
    Hello { addr: SocketAddr, reason: String },
    #[error("sending to {addr}: {source}")]
    Send { addr: SocketAddr, source: std::io::Error },
    #[error("receiving from {addr}: {source}")]
    Recv { addr: SocketAddr, source: std::io::Error },
    #[error("bad frame from {addr}: {source}")]
    Protocol { addr: SocketAddr, source: WireError },
    /// A lane's guarded socket (`lane_guard`) could not be made or connected.
    #[error("lane to {addr}: {source}")]
    LaneSocket { addr: SocketAddr, source: super::lane_guard::LaneGuardError },
}

/// What to do about a [`LinkError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// Try again later on the same path.
    Retry,
    /// Drop the connection; a new one may work.
    Reconnect,
    /// The peer is incompatible.
    Fatal,
}

impl LinkError {
    /// Classification for callers.
    pub fn recovery(&self) -> Recovery {
        match self {
            LinkError::Connect { source, .. } if source.kind() == std::io::ErrorKind::TimedOut => Recovery::Retry,
            LinkError::Protocol { source: WireError::BadVersion { .. } | WireError::BadMagic { .. }, .. } => Recovery::Fatal,
            LinkError::Hello { .. } => Recovery::Fatal,
            _ => Recovery::Reconnect,
        }
    }
}

/// When anything last arrived from one peer daemon, on any of its connections.
pub(crate) struct PeerRx {
    epoch: std::time::Instant,
    /// Milliseconds since `epoch`.
    last_ms: std::sync::atomic::AtomicU64,
}

impl PeerRx {
    pub(crate) fn new() -> PeerRx {
        PeerRx { epoch: std::time::Instant::now(), last_ms: std::sync::atomic::AtomicU64::new(0) }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// A frame arrived.
    fn heard(&self) {
        self.last_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// Whether a frame arrived within `d`.
    fn heard_within(&self, d: Duration) -> bool {
        self.now_ms().saturating_sub(self.last_ms.load(Ordering::Relaxed)) < d.as_millis() as u64
    }
}

/// One TCP connection; frames are written whole under `write`.
///
/// Connections we opened (requests, heartbeats, UD datagrams) are written by the doorbell
/// thread, which serves every QP of the host and so must never wait for one slow peer: their
/// writes never block. What the socket does not take goes to the connection's [`Backlog`],
/// sent by the doorbell thread when epoll reports room (`EPOLLOUT`); meanwhile the QPs that
/// use the connection are parked instead of pumped, so the backlog stays small. Connections
/// peers opened to us carry only responses, written by their own reader thread, which may
/// block: that is back-pressure on the one peer that does not read.
pub(crate) struct Conn {
    stream: TcpStream,
    write: Mutex<Backlog>,
    /// Bytes in the backlog (read without the lock).
    backlog_bytes: AtomicUsize,
    /// Set for non-blocking connections: the doorbell thread's epoll and our token there.
    hook: Option<Hook>,
    alive: AtomicBool,
    /// What the connection's reader (the only thread that reads it) has read ahead.
    rx: Mutex<RxBuf>,
    /// The peer daemon's listening address (its identity).
    pub(crate) peer: SocketAddr,
}

/// Bytes a reader takes from its socket per read: a header with a small frame's data, or a
/// run of small frames, in one system call; larger data goes straight from the socket to
/// its destination (at most this much of it is copied through here).
const RX_BUF: usize = 8192;

/// A reader's read-ahead: `buf[start..end]` is received and not yet consumed.
///
/// A lane's reader *peeks* (`peek`): it waits for a frame with `MSG_PEEK` (into an empty
/// buffer) and leaves the bytes it took in the socket (`peeked` of them, at the socket's
/// head) until it is about to wait again, or needs more than the read brought. A lane carries requests one way
/// only, so its kernel cannot piggyback ACKs on data: it acknowledges small segments when a
/// read empties the socket, and would send and process that TCP ACK (through the other
/// host's socket, on this CPU) inside the very read that brings a request, before the
/// reader has it. Peeking moves that ACK to when the bytes are dropped, after the request
/// was executed.
struct RxBuf {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    peek: bool,
    peeked: usize,
}

impl RxBuf {
    fn new() -> RxBuf {
        RxBuf { buf: vec![0u8; RX_BUF].into_boxed_slice(), start: 0, end: 0, peek: false, peeked: 0 }
    }

    /// What a connection that is no longer read keeps (no allocation).
    fn empty() -> RxBuf {
        RxBuf { buf: Box::default(), start: 0, end: 0, peek: false, peeked: 0 }
    }

    fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Moves up to `out.len()` buffered bytes into `out`; how many.
    fn take(&mut self, out: &mut [u8]) -> usize {
        let n = out.len().min(self.buffered());
        out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.consume(n);
        n
    }

    fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
    }

    /// Drops from `fd` the bytes peeked into the buffer (they stay buffered): the socket
    /// then continues where the buffer ends. Before any read of the socket's own.
    fn settle(&mut self, fd: i32) -> std::io::Result<()> {
        while self.peeked > 0 {
            // SAFETY: at most `peeked` (<= buf.len()) bytes into the live `buf`; with
            // MSG_TRUNC a TCP socket drops them without copying anything.
            let n = unsafe { libc::recv(fd, self.buf.as_mut_ptr().cast(), self.peeked, libc::MSG_TRUNC) };
            match n {
                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                1.. => self.peeked -= (n as usize).min(self.peeked),
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
}

#[derive(Clone)]
pub(crate) struct Hook {
    pub(crate) epfd: i32,
    pub(crate) token: u64,
    /// Where what is parked goes when the connection fails or goes (the doorbell thread
    /// resumes it: a QP flushes, a UD socket is read again).
    pub(crate) resume: Weak<Engine>,
}

/// Frames (or their rest) waiting for room in a non-blocking connection's socket, in order.
#[derive(Default)]
struct Backlog {
    items: VecDeque<Queued>,
    /// `EPOLLOUT` is armed (one-shot) for the connection.
    armed: bool,
    /// The socket is in the doorbell thread's epoll set.
    registered: bool,
    /// What found the backlog non-empty: resumed once it is sent.
    parked: Vec<Parked>,
}

/// A sender waiting for a connection's backlog to go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Parked {
    /// A mediated QP (pumped again).
    Qp(u32),
    /// A UD QP's datagram socket (read again: meanwhile its datagrams wait there, and the
    /// client's sends wait for room as on a full send queue).
    Ud(u32),
}

enum Queued {
    /// Bytes, and how many of them went already.
    Bytes(Vec<u8>, usize),
    /// MR bytes still to send (the WR is not complete before its ACK, so the memory is the
    /// application's to keep as it is; the mapping is held).
    Region(Arc<MappedMr>, usize, usize),
}

impl Queued {
    fn len(&self) -> usize {
        match self {
            Queued::Bytes(b, sent) => b.len() - sent,
            Queued::Region(_, _, len) => *len,
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Whatever is still parked here would wait for an event that can no longer come.
        let parked = std::mem::take(&mut self.write.get_mut().parked);
        if let Some(e) = self.hook.as_ref().and_then(|h| h.resume.upgrade()) {
            e.resume_parked(parked);
        }
    }
}

/// One non-blocking send of `bytes` on socket `fd`: how many it took, 0 when full.
pub(crate) fn try_send(fd: std::os::fd::BorrowedFd<'_>, bytes: &[u8]) -> std::io::Result<usize> {
    let iov = [libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() }];
    // SAFETY: the iovec describes `bytes`, live for the call.
    unsafe { vrdma_abi::shm::try_sendmsg(fd, &iov) }
}

impl Conn {
    /// A connection whose writes block (peers' connections to us).
    fn new(stream: TcpStream, peer: SocketAddr) -> Conn {
        Conn::with_hook(stream, peer, None)
    }

    fn with_hook(stream: TcpStream, peer: SocketAddr, hook: Option<Hook>) -> Conn {
        Conn {
            stream,
            write: Mutex::new(Backlog::default()),
            backlog_bytes: AtomicUsize::new(0),
            hook,
            alive: AtomicBool::new(true),
            rx: Mutex::new(RxBuf::new()),
            peer,
        }
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.stream)
    }

    /// Bytes waiting in the backlog (0 for blocking connections).
    pub(crate) fn backlog(&self) -> usize {
        self.backlog_bytes.load(Ordering::Acquire)
    }

    /// Sends a frame whose data (if any) is in `data`.
    pub(crate) fn send(&self, h: &FrameHeader, data: &[u8]) -> std::io::Result<()> {
        let head = h.encode();
        if self.hook.is_none() {
            let _g = self.write.lock();
            let mut s = &self.stream;
            if data.is_empty() {
                return s.write_all(&head);
            }
            let mut buf = Vec::with_capacity(HEADER_LEN + data.len());
            buf.extend_from_slice(&head);
            buf.extend_from_slice(data);
            return s.write_all(&buf);
        }
        let mut buf = Vec::with_capacity(HEADER_LEN + data.len());
        buf.extend_from_slice(&head);
        buf.extend_from_slice(data);
        self.send_queued(buf)
    }

    /// Sends a frame whose data is `len` bytes of `mr` at `off`.
    pub(crate) fn send_mr(&self, h: &FrameHeader, mr: &Arc<MappedMr>, off: usize, len: usize) -> std::io::Result<()> {
        let Some(hook) = &self.hook else {
            return mr.send(self, h, off, len);
        };
        let head = h.encode();
        let mut b = self.write.lock();
        let sent = if b.items.is_empty() { mr.try_send(self.fd(), &head, off, len)? } else { 0 };
        if sent < head.len() {
            b.items.push_back(Queued::Bytes(head.to_vec(), sent));
        }
        let done = sent.saturating_sub(head.len());
        if done < len {
            b.items.push_back(Queued::Region(mr.clone(), off + done, len - done));
        }
        self.queued(&mut b, hook);
        Ok(())
    }

    /// Sends a frame whose data is `len` bytes of `mem` at `off` (registered memory); blocks.
    pub(crate) fn send_region(&self, h: &FrameHeader, mem: &MemRegion, off: usize, len: usize) -> std::io::Result<()> {
        debug_assert!(self.hook.is_none(), "a blocking send on a non-blocking connection");
        let _g = self.write.lock();
        mem.write_to_fd(self.fd(), &h.encode(), off, len)
    }

    /// Sends frame `h` and `len` bytes produced `step` at a time by `fill(offset, buf)`; blocks.
    pub(crate) fn send_streamed(
        &self,
        h: &FrameHeader,
        len: usize,
        step: usize,
        mut fill: impl FnMut(usize, &mut [u8]),
    ) -> std::io::Result<()> {
        debug_assert!(self.hook.is_none(), "a blocking send on a non-blocking connection");
        let mut buf = vec![0u8; len.min(step)];
        let _g = self.write.lock();
        (&self.stream).write_all(&h.encode())?;
        let mut at = 0;
        while at < len {
            let n = (len - at).min(step);
            fill(at, &mut buf[..n]);
            (&self.stream).write_all(&buf[..n])?;
            at += n;
        }
        Ok(())
    }

    /// Sends bytes already framed (a batch of small frames).
    pub(crate) fn send_raw(&self, bytes: Vec<u8>) -> std::io::Result<()> {
        if self.hook.is_none() {
            let _g = self.write.lock();
            return (&self.stream).write_all(&bytes);
        }
        self.send_queued(bytes)
    }

    fn send_queued(&self, bytes: Vec<u8>) -> std::io::Result<()> {
        let hook = self.hook.as_ref().expect("non-blocking connection");
        let mut b = self.write.lock();
        let sent = if b.items.is_empty() { try_send(self.fd(), &bytes)? } else { 0 };
        if sent < bytes.len() {
            b.items.push_back(Queued::Bytes(bytes, sent));
        }
        self.queued(&mut b, hook);
        Ok(())
    }

    /// After a write: accounts for the backlog and asks epoll for room if it is not empty.
    fn queued(&self, b: &mut Backlog, hook: &Hook) {
        let bytes: usize = b.items.iter().map(Queued::len).sum();
        self.backlog_bytes.store(bytes, Ordering::Release);
        if !b.items.is_empty() && !b.armed {
            let mut ev = libc::epoll_event { events: (libc::EPOLLOUT | libc::EPOLLONESHOT) as u32, u64: hook.token };
            let op = if b.registered { libc::EPOLL_CTL_MOD } else { libc::EPOLL_CTL_ADD };
            // SAFETY: the engine's epoll fd (it outlives its connections) and a live event.
            if unsafe { libc::epoll_ctl(hook.epfd, op, self.stream.as_raw_fd(), &mut ev) } == 0 {
                b.registered = true;
                b.armed = true;
            } else {
                // Without a wakeup the backlog would never go: fail the connection instead.
                log::warn!("engine: connection to {}: epoll: {}", self.peer, std::io::Error::last_os_error());
                self.fail_locked(b);
            }
        }
    }

    /// With the backlog non-empty, parks `who` (resumed when it is sent) and returns true:
    /// new requests wait for room rather than grow the backlog.
    pub(crate) fn park_if_backlogged(&self, who: Parked) -> bool {
        if self.backlog() == 0 {
            return false;
        }
        let mut b = self.write.lock();
        if b.items.is_empty() {
            return false;
        }
        if !b.parked.contains(&who) {
            b.parked.push(who);
        }
        true
    }

    /// Whether `who` is parked here (so it is resumed when the backlog is sent, and needs
    /// no other wakeup meanwhile).
    pub(crate) fn is_parked(&self, who: Parked) -> bool {
        self.backlog() > 0 && self.write.lock().parked.contains(&who)
    }

    /// The doorbell thread: epoll reported room. Sends what fits; once the backlog is gone
    /// (or the connection failed), returns what was parked, to resume.
    pub(crate) fn on_writable(&self) -> Vec<Parked> {
        let Some(hook) = &self.hook else { return Vec::new() };
        let mut b = self.write.lock();
        b.armed = false;
        if let Err(err) = self.flush(&mut b) {
            // The reader of this connection sees it close and fails the peer's QPs.
            log::warn!("engine: sending to {}: {err}", self.peer);
            self.alive.store(false, Ordering::Release);
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
            b.items.clear();
        }
        self.queued(&mut b, hook);
        if b.items.is_empty() {
            std::mem::take(&mut b.parked)
        } else {
            Vec::new()
        }
    }

    /// The connection failed: nothing more goes; what was parked is resumed.
    fn fail_locked(&self, b: &mut Backlog) {
        self.alive.store(false, Ordering::Release);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        b.items.clear();
        self.backlog_bytes.store(0, Ordering::Release);
        let parked = std::mem::take(&mut b.parked);
        if let Some(e) = self.hook.as_ref().and_then(|h| h.resume.upgrade()) {
            e.resume_parked(parked);
        }
    }

    /// Sends backlog items until the socket is full or the backlog empty.
    fn flush(&self, b: &mut Backlog) -> std::io::Result<()> {
        while let Some(front) = b.items.front_mut() {
            let (n, left) = match front {
                Queued::Bytes(bytes, sent) => {
                    let n = try_send(self.fd(), &bytes[*sent..])?;
                    *sent += n;
                    (n, bytes.len() - *sent)
                }
                Queued::Region(mr, off, len) => {
                    let n = mr.try_send(self.fd(), &[], *off, *len)?;
                    (*off, *len) = (*off + n, *len - n);
                    (n, *len)
                }
            };
            if left > 0 {
                // Full (a short send means the same).
                let _ = n;
                return Ok(());
            }
            b.items.pop_front();
        }
        Ok(())
    }

    pub(crate) fn shutdown(&self) {
        if self.hook.is_some() {
            self.fail_locked(&mut self.write.lock());
            return;
        }
        self.alive.store(false, Ordering::Release);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// Reads exactly `buf.len()` bytes.
    pub(crate) fn read_exact(&self, buf: &mut [u8]) -> std::io::Result<()> {
        let n = {
            let mut rx = self.rx.lock();
            let n = rx.take(buf);
            if n < buf.len() {
                rx.settle(self.stream.as_raw_fd())?;
            }
            n
        };
        if n < buf.len() {
            (&self.stream).read_exact(&mut buf[n..])?;
        }
        Ok(())
    }

    /// Makes this connection's reader peek (a lane's: see [`RxBuf`]).
    pub(crate) fn peek_reads(&self) {
        self.rx.lock().peek = true;
    }

    /// Reads `len` bytes into `mem` at `off`.
    pub(crate) fn read_region(&self, mem: &MemRegion, off: usize, len: usize) -> std::io::Result<()> {
        let n = {
            let mut rx = self.rx.lock();
            let n = len.min(rx.buffered());
            if n > 0 {
                mem.write_from(off, &rx.buf[rx.start..rx.start + n])
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
                rx.consume(n);
            }
            if n < len {
                rx.settle(self.stream.as_raw_fd())?;
            }
            n
        };
        if n < len {
            mem.read_from_fd(std::os::fd::AsFd::as_fd(&self.stream), off + n, len - n)?;
        }
        Ok(())
    }

    /// Reads and drops `len` bytes (data of a request we refuse, to stay framed).
    pub(crate) fn discard(&self, mut len: u64) -> std::io::Result<()> {
        {
            // What was read ahead first: usually all of it (and then no 16 KiB buffer to zero).
            let mut rx = self.rx.lock();
            let n = len.min(rx.buffered() as u64) as usize;
            rx.consume(n);
            len -= n as u64;
        }
        if len == 0 {
            return Ok(());
        }
        let mut buf = [0u8; 16384];
        while len > 0 {
            let n = len.min(buf.len() as u64) as usize;
            self.read_exact(&mut buf[..n])?;
            len -= n as u64;
        }
        Ok(())
    }

    /// Whether a frame (or part of one) is waiting to be read. A zero-timeout poll: it arms
    /// no timer (a timed wait would, and on a VM arming and cancelling a high-resolution
    /// timer before the next tick costs two clock reprogrammings per message).
    fn readable_now(&self) -> bool {
        {
            let mut rx = self.rx.lock();
            if rx.buffered() > 0 {
                return true;
            }
            // (Peeked bytes are in the socket still: dropped first, they are not news.)
            if rx.settle(self.stream.as_raw_fd()).is_err() {
                return true;
            }
        }
        let mut p = libc::pollfd { fd: self.stream.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, live for the call.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        // An interrupted poll counts as nothing there: the owed ACKs go out now.
        n > 0
    }

    /// Reads the next frame header, and whether that took a read from the socket (a frame
    /// already read ahead took none: no wakeup). The socket's read timeout (the peer
    /// timeout) fires on an idle connection too: that is the peer's death only if no
    /// connection of the peer delivered anything for as long (`live`): heartbeats on an idle
    /// connection lag while their sender is blocked writing a busy one to a slow receiver,
    /// a peer that is alive.
    fn read_header(&self, live: &PeerRx, timeout: Duration) -> Result<(FrameHeader, bool), LinkError> {
        self.read_header_until(live, timeout, None).map(|r| r.expect("no deadline"))
    }

    /// [`Conn::read_header`], or none once `deadline` passed when a signal interrupts the
    /// wait (a lane reader's token timer, see `token_timer`).
    fn read_header_until(
        &self,
        live: &PeerRx,
        timeout: Duration,
        deadline: Option<Instant>,
    ) -> Result<Option<(FrameHeader, bool)>, LinkError> {
        let mut rx = self.rx.lock();
        let mut read = false;
        // (Tracing: when the kernel received what this read took.)
        let mut received = None;
        while rx.buffered() < HEADER_LEN {
            if rx.start > 0 {
                // Room for a whole frame's worth after what is left of the header.
                let (start, end) = (rx.start, rx.end);
                rx.buf.copy_within(start..end, 0);
                (rx.start, rx.end) = (0, end - start);
            }
            let fd = self.stream.as_raw_fd();
            rx.settle(fd).map_err(|source| LinkError::Recv { addr: self.peer, source })?;
            // (Peeking only from an empty buffer: what it brings is then all in the socket.)
            let peek = rx.peek && rx.buffered() == 0;
            let flags = if peek { libc::MSG_PEEK } else { 0 };
            let end = rx.end;
            let r = if trace::enabled() {
                read_stamped(fd, &mut rx.buf[end..], flags).map(|(n, at)| {
                    received = at.or(received);
                    n
                })
            } else {
                recv_into(fd, &mut rx.buf[end..], flags)
            };
            match r {
                Ok(0) => {
                    let source = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
                    return Err(LinkError::Recv { addr: self.peer, source });
                }
                Ok(n) => {
                    rx.end += n;
                    if peek {
                        rx.peeked = n;
                    }
                    read = true;
                }
                // Interrupted (a token timer's tick), or the read timeout on a live peer: on
                // past the deadline, if any, else read again.
                Err(e)
                    if e.kind() == std::io::ErrorKind::Interrupted
                        || matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
                            && live.heard_within(timeout) =>
                {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Ok(None);
                    }
                }
                Err(source) => return Err(LinkError::Recv { addr: self.peer, source }),
            }
        }
        live.heard();
        let mut b = [0u8; HEADER_LEN];
        rx.take(&mut b);
        let h = FrameHeader::decode(&b).map_err(|source| LinkError::Protocol { addr: self.peer, source })?;
        if let Some(at) = received {
            trace::record_at(at, Stage::Received, h.dst_qpn, h.psn);
        }
        Ok(Some((h, read)))
    }
}

fn tune(s: &TcpStream, timeout: Duration) {
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
fn recv_into(fd: i32, buf: &mut [u8], flags: libc::c_int) -> std::io::Result<usize> {
    // SAFETY: at most buf.len() bytes into the live, writable `buf`.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// A read (with recv(2)'s `flags`) that also returns when the kernel received the data
/// (CLOCK_MONOTONIC ns), for tracing (the socket has `SO_TIMESTAMPNS`, see `tune`).
fn read_stamped(fd: i32, buf: &mut [u8], flags: libc::c_int) -> std::io::Result<(usize, Option<u64>)> {
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

fn hello_frame(e: &Engine) -> (FrameHeader, Vec<u8>) {
    let data = format!("{}\n{}", e.cfg.host, e.local_addr()).into_bytes();
    let mut h = FrameHeader::new(Kind::Hello);
    h.arg1 = e.boot_id;
    h.data_len = data.len() as u32;
    (h, data)
}

/// Reads a HELLO: the peer's host name, listening address and boot id.
fn read_hello(c: &Conn) -> Result<(String, SocketAddr, u64), LinkError> {
    let (h, host, addr, boot) = read_first(c)?;
    if h.kind != Kind::Hello {
        return Err(LinkError::Hello { addr: c.peer, reason: "first frame is not HELLO".into() });
    }
    Ok((host, addr, boot))
}

/// Reads the first frame of a connection, HELLO or LANE: its header, and the peer's host
/// name, listening address and boot id.
fn read_first(c: &Conn) -> Result<(FrameHeader, String, SocketAddr, u64), LinkError> {
    // Nothing heard from this peer yet: a HELLO that does not come within the timeout fails.
    let (h, _) = c.read_header(&PeerRx::new(), Duration::ZERO)?;
    let bad = |reason: &str| LinkError::Hello { addr: c.peer, reason: reason.into() };
    if !matches!(h.kind, Kind::Hello | Kind::Lane) {
        return Err(bad("first frame is neither HELLO nor LANE"));
    }
    let mut data = vec![0u8; h.data_len as usize];
    c.read_exact(&mut data).map_err(|source| LinkError::Recv { addr: c.peer, source })?;
    let text = wire::text(&data);
    let (host, addr) = text.split_once('\n').ok_or_else(|| bad("malformed HELLO"))?;
    let addr: SocketAddr = addr.parse().map_err(|_| bad("malformed address in HELLO"))?;
    Ok((h, host.to_string(), addr, h.arg1))
}

/// Opens a *lane* for our QP `src_qpn` to QP `dst_qpn` of the peer daemon at `addr` (boot
/// id `peer_boot`): a connection that carries that pair's requests only. The engine and the
/// QP's client both write requests on it, one at a time (whoever holds the channel's send
/// side, `ring::MED_SEND_SIDE`), so a small request goes out from the application's own
/// `post_send`, with no engine wakeup. Nothing comes back on it but the peer's HELLO: the
/// client shares the socket, so we never read it (what the client does to it, a read,
/// `O_NONBLOCK`, a receive timeout, cannot touch what we receive); the answers come on the
/// peer daemon's own connections to us, and we only watch the lane for its end.
/// Returns our end and the client's (the same socket).
pub(crate) fn open_lane(
    engine: &Arc<Engine>,
    addr: SocketAddr,
    peer_boot: u64,
    src_qpn: u32,
    dst_qpn: u32,
) -> Result<(Arc<Conn>, OwnedFd, [u64; 2]), LinkError> {
    let timeout = engine.cfg.peer_timeout;
    // The client will hold this socket: only a guarded one, which can never be connected
    // anywhere else nor listen (see lane_guard).
    let guard = engine.lane_guard.as_ref().ok_or_else(|| LinkError::Hello { addr, reason: "lanes are off here".into() })?;
    let s = guard.connect(addr, timeout).map_err(|source| LinkError::LaneSocket { addr, source })?;
    tune(&s, timeout);
    let hook = engine.conn_hook();
    let token = hook.token;
    let c = Arc::new(Conn::with_hook(s, addr, Some(hook)));
    engine.register_conn(&c, token);
    let (mut h, data) = hello_frame(engine);
    h.kind = Kind::Lane;
    h.src_qpn = src_qpn;
    h.dst_qpn = dst_qpn;
    // The lane's secret, for its ACK tokens' MACs: it goes to the peer daemon before the
    // client has the socket (and a socket's holder cannot read what was sent on it).
    let key: [u64; 2] = [rand::random(), rand::random()];
    (h.arg2, h.remote_addr) = (key[0], key[1]);
    let handshake = || -> Result<TcpStream, LinkError> {
        c.send(&h, &data).map_err(|source| LinkError::Send { addr, source })?;
        if read_hello(&c)?.2 != peer_boot {
            return Err(LinkError::Hello { addr, reason: "the peer daemon restarted".into() });
        }
        // (Only now does the client get the socket: the HELLO was read before it could.)
        c.stream.try_clone().map_err(|source| LinkError::Connect { addr, source })
    };
    let client = match handshake() {
        Ok(s) => s,
        Err(err) => {
            c.shutdown();
            return Err(err);
        }
    };
    let (e, c2) = (Arc::downgrade(engine), c.clone());
    if let Err(source) = std::thread::Builder::new().name(format!("engine-lane-{src_qpn}")).spawn(move || watch_lane(e, c2, src_qpn)) {
        c.shutdown();
        return Err(LinkError::Connect { addr, source });
    }
    Ok((c, OwnedFd::from(client), key))
}

/// Waits for the end of our QP `qpn`'s lane (poll(2), which no socket option or file flag
/// the client sets changes; nothing is read). When the peer closes it, or sends anything on
/// it, that QP goes to ERR. Ends when the lane is shut down (the QP destroyed, reset or
/// failed).
fn watch_lane(engine: Weak<Engine>, c: Arc<Conn>, qpn: u32) {
    let fd = c.stream.as_raw_fd();
    let why = loop {
        let mut p = libc::pollfd { fd, events: libc::POLLIN | libc::POLLRDHUP, revents: 0 };
        // SAFETY: one valid pollfd, live for the call.
        let n = unsafe { libc::poll(&mut p, 1, -1) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            break err.to_string();
        }
        if p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLRDHUP | libc::POLLNVAL) != 0 || !c.is_alive() {
            break "closed".to_string();
        }
        if p.revents & libc::POLLIN != 0 {
            let mut b = [0u8; 1];
            // SAFETY: reads at most one byte into `b`, without waiting.
            let r = unsafe { libc::recv(fd, b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
            match r {
                0 => break "closed by the peer".to_string(),
                1.. => break "the peer sent data on a lane".to_string(),
                _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock => {
                    // (Someone else took it: the client. Nothing is ours to read here.)
                    std::thread::sleep(Duration::from_millis(1));
                }
                _ => break std::io::Error::last_os_error().to_string(),
            }
        }
    };
    c.shutdown();
    if let Some(e) = engine.upgrade() {
        if !e.stopping.load(Ordering::Acquire) {
            e.lane_failed(qpn, &c, &why);
        }
    }
}

/// Outbound connections to one peer daemon.
pub(crate) struct Link {
    pub(crate) addr: SocketAddr,
    /// The peer daemon's boot id (a restarted peer is a new peer).
    pub(crate) peer_boot: u64,
    conns: Vec<Arc<Conn>>,
    alive: AtomicBool,
}

impl Link {
    /// Opens the connections (HELLO each) and starts their readers.
    pub(crate) fn connect(engine: &Arc<Engine>, addr: SocketAddr) -> Result<Arc<Link>, LinkError> {
        let timeout = engine.cfg.peer_timeout;
        let mut conns = Vec::new();
        let mut peer_boot = 0;
        for _ in 0..engine.cfg.connections_per_host.max(1) {
            let s = TcpStream::connect_timeout(&addr, timeout).map_err(|source| LinkError::Connect { addr, source })?;
            tune(&s, timeout);
            let hook = engine.conn_hook();
            let token = hook.token;
            let c = Arc::new(Conn::with_hook(s, addr, Some(hook)));
            engine.register_conn(&c, token);
            let (h, data) = hello_frame(engine);
            c.send(&h, &data).map_err(|source| LinkError::Send { addr, source })?;
            peer_boot = read_hello(&c)?.2;
            conns.push(c);
        }
        let link = Arc::new(Link { addr, peer_boot, conns, alive: AtomicBool::new(true) });
        for c in &link.conns {
            let (e, c, l) = (Arc::downgrade(engine), c.clone(), Arc::downgrade(&link));
            std::thread::Builder::new().name(format!("engine-out-{addr}")).spawn(move || outbound_reader(e, c, l)).expect("spawn");
        }
        log::info!("engine: connected to peer daemon {addr} ({} connections)", link.conns.len());
        Ok(link)
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire) && self.conns.iter().all(|c| c.is_alive())
    }

    /// The connection QP `qpn` uses (fixed, so its requests stay in order).
    pub(crate) fn conn_for(&self, qpn: u32) -> Arc<Conn> {
        self.conns[qpn as usize % self.conns.len()].clone()
    }

    pub(crate) fn send_connect(&self, id: u64, src_qpn: u32, dst_qpn: u32, req: &ConnectReq) -> Result<(), LinkError> {
        let data = req.encode();
        let mut h = FrameHeader::new(Kind::ConnectReq);
        h.arg1 = id;
        h.src_qpn = src_qpn;
        h.dst_qpn = dst_qpn;
        h.data_len = data.len() as u32;
        // On the QP's own connection: behind its old requests, which must not reach the
        // peer after the (re)connection resets its PSN sequence.
        self.conn_for(src_qpn).send(&h, &data).map_err(|source| LinkError::Send { addr: self.addr, source })
    }

    pub(crate) fn send_peer_gone(&self, remote_qpn: u32, local_qpn: u32) -> Result<(), LinkError> {
        let mut h = FrameHeader::new(Kind::PeerGone);
        h.dst_qpn = remote_qpn;
        h.src_qpn = local_qpn;
        self.conns[0].send(&h, &[]).map_err(|source| LinkError::Send { addr: self.addr, source })
    }

    /// Sends a heartbeat on every connection.
    pub(crate) fn heartbeat(&self, _timeout: Duration) -> Result<(), String> {
        if !self.is_alive() {
            return Err("connection lost".into());
        }
        let h = FrameHeader::new(Kind::Heartbeat);
        // (Behind a backlog a heartbeat would only queue up: the peer is not reading it.)
        for c in self.conns.iter().filter(|c| c.backlog() == 0) {
            c.send(&h, &[]).map_err(|e| format!("heartbeat failed: {e}"))?;
        }
        Ok(())
    }

    pub(crate) fn shutdown(&self) {
        self.alive.store(false, Ordering::Release);
        for c in &self.conns {
            c.shutdown();
        }
    }
}

/// Reads responses on one of our connections.
fn outbound_reader(engine: Weak<Engine>, c: Arc<Conn>, link: Weak<Link>) {
    let Some((live, timeout, follow)) = engine.upgrade().map(|e| (e.peer_rx(c.peer), e.cfg.peer_timeout, e.cfg.follow_cpu)) else { return };
    super::realtime_thread(super::reader_priority(follow));
    let mut follower = CpuFollower::new(follow);
    let err = loop {
        let h = match c.read_header(&live, timeout) {
            Ok((h, read)) => {
                // Asked before the frame is handled: handling it sends on this socket, and
                // the peer's acknowledgements of that would be the last segments received.
                if read {
                    follower.woken_from(|| incoming_cpu(c.fd()));
                }
                h
            }
            Err(e) => break e.to_string(),
        };
        trace::record(Stage::ResponseRead, h.dst_qpn, h.psn);
        let Some(e) = engine.upgrade() else { return };
        let r: Result<(), String> = match h.kind {
            k if k.is_response() => qp::handle_response(&e, &c, &h).map_err(|e| e.to_string()),
            Kind::ConnectRep => {
                let mut data = vec![0u8; h.data_len as usize];
                match c.read_exact(&mut data) {
                    Ok(()) => {
                        if let Some(tx) = e.connect_waiters.lock().remove(&h.arg1) {
                            let r = if h.status == 0 { Ok(()) } else { Err((h.status as i32, wire::text(&data))) };
                            let _ = tx.try_send(r);
                        }
                        Ok(())
                    }
                    Err(err) => Err(err.to_string()),
                }
            }
            Kind::HeartbeatAck | Kind::Hello => c.discard(u64::from(h.data_len)).map_err(|e| e.to_string()),
            other => Err(format!("unexpected {other:?} on a requester connection")),
        };
        trace::record(Stage::ResponseDone, h.dst_qpn, h.psn);
        if let Err(why) = r {
            break why;
        }
    };
    c.shutdown();
    if let Some(l) = link.upgrade() {
        l.alive.store(false, Ordering::Release);
    }
    if let (Some(e), Some(l)) = (engine.upgrade(), link.upgrade()) {
        if !e.stopping.load(Ordering::Acquire) {
            e.fail_peer(c.peer, l.peer_boot, &err);
        }
    }
}

/// Accepts peer daemons' connections.
pub(crate) fn accept_loop(engine: Arc<Engine>, listener: TcpListener) {
    let weak = Arc::downgrade(&engine);
    drop(engine);
    for s in listener.incoming() {
        let Some(e) = weak.upgrade() else { return };
        if e.stopping.load(Ordering::Acquire) {
            return;
        }
        let Ok(s) = s else { continue };
        let timeout = e.cfg.peer_timeout;
        let w = weak.clone();
        std::thread::Builder::new()
            .name("engine-in".into())
            .spawn(move || {
                tune(&s, timeout);
                let from = s.peer_addr().unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
                inbound(w, Arc::new(Conn::new(s, from)))
            })
            .expect("spawn");
    }
}

/// Serves one inbound connection: HELLO, then requests until it fails.
fn inbound(engine: Weak<Engine>, c0: Arc<Conn>) {
    super::realtime_thread(super::reader_priority(engine.upgrade().is_some_and(|e| e.cfg.follow_cpu)));
    let (first, host, peer, peer_boot) = match read_first(&c0) {
        Ok(v) => v,
        Err(e) => {
            log::warn!("engine: inbound connection from {}: {e}", c0.peer);
            return;
        }
    };
    let Some(e) = engine.upgrade() else { return };
    // Re-identify the connection by the peer's listening address.
    let c = Arc::new(Conn {
        stream: match c0.stream.try_clone() {
            Ok(s) => s,
            Err(_) => return,
        },
        write: Mutex::new(Backlog::default()),
        backlog_bytes: AtomicUsize::new(0),
        hook: None,
        alive: AtomicBool::new(true),
        // What the HELLO's read brought with it (the peer need not wait for our answer).
        rx: Mutex::new(std::mem::replace(&mut *c0.rx.lock(), RxBuf::empty())),
        peer,
    });
    if first.kind == Kind::Lane {
        drop(e);
        return serve_lane(engine, c, peer, first.src_qpn, first.dst_qpn, [first.arg2, first.remote_addr]);
    }
    let (h, data) = hello_frame(&e);
    if c.send(&h, &data).is_err() {
        return;
    }
    e.inbound.lock().entry(peer).or_default().push(c.clone());
    log::debug!("engine: inbound connection from {host} ({peer})");
    let (live, timeout) = (e.peer_rx(peer), e.cfg.peer_timeout);
    let mut follower = CpuFollower::new(e.cfg.follow_cpu);
    drop(e);
    // QPs whose ACK this reader deferred. They are sent before the reader would block: while
    // more requests are already waiting, their ACKs coalesce (up to ACK_EVERY / ACK_BYTES);
    // a request of the QP's own sent meanwhile carries it (F_ACKS).
    let mut owed: Vec<Arc<qp::MedQp>> = Vec::new();
    let mut ud_buf = Vec::new();
    let err = loop {
        if !owed.is_empty() && !c.readable_now() {
            if let Some(err) = owed.drain(..).find_map(|q| responder::send_owed_ack(&c, &q).err()) {
                break err.to_string();
            }
            trace::record(Stage::AcksSent, 0, 0);
        }
        let h = match c.read_header(&live, timeout) {
            Ok((h, read)) => {
                // (Before handling the frame: see `outbound_reader`.)
                if read {
                    follower.woken_from(|| incoming_cpu(c.fd()));
                }
                h
            }
            Err(e) => break e.to_string(),
        };
        trace::record(Stage::RequestRead, h.dst_qpn, h.psn);
        let Some(e) = engine.upgrade() else { return };
        let r: Result<(), String> = match h.kind {
            Kind::Heartbeat => c.send(&FrameHeader::new(Kind::HeartbeatAck), &[]).map_err(|e| e.to_string()),
            k if k.is_request() => match responder::handle_request(&e, &c, &c, &h, None, None) {
                Ok(Some(q)) => {
                    if !owed.iter().any(|x| Arc::ptr_eq(x, &q)) {
                        owed.push(q);
                    }
                    Ok(())
                }
                Ok(None) => Ok(()),
                Err(e) => Err(e.to_string()),
            },
            Kind::ConnectReq => {
                let mut data = vec![0u8; h.data_len as usize];
                match c.read_exact(&mut data) {
                    Err(err) => Err(err.to_string()),
                    Ok(()) => {
                        let result = match ConnectReq::decode(&data) {
                            Err(err) => Err((libc::EINVAL, err.to_string())),
                            Ok(req) => match e.broker() {
                                Some(b) => b.accept_remote(peer, h.src_qpn, h.dst_qpn, &req),
                                None => Err((libc::EAGAIN, "daemon starting".into())),
                            },
                        };
                        if result.is_ok() {
                            // A (re)connection starts a new PSN sequence.
                            e.reset_responder(h.dst_qpn);
                        }
                        let mut rep = FrameHeader::new(Kind::ConnectRep);
                        rep.arg1 = h.arg1;
                        let msg = match &result {
                            Ok(()) => Vec::new(),
                            Err((errno, m)) => {
                                rep.status = *errno as u32;
                                m.as_bytes()[..m.len().min(1024)].to_vec()
                            }
                        };
                        rep.data_len = msg.len() as u32;
                        c.send(&rep, &msg).map_err(|e| e.to_string())
                    }
                }
            }
            Kind::PeerGone => {
                e.mark_peer_gone(h.dst_qpn, peer, h.src_qpn);
                if let Some(b) = e.broker() {
                    b.peer_gone(h.dst_qpn, peer, h.src_qpn);
                }
                Ok(())
            }
            Kind::UdSend => super::ud::receive(&e, &c, peer, &h, &mut ud_buf).map_err(|e| e.to_string()),
            Kind::Hello => c.discard(u64::from(h.data_len)).map_err(|e| e.to_string()),
            other => Err(format!("unexpected {other:?} on a responder connection")),
        };
        trace::record(Stage::RequestDone, h.dst_qpn, h.psn);
        if let Err(why) = r {
            break why;
        }
    };
    c.shutdown();
    if let Some(e) = engine.upgrade() {
        if let Some(v) = e.inbound.lock().get_mut(&peer) {
            v.retain(|x| !Arc::ptr_eq(x, &c));
        }
        if !e.stopping.load(Ordering::Acquire) {
            e.fail_peer(peer, peer_boot, &err);
        }
    }
}

/// Serves a lane a peer opened to our QP `dst_qpn` for its QP `src_qpn`: requests of that
/// pair only (anything else ends the lane), executed as on a peer's connection. They are
/// answered on one of the peer daemon's connections to us (the lane's far end is shared
/// with a client; see `open_lane`). The lane's licence is withdrawn by a newer lane for the
/// same QP or by a (re)connection, which starts a new PSN sequence: what an old lane still
/// carries is then dropped, never executed.
fn serve_lane(engine: Weak<Engine>, c: Arc<Conn>, peer: SocketAddr, src_qpn: u32, dst_qpn: u32, key: [u64; 2]) {
    let Some(e) = engine.upgrade() else { return };
    if !e.cfg.lanes {
        // (Lanes are on where both daemons have them: the peer's QP goes without.)
        log::warn!("engine: lane from {peer} for QP {src_qpn} to our QP {dst_qpn}: refused, lanes are off here");
        c.shutdown();
        return;
    }
    // A lane for a QP that is paired with someone else is refused (it must not replace the
    // licence of that pair's lane); one for a QP not connected yet is taken (its requests
    // are answered "not ready" until it is).
    if e.qps.read().get(&dst_qpn).is_some_and(|q| q.remote != peer || q.remote_qpn != src_qpn) {
        log::warn!("engine: lane from {peer} for QP {src_qpn} to our QP {dst_qpn}, which is paired otherwise: refused");
        c.shutdown();
        return;
    }
    // (Its requests come one way only: see `RxBuf`.)
    c.peek_reads();
    let licence = Arc::new(AtomicBool::new(true));
    // (Keyed by the pair: a lane of another QP of that peer's, which the responder answers
    // "gone", never takes this one's licence.)
    if let Some(old) = e.lanes_in.lock().insert((peer, dst_qpn, src_qpn), super::LaneIn { licence: licence.clone(), conn: c.clone() }) {
        old.licence.store(false, Ordering::Release);
    }
    let (h, data) = hello_frame(&e);
    let err = if c.send(&h, &data).is_err() { Some("sending HELLO failed".to_string()) } else { None };
    log::info!("engine: lane from {peer}: its QP {src_qpn} to our QP {dst_qpn}");
    let (live, timeout) = (e.peer_rx(peer), e.cfg.peer_timeout);
    let mut follower = CpuFollower::new(e.cfg.follow_cpu);
    drop(e);
    // The QP whose ACKs are to be seen to before the reader blocks: its deferred ACK (sent,
    // or waiting for its owner to carry it as a token), or a PSN tokens acknowledged that
    // our own ACK must confirm (see `MedQp::ack_duty`).
    let mut duty: Option<Arc<qp::MedQp>> = None;
    // Wakes the reader for a token's deadline, made when first needed (without one, tokens
    // are settled at once).
    let mut timer: Option<TokenTimer> = None;
    // Where answers go: a live connection of the peer daemon's to us.
    let mut out: Option<Arc<Conn>> = None;
    let err = err.unwrap_or_else(|| loop {
        let mut until = None;
        if duty.is_some() && !c.readable_now() {
            let Some(o) = answers_to(&engine, peer, dst_qpn, &mut out) else { break "no connection from the peer daemon".to_string() };
            let q = duty.clone().expect("checked");
            if timer.is_none() {
                timer = TokenTimer::new();
            }
            let mut can_wait = timer.is_some();
            let sent = loop {
                let r = match q.ack_duty(Instant::now(), can_wait) {
                    // (The timer is armed only to wait, and then keeps ticking until the
                    // duties end: arming and stopping it per message would cost more than
                    // the tokens save.)
                    qp::AckDuty::Wait(t) if timer.as_mut().is_some_and(TokenTimer::tick) => {
                        until = Some(t);
                        break Ok(());
                    }
                    qp::AckDuty::Wait(_) => {
                        can_wait = false;
                        continue;
                    }
                    qp::AckDuty::SendOwed => responder::send_owed_ack(&o, &q),
                    qp::AckDuty::Confirm(psn) => responder::send_ack(&o, &q, psn),
                    qp::AckDuty::Idle => {
                        duty = None;
                        break Ok(());
                    }
                };
                trace::record(Stage::AcksSent, 0, 0);
                if r.is_err() {
                    break r;
                }
            };
            if let Err(err) = sent {
                break err.to_string();
            }
        }
        if until.is_none() {
            if let Some(t) = timer.as_mut() {
                t.stop();
            }
        }
        let h = match c.read_header_until(&live, timeout, until) {
            Ok(Some((h, read))) => {
                if read {
                    follower.woken_from(|| incoming_cpu(c.fd()));
                }
                h
            }
            // A token's deadline: see to the ACKs again.
            Ok(None) => continue,
            Err(e) => break e.to_string(),
        };
        trace::record(Stage::RequestRead, h.dst_qpn, h.psn);
        if !h.kind.is_request() || h.dst_qpn != dst_qpn || h.src_qpn != src_qpn {
            break format!("{:?} from QP {} to QP {} on the lane of QP {src_qpn} to QP {dst_qpn}", h.kind, h.src_qpn, h.dst_qpn);
        }
        let Some(o) = answers_to(&engine, peer, dst_qpn, &mut out) else { break "no connection from the peer daemon".to_string() };
        let Some(e) = engine.upgrade() else { break "engine stopped".to_string() };
        match responder::handle_request(&e, &c, &o, &h, Some(&licence), Some(key)) {
            Ok(Some(q)) => duty = Some(q),
            Ok(None) => {}
            Err(err) => break err.to_string(),
        }
        trace::record(Stage::RequestDone, h.dst_qpn, h.psn);
        if !licence.load(Ordering::Acquire) {
            break "replaced by a newer lane or connection".to_string();
        }
    });
    log::debug!("engine: lane from {peer} to our QP {dst_qpn} ends: {err}");
    c.shutdown();
    if let Some(e) = engine.upgrade() {
        let mut lanes = e.lanes_in.lock();
        if lanes.get(&(peer, dst_qpn, src_qpn)).is_some_and(|l| Arc::ptr_eq(&l.licence, &licence)) {
            lanes.remove(&(peer, dst_qpn, src_qpn));
        }
    }
}

/// The connection a lane's answers take: one the peer daemon opened to us (chosen by our
/// QPN, so one QP's answers keep one connection and their order), kept while it lives.
fn answers_to(engine: &Weak<Engine>, peer: SocketAddr, qpn: u32, out: &mut Option<Arc<Conn>>) -> Option<Arc<Conn>> {
    if let Some(o) = out.as_ref().filter(|o| o.is_alive()) {
        return Some(o.clone());
    }
    // The peer's connections are up before it opens a lane, but the accepting thread may
    // not have listed its own yet: a moment's grace.
    for _ in 0..100 {
        let e = engine.upgrade()?;
        let found = e.inbound.lock().get(&peer).and_then(|v| {
            let live: Vec<_> = v.iter().filter(|c| c.is_alive()).collect();
            (!live.is_empty()).then(|| live[qpn as usize % live.len()].clone())
        });
        if found.is_some() {
            out.clone_from(&found);
            return found;
        }
        drop(e);
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::MrMemory;
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    use vrdma_abi::shm::{create_memfd, SharedMapping};
    use vrdma_core::access::MrBounds;

    fn small_buffers(s: &TcpStream, opt: libc::c_int) {
        let bytes: libc::c_int = 16 << 10;
        set_socket_option(s.as_raw_fd(), libc::SOL_SOCKET, opt, &bytes).unwrap();
    }

    /// The doorbell thread writes a connection whose peer does not read: every send returns
    /// at once, the rest waits in the backlog (MR bytes by reference), QPs park behind it,
    /// and once room comes the peer gets every frame whole and in order, and the parked QPs
    /// are handed back.
    #[test]
    fn a_full_socket_never_blocks_the_writer_and_the_backlog_keeps_frame_order() {
        // SAFETY: plain epoll_create1; the descriptor is owned below.
        let epfd = unsafe { OwnedFd::from_raw_fd(libc::epoll_create1(libc::EPOLL_CLOEXEC)) };
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut server, _) = l.accept().unwrap();
        small_buffers(&client, libc::SO_SNDBUF);
        small_buffers(&server, libc::SO_RCVBUF);
        let hook = Hook { epfd: epfd.as_raw_fd(), token: 42, resume: Weak::new() };
        let c = Conn::with_hook(client, l.local_addr().unwrap(), Some(hook));

        const MR_LEN: usize = 1 << 20;
        let fd = create_memfd("backlog-test", MR_LEN, true).unwrap();
        let mapping = SharedMapping::reserve(MR_LEN).unwrap();
        mapping.place_fd(0, fd.as_fd(), 0, MR_LEN, true).unwrap();
        let pattern: Vec<u8> = (0..MR_LEN).map(|i| (i * 7 % 253) as u8).collect();
        mapping.region().write_from(0, &pattern).unwrap();
        let mr = Arc::new(MappedMr {
            mem: MrMemory::Mapped(mapping),
            span_start: 0,
            bounds: MrBounds { addr: 0, length: MR_LEN as u64, access: 0 },
            session: 0,
            pd: 0,
        });

        let mut expected = Vec::new();
        for i in 0..48u32 {
            let mut h = FrameHeader::new(Kind::Write);
            h.psn = i;
            let off = (i as usize * 4099) % (MR_LEN / 2);
            let len = 60_000 + i as usize;
            h.data_len = len as u32;
            expected.extend_from_slice(&h.encode());
            if i % 3 == 0 {
                let data: Vec<u8> = (0..len).map(|j| (i as usize + j) as u8).collect();
                c.send(&h, &data).unwrap();
                expected.extend_from_slice(&data);
            } else {
                c.send_mr(&h, &mr, off, len).unwrap();
                expected.extend_from_slice(&pattern[off..off + len]);
            }
        }
        assert!(c.backlog() > 0, "about 3 MB went to 32 KiB of socket buffers");
        assert!(c.park_if_backlogged(Parked::Qp(7)));
        assert!(c.park_if_backlogged(Parked::Qp(7)) && c.park_if_backlogged(Parked::Ud(9)));

        let want = expected.len();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; want];
            server.read_exact(&mut got).unwrap();
            got
        });
        let mut parked = Vec::new();
        let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 4];
        while parked.is_empty() {
            // SAFETY: a live epoll fd and a buffer of 4 events.
            let n = unsafe { libc::epoll_wait(epfd.as_raw_fd(), ev.as_mut_ptr(), 4, 10_000) };
            assert_eq!(n, 1, "EPOLLOUT is armed while there is a backlog");
            let token = ev[0].u64;
            assert_eq!(token, 42);
            parked = c.on_writable();
        }
        assert_eq!(parked, [Parked::Qp(7), Parked::Ud(9)]);
        assert_eq!(c.backlog(), 0);
        assert!(!c.park_if_backlogged(Parked::Qp(7)));
        assert!(reader.join().unwrap() == expected, "the peer got the frames whole and in order");
    }

    /// A connection to read (as a reader thread does) and the socket that writes to it.
    fn reading_conn() -> (TcpStream, Conn) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let writer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        (writer, Conn::new(server, l.local_addr().unwrap()))
    }

    /// A SEND frame with `data`; its QP number (in the header's first 20 bytes) differs by
    /// `psn`, so that a header cut by a read differs between frames.
    fn frame(psn: u32, data: &[u8]) -> Vec<u8> {
        let mut h = FrameHeader::new(Kind::Send);
        h.psn = psn;
        h.dst_qpn = 1000 + psn;
        h.data_len = data.len() as u32;
        let mut b = h.encode().to_vec();
        b.extend_from_slice(data);
        b
    }

    /// The reader's read-ahead: small frames written in one go are all taken from one read,
    /// a frame's data goes to memory or a buffer (or is dropped) whole and in order whether it was read
    /// ahead, partly read ahead (larger than the buffer) or not at all, a header split over
    /// two writes is joined, and `readable_now` sees what is buffered.
    #[test]
    fn frames_read_ahead_arrive_whole_and_in_order() {
        frames_read_ahead_arrive_whole_and_in_order_when(false);
    }

    /// The same for a lane's reader, which peeks.
    #[test]
    fn frames_peeked_arrive_whole_and_in_order() {
        frames_read_ahead_arrive_whole_and_in_order_when(true);
    }

    fn frames_read_ahead_arrive_whole_and_in_order_when(peek: bool) {
        let (mut writer, c) = reading_conn();
        if peek {
            c.peek_reads();
        }
        let live = PeerRx::new();
        let small: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; 8 + i as usize]).collect();
        let big: Vec<u8> = (0..3 * RX_BUF + 123).map(|i| (i % 251) as u8).collect();
        let mut all = Vec::new();
        for (i, d) in small.iter().enumerate() {
            all.extend_from_slice(&frame(i as u32, d));
        }
        all.extend_from_slice(&frame(100, &big));
        all.extend_from_slice(&frame(101, b"tail"));
        writer.write_all(&all).unwrap();

        const LEN: usize = 1 << 16;
        let fd = vrdma_abi::shm::create_memfd("rx-test", LEN, true).unwrap();
        let mapping = SharedMapping::reserve(LEN).unwrap();
        mapping.place_fd(0, fd.as_fd(), 0, LEN, true).unwrap();
        let mem = mapping.region();

        // Wait until everything is in the socket, so that the first read takes a full buffer.
        std::thread::sleep(Duration::from_millis(100));
        let mut reads = 0;
        for (i, d) in small.iter().enumerate() {
            let (h, read) = c.read_header(&live, Duration::from_secs(5)).unwrap();
            reads += usize::from(read);
            assert_eq!((h.psn, h.data_len as usize), (i as u32, d.len()));
            if i % 5 == 4 {
                // Refused data is dropped, and the next frame is still found.
                c.discard(d.len() as u64).unwrap();
            } else if i % 2 == 0 {
                let mut got = vec![0u8; d.len()];
                c.read_exact(&mut got).unwrap();
                assert_eq!(&got, d);
            } else {
                c.read_region(mem, 100 * i, d.len()).unwrap();
                let mut got = vec![0u8; d.len()];
                mem.read_into(100 * i, &mut got).unwrap();
                assert_eq!(&got, d);
            }
            assert!(c.readable_now(), "the next frame is there");
        }
        assert_eq!(reads, 1, "twenty small frames came with one read");
        let (h, _) = c.read_header(&live, Duration::from_secs(5)).unwrap();
        assert_eq!((h.psn, h.data_len as usize), (100, big.len()));
        c.read_region(mem, 4096, big.len()).unwrap();
        let mut got = vec![0u8; big.len()];
        mem.read_into(4096, &mut got).unwrap();
        assert!(got == big, "a frame larger than the buffer, partly read ahead");
        let (h, _) = c.read_header(&live, Duration::from_secs(5)).unwrap();
        assert_eq!(h.psn, 101);
        let mut tail = [0u8; 4];
        c.read_exact(&mut tail).unwrap();
        assert_eq!(&tail, b"tail");
        assert!(!c.readable_now(), "nothing left");

        // A header that arrives in two parts.
        let f = frame(7, b"split");
        writer.write_all(&f[..10]).unwrap();
        let joined = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            writer.write_all(&f[10..]).unwrap();
            writer
        });
        let (h, read) = c.read_header(&live, Duration::from_secs(5)).unwrap();
        assert!(read);
        assert_eq!((h.psn, h.data_len), (7, 5));
        let mut d = [0u8; 5];
        c.read_exact(&mut d).unwrap();
        assert_eq!(&d, b"split");
        drop(joined.join().unwrap());
    }

    /// The read-ahead's edges: a read that ends inside a header (the rest of the header is
    /// read after what is left moves to the front), data served partly from the buffer and
    /// partly straight from the socket, and `readable_now` seeing a frame that is in the
    /// socket but not yet read ahead.
    #[test]
    fn a_header_cut_by_the_read_ahead_is_joined_and_data_straddles_buffer_and_socket() {
        a_header_cut_by_the_read_ahead_is_joined_when(false);
    }

    /// The same for a lane's reader, which peeks.
    #[test]
    fn a_header_cut_by_a_peek_is_joined_and_data_straddles_buffer_and_socket() {
        a_header_cut_by_the_read_ahead_is_joined_when(true);
    }

    fn a_header_cut_by_the_read_ahead_is_joined_when(peek: bool) {
        let (mut writer, c) = reading_conn();
        if peek {
            c.peek_reads();
        }
        let live = PeerRx::new();
        // The first read (a full buffer) ends 20 bytes into the second frame's header.
        let first: Vec<u8> = (0..RX_BUF - HEADER_LEN - 20).map(|i| (i % 253) as u8).collect();
        let second: Vec<u8> = (0..20_000).map(|i| (i % 241) as u8).collect();
        let mut all = frame(1, &first);
        all.extend_from_slice(&frame(2, &second));
        all.extend_from_slice(&frame(3, b"third"));
        writer.write_all(&all).unwrap();
        std::thread::sleep(Duration::from_millis(100));

        let (h, read) = c.read_header(&live, Duration::from_secs(5)).unwrap();
        assert!(read);
        assert_eq!((h.psn, h.data_len as usize), (1, first.len()));
        let mut got = vec![0u8; first.len()];
        c.read_exact(&mut got).unwrap();
        assert!(got == first);
        assert_eq!(c.rx.lock().buffered(), 20, "a cut header is left");
        let (h, read) = c.read_header(&live, Duration::from_secs(5)).unwrap();
        assert!(read, "the rest of the header took a read");
        assert_eq!((h.dst_qpn, h.psn, h.data_len as usize), (1002, 2, second.len()));
        let buffered = c.rx.lock().buffered();
        assert!(buffered > 0 && buffered < second.len(), "{buffered} of the data read ahead");
        let mut got = vec![0u8; second.len()];
        c.read_exact(&mut got).unwrap();
        assert!(got == second, "data from the buffer, then from the socket");
        assert_eq!(c.rx.lock().buffered(), 0);
        assert!(c.readable_now(), "the third frame waits in the socket");
        let (h, _) = c.read_header(&live, Duration::from_secs(5)).unwrap();
        assert_eq!(h.psn, 3);
        let mut third = [0u8; 5];
        c.read_exact(&mut third).unwrap();
        assert_eq!(&third, b"third");
        assert!(!c.readable_now());
    }

    /// Bytes in `c`'s socket that nobody has read (or dropped).
    fn unread_in_socket(c: &Conn) -> usize {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int into the live `n`.
        assert_eq!(unsafe { libc::ioctl(c.stream.as_raw_fd(), libc::FIONREAD, &mut n) }, 0);
        n as usize
    }

    /// A lane's reader peeks: the frame it has stays in the socket (so the kernel does not
    /// send and process its TCP ACK inside the read that brings the frame) until the reader
    /// is about to wait for more, and is then dropped, never read twice.
    #[test]
    fn a_peeking_reader_leaves_a_frame_in_the_socket_until_it_waits_again() {
        let (mut writer, c) = reading_conn();
        c.peek_reads();
        let live = PeerRx::new();
        let one = frame(1, b"one");
        writer.write_all(&one).unwrap();
        let (h, read) = c.read_header(&live, Duration::from_secs(5)).unwrap();
        assert!(read);
        assert_eq!(h.psn, 1);
        let mut d = [0u8; 3];
        c.read_exact(&mut d).unwrap();
        assert_eq!(&d, b"one");
        assert_eq!(unread_in_socket(&c), one.len(), "the frame handled is still in the socket");
        assert!(!c.readable_now(), "and is no news");
        assert_eq!(unread_in_socket(&c), 0, "dropped before the reader waits");

        // Blocked in a peek, the reader gets the next frame, not the last one again.
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            writer.write_all(&frame(2, b"two")).unwrap();
            writer.write_all(&frame(3, b"three")).unwrap();
            writer
        });
        let (h, _) = c.read_header(&live, Duration::from_secs(5)).unwrap();
        assert_eq!(h.psn, 2);
        c.discard(3).unwrap();
        let writer = late.join().unwrap();
        let (h, _) = c.read_header(&live, Duration::from_secs(5)).unwrap();
        assert_eq!(h.psn, 3);
        let mut d = [0u8; 5];
        c.read_exact(&mut d).unwrap();
        assert_eq!(&d, b"three");
        drop(writer);
        assert!(c.read_header(&live, Duration::from_secs(5)).is_err(), "the peer closed: EOF, not an old frame");
    }

    /// A connection that fails while QPs are parked behind its backlog hands them back (to
    /// flush), rather than leaving them waiting for room that will never come.
    #[test]
    fn parked_senders_come_back_when_the_connection_fails() {
        // SAFETY: plain epoll_create1; the descriptor is owned below.
        let epfd = unsafe { OwnedFd::from_raw_fd(libc::epoll_create1(libc::EPOLL_CLOEXEC)) };
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        small_buffers(&client, libc::SO_SNDBUF);
        small_buffers(&server, libc::SO_RCVBUF);
        let hook = Hook { epfd: epfd.as_raw_fd(), token: 7, resume: Weak::new() };
        let c = Conn::with_hook(client, l.local_addr().unwrap(), Some(hook));
        let data = vec![5u8; 60_000];
        let mut h = FrameHeader::new(Kind::Send);
        h.data_len = data.len() as u32;
        while c.backlog() == 0 {
            c.send(&h, &data).unwrap();
        }
        assert!(c.park_if_backlogged(Parked::Qp(3)) && c.park_if_backlogged(Parked::Ud(4)));
        // The peer resets the connection with our bytes unread.
        let linger = libc::linger { l_onoff: 1, l_linger: 0 };
        set_socket_option(server.as_raw_fd(), libc::SOL_SOCKET, libc::SO_LINGER, &linger).unwrap();
        drop(server);
        let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 4];
        // SAFETY: a live epoll fd and a buffer of 4 events.
        let n = unsafe { libc::epoll_wait(epfd.as_raw_fd(), ev.as_mut_ptr(), 4, 10_000) };
        assert_eq!(n, 1, "the reset is reported");
        assert_eq!(c.on_writable(), [Parked::Qp(3), Parked::Ud(4)]);
        assert_eq!(c.backlog(), 0);
        assert!(!c.is_alive());
    }
}
