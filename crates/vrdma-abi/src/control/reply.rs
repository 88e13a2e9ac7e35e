//! Encoding and decoding of [`Reply`]s.

use super::codec::{read_chunks, write_chunks, Reader, Writer};
use super::header::{frame, unframe};
use super::op::ReplyOp;
use super::{DecodeError, Limits, PeerInfo, Reply, Usage, VnicInfo, MAX_KEYS};

impl Reply {
    /// Encodes with sequence number `seq`.
    pub fn encode(&self, seq: u32) -> Vec<u8> {
        let mut w = Writer::default();
        let op = match self {
            Reply::Error { errno, message } => {
                w.i32(*errno).string(message);
                ReplyOp::Error
            }
            Reply::Ok => ReplyOp::Ok,
            Reply::Hello(v) => {
                w.string(&v.name).string(&v.tenant).count(v.gids.len());
                for g in &v.gids {
                    w.gid(g);
                }
                let l = &v.limits;
                w.u32(l.max_pd).u32(l.max_cq).u32(l.max_qp).u32(l.max_mr).u64(l.max_mr_bytes).u32(l.max_srq).u64(v.node_guid);
                ReplyOp::Hello
            }
            Reply::Handle { handle } => {
                w.u32(*handle);
                ReplyOp::Handle
            }
            Reply::Mr { lkey, rkey } => {
                w.u32(*lkey).u32(*rkey);
                ReplyOp::Mr
            }
            Reply::Cq { cq } => {
                w.u32(*cq);
                ReplyOp::Cq
            }
            Reply::Srq { srq, entries, max_sge } => {
                w.u32(*srq).u32(*entries).u32(*max_sge);
                ReplyOp::Srq
            }
            Reply::Qp { qpn, rq_entries, max_recv_sge, comp_entries } => {
                w.u32(*qpn).u32(*rq_entries).u32(*max_recv_sge).u32(*comp_entries);
                ReplyOp::Qp
            }
            Reply::Connected(p) => {
                w.u32(p.qpn);
                write_ring(&mut w, p.rq_ring);
                w.u32(p.comp_entries);
                write_ring(&mut w, p.srq_ring);
                ReplyOp::Connected
            }
            Reply::ConnectedMediated { sq_entries, max_sge, max_inline, comp_entries } => {
                w.u32(*sq_entries).u32(*max_sge).u32(*max_inline).u32(*comp_entries);
                ReplyOp::ConnectedMediated
            }
            Reply::UdRemote => ReplyOp::UdRemote,
            Reply::PeerMr { addr, length, access, chunks } => {
                w.u64(*addr).u64(*length).u32(*access);
                write_chunks(&mut w, chunks);
                ReplyOp::PeerMr
            }
            Reply::Bytes { data } => {
                w.bytes(data);
                ReplyOp::Bytes
            }
            Reply::Atomic { old } => {
                w.u64(*old);
                ReplyOp::Atomic
            }
            Reply::Usage(u) => {
                w.u32(u.clients).u32(u.pds).u32(u.cqs).u32(u.qps).u32(u.mrs).u64(u.mr_bytes).u32(u.srqs);
                ReplyOp::Usage
            }
            Reply::Keys { keys } => {
                let keys = &keys[..keys.len().min(MAX_KEYS)];
                w.count(keys.len());
                keys.iter().for_each(|k| {
                    w.u32(*k);
                });
                ReplyOp::Keys
            }
        };
        frame(op as u16, seq, w)
    }

    /// Decodes a received datagram.
    pub fn decode(buf: &[u8]) -> Result<(u32, Reply), DecodeError> {
        unframe(buf, |op, r| {
            let op = ReplyOp::from_u16(op).ok_or(DecodeError::UnknownOp { op })?;
            Ok(match op {
                ReplyOp::Error => Reply::Error { errno: r.i32()?, message: r.string()? },
                ReplyOp::Ok => Reply::Ok,
                ReplyOp::Hello => {
                    let name = r.string()?;
                    let tenant = r.string()?;
                    let n = r.count("GID", 128)?;
                    let gids = (0..n).map(|_| r.gid()).collect::<Result<_, _>>()?;
                    let limits = Limits {
                        max_pd: r.u32()?,
                        max_cq: r.u32()?,
                        max_qp: r.u32()?,
                        max_mr: r.u32()?,
                        max_mr_bytes: r.u64()?,
                        max_srq: r.u32()?,
                        ..Limits::default()
                    };
                    Reply::Hello(VnicInfo { name, tenant, gids, limits, node_guid: r.u64()? })
                }
                ReplyOp::Handle => Reply::Handle { handle: r.u32()? },
                ReplyOp::Mr => Reply::Mr { lkey: r.u32()?, rkey: r.u32()? },
                ReplyOp::Cq => Reply::Cq { cq: r.u32()? },
                ReplyOp::Srq => Reply::Srq { srq: r.u32()?, entries: r.u32()?, max_sge: r.u32()? },
                ReplyOp::Qp => Reply::Qp { qpn: r.u32()?, rq_entries: r.u32()?, max_recv_sge: r.u32()?, comp_entries: r.u32()? },
                ReplyOp::Connected => {
                    Reply::Connected(PeerInfo { qpn: r.u32()?, rq_ring: read_ring(r)?, comp_entries: r.u32()?, srq_ring: read_ring(r)? })
                }
                ReplyOp::ConnectedMediated => {
                    Reply::ConnectedMediated { sq_entries: r.u32()?, max_sge: r.u32()?, max_inline: r.u32()?, comp_entries: r.u32()? }
                }
                ReplyOp::UdRemote => Reply::UdRemote,
                ReplyOp::PeerMr => Reply::PeerMr { addr: r.u64()?, length: r.u64()?, access: r.u32()?, chunks: read_chunks(r)? },
                ReplyOp::Bytes => Reply::Bytes { data: r.bytes()? },
                ReplyOp::Atomic => Reply::Atomic { old: r.u64()? },
                ReplyOp::Usage => Reply::Usage(Usage {
                    clients: r.u32()?,
                    pds: r.u32()?,
                    cqs: r.u32()?,
                    qps: r.u32()?,
                    mrs: r.u32()?,
                    mr_bytes: r.u64()?,
                    srqs: r.u32()?,
                }),
                ReplyOp::Keys => {
                    let n = r.count("MR key", MAX_KEYS)?;
                    Reply::Keys { keys: (0..n).map(|_| r.u32()).collect::<Result<_, _>>()? }
                }
            })
        })
    }
}

/// Writes one of a [`PeerInfo`]'s rings (receive queue or SRQ): present, entries, max_sge.
fn write_ring(w: &mut Writer, ring: Option<(u32, u32)>) {
    match ring {
        Some((e, s)) => w.u8(1).u32(e).u32(s),
        None => w.u8(0).u32(0).u32(0),
    };
}

/// Reads what [`write_ring`] wrote.
fn read_ring(r: &mut Reader<'_>) -> Result<Option<(u32, u32)>, DecodeError> {
    let present = r.u8()?;
    let (e, s) = (r.u32()?, r.u32()?);
    match present {
        0 => Ok(None),
        1 => Ok(Some((e, s))),
        v => Err(DecodeError::BadValue { field: "ring present", value: u64::from(v) }),
    }
}
