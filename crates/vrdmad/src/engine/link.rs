//! Host-to-host connections: several TCP connections per peer daemon, framed with
//! [`vrdma_abi::wire`], a HELLO exchange, heartbeats, and a reader thread per connection.

use crate::engine::Refusal;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use vrdma_abi::wire::{self, ConnectReq, FrameHeader, Kind, WireError};

use super::affinity::{incoming_cpu, CpuFollower};
use super::connection::{tune, Conn, PeerRx};
use super::handshake::{check_peer, hello_frame, read_hello, tls_connect, Verified};
use super::priority::{reader_priority, realtime_thread};
use super::reader::ReaderError;
use super::trace::{self, Stage};
use super::{qp, Engine};

/// Transport failures, classified: a `Retry` may succeed later as is, `Reconnect` needs a new
/// connection (the peer or the path failed), `Fatal` means the peer is not a compatible vrdmad.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The TCP connection to the peer daemon failed.
    #[error("connecting to {addr}: {source}")]
    Connect {
        /// The peer daemon's engine address.
        addr: SocketAddr,
        /// The `connect` error.
        source: std::io::Error,
    },
    /// The HELLO exchange failed: the peer is not a compatible vrdmad, or refuses lanes.
    #[error("HELLO with {addr}: {reason}")]
    Hello {
        /// The peer daemon's engine address.
        addr: SocketAddr,
        /// What was wrong.
        reason: &'static str,
    },
    /// The peer at `addr` claimed to be the daemon at `claimed`, or a host the cluster has
    /// elsewhere.
    #[error("peer at {addr} claims to be the daemon at {claimed}: refused")]
    Impostor {
        /// The connection's source address.
        addr: SocketAddr,
        /// The daemon address it claimed.
        claimed: SocketAddr,
    },
    /// The TLS handshake with the daemon at `addr` failed.
    #[error("TLS with {addr}: {source}")]
    Tls {
        /// The peer daemon's address.
        addr: SocketAddr,
        /// Why.
        source: super::peer_tls::PeerTlsError,
    },
    /// Writing to the peer failed.
    #[error("sending to {addr}: {source}")]
    Send {
        /// The peer daemon's engine address.
        addr: SocketAddr,
        /// The write error.
        source: std::io::Error,
    },
    /// Reading from the peer failed.
    #[error("receiving from {addr}: {source}")]
    Recv {
        /// The peer daemon's engine address.
        addr: SocketAddr,
        /// The read error.
        source: std::io::Error,
    },
    /// The peer sent a frame that does not decode.
    #[error("bad frame from {addr}: {source}")]
    Protocol {
        /// The peer daemon's engine address.
        addr: SocketAddr,
        /// What does not decode.
        source: WireError,
    },
    /// A reader thread for a connection to `addr` could not be started.
    #[error("starting a reader for {addr}: {source}")]
    Thread {
        /// The peer daemon's engine address.
        addr: SocketAddr,
        /// The spawn error.
        source: std::io::Error,
    },
    /// A connection of the link is no longer alive.
    #[error("connection lost")]
    Lost,
    /// A heartbeat could not be sent.
    #[error("heartbeat failed: {source}")]
    Heartbeat {
        /// The write error.
        source: std::io::Error,
    },
    /// A lane's guarded socket (`lane::guard`) could not be made or connected.
    #[error("lane to {addr}: {source}")]
    LaneSocket {
        /// The peer daemon's engine address.
        addr: SocketAddr,
        /// Why the lane socket failed.
        source: super::lane::guard::LaneGuardError,
    },
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
            LinkError::Hello { .. } | LinkError::Impostor { .. } | LinkError::Tls { .. } => Recovery::Fatal,
            _ => Recovery::Reconnect,
        }
    }
}

/// Our new connection `s` to the peer daemon at `addr`, made ready for frames: tuned,
/// authenticated (the host name the peer's TLS certificate proved, with TLS on; its frames
/// then sealed) and registered with the engine's poller.
pub(crate) fn register_outbound(engine: &Arc<Engine>, s: TcpStream, addr: SocketAddr) -> Result<(Arc<Conn>, Option<String>), LinkError> {
    tune(&s, engine.cfg.peer_timeout);
    let verified = tls_connect(engine, &s, addr)?;
    let hook = engine.conn_hook();
    let token = hook.token;
    let c = Arc::new(Conn::with_hook(s, addr, Some(hook)));
    let verified_host = verified.map(|(host, keys)| {
        c.seal_frames(&keys, engine.refused_frames.clone());
        host
    });
    engine.register_conn(&c, token);
    Ok((c, verified_host))
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
            let (c, verified_host) = register_outbound(engine, s, addr)?;
            let (h, data) = hello_frame(engine);
            c.send(&h, &data).map_err(|source| LinkError::Send { addr, source })?;
            let (host, claimed, boot) = read_hello(&c)?;
            let verified = verified_host.as_deref().map_or(Verified::Nothing, Verified::Host);
            if let Err(err) = check_peer(engine, &c, &host, claimed, verified) {
                c.shutdown();
                return Err(err);
            }
            peer_boot = boot;
            conns.push(c);
        }
        let link = Arc::new(Link { addr, peer_boot, conns, alive: AtomicBool::new(true) });
        for c in &link.conns {
            let (e, c, l) = (Arc::downgrade(engine), c.clone(), Arc::downgrade(&link));
            let spawned = std::thread::Builder::new().name(format!("engine-out-{addr}")).spawn(move || outbound_reader(e, c, l));
            if let Err(source) = spawned {
                // (Readers already started end with their connections.)
                engine.thread_failed("engine-out", &source);
                link.shutdown();
                return Err(LinkError::Thread { addr, source });
            }
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
    pub(crate) fn heartbeat(&self, _timeout: Duration) -> Result<(), LinkError> {
        if !self.is_alive() {
            return Err(LinkError::Lost);
        }
        let h = FrameHeader::new(Kind::Heartbeat);
        // (Behind a backlog a heartbeat would only queue up: the peer is not reading it.)
        for c in self.conns.iter().filter(|c| c.backlog() == 0) {
            c.send(&h, &[]).map_err(|source| LinkError::Heartbeat { source })?;
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

/// The next frame's header on `c` (as [`Conn::read_header`]); when it took a read from the
/// socket, the reader follows the CPU that received it (see `affinity`). The start of every
/// reader loop.
#[inline]
pub(crate) fn read_header_following(
    c: &Conn,
    live: &PeerRx,
    timeout: Duration,
    follower: &mut CpuFollower,
) -> Result<FrameHeader, LinkError> {
    let (h, read) = c.read_header(live, timeout)?;
    // Asked before the frame is handled: handling it sends on this socket, and the peer's
    // acknowledgements of that would be the last segments received.
    if read {
        follower.woken_from(|| incoming_cpu(c.fd()));
    }
    Ok(h)
}

/// Reads responses on one of our connections.
fn outbound_reader(engine: Weak<Engine>, c: Arc<Conn>, link: Weak<Link>) {
    let Some((live, timeout, follow)) = engine.upgrade().map(|e| (e.peer_rx(c.peer), e.cfg.peer_timeout, e.cfg.follow_cpu)) else { return };
    realtime_thread(reader_priority(follow));
    let mut follower = CpuFollower::new(follow);
    let err = loop {
        let h = match read_header_following(&c, &live, timeout, &mut follower) {
            Ok(h) => h,
            Err(e) => break ReaderError::from(e),
        };
        trace::record(Stage::ResponseRead, h.dst_qpn, h.psn);
        let Some(e) = engine.upgrade() else { return };
        let r: Result<(), ReaderError> = match h.kind {
            k if k.is_response() => qp::handle_response(&e, &c, &h).map_err(ReaderError::from),
            Kind::ConnectRep => {
                let mut data = vec![0u8; h.data_len as usize];
                match c.read_exact(&mut data) {
                    Ok(()) => {
                        if let Some(tx) = e.connect_waiters.lock().remove(&h.arg1) {
                            let r = if h.status == 0 { Ok(()) } else { Err(Refusal::new(h.status as i32, wire::text(&data))) };
                            let _ = tx.try_send(r);
                        }
                        Ok(())
                    }
                    Err(err) => Err(err.into()),
                }
            }
            Kind::HeartbeatAck | Kind::Hello => c.discard(u64::from(h.data_len)).map_err(ReaderError::from),
            kind => Err(ReaderError::Unexpected { kind, role: "requester" }),
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
