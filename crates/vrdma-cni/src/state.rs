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
pub struct Record {
    pub container_id: String,
    pub ifname: String,
    pub netns: Option<String>,
    /// The vNIC whose address the interface has.
    pub vnic: String,
    /// The plugin created the vNIC (and deletes it with the attachment).
    pub created_vnic: bool,
    pub host_veth: String,
    /// ADD finished; false while (or if it died while) ADD runs.
    pub complete: bool,
}

/// The locked state directory of one network.
pub struct State {
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
    pub fn lock(state_dir: &Path, network: &str) -> Result<State, CniError> {
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
        self.root.join(&self.network).join(format!("{container_id}:{ifname}.json"))
    }

    /// The record of (container, ifname) in this network.
    pub fn get(&self, container_id: &str, ifname: &str) -> Result<Option<Record>, CniError> {
        let path = self.path(container_id, ifname);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| io_err(&path)(io::Error::new(io::ErrorKind::InvalidData, e))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(&path)(e)),
        }
    }

    /// Writes (or replaces) a record atomically.
    pub fn put(&self, record: &Record) -> Result<(), CniError> {
        let path = self.path(&record.container_id, &record.ifname);
        let tmp = path.with_extension("tmp");
        let bytes = serde_json::to_vec_pretty(record).expect("a record serializes");
        std::fs::write(&tmp, bytes).map_err(io_err(&tmp))?;
        File::open(&tmp).and_then(|f| f.sync_all()).map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io_err(&path))
    }

    /// Removes a record; a missing one is fine.
    pub fn remove(&self, container_id: &str, ifname: &str) -> Result<(), CniError> {
        let path = self.path(container_id, ifname);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(&path)(e)),
            _ => Ok(()),
        }
    }

    /// This network's records.
    pub fn records(&self) -> Result<Vec<Record>, CniError> {
        records_in(&self.root.join(&self.network))
    }

    /// Every network's records (a vNIC is given to one container whatever the network).
    pub fn all_records(&self) -> Result<Vec<Record>, CniError> {
        let mut all = Vec::new();
        for entry in std::fs::read_dir(&self.root).map_err(io_err(&self.root))?.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                all.extend(records_in(&entry.path())?);
            }
        }
        Ok(all)
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
            let mut vnics: Vec<String> = s.all_records().unwrap().into_iter().map(|r| r.vnic).collect();
            vnics.sort();
            assert_eq!(vnics, ["a", "b"]);
            s.remove("c2", "eth0").unwrap();
            s.remove("c2", "eth0").unwrap();
            assert_eq!(s.get("c2", "eth0").unwrap(), None);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
