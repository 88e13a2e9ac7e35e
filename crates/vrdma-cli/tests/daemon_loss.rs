//! vrdmad killed under its applications: every queue of asynchronous events a context was
//! given gets IBV_EVENT_DEVICE_FATAL, a mediated QP IBV_EVENT_QP_FATAL first (its receives
//! flushed), and nothing waits for the daemon that is gone.

mod common;
use common::*;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};
use vrdma::*;

const ALL: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

fn wait_wc(cq: &Cq, limit: Duration) -> Option<Wc> {
    let mut wcs = [Wc::EMPTY];
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if cq.poll(&mut wcs) == 1 {
            return Some(wcs[0]);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

/// The next event, or None once `limit` passed with none (poll(2) on the queue's fd).
fn next_event(ev: &AsyncEvents, limit: Duration) -> Option<AsyncEvent> {
    let mut p = libc::pollfd { fd: ev.fd().as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one live pollfd.
    let n = unsafe { libc::poll(&mut p, 1, limit.as_millis() as i32) };
    (n == 1).then(|| ev.next().expect("readable queue has an event"))
}

#[test]
fn killed_vrdmad_raises_qp_fatal_then_device_fatal() {
    let mut d = Daemon::start_with("devfatal", &["--mediated"]);
    d.ok(&["vnic", "create", "a", "--tenant", "t"]);
    d.ok(&["vnic", "create", "b", "--tenant", "t"]);
    let (ctx_a, ctx_b) = (Context::open(&d.socket("a")).unwrap(), Context::open(&d.socket("b")).unwrap());
    // Two queues on one context, as two ibv_open_device calls of the drop-in share it.
    let (ev, ev2) = (AsyncEvents::new().unwrap(), AsyncEvents::new().unwrap());
    ctx_a.watch_events(&ev);
    ctx_a.watch_events(&ev2);
    let caps = QpCaps { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };
    let (pd_a, pd_b) = (ctx_a.alloc_pd().unwrap(), ctx_b.alloc_pd().unwrap());
    let (cq_a, cq_b) = (ctx_a.create_cq(64, None).unwrap(), ctx_b.create_cq(64, None).unwrap());
    let mut init = QpInitAttr::rc(&cq_a, &cq_a, caps);
    init.events = Some(&ev);
    let qp_a = pd_a.create_qp(&init).unwrap();
    let qp_b = pd_b.create_qp(&QpInitAttr::rc(&cq_b, &cq_b, caps)).unwrap();
    let (buf_a, buf_b) = (MrBuf::new(&pd_a, 4096, ALL).unwrap(), MrBuf::new(&pd_b, 4096, ALL).unwrap());
    qp_a.connect_rc(ctx_b.gids()[0], qp_b.qp_num(), ALL).unwrap();
    qp_b.connect_rc(ctx_a.gids()[0], qp_a.qp_num(), ALL).unwrap();

    // The pair works through the mediated engine.
    qp_b.post_recv(&RecvWr { wr_id: 7, sg_list: &[buf_b.sge(0, 64)] }).unwrap();
    buf_a.write(0, b"before the end");
    qp_a.post_send(&SendWr::new(1, WrOpcode::Send, &[buf_a.sge(0, 14)], send_flags::SIGNALED)).unwrap();
    let s = wait_wc(&cq_a, Duration::from_secs(10)).expect("send completes");
    assert_eq!((s.wr_id, s.status), (1, WcStatus::Success));
    let r = wait_wc(&cq_b, Duration::from_secs(10)).expect("receive completes");
    assert_eq!((r.wr_id, r.status, r.byte_len), (7, WcStatus::Success, 14));
    assert!(next_event(&ev, Duration::ZERO).is_none(), "no event while vrdmad lives");

    // A receive outstanding when vrdmad dies.
    qp_a.post_recv(&RecvWr { wr_id: 9, sg_list: &[buf_a.sge(0, 64)] }).unwrap();
    let t0 = Instant::now();
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    let first = next_event(&ev, Duration::from_secs(10)).expect("an event after vrdmad's end");
    assert_eq!((first.kind, first.qpn), (AsyncEventKind::QpFatal, qp_a.qp_num()));
    let second = next_event(&ev, Duration::from_secs(10)).expect("DEVICE_FATAL");
    assert_eq!((second.kind, second.qpn), (AsyncEventKind::DeviceFatal, 0));
    let other = next_event(&ev2, Duration::from_secs(10)).expect("DEVICE_FATAL on the second queue");
    assert_eq!(other.kind, AsyncEventKind::DeviceFatal);
    eprintln!("events {:?} after the kill", t0.elapsed());
    assert!(next_event(&ev, Duration::from_millis(200)).is_none(), "one event each");
    let f = wait_wc(&cq_a, Duration::from_secs(10)).expect("the receive flushes");
    assert_eq!((f.wr_id, f.status), (9, WcStatus::WrFlushErr));
    assert_eq!(qp_a.query().qp_state, QpState::Err as u32);
}
