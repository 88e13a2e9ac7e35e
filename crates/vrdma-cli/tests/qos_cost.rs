//! What metering and fair queuing cost (issue 29, Performance): `vrdma perf` on the direct
//! path (two vNICs on one host) and across hosts, with QoS policies absent and present in
//! alternating rounds of one run. "Present" is a cap too high to bind (1000 GB/s, 1000 M
//! WRs/s) and weight 2 on every vNIC, and weight 3 on their tenant: the library meters
//! against its cap on the direct path, and across hosts every WR goes through the scheduler
//! (a vNIC with a policy gets no lane). Targets: <= 3% direct, <= 5% across hosts.
//!
//! A benchmark (`#[ignore]`): scripts/bench-qos-cost.sh runs it in release and prints its
//! `qos-cost` lines. VRDMA_QOS_COST_ROUNDS (default 5) rounds, each measuring both modes,
//! in ABBA order so a drift of the machine's load weighs on both alike.

mod common;
use common::cluster::{wait_until, Cluster};
use common::perf::{finish_pair, result_row, start_pair, vnic_pair, Side};

use std::time::Duration;

const TENANT: &str = "cost";
const DIRECT: (Side, Side) = (("h1", "d1"), ("h1", "d2"));
const CROSS: (Side, Side) = (("h1", "x1"), ("h2", "x2"));
const VNICS: [&str; 4] = ["d1", "d2", "x1", "x2"];

/// One measurement: (name, path's sides, perf arguments, the result row's figure).
type Measure = (&'static str, (Side<'static>, Side<'static>), &'static [&'static str], &'static str);

const MEASURES: [Measure; 6] = [
    ("direct send_lat 8 B p50 [us]", DIRECT, &["perf", "send_lat", "-s", "8", "-n", "20000"], "lat_p50_us"),
    ("direct write_bw 64 KiB [MB/s]", DIRECT, &["perf", "write_bw", "-s", "65536", "-D", "2"], "bw_avg_MBps"),
    ("direct write_bw 8 B [Mmsg/s]", DIRECT, &["perf", "write_bw", "-s", "8", "-D", "2"], "msg_rate_mps"),
    ("cross send_lat 8 B p50 [us]", CROSS, &["perf", "send_lat", "-s", "8", "-n", "20000"], "lat_p50_us"),
    ("cross write_bw 64 KiB [MB/s]", CROSS, &["perf", "write_bw", "-s", "65536", "-D", "2"], "bw_avg_MBps"),
    ("cross write_bw 8 B [Mmsg/s]", CROSS, &["perf", "write_bw", "-s", "8", "-D", "2"], "msg_rate_mps"),
];

/// Sets (or clears) the policies and waits until both hosts list them.
fn policies(c: &Cluster, present: bool) {
    if present {
        for v in VNICS {
            c.ok("h1", &["vnic", "qos", v, "--max-bw", "1000GB", "--max-msg-rate", "1000M", "--weight", "2"]);
        }
        c.ok("h1", &["tenant", "qos", TENANT, "--weight", "3"]);
    } else {
        for v in VNICS {
            c.ok("h1", &["vnic", "qos", v, "--clear"]);
        }
        c.ok("h1", &["tenant", "qos", TENANT, "--clear"]);
    }
    let weight = if present { 2 } else { 1 };
    for h in ["h1", "h2"] {
        let seen = wait_until(Duration::from_secs(5), || {
            let l = c.list(h);
            VNICS.iter().all(|n| l.iter().any(|v| v["vnic"]["name"] == *n && v["vnic"]["qos"]["weight"].as_u64().unwrap_or(1) == weight))
        });
        assert!(seen, "{h} does not list the policies (present: {present}): {:?}", c.list(h));
    }
    // Within a second on every host: the engines and the libraries take them up.
    std::thread::sleep(Duration::from_millis(1500));
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[test]
#[ignore = "benchmark: scripts/bench-qos-cost.sh"]
fn qos_cost_absent_against_present() {
    let Some(c) = Cluster::start("qoscost", 2) else { return };
    let direct_ip = vnic_pair(&c, DIRECT.0, DIRECT.1, TENANT);
    let cross_ip = vnic_pair(&c, CROSS.0, CROSS.1, TENANT);
    let rounds: usize = std::env::var("VRDMA_QOS_COST_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    // figures[measure][mode]: mode 0 absent, 1 present.
    let mut figures = vec![[Vec::new(), Vec::new()]; MEASURES.len()];
    let mut port = 19000u16;
    for round in 0..rounds {
        let order = if round % 2 == 0 { [false, true] } else { [true, false] };
        for present in order {
            policies(&c, present);
            for (i, (name, (client, server), args, key)) in MEASURES.iter().enumerate() {
                let ip = if client.0 == server.0 { &direct_ip } else { &cross_ip };
                port += 1;
                let p = port.to_string();
                let mut a = args.to_vec();
                a.extend_from_slice(&["-p", &p]);
                let run = start_pair(&c, *client, *server, ip, &a, &["--json"]);
                let out = finish_pair(&c, run, Duration::from_secs(60), &format!("{name}, policies present: {present}"));
                let v = result_row(&out)[*key].as_f64().unwrap_or_else(|| panic!("no {key} in {out}"));
                eprintln!("round {round} {} {name}: {v:.3}", if present { "present" } else { "absent" });
                figures[i][usize::from(present)].push(v);
            }
        }
    }
    for (i, (name, ..)) in MEASURES.iter().enumerate() {
        let (absent, present) = (median(figures[i][0].clone()), median(figures[i][1].clone()));
        // The cost: slower latency, or less bandwidth, in percent of the figure without.
        let cost = if name.contains("_lat") { (present - absent) / absent } else { (absent - present) / absent } * 100.0;
        eprintln!(
            "qos-cost | {name} | {absent:.3} | {present:.3} | {cost:+.1}% | absent {:?} | present {:?}",
            figures[i][0].iter().map(|v| format!("{v:.2}")).collect::<Vec<_>>(),
            figures[i][1].iter().map(|v| format!("{v:.2}")).collect::<Vec<_>>()
        );
    }
}
