//! ADD's result (SPEC.md, "ADD Success"), and reading one back as CHECK's `prevResult`.

use std::net::Ipv4Addr;

use serde_json::{json, Value};

use crate::error::CniError;
use crate::version::Version;

/// A route, as results list it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub dst: (Ipv4Addr, u8),
    pub gw: Option<Ipv4Addr>,
}

/// What one ADD made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    pub host_veth: String,
    pub host_mac: String,
    pub ifname: String,
    pub container_mac: String,
    /// `CNI_NETNS`.
    pub sandbox: String,
    pub address: (Ipv4Addr, u8),
    pub gateway: Ipv4Addr,
    pub routes: Vec<Route>,
    /// The vNIC's control socket on the host (1.1.0's `socketPath`).
    pub socket_path: Option<String>,
}

fn cidr((a, l): (Ipv4Addr, u8)) -> String {
    format!("{a}/{l}")
}

fn parse_cidr(s: &str) -> Option<(Ipv4Addr, u8)> {
    let (a, l) = s.split_once('/')?;
    let l: u8 = l.parse().ok()?;
    (l <= 32).then_some((a.parse().ok()?, l))
}

/// The result of an ADD: `prev` (a chained plugin's `prevResult`, passed through) with our
/// interfaces (host end, then the container's), address and routes appended, in the form
/// of `version` (echoing `version_text`).
pub fn build(version: Version, version_text: &str, prev: Option<&Value>, ours: &Attachment) -> Value {
    let mut result = prev.filter(|p| p.is_object()).cloned().unwrap_or_else(|| json!({}));
    result["cniVersion"] = json!(version_text);
    let list = |result: &mut Value, key: &str| -> Vec<Value> { result.get(key).and_then(Value::as_array).cloned().unwrap_or_default() };

    let mut interfaces = list(&mut result, "interfaces");
    let base = interfaces.len();
    interfaces.push(json!({"name": ours.host_veth, "mac": ours.host_mac}));
    let mut container = json!({"name": ours.ifname, "mac": ours.container_mac, "sandbox": ours.sandbox});
    if let (true, Some(sock)) = (version.has_status_and_gc(), &ours.socket_path) {
        container["socketPath"] = json!(sock);
    }
    interfaces.push(container);

    let mut ips = list(&mut result, "ips");
    let mut ip = json!({"address": cidr(ours.address), "gateway": ours.gateway.to_string(), "interface": base + 1});
    if version.ips_carry_version() {
        ip["version"] = json!("4");
    }
    ips.push(ip);

    let mut routes = list(&mut result, "routes");
    for r in &ours.routes {
        let mut route = json!({"dst": cidr(r.dst)});
        if let Some(gw) = r.gw {
            route["gw"] = json!(gw.to_string());
        }
        routes.push(route);
    }

    result["interfaces"] = Value::Array(interfaces);
    result["ips"] = Value::Array(ips);
    result["routes"] = Value::Array(routes);
    if !matches!(result.get("dns"), Some(d) if !d.is_null()) {
        result["dns"] = json!({});
    }
    result
}

/// What a `prevResult` says about our interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub mac: Option<String>,
    /// IPv4 addresses assigned to it.
    pub addresses: Vec<(Ipv4Addr, u8)>,
    /// Every IPv4 route of the result.
    pub routes: Vec<Route>,
}

/// Finds interface `ifname` in `sandbox` in `prev` and what it should have.
pub fn expected(prev: &Value, ifname: &str, sandbox: &str) -> Result<Expected, CniError> {
    let decode = |reason: String| CniError::Decode { what: "prevResult", reason };
    let interfaces = prev.get("interfaces").and_then(Value::as_array).ok_or_else(|| decode("no interfaces".into()))?;
    let index = interfaces
        .iter()
        .position(|i| i["name"] == ifname && i["sandbox"] == sandbox)
        .ok_or_else(|| CniError::CheckFailed { reason: format!("prevResult lists no interface {ifname} in {sandbox}") })?;
    let mac = interfaces[index]["mac"].as_str().map(str::to_string);
    let addresses = prev
        .get("ips")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|ip| ip["interface"].as_u64() == Some(index as u64))
        .filter_map(|ip| ip["address"].as_str().and_then(parse_cidr))
        .collect();
    let routes = prev
        .get("routes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|r| Some(Route { dst: parse_cidr(r["dst"].as_str()?)?, gw: r["gw"].as_str().and_then(|g| g.parse().ok()) }))
        .collect();
    Ok(Expected { mac, addresses, routes })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ours() -> Attachment {
        Attachment {
            host_veth: "vc0123".into(),
            host_mac: "9a:00:00:00:00:01".into(),
            ifname: "eth0".into(),
            container_mac: "0a:58:c6:13:00:05".into(),
            sandbox: "/run/netns/x".into(),
            address: ("198.19.0.5".parse().unwrap(), 15),
            gateway: "198.18.0.1".parse().unwrap(),
            routes: vec![Route { dst: (Ipv4Addr::UNSPECIFIED, 0), gw: Some("198.18.0.1".parse().unwrap()) }],
            socket_path: Some("/run/vrdma/vnics/a/control.sock".into()),
        }
    }

    #[test]
    fn a_result_lists_both_ends_the_address_and_routes() {
        let r = build(Version(1, 0, 0), "1.0.0", None, &ours());
        assert_eq!(
            r,
            json!({
                "cniVersion": "1.0.0",
                "interfaces": [{"name": "vc0123", "mac": "9a:00:00:00:00:01"}, {"name": "eth0", "mac": "0a:58:c6:13:00:05", "sandbox": "/run/netns/x"}],
                "ips": [{"address": "198.19.0.5/15", "gateway": "198.18.0.1", "interface": 1}],
                "routes": [{"dst": "0.0.0.0/0", "gw": "198.18.0.1"}],
                "dns": {}
            })
        );
        let old = build(Version(0, 4, 0), "0.4.0", None, &ours());
        assert_eq!(old["ips"][0]["version"], "4");
        let new = build(Version(1, 1, 0), "1.1.0", None, &ours());
        assert_eq!(new["interfaces"][1]["socketPath"], "/run/vrdma/vnics/a/control.sock");
    }

    #[test]
    fn a_prev_result_is_passed_through_and_extended() {
        let prev = json!({"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/run/netns/x"}],
            "ips": [{"address": "10.0.0.2/24", "interface": 0}], "routes": [{"dst": "10.9.0.0/16"}], "dns": {"nameservers": ["10.0.0.1"]}, "extra": 1});
        let mut o = ours();
        o.ifname = "net1".into();
        let r = build(Version(1, 0, 0), "1.0.0", Some(&prev), &o);
        assert_eq!(r["interfaces"].as_array().unwrap().len(), 3);
        assert_eq!(r["ips"][1]["interface"], 2);
        assert_eq!(r["routes"].as_array().unwrap().len(), 2);
        assert_eq!(r["dns"]["nameservers"][0], "10.0.0.1");
        assert_eq!(r["extra"], 1);
        let e = expected(&r, "net1", "/run/netns/x").unwrap();
        assert_eq!(e.addresses, vec![("198.19.0.5".parse().unwrap(), 15)]);
        assert_eq!(e.mac.as_deref(), Some("0a:58:c6:13:00:05"));
        assert_eq!(e.routes.len(), 2);
    }

    #[test]
    fn expected_needs_our_interface() {
        let r = build(Version(1, 0, 0), "1.0.0", None, &ours());
        assert_eq!(expected(&r, "eth1", "/run/netns/x").unwrap_err().code(), 107);
        assert_eq!(expected(&r, "eth0", "/run/netns/y").unwrap_err().code(), 107);
        assert_eq!(expected(&json!({}), "eth0", "/run/netns/x").unwrap_err().code(), 6);
    }
}
