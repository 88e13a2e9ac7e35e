//! The control store: where the cluster's vNIC records, hosts and tenant rules
//! live. One trait, two backends: the embedded file store ([`file::FileStore`], the default,
//! one host) and etcd ([`etcd::EtcdStore`], clusters).
//!
//! Every daemon keeps a cache of the whole store, loaded with [`Store::snapshot`] and kept
//! current by [`Store::watch`]; a watch that loses its stream delivers a fresh
//! [`StoreEvent::Resync`] before it resumes, so the cache never misses a change.

pub mod etcd;
pub mod file;
mod fuzz;
pub mod guard;
pub mod validate;

use serde::{Deserialize, Serialize};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use vrdma_abi::control::{Limits, Qos};

pub use etcd::{EtcdConfig, EtcdError, EtcdStore, Password, Security};
pub use file::FileStore;
pub use fuzz::fuzz_records;
pub use guard::GuardedStore;
pub use validate::{valid_record_name, Check, RecordError};

/// Store failures.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The embedded store failed.
    #[error(transparent)]
    File(#[from] file::FileStoreError),
    /// etcd failed or could not be reached.
    #[error(transparent)]
    Etcd(#[from] etcd::EtcdError),
    /// `create_vnic`: a vNIC of that name exists.
    #[error("a vNIC named {0} already exists")]
    NameTaken(String),
    /// `create_vnic`: another vNIC has that address.
    #[error("address {0} is taken")]
    IpTaken(Ipv4Addr),
    /// No such vNIC.
    #[error("no vNIC named {0}")]
    NotFound(String),
    /// `update_vnic` may not change a vNIC's name or address.
    #[error("vNIC {0}: the address of a vNIC cannot change")]
    IpChanged(String),
    /// Someone else changed the record between our read and our write.
    #[error("vNIC {0} was changed concurrently; retry")]
    Conflict(String),
    /// A record in the store does not parse.
    #[error("record {key} in the store is malformed: {reason}")]
    BadRecord {
        /// Its key.
        key: String,
        /// Why.
        reason: String,
    },
    /// A `--store` URL we do not understand.
    #[error("store {url:?}: {reason}")]
    BadUrl {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
}

/// A vNIC as stored.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct VnicRecord {
    /// Unique name.
    pub name: String,
    /// Tenant it belongs to.
    pub tenant: String,
    /// Container address (its vGID is `::ffff:ip`).
    pub ip: Ipv4Addr,
    /// Prefix length of the container network.
    pub prefix_len: u8,
    /// Resource limits.
    pub limits: Limits,
    /// Node GUID.
    pub node_guid: u64,
    /// Name of the host whose vrdmad serves it; migration changes it. Empty (records written
    /// before clusters existed): the host of the embedded store.
    #[serde(default)]
    pub host: String,
    /// Caps and fair-sharing weight (records written before QoS existed: none, weight 1).
    #[serde(default)]
    pub qos: Qos,
}

/// A host of the cluster, registered by its vrdmad while it runs (in etcd under a lease, so
/// the record of a dead host expires).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct HostRecord {
    /// Host name (`vrdmad --host`).
    pub name: String,
    /// Where its vrdmad's host-to-host transport listens.
    pub transport_addr: SocketAddr,
    /// Its address on the underlay network: the next hop of routes to its containers.
    pub underlay_ip: Ipv4Addr,
}

/// A tenant connection rule: vNICs of `from_tenant` and `to_tenant` may connect to each
/// other. Rules are symmetric (an RC connection carries traffic both ways, so a one-way
/// permission would be meaningless); `allow A B` and `allow B A` are the same rule.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RuleRecord {
    /// One tenant.
    pub from_tenant: String,
    /// The other tenant.
    pub to_tenant: String,
}

impl RuleRecord {
    /// The rule with its two tenants in canonical (sorted) order.
    pub fn new(a: &str, b: &str) -> RuleRecord {
        let (x, y) = if a <= b { (a, b) } else { (b, a) };
        RuleRecord { from_tenant: x.to_string(), to_tenant: y.to_string() }
    }

    /// Whether this rule lets tenants `a` and `b` connect.
    pub fn allows(&self, a: &str, b: &str) -> bool {
        (self.from_tenant == a && self.to_tenant == b) || (self.from_tenant == b && self.to_tenant == a)
    }
}

/// A tenant's policy (`vrdma tenant qos`): its caps bound the sum of its vNICs' traffic on
/// each host, its weight is its share of a contended link against other tenants. Tenants
/// without a record have none (uncapped, weight 1).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct TenantRecord {
    /// The tenant.
    pub name: String,
    /// Caps and weight.
    #[serde(default)]
    pub qos: Qos,
}

/// Whether `name` may be a tenant name: it appears in store keys, so the rule of every
/// record name ([`valid_record_name`]).
pub fn valid_tenant(name: &str) -> bool {
    valid_record_name(name)
}

/// Everything in the store at one revision.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// All vNICs, of every host.
    pub vnics: Vec<VnicRecord>,
    /// Live hosts.
    pub hosts: Vec<HostRecord>,
    /// Tenant rules.
    pub rules: Vec<RuleRecord>,
    /// Tenant policies.
    pub tenants: Vec<TenantRecord>,
    /// The store's revision this snapshot was taken at.
    pub revision: i64,
}

/// A change in the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreEvent {
    /// A vNIC was created or changed.
    VnicPut(VnicRecord),
    /// A vNIC was deleted.
    VnicDeleted(String),
    /// A host registered (or re-registered).
    HostPut(HostRecord),
    /// A host's record was deleted or expired.
    HostDeleted(String),
    /// A rule was added.
    RulePut(RuleRecord),
    /// A rule was removed.
    RuleDeleted(RuleRecord),
    /// A tenant's policy was set.
    TenantPut(TenantRecord),
    /// A tenant's policy was removed.
    TenantDeleted(String),
    /// The watch lost events (reconnect, compaction): this is the whole store now.
    Resync(Snapshot),
}

/// Receives watch events, in store order, on the watch's own thread.
pub type WatchCallback = Box<dyn FnMut(StoreEvent) + Send>;

/// A running watch; dropping it stops delivery (within the backend's poll interval).
pub struct WatchHandle {
    stop: Arc<AtomicBool>,
}

impl WatchHandle {
    pub(crate) fn new(stop: Arc<AtomicBool>) -> WatchHandle {
        WatchHandle { stop }
    }
}

impl Drop for WatchHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The control store.
pub trait Store: Send + Sync {
    /// All vNICs of the cluster.
    fn list_vnics(&self) -> Result<Vec<VnicRecord>, StoreError>;
    /// One vNIC.
    fn get_vnic(&self, name: &str) -> Result<Option<VnicRecord>, StoreError>;
    /// Creates a vNIC, atomically claiming its name and its address:
    /// [`StoreError::NameTaken`] or [`StoreError::IpTaken`] if either is in use.
    fn create_vnic(&self, v: &VnicRecord) -> Result<(), StoreError>;
    /// Replaces an existing vNIC's record (limits, host); its address may not change.
    fn update_vnic(&self, v: &VnicRecord) -> Result<(), StoreError>;
    /// Deletes a vNIC and frees its address; true if it existed.
    fn delete_vnic(&self, name: &str) -> Result<bool, StoreError>;
    /// Registers this host (etcd: under a lease kept alive until the store is dropped).
    fn put_host(&self, h: &HostRecord) -> Result<(), StoreError>;
    /// Live hosts.
    fn list_hosts(&self) -> Result<Vec<HostRecord>, StoreError>;
    /// Adds a rule (idempotent).
    fn put_rule(&self, r: &RuleRecord) -> Result<(), StoreError>;
    /// Removes a rule; true if it existed.
    fn delete_rule(&self, r: &RuleRecord) -> Result<bool, StoreError>;
    /// All rules.
    fn list_rules(&self) -> Result<Vec<RuleRecord>, StoreError>;
    /// Sets a tenant's policy (replacing any).
    fn put_tenant(&self, t: &TenantRecord) -> Result<(), StoreError>;
    /// Removes a tenant's policy; true if it had one.
    fn delete_tenant(&self, name: &str) -> Result<bool, StoreError>;
    /// Every tenant policy.
    fn list_tenants(&self) -> Result<Vec<TenantRecord>, StoreError>;
    /// Everything, at one revision.
    fn snapshot(&self) -> Result<Snapshot, StoreError>;
    /// Delivers every change after `from_revision` (exclusive: pass a snapshot's revision)
    /// to `cb` on a thread of the store, until the handle is dropped.
    fn watch(&self, from_revision: i64, cb: WatchCallback) -> Result<WatchHandle, StoreError>;
    /// Records read from the store and refused as invalid so far (a guarded store's; 0 for
    /// stores that do not check).
    fn refused_records(&self) -> u64 {
        0
    }
}

/// Which store a daemon uses (`vrdmad --store`).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum StoreConfig {
    /// The embedded file store in the state directory.
    #[default]
    File,
    /// etcd: endpoints, TLS and credentials.
    Etcd(EtcdConfig),
}

impl std::str::FromStr for StoreConfig {
    type Err = StoreError;
    /// `file`, `etcd://H1:P1[,H2:P2…]` or `https://H1:P1[,…]` (TLS; each endpoint may repeat
    /// the scheme, as etcdctl's `--endpoints` do).
    fn from_str(s: &str) -> Result<Self, StoreError> {
        let bad = |reason: &str| StoreError::BadUrl { url: s.to_string(), reason: reason.to_string() };
        if s == "file" || s.is_empty() {
            return Ok(StoreConfig::File);
        }
        let (https, rest) = match (s.strip_prefix("etcd://"), s.strip_prefix("https://")) {
            (Some(r), _) => (false, r),
            (_, Some(r)) => (true, r),
            _ => return Err(bad("expected file, etcd://HOST:PORT[,HOST:PORT…] or https://HOST:PORT[,HOST:PORT…]")),
        };
        let scheme = if https { "https://" } else { "etcd://" };
        let mut eps = Vec::new();
        for e in rest.split(',') {
            let e = e.trim();
            let e = e.strip_prefix(scheme).unwrap_or(e).trim_end_matches('/');
            let Some((h, p)) = e.rsplit_once(':') else { return Err(bad("every endpoint needs HOST:PORT")) };
            if h.is_empty() || p.parse::<u16>().is_err() || e.contains('/') {
                return Err(bad("every endpoint needs HOST:PORT"));
            }
            eps.push(e.to_string());
        }
        Ok(StoreConfig::Etcd(EtcdConfig { endpoints: eps, https, ..Default::default() }))
    }
}

/// Why a cluster daemon should refuse this store without `--insecure-store`, if it should:
/// whoever can write the store decides which vNICs each host serves, their addresses and the
/// tenant rules, so etcd must be reached over TLS (its certificate checked) *and* with
/// credentials (a client certificate or an etcd user), or anyone on its network can.
pub fn insecure_reason(cfg: &StoreConfig) -> Option<String> {
    let StoreConfig::Etcd(e) = cfg else { return None };
    let authenticated = e.cert.is_some() || e.user.is_some();
    match (e.tls(), authenticated) {
        (true, true) => None,
        (false, false) => Some("etcd is reached over plain HTTP without credentials: anyone who can reach it can rewrite the cluster (which host serves which vNIC, addresses, tenant rules)".into()),
        (false, true) => Some("etcd is reached over plain HTTP: its credentials and every record can be read and altered on the way (give --etcd-cacert)".into()),
        (true, false) => Some("etcd is reached without credentials (no --etcd-cert, no --etcd-user): unless etcd itself refuses anonymous clients, anyone who can reach it can rewrite the cluster".into()),
    }
}

/// A store configuration with its files read (certificates, keys): what start-up retries
/// open, so a file is read once and a bad one fails at once.
pub enum Prepared {
    /// The embedded store.
    File,
    /// etcd: its endpoints and loaded security settings.
    Etcd {
        /// `host:port` endpoints.
        endpoints: Vec<String>,
        /// TLS and credentials.
        security: Security,
    },
}

/// Checks `cfg` and reads its files.
pub fn prepare(cfg: &StoreConfig) -> Result<Prepared, StoreError> {
    Ok(match cfg {
        StoreConfig::File => Prepared::File,
        StoreConfig::Etcd(e) => Prepared::Etcd { endpoints: e.endpoints.clone(), security: e.load().map_err(EtcdError::from)? },
    })
}

/// Opens a prepared store; `state_dir` holds the embedded one.
pub fn open_prepared(p: &Prepared, state_dir: &std::path::Path) -> Result<Arc<dyn Store>, StoreError> {
    Ok(match p {
        Prepared::File => Arc::new(FileStore::open(state_dir)?),
        Prepared::Etcd { endpoints, security } => {
            Arc::new(EtcdStore::connect_secure(endpoints.clone(), security.clone(), etcd::HOST_TTL_SECS)?)
        }
    })
}

/// Opens the configured store; `state_dir` holds the embedded one.
pub fn open(cfg: &StoreConfig, state_dir: &std::path::Path) -> Result<Arc<dyn Store>, StoreError> {
    open_prepared(&prepare(cfg)?, state_dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_urls() {
        assert_eq!("file".parse::<StoreConfig>().unwrap(), StoreConfig::File);
        assert_eq!(
            "etcd://198.18.0.1:2379,h2:23790".parse::<StoreConfig>().unwrap(),
            StoreConfig::Etcd(EtcdConfig::plain(vec!["198.18.0.1:2379".into(), "h2:23790".into()]))
        );
        let tls = EtcdConfig { https: true, ..EtcdConfig::plain(vec!["198.18.0.1:2379".into(), "[::1]:2379".into()]) };
        assert_eq!("https://198.18.0.1:2379,https://[::1]:2379/".parse::<StoreConfig>().unwrap(), StoreConfig::Etcd(tls.clone()));
        assert_eq!("https://198.18.0.1:2379,[::1]:2379".parse::<StoreConfig>().unwrap(), StoreConfig::Etcd(tls));
        for bad in ["etcd://", "etcd://h", "etcd://h:x", "http://h:1", "etcd://h:1/x", "https://", "https://h:1,etcd://h:2"] {
            assert!(bad.parse::<StoreConfig>().is_err(), "{bad}");
        }
    }

    #[test]
    fn only_an_authenticated_tls_etcd_is_secure() {
        assert_eq!(insecure_reason(&StoreConfig::File), None);
        let plain = EtcdConfig::plain(vec!["h:1".into()]);
        let p = |s: &str| Some(std::path::PathBuf::from(s));
        let user = |c: EtcdConfig| EtcdConfig { user: Some("u".into()), password: Some(Password::new("p")), ..c };
        let tls = EtcdConfig { cacert: p("ca"), ..plain.clone() };
        for (c, secure) in [
            (plain.clone(), false),
            (user(plain.clone()), false),
            (tls.clone(), false),
            (user(tls.clone()), true),
            (EtcdConfig { cert: p("c"), key: p("k"), ..tls }, true),
        ] {
            assert_eq!(insecure_reason(&StoreConfig::Etcd(c.clone())).is_none(), secure, "{c:?}");
        }
    }

    #[test]
    fn rules_are_symmetric() {
        let r = RuleRecord::new("red", "blue");
        assert_eq!(r, RuleRecord::new("blue", "red"));
        assert!(r.allows("red", "blue") && r.allows("blue", "red"));
        assert!(!r.allows("red", "green"));
    }

    #[test]
    fn old_records_parse() {
        let old = r#"{"name":"a","tenant":"t","ip":"198.18.0.2","prefix_len":15,
            "limits":{"max_pd":1,"max_cq":1,"max_qp":1,"max_mr":1,"max_mr_bytes":1,"max_srq":1},"node_guid":7}"#;
        let v: VnicRecord = serde_json::from_str(old).unwrap();
        assert_eq!(v.host, "");
    }

    /// Limits are stored as the record of each vNIC: the field names stay those of the
    /// records already in file stores and etcd, and every limit must be there.
    #[test]
    fn limits_keep_their_stored_form() {
        let l = Limits { max_pd: 1, max_cq: 2, max_qp: 3, max_mr: 4, max_mr_bytes: 5, max_srq: 6, ..Limits::default() };
        let json = r#"{"max_pd":1,"max_cq":2,"max_qp":3,"max_mr":4,"max_mr_bytes":5,"max_srq":6"#;
        assert!(serde_json::to_string(&l).unwrap().starts_with(json));
        // Records stored before the later limits existed get their defaults.
        assert_eq!(serde_json::from_str::<Limits>(&format!("{json}}}")).unwrap(), l);
        assert_eq!(serde_json::from_str::<Limits>(&serde_json::to_string(&l).unwrap()).unwrap(), l);
        assert!(serde_json::from_str::<Limits>(r#"{"max_pd":1}"#).is_err());
    }
}
