//! The cluster control plane, end to end: three (or two) simulated hosts, one real etcd, one
//! vrdmad per host (see `common/cluster.rs`).

mod common;
use common::cluster::{wait_until, Cluster, EtcdSecurity};
use common::wait_output;
use std::collections::HashSet;
use std::net::Ipv4Addr;
use std::time::Duration;

fn gid(ip: Ipv4Addr) -> [u8; 16] {
    ip.to_ipv6_mapped().octets()
}

/// An RC QP on a vNIC's socket, for broker decisions (no data path involved).
struct Endpoint {
    qp: vrdma::Qp,
    _cq: vrdma::Cq,
    _pd: vrdma::Pd,
    ctx: vrdma::Context,
}

impl Endpoint {
    fn open(socket: &std::path::Path) -> Endpoint {
        let ctx = vrdma::Context::open(socket).unwrap_or_else(|e| panic!("open {}: {e}", socket.display()));
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16, None).unwrap();
        let qp = pd.create_qp(&vrdma::QpInitAttr::rc(&cq, &cq, vrdma::QpCaps::default())).unwrap();
        Endpoint { qp, _cq: cq, _pd: pd, ctx }
    }
}

#[test]
fn two_daemons_creating_at_once_never_share_an_address() {
    let Some(c) = Cluster::start("ips", 2) else { return };
    std::thread::scope(|s| {
        for h in ["h1", "h2"] {
            let c = &c;
            s.spawn(move || {
                for i in 0..20 {
                    c.ok(h, &["vnic", "create", &format!("{h}-v{i}"), "--tenant", "t"]);
                }
            });
        }
    });
    let list = c.list("h1");
    assert_eq!(list.len(), 40, "h1 lists every vNIC of the cluster");
    let ips: HashSet<&str> = list.iter().map(|v| v["vnic"]["ip"].as_str().unwrap()).collect();
    assert_eq!(ips.len(), 40, "addresses are unique: {list:?}");
    let local = list.iter().filter(|v| v["local"] == true).count();
    assert_eq!(local, 20, "h1 serves its own 20");
    assert!(c.host("h2").socket("h2-v19").exists() && !c.host("h1").socket("h2-v19").exists());
}

#[test]
fn vnic_created_for_another_host_is_served_there_without_restart() {
    let Some(c) = Cluster::start("remote", 2) else { return };
    let hosts = c.ok("h1", &["host", "list"]);
    assert!(hosts.contains("h1") && hosts.contains("h2") && hosts.contains(&c.host("h2").ip.to_string()), "{hosts}");
    let out = c.ok("h1", &["vnic", "create", "far", "--tenant", "t", "--host", "h2"]);
    assert!(out.contains("host h2"), "{out}");
    let sock = c.host("h2").socket("far");
    assert!(wait_until(Duration::from_secs(10), || sock.exists()), "h2 does not serve far:\n{}", c.logs());
    assert!(!c.host("h1").socket("far").exists());
    let on_h1 = c.list("h1");
    let far = on_h1.iter().find(|v| v["vnic"]["name"] == "far").unwrap();
    assert_eq!((far["local"].as_bool(), far["vnic"]["host"].as_str()), (Some(false), Some("h2")));
    // `vrdma run` on the wrong host says where to go.
    let o = c.vrdma("h1", &["run", "--vnic", "far", "--", "true"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("served by host h2"));

    // Limits changed through h1 apply to h2's next allocations.
    let ctx = vrdma::Context::open(&sock).unwrap();
    let _pd1 = ctx.alloc_pd().unwrap();
    c.ok("h1", &["vnic", "limits", "far", "--max-pd", "1"]);
    assert!(
        wait_until(Duration::from_secs(10), || match ctx.alloc_pd() {
            Ok(_pd) => false, // dropped at once: the old limit still applies
            Err(e) => e.to_string().contains("PD limit 1"),
        }),
        "limit not applied:\n{}",
        c.logs()
    );

    // Deleted through h1: h2 stops serving it and closes its session.
    drop(_pd1);
    c.ok("h1", &["vnic", "delete", "far"]);
    assert!(wait_until(Duration::from_secs(10), || !sock.exists()), "h2 still serves far");
    assert!(wait_until(Duration::from_secs(5), || ctx.alloc_pd().is_err()), "session on a deleted vNIC still works");
}

#[test]
fn tenant_rules_apply_live_on_every_daemon() {
    let Some(c) = Cluster::start("rules", 2) else { return };
    c.ok("h1", &["vnic", "create", "ra", "--tenant", "red"]);
    c.ok("h1", &["vnic", "create", "rb", "--tenant", "blue"]);
    c.ok("h1", &["vnic", "create", "rr", "--tenant", "blue", "--host", "h2"]);
    let h1 = c.host("h1");
    let (a, b) = (Endpoint::open(&h1.socket("ra")), Endpoint::open(&h1.socket("rb")));
    let b_gid = b.ctx.gids()[0];
    let e = a.qp.connect_rc(b_gid, b.qp.qp_num(), 0).unwrap_err();
    assert!(e.to_string().contains("tenant red may not connect to tenant blue"), "{e}");

    // The rule is made through the *other* daemon; h1 learns it from the store.
    c.ok("h2", &["tenant", "allow", "blue", "red"]);
    assert!(c.ok("h1", &["tenant", "rules"]).contains("blue <-> red"));
    assert!(
        wait_until(Duration::from_secs(10), || {
            let a2 = Endpoint::open(&h1.socket("ra"));
            a2.qp.connect_rc(b_gid, b.qp.qp_num(), 0).is_ok()
        }),
        "rule not applied on h1:\n{}",
        c.logs()
    );
    // A GID on another host resolves (rules checked here) and is handed to the mediated
    // engine, whose peer daemon checks the QP (there is no QP 99).
    let rr_ip = c.vnic_ip("h1", "rr");
    a.ctx.check_gid(gid(rr_ip)).unwrap();
    let e = Endpoint::open(&h1.socket("ra")).qp.connect_rc(gid(rr_ip), 99, 0).unwrap_err();
    assert!(e.to_string().contains("mediated engine") || e.to_string().contains("vNIC rr has no QP 99"), "{e}");

    c.ok("h1", &["tenant", "deny", "red", "blue"]);
    assert!(
        wait_until(Duration::from_secs(10), || {
            // (Refused for the rule, not because b's QP is still paired with an earlier one.)
            let a2 = Endpoint::open(&h1.socket("ra"));
            a2.qp.connect_rc(b_gid, b.qp.qp_num(), 0).is_err_and(|e| e.to_string().contains("may not connect"))
        }),
        "rule removal not applied:\n{}",
        c.logs()
    );
    let e = Endpoint::open(&h1.socket("ra")).qp.connect_rc(gid(rr_ip), 99, 0).unwrap_err();
    assert!(e.to_string().contains("may not connect"), "{e}");
    let refused = c.list("h1").iter().find(|v| v["vnic"]["name"] == "ra").unwrap()["counters"]["refused_connections"].as_u64();
    assert!(refused >= Some(3), "refusals are counted: {refused:?}");
}

/// Pings `ip` from a container on `host` with `vnic`; true on an answer.
fn ping(c: &Cluster, host: &str, vnic: &str, ip: Ipv4Addr) -> bool {
    let child = c.run_container(host, vnic, &["ping", "-c", "1", "-W", "1", &ip.to_string()]);
    wait_output(child, Duration::from_secs(20)).0
}

#[test]
fn containers_reach_each_other_across_hosts_until_the_link_is_cut() {
    let Some(c) = Cluster::start("reach", 2) else { return };
    c.ok("h1", &["vnic", "create", "pa", "--tenant", "t"]);
    c.ok("h1", &["vnic", "create", "pb", "--tenant", "t", "--host", "h2"]);
    c.ok("h1", &["vnic", "create", "pc", "--tenant", "t", "--host", "h2"]);
    let (pa_ip, pb_ip) = (c.vnic_ip("h1", "pa"), c.vnic_ip("h1", "pb"));
    assert!(wait_until(Duration::from_secs(10), || c.host("h2").socket("pc").exists()));
    let mut target = c.run_container("h2", "pb", &["sleep", "300"]);
    assert!(
        wait_until(Duration::from_secs(30), || ping(&c, "h1", "pa", pb_ip)),
        "container on h1 cannot reach {pb_ip} on h2:\n{}",
        c.logs()
    );

    c.cut_link("h2");
    assert!(!ping(&c, "h1", "pa", pb_ip), "reachable through a cut link");
    c.restore_link("h2");
    assert!(wait_until(Duration::from_secs(60), || ping(&c, "h1", "pa", pb_ip)), "not reachable after the link came back:\n{}", c.logs());
    let _ = target.kill();
    let _ = target.wait();

    // The other way round.
    let mut target = c.run_container("h1", "pa", &["sleep", "300"]);
    assert!(wait_until(Duration::from_secs(30), || ping(&c, "h2", "pc", pa_ip)), "h2 cannot reach {pa_ip} on h1:\n{}", c.logs());
    let _ = target.kill();
    let _ = target.wait();
}

fn host_names(c: &Cluster, on: &str) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(&c.ok(on, &["host", "list", "--json"])).unwrap();
    v.as_array().into_iter().flatten().map(|h| h["host"]["name"].as_str().unwrap_or("").to_string()).collect()
}

#[test]
fn restarted_daemon_recovers_its_vnics_from_the_store() {
    let Some(mut c) = Cluster::start("restart", 2) else { return };
    c.ok("h2", &["vnic", "create", "keep", "--tenant", "t"]);
    c.kill_daemon("h2");
    // Its lease expires: the others see the host go.
    assert!(wait_until(Duration::from_secs(30), || !host_names(&c, "h1").contains(&"h2".to_string())), "h2's record did not expire");
    // Meanwhile a vNIC is created for it.
    c.ok("h1", &["vnic", "create", "late", "--tenant", "t", "--host", "h2"]);
    c.restart_daemon("h2");
    let h2 = c.host("h2");
    for v in ["keep", "late"] {
        assert!(wait_until(Duration::from_secs(10), || h2.socket(v).exists()), "{v} not served after restart:\n{}", c.logs());
        let ctx = vrdma::Context::open(&h2.socket(v)).unwrap();
        assert_eq!(ctx.name(), v);
    }
    assert!(wait_until(Duration::from_secs(10), || host_names(&c, "h1").contains(&"h2".to_string())));
}

#[test]
fn daemon_started_while_its_store_is_unreachable_waits_and_then_serves() {
    let Some(mut c) = Cluster::start("storewait", 2) else { return };
    c.ok("h1", &["vnic", "create", "w", "--tenant", "t", "--host", "h2"]);
    assert!(wait_until(Duration::from_secs(10), || c.host("h2").socket("w").exists()));
    // h2 reboots while its underlay (the way to etcd) is down.
    c.cut_link("h2");
    c.respawn_daemon("h2");
    std::thread::sleep(Duration::from_secs(4));
    assert!(c.daemon_alive("h2"), "vrdmad gave up on an unreachable store:\n{}", c.logs());
    assert!(c.host("h2").log().contains("control store not reachable yet"), "no retry logged:\n{}", c.logs());
    c.restore_link("h2");
    let h2 = c.host("h2");
    // (The killed daemon's socket file may still be there: serving means answering.)
    assert!(
        wait_until(Duration::from_secs(30), || vrdma::Context::open(&h2.socket("w")).is_ok_and(|ctx| ctx.name() == "w")),
        "w not served once the store came back:\n{}",
        c.logs()
    );
}

#[test]
fn moved_vnic_is_served_on_the_new_host_and_removed_from_the_old() {
    let Some(c) = Cluster::start("move", 3) else { return };
    c.ok("h1", &["vnic", "create", "mv", "--tenant", "t"]);
    let (h1, h2) = (c.host("h1"), c.host("h2"));
    let old = vrdma::Context::open(&h1.socket("mv")).unwrap();
    let gid_before = old.gids()[0];
    // Moved through a third host's CLI.
    c.ok("h3", &["vnic", "move", "mv", "--host", "h2"]);
    assert!(wait_until(Duration::from_secs(10), || h2.socket("mv").exists()), "not served on h2:\n{}", c.logs());
    assert!(wait_until(Duration::from_secs(10), || !h1.socket("mv").exists()), "still served on h1");
    assert!(wait_until(Duration::from_secs(5), || old.alloc_pd().is_err()), "the old host's session survived the move");
    let new = vrdma::Context::open(&h2.socket("mv")).unwrap();
    assert_eq!(new.gids()[0], gid_before, "the vGID moves with the vNIC");
    let on_h3 = c.list("h3");
    assert_eq!(on_h3.iter().find(|v| v["vnic"]["name"] == "mv").unwrap()["vnic"]["host"], "h2");
}

#[test]
fn changes_made_during_a_link_cut_reach_the_host_afterwards() {
    let Some(c) = Cluster::start("catchup", 2) else { return };
    c.ok("h1", &["vnic", "create", "before", "--tenant", "t"]);
    c.cut_link("h1");
    // h1's CLI still answers (its daemon serves its cache), but its store is unreachable.
    let o = c.vrdma("h1", &["vnic", "create", "nope", "--tenant", "t"]);
    assert!(!o.status.success(), "created a vNIC without the store");
    c.ok("h2", &["vnic", "create", "during", "--tenant", "t", "--host", "h1"]);
    c.ok("h2", &["vnic", "delete", "before"]);
    std::thread::sleep(Duration::from_secs(3));
    c.restore_link("h1");
    let h1 = c.host("h1");
    assert!(
        wait_until(Duration::from_secs(40), || h1.socket("during").exists() && !h1.socket("before").exists()),
        "h1 did not catch up:\n{}",
        c.logs()
    );
}

/// CPU time (user + system) process `pid` used so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Duration::from_millis(ticks * 1000 / hz)
}

/// The doorbell thread sleeps in epoll until its next heartbeat: a timeout rounded down to
/// whole milliseconds once turned the last fraction of a millisecond before each heartbeat
/// into a busy loop (about 4% of a CPU with heartbeats every 10 ms).
#[test]
fn idle_daemon_does_not_spin_between_frequent_heartbeats() {
    if !vrdma_test_support::require_root("idle_daemon_does_not_spin_between_frequent_heartbeats") {
        return;
    }
    // Peer timeout 40 ms: a heartbeat round every 10 ms.
    let mut d = common::Daemon::start_with("heartbeats", &["--peer-timeout-ms", "40"]);
    std::thread::sleep(Duration::from_millis(500));
    let pid = d.child.id();
    let before = cpu_time(pid);
    std::thread::sleep(Duration::from_secs(5));
    let used = cpu_time(pid) - before;
    let _ = d.child.kill();
    assert!(used <= Duration::from_millis(60), "idle vrdmad with 10 ms heartbeats used {used:?} in 5 s");
}

#[test]
fn idle_daemons_use_no_measurable_cpu_and_names_are_unique() {
    let Some(c) = Cluster::start("idle", 2) else { return };
    c.ok("h1", &["vnic", "create", "i1", "--tenant", "t"]);
    c.ok("h1", &["vnic", "create", "i2", "--tenant", "t", "--host", "h2"]);
    std::thread::sleep(Duration::from_secs(1));
    let pids: Vec<u32> = ["h1", "h2"].iter().map(|h| c.daemon_pid(h)).collect();
    let before: Vec<Duration> = pids.iter().map(|p| cpu_time(*p)).collect();
    std::thread::sleep(Duration::from_secs(10));
    for (p, b) in pids.iter().zip(before) {
        let used = cpu_time(*p) - b;
        assert!(used <= Duration::from_millis(60), "idle vrdmad {p} used {used:?} in 10 s");
    }
    // A second daemon claiming h1's name from another address refuses to start.
    let h2 = c.host("h2");
    let o = std::process::Command::new("ip")
        .args(["netns", "exec", &h2.netns, common::VRDMAD, "--run-dir"])
        .arg(h2.dir.join("dup-run"))
        .arg("--state-dir")
        .arg(h2.dir.join("dup-state"))
        .args(["--store", &format!("etcd://{}", c.etcd_endpoint), "--insecure-store", "--insecure-transport", "--host", "h1"])
        .output()
        .unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("registered by a live vrdmad"), "{o:?}");
    // A cluster daemon without a host certificate refuses to start unless told otherwise.
    let o = std::process::Command::new("ip")
        .args(["netns", "exec", &h2.netns, common::VRDMAD, "--run-dir"])
        .arg(h2.dir.join("nocert-run"))
        .arg("--state-dir")
        .arg(h2.dir.join("nocert-state"))
        .args(["--store", &format!("etcd://{}", c.etcd_endpoint), "--insecure-store", "--host", "h9"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("peers are not authenticated") && err.contains("--insecure-transport"), "{o:?}");
}

/// SEND/RECV, WRITE, READ and atomics between containers on two hosts, through the mediated
/// engine, every byte verified on both sides.
#[test]
fn vrdma_check_across_hosts() {
    let Some(c) = Cluster::start("xcheck", 2) else { return };
    let (client, server) = c.start_check_pair();
    let (ok_c, out_c) = wait_output(client, Duration::from_secs(60));
    let (ok_s, out_s) = wait_output(server, Duration::from_secs(10));
    assert!(ok_c && ok_s, "client {ok_c}:\n{out_c}\nserver {ok_s}:\n{out_s}\n{}", c.logs());
    assert!(out_c.contains("RDMA READ      ok") && out_s.contains("all data verified"), "{out_c}\n{out_s}");
}

/// The remote-serving scenario on a secured etcd: `h1` creates a vNIC for `h2`, `h2` serves
/// it, both see each other, the delete goes through.
fn remote_vnic_round_trip(c: &Cluster) {
    let hosts = c.ok("h1", &["host", "list"]);
    assert!(hosts.contains("h1") && hosts.contains("h2"), "{hosts}");
    c.ok("h1", &["vnic", "create", "far", "--tenant", "t", "--host", "h2"]);
    let sock = c.host("h2").socket("far");
    assert!(wait_until(Duration::from_secs(10), || sock.exists()), "h2 does not serve far:\n{}", c.logs());
    let ctx = vrdma::Context::open(&sock).unwrap();
    drop(ctx.alloc_pd().unwrap());
    let on_h1 = c.list("h1");
    let far = on_h1.iter().find(|v| v["vnic"]["name"] == "far").unwrap();
    assert_eq!((far["local"].as_bool(), far["vnic"]["host"].as_str()), (Some(false), Some("h2")));
    // Deleted through h1: h2 stops serving it and closes the session.
    c.ok("h1", &["vnic", "delete", "far"]);
    assert!(wait_until(Duration::from_secs(10), || !sock.exists()), "h2 still serves far");
    assert!(wait_until(Duration::from_secs(5), || ctx.alloc_pd().is_err()), "session on a deleted vNIC still works");
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

#[test]
fn etcd_over_tls_with_client_certificates() {
    let Some(c) = Cluster::start_secure("mtls", 2, EtcdSecurity::MutualTls) else { return };
    remote_vnic_round_trip(&c);
    let pki = c.pki.as_ref().unwrap();
    let p = |p: &std::path::Path| p.display().to_string();
    let store = format!("etcd://{}", c.etcd_endpoint);
    let wait = strings(&["--store-wait-secs", "3"]);

    // Without the CA the daemon speaks plain HTTP to a TLS port: etcd hangs up; retried
    // until --store-wait-secs, then a clear failure.
    let plain = strings(&["--store", &store, "--insecure-store"]);
    let (st, log) = c.run_extra_daemon("h1", "plain", &[plain, wait.clone()].concat(), Duration::from_secs(30));
    assert!(st.is_some_and(|s| !s.success()), "a daemon without the CA must fail: {log}");
    assert!(log.contains("if etcd serves TLS only, give --etcd-cacert"), "{log}");

    // A CA that did not sign etcd's certificate: refused in the handshake, retried until
    // --store-wait-secs, then a clear failure.
    let args = [strings(&["--store", &store, "--insecure-store", "--etcd-cacert", &p(&pki.other_ca)]), wait.clone()].concat();
    let (st, log) = c.run_extra_daemon("h1", "wrongca", &args, Duration::from_secs(30));
    assert!(st.is_some_and(|s| !s.success()), "a daemon with the wrong CA must fail: {log}");
    assert!(log.contains("TLS") && log.contains("UnknownIssuer"), "{log}");

    // The right CA but no client certificate, or one of another CA: etcd refuses it.
    for (name, extra) in
        [("nocert", vec![]), ("othercert", strings(&["--etcd-cert", &p(&pki.other_client_cert), "--etcd-key", &p(&pki.other_client_key)]))]
    {
        let args = [strings(&["--store", &store, "--insecure-store", "--etcd-cacert", &p(&pki.ca)]), extra, wait.clone()].concat();
        let (st, log) = c.run_extra_daemon("h1", name, &args, Duration::from_secs(30));
        assert!(st.is_some_and(|s| !s.success()), "{name}: must fail: {log}");
        assert!(log.contains("not reachable") && log.to_lowercase().contains("certificate"), "{name}: {log}");
    }

    // Configuration errors are fatal at once, before any connection; so is a store reached
    // without TLS or without credentials, unless --insecure-store says so.
    for (name, extra) in [("noauth", strings(&["--etcd-cacert", &p(&pki.ca)])), ("notls", vec![])] {
        let args = [strings(&["--store", &store]), extra].concat();
        let (st, log) = c.run_extra_daemon("h1", name, &args, Duration::from_secs(10));
        assert!(st.is_some_and(|s| !s.success()) && log.contains("refusing an insecure control store"), "{name}: {log}");
        assert!(log.contains("--insecure-store"), "{name}: {log}");
    }
    let args = strings(&["--store", &store, "--etcd-cacert", &p(&pki.ca), "--etcd-cert", &p(&pki.client_cert)]);
    let (st, log) = c.run_extra_daemon("h1", "nokey", &args, Duration::from_secs(10));
    assert!(st.is_some_and(|s| !s.success()) && log.contains("--etcd-cert needs --etcd-key"), "{log}");
    let args = strings(&["--store", &store, "--insecure-store", "--etcd-cacert", "/nonexistent/ca.pem"]);
    let (st, log) = c.run_extra_daemon("h1", "noca", &args, Duration::from_secs(10));
    assert!(st.is_some_and(|s| !s.success()) && log.contains("/nonexistent/ca.pem"), "{log}");

    // The cluster still works.
    c.ok("h2", &["vnic", "create", "near", "--tenant", "t"]);
    assert!(c.list("h1").iter().any(|v| v["vnic"]["name"] == "near"));
}

#[test]
fn etcd_with_password_authentication() {
    let Some(c) = Cluster::start_secure("auth", 2, EtcdSecurity::TlsPassword) else { return };
    remote_vnic_round_trip(&c);
    // etcd's tokens live 2 s here, the host keepalives come every 3 s: the daemons
    // authenticate again as their tokens expire, and carry on.
    std::thread::sleep(Duration::from_secs(4));
    c.ok("h1", &["vnic", "create", "late", "--tenant", "t", "--host", "h2"]);
    assert!(wait_until(Duration::from_secs(10), || c.host("h2").socket("late").exists()), "{}", c.logs());
    assert!(c.logs().contains("authenticating again"), "{}", c.logs());
    assert!(!c.logs().contains(common::cluster::ETCD_PASSWORD), "the password is logged");

    let pki = c.pki.as_ref().unwrap();
    let ca = pki.ca.display().to_string();
    let store = format!("https://{}", c.etcd_endpoint);
    // A wrong password is refused at once (not retried).
    let bad = c.dir.join("bad-password");
    std::fs::write(&bad, "nope\n").unwrap();
    let args =
        strings(&["--store", &store, "--etcd-cacert", &ca, "--etcd-user", "vrdma", "--etcd-password-file", &bad.display().to_string()]);
    let (st, log) = c.run_extra_daemon("h1", "badpw", &args, Duration::from_secs(20));
    assert!(st.is_some_and(|s| !s.success()), "{log}");
    assert!(log.contains("authentication as user vrdma failed"), "{log}");
    // No credentials: etcd refuses the requests.
    let args = strings(&["--store", &store, "--insecure-store", "--etcd-cacert", &ca, "--store-wait-secs", "3"]);
    let (st, log) = c.run_extra_daemon("h1", "nouser", &args, Duration::from_secs(20));
    assert!(st.is_some_and(|s| !s.success()), "{log}");
    assert!(log.contains("user name is empty"), "{log}");
    // A user without a password is a configuration error.
    let args = strings(&["--store", &store, "--etcd-cacert", &ca, "--etcd-user", "vrdma"]);
    let (st, log) = c.run_extra_daemon("h1", "nopw", &args, Duration::from_secs(10));
    assert!(st.is_some_and(|s| !s.success()) && log.contains("needs a password"), "{log}");
}
