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
}

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let a = Args::parse();
    let cfg = vrdmad::Config { run_dir: a.run_dir, state_dir: a.state_dir, ..Default::default() };
    let _daemon = vrdmad::Daemon::start(cfg)?;
    loop {
        std::thread::park();
    }
}
