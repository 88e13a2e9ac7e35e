//! The daemon's cache of the cluster, and where the broker found a destination in it.

use std::collections::{HashMap, HashSet};

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
}
