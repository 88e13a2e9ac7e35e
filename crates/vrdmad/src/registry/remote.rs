//! The registry's side of other daemons (reached through the engine): connections and
//! datagrams they ask for, their QPs going away, and the PEER_GONE notices ours owe them.

use std::net::{Ipv6Addr, SocketAddr};

use vrdma_abi::wire::ConnectReq;

use super::{gid_of, Registry, RequestError, UdRefusal, QPT_RC, QPT_UD};

impl Registry {
    /// A peer daemon asks to connect its QP `src_qpn` to our QP `dst_qpn` (broker, responder
    /// side): GID, tenant rules and the QP are checked; refusals are counted and logged.
    pub fn accept_remote(&mut self, from: SocketAddr, src_qpn: u32, dst_qpn: u32, req: &ConnectReq) -> Result<(), RequestError> {
        let gid = Ipv6Addr::from(req.dst_gid);
        let Some(dest) = self.vnics.values().find(|v| gid_of(v.rec.ip) == req.dst_gid).map(|v| v.rec.name.clone()) else {
            log::warn!("refused QP {src_qpn} from {from}: no vNIC here has GID {gid}");
            return Err(RequestError::UnknownGid { gid });
        };
        let tenant = self.vnics[&dest].rec.tenant.clone();
        // The requester's vNIC and tenant come from the cluster view: its GID must be a vNIC
        // the daemon at `from` serves; the tenant the frame claims is not used.
        let src_tenant = match self.cluster.source_vnic(&req.src_gid, from) {
            Ok(src) => src.tenant.clone(),
            Err(why) => {
                self.count_refused_on(&dest);
                let src = Ipv6Addr::from(req.src_gid);
                log::warn!("refused connection from QP {src_qpn} at {from} (GID {src}) to vNIC {dest}: {why}");
                return Err(RequestError::ForeignSource { gid: src, from, why });
            }
        };
        if src_tenant != req.src_tenant {
            log::warn!("connection from QP {src_qpn} at {from} claims tenant {:?}; its vNIC's is {src_tenant}", req.src_tenant);
        }
        if !self.cluster.may_connect(&src_tenant, &tenant) {
            self.count_refused_on(&dest);
            log::warn!(
                "refused connection from QP {src_qpn} at {from} (tenant {src_tenant}) to vNIC {dest} (tenant {tenant}): no rule allows it"
            );
            return Err(RequestError::TenantsNotAllowed { from: src_tenant, to: tenant });
        }
        match self.qps.get_mut(&dst_qpn) {
            Some(p) if p.qp_type == QPT_RC && self.sessions.get(&p.session).is_some_and(|s| s.vnic == dest) => {
                if !p.remote_peers.contains(&(from, src_qpn)) {
                    p.remote_peers.push((from, src_qpn));
                }
                Ok(())
            }
            _ => {
                self.count_refused_on(&dest);
                Err(RequestError::NoRcQp { vnic: dest, qpn: dst_qpn })
            }
        }
    }

    /// Whether a datagram from the vNIC with `src_gid`, forwarded by the daemon at `from`,
    /// may reach our UD QP `dst_qpn` at `dgid`: the QP is a UD QP of the vNIC with that GID,
    /// the source vNIC is served by that daemon, and tenant rules allow it.
    pub fn accept_ud(&mut self, from: SocketAddr, src_gid: &[u8; 16], dst_qpn: u32, dgid: &[u8; 16]) -> Result<(), UdRefusal> {
        let q = self.qps.get(&dst_qpn).filter(|q| q.qp_type == QPT_UD).ok_or(UdRefusal::NoUdQp { qpn: dst_qpn })?;
        let vnic = &self.sessions.get(&q.session).ok_or(UdRefusal::NoSession)?.vnic;
        let dest = &self.vnics.get(vnic).ok_or(UdRefusal::VnicDeleted)?.rec;
        if gid_of(dest.ip) != *dgid {
            return Err(UdRefusal::WrongGid { qpn: dst_qpn, gid: Ipv6Addr::from(*dgid) });
        }
        let src = self.cluster.vnics.values().find(|v| gid_of(v.ip) == *src_gid).ok_or(UdRefusal::UnknownSource)?;
        match self.cluster.hosts.get(&src.host) {
            Some(h) if h.transport_addr == from => {}
            _ => return Err(UdRefusal::WrongDaemon { vnic: src.name.clone(), from }),
        }
        if !self.cluster.may_connect(&src.tenant, &dest.tenant) {
            let why = UdRefusal::TenantsNotAllowed { from: src.tenant.clone(), to: dest.tenant.clone() };
            let name = dest.name.clone();
            self.count_refused_on(&name);
            return Err(why);
        }
        Ok(())
    }

    /// The peer daemon says its QP `remote_qpn`, connected to our `local_qpn`, is gone.
    pub fn remote_peer_gone(&mut self, local_qpn: u32, from: SocketAddr, remote_qpn: u32) {
        let Some(q) = self.qps.get_mut(&local_qpn) else { return };
        q.remote_peers.retain(|p| *p != (from, remote_qpn));
        if q.remote != Some((from, remote_qpn)) {
            return;
        }
        self.flag_peer_gone(&self.qps[&local_qpn]);
    }

    /// Ends a QP's mediated connection (reset, destroy): the engine stops, peers are told
    /// (once the lock is released: see [`Registry::take_notices`]).
    pub(super) fn disconnect_remote(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else { return };
        let remote = q.remote.take();
        let peers = std::mem::take(&mut q.remote_peers);
        if remote.is_some() {
            self.keep_engine_meter(qpn);
        }
        if let Some(e) = &self.engine {
            if remote.is_some() {
                e.detach(qpn);
            }
        }
        for (addr, rq) in remote.into_iter().chain(peers) {
            self.notices.push((addr, rq, qpn));
        }
    }

    /// PEER_GONE notices queued while the lock was held: (daemon, its QP, our QP).
    pub fn take_notices(&mut self) -> Vec<(SocketAddr, u32, u32)> {
        std::mem::take(&mut self.notices)
    }
}
