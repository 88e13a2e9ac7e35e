//! The receiving side of a connection: its reader's read-ahead (or peek) buffer, and when the
//! peer was last heard from.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_abi::shm::MemRegion;
use vrdma_abi::wire::{FrameHeader, HEADER_LEN};

use super::seal::{Opener, SealError, RECORD_MAX, RECORD_OVERHEAD};
use super::socket::{read_stamped, recv_into};
use super::Conn;
use crate::engine::link::LinkError;
use crate::engine::trace::{self, Stage};

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

/// Bytes a reader takes from its socket per read: a header with a small frame's data, or a
/// run of small frames, in one system call; larger data goes straight from the socket to
/// its destination (at most this much of it is copied through here).
pub(crate) const RX_BUF: usize = 8192;

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
pub(crate) struct RxBuf {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    peek: bool,
    peeked: usize,
    /// Sealed frames (see `seal`): the records received and not yet opened; `buf` then holds
    /// plaintext only, of records that opened. A sealed lane peeks whole records: `peeked`
    /// then counts received bytes (in `Unopened::buf`, opened or not) still in the socket.
    sealed: Option<Box<Unopened>>,
}

/// Bytes of records received, not yet opened.
struct Unopened {
    opener: Opener,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Where refused records are counted (the engine's).
    refused: Arc<AtomicU64>,
    /// The connection's two addresses (for the log).
    addrs: String,
    /// A record was refused: nothing more is read.
    failed: bool,
}

/// Bytes of received records a sealed reader holds (several records per read).
const SEALED_RX: usize = 64 * 1024 + RECORD_MAX + RECORD_OVERHEAD;

impl RxBuf {
    pub(crate) fn new() -> RxBuf {
        RxBuf { buf: vec![0u8; RX_BUF].into_boxed_slice(), start: 0, end: 0, peek: false, peeked: 0, sealed: None }
    }

    /// What a connection that is no longer read keeps (no allocation).
    pub(crate) fn empty() -> RxBuf {
        RxBuf { buf: Box::default(), start: 0, end: 0, peek: false, peeked: 0, sealed: None }
    }

    /// From now on what arrives is sealed records (see `seal`), opened with `opener`;
    /// refusals are counted in `refused` and logged with `addrs`.
    pub(crate) fn seal(&mut self, opener: Opener, refused: Arc<AtomicU64>, addrs: String) {
        // Room for a whole record's plaintext beside what a reader keeps of a header.
        let mut buf = vec![0u8; RX_BUF + RECORD_MAX].into_boxed_slice();
        let n = self.buffered();
        buf[..n].copy_from_slice(&self.buf[self.start..self.end]);
        debug_assert_eq!(self.peeked, 0, "sealed before anything was peeked");
        (self.buf, self.start, self.end) = (buf, 0, n);
        let unopened = Unopened { opener, buf: vec![0u8; SEALED_RX].into_boxed_slice(), start: 0, end: 0, refused, addrs, failed: false };
        self.sealed = Some(Box::new(unopened));
    }

    pub(crate) fn is_sealed(&self) -> bool {
        self.sealed.is_some()
    }

    /// Received bytes not yet usable: of a record not yet whole.
    fn unopened(&self) -> usize {
        self.sealed.as_ref().map_or(0, |u| u.end - u.start)
    }

    /// Opens the whole records received while their plaintext fits `buf`: how many
    /// plaintext bytes that added. A refused record fails the connection's reading for good.
    fn open_received(&mut self) -> std::io::Result<usize> {
        let Some(u) = self.sealed.as_deref_mut() else { return Ok(0) };
        if u.failed {
            return Err(refused_error());
        }
        let mut added = 0;
        while let Some(n) = u.opener.record_len(&u.buf[u.start..u.end]).map_err(|e| u.refuse(e))? {
            if n > u.end - u.start {
                break;
            }
            if self.buf.len() - self.end < n - RECORD_OVERHEAD {
                if self.start == 0 {
                    break;
                }
                self.buf.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, self.end - self.start);
                if self.buf.len() - self.end < n - RECORD_OVERHEAD {
                    break;
                }
            }
            let at = u.start;
            let len = match u.opener.open(&mut u.buf[at..at + n]) {
                Ok(plain) => {
                    self.buf[self.end..self.end + plain.len()].copy_from_slice(plain);
                    plain.len()
                }
                Err(e) => return Err(u.refuse(e)),
            };
            self.end += len;
            added += len;
            u.start += n;
        }
        if u.start == u.end {
            (u.start, u.end) = (0, 0);
        }
        Ok(added)
    }

    /// A sealed connection's read: opens what is there, else one recv(2) (a peek, on a lane
    /// waiting for a frame with nothing received: see [`RxBuf`]) and then opens what that
    /// completed. Ok(None): the peer closed the connection; else progress was made, with
    /// `Some(true)` if it took a recv(2) (bytes that just came from the socket), `Some(false)`
    /// if records received earlier opened.
    fn fill_sealed(&mut self, fd: i32, may_peek: bool) -> std::io::Result<Option<bool>> {
        if self.open_received()? > 0 {
            return Ok(Some(false));
        }
        let n = self.recv_sealed(fd, may_peek)?;
        if n == 0 {
            return Ok(None);
        }
        self.open_received()?;
        Ok(Some(true))
    }

    /// One recv(2) of records into `Unopened::buf`, after what it holds (dropping what was
    /// peeked first; peeking if `may_peek` and nothing is held). Ok(0): the peer closed the
    /// connection (an error if it ended inside a record).
    fn recv_sealed(&mut self, fd: i32, may_peek: bool) -> std::io::Result<usize> {
        self.settle(fd)?;
        let peek = self.peek && may_peek;
        let Some(u) = self.sealed.as_deref_mut() else { return Ok(0) };
        if u.failed {
            return Err(refused_error());
        }
        if u.start > 0 && u.buf.len() - u.end < RECORD_MAX + RECORD_OVERHEAD {
            u.buf.copy_within(u.start..u.end, 0);
            (u.start, u.end) = (0, u.end - u.start);
        }
        // (Peeking only into an empty buffer: what it brings is then all in the socket.)
        let peek = peek && u.end == 0;
        let end = u.end;
        let n = recv_into(fd, &mut u.buf[end..], if peek { libc::MSG_PEEK } else { 0 })?;
        if n == 0 {
            if u.end > u.start {
                let err = u.opener.truncated();
                return Err(u.refuse(err));
            }
            return Ok(0);
        }
        u.end += n;
        if peek {
            self.peeked = n;
        }
        Ok(n)
    }

    /// `len` bytes of a sealed connection's plaintext handed to `sink(at, bytes)` in order
    /// (`at`: where `bytes` begin among the `len`), straight from the records as they open
    /// (no copy through `buf` but for the rest of the last record). Only bytes of records
    /// that opened reach `sink`.
    fn read_sealed(&mut self, fd: i32, len: usize, mut sink: impl FnMut(usize, &[u8]) -> std::io::Result<()>) -> std::io::Result<()> {
        let n = len.min(self.buffered());
        if n > 0 {
            sink(0, &self.buf[self.start..self.start + n])?;
            self.consume(n);
        }
        let mut at = n;
        while at < len {
            let RxBuf { buf, start, end, sealed, .. } = self;
            let Some(u) = sealed.as_deref_mut() else { return Err(std::io::ErrorKind::UnexpectedEof.into()) };
            if u.failed {
                return Err(refused_error());
            }
            let whole = match u.opener.record_len(&u.buf[u.start..u.end]) {
                Err(e) => return Err(u.refuse(e)),
                Ok(Some(n)) if n <= u.end - u.start => Some(n),
                Ok(_) => None,
            };
            let Some(n) = whole else {
                match self.recv_sealed(fd, false) {
                    Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
                continue;
            };
            let r = u.start;
            let plain = match u.opener.open(&mut u.buf[r..r + n]) {
                Ok(plain) => plain,
                Err(e) => return Err(u.refuse(e)),
            };
            let take = plain.len().min(len - at);
            sink(at, &plain[..take])?;
            // The rest of the record (the next frames'), read ahead: `buf` is empty here.
            let rest = plain.len() - take;
            buf[..rest].copy_from_slice(&plain[take..]);
            (*start, *end) = (0, rest);
            u.start += n;
            if u.start == u.end {
                (u.start, u.end) = (0, 0);
            }
            at += take;
        }
        Ok(())
    }

    pub(crate) fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Moves up to `out.len()` buffered bytes into `out`; how many.
    pub(crate) fn take(&mut self, out: &mut [u8]) -> usize {
        let n = out.len().min(self.buffered());
        out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.consume(n);
        n
    }

    pub(crate) fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
    }

    /// Drops from `fd` the bytes peeked into the buffer (they stay buffered): the socket
    /// then continues where the buffer ends. Before any read of the socket's own.
    pub(crate) fn settle(&mut self, fd: i32) -> std::io::Result<()> {
        while self.peeked > 0 {
            // SAFETY: at most buf.len() bytes into the live `buf`; with
            // MSG_TRUNC a TCP socket drops them without copying anything.
            let n = unsafe { libc::recv(fd, self.buf.as_mut_ptr().cast(), self.peeked.min(self.buf.len()), libc::MSG_TRUNC) };
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

impl Unopened {
    /// A record refused: counted, logged with both addresses; the connection is done.
    fn refuse(&mut self, err: SealError) -> std::io::Error {
        self.failed = true;
        let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        // (Every refusal up to 64, then at powers of two: a flood does not flood the log.)
        if n <= 64 || n.is_power_of_two() {
            log::warn!("engine: connection {}: {err}; closing it ({n} refused so far)", self.addrs);
        }
        refused_error()
    }
}

fn refused_error() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, "a sealed record was refused")
}

impl Conn {
    /// Reads exactly `buf.len()` bytes.
    pub(crate) fn read_exact(&self, buf: &mut [u8]) -> std::io::Result<()> {
        let sealed = self.rx.lock().is_sealed();
        if sealed {
            let len = buf.len();
            return self.rx.lock().read_sealed(self.stream.as_raw_fd(), len, |at, bytes| {
                buf[at..at + bytes.len()].copy_from_slice(bytes);
                Ok(())
            });
        }
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

    /// Makes this connection's reader peek (a lane's: see [`RxBuf`]); a sealed one peeks
    /// whole records.
    pub(crate) fn peek_reads(&self) {
        self.rx.lock().peek = true;
    }

    /// Reads `len` bytes into `mem` at `off`.
    pub(crate) fn read_region(&self, mem: &MemRegion, off: usize, len: usize) -> std::io::Result<()> {
        let sealed = self.rx.lock().is_sealed();
        if sealed {
            // (Only bytes of records that opened reach the memory, copied there from the
            // record they opened in.)
            return self.rx.lock().read_sealed(self.stream.as_raw_fd(), len, |at, bytes| {
                mem.write_from(off + at, bytes).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))
            });
        }
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
        if self.is_sealed() {
            let len = usize::try_from(len).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
            return self.rx.lock().read_sealed(self.stream.as_raw_fd(), len, |_, _| Ok(()));
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
    pub(crate) fn readable_now(&self) -> bool {
        {
            let mut rx = self.rx.lock();
            if rx.buffered() > 0 || rx.unopened() > 0 {
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
    pub(crate) fn read_header(&self, live: &PeerRx, timeout: Duration) -> Result<(FrameHeader, bool), LinkError> {
        // (Without a deadline there is always a header, or an error.)
        loop {
            if let Some(r) = self.read_header_until(live, timeout, None)? {
                return Ok(r);
            }
        }
    }

    /// The peer closed the connection.
    fn closed(&self) -> LinkError {
        LinkError::Recv { addr: self.peer, source: std::io::Error::from(std::io::ErrorKind::UnexpectedEof) }
    }

    /// A read for a header failed with `e`: an interruption (a token timer's tick) or the read
    /// timeout on a live peer means read again (`Ok(false)`), or give up the wait
    /// (`Ok(true)`) once `deadline` passed; anything else ends the connection.
    fn wait_is_over(&self, e: std::io::Error, live: &PeerRx, timeout: Duration, deadline: Option<Instant>) -> Result<bool, LinkError> {
        use std::io::ErrorKind::{Interrupted, TimedOut, WouldBlock};
        let retry = e.kind() == Interrupted || matches!(e.kind(), WouldBlock | TimedOut) && live.heard_within(timeout);
        if !retry {
            return Err(LinkError::Recv { addr: self.peer, source: e });
        }
        Ok(deadline.is_some_and(|d| Instant::now() >= d))
    }

    /// [`Conn::read_header`], or none once `deadline` passed when a signal interrupts the
    /// wait (a lane reader's token timer, see `lane::token_timer`).
    pub(crate) fn read_header_until(
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
            if rx.is_sealed() {
                match rx.fill_sealed(fd, true) {
                    Ok(None) => return Err(self.closed()),
                    Ok(Some(received)) => read |= received,
                    Err(e) => {
                        if self.wait_is_over(e, live, timeout, deadline)? {
                            return Ok(None);
                        }
                    }
                }
                continue;
            }
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
                Ok(0) => return Err(self.closed()),
                Ok(n) => {
                    rx.end += n;
                    if peek {
                        rx.peeked = n;
                    }
                    read = true;
                }
                Err(e) => {
                    if self.wait_is_over(e, live, timeout, deadline)? {
                        return Ok(None);
                    }
                }
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
