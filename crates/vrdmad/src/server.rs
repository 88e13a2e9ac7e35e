//! Sockets and threads: one accept loop per vNIC socket, one thread per client session
//! (blocked in `recvmsg` while idle, so an idle daemon uses no CPU).

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use vrdma_abi::channel::{self, Channel, ChannelError};
use vrdma_abi::control::{Limits, Reply, Request};

use crate::engine::{Broker, Engine, EngineConfig, EngineError, MrGrant};
use crate::registry::{ConnectPlan, Registry, RequestError};
use crate::store::{FileStore, Store, VnicRecord};
use std::net::SocketAddr;
use vrdma_abi::wire::ConnectReq;

/// Daemon failures.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("creating directory {path}: {source}")]
    Dir { path: String, source: std::io::Error },
    #[error("listening on {path}: {source}")]
    Listen { path: String, source: ChannelError },
    #[error("admin socket {path}: {source}")]
    Admin { path: String, source: std::io::Error },
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error("vNIC {name}: {reason}")]
    Vnic { name: String, reason: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// Daemon configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// Run directory (sockets): default /run/vrdma.
    pub run_dir: PathBuf,
    /// State directory (embedded store): default /var/lib/vrdma.
    pub state_dir: PathBuf,
    /// Container network (the bridge owns the first address).
    pub network: (Ipv4Addr, u8),
    /// Where the host-to-host transport of the mediated engine listens. One host needs it
    /// only for policy-mediated connections, so the default is loopback on any port.
    pub transport: SocketAddr,
    /// Policy: every RC connection goes through the mediated engine, even on one host
    /// (byte-exact access checks and metering in the daemon; also how the engine is tested
    /// on one host).
    pub force_mediated: bool,
    /// A silent peer daemon is declared dead after this long (its QPs flush).
    pub peer_timeout: std::time::Duration,
    /// This host's name.
    pub host: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            run_dir: "/run/vrdma".into(),
            state_dir: "/var/lib/vrdma".into(),
            network: (Ipv4Addr::new(198, 18, 0, 0), 15),
            transport: SocketAddr::from(([127, 0, 0, 1], 0)),
            force_mediated: false,
            peer_timeout: std::time::Duration::from_secs(5),
            host: std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_else(|_| "localhost".into()),
        }
    }
}

/// A running daemon.
pub struct Daemon {
    pub(crate) cfg: Config,
    pub(crate) registry: Mutex<Registry>,
    pub(crate) store: Box<dyn Store>,
    pub(crate) engine: Arc<Engine>,
}

impl Broker for Daemon {
    fn accept_remote(&self, from: SocketAddr, src_qpn: u32, dst_qpn: u32, req: &ConnectReq) -> Result<(), (i32, String)> {
        self.registry.lock().accept_remote(from, src_qpn, dst_qpn, req)
    }
    fn mr(&self, key: u32) -> Option<MrGrant> {
        self.registry.lock().mr_grant(key)
    }
    fn peer_gone(&self, local_qpn: u32, from: SocketAddr, remote_qpn: u32) {
        self.registry.lock().remote_peer_gone(local_qpn, from, remote_qpn);
    }
}

impl Daemon {
    /// Starts: loads the store, serves every stored vNIC and the admin socket.
    pub fn start(cfg: Config) -> Result<Arc<Daemon>, ServerError> {
        for d in [&cfg.run_dir, &cfg.run_dir.join("vnics"), &cfg.state_dir] {
            std::fs::create_dir_all(d).map_err(|source| ServerError::Dir { path: d.display().to_string(), source })?;
        }
        let store = FileStore::open(&cfg.state_dir)?;
        let engine = Engine::start(EngineConfig {
            listen: cfg.transport,
            host: cfg.host.clone(),
            peer_timeout: cfg.peer_timeout,
            ..EngineConfig::default()
        })?;
        let mut registry = Registry::default();
        registry.set_engine(engine.clone(), cfg.force_mediated);
        let d = Arc::new(Daemon { cfg, registry: Mutex::new(registry), store: Box::new(store), engine });
        let broker: Arc<dyn Broker> = d.clone();
        d.engine.set_broker(Arc::downgrade(&broker));
        for rec in d.store.list()? {
            d.serve_vnic(rec)?;
        }
        crate::admin::start(d.clone())?;
        log::info!("vrdmad serving {} in {}", d.cfg.run_dir.display(), d.cfg.state_dir.display());
        Ok(d)
    }

    /// Directory of a vNIC.
    pub fn vnic_dir(&self, name: &str) -> PathBuf {
        self.cfg.run_dir.join("vnics").join(name)
    }

    /// Creates a vNIC, persists it and serves it.
    pub fn create_vnic(
        self: &Arc<Self>,
        name: &str,
        tenant: &str,
        ip: Option<(Ipv4Addr, u8)>,
        limits: Option<Limits>,
    ) -> Result<VnicRecord, ServerError> {
        let err = |reason: String| ServerError::Vnic { name: name.to_string(), reason };
        if name.is_empty() || name.len() > 64 || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            return Err(err("names are 1-64 characters of [A-Za-z0-9_-]".into()));
        }
        if tenant.is_empty() || tenant.len() > 64 {
            return Err(err("tenant must be 1-64 characters".into()));
        }
        let (net, len) = self.cfg.network;
        let in_net = |a: Ipv4Addr| (u32::from(a) ^ u32::from(net)) >> (32 - u32::from(len)) == 0;
        let rec = {
            let reg = self.registry.lock();
            if reg.has_vnic(name) {
                return Err(err("already exists".into()));
            }
            let used: Vec<Ipv4Addr> = reg.records().iter().map(|r| r.ip).collect();
            let (ip, plen) = match ip {
                Some((a, l)) => {
                    if !in_net(a) || l != len {
                        return Err(err(format!("address {a}/{l} is not in the container network {net}/{len}")));
                    }
                    if used.contains(&a) || u32::from(a) <= u32::from(net) + 1 {
                        return Err(err(format!("address {a} is taken")));
                    }
                    (a, l)
                }
                None => {
                    let base = u32::from(net) + 2;
                    let size = 1u32 << (32 - u32::from(len));
                    let a = (base..u32::from(net) + size - 1)
                        .map(Ipv4Addr::from)
                        .find(|a| !used.contains(a))
                        .ok_or_else(|| err("container network is full".into()))?;
                    (a, len)
                }
            };
            VnicRecord {
                name: name.into(),
                tenant: tenant.into(),
                ip,
                prefix_len: plen,
                limits: limits.unwrap_or_default().into(),
                node_guid: rand::random(),
            }
        };
        self.store.put(&rec)?;
        self.serve_vnic(rec.clone())?;
        log::info!("created vNIC {} tenant {} ip {}/{}", rec.name, rec.tenant, rec.ip, rec.prefix_len);
        Ok(rec)
    }

    /// Deletes a vNIC (refused while clients are connected).
    pub fn delete_vnic(&self, name: &str) -> Result<(), ServerError> {
        self.registry.lock().remove_vnic(name).map_err(|e| ServerError::Vnic { name: name.into(), reason: e.message })?;
        self.store.delete(name)?;
        let dir = self.vnic_dir(name);
        // Wake the accept loop so it notices the vNIC is gone, then remove its directory.
        let _ = Channel::connect(&dir.join("control.sock"));
        let _ = std::fs::remove_dir_all(&dir);
        log::info!("deleted vNIC {name}");
        Ok(())
    }

    fn serve_vnic(self: &Arc<Self>, rec: VnicRecord) -> Result<(), ServerError> {
        let dir = self.vnic_dir(&rec.name);
        std::fs::create_dir_all(&dir).map_err(|source| ServerError::Dir { path: dir.display().to_string(), source })?;
        let sock = dir.join("control.sock");
        let listener = channel::listen(&sock).map_err(|source| ServerError::Listen { path: sock.display().to_string(), source })?;
        // Containers run as any user; the directory is theirs alone by mount isolation.
        let _ = std::fs::set_permissions(&sock, std::os::unix::fs::PermissionsExt::from_mode(0o666));
        let name = rec.name.clone();
        self.registry.lock().add_vnic(rec);
        let d = self.clone();
        std::thread::Builder::new()
            .name(format!("vnic-{name}"))
            .spawn(move || d.accept_loop(&name, listener))
            .expect("spawn accept thread");
        Ok(())
    }

    fn accept_loop(self: Arc<Self>, vnic: &str, listener: UnixListener) {
        loop {
            let conn = match listener.accept() {
                Ok((s, _)) => OwnedFd::from(s),
                Err(e) => {
                    log::warn!("vNIC {vnic}: accept failed: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    continue;
                }
            };
            let Some(session) = self.registry.lock().open_session(vnic) else {
                log::info!("vNIC {vnic} is gone; its accept loop ends");
                return;
            };
            let d = self.clone();
            let vnic = vnic.to_string();
            let spawned = std::thread::Builder::new()
                .name(format!("client-{session}"))
                .spawn(move || d.serve_client(&vnic, session, Channel::from(conn)));
            if spawned.is_err() {
                self.registry.lock().close_session(session);
            }
        }
    }

    fn serve_client(&self, vnic: &str, session: u64, ch: Channel) {
        log::debug!("vNIC {vnic}: client session {session} opened (fd {})", ch.as_raw_fd());
        loop {
            let (msg, fds) = match ch.recv() {
                Ok(m) => m,
                Err(ChannelError::Closed) => break,
                Err(e) => {
                    // Oversized or truncated input: counted, and the connection is closed,
                    // because we can no longer tell where messages begin.
                    self.registry.lock().count_bad_input(session);
                    log::warn!("vNIC {vnic} session {session}: {e}; closing");
                    break;
                }
            };
            let (seq, reply, out_fds) = match Request::decode(&msg) {
                Err(e) => {
                    self.registry.lock().count_bad_input(session);
                    log::warn!("vNIC {vnic} session {session}: bad message: {e}");
                    (0, Reply::Error { errno: libc::EINVAL, message: e.to_string() }, vec![])
                }
                Ok((seq, req)) => {
                    let result = match req {
                        Request::ConnectQp { qpn, dgid, dest_qpn } => self.connect_qp(session, qpn, dgid, dest_qpn),
                        req => self.registry.lock().handle_request(session, req, fds),
                    };
                    match result {
                        Ok((r, f)) => (seq, r, f),
                        Err(e) => {
                            if e.bad_input {
                                self.registry.lock().count_bad_input(session);
                                log::warn!("vNIC {vnic} session {session}: refused: {}", e.message);
                            }
                            (seq, Reply::Error { errno: e.errno, message: e.message }, vec![])
                        }
                    }
                }
            };
            self.send_notices();
            let raw: Vec<_> = out_fds.iter().map(|f| f.as_raw_fd()).collect();
            if ch.send(&reply.encode(seq), &raw).is_err() {
                break;
            }
        }
        self.registry.lock().close_session(session);
        self.send_notices();
        log::debug!("vNIC {vnic}: client session {session} closed, resources reclaimed");
    }

    /// `ConnectQp`: direct connections are made under the registry lock; mediated ones ask
    /// the peer daemon first, without it (that daemon may be asking us at the same time).
    fn connect_qp(&self, session: u64, qpn: u32, dgid: [u8; 16], dest_qpn: u32) -> Result<(Reply, Vec<Arc<OwnedFd>>), RequestError> {
        let plan = self.registry.lock().prepare_connect(session, qpn, dgid, dest_qpn)?;
        match plan {
            ConnectPlan::Done(r, f) => Ok((r, f)),
            ConnectPlan::Remote { addr, req } => {
                if let Err(e) = self.engine.connect_remote(addr, qpn, dest_qpn, &req) {
                    self.registry.lock().count_refused(session);
                    log::warn!("QP {qpn}: connection to QP {dest_qpn} at {addr} failed: {e}");
                    return Err(RequestError { errno: e.errno(), message: e.to_string(), bad_input: false });
                }
                self.registry.lock().finish_remote_connect(session, qpn, addr, dest_qpn)
            }
        }
    }

    /// Sends the PEER_GONE notices the registry queued.
    fn send_notices(&self) {
        let notices = self.registry.lock().take_notices();
        for (addr, remote_qpn, local_qpn) in notices {
            self.engine.send_peer_gone(addr, remote_qpn, local_qpn);
        }
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
