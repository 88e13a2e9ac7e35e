//! Failures across hosts: a cut link and a killed daemon flush every outstanding
//! WR (the peer's side within the configured peer timeout, the dead daemon's own clients at
//! once), a restarted daemon serves new
//! connections, a migrated vNIC keeps its GID, and tenants stay isolated across hosts.

mod common;
use common::cluster::{wait_until, Cluster, PEER_TIMEOUT};
use common::{wait_output, VRDMA};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Stdio};
use std::time::{Duration, Instant};

/// A `vrdma __peer` in a container: it streams WRITEs and SENDs at its partner until a
/// completion fails, then exits non-zero naming the status.
struct Streamer {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Streamer {
    fn start(c: &Cluster, host: &str, vnic: &str) -> Streamer {
        Streamer::start_with(c, host, vnic, &[])
    }

    /// As `start`, with more `vrdma __peer` options.
    fn start_with(c: &Cluster, host: &str, vnic: &str, args: &[&str]) -> Streamer {
        let mut child = c
            .vrdma_cmd(host)
            .args(["run", "--vnic", vnic, "--", VRDMA, "__peer", "--socket", "/run/vrdma/control.sock"])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Streamer { child, out }
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.out.read_line(&mut l).unwrap();
        l
    }

    /// Exchanges endpoints between two streamers and waits until both are connected.
    fn pair(a: &mut Streamer, b: &mut Streamer) {
        let (ea, eb) = (a.line(), b.line());
        assert!(ea.starts_with('{') && eb.starts_with('{'), "endpoints: {ea:?} {eb:?}");
        a.child.stdin.as_mut().unwrap().write_all(eb.as_bytes()).unwrap();
        b.child.stdin.as_mut().unwrap().write_all(ea.as_bytes()).unwrap();
        assert_eq!(a.line().trim(), "connected");
        assert_eq!(b.line().trim(), "connected");
    }

    /// Waits up to `limit` for the streamer to stop; returns its stderr.
    fn wait_failure(&mut self, limit: Duration) -> Option<String> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(st) = self.child.try_wait().unwrap() {
                let mut err = String::new();
                std::io::Read::read_to_string(self.child.stderr.as_mut().unwrap(), &mut err).unwrap();
                assert!(!st.success(), "streamer exited successfully?");
                return Some(err);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Streamer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Two hosts, vNIC `a` on h1 and `b` on h2, streaming at each other through the engine.
fn streaming(test: &str) -> Option<(Cluster, Streamer, Streamer)> {
    let c = Cluster::start(test, 2)?;
    c.ok("h1", &["vnic", "create", "a", "--tenant", "t"]);
    c.ok("h1", &["vnic", "create", "b", "--tenant", "t", "--host", "h2"]);
    assert!(wait_until(Duration::from_secs(10), || c.host("h2").socket("b").exists()));
    let mut sa = Streamer::start(&c, "h1", "a");
    let mut sb = Streamer::start(&c, "h2", "b");
    Streamer::pair(&mut sa, &mut sb);
    // Let traffic flow for a moment.
    std::thread::sleep(Duration::from_millis(500));
    assert!(sa.child.try_wait().unwrap().is_none() && sb.child.try_wait().unwrap().is_none(), "{}", c.logs());
    Some((c, sa, sb))
}

/// The bound the issue asks for: the configured peer timeout, plus scheduling slack on a
/// loaded two-core machine.
fn bound() -> Duration {
    PEER_TIMEOUT * 2 + Duration::from_secs(3)
}

#[test]
fn cut_link_flushes_both_sides_within_the_peer_timeout() {
    let Some((c, mut sa, mut sb)) = streaming("xcut") else { return };
    let t0 = Instant::now();
    c.cut_link("h2");
    let ea = sa.wait_failure(bound()).unwrap_or_else(|| panic!("h1's QP still running {:?} after the cut\n{}", bound(), c.logs()));
    let eb = sb.wait_failure(bound()).unwrap_or_else(|| panic!("h2's QP still running after the cut\n{}", c.logs()));
    eprintln!("both sides flushed {:?} after the cut", t0.elapsed());
    assert!(ea.contains("WrFlushErr") && eb.contains("WrFlushErr"), "h1: {ea}\nh2: {eb}");
    c.restore_link("h2");
}

#[test]
fn killed_peer_daemon_flushes_the_survivor_and_a_restarted_one_serves_again() {
    let Some((mut c, mut sa, mut sb)) = streaming("xkill") else { return };
    let t0 = Instant::now();
    c.kill_daemon("h2");
    let ea = sa.wait_failure(bound()).unwrap_or_else(|| panic!("h1's QP still running after h2's daemon died\n{}", c.logs()));
    eprintln!("survivor flushed {:?} after the kill", t0.elapsed());
    assert!(ea.contains("WrFlushErr"), "{ea}");
    // The client on h2 lost its own daemon (and the engine with it): its library sees the
    // control socket hang up and flushes what the engine will never complete.
    let eb = sb.wait_failure(bound()).unwrap_or_else(|| panic!("h2's client still waiting for its dead daemon\n{}", c.logs()));
    eprintln!("h2's own client flushed {:?} after the kill", t0.elapsed());
    assert!(eb.contains("WrFlushErr"), "{eb}");
    drop(sb);
    c.restart_daemon("h2");
    assert!(wait_until(Duration::from_secs(10), || c.host("h2").socket("b").exists()));
    let b_ip = c.vnic_ip("h1", "b").to_string();
    let server = c.run_container("h2", "b", &[VRDMA, "check"]);
    std::thread::sleep(Duration::from_secs(1));
    let client = c.run_container("h1", "a", &[VRDMA, "check", &b_ip]);
    let (ok_c, out_c) = wait_output(client, Duration::from_secs(60));
    let (ok_s, out_s) = wait_output(server, Duration::from_secs(10));
    assert!(ok_c && ok_s, "after restart: client {out_c}\nserver {out_s}\n{}", c.logs());
}

#[test]
fn migrated_vnic_keeps_its_gid_and_peers_reconnect_unchanged() {
    let Some(c) = Cluster::start("xmig", 3) else { return };
    c.ok("h1", &["vnic", "create", "peer", "--tenant", "t"]);
    c.ok("h1", &["vnic", "create", "mover", "--tenant", "t", "--host", "h2"]);
    assert!(wait_until(Duration::from_secs(10), || c.host("h2").socket("mover").exists()));
    let ip = c.vnic_ip("h1", "mover").to_string();
    let check = |host: &str| {
        let server = c.run_container(host, "mover", &[VRDMA, "check"]);
        std::thread::sleep(Duration::from_secs(1));
        let client = c.run_container("h1", "peer", &[VRDMA, "check", &ip]);
        let (ok_c, out_c) = wait_output(client, Duration::from_secs(60));
        let (ok_s, out_s) = wait_output(server, Duration::from_secs(10));
        assert!(ok_c && ok_s, "on {host}: client {out_c}\nserver {out_s}\n{}", c.logs());
    };
    check("h2");
    c.ok("h1", &["vnic", "move", "mover", "--host", "h3"]);
    assert!(wait_until(Duration::from_secs(10), || c.host("h3").socket("mover").exists() && !c.host("h2").socket("mover").exists()));
    assert_eq!(c.vnic_ip("h3", "mover").to_string(), ip, "the vNIC keeps its address (and GID)");
    // The peer on h1 runs exactly the same command against the same GID.
    check("h3");
}

#[test]
fn tenants_are_isolated_across_hosts() {
    let Some(c) = Cluster::start("xten", 2) else { return };
    c.ok("h1", &["vnic", "create", "red", "--tenant", "red"]);
    c.ok("h1", &["vnic", "create", "blue", "--tenant", "blue", "--host", "h2"]);
    assert!(wait_until(Duration::from_secs(10), || c.host("h2").socket("blue").exists()));
    let ip = c.vnic_ip("h1", "blue").to_string();
    let server = c.run_container("h2", "blue", &[VRDMA, "check"]);
    std::thread::sleep(Duration::from_secs(1));
    let t0 = Instant::now();
    let client = c.run_container("h1", "red", &[VRDMA, "check", &ip]);
    let (ok_c, out_c) = wait_output(client, Duration::from_secs(30));
    assert!(!ok_c, "a cross-tenant connection worked: {out_c}");
    assert!(t0.elapsed() < Duration::from_secs(20), "refusal took {:?}", t0.elapsed());
    assert!(out_c.contains("tenant") || out_c.contains("refused"), "{out_c}");
    let refused = |host: &str, vnic: &str| {
        c.list(host).iter().find(|v| v["vnic"]["name"] == vnic).map(|v| v["counters"]["refused_connections"].as_u64().unwrap_or(0))
    };
    assert!(refused("h1", "red").unwrap_or(0) >= 1, "h1 counts the refusal");
    assert!(refused("h2", "blue").unwrap_or(0) >= 1, "h2 counts the refusal");
    let _ = wait_output(server, Duration::from_secs(1));
}

/// One daemon serves every vNIC of its host through one doorbell thread. A QP receiving a
/// large READ response over a slow link holds its own lock for as long as the response takes;
/// the doorbell thread must not wait for it (while that QP's owner keeps posting), or every
/// other QP of the host, here one talking to a third host over a healthy link, stops sending
/// for that long.
#[test]
fn a_slow_read_response_does_not_stall_other_qps_of_the_host() {
    let Some(c) = Cluster::start("slowread", 3) else { return };
    if !std::process::Command::new("tc").arg("-V").output().is_ok_and(|o| o.status.success()) {
        vrdma_test_support::skip("a_slow_read_response_does_not_stall_other_qps_of_the_host", "no tc (install iproute2)");
        return;
    }
    for (vnic, host) in [("r1", "h1"), ("r2", "h2"), ("s1", "h1"), ("s3", "h3")] {
        c.ok("h1", &["vnic", "create", vnic, "--tenant", "t", "--host", host]);
    }
    assert!(
        wait_until(Duration::from_secs(20), || [("h1", "r1"), ("h2", "r2"), ("h1", "s1"), ("h3", "s3")]
            .iter()
            .all(|(h, v)| c.host(h).socket(v).exists())),
        "{}",
        c.logs()
    );
    // h2's link to the underlay at 16 Mbit/s: a 256 KiB READ response takes 130 ms.
    c.throttle("h2", "16mbit");

    // r1 on h1 streams WRITEs and SENDs at r2 on h2 and READs 256 KiB of it every 64 WRs:
    // its send queue is never empty while a READ response trickles in.
    let mut reader = Streamer::start_with(&c, "h1", "r1", &["--reads", "262144"]);
    let mut partner = Streamer::start(&c, "h2", "r2");
    Streamer::pair(&mut reader, &mut partner);
    std::thread::sleep(Duration::from_secs(1));

    // Meanwhile an 8-byte ping-pong from the same host to h3, over a healthy link.
    let server = c.run_container("h3", "s3", &[VRDMA, "perf", "send_lat", "-s", "8", "-n", "5000", "-p", "18602"]);
    std::thread::sleep(Duration::from_millis(800));
    let ip = c.vnic_ip("h1", "s3").to_string();
    let client = c.run_container("h1", "s1", &[VRDMA, "perf", "send_lat", "-s", "8", "-n", "5000", "-p", "18602", "--json", &ip]);
    let (ok_c, out_c) = wait_output(client, Duration::from_secs(120));
    let (ok_s, out_s) = wait_output(server, Duration::from_secs(10));
    let streaming = reader.child.try_wait().unwrap().is_none() && partner.child.try_wait().unwrap().is_none();
    let _ = reader.child.kill();
    let _ = partner.child.kill();
    assert!(ok_c && ok_s, "send_lat h1 -> h3:\n{out_c}\nserver:\n{out_s}\n{}", c.logs());
    assert!(streaming, "the READ streamer stopped early\n{}", c.logs());
    let row: serde_json::Value =
        out_c.lines().filter(|l| l.starts_with('{')).find_map(|l| serde_json::from_str(l).ok()).expect("send_lat JSON row");
    let (p99, avg, max) = (row["lat_p99_us"].as_f64().unwrap(), row["lat_avg_us"].as_f64().unwrap(), row["lat_max_us"].as_f64().unwrap());
    eprintln!("send_lat h1 -> h3 while h1 reads from h2 at 16 Mbit/s: p99 {p99:.0} us, average {avg:.0} us, max {max:.0} us");
    // A doorbell thread waiting for the READing QP would hold these sends for whole
    // responses (130 ms each, so even once is too many); a healthy link's ping-pong takes
    // tens of microseconds.
    assert!(
        avg < 20_000.0 && p99 < 50_000.0 && max < 100_000.0,
        "send_lat h1 -> h3: p99 {p99} us, average {avg} us, max {max} us while h1 receives READ responses from h2"
    );
}
