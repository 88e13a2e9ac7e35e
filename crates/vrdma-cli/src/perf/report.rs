//! `vrdma perf`'s results: a row per size, as JSON or as perftest-like table rows.

use serde::{Deserialize, Serialize};

/// One result row.
#[derive(Serialize, Debug, Clone)]
pub(crate) struct Row {
    test: String,
    size: u64,
    iterations: u64,
    qps: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    lat_avg_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lat_p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lat_p99_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lat_min_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lat_max_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(rename = "bw_avg_MBps")]
    bw_avg_mbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    msg_rate_mps: Option<f64>,
    /// The server's own median and average (write_lat, which both sides time).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) server_lat_p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) server_lat_avg_us: Option<f64>,
    /// `--check` verified this size's data.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(crate) data_checked: bool,
}

/// One side's summary of a latency round, sent by the server to the client.
#[derive(Serialize, Deserialize, Debug)]
pub(crate) struct SideLatency {
    pub(crate) p50_us: f64,
    pub(crate) avg_us: f64,
}

impl SideLatency {
    pub(crate) fn of(mut v: Vec<f64>) -> SideLatency {
        let avg_us = sort_and_average(&mut v);
        SideLatency { p50_us: percentile(&v, 0.5), avg_us }
    }
}

/// Bytes in the MB of bandwidth figures (perftest's and ucx_perftest's).
const MB: f64 = 1_048_576.0;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Sorts latency samples (for percentiles) and returns their average.
fn sort_and_average(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// The row of a latency test from its per-iteration latencies (µs).
pub(crate) fn lat_row(test: &str, size: u64, iters: u64, mut v: Vec<f64>) -> Row {
    let avg = sort_and_average(&mut v);
    Row {
        test: test.into(),
        size,
        iterations: iters,
        qps: 1,
        lat_avg_us: Some(avg),
        lat_p50_us: Some(percentile(&v, 0.5)),
        lat_p99_us: Some(percentile(&v, 0.99)),
        lat_min_us: v.first().copied(),
        lat_max_us: v.last().copied(),
        bw_avg_mbps: None,
        msg_rate_mps: None,
        server_lat_p50_us: None,
        server_lat_avg_us: None,
        data_checked: false,
    }
}

/// The row of a bandwidth test: `msgs` messages of `bytes` in all over `qps` QPs in `secs`.
pub(crate) fn bw_row(test: &str, size: u64, qps: usize, msgs: u64, bytes: u64, secs: f64) -> Row {
    Row {
        test: test.into(),
        size,
        iterations: msgs / qps as u64,
        qps: qps as u32,
        lat_avg_us: None,
        lat_p50_us: None,
        lat_p99_us: None,
        lat_min_us: None,
        lat_max_us: None,
        bw_avg_mbps: Some(bytes as f64 / secs / MB),
        msg_rate_mps: Some(msgs as f64 / secs / 1e6),
        server_lat_p50_us: None,
        server_lat_avg_us: None,
        data_checked: false,
    }
}

/// Prints `r` as JSON or as a table row (after the table's header, the first time).
pub(crate) fn print_row(r: &Row, json: bool, header: &mut bool) {
    if json {
        println!("{}", serde_json::to_string(r).unwrap_or_default());
        return;
    }
    if !*header {
        *header = true;
        if r.lat_avg_us.is_some() {
            println!("{:>10} {:>10} {:>10} {:>10} {:>10} {:>10}", "#bytes", "#iters", "t_min[us]", "t_avg[us]", "t_p50[us]", "t_p99[us]");
        } else {
            println!("{:>10} {:>10} {:>5} {:>14} {:>14}", "#bytes", "#iters", "#qps", "BW avg[MB/s]", "MsgRate[Mpps]");
        }
    }
    if let Some(avg) = r.lat_avg_us {
        println!(
            "{:>10} {:>10} {:>10.3} {:>10.3} {:>10.3} {:>10.3}",
            r.size,
            r.iterations,
            r.lat_min_us.unwrap_or(0.0),
            avg,
            r.lat_p50_us.unwrap_or(0.0),
            r.lat_p99_us.unwrap_or(0.0)
        );
    } else {
        println!(
            "{:>10} {:>10} {:>5} {:>14.1} {:>14.4}",
            r.size,
            r.iterations,
            r.qps,
            r.bw_avg_mbps.unwrap_or(0.0),
            r.msg_rate_mps.unwrap_or(0.0)
        );
    }
}
