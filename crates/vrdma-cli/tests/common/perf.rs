//! `vrdma perf` (and `vrdma __antagonist`) runs between containers of a simulated cluster,
//! and their JSON output: result rows and per-interval rows.

use std::process::Child;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::cluster::{wait_until, Cluster};
use super::{wait_output, VRDMA};

/// The Husky-style suites' pairs (husky.rs, husky_churn_stress.rs): the victim tenant's and
/// the antagonist tenant's, each from h1 to h2.
pub(crate) const VICTIM_A: Side = ("h1", "victim-a");
pub(crate) const VICTIM_B: Side = ("h2", "victim-b");
pub(crate) const ANTAG_A: Side = ("h1", "antag-a");
pub(crate) const ANTAG_B: Side = ("h2", "antag-b");

/// The variable `name` parsed, or `default` (unset or unparsable).
pub(crate) fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Milliseconds since the Unix epoch (perf's `--start-at`).
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// Creates vNIC `a` on `host_a` and `b` on `host_b`, both of `tenant`; b's address.
pub(crate) fn vnic_pair(c: &Cluster, (host_a, a): (&str, &str), (host_b, b): (&str, &str), tenant: &str) -> String {
    c.ok("h1", &["vnic", "create", a, "--tenant", tenant, "--host", host_a]);
    c.ok("h1", &["vnic", "create", b, "--tenant", tenant, "--host", host_b]);
    for (h, v) in [(host_a, a), (host_b, b)] {
        assert!(wait_until(Duration::from_secs(10), || c.host(h).socket(v).exists()), "{v} on {h}:\n{}", c.logs());
    }
    c.vnic_ip("h1", b).to_string()
}

/// Where one side of a run executes: (host, vNIC).
pub(crate) type Side<'a> = (&'a str, &'a str);

/// A client/server run of `vrdma SUBCOMMAND ARGS…` (e.g. `perf write_bw …`): the server in
/// `server`'s container first, then the client in `client`'s with `client_args` and the
/// server's address `server_ip` appended. Returns (client, server).
pub(crate) fn start_pair(c: &Cluster, client: Side, server: Side, server_ip: &str, args: &[&str], client_args: &[&str]) -> (Child, Child) {
    let mut cmd = vec![VRDMA];
    cmd.extend_from_slice(args);
    let srv = c.run_container(server.0, server.1, &cmd);
    // The server listens before the client connects (the client retries for 20 s anyway).
    std::thread::sleep(Duration::from_millis(300));
    cmd.extend_from_slice(client_args);
    cmd.push(server_ip);
    (c.run_container(client.0, client.1, &cmd), srv)
}

/// Waits for both sides (at most `limit`), panicking with their output and the cluster's
/// logs unless both succeeded; the client's output.
pub(crate) fn finish_pair(c: &Cluster, (client, server): (Child, Child), limit: Duration, what: &str) -> String {
    let (ok_c, out_c) = wait_output(client, limit);
    let (ok_s, out_s) = wait_output(server, Duration::from_secs(20));
    assert!(ok_c && ok_s, "{what}\n--- client:\n{out_c}\n--- server:\n{out_s}\n{}", c.logs());
    out_c
}

/// The JSON objects among `out`'s lines.
pub(crate) fn json_lines(out: &str) -> Vec<serde_json::Value> {
    out.lines().filter(|l| l.starts_with('{')).filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// The result row (not an interval row) of a perf run's output.
pub(crate) fn result_row(out: &str) -> serde_json::Value {
    json_lines(out).into_iter().rfind(|v| v.get("test").is_some()).unwrap_or_else(|| panic!("no result row in:\n{out}"))
}

/// One interval row of `vrdma perf --interval --json`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Interval {
    pub(crate) start_s: f64,
    pub(crate) end_s: f64,
    pub(crate) bytes: f64,
    pub(crate) wrs: f64,
}

/// The interval rows of a perf run's output.
pub(crate) fn intervals(out: &str) -> Vec<Interval> {
    json_lines(out)
        .iter()
        .filter_map(|v| {
            let end = v["interval_end_s"].as_f64()?;
            Some(Interval { start_s: end - v["interval_s"].as_f64()?, end_s: end, bytes: v["bytes"].as_f64()?, wrs: v["wrs"].as_f64()? })
        })
        .collect()
}

/// The rate over the intervals lying within `[from, to]` seconds of the timed loop:
/// (bytes/s, WRs/s).
pub(crate) fn rate_within(iv: &[Interval], from: f64, to: f64) -> (f64, f64) {
    let inside: Vec<&Interval> = iv.iter().filter(|i| i.start_s >= from - 0.05 && i.end_s <= to + 0.05).collect();
    assert!(!inside.is_empty(), "no interval within [{from}, {to}]: {iv:?}");
    let secs: f64 = inside.iter().map(|i| i.end_s - i.start_s).sum();
    (inside.iter().map(|i| i.bytes).sum::<f64>() / secs, inside.iter().map(|i| i.wrs).sum::<f64>() / secs)
}
