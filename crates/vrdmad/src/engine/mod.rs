//! The mediated data-path engine (DESIGN §3): vrdmad executes the send WRs of QPs whose
//! peer it reaches over the host-to-host transport (another host's vrdmad, or this one when
//! policy mediates), keeping RC semantics: PSN order, exactly once, RDMA READ and atomics
//! executed at the responder, RNR and remote errors as completions, and every outstanding
//! WR flushed when the peer or the link fails.
//!
//! Threads: one *doorbell* thread sleeps in `epoll_wait` on the mediated QPs' doorbell
//! eventfds (clients ring only when the engine asked, see `MED_DOORBELL_WANTED`), spins
//! briefly after work on machines of more than two CPUs ([`default_spin`]), and drives retry
//! timers and heartbeats; it is the only sender of
//! requests. Each TCP connection has a reader thread. Readers of *outbound* connections take
//! responses; readers of *inbound* ones execute requests and answer on the same connection.
//! A reader never sends a request, so no two daemons can block on each other's full sockets.

mod affinity;
mod lane_guard;
mod link;
mod qp;
mod responder;
mod token_timer;
mod trace;
mod ud;

use std::collections::{BinaryHeap, HashMap};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use vrdma_abi::control::MrChunk;
use vrdma_abi::shm::SharedMapping;
use vrdma_abi::verbs::WcStatus;
use vrdma_abi::wire::ConnectReq;
use vrdma_abi::wire::FrameHeader;
use vrdma_core::access::MrBounds;
use vrdma_core::sg::{self, Atomic};

use crate::procmem::{ProcMem, ProcMemError};
use link::Conn;

pub use link::LinkError;
use link::{Link, Parked};
use qp::MedQp;
pub use qp::MedQpSetup;
pub use qp::RecvSideSetup;
pub use ud::UdReceiverSetup;
use ud::{Pumped, UdReceiver, UdSender};

/// Engine failures (setting up; data-path failures become completions).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("binding the host-to-host transport on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("creating the engine's epoll set: {source}")]
    Epoll { source: std::io::Error },
    #[error("setting up mediated QP {qpn}: {reason}")]
    Attach { qpn: u32, reason: String },
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error("peer {addr} refused the connection: {message} (errno {errno})")]
    Refused { addr: SocketAddr, errno: i32, message: String },
}

impl EngineError {
    /// The errno a verb reports for this failure.
    pub fn errno(&self) -> i32 {
        match self {
            EngineError::Refused { errno, .. } => *errno,
            EngineError::Link(_) => libc::EHOSTUNREACH,
            _ => libc::ENOMEM,
        }
    }
}

/// A lane a peer opened to one of our QPs (see `link::serve_lane`).
pub(crate) struct LaneIn {
    /// The lane's licence to carry requests, withdrawn when a newer lane or a (re)connection
    /// (a new PSN sequence) replaces it.
    pub(crate) licence: Arc<AtomicBool>,
    pub(crate) conn: Arc<Conn>,
}

/// A QP's lane, opened before it is attached (see [`Engine::open_lane`]); closed on drop
/// unless [`Engine::attach`] took it.
pub struct Lane {
    conn: Option<Arc<Conn>>,
    client: Option<OwnedFd>,
    /// Its secret (see [`link::open_lane`]).
    key: [u64; 2],
    addr: SocketAddr,
    peer_boot: u64,
}

impl Drop for Lane {
    fn drop(&mut self) {
        if let Some(c) = self.conn.take() {
            c.shutdown();
        }
    }
}

/// Engine settings.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Where the transport listens (port 0: any).
    pub listen: SocketAddr,
    /// This host's name (told to peers).
    pub host: String,
    /// TCP connections per peer host (QPs are spread over them by QPN).
    pub connections_per_host: usize,
    /// A peer silent this long (no data, no heartbeat answer) is declared dead: its QPs go to
    /// ERR and their outstanding WRs flush.
    pub peer_timeout: Duration,
    /// How long the doorbell thread keeps polling after work before sleeping.
    pub spin: Duration,
    /// Whether engine threads move to the CPU their wakeups come from (`affinity`).
    pub follow_cpu: bool,
    /// Whether RC QPs get lanes: a connection of their own to the peer's daemon, shared
    /// with the client library, which then sends small requests itself while the engine
    /// does not need the QP's send side (no engine wakeup per message; see `link::open_lane`).
    /// On by default, where the kernel can confine the sockets clients hold (`lane_guard`);
    /// off, with a warning saying why, where it cannot.
    pub lanes: bool,
}

/// TCP connections per peer host by default (QPs are spread over them by QPN, each with its
/// reader threads).
pub const DEFAULT_CONNECTIONS: usize = 2;

/// The doorbell thread's default polling after work: none on a machine of two CPUs or
/// fewer, 50 µs above. It polls at real-time priority, so on two CPUs it keeps a
/// busy-polling application off a core for the whole spin: measured on a 2-CPU VM, an
/// 8-byte ping-pong through the engine took 54 µs one way with a 50 µs spin, 21–27 µs
/// without (and 1 MiB write_bw went from 1.8–2.4 to 3.5–4.9 GB/s).
pub fn default_spin() -> Duration {
    match std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) {
        0..=2 => Duration::ZERO,
        _ => Duration::from_micros(50),
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            listen: "0.0.0.0:4791".parse().expect("literal"),
            host: "localhost".into(),
            connections_per_host: DEFAULT_CONNECTIONS,
            peer_timeout: Duration::from_secs(5),
            spin: default_spin(),
            follow_cpu: true,
            lanes: true,
        }
    }
}

/// An MR the engine may access, as the registry describes it.
pub struct MrGrant {
    /// Session that registered it.
    pub session: u64,
    /// Its PD.
    pub pd: u32,
    /// Range and access.
    pub bounds: MrBounds,
    /// Its memfd chunks (none for a copied MR).
    pub chunks: Vec<(MrChunk, Arc<OwnedFd>)>,
    /// A copied MR's owner memory (the copying fallback, [`crate::procmem`]).
    pub proc_mem: Option<Arc<ProcMem>>,
}

/// What the engine asks of the daemon's registry (implemented by the daemon; called with no
/// engine lock held).
pub trait Broker: Send + Sync {
    /// A peer daemon (listening at `from`) asks to connect its QP `src_qpn` to our
    /// `dst_qpn`: tenant rules, GID and QP checks. Err: (errno, message).
    fn accept_remote(&self, from: SocketAddr, src_qpn: u32, dst_qpn: u32, req: &ConnectReq) -> Result<(), (i32, String)>;
    /// The MR with `key`, if any.
    fn mr(&self, key: u32) -> Option<MrGrant>;
    /// The peer daemon at `from` says its QP `remote_qpn`, connected to our `local_qpn`, is
    /// gone.
    fn peer_gone(&self, local_qpn: u32, from: SocketAddr, remote_qpn: u32);
    /// May a datagram from the vNIC with `src_gid` (behind the daemon at `from`) reach our
    /// UD QP `dst_qpn` at `dgid`? Err: why not.
    fn accept_ud(&self, from: SocketAddr, src_gid: &[u8; 16], dst_qpn: u32, dgid: &[u8; 16]) -> Result<(), String>;
    /// Our UD QP `qpn`'s receiving side, if it is one.
    fn ud_receiver(&self, qpn: u32) -> Option<UdReceiverSetup>;
}

/// How the engine reaches an MR's bytes.
pub(crate) enum MrMemory {
    /// Its memfds, mapped into vrdmad.
    Mapped(SharedMapping),
    /// Copied through its owner's memory.
    Copied(Arc<ProcMem>),
}

/// An MR as the engine accesses it. Offsets are from the page below its first byte.
pub(crate) struct MappedMr {
    pub(crate) mem: MrMemory,
    pub(crate) span_start: u64,
    pub(crate) bounds: MrBounds,
    pub(crate) session: u64,
    pub(crate) pd: u32,
}

/// Bytes a copied MR moves per step between the socket and its owner's memory.
const COPY_STEP: usize = 256 * 1024;

impl MappedMr {
    /// Reads `buf.len()` bytes at `off`.
    pub(crate) fn read(&self, off: usize, buf: &mut [u8]) -> Result<(), WcStatus> {
        match &self.mem {
            MrMemory::Mapped(m) => m.region().read_into(off, buf).map_err(|_| WcStatus::LocProtErr),
            MrMemory::Copied(p) => p.read(self.span_start + off as u64, buf).map_err(|_| WcStatus::LocProtErr),
        }
    }

    /// Writes `data` at `off`.
    pub(crate) fn write(&self, off: usize, data: &[u8]) -> Result<(), WcStatus> {
        match &self.mem {
            MrMemory::Mapped(m) => m.region().write_from(off, data).map_err(|_| WcStatus::LocProtErr),
            MrMemory::Copied(p) => p.write(self.span_start + off as u64, data).map_err(|_| WcStatus::LocProtErr),
        }
    }

    /// An RDMA atomic on the 8 bytes at `off`.
    pub(crate) fn atomic(&self, off: usize, op: Atomic) -> Result<u64, WcStatus> {
        match &self.mem {
            MrMemory::Mapped(m) => sg::atomic(m.region(), off, op),
            MrMemory::Copied(p) => p.atomic(self.span_start + off as u64, op).map_err(|e| match e {
                ProcMemError::Misaligned { .. } => WcStatus::RemInvReqErr,
                _ => WcStatus::RemAccessErr,
            }),
        }
    }

    /// Sends frame `h` followed by `len` bytes at `off`.
    pub(crate) fn send(&self, c: &Conn, h: &FrameHeader, off: usize, len: usize) -> std::io::Result<()> {
        match &self.mem {
            MrMemory::Mapped(m) => c.send_region(h, m.region(), off, len),
            MrMemory::Copied(p) => c.send_streamed(h, len, COPY_STEP, |at, buf| {
                // The owner unmapped registered memory (breaking the verbs contract): zeros go out.
                if p.read(self.span_start + (off + at) as u64, buf).is_err() {
                    buf.fill(0);
                }
            }),
        }
    }

    /// One non-blocking send of `head` and then `len` bytes at `off` on socket `fd`: the
    /// bytes the socket took (of `head`, then of the MR), 0 when it is full.
    pub(crate) fn try_send(&self, fd: std::os::fd::BorrowedFd<'_>, head: &[u8], off: usize, len: usize) -> std::io::Result<usize> {
        match &self.mem {
            MrMemory::Mapped(m) => m.region().try_send_to_socket(fd, head, off, len),
            MrMemory::Copied(p) => {
                let mut buf = Vec::with_capacity(head.len() + len.min(COPY_STEP));
                buf.extend_from_slice(head);
                let at = buf.len();
                buf.resize(at + len.min(COPY_STEP), 0);
                // The owner unmapped registered memory (breaking the verbs contract): zeros go out.
                if p.read(self.span_start + off as u64, &mut buf[at..]).is_err() {
                    buf[at..].fill(0);
                }
                link::try_send(fd, &buf)
            }
        }
    }

    /// Reads `len` bytes from the socket into `off`. `Ok(false)`: the bytes were consumed but
    /// could not be stored (a copied MR's owner unmapped it).
    pub(crate) fn receive(&self, c: &Conn, off: usize, len: usize) -> std::io::Result<bool> {
        match &self.mem {
            MrMemory::Mapped(m) => c.read_region(m.region(), off, len).map(|()| true),
            MrMemory::Copied(p) => {
                let mut buf = vec![0u8; len.min(COPY_STEP)];
                let (mut at, mut ok) = (0, true);
                while at < len {
                    let n = (len - at).min(COPY_STEP);
                    c.read_exact(&mut buf[..n])?;
                    ok &= p.write(self.span_start + (off + at) as u64, &buf[..n]).is_ok();
                    at += n;
                }
                Ok(ok)
            }
        }
    }
}

/// The engine.
pub struct Engine {
    pub(crate) cfg: EngineConfig,
    pub(crate) boot_id: u64,
    local_addr: RwLock<SocketAddr>,
    pub(crate) broker: RwLock<Option<Weak<dyn Broker>>>,
    links: Mutex<HashMap<SocketAddr, Arc<Link>>>,
    /// Serialises link setup, so concurrent connects to one peer share one link.
    link_setup: Mutex<()>,
    pub(crate) qps: RwLock<HashMap<u32, Arc<MedQp>>>,
    mrs: Mutex<HashMap<u32, Arc<MappedMr>>>,
    epoll: OwnedFd,
    /// Wakes the doorbell thread for timers and new work queued by readers.
    kick: OwnedFd,
    timers: Mutex<BinaryHeap<std::cmp::Reverse<(Instant, u32)>>>,
    pub(crate) connect_waiters: Mutex<HashMap<u64, ConnectWaiter>>,
    next_req: AtomicU64,
    /// Inbound connections by the peer's listening address (so a link failure in either
    /// direction fails the same QPs).
    pub(crate) inbound: Mutex<HashMap<SocketAddr, Vec<Arc<link::Conn>>>>,
    /// Lanes peers opened to our QPs, by (peer's listening address, our QPN, their QPN).
    /// Not among `inbound`: a lane's far end is shared with a client, so nothing is answered
    /// on it.
    pub(crate) lanes_in: Mutex<HashMap<(SocketAddr, u32, u32), LaneIn>>,
    /// Makes our lanes' sockets (lanes are on only with it).
    pub(crate) lane_guard: Option<lane_guard::LaneGuard>,
    /// When each peer daemon (by listening address) was last heard from, on any connection.
    peer_rx: Mutex<HashMap<SocketAddr, Arc<link::PeerRx>>>,
    /// UD QPs that send to other hosts, by QPN.
    ud_senders: RwLock<HashMap<u32, Arc<UdSender>>>,
    /// Senders of destroyed UD QPs whose socket the doorbell thread still has to drain: a
    /// datagram the client wrote has completed (it left the "NIC"), so it is forwarded even
    /// if the QP is destroyed right after, as a NIC does not recall a sent packet.
    ud_closing: Mutex<Vec<Arc<UdSender>>>,
    /// Our non-blocking connections by epoll token (their backlogs are sent on `EPOLLOUT`).
    out_conns: Mutex<HashMap<u64, std::sync::Weak<Conn>>>,
    /// Parked on connections that failed or went, to resume.
    resumed: Mutex<Vec<Parked>>,
    next_conn: AtomicU64,
    /// UD QPs that received from other hosts, by QPN (mapped on the first datagram).
    ud_receivers: Mutex<HashMap<u32, Arc<UdReceiver>>>,
    stopping: AtomicBool,
}

const KICK_TOKEN: u64 = u64::MAX;
/// Doorbell-thread epoll tokens of UD datagram sockets: this bit, and the QPN.
const UD_TOKEN: u64 = 1 << 32;
/// Doorbell-thread epoll tokens of our connections (room for their backlog): this bit, and
/// a number.
const CONN_TOKEN: u64 = 1 << 33;

/// Where the answer to a CONNECT_REQ goes: Ok, or (errno, message).
pub(crate) type ConnectWaiter = std::sync::mpsc::SyncSender<Result<(), (i32, String)>>;

fn eventfd() -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscall; the fd is owned below.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub(crate) use crate::registry::signal_eventfd as write_eventfd;

/// Gives the calling engine thread a low real-time priority, so that when a doorbell or a
/// frame wakes it, it preempts busy-polling applications at once instead of waiting for the
/// scheduler's next tick (milliseconds on a loaded host). The threads sleep whenever there
/// is no work, so they never hold a core; without the privilege this is skipped.
///
/// Threads that follow their work's CPU (`affinity`) share CPUs, and there readers
/// ([`reader_priority`]) rank above the doorbell thread ([`DOORBELL_PRIORITY`]): a frame
/// received while a doorbell thread sends on the reader's CPU (the softirq of a simulated
/// host's send runs in the sender's `sendmsg`) is delivered as soon as the softirq is done,
/// not after the doorbell thread's whole pass (measured: 26–30 µs against 27–42 µs one way
/// for an 8-byte ping-pong between two simulated hosts on 2 CPUs). Unpinned, equal
/// priorities are better: a reader of higher priority woken on a CPU where the doorbell
/// thread runs preempts it there instead of running on the other CPU at once.
pub(crate) fn realtime_thread(priority: i32) {
    let p = libc::sched_param { sched_priority: priority };
    // SAFETY: changes the calling thread's scheduling policy; no memory is involved.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &p) } != 0 {
        log::debug!("engine: no real-time priority: {}", std::io::Error::last_os_error());
    }
}

/// Real-time priority of the doorbell thread.
pub(crate) const DOORBELL_PRIORITY: i32 = 1;
/// Real-time priority of connection readers (see [`realtime_thread`]).
pub(crate) fn reader_priority(follow_cpu: bool) -> i32 {
    if follow_cpu {
        DOORBELL_PRIORITY + 1
    } else {
        DOORBELL_PRIORITY
    }
}

fn drain_eventfd(fd: i32) {
    let mut v: u64 = 0;
    // SAFETY: reading 8 bytes into a live u64 from a non-blocking eventfd.
    unsafe { libc::read(fd, &mut v as *mut u64 as *mut libc::c_void, 8) };
}

impl Engine {
    /// Binds the transport and starts the engine's threads.
    pub fn start(cfg: EngineConfig) -> Result<Arc<Engine>, EngineError> {
        let listener = TcpListener::bind(cfg.listen).map_err(|source| EngineError::Bind { addr: cfg.listen, source })?;
        let mut local_addr = listener.local_addr().map_err(|source| EngineError::Bind { addr: cfg.listen, source })?;
        if local_addr.ip().is_unspecified() {
            local_addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        // SAFETY: plain syscall; the fd is owned below.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(EngineError::Epoll { source: std::io::Error::last_os_error() });
        }
        // SAFETY: a fresh descriptor we own.
        let epoll = unsafe { OwnedFd::from_raw_fd(ep) };
        let kick = eventfd().map_err(|source| EngineError::Epoll { source })?;
        let lane_guard = match cfg.lanes.then(lane_guard::LaneGuard::start) {
            None => None,
            Some(Ok(g)) => Some(g),
            Some(Err(e)) => {
                let why = if e.unsupported() { " (not supported here)" } else { "" };
                log::warn!("mediated engine: lanes off{why}: {e}");
                None
            }
        };
        let e = Arc::new(Engine {
            cfg,
            boot_id: rand::random(),
            local_addr: RwLock::new(local_addr),
            broker: RwLock::new(None),
            links: Mutex::new(HashMap::new()),
            link_setup: Mutex::new(()),
            qps: RwLock::new(HashMap::new()),
            mrs: Mutex::new(HashMap::new()),
            epoll,
            kick,
            timers: Mutex::new(BinaryHeap::new()),
            connect_waiters: Mutex::new(HashMap::new()),
            next_req: AtomicU64::new(1),
            inbound: Mutex::new(HashMap::new()),
            lanes_in: Mutex::new(HashMap::new()),
            lane_guard,
            peer_rx: Mutex::new(HashMap::new()),
            ud_senders: RwLock::new(HashMap::new()),
            ud_closing: Mutex::new(Vec::new()),
            out_conns: Mutex::new(HashMap::new()),
            resumed: Mutex::new(Vec::new()),
            next_conn: AtomicU64::new(1),
            ud_receivers: Mutex::new(HashMap::new()),
            stopping: AtomicBool::new(false),
        });
        e.epoll_add(e.kick.as_raw_fd(), KICK_TOKEN).map_err(|source| EngineError::Epoll { source })?;
        let me = e.clone();
        std::thread::Builder::new().name("engine-accept".into()).spawn(move || link::accept_loop(me, listener)).expect("spawn");
        let me = Arc::downgrade(&e);
        std::thread::Builder::new().name("engine-doorbell".into()).spawn(move || doorbell_loop(me)).expect("spawn");
        log::info!("mediated engine: host-to-host transport on {local_addr}");
        if e.lane_guard.is_some() {
            log::info!("mediated engine: lanes on (their sockets confined to their peer daemon)");
        } else if !e.cfg.lanes {
            log::info!("mediated engine: lanes off (configured)");
        }
        Ok(e)
    }

    /// Where this engine's transport listens (as peers on this host reach it).
    pub fn local_addr(&self) -> SocketAddr {
        *self.local_addr.read()
    }

    /// Sets the address peers reach this engine at (the underlay address and bound port),
    /// which identifies it in HELLO.
    pub fn set_advertised(&self, addr: SocketAddr) {
        *self.local_addr.write() = addr;
    }

    /// Connects the daemon (called once, after start).
    pub fn set_broker(&self, b: Weak<dyn Broker>) {
        *self.broker.write() = Some(b);
    }

    pub(crate) fn broker(&self) -> Option<Arc<dyn Broker>> {
        self.broker.read().as_ref().and_then(Weak::upgrade)
    }

    fn epoll_add(&self, fd: i32, token: u64) -> std::io::Result<()> {
        self.epoll_add_events(fd, token, libc::EPOLLIN as u32)
    }

    fn epoll_add_events(&self, fd: i32, token: u64, events: u32) -> std::io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: valid epoll fd and event struct.
        if unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    fn epoll_del(&self, fd: i32) {
        // SAFETY: valid epoll fd; a stale fd only makes the call fail.
        unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
    }

    /// The liveness record of the peer daemon at `addr`, shared by all its connections' readers.
    pub(crate) fn peer_rx(&self, addr: SocketAddr) -> Arc<link::PeerRx> {
        self.peer_rx.lock().entry(addr).or_insert_with(|| Arc::new(link::PeerRx::new())).clone()
    }

    /// Where a new non-blocking connection asks for room: our epoll, a fresh token.
    pub(crate) fn conn_hook(self: &Arc<Self>) -> link::Hook {
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff;
        link::Hook { epfd: self.epoll.as_raw_fd(), token: CONN_TOKEN | id, resume: Arc::downgrade(self) }
    }

    /// Records a non-blocking connection under its token.
    pub(crate) fn register_conn(&self, c: &Arc<Conn>, token: u64) {
        let mut m = self.out_conns.lock();
        m.retain(|_, w| w.strong_count() > 0);
        m.insert(token, Arc::downgrade(c));
    }

    /// What was parked on a connection that failed or went: the doorbell thread resumes it.
    pub(crate) fn resume_parked(&self, parked: Vec<Parked>) {
        if !parked.is_empty() {
            self.resumed.lock().extend(parked);
            self.kick();
        }
    }

    /// Resumes what was parked (a QP is pumped, a UD socket read again).
    fn resume(&self, parked: impl IntoIterator<Item = Parked>, active: &mut Vec<Arc<MedQp>>) {
        for p in parked {
            match p {
                Parked::Qp(qpn) => active.extend(self.qps.read().get(&qpn).cloned()),
                Parked::Ud(qpn) => {
                    if let Some(s) = self.ud_senders.read().get(&qpn) {
                        // Level-triggered: reported at once if datagrams wait.
                        let _ = self.epoll_add(s.socket.as_raw_fd(), UD_TOKEN | u64::from(qpn));
                    }
                }
            }
        }
    }

    /// Wakes the doorbell thread (new timers, work made possible by a response).
    pub(crate) fn kick(&self) {
        write_eventfd(&self.kick);
    }

    pub(crate) fn add_timer(&self, at: Instant, qpn: u32) {
        self.timers.lock().push(std::cmp::Reverse((at, qpn)));
        self.kick();
    }

    /// The link to the daemon at `addr`, connecting if needed.
    pub(crate) fn link(self: &Arc<Self>, addr: SocketAddr) -> Result<Arc<Link>, LinkError> {
        if let Some(l) = self.existing_link(addr) {
            return Ok(l);
        }
        let _setup = self.link_setup.lock();
        if let Some(l) = self.existing_link(addr) {
            return Ok(l);
        }
        let l = Link::connect(self, addr)?;
        self.links.lock().insert(addr, l.clone());
        Ok(l)
    }

    pub(crate) fn existing_link(&self, addr: SocketAddr) -> Option<Arc<Link>> {
        self.links.lock().get(&addr).filter(|l| l.is_alive()).cloned()
    }

    /// Broker across daemons: asks the daemon at `addr` to accept our QP `src_qpn` as the
    /// peer of its `dst_qpn`. Blocks (the caller holds no registry lock) for at most the
    /// peer timeout.
    pub fn connect_remote(self: &Arc<Self>, addr: SocketAddr, src_qpn: u32, dst_qpn: u32, req: &ConnectReq) -> Result<(), EngineError> {
        let link = self.link(addr)?;
        let id = self.next_req.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.connect_waiters.lock().insert(id, tx);
        let sent = link.send_connect(id, src_qpn, dst_qpn, req);
        let r = match sent {
            Ok(()) => rx.recv_timeout(self.cfg.peer_timeout).unwrap_or_else(|_| Err((libc::ETIMEDOUT, format!("no answer from {addr}")))),
            Err(e) => Err((libc::EHOSTUNREACH, e.to_string())),
        };
        self.connect_waiters.lock().remove(&id);
        r.map_err(|(errno, message)| EngineError::Refused { addr, errno, message })
    }

    /// Opens the lane of our QP `src_qpn` to the peer daemon's QP `dst_qpn` (see
    /// [`link::open_lane`]), if lanes are on; none if the peer refuses it (a peer without
    /// lanes) or it cannot be opened: the QP then goes without. Fails only if the peer
    /// cannot be reached at all. Blocks for a connection and a HELLO: callers hold no
    /// registry lock.
    pub fn open_lane(self: &Arc<Self>, addr: SocketAddr, src_qpn: u32, dst_qpn: u32) -> Result<Option<Lane>, EngineError> {
        if self.lane_guard.is_none() {
            return Ok(None);
        }
        let link = self.link(addr)?;
        match link::open_lane(self, addr, link.peer_boot, src_qpn, dst_qpn) {
            Ok((conn, client, key)) => Ok(Some(Lane { conn: Some(conn), client: Some(client), key, addr, peer_boot: link.peer_boot })),
            Err(err) => {
                // (A peer without lanes refuses them.) The QP works without one: its
                // requests take the engine's connections.
                log::warn!("engine: QP {src_qpn}: no lane to QP {dst_qpn} at {addr} ({err}): its WRs go through the engine");
                Ok(None)
            }
        }
    }

    /// Starts executing QP `setup.qpn`'s sends; returns the channel memfd and the doorbell
    /// eventfd for the client, and with a lane (from [`Engine::open_lane`] for this QP) the
    /// client's end of it.
    #[allow(clippy::type_complexity)]
    pub fn attach(
        self: &Arc<Self>,
        setup: MedQpSetup,
        mut lane: Option<Lane>,
    ) -> Result<(Arc<OwnedFd>, Arc<OwnedFd>, Option<Arc<OwnedFd>>, vrdma_abi::ring::MediatedLayout), EngineError> {
        let qpn = setup.qpn;
        let attach_err = |reason: String| EngineError::Attach { qpn, reason };
        // Make sure the link exists now, so a dead peer fails modify_qp rather than the first WR.
        let link = self.link(setup.remote)?;
        // (A lane to another peer, or to an earlier incarnation of this one, is dropped: closed.)
        let lane = lane.as_mut().filter(|l| l.addr == setup.remote && l.peer_boot == link.peer_boot);
        let (conn, client_lane, lane_key) = match lane.and_then(|l| Some((l.conn.take()?, l.client.take()?, l.key))) {
            Some((c, fd, key)) => (c, Some(Arc::new(fd)), Some(key)),
            None => (link.conn_for(qpn), None, None),
        };
        let lane = client_lane.is_some();
        // On failure below, the lane (if any) must close, or its watcher would wait for good.
        let closing = lane.then(|| conn.clone());
        let attach_err = |reason: String| {
            if let Some(c) = &closing {
                c.shutdown();
            }
            attach_err(reason)
        };
        let doorbell = Arc::new(eventfd().map_err(|e| attach_err(e.to_string()))?);
        let (q, chan_fd, layout) = MedQp::new(setup, doorbell.clone(), conn, lane_key, link.peer_boot).map_err(attach_err)?;
        // Edge-triggered: every ring (an eventfd write) is one event, and the doorbell thread
        // never reads the counter, a system call less per doorbell on the latency path (the
        // counter cannot fill: 2^64 - 2 rings).
        self.epoll_add_events(doorbell.as_raw_fd(), u64::from(qpn), (libc::EPOLLIN | libc::EPOLLET) as u32)
            .map_err(|e| attach_err(e.to_string()))?;
        if let Some(old) = self.qps.write().insert(qpn, q) {
            self.epoll_del(old.doorbell.as_raw_fd());
            old.close_lane();
        }
        Ok((chan_fd, doorbell, client_lane, layout))
    }

    /// The lane of our QP `qpn` failed (the peer daemon closed it, a protocol error, or the
    /// whole peer went silent): that QP, and only it, goes to ERR and flushes (if `c` is
    /// still its lane).
    pub(crate) fn lane_failed(&self, qpn: u32, c: &Arc<Conn>, why: &str) {
        let q = self.qps.read().get(&qpn).filter(|q| q.uses_conn(c)).cloned();
        if let Some(q) = q.filter(|q| !q.is_link_down() && !q.detached.load(Ordering::Acquire)) {
            log::warn!("engine: QP {qpn}: lane to {}: {why}; QP to ERR", c.peer);
            q.link_failed();
            self.kick_qp(&q);
        }
    }

    /// Stops executing QP `qpn` (destroyed, reset or its client gone).
    pub fn detach(&self, qpn: u32) {
        if let Some(q) = self.qps.write().remove(&qpn) {
            self.epoll_del(q.doorbell.as_raw_fd());
            q.detached.store(true, Ordering::Release);
            // The client's end stops carrying anything to the peer.
            q.close_lane();
            let tokens = q.tokens_applied.load(Ordering::Relaxed);
            if tokens > 0 {
                log::info!("engine: QP {qpn}: {tokens} ACK tokens acknowledged its requests");
            }
            // A deferred ACK still owed is sent by the connection's reader before it next waits.
        }
    }

    /// UD QP `qpn` (of the vNIC with `src_gid`) sends to the vNIC with `dgid`, whose daemon
    /// is at `addr`. Connects the link now, so the datagrams find it. The QP's first route
    /// creates its datagram socket: the client's end is returned then, `None` later.
    pub fn add_ud_route(
        self: &Arc<Self>,
        qpn: u32,
        src_gid: [u8; 16],
        dgid: [u8; 16],
        addr: SocketAddr,
    ) -> Result<Option<OwnedFd>, EngineError> {
        self.link(addr)?;
        let attach_err = |e: std::io::Error| EngineError::Attach { qpn, reason: e.to_string() };
        let mut created = None;
        let sender = {
            let mut senders = self.ud_senders.write();
            match senders.get(&qpn) {
                Some(s) => s.clone(),
                None => {
                    let (client, socket) = ud::seqpacket_pair().map_err(attach_err)?;
                    let s = Arc::new(UdSender::new(qpn, src_gid, socket));
                    self.epoll_add(s.socket.as_raw_fd(), UD_TOKEN | u64::from(qpn)).map_err(attach_err)?;
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
        if let Some(s) = self.ud_senders.write().remove(&qpn) {
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

    /// Our QP `local_qpn`, connected to `remote_qpn` at `addr`, is gone: tell that daemon.
    pub fn send_peer_gone(self: &Arc<Self>, addr: SocketAddr, remote_qpn: u32, local_qpn: u32) {
        if let Some(l) = self.existing_link(addr) {
            let _ = l.send_peer_gone(remote_qpn, local_qpn);
        }
    }

    /// Our QP `local_qpn`'s peer, QP `remote_qpn` at `from`, is gone (PEER_GONE): later
    /// sends fail like a NIC's retries. A notice naming a QP ours is not connected to (a
    /// stale or forged one) changes nothing.
    pub fn mark_peer_gone(&self, local_qpn: u32, from: SocketAddr, remote_qpn: u32) {
        if let Some(q) = self.qps.read().get(&local_qpn).filter(|q| q.remote == from && q.remote_qpn == remote_qpn) {
            q.peer_gone.store(true, Ordering::Release);
            q.want_send_side();
            // WRs already sent wait out their retries from now on.
            self.kick_qp(q);
        }
    }

    /// A peer (re)connected to our QP `qpn`: its requests start again at PSN 0.
    pub(crate) fn reset_responder(&self, qpn: u32) {
        let q = self.qps.read().get(&qpn).cloned();
        // Under the QP's responder lock, which a lane's request holds while it checks its
        // licence: an old lane's request runs before the reset or not at all.
        let rs = q.as_ref().map(|q| q.resp.lock());
        self.lanes_in.lock().retain(|&(_, n, _), lane| {
            if n == qpn {
                lane.licence.store(false, Ordering::Release);
            }
            n != qpn
        });
        drop(rs);
        if let Some(q) = q {
            let mut rs = q.resp.lock();
            rs.expected_psn = 0;
            rs.dead = false;
            rs.unacked = 0;
            rs.unacked_bytes = 0;
            q.clear_owed_ack();
            MedQp::acked_by_us(&mut rs);
        }
    }

    /// The MR `key` changed or went away: drop the mapping.
    pub fn forget_mr(&self, key: u32) {
        self.mrs.lock().remove(&key);
    }

    /// The mapping of MR `key` if it belongs to `session`'s `pd`.
    pub(crate) fn mr(&self, key: u32, session: u64, pd: u32) -> Option<Arc<MappedMr>> {
        let cached = self.mrs.lock().get(&key).cloned();
        let m = match cached {
            Some(m) => m,
            None => {
                let g = self.broker()?.mr(key)?;
                let m = Arc::new(map_mr(g)?);
                self.mrs.lock().insert(key, m.clone());
                m
            }
        };
        (m.session == session && m.pd == pd).then_some(m)
    }

    /// Every QP whose peer is the daemon at `addr` (that incarnation of it) goes to ERR and
    /// flushes (link failed).
    pub(crate) fn fail_peer(&self, addr: SocketAddr, peer_boot: u64, why: &str) {
        let removed = {
            let mut links = self.links.lock();
            match links.get(&addr) {
                Some(l) if !l.is_alive() => links.remove(&addr),
                _ => None,
            }
        };
        if let Some(l) = removed {
            l.shutdown();
        }
        let inbound = self.inbound.lock().remove(&addr).unwrap_or_default();
        for c in inbound {
            c.shutdown();
        }
        // (Their serving threads end, and drop their entries.)
        for (_, lane) in self.lanes_in.lock().iter().filter(|((a, _, _), _)| *a == addr) {
            lane.conn.shutdown();
        }
        let victims: Vec<Arc<MedQp>> =
            self.qps.read().values().filter(|q| q.remote == addr && q.peer_boot == peer_boot && !q.is_link_down()).cloned().collect();
        if !victims.is_empty() {
            log::warn!("peer daemon {addr}: {why}; {} QP(s) to ERR", victims.len());
        }
        for q in victims {
            q.link_failed();
            q.close_lane();
            self.kick_qp(&q);
        }
    }

    pub(crate) fn kick_qp(&self, q: &MedQp) {
        write_eventfd(&q.doorbell);
    }

    /// Stops background threads (tests).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        // (Their watchers wait for nothing else.)
        for q in self.qps.read().values() {
            q.close_lane();
        }
        // The readers of peers' connections and lanes end with their sockets (and, stopping,
        // fail nobody).
        for l in self.links.lock().values() {
            l.shutdown();
        }
        for c in self.inbound.lock().values().flatten() {
            c.shutdown();
        }
        for lane in self.lanes_in.lock().values() {
            lane.licence.store(false, Ordering::Release);
            lane.conn.shutdown();
        }
        self.kick();
    }
}

fn map_mr(g: MrGrant) -> Option<MappedMr> {
    let page = vrdma_abi::ring::PAGE as u64;
    let span_start = g.bounds.addr & !(page - 1);
    let span_len = g.bounds.addr.checked_add(g.bounds.length)?.div_ceil(page) * page - span_start;
    let mem = match g.proc_mem {
        Some(p) => MrMemory::Copied(p),
        None => {
            let mapping = SharedMapping::reserve(span_len as usize).ok()?;
            for (c, fd) in &g.chunks {
                mapping.place_fd(c.mr_offset as usize, std::os::fd::AsFd::as_fd(&**fd), c.fd_offset as usize, c.len as usize, true).ok()?;
            }
            MrMemory::Mapped(mapping)
        }
    };
    Some(MappedMr { mem, span_start, bounds: g.bounds, session: g.session, pd: g.pd })
}

/// The doorbell thread: sleeps until a client rings, a timer is due or a reader kicks; runs
/// the QPs' send sides; spins for `cfg.spin` after work so back-to-back posts need no wakeup.
fn doorbell_loop(engine: Weak<Engine>) {
    realtime_thread(DOORBELL_PRIORITY);
    let mut follower = affinity::CpuFollower::new(engine.upgrade().is_some_and(|e| e.cfg.follow_cpu));
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 64];
    let mut last_heartbeat = Instant::now();
    let mut active: Vec<Arc<MedQp>> = Vec::new();
    let (mut ud_msg, mut ud_frame) = (Vec::new(), Vec::new());
    loop {
        let Some(e) = engine.upgrade() else { return };
        if e.stopping.load(Ordering::Acquire) {
            return;
        }
        let hb_every = e.cfg.peer_timeout / 4;
        let now = Instant::now();
        let next_timer = e.timers.lock().peek().map(|r| r.0 .0);
        // epoll counts whole milliseconds. The heartbeat needs no precision: rounded up, or
        // the last fraction of a millisecond before each one would be a busy loop of zero
        // timeouts on an idle daemon. A due timer (RNR waits, as short as 10 µs) is rounded
        // down: polled until due, as its precision is the QP's.
        let mut wait_ms = hb_every.saturating_sub(now.duration_since(last_heartbeat)).as_micros().div_ceil(1000);
        if let Some(t) = next_timer {
            wait_ms = wait_ms.min(t.saturating_duration_since(now).as_millis());
        }
        let epfd = e.epoll.as_raw_fd();
        drop(e);
        trace::record(trace::Stage::DoorbellSleep, 0, 0);
        // SAFETY: valid epoll fd and a buffer of `events.len()` entries.
        let n = unsafe { libc::epoll_wait(epfd, events.as_mut_ptr(), events.len() as i32, wait_ms.min(i32::MAX as u128) as i32) };
        trace::record(trace::Stage::DoorbellWake, n.max(0) as u32, 0);
        let Some(e) = engine.upgrade() else { return };
        active.clear();
        // Whatever asks for a pass other than a doorbell (resumed or closing senders, QPs
        // wanting a pump) kicks: without a kick those lists are not even looked at, so a
        // doorbell's way to the wire does not scan every QP of the host.
        let mut kicked = false;
        for ev in events.iter().take(n.max(0) as usize) {
            let token = ev.u64;
            if token == KICK_TOKEN {
                drain_eventfd(e.kick.as_raw_fd());
                kicked = true;
                continue;
            }
            if token & CONN_TOKEN != 0 {
                let conn = e.out_conns.lock().get(&token).and_then(std::sync::Weak::upgrade);
                if let Some(c) = conn {
                    e.resume(c.on_writable(), &mut active);
                }
                continue;
            }
            if token & UD_TOKEN != 0 {
                let sender = e.ud_senders.read().get(&(token as u32)).cloned();
                if let Some(s) = sender {
                    // Closed: nothing more will come. Parked: not read again (its datagrams
                    // wait) until the connection has room; out of the set, not just muted, as
                    // epoll would still report a hang-up.
                    if matches!(s.pump(&e, &mut ud_msg, &mut ud_frame), Pumped::Closed | Pumped::Parked) {
                        e.epoll_del(s.socket.as_raw_fd());
                    }
                }
                continue;
            }
            if let Some(q) = e.qps.read().get(&(token as u32)) {
                // (Edge-triggered: nothing to read.)
                active.push(q.clone());
            }
        }
        // Rung by a client: move to its CPU if it keeps ringing from there.
        if let Some(q) = active.first() {
            follower.woken_from(|| q.ringer_cpu());
        }
        if kicked {
            // Parked on connections that failed or went.
            let resumed = std::mem::take(&mut *e.resumed.lock());
            e.resume(resumed, &mut active);
            // Destroyed UD QPs: forward what they sent before going.
            let closing = std::mem::take(&mut *e.ud_closing.lock());
            for s in closing {
                s.drain(&e, &mut ud_msg, &mut ud_frame);
            }
        }
        // Due timers (RNR waits, not-ready retries).
        let now = Instant::now();
        loop {
            let due = {
                let mut t = e.timers.lock();
                match t.peek() {
                    Some(r) if r.0 .0 <= now => t.pop().map(|r| r.0 .1),
                    _ => None,
                }
            };
            let Some(qpn) = due else { break };
            if let Some(q) = e.qps.read().get(&qpn) {
                active.push(q.clone());
            }
        }
        // Responses may have freed room in every QP that had work: readers kick us for those.
        if kicked {
            for q in e.qps.read().values() {
                if q.wants_pump.swap(false, Ordering::AcqRel) {
                    active.push(q.clone());
                }
            }
        }
        if !active.is_empty() {
            // (No clock reads when there is no spin, as on two CPUs: one pass, then again
            // only while there is more.)
            let spin = !e.cfg.spin.is_zero();
            let spin_until = if spin { Instant::now() + e.cfg.spin } else { now };
            loop {
                let mut more = false;
                for q in &active {
                    q.pump(&e);
                    more |= q.has_work();
                }
                if !more && (!spin || Instant::now() >= spin_until) {
                    break;
                }
                if !more {
                    std::hint::spin_loop();
                }
                if more && (!spin || Instant::now() >= spin_until + e.cfg.spin * 4) {
                    // Still busy (e.g. stalled on completions): let the sleeper logic decide.
                    break;
                }
            }
            for q in &active {
                // A parked QP needs no doorbells (each would be a wakeup for nothing): it is
                // pumped, and then asks again, once its connection has room.
                if !q.is_parked() {
                    q.want_doorbell();
                }
                if q.has_work() {
                    e.kick_qp(q);
                }
            }
        }
        if last_heartbeat.elapsed() >= hb_every {
            last_heartbeat = Instant::now();
            let links: Vec<Arc<Link>> = e.links.lock().values().cloned().collect();
            for l in links {
                if let Err(err) = l.heartbeat(e.cfg.peer_timeout) {
                    e.fail_peer(l.addr, l.peer_boot, &err);
                }
            }
        }
    }
}
