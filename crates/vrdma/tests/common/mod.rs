//! In-process vrdmad with a private run directory, and connected QP pairs.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use vrdma::*;

/// The data path a test's QPs take: every case of the verbs suite runs on each (see
/// [`each_path`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// The direct shared-memory path between QPs of one host.
    Direct,
    /// vrdmad's mediated engine (what cross-host QPs use), forced on one host, without
    /// lanes (`vrdmad --no-engine-lanes`).
    Mediated,
    /// The mediated engine with lanes (the default: the library sends small requests itself).
    MediatedLanes,
}

impl Mode {
    /// Whether QPs go through the mediated engine.
    pub(crate) fn mediated(self) -> bool {
        self != Mode::Direct
    }

    /// Whether vrdmad gives mediated RC QPs lanes (on the direct path it has them on, as
    /// by default, but nothing uses them).
    pub(crate) fn lanes(self) -> bool {
        self != Mode::Mediated
    }

    /// The same path with lanes on.
    pub(crate) fn with_lanes(self) -> Mode {
        match self {
            Mode::Direct => Mode::Direct,
            Mode::Mediated | Mode::MediatedLanes => Mode::MediatedLanes,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::Mediated => "mediated",
            Mode::MediatedLanes => "lanes",
        }
    }
}

/// `each_path!(case);` before `fn case(mode: Mode)`: the case as three tests, `case::direct`,
/// `case::mediated` and `case::mediated_lanes`, so that both data paths (and the engine with
/// and without lanes) meet the same semantics.
#[macro_export]
macro_rules! each_path {
    ($case:ident) => {
        mod $case {
            use super::Mode;

            #[test]
            fn direct() {
                super::$case(Mode::Direct)
            }

            #[test]
            fn mediated() {
                super::$case(Mode::Mediated)
            }

            #[test]
            fn mediated_lanes() {
                super::$case(Mode::MediatedLanes)
            }
        }
    };
}

pub(crate) struct Host {
    pub daemon: Arc<vrdmad::Daemon>,
    pub dir: PathBuf,
    pub mode: Mode,
}

impl Host {
    /// An in-process vrdmad whose QPs take `mode`'s data path.
    pub(crate) fn new(mode: Mode, tag: &str) -> Host {
        // The three variants of a case run side by side in one process: a directory each.
        static HOSTS: AtomicUsize = AtomicUsize::new(0);
        let n = HOSTS.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("vrdma-test-{tag}-{}-{}-{n}", mode.name(), std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = vrdmad::Config {
            run_dir: dir.join("run"),
            state_dir: dir.join("state"),
            force_mediated: mode.mediated(),
            engine_lanes: mode.lanes(),
            peer_timeout: std::time::Duration::from_secs(2),
            ..Default::default()
        };
        let daemon = vrdmad::Daemon::start(cfg).expect("daemon starts");
        Host { daemon, dir, mode }
    }

    pub(crate) fn vnic(&self, name: &str, tenant: &str) -> PathBuf {
        self.daemon.create_vnic(name, tenant, None, None).expect("vnic");
        self.daemon.vnic_dir(name).join("control.sock")
    }

    pub(crate) fn vnic_limits(&self, name: &str, tenant: &str, l: Limits) -> PathBuf {
        self.daemon.create_vnic(name, tenant, None, Some(l)).expect("vnic");
        self.daemon.vnic_dir(name).join("control.sock")
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) struct End {
    pub ctx: Context,
    pub pd: Pd,
    pub cq: Cq,
    pub qp: Qp,
    pub buf: MrBuf,
}

pub(crate) const BUF: usize = 1 << 16;
pub(crate) const ALL: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

pub(crate) fn end(sock: &std::path::Path, access_flags: u32, channel: bool) -> End {
    let ctx = Context::open(sock).expect("open");
    let pd = ctx.alloc_pd().expect("pd");
    let ch = if channel { Some(ctx.create_comp_channel().unwrap()) } else { None };
    let cq = ctx.create_cq(256, ch.as_ref()).expect("cq");
    let qp = pd
        .create_qp(&QpInitAttr::rc(
            &cq,
            &cq,
            QpCaps { max_send_wr: 128, max_recv_wr: 128, max_send_sge: 4, max_recv_sge: 4, max_inline_data: 256 },
        ))
        .expect("qp");
    let buf = MrBuf::new(&pd, BUF, access_flags).expect("mr");
    End { ctx, pd, cq, qp, buf }
}

pub(crate) fn to_init(qp: &Qp) {
    qp.init_rc(ALL).unwrap();
}

pub(crate) fn rtr_attr(dgid: [u8; 16], dqpn: u32) -> QpAttr {
    QpAttr {
        qp_state: QpState::Rtr as u32,
        path_mtu: 5,
        dest_qp_num: dqpn,
        is_global: true,
        dgid,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 1,
        ..Default::default()
    }
}

pub(crate) const RTR_MASK: u32 = qp_attr::STATE
    | qp_attr::AV
    | qp_attr::PATH_MTU
    | qp_attr::DEST_QPN
    | qp_attr::RQ_PSN
    | qp_attr::MAX_DEST_RD_ATOMIC
    | qp_attr::MIN_RNR_TIMER;
pub(crate) const RTS_MASK: u32 =
    qp_attr::STATE | qp_attr::SQ_PSN | qp_attr::TIMEOUT | qp_attr::RETRY_CNT | qp_attr::RNR_RETRY | qp_attr::MAX_QP_RD_ATOMIC;

/// `rnr_retry` of [`Qp::connect_rc`]: infinite.
const RNR_RETRY_INFINITE: u8 = 7;

/// Connects `e` to the QP `peer_qpn` at `peer_gid` with [`Qp::connect_rc`]; a finite
/// `rnr_retry` (the test of RNR retries running out) needs its own RTS step, as `connect_rc`
/// always retries forever and RTS → RTS cannot change it.
/// An RC QP of `ctx`'s `pd` that takes its receives from `srq` (receive lists of
/// `max_recv_sge` elements), connected with a fresh end on `peer_sock`: that end in RTS,
/// the QP in RTR.
pub(crate) fn srq_qp_facing(peer_sock: &std::path::Path, ctx: &Context, pd: &Pd, cq: &Cq, srq: &Srq, max_recv_sge: u32) -> (End, Qp) {
    let caps = QpCaps { max_send_wr: 4, max_recv_wr: 0, max_send_sge: 1, max_recv_sge, max_inline_data: 0 };
    let mut init = QpInitAttr::rc(cq, cq, caps);
    init.srq = Some(srq);
    let q = pd.create_qp(&init).unwrap();
    let s = end(peer_sock, ALL, false);
    connect_with(&s, ctx.gids()[0], q.qp_num(), 7).unwrap();
    to_init(&q);
    q.modify(&rtr_attr(s.ctx.gids()[0], s.qp.qp_num()), RTR_MASK).unwrap();
    (s, q)
}

pub(crate) fn connect_with(e: &End, peer_gid: [u8; 16], peer_qpn: u32, rnr_retry: u8) -> Result<(), Error> {
    if rnr_retry == RNR_RETRY_INFINITE {
        return e.qp.connect_rc(peer_gid, peer_qpn, ALL);
    }
    e.qp.init_rc(ALL)?;
    e.qp.modify(&rtr_attr(peer_gid, peer_qpn), RTR_MASK)?;
    let a = QpAttr { qp_state: QpState::Rts as u32, timeout: 10, retry_cnt: 2, rnr_retry, max_rd_atomic: 1, ..Default::default() };
    e.qp.modify(&a, RTS_MASK)
}

impl Host {
    /// Two connected RC ends on the vNICs of `sa` and `sb`, on this host's data path.
    pub(crate) fn pair(&self, sa: &std::path::Path, sb: &std::path::Path, access_flags: u32) -> (End, End) {
        let a = end(sa, access_flags, false);
        let b = end(sb, access_flags, false);
        connect_with(&a, b.ctx.gids()[0], b.qp.qp_num(), 7).unwrap();
        connect_with(&b, a.ctx.gids()[0], a.qp.qp_num(), 7).unwrap();
        let mediated = self.mode.mediated();
        assert_eq!(a.qp.is_mediated(), mediated, "data path");
        assert_eq!(b.qp.is_mediated(), mediated, "data path");
        (a, b)
    }
}

/// Polls until one completion arrives (or panics after 10 s).
pub(crate) fn wait_one(cq: &Cq) -> Wc {
    let mut wc = [Wc::EMPTY];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if cq.poll(&mut wc) == 1 {
            return wc[0];
        }
        assert!(std::time::Instant::now() < deadline, "no completion within 10 s");
        std::thread::yield_now();
    }
}

pub(crate) fn poll_none(cq: &Cq) {
    let mut wc = [Wc::EMPTY; 4];
    assert_eq!(cq.poll(&mut wc), 0, "unexpected completion {:?}", wc[0]);
}

/// CPU time (µs) of each thread of this process whose name starts with `prefix` (vrdmad runs
/// in-process here: its engine threads are "engine…"), by thread id.
pub(crate) fn engine_cpu_us(prefix: &str) -> std::collections::HashMap<String, u64> {
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let mut out = std::collections::HashMap::new();
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        if !stat[open + 1..close].starts_with(prefix) {
            continue;
        }
        // After the command: state is field 3, utime and stime fields 14 and 15.
        let f: Vec<&str> = stat[close + 2..].split(' ').collect();
        let ticks = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
        out.insert(t.file_name().to_string_lossy().into_owned(), ticks * 1_000_000 / hz);
    }
    out
}
