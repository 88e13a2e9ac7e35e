//! CHECK: the attachment is as ADD's result (`prevResult`) says.

use std::path::Path;

use vrdma_netns::attach::{container_mac, host_link, netns_link, netns_routes};

use crate::add::routes_for;
use crate::config::Config;
use crate::daemon::Daemon;
use crate::env::Attachment;
use crate::error::CniError;
use crate::result::expected;
use crate::state::State;

fn failed(reason: String) -> CniError {
    CniError::CheckFailed { reason }
}

/// Runs CHECK.
pub fn check(at: &Attachment, conf: &Config) -> Result<(), CniError> {
    if !conf.version.has_check() {
        return Err(CniError::IncompatibleVersion { version: conf.version_text.clone(), reason: "CHECK needs 0.4.0 or later".into() });
    }
    let netns = at.netns.as_deref().expect("CHECK has CNI_NETNS (checked with the environment)");
    let prev = conf.prev_result.as_ref().ok_or_else(|| CniError::InvalidConfig { reason: "CHECK needs prevResult".into() })?;
    let want = expected(prev, &at.ifname, &netns.display().to_string())?;
    let record = State::lock(&conf.state_dir, &conf.name)?
        .get(&at.container_id, &at.ifname)?
        .filter(|r| r.complete)
        .ok_or_else(|| failed(format!("no attachment of {} {} was made by this plugin", at.container_id, at.ifname)))?;

    // vrdmad and the vNIC (an external dependency the result does not show).
    let daemon = Daemon::new(&conf.admin_socket);
    let network = daemon.network()?;
    let vnic = daemon.find(&record.vnic)?.ok_or_else(|| failed(format!("vNIC {} is gone", record.vnic)))?;
    if !vnic.local {
        return Err(failed(format!("vNIC {} is served by host {} now", vnic.name, vnic.host)));
    }
    let address = (vnic.ip, vnic.prefix_len);
    if !want.addresses.contains(&address) {
        return Err(failed(format!("prevResult does not give {} the vNIC's address {}/{}", at.ifname, vnic.ip, vnic.prefix_len)));
    }

    // The host end.
    let host = host_link(&record.host_veth)?.ok_or_else(|| failed(format!("host interface {} is gone", record.host_veth)))?;
    if host.master.as_deref() != Some(conf.bridge.as_str()) || !host.up {
        return Err(failed(format!("host interface {} is not up on bridge {}", record.host_veth, conf.bridge)));
    }

    // The container's interface, its address and our routes.
    check_container(netns, at, &want.mac, address)?;
    let routes = netns_routes(netns, &at.ifname)?;
    let (_, ours) = routes_for(conf, &vnic, &network);
    for r in ours.iter().filter(|r| want.routes.contains(r)) {
        if !routes.iter().any(|have| have.dst == r.dst && (r.gw.is_none() || have.via == r.gw)) {
            return Err(failed(format!("route to {}/{} is missing in {}", r.dst.0, r.dst.1, netns.display())));
        }
    }
    Ok(())
}

fn check_container(netns: &Path, at: &Attachment, mac: &Option<String>, address: (std::net::Ipv4Addr, u8)) -> Result<(), CniError> {
    let link = match netns_link(netns, &at.ifname) {
        Ok(Some(l)) => l,
        Ok(None) => return Err(failed(format!("{} is gone from {}", at.ifname, netns.display()))),
        Err(e @ vrdma_netns::attach::AttachError::OpenNetns { .. }) => return Err(failed(e.to_string())),
        Err(e) => return Err(e.into()),
    };
    if !link.up {
        return Err(failed(format!("{} is down", at.ifname)));
    }
    let want_mac = mac.clone().unwrap_or_else(|| container_mac(address.0));
    if !link.mac.eq_ignore_ascii_case(&want_mac) {
        return Err(failed(format!("{} has MAC {}, not {want_mac}", at.ifname, link.mac)));
    }
    if !link.addresses.contains(&address) {
        return Err(failed(format!("{} lacks its address {}/{}", at.ifname, address.0, address.1)));
    }
    Ok(())
}
