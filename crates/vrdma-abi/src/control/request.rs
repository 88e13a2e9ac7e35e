//! Encoding and decoding of [`Request`]s.

use super::codec::{read_chunks, write_chunks, Writer};
use super::header::{frame, unframe};
use super::op::RequestOp;
use super::{DecodeError, QpCaps, Request, MAX_COPY_DATA, MAX_DIRECT_COPY};

impl Request {
    /// Encodes with sequence number `seq`.
    pub fn encode(&self, seq: u32) -> Vec<u8> {
        let mut w = Writer::default();
        let op = match self {
            Request::Hello { version } => {
                w.u32(*version);
                RequestOp::Hello
            }
            Request::AllocPd => RequestOp::AllocPd,
            Request::DeallocPd { pd } => {
                w.u32(*pd);
                RequestOp::DeallocPd
            }
            Request::RegMr { pd, addr, length, access, chunks } => {
                w.u32(*pd).u64(*addr).u64(*length).u32(*access);
                write_chunks(&mut w, chunks);
                RequestOp::RegMr
            }
            Request::DeregMr { key } => {
                w.u32(*key);
                RequestOp::DeregMr
            }
            Request::CreateCq { cqe } => {
                w.u32(*cqe);
                RequestOp::CreateCq
            }
            Request::DestroyCq { cq } => {
                w.u32(*cq);
                RequestOp::DestroyCq
            }
            Request::CreateSrq { pd, max_wr, max_sge } => {
                w.u32(*pd).u32(*max_wr).u32(*max_sge);
                RequestOp::CreateSrq
            }
            Request::DestroySrq { srq } => {
                w.u32(*srq);
                RequestOp::DestroySrq
            }
            Request::CreateQp { pd, send_cq, recv_cq, srq, qp_type, caps } => {
                w.u32(*pd).u32(*send_cq).u32(*recv_cq).u32(*srq).u8(*qp_type);
                w.u32(caps.max_send_wr).u32(caps.max_recv_wr).u32(caps.max_send_sge).u32(caps.max_recv_sge).u32(caps.max_inline_data);
                RequestOp::CreateQp
            }
            Request::SetQpState { qpn, state } => {
                w.u32(*qpn).u8(*state);
                RequestOp::SetQpState
            }
            Request::ConnectQp { qpn, dgid, dest_qpn } => {
                w.u32(*qpn).gid(dgid).u32(*dest_qpn);
                RequestOp::ConnectQp
            }
            Request::DestroyQp { qpn } => {
                w.u32(*qpn);
                RequestOp::DestroyQp
            }
            Request::MoveToEngine { qpn } => {
                w.u32(*qpn);
                RequestOp::MoveToEngine
            }
            Request::MapPeerMr { qpn, key } => {
                w.u32(*qpn).u32(*key);
                RequestOp::MapPeerMr
            }
            Request::QueryUsage => RequestOp::QueryUsage,
            Request::CheckGid { dgid } => {
                w.gid(dgid);
                RequestOp::CheckGid
            }
            Request::ResolveUd { qpn, dgid, dest_qpn } => {
                w.u32(*qpn).gid(dgid).u32(*dest_qpn);
                RequestOp::ResolveUd
            }
            Request::MapUdPeerMr { qpn, dest_qpn, key } => {
                w.u32(*qpn).u32(*dest_qpn).u32(*key);
                RequestOp::MapUdPeerMr
            }
            Request::PeerMrWrite { qpn, dest_qpn, key, addr, need_remote, data } => {
                w.u32(*qpn).u32(*dest_qpn).u32(*key).u64(*addr).u8(u8::from(*need_remote)).bytes(data);
                RequestOp::PeerMrWrite
            }
            Request::PeerMrRead { qpn, dest_qpn, key, addr, len } => {
                w.u32(*qpn).u32(*dest_qpn).u32(*key).u64(*addr).u32(*len);
                RequestOp::PeerMrRead
            }
            Request::PeerMrAtomic { qpn, dest_qpn, key, addr, cmp_swap, compare_add, swap } => {
                w.u32(*qpn).u32(*dest_qpn).u32(*key).u64(*addr).u8(u8::from(*cmp_swap)).u64(*compare_add).u64(*swap);
                RequestOp::PeerMrAtomic
            }
            Request::PeerMrCopy { qpn, dest_qpn, key, addr, lkey, local_addr, len, to_peer, need_remote, staged } => {
                w.u32(*qpn).u32(*dest_qpn).u32(*key).u64(*addr).u32(*lkey).u64(*local_addr).u32(*len);
                w.u8(u8::from(*to_peer)).u8(u8::from(*need_remote)).u8(u8::from(*staged));
                RequestOp::PeerMrCopy
            }
            Request::CopyStaging => RequestOp::CopyStaging,
            Request::TakeRehomes => RequestOp::TakeRehomes,
            Request::BeginRehome { key } => {
                w.u32(*key);
                RequestOp::BeginRehome
            }
            Request::RehomeMr { key, chunks } => {
                w.u32(*key);
                write_chunks(&mut w, chunks);
                RequestOp::RehomeMr
            }
        };
        frame(op as u16, seq, w)
    }

    /// Decodes a received datagram; returns the header's sequence number too.
    pub fn decode(buf: &[u8]) -> Result<(u32, Request), DecodeError> {
        unframe(buf, |op, r| {
            let op = RequestOp::from_u16(op).ok_or(DecodeError::UnknownOp { op })?;
            Ok(match op {
                RequestOp::Hello => Request::Hello { version: r.u32()? },
                RequestOp::AllocPd => Request::AllocPd,
                RequestOp::DeallocPd => Request::DeallocPd { pd: r.u32()? },
                RequestOp::RegMr => {
                    Request::RegMr { pd: r.u32()?, addr: r.u64()?, length: r.u64()?, access: r.u32()?, chunks: read_chunks(r)? }
                }
                RequestOp::DeregMr => Request::DeregMr { key: r.u32()? },
                RequestOp::CreateCq => Request::CreateCq { cqe: r.u32()? },
                RequestOp::DestroyCq => Request::DestroyCq { cq: r.u32()? },
                RequestOp::CreateSrq => Request::CreateSrq { pd: r.u32()?, max_wr: r.u32()?, max_sge: r.u32()? },
                RequestOp::DestroySrq => Request::DestroySrq { srq: r.u32()? },
                RequestOp::CreateQp => Request::CreateQp {
                    pd: r.u32()?,
                    send_cq: r.u32()?,
                    recv_cq: r.u32()?,
                    srq: r.u32()?,
                    qp_type: r.u8()?,
                    caps: QpCaps {
                        max_send_wr: r.u32()?,
                        max_recv_wr: r.u32()?,
                        max_send_sge: r.u32()?,
                        max_recv_sge: r.u32()?,
                        max_inline_data: r.u32()?,
                    },
                },
                RequestOp::SetQpState => Request::SetQpState { qpn: r.u32()?, state: r.u8()? },
                RequestOp::ConnectQp => Request::ConnectQp { qpn: r.u32()?, dgid: r.gid()?, dest_qpn: r.u32()? },
                RequestOp::DestroyQp => Request::DestroyQp { qpn: r.u32()? },
                RequestOp::MoveToEngine => Request::MoveToEngine { qpn: r.u32()? },
                RequestOp::MapPeerMr => Request::MapPeerMr { qpn: r.u32()?, key: r.u32()? },
                RequestOp::QueryUsage => Request::QueryUsage,
                RequestOp::CheckGid => Request::CheckGid { dgid: r.gid()? },
                RequestOp::ResolveUd => Request::ResolveUd { qpn: r.u32()?, dgid: r.gid()?, dest_qpn: r.u32()? },
                RequestOp::MapUdPeerMr => Request::MapUdPeerMr { qpn: r.u32()?, dest_qpn: r.u32()?, key: r.u32()? },
                RequestOp::PeerMrWrite => Request::PeerMrWrite {
                    qpn: r.u32()?,
                    dest_qpn: r.u32()?,
                    key: r.u32()?,
                    addr: r.u64()?,
                    need_remote: r.flag("need_remote")?,
                    data: r.bytes()?,
                },
                RequestOp::PeerMrRead => {
                    let (qpn, dest_qpn, key, addr, len) = (r.u32()?, r.u32()?, r.u32()?, r.u64()?, r.u32()?);
                    if len as usize > MAX_COPY_DATA {
                        return Err(DecodeError::BadValue { field: "read length", value: u64::from(len) });
                    }
                    Request::PeerMrRead { qpn, dest_qpn, key, addr, len }
                }
                RequestOp::PeerMrAtomic => Request::PeerMrAtomic {
                    qpn: r.u32()?,
                    dest_qpn: r.u32()?,
                    key: r.u32()?,
                    addr: r.u64()?,
                    cmp_swap: r.flag("cmp_swap")?,
                    compare_add: r.u64()?,
                    swap: r.u64()?,
                },
                RequestOp::PeerMrCopy => {
                    let (qpn, dest_qpn, key, addr) = (r.u32()?, r.u32()?, r.u32()?, r.u64()?);
                    let (lkey, local_addr, len) = (r.u32()?, r.u64()?, r.u32()?);
                    if len as usize > MAX_DIRECT_COPY {
                        return Err(DecodeError::BadValue { field: "copy length", value: u64::from(len) });
                    }
                    let (to_peer, need_remote, staged) = (r.flag("to_peer")?, r.flag("need_remote")?, r.flag("staged")?);
                    Request::PeerMrCopy { qpn, dest_qpn, key, addr, lkey, local_addr, len, to_peer, need_remote, staged }
                }
                RequestOp::CopyStaging => Request::CopyStaging,
                RequestOp::TakeRehomes => Request::TakeRehomes,
                RequestOp::BeginRehome => Request::BeginRehome { key: r.u32()? },
                RequestOp::RehomeMr => Request::RehomeMr { key: r.u32()?, chunks: read_chunks(r)? },
            })
        })
    }
}
