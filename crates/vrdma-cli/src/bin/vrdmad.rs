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
    /// Directory where this host's CDI spec of its vNICs (vrdma.io-vnic.json, kind
    /// vrdma.io/vnic) is kept current for podman, containerd, CRI-O and Docker; `none`: no
    /// spec. The drop-in libibverbs it mounts is found as `vrdma run` finds it
    /// ($VRDMA_LIB_DIR, else ../lib/vrdma beside this binary).
    #[arg(long, default_value = vrdma_cdi::DEFAULT_SPEC_DIR, env = "VRDMA_CDI_DIR", value_name = "DIR")]
    cdi_dir: std::path::PathBuf,
    /// Serve Prometheus metrics (text exposition format) on http://ADDR/metrics, e.g.
    /// 127.0.0.1:9464; off by default.
    #[arg(long, env = "VRDMA_METRICS", value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    /// With --metrics: per-QP series too (`vrdma_qp_*{qpn}`; one series set per live QP).
    #[arg(long, requires = "metrics")]
    metrics_qps: bool,
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

/// The drop-in the CDI spec mounts; without one, containers would get the image's own
/// libibverbs, which finds no vNIC: said once at start.
fn cdi_dropin(cdi_dir: &std::path::Path) -> Option<vrdma_cdi::DropIn> {
    if cdi_dir.as_os_str() == "none" {
        return None;
    }
    let exe = std::env::current_exe().ok();
    let found = vrdma_cdi::find_dropin(exe.as_deref());
    if found.is_none() {
        log::warn!(
            "no drop-in libibverbs installed (scripts/install-dropin.sh, or VRDMA_LIB_DIR): the CDI spec gives containers no verbs library"
        );
    }
    found
}

/// SIGTERM and SIGINT, blocked in every thread (this one before any other starts, which
/// inherit the mask) so that [`stop_cleanly`] takes them.
fn block_stop_signals() -> anyhow::Result<libc::sigset_t> {
    // SAFETY: an all-zero sigset_t is a valid value to initialise with sigemptyset.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, exclusively borrowed sigset_t; the old mask is not asked for.
    let rc = unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut())
    };
    anyhow::ensure!(rc == 0, "blocking SIGTERM: {}", std::io::Error::from_raw_os_error(rc));
    Ok(set)
}

/// Waits for SIGTERM or SIGINT, saves the meters (`vrdmad::metrics::persist`), removes
/// what vrdmad installed in the kernel for the transport (its firewall table) and exits.
fn stop_cleanly(daemon: &vrdmad::Daemon, set: &libc::sigset_t) -> ! {
    let mut sig = 0;
    // SAFETY: `set` is an initialised sigset_t, `sig` a valid out-pointer.
    while unsafe { libc::sigwait(set, &mut sig) } != 0 {}
    if let Err(e) = vrdmad::metrics::persist::save_now(daemon) {
        log::warn!("saving meters: {e}");
    }
    vrdmad::firewall::remove_installed();
    log::info!("signal {sig}: meters saved, exiting");
    std::process::exit(0);
}

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let a = Args::parse();
    let store = store_config(&a)?;
    let stop_signals = block_stop_signals()?;
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
        cdi_dir: (a.cdi_dir.as_os_str() != "none").then_some(a.cdi_dir.clone()),
        cdi_dropin: cdi_dropin(&a.cdi_dir),
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
    let daemon = vrdmad::Daemon::start(cfg)?;
    if let Some(addr) = a.metrics {
        vrdmad::metrics::serve(&daemon, addr, a.metrics_qps)?;
    }
    stop_cleanly(&daemon, &stop_signals)
}
