//! ADD: give the container's namespace an interface with its vNIC's address.
//!
//! Transactional: the attachment is recorded (incomplete) before anything is created, and
//! every error undoes what was made; a record left by an ADD that died is cleaned up by
//! DEL, GC, or the next ADD of the same attachment.

use std::net::Ipv4Addr;
use std::path::Path;

use serde_json::Value;
use vrdma_netns::attach::{attach, netns_link, AttachSpec};

use crate::config::{Config, VnicSource};
use crate::daemon::{Daemon, Network, Vnic};
use crate::del::undo;
use crate::env::Attachment;
use crate::error::CniError;
use crate::result::{self, Route};
use crate::state::{Record, State};
use crate::{names, Invocation};

/// Runs ADD; returns the result to print.
pub(crate) fn add(inv: &Invocation, at: &Attachment, conf: &Config) -> Result<Value, CniError> {
    let netns = at.netns.as_deref().expect("ADD has CNI_NETNS (checked with the environment)");
    let source = conf.vnic_source(inv)?;
    // Before anything is created: the namespace is there and has no such interface.
    match netns_link(netns, &at.ifname) {
        Ok(None) => {}
        Ok(Some(_)) => return Err(already(at, format!("{} exists in {}", at.ifname, netns.display()))),
        Err(e @ vrdma_netns::attach::AttachError::OpenNetns { .. }) => {
            return Err(CniError::UnknownContainer { container: at.container_id.clone(), reason: e.to_string() })
        }
        Err(e) => return Err(e.into()),
    }
    let daemon = Daemon::new(&conf.admin_socket);
    let state = State::lock(&conf.state_dir, &conf.name)?;
    if let Some(old) = state.get(&at.container_id, &at.ifname)? {
        if old.complete {
            return Err(already(at, format!("attached to vNIC {} by an earlier ADD (DEL it first)", old.vnic)));
        }
        // An ADD that died half way: clear what it left, then start over.
        undo(&old, &daemon)?;
        state.remove(&at.container_id, &at.ifname)?;
    }
    let network = daemon.network()?;
    let mut record = Record {
        container_id: at.container_id.clone(),
        ifname: at.ifname.clone(),
        netns: Some(netns.display().to_string()),
        vnic: String::new(),
        created_vnic: false,
        host_veth: names::host_veth(&at.container_id, &at.ifname),
        complete: false,
    };
    let vnic = match source {
        VnicSource::Named { vnic, tenant, ip } => {
            let v = named_vnic(&daemon, &state, &vnic, tenant.as_deref(), ip)?;
            record.vnic = v.name.clone();
            state.put(&record)?;
            v
        }
        VnicSource::PerContainer { tenant, limits, ip } => {
            record.vnic = names::vnic(&at.container_id, &at.ifname);
            record.created_vnic = true;
            if daemon.find(&record.vnic)?.is_some() {
                // Not ours (ours would have a record): leave it alone.
                return Err(CniError::Daemon { reason: format!("a vNIC named {} exists already", record.vnic) });
            }
            state.put(&record)?;
            match daemon.create(&record.vnic, &tenant, ip, limits) {
                Ok(v) => v,
                Err(e) => {
                    state.remove(&at.container_id, &at.ifname)?;
                    return Err(e);
                }
            }
        }
    };
    let made = plumb(conf, netns, at, &record, &vnic, &network).and_then(|result| {
        record.complete = true;
        state.put(&record)?;
        Ok(result)
    });
    if made.is_err() {
        if let Err(e) = undo(&record, &daemon).and_then(|()| state.remove(&at.container_id, &at.ifname)) {
            eprintln!("vrdma-cni: undoing the failed ADD of {}: {e} (DEL will retry)", at.container_id);
        }
    }
    made
}

fn already(at: &Attachment, reason: String) -> CniError {
    CniError::AlreadyAttached { container: at.container_id.clone(), ifname: at.ifname.clone(), reason }
}

/// An existing vNIC the container may have: known, of the tenant asked for, served here,
/// not given to another container, with the address asked for.
fn named_vnic(daemon: &Daemon, state: &State, name: &str, tenant: Option<&str>, ip: Option<Ipv4Addr>) -> Result<Vnic, CniError> {
    let v = daemon.find(name)?.ok_or_else(|| CniError::UnknownVnic { vnic: name.to_string() })?;
    if let Some(t) = tenant.filter(|t| *t != v.tenant) {
        return Err(CniError::WrongTenant { vnic: v.name, actual: v.tenant, expected: t.to_string() });
    }
    if !v.local {
        return Err(CniError::VnicElsewhere { vnic: v.name, host: v.host });
    }
    if let Some((network, user)) = state.user_of(&v.name)? {
        if !user.is_stale() {
            return Err(CniError::VnicInUse { vnic: v.name, container: user.container_id, ifname: user.ifname });
        }
        // Its container went without a DEL (its namespace, and the interface in it, are
        // gone): undone here as DEL would, or the vNIC would stay unusable.
        undo(&user, daemon)?;
        state.remove_in(&network, &user.container_id, &user.ifname)?;
        eprintln!(
            "vrdma-cni: vNIC {} was recorded for container {} ({}), whose network namespace is gone: that attachment is undone",
            v.name, user.container_id, user.ifname
        );
    }
    if let Some(a) = ip.filter(|a| *a != v.ip) {
        return Err(CniError::InvalidConfig { reason: format!("address {a} was asked for, but vNIC {name} has {}", v.ip) });
    }
    Ok(v)
}

/// The routes the interface gets: the default route on a primary network; on a secondary
/// one, vrdma's network via the bridge if the vNIC's own subnet does not cover it (else the
/// kernel's on-link route is it, and is listed).
pub(crate) fn routes_for(conf: &Config, vnic: &Vnic, network: &Network) -> (Vec<(Ipv4Addr, u8)>, Vec<Route>) {
    if conf.default_route {
        let default = (Ipv4Addr::UNSPECIFIED, 0);
        return (vec![default], vec![Route { dst: default, gw: Some(network.gateway) }]);
    }
    let net = (network.address, network.prefix_len);
    let covered = vnic.prefix_len <= network.prefix_len && same_subnet(vnic.ip, network.address, vnic.prefix_len);
    if covered {
        (vec![], vec![Route { dst: net, gw: None }])
    } else {
        (vec![net], vec![Route { dst: net, gw: Some(network.gateway) }])
    }
}

fn same_subnet(a: Ipv4Addr, b: Ipv4Addr, prefix_len: u8) -> bool {
    let mask = if prefix_len == 0 { 0 } else { u32::MAX << (32 - u32::from(prefix_len)) };
    u32::from(a) & mask == u32::from(b) & mask
}

/// The bridge and the veth pair; the result.
fn plumb(conf: &Config, netns: &Path, at: &Attachment, record: &Record, vnic: &Vnic, network: &Network) -> Result<Value, CniError> {
    vrdma_netns::ensure_bridge(&conf.bridge, network.gateway, network.prefix_len)?;
    let (to_add, listed) = routes_for(conf, vnic, network);
    let attached = attach(&AttachSpec {
        netns: netns.to_path_buf(),
        ifname: at.ifname.clone(),
        host_veth: record.host_veth.clone(),
        bridge: conf.bridge.clone(),
        ip: vnic.ip,
        prefix_len: vnic.prefix_len,
        gateway: network.gateway,
        routes: to_add,
    })
    .map_err(|e| match e {
        vrdma_netns::attach::AttachError::LinkExists { name, place } => already(at, format!("{name} exists in {place}")),
        e => e.into(),
    })?;
    let ours = result::Attachment {
        host_veth: record.host_veth.clone(),
        host_mac: attached.host_mac,
        ifname: at.ifname.clone(),
        container_mac: attached.container_mac,
        sandbox: netns.display().to_string(),
        address: (vnic.ip, vnic.prefix_len),
        gateway: network.gateway,
        routes: listed,
        socket_path: vnic.dir.as_ref().map(|d| d.join("control.sock").display().to_string()),
    };
    Ok(result::build(conf.version, &conf.version_text, conf.prev_result.as_ref(), &ours))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(default_route: bool) -> Config {
        let mut c = Config::from_value(serde_json::json!({"cniVersion": "1.0.0", "name": "n", "tenant": "t"})).unwrap();
        c.default_route = default_route;
        c
    }

    fn vnic(ip: &str, prefix_len: u8) -> Vnic {
        Vnic { name: "a".into(), tenant: "t".into(), ip: ip.parse().unwrap(), prefix_len, host: String::new(), local: true, dir: None }
    }

    #[test]
    fn primary_gets_a_default_route_secondary_the_network() {
        let net = Network { address: "198.18.0.0".parse().unwrap(), prefix_len: 15, gateway: "198.18.0.1".parse().unwrap() };
        let (add, listed) = routes_for(&conf(true), &vnic("198.19.0.5", 15), &net);
        assert_eq!(add, vec![(Ipv4Addr::UNSPECIFIED, 0)]);
        assert_eq!(listed[0].gw, Some(net.gateway));
        let (add, listed) = routes_for(&conf(false), &vnic("198.19.0.5", 15), &net);
        assert!(add.is_empty(), "the on-link route covers the network");
        assert_eq!(listed, vec![Route { dst: (net.address, 15), gw: None }]);
        let (add, listed) = routes_for(&conf(false), &vnic("198.19.0.5", 24), &net);
        assert_eq!(add, vec![(net.address, 15)]);
        assert_eq!(listed[0].gw, Some(net.gateway));
    }
}
