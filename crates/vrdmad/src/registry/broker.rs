//! The connection broker: where a GID lives and whether the caller's tenant may reach it,
//! and connecting RC QPs (directly on one host, through the engine across hosts).

use std::net::{Ipv6Addr, SocketAddr};

use vrdma_abi::control::{PeerInfo, Reply};
use vrdma_abi::wire::ConnectReq;

use super::{gid_of, Registry, ReplyFds, RequestError, Resolved, QPT_RC};
use crate::engine::{Lane, MedQpSetup};

/// How a request that may need another host's daemon proceeds (see [`ConnectPlan`],
/// [`UdPlan`](super::UdPlan)).
pub enum Plan<R> {
    /// Answered (on this host, or an error).
    Done(Reply, ReplyFds),
    /// The engine must ask another daemon first, without the registry lock (that daemon
    /// may be asking us at the same time): `R` says what to ask.
    Remote(R),
}

impl<R> Plan<R> {
    /// The answer, or the one `remote` gives after its step through the engine.
    pub fn answer_or(self, remote: impl FnOnce(R) -> Result<(Reply, ReplyFds), RequestError>) -> Result<(Reply, ReplyFds), RequestError> {
        match self {
            Plan::Done(reply, fds) => Ok((reply, fds)),
            Plan::Remote(step) => remote(step),
        }
    }

    /// The answer of the registry alone: a step through the engine is the daemon's to take
    /// (`Daemon::connect_qp`, `Daemon::resolve_ud`: they take it without the registry lock).
    pub fn answered_here(self) -> Result<(Reply, ReplyFds), RequestError> {
        self.answer_or(|_| Err(RequestError::RemoteNeedsDaemon))
    }
}

/// How a connection request proceeds: answered directly (same host), or the peer is reached
/// through the engine: ask its daemon, then [`Registry::finish_remote_connect`].
pub type ConnectPlan = Plan<RemoteConnect>;

/// What to ask the peer daemon for a connection through the engine.
pub struct RemoteConnect {
    /// The peer daemon's transport address.
    pub addr: SocketAddr,
    /// What to ask it.
    pub req: ConnectReq,
}

impl Registry {
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
        let my_vnic = self.sessions.get(&session).ok_or(RequestError::NoSession)?.vnic.clone();
        let my_tenant = self.vnics.get(&my_vnic).ok_or(RequestError::VnicDeleted)?.rec.tenant.clone();
        let gid = Ipv6Addr::from(dgid);
        let local = self.vnics.values().find(|v| gid_of(v.rec.ip) == dgid).map(|v| v.rec.clone());
        let remote = || self.cluster.vnics.values().find(|v| gid_of(v.ip) == dgid && !self.cluster.is_local(&v.host)).cloned();
        let (dest, is_local) = match local {
            Some(r) => (r, true),
            None => match remote() {
                Some(r) => (r, false),
                None => {
                    self.count_refused_on(&my_vnic);
                    log::warn!("vNIC {my_vnic}: QP {qpn} refused: no vNIC has GID {gid}");
                    return Err(RequestError::UnknownGid { gid });
                }
            },
        };
        if !self.cluster.may_connect(&my_tenant, &dest.tenant) && (is_local || !defer_remote_rules) {
            self.count_refused_on(&my_vnic);
            self.count_refused_on(&dest.name);
            let (dest_name, dest_tenant) = (&dest.name, &dest.tenant);
            log::warn!("refused connection from vNIC {my_vnic} (tenant {my_tenant}) QP {qpn} to vNIC {dest_name} (tenant {dest_tenant}): no rule allows it");
            return Err(RequestError::TenantsNotAllowed { from: my_tenant, to: dest.tenant });
        }
        if is_local {
            return Ok(Resolved::Local(dest.name));
        }
        let Some(host) = self.cluster.hosts.get(&dest.host).cloned() else {
            self.count_refused_on(&my_vnic);
            log::warn!("vNIC {my_vnic}: QP {qpn} refused: vNIC {} (GID {gid}) is on host {}, which is down", dest.name, dest.host);
            return Err(RequestError::HostDown { vnic: dest.name, host: dest.host });
        };
        Ok(Resolved::Remote { vnic: dest, host })
    }

    /// Counts a refused connection (or datagram) on vNIC `name`, if it is still served here.
    pub(super) fn count_refused_on(&mut self, name: &str) {
        if let Some(v) = self.vnics.get_mut(name) {
            v.counters.refused_connections += 1;
        }
    }

    /// `CheckGid`: whether the caller may address `dgid` (a remote GID is a valid AH
    /// destination).
    pub(super) fn check_gid(&mut self, session: u64, dgid: [u8; 16]) -> Result<Reply, RequestError> {
        self.resolve_gid(session, 0, dgid)?;
        Ok(Reply::Ok)
    }

    /// The fds and description of QP `dest_qpn`'s receive side, for a requester.
    pub(super) fn peer_info(&self, dest_qpn: u32) -> (PeerInfo, ReplyFds) {
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

    /// `ConnectQp`, first half: resolves the destination (tenant rules) and either connects
    /// directly (same host) or says which daemon to ask (mediated).
    pub fn prepare_connect(&mut self, session: u64, qpn: u32, dgid: [u8; 16], dest_qpn: u32) -> Result<ConnectPlan, RequestError> {
        if self.own_qp(session, qpn)?.qp_type != QPT_RC {
            return Err(RequestError::NotRcQp { qpn });
        }
        let my_vnic = self.sessions[&session].vnic.clone();
        let (dest, is_remote) = match self.resolve_gid_with(session, qpn, dgid, true)? {
            Resolved::Local(name) => (name, None),
            Resolved::Remote { vnic, host } => (vnic.name, Some(host.transport_addr)),
        };
        let connect_req = |r: &Self| {
            let me = &r.vnics[&my_vnic].rec;
            ConnectReq { src_gid: gid_of(me.ip), dst_gid: dgid, src_tenant: me.tenant.clone() }
        };
        if let Some(addr) = is_remote {
            // Another host serves the destination: its daemon accepts (or refuses) the QP.
            if self.engine.is_none() {
                return Err(RequestError::CrossHostNeedsEngine);
            }
            log::debug!("QP {qpn} of vNIC {my_vnic}: {dest} is remote, asking {addr}");
            return Ok(Plan::Remote(RemoteConnect { addr, req: connect_req(self) }));
        }
        // A vNIC caught over its caps on the direct path connects through the engine too.
        if self.force_mediated || self.is_demoted(&my_vnic) {
            if let Some(e) = &self.engine {
                return Ok(Plan::Remote(RemoteConnect { addr: e.local_addr(), req: connect_req(self) }));
            }
        }
        match self.qps.get(&dest_qpn) {
            Some(p) if p.qp_type == QPT_RC && self.sessions.get(&p.session).is_some_and(|s| s.vnic == dest) => {}
            _ => {
                self.count_refused_on(&my_vnic);
                return Err(RequestError::NoRcQp { vnic: dest, qpn: dest_qpn });
            }
        }
        let (info, fds) = self.peer_info(dest_qpn);
        self.own_qp_mut(session, qpn)?.connected_to = Some(dest_qpn);
        if let Some(v) = self.vnics.get_mut(&my_vnic) {
            v.counters.connections += 1;
        }
        // The QP's share of its vNIC's caps, before its first send (and the others' shares
        // shrink to make room).
        self.publish_qos(&my_vnic);
        Ok(Plan::Done(Reply::Connected(info), fds))
    }

    /// `ConnectQp`, second half of a mediated connection the peer daemon accepted: the engine
    /// takes over the QP's sends and the client gets its channel.
    pub fn finish_remote_connect(
        &mut self,
        session: u64,
        qpn: u32,
        addr: SocketAddr,
        dest_qpn: u32,
        lane: Option<Lane>,
    ) -> Result<(Reply, ReplyFds), RequestError> {
        let engine = self.engine.clone().ok_or(RequestError::NoEngine)?;
        let q = self.own_qp(session, qpn)?;
        let cq = |h: u32| self.cqs.get(&h).map(|c| (c.region.clone(), c.eventfd.clone()));
        let (Some(send_cq), Some(recv_cq)) = (cq(q.send_cq), cq(q.recv_cq)) else {
            return Err(RequestError::QpCqGone);
        };
        let recv = self.recv_side(q).ok_or(RequestError::QpSrqGone)?;
        let vnic = self.sessions[&session].vnic.clone();
        let setup = MedQpSetup { qpn, session, pd: q.pd, vnic, remote: addr, remote_qpn: dest_qpn, caps: q.caps, recv, send_cq, recv_cq };
        let (chan, doorbell, lane, layout) = engine.attach(setup, lane)?;
        self.own_qp_mut(session, qpn)?.remote = Some((addr, dest_qpn));
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
}
