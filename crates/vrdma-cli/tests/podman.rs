//! podman end-to-end (issue 28): containers started by Debian's podman 4.3 with runc get
//! their vNIC from vrdmad's CDI spec alone (`--device vrdma.io/vnic=NAME`; the daemon keeps
//! /var/run/cdi/vrdma.io-vnic.json, the only directory podman 4.3 reads besides /etc/cdi) and
//! run unmodified Debian binaries over it: ibv_devinfo, ibv_rc_pingpong, perftest, and Open
//! MPI over UCX between two containers. Containers of two tenants fail to connect cleanly.
//! podman's default sandbox stays: no --privileged, no capability added.
//!
//! The root filesystem is Debian's (debootstrap --variant=minbase from the host's Debian
//! mirror, with ibverbs-utils, perftest, openmpi-bin and ucx-utils), built once and cached
//! in /var/cache/vrdma-test; the drop-in libibverbs comes from the CDI mount, nothing of vrdma
//! is in the image. The container's address is its vNIC's: podman's CNI backend attaches it
//! to vrdma0 through vrdma's CNI plugin (`--network` of a network `vrdma-cni install` wrote;
//! podman finds it and the plugin through a containers.conf of the test's own, and the vNIC
//! through `CNI_ARGS=VRDMA_VNIC=NAME`, which podman passes on to its plugins).

mod common;
use common::*;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The runs share two CPUs with everything else: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Where the root filesystem is cached between runs.
const CACHE_DIR: &str = "/var/cache/vrdma-test";
/// Packages of the root filesystem (besides minbase). Changing them needs a new
/// [`ROOTFS_NAME`], so a cached filesystem without them is not used.
const ROOTFS_PACKAGES: &str = "ibverbs-utils,perftest,openmpi-bin,ucx-utils";
const ROOTFS_NAME: &str = "podman-rootfs-1";
/// The CDI spec directory podman 4.3 reads (it has no option to name another).
const CDI_DIR: &str = "/var/run/cdi";
const BRIDGE: &str = "vrdma0";
const GATEWAY: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const PREFIX_LEN: u8 = 15;
/// `podman` and its `run` options that work on these machines (runc; cgroupfs; limits
/// within the host's): podman's default sandbox otherwise.
const PODMAN_RUN: [&str; 9] =
    ["--runtime", "runc", "--cgroup-manager=cgroupfs", "run", "--rm", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"];
/// Debian's podman configuration (defaults, the default capabilities among them).
const SYSTEM_CONTAINERS_CONF: &str = "/usr/share/containers/containers.conf";
/// The vNICs: two of tenant blue, one of tenant red.
const VNICS: [(&str, &str, Ipv4Addr); 3] = [
    ("pa", "blue", Ipv4Addr::new(198, 18, 40, 2)),
    ("pb", "blue", Ipv4Addr::new(198, 18, 40, 3)),
    ("pc", "red", Ipv4Addr::new(198, 18, 40, 4)),
];

fn prerequisites(test: &str) -> bool {
    let cni = vrdma_cni();
    vrdma_test_support::require_root(test)
        && vrdma_test_support::require_files(test, &[cni.to_str().unwrap()], "the workspace's binaries: cargo build -p vrdma-cni")
        && vrdma_test_support::require_files(
            test,
            &["/usr/bin/podman", "/usr/sbin/runc", "/usr/sbin/debootstrap"],
            "podman runc containernetworking-plugins debootstrap",
        )
}

/// The Debian mirror apt uses here (its sources), for debootstrap: no other network is
/// reachable from CI.
fn debian_mirror() -> String {
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    let mut more: Vec<PathBuf> = std::fs::read_dir("/etc/apt/sources.list.d").into_iter().flatten().flatten().map(|e| e.path()).collect();
    more.sort();
    files.extend(more);
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        for line in text.lines().map(str::trim).filter(|l| !l.starts_with('#')) {
            // One-line format ("deb URI suite …") or deb822 ("URIs: URI").
            let uri = line
                .strip_prefix("URIs:")
                .map(str::trim)
                .or_else(|| line.strip_prefix("deb ").and_then(|r| r.split_whitespace().find(|w| w.contains("://"))));
            if let Some(uri) = uri.and_then(|u| u.split_whitespace().next()) {
                if uri.trim_end_matches('/').ends_with("/debian") {
                    return uri.to_string();
                }
            }
        }
    }
    "http://deb.debian.org/debian".into()
}

/// The host's Debian release name (the root filesystem matches the host's libraries, so
/// the host-built MPI program runs in it).
fn debian_suite() -> String {
    let os = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    os.lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|s| s.trim_matches('"').to_string())
        .unwrap_or_else(|| "bookworm".into())
}

/// The cached root filesystem, made with debootstrap on first use (about 1.5 minutes).
fn rootfs() -> PathBuf {
    let suite = debian_suite();
    let dir = Path::new(CACHE_DIR).join(format!("{ROOTFS_NAME}-{suite}"));
    if dir.join("usr/bin/ib_write_bw").exists() {
        return dir;
    }
    std::fs::create_dir_all(CACHE_DIR).unwrap();
    let tmp = Path::new(CACHE_DIR).join(format!(".{ROOTFS_NAME}-{suite}.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let mirror = debian_mirror();
    eprintln!("making the containers' root filesystem in {} (debootstrap {suite} from {mirror})", dir.display());
    let started = Instant::now();
    let o = Command::new("debootstrap")
        .args(["--variant=minbase", &format!("--include={ROOTFS_PACKAGES}"), &suite])
        .arg(&tmp)
        .arg(&mirror)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    if !o.status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        panic!("debootstrap failed:\n{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    }
    // Nothing of debootstrap's downloads is needed in the containers.
    for f in std::fs::read_dir(tmp.join("var/cache/apt/archives")).into_iter().flatten().flatten() {
        if f.path().extension().is_some_and(|e| e == "deb") {
            let _ = std::fs::remove_file(f.path());
        }
    }
    if std::fs::rename(&tmp, &dir).is_err() {
        // Made meanwhile by another run.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    eprintln!("root filesystem ready in {:.0?}", started.elapsed());
    dir
}

/// A vrdmad keeping its CDI spec in /var/run/cdi, the three vNICs, the CNI network, the
/// root filesystem.
struct Setup {
    d: Daemon,
    rootfs: PathBuf,
    lib: PathBuf,
    /// The CNI network's name (`podman run --network NAME`).
    network: String,
    /// containers.conf naming the network's configuration and plugin directories.
    containers_conf: PathBuf,
}

impl Setup {
    fn new(tag: &str) -> Setup {
        let rootfs = rootfs();
        vrdma_netns::ensure_bridge(BRIDGE, GATEWAY, PREFIX_LEN).unwrap();
        // The drop-in vrdmad's spec mounts: found through VRDMA_LIB_DIR, as installed.
        let lib = std::env::temp_dir().join(format!("vrdma-podman-lib-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::copy(dropin_so(), lib.join("libibverbs.so.1")).unwrap();
        std::env::set_var("VRDMA_LIB_DIR", &lib);
        let d = Daemon::start_with(tag, &["--cdi-dir", CDI_DIR]);
        for (name, tenant, addr) in VNICS {
            d.ok(&["vnic", "create", name, "--tenant", tenant, "--ip", &format!("{addr}/{PREFIX_LEN}")]);
        }
        let (network, containers_conf) = install_cni(&d);
        let spec = std::fs::read_to_string(Path::new(CDI_DIR).join("vrdma.io-vnic.json")).unwrap();
        let run_dir = d.run_dir().display().to_string();
        assert!(spec.contains(&run_dir) && VNICS.iter().all(|(n, _, _)| spec.contains(&format!("\"name\": \"{n}\""))), "{spec}");
        Setup { d, rootfs, lib, network, containers_conf }
    }

    /// `podman run` with podman's default sandbox, `vnic` as a CDI device and on the vrdma
    /// CNI network, `extra` podman options; the command `args`.
    fn podman(&self, vnic: &str, extra: &[&str], args: &[&str]) -> Command {
        let mut c = Command::new("podman");
        c.env("CONTAINERS_CONF", &self.containers_conf)
            .env("CNI_ARGS", format!("VRDMA_VNIC={vnic}"))
            .args(PODMAN_RUN)
            .args(["--network", &self.network])
            .args(["--device", &format!("vrdma.io/vnic={vnic}")])
            .args(extra)
            .arg("--rootfs")
            .arg(&self.rootfs)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    fn run(&self, vnic: &str, args: &[&str]) -> Child {
        self.podman(vnic, &[], args).spawn().unwrap()
    }

    /// Server `cmd -p PORT` in `srv`, client `cmd -p PORT <srv's address>` in `cli`.
    fn pair(&self, srv: &str, cli: &str, cmd: &[&str], port: u16, limit: Duration) -> Outcome {
        let server_addr = VNICS.iter().find(|(n, _, _)| *n == srv).unwrap().2.to_string();
        let p = port.to_string();
        let mut tries = 0;
        loop {
            tries += 1;
            let server = self.run(srv, &[cmd, &["-p", &p]].concat());
            // The server must be listening before the client connects (podman takes a
            // second or two to start a container).
            std::thread::sleep(Duration::from_millis(3000));
            let start = Instant::now();
            let client = self.run(cli, &[cmd, &["-p", &p, &server_addr]].concat());
            let (ok_c, out_c) = wait_output(client, limit);
            let (ok_s, out_s) = wait_output(server, limit.saturating_sub(start.elapsed()).max(Duration::from_secs(15)));
            let refused = out_c.contains("Couldn't connect to");
            if !ok_c && refused && tries < 3 {
                continue; // the server was not listening yet on a loaded machine
            }
            // perftest's clock calibration fails on a loaded machine (see dropin.rs).
            let uncalibrated = |o: &str| o.contains("Can't produce a report") && o.contains("Correlation coefficient");
            if !(ok_c && ok_s) && (uncalibrated(&out_c) || uncalibrated(&out_s)) && tries < 3 {
                continue;
            }
            return Outcome { ok_c, out_c, ok_s, out_s, what: format!("{cmd:?} {srv}/{cli}") };
        }
    }
}

/// `vrdma-cni install` of a network of this test's own (named after the process), with
/// `d`'s admin socket and the vNIC named by CNI_ARGS; returns its name and a containers.conf
/// pointing podman's CNI backend at it.
fn install_cni(d: &Daemon) -> (String, PathBuf) {
    let network = format!("vrdma-test-{}", std::process::id());
    let (conf_dir, bin_dir) = (d.dir.join("cni/net.d"), d.dir.join("cni/bin"));
    let o = Command::new(vrdma_cni())
        .args(["install", "--name", &network, "--vnic-arg", "", "--conf-dir"])
        .arg(&conf_dir)
        .arg("--bin-dir")
        .arg(&bin_dir)
        .arg("--admin-socket")
        .arg(d.run_dir().join("admin.sock"))
        .output()
        .unwrap();
    assert!(o.status.success(), "vrdma-cni install: {}", String::from_utf8_lossy(&o.stderr));
    // CONTAINERS_CONF replaces the system's configuration (whose default capabilities are
    // the sandbox under test): it is the system's file with the CNI backend (Debian's podman
    // has no other) and the network's two directories.
    let system = std::fs::read_to_string(SYSTEM_CONTAINERS_CONF).unwrap_or_default();
    let ours = format!(
        "network_backend = \"cni\"\nnetwork_config_dir = \"{}\"\ncni_plugin_dirs = [\"{}\", \"/usr/lib/cni\"]\n",
        conf_dir.display(),
        bin_dir.display()
    );
    let text = match system.find("\n[network]\n") {
        Some(at) => format!("{}{ours}{}", &system[..at + "\n[network]\n".len()], &system[at + "\n[network]\n".len()..]),
        None => format!("{system}\n[network]\n{ours}"),
    };
    let containers_conf = d.dir.join("containers.conf");
    std::fs::write(&containers_conf, text).unwrap();
    (network, containers_conf)
}

/// The CNI plugin of this build (a workspace binary beside `vrdma`).
fn vrdma_cni() -> PathBuf {
    Path::new(VRDMA).with_file_name("vrdma-cni")
}

impl Drop for Setup {
    fn drop(&mut self) {
        // The spec names this daemon's directories, which go with it.
        let spec = Path::new(CDI_DIR).join("vrdma.io-vnic.json");
        if std::fs::read_to_string(&spec).is_ok_and(|s| s.contains(&self.d.run_dir().display().to_string())) {
            let _ = std::fs::remove_file(&spec);
        }
        let _ = std::fs::remove_dir_all(&self.lib);
        // The plugin's state directory of this network, once it holds no attachment.
        let _ = std::fs::remove_dir(Path::new("/var/lib/cni/vrdma").join(&self.network));
    }
}

struct Outcome {
    ok_c: bool,
    out_c: String,
    ok_s: bool,
    out_s: String,
    what: String,
}

impl Outcome {
    fn assert_ok(&self, needle: &str) {
        assert!(
            self.ok_c && self.ok_s && self.out_c.contains(needle) && self.out_s.contains(needle),
            "{} failed\n--- client:\n{}\n--- server:\n{}",
            self.what,
            self.out_c,
            self.out_s
        );
        let result = |l: &&str| l.contains(needle) && (needle != " " || l.trim_start().starts_with(|c: char| c.is_ascii_digit()));
        eprintln!("ok: {}: {}", self.what, self.out_c.lines().rfind(result).unwrap_or_default().trim());
    }

    fn assert_refused(&self) {
        assert!(!self.ok_c && !self.ok_s, "{}: a cross-tenant run must fail\n{}\n{}", self.what, self.out_c, self.out_s);
        assert!(
            !self.out_c.contains("TIMED OUT") && !self.out_s.contains("TIMED OUT"),
            "{}: hung\n{}\n{}",
            self.what,
            self.out_c,
            self.out_s
        );
        assert!(
            self.out_c.contains("may not connect to tenant") || self.out_s.contains("may not connect to tenant"),
            "{}: no clear error\n{}\n{}",
            self.what,
            self.out_c,
            self.out_s
        );
        eprintln!("ok: {}: refused", self.what);
    }
}

/// The effective capabilities a container's command has (`CapEff` of /proc/self/status).
fn cap_eff(out: &str) -> u64 {
    let hex = out.lines().find_map(|l| l.strip_prefix("CapEff:")).unwrap_or_else(|| panic!("no CapEff in\n{out}"));
    u64::from_str_radix(hex.trim(), 16).unwrap()
}

#[test]
fn podman_container_gets_its_vnic_and_nothing_more() {
    if !prerequisites("podman_container_gets_its_vnic_and_nothing_more") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("podman-devinfo");
    let script = "ibv_devinfo && grep CapEff /proc/self/status && echo run: $(ls -A /run/vrdma) && ls -l /dev/infiniband \
                  && echo ld: $LD_LIBRARY_PATH && cat /proc/net/fib_trie";
    let (ok, out) = wait_output(s.run("pa", &["sh", "-c", script]), Duration::from_secs(60));
    assert!(ok, "{out}");
    assert!(out.contains("hca_id:\tvrdma_pa") && out.contains("PORT_ACTIVE"), "ibv_devinfo sees the vNIC:\n{out}");
    assert!(out.contains("run: control.sock\n"), "the vNIC's directory, no admin socket, no other vNIC:\n{out}");
    assert!(out.lines().any(|l| l.starts_with("crw-rw-rw-") && l.contains("1, 3") && l.ends_with("vrdma_pa")), "device node:\n{out}");
    assert!(out.contains("ld: /opt/vrdma/lib\n"), "{out}");
    assert!(out.contains("198.18.40.2\n") && out.contains("/32 host LOCAL"), "the container's address is its vNIC's:\n{out}");
    // podman's default sandbox: the same capabilities as a container without the device,
    // and none of those that would matter here.
    let plain = Command::new("podman")
        .args(PODMAN_RUN)
        .args(["--network", "none", "--rootfs"])
        .arg(&s.rootfs)
        .args(["grep", "CapEff", "/proc/self/status"])
        .output()
        .unwrap();
    let plain = String::from_utf8_lossy(&plain.stdout).into_owned();
    assert_eq!(cap_eff(&out), cap_eff(&plain), "the vNIC adds no capability");
    const SYS_ADMIN: u32 = 21;
    const NET_ADMIN: u32 = 12;
    const IPC_LOCK: u32 = 14;
    const SYS_PTRACE: u32 = 19;
    for cap in [SYS_ADMIN, NET_ADMIN, IPC_LOCK, SYS_PTRACE] {
        assert_eq!(cap_eff(&out) & (1 << cap), 0, "capability {cap} in the default sandbox: {:#x}", cap_eff(&out));
    }
    eprintln!("ok: podman container: ibv_devinfo, its vNIC only, CapEff {:#x}", cap_eff(&out));
}

#[test]
fn podman_rc_pingpong() {
    if !prerequisites("podman_rc_pingpong") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("podman-pingpong");
    s.pair("pa", "pb", &["ibv_rc_pingpong", "-g", "0", "-c"], 19300, Duration::from_secs(120)).assert_ok("iters in");
}

#[test]
fn podman_perftest() {
    if !prerequisites("podman_perftest") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("podman-perftest");
    let t = Duration::from_secs(300);
    for (cmd, port) in [(&["ib_write_bw", "-x", "0", "-a"][..], 19310), (&["ib_send_lat", "-x", "0"][..], 19311)] {
        let o = s.pair("pa", "pb", cmd, port, t);
        o.assert_ok(" ");
        assert!(o.out_c.lines().any(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit())), "no results:\n{}", o.out_c);
    }
}

/// Open MPI (the image's, unmodified) over UCX's rc_verbs on the vNICs, one rank in each
/// of two podman containers: mpirun on the host starts them through an rsh agent that is
/// `podman run` (their daemons call home over the container network).
#[test]
fn podman_mpi_over_ucx() {
    if !prerequisites("podman_mpi_over_ucx") || mpi_missing("podman_mpi_over_ucx") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("podman-mpi");
    let exe = build_mpi_pingpong(&s.d.dir);
    let exe_dir = exe.parent().unwrap().display();
    // The agent: `podman run` of the host named (a vNIC) on the vrdma network, the
    // program's directory mounted read-only at the same path.
    let agent = s.d.dir.join("podman-rsh");
    write_script(
        &agent,
        &format!(
            "#!/bin/sh\nhost=$1; shift\nexport CONTAINERS_CONF={} CNI_ARGS=VRDMA_VNIC=$host\n\
             exec podman {} --network {} --device \"vrdma.io/vnic=$host\" -v {exe_dir}:{exe_dir}:ro --rootfs {} sh -c \"$*\"\n",
            s.containers_conf.display(),
            PODMAN_RUN.join(" "),
            s.network,
            s.rootfs.display()
        ),
    );
    let mut cmd = vec![
        "--mca",
        "plm_rsh_agent",
        agent.to_str().unwrap(),
        "--host",
        "pa,pb",
        "-np",
        "2",
        "--bind-to",
        "none",
        "--mca",
        "oob_tcp_if_include",
        "198.18.0.0/15",
    ];
    cmd.extend_from_slice(&MPI_OVER_UCX);
    cmd.push(exe.to_str().unwrap());
    let mpirun = Command::new("mpirun").args(&cmd).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let (ok, out) = wait_output(mpirun, Duration::from_secs(300));
    check_mpi_pingpong("across two podman containers", ok, &out, &["pa", "pb"], &std::fs::read_to_string(&agent).unwrap());
}

#[test]
fn podman_cross_tenant_runs_fail_cleanly() {
    if !prerequisites("podman_cross_tenant_runs_fail_cleanly") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("podman-tenants");
    let t = Duration::from_secs(90);
    s.pair("pa", "pc", &["ibv_rc_pingpong", "-g", "0"], 19320, t).assert_refused();
    s.pair("pa", "pc", &["ib_send_lat", "-x", "0"], 19321, t).assert_refused();
    s.pair("pa", "pc", &["ib_write_bw", "-x", "0"], 19322, t).assert_refused();
    let refused = s.d.vnic("pa")["counters"]["refused_connections"].as_u64().unwrap();
    assert!(refused >= 3, "refusals are counted: {refused}");
}
