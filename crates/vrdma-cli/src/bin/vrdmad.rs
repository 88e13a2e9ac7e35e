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
    /// Address the host-to-host transport (mediated engine) listens on.
    #[arg(long, default_value = "127.0.0.1:0", env = "VRDMA_TRANSPORT")]
    transport: std::net::SocketAddr,
    /// Policy: connect every RC QP through the mediated engine, even on one host.
    #[arg(long)]
    mediated: bool,
    /// Milliseconds after which a silent peer daemon is declared dead (its QPs flush).
    #[arg(long, default_value_t = 5000)]
    peer_timeout_ms: u64,
}

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let a = Args::parse();
    let cfg = vrdmad::Config {
        run_dir: a.run_dir,
        state_dir: a.state_dir,
        transport: a.transport,
        force_mediated: a.mediated,
        peer_timeout: std::time::Duration::from_millis(a.peer_timeout_ms.max(100)),
        ..Default::default()
    };
    let _daemon = vrdmad::Daemon::start(cfg)?;
    loop {
        std::thread::park();
    }
}
