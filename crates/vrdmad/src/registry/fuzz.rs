//! Stateful fuzzing of the control protocol: sequences of requests from several clients of
//! two vNICs of different tenants, with handles taken from earlier replies (theirs or the
//! other clients'), sessions opening and closing, vNICs deleted and re-added, limits changed
//! midway. After every step the registry's bookkeeping must hold
//! ([`Registry::check_invariants`]) and nothing may panic.

use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;

use vrdma_abi::control::{Limits, MrChunk, QpCaps, Reply, Request};
use vrdma_abi::shm;

use super::{gid_of, Registry};
use crate::fuzz_choices::Choices;
use crate::store::VnicRecord;

fn vnic(name: &str, tenant: &str, ip: u8) -> VnicRecord {
    VnicRecord {
        name: name.into(),
        tenant: tenant.into(),
        ip: Ipv4Addr::new(198, 18, 0, ip),
        prefix_len: 15,
        limits: small_limits(),
        node_guid: u64::from(ip),
        host: String::new(),
        qos: Default::default(),
    }
}

/// Limits small enough that sequences reach them.
fn small_limits() -> Limits {
    Limits {
        max_pd: 4,
        max_cq: 6,
        max_qp: 6,
        max_mr: 6,
        max_mr_bytes: 1 << 20,
        max_srq: 3,
        max_sessions: 3,
        max_ring_bytes: 8 << 20,
        max_fds: 10,
        ..Limits::default()
    }
}

/// Handles seen in replies (every client's: a hostile client guesses others' too).
#[derive(Default)]
struct Seen {
    handles: Vec<u32>,
    qpns: Vec<u32>,
    keys: Vec<u32>,
}

impl Seen {
    fn pick(list: &[u32], c: &mut Choices) -> Option<u32> {
        let b = c.byte()?;
        Some(match list.len() {
            _ if b >= 250 => c.u32()?,
            0 => u32::from(b),
            n => list[usize::from(b) % n],
        })
    }
}

/// Runs one sequence; returns how many requests succeeded. Panics (the fuzzer's finding) if
/// the registry's bookkeeping breaks.
pub fn fuzz_requests(data: &[u8]) -> usize {
    let mut r = Registry::default();
    let names = [("a", "red", 2), ("b", "blue", 3)];
    for (n, t, ip) in names {
        r.add_vnic(vnic(n, t, ip));
    }
    let mut sessions: Vec<u64> = Vec::new();
    let mut seen = Seen::default();
    let mut c = Choices(data);
    let mut succeeded = 0;
    for _ in 0..200 {
        let Some(op) = c.byte() else { break };
        // The step's kind, and for the vNIC steps which vNIC and how.
        let (which, how) = (usize::from(op / 25) % 2, op / 50 % 3);
        match op % 25 {
            0 => {
                let (n, _, _) = names[which];
                if let Ok(s) = r.open_session(n, None) {
                    sessions.push(s);
                }
            }
            1 => {
                if let Some(i) = c.byte().filter(|_| !sessions.is_empty()) {
                    let s = sessions.swap_remove(usize::from(i) % sessions.len());
                    r.close_session(s);
                }
            }
            2 => {
                // Deleted by an administrator (refused while in use), deleted in the store
                // (forced: sessions stay, orphaned), or (re-)added.
                let (n, t, ip) = names[which];
                match how {
                    0 => drop(r.remove_vnic(n)),
                    1 => drop(r.remove_vnic_forced(n)),
                    _ => r.add_vnic(vnic(n, t, ip)),
                }
            }
            3 => {
                // Limits changed under live objects (they apply to new allocations).
                let (n, t, ip) = names[which];
                let Some(ring) = c.small() else { break };
                let limits = Limits { max_ring_bytes: u64::from(ring) << 16, max_qp: ring % 8, ..small_limits() };
                if r.has_vnic(n) {
                    r.add_vnic(VnicRecord { limits, ..vnic(n, t, ip) });
                }
            }
            _ => {
                let Some(i) = c.byte() else { break };
                let Some(&s) = sessions.get(usize::from(i) % sessions.len().max(1)) else { continue };
                let Some((req, fds)) = request(op % 25, &mut c, &seen) else { break };
                let vnic = r.sessions[&s].vnic.clone();
                let before = r.limited_amounts(&vnic);
                if let Ok((reply, _fds)) = r.handle_request(s, req, fds) {
                    succeeded += 1;
                    // Whatever grew must have stayed within its limit (limits lowered
                    // under live objects leave them over it, and refuse new ones).
                    for ((what, was, _), (_, now, limit)) in before.iter().zip(r.limited_amounts(&vnic)) {
                        assert!(now <= *was || now <= limit, "vNIC {vnic}: {what} grew from {was} to {now}, over its limit {limit}");
                    }
                    match reply {
                        Reply::Handle { handle } | Reply::Cq { cq: handle } | Reply::Srq { srq: handle, .. } => seen.handles.push(handle),
                        Reply::Qp { qpn, .. } => seen.qpns.push(qpn),
                        Reply::Mr { lkey, rkey } => seen.keys.extend([lkey, rkey]),
                        _ => {}
                    }
                }
            }
        }
        if let Err(e) = r.check_invariants() {
            panic!("after op {op}: {e}");
        }
    }
    for s in sessions {
        r.close_session(s);
    }
    if let Err(e) = r.check_invariants() {
        panic!("after every session closed: {e}");
    }
    succeeded
}

/// One request of kind `kind` (4..25) with fields from the fuzzer's bytes.
fn request(kind: u8, c: &mut Choices, seen: &Seen) -> Option<(Request, Vec<OwnedFd>)> {
    let h = |c: &mut Choices| Seen::pick(&seen.handles, c);
    let qpn = |c: &mut Choices| Seen::pick(&seen.qpns, c);
    let key = |c: &mut Choices| Seen::pick(&seen.keys, c);
    let gid = |c: &mut Choices| -> Option<[u8; 16]> { Some(gid_of(Ipv4Addr::new(198, 18, 0, c.byte()? % 5))) };
    let req = match kind {
        4 => Request::AllocPd,
        5 => Request::DeallocPd { pd: h(c)? },
        6 => Request::CreateCq { cqe: c.small()? },
        7 => Request::DestroyCq { cq: h(c)? },
        8 => Request::CreateSrq { pd: h(c)?, max_wr: c.small()? << (c.byte()? % 8), max_sge: c.small()? },
        9 => Request::DestroySrq { srq: h(c)? },
        10 | 11 => {
            let caps = QpCaps {
                max_send_wr: c.small()?,
                max_recv_wr: c.small()? << (c.byte()? % 8),
                max_send_sge: c.small()?,
                max_recv_sge: c.small()?,
                max_inline_data: c.small()?,
            };
            let srq = if c.byte()? % 2 == 0 { 0 } else { h(c)? };
            let qp_type = [2, 4, c.byte()?][usize::from(c.byte()? % 3)];
            Request::CreateQp { pd: h(c)?, send_cq: h(c)?, recv_cq: h(c)?, srq, qp_type, caps }
        }
        12 => Request::SetQpState { qpn: qpn(c)?, state: c.byte()? % 8 },
        13 => Request::ConnectQp { qpn: qpn(c)?, dgid: gid(c)?, dest_qpn: qpn(c)? },
        14 => Request::DestroyQp { qpn: qpn(c)? },
        15 => Request::MapPeerMr { qpn: qpn(c)?, key: key(c)? },
        16 => Request::DeregMr { key: key(c)? },
        17 | 18 => {
            let pd = h(c)?;
            return reg_mr(c, pd);
        }
        19 => Request::QueryUsage,
        20 => Request::CheckGid { dgid: gid(c)? },
        21 => Request::ResolveUd { qpn: qpn(c)?, dgid: gid(c)?, dest_qpn: qpn(c)? },
        22 => Request::MapUdPeerMr { qpn: qpn(c)?, dest_qpn: qpn(c)?, key: key(c)? },
        23 => Request::MoveToEngine { qpn: qpn(c)? },
        _ if c.byte()? < 128 => Request::BeginRehome { key: key(c)? },
        _ if c.byte()? < 32 => Request::CopyStaging,
        // A direct copy naming a key of the caller's (vrdmad maps its memfds) or anyone's.
        _ => Request::PeerMrCopy {
            qpn: qpn(c)?,
            dest_qpn: if c.byte()? % 2 == 0 { 0 } else { qpn(c)? },
            key: key(c)?,
            addr: 0x7f00_0000_0000 + u64::from(c.small()?),
            lkey: key(c)?,
            local_addr: 0x7f00_0000_0000 + u64::from(c.small()?),
            len: c.small()?,
            to_peer: c.byte()? % 2 == 0,
            need_remote: c.byte()? % 2 == 0,
            staged: c.byte()? % 2 == 0,
        },
    };
    Some((req, Vec::new()))
}

/// A `RegMr` of a fresh memfd of a few pages, its chunks as the fuzzer's bytes say (in
/// range or not).
fn reg_mr(c: &mut Choices, pd: u32) -> Option<(Request, Vec<OwnedFd>)> {
    let pages = u64::from(c.byte()? % 4 + 1);
    let page = 4096u64;
    let n = usize::from(c.byte()? % 3);
    let mut chunks = Vec::new();
    let mut fds = Vec::new();
    for i in 0..n {
        let odd = c.byte()?;
        let len = if odd < 200 { pages * page } else { u64::from(odd) * 17 };
        chunks.push(MrChunk { mr_offset: i as u64 * pages * page, len, fd_offset: if odd % 7 == 0 { page } else { 0 } });
        fds.push(shm::create_memfd("fuzz-mr", (pages * page) as usize, c.byte()? % 2 == 0).ok()?);
    }
    let length = u64::from(c.small()?).min(n as u64 * pages * page + 64);
    let addr = 0x7f00_0000_0000 + u64::from(c.byte()?) * 8;
    Some((Request::RegMr { pd, addr, length, access: u32::from(c.byte()?) & 0x1f, chunks }, fds))
}

/// A sequence that exercises every kind of step (the fuzzer's seed): both vNICs' clients
/// create PDs, CQs, SRQs, QPs and MRs, use each other's handles, close with objects held,
/// and vNICs are deleted and limits lowered under them.
pub fn seed_sequence() -> Vec<u8> {
    // (Opening sessions on a and b: steps 0 and 25; see `fuzz_requests`.)
    let mut seq = vec![0, 25, 0, 25];
    for round in 0..40u8 {
        seq.extend_from_slice(&[0, 25, 4, round % 3, 6, round % 3, 16, 8, round % 3, 0, 64, 2, 4]);
        seq.extend_from_slice(&[10 + round % 2, round % 3, 8, 16, 1, 1, 1, 0, 2, 0, 0, 1, 1]);
        seq.extend_from_slice(&[17, round % 3, 0, 1, 2, 10, 1, 5, 9, 40, 7, 12, round % 3, 0, 3]);
        if round % 5 == 0 {
            // Close a session, try to delete a (refused while in use), lower b's limits,
            // delete b in the store under its sessions, add it again.
            seq.extend_from_slice(&[1, round, 2, 28, 3, 77, 127, 0, 25]);
        }
    }
    seq
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A few hand-made sequences: a full object lifecycle on both vNICs, handles used
    /// across sessions, sessions closed with objects held, the vNIC deleted under them.
    #[test]
    fn request_sequences_keep_the_books() {
        fuzz_requests(b"");
        fuzz_requests(&[0, 24, 4, 0, 4, 1, 6, 0, 16, 6, 1, 16, 10, 0, 0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 2, 0]);
        let made = fuzz_requests(&seed_sequence());
        assert!(made >= 20, "the seed reaches the registry's objects: {made} requests succeeded");
    }
}
