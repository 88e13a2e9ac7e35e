//! The plugin's record of its attachments: one JSON file per attachment under
//! `<stateDir>/<network>/`, written before anything is created and removed after everything
//! is gone, so that DEL and GC can undo what a crashed ADD left. Every invocation holds an
//! exclusive lock on `<stateDir>/lock` (the runtime may run plugins for different
//! containers at once; a vNIC must not be given to two of them).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::CniError;

/// One attachment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Record {
    pub(crate) container_id: String,
    pub(crate) ifname: String,
    pub(crate) netns: Option<String>,
    /// The vNIC whose address the interface has.
    pub(crate) vnic: String,
    /// The plugin created the vNIC (and deletes it with the attachment).
    pub(crate) created_vnic: bool,
    pub(crate) host_veth: String,
    /// ADD finished; false while (or if it died while) ADD runs.
    pub(crate) complete: bool,
}

/// The locked state directory of one network.
pub(crate) struct State {
    root: PathBuf,
    network: String,
    /// Holds the lock until dropped.
    _lock: File,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CniError + '_ {
    move |source| CniError::State { path: path.to_path_buf(), source }
}

impl State {
    /// Creates `state_dir/network` if needed and takes the lock (waiting for other
    /// invocations).
    pub(crate) fn lock(state_dir: &Path, network: &str) -> Result<State, CniError> {
        let dir = state_dir.join(network);
        std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let lock_path = state_dir.join("lock");
        let lock = OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path).map_err(io_err(&lock_path))?;
        loop {
            // SAFETY: flock on a descriptor we own; no memory is passed.
            if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } == 0 {
                break;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(io_err(&lock_path)(e));
            }
        }
        Ok(State { root: state_dir.to_path_buf(), network: network.to_string(), _lock: lock })
    }

    /// File of an attachment: `:` cannot occur in a container ID or an ifname.
    fn path(&self, container_id: &str, ifname: &str) -> PathBuf {
        self.path_in(&self.network, container_id, ifname)
    }

    /// File of an attachment in network `network`.
    fn path_in(&self, network: &str, container_id: &str, ifname: &str) -> PathBuf {
        self.root.join(network).join(format!("{container_id}:{ifname}.json"))
    }

    /// The record of (container, ifname) in this network.
    pub(crate) fn get(&self, container_id: &str, ifname: &str) -> Result<Option<Record>, CniError> {
        let path = self.path(container_id, ifname);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| io_err(&path)(io::Error::new(io::ErrorKind::InvalidData, e))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(&path)(e)),
        }
    }

    /// Writes (or replaces) a record atomically.
    pub(crate) fn put(&self, record: &Record) -> Result<(), CniError> {
        let path = self.path(&record.container_id, &record.ifname);
        let tmp = path.with_extension("tmp");
        let bytes = serde_json::to_vec_pretty(record).expect("a record serializes");
        std::fs::write(&tmp, bytes).map_err(io_err(&tmp))?;
        File::open(&tmp).and_then(|f| f.sync_all()).map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io_err(&path))
    }

    /// Removes a record; a missing one is fine.
    pub(crate) fn remove(&self, container_id: &str, ifname: &str) -> Result<(), CniError> {
        self.remove_in(&self.network, container_id, ifname)
    }

    /// This network's records.
    pub(crate) fn records(&self) -> Result<Vec<Record>, CniError> {
        records_in(&self.root.join(&self.network))
    }

    /// Every network's records (a vNIC is given to one container whatever the network),
    /// each with its network's name.
    fn networks_records(&self) -> Result<Vec<(String, Record)>, CniError> {
        let mut all = Vec::new();
        for entry in std::fs::read_dir(&self.root).map_err(io_err(&self.root))?.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                let network = entry.file_name().to_string_lossy().into_owned();
                all.extend(records_in(&entry.path())?.into_iter().map(|r| (network.clone(), r)));
            }
        }
        Ok(all)
    }

    /// The attachment that has vNIC `vnic`, in whichever network, with that network's name.
    pub(crate) fn user_of(&self, vnic: &str) -> Result<Option<(String, Record)>, CniError> {
        Ok(self.networks_records()?.into_iter().find(|(_, r)| r.vnic == vnic))
    }

    /// Removes a record of network `network` (this one or another: see [`State::user_of`]).
    pub(crate) fn remove_in(&self, network: &str, container_id: &str, ifname: &str) -> Result<(), CniError> {
        let path = self.path_in(network, container_id, ifname);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(&path)(e)),
            _ => Ok(()),
        }
    }
}

impl Record {
    /// A finished attachment whose container's network namespace is gone: its container
    /// went without a DEL (a runtime killed, a node's runtime state lost), and with the
    /// namespace went its interface.
    pub(crate) fn is_stale(&self) -> bool {
        self.complete && self.netns.as_deref().is_some_and(|p| !Path::new(p).exists())
    }
}

fn records_in(dir: &Path) -> Result<Vec<Record>, CniError> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))?.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "json") {
            // A record that cannot be read is skipped here (DEL of its attachment reports it).
            if let Some(r) = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()) {
                out.push(r);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(cid: &str, vnic: &str) -> Record {
        Record {
            container_id: cid.into(),
            ifname: "eth0".into(),
            netns: Some("/run/netns/x".into()),
            vnic: vnic.into(),
            created_vnic: false,
            host_veth: "vc0".into(),
            complete: false,
        }
    }

    #[test]
    fn records_round_trip_per_network() {
        let dir = std::env::temp_dir().join(format!("vrdma-cni-state-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        {
            let s = State::lock(&dir, "net-a").unwrap();
            assert_eq!(s.get("c1", "eth0").unwrap(), None);
            s.put(&record("c1", "a")).unwrap();
            let mut r = record("c1", "a");
            r.complete = true;
            s.put(&r).unwrap();
            assert_eq!(s.get("c1", "eth0").unwrap(), Some(r));
            assert_eq!(s.records().unwrap().len(), 1);
        }
        {
            let s = State::lock(&dir, "net-b").unwrap();
            s.put(&record("c2", "b")).unwrap();
            assert_eq!(s.records().unwrap().len(), 1);
            let mut vnics: Vec<String> = s.networks_records().unwrap().into_iter().map(|(_, r)| r.vnic).collect();
            vnics.sort();
            assert_eq!(vnics, ["a", "b"]);
            s.remove("c2", "eth0").unwrap();
            s.remove("c2", "eth0").unwrap();
            assert_eq!(s.get("c2", "eth0").unwrap(), None);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_attachment_whose_namespace_is_gone_is_stale_and_found_in_any_network() {
        let dir = std::env::temp_dir().join(format!("vrdma-cni-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut gone = record("c1", "a");
        (gone.complete, gone.netns) = (true, Some(dir.join("no-such-netns").to_string_lossy().into_owned()));
        {
            let s = State::lock(&dir, "net-a").unwrap();
            s.put(&gone).unwrap();
        }
        let s = State::lock(&dir, "net-b").unwrap();
        let (network, found) = s.user_of("a").unwrap().expect("found in the other network");
        assert_eq!((network.as_str(), &found), ("net-a", &gone));
        assert!(found.is_stale());
        let alive = Record { netns: Some(dir.to_string_lossy().into_owned()), ..gone.clone() };
        assert!(!alive.is_stale(), "its namespace exists");
        assert!(!Record { complete: false, ..gone.clone() }.is_stale(), "an ADD still running (or dead midway) is DEL's");
        assert!(!Record { netns: None, ..gone }.is_stale(), "no namespace known");
        s.remove_in("net-a", "c1", "eth0").unwrap();
        assert_eq!(s.user_of("a").unwrap(), None);
        drop(s);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
