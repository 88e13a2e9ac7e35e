//! `vrdma top`: per-vNIC rates of this host, refreshed like `top` (plain ANSI: home the
//! cursor and clear the screen between frames). `--once` prints one frame (rates over one
//! interval) and `-n N` N frames, without clearing, for scripts and tests.

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::admin;
use crate::stats::human_bytes;

/// Options of `vrdma top`.
#[derive(clap::Args)]
pub(crate) struct TopArgs {
    /// Print one frame and exit.
    #[arg(long)]
    once: bool,
    /// Print N frames and exit.
    #[arg(short = 'n', long = "iterations", value_name = "N")]
    iterations: Option<u64>,
    /// Seconds between frames.
    #[arg(short = 'd', long = "delay", default_value_t = 1.0)]
    delay: f64,
}

/// Counters of one vNIC sampled at one time.
#[derive(Clone, Copy, Default)]
struct Sample {
    tx_bytes: u64,
    tx_wrs: u64,
    rx_bytes: u64,
    rx_wrs: u64,
    errors: u64,
}

/// A vNIC's row: its name, its tenant and its counters.
type Row = (String, String, Sample);

fn sample() -> anyhow::Result<(Instant, Vec<Row>)> {
    let v = admin::call(json!({"op": "stats"}))?;
    let at = Instant::now();
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    let rows = v["vnics"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|x| {
            let t = &x["total"];
            let errors = t["completions"].as_object().into_iter().flatten().filter(|(k, _)| *k != "success").map(|(_, v)| n(v)).sum();
            let s = Sample {
                tx_bytes: n(&t["tx_bytes"]),
                tx_wrs: n(&t["tx_wrs"]),
                rx_bytes: n(&t["rx_bytes"]),
                rx_wrs: n(&t["rx_wrs"]),
                errors,
            };
            (x["vnic"].as_str().unwrap_or("").to_string(), x["tenant"].as_str().unwrap_or("").to_string(), s)
        })
        .collect();
    Ok((at, rows))
}

/// One frame: rates between `before` and `now` over `secs`.
fn frame(rows: &[(String, String, Sample)], before: &HashMap<String, Sample>, secs: f64) -> String {
    let mut out = format!(
        "{:<16} {:<12} {:>14} {:>12} {:>14} {:>12} {:>10} {:>14}\n",
        "VNIC", "TENANT", "TX/s", "TX_WR/s", "RX/s", "RX_WR/s", "ERRORS", "TX_TOTAL"
    );
    for (name, tenant, s) in rows {
        let b = before.get(name).copied().unwrap_or(*s);
        let rate = |now: u64, then: u64| now.saturating_sub(then) as f64 / secs.max(1e-3);
        out.push_str(&format!(
            "{:<16} {:<12} {:>14} {:>12.0} {:>14} {:>12.0} {:>10} {:>14}\n",
            name,
            tenant,
            human_bytes(rate(s.tx_bytes, b.tx_bytes)) + "/s",
            rate(s.tx_wrs, b.tx_wrs),
            human_bytes(rate(s.rx_bytes, b.rx_bytes)) + "/s",
            rate(s.rx_wrs, b.rx_wrs),
            s.errors,
            human_bytes(s.tx_bytes as f64)
        ));
    }
    out
}

/// `vrdma top`.
pub(crate) fn run(a: &TopArgs) -> anyhow::Result<()> {
    let frames = if a.once { Some(1) } else { a.iterations };
    let plain = frames.is_some();
    let delay = Duration::from_secs_f64(a.delay.max(0.05));
    let (mut t0, rows) = sample()?;
    let mut before: HashMap<String, Sample> = rows.into_iter().map(|(n, _, s)| (n, s)).collect();
    let mut shown = 0u64;
    loop {
        std::thread::sleep(delay);
        let (t1, rows) = sample()?;
        let text = frame(&rows, &before, t1.duration_since(t0).as_secs_f64());
        let mut out = std::io::stdout().lock();
        if plain {
            write!(out, "{text}")?;
        } else {
            write!(out, "\x1b[H\x1b[2Jvrdma top — every {:.1} s (Ctrl-C quits)\n\n{text}", a.delay)?;
        }
        out.flush()?;
        shown += 1;
        if frames.is_some_and(|f| shown >= f) {
            return Ok(());
        }
        before = rows.into_iter().map(|(n, _, s)| (n, s)).collect();
        t0 = t1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_shows_rates_over_the_interval() {
        let now = Sample { tx_bytes: 2048, tx_wrs: 20, rx_bytes: 0, rx_wrs: 0, errors: 1 };
        let before = HashMap::from([("a".to_string(), Sample { tx_bytes: 1024, tx_wrs: 10, ..Sample::default() })]);
        let f = frame(&[("a".into(), "t".into(), now)], &before, 1.0);
        assert!(f.contains("1.0 KiB/s"), "{f}");
        assert!(f.lines().nth(1).unwrap().contains(" 10 "), "{f}");
    }
}
