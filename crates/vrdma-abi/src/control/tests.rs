//! Round trips and refusals of the control codec.

use super::codec::Writer;
use super::header::frame;
use super::op::RequestOp;
use super::*;

fn all_requests() -> Vec<Request> {
    vec![
        Request::Hello { version: 1 },
        Request::AllocPd,
        Request::DeallocPd { pd: 3 },
        Request::RegMr { pd: 1, addr: 0x1000, length: 4096, access: 7, chunks: vec![MrChunk { mr_offset: 0, len: 4096, fd_offset: 0 }] },
        Request::DeregMr { key: 9 },
        Request::CreateCq { cqe: 100 },
        Request::DestroyCq { cq: 1 },
        Request::CreateSrq { pd: 1, max_wr: 10, max_sge: 2 },
        Request::DestroySrq { srq: 2 },
        Request::CreateQp {
            pd: 1,
            send_cq: 2,
            recv_cq: 3,
            srq: 0,
            qp_type: 2,
            caps: QpCaps { max_send_wr: 1, max_recv_wr: 2, max_send_sge: 3, max_recv_sge: 4, max_inline_data: 5 },
        },
        Request::SetQpState { qpn: 5, state: 6 },
        Request::ConnectQp { qpn: 5, dgid: [7; 16], dest_qpn: 8 },
        Request::DestroyQp { qpn: 5 },
        Request::MoveToEngine { qpn: 5 },
        Request::MapPeerMr { qpn: 5, key: 0xabcd },
        Request::QueryUsage,
        Request::CheckGid { dgid: [3; 16] },
        Request::ResolveUd { qpn: 5, dgid: [7; 16], dest_qpn: 9 },
        Request::MapUdPeerMr { qpn: 5, dest_qpn: 9, key: 0xabcd },
        Request::TakeRehomes,
        Request::BeginRehome { key: 0xabcd },
        Request::RehomeMr { key: 0xabcd, chunks: vec![MrChunk { mr_offset: 0, len: 4096, fd_offset: 8192 }] },
        Request::PeerMrWrite { qpn: 5, dest_qpn: 0, key: 0xabcd, addr: 0x1000, need_remote: true, data: vec![1, 2, 3] },
        Request::PeerMrRead { qpn: 5, dest_qpn: 9, key: 0xabcd, addr: 0x1000, len: 4096 },
        Request::PeerMrAtomic { qpn: 5, dest_qpn: 0, key: 1, addr: 8, cmp_swap: true, compare_add: 3, swap: 4 },
        Request::PeerMrCopy {
            qpn: 5,
            dest_qpn: 0,
            key: 0xabcd,
            addr: 0x1000,
            lkey: 0x77,
            local_addr: 0x9000,
            len: 1 << 20,
            to_peer: false,
            need_remote: true,
            staged: true,
        },
        Request::CopyStaging,
    ]
}

#[test]
fn requests_round_trip() {
    for (i, r) in all_requests().into_iter().enumerate() {
        let bytes = r.encode(i as u32);
        assert_eq!(Request::decode(&bytes).unwrap(), (i as u32, r));
    }
}

#[test]
fn replies_round_trip() {
    let replies = vec![
        Reply::Error { errno: 22, message: "bad".into() },
        Reply::Ok,
        Reply::Hello(VnicInfo { name: "a".into(), tenant: "t".into(), gids: vec![[1; 16]], limits: Limits::default(), node_guid: 5 }),
        Reply::Handle { handle: 4 },
        Reply::Mr { lkey: 1, rkey: 2 },
        Reply::Cq { cq: 3 },
        Reply::Srq { srq: 1, entries: 2, max_sge: 3 },
        Reply::Qp { qpn: 1, rq_entries: 2, max_recv_sge: 3, comp_entries: 4 },
        Reply::Connected(PeerInfo { qpn: 9, rq_ring: Some((4, 1)), comp_entries: 4, srq_ring: None }),
        Reply::PeerMr { addr: 1, length: 2, access: 3, chunks: vec![] },
        Reply::Bytes { data: vec![9; 100] },
        Reply::Atomic { old: 77 },
        Reply::ConnectedMediated { sq_entries: 1, max_sge: 2, max_inline: 3, comp_entries: 4 },
        Reply::UdRemote,
        Reply::Usage(Usage { clients: 1, pds: 2, cqs: 3, qps: 4, mrs: 5, mr_bytes: 6, srqs: 7 }),
        Reply::Keys { keys: vec![1, 0xdead_beef] },
    ];
    for r in replies {
        assert_eq!(Reply::decode(&r.encode(7)).unwrap(), (7, r));
    }
}

#[test]
fn every_truncation_is_an_error() {
    for r in all_requests() {
        let bytes = r.encode(1);
        for cut in 0..bytes.len() {
            assert!(Request::decode(&bytes[..cut]).is_err(), "{r:?} cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(Request::decode(&longer).is_err());
    }
}

#[test]
fn header_is_checked() {
    let mut b = Request::AllocPd.encode(1);
    b[0] ^= 1;
    assert!(matches!(Request::decode(&b), Err(DecodeError::BadMagic { .. })));
    let mut b = Request::AllocPd.encode(1);
    b[4] = 0x7f;
    assert!(matches!(Request::decode(&b), Err(DecodeError::BadVersion { .. })));
    let mut b = Request::AllocPd.encode(1);
    b[6] = 0x77;
    assert!(matches!(Request::decode(&b), Err(DecodeError::UnknownOp { .. })));
    let mut huge = Request::AllocPd.encode(1);
    huge.resize(MAX_MESSAGE + 1, 0);
    assert!(matches!(Request::decode(&huge), Err(DecodeError::TooLong { .. })));
    let w = {
        let mut w = Writer::default();
        w.u32(1).u64(0).u64(0).u32(0).u16(65535);
        w
    };
    assert!(matches!(Request::decode(&frame(RequestOp::RegMr as u16, 1, w)), Err(DecodeError::TooMany { .. })));
}

/// A direct copy longer than [`MAX_DIRECT_COPY`], or with a flag byte other than 0 or 1, is
/// refused at decoding.
#[test]
fn a_direct_copy_is_bounded() {
    let copy = |len: u32, to_peer: u8| {
        let mut w = Writer::default();
        w.u32(5).u32(0).u32(0xabcd).u64(0x1000).u32(0x77).u64(0x9000).u32(len).u8(to_peer).u8(1).u8(0);
        Request::decode(&frame(RequestOp::PeerMrCopy as u16, 1, w))
    };
    assert!(copy(MAX_DIRECT_COPY as u32, 1).is_ok());
    assert!(matches!(copy(MAX_DIRECT_COPY as u32 + 1, 1), Err(DecodeError::BadValue { field: "copy length", .. })));
    assert!(matches!(copy(8, 2), Err(DecodeError::BadValue { field: "to_peer", .. })));
}
