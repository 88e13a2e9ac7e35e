//! Containers made by `vrdma run`: data-checked RDMA between two of them, tenant isolation,
//! the namespace view inside, and vrdmad staying off the data path.

mod common;
use common::*;
use std::time::Duration;
use vrdma_test_support::{require_root, skip};

#[test]
fn containers_exchange_checked_data_and_tenants_are_isolated() {
    if !require_root("containers_exchange_checked_data_and_tenants_are_isolated") {
        return;
    }
    let d = Daemon::start("containers");
    d.ok(&["vnic", "create", "ca", "--tenant", "blue", "--ip", "198.18.10.2/15"]);
    d.ok(&["vnic", "create", "cb", "--tenant", "blue", "--ip", "198.18.10.3/15"]);
    d.ok(&["vnic", "create", "cc", "--tenant", "red", "--ip", "198.18.10.4/15"]);
    // The inside of a container: its address, its vNIC directory and nothing else of vrdma.
    let (ok, out) = wait_output(
        d.container(
            "ca",
            &["sh", "-c", "ip -4 -o addr show eth0; ls -A /run/vrdma; echo pid=$$; hostname; ls -A /var/lib/vrdma 2>/dev/null | wc -l"],
        ),
        Duration::from_secs(20),
    );
    assert!(ok, "{out}");
    assert!(out.contains("198.18.10.2/15"), "{out}");
    assert!(out.contains("control.sock") && !out.contains("admin.sock") && !out.contains("vnics"), "{out}");
    assert!(out.contains("pid=1") && out.contains("\nca\n"), "{out}");

    let server = d.container("ca", &[VRDMA, "check", "-p", "18600"]);
    std::thread::sleep(Duration::from_millis(300));
    let (ok_c, out_c) = wait_output(d.container("cb", &[VRDMA, "check", "-p", "18600", "198.18.10.2"]), Duration::from_secs(60));
    let (ok_s, out_s) = wait_output(server, Duration::from_secs(10));
    assert!(ok_c && ok_s, "client:\n{out_c}\nserver:\n{out_s}");
    for op in ["SEND/RECV", "RDMA WRITE", "RDMA READ", "ATOMIC"] {
        assert!(out_c.contains(&op.to_string()), "{out_c}");
    }

    // Across tenants: modify_qp(RTR) fails with a clear error, nobody hangs.
    let server = d.container("ca", &[VRDMA, "check", "-p", "18601"]);
    std::thread::sleep(Duration::from_millis(300));
    let (ok_c, out_c) = wait_output(d.container("cc", &[VRDMA, "check", "-p", "18601", "198.18.10.2"]), Duration::from_secs(30));
    let (ok_s, out_s) = wait_output(server, Duration::from_secs(30));
    assert!(!ok_c && !ok_s, "cross-tenant exchange must fail:\n{out_c}\n{out_s}");
    assert!(
        out_c.contains("tenant red may not connect to tenant blue") || out_s.contains("tenant blue may not connect to tenant red"),
        "client:\n{out_c}\nserver:\n{out_s}"
    );
    assert!(!out_c.contains("TIMED OUT") && !out_s.contains("TIMED OUT"), "{out_c}\n{out_s}");
    let refused = d.vnic("cc")["counters"]["refused_connections"].as_u64().unwrap()
        + d.vnic("ca")["counters"]["refused_connections"].as_u64().unwrap();
    assert!(refused >= 1, "refusals are counted");
    assert!(d.log().contains("refused connection"), "refusals are logged: {}", d.log());

    // A plain program is PID 1 of its container, which the kernel shields from SIGTERM; a
    // SIGTERM to `vrdma run` (as `timeout` sends) still stops it, SIGKILL after a grace period.
    let sleeper = d.container("ca", &["sleep", "60"]);
    std::thread::sleep(Duration::from_millis(500));
    let t0 = std::time::Instant::now();
    // SAFETY: kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(sleeper.id() as i32, libc::SIGTERM) }, 0);
    let (ok, out) = wait_output(sleeper, Duration::from_secs(20));
    let took = t0.elapsed();
    assert!(!ok && !out.contains("TIMED OUT"), "{out}");
    assert!(took < Duration::from_secs(10), "vrdma run took {took:?} to stop after SIGTERM");
}

#[test]
fn vrdmad_stays_off_the_data_path() {
    if !require_root("vrdmad_stays_off_the_data_path") {
        return;
    }
    let d = Daemon::start("cpu");
    d.ok(&["vnic", "create", "pa", "--tenant", "t", "--ip", "198.18.11.2/15"]);
    d.ok(&["vnic", "create", "pb", "--tenant", "t", "--ip", "198.18.11.3/15"]);
    let server = d.container("pa", &[VRDMA, "perf", "write_bw", "-s", "65536", "-p", "18602"]);
    std::thread::sleep(Duration::from_millis(300));
    let client = d.container("pb", &[VRDMA, "perf", "write_bw", "-s", "65536", "-D", "10", "--json", "-p", "18602", "198.18.11.2"]);
    // Measure from after connection setup until the end of the 10-second run.
    std::thread::sleep(Duration::from_millis(700));
    let before = d.cpu_time();
    let (ok_c, out_c) = wait_output(client, Duration::from_secs(60));
    let after = d.cpu_time();
    let (ok_s, out_s) = wait_output(server, Duration::from_secs(10));
    assert!(ok_c && ok_s, "{out_c}\n{out_s}");
    let row: serde_json::Value = serde_json::from_str(out_c.lines().find(|l| l.starts_with('{')).expect("json row")).unwrap();
    let mbps = row["bw_avg_MBps"].as_f64().unwrap();
    assert!(mbps > 100.0, "bandwidth {mbps} MB/s");
    let used = after - before;
    eprintln!("vrdmad used {used:?} of CPU during a ~10 s write_bw run at {mbps:.0} MB/s");
    assert!(used < Duration::from_millis(100), "vrdmad used {used:?} (>1% of one core over 10 s)");
}

/// Memory vrdma cannot share (a file mapping, huge pages) takes the copying fallback: every
/// test of `vrdma perf`, all sizes, data checked, between two containers.
#[test]
fn file_backed_and_hugetlb_buffers_work_through_the_copying_fallback() {
    if !require_root("file_backed_and_hugetlb_buffers_work_through_the_copying_fallback") {
        return;
    }
    let d = Daemon::start("copied");
    d.ok(&["vnic", "create", "fa", "--tenant", "t", "--ip", "198.18.12.2/15"]);
    d.ok(&["vnic", "create", "fb", "--tenant", "t", "--ip", "198.18.12.3/15"]);
    let run = |test: &str, mem: &str, port: &str, sizes: &[&str]| {
        let mut sv = vec![VRDMA, "perf", test, "--mem", mem, "--check", "-n", "20", "-p", port];
        sv.extend_from_slice(sizes);
        let server = d.container("fa", &sv);
        std::thread::sleep(Duration::from_millis(300));
        let mut cv = sv.clone();
        cv.push("198.18.12.2");
        let (ok_c, out_c) = wait_output(d.container("fb", &cv), Duration::from_secs(120));
        let (ok_s, out_s) = wait_output(server, Duration::from_secs(20));
        assert!(ok_c && ok_s, "{test} --mem {mem}:\nclient:\n{out_c}\nserver:\n{out_s}");
        assert!(out_c.contains("all verified"), "{test} --mem {mem}: {out_c}");
    };
    for (i, test) in ["send_lat", "write_lat", "read_lat", "atomic_lat", "send_bw", "write_bw", "read_bw", "atomic_bw"].iter().enumerate() {
        let port = format!("{}", 18610 + i);
        let sizes: &[&str] = if test.starts_with("atomic") { &[] } else { &["-a"] };
        run(test, "file", &port, sizes);
    }
    // As scripts/bench-dropin.sh runs them beside perftest: nothing inline, no PAUSE in the wait.
    run("write_lat", "file", "18622", &["-s", "8", "-I", "0", "--spin", "plain"]);
    run("send_lat", "file", "18623", &["-a", "-I", "0"]);
    let copied = d.vnic("fa")["counters"]["copied_mrs"].as_u64().unwrap() + d.vnic("fb")["counters"]["copied_mrs"].as_u64().unwrap();
    assert!(copied >= 16, "every run registered through the copying fallback: {copied}");
    // Huge pages: reserve a few if the machine has none (root), as an application would.
    let knob = "/proc/sys/vm/nr_hugepages";
    let Ok(before) = std::fs::read_to_string(knob) else {
        skip(
            "file_backed_and_hugetlb_buffers_work_through_the_copying_fallback (hugetlb half)",
            format_args!("this kernel has no hugetlb support ({knob} missing)"),
        );
        return;
    };
    let n: u64 = before.trim().parse().unwrap_or(0);
    std::fs::write(knob, format!("{}", n + 8)).expect("reserving huge pages as root");
    let free: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("HugePages_Free:").map(|v| v.trim().parse().unwrap_or(0)))
        .unwrap_or(0);
    if free >= 4 {
        run("write_bw", "hugetlb", "18620", &["-s", "1048576"]);
        run("send_lat", "hugetlb", "18621", &["-s", "4096"]);
    } else {
        skip(
            "file_backed_and_hugetlb_buffers_work_through_the_copying_fallback (hugetlb half)",
            format_args!("the kernel could not reserve huge pages ({free} free)"),
        );
    }
    let _ = std::fs::write(knob, before.trim());
}

/// A latency run whose peer dies mid-run ends with an error instead of spinning forever on
/// memory that the dead peer will never write: the server when the client dies (polling as
/// perftest does, `--spin plain`), and the client when the server dies (with PAUSE).
#[test]
fn a_latency_run_whose_peer_dies_ends_with_an_error() {
    if !require_root("a_latency_run_whose_peer_dies_ends_with_an_error") {
        return;
    }
    let d = Daemon::start("peerdies");
    d.ok(&["vnic", "create", "ka", "--tenant", "t", "--ip", "198.18.14.2/15"]);
    d.ok(&["vnic", "create", "kb", "--tenant", "t", "--ip", "198.18.14.3/15"]);
    for (i, (spin, kill_client)) in [("plain", true), ("pause", false)].into_iter().enumerate() {
        let port = format!("{}", 18630 + i);
        // Far more iterations than the run lasts: the peer dies inside the timed loop.
        let sv = [VRDMA, "perf", "write_lat", "-s", "8", "-n", "50000000", "-I", "0", "--spin", spin, "-p", &port];
        let server = d.container("ka", &sv);
        std::thread::sleep(Duration::from_millis(300));
        let client = d.container("kb", &[&sv[..], &["198.18.14.2"]].concat());
        std::thread::sleep(Duration::from_millis(1500));
        let (mut victim, survivor) = if kill_client { (client, server) } else { (server, client) };
        assert!(matches!(victim.try_wait(), Ok(None)), "the run ended before the peer was killed");
        // SAFETY: kill(2) on our own child (`vrdma run`, which stops its container).
        assert_eq!(unsafe { libc::kill(victim.id() as i32, libc::SIGTERM) }, 0);
        let (_, out_v) = wait_output(victim, Duration::from_secs(20));
        let (ok, out) = wait_output(survivor, Duration::from_secs(20));
        let who = if kill_client { "server" } else { "client" };
        assert!(!ok && !out.contains("TIMED OUT"), "--spin {spin}: the {who} must fail, not hang:\n{out}\n--- the killed peer:\n{out_v}");
        assert!(out.contains("the peer closed the out-of-band connection"), "--spin {spin}, {who}:\n{out}");
    }
}
