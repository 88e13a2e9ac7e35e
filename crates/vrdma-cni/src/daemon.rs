//! vrdmad, through its admin socket ([`vrdmad::admin_client`]).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vrdmad::admin_client::{call, AdminClientError};
use vrdmad::store::LimitsRecord;

use crate::error::CniError;

/// How long one request may take: a runtime waits for its plugin, so a wedged daemon must
/// not wedge container starts.
const TIMEOUT: Duration = Duration::from_secs(20);

/// How long DEL waits for a created vNIC's last clients (the container's processes, just
/// killed) to be noticed gone before deleting it.
const CLIENTS_GONE_WAIT: Duration = Duration::from_secs(5);

/// A vNIC as vrdmad lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vnic {
    pub name: String,
    pub tenant: String,
    pub ip: Ipv4Addr,
    pub prefix_len: u8,
    /// Serving host ("" or this one when `local`).
    pub host: String,
    /// Served by this host's vrdmad.
    pub local: bool,
    /// Its directory on this host (with `control.sock`).
    pub dir: Option<PathBuf>,
}

/// The container network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    pub address: Ipv4Addr,
    pub prefix_len: u8,
    /// The bridge's address.
    pub gateway: Ipv4Addr,
}

/// vrdmad at an admin socket.
pub struct Daemon {
    socket: PathBuf,
}

impl Daemon {
    pub fn new(socket: &Path) -> Daemon {
        Daemon { socket: socket.to_path_buf() }
    }

    fn call(&self, req: Value) -> Result<Value, CniError> {
        call(&self.socket, &req, Some(TIMEOUT)).map_err(|e| match e {
            AdminClientError::Connect { .. } | AdminClientError::Io { .. } => CniError::TryAgainLater { reason: error_chain(&e) },
            AdminClientError::BadReply { .. } | AdminClientError::Refused { .. } => CniError::Daemon { reason: error_chain(&e) },
        })
    }

    /// The container network (also: whether vrdmad answers).
    pub fn network(&self) -> Result<Network, CniError> {
        let v = self.call(json!({"op": "network"}))?;
        let bad = || CniError::Daemon { reason: format!("unexpected network reply {v}") };
        let (address, prefix_len) = v["network"].as_str().and_then(|n| n.split_once('/')).ok_or_else(bad)?;
        Ok(Network {
            address: address.parse().map_err(|_| bad())?,
            prefix_len: prefix_len.parse().map_err(|_| bad())?,
            gateway: v["gateway"].as_str().and_then(|g| g.parse().ok()).ok_or_else(bad)?,
        })
    }

    /// The vNIC named `name`, if vrdmad knows it.
    pub fn find(&self, name: &str) -> Result<Option<Vnic>, CniError> {
        let v = self.call(json!({"op": "list"}))?;
        let Some(entry) = v["vnics"].as_array().into_iter().flatten().find(|e| e["vnic"]["name"] == name) else { return Ok(None) };
        vnic_of(entry).map(Some)
    }

    /// Creates vNIC `name` on this host.
    pub fn create(&self, name: &str, tenant: &str, ip: Option<Ipv4Addr>, limits: Option<LimitsRecord>) -> Result<Vnic, CniError> {
        let ip = match ip {
            Some(a) => Some(format!("{a}/{}", self.network()?.prefix_len)),
            None => None,
        };
        let v = self.call(json!({"op": "create", "name": name, "tenant": tenant, "ip": ip, "limits": limits}))?;
        vnic_of(&v)
    }

    /// Deletes vNIC `name`; returns whether it existed. Waits a little for its last clients
    /// to be gone.
    pub fn delete(&self, name: &str) -> Result<bool, CniError> {
        let deadline = Instant::now() + CLIENTS_GONE_WAIT;
        loop {
            if self.find(name)?.is_none() {
                return Ok(false);
            }
            match self.call(json!({"op": "delete", "name": name})) {
                Ok(_) => return Ok(true),
                Err(CniError::Daemon { reason }) if reason.contains("live clients") && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                // Deleted by someone else meanwhile: fine.
                Err(e) => return if self.find(name)?.is_none() { Ok(false) } else { Err(e) },
            }
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// A `list` entry or `create` reply (`vnic`, `local`, `dir`).
fn vnic_of(entry: &Value) -> Result<Vnic, CniError> {
    let r = &entry["vnic"];
    let bad = || CniError::Daemon { reason: format!("unexpected vNIC record {r}") };
    Ok(Vnic {
        name: r["name"].as_str().ok_or_else(bad)?.to_string(),
        tenant: r["tenant"].as_str().ok_or_else(bad)?.to_string(),
        ip: r["ip"].as_str().and_then(|a| a.parse().ok()).ok_or_else(bad)?,
        prefix_len: r["prefix_len"].as_u64().and_then(|l| u8::try_from(l).ok()).ok_or_else(bad)?,
        host: r["host"].as_str().unwrap_or_default().to_string(),
        local: entry["local"] != false,
        dir: entry["dir"].as_str().map(PathBuf::from),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vnic_entries_are_read() {
        let e = json!({"vnic": {"name": "a", "tenant": "t", "ip": "198.19.0.2", "prefix_len": 15, "host": "h1"}, "local": true, "dir": "/run/vrdma/vnics/a"});
        let v = vnic_of(&e).unwrap();
        assert_eq!((v.name.as_str(), v.tenant.as_str(), v.prefix_len, v.local), ("a", "t", 15, true));
        assert_eq!(v.ip, Ipv4Addr::new(198, 19, 0, 2));
        assert_eq!(v.dir, Some(PathBuf::from("/run/vrdma/vnics/a")));
        assert!(
            !vnic_of(&json!({"vnic": {"name": "b", "tenant": "t", "ip": "198.19.0.3", "prefix_len": 15}, "local": false})).unwrap().local
        );
        assert_eq!(vnic_of(&json!({"vnic": {"name": "a"}})).unwrap_err().code(), 100);
    }

    #[test]
    fn an_absent_daemon_is_try_again_later() {
        let d = Daemon::new(Path::new("/nonexistent/vrdma-cni-test/admin.sock"));
        let e = d.network().unwrap_err();
        assert_eq!(e.code(), 11, "{e}");
        assert!(e.to_string().contains("is vrdmad running?"), "{e}");
    }
}
