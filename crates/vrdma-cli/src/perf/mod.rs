//! `vrdma perf`: perftest-shaped benchmarks over the vrdma verbs library.
//!
//! Latency tests ping-pong one message (write_lat polls on memory like ib_write_lat;
//! send_lat waits for the receive completion) and report half the round trip; read_lat and
//! atomic_lat report the time of one operation. Bandwidth tests keep `tx_depth` work
//! requests outstanding per QP, round-robin over `-q` QPs, and report MB/s and millions of
//! messages per second. A MB is 2^20 bytes, as in perftest's and ucx_perftest's reports, so
//! figures compare with theirs directly.
//!
//! Layout: the options (`args`), the connected setup both sides build (`setup`), the timed
//! loops (`latency` with its `clock`, `bandwidth`), the data check of `--check`
//! (`data_check`), the result rows (`report`) and `reg_mr`'s timing (`reg_mr`); this file
//! runs the sizes in step with the peer.

mod args;
mod bandwidth;
mod clock;
mod data_check;
mod latency;
mod reg_mr;
mod report;
mod setup;

use anyhow::bail;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use vrdma::Wc;

pub(crate) use args::{Kind, PerfArgs, Spin, DEFAULT_INLINE};
pub(crate) use data_check::pattern;
pub(crate) use setup::{poll_n, post_recvs, setup, Setup};

use crate::oob::Oob;
use args::{iters_for, parse, sizes, MAX_SIZE};
use bandwidth::{bandwidth_client, send_bw_server, IntervalReport};
use data_check::{check_fence, check_prepare, check_round};
use latency::latency;
use reg_mr::reg_mr_bench;
use report::{bw_row, lat_row, print_row, SideLatency};

/// What the client announces before each size (and, `done`, after the last).
#[derive(Serialize, Deserialize, Debug)]
struct Round {
    size: u64,
    iters: u64,
    done: bool,
}

/// Runs `vrdma perf`.
pub(crate) fn run(a: PerfArgs) -> anyhow::Result<()> {
    if a.test == "reg_mr" {
        return reg_mr_bench(&a);
    }
    let (kind, lat) = parse(&a.test)?;
    if a.all && a.size != 2 {
        bail!("-a and -s are exclusive");
    }
    if a.size == 0 || a.size > MAX_SIZE {
        bail!("size must be 1..={MAX_SIZE}");
    }
    let client = a.server.is_some();
    let mut oob = match &a.server {
        Some(h) => Oob::connect(h, a.port)?,
        None => Oob::accept(a.port)?,
    };
    let s = setup(&a, kind, lat, &mut oob)?;
    let _ = &s.ctx;
    let mut header = false;
    let mut checked = 0usize;
    if kind == Kind::Send {
        for q in 0..s.qps.len() {
            post_recvs(&s, q, if lat { 2 } else { a.tx_depth.max(16) * 4 })?;
        }
    }
    for size in sizes(&a, kind) {
        let iters = iters_for(&a, lat, size);
        let depth = a.tx_depth.max(16);
        if !client {
            let r: Round = oob.recv()?;
            if r.size != size {
                bail!("client and server disagree on sizes ({} vs {size})", r.size);
            }
        } else {
            oob.send(&Round { size, iters, done: false })?;
        }
        if a.check {
            check_prepare(&s, kind, lat, size, client);
        }
        oob.send(&"go")?;
        let _: String = oob.recv()?;
        // Per server area: atomics the client executed there (for --check).
        let mut counts = vec![iters];
        let mut row = None;
        if lat {
            let v = latency(&s, kind, size, iters, client).map_err(|e| s.explain(e))?;
            if client {
                oob.send(&"done")?;
                let server: Option<SideLatency> = oob.recv()?;
                let mut r = lat_row(&a.test, size, iters, v);
                r.server_lat_p50_us = server.as_ref().map(|l| l.p50_us);
                r.server_lat_avg_us = server.map(|l| l.avg_us);
                row = Some(r);
            } else {
                let mine = (!v.is_empty()).then(|| SideLatency::of(v));
                oob.send(&mine)?;
                let _: String = oob.recv()?;
            }
        } else if client {
            if let Some(at) = a.start_at {
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                let wait = Duration::from_millis(at).saturating_sub(now);
                if wait.is_zero() {
                    eprintln!("warning: started late, {} ms after --start-at", now.as_millis().saturating_sub(u128::from(at)));
                }
                std::thread::sleep(wait);
            }
            let per_wr = if kind == Kind::Atomic { 8 } else { size };
            let intervals = a.interval.map(|i| IntervalReport::new(Duration::from_secs_f64(i), a.json, per_wr));
            let (secs, msgs, posted) = bandwidth_client(&s, kind, size, iters, depth, a.duration.map(Duration::from_secs_f64), intervals)?;
            if a.check {
                check_fence(&s)?;
                let areas = s.peer.areas.max(1) as usize;
                counts = vec![0; areas];
                for (q, p) in posted.iter().enumerate() {
                    counts[q % areas] += p;
                }
            }
            oob.send(&"done")?;
            let _: String = oob.recv()?;
            let bytes = msgs * if kind == Kind::Atomic { 8 } else { size };
            row = Some(bw_row(&a.test, size, s.qps.len(), msgs, bytes, secs));
        } else {
            if kind == Kind::Send {
                if a.duration.is_some() {
                    bail!("-D is not supported for send_bw");
                }
                send_bw_server(&s, iters * s.qps.len() as u64)?;
            }
            let _: String = oob.recv()?;
            oob.send(&"done")?;
        }
        let mut wcs = [Wc::EMPTY; 64];
        while s.scq.poll(&mut wcs) > 0 {}
        if a.check {
            check_round(&s, &mut oob, kind, lat, size, iters, client, counts)?;
            checked += 1;
            if let Some(r) = row.as_mut() {
                r.data_checked = true;
            }
        }
        if let Some(r) = row {
            print_row(&r, a.json, &mut header);
        }
    }
    if a.check && !a.json {
        println!("data checked: {checked} size(s), all verified");
    }
    if client {
        oob.send(&Round { size: 0, iters: 0, done: true })?;
    } else {
        let _: Round = oob.recv()?;
    }
    Ok(())
}
