//! UD destinations: a UD QP's sends to a QP of this host go straight into its rings; to
//! another host, through the engine.

use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use vrdma_abi::control::Reply;

use super::{gid_of, Plan, Registry, ReplyFds, RequestError, Resolved, QPT_UD};
use crate::engine::UdReceiverSetup;

/// How a UD destination resolves: answered (a destination on this host, or an error), or on
/// another host, where the engine forwards the QP's datagrams to its daemon. Add the route
/// ([`crate::engine::Engine::add_ud_route`], without the registry lock: it may connect),
/// then [`Registry::finish_remote_ud`].
pub type UdPlan = Plan<RemoteUd>;

/// A UD destination on another host.
pub struct RemoteUd {
    /// The destination's daemon.
    pub addr: SocketAddr,
    /// The sending vNIC's GID.
    pub src_gid: [u8; 16],
    /// The sending vNIC (whose caps and share its datagrams count against).
    pub vnic: String,
}

impl Registry {
    /// `ResolveUd`: the destination of a UD send, with the same tenant checks as connecting.
    /// A destination on another host is reached through the engine (see [`UdPlan`]).
    pub fn prepare_resolve_ud(&mut self, session: u64, qpn: u32, dgid: [u8; 16], dest_qpn: u32) -> Result<UdPlan, RequestError> {
        let q = self.own_qp(session, qpn)?;
        if q.qp_type != QPT_UD {
            return Err(RequestError::NotUdQp { qpn });
        }
        let dest = match self.resolve_gid(session, qpn, dgid)? {
            Resolved::Local(name) => name,
            Resolved::Remote { host, .. } => {
                if self.engine.is_none() {
                    return Err(RequestError::NoEngine);
                }
                let vnic = &self.sessions[&session].vnic;
                let src_gid = self.vnics.get(vnic).map(|v| gid_of(v.rec.ip)).ok_or(RequestError::VnicDeleted)?;
                return Ok(Plan::Remote(RemoteUd { addr: host.transport_addr, src_gid, vnic: vnic.clone() }));
            }
        };
        match self.qps.get(&dest_qpn) {
            Some(p) if p.qp_type == QPT_UD && self.sessions.get(&p.session).is_some_and(|s| s.vnic == dest) => {}
            _ => return Err(RequestError::NoUdQp { vnic: dest, qpn: dest_qpn }),
        }
        let (info, fds) = self.peer_info(dest_qpn);
        self.own_qp_mut(session, qpn)?.ud_peers.insert(dest_qpn);
        Ok(Plan::Done(Reply::Connected(info), fds))
    }

    /// `ResolveUd` of a destination on another host, once the engine routes to it (`created`:
    /// the client's end of the datagram socket the engine made for the QP's first route): the
    /// client gets the QP's datagram socket. On error the caller detaches the QP's UD
    /// sending side from the engine.
    pub fn finish_remote_ud(&mut self, session: u64, qpn: u32, created: Option<OwnedFd>) -> Result<(Reply, ReplyFds), RequestError> {
        let q = self.own_qp_mut(session, qpn)?;
        if let Some(c) = created {
            q.ud_socket = Some(Arc::new(c));
        }
        let socket = q.ud_socket.clone().ok_or(RequestError::UdSocketGone)?;
        Ok((Reply::UdRemote, vec![socket]))
    }

    /// Our UD QP `qpn`'s receiving side, for the engine.
    pub fn ud_receiver(&self, qpn: u32) -> Option<UdReceiverSetup> {
        let q = self.qps.get(&qpn).filter(|q| q.qp_type == QPT_UD)?;
        let cq = self.cqs.get(&q.recv_cq)?;
        Some(UdReceiverSetup {
            qpn,
            session: q.session,
            pd: q.pd,
            recv: self.recv_side(q)?,
            recv_cq: (cq.region.clone(), cq.eventfd.clone()),
        })
    }
}
