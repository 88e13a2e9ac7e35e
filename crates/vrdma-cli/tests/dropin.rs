//! Unmodified Debian binaries (ibverbs-utils, perftest) over vrdma's drop-in libibverbs.so.1
//! (crates/vrdma-ibverbs), server in one `vrdma run` container and client in another, GID
//! index 0 on the container network (198.18.30.0/24).
//!
//! The drop-in is the cdylib of the workspace build (`cargo build --release --workspace`, as
//! scripts/test.sh does); the containers get it through `VRDMA_LIB_DIR`, except in the test
//! of scripts/install-dropin.sh, where `vrdma run` finds the installed copy by itself.

mod common;
use common::*;

use std::path::PathBuf;
use std::process::Child;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The runs share two CPUs with everything else: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const A: &str = "198.18.30.2";

/// Whether `test` must be skipped (root and the Debian binaries are missing; under CI that
/// fails the test instead).
fn missing_prerequisites(test: &str) -> bool {
    !vrdma_test_support::require_root(test)
        || !vrdma_test_support::require_programs(test, &["ibv_devices", "ibv_rc_pingpong", "ib_write_bw"], "ibverbs-utils and perftest")
}

struct Setup {
    d: Daemon,
    lib: PathBuf,
}

impl Setup {
    fn new(tag: &str) -> Setup {
        let d = Daemon::start(tag);
        let lib = d.dir.join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::copy(dropin_so(), lib.join("libibverbs.so.1")).unwrap();
        d.ok(&["vnic", "create", "da", "--tenant", "blue", "--ip", "198.18.30.2/15"]);
        d.ok(&["vnic", "create", "db", "--tenant", "blue", "--ip", "198.18.30.3/15"]);
        d.ok(&["vnic", "create", "dc", "--tenant", "red", "--ip", "198.18.30.4/15"]);
        Setup { d, lib }
    }

    /// `vrdma run --vnic VNIC [env…] -- ARGS` with the drop-in on the library path.
    fn run(&self, vnic: &str, env: &[&str], args: &[&str]) -> Child {
        self.d
            .vrdma()
            .env("VRDMA_LIB_DIR", &self.lib)
            .args(["run", "--vnic", vnic])
            .args(env)
            .arg("--")
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Server `cmd -p PORT` in `srv`, client `cmd -p PORT A` in `cli`; returns both outcomes.
    fn pair(&self, srv: &str, cli: &str, env: &[&str], cmd: &[&str], port: u16, limit: Duration) -> Outcome {
        let p = port.to_string();
        let mut tries = 0;
        loop {
            tries += 1;
            let server = self.run(srv, env, &[cmd, &["-p", &p]].concat());
            // The server must be listening before the client connects.
            std::thread::sleep(Duration::from_millis(1000));
            let start = Instant::now();
            let client = self.run(cli, env, &[cmd, &["-p", &p, A]].concat());
            let (ok_c, out_c) = wait_output(client, limit);
            let (ok_s, out_s) = wait_output(server, limit.saturating_sub(start.elapsed()).max(Duration::from_secs(15)));
            let refused = out_c.contains("Couldn't connect to") || out_c.contains("Couldn't connect to remote");
            if !ok_c && refused && out_s.contains("TIMED OUT") && tries < 3 {
                continue; // the server was not listening yet on a loaded machine
            }
            // perftest fits the CPU's clock rate over short sleeps before each report and
            // gives up when the fit is poor ("Correlation coefficient r^2: 0.87 < 0.9", then
            // "Can't produce a report"): a loaded shared machine, not the transfers.
            let uncalibrated = |o: &str| o.contains("Can't produce a report") && o.contains("Correlation coefficient");
            if !(ok_c && ok_s) && (uncalibrated(&out_c) || uncalibrated(&out_s)) && tries < 3 {
                eprintln!("{cmd:?}: perftest could not calibrate its clock on this loaded machine; again");
                continue;
            }
            return Outcome { ok_c, out_c, ok_s, out_s, what: format!("{cmd:?} {env:?}") };
        }
    }
}

#[test]
fn devices_and_devinfo_show_the_vnic() {
    if missing_prerequisites("devices_and_devinfo_show_the_vnic") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("dropin-dev");
    let (ok, out) = wait_output(s.run("da", &[], &["ibv_devices"]), Duration::from_secs(30));
    assert!(ok && out.contains("vrdma_da"), "{out}");
    let (ok, out) = wait_output(s.run("da", &[], &["ibv_devinfo", "-v"]), Duration::from_secs(30));
    assert!(ok, "{out}");
    for want in [
        "hca_id:\tvrdma_da",
        "PORT_ACTIVE (4)",
        "link_layer:\t\tEthernet",
        "active_mtu:\t\t4096 (5)",
        "GID[  0]:\t\t::ffff:198.18.30.2, RoCE v2",
    ] {
        assert!(out.contains(want), "ibv_devinfo -v lacks {want:?}:\n{out}");
    }
    // A process outside any container, with no vNIC socket, sees no device.
    let o = std::process::Command::new("ibv_devices")
        .env("LD_LIBRARY_PATH", &s.lib)
        .env("VRDMA_SOCKET", s.d.dir.join("nonexistent.sock"))
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&o.stdout).contains("vrdma_"));
}

#[test]
fn rc_pingpong() {
    if missing_prerequisites("rc_pingpong") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("dropin-rc");
    let t = Duration::from_secs(120);
    let mut port = 18900;
    for size in ["1", "4096", "1048576"] {
        for extra in [&[][..], &["-e"][..], &["-c"][..], &["-e", "-c"][..]] {
            port += 1;
            let cmd = [&["ibv_rc_pingpong", "-g", "0", "-s", size, "-n", "1000"][..], extra].concat();
            s.pair("da", "db", &[], &cmd, port, t).assert_ok("1000 iters in");
        }
    }
    // The new send API (ibv_qp_to_qp_ex, ibv_wr_*), polling and sleeping.
    s.pair("da", "db", &[], &["ibv_rc_pingpong", "-g", "0", "-N", "-s", "4096", "-n", "1000", "-c"], 18950, t).assert_ok("1000 iters in");
    s.pair("da", "db", &[], &["ibv_rc_pingpong", "-g", "0", "-N", "-e", "-n", "1000"], 18951, t).assert_ok("1000 iters in");
}

#[test]
fn srq_and_ud_pingpong() {
    if missing_prerequisites("srq_and_ud_pingpong") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("dropin-srq-ud");
    let t = Duration::from_secs(120);
    s.pair("da", "db", &[], &["ibv_srq_pingpong", "-g", "0"], 18960, t).assert_ok("1000 iters in");
    s.pair("da", "db", &[], &["ibv_srq_pingpong", "-g", "0", "-e", "-s", "65536"], 18961, t).assert_ok("1000 iters in");
    s.pair("da", "db", &[], &["ibv_ud_pingpong", "-g", "0"], 18962, t).assert_ok("1000 iters in");
    s.pair("da", "db", &[], &["ibv_ud_pingpong", "-g", "0", "-e", "-s", "4000", "-c"], 18963, t).assert_ok("1000 iters in");
}

/// scripts/bench-dropin.sh's C loops (vrdma perf's write_lat in C against libibverbs, with
/// both posting APIs and as perftest runs it, and its send_lat) build and run through the
/// drop-in, so the benchmark stays usable.
#[test]
fn write_lat_loop_runs_through_the_dropin() {
    if missing_prerequisites("write_lat_loop_runs_through_the_dropin") {
        return;
    }
    if !vrdma_test_support::require_files("write_lat_loop_runs_through_the_dropin", &["/usr/include/infiniband/verbs.h"], "libibverbs-dev")
    {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("dropin-loop");
    let exe = std::env::temp_dir().join(format!("write_lat_loop-{}", std::process::id()));
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../vrdma-ibverbs/bench/write_lat_loop.c");
    let cc = std::process::Command::new("gcc").args(["-O2", "-o"]).arg(&exe).arg(&src).arg("-libverbs").output().unwrap();
    assert!(cc.status.success(), "gcc: {}", String::from_utf8_lossy(&cc.stderr));
    let exe_s = exe.to_str().unwrap();
    for (i, extra) in [&[][..], &["-w"][..], &["-S"][..], &["-I", "0", "-P"][..]].into_iter().enumerate() {
        let cmd = [&[exe_s][..], extra, &["-n", "2000", "-s", "8"][..]].concat();
        let o = s.pair("da", "db", &[], &cmd, 18970 + i as u16, Duration::from_secs(60));
        assert!(
            o.ok_c && o.ok_s && o.out_c.contains("lat_p50_us"),
            "{} failed\n--- client:\n{}\n--- server:\n{}",
            o.what,
            o.out_c,
            o.out_s
        );
        eprintln!("ok: {}: {}", o.what, o.out_c.trim());
    }
    let _ = std::fs::remove_file(&exe);
}

/// UCX (the transport layer under Open MPI, MPICH and others) on the vNIC through its own
/// verbs transports, unmodified: it finds the device (it requires
/// `/dev/infiniband/<dev_name>`, which `vrdma run` provides), moves checked data over
/// `rc_verbs` (io_demo -q, connected over TCP, then every transfer verified), and runs its
/// benchmarks over `rc_verbs` (eager, rendezvous through RDMA READ, put, get, atomics;
/// its flush is a zero-length RDMA WRITE to rkey 0) and `ud_verbs`.
#[test]
fn ucx_runs_over_the_vnic_with_its_verbs_transports() {
    if missing_prerequisites("ucx_runs_over_the_vnic_with_its_verbs_transports") {
        return;
    }
    if !vrdma_test_support::require_programs(
        "ucx_runs_over_the_vnic_with_its_verbs_transports",
        &["ucx_info", "ucx_perftest", "io_demo"],
        "ucx-utils",
    ) {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("dropin-ucx");
    let t = Duration::from_secs(120);

    let (ok, out) = wait_output(s.run("da", &[], &["ucx_info", "-d"]), Duration::from_secs(60));
    assert!(ok, "{out}");
    let md =
        out.split("# Memory domain: ").find(|m| m.starts_with("vrdma_da")).unwrap_or_else(|| panic!("UCX does not list the vNIC:\n{out}"));
    for tl in ["Transport: rc_verbs", "Transport: ud_verbs", "Device: vrdma_da:1"] {
        assert!(md.contains(tl), "UCX lists the vNIC without {tl:?}:\n{md}");
    }

    // Checked data over rc_verbs (tcp only for the connection: UCX's sockaddr wireup).
    let env = ["-e", "UCX_TLS=rc_verbs,ud_verbs,self,tcp", "-e", "UCX_LOG_LEVEL=info"];
    let mut server = s.run("da", &env, &["io_demo", "-q", "-i", "2000", "-d", "1:1048576", "-p", "19300"]);
    std::thread::sleep(Duration::from_millis(1500));
    let client = s.run("db", &env, &["io_demo", "-q", "-i", "2000", "-d", "1:1048576", "-o", "read,write", "-p", "19300", A]);
    let (ok, out) = wait_output(client, t);
    let _ = server.kill();
    let (_, out_s) = wait_output(server, Duration::from_secs(15));
    assert!(ok && out.contains("Client exit with status 'OK'"), "io_demo -q failed\n--- client:\n{out}\n--- server:\n{out_s}");
    assert!(out.contains("tag(rc_verbs/vrdma_db:1)"), "io_demo did not move its data over rc_verbs:\n{out}");
    eprintln!("ok: io_demo -q over rc_verbs: {}", out.lines().rfind(|l| l.contains("total min")).unwrap_or_default().trim());

    let mut port = 19310;
    for (tls, test, extra) in [
        ("rc_verbs,ud_verbs,self", "tag_lat", &["-n", "10000"][..]),
        ("rc_verbs,ud_verbs,self", "tag_bw", &["-s", "1048576", "-n", "1000"][..]),
        ("rc_verbs,ud_verbs,self", "ucp_put_bw", &["-s", "65536", "-n", "5000"][..]),
        ("rc_verbs,ud_verbs,self", "ucp_get", &["-s", "65536", "-n", "5000"][..]),
        ("rc_verbs,ud_verbs,self", "ucp_add", &["-n", "5000"][..]),
        ("ud_verbs,self", "tag_lat", &["-n", "10000"][..]),
        ("ud_verbs,self", "tag_bw", &["-s", "65536", "-n", "1000"][..]),
    ] {
        port += 1;
        let env = ["-e".to_string(), format!("UCX_TLS={tls}")];
        let env: Vec<&str> = env.iter().map(String::as_str).collect();
        let cmd = [&["ucx_perftest", "-t", test][..], extra].concat();
        // (The server prints no figures.)
        let o = s.pair("da", "db", &env, &cmd, port, t);
        assert!(o.ok_c && o.ok_s && o.out_c.contains("Final:"), "{} failed\n--- client:\n{}\n--- server:\n{}", o.what, o.out_c, o.out_s);
        eprintln!("ok: {}: {}", o.what, o.out_c.lines().rfind(|l| l.starts_with("Final:")).unwrap_or_default());
    }
}

/// MPI, unmodified: Debian's Open MPI, its UCX messaging layer restricted to `rc_verbs` on
/// the vNIC (no shared memory, no TCP for data), runs a program built with its mpicc:
/// ping-pong from 1 B to 4 MiB with every byte checked, a two-way nonblocking exchange,
/// allreduce and broadcast with known results (crates/vrdma-ibverbs/tests/mpi_pingpong.c).
/// Once with both ranks in one container, once with one rank in each of two containers,
/// which mpirun on the host starts through `vrdma run` (its rsh agent).
#[test]
fn mpi_runs_over_the_vnic() {
    if missing_prerequisites("mpi_runs_over_the_vnic") || mpi_missing("mpi_runs_over_the_vnic") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("dropin-mpi");
    let exe = build_mpi_pingpong(&s.d.dir);

    // Two ranks in one container.
    let mut cmd = vec!["mpirun", "-np", "2"];
    cmd.extend_from_slice(&MPI_OVER_UCX);
    cmd.push(exe.to_str().unwrap());
    let (ok, out) = wait_output(s.run("da", &[], &cmd), Duration::from_secs(180));
    check_mpi_pingpong("in one container", ok, &out, &["da"], "");

    // One rank in each of two containers: mpirun on the host reaches them through an rsh
    // agent that is `vrdma run` (its daemons call home over the container network).
    let agent = s.d.dir.join("vrdma-rsh");
    write_script(&agent, &format!("#!/bin/sh\nhost=$1; shift\nexec {VRDMA} run --vnic \"$host\" -- sh -c \"$*\"\n"));
    let mut cmd = vec![
        "--mca",
        "plm_rsh_agent",
        agent.to_str().unwrap(),
        "--host",
        "da,db",
        "-np",
        "2",
        // Each container's orted would bind its one rank to "its" first core: the same one.
        "--bind-to",
        "none",
        "--mca",
        "oob_tcp_if_include",
        "198.18.0.0/15",
    ];
    cmd.extend_from_slice(&MPI_OVER_UCX);
    cmd.push(exe.to_str().unwrap());
    // The agent's `vrdma run` finds this test's vrdmad and drop-in through the environment.
    let mpirun = std::process::Command::new("mpirun")
        .args(&cmd)
        .env("VRDMA_LIB_DIR", &s.lib)
        .envs(s.d.vrdma().get_envs().filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned()))))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (ok, out) = wait_output(mpirun, Duration::from_secs(180));
    check_mpi_pingpong("across two containers", ok, &out, &["da", "db"], "");
}

fn perftest(s: &Setup, test: &str, extra: &[&str], port: u16) {
    let t = Duration::from_secs(300);
    let cmd = [&[test, "-x", "0"][..], extra].concat();
    // Default mode on a device perftest recognises: the ibv_wr_* API.
    let o = s.pair("da", "db", &CONNECTX5, &cmd, port, t);
    o.assert_ok(" ");
    assert!(o.out_c.contains("ibv_wr* API     : ON"), "{}", o.out_c);
    assert!(o.out_c.lines().any(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit())), "no results:\n{}", o.out_c);
    // The classic ibv_post_send.
    let old = [&cmd[..], &["--use_old_post_send"]].concat();
    let o = s.pair("da", "db", &[], &old, port + 1, t);
    o.assert_ok(" ");
    assert!(o.out_c.contains("ibv_wr* API     : OFF"), "{}", o.out_c);
    assert!(o.out_c.lines().any(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit())), "no results:\n{}", o.out_c);
}

#[test]
fn perftest_latency() {
    if missing_prerequisites("perftest_latency") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("dropin-lat");
    perftest(&s, "ib_send_lat", &["-a"], 19000);
    perftest(&s, "ib_write_lat", &["-a"], 19002);
    perftest(&s, "ib_read_lat", &["-a"], 19004);
    // perftest refuses -a for atomics ("Message size cannot be changed for Atomic tests").
    perftest(&s, "ib_atomic_lat", &[], 19006);
}

#[test]
fn perftest_bandwidth() {
    if missing_prerequisites("perftest_bandwidth") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("dropin-bw");
    let mut port = 19100;
    for test in ["ib_send_bw", "ib_write_bw", "ib_read_bw", "ib_atomic_bw"] {
        let all: &[&str] = if test == "ib_atomic_bw" { &[] } else { &["-a"] };
        perftest(&s, test, all, port);
        perftest(&s, test, &["-q", "8"], port + 2);
        port += 4;
    }
}

#[test]
fn cross_tenant_runs_fail_cleanly() {
    if missing_prerequisites("cross_tenant_runs_fail_cleanly") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("dropin-tenants");
    let t = Duration::from_secs(60);
    s.pair("da", "dc", &[], &["ibv_rc_pingpong", "-g", "0"], 19200, t).assert_refused();
    // UD: ibv_create_ah resolves the destination GID and is refused.
    let o = s.pair("da", "dc", &[], &["ibv_ud_pingpong", "-g", "0"], 19201, t);
    o.assert_refused();
    assert!(o.out_s.contains("Failed to create AH"), "{}", o.out_s);
    s.pair("da", "dc", &[], &["ib_send_lat", "-x", "0"], 19202, t).assert_refused();
    s.pair("da", "dc", &[], &["ib_write_bw", "-x", "0"], 19203, t).assert_refused();
    s.pair("da", "dc", &CONNECTX5, &["ib_read_lat", "-x", "0"], 19204, t).assert_refused();
    // ibv_srq_pingpong: the server's modify_qp is refused and it exits non-zero. (Its client
    // then spins forever: srq_pingpong.c's pp_client_exch_dest loops on read() == 0 when the
    // server closes the socket — an application bug, the same on hardware.)
    let o = s.pair("da", "dc", &[], &["ibv_srq_pingpong", "-g", "0"], 19205, Duration::from_secs(15));
    assert!(!o.ok_s && !o.out_s.contains("TIMED OUT") && o.out_s.contains("may not connect to tenant"), "{}", o.out_s);
    let refused = s.d.vnic("da")["counters"]["refused_connections"].as_u64().unwrap();
    assert!(refused >= 5, "refusals are counted: {refused}");
}

#[test]
fn installed_dropin_is_found_by_vrdma_run() {
    if missing_prerequisites("installed_dropin_is_found_by_vrdma_run") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new("dropin-install");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/install-dropin.sh");
    let target = PathBuf::from(VRDMA).parent().unwrap().parent().unwrap().to_path_buf();
    let so = dropin_so();
    // Install from the build this test uses (no cargo run inside the test).
    let release_so = target.join("release").join("libvrdma_ibverbs.so");
    if so != release_so {
        std::fs::copy(&so, &release_so).unwrap();
    }
    let o = std::process::Command::new(&script).arg("--no-build").env("CARGO_TARGET_DIR", &target).output().unwrap();
    assert!(o.status.success(), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(target.join("lib/vrdma/libibverbs.so.1").exists());
    // No VRDMA_LIB_DIR: `vrdma run` finds <exe>/../lib/vrdma itself, binds it at
    // /run/vrdma-lib and puts that on the library path.
    let c =
        s.d.vrdma()
            .args(["run", "--vnic", "db", "--", "sh", "-c", "echo LD=$LD_LIBRARY_PATH; ibv_devices"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
    let (ok, out) = wait_output(c, Duration::from_secs(30));
    assert!(ok && out.contains("vrdma_db") && out.contains("LD=/run/vrdma-lib:"), "{out}");
}
