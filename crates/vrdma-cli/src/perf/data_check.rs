//! `vrdma perf --check`: known patterns written before each size and every byte verified
//! after it, outside the timed loops.

use anyhow::bail;
use vrdma::*;

use super::args::Kind;
use super::setup::{poll_n, Setup};
use crate::oob::Oob;

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
pub(crate) fn check_prepare(s: &Setup, kind: Kind, lat: bool, size: u64, client: bool) {
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
pub(crate) fn check_fence(s: &Setup) -> anyhow::Result<()> {
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
pub(crate) fn check_round(
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

/// `len` bytes of a pattern that `seed` shifts.
pub(crate) fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8).collect()
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
