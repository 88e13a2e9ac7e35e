//! End-to-end tests of `run_container` and `ensure_bridge`.
//!
//! They need root, iproute2's `ip`, and permission to unshare namespaces; without one of
//! those they print why and pass without checking anything. Addresses are in
//! 198.18.0.0/15 (DESIGN.md §9). Connectivity is checked with `ping` (iputils-ping) when
//! installed, and with a python3 TCP exchange when python3 is.

use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::errno::Errno;
use vrdma_netns::{ensure_bridge, run_container, ContainerSpec, NetnsError};
use vrdma_test_support::skip;

/// Why root tests cannot run here, if they cannot.
fn missing_privilege() -> Option<String> {
    // SAFETY: geteuid(2) has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not running as root".into());
    }
    let has_ip = ["ip", "/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
        .iter()
        .any(|ip| Command::new(ip).arg("-V").output().is_ok_and(|o| o.status.success()));
    if !has_ip {
        return Some("iproute2's `ip` is not installed".into());
    }
    None
}

fn ip(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().expect("run ip");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    ["/usr/bin", "/usr/local/bin", "/bin", "/usr/sbin", "/sbin"]
        .iter()
        .map(PathBuf::from)
        .chain(std::env::split_paths(&path))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Deletes the test bridge and the scratch directory, even when the test panics.
struct Cleanup {
    bridge: String,
    dir: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", "dev", &self.bridge]).output();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A test bridge `vrdmat<pid%1000><tag>` with `gateway/24`, or `None` (`test` skipped).
fn setup(test: &str, tag: char, gateway: Ipv4Addr) -> Option<Cleanup> {
    if let Some(why) = missing_privilege() {
        skip(test, why);
        return None;
    }
    let bridge = format!("vrdmat{}{tag}", std::process::id() % 1000);
    let dir = std::env::temp_dir().join(format!("vrdma-netns-test-{}-{tag}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let cleanup = Cleanup { bridge: bridge.clone(), dir };
    match ensure_bridge(&bridge, gateway, 24) {
        Ok(()) => {}
        Err(e) if e.to_string().contains("Operation not permitted") => {
            skip(test, format_args!("cannot create a bridge: {e}"));
            return None;
        }
        Err(e) => panic!("ensure_bridge: {e}"),
    }
    Some(cleanup)
}

fn spec(name: &str, vnic_dir: &Path, ip: Ipv4Addr, gateway: Ipv4Addr, bridge: &str) -> ContainerSpec {
    ContainerSpec {
        name: name.into(),
        vnic_dir: vnic_dir.into(),
        ip,
        prefix_len: 24,
        gateway,
        bridge: bridge.into(),
        command: vec![],
        env: vec![],
        hide_paths: vec![],
        verbs_devices: vec![],
        lib_dir: None,
        sandbox: Default::default(),
    }
}

/// Runs `spec`; `None` if unsharing is not permitted here (test skipped).
fn run(spec: &ContainerSpec) -> Option<Result<i32, NetnsError>> {
    match run_container(spec) {
        Err(NetnsError::Unshare { source: Errno::EPERM }) => {
            skip("run_container", "unshare(2) is not permitted here");
            None
        }
        r => Some(r),
    }
}

fn sh(script: String) -> Vec<String> {
    vec!["sh".into(), "-c".into(), script]
}

#[test]
fn two_containers_on_a_bridge() {
    let gw = Ipv4Addr::new(198, 19, 250, 1);
    let Some(cleanup) = setup("two_containers_on_a_bridge", 'a', gw) else {
        return;
    };
    let bridge = cleanup.bridge.clone();

    // Idempotent: a second call changes nothing and adds no second address.
    ensure_bridge(&bridge, gw, 24).unwrap();
    let addrs = ip(&["-o", "-4", "addr", "show", "dev", &bridge]);
    assert_eq!(addrs.matches("198.19.250.1/24").count(), 1, "{addrs}");
    assert!(ip(&["-o", "link", "show", "dev", &bridge]).contains(",UP"), "bridge is not up");

    let hidden = cleanup.dir.join("hidden");
    fs::create_dir_all(&hidden).unwrap();
    fs::write(hidden.join("secret"), "host-only").unwrap();

    let ping = find_program("ping");
    let python = find_program("python3");
    assert!(ping.is_some() || python.is_some(), "need iputils-ping or python3 to check connectivity between containers");
    eprintln!("connectivity via: ping={ping:?} python3={python:?}");

    let ip_a = Ipv4Addr::new(198, 19, 250, 10);
    let ip_b = Ipv4Addr::new(198, 19, 250, 11);
    let make = |name: &str, ip: Ipv4Addr, tail: String| {
        let vnic = cleanup.dir.join(name);
        fs::create_dir_all(&vnic).unwrap();
        fs::write(vnic.join(format!("marker-{name}")), name).unwrap();
        let mut s = spec(name, &vnic, ip, gw, &bridge);
        s.env = vec![("VRDMA_TEST_ENV".into(), name.into())];
        s.hide_paths = vec![hidden.clone(), "/nonexistent/vrdma-netns".into()];
        // ping needs a raw or ICMP socket: the one capability kept (`--cap-add NET_RAW`).
        s.sandbox.cap_add = vec!["NET_RAW".into()];
        let checks = format!(
            r#"
            err() {{ echo "container {name}: $2" >&2; exit "$1"; }}
            ip -4 addr show eth0 | grep -q "inet {ip}/24 " || err 10 "eth0 lacks {ip}/24"
            [ "$(uname -n)" = "{name}" ] || err 11 "hostname is $(uname -n)"
            [ "$(ls -A /run/vrdma)" = "marker-{name}" ] || err 12 "/run/vrdma holds: $(ls -A /run/vrdma)"
            [ "$$" = 1 ] || err 13 "shell pid is $$"
            [ -z "$(ls -A {hidden})" ] || err 14 "hidden path shows: $(ls -A {hidden})"
            [ "$VRDMA_TEST_ENV" = "{name}" ] || err 15 "env var missing"
            ip route show default | grep -q "via {gw}" || err 16 "no default route via {gw}"
            [ "$(ip -o link show | wc -l)" = 2 ] || err 17 "links: $(ip -o link show)"
            [ "$(ls /proc | grep -c '^[0-9]')" -lt 5 ] || err 18 "/proc shows host processes"
            {tail}
            "#,
            hidden = hidden.display(),
        );
        s.command = sh(checks);
        s
    };

    // B serves (or just stays up for a ping); A connects. A retries until B is up.
    let mut b_tail = String::new();
    let mut a_tail = String::new();
    if let Some(py) = &python {
        b_tail = format!(
            "{py} -c 'import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind((\"{ip_b}\",7471))\ns.listen(1)\ns.settimeout(20)\nc,_=s.accept()\nc.sendall(b\"pong\")\nc.close()' || err 20 'tcp server failed'",
            py = py.display()
        );
        a_tail = format!(
            "{py} -c 'import socket,sys,time\nfor _ in range(100):\n  try:\n    c=socket.create_connection((\"{ip_b}\",7471),timeout=1)\n  except OSError:\n    time.sleep(0.1); continue\n  sys.exit(0 if c.recv(4)==b\"pong\" else 3)\nsys.exit(2)' || err 21 'no tcp reply from {ip_b}'",
            py = py.display()
        );
    }
    if let Some(p) = &ping {
        // B must stay up long enough for A's pings when there is no TCP exchange to wait for.
        if python.is_none() {
            b_tail = "sleep 5".into();
        }
        a_tail = format!(
            "ok=; for i in 1 2 3 4 5 6 7 8 9 10; do {p} -c1 -W1 {ip_b} >/dev/null && ok=1 && break; sleep 0.3; done; [ -n \"$ok\" ] || err 22 'no ping reply from {ip_b}'\n{a_tail}",
            p = p.display()
        );
    }
    let spec_a = make("ctr-a", ip_a, a_tail);
    let spec_b = make("ctr-b", ip_b, b_tail);

    let b = std::thread::spawn(move || run(&spec_b));
    let a = run(&spec_a);
    let b = b.join().expect("container B thread");
    let (Some(a), Some(b)) = (a, b) else { return };
    assert_eq!(a.expect("container A"), 0, "container A failed (see its stderr above)");
    assert_eq!(b.expect("container B"), 0, "container B failed (see its stderr above)");

    // The host veths are gone, and nothing leaked onto the host.
    let ports = ip(&["-o", "link", "show", "master", &bridge]);
    assert!(ports.trim().is_empty(), "ports left on {bridge}: {ports}");
    assert_eq!(fs::read_dir(&hidden).unwrap().count(), 1, "hidden dir changed on the host");
    assert!(!Path::new("/run/vrdma/marker-ctr-a").exists());
}

#[test]
fn exit_codes_and_exec_errors() {
    let gw = Ipv4Addr::new(198, 19, 249, 1);
    let Some(cleanup) = setup("exit_codes_and_exec_errors", 'b', gw) else {
        return;
    };
    let vnic = cleanup.dir.join("vnic");
    fs::create_dir_all(&vnic).unwrap();
    let base = spec("ctr-exit", &vnic, Ipv4Addr::new(198, 19, 249, 20), gw, &cleanup.bridge);

    // Exit status passes through.
    let mut s = base.clone();
    s.command = sh("exit 7".into());
    let Some(r) = run(&s) else { return };
    assert_eq!(r.unwrap(), 7);

    // A command that is not there is an error, not a silent 127. (A PATH of directories
    // the container's root may search: in its user namespace, one it may not, such as a
    // PATH entry under /root, makes the search end in EACCES, as execvp's does.)
    let mut s = base.clone();
    s.command = vec!["vrdma-netns-no-such-program".into()];
    s.env = vec![("PATH".into(), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into())];
    match run(&s).unwrap() {
        Err(NetnsError::Exec { command, source: Errno::ENOENT }) => {
            assert_eq!(command, "vrdma-netns-no-such-program")
        }
        r => panic!("expected Exec(ENOENT), got {r:?}"),
    }

    // Killed by a signal: 128 + signal. PID 1 of a PID namespace cannot be killed by a
    // signal it sends itself, but a real fault is always delivered.
    if let Some(py) = find_program("python3") {
        let mut s = base.clone();
        s.command = vec![py.display().to_string(), "-c".into(), "import ctypes; ctypes.string_at(0)".into()];
        assert_eq!(run(&s).unwrap().unwrap(), 128 + libc::SIGSEGV);
    } else {
        eprintln!("python3 missing: not checking 128+signal");
    }

    // A hidden file is covered by /dev/null; PATH comes from spec.env.
    let secret = cleanup.dir.join("secret.txt");
    fs::write(&secret, "host-only").unwrap();
    let mut s = base.clone();
    s.hide_paths = vec![secret.clone()];
    s.env = vec![("PATH".into(), "/usr/sbin:/usr/bin:/sbin:/bin".into())];
    s.command = sh(format!("[ ! -s {0} ] && [ \"$PATH\" = /usr/sbin:/usr/bin:/sbin:/bin ]", secret.display()));
    assert_eq!(run(&s).unwrap().unwrap(), 0);
    assert_eq!(fs::read_to_string(&secret).unwrap(), "host-only");

    // Verbs device nodes: a /dev/infiniband of the container's own holds a read-writable
    // character node per name (a null device), and nothing else; the host's is unchanged.
    let host_nodes =
        || fs::read_dir("/dev/infiniband").map(|d| d.filter_map(|e| e.ok().map(|e| e.file_name())).collect::<Vec<_>>()).unwrap_or_default();
    let before = host_nodes();
    let mut s = base.clone();
    s.verbs_devices = vec!["vrdma_x".into(), "vrdma_y".into()];
    s.command = sh("for n in vrdma_x vrdma_y; do [ -c /dev/infiniband/$n ] && [ -r /dev/infiniband/$n ] && [ -w /dev/infiniband/$n ] || exit 1; done; \
         echo data > /dev/infiniband/vrdma_x && [ ! -s /dev/infiniband/vrdma_x ] && [ \"$(ls /dev/infiniband | wc -l)\" = 2 ]"
        .into());
    assert_eq!(run(&s).unwrap().unwrap(), 0);
    assert_eq!(host_nodes(), before, "the host's /dev/infiniband changed");

    // /sys/class/net is the container's: its eth0 and lo, not the host's bridge.
    let mut s = base.clone();
    s.command = sh(format!("[ \"$(ls /sys/class/net | tr '\\n' ' ')\" = 'eth0 lo ' ] && [ ! -e /sys/class/net/{} ]", cleanup.bridge));
    assert_eq!(run(&s).unwrap().unwrap(), 0);

    // The sandbox: no capabilities, a read-only host, private /tmp; without it (trusted
    // use, `vrdma run --privileged`), the caller's capabilities and a writable host.
    let marker = cleanup.dir.join("written-from-inside");
    let host_marker = format!("/etc/vrdma-netns-test-{}", std::process::id());
    let caps_are = |v: &str| format!("[ \"$(awk '/^CapEff/{{print $2}}' /proc/self/status)\" = {v} ]");
    let mut s = base.clone();
    s.command = sh(format!(
        "{} && grep -q '^Seccomp:.*2$' /proc/self/status && ! touch {host_marker} 2>/dev/null && touch /tmp/inside-{pid} \
         && [ \"$(ls /dev | wc -l)\" -lt 20 ]",
        caps_are("0000000000000000"),
        pid = std::process::id()
    ));
    assert_eq!(run(&s).unwrap().unwrap(), 0, "sandboxed");
    assert!(!Path::new(&host_marker).exists() && !Path::new(&format!("/tmp/inside-{}", std::process::id())).exists());
    let mut s = base.clone();
    s.sandbox.enabled = false;
    s.command = sh(format!("! {} && touch {m}", caps_are("0000000000000000"), m = marker.display()));
    assert_eq!(run(&s).unwrap().unwrap(), 0, "unsandboxed");
    assert!(marker.exists());

    // The bridge gained no leftover ports.
    let ports = ip(&["-o", "link", "show", "master", &cleanup.bridge]);
    assert!(ports.trim().is_empty(), "ports left: {ports}");
}

#[test]
fn invalid_specs_are_rejected_before_anything_runs() {
    let dir = std::env::temp_dir();
    let gw = Ipv4Addr::new(198, 18, 0, 1);
    let base = ContainerSpec { command: vec!["true".into()], ..spec("v", &dir, Ipv4Addr::new(198, 18, 0, 2), gw, "vrdma0") };
    let field_of = |s: &ContainerSpec| match run_container(s) {
        Err(NetnsError::InvalidSpec { field, .. }) => field,
        r => panic!("expected InvalidSpec, got {r:?}"),
    };

    let mut s = base.clone();
    s.command.clear();
    assert_eq!(field_of(&s), "command");
    let mut s = base.clone();
    s.prefix_len = 33;
    assert_eq!(field_of(&s), "prefix_len");
    let mut s = base.clone();
    s.gateway = Ipv4Addr::new(198, 19, 0, 1);
    s.prefix_len = 24;
    assert_eq!(field_of(&s), "gateway");
    let mut s = base.clone();
    s.ip = gw;
    assert_eq!(field_of(&s), "ip");
    let mut s = base.clone();
    s.bridge = "a-bridge-name-too-long".into();
    assert_eq!(field_of(&s), "bridge");
    let mut s = base.clone();
    s.vnic_dir = dir.join("vrdma-netns-does-not-exist");
    assert_eq!(field_of(&s), "vnic_dir");
    let mut s = base.clone();
    s.name = String::new();
    assert_eq!(field_of(&s), "name");
    let mut s = base.clone();
    s.env = vec![("A=B".into(), "x".into())];
    assert_eq!(field_of(&s), "env");
    let mut s = base.clone();
    s.hide_paths = vec!["relative".into()];
    assert_eq!(field_of(&s), "hide_paths");
    for bad in ["", "a/b", "..", &"n".repeat(64)] {
        let mut s = base.clone();
        s.verbs_devices = vec![bad.to_string()];
        assert_eq!(field_of(&s), "verbs_devices", "{bad:?}");
    }

    assert!(matches!(ensure_bridge("bad/name", gw, 15), Err(NetnsError::InvalidSpec { field: "bridge", .. })));
    assert!(matches!(ensure_bridge("vrdma0", gw, 0), Err(NetnsError::InvalidSpec { field: "prefix_len", .. })));
}

/// The bridge keeps its MAC address while ports come and go: containers cache it (gateway,
/// proxy-ARPed addresses of other hosts), so a MAC that followed the lowest port's address
/// would cut every other container off when the container owning that port exits.
#[test]
fn bridge_mac_survives_ports_coming_and_going() {
    let gw = Ipv4Addr::new(198, 19, 251, 1);
    let Some(cleanup) = setup("bridge_mac_survives_ports_coming_and_going", 'm', gw) else {
        return;
    };
    let bridge = cleanup.bridge.clone();
    let mac = |dev: &str| {
        let out = ip(&["-o", "link", "show", "dev", dev]);
        out.split_whitespace().skip_while(|w| *w != "link/ether").nth(1).unwrap_or_default().to_string()
    };
    let before = mac(&bridge);
    assert_eq!(before.len(), 17, "bridge MAC: {before:?}");
    let port = format!("vrmt{}", std::process::id() % 100_000);
    let peer = format!("{port}p");
    // The lowest unicast MAC there is: an unpinned bridge would take it.
    ip(&["link", "add", &port, "address", "00:00:00:00:00:01", "type", "veth", "peer", "name", &peer]);
    ip(&["link", "set", "dev", &port, "master", &bridge, "up"]);
    assert_eq!(mac(&port), "00:00:00:00:00:01", "test port was not created");
    assert_eq!(mac(&bridge), before, "the bridge took its new port's MAC");
    ip(&["link", "del", "dev", &port]);
    assert_eq!(mac(&bridge), before, "the bridge changed its MAC when a port left");
    // Again after ensure_bridge on an existing bridge (a daemon restart).
    ensure_bridge(&bridge, gw, 24).unwrap();
    assert_eq!(mac(&bridge), before);
}
