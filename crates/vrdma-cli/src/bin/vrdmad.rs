//! vrdmad: thin binary over the `vrdmad` library.
//!
//! It lives in vrdma-cli rather than in the vrdmad crate because the end-to-end tests in
//! `crates/vrdma-cli/tests` run it through `env!("CARGO_BIN_EXE_vrdmad")`, which Cargo
//! defines (and builds the binary for) only for a binary of the test's own package.

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
    /// Control store: `file` (embedded, one host), `etcd://HOST:PORT[,HOST:PORT…]`, or
    /// `https://HOST:PORT[,…]` (etcd over TLS; so is etcd:// with --etcd-cacert).
    #[arg(long, default_value = "file", env = "VRDMA_STORE")]
    store: vrdmad::store::StoreConfig,
    /// CA bundle (PEM) etcd's server certificate must chain to; turns TLS on. The
    /// certificate must name the endpoint's host or IP address.
    #[arg(long, env = "VRDMA_ETCD_CACERT", value_name = "FILE")]
    etcd_cacert: Option<std::path::PathBuf>,
    /// Client certificate (PEM) for etcd's --client-cert-auth (needs --etcd-key, --etcd-cacert).
    #[arg(long, env = "VRDMA_ETCD_CERT", value_name = "FILE")]
    etcd_cert: Option<std::path::PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "VRDMA_ETCD_KEY", value_name = "FILE")]
    etcd_key: Option<std::path::PathBuf>,
    /// etcd user (etcd with `auth enable`); its password comes from --etcd-password-file or
    /// VRDMA_ETCD_PASSWORD, never the command line.
    #[arg(long, env = "VRDMA_ETCD_USER", value_name = "NAME")]
    etcd_user: Option<String>,
    /// File whose first line is the etcd user's password.
    #[arg(long, env = "VRDMA_ETCD_PASSWORD_FILE", value_name = "FILE")]
    etcd_password_file: Option<std::path::PathBuf>,
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
    /// Keep the engine's threads where the scheduler puts them, instead of moving each to
    /// the CPU its wakeups come from (the applications ringing it, the CPU receiving its
    /// peers' frames), which saves an inter-processor interrupt per wakeup.
    #[arg(long)]
    engine_no_follow_cpu: bool,
    /// No lanes. By default each cross-host RC QP gets a lane: a TCP connection of its own to
    /// the peer's daemon on which its client library sends small requests itself, saving the
    /// engine's wakeup per message. The client holds that socket; cgroup BPF programs confine
    /// it to its one peer (no reconnect, no listen), and without them (no cgroup v2 or BPF)
    /// there are no lanes. This daemon then also refuses its peers' lanes.
    #[arg(long, conflicts_with = "engine_lanes")]
    no_engine_lanes: bool,
    /// Lanes (the default; see --no-engine-lanes).
    #[arg(long, hide = true)]
    engine_lanes: bool,
    /// TCP connections to each peer host; QPs are spread over them (default: 2).
    #[arg(long)]
    engine_connections: Option<usize>,
    /// Use an etcd reached without TLS or without credentials (a client certificate or an
    /// etcd user). Without this, vrdmad refuses to start on such a store: whoever can write it
    /// controls which vNICs each host serves, their addresses and the tenant rules.
    #[arg(long)]
    insecure_store: bool,
    /// Run a cluster daemon without a host certificate (STATE_DIR/tls, from `vrdma ca issue`):
    /// its connections with other daemons are then not authenticated. Without this, vrdmad
    /// refuses to start in cluster mode without one.
    #[arg(long)]
    insecure_transport: bool,
    /// Seconds start-up waits for an unreachable etcd before giving up (default: as long as
    /// it takes, retrying with each failure logged).
    #[arg(long)]
    store_wait_secs: Option<u64>,
}

/// Completes the store configuration with the `--etcd-*` options.
fn store_config(a: &Args) -> anyhow::Result<vrdmad::store::StoreConfig> {
    use anyhow::Context as _;
    use vrdmad::store::{Password, StoreConfig};
    // Read here and removed (before any thread exists), so no child process inherits it.
    let env_password = std::env::var("VRDMA_ETCD_PASSWORD").ok();
    std::env::remove_var("VRDMA_ETCD_PASSWORD");
    let mut store = a.store.clone();
    let StoreConfig::Etcd(e) = &mut store else {
        let etcd_option = a.etcd_cacert.is_some()
            || a.etcd_cert.is_some()
            || a.etcd_key.is_some()
            || a.etcd_user.is_some()
            || a.etcd_password_file.is_some()
            || env_password.is_some();
        anyhow::ensure!(!etcd_option, "the --etcd-* options need --store etcd://… or https://…");
        return Ok(store);
    };
    e.cacert = a.etcd_cacert.clone();
    e.cert = a.etcd_cert.clone();
    e.key = a.etcd_key.clone();
    e.user = a.etcd_user.clone();
    e.password = match (&a.etcd_password_file, env_password) {
        (Some(_), Some(_)) => anyhow::bail!("give the etcd password either in --etcd-password-file or in VRDMA_ETCD_PASSWORD"),
        (Some(f), None) => Some(Password::from_file(f).context("etcd password")?),
        (None, Some(p)) if p.is_empty() => anyhow::bail!("VRDMA_ETCD_PASSWORD is empty"),
        (None, Some(p)) => Some(Password::new(p)),
        (None, None) => None,
    };
    e.validate()?;
    if let Some(why) = vrdmad::store::insecure_reason(&store) {
        anyhow::ensure!(a.insecure_store, "refusing an insecure control store: {why}; pass --insecure-store to use it anyway");
        eprintln!("vrdmad: warning: insecure control store (--insecure-store): {why}");
    }
    Ok(store)
}

/// On SIGTERM or SIGINT, removes what vrdmad installed in the kernel for the transport (its
/// firewall table) and exits; the handler itself only writes a byte to a pipe.
fn clean_up_on_signals() -> anyhow::Result<()> {
    use std::sync::atomic::{AtomicI32, Ordering};
    static WAKE: AtomicI32 = AtomicI32::new(-1);
    extern "C" fn on_signal(_: libc::c_int) {
        let b = 1u8;
        // SAFETY: write(2) is async-signal-safe; the fd is our pipe's, the buffer a local byte.
        unsafe { libc::write(WAKE.load(Ordering::Relaxed), std::ptr::from_ref(&b).cast(), 1) };
    }
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array it is given.
    anyhow::ensure!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == 0, "pipe: {}", std::io::Error::last_os_error());
    WAKE.store(fds[1], Ordering::Relaxed);
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: a zeroed sigaction with an empty mask and a handler that only writes to a
        // pipe; handlers reset to the default in children at exec.
        let r = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        anyhow::ensure!(r == 0, "sigaction: {}", std::io::Error::last_os_error());
    }
    let read_end = fds[0];
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        let mut b = 0u8;
        // SAFETY: reads one byte into a local from the pipe this thread owns.
        while unsafe { libc::read(read_end, std::ptr::from_mut(&mut b).cast(), 1) } < 0 {}
        vrdmad::firewall::remove_installed();
        std::process::exit(0);
    })?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let a = Args::parse();
    let store = store_config(&a)?;
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
        store,
        host: a.host.unwrap_or(d.host.clone()),
        transport,
        advertise: a.advertise,
        manage_routes: cluster && !a.no_routes,
        force_mediated: a.mediated,
        peer_timeout: std::time::Duration::from_millis(a.peer_timeout_ms.max(100)),
        engine_spin: a.engine_spin_us.map(std::time::Duration::from_micros).unwrap_or(d.engine_spin),
        engine_follow_cpu: !a.engine_no_follow_cpu,
        engine_lanes: !a.no_engine_lanes,
        engine_connections: a.engine_connections.unwrap_or(d.engine_connections),
        store_wait: a.store_wait_secs.map(std::time::Duration::from_secs),
        ..d
    };
    let tls_dir = cfg.state_dir.join("tls");
    if cluster && !vrdmad::engine::PeerTls::present(&tls_dir) {
        anyhow::ensure!(
            a.insecure_transport,
            "refusing to run a cluster daemon whose peers are not authenticated: no host certificate in {} \
             (make one with `vrdma ca issue {} --out {}`); pass --insecure-transport to run without",
            tls_dir.display(),
            cfg.host,
            tls_dir.display()
        );
    }
    clean_up_on_signals()?;
    let _daemon = vrdmad::Daemon::start(cfg)?;
    loop {
        std::thread::park();
    }
}
