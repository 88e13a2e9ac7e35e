//! Unit tests of the control-socket server: framing, dispatch and session teardown, with
//! a daemon in a private directory and clients on socketpairs.

use std::thread::JoinHandle;

use vrdma_abi::control::{MrChunk, QpCaps, Usage, MAX_MESSAGE, VERSION};

use super::*;
use crate::registry::VnicStatus;

/// A daemon with the embedded store in a private directory, serving vNIC `v`.
struct TestDaemon {
    d: Arc<Daemon>,
    dir: PathBuf,
}

/// A client session served by [`Daemon::serve_client`] over a socketpair.
struct Client {
    ch: Channel,
    server: JoinHandle<()>,
}

impl TestDaemon {
    fn start(tag: &str) -> TestDaemon {
        let dir = std::env::temp_dir().join(format!("vrdmad-server-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = Config { run_dir: dir.join("run"), state_dir: dir.join("state"), ..Default::default() };
        let d = Daemon::start(cfg).expect("daemon starts");
        d.create_vnic("v", "t", None, None).expect("vNIC v");
        TestDaemon { d, dir }
    }

    fn connect(&self) -> Client {
        let (ch, server_end) = Channel::pair().expect("socketpair");
        let session = self.d.registry.lock().open_session("v", None).expect("v is served");
        let d = self.d.clone();
        let server = std::thread::spawn(move || d.serve_client("v", session, server_end));
        Client { ch, server }
    }

    fn status(&self) -> VnicStatus {
        self.d.status().into_iter().find(|s| s.record.name == "v").expect("v is served")
    }
}

impl Drop for TestDaemon {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Client {
    /// Sends `msg` as one frame; the reply's sequence number, reply and fds.
    fn exchange(&self, msg: &[u8]) -> (u32, Reply, Vec<OwnedFd>) {
        self.ch.send(msg, &[]).expect("send");
        let (m, fds) = self.ch.recv().expect("a reply");
        let (seq, reply) = Reply::decode(&m).expect("a well-formed reply");
        (seq, reply, fds)
    }

    fn call(&self, seq: u32, req: &Request) -> (Reply, Vec<OwnedFd>) {
        let (got, reply, fds) = self.exchange(&req.encode(seq));
        assert_eq!(got, seq, "a reply carries its request's sequence number");
        (reply, fds)
    }

    /// Closes the client's end and waits until the daemon has closed the session.
    fn close(self) {
        drop(self.ch);
        self.server.join().expect("the session thread ends cleanly");
    }
}

fn error(r: Reply) -> (i32, String) {
    match r {
        Reply::Error { errno, message } => (errno, message),
        other => panic!("expected an error reply, got {other:?}"),
    }
}

#[test]
fn a_malformed_message_is_answered_and_counted_and_the_session_goes_on() {
    let t = TestDaemon::start("malformed");
    let c = t.connect();
    let (seq, reply, fds) = c.exchange(&[0xff, 0xee, 0xdd]);
    assert_eq!(seq, 0, "an undecodable request has no sequence number to echo");
    assert_eq!(error(reply).0, libc::EINVAL);
    assert!(fds.is_empty());
    assert_eq!(t.status().counters.bad_requests, 1);

    match c.call(7, &Request::Hello { version: u32::from(VERSION) }).0 {
        Reply::Hello(info) => assert_eq!((info.name.as_str(), info.tenant.as_str()), ("v", "t")),
        other => panic!("{other:?}"),
    }
    c.close();
}

/// Requests that break the protocol (another session's handle, fds that do not match)
/// are counted as bad input; a verb failing normally (a CQ size out of range) is not.
/// Either way the client gets the registry's errno and message.
#[test]
fn only_protocol_violations_count_as_bad_input() {
    let t = TestDaemon::start("refusals");
    let c = t.connect();
    assert_eq!(error(c.call(1, &Request::DeallocPd { pd: 12345 }).0), (libc::EINVAL, "PD handle 12345 is not yours".into()));
    let chunk = MrChunk { mr_offset: 0, len: 4096, fd_offset: 0 };
    let reg = Request::RegMr { pd: 1, addr: 0x1000, length: 4096, access: 0, chunks: vec![chunk] };
    assert_eq!(error(c.call(2, &reg).0), (libc::EINVAL, "expected 1 fds, got 0".into()));
    assert_eq!(t.status().counters.bad_requests, 2);

    assert_eq!(error(c.call(3, &Request::CreateCq { cqe: 0 }).0), (libc::EINVAL, "cqe 0 out of range".into()));
    assert_eq!(t.status().counters.bad_requests, 2, "a verb failure is not bad input");
    c.close();
}

#[test]
fn closing_the_socket_releases_the_sessions_objects() {
    let t = TestDaemon::start("close");
    let c = t.connect();
    assert!(matches!(c.call(1, &Request::AllocPd).0, Reply::Handle { .. }));
    let (reply, fds) = c.call(2, &Request::CreateCq { cqe: 16 });
    assert!(matches!(reply, Reply::Cq { .. }));
    assert_eq!(fds.len(), 2, "a CQ comes with its ring and its eventfd");
    let u = t.status().usage;
    assert_eq!((u.clients, u.pds, u.cqs), (1, 1, 1));

    c.close();
    assert_eq!(t.status().usage, Usage::default());
    assert!(t.d.registry.lock().sessions_of("v").is_empty());
}

/// A frame longer than any request leaves no way to tell where the next one begins: it
/// is counted and the session ends, releasing what it held.
#[test]
fn an_oversized_frame_ends_the_session() {
    let t = TestDaemon::start("oversized");
    let c = t.connect();
    assert!(matches!(c.call(1, &Request::AllocPd).0, Reply::Handle { .. }));
    c.ch.send(&vec![0u8; MAX_MESSAGE + 1], &[]).expect("send");
    assert!(matches!(c.ch.recv(), Err(ChannelError::Closed)), "the daemon closes the session");
    c.server.join().expect("the session thread ends cleanly");
    assert_eq!(t.status().counters.bad_requests, 1);
    assert_eq!(t.status().usage, Usage::default());
}

/// The daemon-side costs a client can run up are per-vNIC limits: sessions (EMFILE, also
/// told to a client connecting over the limit), queue memory (ENOMEM) and control requests
/// in progress (EAGAIN). Each refusal is counted; what a destroyed QP held is given back.
#[test]
fn resource_limits_refuse_with_the_kernels_errno_and_are_counted() {
    let t = TestDaemon::start("limits");
    let limits = Limits { max_sessions: 2, max_ring_bytes: 4 << 20, ..Limits::default() };
    t.d.set_limits("v", limits).unwrap();
    // A CPU share of 0 would stop the vNIC's requests for good: refused, nothing stored.
    let e = t.d.set_limits("v", Limits { max_control_cpu_percent: 0, ..limits }).unwrap_err();
    assert!(e.to_string().contains("max_control_cpu_percent"), "{e}");

    // Sessions: two, then EMFILE; a client connecting to the socket is told so.
    let c = t.connect();
    let sock = t.d.vnic_dir("v").join("control.sock");
    let second = Channel::connect(&sock).unwrap();
    let hello = Request::Hello { version: u32::from(VERSION) };
    second.send(&hello.encode(1), &[]).unwrap();
    assert!(matches!(Reply::decode(&second.recv().unwrap().0).unwrap().1, Reply::Hello(_)));
    let third = Channel::connect(&sock).unwrap();
    third.send(&hello.encode(1), &[]).unwrap();
    let (seq, reply) = Reply::decode(&third.recv().unwrap().0).unwrap();
    assert_eq!((seq, error(reply).0), (1, libc::EMFILE));
    assert!(matches!(third.recv(), Err(ChannelError::Closed)), "then the connection closes");
    assert_eq!(t.status().counters.refused_by_limits, 1);

    // Queue memory: a QP at the largest ring size is over 4 MiB; a small one fits.
    let Reply::Handle { handle: pd } = c.call(1, &Request::AllocPd).0 else { panic!("PD") };
    let Reply::Cq { cq } = c.call(2, &Request::CreateCq { cqe: 16 }).0 else { panic!("CQ") };
    let caps = |wr: u32, sge: u32| QpCaps { max_send_wr: 1, max_recv_wr: wr, max_send_sge: 1, max_recv_sge: sge, max_inline_data: 0 };
    let qp = |caps| Request::CreateQp { pd, send_cq: cq, recv_cq: cq, srq: 0, qp_type: crate::registry::QPT_RC, caps };
    let (errno, message) = error(c.call(3, &qp(caps(crate::registry::MAX_QUEUE_DEPTH, crate::registry::MAX_SGE))).0);
    assert_eq!(errno, libc::ENOMEM, "{message}");
    assert_eq!(t.status().counters.refused_by_limits, 2);
    let Reply::Qp { qpn, .. } = c.call(4, &qp(caps(64, 1))).0 else { panic!("a small QP fits") };
    let held = t.status().counters.ring_bytes;
    assert!(held > vrdma_abi::ring::CQ_REGION_SIZE as u64 && held <= 4 << 20, "{held} bytes charged");
    assert!(matches!(c.call(5, &Request::DestroyQp { qpn }).0, Reply::Ok));
    assert_eq!(t.status().counters.ring_bytes, vrdma_abi::ring::CQ_REGION_SIZE as u64, "given back (the CQ's page stays)");

    // Requests in progress: none allowed, EAGAIN.
    t.d.set_limits("v", Limits { max_pending: 0, ..limits }).unwrap();
    assert_eq!(error(c.call(6, &Request::QueryUsage).0).0, libc::EAGAIN);
    assert_eq!(t.status().counters.refused_by_limits, 3);
    drop(second);
    c.close();

    // Lanes: one, then the next QP goes without (counted); a destroyed QP gives its back.
    t.d.set_limits("v", Limits { max_lanes: 1, ..limits }).unwrap();
    let mut reg = t.d.registry.lock();
    let s = reg.open_session("v", None).unwrap();
    let call = |reg: &mut Registry, req| reg.handle_request(s, req, vec![]).unwrap().0;
    let Reply::Handle { handle: pd } = call(&mut reg, Request::AllocPd) else { panic!("PD") };
    let Reply::Cq { cq } = call(&mut reg, Request::CreateCq { cqe: 16 }) else { panic!("CQ") };
    let qp = |caps| Request::CreateQp { pd, send_cq: cq, recv_cq: cq, srq: 0, qp_type: crate::registry::QPT_RC, caps };
    let Reply::Qp { qpn: q1, .. } = call(&mut reg, qp(caps(16, 1))) else { panic!("QP") };
    let Reply::Qp { qpn: q2, .. } = call(&mut reg, qp(caps(16, 1))) else { panic!("QP") };
    let refused = reg.status()[0].counters.refused_by_limits;
    assert!(reg.reserve_lane(s, q1) && reg.reserve_lane(s, q1), "one lane, taken once");
    assert!(!reg.reserve_lane(s, q2), "the vNIC's only lane is taken");
    assert_eq!((reg.status()[0].counters.lanes, reg.status()[0].counters.refused_by_limits), (1, refused + 1));
    call(&mut reg, Request::DestroyQp { qpn: q1 });
    assert_eq!(reg.status()[0].counters.lanes, 0);
    assert!(reg.reserve_lane(s, q2));
    reg.close_session(s);
    assert_eq!((reg.status()[0].counters.lanes, reg.status()[0].counters.ring_bytes), (0, 0));
}

/// `CreateQp`, whose queue memory is made without the registry lock, is still checked as
/// every request is: descriptors it should not carry are bad input, and a QP of another
/// session's PD is refused before any memory is made or charged.
#[test]
fn create_qp_outside_the_lock_is_checked_as_before() {
    let t = TestDaemon::start("createqp");
    let c = t.connect();
    let caps = QpCaps { max_send_wr: 1, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let req = Request::CreateQp { pd: 77, send_cq: 1, recv_cq: 1, srq: 0, qp_type: crate::registry::QPT_RC, caps };
    let fd = vrdma_abi::fd::new_eventfd().unwrap();
    c.ch.send(&req.encode(1), &[fd.as_raw_fd()]).unwrap();
    let (seq, reply) = Reply::decode(&c.ch.recv().unwrap().0).unwrap();
    assert_eq!((seq, error(reply).0), (1, libc::EINVAL));
    assert_eq!(error(c.call(2, &req).0), (libc::EINVAL, "PD handle 77 is not yours".into()));
    assert_eq!(t.status().counters.bad_requests, 2);
    assert_eq!(t.status().counters.ring_bytes, 0);
    c.close();
}
