//! Metering end to end against an in-process vrdmad, on the direct path and through the
//! engine: traffic of known byte counts, then `vrdma vnic stats`' admin request and a
//! `curl` of `--metrics` parsed by Prometheus' own parser agree with it; the counts survive
//! a client restart and a daemon restart.

mod common;
use common::*;
use vrdma::*;

use std::path::Path;
use std::process::Command;

const WRITES: u64 = 50;
const WRITE_LEN: u32 = 4096;
const SENDS: u64 = 20;
const SEND_LEN: u32 = 100;
const READ_LEN: u32 = 2048;

/// Known traffic from `a` to `b`: WRITEs, SENDs, one READ; returns its payload bytes.
fn traffic(a: &End, b: &End) -> u64 {
    for i in 0..WRITES {
        let sg = [a.buf.sge(0, WRITE_LEN)];
        let mut w = SendWr::new(i, WrOpcode::RdmaWrite, &sg, send_flags::SIGNALED);
        w.remote_addr = b.buf.addr();
        w.rkey = b.buf.mr().rkey();
        a.qp.post_send(&w).unwrap();
        assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    }
    for i in 0..SENDS {
        b.qp.post_recv(&RecvWr { wr_id: i, sg_list: &[b.buf.sge(8192, SEND_LEN)] }).unwrap();
        let sg = [a.buf.sge(0, SEND_LEN)];
        a.qp.post_send(&SendWr::new(i, WrOpcode::Send, &sg, send_flags::SIGNALED)).unwrap();
        assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
        assert_eq!(wait_one(&b.cq).status, WcStatus::Success);
    }
    let sg = [a.buf.sge(16384, READ_LEN)];
    let mut r = SendWr::new(99, WrOpcode::RdmaRead, &sg, send_flags::SIGNALED);
    r.remote_addr = b.buf.addr();
    r.rkey = b.buf.mr().rkey();
    a.qp.post_send(&r).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    WRITES * u64::from(WRITE_LEN) + SENDS * u64::from(SEND_LEN) + u64::from(READ_LEN)
}

fn stats(run_dir: &Path, vnic: &str) -> serde_json::Value {
    let req = serde_json::json!({"op": "stats", "name": vnic, "qps": true});
    let v = vrdmad::admin_client::call(&run_dir.join("admin.sock"), &req, Some(std::time::Duration::from_secs(10))).unwrap();
    v["vnics"][0].clone()
}

/// The sum of `family`'s samples for `vnic`, as Prometheus' parser reads `text`.
fn scraped(test: &str, addr: std::net::SocketAddr, family: &str, vnic: &str) -> Option<f64> {
    let parser = "/usr/lib/python3/dist-packages/prometheus_client/parser.py";
    if !vrdma_test_support::require_files(test, &["/usr/bin/curl", "/usr/bin/python3", parser], "curl python3-prometheus-client") {
        return None;
    }
    let out = Command::new("curl").args(["-fsS", "--max-time", "10", &format!("http://{addr}/metrics")]).output().unwrap();
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
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), &out.stdout).unwrap();
    let r = child.wait_with_output().unwrap();
    assert!(r.status.success(), "parser: {}\n{}", String::from_utf8_lossy(&r.stderr), String::from_utf8_lossy(&out.stdout));
    Some(String::from_utf8_lossy(&r.stdout).trim().parse().unwrap())
}

fn agree(what: &str, got: f64, want: u64) {
    let want = want as f64;
    assert!((got - want).abs() <= want * 0.01, "{what}: {got} against {want}");
}

each_path!(meters_agree_with_traffic_and_survive_restarts);
fn meters_agree_with_traffic_and_survive_restarts(mode: Mode) {
    let test = &format!("meters_agree_with_traffic_and_survive_restarts::{mode:?}");
    let h = Host::new(mode, "meter");
    let (sa, sb) = (h.vnic("meter-a", "t"), h.vnic("meter-b", "t"));
    let run_dir = h.dir.join("run");
    let addr = vrdmad::metrics::serve(&h.daemon, "127.0.0.1:0".parse().unwrap(), true).unwrap();

    let (a, b) = h.pair(&sa, &sb, ALL);
    let mut sent = traffic(&a, &b);
    let s = stats(&run_dir, "meter-a");
    assert_eq!(s["total"]["tx_bytes"], sent, "{s:#}");
    assert_eq!(s["total"]["tx"]["rdma_write"]["wrs"], WRITES, "{s:#}");
    assert_eq!(s["total"]["completions"]["success"], WRITES + SENDS + 1, "{s:#}");
    assert_eq!(s["qps"][0]["meter"]["tx_bytes"], sent, "{s:#}");
    assert_eq!(stats(&run_dir, "meter-b")["total"]["rx_bytes"], sent);

    // A client restart: the QPs' counts fold into their vNICs', and go on from there.
    drop((a, b));
    assert_eq!(stats(&run_dir, "meter-a")["total"]["tx_bytes"], sent);
    let (a, b) = h.pair(&sa, &sb, ALL);
    sent += traffic(&a, &b);
    assert_eq!(stats(&run_dir, "meter-a")["total"]["tx_bytes"], sent);
    assert_eq!(stats(&run_dir, "meter-b")["total"]["rx_bytes"], sent);
    // A SEND before its receive: an RNR NAK, and the SEND counted once, when it lands.
    let sg = [a.buf.sge(0, SEND_LEN)];
    a.qp.post_send(&SendWr::new(500, WrOpcode::Send, &sg, send_flags::SIGNALED)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    poll_none(&a.cq);
    b.qp.post_recv(&RecvWr { wr_id: 500, sg_list: &[b.buf.sge(8192, SEND_LEN)] }).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    assert_eq!(wait_one(&b.cq).status, WcStatus::Success);
    sent += u64::from(SEND_LEN);
    let s = stats(&run_dir, "meter-a");
    assert!(s["total"]["rnr_naks"].as_u64().unwrap() >= 1, "{s:#}");
    assert_eq!(s["total"]["tx_bytes"], sent, "{s:#}");
    let s = stats(&run_dir, "meter-b");
    assert_eq!(s["total"]["rx_bytes"], sent, "{s:#}");
    assert_eq!(s["total"]["rx"]["send"]["wrs"], 2 * SENDS + 1, "{s:#}");
    if let Some(v) = scraped(test, addr, "vrdma_vnic_tx_bytes_total", "meter-a") {
        agree("scraped tx bytes", v, sent);
        agree("scraped rx bytes", scraped(test, addr, "vrdma_vnic_rx_bytes_total", "meter-b").unwrap(), sent);
        agree("scraped completions", scraped(test, addr, "vrdma_vnic_completions_total", "meter-a").unwrap(), 2 * (WRITES + SENDS + 1) + 1);
    }
    drop((a, b));

    // A daemon restart (its clean exit saves the totals): another daemon on the same state
    // directory starts from them.
    vrdmad::metrics::persist::save_now(&h.daemon).unwrap();
    let run2 = h.dir.join("run2");
    let cfg = vrdmad::Config {
        run_dir: run2.clone(),
        state_dir: h.dir.join("state"),
        force_mediated: mode.mediated(),
        engine_lanes: mode.lanes(),
        ..Default::default()
    };
    let d2 = vrdmad::Daemon::start(cfg).expect("second daemon starts");
    let s = stats(&run2, "meter-a");
    assert_eq!(s["total"]["tx_bytes"], sent, "{s:#}");
    assert_eq!(stats(&run2, "meter-b")["total"]["rx_bytes"], sent);
    let addr2 = vrdmad::metrics::serve(&d2, "127.0.0.1:0".parse().unwrap(), false).unwrap();
    if let Some(v) = scraped(test, addr2, "vrdma_vnic_tx_bytes_total", "meter-a") {
        agree("scraped tx bytes after a restart", v, sent);
    }
}
