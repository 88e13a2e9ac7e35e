//! vrdmad's admin socket, as the device plugin uses it: probe the daemon, list, create and
//! delete vNICs, over the client the CLI and the CNI plugin share
//! (`vrdmad::admin_client`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use vrdmad::admin_client::{call, AdminClientError};

/// A vNIC as vrdmad stores and lists it.
pub use vrdmad::store::VnicRecord as Vnic;

/// What failed talking to vrdmad.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The request got no answer: the socket is missing, refused, broke off or timed out.
    #[error("vrdmad, {op}: {source}")]
    Call {
        /// The admin operation asked for (`list`, `create`, ...).
        op: &'static str,
        /// How the exchange with vrdmad failed.
        source: AdminClientError,
    },
    /// vrdmad answered, but not in the shape the operation returns (a daemon of another
    /// version, or an error reply).
    #[error("vrdmad's reply to {op} is not what it should be: {why}")]
    Reply {
        /// The admin operation asked for (`list`, `create`, ...).
        op: &'static str,
        /// What is missing or malformed in the reply.
        why: String,
    },
}

impl AdminError {
    /// True when vrdmad could not be reached (or broke off): worth trying again later.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, AdminError::Call { source: AdminClientError::Connect { .. } | AdminClientError::Io { .. }, .. })
    }
}

/// vrdmad's admin socket.
#[derive(Clone, Debug)]
pub struct Admin {
    socket: PathBuf,
}

/// A wedged daemon must not wedge the kubelet's RPC behind it.
const TIMEOUT: Duration = Duration::from_secs(5);

impl Admin {
    /// The admin socket of the vrdmad whose run directory is `run_dir`.
    pub fn new(run_dir: &Path) -> Admin {
        Admin { socket: run_dir.join("admin.sock") }
    }

    fn call(&self, op: &'static str, req: Value) -> Result<Value, AdminError> {
        call(&self.socket, &req, Some(TIMEOUT)).map_err(|source| AdminError::Call { op, source })
    }

    /// True when vrdmad answers on its admin socket.
    pub fn is_up(&self) -> bool {
        self.call("network", json!({"op": "network"})).is_ok()
    }

    /// The vNICs this vrdmad serves.
    pub fn local_vnics(&self) -> Result<Vec<Vnic>, AdminError> {
        let v = self.call("list", json!({"op": "list"}))?;
        let entries = v["vnics"].as_array().ok_or_else(|| AdminError::Reply { op: "list", why: "no vnics array".into() })?;
        entries
            .iter()
            .filter(|e| e["local"] == Value::Bool(true))
            .map(|e| Vnic::deserialize(&e["vnic"]).map_err(|e| AdminError::Reply { op: "list", why: e.to_string() }))
            .collect()
    }

    /// The vNIC named `name`, if this vrdmad serves it.
    pub fn find(&self, name: &str) -> Result<Option<Vnic>, AdminError> {
        Ok(self.local_vnics()?.into_iter().find(|v| v.name == name))
    }

    /// Creates vNIC `name` of `tenant` on this host; `ip` (A.B.C.D/LEN) or the network's next
    /// free address.
    pub fn create(&self, name: &str, tenant: &str, ip: Option<String>) -> Result<Vnic, AdminError> {
        let v = self.call("create", json!({"op": "create", "name": name, "tenant": tenant, "ip": ip}))?;
        Vnic::deserialize(&v["vnic"]).map_err(|e| AdminError::Reply { op: "create", why: e.to_string() })
    }

    /// Deletes vNIC `name`.
    pub fn delete(&self, name: &str) -> Result<(), AdminError> {
        self.call("delete", json!({"op": "delete", "name": name})).map(|_| ())
    }
}
