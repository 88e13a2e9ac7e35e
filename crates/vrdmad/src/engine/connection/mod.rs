//! One TCP connection to or from a peer daemon: frames out (blocking, or non-blocking with a
//! backlog the doorbell thread sends), frames in through a read-ahead buffer (`rx`).

mod fuzzing;
mod rx;
pub(crate) mod seal;
mod socket;
#[cfg(test)]
mod tampering;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use vrdma_abi::shm::MemRegion;
use vrdma_abi::wire::{FrameHeader, HEADER_LEN};

use super::{Engine, MappedMr};
use rx::RxBuf;
use seal::{FrameKeys, Opener, SealError, Sealer};

pub use fuzzing::fuzz_sealed_reader;
pub(crate) use rx::PeerRx;
use socket::disconnect;
pub(crate) use socket::{set_socket_option, try_send, tune};

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
    /// A client holds the socket too (a lane's far end: see [`Conn::try_clone_stream`]).
    client_shared: AtomicBool,
    /// The peer daemon's listening address (its identity).
    pub(crate) peer: SocketAddr,
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
    /// Sealed frames (see `seal`): what is written is sealed, in the order it goes out.
    sealer: Option<Sealer>,
    /// A blocking connection's sealed records of a small frame, kept for the next one.
    sealed_scratch: Vec<u8>,
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
    /// A frame from MR bytes on a sealed connection, sealed a stretch at a time as the
    /// socket takes it (its records' numbers reserved when it was queued).
    SealedRegion(Box<SealedRegion>),
}

/// A frame whose data is MR bytes, sealed as it goes (see [`Queued::SealedRegion`]).
struct SealedRegion {
    mr: Arc<MappedMr>,
    head: [u8; HEADER_LEN],
    /// Where the frame's data is in the MR.
    off: usize,
    /// Bytes of the frame (header and data), and how many of them are sealed.
    total: usize,
    done: usize,
    /// The number of the next record.
    seq: u64,
    /// Sealed bytes, and how many of them went.
    pending: Vec<u8>,
    sent: usize,
}

impl SealedRegion {
    fn left(&self) -> usize {
        (self.total - self.done) + (self.pending.len() - self.sent)
    }

    /// Sends what the socket takes, sealing the next stretch when the last went; whether
    /// all of the frame went.
    fn send(&mut self, key: &seal::SealKey, fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<bool> {
        loop {
            if self.sent == self.pending.len() {
                if self.done == self.total {
                    return Ok(true);
                }
                // (A multiple of the record size: records fall where their numbers say.)
                let n = (self.total - self.done).min(SEALED_WRITE_STEP);
                let (at0, mr, off, head) = (self.done, &self.mr, self.off, &self.head);
                // (The buffer of the last stretch, reused: every byte is written again.)
                self.pending.resize(seal::sealed_len(n), 0);
                self.sent = 0;
                self.seq = key
                    .seal_filled_into(self.seq, &mut self.pending, n, |i, buf| {
                        frame_bytes(head, at0 + i, buf, &mut |a, b| mr_bytes(mr, off + a, b))
                    })
                    .map_err(seal_failed)?;
                self.done += n;
            }
            self.sent += try_send(fd, &self.pending[self.sent..])?;
            if self.sent < self.pending.len() {
                return Ok(false);
            }
        }
    }
}

impl Queued {
    fn len(&self) -> usize {
        match self {
            Queued::Bytes(b, sent) => b.len() - sent,
            Queued::Region(_, _, len) => *len,
            Queued::SealedRegion(r) => r.left(),
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
        if self.client_shared.load(Ordering::Acquire) {
            // Its client may have set `SO_LINGER` and kept data unsent (a pacing rate of a
            // byte a second needs no help from the peer), so that the last `close` waits
            // for the linger time; and the last may be ours, on whichever thread drops the
            // QP last: the doorbell thread, a connection's reader, the registry's lock
            // holder. Disconnected, the socket has nothing left to wait for, whoever closes
            // it (the lane guard lets nobody connect it again).
            retire_shared(&self.stream, self.peer, Retire::Disconnect);
        }
    }
}

impl Conn {
    /// A connection whose writes block (peers' connections to us).
    pub(crate) fn new(stream: TcpStream, peer: SocketAddr) -> Conn {
        Conn::with_hook(stream, peer, None)
    }

    pub(crate) fn with_hook(stream: TcpStream, peer: SocketAddr, hook: Option<Hook>) -> Conn {
        Conn {
            stream,
            write: Mutex::new(Backlog::default()),
            backlog_bytes: AtomicUsize::new(0),
            hook,
            alive: AtomicBool::new(true),
            rx: Mutex::new(RxBuf::new()),
            client_shared: AtomicBool::new(false),
            peer,
        }
    }

    /// The same socket as a blocking connection of its own, identified by the peer's
    /// listening address, with what was read ahead (the HELLO's read may have brought more).
    pub(crate) fn reidentified(&self, peer: SocketAddr) -> std::io::Result<Conn> {
        let stream = self.stream.try_clone()?;
        let c = Conn::new(stream, peer);
        *c.rx.lock() = std::mem::replace(&mut *self.rx.lock(), RxBuf::empty());
        // (With its sequence numbers: this one writes no more.)
        c.write.lock().sealer = self.write.lock().sealer.take();
        Ok(c)
    }

    /// From now on (before any frame) everything this connection carries is sealed with
    /// `keys` (see `seal`); a record that fails to open ends it, counted in `refused`.
    pub(crate) fn seal_frames(&self, keys: &FrameKeys, refused: Arc<AtomicU64>) {
        let addr = |a: std::io::Result<SocketAddr>| a.map_or_else(|_| "?".to_string(), |a| a.to_string());
        let addrs = format!("from {} to {}", addr(self.stream.peer_addr()), addr(self.stream.local_addr()));
        self.write.lock().sealer = Some(Sealer::new(&keys.send));
        self.rx.lock().seal(Opener::new(&keys.recv), refused, addrs);
    }

    /// The key this end seals with, if the connection is sealed (a lane's client seals
    /// its own frames with it).
    pub(crate) fn seal_key(&self) -> Option<[u8; seal::KEY_LEN]> {
        self.write.lock().sealer.as_ref().map(Sealer::key_bytes)
    }

    /// From now on the sequence number of what this end seals is the word at `at` of `map`
    /// (a lane's channel page, shared with its client: see `lane::send_side`).
    pub(crate) fn share_seal_sequence(&self, map: vrdma_abi::shm::SharedMapping, at: usize) {
        if let Some(s) = self.write.lock().sealer.as_mut() {
            s.share_sequence(map, at);
        }
    }

    /// The rest of a frame a lane's client sealed from record `seq` and wrote the first
    /// `skip` bytes of: `plain` sealed again alike (same key, numbers and bytes), less
    /// what went. Fails if the client claims more than the records hold.
    pub(crate) fn send_resealed(&self, plain: &[u8], seq: u64, skip: usize) -> std::io::Result<()> {
        let mut b = self.write.lock();
        let Some(sealer) = b.sealer.as_ref() else { return Err(std::io::Error::other("not a sealed connection")) };
        let mut bytes = sealer.reseal(seq, &[plain]).map_err(seal_failed)?;
        if skip > bytes.len() {
            return Err(std::io::Error::other("the client claims more than its frame"));
        }
        bytes.drain(..skip);
        match &self.hook {
            Some(hook) => {
                let hook = hook.clone();
                self.queue_locked(&mut b, &hook, bytes)
            }
            None => (&self.stream).write_all(&bytes),
        }
    }

    /// Whether frames are sealed on this connection.
    pub(crate) fn is_sealed(&self) -> bool {
        self.rx.lock().is_sealed()
    }

    /// Writes `pieces` (one after the other) on a blocking connection, sealed if it is.
    fn write_locked(&self, b: &mut Backlog, pieces: &[&[u8]]) -> std::io::Result<()> {
        let mut s = &self.stream;
        let Backlog { sealer, sealed_scratch: out, .. } = b;
        if let Some(sealer) = sealer.as_mut() {
            out.clear();
            sealer.seal_into(out, pieces).map_err(seal_failed)?;
            let r = s.write_all(out);
            if out.capacity() > SCRATCH_KEPT {
                // (A large frame's buffer is not kept for the small ones that follow.)
                *out = Vec::new();
            }
            return r;
        }
        match pieces.iter().filter(|p| !p.is_empty()).count() {
            0 => Ok(()),
            1 => s.write_all(pieces.iter().find(|p| !p.is_empty()).unwrap_or(&&[][..])),
            _ => s.write_all(&pieces.concat()),
        }
    }

    /// Another handle on the socket (a lane's client end). From now on the socket is
    /// disconnected before our last handle on it closes (see `Drop`).
    pub(crate) fn try_clone_stream(&self) -> std::io::Result<TcpStream> {
        self.client_shared.store(true, Ordering::Release);
        self.stream.try_clone()
    }

    /// The socket's descriptor (to poll it).
    pub(crate) fn raw_fd(&self) -> std::os::fd::RawFd {
        self.stream.as_raw_fd()
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.stream)
    }

    /// Bytes waiting in the backlog (0 for blocking connections).
    pub(crate) fn backlog(&self) -> usize {
        self.backlog_bytes.load(Ordering::Acquire)
    }

    /// Sends a frame whose data (if any) is in `data`.
    pub(crate) fn send(&self, h: &FrameHeader, data: &[u8]) -> std::io::Result<()> {
        let head = h.encode();
        let Some(hook) = &self.hook else {
            let mut b = self.write.lock();
            return self.write_locked(&mut b, &[&head, data]);
        };
        let mut buf = Vec::with_capacity(HEADER_LEN + data.len());
        buf.extend_from_slice(&head);
        buf.extend_from_slice(data);
        self.send_queued(hook, buf)
    }

    /// Sends a frame whose data is `len` bytes of `mr` at `off`.
    pub(crate) fn send_mr(&self, h: &FrameHeader, mr: &Arc<MappedMr>, off: usize, len: usize) -> std::io::Result<()> {
        let Some(hook) = &self.hook else {
            return mr.send(self, h, off, len);
        };
        let head = h.encode();
        let mut b = self.write.lock();
        if let Some(sealer) = b.sealer.as_mut() {
            // Queued in order with its records' numbers, sealed as the socket takes it (a
            // large WRITE is never sealed whole into memory).
            let total = HEADER_LEN + len;
            let seq = sealer.reserve(total.div_ceil(seal::RECORD_MAX) as u64).map_err(seal_failed)?;
            let r = SealedRegion { mr: mr.clone(), head, off, total, done: 0, seq, pending: Vec::new(), sent: 0 };
            b.items.push_back(Queued::SealedRegion(Box::new(r)));
            if b.items.len() == 1 {
                self.flush(&mut b)?;
            }
            self.queued(&mut b, hook);
            return Ok(());
        }
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
        let mut b = self.write.lock();
        if let Some(sealer) = b.sealer.as_mut() {
            return write_sealed_frame(&self.stream, sealer, &h.encode(), len, |at, buf| {
                // (Checked by the caller; memory that went away sends zeros, as below.)
                if mem.read_into(off + at, buf).is_err() {
                    buf.fill(0);
                }
            });
        }
        mem.write_to_fd(self.fd(), &h.encode(), off, len)
    }

    /// Sends bytes already framed (a batch of small frames).
    pub(crate) fn send_raw(&self, bytes: Vec<u8>) -> std::io::Result<()> {
        let Some(hook) = &self.hook else {
            let mut b = self.write.lock();
            return self.write_locked(&mut b, &[&bytes]);
        };
        self.send_queued(hook, bytes)
    }

    /// Sends `bytes` on a non-blocking connection (its `hook`), what the socket does not
    /// take into the backlog.
    fn send_queued(&self, hook: &Hook, bytes: Vec<u8>) -> std::io::Result<()> {
        let mut b = self.write.lock();
        let bytes = match b.sealer.as_mut() {
            Some(sealer) => sealer.seal(&[&bytes]).map_err(seal_failed)?,
            None => bytes,
        };
        self.queue_locked(&mut b, hook, bytes)
    }

    /// [`Conn::send_queued`] of bytes ready to go (sealed, if the connection is).
    fn queue_locked(&self, b: &mut Backlog, hook: &Hook, bytes: Vec<u8>) -> std::io::Result<()> {
        let sent = if b.items.is_empty() { try_send(self.fd(), &bytes)? } else { 0 };
        if sent < bytes.len() {
            b.items.push_back(Queued::Bytes(bytes, sent));
        }
        self.queued(b, hook);
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
            self.end_stream();
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
        self.end_stream();
        b.items.clear();
        self.backlog_bytes.store(0, Ordering::Release);
        let parked = std::mem::take(&mut b.parked);
        if let Some(e) = self.hook.as_ref().and_then(|h| h.resume.upgrade()) {
            e.resume_parked(parked);
        }
    }

    /// Sends backlog items until the socket is full or the backlog empty.
    fn flush(&self, b: &mut Backlog) -> std::io::Result<()> {
        let Backlog { items, sealer, .. } = b;
        while let Some(front) = items.front_mut() {
            let (n, left) = match front {
                Queued::SealedRegion(r) => {
                    let key = sealer.as_ref().map(Sealer::key).ok_or_else(|| std::io::Error::other("not a sealed connection"))?;
                    (0, usize::from(!r.send(key, self.fd())?))
                }
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
            items.pop_front();
        }
        Ok(())
    }

    pub(crate) fn shutdown(&self) {
        if self.hook.is_some() {
            self.fail_locked(&mut self.write.lock());
            return;
        }
        self.alive.store(false, Ordering::Release);
        self.end_stream();
    }

    /// `shutdown(2)` of both directions: for a socket a client shares, on the closer's thread
    /// (it takes the socket's lock, which the client holds through a `send(2)` of its: see
    /// [`retire_shared`]).
    fn end_stream(&self) {
        if self.client_shared.load(Ordering::Acquire) {
            retire_shared(&self.stream, self.peer, Retire::Shutdown);
        } else {
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// What [`retire_shared`] does to a socket.
#[derive(Clone, Copy, Debug)]
enum Retire {
    /// `shutdown(2)` of both directions (the lane ends; the socket stays ours).
    Shutdown,
    /// Disconnect it before our last reference closes (see `Drop for Conn`).
    Disconnect,
}

/// Does `what` to a socket a client shares on a thread of its own, given a duplicate of it
/// (whose close, after ours, is then the last): both take the socket's lock, which the client
/// holds for as long as a `send(2)` of its takes to copy (page faults included: seconds),
/// and the caller may be the doorbell thread, a connection's reader or the registry's lock
/// holder. In order, so a lane is shut down before it is disconnected. Inline if there is
/// no such thread or descriptor.
fn retire_shared(s: &TcpStream, peer: SocketAddr, what: Retire) {
    type Job = (TcpStream, SocketAddr, Retire);
    static CLOSER: std::sync::OnceLock<Option<std::sync::mpsc::Sender<Job>>> = std::sync::OnceLock::new();
    let run = |s: &TcpStream, peer: SocketAddr, what: Retire| match what {
        Retire::Shutdown => {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        Retire::Disconnect => {
            if let Err(err) = disconnect(s.as_raw_fd()) {
                log::warn!("engine: lane to {peer}: disconnecting before its close: {err}");
            }
        }
    };
    let closer = CLOSER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let spawned = std::thread::Builder::new().name("engine-lane-closer".into()).spawn(move || {
            for (s, peer, what) in rx {
                run(&s, peer, what);
            }
        });
        spawned.ok().map(|_| tx)
    });
    if let (Some(tx), Ok(dup)) = (closer, s.try_clone()) {
        if tx.send((dup, peer, what)).is_ok() {
            return;
        }
    }
    run(s, peer, what);
}

/// Capacity of a blocking connection's buffer of sealed records kept between frames.
const SCRATCH_KEPT: usize = 64 << 10;

/// Bytes a sealed blocking write seals and writes at a time: a large frame (a READ
/// response of up to 2 GiB) never sits whole in memory.
const SEALED_WRITE_STEP: usize = 256 << 10;

/// Writes a frame (header `head`, then `len` bytes `fill(at, buf)` writes) on `stream`,
/// sealed, [`SEALED_WRITE_STEP`] bytes at a time; blocks.
fn write_sealed_frame(
    stream: &TcpStream,
    sealer: &mut Sealer,
    head: &[u8],
    len: usize,
    mut fill: impl FnMut(usize, &mut [u8]),
) -> std::io::Result<()> {
    let total = head.len() + len;
    let mut at = 0;
    // (One buffer for the frame's stretches.)
    let mut out = Vec::with_capacity(seal::sealed_len(total.min(SEALED_WRITE_STEP)));
    while at < total {
        let n = (total - at).min(SEALED_WRITE_STEP);
        out.clear();
        sealer.seal_filled(&mut out, n, |i, buf| frame_bytes(head, at + i, buf, &mut fill)).map_err(seal_failed)?;
        (&*stream).write_all(&out)?;
        at += n;
    }
    Ok(())
}

/// Bytes `at..at + buf.len()` of a frame whose header is `head` and whose data `fill`
/// writes, into `buf`.
fn frame_bytes(head: &[u8], at: usize, buf: &mut [u8], fill: &mut impl FnMut(usize, &mut [u8])) {
    let h = head.len();
    let from_head = h.saturating_sub(at).min(buf.len());
    buf[..from_head].copy_from_slice(&head[at.min(h)..at.min(h) + from_head]);
    if from_head < buf.len() {
        fill(at + from_head - h, &mut buf[from_head..]);
    }
}

/// `buf.len()` bytes of `mr` at `off` (zeros where its owner unmapped it, as an unsealed
/// send would send).
fn mr_bytes(mr: &MappedMr, off: usize, buf: &mut [u8]) {
    if mr.read(off, buf).is_err() {
        buf.fill(0);
    }
}

fn seal_failed(e: SealError) -> std::io::Error {
    std::io::Error::other(e.to_string())
}
