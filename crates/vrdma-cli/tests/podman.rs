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
use common::cluster::{wait_until, Cluster};
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
        self.podman_on(&self.rootfs.display().to_string(), vnic, extra, args)
    }

    /// [`Self::podman`] on root filesystem `rootfs` (`PATH:O`: an overlay over it, so
    /// writes stay out of the cached filesystem).
    fn podman_on(&self, rootfs: &str, vnic: &str, extra: &[&str], args: &[&str]) -> Command {
        let mut c = Command::new("podman");
        c.env("CONTAINERS_CONF", &self.containers_conf)
            .env("CNI_ARGS", format!("VRDMA_VNIC={vnic}"))
            .args(PODMAN_RUN)
            .args(["--network", &self.network])
            .args(["--device", &format!("vrdma.io/vnic={vnic}")])
            .args(extra)
            .args(["--rootfs", rootfs])
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
    install_cni_at(&d.dir, &d.run_dir().join("admin.sock"), &format!("vrdma-test-{}", std::process::id()))
}

/// [`install_cni`] of network `network` in `dir`, for the vrdmad of `admin_socket`.
fn install_cni_at(dir: &Path, admin_socket: &Path, network: &str) -> (String, PathBuf) {
    let network = network.to_string();
    let (conf_dir, bin_dir) = (dir.join("cni/net.d"), dir.join("cni/bin"));
    let o = Command::new(vrdma_cni())
        .args(["install", "--name", &network, "--vnic-arg", "", "--conf-dir"])
        .arg(&conf_dir)
        .arg("--bin-dir")
        .arg(&bin_dir)
        .arg("--admin-socket")
        .arg(admin_socket)
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
    let containers_conf = dir.join("containers.conf");
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

/// The escape suite's probe (tests/escape_probe.py, as tests/escape.rs runs it in `vrdma
/// run`).
const PROBE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/escape_probe.py");

/// The probe's attempts that podman's default sandbox lets through by its own policy
/// (docs/security.md, "podman's defaults"), none of which reaches vrdma: the container's
/// root filesystem is its own and writable (an overlay here; the test checks the host sees
/// nothing), it keeps podman's default capabilities (CHOWN, DAC_OVERRIDE, …; none of
/// SYS_ADMIN, NET_ADMIN, NET_RAW, SYS_PTRACE), its root may ptrace and read its own
/// processes (the only ones it sees), and podman's seccomp profile allows user namespaces
/// and, on a kernel with the x32 ABI on (not the test machines'), x32 calls.
const PODMAN_POLICY: [&str; 7] =
    ["write_host_files", "capabilities", "ptrace_attach", "process_vm_readv", "unshare_user", "clone_newuser", "x32_abi"];

/// A directory with the host's python3 (the image has none) for the probe: `bin/python3`,
/// the one library the image lacks (libexpat) in `lib/`, and `lib/python3.X` as the mount
/// point of the host's standard library.
fn python_for_probe(dir: &Path) -> (PathBuf, String) {
    let exe = std::fs::canonicalize("/usr/bin/python3").unwrap();
    let version = exe.file_name().unwrap().to_str().unwrap().to_string(); // python3.11
    let py = dir.join("py");
    std::fs::create_dir_all(py.join("bin")).unwrap();
    std::fs::create_dir_all(py.join("lib").join(&version)).unwrap();
    std::fs::copy(&exe, py.join("bin/python3")).unwrap();
    let expat = std::fs::canonicalize("/usr/lib/x86_64-linux-gnu/libexpat.so.1").unwrap();
    std::fs::copy(expat, py.join("lib/libexpat.so.1")).unwrap();
    (py, version)
}

/// The escape suite inside a podman container started as the tests above start them
/// (`--device vrdma.io/vnic=…`, the vrdma CNI network, podman's default sandbox, with the
/// probe's process and memory limits): every attempt that matters for vrdma fails — its
/// admin socket and the other vNIC's socket are out of reach, mounts cannot be undone, no
/// raw sockets, no other namespace's handles — and the host, vrdmad and the other vNIC still
/// work afterwards.
#[test]
fn podman_escape_suite() {
    let test = "podman_escape_suite";
    if !prerequisites(test) || !vrdma_test_support::require_files(test, &["/usr/bin/python3"], "python3") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("podman-escape");
    let (py, version) = python_for_probe(&s.d.dir);
    let run_dir = s.d.run_dir().display().to_string();
    let tag = format!("podman{}", std::process::id());
    let mounts = [
        format!("{}:/opt/py:ro", py.display()),
        format!("/usr/lib/{version}:/opt/py/lib/{version}:ro"),
        format!("{PROBE}:/opt/escape_probe.py:ro"),
    ];
    let mut extra = vec!["--pids-limit", "128", "--memory", "256m"];
    for m in &mounts {
        extra.extend(["-v", m.as_str()]);
    }
    // Not PID 1: the probe also attacks the container's PID 1 (the shell).
    let script =
        format!("LD_LIBRARY_PATH=$LD_LIBRARY_PATH:/opt/py/lib /opt/py/bin/python3 /opt/escape_probe.py {run_dir} pb {tag}; exit $?");
    let overlay = format!("{}:O", s.rootfs.display());
    let probe = s.podman_on(&overlay, "pa", &extra, &["sh", "-c", &script]).spawn().unwrap();
    let (ok, out) = wait_output(probe, Duration::from_secs(300));
    eprintln!("--- probe in podman\n{out}");
    assert!(ok && out.contains("PROBE done"), "the probe did not finish:\n{out}");
    let mut escaped = Vec::new();
    let mut allowed = Vec::new();
    let attempts: Vec<&str> = out.lines().filter_map(|l| l.strip_prefix("PROBE ")).filter(|l| *l != "done").collect();
    assert!(attempts.len() >= 35, "too few attempts reported:\n{out}");
    for line in attempts {
        let (name, rest) = line.split_once(' ').unwrap_or((line, ""));
        if rest.starts_with("blocked") {
            continue;
        }
        if PODMAN_POLICY.contains(&name) {
            allowed.push(line.to_string());
        } else {
            escaped.push(line.to_string());
        }
    }
    for dir in ["/etc", "/root", "/var/tmp", "/tmp", "/usr/local", "/var/lib"] {
        let p = format!("{dir}/vrdma-escape-{tag}");
        if Path::new(&p).exists() {
            let _ = std::fs::remove_file(&p);
            escaped.push(format!("{p} appeared on the host"));
        }
    }
    for line in &allowed {
        eprintln!("podman's policy allows: {line}");
    }
    assert!(escaped.is_empty(), "escapes from the podman container:\n{}\n\nfull output:\n{out}", escaped.join("\n"));
    // The cached root filesystem is untouched, vrdmad and the other vNIC still work.
    assert!(!s.rootfs.join(format!("etc/vrdma-escape-{tag}")).exists(), "the probe wrote into the cached root filesystem");
    assert_eq!(s.d.list().as_array().unwrap().len(), VNICS.len(), "vnic list after the probe");
    s.pair("pa", "pb", &["ibv_rc_pingpong", "-g", "0", "-c"], 19330, Duration::from_secs(120)).assert_ok("iters in");
}

/// Across two simulated hosts (common/cluster.rs: network namespaces, etcd, a vrdmad each):
/// podman runs in each host's network namespace (`nsenter --net`), with the host's CDI spec
/// (`vrdma cdi generate`, a file of this test's own in /var/run/cdi) and a vrdma CNI
/// network for the host's vrdmad; the same apps as above between a container on h1 and
/// one on h2 (the containers reach each other through vrdmad's host routes).
#[test]
fn podman_across_two_hosts() {
    let test = "podman_across_two_hosts";
    if !prerequisites(test) {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rootfs = rootfs();
    let Some(c) = Cluster::start(test, 2) else { return };
    c.ok("h1", &["vnic", "create", "xa", "--tenant", "t"]);
    c.ok("h1", &["vnic", "create", "xb", "--tenant", "t", "--host", "h2"]);
    assert!(wait_until(Duration::from_secs(10), || c.host("h2").socket("xb").exists()), "h2 does not serve xb:\n{}", c.logs());
    let lib = c.dir.join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::copy(dropin_so(), lib.join("libibverbs.so.1")).unwrap();
    let specs = SpecFiles(["h1", "h2"].map(|h| Path::new(CDI_DIR).join(format!("vrdma-test-{}-{h}.json", std::process::id()))).to_vec());
    let mut hosts = Vec::new();
    for ((h, vnic), spec) in [("h1", "xa"), ("h2", "xb")].into_iter().zip(&specs.0) {
        let o = c.vrdma_cmd(h).env("VRDMA_LIB_DIR", &lib).args(["cdi", "generate", "--output"]).arg(spec).output().unwrap();
        assert!(o.status.success(), "cdi generate on {h}: {}", String::from_utf8_lossy(&o.stderr));
        let host = c.host(h);
        let (network, conf) =
            install_cni_at(&host.dir, &host.run_dir().join("admin.sock"), &format!("vrdma-test-{}-{h}", std::process::id()));
        hosts.push(PodmanHost { netns: host.netns.clone(), vnic, network, conf, rootfs: rootfs.clone() });
    }
    let server_ip = c.vnic_ip("h1", "xb").to_string();
    let t = Duration::from_secs(180);
    for (cmd, port, needle) in
        [(&["ibv_rc_pingpong", "-g", "0", "-c"][..], 19340, "iters in"), (&["ib_write_bw", "-x", "0"][..], 19341, " ")]
    {
        let o = podman_pair(&hosts[1], &hosts[0], &server_ip, cmd, port, t);
        if !(o.ok_c && o.ok_s) {
            eprintln!("daemon logs:\n{}", c.logs());
        }
        o.assert_ok(needle);
    }
    for h in &hosts {
        let _ = std::fs::remove_dir(Path::new("/var/lib/cni/vrdma").join(&h.network));
    }
}

/// A simulated host's podman: its namespace, the vNIC its containers get, its CNI network.
struct PodmanHost {
    netns: String,
    vnic: &'static str,
    network: String,
    conf: PathBuf,
    rootfs: PathBuf,
}

impl PodmanHost {
    fn run(&self, args: &[&str]) -> Child {
        // nsenter rather than `ip netns exec`, whose fresh /sys has no cgroup mounts for runc.
        Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.netns))
            .arg("podman")
            .env("CONTAINERS_CONF", &self.conf)
            .env("CNI_ARGS", format!("VRDMA_VNIC={}", self.vnic))
            .args(PODMAN_RUN)
            .args(["--network", &self.network, "--device", &format!("vrdma.io/vnic={}", self.vnic), "--rootfs"])
            .arg(&self.rootfs)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }
}

/// Server `cmd -p PORT` on `srv`, client `cmd -p PORT SERVER_IP` on `cli` (retried as
/// [`Setup::pair`] retries).
fn podman_pair(srv: &PodmanHost, cli: &PodmanHost, server_ip: &str, cmd: &[&str], port: u16, limit: Duration) -> Outcome {
    let p = port.to_string();
    let mut tries = 0;
    loop {
        tries += 1;
        let server = srv.run(&[cmd, &["-p", &p]].concat());
        std::thread::sleep(Duration::from_millis(3000));
        let start = Instant::now();
        let client = cli.run(&[cmd, &["-p", &p, server_ip]].concat());
        let (ok_c, out_c) = wait_output(client, limit);
        let (ok_s, out_s) = wait_output(server, limit.saturating_sub(start.elapsed()).max(Duration::from_secs(15)));
        let retry =
            out_c.contains("Couldn't connect to") || (out_c.contains("Can't produce a report") || out_s.contains("Can't produce a report"));
        if !(ok_c && ok_s) && retry && tries < 3 {
            continue;
        }
        return Outcome { ok_c, out_c, ok_s, out_s, what: format!("{cmd:?} {}/{} across hosts", srv.vnic, cli.vnic) };
    }
}

/// This test's CDI spec files, removed at the end.
struct SpecFiles(Vec<PathBuf>);

impl Drop for SpecFiles {
    fn drop(&mut self) {
        for f in &self.0 {
            let _ = std::fs::remove_file(f);
        }
    }
}
