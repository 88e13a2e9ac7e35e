//! The latency tests' timed loops (ping-pong for send and write, one operation at a time
//! for read and atomic).

use vrdma::*;

use super::args::Kind;
use super::clock::Clock;
use super::setup::{poll_n, post_recvs, Setup};

/// Runs one latency round; returns per-iteration latencies (µs): the client's, and for
/// write_lat the server's too (both sides time it, as in ib_write_lat).
pub(crate) fn latency(s: &Setup, kind: Kind, size: u64, iters: u64, client: bool) -> anyhow::Result<Vec<f64>> {
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
            // server's path as well as the client's changes the result
            // (docs/measurements.md), so it is where perftest's is.
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
