//! Hostile cluster suites: a store written by someone other than vrdma, and (see the tests'
//! own comments) a network with hosts and containers that speak the wire.

mod common;
use common::cluster::{wait_until, Cluster};
use std::net::Ipv4Addr;
use std::time::Duration;

fn b64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in data.chunks(3) {
        let n = (u32::from(c[0]) << 16) | (u32::from(*c.get(1).unwrap_or(&0)) << 8) | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(char::from(A[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Writes `key` = `value` straight into etcd, as anyone holding the store's credentials could.
fn put_raw(store: &vrdmad::store::EtcdStore, key: &str, value: &str) {
    let body = serde_json::json!({"key": b64(key.as_bytes()), "value": b64(value.as_bytes())});
    store.gateway_call("/v3/kv/put", &body).unwrap_or_else(|e| panic!("put {key}: {e}"));
}

fn delete_raw(store: &vrdmad::store::EtcdStore, key: &str) {
    store.gateway_call("/v3/kv/deleterange", &serde_json::json!({"key": b64(key.as_bytes())})).unwrap();
}

fn vnic_json(name: &str, ip: &str, host: &str, max_qp: u64) -> String {
    format!(
        r#"{{"name":"{name}","tenant":"t","ip":"{ip}","prefix_len":15,"limits":{{"max_pd":8,"max_cq":8,"max_qp":{max_qp},"max_mr":8,"max_mr_bytes":1048576,"max_srq":8}},"node_guid":7,"host":"{host}"}}"#
    )
}

fn routes(c: &Cluster, host: &str) -> String {
    let h = c.host(host);
    let o = std::process::Command::new("ip").args(["netns", "exec", &h.netns, "ip", "-o", "-4", "route", "show"]).output().unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Records with `..`, `/`, names that differ from their keys, absent fields, addresses outside
/// the container network, a duplicate address, absurd limits and bad host and rule records are
/// written to etcd: nothing outside the run directory is touched, no route outside the
/// container network appears, no such vNIC is served, and the daemons keep serving.
#[test]
fn hostile_store_records_are_ignored() {
    let Some(c) = Cluster::start("hstore", 2) else { return };
    let store = vrdmad::store::EtcdStore::connect(vec![c.etcd_endpoint.clone()]).unwrap();
    c.ok("h1", &["vnic", "create", "good", "--tenant", "t", "--host", "h2"]);
    let good_ip = c.vnic_ip("h1", "good");
    // What a daemon acting on `../..` would serve in, then remove: the host's directory.
    let canaries: Vec<_> = c.hosts.iter().map(|h| h.dir.join("canary")).collect();
    for f in &canaries {
        std::fs::write(f, "still here").unwrap();
    }
    let hostile = [
        ("/vrdma/vnics/..", vnic_json("..", "198.18.9.1", "h1", 8)),
        ("/vrdma/vnics/../..", vnic_json("../..", "198.18.9.2", "h1", 8)),
        ("/vrdma/vnics/x", vnic_json("/", "198.18.9.3", "h1", 8)),
        ("/vrdma/vnics/mismatch", vnic_json("victim", "198.18.9.4", "h1", 8)),
        ("/vrdma/vnics/outside", vnic_json("outside", "203.0.113.7", "h2", 8)),
        ("/vrdma/vnics/dup", vnic_json("dup", &good_ip.to_string(), "h1", 8)),
        ("/vrdma/vnics/absurd", vnic_json("absurd", "198.18.9.5", "h1", u64::from(u32::MAX))),
        ("/vrdma/vnics/empty", "{}".to_string()),
        ("/vrdma/vnics/noaddr", r#"{"name":"noaddr","tenant":"t","host":"h1"}"#.to_string()),
        ("/vrdma/vnics/badhost", vnic_json("badhost", "198.18.9.6", "../h1", 8)),
        ("/vrdma/hosts/evil", format!(r#"{{"name":"evil","transport_addr":"{good_ip}:4791","underlay_ip":"{good_ip}"}}"#)),
        ("/vrdma/hosts/bridge", r#"{"name":"bridge","transport_addr":"198.18.0.1:4791","underlay_ip":"198.18.0.1"}"#.to_string()),
        ("/vrdma/hosts/h9", format!(r#"{{"name":"h9","transport_addr":"{0}:4791","underlay_ip":"{0}"}}"#, c.host("h1").ip)),
        ("/vrdma/rules/../t", "{}".to_string()),
    ];
    for (k, v) in &hostile {
        put_raw(&store, k, v);
    }
    // The watch delivers them; then a vNIC outside the network on another host.
    std::thread::sleep(Duration::from_secs(3));
    for (k, _) in &hostile {
        delete_raw(&store, k);
    }
    std::thread::sleep(Duration::from_secs(2));
    for f in &canaries {
        assert!(f.exists(), "{} was removed:\n{}", f.display(), c.logs());
    }
    for h in &c.hosts {
        for name in ["..", "x", "mismatch", "victim", "dup", "absurd", "empty", "noaddr", "badhost"] {
            assert!(!h.run_dir().join("vnics").join(name).join("control.sock").exists(), "{} serves {name}", h.name);
        }
        let r = routes(&c, &h.name);
        assert!(!r.contains("203.0.113.7"), "{}: {r}", h.name);
        for line in r.lines().filter(|l| l.contains("proto 250")) {
            let dst: Ipv4Addr = line.split_whitespace().next().unwrap().trim_end_matches("/32").parse().unwrap();
            assert!(matches!(dst.octets(), [198, 18 | 19, ..]), "{}: route outside the container network: {line}", h.name);
        }
    }
    let logs = c.logs();
    assert!(logs.contains("ignoring vNIC record") && logs.contains("is already held by good"), "{logs}");
    // Still serving: a new vNIC on each host, and the good one.
    c.ok("h1", &["vnic", "create", "after", "--tenant", "t", "--host", "h2"]);
    assert!(wait_until(Duration::from_secs(10), || c.host("h2").socket("after").exists()), "{}", c.logs());
    let ctx = vrdma::Context::open(&c.host("h2").socket("good")).unwrap();
    drop(ctx.alloc_pd().unwrap());
    let names: Vec<String> = c.list("h1").iter().filter_map(|v| v["vnic"]["name"].as_str().map(String::from)).collect();
    assert!(names.contains(&"good".to_string()) && names.contains(&"after".to_string()), "{names:?}");
}

fn in_netns(c: &Cluster, host: &str, cmd: &[&str]) -> String {
    let o = std::process::Command::new("ip").args(["netns", "exec", &c.host(host).netns]).args(cmd).output().unwrap();
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn refused_count(c: &Cluster, host: &str) -> u64 {
    let out = in_netns(c, host, &["nft", "list", "counter", "ip", "vrdmad_4791", "from_containers"]);
    let w: Vec<&str> = out.split_whitespace().collect();
    w.iter().position(|x| *x == "packets").and_then(|i| w.get(i + 1)).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{out}"))
}

/// A container can connect to no daemon's transport port, its own host's or another's: the
/// attempt fails at once and is counted (and logged) by its host's firewall. The transport
/// listens on the underlay address only, and the daemons still talk to each other.
#[test]
fn containers_cannot_reach_any_transport_port() {
    if !vrdma_test_support::require_files("containers_cannot_reach_any_transport_port", &["/usr/sbin/nft"], "nftables") {
        return;
    }
    let Some(c) = Cluster::start("hfw", 2) else { return };
    c.ok("h1", &["vnic", "create", "box", "--tenant", "t"]);
    // A vNIC on h2 makes h1 route (and forward) to h2: the path a container would take.
    c.ok("h1", &["vnic", "create", "far", "--tenant", "t", "--host", "h2"]);
    assert!(wait_until(Duration::from_secs(10), || c.host("h2").socket("far").exists()), "{}", c.logs());
    let far_ip = c.vnic_ip("h1", "far").to_string();
    assert!(wait_until(Duration::from_secs(10), || routes(&c, "h1").contains(&far_ip)), "{}", c.logs());
    for h in ["h1", "h2"] {
        let listening = in_netns(&c, h, &["ss", "-Hltn", "sport", "= :4791"]);
        assert!(listening.contains(&format!("{}:4791", c.host(h).ip)) && !listening.contains("0.0.0.0:4791"), "{h}: {listening}");
    }
    let before = refused_count(&c, "h1");
    for target in ["h1", "h2"] {
        let dest = format!("/dev/tcp/{}/4791", c.host(target).ip);
        let child = c.run_container("h1", "box", &["/bin/bash", "-c", &format!("exec 3<>{dest} && echo CONNECTED")]);
        let (ok, out) = common::wait_output(child, Duration::from_secs(30));
        assert!(!ok && !out.contains("CONNECTED"), "a container reached {target}'s transport: {out}");
        assert!(out.contains("refused"), "{target}: {out}");
    }
    assert!(refused_count(&c, "h1") >= before + 2, "{}", in_netns(&c, "h1", &["nft", "list", "ruleset"]));
    assert!(wait_until(Duration::from_secs(15), || c.host("h1").log().contains("connection attempts from containers")), "{}", c.logs());
    // The daemons' own traffic is untouched: a vNIC created on h1 for h2 is served there.
    c.ok("h1", &["vnic", "create", "far2", "--tenant", "t", "--host", "h2"]);
    assert!(wait_until(Duration::from_secs(10), || c.host("h2").socket("far2").exists()), "{}", c.logs());
}

/// Sends a HELLO claiming host `name` listening at `claimed` to `to`, from this (root)
/// namespace, after a TLS handshake as `tls` if given; whether the daemon kept the
/// connection open (answered with its own HELLO).
fn forged_hello(to: std::net::SocketAddr, tls: Option<(&vrdmad::engine::PeerTls, &str)>, name: &str, claimed: &str) -> bool {
    use std::io::{Read, Write};
    use vrdma_abi::wire::{FrameHeader, Kind};
    let mut s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // (After a handshake, frames go sealed with the session's keys, as a daemon's do.)
    let mut keys = None;
    if let Some((tls, server)) = tls {
        match tls.connect(&s, server) {
            Ok(k) => keys = Some(k),
            Err(_) => return false,
        }
    }
    let data = format!("{name}\n{claimed}").into_bytes();
    let mut h = FrameHeader::new(Kind::Hello);
    h.arg1 = 42;
    h.data_len = data.len() as u32;
    let mut frames = [&h.encode()[..], &data].concat();
    // What it would do next, in the same breath: connect its QP to every low QPN claiming
    // tenant t, tell them their peers are gone, acknowledge their requests (F_ACKS), take
    // over their lanes, and send a datagram from a spoofed source. None may be acted on.
    for qpn in 1..=32u32 {
        let req = vrdma_abi::wire::ConnectReq { src_gid: [0xaa; 16], dst_gid: [0xbb; 16], src_tenant: "t".into() }.encode();
        let mut f = FrameHeader::new(Kind::ConnectReq);
        (f.src_qpn, f.dst_qpn, f.data_len) = (qpn, qpn, req.len() as u32);
        frames.extend_from_slice(&f.encode());
        frames.extend_from_slice(&req);
        for kind in [Kind::PeerGone, Kind::Send, Kind::UdSend] {
            let mut f = FrameHeader::new(kind);
            (f.src_qpn, f.dst_qpn) = (qpn, qpn);
            if kind == Kind::Send {
                f.flags |= vrdma_abi::wire::F_ACKS;
                f.status = u32::MAX;
            }
            frames.extend_from_slice(&f.encode());
        }
    }
    let Some(keys) = keys else {
        let _ = s.write_all(&frames);
        // (A TLS alert is an answer too, but not a HELLO.)
        let mut answer = [0u8; 64];
        return s.read_exact(&mut answer).is_ok() && FrameHeader::decode(&answer).is_ok_and(|h| h.kind == Kind::Hello);
    };
    let _ = s.write_all(&vrdmad::engine::Sealer::new(&keys.send).seal(&[&frames]).unwrap());
    // The answer: one sealed record, with the daemon's HELLO if it took ours.
    let mut answer = vec![0u8; vrdmad::engine::RECORD_MAX + vrdmad::engine::RECORD_OVERHEAD];
    let mut opener = vrdmad::engine::Opener::new(&keys.recv);
    if s.read_exact(&mut answer[..4]).is_err() {
        return false;
    }
    let Some(n) = opener.record_len(&answer).ok().flatten() else { return false };
    if s.read_exact(&mut answer[4..n]).is_err() {
        return false;
    }
    opener
        .open(&mut answer[..n])
        .is_ok_and(|p| p.first_chunk::<64>().is_some_and(|b| FrameHeader::decode(b).is_ok_and(|h| h.kind == Kind::Hello)))
}

/// `vrdma ca …` (panics on failure).
fn vrdma_ca(args: &[&str]) {
    let o = std::process::Command::new(common::VRDMA).arg("ca").args(args).output().unwrap();
    assert!(o.status.success(), "vrdma ca {args:?}: {}", String::from_utf8_lossy(&o.stderr));
}

/// A fake host on the underlay (the root namespace, on the hosts' subnet, reaching the
/// transport ports as a host would) presents HELLOs claiming another host's address, another
/// host's name at its own address and a name the cluster does not have, in the clear, with a
/// certificate of another CA (a wrong key), and with a certificate of the cluster's CA for a
/// host that is not in the cluster: each is refused, counted and logged with both addresses,
/// while a container pair across the hosts checks every byte of SEND/RECV, WRITE, READ and
/// atomics through the daemons.
#[test]
fn forged_hellos_are_refused_and_traffic_goes_on() {
    let Some(c) = Cluster::start("hhello", 2) else { return };
    let (client, server) = c.start_check_pair();
    let (h1, h2) = (c.host("h1").ip, c.host("h2").ip);
    let me = format!("198.19.{}.1:4791", c.net);
    let port1 = std::net::SocketAddr::from((h1, 4791));
    let h2_addr = format!("{h2}:4791");
    let mut attempts = 0;
    for (name, claimed, why) in [
        ("h2", h2_addr.as_str(), "another host's address"),
        ("h2", me.as_str(), "another host's name at the sender's own address"),
        ("evil", me.as_str(), "a host the cluster does not have"),
    ] {
        assert!(!forged_hello(port1, None, name, claimed), "h1 took a HELLO with {why}");
        attempts += 1;
    }
    let tls = common::cluster::transport_tls();
    if tls {
        // A certificate of another CA for h2 (a wrong key), and one of the cluster's CA for a
        // host the cluster does not have, claiming h2 and then itself.
        let (other, real) = (c.dir.join("other-ca"), c.dir.join("ca"));
        vrdma_ca(&["init", "--dir", &other.display().to_string()]);
        let forged = c.dir.join("forged-h2");
        vrdma_ca(&["issue", "h2", "--dir", &other.display().to_string(), "--out", &forged.display().to_string()]);
        let forged = vrdmad::engine::PeerTls::load(&forged, "h2").unwrap();
        assert!(!forged_hello(port1, Some((&forged, "h1")), "h2", &h2_addr), "h1 took another CA's certificate");
        let stranger = c.dir.join("h9");
        vrdma_ca(&["issue", "h9", "--dir", &real.display().to_string(), "--out", &stranger.display().to_string()]);
        let stranger = vrdmad::engine::PeerTls::load(&stranger, "h9").unwrap();
        assert!(!forged_hello(port1, Some((&stranger, "h1")), "h2", &me), "h1 took h9's certificate as h2's");
        assert!(!forged_hello(port1, Some((&stranger, "h1")), "h9", &me), "h1 took a host the cluster does not have");
        attempts += 3;
    }
    // The legitimate pair completes, every byte checked.
    let (ok_c, out_c) = common::wait_output(client, Duration::from_secs(90));
    let (ok_s, out_s) = common::wait_output(server, Duration::from_secs(10));
    assert!(ok_c && ok_s, "client {ok_c}:\n{out_c}\nserver {ok_s}:\n{out_s}\n{}", c.logs());
    assert!(out_c.contains("RDMA READ      ok") && out_s.contains("all data verified"), "{out_c}\n{out_s}");
    let log = c.host("h1").log();
    let from = format!("refused peer at 198.19.{}.1:", c.net);
    assert_eq!(log.matches(&from).count(), attempts, "{log}");
    if tls {
        assert!(log.contains("its certificate is for another host") && log.contains("no host h9 in the cluster"), "{log}");
    } else {
        assert!(log.contains(&format!("claiming host \"h2\" at {h2_addr}: it claims another address")), "{log}");
        assert!(log.contains("host h2 is at") && log.contains("no host evil in the cluster"), "{log}");
    }
    assert!(!log.contains("QP(s) to ERR"), "a forged HELLO failed QPs:\n{log}");
    // Nothing after a refused first frame was read, let alone acted on.
    assert!(!log.contains("refused connection from QP") && !log.contains("claims tenant"), "{log}");
}

/// What the relay on the path does to the daemons' traffic from h1 to h2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tamper {
    /// Flips one bit.
    FlipBit,
    /// Sends a stretch of bytes again, right after itself.
    Replay,
    /// Inserts bytes of its own.
    Inject,
    /// Cuts the connection in the middle of a stretch.
    Truncate,
}

/// Where the relay starts tampering: past the TLS handshake and the HELLO, in the frames.
const TAMPER_AFTER: usize = 24 << 10;

/// The firewall mark of the relay's own connections (not redirected to itself).
const RELAY_MARK: u32 = 0x7a;

/// Moves the calling thread into network namespace `netns`.
fn enter_netns(netns: &str) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(format!("/run/netns/{netns}")).unwrap();
    // SAFETY: setns(2) on a namespace file we hold open; it changes only this thread.
    assert_eq!(unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns {netns}");
}

/// The address a redirected connection was meant for (SO_ORIGINAL_DST).
fn original_destination(s: &std::net::TcpStream) -> std::net::SocketAddr {
    use std::os::fd::AsRawFd;
    // SAFETY: plain C data; all-zero is a valid value.
    let mut sin: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    const SO_ORIGINAL_DST: libc::c_int = 80;
    // SAFETY: `sin` and `len` are live and sized for the option's value.
    let rc =
        unsafe { libc::getsockopt(s.as_raw_fd(), libc::SOL_IP, SO_ORIGINAL_DST, (&mut sin as *mut libc::sockaddr_in).cast(), &mut len) };
    assert_eq!(rc, 0, "SO_ORIGINAL_DST: {}", std::io::Error::last_os_error());
    std::net::SocketAddr::from((Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)), u16::from_be(sin.sin_port)))
}

/// A TCP connection to `to` carrying [`RELAY_MARK`].
fn marked_connect(to: std::net::SocketAddr) -> std::io::Result<std::net::TcpStream> {
    use std::os::fd::FromRawFd;
    let std::net::SocketAddr::V4(v4) = to else { return Err(std::io::ErrorKind::Unsupported.into()) };
    // SAFETY: a new socket, owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is ours, now owned by the stream (closed on drop).
    let s = unsafe { std::net::TcpStream::from_raw_fd(fd) };
    let mark = RELAY_MARK;
    // SAFETY: a live u32 of the option's size.
    unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_MARK, (&mark as *const u32).cast(), 4) };
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: v4.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*v4.ip()).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: a live sockaddr_in of the given size.
    let rc = unsafe {
        libc::connect(fd, (&sin as *const libc::sockaddr_in).cast(), std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(s)
}

/// Copies `from` to `to`, tampering as `mode` says once `TAMPER_AFTER` bytes went (if it is
/// set); counts the tamperings in `done`.
fn forward(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    mode: Option<std::sync::Arc<std::sync::Mutex<Tamper>>>,
    done: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::io::{Read, Write};
    let mut buf = vec![0u8; 4096];
    let (mut total, mut tampered) = (0usize, false);
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &mut buf[..n];
        let mut out: Vec<u8> = chunk.to_vec();
        if let Some(m) = mode.as_ref().filter(|_| !tampered && total + n > TAMPER_AFTER) {
            tampered = true;
            done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            match *m.lock().unwrap() {
                Tamper::FlipBit => out[n / 2] ^= 0x10,
                Tamper::Replay => out = [chunk.to_vec(), chunk.to_vec()].concat(),
                Tamper::Inject => out = [vec![0x41u8; 100], chunk.to_vec()].concat(),
                Tamper::Truncate => {
                    let _ = to.write_all(&chunk[..n / 2 + 1]);
                    break;
                }
            }
        }
        total += n;
        if to.write_all(&out).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
    let _ = from.shutdown(std::net::Shutdown::Both);
}

/// A relay in h1's namespace, on `port`: every connection h1 makes to a daemon port is
/// redirected to it (nftables), and it forwards the bytes to where they were going, from
/// h1's own address, tampering with what h1 sends as `mode` says.
fn start_relay(
    netns: String,
    port: u16,
    mode: std::sync::Arc<std::sync::Mutex<Tamper>>,
    done: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    let (ready_tx, ready) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        enter_netns(&netns);
        let l = std::net::TcpListener::bind(("0.0.0.0", port)).unwrap();
        ready_tx.send(()).unwrap();
        for s in l.incoming() {
            let Ok(daemon_side) = s else { continue };
            let to = original_destination(&daemon_side);
            let Ok(peer_side) = marked_connect(to) else { continue };
            let (d2, p2) = (daemon_side.try_clone().unwrap(), peer_side.try_clone().unwrap());
            let (m, n) = (mode.clone(), done.clone());
            std::thread::spawn(move || forward(daemon_side, peer_side, Some(m), n));
            let n = done.clone();
            std::thread::spawn(move || forward(p2, d2, None, n));
        }
    });
    ready.recv_timeout(Duration::from_secs(10)).unwrap();
}

/// The daemons' sealed-record refusals in `log`.
fn refused_records(log: &str) -> usize {
    log.lines().filter(|l| l.contains("engine: connection from") && l.contains("; closing it (")).count()
}

/// An attacker on the path between the hosts (a relay h1's connections to h2's daemon are
/// redirected to, forwarding them from h1's address) flips a bit, replays a stretch of
/// bytes, injects bytes and cuts a connection inside a record, each on live authenticated
/// connections carrying a container pair's `vrdma check`: h2 refuses each (the frames are
/// sealed: nothing altered is acted on), counts it and logs it with both addresses. Before
/// sealing, the flipped bit and the replayed and injected bytes were read as h1's frames.
#[test]
fn tampering_on_the_path_is_refused_and_counted() {
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Mutex};
    if !common::cluster::transport_tls() {
        // (Frames are sealed only with TLS: without it, this is the attack it cannot stop.)
        return;
    }
    let Some(c) = Cluster::start("hmitm", 2) else { return };
    c.ok("h1", &["vnic", "create", "ma", "--tenant", "t"]);
    c.ok("h1", &["vnic", "create", "mb", "--tenant", "t", "--host", "h2"]);
    assert!(wait_until(Duration::from_secs(10), || c.host("h2").socket("mb").exists()));
    let mb_ip = c.vnic_ip("h1", "mb").to_string();
    let (h1, h2) = (c.host("h1").ip, c.host("h2").ip);
    let mode = Arc::new(Mutex::new(Tamper::FlipBit));
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let port = 14791;
    start_relay(c.host("h1").netns.clone(), port, mode.clone(), done.clone());
    let (mark, to) = (format!("{RELAY_MARK:#x}"), format!(":{port}"));
    let h2s = h2.to_string();
    for cmd in [
        &["nft", "add", "table", "ip", "vrdma_mitm"][..],
        &["nft", "add chain ip vrdma_mitm out { type nat hook output priority -100; policy accept; }"],
        &[
            "nft",
            "add",
            "rule",
            "ip",
            "vrdma_mitm",
            "out",
            "meta",
            "mark",
            "!=",
            &mark,
            "ip",
            "daddr",
            &h2s,
            "tcp",
            "dport",
            "4791",
            "redirect",
            "to",
            &to,
        ],
    ] {
        let out = in_netns(&c, "h1", cmd);
        assert!(out.trim().is_empty(), "{cmd:?}: {out}");
    }
    for (round, tamper) in [Tamper::FlipBit, Tamper::Replay, Tamper::Inject, Tamper::Truncate].into_iter().enumerate() {
        *mode.lock().unwrap() = tamper;
        let before = refused_records(&c.host("h2").log());
        let tampered = done.load(Ordering::SeqCst);
        let server = c.run_container("h2", "mb", &[common::VRDMA, "check"]);
        std::thread::sleep(Duration::from_secs(2));
        let client = c.run_container("h1", "ma", &[common::VRDMA, "check", &mb_ip]);
        let refused = wait_until(Duration::from_secs(60), || refused_records(&c.host("h2").log()) > before);
        // (The pair fails with its connection, as across a cut link: not what is checked.)
        let (_, out_c) = common::wait_output(client, Duration::from_secs(5));
        let (_, out_s) = common::wait_output(server, Duration::from_secs(5));
        assert!(done.load(Ordering::SeqCst) > tampered, "round {round}: the relay tampered with nothing:\n{out_c}\n{out_s}\n{}", c.logs());
        assert!(refused, "{tamper:?} was not refused:\n{out_c}\n{out_s}\n{}", c.logs());
    }
    let log = c.host("h2").log();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("; closing it (")).collect();
    // Logged with both addresses: h1's (the connection's source) and h2's daemon port.
    assert!(lines.iter().all(|l| l.contains(&format!("from {h1}:")) && l.contains(&format!("to {h2}:4791"))), "{lines:#?}");
    assert!(lines.iter().any(|l| l.contains("fails authentication")), "{lines:#?}");
    assert!(lines.iter().any(|l| l.contains("ended inside record")), "{lines:#?}");
    let _ = in_netns(&c, "h1", &["nft", "delete", "table", "ip", "vrdma_mitm"]);
}

/// A peer daemon's side of one authenticated, sealed connection, as a test speaks it.
struct SealedPeer {
    s: std::net::TcpStream,
    sealer: vrdmad::engine::Sealer,
    opener: vrdmad::engine::Opener,
    /// Plaintext received and not yet taken.
    plain: Vec<u8>,
}

impl SealedPeer {
    /// Connects to `to` from the calling thread's namespace and makes the TLS handshake as
    /// `tls`'s host with the daemon of host `server`.
    fn connect(to: std::net::SocketAddr, tls: &vrdmad::engine::PeerTls, server: &str) -> SealedPeer {
        let s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let keys = tls.connect(&s, server).unwrap_or_else(|e| panic!("handshake with {server}: {e}"));
        SealedPeer {
            s,
            sealer: vrdmad::engine::Sealer::new(&keys.send),
            opener: vrdmad::engine::Opener::new(&keys.recv),
            plain: Vec::new(),
        }
    }

    fn send(&mut self, frames: &[u8]) {
        use std::io::Write;
        let wire = self.sealer.seal(&[frames]).unwrap();
        self.s.write_all(&wire).unwrap();
    }

    /// The next frame (header and data), or none once the daemon closed the connection or
    /// said nothing for the read timeout.
    fn next_frame(&mut self) -> Option<(vrdma_abi::wire::FrameHeader, Vec<u8>)> {
        use std::io::Read;
        use vrdma_abi::wire::{FrameHeader, HEADER_LEN};
        loop {
            if let Some(head) = self.plain.first_chunk::<HEADER_LEN>() {
                let h = FrameHeader::decode(head).ok()?;
                let end = HEADER_LEN + h.data_len as usize;
                if self.plain.len() >= end {
                    let data = self.plain[HEADER_LEN..end].to_vec();
                    self.plain.drain(..end);
                    return Some((h, data));
                }
            }
            let mut record = vec![0u8; 4];
            self.s.read_exact(&mut record).ok()?;
            let n = self.opener.record_len(&record).ok()??;
            record.resize(n, 0);
            self.s.read_exact(&mut record[4..]).ok()?;
            let p = self.opener.open(&mut record).ok()?;
            self.plain.extend_from_slice(p);
        }
    }
}

/// A frame of `kind` from our QP `src` to the peer's QP `dst`, with `data`.
fn frame_to(kind: vrdma_abi::wire::Kind, src: u32, dst: u32, data: &[u8]) -> Vec<u8> {
    let mut h = vrdma_abi::wire::FrameHeader::new(kind);
    (h.src_qpn, h.dst_qpn, h.data_len) = (src, dst, data.len() as u32);
    [&h.encode()[..], data].concat()
}

fn gid_of(ip: Ipv4Addr) -> [u8; 16] {
    ip.to_ipv6_mapped().octets()
}

/// The `refused_connections` counter of `host`'s local vNIC `vnic`.
fn refused_connections(c: &Cluster, host: &str, vnic: &str) -> u64 {
    let v = c.list(host);
    let x = v.iter().find(|x| x["vnic"]["name"] == vnic).unwrap_or_else(|| panic!("no vNIC {vnic} on {host}: {v:?}"));
    x["counters"]["refused_connections"].as_u64().unwrap_or(0)
}

/// Where h1's daemon serves its metrics in the lying-peer test (in h1's namespace).
const METRICS_AT: &str = "127.0.0.1:9464";

/// `vrdma_host_NAME_total` of `host`'s daemon, read from its metrics endpoint.
fn host_counter(c: &Cluster, host: &str, name: &str) -> u64 {
    use std::io::{Read, Write};
    let netns = c.host(host).netns.clone();
    let text = std::thread::spawn(move || {
        enter_netns(&netns);
        let mut s = std::net::TcpStream::connect(METRICS_AT).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        text
    })
    .join()
    .unwrap();
    let series = format!("vrdma_host_{name}_total{{");
    let line = text.lines().find(|l| l.starts_with(&series)).unwrap_or_else(|| panic!("no {series} in:\n{text}"));
    line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{line}"))
}

/// QP numbers the lying peer tries besides the live pair's.
const LIAR_QPNS: u32 = 48;

/// A LYING BUT AUTHENTICATED peer: a process holding h3's valid certificate, connecting from
/// h3's own address (so its handshake and HELLO are accepted as h3's), sends h1 frames that
/// claim what h3 does not serve: CONNECT_REQs from h2's vNIC (another host's), from h3's own
/// red vNIC claiming tenant blue to blue's vNIC (another tenant's), PEER_GONEs and F_ACKS
/// SENDs for h1's QP paired with h2's (a QP it does not own), UD datagrams from h2's vNIC,
/// and a LANE for that QP. Every CONNECT_REQ is answered with a refusal and counted on the
/// vNIC it was for, and the tenant judged is the view's (red), not the frame's; the other
/// frames and the lane are refused, counted by the host and logged; meanwhile a container
/// pair across h1 and h2 runs `vrdma perf write_bw --check` (over a lane) to the end, every
/// byte checked, and no QP leaves RTS.
#[test]
fn a_lying_authenticated_peer_is_refused_and_traffic_goes_on() {
    use vrdma_abi::wire::{ConnectReq, FrameHeader, Kind, F_ACKS};
    if !common::cluster::transport_tls() {
        // (Without certificates there is no authenticated peer to lie.)
        return;
    }
    let Some(c) = Cluster::start_with_daemon_args("hliar", 3, &[&["--metrics", METRICS_AT]]) else { return };
    c.ok("h1", &["vnic", "create", "blue", "--tenant", "blue"]);
    c.ok("h1", &["vnic", "create", "red", "--tenant", "red", "--host", "h3"]);
    c.ok("h1", &["vnic", "create", "ka", "--tenant", "t"]);
    c.ok("h1", &["vnic", "create", "kb", "--tenant", "t", "--host", "h2"]);
    for (h, v) in [("h3", "red"), ("h2", "kb")] {
        assert!(wait_until(Duration::from_secs(10), || c.host(h).socket(v).exists()), "{}", c.logs());
    }
    let (ka, kb, blue, red) = (c.vnic_ip("h1", "ka"), c.vnic_ip("h1", "kb"), c.vnic_ip("h1", "blue"), c.vnic_ip("h1", "red"));
    let perf = |to: Option<String>| {
        let mut cmd: Vec<String> = ["perf", "write_bw", "--check", "-s", "4096", "-D", "10", "-p", "18600"].map(String::from).to_vec();
        cmd.insert(0, common::VRDMA.to_string());
        cmd.extend(to);
        cmd
    };
    let server = c.run_container("h2", "kb", &perf(None).iter().map(String::as_str).collect::<Vec<_>>());
    std::thread::sleep(Duration::from_secs(2));
    let client = c.run_container("h1", "ka", &perf(Some(kb.to_string())).iter().map(String::as_str).collect::<Vec<_>>());
    // The pair's QPs, from h2's log of the lane h1 opened: h1's QP (the liar's target), h2's.
    let lane_from_h1 = format!("engine: lane from {}:4791: its QP ", c.host("h1").ip);
    let mut pair = None;
    let found = wait_until(Duration::from_secs(30), || {
        pair = c.host("h2").log().lines().find_map(|l| {
            let (theirs, ours) = l.split_once(&lane_from_h1)?.1.split_once(" to our QP ")?;
            Some((theirs.trim().parse::<u32>().ok()?, ours.trim().parse::<u32>().ok()?))
        });
        pair.is_some()
    });
    assert!(found, "no lane from h1\n{}", c.logs());
    let (qp1, qp2) = pair.unwrap();
    let (h1, h3) = (c.host("h1").ip, c.host("h3").ip);
    let tls = vrdmad::engine::PeerTls::load(&c.host("h3").dir.join("state").join("tls"), "h3").unwrap();
    let (refused_ka, refused_blue) = (refused_connections(&c, "h1", "ka"), refused_connections(&c, "h1", "blue"));
    let claims = host_counter(&c, "h1", "refused_claims");
    let netns = c.host("h3").netns.clone();
    let liar = std::thread::spawn(move || {
        enter_netns(&netns);
        let to = std::net::SocketAddr::from((h1, 4791));
        let mut p = SealedPeer::connect(to, &tls, "h1");
        let hello = format!("h3\n{h3}:4791").into_bytes();
        let mut frames = frame_to(Kind::Hello, 0, 0, &hello);
        let qpns: Vec<u32> = (1..=LIAR_QPNS).chain((qp1 > LIAR_QPNS).then_some(qp1)).collect();
        for &qpn in &qpns {
            // Another host's vNIC as the source, to h1's ka.
            let foreign = ConnectReq { src_gid: gid_of(kb), dst_gid: gid_of(ka), src_tenant: "t".into() }.encode();
            frames.extend(frame_to(Kind::ConnectReq, qpn, qpn, &foreign));
            // Its own red vNIC claiming tenant blue, to blue.
            let tenant = ConnectReq { src_gid: gid_of(red), dst_gid: gid_of(blue), src_tenant: "blue".into() }.encode();
            frames.extend(frame_to(Kind::ConnectReq, qpn, qpn, &tenant));
            // (As the QP itself, and as h2's QP of the pair.)
            for src in [qpn, qp2] {
                frames.extend(frame_to(Kind::PeerGone, src, qpn, &[]));
            }
            let mut send = FrameHeader::new(Kind::Send);
            (send.src_qpn, send.dst_qpn, send.flags, send.status) = (qpn, qpn, F_ACKS, u32::MAX);
            frames.extend_from_slice(&send.encode());
            let ud = [&gid_of(kb)[..], &gid_of(ka), b"spoofed"].concat();
            frames.extend(frame_to(Kind::UdSend, qpn, qpn, &ud));
        }
        p.send(&frames);
        // Every CONNECT_REQ is answered: with a refusal.
        let sent = 2 * qpns.len();
        let (mut answers, mut accepted) = (0, 0);
        while answers < sent {
            let Some((h, _)) = p.next_frame() else { break };
            if h.kind == Kind::ConnectRep {
                answers += 1;
                accepted += usize::from(h.status == 0);
            }
        }
        // A LANE for h1's QP of the pair, claiming h2's QP's number.
        let mut lane = SealedPeer::connect(to, &tls, "h1");
        let mut h = FrameHeader::new(Kind::Lane);
        (h.src_qpn, h.dst_qpn, h.data_len, h.arg2, h.remote_addr) = (qp2, qp1, hello.len() as u32, 1, 2);
        lane.send(&[&h.encode()[..], &hello].concat());
        // A lane taken is answered with a HELLO; a refused one is closed.
        let lane_refused = lane.next_frame().is_none_or(|(h, _)| h.kind != Kind::Hello);
        (answers, sent, accepted, lane_refused)
    });
    let (answers, sent, accepted, lane_refused) = liar.join().unwrap();
    let (ok_c, out_c) = common::wait_output(client, Duration::from_secs(90));
    let (ok_s, out_s) = common::wait_output(server, Duration::from_secs(30));
    assert!(ok_c && ok_s, "client {ok_c}:\n{out_c}\nserver {ok_s}:\n{out_s}\n{}", c.logs());
    assert_eq!((answers, accepted), (sent, 0), "every CONNECT_REQ answered, none accepted\n{}", c.logs());
    assert!(lane_refused, "a lane for h1's QP {qp1}, paired with h2's {qp2}, was taken\n{}", c.logs());
    let log = c.host("h1").log();
    let from = format!("at {h3}:4791");
    let foreign = log.lines().filter(|l| l.contains("refused connection from QP") && l.contains(&from) && l.contains("to vNIC ka")).count();
    let tenant =
        log.lines().filter(|l| l.contains("refused connection from QP") && l.contains("(tenant red) to vNIC blue (tenant blue)")).count();
    assert_eq!((foreign, tenant), (sent / 2, sent / 2), "{log}");
    assert!(log.contains("claims tenant \"blue\"; its vNIC's is red"), "{log}");
    // The PEER_GONE, the F_ACKS SEND and the datagram for the pair's QP, and the lane, are
    // refused and counted by the host.
    for what in [
        format!("PEER_GONE from its QP {qp2} for our QP {qp1}"),
        format!("Send from its QP {qp1} for our QP {qp1}"),
        format!("UD datagram to QP {qp1}"),
        format!("lane for its QP {qp2} to our QP {qp1}, which is paired otherwise"),
    ] {
        assert!(log.contains(&what), "{what}:\n{log}");
    }
    let total = host_counter(&c, "h1", "refused_claims");
    assert!(total - claims >= 4, "{} refused claims counted\n{log}", total - claims);
    // The CLI shows the same counters.
    let stats: serde_json::Value = serde_json::from_str(&c.ok("h1", &["host", "stats", "--json"])).unwrap();
    assert!(stats["refused_claims"].as_u64().is_some_and(|n| n >= total), "{stats}");
    assert!(c.ok("h1", &["host", "stats"]).contains("frames claiming QPs, lanes or sources"));
    // Counted on the vNICs they were for.
    assert!(refused_connections(&c, "h1", "ka") >= refused_ka + (sent / 2) as u64, "{}", c.logs());
    assert!(refused_connections(&c, "h1", "blue") >= refused_blue + (sent / 2) as u64, "{}", c.logs());
    for h in ["h1", "h2"] {
        assert!(!c.host(h).log().contains("QP(s) to ERR"), "{h} failed QPs:\n{}", c.logs());
    }
}
