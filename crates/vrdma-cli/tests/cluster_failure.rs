//! Failures across hosts (issue 4): a cut link and a killed daemon flush every outstanding
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
        let mut child = c
            .vrdma_cmd(host)
            .args(["run", "--vnic", vnic, "--", VRDMA, "__peer", "--socket", "/run/vrdma/control.sock"])
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
