//! The connected QPs, CQs and buffer of a `vrdma perf` run, and the polling and receive
//! helpers every test shares.

use anyhow::{bail, Context as _};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vrdma::*;

use super::args::{sizes, Kind, PerfArgs, Spin};
use crate::oob::{Endpoint, Oob};

/// One side of a run: its QPs connected to the peer's, and the buffer both sides address.
pub(crate) struct Setup {
    pub(crate) ctx: Context,
    _pd: Pd,
    pub(crate) scq: Cq,
    pub(crate) rcq: Cq,
    pub(crate) qps: Vec<Qp>,
    pub(crate) buf: MrBuf,
    pub(crate) stride: u64,
    /// Buffer areas (1, or one per QP with --buf-per-qp).
    pub(crate) areas: u64,
    pub(crate) peer: Endpoint,
    /// Largest SEND/WRITE posted inline.
    inline_size: u64,
    spin: Spin,
    /// Set when the peer's out-of-band connection hangs up (`Oob::watch_hangup`).
    peer_gone: Arc<AtomicBool>,
}

impl Setup {
    /// The INLINE flag for a `kind` message of `size` bytes.
    pub(crate) fn inline_flag(&self, kind: Kind, size: u64) -> u32 {
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
    pub(crate) fn wait_for_tag(&self, off: usize, tag: u8) -> anyhow::Result<()> {
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

impl Setup {
    /// `e` (a failed run) with its cause when the peer went away: a peer that dies closes
    /// its out-of-band connection and, through vrdmad, flushes our QP; whichever is seen
    /// first, the user should read that the peer went away.
    #[cold]
    pub(crate) fn explain(&self, e: anyhow::Error) -> anyhow::Error {
        if e.to_string().starts_with("the peer closed") {
            return e;
        }
        let started = Instant::now();
        while started.elapsed() < Duration::from_millis(200) {
            if self.peer_gone.load(Ordering::Relaxed) {
                return anyhow::anyhow!("the peer closed the out-of-band connection: {e}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        e
    }
}

/// The error of a latency loop whose peer went away mid-run.
#[cold]
fn peer_gone() -> anyhow::Error {
    anyhow::anyhow!("the peer closed the out-of-band connection while we waited for its write")
}

pub(crate) fn setup(a: &PerfArgs, kind: Kind, lat: bool, oob: &mut Oob) -> anyhow::Result<Setup> {
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

pub(crate) fn poll_n(cq: &Cq, want: usize, wcs: &mut [Wc]) -> anyhow::Result<()> {
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
pub(crate) fn post_recvs(s: &Setup, qi: usize, n: u32) -> anyhow::Result<()> {
    let base = s.stride * (qi as u64 % s.areas) + s.stride / 2;
    for _ in 0..n {
        s.qps[qi].post_recv(&RecvWr { wr_id: qi as u64, sg_list: &[s.buf.sge(base as usize, (s.stride / 2) as u32)] })?;
    }
    Ok(())
}
