//! Admin API: JSON lines over `<run_dir>/admin.sock` (mode 0600, hidden from containers by
//! the vNIC bind mount). Used by the `vrdma` CLI.

use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vrdma_abi::control::Limits;

use crate::server::{Daemon, ServerError};
use crate::store::LimitsRecord;

/// An admin request.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AdminRequest {
    /// Create a vNIC.
    Create { name: String, tenant: String, ip: Option<String>, limits: Option<LimitsRecord> },
    /// Delete a vNIC.
    Delete { name: String },
    /// List vNICs with usage and counters.
    List,
    /// Network of the containers: (address, prefix).
    Network,
}

fn parse_cidr(s: &str) -> Result<(Ipv4Addr, u8), String> {
    let (a, l) = s.split_once('/').ok_or_else(|| format!("{s}: expected A.B.C.D/LEN"))?;
    let a: Ipv4Addr = a.parse().map_err(|e| format!("{a}: {e}"))?;
    let l: u8 = l.parse().map_err(|e| format!("{l}: {e}"))?;
    if l > 32 {
        return Err(format!("prefix {l} > 32"));
    }
    Ok((a, l))
}

fn handle(d: &Arc<Daemon>, line: &str) -> serde_json::Value {
    use serde_json::json;
    let req: AdminRequest = match serde_json::from_str(line) {
        Ok(r) => r,
        Err(e) => return json!({"ok": false, "error": format!("bad request: {e}")}),
    };
    let res: Result<serde_json::Value, ServerError> = match req {
        AdminRequest::Create { name, tenant, ip, limits } => {
            let ip = match ip.map(|s| parse_cidr(&s)).transpose() {
                Ok(ip) => ip,
                Err(e) => return json!({"ok": false, "error": e}),
            };
            d.create_vnic(&name, &tenant, ip, limits.map(Limits::from)).map(|r| json!({"ok": true, "vnic": r, "dir": d.vnic_dir(&r.name)}))
        }
        AdminRequest::Delete { name } => d.delete_vnic(&name).map(|_| json!({"ok": true})),
        AdminRequest::List => {
            let st = d.registry.lock().status();
            let with_dirs: Vec<_> = st
                .into_iter()
                .map(|s| json!({"vnic": s.record, "usage": s.usage, "counters": s.counters, "dir": d.vnic_dir(&s.record.name)}))
                .collect();
            Ok(json!({"ok": true, "vnics": with_dirs}))
        }
        AdminRequest::Network => {
            let (a, l) = d.cfg.network;
            let gw = Ipv4Addr::from(u32::from(a) + 1);
            Ok(json!({"ok": true, "network": format!("{a}/{l}"), "gateway": gw.to_string(), "prefix_len": l}))
        }
    };
    res.unwrap_or_else(|e| json!({"ok": false, "error": e.to_string()}))
}

fn serve(d: Arc<Daemon>, s: UnixStream) {
    let mut w = match s.try_clone() {
        Ok(w) => w,
        Err(_) => return,
    };
    for line in BufReader::new(s).lines() {
        let Ok(line) = line else { return };
        let reply = handle(&d, &line);
        if writeln!(w, "{reply}").is_err() {
            return;
        }
    }
}

/// Starts the admin socket.
pub fn start(d: Arc<Daemon>) -> Result<(), ServerError> {
    let path = d.run_dir().join("admin.sock");
    let _ = std::fs::remove_file(&path);
    let l = UnixListener::bind(&path).map_err(|source| ServerError::Admin { path: path.display().to_string(), source })?;
    let _ = std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600));
    std::thread::Builder::new()
        .name("admin".into())
        .spawn(move || {
            for s in l.incoming().flatten() {
                let d = d.clone();
                let _ = std::thread::Builder::new().name("admin-conn".into()).spawn(move || serve(d, s));
            }
        })
        .map_err(|source| ServerError::Admin { path: "thread".into(), source })?;
    Ok(())
}
