//! The QP's own rules, against an in-process vrdmad: transitions and attribute masks (EINVAL
//! like hardware), what a post checks before it takes a WR, local key errors, and the retry
//! queue's order.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_abi::control::QpCaps;
use vrdma_abi::ring::Sge;
use vrdma_abi::verbs::{access, qp_attr, send_flags, QpState, WcOpcode, WcStatus, WrOpcode};
use vrdma_core::qp_state::QpType;

use super::connect::{INIT_MASK, RTR_MASK, RTS_MASK};
use super::{Qp, QpAttr, QpInitAttr, RecvWr, SendWr, UdDest};
use crate::{Context, Cq, Error, MrBuf, Pd, Wc};

const ALL: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;
const CAPS: QpCaps = QpCaps { max_send_wr: 4, max_recv_wr: 8, max_send_sge: 2, max_recv_sge: 2, max_inline_data: 16 };

/// vrdmad in this process, with a run directory of its own (removed on drop).
struct Vrdmad {
    daemon: Arc<vrdmad::Daemon>,
    dir: PathBuf,
}

impl Vrdmad {
    /// `mediated`: every RC QP goes through vrdmad's engine instead of the direct path.
    fn start(tag: &str, mediated: bool) -> Vrdmad {
        let dir = std::env::temp_dir().join(format!("vrdma-qp-unit-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = vrdmad::Config {
            run_dir: dir.join("run"),
            state_dir: dir.join("state"),
            force_mediated: mediated,
            peer_timeout: Duration::from_secs(2),
            ..Default::default()
        };
        Vrdmad { daemon: vrdmad::Daemon::start(cfg).expect("vrdmad starts"), dir }
    }

    /// A QP of `qp_type` on a new vNIC `name`, with its own CQ and a registered page.
    fn end(&self, name: &str, qp_type: QpType) -> End {
        self.daemon.create_vnic(name, "t", None, None).expect("vnic");
        let ctx = Context::open(&self.daemon.vnic_dir(name).join("control.sock")).expect("open");
        let pd = ctx.alloc_pd().expect("pd");
        let cq = ctx.create_cq(64, None).expect("cq");
        let qp = pd.create_qp(&QpInitAttr { qp_type, ..QpInitAttr::rc(&cq, &cq, CAPS) }).expect("qp");
        let buf = MrBuf::new(&pd, 4096, ALL).expect("mr");
        End { qp, buf, cq, pd, ctx }
    }
}

impl Drop for Vrdmad {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

struct End {
    qp: Qp,
    buf: MrBuf,
    cq: Cq,
    pd: Pd,
    ctx: Context,
}

impl End {
    fn gid(&self) -> [u8; 16] {
        self.ctx.gids()[0]
    }

    /// INIT → RTR attributes towards `peer`.
    fn rtr_to(&self, peer: &End) -> QpAttr {
        let dgid = peer.gid();
        let dest_qp_num = peer.qp.qp_num();
        QpAttr { qp_state: QpState::Rtr as u32, path_mtu: 5, dest_qp_num, is_global: true, dgid, min_rnr_timer: 1, ..Default::default() }
    }

    /// RESET → RTS towards `peer` with the given retry attributes.
    fn connect(&self, peer: &End, timeout: u8, retry_cnt: u8) {
        self.qp.init_rc(ALL).unwrap();
        self.qp.modify(&self.rtr_to(peer), RTR_MASK).unwrap();
        self.qp.modify(&rts(timeout, retry_cnt), RTS_MASK).unwrap();
    }

    fn write(&self, wr_id: u64, peer: &End, off: u64, sge: &[Sge]) -> Result<(), Error> {
        let wr = SendWr::new(wr_id, WrOpcode::RdmaWrite, sge, send_flags::SIGNALED);
        self.qp.post_send(&SendWr { remote_addr: peer.buf.addr() + off, rkey: peer.buf.mr().rkey(), ..wr })
    }

    fn send(&self, wr_id: u64, sge: &[Sge]) -> Result<(), Error> {
        self.qp.post_send(&SendWr::new(wr_id, WrOpcode::Send, sge, send_flags::SIGNALED))
    }

    fn recv(&self, wr_id: u64) {
        self.qp.post_recv(&RecvWr { wr_id, sg_list: &[self.buf.sge(2048, 1024)] }).unwrap();
    }

    /// The wr_ids of the WRs waiting in the retry queue, oldest first.
    fn kept(&self) -> Vec<u64> {
        self.qp.inner.m.lock().pending.iter().map(|p| p.wr_id).collect()
    }

    fn bytes(&self, off: usize, n: usize) -> Vec<u8> {
        let mut v = vec![0; n];
        self.buf.read(off, &mut v);
        v
    }
}

fn rts(timeout: u8, retry_cnt: u8) -> QpAttr {
    QpAttr { qp_state: QpState::Rts as u32, timeout, retry_cnt, rnr_retry: 7, ..Default::default() }
}

fn to_state(s: QpState) -> QpAttr {
    QpAttr { qp_state: s as u32, ..Default::default() }
}

fn einval(r: Result<(), Error>) {
    assert_eq!(r.expect_err("refused").errno(), libc::EINVAL);
}

/// Polls until `n` completions arrived (10 s at most).
fn poll(cq: &Cq, n: usize) -> Vec<Wc> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    let mut wc = [Wc::EMPTY; 8];
    while got.len() < n {
        assert!(Instant::now() < deadline, "{} of {n} completions within 10 s: {got:?}", got.len());
        let k = cq.poll(&mut wc);
        got.extend_from_slice(&wc[..k]);
        std::thread::yield_now();
    }
    got
}

/// Polls for `d` (which runs the retry queue), expecting nothing.
fn poll_none(cq: &Cq, d: Duration) {
    let until = Instant::now() + d;
    let mut wc = [Wc::EMPTY];
    while Instant::now() < until {
        assert_eq!(cq.poll(&mut wc), 0, "unexpected completion {:?}", wc[0]);
        std::thread::yield_now();
    }
}

fn ids(wcs: &[Wc]) -> Vec<(u64, WcStatus)> {
    wcs.iter().map(|w| (w.wr_id, w.status)).collect()
}

#[test]
fn transitions_and_their_masks_are_checked_like_hardware() {
    let d = Vrdmad::start("transitions", false);
    let a = d.end("a", QpType::Rc);
    let init = QpAttr { qp_state: QpState::Init as u32, port_num: 1, qp_access_flags: ALL, ..Default::default() };
    einval(a.qp.modify(&QpAttr { qp_state: QpState::Rtr as u32, ..init }, RTR_MASK)); // skips INIT
    einval(a.qp.modify(&init, qp_attr::STATE | qp_attr::PORT)); // required attributes missing
    einval(a.qp.modify(&init, INIT_MASK | qp_attr::QKEY)); // one RC does not take
    einval(a.qp.modify(&QpAttr { cur_qp_state: QpState::Init as u32, ..init }, INIT_MASK | qp_attr::CUR_STATE));
    einval(a.qp.modify(&QpAttr { qp_state: 99, ..init }, INIT_MASK));
    assert_eq!(a.qp.state(), QpState::Reset, "a refused modify changes nothing");
    a.qp.modify(&init, INIT_MASK).unwrap();
    a.qp.modify(&init, INIT_MASK).unwrap(); // INIT → INIT
    einval(a.qp.modify(&rts(14, 7), RTS_MASK)); // INIT → RTS
    a.qp.modify(&to_state(QpState::Err), qp_attr::STATE).unwrap();
    assert_eq!(a.qp.state(), QpState::Err);
    einval(a.qp.modify(&init, INIT_MASK)); // ERR leads only to RESET
    a.qp.modify(&to_state(QpState::Reset), qp_attr::STATE).unwrap();
    a.qp.modify(&init, INIT_MASK).unwrap();
    assert_eq!(a.qp.state(), QpState::Init);
    // A UD QP's INIT takes a Q_Key instead of access flags; connect_rc is for RC QPs.
    let u = d.end("u", QpType::Ud);
    einval(u.qp.modify(&init, INIT_MASK));
    einval(u.qp.connect_rc(a.gid(), a.qp.qp_num(), ALL));
    u.qp.modify(&QpAttr { qkey: 0x1111, ..init }, qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::QKEY).unwrap();
    assert_eq!(u.qp.query().qkey, 0x1111);
}

#[test]
fn out_of_range_attributes_are_einval_and_only_masked_attributes_apply() {
    let d = Vrdmad::start("ranges", false);
    let (a, b) = (d.end("a", QpType::Rc), d.end("b", QpType::Rc));
    einval(a.qp.modify(&QpAttr { qp_state: QpState::Init as u32, port_num: 2, ..Default::default() }, INIT_MASK));
    // INIT's mask names neither the timeout nor the MTU: they stay as created.
    let init = QpAttr { qp_state: QpState::Init as u32, port_num: 1, qp_access_flags: ALL, timeout: 3, path_mtu: 1, ..Default::default() };
    a.qp.modify(&init, INIT_MASK).unwrap();
    let q = a.qp.query();
    assert_eq!((q.qp_state, q.qp_access_flags, q.port_num), (QpState::Init as u32, ALL, 1));
    assert_eq!((q.timeout, q.path_mtu, q.min_rnr_timer), (14, 0, 12));
    assert_eq!(q.cap.max_send_sge, CAPS.max_send_sge);
    let good = a.rtr_to(&b);
    let gids = a.ctx.gids().len() as u8;
    for bad in [
        QpAttr { path_mtu: 0, ..good },
        QpAttr { path_mtu: 6, ..good },
        QpAttr { min_rnr_timer: 32, ..good },
        QpAttr { max_dest_rd_atomic: 17, ..good },
        QpAttr { is_global: false, ..good },
        QpAttr { sgid_index: gids, ..good },
    ] {
        einval(a.qp.modify(&bad, RTR_MASK));
    }
    assert_eq!(a.qp.state(), QpState::Init);
    a.qp.modify(&good, RTR_MASK).unwrap();
    let good = QpAttr { timeout: 31, retry_cnt: 7, rnr_retry: 7, max_rd_atomic: 16, ..rts(0, 0) };
    for bad in [
        QpAttr { timeout: 32, ..good },
        QpAttr { retry_cnt: 8, ..good },
        QpAttr { rnr_retry: 8, ..good },
        QpAttr { max_rd_atomic: 17, ..good },
    ] {
        einval(a.qp.modify(&bad, RTS_MASK));
    }
    assert_eq!(a.qp.state(), QpState::Rtr);
    a.qp.modify(&good, RTS_MASK).unwrap();
    let q = a.qp.query();
    assert_eq!((q.qp_state, q.path_mtu, q.dest_qp_num, q.dgid), (QpState::Rts as u32, 5, b.qp.qp_num(), b.gid()));
    assert_eq!((q.timeout, q.retry_cnt, q.rnr_retry, q.max_rd_atomic, q.min_rnr_timer), (31, 7, 7, 16, 1));
}

#[test]
fn posts_are_refused_before_rts_and_flushed_in_err() {
    let d = Vrdmad::start("post-states", false);
    let (a, b) = (d.end("a", QpType::Rc), d.end("b", QpType::Rc));
    let sge = [a.buf.sge(0, 8)];
    einval(a.qp.post_recv(&RecvWr { wr_id: 1, sg_list: &sge })); // RESET
    for step in [0, 1, 2] {
        match step {
            1 => a.qp.init_rc(ALL).unwrap(),
            2 => a.qp.modify(&a.rtr_to(&b), RTR_MASK).unwrap(),
            _ => {}
        }
        einval(a.send(1, &sge));
        einval(a.qp.check_send(&SendWr::new(1, WrOpcode::Send, &sge, 0)));
    }
    a.qp.modify(&rts(14, 7), RTS_MASK).unwrap();
    a.qp.modify(&to_state(QpState::Err), qp_attr::STATE).unwrap();
    // In ERR a post is taken and completes at once with WR_FLUSH_ERR (receives too).
    a.qp.check_send(&SendWr::new(2, WrOpcode::Send, &sge, 0)).unwrap();
    a.write(2, &b, 0, &sge).unwrap();
    a.qp.post_recv(&RecvWr { wr_id: 3, sg_list: &sge }).unwrap();
    let wcs = poll(&a.cq, 2);
    assert_eq!(ids(&wcs), [(2, WcStatus::WrFlushErr), (3, WcStatus::WrFlushErr)]);
    assert_eq!((wcs[0].opcode, wcs[1].opcode), (WcOpcode::RdmaWrite, WcOpcode::Recv));
}

#[test]
fn work_requests_beyond_the_capabilities_are_einval_and_have_no_effect() {
    // The checks come before the data path is chosen: the same on both.
    for mediated in [false, true] {
        let d = Vrdmad::start(if mediated { "caps-mediated" } else { "caps-direct" }, mediated);
        let (a, b) = (d.end("a", QpType::Rc), d.end("b", QpType::Rc));
        a.connect(&b, 14, 7);
        b.connect(&a, 14, 7);
        assert_eq!(a.qp.is_mediated(), mediated);
        let three = [a.buf.sge(0, 1), a.buf.sge(1, 1), a.buf.sge(2, 1)];
        einval(a.write(1, &b, 0, &three));
        einval(a.qp.check_send(&SendWr::new(1, WrOpcode::RdmaWrite, &three, 0)));
        einval(b.qp.post_recv(&RecvWr { wr_id: 1, sg_list: &three }));
        a.buf.write(0, b"0123456789abcdefg");
        let inline = |n: u32| [Sge { addr: a.buf.as_ptr() as u64, length: n, lkey: 0 }];
        let (too_long, fits) = (inline(17), inline(16));
        let wr = |sge| SendWr {
            remote_addr: b.buf.addr(),
            rkey: b.buf.mr().rkey(),
            ..SendWr::new(2, WrOpcode::RdmaWrite, sge, send_flags::INLINE | send_flags::SIGNALED)
        };
        einval(a.qp.post_send(&wr(&too_long)));
        einval(a.qp.check_send(&wr(&too_long)));
        a.qp.check_send(&wr(&fits)).unwrap();
        a.qp.post_send(&wr(&fits)).unwrap();
        assert_eq!(ids(&poll(&a.cq, 1)), [(2, WcStatus::Success)], "only the WR that fits was taken");
        assert_eq!(b.bytes(0, 17), b"0123456789abcdef\0");
        poll_none(&a.cq, Duration::from_millis(20));
    }
}

#[test]
fn ud_and_rc_posts_do_not_mix() {
    let d = Vrdmad::start("ud-rc", false);
    let (r, peer, u) = (d.end("r", QpType::Rc), d.end("peer", QpType::Rc), d.end("u", QpType::Ud));
    r.connect(&peer, 14, 7);
    let init = QpAttr { qp_state: QpState::Init as u32, port_num: 1, qkey: 7, ..Default::default() };
    u.qp.modify(&init, qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::QKEY).unwrap();
    u.qp.modify(&to_state(QpState::Rtr), qp_attr::STATE).unwrap();
    u.qp.modify(&to_state(QpState::Rts), qp_attr::STATE | qp_attr::SQ_PSN).unwrap();
    let sge = [u.buf.sge(0, 8)];
    let dest = UdDest { dgid: u.gid(), qpn: u.qp.qp_num(), qkey: 7 };
    einval(r.qp.post_send_ud(&SendWr::new(1, WrOpcode::Send, &sge, 0), &dest));
    einval(u.qp.post_send(&SendWr::new(1, WrOpcode::Send, &sge, 0)));
    let write = SendWr::new(1, WrOpcode::RdmaWrite, &sge, 0);
    einval(u.qp.post_send_ud(&write, &dest));
    einval(u.qp.check_send(&write));
    // A datagram longer than the MTU completes with LOC_LEN_ERR (and the QP goes to ERR).
    let big = MrBuf::new(&u.pd, 8192, ALL).unwrap();
    u.qp.post_send_ud(&SendWr::new(2, WrOpcode::Send, &[big.sge(0, 4097)], send_flags::SIGNALED), &dest).unwrap();
    assert_eq!(ids(&poll(&u.cq, 1)), [(2, WcStatus::LocLenErr)]);
    assert_eq!(u.qp.state(), QpState::Err);
}

#[test]
fn bad_local_keys_complete_with_loc_prot_err_even_after_a_cached_use() {
    let d = Vrdmad::start("lkeys", false);
    let ends: Vec<End> = ["a", "b", "c", "d", "e", "f"].iter().map(|n| d.end(n, QpType::Rc)).collect();
    for pair in ends.chunks(2) {
        pair[0].connect(&pair[1], 14, 7);
        pair[1].connect(&pair[0], 14, 7);
    }
    let (a, b) = (&ends[0], &ends[1]);
    // One element (the WRITE fast path).
    let bad = Sge { lkey: a.buf.mr().lkey() ^ 0x100, ..a.buf.sge(0, 8) };
    a.write(1, b, 0, &[bad]).unwrap();
    assert_eq!(ids(&poll(&a.cq, 1)), [(1, WcStatus::LocProtErr)]);
    assert_eq!(a.qp.state(), QpState::Err);
    // The second element of a gather list (the general path).
    let (c, e) = (&ends[2], &ends[3]);
    e.recv(1);
    let bad = Sge { lkey: c.buf.mr().lkey() ^ 0x100, ..c.buf.sge(8, 8) };
    c.send(2, &[c.buf.sge(0, 8), bad]).unwrap();
    assert_eq!(ids(&poll(&c.cq, 1)), [(2, WcStatus::LocProtErr)]);
    // A key used a moment ago, deregistered since: the QP's cache of the last MR does not
    // outlive it.
    let (f, g) = (&ends[4], &ends[5]);
    let gone = MrBuf::new(&f.pd, 4096, ALL).unwrap();
    let sge = [gone.sge(0, 8)];
    f.write(3, g, 0, &sge).unwrap();
    drop(gone);
    f.write(4, g, 0, &sge).unwrap();
    assert_eq!(ids(&poll(&f.cq, 2)), [(3, WcStatus::Success), (4, WcStatus::LocProtErr)]);
}

#[test]
fn kept_work_requests_run_in_post_order_once_the_responder_is_ready() {
    let d = Vrdmad::start("not-ready", false);
    let (a, b) = (d.end("a", QpType::Rc), d.end("b", QpType::Rc));
    a.connect(&b, 14, 7);
    b.qp.init_rc(ALL).unwrap();
    b.recv(10);
    a.buf.write(0, b"first");
    a.buf.write(8, b"LATER");
    a.write(1, &b, 100, &[a.buf.sge(0, 5)]).unwrap();
    a.send(2, &[a.buf.sge(0, 5)]).unwrap();
    a.write(3, &b, 100, &[a.buf.sge(8, 5)]).unwrap();
    assert_eq!(a.kept(), [1, 2, 3], "the responder is in INIT");
    poll_none(&a.cq, Duration::from_millis(20));
    assert_eq!(b.bytes(100, 5), [0; 5]);
    b.qp.modify(&b.rtr_to(&a), RTR_MASK).unwrap();
    assert_eq!(ids(&poll(&a.cq, 3)), [(1, WcStatus::Success), (2, WcStatus::Success), (3, WcStatus::Success)]);
    assert!(a.kept().is_empty());
    assert_eq!(b.bytes(100, 5), b"LATER", "the second WRITE landed last");
    assert_eq!(ids(&poll(&b.cq, 1)), [(10, WcStatus::Success)]);
}

#[test]
fn a_send_waiting_for_a_receive_holds_back_the_work_requests_behind_it() {
    let d = Vrdmad::start("rnr", false);
    let (a, b) = (d.end("a", QpType::Rc), d.end("b", QpType::Rc));
    a.connect(&b, 14, 7);
    b.connect(&a, 14, 7);
    a.buf.write(0, b"late!");
    a.send(1, &[a.buf.sge(0, 5)]).unwrap();
    a.write(2, &b, 100, &[a.buf.sge(0, 5)]).unwrap();
    a.send(3, &[a.buf.sge(0, 5)]).unwrap();
    assert_eq!(a.kept(), [1, 2, 3], "b has no receive posted");
    poll_none(&a.cq, Duration::from_millis(20));
    assert_eq!(b.bytes(100, 5), [0; 5], "a WRITE does not overtake the SEND before it");
    b.recv(11);
    b.recv(12);
    assert_eq!(ids(&poll(&a.cq, 3)), [(1, WcStatus::Success), (2, WcStatus::Success), (3, WcStatus::Success)]);
    assert_eq!(b.bytes(100, 5), b"late!");
    assert_eq!(ids(&poll(&b.cq, 2)), [(11, WcStatus::Success), (12, WcStatus::Success)]);
}

#[test]
fn the_retry_queue_holds_max_send_wr_and_flushes_in_order_on_err() {
    let d = Vrdmad::start("queue", false);
    let (a, b) = (d.end("a", QpType::Rc), d.end("b", QpType::Rc));
    a.connect(&b, 14, 7);
    let sge = [a.buf.sge(0, 8)];
    for i in 1..=u64::from(CAPS.max_send_wr) {
        a.write(i, &b, 0, &sge).unwrap();
    }
    assert_eq!(a.write(5, &b, 0, &sge).expect_err("queue full").errno(), libc::ENOMEM);
    assert_eq!(a.kept(), [1, 2, 3, 4]);
    a.qp.modify(&to_state(QpState::Err), qp_attr::STATE).unwrap();
    let flushed = (1..=4).map(|i| (i, WcStatus::WrFlushErr)).collect::<Vec<_>>();
    assert_eq!(ids(&poll(&a.cq, 4)), flushed);
    assert!(a.kept().is_empty());
}

#[test]
fn a_responder_that_never_gets_ready_fails_the_request_once_retries_are_spent() {
    let d = Vrdmad::start("retry-exc", false);
    let (a, b) = (d.end("a", QpType::Rc), d.end("b", QpType::Rc));
    // Timeout 1 with no retries: about 8 µs.
    a.connect(&b, 1, 0);
    let sge = [a.buf.sge(0, 8)];
    a.send(1, &sge).unwrap();
    a.write(2, &b, 0, &sge).unwrap();
    assert_eq!(ids(&poll(&a.cq, 2)), [(1, WcStatus::RetryExcErr), (2, WcStatus::WrFlushErr)]);
    assert_eq!(a.qp.state(), QpState::Err);
}

#[test]
fn connect_rc_from_init_keeps_the_receives_posted_there() {
    let d = Vrdmad::start("connect-rc", false);
    let (a, b) = (d.end("a", QpType::Rc), d.end("b", QpType::Rc));
    b.qp.init_rc(access::REMOTE_WRITE).unwrap();
    b.recv(7);
    b.qp.connect_rc(a.gid(), a.qp.qp_num(), access::REMOTE_WRITE).unwrap();
    a.qp.connect_rc(b.gid(), b.qp.qp_num(), access::REMOTE_WRITE).unwrap();
    let q = b.qp.query();
    assert_eq!((q.qp_state, q.qp_access_flags, q.dest_qp_num, q.path_mtu), (QpState::Rts as u32, access::REMOTE_WRITE, a.qp.qp_num(), 5));
    assert_eq!((q.timeout, q.retry_cnt, q.rnr_retry), (14, 7, 7));
    a.send(1, &[a.buf.sge(0, 8)]).unwrap();
    assert_eq!(ids(&poll(&a.cq, 1)), [(1, WcStatus::Success)]);
    assert_eq!(ids(&poll(&b.cq, 1)), [(7, WcStatus::Success)]);
}

#[test]
fn a_receive_too_small_or_not_the_responders_fails_both_sides() {
    let d = Vrdmad::start("bad-receive", false);
    // One gather element (the SEND fast path) and two (the general path).
    for (i, gather) in [1u32, 2].into_iter().enumerate() {
        let (a, b) = (d.end(&format!("a{i}"), QpType::Rc), d.end(&format!("b{i}"), QpType::Rc));
        let (c, e) = (d.end(&format!("c{i}"), QpType::Rc), d.end(&format!("e{i}"), QpType::Rc));
        for (x, y) in [(&a, &b), (&c, &e)] {
            x.connect(y, 14, 7);
            y.connect(x, 14, 7);
        }
        let sges: Vec<Sge> = (0..gather).map(|k| a.buf.sge(k as usize * 64, 8 / gather)).collect();
        b.qp.post_recv(&RecvWr { wr_id: 1, sg_list: &[b.buf.sge(0, 4)] }).unwrap();
        a.send(2, &sges).unwrap();
        assert_eq!(ids(&poll(&a.cq, 1)), [(2, WcStatus::RemInvReqErr)], "{gather} elements");
        assert_eq!(ids(&poll(&b.cq, 1)), [(1, WcStatus::LocLenErr)], "{gather} elements");
        let bad = Sge { lkey: e.buf.mr().lkey() ^ 0x100, ..e.buf.sge(0, 64) };
        e.qp.post_recv(&RecvWr { wr_id: 3, sg_list: &[bad] }).unwrap();
        let sges: Vec<Sge> = (0..gather).map(|k| c.buf.sge(k as usize * 64, 8 / gather)).collect();
        c.send(4, &sges).unwrap();
        // The requester cannot check the responder's key (it is never handed a receive
        // buffer, only its staging ring): its SEND completes, the responder's receive fails
        // when it scatters the payload, and the requester's QP then fails, as after a NAK.
        assert_eq!(ids(&poll(&c.cq, 1)), [(4, WcStatus::Success)], "{gather} elements");
        assert_eq!(ids(&poll(&e.cq, 1)), [(3, WcStatus::LocProtErr)], "{gather} elements");
        assert_eq!(c.qp.state(), QpState::Err, "{gather} elements");
    }
}

/// A hostile peer rewrites a posted receive in the responder's receive ring (shared memory
/// it maps): another of the responder's local-only MRs as its buffer, or a name the
/// application never gave. Its SEND must land in no memory but a receive buffer the
/// responder posted, and complete no receive under a forged name: the receive fails with
/// LOC_PROT_ERR under the name it was posted with, and the target keeps its bytes.
fn forged_receive(d: &Vrdmad, tag: &str, use_srq: bool, forge_buffer: bool) {
    let a = d.end(&format!("{tag}a"), QpType::Rc);
    let mut b = d.end(&format!("{tag}b"), QpType::Rc);
    let srq = b.pd.create_srq(8, 2).unwrap();
    if use_srq {
        b.qp = b.pd.create_qp(&QpInitAttr { srq: Some(&srq), ..QpInitAttr::rc(&b.cq, &b.cq, CAPS) }).unwrap();
    }
    a.connect(&b, 14, 7);
    b.connect(&a, 14, 7);
    // Local-only MRs: SENDs into them are staged (the requester never maps them).
    let inbox = MrBuf::new(&b.pd, 4096, access::LOCAL_WRITE).unwrap();
    let secret = MrBuf::new(&b.pd, 4096, access::LOCAL_WRITE).unwrap();
    secret.write(0, &[0x5a; 64]);
    let posted = RecvWr { wr_id: 1, sg_list: &[inbox.sge(0, 64)] };
    let ring = if use_srq {
        srq.post_recv(&posted).unwrap();
        srq.inner.ring
    } else {
        b.qp.post_recv(&posted).unwrap();
        b.qp.inner.rq.expect("own receive queue")
    };
    // The peer's rewrite of the slot: it now names `secret`, or receive 0xdead.
    assert!(matches!(ring.take(), Ok(vrdma_abi::ring::Take::Entry(_))));
    let (wr_id, sge) = if forge_buffer { (1, secret.sge(0, 64)) } else { (0xdead, inbox.sge(0, 64)) };
    assert!(ring.push_flagged(wr_id, &[sge], 0).unwrap());
    a.buf.write(0, &[0xa5; 64]);
    a.send(2, &[a.buf.sge(0, 64)]).unwrap();
    assert_eq!(ids(&poll(&a.cq, 1)), [(2, WcStatus::Success)]);
    assert_eq!(ids(&poll(&b.cq, 1)), [(1, WcStatus::LocProtErr)], "{tag}");
    let mut got = [0u8; 64];
    secret.read(0, &mut got);
    assert_eq!(got, [0x5a; 64], "{tag}: the local-only MR the peer named was written");
    assert_eq!(b.qp.state(), QpState::Err, "{tag}");
}

#[test]
fn a_peer_that_rewrites_a_posted_receive_gets_nothing_written() {
    let d = Vrdmad::start("forged-receive", false);
    forged_receive(&d, "rqbuf", false, true);
    forged_receive(&d, "rqname", false, false);
    forged_receive(&d, "srqbuf", true, true);
    forged_receive(&d, "srqname", true, false);
}
