//! The exhaustion suite, end to end: a real vrdmad, two containers of one tenant measuring
//! `vrdma perf write_bw` between their vNICs, and a client of a third vNIC (another tenant)
//! flooding that vNIC's daemon-side resources: sessions, QPs at the largest ring size, MRs
//! and control requests. The flood stops at the third vNIC's limits (set with `vrdma vnic
//! create --max-*`) with the kernel's errnos, counted in `vrdma vnic list`; the other
//! tenant's throughput under attack, through the daemon's engine (`vrdmad --mediated`),
//! stays within 90% of what it was alone (medians of alternating phases of one run), its
//! set-up calls take under a second, and vrdmad's memory stays within what the limits allow.

mod common;
use common::perf::{intervals, rate_within, unix_ms};
use common::*;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma::{access, Context, MrBuf, QpCaps, QpInitAttr};

const MAX_SESSIONS: u32 = 48;
const MAX_RING_BYTES: u64 = 512 << 20;
const MAX_MR: u32 = 2048;
const MAX_PENDING: u32 = 8;
const ALL: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

/// vrdmad's resident memory (KiB).
fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()).unwrap()
}

/// Seconds of each phase, alone or attacked, of the one measured run.
const PHASE_S: u64 = 3;
/// Phases of the run: alone and attacked in turn, three of each.
const PHASES: u64 = 6;

/// One `vrdma perf write_bw` run of 1 MiB messages between containers on `a` and `b`
/// (`b_ip`'s) in which the flood is off and on (`active`) in turns of `PHASE_S` seconds,
/// starting off; `on_first_attack` runs early in the first attacked phase. One process pair
/// for the whole comparison: a new pair may land in another speed mode of the machine
/// (9.6 against 11 GB/s here), which separate runs per phase mistook for the flood's
/// effect. Returns each phase's rate (MB/s, its first second left out as the change's
/// transition): (alone, attacked). Retried once (another test may hold the bridge a moment).
fn alternating_perf(
    d: &Daemon,
    (a, b, b_ip): (&str, &str, &str),
    port: u16,
    active: &AtomicBool,
    on_first_attack: &mut dyn FnMut(),
) -> (Vec<f64>, Vec<f64>) {
    let secs = (PHASE_S * PHASES).to_string();
    for attempt in 0..2 {
        active.store(false, Ordering::Relaxed);
        let port = (port + attempt).to_string();
        let srv = [VRDMA, "perf", "write_bw", "-s", "1048576", "-D", &secs, "-p", &port];
        let server = d.container(b, &srv);
        std::thread::sleep(Duration::from_millis(1000));
        let start_at = unix_ms() + 1500;
        let start_at_s = start_at.to_string();
        let mut cli = srv.to_vec();
        cli.extend_from_slice(&["--json", "--interval", "0.5", "--start-at", &start_at_s, b_ip]);
        let client = d.container(a, &cli);
        for phase in 0..PHASES {
            let phase_start = start_at + phase * PHASE_S * 1000;
            std::thread::sleep(Duration::from_millis(phase_start.saturating_sub(unix_ms())));
            active.store(phase % 2 == 1, Ordering::Relaxed);
            if phase == 1 {
                std::thread::sleep(Duration::from_millis(200));
                on_first_attack();
            }
        }
        let (ok_c, out_c) = wait_output(client, Duration::from_secs(120));
        active.store(false, Ordering::Relaxed);
        let (ok_s, out_s) = wait_output(server, Duration::from_secs(30));
        let iv = intervals(&out_c);
        if ok_c && ok_s && iv.last().is_some_and(|i| i.end_s >= (PHASE_S * PHASES) as f64 - 0.6) {
            let rate = |phase: u64| rate_within(&iv, (phase * PHASE_S + 1) as f64, ((phase + 1) * PHASE_S) as f64).0 / 1e6;
            return ((0..PHASES).step_by(2).map(rate).collect(), (1..PHASES).step_by(2).map(rate).collect());
        }
        if attempt == 1 {
            panic!("perf failed:\nclient:\n{out_c}\nserver:\n{out_s}\n{}", d.log());
        }
        eprintln!("perf attempt failed, retrying:\n{out_c}\n{out_s}");
    }
    unreachable!()
}

/// Opens vNIC sockets `sa` and `sb`, makes an RC QP and an MR on each and connects them:
/// how long that took.
fn create_and_connect(sa: &Path, sb: &Path) -> Duration {
    let started = Instant::now();
    let end = |s: &Path| {
        let ctx = Context::open(s).expect("open");
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64, None).unwrap();
        let caps = QpCaps { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let qp = pd.create_qp(&QpInitAttr::rc(&cq, &cq, caps)).unwrap();
        let mr = MrBuf::new(&pd, 65536, ALL).unwrap();
        (ctx, pd, cq, qp, mr)
    };
    let (a, b) = (end(sa), end(sb));
    for (me, peer) in [(&a, &b), (&b, &a)] {
        me.3.connect_rc(peer.0.gids()[0], peer.3.qp_num(), ALL).expect("connect");
    }
    started.elapsed()
}

#[test]
fn a_flooding_vnic_cannot_starve_another_tenants_containers() {
    if !vrdma_test_support::require_root("exhaustion::a_flooding_vnic_cannot_starve_another_tenants_containers") {
        return;
    }
    // Mediated: the daemon's engine carries the victims' bytes, so whatever the flood costs
    // the daemon is felt.
    let d = Daemon::start_with("exhaust", &["--mediated"]);
    // Addresses of our own (other suites use the bridge's network at the same time).
    let net = 150 + std::process::id() % 50;
    let ip = |n: u32| format!("198.18.{net}.{n}");
    d.ok(&["vnic", "create", "exh-va", "--tenant", "exh-victim", "--ip", &format!("{}/15", ip(2))]);
    d.ok(&["vnic", "create", "exh-vb", "--tenant", "exh-victim", "--ip", &format!("{}/15", ip(3))]);
    let (sessions, ring, mrs_max, pending) =
        (MAX_SESSIONS.to_string(), MAX_RING_BYTES.to_string(), MAX_MR.to_string(), MAX_PENDING.to_string());
    d.ok(&[
        "vnic",
        "create",
        "exh-x",
        "--tenant",
        "exh-evil",
        "--ip",
        &format!("{}/15", ip(4)),
        "--max-sessions",
        &sessions,
        "--max-ring-bytes",
        &ring,
        "--max-mr",
        &mrs_max,
        "--max-pending",
        &pending,
    ]);
    assert_eq!(d.vnic("exh-x")["vnic"]["limits"]["max_sessions"], MAX_SESSIONS, "the limits are stored");
    let (sa, sb, sx) = (d.socket("exh-va"), d.socket("exh-vb"), d.socket("exh-x"));
    let daemon_pid = d.child.id();
    let alone_setup = create_and_connect(&sa, &sb);
    let rss_before = rss_kib(daemon_pid);

    // The flood: sessions, QPs at the largest ring size, MRs, until refused.
    let mut held = Vec::new();
    let mut sessions_errno = None;
    for _ in 0..MAX_SESSIONS * 4 {
        match Context::open(&sx) {
            Ok(c) => held.push(c),
            Err(e) => {
                sessions_errno = Some(e.errno());
                break;
            }
        }
    }
    let ctx = held.first().expect("a session").clone();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let caps = QpCaps { max_send_wr: 1, max_recv_wr: 32768, max_send_sge: 1, max_recv_sge: 32, max_inline_data: 0 };
    let (mut qps, mut qps_errno) = (Vec::new(), None);
    for _ in 0..32 {
        match pd.create_qp(&QpInitAttr::rc(&cq, &cq, caps)) {
            Ok(q) => qps.push(q),
            Err(e) => {
                qps_errno = Some(e.errno());
                break;
            }
        }
    }
    let (mut mrs, mut mrs_errno) = (Vec::new(), None);
    for _ in 0..MAX_MR * 2 {
        match MrBuf::new(&pd, 4096, ALL) {
            Ok(m) => mrs.push(m),
            Err(e) => {
                mrs_errno = Some(e.errno());
                break;
            }
        }
    }

    // Control requests from 16 sessions whenever `active`, from threads of the lowest
    // priority (a container's small CPU share): what counts is what vrdmad spends on them.
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
                    match c.usage() {
                        Ok(_) => served.fetch_add(1, Ordering::Relaxed),
                        Err(e) if e.errno() == libc::EAGAIN => refused.fetch_add(1, Ordering::Relaxed),
                        Err(e) => panic!("usage: {e}"),
                    };
                }
            })
        })
        .collect();

    let mut attacked_setup = Duration::ZERO;
    let (alone, attacked) =
        alternating_perf(&d, ("exh-va", "exh-vb", &ip(3)), 18700, &active, &mut || attacked_setup = create_and_connect(&sa, &sb));
    stop.store(true, Ordering::Relaxed);
    for t in flooders {
        t.join().unwrap();
    }
    let rss_after = rss_kib(daemon_pid);
    let x = d.vnic("exh-x");
    // The median of the ratios of adjacent phases, alone then attacked: the machine's speed
    // drifts and jumps between two modes (14 and 10 GB/s here), and the medians of the two
    // lists compared phases of different modes (0.85 in a CI run whose three pairs were
    // 0.85, 0.99 and 0.98).
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let ratios: Vec<f64> = alone.iter().zip(&attacked).map(|(a, b)| b / a).collect();
    let ratio = median(&ratios);
    eprintln!(
        "flood: {} sessions (then errno {sessions_errno:?}), {} QPs at the largest ring (then {qps_errno:?}), {} MRs (then \
         {mrs_errno:?}); control requests served {} refused {}; exh-x counters {}; victims: set-up alone {alone_setup:?} \
         attacked {attacked_setup:?}; write_bw 1 MiB alone {alone:?} MB/s, attacked {attacked:?} MB/s (median ratio {:.2}); \
         vrdmad RSS {} -> {} MiB",
        held.len(),
        qps.len(),
        mrs.len(),
        served.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        x["counters"],
        ratio,
        rss_before >> 10,
        rss_after >> 10,
    );
    assert_eq!((held.len(), sessions_errno), (MAX_SESSIONS as usize, Some(libc::EMFILE)), "sessions");
    assert_eq!(qps_errno, Some(libc::ENOMEM), "QPs at the largest ring size");
    assert_eq!((mrs.len(), mrs_errno), (MAX_MR as usize, Some(libc::ENOMEM)), "MRs");
    assert!(refused.load(Ordering::Relaxed) > 0, "control requests beyond max_pending refused with EAGAIN");
    let counted = x["counters"]["refused_by_limits"].as_u64().unwrap_or(0);
    assert!(counted >= 3 + refused.load(Ordering::Relaxed), "refusals counted in vnic list: {counted}");
    assert!(attacked_setup < Duration::from_secs(1), "set-up under attack took {attacked_setup:?}");
    assert!(ratio >= 0.9, "write_bw under attack {attacked:?}, alone {alone:?}");
    // vrdmad's own memory: what the limits let one vNIC make it hold (its queue memory,
    // which the client may touch and vrdmad maps) plus a margin for its threads.
    let bound_kib = (MAX_RING_BYTES >> 10) + (64 << 10);
    assert!(rss_after.saturating_sub(rss_before) <= bound_kib, "vrdmad's RSS grew {} KiB", rss_after.saturating_sub(rss_before));
    drop((mrs, qps, held));
}
