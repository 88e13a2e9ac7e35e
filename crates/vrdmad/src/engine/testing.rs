//! Test harness for the engine's unit tests: an engine whose broker hands out memfd MRs and
//! UD receive sides, mediated QPs whose shared regions the test holds as their client would,
//! and a connection whose far end the test writes requests to and reads answers from.
//! Also the responder's fuzz target's harness (`responder::fuzzing`), hence built always.
#![cfg_attr(not(test), allow(dead_code))]
// (A harness: a failed set-up step is a broken test or fuzz run, reported by its panic.)
#![allow(clippy::expect_used, clippy::unwrap_used)]

use crate::engine::Refusal;
use std::collections::HashMap;
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use vrdma_abi::control::{MrChunk, QpCaps};
use vrdma_abi::fd::new_eventfd;
use vrdma_abi::ring::{self, CompEntry, CompRing, QpRegionLayout, RecvRing, RecvRingLayout, Sge};
use vrdma_abi::shm::{create_memfd, SharedMapping};
use vrdma_abi::verbs::QpState;
use vrdma_abi::wire::{ConnectReq, FrameHeader, HEADER_LEN};
use vrdma_core::access::MrBounds;

use super::connection::Conn;
use super::qp::MedQp;
use super::{Broker, Engine, EngineConfig, MedQpSetup, MrGrant, RecvSideSetup, UdReceiverSetup};

/// Where the test's "peer daemon" listens (only an identity: nothing connects there).
pub(crate) const PEER: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 1));
/// The session and PD every test object belongs to.
pub(crate) const SESSION: u64 = 5;
pub(crate) const PD: u32 = 3;

/// A broker of memfd MRs and UD receive sides; refuses UD datagrams while `refuse_ud` is set.
#[derive(Default)]
pub(crate) struct TestBroker {
    /// The engine MRs are offered to.
    engine: Mutex<Option<std::sync::Weak<Engine>>>,
    ud: Mutex<HashMap<u32, Arc<OwnedFd>>>,
    pub(crate) refuse_ud: Mutex<Option<String>>,
    /// The answer to connection requests (none: accepted), and the requests seen.
    pub(crate) refuse_connect: Mutex<Option<Refusal>>,
    pub(crate) connects: Mutex<Vec<(u32, u32, ConnectReq)>>,
    /// PEER_GONE notices: (our QPN, their QPN).
    pub(crate) gone: Mutex<Vec<(u32, u32)>>,
}

impl Broker for TestBroker {
    fn accept_remote(&self, _: SocketAddr, src_qpn: u32, dst_qpn: u32, req: &ConnectReq) -> Result<(), Refusal> {
        self.connects.lock().push((src_qpn, dst_qpn, req.clone()));
        self.refuse_connect.lock().clone().map_or(Ok(()), Err)
    }
    fn peer_gone(&self, local_qpn: u32, _: SocketAddr, remote_qpn: u32) {
        self.gone.lock().push((local_qpn, remote_qpn));
    }
    fn accept_ud(&self, _: SocketAddr, _: &[u8; 16], _: u32, _: &[u8; 16]) -> Result<(), String> {
        self.refuse_ud.lock().clone().map_or(Ok(()), Err)
    }
    fn ud_receiver(&self, qpn: u32) -> Option<UdReceiverSetup> {
        let qp_region = self.ud.lock().get(&qpn)?.clone();
        Some(UdReceiverSetup {
            qpn,
            session: SESSION,
            pd: PD,
            recv: RecvSideSetup { qp_region, rq: Some(rq_layout()), comp_entries: 16, srq: None },
            recv_cq: cq(),
        })
    }
}

/// An engine on loopback (lanes off, no spinning) with a [`TestBroker`]; stopped on drop.
pub(crate) struct TestEngine {
    pub(crate) e: Arc<Engine>,
    pub(crate) broker: Arc<TestBroker>,
}

impl Drop for TestEngine {
    fn drop(&mut self) {
        self.e.stop();
    }
}

pub(crate) fn engine() -> TestEngine {
    let cfg = EngineConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        spin: Duration::ZERO,
        follow_cpu: false,
        lanes: false,
        ..EngineConfig::default()
    };
    let e = Engine::start(cfg).unwrap();
    let broker = Arc::new(TestBroker::default());
    let weak: std::sync::Weak<dyn Broker> = Arc::downgrade(&broker) as std::sync::Weak<dyn Broker>;
    e.set_broker(weak);
    *broker.engine.lock() = Some(Arc::downgrade(&e));
    TestEngine { e, broker }
}

/// An MR of `len` bytes (a page multiple) at address `addr` (page-aligned) with `access`,
/// and the test's own view of its bytes.
pub(crate) struct TestMr {
    pub(crate) addr: u64,
    map: SharedMapping,
}

impl TestMr {
    pub(crate) fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.map.region().read_into((addr - self.addr) as usize, &mut b).unwrap();
        b
    }
    pub(crate) fn write(&self, addr: u64, data: &[u8]) {
        self.map.region().write_from((addr - self.addr) as usize, data).unwrap();
    }
}

/// An MR of the test's own memory, copied through `/proc/PID/mem` (see
/// [`TestBroker::register_copied_mr`]). The memory is never freed: its owner's agent may
/// still write it after the test (a write that did not answer in time goes on), and it is
/// reached only through its address, never a reference, as the kernel writes it behind the
/// compiler's back.
pub(crate) struct CopiedMr {
    pub(crate) addr: u64,
    len: usize,
    pub(crate) mem: Arc<crate::procmem::ProcMem>,
}

impl CopiedMr {
    /// Its bytes now (the engine writes them from other threads, through the kernel).
    pub(crate) fn bytes(&self) -> Vec<u8> {
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // SAFETY: `addr..addr+len` is this MR's leaked allocation, live for the process;
        // volatile, so the loads are not elided.
        (0..self.len).map(|i| unsafe { std::ptr::read_volatile((self.addr as *const u8).add(i)) }).collect()
    }

    /// Sets its bytes at `at`.
    pub(crate) fn set(&mut self, at: usize, data: &[u8]) {
        assert!(at + data.len() <= self.len);
        for (i, &b) in data.iter().enumerate() {
            // SAFETY: inside this MR's leaked allocation (checked above), live for the process.
            unsafe { std::ptr::write_volatile((self.addr as *mut u8).add(at + i), b) };
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

impl TestBroker {
    pub(crate) fn register_mr(&self, key: u32, addr: u64, len: usize, access: u32) -> TestMr {
        let fd = Arc::new(create_memfd("engine-test-mr", len, true).unwrap());
        let map = SharedMapping::map_sealed(fd.as_fd(), len, true).unwrap();
        let bounds = MrBounds { addr, length: len as u64, access };
        let chunk = MrChunk { mr_offset: 0, len: bounds.length, fd_offset: 0 };
        let grant = MrGrant { session: SESSION, pd: PD, bounds, chunks: vec![(chunk, fd)], proc_mem: None };
        if let Some(e) = self.engine.lock().as_ref().and_then(std::sync::Weak::upgrade) {
            e.offer_mr(key, grant);
        }
        TestMr { addr, map }
    }

    /// An MR `key` of `len` bytes of this process's own memory, reached as the engine reaches
    /// memory that cannot be shared (file-backed, hugetlb): through the process's
    /// `/proc/PID/mem`. Its owner's memory can be made to stall (`CopiedMr::mem.stall`).
    pub(crate) fn register_copied_mr(&self, key: u32, len: usize, access: u32) -> CopiedMr {
        // (u64s: atomics need 8-byte alignment.)
        let addr = Box::into_raw(vec![0u64; len.div_ceil(8)].into_boxed_slice()) as *mut u64 as u64;
        let mem = Arc::new(crate::procmem::ProcMem::open(std::process::id() as i32).unwrap());
        self.register_copied_mr_at(key, addr, len, access, &mem);
        CopiedMr { addr, len, mem }
    }

    /// MR `key` over `len` bytes at `addr` of a process whose memory `mem` reaches (this
    /// one's), copied through it as [`TestBroker::register_copied_mr`] does; the caller owns
    /// that memory and keeps it for as long as the engine may write it.
    pub(crate) fn register_copied_mr_at(&self, key: u32, addr: u64, len: usize, access: u32, mem: &Arc<crate::procmem::ProcMem>) {
        let bounds = MrBounds { addr, length: len as u64, access };
        let grant = MrGrant { session: SESSION, pd: PD, bounds, chunks: Vec::new(), proc_mem: Some(mem.clone()) };
        if let Some(e) = self.engine.lock().as_ref().and_then(std::sync::Weak::upgrade) {
            e.offer_mr(key, grant);
        }
    }

    /// Makes `qpn` a UD QP with a receive side (returned, as its client holds it).
    pub(crate) fn add_ud_qp(&self, qpn: u32, qkey: u32) -> ClientRecvSide {
        let (side, fd) = ClientRecvSide::new();
        side.map.region().store_u64(ring::QP_QKEY, u64::from(qkey)).unwrap();
        self.ud.lock().insert(qpn, fd);
        side
    }
}

fn rq_layout() -> RecvRingLayout {
    RecvRingLayout::new(8, 2)
}

/// A CQ's region and eventfd.
pub(crate) fn cq() -> (Arc<OwnedFd>, Arc<OwnedFd>) {
    (Arc::new(create_memfd("engine-test-cq", ring::CQ_REGION_SIZE, true).unwrap()), Arc::new(new_eventfd().unwrap()))
}

/// A QP's receiving side as its client sees it: receive ring (its own, or its SRQ's) and
/// inbound completions, in RTS.
pub(crate) struct ClientRecvSide {
    map: SharedMapping,
    rq: RecvRing,
    inbound: CompRing,
    /// The SRQ's mapping, if the receives are an SRQ's.
    _srq: Option<SharedMapping>,
}

impl ClientRecvSide {
    fn new() -> (ClientRecvSide, Arc<OwnedFd>) {
        let layout = QpRegionLayout::new(Some(rq_layout()), 16);
        let fd = Arc::new(create_memfd("engine-test-qp", layout.size(), true).unwrap());
        let map = SharedMapping::map_sealed(fd.as_fd(), layout.size(), true).unwrap();
        let rq = RecvRing::new(map.region().subregion(layout.rq_offset(), rq_layout().size()).unwrap(), rq_layout()).unwrap();
        rq.init().unwrap();
        let inbound = CompRing::new(map.region().subregion(layout.comp_offset(), layout.comp.size()).unwrap(), layout.comp).unwrap();
        map.region().store_u64(ring::QP_OWNER_STATE, QpState::Rts as u64).unwrap();
        (ClientRecvSide { map, rq, inbound, _srq: None }, fd)
    }

    /// As [`ClientRecvSide::new`], its receives an SRQ's: the QP's region and the SRQ's.
    fn with_srq() -> (ClientRecvSide, Arc<OwnedFd>, Arc<OwnedFd>) {
        let layout = QpRegionLayout::new(None, 16);
        let fd = Arc::new(create_memfd("engine-test-qp", layout.size(), true).unwrap());
        let map = SharedMapping::map_sealed(fd.as_fd(), layout.size(), true).unwrap();
        let srq_size = ring::srq_region_size(rq_layout());
        let srq_fd = Arc::new(create_memfd("engine-test-srq", srq_size, true).unwrap());
        let srq = SharedMapping::map_sealed(srq_fd.as_fd(), srq_size, true).unwrap();
        let rq = RecvRing::new(srq.region().subregion(ring::PAGE, rq_layout().size()).unwrap(), rq_layout()).unwrap();
        rq.init().unwrap();
        let inbound = CompRing::new(map.region().subregion(layout.comp_offset(), layout.comp.size()).unwrap(), layout.comp).unwrap();
        map.region().store_u64(ring::QP_OWNER_STATE, QpState::Rts as u64).unwrap();
        (ClientRecvSide { map, rq, inbound, _srq: Some(srq) }, fd, srq_fd)
    }

    pub(crate) fn post_recv(&self, wr_id: u64, sges: &[Sge]) {
        assert!(self.rq.push(wr_id, sges).unwrap());
    }

    /// Posts a receive if the ring has room and takes that many entries: whether it did.
    pub(crate) fn try_post_recv(&self, wr_id: u64, sges: &[Sge]) -> bool {
        self.rq.push(wr_id, sges).unwrap_or(false)
    }

    pub(crate) fn poll(&self) -> Option<CompEntry> {
        self.inbound.pop().unwrap()
    }

    /// Moves the QP to `state` as its client's library does.
    pub(crate) fn set_state(&self, state: QpState) {
        self.map.region().store_u64(ring::QP_OWNER_STATE, state as u64).unwrap();
    }

    /// Sets (`true`) or clears the QP's UD receive lock word, as its client's library may.
    pub(crate) fn set_ud_lock(&self, held: bool) {
        self.map.region().store_u64(ring::QP_UD_LOCK, u64::from(held)).unwrap();
    }
}

/// Our mediated QP `qpn`, paired with QP `remote_qpn` of [`PEER`], its requests read from
/// `conn`; the client's view of its receiving side.
pub(crate) fn mediated_qp(t: &TestEngine, qpn: u32, remote_qpn: u32, conn: &Arc<Conn>) -> (Arc<MedQp>, ClientRecvSide) {
    new_mediated_qp(t, qpn, remote_qpn, conn, Attached::Plain, "v", QpCaps::default())
}

/// As [`mediated_qp`], with a send ring (and send completion ring) of `depth` WRs.
pub(crate) fn deep_mediated_qp(t: &TestEngine, qpn: u32, remote_qpn: u32, conn: &Arc<Conn>, depth: u32) -> (Arc<MedQp>, ClientRecvSide) {
    new_mediated_qp(t, qpn, remote_qpn, conn, Attached::Plain, "v", QpCaps { max_send_wr: depth, ..QpCaps::default() })
}

/// As [`mediated_qp`], of vNIC `vnic`.
pub(crate) fn mediated_qp_of(t: &TestEngine, qpn: u32, remote_qpn: u32, conn: &Arc<Conn>, vnic: &str) -> (Arc<MedQp>, ClientRecvSide) {
    new_mediated_qp(t, qpn, remote_qpn, conn, Attached::Plain, vnic, QpCaps::default())
}

/// As [`mediated_qp`], its receives taken from an SRQ's ring.
pub(crate) fn srq_mediated_qp(t: &TestEngine, qpn: u32, remote_qpn: u32, conn: &Arc<Conn>) -> (Arc<MedQp>, ClientRecvSide) {
    new_mediated_qp(t, qpn, remote_qpn, conn, Attached::Srq, "v", QpCaps::default())
}

/// What a test QP is beyond its numbers: on a shared connection, on a lane (its secret),
/// or receiving from an SRQ.
enum Attached {
    Plain,
    Lane([u64; 2]),
    Srq,
}

fn new_mediated_qp(
    t: &TestEngine,
    qpn: u32,
    remote_qpn: u32,
    conn: &Arc<Conn>,
    attached: Attached,
    vnic: &str,
    caps: QpCaps,
) -> (Arc<MedQp>, ClientRecvSide) {
    let (side, recv) = if matches!(attached, Attached::Srq) {
        let (side, qp_region, srq) = ClientRecvSide::with_srq();
        (side, RecvSideSetup { qp_region, rq: None, comp_entries: 16, srq: Some((srq, rq_layout())) })
    } else {
        let (side, qp_region) = ClientRecvSide::new();
        (side, RecvSideSetup { qp_region, rq: Some(rq_layout()), comp_entries: 16, srq: None })
    };
    let lane = match attached {
        Attached::Lane(secret) => Some(secret),
        _ => None,
    };
    let setup =
        MedQpSetup { qpn, session: SESSION, pd: PD, vnic: vnic.into(), remote: PEER, remote_qpn, caps, recv, send_cq: cq(), recv_cq: cq() };
    let doorbell = Arc::new(new_eventfd().unwrap());
    let (q, _chan, _layout) = MedQp::new(setup, doorbell.clone(), conn.clone(), lane, 0).unwrap();
    // (As `attach` does: the doorbell thread is rung there, by the client or by itself.)
    t.e.epoll_add_events(
        std::os::fd::AsRawFd::as_raw_fd(&*doorbell),
        super::doorbell::Token::qp(qpn),
        (libc::EPOLLIN | libc::EPOLLET) as u32,
    )
    .unwrap();
    t.e.qps.write().insert(qpn, q.clone());
    (q, side)
}

/// A connection from [`PEER`] as its reader sees it, and the peer's end of it (which writes
/// requests' data and reads the answers).
pub(crate) fn connection() -> (TcpStream, Arc<Conn>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let peer_end = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (ours, _) = l.accept().unwrap();
    peer_end.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // (An answer is at the far end when the call that sent it returns, not held by Nagle.)
    ours.set_nodelay(true).unwrap();
    peer_end.set_nodelay(true).unwrap();
    (peer_end, Arc::new(Conn::new(ours, PEER)))
}

/// The next frame the peer's end receives: its header and data.
pub(crate) fn read_frame(s: &mut TcpStream) -> (FrameHeader, Vec<u8>) {
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b).unwrap();
    let h = FrameHeader::decode(&b).unwrap();
    let mut data = vec![0u8; h.data_len as usize];
    s.read_exact(&mut data).unwrap();
    (h, data)
}

/// Whether nothing waits for the peer's end (no answer was sent); what waits is left there.
pub(crate) fn nothing_sent(s: &TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 1];
    let r = s.peek(&mut b);
    s.set_nonblocking(false).unwrap();
    matches!(r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

/// As [`mediated_qp`], but a lane QP (`conn` its lane).
pub(crate) fn mediated_lane_qp(t: &TestEngine, qpn: u32, remote_qpn: u32, conn: &Arc<Conn>) -> (Arc<MedQp>, ClientRecvSide) {
    new_mediated_qp(t, qpn, remote_qpn, conn, Attached::Lane([1, 2]), "v", QpCaps::default())
}

/// Sets socket `fd`'s `which` buffer (`SO_SNDBUF`, `SO_RCVBUF`) to 128 KiB (loopback's grow
/// to megabytes, which would hide what waits behind what).
pub(crate) fn small_buffers(fd: std::os::fd::RawFd, which: libc::c_int) {
    let size: libc::c_int = 128 << 10;
    // SAFETY: `fd` is an open socket for the call; the option value is a live c_int.
    let r = unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, which, (&raw const size).cast(), std::mem::size_of::<libc::c_int>() as u32) };
    assert_eq!(r, 0);
}
