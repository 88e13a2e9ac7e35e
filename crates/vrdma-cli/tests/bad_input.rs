//! vrdmad against hostile clients: garbage, truncated and oversized messages, stale
//! handles, another vNIC's handles, out-of-range sizes. Each gets an error reply (or its
//! connection closed), is counted, and nothing else is affected.

mod common;
use common::*;
use vrdma_abi::channel::Channel;
use vrdma_abi::control::{QpCaps, Reply, Request, MAX_MESSAGE};

fn call(ch: &Channel, req: &Request) -> Reply {
    ch.send(&req.encode(1), &[]).unwrap();
    let (m, _) = ch.recv().unwrap();
    Reply::decode(&m).unwrap().1
}

fn errno(r: Reply) -> i32 {
    match r {
        Reply::Error { errno, .. } => errno,
        other => panic!("expected an error, got {other:?}"),
    }
}

#[test]
fn hostile_clients_get_errors_and_others_keep_working() {
    let d = Daemon::start("bad");
    d.ok(&["vnic", "create", "evil", "--tenant", "t"]);
    d.ok(&["vnic", "create", "good", "--tenant", "t"]);
    let good = Channel::connect(&d.socket("good")).unwrap();
    let good_pd = match call(&good, &Request::AllocPd) {
        Reply::Handle { handle } => handle,
        r => panic!("{r:?}"),
    };
    // An empty datagram reads like end-of-stream: the daemon closes that connection.
    let evil = Channel::connect(&d.socket("evil")).unwrap();
    evil.send(&[], &[]).unwrap();
    assert!(evil.recv().is_err());
    let evil = Channel::connect(&d.socket("evil")).unwrap();
    // Garbage and truncated messages: error replies, connection stays usable.
    let mut rng = 0x1234_5678u64;
    for len in [1usize, 7, 15, 16, 17, 100, 4000] {
        let junk: Vec<u8> = (0..len)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng as u8
            })
            .collect();
        evil.send(&junk, &[]).unwrap();
        let (m, _) = evil.recv().unwrap();
        assert!(matches!(Reply::decode(&m).unwrap().1, Reply::Error { .. }));
    }
    let full = Request::CreateQp { pd: 1, send_cq: 2, recv_cq: 3, srq: 0, qp_type: 2, caps: QpCaps::default() }.encode(5);
    for cut in [17, full.len() - 1] {
        evil.send(&full[..cut], &[]).unwrap();
        let (m, _) = evil.recv().unwrap();
        assert!(matches!(Reply::decode(&m).unwrap().1, Reply::Error { .. }));
    }
    // Stale handles, handles of another vNIC, out-of-range sizes.
    assert_eq!(errno(call(&evil, &Request::DeallocPd { pd: 99999 })), libc::EINVAL);
    assert_eq!(errno(call(&evil, &Request::DeallocPd { pd: good_pd })), libc::EINVAL);
    assert_eq!(errno(call(&evil, &Request::DestroyQp { qpn: 0xffffff })), libc::EINVAL);
    assert_eq!(errno(call(&evil, &Request::DeregMr { key: 0xdead_beef })), libc::EINVAL);
    assert_eq!(errno(call(&evil, &Request::MapPeerMr { qpn: 1, key: 1 })), libc::EINVAL);
    let evil_pd = match call(&evil, &Request::AllocPd) {
        Reply::Handle { handle } => handle,
        r => panic!("{r:?}"),
    };
    assert_eq!(errno(call(&evil, &Request::CreateCq { cqe: u32::MAX })), libc::EINVAL);
    assert_eq!(errno(call(&evil, &Request::CreateSrq { pd: evil_pd, max_wr: 1 << 30, max_sge: 1 })), libc::EINVAL);
    let cq = match call(&evil, &Request::CreateCq { cqe: 4 }) {
        Reply::Cq { cq } => cq,
        r => panic!("{r:?}"),
    };
    let big = QpCaps { max_send_wr: 1, max_recv_wr: u32::MAX, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    assert_eq!(
        errno(call(&evil, &Request::CreateQp { pd: evil_pd, send_cq: cq, recv_cq: cq, srq: 0, qp_type: 2, caps: big })),
        libc::EINVAL
    );
    // An MR whose chunks don't tile the region, or come without fds.
    let reg = Request::RegMr {
        pd: evil_pd,
        addr: 0x10000,
        length: 4096,
        access: 1,
        chunks: vec![vrdma_abi::control::MrChunk { mr_offset: 0, len: 4096, fd_offset: 0 }],
    };
    assert_eq!(errno(call(&evil, &reg)), libc::EINVAL);
    let memfd = vrdma_abi::shm::create_memfd("unsealed", 4096, false).unwrap();
    use std::os::fd::AsRawFd;
    evil.send(&reg.encode(2), &[memfd.as_raw_fd()]).unwrap();
    let (m, _) = evil.recv().unwrap();
    assert!(matches!(Reply::decode(&m).unwrap().1, Reply::Error { errno: libc::EINVAL, .. }), "unsealed memfds are refused");
    // Oversized: the connection is closed.
    evil.send(&vec![0u8; MAX_MESSAGE + 100], &[]).unwrap();
    assert!(evil.recv().is_err(), "oversized message closes the connection");
    // Counted against the evil vNIC only, and logged.
    let bad = d.vnic("evil")["counters"]["bad_requests"].as_u64().unwrap();
    assert!(bad >= 16, "bad requests counted: {bad}");
    assert_eq!(d.vnic("good")["counters"]["bad_requests"].as_u64(), Some(0));
    assert!(d.log().contains("bad message") || d.log().contains("refused"), "{}", d.log());
    // The good vNIC is untouched: its PD still works and full verbs still run.
    assert_eq!(call(&good, &Request::DeallocPd { pd: good_pd }), Reply::Ok);
    let ctx = vrdma::Context::open(&d.socket("good")).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let _buf = vrdma::MrBuf::new(&pd, 4096, vrdma::access::LOCAL_WRITE).unwrap();
    // And the evil vNIC's leftovers are reclaimed once it disconnects.
    drop(evil);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while d.vnic("evil")["usage"]["clients"] != 0 {
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(d.vnic("evil")["usage"]["pds"], 0);
}
