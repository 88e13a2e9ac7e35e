//! A simulated cluster: N hosts as network namespaces on an underlay bridge in
//! the root namespace, one real etcd, one real vrdmad per host, driven through the real
//! `vrdma` binary run inside each host's namespace.
//!
//! ```text
//!  root netns:  bridge vrul<tag> 198.19.<net>.1/24  ── etcd on 198.19.<net>.1:23790
//!                 │ vu<tag>h1        │ vu<tag>h2 …
//!  netns vrh1-<tag>: ul0 198.19.<net>.11/24, vrdma0 198.18.0.1/15 (containers), vrdmad --host h1
//!  netns vrh2-<tag>: ul0 198.19.<net>.12/24, …                                 vrdmad --host h2
//! ```
//!
//! Names and the underlay subnet are unique per cluster, so clusters of concurrently running
//! test processes do not collide; everything is torn down on drop.
//!
//! [`Cluster::start_secure`] runs etcd over TLS (certificates made here with rcgen, the server
//! certificate naming the underlay IP) with client-certificate or password authentication.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{VRDMA, VRDMAD};

const ETCD: &str = "/usr/bin/etcd";
const ETCD_PORT: u16 = 23790;

/// How the cluster's etcd is secured, and the daemons configured for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EtcdSecurity {
    /// Plain HTTP, no authentication.
    Plain,
    /// TLS with `--client-cert-auth`: daemons give the CA, a client certificate and key.
    MutualTls,
    /// TLS (server certificate only) and etcd users (`auth enable`): daemons give the CA
    /// (with an `https://` store URL) and user `vrdma`'s password in a file. Simple tokens
    /// live 2 s, so daemons must authenticate again while they run.
    TlsPassword,
}

/// Whether the clusters' daemons authenticate each other (TLS 1.3 handshakes with host
/// certificates of a test CA made by `vrdma ca`): yes, unless VRDMA_TEST_TRANSPORT_TLS=0
/// (benchmarks compare both).
pub(crate) fn transport_tls() -> bool {
    std::env::var("VRDMA_TEST_TRANSPORT_TLS").map_or(true, |v| v != "0")
}

/// The etcd user the daemons authenticate as (read-write on `/vrdma/` only).
pub(crate) const ETCD_USER: &str = "vrdma";
/// Its password.
pub(crate) const ETCD_PASSWORD: &str = "vrdma-test-password";

/// Certificates of a secured cluster, as PEM files in the cluster's directory.
pub(crate) struct Pki {
    /// The CA that signed etcd's and the daemons' certificates.
    pub ca: PathBuf,
    /// etcd's server certificate (IP SAN: the underlay address) and key.
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// The daemons' client certificate and key.
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// An unrelated CA (with its own client certificate), for tests of what must fail.
    pub other_ca: PathBuf,
    pub other_client_cert: PathBuf,
    pub other_client_key: PathBuf,
    /// A file holding [`ETCD_PASSWORD`].
    pub password_file: PathBuf,
}

impl Pki {
    fn generate(dir: &Path, etcd_ip: Ipv4Addr) -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType};
        std::fs::create_dir_all(dir).unwrap();
        let write = |name: &str, pem: String| {
            let p = dir.join(name);
            std::fs::write(&p, pem).unwrap();
            p
        };
        let ca = |cn: &str| {
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.distinguished_name.push(DnType::CommonName, cn);
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
            let key = KeyPair::generate().unwrap();
            let cert = p.self_signed(&key).unwrap();
            (cert, key)
        };
        let leaf = |cn: &str, sans: Vec<SanType>, usage: Vec<ExtendedKeyUsagePurpose>, issuer: &(rcgen::Certificate, KeyPair)| {
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.distinguished_name.push(DnType::CommonName, cn);
            p.subject_alt_names = sans;
            p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
            p.extended_key_usages = usage;
            let key = KeyPair::generate().unwrap();
            let cert = p.signed_by(&key, &issuer.0, &issuer.1).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (good, other) = (ca("vrdma test CA"), ca("some other CA"));
        // etcd's JSON gateway connects to its own gRPC server with the server certificate,
        // which --client-cert-auth checks as a client certificate: it needs both usages.
        let usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let server = leaf("etcd", vec![SanType::IpAddress(etcd_ip.into())], usages, &good);
        // etcd maps a client certificate's CN to a user when auth is on; none is here.
        let client = leaf("vrdmad", vec![], vec![ExtendedKeyUsagePurpose::ClientAuth], &good);
        let other_client = leaf("vrdmad", vec![], vec![ExtendedKeyUsagePurpose::ClientAuth], &other);
        Pki {
            ca: write("ca.pem", good.0.pem()),
            server_cert: write("server.pem", server.0),
            server_key: write("server-key.pem", server.1),
            client_cert: write("client.pem", client.0),
            client_key: write("client-key.pem", client.1),
            other_ca: write("other-ca.pem", other.0.pem()),
            other_client_cert: write("other-client.pem", other_client.0),
            other_client_key: write("other-client-key.pem", other_client.1),
            password_file: write("password", format!("{ETCD_PASSWORD}\n")),
        }
    }
}

/// One simulated host.
pub(crate) struct Host {
    /// Its name in the cluster (`h1`, `h2`, …).
    pub name: String,
    /// Its network namespace.
    pub netns: String,
    /// The root-namespace end of its underlay link.
    pub link: String,
    /// Its underlay address.
    pub ip: Ipv4Addr,
    /// Its vrdmad's run, state and log directory.
    pub dir: PathBuf,
    daemon: Option<Child>,
}

impl Host {
    /// vrdmad's run directory.
    pub(crate) fn run_dir(&self) -> PathBuf {
        self.dir.join("run")
    }
    /// A vNIC's control socket on this host.
    pub(crate) fn socket(&self, vnic: &str) -> PathBuf {
        self.run_dir().join("vnics").join(vnic).join("control.sock")
    }
    /// vrdmad's log so far.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("vrdmad.log")).unwrap_or_default()
    }
}

/// A running simulated cluster.
/// Every simulated daemon declares a silent peer dead after this long.
pub(crate) const PEER_TIMEOUT: Duration = Duration::from_secs(2);

pub(crate) struct Cluster {
    /// Unique tag of this cluster's names.
    pub tag: String,
    /// Third octet of the underlay subnet 198.19.<net>.0/24.
    pub net: u8,
    /// Scratch directory (etcd data, host directories).
    pub dir: PathBuf,
    /// The underlay bridge in the root namespace.
    pub bridge: String,
    /// The hosts; `hosts[0]` is `h1`.
    pub hosts: Vec<Host>,
    /// `host:port` of etcd.
    pub etcd_endpoint: String,
    /// How etcd is secured.
    pub security: EtcdSecurity,
    /// Options of each host's vrdmad (`daemon_args[i]` for host `i`, if there is one).
    pub daemon_args: Vec<Vec<String>>,
    /// Certificates (secured clusters).
    pub pki: Option<Pki>,
    etcd: Option<Child>,
    net_lock: PathBuf,
}

fn sh(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
}

/// Runs `ip ARGS`, panicking on failure.
pub(crate) fn ip(args: &[&str]) {
    let o = sh(Command::new("ip").args(args));
    assert!(o.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&o.stderr));
}

/// Polls `f` every 100 ms until it is true or `limit` passes.
pub(crate) fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Claims an underlay subnet 198.19.<net>.0/24 for this process: a lock file created with
/// O_EXCL (a dead owner's is taken over), and no interface may already use the subnet.
fn claim_underlay(pid: u32) -> (u8, PathBuf) {
    let used = used_underlay_octets();
    for k in 0..140u32 {
        let net = 100 + ((pid + k) % 140) as u8;
        if used.contains(&net) {
            continue;
        }
        let lock = std::env::temp_dir().join(format!("vrdma-cluster-net-{net}.lock"));
        for _ in 0..2 {
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&lock) {
                Ok(mut f) => {
                    use std::io::Write;
                    let _ = write!(f, "{pid}");
                    return (net, lock);
                }
                Err(_) => {
                    let owner = std::fs::read_to_string(&lock).unwrap_or_default();
                    let alive = owner.trim().parse::<u32>().is_ok_and(|p| Path::new(&format!("/proc/{p}")).exists());
                    if alive {
                        break;
                    }
                    let _ = std::fs::remove_file(&lock);
                }
            }
        }
    }
    panic!("no free underlay subnet in 198.19.100-239.0/24");
}

fn used_underlay_octets() -> Vec<u8> {
    let o = sh(Command::new("ip").args(["-o", "-4", "addr", "show"]));
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("198.19."))
        .filter_map(|w| w.split('.').next()?.parse().ok())
        .collect()
}

/// Set (to anything) for every daemon to run with the engine's default settings.
pub(crate) const ENGINE_DEFAULTS: &str = "VRDMA_CLUSTER_ENGINE_DEFAULTS";

/// Whether h2's daemon opens three connections to each peer (see `start_daemon`): not when
/// defaults are asked for, nor when VRDMAD_EXTRA_ARGS sets the count itself.
pub(crate) fn three_connections_on_h2() -> bool {
    std::env::var_os(ENGINE_DEFAULTS).is_none() && !std::env::var("VRDMAD_EXTRA_ARGS").unwrap_or_default().contains("--engine-connections")
}

impl Cluster {
    /// Starts a cluster of `n` hosts, or returns None (after printing why) when this
    /// machine cannot: not root, or etcd not installed.
    pub(crate) fn start(test: &str, n: usize) -> Option<Cluster> {
        Self::start_secure(test, n, EtcdSecurity::Plain)
    }

    /// Like [`Self::start`], with etcd secured as `security` says and every daemon
    /// configured for it.
    pub(crate) fn start_secure(test: &str, n: usize, security: EtcdSecurity) -> Option<Cluster> {
        Self::start_full(test, n, security, &[])
    }

    /// Like [`Self::start`], host `i`'s vrdmad with `daemon_args[i]` too (if there is one).
    pub(crate) fn start_with_daemon_args(test: &str, n: usize, daemon_args: &[&[&str]]) -> Option<Cluster> {
        Self::start_full(test, n, EtcdSecurity::Plain, daemon_args)
    }

    fn start_full(test: &str, n: usize, security: EtcdSecurity, daemon_args: &[&[&str]]) -> Option<Cluster> {
        if !vrdma_test_support::require_root(test) || !vrdma_test_support::require_files(test, &[ETCD], "etcd-server") {
            return None;
        }
        assert!((1..=9).contains(&n));
        let pid = std::process::id();
        let tag = format!("{:04x}", (pid ^ (pid >> 16)) & 0xffff);
        let (net, net_lock) = claim_underlay(pid);
        let dir = std::env::temp_dir().join(format!("vrdma-cluster-{test}-{pid}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = Cluster {
            tag: tag.clone(),
            net,
            dir: dir.clone(),
            bridge: format!("vrul{tag}"),
            hosts: Vec::new(),
            etcd_endpoint: format!("198.19.{net}.1:{ETCD_PORT}"),
            security,
            pki: None,
            etcd: None,
            net_lock,
            daemon_args: daemon_args.iter().map(|h| h.iter().map(|a| a.to_string()).collect()).collect(),
        };
        // The underlay.
        let _ = sh(Command::new("ip").args(["link", "del", &c.bridge]));
        ip(&["link", "add", &c.bridge, "type", "bridge"]);
        ip(&["addr", "add", &format!("198.19.{net}.1/24"), "dev", &c.bridge]);
        ip(&["link", "set", &c.bridge, "up"]);
        for i in 1..=n {
            let h = Host {
                name: format!("h{i}"),
                netns: format!("vrh{i}-{tag}"),
                link: format!("vu{tag}h{i}"),
                ip: Ipv4Addr::new(198, 19, net, 10 + i as u8),
                dir: dir.join(format!("h{i}")),
                daemon: None,
            };
            let _ = sh(Command::new("ip").args(["netns", "del", &h.netns]));
            let _ = sh(Command::new("ip").args(["link", "del", &h.link]));
            ip(&["netns", "add", &h.netns]);
            ip(&["link", "add", &h.link, "type", "veth", "peer", "name", "ul0", "netns", &h.netns]);
            ip(&["link", "set", &h.link, "master", &c.bridge, "up"]);
            ip(&["-n", &h.netns, "addr", "add", &format!("{}/24", h.ip), "dev", "ul0"]);
            ip(&["-n", &h.netns, "link", "set", "ul0", "up"]);
            ip(&["-n", &h.netns, "link", "set", "lo", "up"]);
            std::fs::create_dir_all(&h.dir).unwrap();
            c.hosts.push(h);
        }
        // etcd, on the underlay.
        let peer_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let scheme = if security == EtcdSecurity::Plain { "http" } else { "https" };
        let client_url = format!("{scheme}://{}", c.etcd_endpoint);
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let mut etcd = Command::new(ETCD);
        etcd.args(["--name", "vrdma-test", "--data-dir"]).arg(dir.join("etcd"));
        if security != EtcdSecurity::Plain {
            let pki = Pki::generate(&dir.join("pki"), Ipv4Addr::new(198, 19, net, 1));
            etcd.arg("--cert-file").arg(&pki.server_cert).arg("--key-file").arg(&pki.server_key);
            if security == EtcdSecurity::MutualTls {
                etcd.arg("--client-cert-auth").arg("--trusted-ca-file").arg(&pki.ca);
            } else {
                // (--trusted-ca-file alone would make etcd demand client certificates.)
                etcd.args(["--auth-token-ttl", "2"]);
            }
            c.pki = Some(pki);
        }
        let etcd = etcd
            .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("vrdma-test={peer_url}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("etcd.log")).unwrap())
            .spawn()
            .expect("start etcd");
        c.etcd = Some(etcd);
        let mut admin = c.etcd_config();
        (admin.user, admin.password) = (None, None); // not created yet
        assert!(wait_until(Duration::from_secs(30), || vrdmad::store::EtcdStore::healthy_with(&admin)), "etcd did not become healthy");
        if security == EtcdSecurity::TlsPassword {
            c.enable_etcd_auth(&admin);
        }
        if transport_tls() {
            c.issue_host_certificates();
        }
        for i in 0..n {
            c.start_daemon(i);
        }
        Some(c)
    }

    /// `vrdma ca init` in the cluster's directory, and `vrdma ca issue` for every host into
    /// its daemon's `STATE_DIR/tls`.
    fn issue_host_certificates(&self) {
        let ca = self.dir.join("ca");
        let run = |args: &[&str], dir: &[&Path]| {
            let o = Command::new(VRDMA).args(args).args(dir).output().unwrap();
            assert!(o.status.success(), "vrdma {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        };
        run(&["ca", "init", "--dir"], &[&ca]);
        for h in &self.hosts {
            let out = h.dir.join("state").join("tls");
            let o = Command::new(VRDMA).args(["ca", "issue", &h.name, "--dir"]).arg(&ca).arg("--out").arg(&out).output().unwrap();
            assert!(o.status.success(), "vrdma ca issue {}: {}", h.name, String::from_utf8_lossy(&o.stderr));
        }
    }

    /// The daemons' etcd configuration, as the library sees it.
    pub(crate) fn etcd_config(&self) -> vrdmad::store::EtcdConfig {
        let mut cfg = vrdmad::store::EtcdConfig::plain(vec![self.etcd_endpoint.clone()]);
        if let Some(p) = &self.pki {
            cfg.cacert = Some(p.ca.clone());
            if self.security == EtcdSecurity::MutualTls {
                (cfg.cert, cfg.key) = (Some(p.client_cert.clone()), Some(p.client_key.clone()));
            } else {
                cfg.user = Some(ETCD_USER.into());
                cfg.password = Some(vrdmad::store::Password::new(ETCD_PASSWORD));
            }
        }
        cfg
    }

    /// vrdmad's store options for this cluster (the two TLS flavours use both URL forms).
    pub(crate) fn store_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        let path = |p: &Path| p.display().to_string();
        match (self.security, &self.pki) {
            (EtcdSecurity::MutualTls, Some(p)) => {
                a.extend(["--store".into(), format!("etcd://{}", self.etcd_endpoint)]);
                a.extend(["--etcd-cacert".into(), path(&p.ca), "--etcd-cert".into(), path(&p.client_cert)]);
                a.extend(["--etcd-key".into(), path(&p.client_key)]);
            }
            (EtcdSecurity::TlsPassword, Some(p)) => {
                a.extend(["--store".into(), format!("https://{}", self.etcd_endpoint), "--etcd-cacert".into(), path(&p.ca)]);
                a.extend(["--etcd-user".into(), ETCD_USER.into(), "--etcd-password-file".into(), path(&p.password_file)]);
            }
            // The test's etcd listens on the hosts' private underlay only.
            _ => a.extend(["--store".into(), format!("etcd://{}", self.etcd_endpoint), "--insecure-store".into()]),
        }
        a
    }

    /// `etcdctl user add root; role add …; auth enable`, through the JSON gateway: user
    /// `root` (required by etcd), and user `vrdma` with read-write access to `/vrdma/` only.
    fn enable_etcd_auth(&self, admin: &vrdmad::store::EtcdConfig) {
        use serde_json::json;
        let sec = admin.load().unwrap();
        let s = vrdmad::store::EtcdStore::connect_secure(admin.endpoints.clone(), sec, 10).unwrap();
        // Keys are base64: "/vrdma/" up to "/vrdma0" (the prefix's range end).
        let (key, range_end) = ("L3ZyZG1hLw==", "L3ZyZG1hMA==");
        for (path, body) in [
            ("/v3/auth/role/add", json!({"name": "root"})),
            ("/v3/auth/user/add", json!({"name": "root", "password": "root-test-password"})),
            ("/v3/auth/user/grant", json!({"user": "root", "role": "root"})),
            ("/v3/auth/role/add", json!({"name": ETCD_USER})),
            ("/v3/auth/role/grant", json!({"name": ETCD_USER, "perm": {"permType": "READWRITE", "key": key, "range_end": range_end}})),
            ("/v3/auth/user/add", json!({"name": ETCD_USER, "password": ETCD_PASSWORD})),
            ("/v3/auth/user/grant", json!({"user": ETCD_USER, "role": ETCD_USER})),
            ("/v3/auth/enable", json!({})),
        ] {
            s.gateway_call(path, &body).unwrap_or_else(|e| panic!("{path}: {e}"));
        }
        // Without a token, etcd now refuses.
        assert!(!vrdmad::store::EtcdStore::healthy_with(admin), "auth is not on");
        assert!(wait_until(Duration::from_secs(10), || vrdmad::store::EtcdStore::healthy_with(&self.etcd_config())));
    }

    /// Runs a vrdmad named `name` in `host`'s namespace with private directories and
    /// `args` (store options included) until it exits, at most `limit`; its exit status
    /// (None: still running, killed) and log.
    pub(crate) fn run_extra_daemon(
        &self,
        host: &str,
        name: &str,
        args: &[String],
        limit: Duration,
    ) -> (Option<std::process::ExitStatus>, String) {
        let h = self.host(host);
        let dir = self.dir.join(format!("extra-{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("vrdmad.log");
        let mut child = Command::new("ip")
            .args(["netns", "exec", &h.netns, VRDMAD, "--run-dir"])
            .arg(dir.join("run"))
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(["--host", name, "--transport", "0.0.0.0:0", "--no-routes", "--insecure-transport"])
            .args(["--cdi-dir", "none"])
            .args(args)
            .env("RUST_LOG", daemon_log_level())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start vrdmad");
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break Some(st);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        (status, std::fs::read_to_string(&log).unwrap_or_default())
    }

    fn idx(&self, host: &str) -> usize {
        self.hosts.iter().position(|h| h.name == host).unwrap_or_else(|| panic!("no host {host}"))
    }

    /// A host by name.
    pub(crate) fn host(&self, host: &str) -> &Host {
        &self.hosts[self.idx(host)]
    }

    /// Limits `host`'s link to the underlay to `rate` (tc syntax, e.g. "16mbit").
    pub(crate) fn throttle(&self, host: &str, rate: &str) {
        let ns = &self.host(host).netns;
        let tc = Command::new("ip")
            .args([
                "netns", "exec", ns, "tc", "qdisc", "add", "dev", "ul0", "root", "tbf", "rate", rate, "burst", "32kb", "latency", "200ms",
            ])
            .output()
            .unwrap();
        assert!(tc.status.success(), "tc: {}", String::from_utf8_lossy(&tc.stderr));
    }

    fn start_daemon(&mut self, i: usize) {
        self.spawn_daemon(i);
        let h = &self.hosts[i];
        let sock = h.run_dir().join("admin.sock");
        assert!(wait_until(Duration::from_secs(20), || sock.exists()), "vrdmad on {} did not start:\n{}", h.name, h.log());
    }

    /// Starts host `i`'s vrdmad without waiting for it to serve.
    fn spawn_daemon(&mut self, i: usize) {
        let store = self.store_args();
        let h = &mut self.hosts[i];
        let _ = std::fs::remove_file(h.run_dir().join("admin.sock"));
        let log = std::fs::OpenOptions::new().create(true).append(true).open(h.dir.join("vrdmad.log")).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", &h.netns, VRDMAD, "--run-dir"])
            .arg(h.run_dir())
            .arg("--state-dir")
            .arg(h.dir.join("state"))
            .args(&store)
            .args(["--host", &h.name, "--cdi-dir", "none"])
            .args(if transport_tls() { &[][..] } else { &["--insecure-transport"][..] })
            // Failure tests expect flushes within this bound (plus slack).
            .args(["--peer-timeout-ms", &PEER_TIMEOUT.as_millis().to_string()])
            // h2 opens three connections to each peer host, the others the default two, so
            // the tests cover QPs spread over more than two and `--engine-connections`;
            // benchmarks measure the defaults (ENGINE_DEFAULTS).
            .args(if i == 1 && three_connections_on_h2() { &["--engine-connections", "3"][..] } else { &[] })
            // Benchmarks compare daemon options (e.g. --engine-no-follow-cpu) this way.
            .args(std::env::var("VRDMAD_EXTRA_ARGS").unwrap_or_default().split_whitespace())
            .args(self.daemon_args.get(i).into_iter().flatten())
            .env("RUST_LOG", daemon_log_level())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start vrdmad");
        h.daemon = Some(child);
    }

    /// `vrdma ARGS` inside `host`'s namespace, against its vrdmad.
    pub(crate) fn vrdma_cmd(&self, host: &str) -> Command {
        let h = self.host(host);
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &h.netns, VRDMA])
            .env("VRDMA_RUN_DIR", h.run_dir())
            .env("VRDMA_STATE_DIR", h.dir.join("state"))
            .env("RUST_BACKTRACE", "0");
        c
    }

    /// Runs `vrdma ARGS` against `host`'s daemon.
    pub(crate) fn vrdma(&self, host: &str, args: &[&str]) -> Output {
        sh(self.vrdma_cmd(host).args(args))
    }

    /// Runs `vrdma ARGS` against `host`'s daemon; panics unless it succeeds; its stdout.
    pub(crate) fn ok(&self, host: &str, args: &[&str]) -> String {
        let o = self.vrdma(host, args);
        assert!(
            o.status.success(),
            "on {host}: vrdma {args:?} failed: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// `vrdma vnic list --json` on `host`.
    pub(crate) fn list(&self, host: &str) -> Vec<serde_json::Value> {
        let v: serde_json::Value = serde_json::from_str(&self.ok(host, &["vnic", "list", "--json"])).unwrap();
        v.as_array().cloned().unwrap_or_default()
    }

    /// The address of a vNIC, as `host` sees it.
    pub(crate) fn vnic_ip(&self, host: &str, vnic: &str) -> Ipv4Addr {
        let l = self.list(host);
        let v = l.iter().find(|v| v["vnic"]["name"] == vnic).unwrap_or_else(|| panic!("{host} does not list {vnic}"));
        v["vnic"]["ip"].as_str().unwrap().parse().unwrap()
    }

    /// Spawns `vrdma run --vnic VNIC -- CMD` inside `host`'s namespace (output piped).
    pub(crate) fn run_container(&self, host: &str, vnic: &str, cmd: &[&str]) -> Child {
        self.vrdma_cmd(host)
            .args(["run", "--vnic", vnic, "--"])
            .args(cmd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// vNICs `ka` on h1 and `kb` on h2 (tenant `t`), and `vrdma check` between containers on
    /// them: the server in `kb`, then the client in `ka`. Returns (client, server).
    pub(crate) fn start_check_pair(&self) -> (Child, Child) {
        self.ok("h1", &["vnic", "create", "ka", "--tenant", "t"]);
        self.ok("h1", &["vnic", "create", "kb", "--tenant", "t", "--host", "h2"]);
        assert!(wait_until(Duration::from_secs(10), || self.host("h2").socket("kb").exists()), "{}", self.logs());
        let kb_ip = self.vnic_ip("h1", "kb");
        let server = self.run_container("h2", "kb", &[VRDMA, "check"]);
        std::thread::sleep(Duration::from_secs(2));
        let client = self.run_container("h1", "ka", &[VRDMA, "check", &kb_ip.to_string()]);
        (client, server)
    }

    /// Takes `host`'s underlay link down (as if its cable were pulled).
    pub(crate) fn cut_link(&self, host: &str) {
        ip(&["link", "set", &self.host(host).link, "down"]);
    }

    /// Brings `host`'s underlay link back.
    pub(crate) fn restore_link(&self, host: &str) {
        ip(&["link", "set", &self.host(host).link, "up"]);
    }

    /// SIGKILLs `host`'s vrdmad.
    pub(crate) fn kill_daemon(&mut self, host: &str) {
        let i = self.idx(host);
        if let Some(mut c) = self.hosts[i].daemon.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts `host`'s vrdmad again (same directories, same store).
    pub(crate) fn restart_daemon(&mut self, host: &str) {
        self.kill_daemon(host);
        let i = self.idx(host);
        self.start_daemon(i);
    }

    /// Starts `host`'s vrdmad again without waiting for it to serve (its store may be
    /// unreachable).
    pub(crate) fn respawn_daemon(&mut self, host: &str) {
        self.kill_daemon(host);
        let i = self.idx(host);
        self.spawn_daemon(i);
    }

    /// The pid of `host`'s vrdmad (`ip netns exec` execs it in place).
    pub(crate) fn daemon_pid(&self, host: &str) -> u32 {
        self.host(host).daemon.as_ref().map(|c| c.id()).unwrap_or_else(|| panic!("{host}'s vrdmad is not running"))
    }

    /// Whether `host`'s daemon process is alive.
    pub(crate) fn daemon_alive(&mut self, host: &str) -> bool {
        let i = self.idx(host);
        self.hosts[i].daemon.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// Every daemon's log and every host's network state (addresses, routes, neighbours,
    /// link and TCP counters), for failure messages: a connection between containers that
    /// failed is explained by the routes and neighbours as they were at the time.
    pub(crate) fn logs(&self) -> String {
        let mut out: String = self.hosts.iter().map(|h| format!("--- vrdmad {} ---\n{}", h.name, h.log())).collect();
        for h in &self.hosts {
            out.push_str(&format!("--- network of {} ({}) ---\n", h.name, h.netns));
            for args in [&["-br", "addr"][..], &["route"][..], &["neigh"][..], &["-s", "-br", "link"][..]] {
                let o = sh(Command::new("ip").args(["-n", &h.netns]).args(args));
                out.push_str(&format!(
                    "$ ip {}\n{}{}",
                    args.join(" "),
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                ));
            }
            let o = sh(Command::new("ip").args(["netns", "exec", &h.netns, "nstat", "-a", "-s", "-z"]));
            let keep = [
                "TcpActiveOpens",
                "TcpAttemptFails",
                "TcpRetransSegs",
                "TcpOutRsts",
                "TcpExtTCPTimeouts",
                "IpInNoRoutes",
                "IpOutNoRoutes",
                "IpInAddrErrors",
                "IpExtInNoRoutes",
                "IcmpOutDestUnreachs",
            ];
            for l in String::from_utf8_lossy(&o.stdout).lines().filter(|l| keep.iter().any(|k| l.starts_with(k))) {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for h in &mut self.hosts {
            if let Some(mut c) = h.daemon.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
            // Containers still running in the host's namespace.
            let o = sh(Command::new("ip").args(["netns", "pids", &h.netns]));
            for pid in String::from_utf8_lossy(&o.stdout).split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
                // SAFETY: kill(2) with a pid from `ip netns pids`; no memory effects.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            let _ = sh(Command::new("ip").args(["netns", "del", &h.netns]));
            let _ = sh(Command::new("ip").args(["link", "del", &h.link]));
        }
        if let Some(mut e) = self.etcd.take() {
            let _ = e.kill();
            let _ = e.wait();
        }
        let _ = sh(Command::new("ip").args(["link", "del", &self.bridge]));
        let _ = std::fs::remove_file(&self.net_lock);
        if std::env::var_os("VRDMA_KEEP_CLUSTER").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The daemons' log level: `info`, or `VRDMA_TEST_DAEMON_LOG` (e.g. `debug` to trace a failure).
fn daemon_log_level() -> String {
    std::env::var("VRDMA_TEST_DAEMON_LOG").unwrap_or_else(|_| "info".to_string())
}
