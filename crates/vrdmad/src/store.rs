//! The control store (DESIGN §4): where vNIC records live. One trait; the embedded file
//! store is the default for one host.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use vrdma_abi::control::Limits;

/// Store failures.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("reading store {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("parsing store {path}: {source}")]
    Parse { path: String, source: serde_json::Error },
    #[error("writing store {path}: {source}")]
    Write { path: String, source: std::io::Error },
}

/// Persistent limits (serde mirror of [`Limits`]).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct LimitsRecord {
    pub max_pd: u32,
    pub max_cq: u32,
    pub max_qp: u32,
    pub max_mr: u32,
    pub max_mr_bytes: u64,
    pub max_srq: u32,
}

impl From<Limits> for LimitsRecord {
    fn from(l: Limits) -> Self {
        LimitsRecord {
            max_pd: l.max_pd,
            max_cq: l.max_cq,
            max_qp: l.max_qp,
            max_mr: l.max_mr,
            max_mr_bytes: l.max_mr_bytes,
            max_srq: l.max_srq,
        }
    }
}
impl From<LimitsRecord> for Limits {
    fn from(l: LimitsRecord) -> Self {
        Limits { max_pd: l.max_pd, max_cq: l.max_cq, max_qp: l.max_qp, max_mr: l.max_mr, max_mr_bytes: l.max_mr_bytes, max_srq: l.max_srq }
    }
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
    pub limits: LimitsRecord,
    /// Node GUID.
    pub node_guid: u64,
}

/// The control store.
pub trait Store: Send + Sync {
    /// All vNICs.
    fn list(&self) -> Result<Vec<VnicRecord>, StoreError>;
    /// Inserts or replaces a vNIC.
    fn put(&self, v: &VnicRecord) -> Result<(), StoreError>;
    /// Removes a vNIC; true if it existed.
    fn delete(&self, name: &str) -> Result<bool, StoreError>;
}

/// Embedded store: one JSON file in the state directory, replaced atomically.
pub struct FileStore {
    path: PathBuf,
    lock: parking_lot::Mutex<()>,
}

impl FileStore {
    /// Opens (or creates) the store in `state_dir`.
    pub fn open(state_dir: &std::path::Path) -> Result<Self, StoreError> {
        let path = state_dir.join("vnics.json");
        std::fs::create_dir_all(state_dir).map_err(|source| StoreError::Write { path: state_dir.display().to_string(), source })?;
        Ok(FileStore { path, lock: parking_lot::Mutex::new(()) })
    }

    fn load(&self) -> Result<BTreeMap<String, VnicRecord>, StoreError> {
        let p = self.path.display().to_string();
        match std::fs::read(&self.path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|source| StoreError::Parse { path: p, source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
            Err(source) => Err(StoreError::Read { path: p, source }),
        }
    }

    fn save(&self, m: &BTreeMap<String, VnicRecord>) -> Result<(), StoreError> {
        let p = self.path.display().to_string();
        let tmp = self.path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(m).map_err(|source| StoreError::Parse { path: p.clone(), source })?;
        std::fs::write(&tmp, bytes).map_err(|source| StoreError::Write { path: p.clone(), source })?;
        std::fs::rename(&tmp, &self.path).map_err(|source| StoreError::Write { path: p, source })
    }
}

impl Store for FileStore {
    fn list(&self) -> Result<Vec<VnicRecord>, StoreError> {
        let _g = self.lock.lock();
        Ok(self.load()?.into_values().collect())
    }
    fn put(&self, v: &VnicRecord) -> Result<(), StoreError> {
        let _g = self.lock.lock();
        let mut m = self.load()?;
        m.insert(v.name.clone(), v.clone());
        self.save(&m)
    }
    fn delete(&self, name: &str) -> Result<bool, StoreError> {
        let _g = self.lock.lock();
        let mut m = self.load()?;
        let had = m.remove(name).is_some();
        self.save(&m)?;
        Ok(had)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn file_store_round_trip() {
        let dir = std::env::temp_dir().join(format!("vrdma-store-{}", std::process::id()));
        let s = FileStore::open(&dir).unwrap();
        let v = VnicRecord {
            name: "a".into(),
            tenant: "t".into(),
            ip: Ipv4Addr::new(198, 18, 0, 2),
            prefix_len: 15,
            limits: Limits::default().into(),
            node_guid: 1,
        };
        s.put(&v).unwrap();
        assert_eq!(FileStore::open(&dir).unwrap().list().unwrap(), vec![v]);
        assert!(s.delete("a").unwrap());
        assert!(!s.delete("a").unwrap());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
