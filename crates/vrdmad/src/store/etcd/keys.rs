//! Where each record lives under `/vrdma/` (the table in the module's documentation) and
//! which store event a change of a key means.

use std::net::Ipv4Addr;

use serde::Deserialize;

use super::super::{HostRecord, RuleRecord, StoreError, StoreEvent, TenantRecord, VnicRecord};

pub(super) const PREFIX: &str = "/vrdma/";
pub(super) const VNICS: &str = "/vrdma/vnics/";
const IPS: &str = "/vrdma/ips/";
pub(super) const HOSTS: &str = "/vrdma/hosts/";
pub(super) const RULES: &str = "/vrdma/rules/";
pub(super) const TENANTS: &str = "/vrdma/tenants/";

pub(super) fn vnic_key(name: &str) -> String {
    format!("{VNICS}{name}")
}

pub(super) fn ip_key(ip: Ipv4Addr) -> String {
    format!("{IPS}{ip}")
}

pub(super) fn host_key(name: &str) -> String {
    format!("{HOSTS}{name}")
}

pub(super) fn tenant_key(name: &str) -> String {
    format!("{TENANTS}{name}")
}

/// Tenants in sorted order, so both directions of a rule are one key.
pub(super) fn rule_key(r: &RuleRecord) -> String {
    let r = RuleRecord::new(&r.from_tenant, &r.to_tenant);
    format!("{RULES}{}/{}", r.from_tenant, r.to_tenant)
}

pub(super) fn parse_value<T: for<'de> Deserialize<'de>>(key: &str, value: &str) -> Result<T, StoreError> {
    serde_json::from_str(value).map_err(|e| StoreError::BadRecord { key: key.to_string(), reason: e.to_string() })
}

/// The vNIC record stored at `key` (`/vrdma/vnics/<name>`), which must carry that name.
pub(super) fn parse_vnic(key: &str, value: &str) -> Result<VnicRecord, StoreError> {
    let v: VnicRecord = parse_value(key, value)?;
    named(key, VNICS, &v.name)?;
    Ok(v)
}

/// The host record stored at `key`, which must carry the key's name.
fn parse_host(key: &str, value: &str) -> Result<HostRecord, StoreError> {
    let h: HostRecord = parse_value(key, value)?;
    named(key, HOSTS, &h.name)?;
    Ok(h)
}

/// A record's name must be the one its key gives it: the key is what etcd's permissions and
/// the address claims are about.
fn named(key: &str, prefix: &str, name: &str) -> Result<(), StoreError> {
    if key.strip_prefix(prefix) == Some(name) {
        Ok(())
    } else {
        Err(StoreError::BadRecord {
            key: key.to_string(),
            reason: format!("the record names {:?}", name.chars().take(80).collect::<String>()),
        })
    }
}

/// The store event a put (`value: Some`) or delete of `key` means; None for keys that
/// carry no event (address claims, foreign keys).
pub(super) fn event_of(key: &str, value: Option<&str>) -> Result<Option<StoreEvent>, StoreError> {
    if let Some(name) = key.strip_prefix(VNICS) {
        return Ok(Some(match value {
            Some(v) => StoreEvent::VnicPut(parse_vnic(key, v)?),
            None => StoreEvent::VnicDeleted(name.to_string()),
        }));
    }
    if let Some(name) = key.strip_prefix(HOSTS) {
        return Ok(Some(match value {
            Some(v) => StoreEvent::HostPut(parse_host(key, v)?),
            None => StoreEvent::HostDeleted(name.to_string()),
        }));
    }
    if let Some(name) = key.strip_prefix(TENANTS) {
        return Ok(Some(match value {
            Some(v) => {
                let t: TenantRecord = parse_value(key, v)?;
                named(key, TENANTS, &t.name)?;
                StoreEvent::TenantPut(t)
            }
            None => StoreEvent::TenantDeleted(name.to_string()),
        }));
    }
    if let Some(pair) = key.strip_prefix(RULES) {
        let (a, b) = pair.split_once('/').ok_or_else(|| StoreError::BadRecord { key: key.into(), reason: "expected rules/A/B".into() })?;
        let r = RuleRecord::new(a, b);
        return Ok(Some(if value.is_some() { StoreEvent::RulePut(r) } else { StoreEvent::RuleDeleted(r) }));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_the_events_they_mean() {
        assert_eq!(rule_key(&RuleRecord::new("red", "blue")), "/vrdma/rules/blue/red");
        assert_eq!(ip_key(Ipv4Addr::new(198, 18, 0, 2)), "/vrdma/ips/198.18.0.2");
        assert_eq!(event_of(&vnic_key("a"), None).unwrap(), Some(StoreEvent::VnicDeleted("a".into())));
        assert_eq!(event_of(&host_key("h"), None).unwrap(), Some(StoreEvent::HostDeleted("h".into())));
        assert_eq!(event_of("/vrdma/rules/a/b", Some("{}")).unwrap(), Some(StoreEvent::RulePut(RuleRecord::new("a", "b"))));
        assert_eq!(event_of(&ip_key(Ipv4Addr::LOCALHOST), Some("a")).unwrap(), None);
        assert!(event_of("/vrdma/rules/ab", None).is_err());
        assert!(event_of(&vnic_key("a"), Some("{")).is_err());
        let rec = r#"{"name":"b","tenant":"t","ip":"198.18.0.2","prefix_len":15,
            "limits":{"max_pd":1,"max_cq":1,"max_qp":1,"max_mr":1,"max_mr_bytes":1,"max_srq":1},"node_guid":7}"#;
        assert!(matches!(event_of(&vnic_key("b"), Some(rec)).unwrap(), Some(StoreEvent::VnicPut(_))));
        assert!(event_of(&vnic_key("a"), Some(rec)).is_err(), "a record under another name's key");
        let h = r#"{"name":"h1","transport_addr":"198.19.0.1:4791","underlay_ip":"198.19.0.1"}"#;
        assert!(event_of(&host_key("h1"), Some(h)).is_ok());
        assert!(event_of(&host_key("h2"), Some(h)).is_err());
        let t = r#"{"name":"t1","qos":{"max_bw":200000000,"max_msg_rate":0,"weight":3}}"#;
        assert!(matches!(event_of(&tenant_key("t1"), Some(t)).unwrap(), Some(StoreEvent::TenantPut(r)) if r.qos.weight == 3));
        assert!(event_of(&tenant_key("t2"), Some(t)).is_err(), "a policy under another tenant's key");
        assert_eq!(event_of(&tenant_key("t1"), None).unwrap(), Some(StoreEvent::TenantDeleted("t1".into())));
    }
}
