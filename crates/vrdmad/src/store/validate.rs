//! What a store record must be before the daemon acts on it.
//!
//! Records come from etcd, which anyone holding the store's credentials (or, without them, anyone
//! on its network) can write. A vNIC's name becomes a directory under the run directory that is
//! later removed recursively, its address becomes a /32 route on every host, a host's address
//! becomes a next hop and the identity of a peer, and limits size the daemon's allocations. So
//! every record is checked here; [`Check`] holds the rules, [`super::guard::View`] applies them to
//! the stream of store events.

use std::net::{IpAddr, Ipv4Addr};

use vrdma_abi::control::{Limits, Qos};

use super::{HostRecord, RuleRecord, TenantRecord, VnicRecord};

/// Largest count limit a record may set (PDs, CQs, QPs, MRs, SRQs): far above any real need,
/// far below what would overflow the daemon's tables.
pub const MAX_COUNT_LIMIT: u32 = 1 << 24;
/// Largest CPU share a record may set (percent of one CPU: 256 CPUs). The smallest is 1: a
/// share of 0 would stop the vNIC's requests for good.
pub const MAX_CPU_PERCENT_LIMIT: u32 = 100 * 256;
/// Largest `max_mr_bytes` a record may set (1 PiB).
pub const MAX_MR_BYTES_LIMIT: u64 = 1 << 50;
/// Largest bandwidth cap a policy may set (1 PB/s: any finite cap fits; the engine's token
/// arithmetic stays far from overflow).
pub const MAX_QOS_BW: u64 = 1 << 50;
/// Largest message-rate cap a policy may set (2^40 WRs/s).
pub const MAX_QOS_MSG_RATE: u64 = 1 << 40;
/// Largest fair-sharing weight.
pub const MAX_QOS_WEIGHT: u32 = 10_000;

/// Why a record is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// A name (vNIC, host or tenant) outside `[A-Za-z0-9][A-Za-z0-9._-]{0,62}`.
    #[error("{what} name {name:?} is not 1-63 characters of [A-Za-z0-9._-] starting with a letter or digit")]
    BadName {
        /// vNIC, host or tenant.
        what: &'static str,
        /// The name (truncated).
        name: String,
    },
    /// The record's name differs from the one in its key.
    #[error("record names {inner:?} but its key names {key:?}")]
    KeyMismatch {
        /// Name in the key.
        key: String,
        /// Name in the record.
        inner: String,
    },
    /// A vNIC address outside the container network (or one of its reserved addresses).
    #[error("address {ip}/{prefix_len} is not a container address of {net}/{net_len}")]
    OutsideNetwork {
        /// The address.
        ip: Ipv4Addr,
        /// Its prefix length.
        prefix_len: u8,
        /// The container network.
        net: Ipv4Addr,
        /// Its prefix length.
        net_len: u8,
    },
    /// A host address that cannot be a host on the underlay.
    #[error("host address {0} is not a usable underlay address")]
    BadHostAddress(String),
    /// A limit out of range.
    #[error("limit {name} = {value} is out of range (at most {max}; CPU shares at least 1)")]
    LimitOutOfRange {
        /// Which limit.
        name: &'static str,
        /// Its value.
        value: u64,
        /// The largest allowed.
        max: u64,
    },
    /// Another record holds the address.
    #[error("address {ip} is already held by {holder}")]
    Duplicate {
        /// The address.
        ip: String,
        /// Who holds it.
        holder: String,
    },
}

/// Whether `name` may name a vNIC, host or tenant: `[A-Za-z0-9][A-Za-z0-9._-]{0,62}` (never
/// `.`, `..` or anything with a `/`, so it is safe as a path component and a key segment).
pub fn valid_record_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

fn name(what: &'static str, n: &str) -> Result<(), RecordError> {
    if valid_record_name(n) {
        Ok(())
    } else {
        Err(RecordError::BadName { what, name: n.chars().take(80).collect() })
    }
}

/// The rules records are checked against: the container network of this cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Check {
    /// Container network address.
    pub net: Ipv4Addr,
    /// Its prefix length.
    pub net_len: u8,
}

impl Default for Check {
    /// 198.18.0.0/15, vrdmad's default container network.
    fn default() -> Self {
        Check { net: Ipv4Addr::new(198, 18, 0, 0), net_len: 15 }
    }
}

impl Check {
    /// Rules for the container network `net`/`net_len`.
    pub fn new(net: Ipv4Addr, net_len: u8) -> Check {
        Check { net, net_len: net_len.min(32) }
    }

    fn mask(&self) -> u32 {
        if self.net_len == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(self.net_len))
        }
    }

    /// Whether `ip` lies in the container network (any address of it).
    pub fn in_network(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask() == u32::from(self.net) & self.mask()
    }

    /// Whether `ip` may be a container's address: inside the network, not its network or
    /// broadcast address, not the bridge's (the first host address).
    pub fn container_address(&self, ip: Ipv4Addr) -> bool {
        let (base, mask) = (u32::from(self.net) & self.mask(), self.mask());
        let a = u32::from(ip);
        self.in_network(ip) && a != base && a != base | !mask && a != base.wrapping_add(1)
    }

    /// Whether `ip` is the container network's own first address (each host's bridge).
    fn container_gateway(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) == (u32::from(self.net) & self.mask()).wrapping_add(1)
    }

    /// Checks a vNIC record stored under name `key`.
    pub fn vnic(&self, key: &str, v: &VnicRecord) -> Result<(), RecordError> {
        name("vNIC", key)?;
        if v.name != key {
            return Err(RecordError::KeyMismatch { key: key.into(), inner: v.name.chars().take(80).collect() });
        }
        name("tenant", &v.tenant)?;
        // Empty: a record of the embedded store from before clusters (this host).
        if !v.host.is_empty() {
            name("host", &v.host)?;
        }
        if !self.container_address(v.ip) || v.prefix_len < self.net_len || v.prefix_len > 32 {
            return Err(RecordError::OutsideNetwork { ip: v.ip, prefix_len: v.prefix_len, net: self.net, net_len: self.net_len });
        }
        limits(&v.limits)?;
        qos(&v.qos)
    }

    /// Checks a tenant policy stored under name `key`.
    pub fn tenant(&self, key: &str, t: &TenantRecord) -> Result<(), RecordError> {
        name("tenant", key)?;
        if t.name != key {
            return Err(RecordError::KeyMismatch { key: key.into(), inner: t.name.chars().take(80).collect() });
        }
        qos(&t.qos)
    }

    /// Checks a host record stored under name `key`.
    pub fn host(&self, key: &str, h: &HostRecord) -> Result<(), RecordError> {
        name("host", key)?;
        if h.name != key {
            return Err(RecordError::KeyMismatch { key: key.into(), inner: h.name.chars().take(80).collect() });
        }
        // An underlay may share the container network's range (the simulated hosts do); the
        // guard keeps a host's address from being a vNIC's.
        let u = h.underlay_ip;
        if u.is_unspecified() || u.is_broadcast() || u.is_multicast() || self.container_gateway(u) {
            return Err(RecordError::BadHostAddress(u.to_string()));
        }
        // The transport listens on the underlay address the host advertises: a record that
        // points its transport elsewhere would let its name stand for someone else's port.
        if h.transport_addr.ip() != IpAddr::V4(u) || h.transport_addr.port() == 0 {
            return Err(RecordError::BadHostAddress(h.transport_addr.to_string()));
        }
        Ok(())
    }

    /// Checks a tenant rule.
    pub fn rule(&self, r: &RuleRecord) -> Result<(), RecordError> {
        name("tenant", &r.from_tenant)?;
        name("tenant", &r.to_tenant)
    }
}

/// Checks a vNIC's limits.
pub fn limits(l: &Limits) -> Result<(), RecordError> {
    let counts = [("max_pd", l.max_pd), ("max_cq", l.max_cq), ("max_qp", l.max_qp), ("max_mr", l.max_mr), ("max_srq", l.max_srq)];
    for (n, v) in counts {
        if v > MAX_COUNT_LIMIT {
            return Err(RecordError::LimitOutOfRange { name: n, value: v.into(), max: MAX_COUNT_LIMIT.into() });
        }
    }
    if l.max_mr_bytes > MAX_MR_BYTES_LIMIT {
        return Err(RecordError::LimitOutOfRange { name: "max_mr_bytes", value: l.max_mr_bytes, max: MAX_MR_BYTES_LIMIT });
    }
    for (n, v) in [("max_control_cpu_percent", l.max_control_cpu_percent), ("max_copy_cpu_percent", l.max_copy_cpu_percent)] {
        if !(1..=MAX_CPU_PERCENT_LIMIT).contains(&v) {
            return Err(RecordError::LimitOutOfRange { name: n, value: v.into(), max: MAX_CPU_PERCENT_LIMIT.into() });
        }
    }
    Ok(())
}

/// Checks a QoS policy: caps within range, a weight of 1 to [`MAX_QOS_WEIGHT`].
pub fn qos(q: &Qos) -> Result<(), RecordError> {
    if q.max_bw > MAX_QOS_BW {
        return Err(RecordError::LimitOutOfRange { name: "max_bw", value: q.max_bw, max: MAX_QOS_BW });
    }
    if q.max_msg_rate > MAX_QOS_MSG_RATE {
        return Err(RecordError::LimitOutOfRange { name: "max_msg_rate", value: q.max_msg_rate, max: MAX_QOS_MSG_RATE });
    }
    if q.weight == 0 || q.weight > MAX_QOS_WEIGHT {
        return Err(RecordError::LimitOutOfRange { name: "weight", value: q.weight.into(), max: MAX_QOS_WEIGHT.into() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    pub(crate) fn vnic(name: &str, ip: [u8; 4]) -> VnicRecord {
        VnicRecord {
            name: name.into(),
            tenant: "t".into(),
            ip: Ipv4Addr::from(ip),
            prefix_len: 15,
            limits: Limits::default(),
            node_guid: 1,
            host: "h1".into(),
            qos: Default::default(),
        }
    }

    #[test]
    fn names() {
        for ok in ["a", "A9", "0", "a.b-c_d", &"x".repeat(63)] {
            assert!(valid_record_name(ok), "{ok}");
        }
        for bad in ["", ".", "..", "../..", "/", "a/b", "-a", ".a", "_a", "a b", "é", &"x".repeat(64), "a\0"] {
            assert!(!valid_record_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn vnic_records() {
        let c = Check::default();
        c.vnic("a", &vnic("a", [198, 18, 0, 2])).unwrap();
        c.vnic("a", &vnic("a", [198, 19, 255, 254])).unwrap();
        assert!(matches!(c.vnic("b", &vnic("a", [198, 18, 0, 2])), Err(RecordError::KeyMismatch { .. })));
        for key in ["/", "..", "../..", ""] {
            assert!(matches!(c.vnic(key, &vnic(key, [198, 18, 0, 2])), Err(RecordError::BadName { .. })), "{key}");
        }
        for ip in [[10, 0, 0, 1], [198, 18, 0, 0], [198, 18, 0, 1], [198, 19, 255, 255], [198, 20, 0, 1], [0, 0, 0, 0]] {
            assert!(matches!(c.vnic("a", &vnic("a", ip)), Err(RecordError::OutsideNetwork { .. })), "{ip:?}");
        }
        let mut v = vnic("a", [198, 18, 0, 2]);
        v.prefix_len = 8;
        assert!(c.vnic("a", &v).is_err());
        v.prefix_len = 33;
        assert!(c.vnic("a", &v).is_err());
        let mut v = vnic("a", [198, 18, 0, 2]);
        v.tenant = "../x".into();
        assert!(matches!(c.vnic("a", &v), Err(RecordError::BadName { what: "tenant", .. })));
        let mut v = vnic("a", [198, 18, 0, 2]);
        v.host = "/".into();
        assert!(matches!(c.vnic("a", &v), Err(RecordError::BadName { what: "host", .. })));
        v.host.clear();
        c.vnic("a", &v).unwrap();
        let mut v = vnic("a", [198, 18, 0, 2]);
        v.limits.max_qp = u32::MAX;
        assert!(matches!(c.vnic("a", &v), Err(RecordError::LimitOutOfRange { name: "max_qp", .. })));
        let mut v = vnic("a", [198, 18, 0, 2]);
        v.limits.max_mr_bytes = u64::MAX;
        assert!(matches!(c.vnic("a", &v), Err(RecordError::LimitOutOfRange { name: "max_mr_bytes", .. })));
        // A CPU share of 0 would stop the vNIC's requests for good.
        let mut v = vnic("a", [198, 18, 0, 2]);
        v.limits.max_control_cpu_percent = 0;
        assert!(matches!(c.vnic("a", &v), Err(RecordError::LimitOutOfRange { name: "max_control_cpu_percent", .. })));
        let mut v = vnic("a", [198, 18, 0, 2]);
        v.limits.max_copy_cpu_percent = u32::MAX;
        assert!(matches!(c.vnic("a", &v), Err(RecordError::LimitOutOfRange { name: "max_copy_cpu_percent", .. })));
        // Another network.
        let c = Check::new(Ipv4Addr::new(10, 44, 0, 0), 16);
        c.vnic("a", &VnicRecord { prefix_len: 16, ..vnic("a", [10, 44, 3, 4]) }).unwrap();
        assert!(c.vnic("a", &vnic("a", [198, 18, 0, 2])).is_err());
    }

    #[test]
    fn host_records() {
        let c = Check::default();
        let h = |name: &str, ip: [u8; 4], port: u16| HostRecord {
            name: name.into(),
            transport_addr: SocketAddr::from((ip, port)),
            underlay_ip: Ipv4Addr::from(ip),
        };
        c.host("h1", &h("h1", [198, 20, 0, 1], 4791)).unwrap();
        c.host("h1", &h("h1", [127, 0, 0, 1], 4791)).unwrap();
        assert!(c.host("h2", &h("h1", [198, 20, 0, 1], 4791)).is_err());
        assert!(c.host("..", &h("..", [198, 20, 0, 1], 4791)).is_err());
        c.host("h1", &h("h1", [198, 19, 7, 11], 4791)).unwrap();
        for ip in [[0, 0, 0, 0], [255, 255, 255, 255], [224, 0, 0, 1], [198, 18, 0, 1]] {
            assert!(matches!(c.host("h1", &h("h1", ip, 4791)), Err(RecordError::BadHostAddress(_))), "{ip:?}");
        }
        assert!(c.host("h1", &h("h1", [198, 20, 0, 1], 0)).is_err());
        let mut other = h("h1", [198, 20, 0, 1], 4791);
        other.transport_addr = SocketAddr::from(([198, 20, 0, 9], 4791));
        assert!(c.host("h1", &other).is_err());
    }

    #[test]
    fn qos_policies() {
        let c = Check::default();
        let t = |name: &str, qos: Qos| TenantRecord { name: name.into(), qos };
        c.tenant("t", &t("t", Qos::default())).unwrap();
        c.tenant("t", &t("t", Qos { max_bw: 200_000_000, max_msg_rate: 2_000_000, weight: 3 })).unwrap();
        assert!(matches!(c.tenant("u", &t("t", Qos::default())), Err(RecordError::KeyMismatch { .. })));
        assert!(matches!(c.tenant("..", &t("..", Qos::default())), Err(RecordError::BadName { .. })));
        for (bad, what) in [
            (Qos { weight: 0, ..Qos::default() }, "weight"),
            (Qos { weight: MAX_QOS_WEIGHT + 1, ..Qos::default() }, "weight"),
            (Qos { max_bw: u64::MAX, ..Qos::default() }, "max_bw"),
            (Qos { max_msg_rate: u64::MAX, ..Qos::default() }, "max_msg_rate"),
        ] {
            assert!(matches!(c.tenant("t", &t("t", bad)), Err(RecordError::LimitOutOfRange { name, .. }) if name == what), "{bad:?}");
            let v = VnicRecord { qos: bad, ..vnic("a", [198, 18, 0, 2]) };
            assert!(c.vnic("a", &v).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn rules() {
        let c = Check::default();
        c.rule(&RuleRecord::new("red", "blue")).unwrap();
        assert!(c.rule(&RuleRecord::new("red", "../blue")).is_err());
        assert!(c.rule(&RuleRecord::new("", "blue")).is_err());
    }
}
