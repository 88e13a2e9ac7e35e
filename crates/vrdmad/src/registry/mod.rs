//! The daemon's state: vNICs, client sessions and every verbs object they hold, and the
//! handling of each control request (validation, limits, connection brokering).
//!
//! Everything a request names (handles, QPNs, keys) is looked up *within the caller's
//! session*; a stale handle or one of another vNIC gets an error reply and is counted.
//!
//! Layout: this file holds the [`Registry`] and dispatches requests; `vnic` is the table of
//! served vNICs, `session` the client sessions; `pd`, `cq`, `srq`, `qp` and `mr` the verbs
//! objects; `broker` resolves GIDs and connects RC QPs, `ud` resolves UD destinations,
//! `peer_mr` hands out a peer's MRs (`key_guard` throttles bad remote keys, `rehome` takes
//! them back from peers that lose the right); `remote` answers other daemons (through the engine);
//! `qos` checks that the direct path keeps to each vNIC's caps (and demotes a vNIC that
//! does not); `load` bounds each vNIC's control requests in progress and their CPU share;
//! `cluster` is the cache of the cluster; `error` says why a request failed.

mod broker;
mod cluster;
mod copy_into;
mod cq;
mod descriptors;
mod error;
mod fuzz;
mod invariants;
mod key_guard;
mod load;
mod metering;
mod mr;
mod pd;
mod peer_mr;
mod qos;
mod qp;
mod queue_memory;
mod rehome;
mod remote;
mod session;
mod srq;
mod staging;
mod ud;
mod vnic;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use vrdma_abi::control::{Reply, Request};
use vrdma_abi::shm::{self, SharedMapping};

use crate::engine::Engine;

pub use broker::{ConnectPlan, Plan, RemoteConnect};
pub use cluster::{ClusterView, Resolved, SourceRefusal};
pub use copy_into::{CopyIntoError, DirectCopy};
pub use descriptors::DESCRIPTOR_RESERVE;
pub use error::{RequestError, UdRefusal};
pub use fuzz::{fuzz_requests, seed_sequence};
pub use load::{PendingGauge, PendingRequest};
pub use metering::VnicMeter;
pub use peer_mr::copy_access;
pub use qos::{Detector, Excess, TICK as QOS_TICK, TOLERANCE_PERCENT as QOS_TOLERANCE_PERCENT, WINDOW_NS as QOS_WINDOW_NS};
pub use qp::{QpPlan, QpRegion};
pub use ud::{RemoteUd, UdPlan};
pub use vnic::{Counters, VnicStatus};
/// Wakes whoever sleeps on a CQ's eventfd (kept here for the engine's older import path).
pub use vrdma_abi::fd::signal_eventfd;

use cq::CqRec;
use mr::MrRec;
use qp::QpRec;
use session::Session;
use srq::SrqRec;
use vnic::VnicState;

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

/// Fds to send with a reply.
pub type ReplyFds = Vec<Arc<OwnedFd>>;

/// All daemon state.
#[derive(Default)]
pub struct Registry {
    vnics: HashMap<String, VnicState>,
    /// Persisted meter totals of vNICs not served yet (see `metering`).
    meter_base: HashMap<String, vrdma_abi::ring::MeterWords>,
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
    /// MRs their owners must move to new pages, by session.
    rehomes: rehome::Rehoming,
    /// Descriptors held for all MRs, and their budget (see `descriptors`).
    descriptors_held: u64,
    descriptor_budget: Option<u64>,
    /// The direct path's caps: each vNIC's check, and the vNICs demoted (see `qos`).
    qos_watch: qos::QosWatch,
    /// vrdmad's mappings of MRs that direct copies write or read (see `copy_into`).
    own_maps: copy_into::OwnMaps,
}

/// A reply that carries no descriptors.
fn without_fds(reply: Reply) -> (Reply, ReplyFds) {
    (reply, vec![])
}

/// How many descriptors `req` comes with: one per MR chunk, none for anything else.
pub fn expected_fds(req: &Request) -> usize {
    match req {
        Request::RegMr { chunks, .. } | Request::RehomeMr { chunks, .. } => chunks.len(),
        _ => 0,
    }
}

impl Registry {
    /// Handles one request of `session`. `fds` are the descriptors that came with it.
    pub fn handle_request(&mut self, session: u64, req: Request, fds: Vec<OwnedFd>) -> Result<(Reply, ReplyFds), RequestError> {
        let expected = expected_fds(&req);
        if fds.len() != expected {
            return Err(RequestError::FdCount { expected, got: fds.len() });
        }
        match req {
            Request::Hello { version } => {
                let reply = self.hello(session, version)?;
                Ok((reply, self.rehome_eventfd(session).into_iter().collect()))
            }
            Request::TakeRehomes => self.take_rehomes(session).map(without_fds),
            Request::CopyStaging => self.copy_staging(session),
            Request::BeginRehome { key } => self.begin_rehome(session, key).map(without_fds),
            Request::RehomeMr { key, chunks } => {
                self.with_descriptors(session, Some(key), fds.len(), |r| r.rehome_mr(session, key, chunks, fds))
            }
            Request::QueryUsage => Ok(without_fds(Reply::Usage(self.vnic_of(session)?.usage))),
            Request::AllocPd => self.alloc_pd(session).map(without_fds),
            Request::DeallocPd { pd } => self.dealloc_pd(session, pd).map(without_fds),
            Request::RegMr { pd, addr, length, access, chunks } => self.with_descriptors(session, None, fds.len(), |r| {
                r.reg_mr(session, mr::MrSpec { pd, addr, length, access }, chunks, fds).map(without_fds)
            }),
            Request::DeregMr { key } => self.with_descriptors(session, Some(key), 0, |r| r.dereg_mr(session, key).map(without_fds)),
            Request::CreateCq { cqe } => self.create_cq(session, cqe),
            Request::DestroyCq { cq } => self.destroy_cq(session, cq).map(without_fds),
            Request::CreateSrq { pd, max_wr, max_sge } => self.create_srq(session, pd, max_wr, max_sge),
            Request::DestroySrq { srq } => self.destroy_srq(session, srq).map(without_fds),
            Request::CreateQp { pd, send_cq, recv_cq, srq, qp_type, caps } => {
                self.create_qp(session, qp::QpSpec { pd, send_cq, recv_cq, srq, qp_type, caps })
            }
            Request::SetQpState { qpn, state } => self.set_qp_state(session, qpn, state).map(without_fds),
            Request::ConnectQp { qpn, dgid, dest_qpn } => self.prepare_connect(session, qpn, dgid, dest_qpn)?.answered_here(),
            Request::DestroyQp { qpn } => self.destroy_own_qp(session, qpn).map(without_fds),
            Request::MoveToEngine { qpn } => self.prepare_move_to_engine(session, qpn)?.0.answered_here(),
            Request::MapPeerMr { qpn, key } => self.map_peer_mr(session, qpn, None, key),
            Request::CheckGid { dgid } => self.check_gid(session, dgid).map(without_fds),
            Request::ResolveUd { qpn, dgid, dest_qpn } => self.prepare_resolve_ud(session, qpn, dgid, dest_qpn)?.answered_here(),
            Request::MapUdPeerMr { qpn, dest_qpn, key } => self.map_peer_mr(session, qpn, Some(dest_qpn), key),
            req @ (Request::PeerMrWrite { .. } | Request::PeerMrRead { .. } | Request::PeerMrAtomic { .. }) => {
                let mem = self.copy_target(session, &req)?;
                copy_access(&mem, &req).map(without_fds)
            }
            req @ Request::PeerMrCopy { .. } => {
                self.direct_copy(session, &req)?.run()?;
                Ok(without_fds(Reply::Ok))
            }
        }
    }

    /// A new handle for a PD, CQ or SRQ (never 0).
    fn handle(&mut self) -> u32 {
        self.next_handle = self.next_handle.wrapping_add(1).max(1);
        self.next_handle
    }

    /// Sets the engine and the mediation policy.
    pub fn set_engine(&mut self, engine: Arc<Engine>, force_mediated: bool) {
        self.engine = Some(engine);
        self.force_mediated = force_mediated;
    }
}

/// A sealed memfd of `size` bytes for a queue, mapped here to be initialised by `init`.
fn make_region(
    size: usize,
    init: impl FnOnce(&SharedMapping) -> Result<(), shm::ShmError>,
) -> Result<(OwnedFd, SharedMapping), RequestError> {
    let fd = shm::create_memfd("vrdma-queue", size, true).map_err(RequestError::QueueMemory)?;
    let map = SharedMapping::map_sealed(fd.as_fd(), size, true).map_err(RequestError::QueueMemory)?;
    init(&map).map_err(RequestError::QueueMemory)?;
    Ok((fd, map))
}
