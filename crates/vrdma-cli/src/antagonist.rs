//! `vrdma __antagonist`: the two Husky-style antagonists `vrdma perf` cannot play, for the
//! isolation tests (crates/vrdma-cli/tests/husky.rs). Both sides meet over the same TCP
//! out-of-band exchange as perf (the server runs without an address).
//!
//! - `rnr`: the server connects its QPs and posts no receive; the client keeps every send
//!   queue full of SENDs, so each one is answered with RNR NAKs and retried (connect_rc asks
//!   for infinite RNR retries and the shortest RNR timer) for the whole run.
//! - `churn`: connection churn; each round both sides create a QP, exchange its number,
//!   connect, move one SEND and destroy the QP again.
//!
//! The client prints one JSON line: what it did and in how many seconds.

use anyhow::{bail, Context as _};
use std::time::{Duration, Instant};
use vrdma::*;

use crate::oob::{Endpoint, Oob};

/// Bytes of the buffer both sides register (a SEND's payload comes from its start).
const BUF: usize = 1 << 20;
/// Send queue depth of each `rnr` QP.
const RNR_DEPTH: u32 = 32;

/// The antagonists.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum Mode {
    /// SENDs at QPs that post no receives (RNR NAKs and retries).
    Rnr,
    /// Connect/disconnect churn: a new QP per round.
    Churn,
}

/// Options of `vrdma __antagonist`.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Args {
    /// rnr or churn.
    #[arg(value_enum)]
    mode: Mode,
    /// Server address (client side); the server runs without it.
    server: Option<String>,
    /// TCP port of the out-of-band exchange.
    #[arg(short = 'p', long, default_value_t = 18700)]
    port: u16,
    /// Client: run this many seconds.
    #[arg(short = 'D', long, default_value_t = 5.0)]
    duration: f64,
    /// rnr: QPs; churn: QPs connected per round.
    #[arg(short = 'q', long, default_value_t = 8)]
    qps: u32,
    /// rnr: bytes per SEND.
    #[arg(short = 's', long, default_value_t = 4096)]
    size: u32,
}

pub(crate) fn run(a: Args) -> anyhow::Result<()> {
    let ctx = Context::open_default().context("opening the vNIC (is this a `vrdma run` container?)")?;
    let pd = ctx.alloc_pd()?;
    let buf = MrBuf::new(&pd, BUF, access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ)?;
    let mut oob = match &a.server {
        Some(host) => Oob::connect(host, a.port)?,
        None => Oob::accept(a.port)?,
    };
    let client = a.server.is_some();
    match a.mode {
        Mode::Rnr => rnr(&a, &ctx, &pd, &buf, &mut oob, client),
        Mode::Churn => churn(&a, &ctx, &pd, &buf, &mut oob, client),
    }
}

/// Creates `n` RC QPs on `cq`, sends their numbers, and connects them to the peer's.
fn connected_qps(ctx: &Context, pd: &Pd, cq: &Cq, n: u32, depth: u32, oob: &mut Oob, recvs: Option<&MrBuf>) -> anyhow::Result<Vec<Qp>> {
    let caps = QpCaps { max_send_wr: depth, max_recv_wr: depth, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let remote_access = access::REMOTE_WRITE | access::REMOTE_READ;
    let mut qps = Vec::new();
    for _ in 0..n {
        let qp = pd.create_qp(&QpInitAttr::rc(cq, cq, caps))?;
        qp.init_rc(remote_access)?;
        // Posted before the peer can connect and send.
        if let Some(b) = recvs {
            qp.post_recv(&RecvWr { wr_id: 0, sg_list: &[b.sge(0, 64)] })?;
        }
        qps.push(qp);
    }
    oob.send(&Endpoint {
        qpns: qps.iter().map(|q| q.qp_num()).collect(),
        gid: ctx.gids()[0].to_vec(),
        addr: 0,
        rkey: 0,
        stride: 0,
        areas: 1,
    })?;
    let peer: Endpoint = oob.recv()?;
    if peer.qpns.len() != qps.len() {
        bail!("peer has {} QPs, we have {}", peer.qpns.len(), qps.len());
    }
    let mut gid = [0u8; 16];
    gid.copy_from_slice(peer.gid.get(..16).context("peer GID")?);
    for (q, dq) in qps.iter().zip(&peer.qpns) {
        q.connect_rc(gid, *dq, remote_access)?;
    }
    // Both sides connected before anyone sends (as perf).
    oob.send(&"ready")?;
    let _: String = oob.recv()?;
    Ok(qps)
}

fn rnr(a: &Args, ctx: &Context, pd: &Pd, buf: &MrBuf, oob: &mut Oob, client: bool) -> anyhow::Result<()> {
    let cq = ctx.create_cq(RNR_DEPTH * a.qps.max(1), None)?;
    let qps = connected_qps(ctx, pd, &cq, a.qps.max(1), RNR_DEPTH, oob, None)?;
    if !client {
        // Posts nothing; holds its QPs until the client is done.
        let _: String = oob.recv()?;
        return Ok(());
    }
    let sge = [buf.sge(0, a.size.min(BUF as u32))];
    let start = Instant::now();
    let (mut posted, mut completed, mut failed) = (0u64, 0u64, 0u64);
    let mut wcs = [Wc::EMPTY; 64];
    while start.elapsed().as_secs_f64() < a.duration {
        for q in &qps {
            loop {
                match q.post_send(&SendWr::new(posted, WrOpcode::Send, &sge, send_flags::SIGNALED)) {
                    Ok(()) => posted += 1,
                    Err(Error::QueueFull { .. }) => break,
                    Err(e) => return Err(e.into()),
                }
            }
        }
        let n = cq.poll(&mut wcs);
        completed += n as u64;
        failed += wcs[..n].iter().filter(|w| w.status != WcStatus::Success).count() as u64;
        std::thread::sleep(Duration::from_millis(10));
    }
    let secs = start.elapsed().as_secs_f64();
    oob.send(&"done")?;
    println!(
        "{}",
        serde_json::json!({"mode": "rnr", "qps": qps.len(), "posted": posted, "completed": completed, "failed": failed, "secs": secs})
    );
    Ok(())
}

fn churn(a: &Args, ctx: &Context, pd: &Pd, buf: &MrBuf, oob: &mut Oob, client: bool) -> anyhow::Result<()> {
    let n = a.qps.max(1);
    let cq = ctx.create_cq(4 * n, None)?;
    let sge = [buf.sge(0, 8)];
    let start = Instant::now();
    let mut rounds = 0u64;
    let mut wcs = [Wc::EMPTY; 16];
    loop {
        // The client decides whether there is another round.
        let more = if client {
            let more = start.elapsed().as_secs_f64() < a.duration;
            oob.send(&more)?;
            more
        } else {
            oob.recv::<bool>()?
        };
        if !more {
            break;
        }
        let qps = connected_qps(ctx, pd, &cq, n, 4, oob, (!client).then_some(buf))?;
        let mut want = n as usize;
        if client {
            for q in &qps {
                q.post_send(&SendWr::new(rounds, WrOpcode::Send, &sge, send_flags::SIGNALED))?;
            }
        }
        // Each side reaps its own completions: the client its sends, the server its receives.
        let deadline = Instant::now() + Duration::from_secs(10);
        while want > 0 {
            let got = cq.poll(&mut wcs);
            for w in &wcs[..got] {
                if w.status != WcStatus::Success {
                    bail!("round {rounds}: completion error {:?}", w.status);
                }
            }
            want -= got;
            if Instant::now() > deadline {
                bail!("round {rounds}: timed out waiting for completions");
            }
        }
        // Both sides finished before either destroys its QPs.
        oob.send(&"round")?;
        let _: String = oob.recv()?;
        drop(qps);
        rounds += 1;
    }
    if client {
        let secs = start.elapsed().as_secs_f64();
        println!("{}", serde_json::json!({"mode": "churn", "qps": n, "rounds": rounds, "secs": secs}));
    }
    Ok(())
}
