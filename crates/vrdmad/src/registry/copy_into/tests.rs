//! Direct copies against this test process's own memory: every byte arrives, into a mapped
//! MR and into one registered in place, both ways; and every refusal.

use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::sync::Arc;

use vrdma_abi::control::{MrChunk, QpCaps, Reply, Request};
use vrdma_abi::shm::{self, SharedMapping};
use vrdma_abi::verbs::access;

use crate::procmem::ProcMem;
use crate::registry::tests::{handle, rec};
use crate::registry::{gid_of, Registry, ReplyFds, RequestError};
use crate::store::RuleRecord;

/// A session (whose process memory is this process's) with a PD and an RC QP.
fn side(r: &mut Registry, vnic: &str) -> (u64, u32, u32) {
    let mem = ProcMem::open(std::process::id() as i32).expect("own /proc/self/mem");
    let s = r.open_session(vnic, Some(Ok(Arc::new(mem)))).unwrap();
    let pd = handle(r, s, Request::AllocPd);
    let cq = handle(r, s, Request::CreateCq { cqe: 16 });
    let caps = QpCaps { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let qp = handle(r, s, Request::CreateQp { pd, send_cq: cq, recv_cq: cq, srq: 0, qp_type: 2, caps });
    (s, pd, qp)
}

fn errno(r: Result<(Reply, ReplyFds), RequestError>) -> i32 {
    r.map(|(reply, _)| panic!("expected an error, got {reply:?}")).unwrap_err().errno()
}

/// A page-aligned anonymous buffer of this process (freed when dropped).
struct Buf {
    ptr: *mut u8,
    len: usize,
}

impl Buf {
    fn new(len: usize, fill: impl Fn(usize) -> u8) -> Buf {
        // SAFETY: a fresh private anonymous mapping, ours alone.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        assert_ne!(p, libc::MAP_FAILED);
        let b = Buf { ptr: p.cast(), len };
        for i in 0..len {
            // SAFETY: within our mapping.
            unsafe { b.ptr.add(i).write_volatile(fill(i)) };
        }
        b
    }
    fn addr(&self) -> u64 {
        self.ptr as u64
    }
    fn byte(&self, i: usize) -> u8 {
        // SAFETY: within our mapping (the kernel may have written it through /proc/self/mem).
        unsafe { self.ptr.add(i).read_volatile() }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping; nothing refers to it any more.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn pattern(seed: usize) -> impl Fn(usize) -> u8 {
    move |i| (i.wrapping_mul(31).wrapping_add(seed * 7) % 251) as u8
}

const ALL: u32 = access::LOCAL_WRITE | access::REMOTE_READ | access::REMOTE_WRITE;

struct Setup {
    r: Registry,
    /// The requester: session, PD, QP.
    s: u64,
    pd: u32,
    q: u32,
    /// The owner's session and QP.
    so: u64,
    qo: u32,
    /// The owner's MR (in place) over `peer`.
    key: u32,
    peer: Buf,
}

const LEN: usize = 3 * 4096 + 100;

fn setup() -> Setup {
    let mut r = Registry::default();
    r.cluster_mut().local_host = "h1".into();
    for v in [rec("own", "red", 2, "h1"), rec("req", "blue", 3, "h1")] {
        r.cluster_mut().vnics.insert(v.name.clone(), v.clone());
        r.add_vnic(v);
    }
    r.cluster_mut().rules.insert(RuleRecord::new("blue", "red"));
    let (so, pdo, qo) = side(&mut r, "own");
    let (s, pd, q) = side(&mut r, "req");
    let gid = |ip: u8| gid_of(Ipv4Addr::new(198, 18, 0, ip));
    r.handle_request(so, Request::ConnectQp { qpn: qo, dgid: gid(3), dest_qpn: q }, vec![]).unwrap();
    r.handle_request(s, Request::ConnectQp { qpn: q, dgid: gid(2), dest_qpn: qo }, vec![]).unwrap();
    let peer = Buf::new(LEN, pattern(1));
    let key = handle(&mut r, so, Request::RegMr { pd: pdo, addr: peer.addr() + 1, length: LEN as u64 - 1, access: ALL, chunks: vec![] });
    Setup { r, s, pd, q, so, qo, key, peer }
}

fn copy(q: u32, key: u32, addr: u64, lkey: u32, local_addr: u64, len: usize, to_peer: bool) -> Request {
    Request::PeerMrCopy { qpn: q, dest_qpn: 0, key, addr, lkey, local_addr, len: len as u32, to_peer, need_remote: true, staged: false }
}

/// READ and WRITE between the owner's in-place MR and the requester's MR registered in
/// place, at several sizes and offsets: every byte lands, no byte beside it moves.
#[test]
fn copies_between_two_in_place_mrs_keep_every_byte() {
    let Setup { mut r, s, pd, q, key, peer, .. } = setup();
    let mine = Buf::new(LEN, pattern(2));
    let lkey = handle(&mut r, s, Request::RegMr { pd, addr: mine.addr(), length: LEN as u64, access: access::LOCAL_WRITE, chunks: vec![] });
    for (off, len) in [(1usize, 1usize), (1, 4095), (100, 8192), (1, LEN - 1)] {
        let (p, m) = (peer.addr() + off as u64, mine.addr() + off as u64);
        r.handle_request(s, copy(q, key, p, lkey, m, len, false), vec![]).unwrap();
        for i in 0..LEN {
            let want = if i >= off && i < off + len { peer.byte(i) } else { pattern(2)(i) };
            assert_eq!(mine.byte(i), want, "READ of {len} at {off}: byte {i}");
        }
        // Back, after changing the requester's copy: the owner gets the new bytes.
        for i in off..off + len {
            // SAFETY: within our mapping.
            unsafe { mine.ptr.add(i).write_volatile(pattern(3)(i)) };
        }
        r.handle_request(s, copy(q, key, p, lkey, m, len, true), vec![]).unwrap();
        for i in 0..LEN {
            let want = if i >= off && i < off + len { pattern(3)(i) } else { pattern(1)(i) };
            assert_eq!(peer.byte(i), want, "WRITE of {len} at {off}: byte {i}");
        }
        for i in off..off + len {
            // SAFETY: within our mapping.
            unsafe {
                peer.ptr.add(i).write_volatile(pattern(1)(i));
                mine.ptr.add(i).write_volatile(pattern(2)(i));
            }
        }
    }
}

/// READ into, and WRITE from, the requester's MR on a memfd (vrdmad maps it).
#[test]
fn copies_into_a_mapped_mr_keep_every_byte() {
    let Setup { mut r, s, pd, q, key, peer, .. } = setup();
    let span = 4 * 4096;
    let fd = shm::create_memfd("copy-into-test", span, true).unwrap();
    let view = SharedMapping::map_sealed(fd.as_fd(), span, true).unwrap();
    let base = 0x5000_0000u64;
    let chunk = MrChunk { mr_offset: 0, len: span as u64, fd_offset: 0 };
    let req = Request::RegMr { pd, addr: base + 10, length: LEN as u64, access: access::LOCAL_WRITE, chunks: vec![chunk] };
    let lkey = match r.handle_request(s, req, vec![fd]).unwrap().0 {
        Reply::Mr { lkey, .. } => lkey,
        other => panic!("{other:?}"),
    };
    let len = LEN - 1;
    r.handle_request(s, copy(q, key, peer.addr() + 1, lkey, base + 10, len, false), vec![]).unwrap();
    let mut got = vec![0u8; span];
    view.region().read_into(0, &mut got).unwrap();
    for (i, b) in got.iter().enumerate() {
        let want = if (10..10 + len).contains(&i) { pattern(1)(i - 10 + 1) } else { 0 };
        assert_eq!(*b, want, "byte {i} of the memfd");
    }
    let back: Vec<u8> = (0..len).map(pattern(5)).collect();
    view.region().write_from(10, &back).unwrap();
    r.handle_request(s, copy(q, key, peer.addr() + 1, lkey, base + 10, len, true), vec![]).unwrap();
    for (i, b) in back.iter().enumerate() {
        assert_eq!(peer.byte(i + 1), *b, "byte {i} written to the owner");
    }
    assert_eq!(peer.byte(0), pattern(1)(0));
}

/// Every refusal: the peer's key, bounds and rights (counted as bad keys), a QP not
/// connected, and a requester buffer that is not its own MR or lies outside it.
#[test]
fn refusals() {
    let Setup { mut r, s, pd, q, so, qo, key, peer } = setup();
    let mine = Buf::new(LEN, pattern(2));
    let lkey = handle(&mut r, s, Request::RegMr { pd, addr: mine.addr(), length: LEN as u64, access: access::LOCAL_WRITE, chunks: vec![] });
    let ro = handle(&mut r, s, Request::RegMr { pd, addr: mine.addr(), length: LEN as u64, access: 0, chunks: vec![] });
    let (p, m) = (peer.addr() + 1, mine.addr());
    let ask = |r: &mut Registry, s, req| errno(r.handle_request(s, req, vec![]));

    assert_eq!(ask(&mut r, s, copy(q, key ^ 2, p, lkey, m, 8, false)), libc::EACCES, "not the peer's key");
    assert_eq!(ask(&mut r, s, copy(q, key, p + LEN as u64 - 8, lkey, m, 8, false)), libc::EACCES, "past the peer's MR");
    assert_eq!(ask(&mut r, s, copy(q, key, p - 1, lkey, m, 8, false)), libc::EACCES, "before the peer's MR");
    let bad_keys = |r: &Registry| r.status().iter().find(|v| v.record.name == "req").unwrap().counters.bad_keys;
    assert_eq!(bad_keys(&r), 3);

    // A peer MR granting no remote access.
    let pdo = r.qps.get(&qo).unwrap().pd;
    let closed = handle(&mut r, so, Request::RegMr { pd: pdo, addr: p, length: 64, access: access::LOCAL_WRITE, chunks: vec![] });
    assert_eq!(ask(&mut r, s, copy(q, closed, p, lkey, m, 8, false)), libc::EACCES, "no REMOTE_READ");
    assert_eq!(ask(&mut r, s, copy(q, closed, p, lkey, m, 8, true)), libc::EACCES, "no REMOTE_WRITE");

    // The requester's side: its own MR, within it, with LOCAL_WRITE to receive a READ.
    assert_eq!(ask(&mut r, s, copy(q, key, p, key, m, 8, false)), libc::EPERM, "the peer's MR named as the requester's");
    assert_eq!(ask(&mut r, s, copy(q, key, p, lkey, m + LEN as u64 - 4, 8, false)), libc::EPERM, "past its own MR");
    assert_eq!(ask(&mut r, s, copy(q, key, p, ro, m, 8, false)), libc::EPERM, "a READ into an MR without LOCAL_WRITE");
    r.handle_request(s, copy(q, key, p, ro, m, 8, true), vec![]).expect("a WRITE from it is fine");
    assert_eq!(bad_keys(&r), 5, "own-side refusals are not bad remote keys");

    // Not connected: a QP of the requester never connected, then the owner's reset.
    let cq = handle(&mut r, s, Request::CreateCq { cqe: 4 });
    let caps = QpCaps { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let lone = handle(&mut r, s, Request::CreateQp { pd, send_cq: cq, recv_cq: cq, srq: 0, qp_type: 2, caps });
    assert_eq!(ask(&mut r, s, copy(lone, key, p, lkey, m, 8, false)), libc::ENOTCONN);
    assert_eq!(ask(&mut r, so, copy(q, key, p, lkey, m, 8, false)), libc::EINVAL, "another session's QP");
    let reset = vrdma_abi::verbs::QpState::Reset as u8;
    r.handle_request(so, Request::SetQpState { qpn: qo, state: reset }, vec![]).unwrap();
    assert_eq!(ask(&mut r, s, copy(q, key, p, lkey, m, 8, false)), libc::ENOTCONN);
    assert!((0..LEN).all(|i| mine.byte(i) == pattern(2)(i)), "no refused copy wrote anything");
}

/// An in-place MR deregistered between `BeginRehome` and `RehomeMr` (its owner gave up the
/// move) leaves no copy waiting on its range: a second MR over the same memory (as a
/// registration cache makes) is copied at once.
#[test]
fn a_move_given_up_by_deregistration_holds_no_copy() {
    let Setup { mut r, s, pd, q, so, key, peer, .. } = setup();
    let mine = Buf::new(LEN, pattern(2));
    let lkey = handle(&mut r, s, Request::RegMr { pd, addr: mine.addr(), length: LEN as u64, access: access::LOCAL_WRITE, chunks: vec![] });
    r.handle_request(so, Request::BeginRehome { key }, vec![]).unwrap();
    r.handle_request(so, Request::DeregMr { key }, vec![]).unwrap();
    // The owner's only PD, the one `setup` made.
    let owner_pd = *r.sessions.get(&so).and_then(|x| x.pds.iter().next()).expect("the owner's PD");
    let again = handle(&mut r, so, Request::RegMr { pd: owner_pd, addr: peer.addr(), length: LEN as u64, access: ALL, chunks: vec![] });
    let t = std::time::Instant::now();
    r.handle_request(s, copy(q, again, peer.addr(), lkey, mine.addr(), LEN, false), vec![]).unwrap();
    assert!(t.elapsed() < std::time::Duration::from_secs(1), "the copy waited {:?} for a move given up", t.elapsed());
    assert!((0..LEN).all(|i| mine.byte(i) == peer.byte(i)), "READ after the move was given up");
}

/// A staged READ lands in the session's staging buffer (sealed, one for the session's life,
/// charged to its vNIC until the session ends), not in the requester's MR, which is checked
/// all the same; without the buffer, or for a WRITE, it is refused as bad input (counted).
#[test]
fn a_staged_read_fills_the_sessions_buffer_and_nothing_else() {
    let Setup { mut r, s, pd, q, key, peer, .. } = setup();
    let mine = Buf::new(LEN, pattern(2));
    let lkey = handle(&mut r, s, Request::RegMr { pd, addr: mine.addr(), length: LEN as u64, access: access::LOCAL_WRITE, chunks: vec![] });
    let ro = handle(&mut r, s, Request::RegMr { pd, addr: mine.addr(), length: LEN as u64, access: 0, chunks: vec![] });
    let staged = |lkey: u32, len: usize, to_peer: bool| {
        let mut c = copy(q, key, peer.addr() + 1, lkey, mine.addr() + 1, len, to_peer);
        if let Request::PeerMrCopy { staged, .. } = &mut c {
            *staged = true;
        }
        c
    };
    let ring_bytes = |r: &Registry| r.status().iter().find(|v| v.record.name == "req").unwrap().counters.ring_bytes;
    let refused = |r: &mut Registry, req: Request| {
        let e = r.handle_request(s, req, vec![]).map(|(reply, _)| panic!("expected an error, got {reply:?}")).unwrap_err();
        (e.errno(), e.is_bad_input())
    };
    assert_eq!(refused(&mut r, staged(lkey, 100, false)), (libc::EINVAL, true), "no staging buffer yet");
    let ring_before = ring_bytes(&r);
    let (reply, fds) = r.handle_request(s, Request::CopyStaging, vec![]).unwrap();
    assert_eq!((reply, fds.len()), (Reply::Ok, 1));
    assert_eq!(ring_bytes(&r), ring_before + vrdma_abi::control::MAX_DIRECT_COPY as u64);
    let (_, again) = r.handle_request(s, Request::CopyStaging, vec![]).unwrap();
    assert!(Arc::ptr_eq(&fds[0], &again[0]), "one buffer for the session");
    // The client cannot shrink it under vrdmad's mapping.
    // SAFETY: ftruncate of a descriptor we hold.
    assert_ne!(unsafe { libc::ftruncate(std::os::fd::AsRawFd::as_raw_fd(&*fds[0]), 0) }, 0, "sealed");
    let view = SharedMapping::map_sealed(fds[0].as_fd(), vrdma_abi::control::MAX_DIRECT_COPY, false).unwrap();

    let len = LEN - 1;
    r.handle_request(s, staged(lkey, len, false), vec![]).unwrap();
    let mut got = vec![0u8; len];
    view.region().read_into(0, &mut got).unwrap();
    assert!(got.iter().enumerate().all(|(i, &x)| x == peer.byte(1 + i)), "the peer's bytes, from the buffer's start");
    assert!((0..LEN).all(|i| mine.byte(i) == pattern(2)(i)), "the requester's MR untouched");

    assert_eq!(refused(&mut r, staged(ro, len, false)), (libc::EPERM, false), "an MR without LOCAL_WRITE");
    assert_eq!(refused(&mut r, staged(lkey, len, true)), (libc::EINVAL, true), "a staged WRITE");
    r.check_invariants().unwrap();
    r.close_session(s);
    assert_eq!(ring_bytes(&r), 0, "everything uncharged with the session, the buffer too");
}
