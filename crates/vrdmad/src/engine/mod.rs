//! The mediated data-path engine: vrdmad executes the send WRs of QPs whose
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
//!
//! Layout: `config` and `broker` (what the daemon gives and asks), `mr` (MRs as the engine
//! reaches them), `doorbell` and `priority` (the doorbell thread), `peers` (links, the
//! connection broker across daemons, failure), `link` (our connections to a peer and their
//! readers), `accept` (peers' connections to us), `handshake` (HELLO), `connection` (one TCP
//! connection: backlog, read-ahead, socket calls), `qp` (a mediated QP: ring views,
//! requester, completions, responses, the responder's state), `responder` (requests
//! executed), `lane` (a QP's own connection shared with its client, ACK tokens, the socket
//! guard), `ud` (UD across hosts), `qos` (caps and fair shares of the host's egress), `reader`
//! (why readers end), `affinity` and `trace`.

mod accept;
mod affinity;
mod broker;
mod config;
mod connection;
mod doorbell;
mod handshake;
mod lane;
mod link;
mod mr;
mod peer_tls;
mod peers;
mod priority;
mod qos;
mod qp;
mod reader;
mod responder;
mod testing;
mod trace;
mod ud;

use std::collections::{BinaryHeap, HashMap};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::{Mutex, RwLock};
use vrdma_abi::fd::{new_eventfd, signal_eventfd};

use connection::{Conn, Parked, PeerRx};
use lane::LaneIn;
use link::Link;
use mr::MappedMr;
use qp::MedQp;
use ud::{UdReceiver, UdSender};

pub(crate) use broker::ConnectWaiter;
pub use broker::{Broker, MrGrant, Refusal};
pub use config::{default_spin, EngineConfig, DEFAULT_CONNECTIONS};
pub use connection::fuzz_sealed_reader;
pub use connection::seal::{fuzz_sealed_stream, FrameKeys, Opener, SealError, Sealer, KEY_LEN, RECORD_MAX, RECORD_OVERHEAD};
pub use handshake::fuzz_first_frame;
pub use lane::Lane;
pub use link::LinkError;
pub use peer_tls::{peer_tls_for, PeerCert, PeerTls, PeerTlsError};
pub use qp::{AttachError, MedQpSetup, RecvSideSetup};
pub use responder::{fuzz_responder, responder_seeds};
pub use ud::UdReceiverSetup;

/// Engine failures (setting up; data-path failures become completions).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The engine's TCP listener could not be bound.
    #[error("binding the host-to-host transport on {addr}: {source}")]
    Bind {
        /// The listen address configured.
        addr: SocketAddr,
        /// The `bind` or `listen` error.
        source: std::io::Error,
    },
    /// The engine's epoll set could not be created.
    #[error("creating the engine's epoll set: {source}")]
    Epoll {
        /// The `epoll_create1` error.
        source: std::io::Error,
    },
    /// A QP's mediated channel (rings, doorbell, lane) could not be set up.
    #[error("setting up mediated QP {qpn}: {source}")]
    Attach {
        /// The QP.
        qpn: u32,
        /// What failed.
        source: qp::AttachError,
    },
    /// An engine thread could not be started.
    #[error("starting thread {name}: {source}")]
    Thread {
        /// The thread's name.
        name: &'static str,
        /// The spawn error.
        source: std::io::Error,
    },
    /// The link to the peer daemon failed.
    #[error(transparent)]
    Link(#[from] LinkError),
    /// The peer daemon refused the remote connect (no such QP, tenant rules…).
    #[error("peer {addr} refused the connection: {message} (errno {errno})")]
    Refused {
        /// The peer daemon's engine address.
        addr: SocketAddr,
        /// The errno it returned, which the verb returns.
        errno: i32,
        /// Its explanation.
        message: String,
    },
}

impl EngineError {
    /// The errno a verb reports for this failure.
    pub fn errno(&self) -> i32 {
        match self {
            EngineError::Refused { errno, .. } => *errno,
            EngineError::Thread { .. } | EngineError::Link(LinkError::Thread { .. }) => libc::EAGAIN,
            EngineError::Link(_) => libc::EHOSTUNREACH,
            _ => libc::ENOMEM,
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
    /// The MRs the registry lets the engine reach, kept current by it ([`Engine::offer_mr`],
    /// [`Engine::forget_mr`]). Not asked of the registry when needed: the doorbell thread
    /// needs an MR while it holds the scheduler's lock, and the registry's session threads
    /// take that lock (attaching and detaching QPs) while they hold the registry's.
    grants: Mutex<HashMap<u32, MrGrant>>,
    epoll: OwnedFd,
    /// Wakes the doorbell thread for timers and new work queued by readers.
    kick: OwnedFd,
    timers: Mutex<BinaryHeap<std::cmp::Reverse<(Instant, u32)>>>,
    pub(crate) connect_waiters: Mutex<HashMap<u64, ConnectWaiter>>,
    next_req: AtomicU64,
    /// Inbound connections by the peer's listening address (so a link failure in either
    /// direction fails the same QPs).
    pub(crate) inbound: Mutex<HashMap<SocketAddr, Vec<accept::Inbound>>>,
    /// Lanes peers opened to our QPs, by (peer's listening address, our QPN, their QPN).
    /// Not among `inbound`: a lane's far end is shared with a client, so nothing is answered
    /// on it.
    pub(crate) lanes_in: Mutex<HashMap<(SocketAddr, u32, u32), LaneIn>>,
    /// Makes our lanes' sockets (lanes are on only with it).
    pub(crate) lane_guard: Option<lane::guard::LaneGuard>,
    /// The contention watcher, unparked when a lane QP attaches (it sleeps while none is).
    pub(crate) contention_watcher: std::sync::OnceLock<std::thread::Thread>,
    /// When each peer daemon (by listening address) was last heard from, on any connection.
    peer_rx: Mutex<HashMap<SocketAddr, Arc<PeerRx>>>,
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
    /// Threads that could not be started (each dropped the connection or request it was for).
    thread_failures: AtomicU64,
    /// Peers refused at their first frame (`handshake::check_peer`).
    refused_peers: AtomicU64,
    /// Sealed records refused (altered, injected, replayed: `connection::seal`), each of
    /// which ended its connection.
    pub(crate) refused_frames: Arc<AtomicU64>,
    /// Frames of an authenticated peer refused for claiming what it does not serve
    /// (`Engine::refuse_claim`).
    refused_claims: AtomicU64,
    /// The egress scheduler: caps and fair shares of this host's vNICs (`qos`).
    qos: Mutex<qos::Scheduler>,
    /// When the engine started (the scheduler's clock counts from it).
    started: Instant,
    /// The scheduler left QPs waiting for room on the wire (acknowledgements kick).
    wire_waiting: AtomicBool,
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
        let kick = new_eventfd().map_err(|source| EngineError::Epoll { source })?;
        let lane_guard = match cfg.lanes.then(lane::guard::LaneGuard::start) {
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
            grants: Mutex::new(HashMap::new()),
            epoll,
            kick,
            timers: Mutex::new(BinaryHeap::new()),
            connect_waiters: Mutex::new(HashMap::new()),
            next_req: AtomicU64::new(1),
            inbound: Mutex::new(HashMap::new()),
            lanes_in: Mutex::new(HashMap::new()),
            lane_guard,
            contention_watcher: std::sync::OnceLock::new(),
            peer_rx: Mutex::new(HashMap::new()),
            ud_senders: RwLock::new(HashMap::new()),
            ud_closing: Mutex::new(Vec::new()),
            out_conns: Mutex::new(HashMap::new()),
            resumed: Mutex::new(Vec::new()),
            next_conn: AtomicU64::new(1),
            ud_receivers: Mutex::new(HashMap::new()),
            stopping: AtomicBool::new(false),
            thread_failures: AtomicU64::new(0),
            refused_peers: AtomicU64::new(0),
            refused_frames: Arc::new(AtomicU64::new(0)),
            refused_claims: AtomicU64::new(0),
            qos: Mutex::new(qos::Scheduler::default()),
            started: Instant::now(),
            wire_waiting: AtomicBool::new(false),
        });
        e.epoll_add(e.kick.as_raw_fd(), doorbell::KICK_TOKEN).map_err(|source| EngineError::Epoll { source })?;
        let me = e.clone();
        let spawned = std::thread::Builder::new().name("engine-accept".into()).spawn(move || accept::accept_loop(me, listener));
        spawned.map_err(|source| EngineError::Thread { name: "engine-accept", source })?;
        let me = Arc::downgrade(&e);
        let spawned = std::thread::Builder::new().name("engine-doorbell".into()).spawn(move || doorbell::doorbell_loop(me));
        if let Err(source) = spawned {
            // (The accept thread ends at its next connection, finding the engine gone.)
            e.stop();
            return Err(EngineError::Thread { name: "engine-doorbell", source });
        }
        if e.lane_guard.is_some() {
            // Fair sharing for lanes (`qos::contention`); without it, only lanes are unfair.
            let me = Arc::downgrade(&e);
            let spawned = std::thread::Builder::new().name("engine-lanes-qos".into()).spawn(move || qos::contention::watch_contention(me));
            match spawned {
                Ok(h) => {
                    let _ = e.contention_watcher.set(h.thread().clone());
                }
                Err(err) => e.thread_failed("engine-lanes-qos", &err),
            }
        }
        log::info!("mediated engine: host-to-host transport on {local_addr}");
        if e.lane_guard.is_some() {
            log::info!("mediated engine: lanes on (their sockets confined to their peer daemon)");
        } else if !e.cfg.lanes {
            log::info!("mediated engine: lanes off (configured)");
        }
        Ok(e)
    }

    /// What the engine counted for mediated QP `qpn` (None if it does not mediate it).
    pub fn meter_of(&self, qpn: u32) -> Option<vrdma_abi::ring::MeterWords> {
        self.qps.read().get(&qpn).map(|q| q.meter.read())
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

    /// Wakes the doorbell thread (new timers, work made possible by a response).
    pub(crate) fn kick(&self) {
        signal_eventfd(&self.kick);
    }

    pub(crate) fn add_timer(&self, at: Instant, qpn: u32) {
        self.timers.lock().push(std::cmp::Reverse((at, qpn)));
        self.kick();
    }

    pub(crate) fn kick_qp(&self, q: &MedQp) {
        signal_eventfd(&q.doorbell);
    }

    /// A thread could not be started: the connection or request it was for is dropped, and the
    /// failure logged and counted ([`Engine::thread_failures`]).
    pub(crate) fn thread_failed(&self, name: &str, err: &std::io::Error) {
        let n = self.thread_failures.fetch_add(1, Ordering::Relaxed) + 1;
        log::warn!("engine: starting thread {name}: {err} ({n} such failures so far)");
    }

    /// How many engine threads could not be started since the engine began.
    pub fn thread_failures(&self) -> u64 {
        self.thread_failures.load(Ordering::Relaxed)
    }

    /// Connections refused at their first frame since the engine began: a peer claiming an
    /// address other than its own, or a host the cluster view has elsewhere.
    pub fn refused_peers(&self) -> u64 {
        self.refused_peers.load(Ordering::Relaxed)
    }

    /// Sealed records refused since the engine began (altered, injected, replayed or
    /// reordered on the way; each ended its connection).
    pub fn refused_frames(&self) -> u64 {
        self.refused_frames.load(Ordering::Relaxed)
    }

    /// Frames refused since the engine began because the authenticated peer that sent them
    /// claimed a QP, lane or datagram source it does not serve (PEER_GONE or a request for a
    /// QP paired with another, a LANE for such a QP, a datagram whose source it does not
    /// serve). Connection requests are counted on their vNIC (`refused_connections`).
    pub fn refused_claims(&self) -> u64 {
        self.refused_claims.load(Ordering::Relaxed)
    }

    /// A frame from the peer daemon at `from` claimed what it does not serve (`what`):
    /// counted, and logged (every one up to 64, then at powers of two).
    pub(crate) fn refuse_claim(&self, from: SocketAddr, what: std::fmt::Arguments<'_>) {
        let n = self.refused_claims.fetch_add(1, Ordering::Relaxed) + 1;
        if n <= 64 || n.is_power_of_two() {
            log::warn!("engine: refused from peer {from}: {what} ({n} refused so far)");
        }
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
            c.conn.shutdown();
        }
        for lane in self.lanes_in.lock().values() {
            lane.licence.store(false, Ordering::Release);
            lane.conn.shutdown();
        }
        self.kick();
    }
}
