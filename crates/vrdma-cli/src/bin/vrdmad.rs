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
    /// Address the host-to-host transport listens on.
    #[arg(long, default_value = "0.0.0.0:4791")]
    transport: std::net::SocketAddr,
    /// This host's underlay address, advertised to the other hosts (default: the
    /// transport's address if specific, else the source address towards the store).
    #[arg(long)]
    advertise: Option<std::net::Ipv4Addr>,
    /// Do not route other hosts' container addresses (with etcd, routes are on by default).
    #[arg(long)]
    no_routes: bool,
}

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let a = Args::parse();
    let d = vrdmad::Config::default();
    let manage_routes = matches!(a.store, vrdmad::store::StoreConfig::Etcd(_)) && !a.no_routes;
    let cfg = vrdmad::Config {
        run_dir: a.run_dir,
        state_dir: a.state_dir,
        store: a.store,
        host: a.host.unwrap_or(d.host.clone()),
        transport: a.transport,
        advertise: a.advertise,
        manage_routes,
        ..d
    };
    let _daemon = vrdmad::Daemon::start(cfg)?;
    loop {
        std::thread::park();
    }
}
