//! Host-to-host connections: several TCP connections per peer daemon, framed with
//! [`vrdma_abi::wire`], a HELLO exchange, heartbeats, and a reader thread per connection.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use vrdma_abi::shm::MemRegion;
use vrdma_abi::wire::{self, ConnectReq, FrameHeader, Kind, WireError, HEADER_LEN};

use super::{qp, responder, Engine};

/// How long a responder holds an ACK for the QP's own next request to carry (in an RDMA
/// ping-pong the answer comes sooner: one ACK frame, and the peer reader's wakeup, saved per
/// message) before sending it alone. A requester waiting on a send completion with no
/// traffic the other way waits this much longer than with an immediate ACK.
pub(crate) const ACK_DELAY: Duration = Duration::from_micros(50);

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
pub(crate) struct Conn {
    stream: TcpStream,
    write: Mutex<()>,
    alive: AtomicBool,
    /// The peer daemon's listening address (its identity).
    pub(crate) peer: SocketAddr,
}

impl Conn {
    fn new(stream: TcpStream, peer: SocketAddr) -> Conn {
        Conn { stream, write: Mutex::new(()), alive: AtomicBool::new(true), peer }
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Sends a frame whose data (if any) is in `data`.
    pub(crate) fn send(&self, h: &FrameHeader, data: &[u8]) -> std::io::Result<()> {
        let _g = self.write.lock();
        let mut s = &self.stream;
        if data.is_empty() {
            return s.write_all(&h.encode());
        }
        let mut buf = Vec::with_capacity(HEADER_LEN + data.len());
        buf.extend_from_slice(&h.encode());
        buf.extend_from_slice(data);
        s.write_all(&buf)
    }

    /// Sends a frame whose data is `len` bytes of `mem` at `off` (registered memory).
    pub(crate) fn send_region(&self, h: &FrameHeader, mem: &MemRegion, off: usize, len: usize) -> std::io::Result<()> {
        let _g = self.write.lock();
        mem.write_to_fd(std::os::fd::AsFd::as_fd(&self.stream), &h.encode(), off, len)
    }

    /// Sends frame `h` and `len` bytes produced `step` at a time by `fill(offset, buf)`.
    pub(crate) fn send_streamed(
        &self,
        h: &FrameHeader,
        len: usize,
        step: usize,
        mut fill: impl FnMut(usize, &mut [u8]),
    ) -> std::io::Result<()> {
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
    pub(crate) fn send_raw(&self, bytes: &[u8]) -> std::io::Result<()> {
        let _g = self.write.lock();
        (&self.stream).write_all(bytes)
    }

    pub(crate) fn shutdown(&self) {
        self.alive.store(false, Ordering::Release);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// Reads exactly `buf.len()` bytes.
    pub(crate) fn read_exact(&self, buf: &mut [u8]) -> std::io::Result<()> {
        (&self.stream).read_exact(buf)
    }

    /// Reads `len` bytes into `mem` at `off`.
    pub(crate) fn read_region(&self, mem: &MemRegion, off: usize, len: usize) -> std::io::Result<()> {
        mem.read_from_fd(std::os::fd::AsFd::as_fd(&self.stream), off, len)
    }

    /// Reads and drops `len` bytes (data of a request we refuse, to stay framed).
    pub(crate) fn discard(&self, mut len: u64) -> std::io::Result<()> {
        let mut buf = [0u8; 16384];
        while len > 0 {
            let n = len.min(buf.len() as u64) as usize;
            self.read_exact(&mut buf[..n])?;
            len -= n as u64;
        }
        Ok(())
    }

    /// Whether data arrives (or is there) within `wait`.
    fn readable_within(&self, wait: Duration) -> bool {
        let mut p = libc::pollfd { fd: self.stream.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ts = libc::timespec { tv_sec: wait.as_secs() as libc::time_t, tv_nsec: wait.subsec_nanos() as libc::c_long };
        // SAFETY: one valid pollfd and a timespec, both live for the call; no signal mask.
        let n = unsafe { libc::ppoll(&mut p, 1, &ts, std::ptr::null()) };
        // An interrupted wait counts as none: the owed ACKs go out now, never held longer.
        n > 0
    }

    /// Reads the next frame header. The socket's read timeout (the peer timeout) fires on an
    /// idle connection too: that is the peer's death only if no connection of the peer
    /// delivered anything for as long (`live`): heartbeats on an idle connection lag while
    /// their sender is blocked writing a busy one to a slow receiver, a peer that is alive.
    fn read_header(&self, live: &PeerRx, timeout: Duration) -> Result<FrameHeader, LinkError> {
        let mut b = [0u8; HEADER_LEN];
        let mut got = 0;
        while got < HEADER_LEN {
            match (&self.stream).read(&mut b[got..]) {
                Ok(0) => {
                    let source = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
                    return Err(LinkError::Recv { addr: self.peer, source });
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) && live.heard_within(timeout) => {}
                Err(source) => return Err(LinkError::Recv { addr: self.peer, source }),
            }
        }
        live.heard();
        FrameHeader::decode(&b).map_err(|source| LinkError::Protocol { addr: self.peer, source })
    }
}

fn tune(s: &TcpStream, timeout: Duration) {
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(timeout));
    let ms = timeout.as_millis().min(u32::MAX as u128) as libc::c_uint;
    // SAFETY: setsockopt on a live socket with a c_uint value; bounded send stalls on a cut
    // link become errors instead of hangs.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            &ms as *const libc::c_uint as *const libc::c_void,
            std::mem::size_of::<libc::c_uint>() as libc::socklen_t,
        )
    };
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
    // Nothing heard from this peer yet: a HELLO that does not come within the timeout fails.
    let h = c.read_header(&PeerRx::new(), Duration::ZERO)?;
    let bad = |reason: &str| LinkError::Hello { addr: c.peer, reason: reason.into() };
    if h.kind != Kind::Hello {
        return Err(bad("first frame is not HELLO"));
    }
    let mut data = vec![0u8; h.data_len as usize];
    c.read_exact(&mut data).map_err(|source| LinkError::Recv { addr: c.peer, source })?;
    let text = wire::text(&data);
    let (host, addr) = text.split_once('\n').ok_or_else(|| bad("malformed HELLO"))?;
    let addr: SocketAddr = addr.parse().map_err(|_| bad("malformed address in HELLO"))?;
    Ok((host.to_string(), addr, h.arg1))
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
            let c = Arc::new(Conn::new(s, addr));
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
        self.conns[0].send(&h, &data).map_err(|source| LinkError::Send { addr: self.addr, source })
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
        for c in &self.conns {
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
    super::realtime_thread();
    let Some((live, timeout)) = engine.upgrade().map(|e| (e.peer_rx(c.peer), e.cfg.peer_timeout)) else { return };
    let err = loop {
        let h = match c.read_header(&live, timeout) {
            Ok(h) => h,
            Err(e) => break e.to_string(),
        };
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
    super::realtime_thread();
    let (host, peer, peer_boot) = match read_hello(&c0) {
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
        write: Mutex::new(()),
        alive: AtomicBool::new(true),
        peer,
    });
    let (h, data) = hello_frame(&e);
    if c.send(&h, &data).is_err() {
        return;
    }
    e.inbound.lock().entry(peer).or_default().push(c.clone());
    log::debug!("engine: inbound connection from {host} ({peer})");
    let (live, timeout) = (e.peer_rx(peer), e.cfg.peer_timeout);
    drop(e);
    // QPs whose ACK this reader deferred: sent if no request of theirs carries it within
    // ACK_DELAY (checked only while no further request arrives).
    let mut owed: Vec<Arc<qp::MedQp>> = Vec::new();
    let mut ud_buf = Vec::new();
    let err = loop {
        if !owed.is_empty() {
            owed.retain(|q| q.owes_ack());
            if !owed.is_empty() && !c.readable_within(ACK_DELAY) {
                if let Some(err) = owed.drain(..).find_map(|q| responder::send_owed_ack(&c, &q).err()) {
                    break err.to_string();
                }
            }
        }
        let h = match c.read_header(&live, timeout) {
            Ok(h) => h,
            Err(e) => break e.to_string(),
        };
        let Some(e) = engine.upgrade() else { return };
        let r: Result<(), String> = match h.kind {
            Kind::Heartbeat => c.send(&FrameHeader::new(Kind::HeartbeatAck), &[]).map_err(|e| e.to_string()),
            k if k.is_request() => match responder::handle_request(&e, &c, &h) {
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
                e.mark_peer_gone(h.dst_qpn);
                if let Some(b) = e.broker() {
                    b.peer_gone(h.dst_qpn, peer, h.src_qpn);
                }
                Ok(())
            }
            Kind::UdSend => super::ud::receive(&e, &c, peer, &h, &mut ud_buf).map_err(|e| e.to_string()),
            Kind::Hello => c.discard(u64::from(h.data_len)).map_err(|e| e.to_string()),
            other => Err(format!("unexpected {other:?} on a responder connection")),
        };
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
