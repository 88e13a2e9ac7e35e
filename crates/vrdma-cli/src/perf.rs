//! `vrdma perf`: perftest-shaped benchmarks over the vrdma verbs library.
//!
//! Latency tests ping-pong one message (write_lat polls on memory like ib_write_lat;
//! send_lat waits for the receive completion) and report half the round trip; read_lat and
//! atomic_lat report the time of one operation. Bandwidth tests keep `tx_depth` work
//! requests outstanding per QP, round-robin over `-q` QPs, and report MB/s and millions of
//! messages per second. A MB is 2^20 bytes, as in perftest's and ucx_perftest's reports, so
//! figures compare with theirs directly.

use anyhow::{bail, Context as _};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vrdma::*;

use crate::oob::{Endpoint, Oob};

/// Benchmark options.
#[derive(Clone, Debug, clap::Args)]
pub struct PerfArgs {
    /// send_lat, write_lat, read_lat, atomic_lat, send_bw, write_bw, read_bw, atomic_bw
    pub test: String,
    /// Server address (client side); the server runs without it.
    pub server: Option<String>,
    /// Message size in bytes.
    #[arg(short = 's', long, default_value_t = 2)]
    pub size: u64,
    /// All sizes from 2 B to 8 MiB.
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Iterations (default 1000 for latency, 5000 for bandwidth; fewer for large sizes with -a).
    #[arg(short = 'n', long)]
    pub iters: Option<u64>,
    /// Number of QPs (bandwidth tests).
    #[arg(short = 'q', long, default_value_t = 1)]
    pub qps: u32,
    /// TCP port of the out-of-band exchange.
    #[arg(short = 'p', long, default_value_t = 18515)]
    pub port: u16,
    /// Outstanding work requests per QP (bandwidth tests).
    #[arg(short = 't', long, default_value_t = 128)]
    pub tx_depth: u32,
    /// Run bandwidth tests for this many seconds instead of a fixed count (write/read/atomic).
    #[arg(short = 'D', long)]
    pub duration: Option<f64>,
    /// One JSON object per size instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Give each QP its own buffer (default: QPs share one buffer, as perftest shares one
    /// MR; separate buffers make -q runs measure the CPU caches as much as vrdma).
    #[arg(long)]
    pub buf_per_qp: bool,
    /// Verify the data after each size (outside the timed loop): received and written bytes
    /// against a known pattern (and that nothing beyond the message changed), read bytes
    /// likewise, atomic counters and fetched values; any mismatch fails the run.
    #[arg(long)]
    pub check: bool,
    /// The memory this side registers: anon (zero-copy), or file / hugetlb (memory vrdma
    /// cannot share, which takes the copying fallback through vrdmad).
    #[arg(long, default_value = "anon")]
    pub mem: vrdma::Backing,
    /// Bandwidth client: start the timed loop at this wall-clock time (milliseconds since
    /// the Unix epoch), so that many pairs started one after another measure the same
    /// window (with -D, their figures add up to the aggregate).
    #[arg(long, value_name = "UNIX_MS")]
    pub start_at: Option<u64>,
    /// SENDs and WRITEs up to this many bytes go inline (perftest's -I; perftest itself
    /// sends nothing inline on a device it does not recognise, vrdma's included).
    #[arg(short = 'I', long, default_value_t = DEFAULT_INLINE)]
    pub inline_size: u32,
    /// How write_lat waits for the peer's write to land in memory: `pause` (with the CPU's
    /// spin-wait hint) or `plain` (without: ib_write_lat's loop, which reads the byte and
    /// its run state as ours reads the byte and the peer's hang-up flag; compare
    /// ib_write_lat with `--spin plain`).
    #[arg(long, value_enum, default_value_t = Spin::Pause)]
    pub spin: Spin,
}

/// Default inline limit of `vrdma perf` (and the QPs' `max_inline_data`).
const DEFAULT_INLINE: u32 = 64;

/// How a latency loop waits on memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Spin {
    /// With `std::hint::spin_loop` (PAUSE) between reads.
    Pause,
    /// Back-to-back reads (of the byte and the hang-up flag).
    Plain,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Send,
    Write,
    Read,
    Atomic,
}

#[derive(Serialize, Deserialize, Debug)]
struct Round {
    size: u64,
    iters: u64,
    done: bool,
}

/// One result row.
#[derive(Serialize, Debug, Clone)]
pub struct Row {
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
    server_lat_p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    server_lat_avg_us: Option<f64>,
    /// `--check` verified this size's data.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    data_checked: bool,
}

/// One side's summary of a latency round, sent by the server to the client.
#[derive(Serialize, Deserialize, Debug)]
struct SideLatency {
    p50_us: f64,
    avg_us: f64,
}

impl SideLatency {
    fn of(mut v: Vec<f64>) -> SideLatency {
        let avg_us = sort_and_average(&mut v);
        SideLatency { p50_us: percentile(&v, 0.5), avg_us }
    }
}

struct Setup {
    ctx: Context,
    _pd: Pd,
    scq: Cq,
    rcq: Cq,
    qps: Vec<Qp>,
    buf: MrBuf,
    stride: u64,
    /// Buffer areas (1, or one per QP with --buf-per-qp).
    areas: u64,
    peer: Endpoint,
    /// Largest SEND/WRITE posted inline.
    inline_size: u64,
    spin: Spin,
    /// Set when the peer's out-of-band connection hangs up (`Oob::watch_hangup`).
    peer_gone: Arc<AtomicBool>,
}

impl Setup {
    /// The INLINE flag for a `kind` message of `size` bytes.
    fn inline_flag(&self, kind: Kind, size: u64) -> u32 {
        if matches!(kind, Kind::Send | Kind::Write) && size <= self.inline_size {
            send_flags::INLINE
        } else {
            0
        }
    }

    /// Waits until the byte at `off` of our buffer is `tag` (the peer's write landed), or
    /// fails once the peer has gone: every poll also reads the hang-up flag, as
    /// ib_write_lat's loop reads its run state, so `--spin plain` is its loop.
    #[inline(always)]
    fn wait_for_tag(&self, off: usize, tag: u8) -> anyhow::Result<()> {
        let gone = &*self.peer_gone;
        match self.spin {
            Spin::Pause => {
                while self.buf.read_volatile(off) != tag {
                    if gone.load(Ordering::Relaxed) {
                        return Err(peer_gone());
                    }
                    std::hint::spin_loop();
                }
            }
            Spin::Plain => {
                while self.buf.read_volatile(off) != tag {
                    if gone.load(Ordering::Relaxed) {
                        return Err(peer_gone());
                    }
                }
            }
        }
        Ok(())
    }
}

/// The error of a latency loop whose peer went away mid-run.
#[cold]
fn peer_gone() -> anyhow::Error {
    anyhow::anyhow!("the peer closed the out-of-band connection while we waited for its write")
}

const MAX_SIZE: u64 = 8 << 20;

/// Bytes in the MB of bandwidth figures (perftest's and ucx_perftest's).
const MB: f64 = 1_048_576.0;

fn parse(test: &str) -> anyhow::Result<(Kind, bool)> {
    let (k, lat) = match test.rsplit_once('_') {
        Some((k, "lat")) => (k, true),
        Some((k, "bw")) => (k, false),
        _ => bail!("unknown test {test}: expected send|write|read|atomic _lat|_bw"),
    };
    let kind = match k {
        "send" => Kind::Send,
        "write" => Kind::Write,
        "read" => Kind::Read,
        "atomic" => Kind::Atomic,
        _ => bail!("unknown test {test}"),
    };
    Ok((kind, lat))
}

fn sizes(a: &PerfArgs, kind: Kind) -> Vec<u64> {
    if kind == Kind::Atomic {
        return vec![8];
    }
    if a.all {
        (1..=23).map(|i| 1u64 << i).collect()
    } else {
        vec![a.size]
    }
}

fn iters_for(a: &PerfArgs, lat: bool, size: u64) -> u64 {
    if let Some(n) = a.iters {
        return n;
    }
    let base: u64 = if lat { 1000 } else { 5000 };
    if a.all {
        // Keep -a runs bounded: at most ~1 GiB per size.
        base.min(((1u64 << 30) / size).max(100))
    } else {
        base
    }
}

fn setup(a: &PerfArgs, kind: Kind, lat: bool, oob: &mut Oob) -> anyhow::Result<Setup> {
    let ctx = Context::open_default().context("opening the vNIC (is this a `vrdma run` container?)")?;
    let pd = ctx.alloc_pd()?;
    let nqp = if lat { 1 } else { a.qps.max(1) };
    let depth = a.tx_depth.max(16);
    let scq = ctx.create_cq(depth * nqp * 2, None)?;
    let rcq = ctx.create_cq(depth * nqp * 2, None)?;
    let max = sizes(a, kind).into_iter().max().unwrap_or(8).max(8);
    // Two areas per QP: what we send from, and what the peer writes into.
    let stride = (2 * max).next_multiple_of(4096);
    let areas = if a.buf_per_qp { u64::from(nqp) } else { 1 };
    let buf = MrBuf::with_backing(
        &pd,
        (stride * areas) as usize,
        access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC,
        a.mem,
    )?;
    let caps = QpCaps { max_send_wr: depth, max_recv_wr: depth * 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: a.inline_size };
    let mut qps = Vec::new();
    for _ in 0..nqp {
        qps.push(pd.create_qp(&QpInitAttr::rc(&scq, &rcq, caps))?);
    }
    let me = Endpoint {
        qpns: qps.iter().map(|q| q.qp_num()).collect(),
        gid: ctx.gids()[0].to_vec(),
        addr: buf.addr(),
        rkey: buf.mr().rkey(),
        stride,
        areas,
    };
    oob.send(&me)?;
    let peer: Endpoint = oob.recv()?;
    if peer.qpns.len() != qps.len() {
        bail!("peer has {} QPs, we have {}", peer.qpns.len(), qps.len());
    }
    let mut gid = [0u8; 16];
    gid.copy_from_slice(peer.gid.get(..16).context("peer GID")?);
    for (q, dq) in qps.iter().zip(&peer.qpns) {
        q.connect_rc(gid, *dq, access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC)?;
    }
    // Both sides connected before anyone sends.
    oob.send(&"ready")?;
    let _: String = oob.recv()?;
    let peer_gone = oob.watch_hangup()?;
    Ok(Setup { ctx, _pd: pd, scq, rcq, qps, buf, stride, areas, peer, inline_size: u64::from(a.inline_size), spin: a.spin, peer_gone })
}

fn poll_n(cq: &Cq, want: usize, wcs: &mut [Wc]) -> anyhow::Result<()> {
    let mut got = 0;
    // The 30 s limit starts at the first long wait: a clock read on every call would be
    // part of every latency measured (perftest reads none).
    let mut deadline = None;
    let mut empty = 0u32;
    while got < want {
        let cap = (want - got).min(wcs.len());
        let n = cq.poll(&mut wcs[..cap]);
        for w in &wcs[..n] {
            if w.status != WcStatus::Success {
                bail!("completion error {:?} (wr_id {}, opcode {:?})", w.status, w.wr_id, w.opcode);
            }
        }
        got += n;
        if n == 0 {
            empty = empty.wrapping_add(1);
            // Reading the clock on every empty poll would slow the poll loop itself.
            if empty.is_multiple_of(4096) {
                let now = Instant::now();
                match deadline {
                    None => deadline = Some(now + Duration::from_secs(30)),
                    Some(d) if now > d => bail!("timed out waiting for completions ({got}/{want})"),
                    Some(_) => {}
                }
            }
        }
    }
    Ok(())
}

/// Posts `n` receives of the largest size on QP `qi` (each completed receive is reposted, so
/// the number outstanding stays constant across sizes).
fn post_recvs(s: &Setup, qi: usize, n: u32) -> anyhow::Result<()> {
    let base = s.stride * (qi as u64 % s.areas) + s.stride / 2;
    for _ in 0..n {
        s.qps[qi].post_recv(&RecvWr { wr_id: qi as u64, sg_list: &[s.buf.sge(base as usize, (s.stride / 2) as u32)] })?;
    }
    Ok(())
}

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

fn lat_row(test: &str, size: u64, iters: u64, mut v: Vec<f64>) -> Row {
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

/// Per-iteration timestamps cheap enough not to distort sub-microsecond latencies: the
/// CPU's time-stamp counter (as perftest's get_cycles), calibrated against the monotonic
/// clock; `Instant` elsewhere.
struct Clock {
    #[cfg(target_arch = "x86_64")]
    us_per_tick: f64,
}

impl Clock {
    fn new() -> Clock {
        #[cfg(target_arch = "x86_64")]
        {
            let (t0, c0) = (Instant::now(), Self::ticks());
            std::thread::sleep(Duration::from_millis(20));
            let (t1, c1) = (Instant::now(), Self::ticks());
            Clock { us_per_tick: (t1 - t0).as_secs_f64() * 1e6 / (c1.wrapping_sub(c0).max(1)) as f64 }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Clock {}
    }

    #[cfg(target_arch = "x86_64")]
    fn ticks() -> u64 {
        // SAFETY: RDTSC has no memory effects and exists on every x86_64 CPU.
        unsafe { core::arch::x86_64::_rdtsc() }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn ticks() -> u64 {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }

    fn us(&self, ticks: u64) -> f64 {
        #[cfg(target_arch = "x86_64")]
        {
            ticks as f64 * self.us_per_tick
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            ticks as f64 / 1000.0
        }
    }
}

/// Runs one latency round; returns per-iteration latencies (µs): the client's, and for
/// write_lat the server's too (both sides time it, as in ib_write_lat).
fn latency(s: &Setup, kind: Kind, size: u64, iters: u64, client: bool) -> anyhow::Result<Vec<f64>> {
    let mut wcs = [Wc::EMPTY; 16];
    let qp = &s.qps[0];
    let half = (s.stride / 2) as usize;
    let mut out = Vec::with_capacity(iters as usize);
    let clock = Clock::new();
    let sz = size.max(1) as usize;
    let flags = send_flags::SIGNALED | s.inline_flag(kind, size);
    let sge = [s.buf.sge(0, sz as u32)];
    match kind {
        Kind::Write => {
            // As ib_write_lat: every write signaled, its completion polled before waiting
            // for the peer's; both sides read the clock just before each post (where
            // ib_write_lat stamps `tposted`), and an iteration's latency is half the time
            // between two posts. Where the clock is read matters here: a read on the
            // server's path as well as the client's moves this machine's latency by up to
            // 30% in some runs, so it is where perftest's is.
            let mut wr = SendWr::new(0, WrOpcode::RdmaWrite, &sge, flags);
            wr.remote_addr = s.peer.addr + half as u64;
            wr.rkey = s.peer.rkey;
            let last_local = half + sz - 1;
            let mut stamps = Vec::with_capacity(iters as usize + 1);
            for i in 0..iters {
                let tag = (i % 255 + 1) as u8;
                if !client {
                    s.wait_for_tag(last_local, tag)?;
                }
                stamps.push(Clock::ticks());
                s.buf.write(sz - 1, &[tag]);
                qp.post_send(&wr)?;
                poll_n(&s.scq, 1, &mut wcs)?;
                if client {
                    s.wait_for_tag(last_local, tag)?;
                }
            }
            // The client's last iteration ends when the server's answer lands.
            if client {
                stamps.push(Clock::ticks());
            }
            out.extend(stamps.windows(2).map(|w| clock.us(w[1].wrapping_sub(w[0])) / 2.0));
        }
        Kind::Send => {
            let wr = SendWr::new(0, WrOpcode::Send, &sge, flags);
            for _ in 0..iters {
                let t0 = Clock::ticks();
                if client {
                    qp.post_send(&wr)?;
                    poll_n(&s.scq, 1, &mut wcs)?;
                    poll_n(&s.rcq, 1, &mut wcs)?;
                    post_recvs(s, 0, 1)?;
                    out.push(clock.us(Clock::ticks().wrapping_sub(t0)) / 2.0);
                } else {
                    poll_n(&s.rcq, 1, &mut wcs)?;
                    post_recvs(s, 0, 1)?;
                    qp.post_send(&wr)?;
                    poll_n(&s.scq, 1, &mut wcs)?;
                }
            }
        }
        Kind::Read | Kind::Atomic => {
            if client {
                let sge8 = [s.buf.sge(0, if kind == Kind::Atomic { 8 } else { sz as u32 })];
                let mut wr = SendWr::new(
                    0,
                    if kind == Kind::Atomic { WrOpcode::AtomicFetchAndAdd } else { WrOpcode::RdmaRead },
                    &sge8,
                    send_flags::SIGNALED,
                );
                wr.remote_addr = s.peer.addr + half as u64;
                wr.rkey = s.peer.rkey;
                wr.compare_add = 1;
                for _ in 0..iters {
                    let t0 = Clock::ticks();
                    qp.post_send(&wr)?;
                    poll_n(&s.scq, 1, &mut wcs)?;
                    out.push(clock.us(Clock::ticks().wrapping_sub(t0)));
                }
            }
        }
    }
    Ok(out)
}

/// Runs one bandwidth round on the client; returns (seconds, messages, messages per QP).
fn bandwidth_client(
    s: &Setup,
    kind: Kind,
    size: u64,
    iters: u64,
    depth: u32,
    duration: Option<Duration>,
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
fn send_bw_server(s: &Setup, total: u64) -> anyhow::Result<()> {
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

/// Bytes after the message that `--check` expects unchanged.
const CHECK_TAIL: usize = 64;

/// `--check`: the pattern a side sends (or publishes for READ) at `size`; it differs by side
/// and by size, so stale data of an earlier size or of the other direction does not pass.
fn check_pattern(size: u64, from_server: bool) -> Vec<u8> {
    let seed = (size.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8 ^ if from_server { 0x55 } else { 0 };
    pattern(seed, size as usize)
}

/// `--check`: `got` is a message of `want.len()` bytes followed by bytes that must still be
/// zero (nothing written beyond the message).
fn check_bytes(what: &str, got: &[u8], want: &[u8]) -> Result<(), String> {
    let n = want.len();
    if got.len() < n {
        return Err(format!("{what}: {} bytes, expected {n}", got.len()));
    }
    if let Some(i) = got[..n].iter().zip(want).position(|(g, w)| g != w) {
        return Err(format!("{what}: byte {i} of {n} is {:#04x}, expected {:#04x}", got[i], want[i]));
    }
    if let Some(i) = got[n..].iter().position(|b| *b != 0) {
        return Err(format!("{what}: byte {i} after the {n}-byte message changed to {:#04x}", got[n + i]));
    }
    Ok(())
}

/// `--check`: the value an atomic counter starts from at `size`.
fn check_counter_base(size: u64) -> u64 {
    0x5eed_0000_0000_0000 | (size << 16)
}

/// `--check`, before a round (before "go", so nothing is in flight): fills what this side
/// sends from with its pattern, and what the peer writes, sends or reads into with zeros.
fn check_prepare(s: &Setup, kind: Kind, lat: bool, size: u64, client: bool) {
    let half = (s.stride / 2) as usize;
    let n = size as usize;
    let zeros = vec![0u8; n + CHECK_TAIL.min(half - n)];
    for a in 0..s.areas as usize {
        let (src, dst) = (a * s.stride as usize, a * s.stride as usize + half);
        match kind {
            Kind::Send | Kind::Write => {
                if client || lat {
                    s.buf.write(src, &check_pattern(size, !client));
                }
                if !client || lat {
                    s.buf.write(dst, &zeros);
                }
            }
            Kind::Read if client => s.buf.write(src, &zeros),
            Kind::Read => s.buf.write(dst, &check_pattern(size, true)),
            Kind::Atomic if client => s.buf.write(src, &[0u8; 8]),
            Kind::Atomic => s.buf.write(dst, &check_counter_base(size).to_ne_bytes()),
        }
    }
}

/// `--check`, after a round: this side's verdict on its own memory. `counts[a]` is the
/// number of atomics the client executed on the server's area `a`.
fn check_verify(s: &Setup, kind: Kind, lat: bool, size: u64, iters: u64, client: bool, counts: &[u64]) -> Result<(), String> {
    let half = (s.stride / 2) as usize;
    let n = size as usize;
    let tail = CHECK_TAIL.min(half - n);
    let compare = |what: &str, at: usize, want: &[u8]| -> Result<(), String> {
        let mut got = vec![0u8; n + tail];
        s.buf.read(at, &mut got);
        check_bytes(what, &got, want)
    };
    for a in 0..s.areas as usize {
        let (src, dst) = (a * s.stride as usize, a * s.stride as usize + half);
        match kind {
            Kind::Send | Kind::Write if !client || lat => {
                let mut want = check_pattern(size, client);
                if kind == Kind::Write && lat {
                    // write_lat stamps its iteration tag into the last byte.
                    want[n - 1] = ((iters - 1) % 255 + 1) as u8;
                }
                let what = if kind == Kind::Send { "received data" } else { "written data" };
                compare(&format!("{what} (area {a})"), dst, &want)?;
            }
            Kind::Send | Kind::Write => {}
            Kind::Read if client => compare(&format!("read data (area {a})"), src, &check_pattern(size, true))?,
            Kind::Read => {}
            Kind::Atomic => {
                let mut v = [0u8; 8];
                let base = check_counter_base(size);
                if client {
                    // The value the last FETCH_AND_ADD fetched: exact with one QP (responses
                    // arrive in order), within range when several QPs share the counter.
                    s.buf.read(src, &mut v);
                    let got = u64::from_ne_bytes(v);
                    let total: u64 = counts.iter().sum();
                    let ok = if s.qps.len() == 1 { got == base + total - 1 } else { (base..base + total).contains(&got) };
                    if !ok {
                        return Err(format!(
                            "the last FETCH_AND_ADD fetched {got:#x}; expected {:#x}{}",
                            base + total - 1,
                            if s.qps.len() == 1 { "" } else { " or less, from the same counter" }
                        ));
                    }
                } else {
                    s.buf.read(dst, &mut v);
                    let got = u64::from_ne_bytes(v);
                    let want = base + counts.get(a).copied().unwrap_or(0);
                    if got != want {
                        return Err(format!(
                            "counter (area {a}) is {got:#x} after {} FETCH_AND_ADD(1), expected {want:#x}",
                            counts.get(a).copied().unwrap_or(0)
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// `--check`: after a bandwidth round, waits until every WR the client posted (the last ones
/// may be unsignaled) has executed: a signaled zero-length RDMA WRITE per QP completes only
/// after all WRs before it on its QP.
fn check_fence(s: &Setup) -> anyhow::Result<()> {
    let sge = [s.buf.sge(0, 0)];
    for (q, qp) in s.qps.iter().enumerate() {
        let mut wr = SendWr::new(u64::MAX, WrOpcode::RdmaWrite, &sge, send_flags::SIGNALED);
        wr.remote_addr = s.peer.addr + s.peer.stride * (q as u64 % s.peer.areas.max(1)) + s.peer.stride / 2;
        wr.rkey = s.peer.rkey;
        qp.post_send(&wr)?;
    }
    let mut wcs = [Wc::EMPTY; 64];
    poll_n(&s.scq, s.qps.len(), &mut wcs)
}

/// `--check`, after a round: the client tells the atomic counts, both sides verify their
/// memory and exchange verdicts; either side's mismatch fails both.
#[allow(clippy::too_many_arguments)]
fn check_round(
    s: &Setup,
    oob: &mut Oob,
    kind: Kind,
    lat: bool,
    size: u64,
    iters: u64,
    client: bool,
    counts: Vec<u64>,
) -> anyhow::Result<()> {
    let counts: Vec<u64> = if client {
        oob.send(&counts)?;
        counts
    } else {
        oob.recv()?
    };
    let mine = check_verify(s, kind, lat, size, iters, client, &counts).err();
    let theirs: Option<String> = if client {
        oob.send(&mine)?;
        oob.recv()?
    } else {
        let t = oob.recv()?;
        oob.send(&mine)?;
        t
    };
    let side = |c: bool| if c { "client" } else { "server" };
    if let Some(m) = mine {
        bail!("data check failed at {size} bytes ({}): {m}", side(client));
    }
    if let Some(m) = theirs {
        bail!("data check failed at {size} bytes ({}): {m}", side(!client));
    }
    Ok(())
}

fn print_row(r: &Row, json: bool, header: &mut bool) {
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

/// `vrdma perf reg_mr -s SIZE`: time to register SIZE bytes of ordinary heap memory, written
/// before registration (so every page is resident and must be preserved).
fn reg_mr_bench(a: &PerfArgs) -> anyhow::Result<()> {
    let ctx = Context::open_default().context("opening the vNIC")?;
    let pd = ctx.alloc_pd()?;
    let size = a.size as usize;
    let mut mem = vec![0u8; size];
    for (i, b) in mem.iter_mut().enumerate().step_by(4096) {
        *b = i as u8 | 1;
    }
    let t0 = Instant::now();
    // SAFETY: `mem` outlives the MR (dropped first below).
    let mr = unsafe { pd.reg_mr(mem.as_mut_ptr(), size, access::LOCAL_WRITE | access::REMOTE_WRITE) }?;
    let reg = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    drop(mr);
    let dereg = t1.elapsed().as_secs_f64();
    if mem.iter().enumerate().step_by(4096).any(|(i, b)| *b != (i as u8 | 1)) {
        bail!("memory content changed by registration");
    }
    let row = serde_json::json!({"test": "reg_mr", "size": size, "iterations": 1, "reg_s": reg, "dereg_s": dereg, "GBps": size as f64 / reg / 1e9});
    if a.json {
        println!("{row}");
    } else {
        println!("reg_mr of {size} bytes (all pages resident): {reg:.3} s ({:.2} GB/s), dereg {dereg:.4} s", size as f64 / reg / 1e9);
    }
    Ok(())
}

/// Runs `vrdma perf`.
pub fn run(a: PerfArgs) -> anyhow::Result<()> {
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
            let v = latency(&s, kind, size, iters, client)?;
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
            let (secs, msgs, posted) = bandwidth_client(&s, kind, size, iters, depth, a.duration.map(Duration::from_secs_f64))?;
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
            let r = Row {
                test: a.test.clone(),
                size,
                iterations: msgs / s.qps.len() as u64,
                qps: s.qps.len() as u32,
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
            };
            row = Some(r);
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

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8).collect()
}

fn verify(what: &str, got: &[u8], want: &[u8]) -> anyhow::Result<()> {
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        bail!("{what}: data mismatch at byte {i}: got {:#x}, want {:#x}", got[i], want[i]);
    }
    Ok(())
}

/// `vrdma check`: SEND/RECV, RDMA WRITE, RDMA READ and both atomics between two vNICs,
/// every byte verified on the receiving side. Exits non-zero on any mismatch.
pub fn check(server: Option<String>, port: u16) -> anyhow::Result<()> {
    const LEN: usize = 1 << 20;
    let client = server.is_some();
    let mut oob = match &server {
        Some(h) => Oob::connect(h, port)?,
        None => Oob::accept(port)?,
    };
    let a = PerfArgs {
        test: "send_lat".into(),
        server: server.clone(),
        size: LEN as u64,
        all: false,
        iters: None,
        qps: 1,
        port,
        tx_depth: 16,
        duration: None,
        json: false,
        buf_per_qp: false,
        mem: vrdma::Backing::Anonymous,
        start_at: None,
        check: false,
        inline_size: DEFAULT_INLINE,
        spin: Spin::Pause,
    };
    let s = setup(&a, Kind::Send, true, &mut oob)?;
    let mut wcs = [Wc::EMPTY; 4];
    let half = (s.stride / 2) as usize;
    let qp = &s.qps[0];
    post_recvs(&s, 0, 1)?;
    oob.send(&"posted")?;
    let _: String = oob.recv()?;
    // 1. SEND/RECV both ways.
    let p1 = pattern(1, LEN);
    if client {
        s.buf.write(0, &p1);
        qp.post_send(&SendWr::new(1, WrOpcode::Send, &[s.buf.sge(0, LEN as u32)], send_flags::SIGNALED))?;
        poll_n(&s.scq, 1, &mut wcs)?;
        poll_n(&s.rcq, 1, &mut wcs)?;
        let mut got = vec![0u8; LEN];
        s.buf.read(half, &mut got);
        let echo: Vec<u8> = p1.iter().map(|b| b ^ 0xff).collect();
        verify("SEND echo", &got, &echo)?;
        println!("SEND/RECV      ok: {LEN} bytes each way, verified");
    } else {
        poll_n(&s.rcq, 1, &mut wcs)?;
        if wcs[0].byte_len as usize != LEN {
            bail!("received {} bytes, expected {LEN}", wcs[0].byte_len);
        }
        let mut got = vec![0u8; LEN];
        s.buf.read(half, &mut got);
        verify("SEND", &got, &p1)?;
        let echo: Vec<u8> = got.iter().map(|b| b ^ 0xff).collect();
        s.buf.write(0, &echo);
        qp.post_send(&SendWr::new(1, WrOpcode::Send, &[s.buf.sge(0, LEN as u32)], send_flags::SIGNALED))?;
        poll_n(&s.scq, 1, &mut wcs)?;
    }
    // 2. RDMA WRITE client -> server, verified by the server.
    let p2 = pattern(2, LEN);
    if client {
        s.buf.write(0, &p2);
        let sg = [s.buf.sge(0, LEN as u32)];
        let mut wr = SendWr::new(2, WrOpcode::RdmaWrite, &sg, send_flags::SIGNALED);
        wr.remote_addr = s.peer.addr + half as u64;
        wr.rkey = s.peer.rkey;
        qp.post_send(&wr)?;
        poll_n(&s.scq, 1, &mut wcs)?;
        oob.send(&"written")?;
        let v: String = oob.recv()?;
        if v != "ok" {
            bail!("server: {v}");
        }
        println!("RDMA WRITE     ok: {LEN} bytes, verified by the target");
    } else {
        let _: String = oob.recv()?;
        let mut got = vec![0u8; LEN];
        s.buf.read(half, &mut got);
        match verify("WRITE", &got, &p2) {
            Ok(()) => oob.send(&"ok")?,
            Err(e) => {
                oob.send(&e.to_string())?;
                return Err(e);
            }
        }
    }
    // 3. RDMA READ: the server publishes a pattern, the client reads and checks it.
    let p3 = pattern(3, LEN);
    if client {
        let _: String = oob.recv()?;
        let sg = [s.buf.sge(0, LEN as u32)];
        let mut wr = SendWr::new(3, WrOpcode::RdmaRead, &sg, send_flags::SIGNALED);
        wr.remote_addr = s.peer.addr + half as u64;
        wr.rkey = s.peer.rkey;
        qp.post_send(&wr)?;
        poll_n(&s.scq, 1, &mut wcs)?;
        let mut got = vec![0u8; LEN];
        s.buf.read(0, &mut got);
        verify("READ", &got, &p3)?;
        oob.send(&"read")?;
        println!("RDMA READ      ok: {LEN} bytes, verified");
    } else {
        s.buf.write(half, &p3);
        oob.send(&"published")?;
        let _: String = oob.recv()?;
    }
    // 4. Atomics on a counter in the server's memory.
    if client {
        let _: String = oob.recv()?;
        let sg = [s.buf.sge(0, 8)];
        let mut wr = SendWr::new(4, WrOpcode::AtomicFetchAndAdd, &sg, send_flags::SIGNALED);
        wr.remote_addr = s.peer.addr + half as u64;
        wr.rkey = s.peer.rkey;
        wr.compare_add = 5;
        qp.post_send(&wr)?;
        poll_n(&s.scq, 1, &mut wcs)?;
        let mut v = [0u8; 8];
        s.buf.read(0, &mut v);
        if u64::from_ne_bytes(v) != 100 {
            bail!("FETCH_AND_ADD returned {}, expected 100", u64::from_ne_bytes(v));
        }
        wr.opcode = WrOpcode::AtomicCmpAndSwp;
        wr.compare_add = 105;
        wr.swap = 7;
        qp.post_send(&wr)?;
        poll_n(&s.scq, 1, &mut wcs)?;
        s.buf.read(0, &mut v);
        if u64::from_ne_bytes(v) != 105 {
            bail!("CMP_AND_SWP returned {}, expected 105", u64::from_ne_bytes(v));
        }
        oob.send(&"swapped")?;
        let v: String = oob.recv()?;
        if v != "ok" {
            bail!("server: {v}");
        }
        println!("ATOMIC FAA+CAS ok: 100 +5 -> 105, CAS 105->7, verified by the target");
    } else {
        s.buf.write(half, &100u64.to_ne_bytes());
        oob.send(&"counter")?;
        let _: String = oob.recv()?;
        let mut v = [0u8; 8];
        s.buf.read(half, &mut v);
        let val = u64::from_ne_bytes(v);
        oob.send(&if val == 7 { "ok".to_string() } else { format!("counter is {val}, expected 7") })?;
        if val != 7 {
            bail!("counter is {val}, expected 7");
        }
        println!("check server: all data verified");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_bytes_finds_corruption_overruns_and_stale_data() {
        let want = check_pattern(4096, false);
        let mut got = want.clone();
        got.extend_from_slice(&[0; CHECK_TAIL]);
        assert_eq!(check_bytes("x", &got, &want), Ok(()));
        let mut bad = got.clone();
        bad[1000] ^= 1;
        assert!(check_bytes("x", &bad, &want).unwrap_err().contains("byte 1000 of 4096"));
        let mut over = got.clone();
        over[4096 + 3] = 7;
        assert!(check_bytes("x", &over, &want).unwrap_err().contains("byte 3 after the 4096-byte message"));
        assert!(check_bytes("x", &got[..100], &want).is_err());
        // The other direction's data, or an earlier size's, does not pass.
        let mut other = check_pattern(4096, true);
        other.extend_from_slice(&[0; CHECK_TAIL]);
        assert!(check_bytes("x", &other, &want).is_err());
        let mut stale = check_pattern(2048, false);
        stale.resize(4096 + CHECK_TAIL, 0);
        assert!(check_bytes("x", &stale, &want).is_err());
        // Every size's pattern differs from the next one's in most bytes.
        for k in 1..23 {
            let (a, b) = (check_pattern(1 << k, false), check_pattern(1 << (k + 1), false));
            let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
            assert!(same * 4 <= a.len().max(4), "sizes {} and {}: {same} equal bytes", 1 << k, 1 << (k + 1));
        }
    }
}
