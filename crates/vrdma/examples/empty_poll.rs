//! The cost of an empty poll: `Cq::poll` on a CQ whose one QP is connected and idle, against
//! an in-process vrdmad (no setup needed), alternately from the CQ's first polling thread
//! (which checks the QPs' rings without the CQ's list lock) and from another thread (which
//! polls under the lock, as every poll did before). Run it with polls never yielding:
//!
//! ```sh
//! VRDMA_POLL_YIELD_AFTER=never taskset -c 1 cargo run --release -p vrdma --example empty_poll
//! ```

use std::time::{Duration, Instant};

use vrdma::*;

fn main() {
    let dir = std::env::temp_dir().join(format!("vrdma-empty-poll-{}", std::process::id()));
    let cfg = vrdmad::Config {
        run_dir: dir.join("run"),
        state_dir: dir.join("state"),
        peer_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    let daemon = vrdmad::Daemon::start(cfg).expect("vrdmad starts");
    let caps = QpCaps { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };
    let end = |name: &str| {
        daemon.create_vnic(name, "t", None, None).expect("vnic");
        let ctx = Context::open(&daemon.vnic_dir(name).join("control.sock")).expect("open");
        let pd = ctx.alloc_pd().expect("pd");
        let cq = ctx.create_cq(64, None).expect("cq");
        let qp = pd.create_qp(&QpInitAttr::rc(&cq, &cq, caps)).expect("qp");
        (ctx, pd, cq, qp)
    };
    let a = end("pa");
    let b = end("pb");
    a.3.connect_rc(b.0.gids()[0], b.3.qp_num(), access::REMOTE_WRITE).expect("connect");
    b.3.connect_rc(a.0.gids()[0], a.3.qp_num(), access::REMOTE_WRITE).expect("connect");
    let cq = &a.2;
    let per_poll = || {
        let mut wc = [Wc::EMPTY];
        let polls = 2_000_000u32;
        let t = Instant::now();
        for _ in 0..polls {
            std::hint::black_box(cq.poll(&mut wc));
        }
        t.elapsed().as_nanos() as f64 / f64::from(polls)
    };
    for round in 1..=5 {
        let owner = per_poll();
        let other = std::thread::scope(|s| s.spawn(per_poll).join().expect("poller"));
        println!("round {round}: {owner:.1} ns per empty poll without the lock, {other:.1} ns under it");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
