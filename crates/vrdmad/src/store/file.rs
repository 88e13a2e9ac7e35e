//! The embedded store: JSON files in the state directory, each replaced atomically
//! (`vnics.json`, a map name → record, the format of earlier versions; `rules.json`). One host
//! only: host records live in memory, and a watch sees the changes this process makes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{HostRecord, RuleRecord, Snapshot, Store, StoreError, StoreEvent, TenantRecord, VnicRecord, WatchCallback, WatchHandle};

/// Failures of the embedded store.
#[derive(Debug, thiserror::Error)]
pub enum FileStoreError {
    /// Reading a file.
    #[error("reading store {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A file does not parse.
    #[error("parsing store {path}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// Why.
        source: serde_json::Error,
    },
    /// Writing a file.
    #[error("writing store {path}: {source}")]
    Write {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

struct Subscriber {
    stop: Arc<AtomicBool>,
    cb: WatchCallback,
}

struct State {
    hosts: BTreeMap<String, HostRecord>,
    revision: i64,
}

/// Embedded store: JSON files in the state directory.
pub struct FileStore {
    dir: PathBuf,
    state: Mutex<State>,
    subscribers: Mutex<Vec<Subscriber>>,
}

fn load<T: DeserializeOwned + Default>(path: &Path) -> Result<T, FileStoreError> {
    let p = path.display().to_string();
    match std::fs::read(path) {
        Ok(b) => serde_json::from_slice(&b).map_err(|source| FileStoreError::Parse { path: p, source }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(T::default()),
        Err(source) => Err(FileStoreError::Read { path: p, source }),
    }
}

fn save<T: Serialize>(path: &Path, v: &T) -> Result<(), FileStoreError> {
    let p = path.display().to_string();
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec_pretty(v).map_err(|source| FileStoreError::Parse { path: p.clone(), source })?;
    std::fs::write(&tmp, bytes).map_err(|source| FileStoreError::Write { path: p.clone(), source })?;
    std::fs::rename(&tmp, path).map_err(|source| FileStoreError::Write { path: p, source })
}

impl FileStore {
    /// Opens (or creates) the store in `state_dir`.
    pub fn open(state_dir: &Path) -> Result<Self, FileStoreError> {
        std::fs::create_dir_all(state_dir).map_err(|source| FileStoreError::Write { path: state_dir.display().to_string(), source })?;
        let s = FileStore {
            dir: state_dir.to_path_buf(),
            state: Mutex::new(State { hosts: BTreeMap::new(), revision: 1 }),
            subscribers: Mutex::new(Vec::new()),
        };
        // Fail now, not at the first request, if a file is unreadable.
        s.vnics()?;
        s.rules()?;
        s.tenants()?;
        Ok(s)
    }

    fn vnics_path(&self) -> PathBuf {
        self.dir.join("vnics.json")
    }
    fn rules_path(&self) -> PathBuf {
        self.dir.join("rules.json")
    }
    fn tenants_path(&self) -> PathBuf {
        self.dir.join("tenants.json")
    }
    fn tenants(&self) -> Result<BTreeMap<String, TenantRecord>, FileStoreError> {
        let mut m: BTreeMap<String, TenantRecord> = load(&self.tenants_path())?;
        m.retain(|k, t| *k == t.name);
        Ok(m)
    }
    /// The vNICs, each under its own name (an entry whose record names another vNIC is
    /// skipped: the name decides the vNIC's directory, so it must not be ambiguous).
    fn vnics(&self) -> Result<BTreeMap<String, VnicRecord>, FileStoreError> {
        let mut m: BTreeMap<String, VnicRecord> = load(&self.vnics_path())?;
        m.retain(|k, v| {
            let same = *k == v.name;
            if !same {
                log::warn!("store {}: skipping entry {k:?}: its record names {:?}", self.vnics_path().display(), v.name);
            }
            same
        });
        Ok(m)
    }
    fn rules(&self) -> Result<Vec<RuleRecord>, FileStoreError> {
        load(&self.rules_path())
    }

    /// Runs `f` under the store lock; on success bumps the revision and delivers the events
    /// it returned (after the lock is released, so a subscriber may call the store).
    fn mutate<R>(&self, f: impl FnOnce(&mut State) -> Result<(R, Vec<StoreEvent>), StoreError>) -> Result<R, StoreError> {
        let (r, events) = {
            let mut st = self.state.lock();
            let (r, events) = f(&mut st)?;
            if !events.is_empty() {
                st.revision += 1;
            }
            (r, events)
        };
        if !events.is_empty() {
            let mut subs = self.subscribers.lock();
            subs.retain(|s| !s.stop.load(Ordering::SeqCst));
            for s in subs.iter_mut() {
                for e in &events {
                    (s.cb)(e.clone());
                }
            }
        }
        Ok(r)
    }
}

impl Store for FileStore {
    fn list_vnics(&self) -> Result<Vec<VnicRecord>, StoreError> {
        let _g = self.state.lock();
        Ok(self.vnics()?.into_values().collect())
    }

    fn get_vnic(&self, name: &str) -> Result<Option<VnicRecord>, StoreError> {
        let _g = self.state.lock();
        Ok(self.vnics()?.remove(name))
    }

    fn create_vnic(&self, v: &VnicRecord) -> Result<(), StoreError> {
        self.mutate(|_| {
            let mut m = self.vnics()?;
            if m.contains_key(&v.name) {
                return Err(StoreError::NameTaken(v.name.clone()));
            }
            if m.values().any(|o| o.ip == v.ip) {
                return Err(StoreError::IpTaken(v.ip));
            }
            m.insert(v.name.clone(), v.clone());
            save(&self.vnics_path(), &m)?;
            Ok(((), vec![StoreEvent::VnicPut(v.clone())]))
        })
    }

    fn update_vnic(&self, v: &VnicRecord) -> Result<(), StoreError> {
        self.mutate(|_| {
            let mut m = self.vnics()?;
            match m.get(&v.name) {
                None => return Err(StoreError::NotFound(v.name.clone())),
                Some(o) if o.ip != v.ip => return Err(StoreError::IpChanged(v.name.clone())),
                Some(_) => {}
            }
            m.insert(v.name.clone(), v.clone());
            save(&self.vnics_path(), &m)?;
            Ok(((), vec![StoreEvent::VnicPut(v.clone())]))
        })
    }

    fn delete_vnic(&self, name: &str) -> Result<bool, StoreError> {
        self.mutate(|_| {
            let mut m = self.vnics()?;
            if m.remove(name).is_none() {
                return Ok((false, vec![]));
            }
            save(&self.vnics_path(), &m)?;
            Ok((true, vec![StoreEvent::VnicDeleted(name.to_string())]))
        })
    }

    fn put_host(&self, h: &HostRecord) -> Result<(), StoreError> {
        self.mutate(|st| {
            st.hosts.insert(h.name.clone(), h.clone());
            Ok(((), vec![StoreEvent::HostPut(h.clone())]))
        })
    }

    fn list_hosts(&self) -> Result<Vec<HostRecord>, StoreError> {
        Ok(self.state.lock().hosts.values().cloned().collect())
    }

    fn put_rule(&self, r: &RuleRecord) -> Result<(), StoreError> {
        let r = RuleRecord::new(&r.from_tenant, &r.to_tenant);
        self.mutate(|_| {
            let mut rules = self.rules()?;
            if rules.contains(&r) {
                return Ok(((), vec![]));
            }
            rules.push(r.clone());
            rules.sort();
            save(&self.rules_path(), &rules)?;
            Ok(((), vec![StoreEvent::RulePut(r)]))
        })
    }

    fn delete_rule(&self, r: &RuleRecord) -> Result<bool, StoreError> {
        let r = RuleRecord::new(&r.from_tenant, &r.to_tenant);
        self.mutate(|_| {
            let mut rules = self.rules()?;
            let before = rules.len();
            rules.retain(|x| *x != r);
            if rules.len() == before {
                return Ok((false, vec![]));
            }
            save(&self.rules_path(), &rules)?;
            Ok((true, vec![StoreEvent::RuleDeleted(r)]))
        })
    }

    fn list_rules(&self) -> Result<Vec<RuleRecord>, StoreError> {
        let _g = self.state.lock();
        Ok(self.rules()?)
    }

    fn put_tenant(&self, t: &TenantRecord) -> Result<(), StoreError> {
        self.mutate(|_| {
            let mut m = self.tenants()?;
            if m.get(&t.name) == Some(t) {
                return Ok(((), vec![]));
            }
            m.insert(t.name.clone(), t.clone());
            save(&self.tenants_path(), &m)?;
            Ok(((), vec![StoreEvent::TenantPut(t.clone())]))
        })
    }

    fn delete_tenant(&self, name: &str) -> Result<bool, StoreError> {
        self.mutate(|_| {
            let mut m = self.tenants()?;
            if m.remove(name).is_none() {
                return Ok((false, vec![]));
            }
            save(&self.tenants_path(), &m)?;
            Ok((true, vec![StoreEvent::TenantDeleted(name.to_string())]))
        })
    }

    fn list_tenants(&self) -> Result<Vec<TenantRecord>, StoreError> {
        let _g = self.state.lock();
        Ok(self.tenants()?.into_values().collect())
    }

    fn snapshot(&self) -> Result<Snapshot, StoreError> {
        let st = self.state.lock();
        Ok(Snapshot {
            vnics: self.vnics()?.into_values().collect(),
            hosts: st.hosts.values().cloned().collect(),
            rules: self.rules()?,
            tenants: self.tenants()?.into_values().collect(),
            revision: st.revision,
        })
    }

    fn watch(&self, _from_revision: i64, cb: WatchCallback) -> Result<WatchHandle, StoreError> {
        let stop = Arc::new(AtomicBool::new(false));
        self.subscribers.lock().push(Subscriber { stop: stop.clone(), cb });
        Ok(WatchHandle::new(stop))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;
    use vrdma_abi::control::Limits;

    fn rec(name: &str, ip: u8) -> VnicRecord {
        VnicRecord {
            name: name.into(),
            tenant: "t".into(),
            ip: Ipv4Addr::new(198, 18, 0, ip),
            prefix_len: 15,
            limits: Limits::default(),
            node_guid: 1,
            host: "h".into(),
            qos: Default::default(),
        }
    }

    #[test]
    fn tenant_policies_persist_and_are_watched() {
        use vrdma_abi::control::Qos;
        let dir = std::env::temp_dir().join(format!("vrdma-store-tenants-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let s = FileStore::open(&dir).unwrap();
        let events = Arc::new(Mutex::new(Vec::new()));
        let e2 = events.clone();
        let _h = s.watch(0, Box::new(move |e| e2.lock().push(e))).unwrap();
        let t = TenantRecord { name: "red".into(), qos: Qos { max_bw: 200_000_000, max_msg_rate: 0, weight: 3 } };
        s.put_tenant(&t).unwrap();
        s.put_tenant(&t).unwrap(); // unchanged: no event
        let reopened = FileStore::open(&dir).unwrap();
        assert_eq!(reopened.list_tenants().unwrap(), vec![t.clone()]);
        assert_eq!(reopened.snapshot().unwrap().tenants, vec![t.clone()]);
        assert!(s.delete_tenant("red").unwrap());
        assert!(!s.delete_tenant("red").unwrap());
        assert_eq!(*events.lock(), vec![StoreEvent::TenantPut(t), StoreEvent::TenantDeleted("red".into())]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn file_store_round_trip_and_events() {
        let dir = std::env::temp_dir().join(format!("vrdma-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let s = FileStore::open(&dir).unwrap();
        let events = Arc::new(Mutex::new(Vec::new()));
        let e2 = events.clone();
        let h = s.watch(0, Box::new(move |e| e2.lock().push(e))).unwrap();
        let v = rec("a", 2);
        s.create_vnic(&v).unwrap();
        assert!(matches!(s.create_vnic(&v), Err(StoreError::NameTaken(_))));
        assert!(matches!(s.create_vnic(&rec("b", 2)), Err(StoreError::IpTaken(_))));
        assert_eq!(FileStore::open(&dir).unwrap().list_vnics().unwrap(), vec![v.clone()]);
        let mut moved = v.clone();
        moved.host = "h2".into();
        s.update_vnic(&moved).unwrap();
        assert!(matches!(s.update_vnic(&rec("a", 3)), Err(StoreError::IpChanged(_))));
        assert_eq!(s.get_vnic("a").unwrap(), Some(moved.clone()));
        s.put_rule(&RuleRecord::new("x", "y")).unwrap();
        s.put_rule(&RuleRecord::new("y", "x")).unwrap();
        assert_eq!(s.list_rules().unwrap().len(), 1);
        assert!(s.delete_rule(&RuleRecord::new("y", "x")).unwrap());
        assert!(s.delete_vnic("a").unwrap());
        assert!(!s.delete_vnic("a").unwrap());
        s.create_vnic(&rec("b", 2)).unwrap(); // the address is free again
        drop(h);
        s.delete_vnic("b").unwrap();
        let ev = events.lock().clone();
        assert_eq!(
            ev,
            vec![
                StoreEvent::VnicPut(v),
                StoreEvent::VnicPut(moved),
                StoreEvent::RulePut(RuleRecord::new("x", "y")),
                StoreEvent::RuleDeleted(RuleRecord::new("x", "y")),
                StoreEvent::VnicDeleted("a".into()),
                StoreEvent::VnicPut(rec("b", 2)),
            ]
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
