//! Stress for a hang seen once in `husky::victim_keeps_its_share_beside_connection_churn`:
//! many short victim `write_bw` runs (each a new QP, set up while the churn goes on) beside
//! one long `__antagonist churn`. A victim run that does not finish in time is a stall:
//! the test writes `$VRDMA_STRESS_MARK` (if set) and waits `VRDMA_STRESS_HOLD` seconds
//! (default 0) with the cluster alive, so that its state can be captured, then fails.
//! VRDMA_STRESS_CHURN_QPS (default 4, as husky's) sets the QPs of each churn round.

mod common;
use common::cluster::Cluster;
use common::perf::{env_or, start_pair, vnic_pair, ANTAG_A, ANTAG_B, VICTIM_A, VICTIM_B};
use common::wait_output;

use std::time::{Duration, Instant};

#[test]
#[ignore = "stress (minutes): run by hand"]
fn victim_runs_beside_connection_churn_never_stall() {
    let Some(c) = Cluster::start("hstress", 2) else { return };
    let victim_ip = vnic_pair(&c, VICTIM_A, VICTIM_B, "victim");
    let antag_b_ip = vnic_pair(&c, ANTAG_A, ANTAG_B, "antag");
    let runs: u32 = env_or("VRDMA_STRESS_RUNS", 100);
    let secs: f64 = env_or("VRDMA_STRESS_SECS", 0.3);
    let antag_secs = (runs as f64) * (secs + 3.0) + 30.0;
    let churn_qps: u32 = env_or("VRDMA_STRESS_CHURN_QPS", 4);
    let antag = start_pair(
        &c,
        ANTAG_A,
        ANTAG_B,
        &antag_b_ip,
        &["__antagonist", "churn", "-q", &churn_qps.to_string(), "-D", &antag_secs.to_string(), "-p", "18901"],
        &[],
    );
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    for i in 0..runs {
        let port = (19000 + i % 500) as u16;
        // As husky's victim: connected, then idle until a start time 1 s ahead.
        let start_at = (common::perf::unix_ms() + 1000).to_string();
        let (client, server) = start_pair(
            &c,
            VICTIM_A,
            VICTIM_B,
            &victim_ip,
            &["perf", "write_bw", "-s", "65536", "-D", &secs.to_string(), "-p", &port.to_string()],
            &["--json", "--interval", "0.1", "--start-at", &start_at],
        );
        let limit = Duration::from_secs_f64(secs + 12.0);
        let pid = client.id();
        // (Waits on its own thread: a stall is marked while the client still hangs.)
        let waiter = std::thread::spawn(move || wait_output(client, limit + Duration::from_secs(600)));
        let t = Instant::now();
        while !waiter.is_finished() && t.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(50));
        }
        if !waiter.is_finished() {
            eprintln!("STALL in victim run {i} (client pid {pid}) after {:?} of churn", started.elapsed());
            if let Ok(mark) = std::env::var("VRDMA_STRESS_MARK") {
                std::fs::write(&mark, format!("{pid}\n{}\n", c.dir.display())).unwrap();
            }
            std::thread::sleep(Duration::from_secs(env_or("VRDMA_STRESS_HOLD", 0)));
            let _ = std::process::Command::new("kill").arg(pid.to_string()).status();
            let (_, out) = waiter.join().unwrap();
            let (_, sout) = wait_output(server, Duration::from_secs(5));
            panic!("victim run {i} stalled:\n--- client:\n{out}\n--- server:\n{sout}\n{}", c.logs());
        }
        let (ok, out) = waiter.join().unwrap();
        let (sok, sout) = wait_output(server, Duration::from_secs(20));
        assert!(ok && sok, "victim run {i} failed:\n--- client:\n{out}\n--- server:\n{sout}\n{}", c.logs());
        let bw = common::perf::result_row(&out)["bw_avg_MBps"].as_f64().unwrap_or(0.0);
        let empty = common::perf::intervals(&out).iter().filter(|iv| iv.bytes == 0.0).count();
        if i % 10 == 0 || bw < 200.0 || empty > 0 {
            eprintln!("victim run {i} done at {:?}: {bw:.0} MB/s, {empty} empty intervals", started.elapsed());
        }
    }
    let (client, server) = antag;
    let _ = std::process::Command::new("kill").arg(client.id().to_string()).status();
    let _ = wait_output(client, Duration::from_secs(10));
    let _ = wait_output(server, Duration::from_secs(10));
}
