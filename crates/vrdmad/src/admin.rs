//! Admin API: JSON lines over `<run_dir>/admin.sock` (mode 0600, hidden from containers by
//! the vNIC bind mount). Used by the `vrdma` CLI.

use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vrdma_abi::control::{Limits, Qos};

use crate::server::{Daemon, ServerError};

/// An admin request.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AdminRequest {
    /// Create a vNIC (on `host`, default the daemon's own).
    Create {
        /// The vNIC's name, unique in the cluster.
        name: String,
        /// The tenant it belongs to (tenant rules decide whom it may reach).
        tenant: String,
        /// Its container address as `A.B.C.D/LEN`; default: the next free one.
        ip: Option<String>,
        /// Its resource limits; default: [`Limits::default`].
        limits: Option<Limits>,
        /// The host that serves it; default: this daemon's.
        #[serde(default)]
        host: Option<String>,
    },
    /// Offline migration: the vNIC is served by `host` from now on.
    Move {
        /// The vNIC.
        name: String,
        /// The host that serves it from now on.
        host: String,
    },
    /// Change a vNIC's limits.
    SetLimits {
        /// The vNIC.
        name: String,
        /// Its new limits (objects already over them stay).
        limits: Limits,
    },
    /// Change a vNIC's QoS policy.
    VnicQos {
        /// The vNIC.
        name: String,
        /// What changes.
        #[serde(flatten)]
        change: QosChange,
    },
    /// Change a tenant's QoS policy (its caps bound the sum of its vNICs).
    TenantQos {
        /// The tenant.
        tenant: String,
        /// What changes.
        #[serde(flatten)]
        change: QosChange,
    },
    /// List the tenants known (of vNICs, rules or policies) with their policies.
    Tenants,
    /// Allow tenants `a` and `b` to connect (symmetric).
    Allow {
        /// One tenant.
        a: String,
        /// The other (may be `a` itself).
        b: String,
    },
    /// Remove the rule allowing `a` and `b`.
    Deny {
        /// One tenant of the rule.
        a: String,
        /// The other.
        b: String,
    },
    /// List the tenant rules.
    Rules,
    /// This host's transport refusals (the `vrdma_host_*` counters of the metrics endpoint).
    HostStats,
    /// List the hosts of the cluster.
    Hosts,
    /// Delete a vNIC.
    Delete {
        /// The vNIC.
        name: String,
    },
    /// List vNICs: those served here with usage, counters and directory; those of other
    /// hosts with `"local": false`.
    List,
    /// Network of the containers: (address, prefix).
    Network,
    /// Meters of the vNICs served here (`name`: of that one only; `qps`: each live QP's too).
    Stats {
        /// One vNIC (default: all of them).
        #[serde(default)]
        name: Option<String>,
        /// Each live QP's counters too.
        #[serde(default)]
        qps: bool,
    },
}

/// A change of a QoS policy: `clear` first resets it (uncapped, weight 1), then each given
/// field is set (a cap of 0 removes that cap).
#[derive(Debug, Default, Clone, Copy, Serialize, Deserialize)]
pub struct QosChange {
    /// Reset the policy before applying the fields.
    #[serde(default)]
    pub clear: bool,
    /// New bandwidth cap, bytes/s.
    #[serde(default)]
    pub max_bw: Option<u64>,
    /// New message-rate cap, WRs/s.
    #[serde(default)]
    pub max_msg_rate: Option<u64>,
    /// New weight.
    #[serde(default)]
    pub weight: Option<u32>,
}

impl QosChange {
    /// The policy `cur` after this change.
    pub fn apply(&self, cur: Qos) -> Qos {
        let base = if self.clear { Qos::default() } else { cur };
        Qos {
            max_bw: self.max_bw.unwrap_or(base.max_bw),
            max_msg_rate: self.max_msg_rate.unwrap_or(base.max_msg_rate),
            weight: self.weight.unwrap_or(base.weight),
        }
    }
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
        AdminRequest::Create { name, tenant, ip, limits, host } => {
            let ip = match ip.map(|s| parse_cidr(&s)).transpose() {
                Ok(ip) => ip,
                Err(e) => return json!({"ok": false, "error": e}),
            };
            d.create_vnic_on(&name, &tenant, ip, limits, host.as_deref()).map(|r| {
                let local = d.cluster().is_local(&r.host);
                json!({"ok": true, "vnic": r, "local": local, "dir": local.then(|| d.vnic_dir(&r.name))})
            })
        }
        AdminRequest::Delete { name } => d.delete_vnic(&name).map(|_| json!({"ok": true})),
        AdminRequest::Move { name, host } => d.move_vnic(&name, &host).map(|r| {
            let known = d.cluster().hosts.contains_key(&host);
            json!({"ok": true, "vnic": r, "host_up": known})
        }),
        AdminRequest::SetLimits { name, limits } => d.set_limits(&name, limits).map(|r| json!({"ok": true, "vnic": r})),
        AdminRequest::VnicQos { name, change } => d.set_vnic_qos(&name, |q| change.apply(q)).map(|r| json!({"ok": true, "vnic": r})),
        AdminRequest::TenantQos { tenant, change } => {
            d.set_tenant_qos(&tenant, |q| change.apply(q)).map(|t| json!({"ok": true, "tenant": t}))
        }
        AdminRequest::Tenants => {
            let c = d.cluster();
            let mut names: std::collections::BTreeSet<String> = c.vnics.values().map(|v| v.tenant.clone()).collect();
            names.extend(c.tenants.keys().cloned());
            names.extend(c.rules.iter().flat_map(|r| [r.from_tenant.clone(), r.to_tenant.clone()]));
            let tenants: Vec<_> = names
                .into_iter()
                .map(|t| {
                    let vnics = c.vnics.values().filter(|v| v.tenant == t).count();
                    json!({"tenant": t, "qos": c.tenants.get(&t).copied().unwrap_or_default(), "vnics": vnics})
                })
                .collect();
            Ok(json!({"ok": true, "tenants": tenants}))
        }
        AdminRequest::Allow { a, b } => d.set_rule(&a, &b, true).map(|_| json!({"ok": true})),
        AdminRequest::Deny { a, b } => d.set_rule(&a, &b, false).map(|had| json!({"ok": true, "existed": had})),
        AdminRequest::Rules => {
            let mut rules: Vec<_> = d.cluster().rules.into_iter().collect();
            rules.sort();
            Ok(json!({"ok": true, "rules": rules}))
        }
        AdminRequest::HostStats => {
            let e = d.engine();
            Ok(json!({
                "ok": true,
                "host": d.host().name,
                "refused_peers": e.refused_peers(),
                "refused_frames": e.refused_frames(),
                "refused_claims": e.refused_claims(),
                "firewall_refusals": crate::firewall::refused_connections(),
                "refused_store_records": d.store().refused_records(),
            }))
        }
        AdminRequest::Hosts => d.store.list_hosts().map_err(ServerError::from).map(|mut hs| {
            hs.sort_by(|a, b| a.name.cmp(&b.name));
            let me = d.host().name.clone();
            let vnics = d.cluster().vnics;
            let hosts: Vec<_> = hs
                .into_iter()
                .map(|h| {
                    let n = vnics.values().filter(|v| v.host == h.name || (v.host.is_empty() && h.name == me)).count();
                    json!({"host": h, "vnics": n, "this": h.name == me})
                })
                .collect();
            json!({"ok": true, "hosts": hosts})
        }),
        AdminRequest::List => {
            let st = d.registry.lock().status();
            let throttled = d.engine().throttled_vnics();
            let mut out: Vec<_> = st
                .iter()
                .map(|s| {
                    let t = throttled.contains(&s.record.name);
                    json!({"vnic": s.record, "usage": s.usage, "counters": s.counters, "dir": d.vnic_dir(&s.record.name), "local": true, "throttled": t})
                })
                .collect();
            let c = d.cluster();
            let mut remote: Vec<_> = c.vnics.values().filter(|v| !c.is_local(&v.host)).collect();
            remote.sort_by(|a, b| a.name.cmp(&b.name));
            out.extend(remote.into_iter().map(|v| json!({"vnic": v, "local": false})));
            Ok(json!({"ok": true, "vnics": out}))
        }
        AdminRequest::Stats { name, qps } => crate::metrics::report::stats_reply(d, name.as_deref(), qps),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qos_requests_parse_and_apply() {
        let r: AdminRequest = serde_json::from_str(r#"{"op":"vnic_qos","name":"a","max_bw":400000000}"#).unwrap();
        let AdminRequest::VnicQos { name, change } = r else { panic!("{r:?}") };
        assert_eq!(name, "a");
        let cur = Qos { max_bw: 1, max_msg_rate: 5, weight: 2 };
        assert_eq!(change.apply(cur), Qos { max_bw: 400_000_000, max_msg_rate: 5, weight: 2 });
        let r: AdminRequest = serde_json::from_str(r#"{"op":"tenant_qos","tenant":"t","clear":true,"weight":3}"#).unwrap();
        let AdminRequest::TenantQos { change, .. } = r else { panic!() };
        assert_eq!(change.apply(cur), Qos { max_bw: 0, max_msg_rate: 0, weight: 3 });
    }
}
