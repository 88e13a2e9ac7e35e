//! Metering against `vrdma perf`: a vrdmad process with `--metrics`, two vNICs on this host
//! (no containers: the processes open the vNICs' sockets through `VRDMA_SOCKET`), a
//! `vrdma perf write_bw --json` run, then a `curl` of the endpoint parsed by Prometheus'
//! parser and `vrdma vnic stats --json` agree with perf's own totals within 1%, after a second
//! client run and after a daemon restart (SIGTERM saves the totals), on the direct path and
//! through the engine (`vrdmad --mediated`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const SIZE: u64 = 65536;
const ITERS: u64 = 2000;

struct Daemon {
    child: Child,
    metrics: String,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts vrdmad on `dir`; returns it once its metrics endpoint is up.
fn start_daemon(dir: &Path, mediated: bool) -> Daemon {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vrdmad"));
    cmd.args(["--run-dir", &dir.join("run").display().to_string(), "--state-dir", &dir.join("state").display().to_string()]);
    cmd.args(["--cdi-dir", "none", "--metrics", "127.0.0.1:0"]).env("RUST_LOG", "info").stdout(Stdio::null()).stderr(Stdio::piped());
    if mediated {
        cmd.arg("--mediated");
    }
    let mut child = cmd.spawn().expect("vrdmad starts");
    let (tx, rx) = std::sync::mpsc::channel();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if let Some(at) = line.find("metrics on http://") {
                let _ = tx.send(line[at + "metrics on ".len()..].trim().to_string());
            }
        }
    });
    let metrics = rx.recv_timeout(Duration::from_secs(30)).expect("vrdmad serves its metrics");
    Daemon { child, metrics }
}

fn vrdma(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_vrdma")).args(args).env("VRDMA_RUN_DIR", dir.join("run")).output().unwrap();
    assert!(out.status.success(), "vrdma {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn socket(dir: &Path, vnic: &str) -> PathBuf {
    dir.join("run").join("vnics").join(vnic).join("control.sock")
}

/// One `vrdma perf write_bw` between vNICs `server` and `client`; the payload bytes the client
/// reports it wrote.
fn perf_write_bw(dir: &Path, server: &str, client: &str, port: u16) -> u64 {
    let common = ["perf", "write_bw", "-s", &SIZE.to_string(), "-n", &ITERS.to_string(), "-p", &port.to_string(), "--json"];
    let bin = env!("CARGO_BIN_EXE_vrdma");
    let srv = Command::new(bin).args(common).env("VRDMA_SOCKET", socket(dir, server)).stdout(Stdio::null()).spawn().unwrap();
    let mut out = None;
    for _ in 0..50 {
        let o = Command::new(bin).args(common).arg("127.0.0.1").env("VRDMA_SOCKET", socket(dir, client)).output().unwrap();
        if o.status.success() {
            out = Some(o);
            break;
        }
        std::thread::sleep(Duration::from_millis(200)); // the server is not listening yet
    }
    let out = out.expect("perf client ran");
    let status = srv.wait_with_output().unwrap().status;
    assert!(status.success(), "perf server failed");
    let row: serde_json::Value = serde_json::from_slice(out.stdout.split(|&b| b == b'\n').next().unwrap()).unwrap();
    row["size"].as_u64().unwrap() * row["iterations"].as_u64().unwrap() * row["qps"].as_u64().unwrap()
}

/// The sum of `family`'s samples for `vnic`, as Prometheus' parser reads the endpoint.
fn scraped(url: &str, family: &str, vnic: &str) -> f64 {
    let out = Command::new("curl").args(["-fsS", "--max-time", "10", url]).output().unwrap();
    assert!(out.status.success(), "curl: {}", String::from_utf8_lossy(&out.stderr));
    let script = r#"
import sys
from prometheus_client.parser import text_string_to_metric_families
family, vnic = sys.argv[1], sys.argv[2]
total, seen = 0.0, False
for f in text_string_to_metric_families(sys.stdin.read()):
    for s in f.samples:
        if s.name == family and s.labels.get("vnic") == vnic:
            total += s.value
            seen = True
assert seen, "no " + family + " for " + vnic
print(total)
"#;
    let mut child = Command::new("/usr/bin/python3")
        .args(["-c", script, family, vnic])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), &out.stdout).unwrap();
    let r = child.wait_with_output().unwrap();
    assert!(r.status.success(), "parser: {}", String::from_utf8_lossy(&r.stderr));
    String::from_utf8_lossy(&r.stdout).trim().parse().unwrap()
}

fn agree(what: &str, got: f64, want: u64) {
    let want = want as f64;
    assert!((got - want).abs() <= want * 0.01, "{what}: {got} against perf's {want}");
}

/// What the endpoint and `vrdma vnic stats` say the two vNICs sent, checked against `want`.
fn check(dir: &Path, d: &Daemon, a: &str, b: &str, want: u64, when: &str) {
    let tx = |v: &str| scraped(&d.metrics, "vrdma_vnic_tx_bytes_total", v);
    agree(&format!("scraped tx bytes {when}"), tx(a) + tx(b), want);
    let rx = |v: &str| scraped(&d.metrics, "vrdma_vnic_rx_bytes_total", v);
    agree(&format!("scraped rx bytes {when}"), rx(a) + rx(b), want);
    let stats = |v: &str| -> f64 {
        let s: serde_json::Value = serde_json::from_str(&vrdma(dir, &["vnic", "stats", v, "--json"])).unwrap();
        s["total"]["tx_bytes"].as_u64().unwrap() as f64
    };
    agree(&format!("vnic stats tx bytes {when}"), stats(a) + stats(b), want);
}

fn meters_agree_with_perf(test: &str, mediated: bool) {
    let parser = "/usr/lib/python3/dist-packages/prometheus_client/parser.py";
    if !vrdma_test_support::require_files(test, &["/usr/bin/curl", "/usr/bin/python3", parser], "curl python3-prometheus-client") {
        return;
    }
    let tag = if mediated { "med" } else { "dir" };
    let dir = std::env::temp_dir().join(format!("vrdma-metering-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (format!("mperf-{tag}-a"), format!("mperf-{tag}-b"));
    let port = 19000 + (std::process::id() % 500) as u16 * 2 + u16::from(mediated);

    let d = start_daemon(&dir, mediated);
    vrdma(&dir, &["vnic", "create", &a, "--tenant", "mperf"]);
    vrdma(&dir, &["vnic", "create", &b, "--tenant", "mperf"]);
    let mut sent = perf_write_bw(&dir, &a, &b, port);
    assert!(sent >= SIZE * ITERS / 2, "perf wrote {sent}");
    check(&dir, &d, &a, &b, sent, "after one run");
    // Another client: the first one's QPs are folded into the vNICs' totals.
    sent += perf_write_bw(&dir, &a, &b, port);
    check(&dir, &d, &a, &b, sent, "after a second client");
    // SIGTERM: vrdmad saves the totals and exits; the next one starts from them.
    // SAFETY: kill(2) of our own child process.
    assert_eq!(unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) }, 0);
    let mut d = d;
    let status = d.child.wait().unwrap();
    assert!(status.success(), "vrdmad exits cleanly on SIGTERM: {status}");
    let d = start_daemon(&dir, mediated);
    check(&dir, &d, &a, &b, sent, "after a daemon restart");
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn meters_agree_with_perf_on_the_direct_path() {
    meters_agree_with_perf("meters_agree_with_perf_on_the_direct_path", false);
}

#[test]
fn meters_agree_with_perf_through_the_engine() {
    meters_agree_with_perf("meters_agree_with_perf_through_the_engine", true);
}
