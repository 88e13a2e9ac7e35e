//! Lanes: a mediated RC QP's own connection to its peer daemon, shared with the QP's client,
//! which then sends small requests itself (no engine wakeup per message). Here: opening a
//! lane and the engine's side of it (`open_lane`, `watch`), serving lanes peers open to us
//! (`serve`), the QP's send side that client and engine hand back and forth (`send_side`), the
//! ACK tokens the owner carries on its lane (`tokens`, `token_timer`), the cgroup BPF guard
//! that confines the sockets clients hold (`guard`), and the deadline each frame a lane
//! carries must meet (`deadline`).

pub(crate) mod deadline;
pub(crate) mod guard;
mod send_side;
mod serve;
pub(crate) mod token_timer;
pub(crate) mod tokens;
mod watch;

use std::net::{SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vrdma_abi::wire::Kind;

use super::connection::Conn;
use super::handshake::{check_peer, hello_frame, read_hello, Verified};
use super::link::{register_outbound, LinkError};
use super::{Engine, EngineError};

pub(crate) use serve::serve_lane;

/// A lane a peer opened to one of our QPs (see `serve::serve_lane`).
pub(crate) struct LaneIn {
    /// The lane's licence to carry requests, withdrawn when a newer lane or a (re)connection
    /// (a new PSN sequence) replaces it.
    pub(crate) licence: Arc<AtomicBool>,
    pub(crate) conn: Arc<Conn>,
}

/// A QP's lane, opened before it is attached (see [`Engine::open_lane`]); closed on drop
/// unless [`Engine::attach`] took it.
pub struct Lane {
    pub(crate) conn: Option<Arc<Conn>>,
    pub(crate) client: Option<OwnedFd>,
    /// Its secret (see [`open_lane`]).
    pub(crate) key: [u64; 2],
    pub(crate) addr: SocketAddr,
    pub(crate) peer_boot: u64,
}

impl Drop for Lane {
    fn drop(&mut self) {
        if let Some(c) = self.conn.take() {
            c.shutdown();
        }
    }
}

impl Engine {
    /// Opens the lane of our QP `src_qpn` to the peer daemon's QP `dst_qpn` (see
    /// [`open_lane`]), if lanes are on; none if the peer refuses it (a peer without
    /// lanes) or it cannot be opened: the QP then goes without. Fails only if the peer
    /// cannot be reached at all. Blocks for a connection and a HELLO: callers hold no
    /// registry lock.
    pub fn open_lane(self: &Arc<Self>, addr: SocketAddr, src_qpn: u32, dst_qpn: u32) -> Result<Option<Lane>, EngineError> {
        if self.lane_guard.is_none() {
            return Ok(None);
        }
        let link = self.link(addr)?;
        match open_lane(self, addr, link.peer_boot, src_qpn, dst_qpn) {
            Ok((conn, client, key)) => Ok(Some(Lane { conn: Some(conn), client: Some(client), key, addr, peer_boot: link.peer_boot })),
            Err(err) => {
                // (A peer without lanes refuses them.) The QP works without one: its
                // requests take the engine's connections.
                log::warn!("engine: QP {src_qpn}: no lane to QP {dst_qpn} at {addr} ({err}): its WRs go through the engine");
                Ok(None)
            }
        }
    }

    /// The lane of our QP `qpn` failed (the peer daemon closed it, a protocol error, or the
    /// whole peer went silent): that QP, and only it, goes to ERR and flushes (if `c` is
    /// still its lane).
    pub(crate) fn lane_failed(&self, qpn: u32, c: &Arc<Conn>, why: &dyn std::fmt::Display) {
        let q = self.qps.read().get(&qpn).filter(|q| q.uses_conn(c)).cloned();
        if let Some(q) = q.filter(|q| !q.is_link_down() && !q.detached.load(Ordering::Acquire)) {
            log::warn!("engine: QP {qpn}: lane to {}: {why}; QP to ERR", c.peer);
            q.link_failed();
            self.kick_qp(&q);
        }
    }
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
    // anywhere else nor listen (see `guard`).
    let guard = engine.lane_guard.as_ref().ok_or(LinkError::Hello { addr, reason: "lanes are off here" })?;
    let s = guard.connect(addr, timeout).map_err(|source| LinkError::LaneSocket { addr, source })?;
    // (Authenticated as every connection is, before the client has the socket.)
    let (c, verified_host) = register_outbound(engine, s, addr)?;
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
        let (host, claimed, boot) = read_hello(&c)?;
        check_peer(engine, &c, &host, claimed, verified_host.as_deref().map_or(Verified::Nothing, Verified::Host))?;
        if boot != peer_boot {
            return Err(LinkError::Hello { addr, reason: "the peer daemon restarted" });
        }
        // (Only now does the client get the socket: the HELLO was read before it could.)
        c.try_clone_stream().map_err(|source| LinkError::Connect { addr, source })
    };
    let client = match handshake() {
        Ok(s) => s,
        Err(err) => {
            c.shutdown();
            return Err(err);
        }
    };
    let (e, c2) = (Arc::downgrade(engine), c.clone());
    let spawned = std::thread::Builder::new().name(format!("engine-lane-{src_qpn}")).spawn(move || watch::watch_lane(e, c2, src_qpn));
    if let Err(source) = spawned {
        engine.thread_failed("engine-lane", &source);
        c.shutdown();
        return Err(LinkError::Thread { addr, source });
    }
    Ok((c, OwnedFd::from(client), key))
}
