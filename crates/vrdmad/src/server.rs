//! The daemon: its configuration, the store and the vNICs it serves (`clients` has the
//! sockets and session threads).

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use vrdma_abi::channel::{self, Channel, ChannelError};
use vrdma_abi::control::{Limits, Qos, Reply, Request};

use crate::engine::{Broker, Engine, EngineConfig, EngineError, Refusal};
use crate::registry::{Registry, RemoteConnect, RemoteUd, ReplyFds, RequestError};
use crate::routes::Routes;
use crate::store::{self, HostRecord, RuleRecord, Store, StoreConfig, StoreError, StoreEvent, TenantRecord, VnicRecord, WatchHandle};
use vrdma_abi::wire::ConnectReq;

mod clients;
mod qos_watch;

/// Daemon failures.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A run or state directory could not be created.
    #[error("creating directory {path}: {source}")]
    Dir {
        /// The directory.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A vNIC's control socket could not be bound.
    #[error("listening on {path}: {source}")]
    Listen {
        /// The socket's path.
        path: String,
        /// Why.
        source: ChannelError,
    },
    /// The admin socket could not be bound.
    #[error("admin socket {path}: {source}")]
    Admin {
        /// The socket's path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The control store failed.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// A vNIC could not be served (its directory, socket or accept thread).
    #[error("vNIC {name}: {reason}")]
    Vnic {
        /// The vNIC.
        name: String,
        /// Why.
        reason: String,
    },
    /// The daemon's configuration is inconsistent.
    #[error("{0}")]
    Config(String),
    /// The mediated engine failed to start.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// Raises the soft limit of open files to the hard one: every session, queue and MR holds
/// descriptors in vrdmad, and the usual soft limit (1024) would let one vNIC's allowance run
/// the daemon out of them for every vNIC. Returns the limit in force.
fn raise_fd_limit() -> u64 {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid rlimit struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
            l.rlim_cur = l.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &l) != 0 {
                libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
            }
        }
    }
    l.rlim_cur
}

/// What all MRs together may hold of `open_files_limit` descriptors: all but a reserve for
/// sessions, queues and the engine (half, under a small limit).
fn mr_descriptor_budget(open_files_limit: u64) -> u64 {
    let reserve = crate::registry::DESCRIPTOR_RESERVE;
    if open_files_limit > 2 * reserve {
        open_files_limit - reserve
    } else {
        open_files_limit / 2
    }
}

/// Default port of the host-to-host transport.
pub const DEFAULT_TRANSPORT_PORT: u16 = 4791;

/// Daemon configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// Run directory (sockets): default /run/vrdma.
    pub run_dir: PathBuf,
    /// State directory (embedded store): default /var/lib/vrdma.
    pub state_dir: PathBuf,
    /// Container network (the bridge owns the first address).
    pub network: (Ipv4Addr, u8),
    /// The control store (`--store`): embedded file store, or etcd.
    pub store: StoreConfig,
    /// This host's name in the cluster (`--host`, default the hostname).
    pub host: String,
    /// Where the host-to-host transport of the mediated engine listens. One host needs it
    /// only for policy-mediated connections, so the default is loopback on any port;
    /// `vrdmad --store etcd://…` defaults to 0.0.0.0:4791.
    pub transport: SocketAddr,
    /// This host's underlay address, advertised to the others as the next hop to its
    /// containers and as the transport's address (`--advertise`); derived when None: the
    /// transport's address if specific, else the source address towards the store.
    pub advertise: Option<Ipv4Addr>,
    /// Route container addresses of other hosts via their underlay addresses (see
    /// [`crate::routes`]).
    pub manage_routes: bool,
    /// The container bridge (`vrdma run` attaches containers to it).
    pub bridge: String,
    /// Policy: every RC connection goes through the mediated engine, even on one host
    /// (byte-exact access checks and metering in the daemon; also how the engine is tested
    /// on one host).
    pub force_mediated: bool,
    /// A silent peer daemon is declared dead after this long (its QPs flush).
    pub peer_timeout: std::time::Duration,
    /// How long the engine's doorbell thread polls after work before sleeping (default:
    /// [`crate::engine::default_spin`]).
    pub engine_spin: std::time::Duration,
    /// Whether the engine's threads move to the CPUs their wakeups come from (default: yes;
    /// see `engine::affinity`).
    pub engine_follow_cpu: bool,
    /// Whether cross-host RC QPs get lanes (default: yes, where the kernel can confine the
    /// sockets their clients hold to their peer daemon; see `engine::lane::guard`).
    pub engine_lanes: bool,
    /// TCP connections to each peer host (default: [`crate::engine::DEFAULT_CONNECTIONS`]).
    pub engine_connections: usize,
    /// How long start-up waits for an unreachable etcd (`None`: as long as it takes), so a
    /// host booting before its store, or during a store outage, joins when the store is back.
    pub store_wait: Option<std::time::Duration>,
    /// Where this host's CDI spec of its vNICs is kept (`vrdmad --cdi-dir`; None: none).
    pub cdi_dir: Option<PathBuf>,
    /// The drop-in libibverbs the CDI spec mounts into containers (None: not installed).
    pub cdi_dropin: Option<vrdma_cdi::DropIn>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            run_dir: "/run/vrdma".into(),
            state_dir: "/var/lib/vrdma".into(),
            network: (Ipv4Addr::new(198, 18, 0, 0), 15),
            store: StoreConfig::File,
            host: default_host_name(),
            transport: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            manage_routes: false,
            bridge: "vrdma0".into(),
            force_mediated: false,
            peer_timeout: std::time::Duration::from_secs(5),
            engine_spin: crate::engine::default_spin(),
            engine_follow_cpu: true,
            engine_lanes: true,
            engine_connections: crate::engine::DEFAULT_CONNECTIONS,
            store_wait: None,
            cdi_dir: None,
            cdi_dropin: None,
        }
    }
}

/// Opens the store; an etcd that cannot be reached is retried (backing off to 5 s, each
/// failure logged) until `wait` has passed. Other failures (a malformed record, an answer
/// that is not etcd's) are returned at once.
fn open_store_waiting(cfg: &Config) -> Result<Arc<dyn store::Store>, store::StoreError> {
    // Certificates and keys are read once; a bad one is a configuration error, not retried.
    let prepared = store::prepare(&cfg.store)?;
    let started = std::time::Instant::now();
    let mut pause = std::time::Duration::from_millis(200);
    loop {
        match store::open_prepared(&prepared, &cfg.state_dir) {
            Err(store::StoreError::Etcd(
                e @ (store::EtcdError::Unreachable(_) | store::EtcdError::Io { .. } | store::EtcdError::Tls { .. }),
            )) if cfg.store_wait.is_none_or(|w| started.elapsed() + pause <= w) => {
                log::warn!("control store not reachable yet ({e}); retrying in {} ms", pause.as_millis());
                std::thread::sleep(pause);
                pause = (pause * 2).min(std::time::Duration::from_secs(5));
            }
            // Every record the daemon reads is checked against the container network first.
            r => return r.map(|s| Arc::new(store::GuardedStore::new(s, store::Check::new(cfg.network.0, cfg.network.1))) as _),
        }
    }
}

/// The kernel's host name (`/proc/sys/kernel/hostname`), or `localhost`.
pub fn default_host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| valid_name(s))
        .unwrap_or_else(|| "localhost".into())
}

/// Names of vNICs and hosts: `[A-Za-z0-9][A-Za-z0-9._-]{0,62}` (they appear in paths and
/// store keys).
pub fn valid_name(s: &str) -> bool {
    crate::store::valid_tenant(s) && s != "." && s != ".."
}

/// The source address this host uses towards `endpoint` (`host:port`), without sending
/// anything (a connected UDP socket).
fn source_address_towards(endpoint: &str) -> Option<Ipv4Addr> {
    use std::net::ToSocketAddrs;
    let dest = endpoint.to_socket_addrs().ok()?.find(|a| a.is_ipv4())?;
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect(dest).ok()?;
    match s.local_addr().ok()?.ip() {
        IpAddr::V4(a) if !a.is_unspecified() => Some(a),
        _ => None,
    }
}

/// A running daemon.
pub struct Daemon {
    pub(crate) cfg: Config,
    pub(crate) registry: Mutex<Registry>,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) engine: Arc<Engine>,
    host: HostRecord,
    /// Client sockets by session, to close them when their vNIC leaves this host.
    conns: Mutex<HashMap<u64, (String, UnixStream)>>,
    /// Serialises applying store changes (watch thread, admin requests).
    apply_lock: Mutex<()>,
    routes: Mutex<Routes>,
    watch: Mutex<Option<WatchHandle>>,
}

impl Broker for Daemon {
    fn accept_remote(&self, from: SocketAddr, src_qpn: u32, dst_qpn: u32, req: &ConnectReq) -> Result<(), Refusal> {
        self.registry.lock().accept_remote(from, src_qpn, dst_qpn, req).map_err(|e| Refusal::new(e.errno(), e.to_string()))
    }
    fn peer_gone(&self, local_qpn: u32, from: SocketAddr, remote_qpn: u32) {
        self.registry.lock().remote_peer_gone(local_qpn, from, remote_qpn);
    }
    fn accept_ud(&self, from: SocketAddr, src_gid: &[u8; 16], dst_qpn: u32, dgid: &[u8; 16]) -> Result<(), String> {
        self.registry.lock().accept_ud(from, src_gid, dst_qpn, dgid).map_err(|e| e.to_string())
    }
    fn ud_receiver(&self, qpn: u32) -> Option<crate::engine::UdReceiverSetup> {
        self.registry.lock().ud_receiver(qpn)
    }
    fn check_peer_host(&self, name: &str, addr: SocketAddr) -> Result<(), String> {
        self.registry.lock().cluster().check_peer_host(name, addr)
    }
    fn host_at(&self, addr: SocketAddr) -> Option<String> {
        self.registry.lock().cluster().hosts.values().find(|h| h.transport_addr == addr).map(|h| h.name.clone())
    }
}

impl Daemon {
    /// Starts: opens the store, registers this host, serves this host's vNICs, watches the
    /// store for changes and serves the admin socket.
    pub fn start(cfg: Config) -> Result<Arc<Daemon>, ServerError> {
        // Wakeups of eventfds clients share never wait, whatever a client does to them.
        vrdma_abi::fd::signal_from_kernel();
        for d in [&cfg.run_dir, &cfg.run_dir.join("vnics"), &cfg.state_dir] {
            std::fs::create_dir_all(d).map_err(|source| ServerError::Dir { path: d.display().to_string(), source })?;
        }
        if !valid_name(&cfg.host) {
            return Err(ServerError::Config(format!("host name {:?}: a letter or digit, then up to 62 of [A-Za-z0-9._-]", cfg.host)));
        }
        let open_files_limit = raise_fd_limit();
        let store = open_store_waiting(&cfg)?;
        let underlay_ip = cfg
            .advertise
            .or(match cfg.transport.ip() {
                IpAddr::V4(a) if !a.is_unspecified() => Some(a),
                _ => None,
            })
            .or_else(|| match &cfg.store {
                StoreConfig::Etcd(e) => e.endpoints.iter().find_map(|e| source_address_towards(e)),
                StoreConfig::File => None,
            })
            .unwrap_or(Ipv4Addr::LOCALHOST);
        // Two live daemons under one name would both serve its vNICs. A record of our own
        // predecessor (same address, lease not yet expired) is fine.
        if let Some(other) = store.list_hosts()?.into_iter().find(|h| h.name == cfg.host && h.underlay_ip != underlay_ip) {
            return Err(ServerError::Config(format!(
                "host name {} is registered by a live vrdmad at {} (if it died, its record expires within {} s)",
                cfg.host,
                other.underlay_ip,
                store::etcd::HOST_TTL_SECS
            )));
        }
        // In a cluster the transport listens on the underlay address only (not on the
        // container bridge's), and a firewall keeps containers from it (`firewall`).
        let cluster = cfg.store != StoreConfig::File;
        let listen = match cfg.transport.ip() {
            ip if cluster && ip.is_unspecified() => SocketAddr::new(IpAddr::V4(underlay_ip), cfg.transport.port()),
            _ => cfg.transport,
        };
        let engine = Engine::start(EngineConfig {
            listen,
            host: cfg.host.clone(),
            peer_timeout: cfg.peer_timeout,
            spin: cfg.engine_spin,
            follow_cpu: cfg.engine_follow_cpu,
            lanes: cfg.engine_lanes,
            connections_per_host: cfg.engine_connections,
            tls: crate::engine::peer_tls_for(&cfg.state_dir.join("tls"), &cfg.host, cluster).map_err(ServerError::Config)?,
        })?;
        let host = HostRecord {
            name: cfg.host.clone(),
            // The port the engine bound (the configured one may be 0).
            transport_addr: SocketAddr::new(IpAddr::V4(underlay_ip), engine.local_addr().port()),
            underlay_ip,
        };
        // Peers identify this daemon by the address they reach it at (told in HELLO).
        engine.set_advertised(host.transport_addr);
        if cluster {
            let (port, network, bridge) = (engine.local_addr().port(), cfg.network, cfg.bridge.clone());
            let underlay = crate::firewall::subnet_of(underlay_ip);
            crate::firewall::install_for_daemon(&crate::firewall::FirewallConfig { port, bridge, network, underlay });
        }
        let mut registry = Registry::default();
        registry.set_descriptor_budget(mr_descriptor_budget(open_files_limit));
        registry.set_engine(engine.clone(), cfg.force_mediated);
        registry.set_meter_base(crate::metrics::persist::load(&cfg.state_dir));
        let d = Arc::new(Daemon {
            cfg,
            registry: Mutex::new(registry),
            store,
            engine,
            host: host.clone(),
            conns: Mutex::new(HashMap::new()),
            apply_lock: Mutex::new(()),
            routes: Mutex::new(Routes::default()),
            watch: Mutex::new(None),
        });
        let broker: Arc<dyn Broker> = d.clone();
        d.engine.set_broker(Arc::downgrade(&broker));
        {
            let mut reg = d.registry.lock();
            reg.cluster_mut().local_host = host.name.clone();
            reg.cluster_mut().single_host = d.cfg.store == StoreConfig::File;
        }
        d.store.put_host(&host)?;
        let snap = d.store.snapshot()?;
        let revision = snap.revision;
        d.apply(StoreEvent::Resync(snap));
        let (tx, rx) = std::sync::mpsc::channel::<StoreEvent>();
        *d.watch.lock() = Some(d.store.watch(
            revision,
            Box::new(move |e| {
                let _ = tx.send(e);
            }),
        )?);
        let d2 = d.clone();
        std::thread::Builder::new()
            .name("store-watch".into())
            .spawn(move || loop {
                match rx.recv_timeout(Duration::from_secs(5)) {
                    Ok(e) => d2.apply(e),
                    // Retries routes that failed (e.g. while a link was down).
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => d2.sync_routes(),
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                }
            })
            .map_err(|source| ServerError::Dir { path: "store-watch thread".into(), source })?;
        crate::admin::start(d.clone())?;
        crate::metrics::persist::start(&d);
        qos_watch::start(&d);
        log::info!(
            "vrdmad host {} (underlay {}, transport {}) serving {} in {}",
            d.host.name,
            d.host.underlay_ip,
            d.cfg.transport,
            d.cfg.run_dir.display(),
            d.cfg.state_dir.display()
        );
        Ok(d)
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// This host as registered in the store.
    pub fn host(&self) -> &HostRecord {
        &self.host
    }

    /// The control store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Directory of a vNIC.
    pub fn vnic_dir(&self, name: &str) -> PathBuf {
        self.cfg.run_dir.join("vnics").join(name)
    }

    /// Applies one store change: the cluster cache, the vNICs served here, the routes.
    /// Idempotent (the admin path applies its own changes at once, and the watch delivers
    /// them again).
    pub fn apply(self: &Arc<Self>, e: StoreEvent) {
        let _g = self.apply_lock.lock();
        let touched: Vec<String> = {
            let mut reg = self.registry.lock();
            let c = reg.cluster_mut();
            match e {
                StoreEvent::VnicPut(v) => {
                    let n = v.name.clone();
                    c.vnics.insert(n.clone(), v);
                    vec![n]
                }
                StoreEvent::VnicDeleted(n) => {
                    c.vnics.remove(&n);
                    vec![n]
                }
                StoreEvent::HostPut(h) => {
                    c.hosts.insert(h.name.clone(), h);
                    vec![]
                }
                StoreEvent::HostDeleted(n) => {
                    c.hosts.remove(&n);
                    vec![]
                }
                StoreEvent::RulePut(r) => {
                    c.rules.insert(RuleRecord::new(&r.from_tenant, &r.to_tenant));
                    vec![]
                }
                StoreEvent::RuleDeleted(r) => {
                    c.rules.remove(&RuleRecord::new(&r.from_tenant, &r.to_tenant));
                    vec![]
                }
                StoreEvent::TenantPut(t) => {
                    c.tenants.insert(t.name, t.qos);
                    vec![]
                }
                StoreEvent::TenantDeleted(n) => {
                    c.tenants.remove(&n);
                    vec![]
                }
                StoreEvent::Resync(snap) => {
                    c.vnics = snap.vnics.into_iter().map(|v| (v.name.clone(), v)).collect();
                    c.hosts = snap.hosts.into_iter().map(|h| (h.name.clone(), h)).collect();
                    c.rules = snap.rules.into_iter().map(|r| RuleRecord::new(&r.from_tenant, &r.to_tenant)).collect();
                    c.tenants = snap.tenants.into_iter().map(|t| (t.name, t.qos)).collect();
                    // This host stays registered even if the snapshot raced its lease.
                    c.hosts.insert(self.host.name.clone(), self.host.clone());
                    let mut names: HashSet<String> = c.vnics.keys().cloned().collect();
                    names.extend(reg.records().into_iter().map(|r| r.name));
                    names.into_iter().collect()
                }
            }
        };
        // A withdrawn rule ends peers' access to MRs across it (their owners re-home them).
        self.registry.lock().revalidate_grants();
        for n in touched {
            self.reconcile_vnic(&n);
        }
        self.sync_cdi();
        self.sync_routes();
        self.sync_qos();
    }

    /// Gives the engine the policies of this host's vNICs and their tenants (a change in the
    /// store reaches the scheduler here, on the store-watch thread: live, no restart).
    fn sync_qos(&self) {
        let (vnics, tenants) = {
            let reg = self.registry.lock();
            let c = reg.cluster();
            let vnics: HashMap<String, (String, Qos)> =
                c.vnics.values().filter(|v| c.is_local(&v.host)).map(|v| (v.name.clone(), (v.tenant.clone(), v.qos))).collect();
            (vnics, c.tenants.clone())
        };
        self.engine.set_qos(vnics, tenants);
    }

    /// Serves, updates or stops serving vNIC `name` so that this host serves it exactly when
    /// the store says so.
    fn reconcile_vnic(self: &Arc<Self>, name: &str) {
        let (want, served) = {
            let reg = self.registry.lock();
            let c = reg.cluster();
            (c.vnics.get(name).filter(|v| c.is_local(&v.host)).cloned(), reg.has_vnic(name))
        };
        match (want, served) {
            (Some(rec), true) => self.registry.lock().add_vnic(rec),
            (Some(rec), false) => match self.serve_vnic(rec) {
                Ok(()) => log::info!("serving vNIC {name}"),
                Err(e) => log::error!("cannot serve vNIC {name}: {e}"),
            },
            (None, true) => self.unserve_vnic(name),
            (None, false) => {}
        }
    }

    /// Stops serving a vNIC now: its client sessions are closed (their objects released)
    /// and its socket removed.
    fn unserve_vnic(&self, name: &str) {
        let sessions = {
            let mut reg = self.registry.lock();
            let s = reg.sessions_of(name);
            reg.remove_vnic_forced(name);
            s
        };
        for s in &sessions {
            if let Some((_, sock)) = self.conns.lock().get(s) {
                let _ = sock.shutdown(Shutdown::Both);
            }
        }
        let dir = self.vnic_dir(name);
        // Wake the accept loop so it notices the vNIC is gone, then remove its directory.
        let _ = Channel::connect(&dir.join("control.sock"));
        let _ = std::fs::remove_dir_all(&dir);
        log::info!("stopped serving vNIC {name} ({} sessions closed)", sessions.len());
    }

    /// Installs routes to the containers of other hosts (when enabled).
    fn sync_routes(&self) {
        if !self.cfg.manage_routes {
            return;
        }
        let want: HashMap<Ipv4Addr, Ipv4Addr> = {
            let reg = self.registry.lock();
            let c = reg.cluster();
            c.vnics
                .values()
                .filter(|v| !c.is_local(&v.host))
                .filter_map(|v| c.hosts.get(&v.host).map(|h| (v.ip, h.underlay_ip)))
                .filter(|(_, via)| *via != self.host.underlay_ip)
                .collect()
        };
        let (net, len) = self.cfg.network;
        let gw = Ipv4Addr::from(u32::from(net) + 1);
        self.routes.lock().sync(&want, &self.cfg.bridge, gw, len);
    }

    fn vnic_err(name: &str, reason: impl Into<String>) -> ServerError {
        ServerError::Vnic { name: name.to_string(), reason: reason.into() }
    }

    fn check_host(&self, name: &str, host: &str) -> Result<(), ServerError> {
        if !valid_name(host) {
            return Err(Self::vnic_err(name, format!("host name {host:?}: a letter or digit, then up to 62 of [A-Za-z0-9._-]")));
        }
        if self.cfg.store == StoreConfig::File && host != self.host.name {
            return Err(Self::vnic_err(
                name,
                format!("the embedded store serves this host ({}) only; run vrdmad with --store etcd://… for a cluster", self.host.name),
            ));
        }
        Ok(())
    }

    /// Creates a vNIC served by this host (see [`Self::create_vnic_on`]).
    pub fn create_vnic(
        self: &Arc<Self>,
        name: &str,
        tenant: &str,
        ip: Option<(Ipv4Addr, u8)>,
        limits: Option<Limits>,
    ) -> Result<VnicRecord, ServerError> {
        self.create_vnic_on(name, tenant, ip, limits, None)
    }

    /// Creates a vNIC in the store (for `host`, default this one); serves it if it is ours.
    /// Without `ip`, the first free address of the container network is claimed, atomically
    /// across daemons.
    pub fn create_vnic_on(
        self: &Arc<Self>,
        name: &str,
        tenant: &str,
        ip: Option<(Ipv4Addr, u8)>,
        limits: Option<Limits>,
        host: Option<&str>,
    ) -> Result<VnicRecord, ServerError> {
        let err = |reason: String| Self::vnic_err(name, reason);
        if name.is_empty() || name.len() > 64 || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            return Err(err("names are a letter or digit, then up to 62 of [A-Za-z0-9._-]".into()));
        }
        if !store::valid_tenant(tenant) {
            return Err(err("tenant must be a letter or digit, then up to 62 of [A-Za-z0-9._-]".into()));
        }
        let host = host.unwrap_or(&self.host.name).to_string();
        self.check_host(name, &host)?;
        if let Some(l) = &limits {
            crate::store::validate::limits(l).map_err(|e| Self::vnic_err(name, e.to_string()))?;
        }
        let (net, len) = self.cfg.network;
        let in_net = |a: Ipv4Addr| (u32::from(a) ^ u32::from(net)) >> (32 - u32::from(len)) == 0;
        let mut rec = VnicRecord {
            name: name.into(),
            tenant: tenant.into(),
            ip: Ipv4Addr::UNSPECIFIED,
            prefix_len: len,
            limits: limits.unwrap_or_default(),
            node_guid: rand::random(),
            host,
            qos: Default::default(),
        };
        // A create retried on another etcd member after a lost reply finds its own record:
        // that is success (node GUIDs are random 64-bit values).
        let ours = |r: &VnicRecord| self.store.get_vnic(name).ok().flatten().is_some_and(|s| s.node_guid == r.node_guid && s.ip == r.ip);
        let map = |e: StoreError| match e {
            StoreError::NameTaken(_) => err("already exists".into()),
            StoreError::IpTaken(a) => err(format!("address {a} is taken")),
            e => ServerError::Store(e),
        };
        match ip {
            Some((a, l)) => {
                if !in_net(a) || l != len {
                    return Err(err(format!("address {a}/{l} is not in the container network {net}/{len}")));
                }
                let bcast = u32::from(net) + (1u32 << (32 - u32::from(len))) - 1;
                if u32::from(a) <= u32::from(net) + 1 || u32::from(a) == bcast {
                    return Err(err(format!("address {a} is taken")));
                }
                rec.ip = a;
                match self.store.create_vnic(&rec) {
                    Err(StoreError::NameTaken(_)) if ours(&rec) => {}
                    r => r.map_err(map)?,
                }
            }
            None => {
                let mut used: HashSet<Ipv4Addr> = self.store.list_vnics()?.into_iter().map(|v| v.ip).collect();
                let size = 1u32 << (32 - u32::from(len));
                let mut candidates = (u32::from(net) + 2..u32::from(net) + size - 1).map(Ipv4Addr::from);
                loop {
                    let a = candidates.by_ref().find(|a| !used.contains(a)).ok_or_else(|| err("container network is full".into()))?;
                    rec.ip = a;
                    match self.store.create_vnic(&rec) {
                        Ok(()) => break,
                        Err(StoreError::NameTaken(_)) if ours(&rec) => break,
                        // Another daemon claimed it between our list and our create.
                        Err(StoreError::IpTaken(_)) => {
                            used.insert(a);
                        }
                        Err(e) => return Err(map(e)),
                    }
                }
            }
        }
        self.apply(StoreEvent::VnicPut(rec.clone()));
        log::info!("created vNIC {} tenant {} ip {}/{} on host {}", rec.name, rec.tenant, rec.ip, rec.prefix_len, rec.host);
        Ok(rec)
    }

    /// Deletes a vNIC (refused while clients of this host use it).
    pub fn delete_vnic(self: &Arc<Self>, name: &str) -> Result<(), ServerError> {
        if self.store.get_vnic(name)?.is_none() {
            return Err(Self::vnic_err(name, format!("no vNIC named {name}")));
        }
        if let Some(s) = self.status().into_iter().find(|s| s.record.name == name) {
            if s.usage.clients > 0 {
                return Err(Self::vnic_err(name, format!("vNIC {name} has {} live clients", s.usage.clients)));
            }
        }
        self.store.delete_vnic(name)?;
        self.apply(StoreEvent::VnicDeleted(name.to_string()));
        log::info!("deleted vNIC {name}");
        Ok(())
    }

    /// Offline migration: `name` is served by `host` from now on; this host's sessions of
    /// it (if it was served here) are closed.
    pub fn move_vnic(self: &Arc<Self>, name: &str, host: &str) -> Result<VnicRecord, ServerError> {
        self.check_host(name, host)?;
        let mut rec = self.store.get_vnic(name)?.ok_or_else(|| Self::vnic_err(name, format!("no vNIC named {name}")))?;
        rec.host = host.to_string();
        self.store.update_vnic(&rec)?;
        self.apply(StoreEvent::VnicPut(rec.clone()));
        log::info!("moved vNIC {name} to host {host}");
        Ok(rec)
    }

    /// Changes a vNIC's limits (applied to new allocations by the serving daemon).
    pub fn set_limits(self: &Arc<Self>, name: &str, limits: Limits) -> Result<VnicRecord, ServerError> {
        crate::store::validate::limits(&limits).map_err(|e| Self::vnic_err(name, e.to_string()))?;
        let mut rec = self.store.get_vnic(name)?.ok_or_else(|| Self::vnic_err(name, format!("no vNIC named {name}")))?;
        rec.limits = limits;
        self.store.update_vnic(&rec)?;
        self.apply(StoreEvent::VnicPut(rec.clone()));
        Ok(rec)
    }

    /// Sets vNIC `name`'s QoS policy (see [`Daemon::set_vnic_qos`]).
    pub fn apply_vnic_qos(self: &Arc<Self>, name: &str, qos: Qos) -> Result<VnicRecord, ServerError> {
        self.set_vnic_qos(name, |_| qos)
    }

    /// Whether vNIC `name` was moved off the direct path for exceeding its caps there.
    pub fn is_demoted(&self, name: &str) -> bool {
        self.registry.lock().is_demoted(name)
    }

    /// Changes a vNIC's QoS policy to `change(current)`: the engines of every host apply it
    /// from the store's watch, and this host's direct-path caps change before this returns.
    pub fn set_vnic_qos(self: &Arc<Self>, name: &str, change: impl FnOnce(Qos) -> Qos) -> Result<VnicRecord, ServerError> {
        let mut rec = self.store.get_vnic(name)?.ok_or_else(|| Self::vnic_err(name, format!("no vNIC named {name}")))?;
        rec.qos = change(rec.qos);
        store::validate::qos(&rec.qos).map_err(|e| Self::vnic_err(name, e.to_string()))?;
        self.store.update_vnic(&rec)?;
        self.apply(StoreEvent::VnicPut(rec.clone()));
        // The direct path's caps here at once (other hosts' and later changes: the registry's
        // check publishes what the record says).
        self.registry.lock().set_vnic_qos(name, rec.qos);
        log::info!("vNIC {name}: QoS {:?}", rec.qos);
        Ok(rec)
    }

    /// Changes tenant `tenant`'s QoS policy to `change(current)`; a policy equal to the
    /// default (uncapped, weight 1) removes the tenant's record.
    pub fn set_tenant_qos(self: &Arc<Self>, tenant: &str, change: impl FnOnce(Qos) -> Qos) -> Result<TenantRecord, ServerError> {
        if !store::valid_tenant(tenant) {
            return Err(ServerError::Config(format!("tenant {tenant:?}: a letter or digit, then up to 62 of [A-Za-z0-9._-]")));
        }
        let cur = self.store.list_tenants()?.into_iter().find(|t| t.name == tenant).map(|t| t.qos).unwrap_or_default();
        let t = TenantRecord { name: tenant.to_string(), qos: change(cur) };
        store::validate::qos(&t.qos).map_err(|e| ServerError::Config(format!("tenant {tenant}: {e}")))?;
        if t.qos == Qos::default() {
            self.store.delete_tenant(tenant)?;
            self.apply(StoreEvent::TenantDeleted(tenant.to_string()));
        } else {
            self.store.put_tenant(&t)?;
            self.apply(StoreEvent::TenantPut(t.clone()));
        }
        log::info!("tenant {tenant}: QoS {:?}", t.qos);
        Ok(t)
    }

    /// Allows (or, `allow == false`, stops allowing) tenants `a` and `b` to connect.
    pub fn set_rule(self: &Arc<Self>, a: &str, b: &str, allow: bool) -> Result<bool, ServerError> {
        for t in [a, b] {
            if !store::valid_tenant(t) {
                return Err(ServerError::Config(format!("tenant {t:?}: a letter or digit, then up to 62 of [A-Za-z0-9._-]")));
            }
        }
        let r = RuleRecord::new(a, b);
        if allow {
            self.store.put_rule(&r)?;
            self.apply(StoreEvent::RulePut(r));
            Ok(true)
        } else {
            let had = self.store.delete_rule(&r)?;
            self.apply(StoreEvent::RuleDeleted(r));
            Ok(had)
        }
    }

    /// The cluster cache: every vNIC (with its host), the live hosts, the rules.
    pub fn cluster(&self) -> crate::registry::ClusterView {
        self.registry.lock().cluster().clone()
    }

    /// The mediated engine.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Status (record, usage, counters) of every vNIC.
    pub fn status(&self) -> Vec<crate::registry::VnicStatus> {
        self.registry.lock().status()
    }

    /// The run directory.
    pub fn run_dir(&self) -> &Path {
        &self.cfg.run_dir
    }
}

#[cfg(test)]
mod tests;
