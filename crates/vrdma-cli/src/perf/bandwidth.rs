//! The bandwidth tests' timed loops: the client keeps `tx_depth` WRs outstanding per QP;
//! the server of send_bw keeps receives posted.

use anyhow::{bail, Context as _};
use std::time::{Duration, Instant};
use vrdma::*;

use super::args::Kind;
use super::setup::Setup;

/// Prints the rate completed in each interval of a run (`vrdma perf --interval`).
pub(crate) struct IntervalReport {
    /// Interval length.
    pub(crate) every: Duration,
    /// JSON lines instead of text.
    pub(crate) json: bool,
    /// Bytes per WR.
    pub(crate) bytes_per_wr: u64,
    next: Option<Instant>,
    last: (Instant, u64),
}

impl IntervalReport {
    pub(crate) fn new(every: Duration, json: bool, bytes_per_wr: u64) -> IntervalReport {
        let now = Instant::now();
        IntervalReport { every, json, bytes_per_wr, next: None, last: (now, 0) }
    }

    fn start(&mut self, t0: Instant) {
        self.next = Some(t0 + self.every);
        self.last = (t0, 0);
    }

    /// `completed` WRs so far at `now`: a line per interval ended since the last call.
    fn tick(&mut self, t0: Instant, completed: u64) {
        let Some(next) = self.next else { return };
        let now = Instant::now();
        if now < next {
            return;
        }
        let secs = now.duration_since(self.last.0).as_secs_f64();
        let wrs = completed - self.last.1;
        let bytes = wrs * self.bytes_per_wr;
        let end = now.duration_since(t0).as_secs_f64();
        if self.json {
            println!(
                "{}",
                serde_json::json!({"interval_end_s": end, "interval_s": secs, "wrs": wrs, "bytes": bytes,
                    "bytes_per_s": bytes as f64 / secs, "wrs_per_s": wrs as f64 / secs})
            );
        } else {
            println!("{end:>8.2} s {:>12.1} MB/s {:>12.0} WR/s", bytes as f64 / secs / 1e6, wrs as f64 / secs);
        }
        self.last = (now, completed);
        self.next = Some(next + self.every);
    }
}

/// Runs one bandwidth round on the client; returns (seconds, messages, messages per QP).
pub(crate) fn bandwidth_client(
    s: &Setup,
    kind: Kind,
    size: u64,
    iters: u64,
    depth: u32,
    duration: Option<Duration>,
    mut intervals: Option<IntervalReport>,
) -> anyhow::Result<(f64, u64, Vec<u64>)> {
    let mut wcs = [Wc::EMPTY; 64];
    let nqp = s.qps.len();
    let sz = size.max(1) as u32;
    let cq_mod: u64 = 16.min(u64::from(depth) / 2).max(1);
    let (op, len) = match kind {
        Kind::Send => (WrOpcode::Send, sz),
        Kind::Write => (WrOpcode::RdmaWrite, sz),
        Kind::Read => (WrOpcode::RdmaRead, sz),
        Kind::Atomic => (WrOpcode::AtomicFetchAndAdd, 8),
    };
    let sges: Vec<[Sge; 1]> = (0..nqp).map(|q| [s.buf.sge((s.stride * (q as u64 % s.areas)) as usize, len)]).collect();
    let mut posted = vec![0u64; nqp];
    // Signaled completions per QP: a QP's unsignaled WRs are done only when a later signaled
    // WR *of that QP* completes, so each QP signals every cq_mod of its own WRs and its
    // outstanding count is bounded by tx_depth (its send queue), as in perftest.
    let mut done_sig = vec![0u64; nqp];
    let mut completed_signals = 0u64;
    let mut signaled = 0u64;
    let t0 = Instant::now();
    let deadline = duration.map(|d| t0 + d);
    let total_target = if deadline.is_some() { u64::MAX } else { iters * nqp as u64 };
    let mut total_posted = 0u64;
    let inline = s.inline_flag(kind, size);
    if let Some(r) = intervals.as_mut() {
        r.start(t0);
    }
    'outer: loop {
        for q in 0..nqp {
            if total_posted >= total_target {
                break 'outer;
            }
            // Outstanding on this QP = posted - (its completed signals × cq_mod).
            if posted[q] - done_sig[q] * cq_mod >= u64::from(depth) {
                let n = s.scq.poll(&mut wcs);
                for w in &wcs[..n] {
                    if w.status != WcStatus::Success {
                        bail!("completion error {:?}", w.status);
                    }
                    *done_sig.get_mut(w.wr_id as usize).context("completion of an unknown QP")? += 1;
                }
                completed_signals += n as u64;
                if let Some(r) = intervals.as_mut() {
                    r.tick(t0, completed_signals * cq_mod);
                }
                continue;
            }
            posted[q] += 1;
            total_posted += 1;
            let sig = if posted[q].is_multiple_of(cq_mod) { send_flags::SIGNALED } else { 0 };
            if sig != 0 {
                signaled += 1;
            }
            let mut wr = SendWr::new(q as u64, op, &sges[q], sig | inline);
            wr.remote_addr = s.peer.addr + s.peer.stride * (q as u64 % s.peer.areas.max(1)) + s.peer.stride / 2;
            wr.rkey = s.peer.rkey;
            wr.compare_add = 1;
            s.qps[q].post_send(&wr)?;
            if let Some(d) = deadline {
                if total_posted.is_multiple_of(1024) && Instant::now() >= d {
                    break 'outer;
                }
            }
        }
    }
    // Drain the remaining signaled completions.
    while completed_signals < signaled {
        let n = s.scq.poll(&mut wcs);
        for w in &wcs[..n] {
            if w.status != WcStatus::Success {
                bail!("completion error {:?}", w.status);
            }
        }
        completed_signals += n as u64;
        if n == 0 && t0.elapsed() > Duration::from_secs(120) {
            bail!("timed out draining completions");
        }
    }
    Ok((t0.elapsed().as_secs_f64(), total_posted, posted))
}

/// The server side of send_bw: keeps receives posted until `total` messages arrived.
pub(crate) fn send_bw_server(s: &Setup, total: u64) -> anyhow::Result<()> {
    let mut wcs = [Wc::EMPTY; 64];
    let mut got = 0u64;
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut empty = 0u32;
    let half = s.stride / 2;
    let sges: Vec<[Sge; 1]> =
        (0..s.qps.len()).map(|q| [s.buf.sge((s.stride * (q as u64 % s.areas) + half) as usize, half as u32)]).collect();
    let mut batch: Vec<Vec<RecvWr<'_>>> = vec![Vec::with_capacity(64); s.qps.len()];
    while got < total {
        let n = s.rcq.poll(&mut wcs);
        for w in &wcs[..n] {
            if w.status != WcStatus::Success {
                bail!("receive completion error {:?}", w.status);
            }
            let qi = if s.qps.len() == 1 { 0 } else { s.qps.iter().position(|q| q.qp_num() == w.qp_num).unwrap_or(0) };
            batch[qi].push(RecvWr { wr_id: qi as u64, sg_list: &sges[qi] });
        }
        // Repost what was consumed, one list per QP (ibv_post_recv takes lists too).
        for (qi, b) in batch.iter_mut().enumerate() {
            if !b.is_empty() {
                s.qps[qi].post_recv_list(b).map_err(|(_, e)| e)?;
                b.clear();
            }
        }
        got += n as u64;
        if n == 0 {
            empty = empty.wrapping_add(1);
            if empty.is_multiple_of(4096) && Instant::now() > deadline {
                bail!("send_bw server timed out at {got}/{total}");
            }
        }
    }
    Ok(())
}
