//! UD across hosts. A UD QP that resolved a destination on another host sends those
//! datagrams to vrdmad on its datagram socket ([`vrdma_abi::ud::UdDatagram`] messages); the
//! doorbell thread forwards each as a `UdSend` frame to the destination's daemon, whose
//! connection reader delivers it into the destination UD QP's receive queue, the way a
//! local sender's library does on the direct path (GRH, receive completion, CQ event).
//!
//! Datagram semantics throughout: whatever cannot be delivered (no receive posted, wrong
//! Q_Key, QP not ready, tenant rules, unknown destination, full socket) is dropped and
//! counted, never reported to the sender, never a reason to fail the link.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use vrdma_abi::fd::set_nonblocking;
use vrdma_abi::ring::{self};
use vrdma_abi::shm::ShmError;
use vrdma_abi::ud::{self, UdDatagram, GRH_LEN, UD_DATAGRAM_MAX, UD_FRAME_MAX};
use vrdma_abi::verbs::{QpState, WcStatus};
use vrdma_abi::wire::{self, FrameHeader, Kind};
use vrdma_core::access::{check, Need};

use super::connection::{set_socket_option, Conn, Parked};
use super::doorbell::Token;
use super::qos::Budget;
use super::qp::{CqView, RecvSide, RecvSideSetup};
use super::{Engine, EngineError, MappedMr};

/// Datagrams forwarded at most from the socket of a destroyed UD QP: more than its send
/// buffer holds, and a bound should a client keep writing to a copy of its end.
const DRAIN_MAX: usize = 16384;
/// A destroyed UD QP's datagrams are forwarded while their connection has less than this
/// waiting (a full socket's worth), then dropped.
const DRAIN_BACKLOG_MAX: usize = 8 << 20;
/// How long a delivery waits at most for the destination's UD receive lock (a local sender
/// holds it for one datagram's copy; one that crashed or holds it on purpose: the datagram
/// is dropped, as UD may).
const UD_LOCK_WAIT: Duration = Duration::from_millis(1);
/// How long deliveries to one UD QP may wait for its lock in all, per [`UD_LOCK_WINDOW`]:
/// the lock word lives in memory its client writes, so a client holding it must not hold
/// the connection that delivers to every QP of its host for more than this.
const UD_LOCK_BUDGET: Duration = Duration::from_millis(5);
/// See [`UD_LOCK_BUDGET`].
const UD_LOCK_WINDOW: Duration = Duration::from_secs(1);

/// What the registry hands the engine to deliver datagrams to one of its UD QPs.
pub struct UdReceiverSetup {
    /// The QP.
    pub qpn: u32,
    /// Its client session.
    pub session: u64,
    /// Its PD.
    pub pd: u32,
    /// Its receiving side.
    pub recv: RecvSideSetup,
    /// Receive CQ region and eventfd.
    pub recv_cq: (Arc<OwnedFd>, Arc<OwnedFd>),
}

/// Send buffer of a client's UD datagram socket (about 1000 MTU datagrams).
const UD_SOCKET_BUFFER: libc::c_int = 4 << 20;

/// A connected `SOCK_SEQPACKET` pair: the client's end (blocking is up to the client, its
/// send buffer large enough for bursts) and the engine's (non-blocking).
pub(crate) fn seqpacket_pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    use std::os::fd::FromRawFd;
    let mut fds = [0i32; 2];
    // SAFETY: socketpair writes two descriptors into `fds`, which we own below.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fresh descriptors, owned by nothing else.
    let (client, engine) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    set_nonblocking(&engine, true)?;
    // Forced: the client could not raise its buffer past wmem_max itself.
    let _ = set_socket_option(client.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, &UD_SOCKET_BUFFER);
    Ok((client, engine))
}

/// How a pump of a datagram socket ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pumped {
    /// Nothing more to read now.
    Empty,
    /// The limit was reached with datagrams left (epoll reports the socket again).
    More,
    /// The client closed its end (or the socket failed): nothing more will come.
    Closed,
    /// Parked on a connection with a backlog (read again once it is sent).
    Parked,
}

/// A UD QP's sending side: its datagram socket and the remote destinations it resolved.
pub(crate) struct UdSender {
    pub(crate) qpn: u32,
    /// Its vNIC: its datagrams are that vNIC's egress, under its caps and fair share (the
    /// doorbell thread pumps the socket through the scheduler, see `qos::Scheduled`).
    pub(crate) vnic: String,
    src_gid: [u8; 16],
    pub(crate) socket: OwnedFd,
    /// Destination GID → its daemon, as resolved through the control path (tenant rules
    /// checked there); datagrams to any other GID are dropped.
    routes: Mutex<HashMap<[u8; 16], SocketAddr>>,
    /// A link (re)connection is under way in the background.
    connecting: Arc<AtomicBool>,
    pub(crate) dropped: AtomicU64,
}

impl UdSender {
    pub(crate) fn new(qpn: u32, vnic: &str, src_gid: [u8; 16], socket: OwnedFd) -> UdSender {
        UdSender {
            qpn,
            vnic: vnic.to_string(),
            src_gid,
            socket,
            routes: Mutex::new(HashMap::new()),
            connecting: Arc::new(AtomicBool::new(false)),
            dropped: AtomicU64::new(0),
        }
    }

    pub(crate) fn add_route(&self, dgid: [u8; 16], addr: SocketAddr) {
        self.routes.lock().insert(dgid, addr);
    }

    /// Forwards one pump's worth of datagrams (see [`UdSender::pump_within`]).
    #[cfg(test)]
    pub(crate) fn pump(&self, e: &Arc<Engine>, msg: &mut Vec<u8>, frame: &mut Vec<u8>) -> Pumped {
        self.pump_within(e, &mut Budget::default(), msg, frame)
    }

    /// Forwards datagrams while `budget` (the scheduler's grant: the vNIC's caps and fair
    /// share) allows, recording them there (one WR each, its payload's bytes; one dropped
    /// costs a WR). When one leaves its connection with a backlog, the sender parks there
    /// and stops: the rest wait in the socket.
    pub(crate) fn pump_within(&self, e: &Arc<Engine>, budget: &mut Budget, msg: &mut Vec<u8>, frame: &mut Vec<u8>) -> Pumped {
        self.forward_queued(e, msg, frame, Some(budget))
    }

    /// Reads and forwards the socket's datagrams: a budget's worth that parks (`pump`), or,
    /// draining a destroyed QP (no budget), up to [`DRAIN_MAX`] that never park.
    fn forward_queued(&self, e: &Arc<Engine>, msg: &mut Vec<u8>, frame: &mut Vec<u8>, mut budget: Option<&mut Budget>) -> Pumped {
        let park = budget.is_some();
        msg.resize(UD_DATAGRAM_MAX + 1, 0);
        // Draining (not parking): past DRAIN_BACKLOG_MAX waiting on a connection, the rest is
        // dropped, so that a client cannot grow our memory by destroying full QPs.
        let mut full = false;
        for _ in 0..DRAIN_MAX {
            if budget.as_ref().is_some_and(|b| !b.allows_more()) {
                return Pumped::More;
            }
            // SAFETY: receives into `msg`, a live buffer of `msg.len()` bytes. MSG_TRUNC makes
            // the call return a message's real length, so an oversized one is seen as such.
            let n =
                unsafe { libc::recv(self.socket.as_raw_fd(), msg.as_mut_ptr().cast(), msg.len(), libc::MSG_DONTWAIT | libc::MSG_TRUNC) };
            if n == 0 {
                return Pumped::Closed;
            }
            if n < 0 {
                let err = std::io::Error::last_os_error();
                return match err.kind() {
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => Pumped::Empty,
                    _ => Pumped::Closed,
                };
            }
            let n = n as usize;
            // (Charged as sent, forwarded or not: reading and judging it took the thread.)
            if let Some(b) = budget.as_mut() {
                b.spend(n.saturating_sub(ud::UD_DATAGRAM_HEADER) as u32);
            }
            if n > UD_DATAGRAM_MAX {
                self.drop_one(format_args!("message of {n} bytes"));
                continue;
            }
            if full {
                self.drop_one(format_args!("its QP was destroyed with the connection backlogged"));
                continue;
            }
            match UdDatagram::decode(&msg[..n]) {
                Ok((d, payload)) => {
                    if let Some(conn) = self.forward(e, &d, payload, frame) {
                        if park && conn.park_if_backlogged(Parked::Ud(self.qpn)) {
                            return Pumped::Parked;
                        }
                        full = !park && conn.backlog() > DRAIN_BACKLOG_MAX;
                    }
                }
                Err(err) => self.drop_one(format_args!("{err}")),
            }
        }
        Pumped::More
    }

    /// The QP was destroyed: forwards the datagrams still in its socket (each completed to
    /// its sender when written there), up to [`DRAIN_MAX`].
    pub(crate) fn drain(&self, e: &Arc<Engine>, msg: &mut Vec<u8>, frame: &mut Vec<u8>) {
        if self.forward_queued(e, msg, frame, None) == Pumped::More {
            // (Counted as one: what is left is discarded with the socket.)
            self.drop_one(format_args!("still writing after its QP was destroyed"));
        }
        let dropped = self.dropped.load(Ordering::Relaxed);
        if dropped > 0 {
            log::debug!("UD QP {}: {dropped} datagram(s) to other hosts dropped", self.qpn);
        }
    }

    fn drop_one(&self, why: std::fmt::Arguments<'_>) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
        log::debug!("UD QP {}: datagram dropped: {why}", self.qpn);
    }

    /// Forwards one datagram; returns its connection if that has a backlog now.
    fn forward(&self, e: &Arc<Engine>, d: &UdDatagram, payload: &[u8], frame: &mut Vec<u8>) -> Option<Arc<Conn>> {
        let Some(addr) = self.routes.lock().get(&d.dgid).copied() else {
            self.drop_one(format_args!("GID {} was not resolved", std::net::Ipv6Addr::from(d.dgid)));
            return None;
        };
        let Some(link) = e.existing_link(addr) else {
            // The link failed since the destination was resolved: reconnect off this thread
            // (datagrams meanwhile are lost, as on a link that is down).
            if !self.connecting.swap(true, Ordering::AcqRel) {
                let (e2, flag) = (e.clone(), self.connecting.clone());
                let spawned = std::thread::Builder::new().name("engine-ud-connect".into()).spawn(move || {
                    if let Err(err) = e2.link(addr) {
                        log::debug!("UD: reconnecting to {addr}: {err}");
                    }
                    flag.store(false, Ordering::Release);
                });
                if let Err(err) = spawned {
                    // (The next datagram to that destination tries again.)
                    e.thread_failed("engine-ud-connect", &err);
                    self.connecting.store(false, Ordering::Release);
                }
            }
            self.drop_one(format_args!("no link to {addr}"));
            return None;
        };
        let mut h = FrameHeader::new(Kind::UdSend);
        h.dst_qpn = d.dest_qpn;
        h.src_qpn = self.qpn;
        h.imm = d.imm;
        h.arg1 = u64::from(d.qkey);
        if d.flags & ud::UD_F_IMM != 0 {
            h.flags |= wire::F_IMM;
        }
        if d.flags & ud::UD_F_SOLICITED != 0 {
            h.flags |= wire::F_SOLICITED;
        }
        h.data_len = (ud::UD_FRAME_GIDS + payload.len()) as u32;
        frame.clear();
        frame.extend_from_slice(&self.src_gid);
        frame.extend_from_slice(&d.dgid);
        frame.extend_from_slice(payload);
        let conn = link.conn_for(self.qpn);
        if let Err(err) = conn.send(&h, frame) {
            self.drop_one(format_args!("sending to {addr}: {err}"));
        }
        (conn.backlog() > 0).then_some(conn)
    }
}

/// A UD QP's receiving side, as the engine delivers into it.
pub(crate) struct UdReceiver {
    qpn: u32,
    session: u64,
    pd: u32,
    side: RecvSide,
    recv_cq: CqView,
    state: Mutex<RxState>,
}

/// Buffers reused from one delivery to the next.
struct RxState {
    sges: Vec<ring::Sge>,
    /// The receive's scatter list resolved: MR, offset in it, length.
    targets: Vec<(Arc<MappedMr>, usize, usize)>,
    inbound_head_cache: u64,
    /// Waiting for the QP's lock so far in the current window, and when that began.
    lock_waited: Duration,
    lock_window: Instant,
}

impl UdReceiver {
    pub(crate) fn new(s: UdReceiverSetup) -> Result<UdReceiver, ShmError> {
        Ok(UdReceiver {
            qpn: s.qpn,
            session: s.session,
            pd: s.pd,
            side: RecvSide::map(s.recv)?,
            recv_cq: CqView::new(s.recv_cq)?,
            state: Mutex::new(RxState {
                sges: Vec::new(),
                targets: Vec::new(),
                inbound_head_cache: 0,
                lock_waited: Duration::ZERO,
                lock_window: Instant::now(),
            }),
        })
    }

    /// Delivers one datagram, or drops it (returns why).
    fn deliver(&self, e: &Engine, h: &FrameHeader, src_gid: &[u8; 16], dgid: &[u8; 16], payload: &[u8]) -> Result<(), &'static str> {
        if !matches!(self.side.owner_state(), Some(QpState::Rtr | QpState::Rts | QpState::Sqd)) {
            return Err("destination QP not ready");
        }
        let qkey = self.side.qp_map.region().atomic_u64(ring::QP_QKEY).map(|w| w.load(Ordering::Acquire)).unwrap_or(0);
        if qkey as u32 != h.arg1 as u32 {
            return Err("Q_Key mismatch");
        }
        let mut st = self.state.lock();
        let _lock = self.ud_lock(&mut st).ok_or("receive lock held too long")?;
        let RxState { sges, targets, inbound_head_cache, .. } = &mut *st;
        let Some((wr_id, srq)) = self.side.take_recv(sges) else { return Err("no receive posted") };
        let imm = (h.flags & wire::F_IMM != 0).then_some(h.imm);
        let solicited = h.flags & wire::F_SOLICITED != 0;
        let mut ce = ud::recv_completion(wr_id, payload.len(), imm, solicited, srq, h.src_qpn);
        // Resolve the whole scatter list before writing a byte, as the direct path does.
        targets.clear();
        let mut room = 0usize;
        for s in sges.iter().filter(|s| s.length > 0) {
            let Some(mr) = e.mr(s.lkey, self.session, self.pd) else {
                ce.status = WcStatus::LocProtErr as u8;
                break;
            };
            if check(&mr.bounds, s.addr, u64::from(s.length), Need::LocalWrite).is_err() {
                ce.status = WcStatus::LocProtErr as u8;
                break;
            }
            let off = (s.addr - mr.span_start) as usize;
            targets.push((mr, off, s.length as usize));
            room += s.length as usize;
        }
        if ce.status == 0 && room < GRH_LEN + payload.len() {
            ce.status = WcStatus::LocLenErr as u8;
        }
        if ce.status == 0 && scatter(targets, &[&ud::grh(src_gid, dgid, payload.len()), payload]).is_err() {
            ce.status = WcStatus::LocProtErr as u8;
        }
        if ce.status != 0 {
            ce.byte_len = 0;
        }
        if self.side.inbound.push_cached(&ce, inbound_head_cache).unwrap_or(false) {
            self.recv_cq.notify(solicited || ce.status != 0);
        }
        Ok(())
    }

    /// Takes the QP's UD receive lock, shared with local senders' libraries: waits at most
    /// [`UD_LOCK_WAIT`], and no more than what is left of the QP's [`UD_LOCK_BUDGET`].
    fn ud_lock(&self, st: &mut RxState) -> Option<UdLockGuard<'_>> {
        let w = self.side.qp_map.region().atomic_u64(ring::QP_UD_LOCK).ok()?;
        let started = Instant::now();
        if started.duration_since(st.lock_window) >= UD_LOCK_WINDOW {
            (st.lock_window, st.lock_waited) = (started, Duration::ZERO);
        }
        let deadline = started + UD_LOCK_WAIT.min(UD_LOCK_BUDGET.saturating_sub(st.lock_waited));
        let mut spins = 0u32;
        let got = loop {
            if w.compare_exchange_weak(0, 1, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                break true;
            }
            spins += 1;
            if spins < 128 {
                std::hint::spin_loop();
            } else {
                if Instant::now() >= deadline {
                    break false;
                }
                std::thread::yield_now();
            }
        };
        if spins >= 128 {
            st.lock_waited += started.elapsed();
        }
        // (Lazily: a guard made and dropped would release the lock its holder has.)
        got.then(|| UdLockGuard { rx: self })
    }
}

/// Writes `sources`, one after the other, across `targets` (which have room for them all).
fn scatter(targets: &[(Arc<MappedMr>, usize, usize)], sources: &[&[u8]]) -> Result<(), WcStatus> {
    let mut t = targets.iter();
    let (mut mr, mut off, mut room) = match t.next() {
        Some((mr, off, len)) => (mr, *off, *len),
        None => return Ok(()),
    };
    for mut src in sources.iter().copied() {
        while !src.is_empty() {
            while room == 0 {
                let (m, o, l) = t.next().ok_or(WcStatus::LocLenErr)?;
                (mr, off, room) = (m, *o, *l);
            }
            let n = room.min(src.len());
            mr.write(off, &src[..n])?;
            (off, room, src) = (off + n, room - n, &src[n..]);
        }
    }
    Ok(())
}

struct UdLockGuard<'a> {
    rx: &'a UdReceiver,
}

impl Drop for UdLockGuard<'_> {
    fn drop(&mut self) {
        if let Ok(w) = self.rx.side.qp_map.region().atomic_u64(ring::QP_UD_LOCK) {
            w.store(0, Ordering::Release);
        }
    }
}

/// A `UdSend` frame on connection `c` from the daemon at `from` (its data not yet read):
/// delivered if the destination accepts it, else dropped. Only a broken stream is an error.
pub(crate) fn receive(e: &Arc<Engine>, c: &Conn, from: SocketAddr, h: &FrameHeader, buf: &mut Vec<u8>) -> std::io::Result<()> {
    let len = h.data_len as usize;
    if len > UD_FRAME_MAX {
        // The header decoder bounds UdSend data; this guards a future change of that bound.
        return c.discard(len as u64);
    }
    buf.resize(len, 0);
    c.read_exact(buf)?;
    let Ok(ud::UdFrame { src_gid, dst_gid: dgid, payload }) = ud::split_frame(buf) else {
        log::debug!("UD datagram from {from} to QP {}: malformed, dropped", h.dst_qpn);
        return Ok(());
    };
    let rx = match e.broker().map(|b| b.accept_ud(from, &src_gid, h.dst_qpn, &dgid)) {
        Some(Ok(())) => e.ud_receiver(h.dst_qpn),
        Some(Err(why)) => {
            e.refuse_claim(from, format_args!("UD datagram to QP {}: {why}, dropped", h.dst_qpn));
            return Ok(());
        }
        None => None,
    };
    let Some(rx) = rx else { return Ok(()) };
    if let Err(why) = rx.deliver(e, h, &src_gid, &dgid, payload) {
        log::trace!("UD datagram from {from} to QP {}: {why}, dropped", rx.qpn);
    }
    Ok(())
}
impl Engine {
    /// UD QP `qpn` (of the vNIC with `src_gid`) sends to the vNIC with `dgid`, whose daemon
    /// is at `addr`. Connects the link now, so the datagrams find it. The QP's first route
    /// creates its datagram socket: the client's end is returned then, `None` later.
    pub fn add_ud_route(
        self: &Arc<Self>,
        qpn: u32,
        src_gid: [u8; 16],
        dgid: [u8; 16],
        addr: SocketAddr,
        vnic: &str,
    ) -> Result<Option<OwnedFd>, EngineError> {
        self.link(addr)?;
        let attach_err = |e: std::io::Error| EngineError::Attach { qpn, source: e.into() };
        let mut created = None;
        let sender = {
            let mut senders = self.ud_senders.write();
            match senders.get(&qpn) {
                Some(s) => s.clone(),
                None => {
                    let (client, socket) = seqpacket_pair().map_err(attach_err)?;
                    let s = Arc::new(UdSender::new(qpn, vnic, src_gid, socket));
                    self.epoll_add(s.socket.as_raw_fd(), Token::ud(qpn)).map_err(attach_err)?;
                    senders.insert(qpn, s.clone());
                    created = Some(client);
                    s
                }
            }
        };
        sender.add_route(dgid, addr);
        Ok(created)
    }

    /// UD QP `qpn` is destroyed: stop delivering to it; what it sent before is still
    /// forwarded (by the doorbell thread, which drains its socket once more), then its
    /// sending side goes.
    pub fn detach_ud(&self, qpn: u32) {
        let removed = self.ud_senders.write().remove(&qpn);
        // (Not under the senders' lock: the doorbell thread takes the scheduler's first.)
        self.qos.lock().forget(qpn);
        if let Some(s) = removed {
            self.epoll_del(s.socket.as_raw_fd());
            self.ud_closing.lock().push(s);
            self.kick();
        }
        self.ud_receivers.lock().remove(&qpn);
    }

    /// The receiving side of our UD QP `qpn`, mapped on first use.
    pub(crate) fn ud_receiver(&self, qpn: u32) -> Option<Arc<UdReceiver>> {
        if let Some(r) = self.ud_receivers.lock().get(&qpn) {
            return Some(r.clone());
        }
        let setup = self.broker()?.ud_receiver(qpn)?;
        match UdReceiver::new(setup) {
            Ok(r) => {
                let r = Arc::new(r);
                self.ud_receivers.lock().insert(qpn, r.clone());
                Some(r)
            }
            Err(err) => {
                log::warn!("UD QP {qpn}: mapping its receive side: {err}");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests;
