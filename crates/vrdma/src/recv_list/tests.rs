//! The CQ's check without the lock, against an in-process vrdmad on the direct path, where a
//! peer's `post_send` publishes the completion into the receiver's ring before it returns:
//! so a test can publish at an exact point of a poll, deterministically.

use std::cell::RefCell;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use vrdma_abi::control::QpCaps;
use vrdma_abi::verbs::{access, WcOpcode, WrOpcode};

use crate::qp::{Qp, QpInitAttr, RecvWr, SendWr};
use crate::{Context, Cq, MrBuf, Pd, Wc};

thread_local! {
    /// Run by this thread's next poll between the check and the lock (see `cq.rs`).
    static BETWEEN_CHECK_AND_LOCK: RefCell<Option<Box<dyn FnOnce()>>> = const { RefCell::new(None) };
}

/// Called by the CQ's poll after the check said "something pending", before the lock.
pub(crate) fn between_check_and_lock() {
    if let Some(f) = BETWEEN_CHECK_AND_LOCK.with(|h| h.borrow_mut().take()) {
        f();
    }
}

const CAPS: QpCaps = QpCaps { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };

struct Vrdmad {
    daemon: Arc<vrdmad::Daemon>,
    dir: PathBuf,
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

fn start(tag: &str) -> Vrdmad {
    let dir = std::env::temp_dir().join(format!("vrdma-recv-list-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = vrdmad::Config {
        run_dir: dir.join("run"),
        state_dir: dir.join("state"),
        peer_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    Vrdmad { daemon: vrdmad::Daemon::start(cfg).expect("vrdmad starts"), dir }
}

fn end(d: &Vrdmad, name: &str) -> End {
    d.daemon.create_vnic(name, "t", None, None).expect("vnic");
    let ctx = Context::open(&d.daemon.vnic_dir(name).join("control.sock")).expect("open");
    let pd = ctx.alloc_pd().expect("pd");
    let cq = ctx.create_cq(64, None).expect("cq");
    let qp = pd.create_qp(&QpInitAttr::rc(&cq, &cq, CAPS)).expect("qp");
    let buf = MrBuf::new(&pd, 4096, access::LOCAL_WRITE).expect("mr");
    End { qp, buf, cq, pd, ctx }
}

fn connect(a: &End, b: &End) {
    a.qp.connect_rc(b.ctx.gids()[0], b.qp.qp_num(), 0).unwrap();
    b.qp.connect_rc(a.ctx.gids()[0], a.qp.qp_num(), 0).unwrap();
}

impl End {
    fn recv(&self, wr_id: u64) {
        self.qp.post_recv(&RecvWr { wr_id, sg_list: &[self.buf.sge(0, 64)] }).unwrap();
    }

    /// An unsignaled SEND: the peer's receive completion is all it makes.
    fn send(&self, wr_id: u64) {
        self.qp.post_send(&SendWr::new(wr_id, WrOpcode::Send, &[self.buf.sge(64, 8)], 0)).unwrap();
    }

    fn poll_ids(&self) -> Vec<u64> {
        let mut wc = [Wc::EMPTY; 8];
        let n = self.cq.poll(&mut wc);
        assert!(wc[..n].iter().all(|w| w.opcode == WcOpcode::Recv));
        wc[..n].iter().map(|w| w.wr_id).collect()
    }
}

#[test]
fn a_completion_published_between_the_check_and_the_lock_is_polled() {
    let d = start("between");
    let (a, b) = (end(&d, "a"), Rc::new(end(&d, "b")));
    connect(&a, &b);
    for i in 0..4 {
        a.recv(i);
    }
    assert!(a.cq.inner.recv_qps.surely_idle(), "nothing sent yet");
    b.send(10);
    assert!(!a.cq.inner.recv_qps.surely_idle(), "the check sees a published completion");
    // The check of this poll sees the first SEND; the second lands after it, before the lock.
    let later = b.clone();
    BETWEEN_CHECK_AND_LOCK.with(|h| *h.borrow_mut() = Some(Box::new(move || later.send(11))));
    assert_eq!(a.poll_ids(), vec![0, 1]);
    assert!(a.cq.inner.recv_qps.surely_idle());
    assert!(a.poll_ids().is_empty());
}

#[test]
fn a_completion_published_right_after_an_idle_check_is_polled_next() {
    let d = start("after");
    let (a, b) = (end(&d, "a"), end(&d, "b"));
    connect(&a, &b);
    a.recv(7);
    // The poll's check finds nothing and returns without the lock; the SEND comes after.
    assert!(a.poll_ids().is_empty());
    b.send(1);
    assert_eq!(a.poll_ids(), vec![7]);
}

#[test]
fn only_the_first_polling_thread_checks_without_the_lock_and_detached_qps_leave_the_check() {
    let d = start("owner");
    let (a, b) = (end(&d, "a"), end(&d, "b"));
    connect(&a, &b);
    a.recv(1);
    assert!(a.poll_ids().is_empty());
    // Another thread is not the owner: unsure, so it polls under the lock, and gets it.
    b.send(1);
    let got = std::thread::scope(|s| s.spawn(|| (a.cq.inner.recv_qps.surely_idle(), a.poll_ids())).join().unwrap());
    assert_eq!(got, (false, vec![1]));
    // A second QP on the same CQ, then gone: the check follows the list.
    let qp2 = a.pd.create_qp(&QpInitAttr::rc(&a.cq, &a.cq, CAPS)).unwrap();
    assert_eq!(a.cq.inner.recv_qps.snapshot_len(), 2);
    drop(qp2);
    assert_eq!(a.cq.inner.recv_qps.snapshot_len(), 1);
    assert!(a.cq.inner.recv_qps.surely_idle());
}

#[test]
fn a_check_that_never_ends_costs_a_leak_and_the_checks_not_a_hang() {
    use std::sync::atomic::Ordering;
    let d = start("stale");
    let (a, b) = (end(&d, "a"), end(&d, "b"));
    connect(&a, &b);
    a.recv(3);
    assert!(a.poll_ids().is_empty(), "this thread is the owner now");
    // As after a fork that happened while another thread of the parent was in a check.
    a.cq.inner.recv_qps.checking.store(true, Ordering::Release);
    let qp2 = a.pd.create_qp(&QpInitAttr::rc(&a.cq, &a.cq, CAPS)).unwrap();
    drop(qp2);
    assert!(!a.cq.inner.recv_qps.surely_idle(), "checks are off: every poll takes the lock");
    b.send(1);
    assert_eq!(a.poll_ids(), vec![3]);
}
