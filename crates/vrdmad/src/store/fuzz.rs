//! The fuzzer's entry point for store records (`fuzz/fuzz_targets/store_records.rs`): a
//! sequence of etcd key changes, decoded as the watch decodes them and passed through the
//! [`View`] that guards the daemon, checking what comes out.

// A fuzz harness: a panic is how it reports a record the guard should have stopped.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::HashMap;
use std::net::Ipv4Addr;

use super::etcd::decode_event;
use super::guard::View;
use super::validate::{valid_record_name, Check};
use super::{Snapshot, StoreEvent};

/// `data` is lines of `KEY` (a delete), `KEY\tVALUE` (a put) or a lone `!` (a resync with the
/// records put so far). Panics if the guard lets through a record the daemon must never act
/// on: a bad name, an address outside the container network, two vNICs (or hosts) on one
/// address, a limit out of range.
pub fn fuzz_records(data: &[u8]) {
    let check = Check::default();
    let mut view = View::new(check);
    // What the daemon would hold after the events: name → address.
    let mut vnics: HashMap<String, Ipv4Addr> = HashMap::new();
    let mut hosts: HashMap<String, Ipv4Addr> = HashMap::new();
    let mut raw = Snapshot::default();
    for line in data.split(|&b| b == b'\n').take(256) {
        let Ok(line) = std::str::from_utf8(line) else { continue };
        let event = if line == "!" {
            StoreEvent::Resync(raw.clone())
        } else {
            let (key, value) = match line.split_once('\t') {
                Some((k, v)) => (k, Some(v)),
                None => (line, None),
            };
            match decode_event(key, value) {
                Ok(Some(e)) => e,
                _ => continue,
            }
        };
        match &event {
            StoreEvent::VnicPut(v) => raw.vnics.push(v.clone()),
            StoreEvent::HostPut(h) => raw.hosts.push(h.clone()),
            StoreEvent::RulePut(r) => raw.rules.push(r.clone()),
            StoreEvent::TenantPut(t) => raw.tenants.push(t.clone()),
            _ => {}
        }
        for out in view.admit(event) {
            match out {
                StoreEvent::VnicPut(v) => {
                    check.vnic(&v.name, &v).expect("an admitted vNIC is valid");
                    vnics.insert(v.name.clone(), v.ip);
                }
                StoreEvent::VnicDeleted(n) => {
                    assert!(valid_record_name(&n), "deleting {n:?}");
                    vnics.remove(&n);
                }
                StoreEvent::HostPut(h) => {
                    check.host(&h.name, &h).expect("an admitted host is valid");
                    hosts.insert(h.name.clone(), h.underlay_ip);
                }
                StoreEvent::HostDeleted(n) => {
                    assert!(valid_record_name(&n), "deleting host {n:?}");
                    hosts.remove(&n);
                }
                StoreEvent::RulePut(r) | StoreEvent::RuleDeleted(r) => check.rule(&r).expect("an admitted rule is valid"),
                StoreEvent::TenantPut(t) => check.tenant(&t.name, &t).expect("an admitted tenant policy is valid"),
                StoreEvent::TenantDeleted(n) => assert!(valid_record_name(&n), "deleting tenant {n:?}"),
                StoreEvent::Resync(s) => {
                    for v in &s.vnics {
                        check.vnic(&v.name, v).expect("a resynced vNIC is valid");
                    }
                    for h in &s.hosts {
                        check.host(&h.name, h).expect("a resynced host is valid");
                    }
                    for t in &s.tenants {
                        check.tenant(&t.name, t).expect("a resynced tenant policy is valid");
                    }
                    vnics = s.vnics.iter().map(|v| (v.name.clone(), v.ip)).collect();
                    hosts = s.hosts.iter().map(|h| (h.name.clone(), h.underlay_ip)).collect();
                }
            }
            let mut ips: Vec<_> = vnics.values().collect();
            ips.sort();
            assert!(ips.windows(2).all(|w| w[0] != w[1]), "two vNICs on one address: {vnics:?}");
            let mut ips: Vec<_> = hosts.values().collect();
            ips.sort();
            assert!(ips.windows(2).all(|w| w[0] != w[1]), "two hosts on one address: {hosts:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_sequences_keep_the_invariants() {
        let rec = |name: &str, ip: &str| {
            format!(
                r#"{{"name":"{name}","tenant":"t","ip":"{ip}","prefix_len":15,"limits":{{"max_pd":1,"max_cq":1,"max_qp":1,"max_mr":1,"max_mr_bytes":1,"max_srq":1}},"node_guid":7,"host":"h1"}}"#
            )
        };
        let seq = [
            format!("/vrdma/vnics/a\t{}", rec("a", "198.18.0.2")),
            format!("/vrdma/vnics/b\t{}", rec("b", "198.18.0.2")),
            format!("/vrdma/vnics/..\t{}", rec("..", "198.18.0.3")),
            format!("/vrdma/vnics/x\t{}", rec("x", "10.0.0.1")),
            "/vrdma/hosts/h1\t{\"name\":\"h1\",\"transport_addr\":\"198.20.0.1:4791\",\"underlay_ip\":\"198.20.0.1\"}".into(),
            "/vrdma/hosts/h2\t{\"name\":\"h2\",\"transport_addr\":\"198.20.0.1:4791\",\"underlay_ip\":\"198.20.0.1\"}".into(),
            "/vrdma/rules/../x\t{}".into(),
            "!".into(),
            "/vrdma/vnics/a".into(),
            "/vrdma/vnics/../..".into(),
            "!".into(),
        ];
        fuzz_records(seq.join("\n").as_bytes());
        fuzz_records(b"");
        fuzz_records(b"\xff\n!\n\t\n/vrdma/vnics/\t{}");
    }
}
