//! Client of vrdmad's admin socket (JSON lines), as the device plugin uses it: probe the
//! daemon, list, create and delete vNICs.
//!
//! vrdma-cli has its own copy of the call (an anyhow one inside a binary crate); this is the
//! library version with typed errors.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

/// What failed talking to vrdmad.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("connecting to vrdmad at {path} (is vrdmad running?): {source}")]
    Connect { path: PathBuf, source: std::io::Error },
    #[error("talking to vrdmad at {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("vrdmad's reply to {op} is not what it should be: {why}")]
    Reply { op: String, why: String },
    #[error("vrdmad refused {op}: {message}")]
    Refused { op: String, message: String },
}

/// A vNIC as vrdmad lists it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct Vnic {
    pub name: String,
    pub tenant: String,
    pub ip: std::net::Ipv4Addr,
    pub prefix_len: u8,
    #[serde(default)]
    pub host: String,
}

/// vrdmad's admin socket.
#[derive(Clone, Debug)]
pub struct Admin {
    socket: PathBuf,
    timeout: Duration,
}

impl Admin {
    /// The admin socket of the vrdmad whose run directory is `run_dir`.
    pub fn new(run_dir: &Path) -> Admin {
        Admin { socket: run_dir.join("admin.sock"), timeout: Duration::from_secs(5) }
    }

    /// Sends one request; returns the reply when it says `ok`.
    pub fn call(&self, req: Value) -> Result<Value, AdminError> {
        let op = req["op"].as_str().unwrap_or("?").to_string();
        let io = |source| AdminError::Io { path: self.socket.clone(), source };
        let s = UnixStream::connect(&self.socket).map_err(|source| AdminError::Connect { path: self.socket.clone(), source })?;
        // A wedged daemon must not wedge the kubelet's RPC behind it.
        s.set_read_timeout(Some(self.timeout)).map_err(io)?;
        s.set_write_timeout(Some(self.timeout)).map_err(io)?;
        let mut w = s.try_clone().map_err(io)?;
        writeln!(w, "{req}").map_err(io)?;
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).map_err(io)?;
        let v: Value = serde_json::from_str(&line).map_err(|e| AdminError::Reply { op: op.clone(), why: e.to_string() })?;
        if v["ok"] != Value::Bool(true) {
            let message = v["error"].as_str().unwrap_or("no reason given").to_string();
            return Err(AdminError::Refused { op, message });
        }
        Ok(v)
    }

    /// True when vrdmad answers on its admin socket.
    pub fn is_up(&self) -> bool {
        self.call(json!({"op": "network"})).is_ok()
    }

    /// The vNICs this vrdmad serves.
    pub fn local_vnics(&self) -> Result<Vec<Vnic>, AdminError> {
        let v = self.call(json!({"op": "list"}))?;
        let entries = v["vnics"].as_array().ok_or_else(|| AdminError::Reply { op: "list".into(), why: "no vnics array".into() })?;
        entries
            .iter()
            .filter(|e| e["local"] == Value::Bool(true))
            .map(|e| Vnic::deserialize(&e["vnic"]).map_err(|e| AdminError::Reply { op: "list".into(), why: e.to_string() }))
            .collect()
    }

    /// The vNIC named `name`, if this vrdmad serves it.
    pub fn find(&self, name: &str) -> Result<Option<Vnic>, AdminError> {
        Ok(self.local_vnics()?.into_iter().find(|v| v.name == name))
    }

    /// Creates vNIC `name` of `tenant` on this host; `ip` (A.B.C.D/LEN) or the network's next
    /// free address.
    pub fn create(&self, name: &str, tenant: &str, ip: Option<String>) -> Result<Vnic, AdminError> {
        let v = self.call(json!({"op": "create", "name": name, "tenant": tenant, "ip": ip}))?;
        Vnic::deserialize(&v["vnic"]).map_err(|e| AdminError::Reply { op: "create".into(), why: e.to_string() })
    }

    /// Deletes vNIC `name`.
    pub fn delete(&self, name: &str) -> Result<(), AdminError> {
        self.call(json!({"op": "delete", "name": name})).map(|_| ())
    }
}
