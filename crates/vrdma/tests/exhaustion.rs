//! The exhaustion suite, in process: one client floods its vNIC's daemon-side resources
//! (sessions, QPs at the largest ring size, MRs, control requests) while two vNICs of another
//! tenant create, connect and move bytes through the daemon's engine. Every flood is stopped
//! by a per-vNIC limit with the kernel's errno and counted; the other vNICs' calls stay fast
//! and their throughput stays within 90% of what it was alone, measured in the same run.
//! (Lane trickles and a held UD lock are attacked in vrdmad's unit tests: `engine::lane::
//! deadline`, `engine::ud`.)

mod common;
use common::*;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma::{Context, Limits, MrBuf, QpCaps, QpInitAttr, SendWr, WcStatus, WrOpcode};

/// The attacker's vNIC's limits: the defaults but smaller, so that the test reaches them
/// quickly.
fn attacker_limits() -> Limits {
    Limits { max_sessions: 48, max_ring_bytes: 512 << 20, max_mr: 2048, max_pending: 8, ..Limits::default() }
}

/// 1 MiB RDMA WRITEs from `a` to `b`, 16 in flight, for `secs`: bytes per second.
fn write_bw(a: &End, b: &End, src: &MrBuf, dst: &MrBuf, secs: f64) -> f64 {
    const MSG: u32 = 1 << 20;
    let sg = [src.sge(0, MSG)];
    let mut w = SendWr::new(1, WrOpcode::RdmaWrite, &sg, vrdma::send_flags::SIGNALED);
    w.remote_addr = dst.addr();
    w.rkey = dst.mr().rkey();
    let _ = b;
    let (started, mut done, mut posted) = (Instant::now(), 0u64, 0u64);
    let mut wc = [vrdma::Wc::EMPTY; 16];
    while started.elapsed().as_secs_f64() < secs {
        while posted - done < 16 {
            a.qp.post_send(&w).expect("post");
            posted += 1;
        }
        let n = a.cq.poll(&mut wc);
        for c in &wc[..n] {
            assert_eq!(c.status, WcStatus::Success);
        }
        done += n as u64;
        if n == 0 {
            std::thread::yield_now();
        }
    }
    while done < posted {
        done += a.cq.poll(&mut wc) as u64;
    }
    (done * u64::from(MSG)) as f64 / started.elapsed().as_secs_f64()
}

/// Opens a vNIC, makes an RC QP and an MR, connects a pair: how long each end's calls took.
fn create_and_connect(h: &Host, sa: &Path, sb: &Path) -> Duration {
    let started = Instant::now();
    let (a, b) = h.pair(sa, sb, ALL);
    let took = started.elapsed();
    drop((a, b));
    took
}

fn errno_of(r: Result<impl Sized, vrdma::Error>) -> Option<i32> {
    r.err().map(|e| e.errno())
}

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok()).unwrap()
}

/// What the attacker got before its limits stopped it, and the errno that did.
#[derive(Debug, Default)]
struct Flood {
    sessions: usize,
    sessions_errno: Option<i32>,
    qps: usize,
    qps_errno: Option<i32>,
    mrs: usize,
    mrs_errno: Option<i32>,
}

#[test]
fn a_flooding_client_is_stopped_by_its_limits_and_others_keep_their_service() {
    let h = Host::new(Mode::Mediated, "exhaust");
    let sa = h.vnic("va", "victim");
    let sb = h.vnic("vb", "victim");
    let sx = h.vnic_limits("x", "evil", attacker_limits());
    let limits = attacker_limits();

    // The victims' pair, its set-up timed alone.
    let alone_setup = create_and_connect(&h, &sa, &sb);
    let (a, b) = h.pair(&sa, &sb, ALL);
    let src = MrBuf::new(&a.pd, 1 << 20, ALL).unwrap();
    let dst = MrBuf::new(&b.pd, 1 << 20, ALL).unwrap();
    let rss_before = rss_kib();

    // The flood: sessions, then QPs at the largest ring size and MRs, until refused.
    let mut f = Flood::default();
    let mut held = Vec::new();
    for _ in 0..limits.max_sessions * 4 {
        match Context::open(&sx) {
            Ok(c) => held.push(c),
            Err(e) => {
                f.sessions_errno = Some(e.errno());
                break;
            }
        }
    }
    f.sessions = held.len();
    let ctx = held.first().expect("one session at least").clone();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let caps = QpCaps { max_send_wr: 1, max_recv_wr: 32768, max_send_sge: 1, max_recv_sge: 32, max_inline_data: 0 };
    let mut qps = Vec::new();
    for _ in 0..32 {
        match pd.create_qp(&QpInitAttr::rc(&cq, &cq, caps)) {
            Ok(q) => qps.push(q),
            Err(e) => {
                f.qps_errno = Some(e.errno());
                break;
            }
        }
    }
    f.qps = qps.len();
    let mut mrs = Vec::new();
    for _ in 0..limits.max_mr * 2 {
        match MrBuf::new(&pd, 4096, ALL) {
            Ok(m) => mrs.push(m),
            Err(e) => {
                f.mrs_errno = Some(e.errno());
                break;
            }
        }
    }
    f.mrs = mrs.len();

    // Control requests from 16 sessions at once whenever `active`. The flooding threads run
    // at the lowest priority, as a container with a small CPU share would: what is measured
    // is what the daemon spends on them.
    let (stop, active) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let (served, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let flooders: Vec<_> = held
        .iter()
        .take(16)
        .cloned()
        .map(|c| {
            let (stop, active, served, refused) = (stop.clone(), active.clone(), served.clone(), refused.clone());
            std::thread::spawn(move || {
                // SAFETY: setpriority on this thread (a TID is a PID for PRIO_PROCESS).
                unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19) };
                while !stop.load(Ordering::Relaxed) {
                    if !active.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                    match errno_of(c.usage()) {
                        None => served.fetch_add(1, Ordering::Relaxed),
                        Some(libc::EAGAIN) => refused.fetch_add(1, Ordering::Relaxed),
                        Some(e) => panic!("usage: errno {e}"),
                    };
                }
            })
        })
        .collect();

    // Throughput alone and under attack, in alternating rounds (the machine's speed drifts).
    let (mut alone_bw, mut attacked_bw) = (Vec::new(), Vec::new());
    let mut attacked_setup = Duration::ZERO;
    for round in 0..5 {
        active.store(false, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(100));
        alone_bw.push(write_bw(&a, &b, &src, &dst, 1.0));
        active.store(true, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(100));
        if round == 0 {
            attacked_setup = create_and_connect(&h, &sa, &sb);
        }
        attacked_bw.push(write_bw(&a, &b, &src, &dst, 1.0));
    }
    stop.store(true, Ordering::Relaxed);
    for t in flooders {
        t.join().unwrap();
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (alone, attacked) = (median(&mut alone_bw), median(&mut attacked_bw));
    let rss_after = rss_kib();
    let x = h.daemon.status().into_iter().find(|s| s.record.name == "x").unwrap();
    eprintln!(
        "flood: {f:?}; control requests served {} refused {}; x refused_by_limits {}, ring bytes {}; \
         victims: set-up alone {alone_setup:?} attacked {attacked_setup:?}; write_bw 1 MiB alone {:.0} MB/s attacked {:.0} MB/s \
         ({:.2}); RSS {} -> {} MiB",
        served.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        x.counters.refused_by_limits,
        x.counters.ring_bytes,
        alone / 1e6,
        attacked / 1e6,
        attacked / alone,
        rss_before >> 10,
        rss_after >> 10,
    );

    assert_eq!((f.sessions, f.sessions_errno), (limits.max_sessions as usize, Some(libc::EMFILE)), "sessions");
    assert_eq!(f.qps_errno, Some(libc::ENOMEM), "QPs at the largest ring: {} made", f.qps);
    assert!(x.counters.ring_bytes <= limits.max_ring_bytes);
    assert_eq!((f.mrs, f.mrs_errno), (limits.max_mr as usize, Some(libc::ENOMEM)), "MRs");
    assert!(refused.load(Ordering::Relaxed) > 0, "control requests beyond max_pending are refused (EAGAIN)");
    assert!(x.counters.refused_by_limits >= 3 + refused.load(Ordering::Relaxed), "refusals counted");
    // (This process holds the daemon and the clients: its growth is bounded by what the
    // attacker's limits let it allocate, queue memory above all, plus the MRs' pages.)
    let bound_kib = (limits.max_ring_bytes >> 10) + (limits.max_mr as u64 * 4) + (64 << 10);
    assert!(rss_after.saturating_sub(rss_before) <= bound_kib, "RSS grew {} KiB, bound {bound_kib} KiB", rss_after - rss_before);
    assert!(attacked_setup < Duration::from_secs(1), "set-up under attack took {attacked_setup:?}");
    assert!(attacked >= 0.9 * alone, "throughput under attack {:.0} MB/s, alone {:.0} MB/s", attacked / 1e6, alone / 1e6);
    drop((mrs, qps, held));
}
