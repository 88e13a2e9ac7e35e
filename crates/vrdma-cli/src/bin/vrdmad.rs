//! vrdmad: thin binary over the `vrdmad` library.

use clap::Parser;

/// vrdma's per-host daemon.
#[derive(Parser)]
#[command(version, about)]
struct Args {
    /// Run directory (vNIC sockets, admin socket).
    #[arg(long, default_value = "/run/vrdma", env = "VRDMA_RUN_DIR")]
    run_dir: std::path::PathBuf,
    /// State directory (embedded store).
    #[arg(long, default_value = "/var/lib/vrdma", env = "VRDMA_STATE_DIR")]
    state_dir: std::path::PathBuf,
    /// Control store: `file` (embedded, one host) or `etcd://HOST:PORT[,HOST:PORT…]`.
    #[arg(long, default_value = "file", env = "VRDMA_STORE")]
    store: vrdmad::store::StoreConfig,
    /// This host's name in the cluster (default: the hostname).
    #[arg(long, env = "VRDMA_HOST")]
    host: Option<String>,
    /// Address the host-to-host transport (mediated engine) listens on (default: 0.0.0.0:4791
    /// with etcd, 127.0.0.1 on any port with the embedded store).
    #[arg(long, env = "VRDMA_TRANSPORT")]
    transport: Option<std::net::SocketAddr>,
    /// This host's underlay address, advertised to the other hosts (default: the
    /// transport's address if specific, else the source address towards the store).
    #[arg(long)]
    advertise: Option<std::net::Ipv4Addr>,
    /// Do not route other hosts' container addresses (with etcd, routes are on by default).
    #[arg(long)]
    no_routes: bool,
    /// Policy: connect every RC QP through the mediated engine, even on one host.
    #[arg(long)]
    mediated: bool,
    /// Milliseconds after which a silent peer daemon is declared dead (its QPs flush).
    #[arg(long, default_value_t = 5000)]
    peer_timeout_ms: u64,
    /// Microseconds the engine keeps polling for new work before sleeping (default: 0 on
    /// two CPUs or fewer, where polling at real-time priority starves applications; 50 above).
    #[arg(long)]
    engine_spin_us: Option<u64>,
    /// Seconds start-up waits for an unreachable etcd before giving up (default: as long as
    /// it takes, retrying with each failure logged).
    #[arg(long)]
    store_wait_secs: Option<u64>,
}

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let a = Args::parse();
    let d = vrdmad::Config::default();
    let cluster = matches!(a.store, vrdmad::store::StoreConfig::Etcd(_));
    let transport = a.transport.unwrap_or(if cluster {
        std::net::SocketAddr::from(([0, 0, 0, 0], vrdmad::server::DEFAULT_TRANSPORT_PORT))
    } else {
        d.transport
    });
    let cfg = vrdmad::Config {
        run_dir: a.run_dir,
        state_dir: a.state_dir,
        store: a.store,
        host: a.host.unwrap_or(d.host.clone()),
        transport,
        advertise: a.advertise,
        manage_routes: cluster && !a.no_routes,
        force_mediated: a.mediated,
        peer_timeout: std::time::Duration::from_millis(a.peer_timeout_ms.max(100)),
        engine_spin: a.engine_spin_us.map(std::time::Duration::from_micros).unwrap_or(d.engine_spin),
        store_wait: a.store_wait_secs.map(std::time::Duration::from_secs),
        ..d
    };
    let _daemon = vrdmad::Daemon::start(cfg)?;
    loop {
        std::thread::park();
    }
}
