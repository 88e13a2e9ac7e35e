//! The daemon's cache of the cluster, and where the broker found a destination in it.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;

use super::Registry;
use crate::store::{HostRecord, RuleRecord, VnicRecord};

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
    /// Tenant policies (caps, weights), by tenant; a tenant without one has none.
    pub tenants: HashMap<String, vrdma_abi::control::Qos>,
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

    /// The host record of the host serving a vNIC whose record names `host`.
    fn serving_host(&self, host: &str) -> Option<&HostRecord> {
        self.hosts.get(if self.is_local(host) { self.local_host.as_str() } else { host })
    }

    /// Whether the daemon listening at `addr` is host `name`: the view has that host at that
    /// address. Err: what the view says instead.
    pub fn check_peer_host(&self, name: &str, addr: SocketAddr) -> Result<(), String> {
        match self.hosts.get(name) {
            Some(h) if h.transport_addr == addr => Ok(()),
            Some(h) => Err(format!("host {name} is at {}", h.transport_addr)),
            None => match self.hosts.values().find(|h| h.transport_addr == addr) {
                Some(other) => Err(format!("{addr} is host {}", other.name)),
                None => Err(format!("no host {name} in the cluster")),
            },
        }
    }

    /// The vNIC with GID `gid` if the daemon listening at `from` serves it: what a peer
    /// daemon's frames may speak for (its tenant comes from here, never from the frame).
    pub fn source_vnic(&self, gid: &[u8; 16], from: SocketAddr) -> Result<&VnicRecord, SourceRefusal> {
        let v = self.vnics.values().find(|v| v.ip.to_ipv6_mapped().octets() == *gid).ok_or(SourceRefusal::Unknown)?;
        match self.serving_host(&v.host) {
            Some(h) if h.transport_addr == from => Ok(v),
            _ => Err(SourceRefusal::NotServedBy { vnic: v.name.clone(), host: v.host.clone() }),
        }
    }
}

/// Why a peer daemon may not speak for a source vNIC.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceRefusal {
    /// No vNIC of the cluster has the GID.
    #[error("no vNIC of the cluster has that GID")]
    Unknown,
    /// The vNIC is another daemon's.
    #[error("vNIC {vnic} is served by host {host:?}, not by that daemon")]
    NotServedBy {
        /// The vNIC.
        vnic: String,
        /// Its host.
        host: String,
    },
}

/// Where a GID lives, as the broker resolved it (tenant rules already checked).
// (Short-lived, one per connection request: boxing the remote records buys nothing.)
#[allow(clippy::large_enum_variant)]
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

impl Registry {
    /// The cluster cache.
    pub fn cluster(&self) -> &ClusterView {
        &self.cluster
    }

    /// The cluster cache, to update from the store.
    pub fn cluster_mut(&mut self) -> &mut ClusterView {
        &mut self.cluster
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_host_store_serves_every_record() {
        let mut c = ClusterView { local_host: "new-name".into(), ..Default::default() };
        assert!(c.is_local("") && c.is_local("new-name") && !c.is_local("old-name"));
        c.single_host = true;
        assert!(c.is_local("old-name"));
        assert!(c.may_connect("x", "x") && !c.may_connect("x", "y"));
    }

    #[test]
    fn peers_and_sources_come_from_the_view() {
        let h = |name: &str, last: u8| HostRecord {
            name: name.into(),
            transport_addr: SocketAddr::from(([198, 19, 0, last], 4791)),
            underlay_ip: std::net::Ipv4Addr::new(198, 19, 0, last),
        };
        let mut c = ClusterView { local_host: "h1".into(), ..Default::default() };
        for x in [h("h1", 11), h("h2", 12)] {
            c.hosts.insert(x.name.clone(), x);
        }
        let (a1, a2) = (h("h1", 11).transport_addr, h("h2", 12).transport_addr);
        c.check_peer_host("h2", a2).unwrap();
        assert!(c.check_peer_host("h2", a1).unwrap_err().contains("host h2 is at"));
        assert!(c.check_peer_host("h3", a1).unwrap_err().contains("is host h1"));
        assert!(c.check_peer_host("h3", SocketAddr::from(([198, 19, 0, 13], 4791))).is_err());
        let v = VnicRecord {
            name: "b".into(),
            tenant: "blue".into(),
            ip: std::net::Ipv4Addr::new(198, 18, 0, 7),
            prefix_len: 15,
            limits: Default::default(),
            node_guid: 1,
            host: "h2".into(),
            qos: Default::default(),
        };
        c.vnics.insert("b".into(), v.clone());
        let gid = v.ip.to_ipv6_mapped().octets();
        assert_eq!(c.source_vnic(&gid, a2).unwrap().tenant, "blue");
        assert!(matches!(c.source_vnic(&gid, a1), Err(SourceRefusal::NotServedBy { .. })));
        assert_eq!(c.source_vnic(&[0; 16], a2), Err(SourceRefusal::Unknown));
    }
}
