//! The daemon's state: vNICs, client sessions and every verbs object they hold, and the
//! handling of each control request (validation, limits, connection brokering).
//!
//! Everything a request names (handles, QPNs, keys) is looked up *within the caller's
//! session*; a stale handle or one of another vNIC gets an error reply and is counted.

use std::collections::{HashMap, HashSet};
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vrdma_abi::control::{Limits, MrChunk, PeerInfo, QpCaps, Reply, Request, Usage, VnicInfo, VERSION};
use vrdma_abi::ring::{self, QpRegionLayout, RecvRing, RecvRingLayout};
use vrdma_abi::shm::{self, SharedMapping};

use crate::engine::{Engine, MedQpSetup, MrGrant, RecvSideSetup};
use crate::store::{HostRecord, RuleRecord, VnicRecord};
use std::net::SocketAddr;
use vrdma_abi::wire::ConnectReq;
use vrdma_core::access::{check, MrBounds, Need};
use vrdma_core::sg::Atomic;

use crate::procmem::ProcMem;

/// Largest queue depth a client may ask for.
pub const MAX_QUEUE_DEPTH: u32 = 32768;
/// Largest scatter/gather list.
pub const MAX_SGE: u32 = 32;
/// Largest inline data.
pub const MAX_INLINE: u32 = 4096;

/// `IBV_QPT_RC`.
pub const QPT_RC: u8 = 2;
/// `IBV_QPT_UD`.
pub const QPT_UD: u8 = 4;

/// The vGID of an IPv4 address: `::ffff:a.b.c.d`.
pub fn gid_of(ip: Ipv4Addr) -> [u8; 16] {
    ip.to_ipv6_mapped().octets()
}

/// Failure of a request, as sent back to the client.
#[derive(Debug, thiserror::Error)]
#[error("{message} (errno {errno})")]
pub struct RequestError {
    /// errno for the verb.
    pub errno: i32,
    /// Human-readable reason.
    pub message: String,
    /// Whether this is a protocol violation (counted as bad input) rather than a normal
    /// verb failure like a limit.
    pub bad_input: bool,
}

fn fail(errno: i32, message: impl Into<String>) -> RequestError {
    RequestError { errno, message: message.into(), bad_input: false }
}
fn bad(errno: i32, message: impl Into<String>) -> RequestError {
    RequestError { errno, message: message.into(), bad_input: true }
}

/// Per-vNIC counters.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Counters {
    /// Requests refused as malformed or naming objects the caller does not own.
    pub bad_requests: u64,
    /// Connections refused by tenant rules or unknown destinations.
    pub refused_connections: u64,
    /// Connections established.
    pub connections: u64,
    /// MRs registered through the copying fallback (memory that could not be shared).
    pub copied_mrs: u64,
}

struct VnicState {
    rec: VnicRecord,
    usage: Usage,
    counters: Counters,
}

#[derive(Default)]
struct Session {
    vnic: String,
    pds: HashSet<u32>,
    cqs: HashSet<u32>,
    srqs: HashSet<u32>,
    qps: HashSet<u32>,
    mrs: HashSet<u32>,
    /// The client's memory for the copying fallback, opened when it connected (so a PID
    /// reused later can never name another process), or why it could not be.
    proc_mem: Option<Result<Arc<ProcMem>, String>>,
}

struct CqRec {
    session: u64,
    region: Arc<OwnedFd>,
    eventfd: Arc<OwnedFd>,
}

struct SrqRec {
    session: u64,
    pd: u32,
    region: Arc<OwnedFd>,
    entries: u32,
    max_sge: u32,
}

struct QpRec {
    session: u64,
    pd: u32,
    send_cq: u32,
    recv_cq: u32,
    srq: u32,
    region: Arc<OwnedFd>,
    mapping: SharedMapping,
    rq: Option<(u32, u32)>,
    comp_entries: u32,
    connected_to: Option<u32>,
    /// 2 = RC, 4 = UD (`ibv_qp_type`).
    qp_type: u8,
    /// UD QPs this (UD) QP resolved as destinations (it may map their receive MRs).
    ud_peers: HashSet<u32>,
    caps: QpCaps,
    /// Connected through the engine to this (daemon address, QPN).
    remote: Option<(SocketAddr, u32)>,
    /// QPs of other daemons (or of this one, mediated) connected to this QP.
    remote_peers: Vec<(SocketAddr, u32)>,
    /// A UD QP's datagram socket to the engine (client's end), once it resolved a
    /// destination on another host.
    ud_socket: Option<Arc<OwnedFd>>,
}

struct MrRec {
    session: u64,
    pd: u32,
    addr: u64,
    length: u64,
    access: u32,
    chunks: Vec<(MrChunk, Arc<OwnedFd>)>,
    /// Set for a copied MR (registered without chunks): its owner's memory.
    proc_mem: Option<Arc<ProcMem>>,
}

/// The daemon's cache of the cluster (kept current from the store's watch): every vNIC of
/// every host, the live hosts, the tenant rules.
#[derive(Default, Debug, Clone)]
pub struct ClusterView {
    /// This daemon's host name.
    pub local_host: String,
    /// Every vNIC of the cluster, by name.
    pub vnics: HashMap<String, VnicRecord>,
    /// Live hosts, by name.
    pub hosts: HashMap<String, HostRecord>,
    /// Tenant rules (symmetric, canonical order).
    pub rules: HashSet<RuleRecord>,
    /// The store serves one host only (the embedded store): every vNIC is this host's,
    /// whatever host name its record carries (the hostname may have changed).
    pub single_host: bool,
}

impl ClusterView {
    /// Whether `host` (a record's host field) is this daemon's; empty means the one host
    /// of an embedded store.
    pub fn is_local(&self, host: &str) -> bool {
        self.single_host || host.is_empty() || host == self.local_host
    }

    /// Whether vNICs of tenants `a` and `b` may connect: same tenant, or a rule allows it.
    pub fn may_connect(&self, a: &str, b: &str) -> bool {
        a == b || self.rules.contains(&RuleRecord::new(a, b))
    }
}

/// Where a GID lives, as the broker resolved it (tenant rules already checked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved {
    /// A vNIC this daemon serves.
    Local(String),
    /// A vNIC served by another host's daemon.
    Remote {
        /// Its record.
        vnic: VnicRecord,
        /// The host serving it.
        host: HostRecord,
    },
}

/// Fds to send with a reply.
pub type ReplyFds = Vec<Arc<OwnedFd>>;

/// All daemon state.
#[derive(Default)]
pub struct Registry {
    vnics: HashMap<String, VnicState>,
    sessions: HashMap<u64, Session>,
    pds: HashMap<u32, u64>,
    cqs: HashMap<u32, CqRec>,
    srqs: HashMap<u32, SrqRec>,
    qps: HashMap<u32, QpRec>,
    mrs: HashMap<u32, MrRec>,
    next_session: u64,
    next_handle: u32,
    next_qpn: u32,
    cluster: ClusterView,
    /// The mediated engine (absent only in unit tests of the registry).
    engine: Option<Arc<Engine>>,
    /// Policy: connect even same-host QPs through the engine.
    force_mediated: bool,
    /// PEER_GONE notices to send once the registry lock is released.
    notices: Vec<(SocketAddr, u32, u32)>,
}

/// How a connection request proceeds.
pub enum ConnectPlan {
    /// Answered (direct connection, or an error).
    Done(Reply, ReplyFds),
    /// The peer is reached through the engine: ask its daemon (without the registry lock),
    /// then [`Registry::finish_remote_connect`].
    Remote {
        /// The peer daemon's transport address.
        addr: SocketAddr,
        /// What to ask it.
        req: ConnectReq,
    },
}

/// How a UD destination resolves.
pub enum UdPlan {
    /// Answered (a destination on this host, or an error).
    Done(Reply, ReplyFds),
    /// On another host: the engine forwards the QP's datagrams to its daemon. Add the
    /// route ([`Engine::add_ud_route`], without the registry lock: it may connect), then
    /// [`Registry::finish_remote_ud`].
    Remote {
        /// The destination's daemon.
        addr: SocketAddr,
        /// The sending vNIC's GID.
        src_gid: [u8; 16],
    },
}

/// A vNIC as reported to administrators.
#[derive(Clone, Debug, serde::Serialize)]
pub struct VnicStatus {
    /// Stored record.
    pub record: VnicRecord,
    /// Live usage.
    pub usage: Usage,
    /// Counters.
    pub counters: Counters,
}

fn create_eventfd() -> Result<OwnedFd, RequestError> {
    use std::os::fd::FromRawFd;
    // SAFETY: plain eventfd(2) call.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(fail(libc::ENOMEM, "eventfd failed"));
    }
    // SAFETY: fd is new and owned by us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Wakes whoever sleeps on a CQ's eventfd.
pub fn signal_eventfd(fd: &OwnedFd) {
    use std::os::fd::AsRawFd;
    let one: u64 = 1;
    // SAFETY: writing 8 bytes from a live u64 to an eventfd.
    unsafe { libc::write(fd.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
}

impl Registry {
    /// Adds (or replaces the record of) a vNIC.
    pub fn add_vnic(&mut self, rec: VnicRecord) {
        match self.vnics.get_mut(&rec.name) {
            Some(v) => v.rec = rec,
            None => {
                self.vnics.insert(rec.name.clone(), VnicState { rec, usage: Usage::default(), counters: Counters::default() });
            }
        }
    }

    /// Removes a vNIC; fails while clients use it.
    pub fn remove_vnic(&mut self, name: &str) -> Result<(), RequestError> {
        match self.vnics.get(name) {
            None => Err(fail(libc::ENOENT, format!("no vNIC named {name}"))),
            Some(v) if v.usage.clients > 0 => Err(fail(libc::EBUSY, format!("vNIC {name} has {} live clients", v.usage.clients))),
            Some(_) => {
                self.vnics.remove(name);
                Ok(())
            }
        }
    }

    /// Removes a vNIC even while clients use it (deleted or moved away in the store): their
    /// sessions stay until the daemon closes their sockets, and get ENODEV meanwhile.
    pub fn remove_vnic_forced(&mut self, name: &str) -> bool {
        self.vnics.remove(name).is_some()
    }

    /// Sessions open on `vnic`.
    pub fn sessions_of(&self, vnic: &str) -> Vec<u64> {
        self.sessions.iter().filter(|(_, s)| s.vnic == vnic).map(|(id, _)| *id).collect()
    }

    /// The cluster cache.
    pub fn cluster(&self) -> &ClusterView {
        &self.cluster
    }

    /// The cluster cache, to update from the store.
    pub fn cluster_mut(&mut self) -> &mut ClusterView {
        &mut self.cluster
    }

    /// Status of every vNIC.
    pub fn status(&self) -> Vec<VnicStatus> {
        let mut v: Vec<_> =
            self.vnics.values().map(|v| VnicStatus { record: v.rec.clone(), usage: v.usage, counters: v.counters }).collect();
        v.sort_by(|a, b| a.record.name.cmp(&b.record.name));
        v
    }

    /// Whether a vNIC exists.
    pub fn has_vnic(&self, name: &str) -> bool {
        self.vnics.contains_key(name)
    }

    /// Records of every vNIC.
    pub fn records(&self) -> Vec<VnicRecord> {
        self.vnics.values().map(|v| v.rec.clone()).collect()
    }

    /// Opens a client session on `vnic`; `proc_mem` is the client's memory (opened from its
    /// socket's credentials when it connected; needed only to register copied MRs).
    pub fn open_session(&mut self, vnic: &str, proc_mem: Option<Result<Arc<ProcMem>, String>>) -> Option<u64> {
        let v = self.vnics.get_mut(vnic)?;
        v.usage.clients += 1;
        self.next_session += 1;
        let id = self.next_session;
        self.sessions.insert(id, Session { vnic: vnic.to_string(), proc_mem, ..Default::default() });
        Some(id)
    }

    /// Counts a malformed message from `session`.
    pub fn count_bad_input(&mut self, session: u64) {
        if let Some(v) = self.sessions.get(&session).and_then(|s| self.vnics.get_mut(&s.vnic)) {
            v.counters.bad_requests += 1;
        }
    }

    fn vnic_of(&mut self, session: u64) -> Result<&mut VnicState, RequestError> {
        let name = &self.sessions.get(&session).ok_or_else(|| bad(libc::EINVAL, "no session"))?.vnic;
        self.vnics.get_mut(name).ok_or_else(|| fail(libc::ENODEV, "vNIC was deleted"))
    }

    fn handle(&mut self) -> u32 {
        self.next_handle = self.next_handle.wrapping_add(1).max(1);
        self.next_handle
    }

    fn session(&mut self, id: u64) -> Result<&mut Session, RequestError> {
        self.sessions.get_mut(&id).ok_or_else(|| bad(libc::EINVAL, "no session"))
    }

    fn own_pd(&self, session: u64, pd: u32) -> Result<(), RequestError> {
        match self.pds.get(&pd) {
            Some(s) if *s == session => Ok(()),
            _ => Err(bad(libc::EINVAL, format!("PD handle {pd} is not yours"))),
        }
    }

    fn own_cq(&self, session: u64, cq: u32) -> Result<&CqRec, RequestError> {
        match self.cqs.get(&cq) {
            Some(c) if c.session == session => Ok(c),
            _ => Err(bad(libc::EINVAL, format!("CQ handle {cq} is not yours"))),
        }
    }

    fn own_qp(&self, session: u64, qpn: u32) -> Result<&QpRec, RequestError> {
        match self.qps.get(&qpn) {
            Some(q) if q.session == session => Ok(q),
            _ => Err(bad(libc::EINVAL, format!("QP {qpn} is not yours"))),
        }
    }

    /// Handles one request of `session`. `fds` are the descriptors that came with it.
    pub fn handle_request(&mut self, session: u64, req: Request, fds: Vec<OwnedFd>) -> Result<(Reply, ReplyFds), RequestError> {
        let expected_fds = match &req {
            Request::RegMr { chunks, .. } => chunks.len(),
            _ => 0,
        };
        if fds.len() != expected_fds {
            return Err(bad(libc::EINVAL, format!("expected {expected_fds} fds, got {}", fds.len())));
        }
        match req {
            Request::Hello { version } => {
                if version != u32::from(VERSION) {
                    return Err(bad(libc::EPROTO, format!("protocol version {version} unsupported")));
                }
                let v = self.vnic_of(session)?;
                let info = VnicInfo {
                    name: v.rec.name.clone(),
                    tenant: v.rec.tenant.clone(),
                    gids: vec![gid_of(v.rec.ip)],
                    limits: v.rec.limits,
                    node_guid: v.rec.node_guid,
                };
                Ok((Reply::Hello(info), vec![]))
            }
            Request::QueryUsage => Ok((Reply::Usage(self.vnic_of(session)?.usage), vec![])),
            Request::AllocPd => {
                let v = self.vnic_of(session)?;
                if v.usage.pds >= v.rec.limits.max_pd {
                    return Err(fail(libc::ENOMEM, format!("PD limit {} reached", v.rec.limits.max_pd)));
                }
                v.usage.pds += 1;
                let h = self.handle();
                self.pds.insert(h, session);
                self.session(session)?.pds.insert(h);
                Ok((Reply::Handle { handle: h }, vec![]))
            }
            Request::DeallocPd { pd } => {
                self.own_pd(session, pd)?;
                let busy = self.qps.values().any(|q| q.pd == pd)
                    || self.mrs.values().any(|m| m.pd == pd)
                    || self.srqs.values().any(|s| s.pd == pd);
                if busy {
                    return Err(fail(libc::EBUSY, format!("PD {pd} still has QPs, MRs or SRQs")));
                }
                self.pds.remove(&pd);
                self.session(session)?.pds.remove(&pd);
                self.vnic_of(session)?.usage.pds -= 1;
                Ok((Reply::Ok, vec![]))
            }
            Request::RegMr { pd, addr, length, access, chunks } => self.reg_mr(session, pd, addr, length, access, chunks, fds),
            Request::DeregMr { key } => {
                match self.mrs.get(&key) {
                    Some(m) if m.session == session => {}
                    _ => return Err(bad(libc::EINVAL, format!("MR key {key:#x} is not yours"))),
                }
                let m = self.mrs.remove(&key).expect("checked above");
                if let Some(e) = &self.engine {
                    e.forget_mr(key);
                }
                self.session(session)?.mrs.remove(&key);
                let u = &mut self.vnic_of(session)?.usage;
                u.mrs -= 1;
                u.mr_bytes -= m.length;
                self.bump_mr_epoch(session);
                Ok((Reply::Ok, vec![]))
            }
            Request::CreateCq { cqe } => {
                if cqe == 0 || cqe > 4 * MAX_QUEUE_DEPTH {
                    return Err(fail(libc::EINVAL, format!("cqe {cqe} out of range")));
                }
                let v = self.vnic_of(session)?;
                if v.usage.cqs >= v.rec.limits.max_cq {
                    return Err(fail(libc::ENOMEM, format!("CQ limit {} reached", v.rec.limits.max_cq)));
                }
                let region = shm::create_memfd("vrdma-cq", ring::CQ_REGION_SIZE, true).map_err(|e| fail(libc::ENOMEM, e.to_string()))?;
                let eventfd = create_eventfd()?;
                self.vnic_of(session)?.usage.cqs += 1;
                let h = self.handle();
                let rec = CqRec { session, region: Arc::new(region), eventfd: Arc::new(eventfd) };
                let fds = vec![rec.region.clone(), rec.eventfd.clone()];
                self.cqs.insert(h, rec);
                self.session(session)?.cqs.insert(h);
                Ok((Reply::Cq { cq: h }, fds))
            }
            Request::DestroyCq { cq } => {
                self.own_cq(session, cq)?;
                if self.qps.values().any(|q| q.send_cq == cq || q.recv_cq == cq) {
                    return Err(fail(libc::EBUSY, format!("CQ {cq} still has QPs")));
                }
                self.cqs.remove(&cq);
                self.session(session)?.cqs.remove(&cq);
                self.vnic_of(session)?.usage.cqs -= 1;
                Ok((Reply::Ok, vec![]))
            }
            Request::CreateSrq { pd, max_wr, max_sge } => {
                self.own_pd(session, pd)?;
                if max_wr == 0 || max_wr > MAX_QUEUE_DEPTH || max_sge == 0 || max_sge > MAX_SGE {
                    return Err(fail(libc::EINVAL, format!("SRQ max_wr {max_wr} / max_sge {max_sge} out of range")));
                }
                let v = self.vnic_of(session)?;
                if v.usage.srqs >= v.rec.limits.max_srq {
                    return Err(fail(libc::ENOMEM, format!("SRQ limit {} reached", v.rec.limits.max_srq)));
                }
                let layout = RecvRingLayout::new(max_wr as usize, max_sge as usize);
                let (region, _map) = make_region(ring::srq_region_size(layout), |m| {
                    RecvRing::new(m.region().subregion(ring::PAGE, layout.size())?, layout)?.init()
                })?;
                self.vnic_of(session)?.usage.srqs += 1;
                let h = self.handle();
                let region = Arc::new(region);
                self.srqs.insert(
                    h,
                    SrqRec { session, pd, region: region.clone(), entries: layout.capacity as u32, max_sge: layout.max_sge as u32 },
                );
                self.session(session)?.srqs.insert(h);
                Ok((Reply::Srq { srq: h, entries: layout.capacity as u32, max_sge: layout.max_sge as u32 }, vec![region]))
            }
            Request::DestroySrq { srq } => {
                match self.srqs.get(&srq) {
                    Some(s) if s.session == session => {}
                    _ => return Err(bad(libc::EINVAL, format!("SRQ {srq} is not yours"))),
                }
                if self.qps.values().any(|q| q.srq == srq) {
                    return Err(fail(libc::EBUSY, format!("SRQ {srq} still has QPs")));
                }
                self.srqs.remove(&srq);
                self.session(session)?.srqs.remove(&srq);
                self.vnic_of(session)?.usage.srqs -= 1;
                Ok((Reply::Ok, vec![]))
            }
            Request::CreateQp { pd, send_cq, recv_cq, srq, qp_type, caps } => {
                self.create_qp(session, pd, send_cq, recv_cq, srq, qp_type, caps)
            }
            Request::SetQpState { qpn, state } => {
                self.own_qp(session, qpn)?;
                if vrdma_abi::verbs::QpState::from_u32(u32::from(state)).is_none() {
                    return Err(bad(libc::EINVAL, format!("state {state} invalid")));
                }
                if state == vrdma_abi::verbs::QpState::Reset as u8 {
                    self.disconnect_remote(qpn);
                    if let Some(q) = self.qps.get_mut(&qpn) {
                        q.connected_to = None;
                    }
                }
                Ok((Reply::Ok, vec![]))
            }
            Request::ConnectQp { qpn, dgid, dest_qpn } => match self.prepare_connect(session, qpn, dgid, dest_qpn)? {
                ConnectPlan::Done(r, f) => Ok((r, f)),
                ConnectPlan::Remote { addr, req } => {
                    // Callers that can wait without the lock use prepare_connect directly; here
                    // (unit tests) the engine is asked inline.
                    let engine = self.engine.clone().ok_or_else(|| fail(libc::EHOSTUNREACH, "no mediated engine"))?;
                    engine.connect_remote(addr, qpn, dest_qpn, &req).map_err(|e| fail(e.errno(), e.to_string()))?;
                    let lane = engine.open_lane(addr, qpn, dest_qpn).map_err(|e| fail(e.errno(), e.to_string()))?;
                    self.finish_remote_connect(session, qpn, addr, dest_qpn, lane)
                }
            },
            Request::DestroyQp { qpn } => {
                self.own_qp(session, qpn)?;
                self.destroy_qp(qpn);
                Ok((Reply::Ok, vec![]))
            }
            Request::MapPeerMr { qpn, key } => Self::peer_mr_reply(self.peer_mr(session, qpn, None, key)?, key),
            Request::CheckGid { dgid } => {
                self.resolve_gid(session, 0, dgid)?; // a remote GID is a valid AH destination
                Ok((Reply::Ok, vec![]))
            }
            Request::ResolveUd { qpn, dgid, dest_qpn } => match self.prepare_resolve_ud(session, qpn, dgid, dest_qpn)? {
                UdPlan::Done(r, f) => Ok((r, f)),
                UdPlan::Remote { addr, src_gid } => {
                    // As for ConnectQp: the daemon asks the engine without the lock; here
                    // (unit tests) inline.
                    let engine = self.engine.clone().ok_or_else(|| fail(libc::EHOSTUNREACH, "no mediated engine"))?;
                    let created = engine.add_ud_route(qpn, src_gid, dgid, addr).map_err(|e| fail(e.errno(), e.to_string()))?;
                    self.finish_remote_ud(session, qpn, created).inspect_err(|_| engine.detach_ud(qpn))
                }
            },
            Request::MapUdPeerMr { qpn, dest_qpn, key } => Self::peer_mr_reply(self.peer_mr(session, qpn, Some(dest_qpn), key)?, key),
            req @ (Request::PeerMrWrite { .. } | Request::PeerMrRead { .. } | Request::PeerMrAtomic { .. }) => {
                let mem = self.copy_target(session, &req)?;
                copy_access(&mem, &req).map(|r| (r, vec![]))
            }
        }
    }

    /// The memory a copy request (`PeerMrWrite`, `PeerMrRead`, `PeerMrAtomic`) may access,
    /// after checking the QP, the peer's MR and its bounds and access rights. The copy itself
    /// ([`copy_access`]) needs no registry lock.
    pub fn copy_target(&self, session: u64, req: &Request) -> Result<Arc<ProcMem>, RequestError> {
        match *req {
            Request::PeerMrWrite { qpn, dest_qpn, key, addr, need_remote, ref data } => {
                let need = if need_remote { Need::RemoteWrite } else { Need::LocalWrite };
                self.copied_peer_mr(session, qpn, dest_qpn, key, addr, data.len() as u64, need)
            }
            Request::PeerMrRead { qpn, dest_qpn, key, addr, len } => {
                self.copied_peer_mr(session, qpn, dest_qpn, key, addr, u64::from(len), Need::RemoteRead)
            }
            Request::PeerMrAtomic { qpn, dest_qpn, key, addr, .. } => {
                self.copied_peer_mr(session, qpn, dest_qpn, key, addr, 8, Need::RemoteAtomic)
            }
            _ => Err(bad(libc::EINVAL, "not a copy request")),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn reg_mr(
        &mut self,
        session: u64,
        pd: u32,
        addr: u64,
        length: u64,
        access: u32,
        chunks: Vec<MrChunk>,
        fds: Vec<OwnedFd>,
    ) -> Result<(Reply, ReplyFds), RequestError> {
        self.own_pd(session, pd)?;
        let page = ring::PAGE as u64;
        let span_start = addr & !(page - 1);
        let end = addr.checked_add(length).ok_or_else(|| bad(libc::EINVAL, "MR wraps the address space"))?;
        let proc_mem = if chunks.is_empty() { Some(self.copied_region(session, addr, length)?) } else { None };
        let span_len = end.div_ceil(page) * page - span_start;
        // The chunks must tile the page span exactly, each backed by a sealed memfd.
        let mut at = 0u64;
        for (c, fd) in chunks.iter().zip(&fds) {
            if c.mr_offset != at || c.len == 0 || c.len % page != 0 || c.fd_offset % page != 0 {
                return Err(bad(libc::EINVAL, format!("MR chunk {c:?} does not tile the region")));
            }
            let fd_end = c.fd_offset.checked_add(c.len).ok_or_else(|| bad(libc::EINVAL, "chunk overflows"))?;
            shm::check_sealed(fd.as_fd(), fd_end as usize).map_err(|e| bad(libc::EINVAL, e.to_string()))?;
            at += c.len;
        }
        if at != span_len && proc_mem.is_none() {
            return Err(bad(libc::EINVAL, format!("MR chunks cover {at} bytes, the region spans {span_len}")));
        }
        let v = self.vnic_of(session)?;
        let l = v.rec.limits;
        if v.usage.mrs >= l.max_mr {
            return Err(fail(libc::ENOMEM, format!("MR limit {} reached", l.max_mr)));
        }
        if v.usage.mr_bytes.saturating_add(length) > l.max_mr_bytes {
            return Err(fail(libc::EDQUOT, format!("MR byte limit {} reached", l.max_mr_bytes)));
        }
        v.usage.mrs += 1;
        v.usage.mr_bytes += length;
        if proc_mem.is_some() {
            v.counters.copied_mrs += 1;
        }
        // rkeys are random (DESIGN §6), never sequential; the low byte is a generation.
        let key = loop {
            let k: u32 = rand::random::<u32>() | 1;
            if !self.mrs.contains_key(&k) {
                break k;
            }
        };
        let chunks = chunks.into_iter().zip(fds.into_iter().map(Arc::new)).collect();
        if proc_mem.is_some() {
            log::info!("session {session}: MR {key:#x} ({length} bytes at {addr:#x}) is copied through the process's memory");
        }
        self.mrs.insert(key, MrRec { session, pd, addr, length, access, chunks, proc_mem });
        self.session(session)?.mrs.insert(key);
        Ok((Reply::Mr { lkey: key, rkey: key }, vec![]))
    }

    #[allow(clippy::too_many_arguments)]
    fn create_qp(
        &mut self,
        session: u64,
        pd: u32,
        send_cq: u32,
        recv_cq: u32,
        srq: u32,
        qp_type: u8,
        caps: QpCaps,
    ) -> Result<(Reply, ReplyFds), RequestError> {
        self.own_pd(session, pd)?;
        self.own_cq(session, send_cq)?;
        let recv_cq_rec = self.own_cq(session, recv_cq)?;
        let _ = recv_cq_rec;
        if qp_type != QPT_RC && qp_type != QPT_UD {
            return Err(fail(libc::EOPNOTSUPP, format!("QP type {qp_type} is not supported (RC and UD only)")));
        }
        if caps.max_send_wr > MAX_QUEUE_DEPTH
            || caps.max_recv_wr > MAX_QUEUE_DEPTH
            || caps.max_send_sge > MAX_SGE
            || caps.max_recv_sge > MAX_SGE
            || caps.max_inline_data > MAX_INLINE
        {
            return Err(fail(libc::EINVAL, format!("QP capabilities {caps:?} exceed the device limits")));
        }
        let srq_rec = if srq != 0 {
            match self.srqs.get(&srq) {
                Some(s) if s.session == session => Some((s.entries, s.max_sge)),
                _ => return Err(bad(libc::EINVAL, format!("SRQ {srq} is not yours"))),
            }
        } else {
            None
        };
        let v = self.vnic_of(session)?;
        if v.usage.qps >= v.rec.limits.max_qp {
            return Err(fail(libc::ENOMEM, format!("QP limit {} reached", v.rec.limits.max_qp)));
        }
        let rq = if srq_rec.is_none() {
            Some(RecvRingLayout::with_headroom(caps.max_recv_wr.max(1) as usize, caps.max_recv_sge.max(1) as usize))
        } else {
            None
        };
        let comp_entries = match (rq, srq_rec) {
            (Some(r), _) => r.capacity,
            (None, Some((e, _))) => e as usize,
            (None, None) => 1,
        };
        let layout = QpRegionLayout::new(rq, comp_entries);
        let (region, mapping) = make_region(layout.size(), |m| match rq {
            Some(r) => RecvRing::new(m.region().subregion(layout.rq_offset(), r.size())?, r)?.init(),
            None => Ok(()),
        })?;
        self.vnic_of(session)?.usage.qps += 1;
        let qpn = loop {
            self.next_qpn = (self.next_qpn + 1) & 0x00ff_ffff;
            if self.next_qpn >= 16 && !self.qps.contains_key(&self.next_qpn) {
                break self.next_qpn;
            }
        };
        let region = Arc::new(region);
        let rq_pair = rq.map(|r| (r.capacity as u32, r.max_sge as u32));
        self.qps.insert(
            qpn,
            QpRec {
                session,
                pd,
                send_cq,
                recv_cq,
                srq,
                region: region.clone(),
                mapping,
                rq: rq_pair,
                comp_entries: layout.comp.capacity as u32,
                connected_to: None,
                qp_type,
                ud_peers: HashSet::new(),
                caps,
                remote: None,
                remote_peers: Vec::new(),
                ud_socket: None,
            },
        );
        self.session(session)?.qps.insert(qpn);
        let (rq_entries, max_recv_sge) = rq_pair.unwrap_or((0, 0));
        Ok((Reply::Qp { qpn, rq_entries, max_recv_sge, comp_entries: layout.comp.capacity as u32 }, vec![region]))
    }

    /// Where the vNIC with GID `dgid` lives, if the caller's vNIC may reach it: served here,
    /// or by another host of the cluster (tenant rules checked either way). Refusals are
    /// counted (on both vNICs when both are local) and logged. `qpn` names the caller's QP in
    /// the log (0: none).
    pub fn resolve_gid(&mut self, session: u64, qpn: u32, dgid: [u8; 16]) -> Result<Resolved, RequestError> {
        self.resolve_gid_with(session, qpn, dgid, false)
    }

    /// [`Registry::resolve_gid`]; with `defer_remote_rules`, a vNIC on another host is
    /// returned even if rules refuse, because its daemon decides too (and so refuses, counts
    /// and logs it on its side, as the broker must on both daemons).
    fn resolve_gid_with(&mut self, session: u64, qpn: u32, dgid: [u8; 16], defer_remote_rules: bool) -> Result<Resolved, RequestError> {
        let my_vnic = self.sessions.get(&session).ok_or_else(|| bad(libc::EINVAL, "no session"))?.vnic.clone();
        let my_tenant = self.vnics.get(&my_vnic).ok_or_else(|| fail(libc::ENODEV, "vNIC was deleted"))?.rec.tenant.clone();
        let gid = std::net::Ipv6Addr::from(dgid);
        let local = self.vnics.values().find(|v| gid_of(v.rec.ip) == dgid).map(|v| v.rec.clone());
        let remote = || self.cluster.vnics.values().find(|v| gid_of(v.ip) == dgid && !self.cluster.is_local(&v.host)).cloned();
        let (dest, is_local) = match local {
            Some(r) => (r, true),
            None => match remote() {
                Some(r) => (r, false),
                None => {
                    self.vnics.get_mut(&my_vnic).expect("session's vNIC").counters.refused_connections += 1;
                    log::warn!("vNIC {my_vnic}: QP {qpn} refused: no vNIC has GID {gid}");
                    return Err(fail(libc::EHOSTUNREACH, format!("no vNIC has GID {gid}")));
                }
            },
        };
        if !self.cluster.may_connect(&my_tenant, &dest.tenant) && (is_local || !defer_remote_rules) {
            for n in [&my_vnic, &dest.name] {
                if let Some(v) = self.vnics.get_mut(n) {
                    v.counters.refused_connections += 1;
                }
            }
            let (dest_name, dest_tenant) = (&dest.name, &dest.tenant);
            log::warn!("refused connection from vNIC {my_vnic} (tenant {my_tenant}) QP {qpn} to vNIC {dest_name} (tenant {dest_tenant}): no rule allows it");
            return Err(fail(libc::ECONNREFUSED, format!("tenant {my_tenant} may not connect to tenant {dest_tenant}")));
        }
        if is_local {
            return Ok(Resolved::Local(dest.name));
        }
        let Some(host) = self.cluster.hosts.get(&dest.host).cloned() else {
            self.vnics.get_mut(&my_vnic).expect("session's vNIC").counters.refused_connections += 1;
            log::warn!("vNIC {my_vnic}: QP {qpn} refused: vNIC {} (GID {gid}) is on host {}, which is down", dest.name, dest.host);
            return Err(fail(libc::EHOSTUNREACH, format!("vNIC {} is on host {}, which is down", dest.name, dest.host)));
        };
        Ok(Resolved::Remote { vnic: dest, host })
    }

    /// The fds and description of QP `dest_qpn`'s receive side, for a requester.
    fn peer_info(&self, dest_qpn: u32) -> (PeerInfo, ReplyFds) {
        let peer = &self.qps[&dest_qpn];
        let cq = &self.cqs[&peer.recv_cq];
        let mut fds = vec![peer.region.clone(), cq.region.clone(), cq.eventfd.clone()];
        let srq_ring = if peer.srq != 0 {
            let s = &self.srqs[&peer.srq];
            fds.push(s.region.clone());
            Some((s.entries, s.max_sge))
        } else {
            None
        };
        (PeerInfo { qpn: dest_qpn, rq_ring: peer.rq, comp_entries: peer.comp_entries, srq_ring }, fds)
    }

    /// `ResolveUd`: the destination of a UD send, with the same tenant checks as connecting.
    /// A destination on another host is reached through the engine (see [`UdPlan`]).
    pub fn prepare_resolve_ud(&mut self, session: u64, qpn: u32, dgid: [u8; 16], dest_qpn: u32) -> Result<UdPlan, RequestError> {
        let q = self.own_qp(session, qpn)?;
        if q.qp_type != QPT_UD {
            return Err(bad(libc::EINVAL, format!("QP {qpn} is not a UD QP")));
        }
        let dest = match self.resolve_gid(session, qpn, dgid)? {
            Resolved::Local(name) => name,
            Resolved::Remote { host, .. } => {
                if self.engine.is_none() {
                    return Err(fail(libc::EHOSTUNREACH, "no mediated engine"));
                }
                let vnic = &self.sessions[&session].vnic;
                let src_gid = self.vnics.get(vnic).map(|v| gid_of(v.rec.ip)).ok_or_else(|| fail(libc::ENODEV, "vNIC was deleted"))?;
                return Ok(UdPlan::Remote { addr: host.transport_addr, src_gid });
            }
        };
        match self.qps.get(&dest_qpn) {
            Some(p) if p.qp_type == QPT_UD && self.sessions.get(&p.session).is_some_and(|s| s.vnic == dest) => {}
            _ => return Err(fail(libc::ENOENT, format!("vNIC {dest} has no UD QP {dest_qpn}"))),
        }
        let (info, fds) = self.peer_info(dest_qpn);
        self.qps.get_mut(&qpn).expect("own_qp checked").ud_peers.insert(dest_qpn);
        Ok(UdPlan::Done(Reply::Connected(info), fds))
    }

    /// `ResolveUd` of a destination on another host, once the engine routes to it (`created`:
    /// the client's end of the datagram socket the engine made for the QP's first route): the
    /// client gets the QP's datagram socket. On error the caller detaches the QP's UD
    /// sending side from the engine.
    pub fn finish_remote_ud(&mut self, session: u64, qpn: u32, created: Option<OwnedFd>) -> Result<(Reply, ReplyFds), RequestError> {
        self.own_qp(session, qpn)?;
        let q = self.qps.get_mut(&qpn).expect("own_qp checked");
        if let Some(c) = created {
            q.ud_socket = Some(Arc::new(c));
        }
        let socket = q.ud_socket.clone().ok_or_else(|| fail(libc::EIO, "the QP's datagram socket is gone"))?;
        Ok((Reply::UdRemote, vec![socket]))
    }

    /// Whether a datagram from the vNIC with `src_gid`, forwarded by the daemon at `from`,
    /// may reach our UD QP `dst_qpn` at `dgid`: the QP is a UD QP of the vNIC with that GID,
    /// the source vNIC is served by that daemon, and tenant rules allow it.
    pub fn accept_ud(&mut self, from: SocketAddr, src_gid: &[u8; 16], dst_qpn: u32, dgid: &[u8; 16]) -> Result<(), String> {
        let q = self.qps.get(&dst_qpn).filter(|q| q.qp_type == QPT_UD).ok_or_else(|| format!("no UD QP {dst_qpn}"))?;
        let vnic = &self.sessions.get(&q.session).ok_or("the QP has no session")?.vnic;
        let dest = &self.vnics.get(vnic).ok_or("its vNIC was deleted")?.rec;
        if gid_of(dest.ip) != *dgid {
            return Err(format!("QP {dst_qpn} is not at GID {}", std::net::Ipv6Addr::from(*dgid)));
        }
        let src = self.cluster.vnics.values().find(|v| gid_of(v.ip) == *src_gid).ok_or("unknown source GID")?;
        match self.cluster.hosts.get(&src.host) {
            Some(h) if h.transport_addr == from => {}
            _ => return Err(format!("source vNIC {} is not served by {from}", src.name)),
        }
        if !self.cluster.may_connect(&src.tenant, &dest.tenant) {
            let why = format!("tenant {} may not reach tenant {}", src.tenant, dest.tenant);
            let name = dest.name.clone();
            self.vnics.get_mut(&name).expect("exists").counters.refused_connections += 1;
            return Err(why);
        }
        Ok(())
    }

    /// Our UD QP `qpn`'s receiving side, for the engine.
    pub fn ud_receiver(&self, qpn: u32) -> Option<crate::engine::UdReceiverSetup> {
        let q = self.qps.get(&qpn).filter(|q| q.qp_type == QPT_UD)?;
        let cq = self.cqs.get(&q.recv_cq)?;
        Some(crate::engine::UdReceiverSetup {
            qpn,
            session: q.session,
            pd: q.pd,
            recv: self.recv_side(q)?,
            recv_cq: (cq.region.clone(), cq.eventfd.clone()),
        })
    }

    /// `q`'s receiving side, for the engine (`None` if its SRQ is gone).
    fn recv_side(&self, q: &QpRec) -> Option<RecvSideSetup> {
        let srq = match q.srq {
            0 => None,
            h => {
                let s = self.srqs.get(&h)?;
                Some((s.region.clone(), RecvRingLayout::new(s.entries as usize, s.max_sge as usize)))
            }
        };
        Some(RecvSideSetup {
            qp_region: q.region.clone(),
            rq: q.rq.map(|(e, s)| RecvRingLayout::new(e as usize, s as usize)),
            comp_entries: q.comp_entries,
            srq,
        })
    }

    /// The MR `key` of the PD of `qpn`'s peer — its connected QP, or (`ud_dest`) a UD QP it
    /// resolved before — if there is one.
    fn peer_mr(&self, session: u64, qpn: u32, ud_dest: Option<u32>, key: u32) -> Result<Option<&MrRec>, RequestError> {
        let q = self.own_qp(session, qpn)?;
        let peer = match ud_dest {
            None => {
                q.connected_to.and_then(|p| self.qps.get(&p)).ok_or_else(|| fail(libc::ENOTCONN, format!("QP {qpn} is not connected")))?
            }
            Some(dest_qpn) => {
                if !q.ud_peers.contains(&dest_qpn) {
                    return Err(bad(libc::EINVAL, format!("QP {qpn} did not resolve UD QP {dest_qpn}")));
                }
                self.qps.get(&dest_qpn).ok_or_else(|| fail(libc::ENOENT, format!("UD QP {dest_qpn} is gone")))?
            }
        };
        Ok(self.mrs.get(&key).filter(|m| m.session == peer.session && m.pd == peer.pd))
    }

    /// The session's process memory for a copied MR over `[addr, addr+length)`, which must
    /// be readable there (opened at the session's first copied MR).
    fn copied_region(&mut self, session: u64, addr: u64, length: u64) -> Result<Arc<ProcMem>, RequestError> {
        if length == 0 {
            return Err(bad(libc::EINVAL, "empty MR"));
        }
        let mem = match &self.session(session)?.proc_mem {
            Some(Ok(m)) => m.clone(),
            Some(Err(why)) => return Err(fail(libc::EPERM, format!("memory that cannot be shared needs the client's memory: {why}"))),
            None => return Err(fail(libc::EOPNOTSUPP, "memory that cannot be shared cannot be registered on this session")),
        };
        let mut b = [0u8; 1];
        for a in [addr, addr + length - 1] {
            mem.read(a, &mut b).map_err(|e| fail(libc::EFAULT, e.to_string()))?;
        }
        Ok(mem)
    }

    /// The copied MR `key` of `qpn`'s peer (its connected QP, or UD destination `dest_qpn`),
    /// if `[addr, addr+len)` of it grants `need`: the owner's memory to access.
    #[allow(clippy::too_many_arguments)]
    pub fn copied_peer_mr(
        &self,
        session: u64,
        qpn: u32,
        dest_qpn: u32,
        key: u32,
        addr: u64,
        len: u64,
        need: Need,
    ) -> Result<Arc<ProcMem>, RequestError> {
        let mr = self
            .peer_mr(session, qpn, (dest_qpn != 0).then_some(dest_qpn), key)?
            .ok_or_else(|| fail(libc::EACCES, format!("key {key:#x} is not an MR of the peer's PD")))?;
        let mem = mr.proc_mem.clone().ok_or_else(|| bad(libc::EINVAL, format!("MR {key:#x} is not a copied MR")))?;
        check(&MrBounds { addr: mr.addr, length: mr.length, access: mr.access }, addr, len, need)
            .map_err(|_| fail(libc::EACCES, format!("MR {key:#x} does not grant {need:?} on {len} bytes at {addr:#x}")))?;
        Ok(mem)
    }

    fn peer_mr_reply(mr: Option<&MrRec>, key: u32) -> Result<(Reply, ReplyFds), RequestError> {
        let Some(mr) = mr else {
            return Err(fail(libc::EACCES, format!("key {key:#x} is not an MR of the peer's PD")));
        };
        let fds = mr.chunks.iter().map(|(_, fd)| fd.clone()).collect();
        Ok((
            Reply::PeerMr { addr: mr.addr, length: mr.length, access: mr.access, chunks: mr.chunks.iter().map(|(c, _)| *c).collect() },
            fds,
        ))
    }

    /// `ConnectQp`, first half: resolves the destination (tenant rules) and either connects
    /// directly (same host) or says which daemon to ask (mediated).
    pub fn prepare_connect(&mut self, session: u64, qpn: u32, dgid: [u8; 16], dest_qpn: u32) -> Result<ConnectPlan, RequestError> {
        if self.own_qp(session, qpn)?.qp_type != QPT_RC {
            return Err(bad(libc::EINVAL, format!("QP {qpn} is not an RC QP")));
        }
        let my_vnic = self.sessions[&session].vnic.clone();
        let (dest, is_remote) = match self.resolve_gid_with(session, qpn, dgid, true)? {
            Resolved::Local(name) => (name, None),
            Resolved::Remote { vnic, host } => (vnic.name, Some(host.transport_addr)),
        };
        if let Some(addr) = is_remote {
            // Another host serves the destination: its daemon accepts (or refuses) the QP.
            if self.engine.is_none() {
                return Err(fail(libc::EHOSTUNREACH, "cross-host connection needs the mediated engine"));
            }
            let me = &self.vnics[&my_vnic].rec;
            let req = ConnectReq { src_gid: gid_of(me.ip), dst_gid: dgid, src_tenant: me.tenant.clone() };
            log::debug!("QP {qpn} of vNIC {my_vnic}: {dest} is remote, asking {addr}");
            return Ok(ConnectPlan::Remote { addr, req });
        }
        if self.force_mediated {
            if let Some(e) = &self.engine {
                let me = &self.vnics[&my_vnic].rec;
                let req = ConnectReq { src_gid: gid_of(me.ip), dst_gid: dgid, src_tenant: me.tenant.clone() };
                return Ok(ConnectPlan::Remote { addr: e.local_addr(), req });
            }
        }
        match self.qps.get(&dest_qpn) {
            Some(p) if p.qp_type == QPT_RC && self.sessions.get(&p.session).is_some_and(|s| s.vnic == dest) => {}
            _ => {
                self.vnics.get_mut(&my_vnic).expect("exists").counters.refused_connections += 1;
                return Err(fail(libc::ECONNREFUSED, format!("vNIC {dest} has no QP {dest_qpn}")));
            }
        }
        let (info, fds) = self.peer_info(dest_qpn);
        self.qps.get_mut(&qpn).expect("own_qp checked").connected_to = Some(dest_qpn);
        self.vnics.get_mut(&my_vnic).expect("exists").counters.connections += 1;
        Ok(ConnectPlan::Done(Reply::Connected(info), fds))
    }

    /// `ConnectQp`, second half of a mediated connection the peer daemon accepted: the engine
    /// takes over the QP's sends and the client gets its channel.
    pub fn finish_remote_connect(
        &mut self,
        session: u64,
        qpn: u32,
        addr: SocketAddr,
        dest_qpn: u32,
        lane: Option<crate::engine::Lane>,
    ) -> Result<(Reply, ReplyFds), RequestError> {
        let engine = self.engine.clone().ok_or_else(|| fail(libc::EHOSTUNREACH, "no mediated engine"))?;
        let q = self.own_qp(session, qpn)?;
        let cq = |h: u32| self.cqs.get(&h).map(|c| (c.region.clone(), c.eventfd.clone()));
        let (Some(send_cq), Some(recv_cq)) = (cq(q.send_cq), cq(q.recv_cq)) else {
            return Err(fail(libc::EINVAL, "the QP's CQ is gone"));
        };
        let recv = self.recv_side(q).ok_or_else(|| fail(libc::EINVAL, "the QP's SRQ is gone"))?;
        let setup = MedQpSetup { qpn, session, pd: q.pd, remote: addr, remote_qpn: dest_qpn, caps: q.caps, recv, send_cq, recv_cq };
        let (chan, doorbell, lane, layout) = engine.attach(setup, lane).map_err(|e| fail(e.errno(), e.to_string()))?;
        self.qps.get_mut(&qpn).expect("own_qp checked").remote = Some((addr, dest_qpn));
        let vnic = self.sessions[&session].vnic.clone();
        if let Some(v) = self.vnics.get_mut(&vnic) {
            v.counters.connections += 1;
        }
        log::debug!("QP {qpn} of vNIC {vnic} connected to QP {dest_qpn} at {addr} through the engine");
        Ok((
            Reply::ConnectedMediated {
                sq_entries: layout.sq.capacity as u32,
                max_sge: layout.sq.max_sge as u32,
                max_inline: layout.sq.max_inline as u32,
                comp_entries: layout.comp.capacity as u32,
            },
            [chan, doorbell].into_iter().chain(lane).collect(),
        ))
    }

    /// Counts a connection the peer daemon refused.
    pub fn count_refused(&mut self, session: u64) {
        if let Ok(v) = self.vnic_of(session) {
            v.counters.refused_connections += 1;
        }
    }

    /// Sets the engine and the mediation policy.
    pub fn set_engine(&mut self, engine: Arc<Engine>, force_mediated: bool) {
        self.engine = Some(engine);
        self.force_mediated = force_mediated;
    }

    /// PEER_GONE notices queued while the lock was held: (daemon, its QP, our QP).
    pub fn take_notices(&mut self) -> Vec<(SocketAddr, u32, u32)> {
        std::mem::take(&mut self.notices)
    }

    /// A peer daemon asks to connect its QP `src_qpn` to our QP `dst_qpn` (broker, responder
    /// side): GID, tenant rules and the QP are checked; refusals are counted and logged.
    pub fn accept_remote(&mut self, from: SocketAddr, src_qpn: u32, dst_qpn: u32, req: &ConnectReq) -> Result<(), (i32, String)> {
        let Some(dest) = self.vnics.values().find(|v| gid_of(v.rec.ip) == req.dst_gid).map(|v| v.rec.name.clone()) else {
            log::warn!("refused QP {src_qpn} from {from}: no vNIC here has GID {}", std::net::Ipv6Addr::from(req.dst_gid));
            return Err((libc::EHOSTUNREACH, format!("no vNIC has GID {}", std::net::Ipv6Addr::from(req.dst_gid))));
        };
        let tenant = self.vnics[&dest].rec.tenant.clone();
        if !self.cluster.may_connect(&req.src_tenant, &tenant) {
            self.vnics.get_mut(&dest).expect("exists").counters.refused_connections += 1;
            log::warn!(
                "refused connection from QP {src_qpn} at {from} (tenant {}) to vNIC {dest} (tenant {tenant}): no rule allows it",
                req.src_tenant
            );
            return Err((libc::ECONNREFUSED, format!("tenant {} may not connect to tenant {tenant}", req.src_tenant)));
        }
        match self.qps.get_mut(&dst_qpn) {
            Some(p) if p.qp_type == QPT_RC && self.sessions.get(&p.session).is_some_and(|s| s.vnic == dest) => {
                if !p.remote_peers.contains(&(from, src_qpn)) {
                    p.remote_peers.push((from, src_qpn));
                }
                Ok(())
            }
            _ => {
                self.vnics.get_mut(&dest).expect("exists").counters.refused_connections += 1;
                Err((libc::ECONNREFUSED, format!("vNIC {dest} has no QP {dst_qpn}")))
            }
        }
    }

    /// The MR `key`, for the engine.
    pub fn mr_grant(&self, key: u32) -> Option<MrGrant> {
        self.mrs.get(&key).map(|m| MrGrant {
            session: m.session,
            pd: m.pd,
            bounds: MrBounds { addr: m.addr, length: m.length, access: m.access },
            chunks: m.chunks.clone(),
            proc_mem: m.proc_mem.clone(),
        })
    }

    /// The peer daemon says its QP `remote_qpn`, connected to our `local_qpn`, is gone.
    pub fn remote_peer_gone(&mut self, local_qpn: u32, from: SocketAddr, remote_qpn: u32) {
        let Some(q) = self.qps.get_mut(&local_qpn) else { return };
        q.remote_peers.retain(|p| *p != (from, remote_qpn));
        if q.remote != Some((from, remote_qpn)) {
            return;
        }
        if let Ok(w) = q.mapping.region().atomic_u64(ring::QP_ERROR_REQUEST) {
            w.store(ring::QP_ERR_PEER_GONE, Ordering::SeqCst);
        }
        for cq in [q.send_cq, q.recv_cq] {
            if let Some(c) = self.cqs.get(&cq) {
                signal_eventfd(&c.eventfd);
            }
        }
    }

    /// Ends a QP's mediated connection (reset, destroy): the engine stops, peers are told.
    fn disconnect_remote(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else { return };
        let remote = q.remote.take();
        let peers = std::mem::take(&mut q.remote_peers);
        if let Some(e) = &self.engine {
            if remote.is_some() {
                e.detach(qpn);
            }
        }
        for (addr, rq) in remote.into_iter().chain(peers) {
            self.notices.push((addr, rq, qpn));
        }
    }

    fn bump_mr_epoch(&self, session: u64) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        for q in s.qps.iter().filter_map(|n| self.qps.get(n)) {
            if let Ok(w) = q.mapping.region().atomic_u64(ring::QP_MR_EPOCH) {
                w.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// Tells every QP connected to `qpn` that its peer is gone: their owners move them to
    /// ERR and flush, woken through their CQs' eventfds.
    fn notify_peers_gone(&self, qpn: u32) {
        for q in self.qps.values().filter(|q| q.connected_to == Some(qpn)) {
            if let Ok(w) = q.mapping.region().atomic_u64(ring::QP_ERROR_REQUEST) {
                w.store(ring::QP_ERR_PEER_GONE, Ordering::SeqCst);
            }
            for cq in [q.send_cq, q.recv_cq] {
                if let Some(c) = self.cqs.get(&cq) {
                    signal_eventfd(&c.eventfd);
                }
            }
        }
    }

    fn destroy_qp(&mut self, qpn: u32) {
        self.notify_peers_gone(qpn);
        self.disconnect_remote(qpn);
        if let (Some(e), Some(QPT_UD)) = (&self.engine, self.qps.get(&qpn).map(|q| q.qp_type)) {
            e.detach_ud(qpn);
        }
        if let Some(q) = self.qps.remove(&qpn) {
            if let Some(s) = self.sessions.get_mut(&q.session) {
                s.qps.remove(&qpn);
                let vnic = s.vnic.clone();
                if let Some(v) = self.vnics.get_mut(&vnic) {
                    v.usage.qps -= 1;
                }
            }
        }
    }

    /// Releases everything a session holds (client exited or was killed).
    pub fn close_session(&mut self, session: u64) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        let qps: Vec<u32> = s.qps.iter().copied().collect();
        for q in qps {
            self.destroy_qp(q);
        }
        let s = self.sessions.remove(&session).expect("checked");
        for k in &s.mrs {
            self.mrs.remove(k);
            if let Some(e) = &self.engine {
                e.forget_mr(*k);
            }
        }
        for h in &s.srqs {
            self.srqs.remove(h);
        }
        for h in &s.cqs {
            self.cqs.remove(h);
        }
        for h in &s.pds {
            self.pds.remove(h);
        }
        if let Some(v) = self.vnics.get_mut(&s.vnic) {
            v.usage = Usage { clients: v.usage.clients.saturating_sub(1), ..Usage::default() };
            // Other sessions of the same vNIC keep their objects: recount from the tables.
            let others: Vec<u64> = self.sessions.iter().filter(|(_, o)| o.vnic == s.vnic).map(|(id, _)| *id).collect();
            for id in others {
                let o = &self.sessions[&id];
                v.usage.pds += o.pds.len() as u32;
                v.usage.cqs += o.cqs.len() as u32;
                v.usage.qps += o.qps.len() as u32;
                v.usage.srqs += o.srqs.len() as u32;
                v.usage.mrs += o.mrs.len() as u32;
                v.usage.mr_bytes += o.mrs.iter().filter_map(|k| self.mrs.get(k)).map(|m| m.length).sum::<u64>();
            }
        }
    }

    /// Limits of a vNIC.
    pub fn limits(&self, vnic: &str) -> Option<Limits> {
        self.vnics.get(vnic).map(|v| v.rec.limits)
    }
}

/// Performs a copy request on the memory [`Registry::copy_target`] checked. Errors: EFAULT
/// when the owner's memory is no longer there, EINVAL for a misaligned atomic.
pub fn copy_access(mem: &ProcMem, req: &Request) -> Result<Reply, RequestError> {
    let io = |e: crate::procmem::ProcMemError| match e {
        crate::procmem::ProcMemError::Misaligned { .. } => fail(libc::EINVAL, e.to_string()),
        e => fail(libc::EFAULT, e.to_string()),
    };
    match *req {
        Request::PeerMrWrite { addr, ref data, .. } => mem.write(addr, data).map(|()| Reply::Ok).map_err(io),
        Request::PeerMrRead { addr, len, .. } => {
            let mut data = vec![0u8; len as usize];
            mem.read(addr, &mut data).map_err(io)?;
            Ok(Reply::Bytes { data })
        }
        Request::PeerMrAtomic { addr, cmp_swap, compare_add, swap, .. } => {
            let op = if cmp_swap { Atomic::CmpSwap { compare: compare_add, swap } } else { Atomic::FetchAdd { add: compare_add } };
            mem.atomic(addr, op).map(|old| Reply::Atomic { old }).map_err(io)
        }
        _ => Err(bad(libc::EINVAL, "not a copy request")),
    }
}

fn make_region(
    size: usize,
    init: impl FnOnce(&SharedMapping) -> Result<(), shm::ShmError>,
) -> Result<(OwnedFd, SharedMapping), RequestError> {
    let err = |e: shm::ShmError| fail(libc::ENOMEM, e.to_string());
    let fd = shm::create_memfd("vrdma-queue", size, true).map_err(err)?;
    let map = SharedMapping::map_sealed(fd.as_fd(), size, true).map_err(err)?;
    init(&map).map_err(err)?;
    Ok((fd, map))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(name: &str, tenant: &str, ip: u8, host: &str) -> VnicRecord {
        VnicRecord {
            name: name.into(),
            tenant: tenant.into(),
            ip: Ipv4Addr::new(198, 18, 0, ip),
            prefix_len: 15,
            limits: Limits::default(),
            node_guid: 1,
            host: host.into(),
        }
    }

    #[test]
    fn broker_resolves_local_and_remote_gids_with_rules() {
        let mut r = Registry::default();
        r.cluster_mut().local_host = "h1".into();
        let h2 = HostRecord {
            name: "h2".into(),
            transport_addr: "198.19.255.12:4791".parse().unwrap(),
            underlay_ip: Ipv4Addr::new(198, 19, 255, 12),
        };
        for v in [rec("a", "red", 2, "h1"), rec("b", "blue", 3, "h1"), rec("far", "blue", 4, "h2"), rec("mine", "red", 5, "h1")] {
            r.cluster_mut().vnics.insert(v.name.clone(), v.clone());
            if v.host == "h1" && v.name != "mine" {
                r.add_vnic(v);
            }
        }
        r.cluster_mut().hosts.insert("h2".into(), h2.clone());
        let s = r.open_session("a", None).unwrap();
        let gid = |ip: u8| gid_of(Ipv4Addr::new(198, 18, 0, ip));

        // Cross-tenant: refused and counted on both local vNICs.
        assert_eq!(r.resolve_gid(s, 1, gid(3)).unwrap_err().errno, libc::ECONNREFUSED);
        assert_eq!(r.resolve_gid(s, 1, gid(4)).unwrap_err().errno, libc::ECONNREFUSED);
        // Unknown GIDs, and records of this host that are not served (yet).
        assert_eq!(r.resolve_gid(s, 1, gid(9)).unwrap_err().errno, libc::EHOSTUNREACH);
        assert_eq!(r.resolve_gid(s, 1, gid(5)).unwrap_err().errno, libc::EHOSTUNREACH);
        let counted = |r: &Registry, n: &str| r.status().iter().find(|v| v.record.name == n).unwrap().counters.refused_connections;
        assert_eq!((counted(&r, "a"), counted(&r, "b")), (4, 1));

        // A rule (either order) allows both directions.
        r.cluster_mut().rules.insert(RuleRecord::new("blue", "red"));
        assert_eq!(r.resolve_gid(s, 1, gid(3)).unwrap(), Resolved::Local("b".into()));
        assert_eq!(r.resolve_gid(s, 1, gid(4)).unwrap(), Resolved::Remote { vnic: rec("far", "blue", 4, "h2"), host: h2 });
        // A vNIC whose host is down.
        r.cluster_mut().hosts.clear();
        assert_eq!(r.resolve_gid(s, 1, gid(4)).unwrap_err().errno, libc::EHOSTUNREACH);

        // Removed under a live session: requests get ENODEV, closing still works.
        assert_eq!(r.sessions_of("a"), vec![s]);
        assert!(r.remove_vnic_forced("a"));
        assert_eq!(r.handle_request(s, Request::AllocPd, vec![]).unwrap_err().errno, libc::ENODEV);
        r.close_session(s);
        assert!(r.sessions_of("a").is_empty());
    }

    /// A datagram from another host reaches a UD QP only if it is addressed to that QP's
    /// GID, comes from the daemon serving the source vNIC, and tenant rules allow it.
    #[test]
    fn remote_ud_datagrams_are_checked_before_delivery() {
        let mut r = Registry::default();
        r.cluster_mut().local_host = "h1".into();
        let h2_addr: SocketAddr = "198.19.255.12:4791".parse().unwrap();
        let h2 = HostRecord { name: "h2".into(), transport_addr: h2_addr, underlay_ip: Ipv4Addr::new(198, 19, 255, 12) };
        for v in [rec("a", "red", 2, "h1"), rec("far", "red", 4, "h2"), rec("other", "blue", 6, "h2")] {
            r.cluster_mut().vnics.insert(v.name.clone(), v.clone());
            if v.host == "h1" {
                r.add_vnic(v);
            }
        }
        r.cluster_mut().hosts.insert("h2".into(), h2);
        let s = r.open_session("a", None).unwrap();
        let gid = |ip: u8| gid_of(Ipv4Addr::new(198, 18, 0, ip));
        let handle = |r: &mut Registry, req| match r.handle_request(s, req, vec![]).unwrap().0 {
            Reply::Handle { handle } => handle,
            Reply::Cq { cq } => cq,
            Reply::Qp { qpn, .. } => qpn,
            other => panic!("{other:?}"),
        };
        let pd = handle(&mut r, Request::AllocPd);
        let cq = handle(&mut r, Request::CreateCq { cqe: 16 });
        let caps = QpCaps { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let ud = handle(&mut r, Request::CreateQp { pd, send_cq: cq, recv_cq: cq, srq: 0, qp_type: QPT_UD, caps });
        let rc = handle(&mut r, Request::CreateQp { pd, send_cq: cq, recv_cq: cq, srq: 0, qp_type: 2, caps });

        assert_eq!(r.accept_ud(h2_addr, &gid(4), ud, &gid(2)), Ok(()));
        assert!(r.ud_receiver(ud).is_some());
        // Not a UD QP, no such QP, or another GID than the QP's.
        assert!(r.accept_ud(h2_addr, &gid(4), rc, &gid(2)).is_err());
        assert!(r.ud_receiver(rc).is_none());
        assert!(r.accept_ud(h2_addr, &gid(4), 999, &gid(2)).is_err());
        assert!(r.accept_ud(h2_addr, &gid(4), ud, &gid(9)).is_err());
        // A source GID nobody has, or one served by another daemon than the sender.
        assert!(r.accept_ud(h2_addr, &gid(8), ud, &gid(2)).is_err());
        assert!(r.accept_ud("198.19.255.13:4791".parse().unwrap(), &gid(4), ud, &gid(2)).is_err());
        // Another tenant: refused and counted, until a rule allows it.
        let refused = |r: &Registry| r.status().iter().find(|v| v.record.name == "a").unwrap().counters.refused_connections;
        let before = refused(&r);
        assert!(r.accept_ud(h2_addr, &gid(6), ud, &gid(2)).unwrap_err().contains("tenant"));
        assert_eq!(refused(&r), before + 1);
        r.cluster_mut().rules.insert(RuleRecord::new("blue", "red"));
        assert_eq!(r.accept_ud(h2_addr, &gid(6), ud, &gid(2)), Ok(()));
        r.close_session(s);
        assert!(r.accept_ud(h2_addr, &gid(4), ud, &gid(2)).is_err());
    }

    #[test]
    fn single_host_store_serves_every_record() {
        let mut c = ClusterView { local_host: "new-name".into(), ..Default::default() };
        assert!(c.is_local("") && c.is_local("new-name") && !c.is_local("old-name"));
        c.single_host = true;
        assert!(c.is_local("old-name"));
        assert!(c.may_connect("x", "x") && !c.may_connect("x", "y"));
    }
}
