use std::net::SocketAddr;

use super::*;
use crate::store::FileStore;
use vrdma_abi::control::Limits;

fn vnic(name: &str, last: u8) -> VnicRecord {
    VnicRecord {
        name: name.into(),
        tenant: "t".into(),
        ip: Ipv4Addr::new(198, 18, 0, last),
        prefix_len: 15,
        limits: Limits::default(),
        node_guid: 1,
        host: "h1".into(),
        qos: Default::default(),
    }
}

fn host(name: &str, last: u8) -> HostRecord {
    HostRecord {
        name: name.into(),
        transport_addr: SocketAddr::from(([198, 20, 0, last], 4791)),
        underlay_ip: Ipv4Addr::new(198, 20, 0, last),
    }
}

fn names(events: &[StoreEvent]) -> Vec<String> {
    events
        .iter()
        .map(|e| match e {
            StoreEvent::VnicPut(v) => format!("+{}", v.name),
            StoreEvent::VnicDeleted(n) => format!("-{n}"),
            StoreEvent::HostPut(h) => format!("+host {}", h.name),
            StoreEvent::HostDeleted(n) => format!("-host {n}"),
            StoreEvent::RulePut(r) => format!("+rule {}/{}", r.from_tenant, r.to_tenant),
            StoreEvent::RuleDeleted(r) => format!("-rule {}/{}", r.from_tenant, r.to_tenant),
            StoreEvent::TenantPut(t) => format!("+tenant {}", t.name),
            StoreEvent::TenantDeleted(n) => format!("-tenant {n}"),
            StoreEvent::Resync(s) => format!("resync {}", s.vnics.len()),
        })
        .collect()
}

#[test]
fn hostile_records_are_never_admitted() {
    let mut v = View::new(Check::default());
    for name in ["/", "..", "../..", "", "a/../../etc"] {
        assert!(v.admit(StoreEvent::VnicPut(vnic(name, 2))).is_empty(), "{name}");
        assert!(v.admit(StoreEvent::VnicDeleted(name.into())).is_empty(), "{name}");
    }
    let mut outside = vnic("out", 2);
    outside.ip = Ipv4Addr::new(10, 0, 0, 1);
    assert!(v.admit(StoreEvent::VnicPut(outside)).is_empty());
    let mut absurd = vnic("big", 3);
    absurd.limits.max_cq = u32::MAX;
    assert!(v.admit(StoreEvent::VnicPut(absurd)).is_empty());
    assert!(v.admit(StoreEvent::RulePut(RuleRecord::new("..", "x"))).is_empty());
    assert!(v.admit(StoreEvent::HostPut(host("..", 1))).is_empty());
    assert_eq!(v.refused(), 9);
    // Logged once each: the same refusal again is counted, not logged again.
    let logged = v.logged.len();
    v.admit(StoreEvent::VnicPut(vnic("/", 2)));
    assert_eq!((v.logged.len(), v.refused()), (logged, 10));
}

#[test]
fn a_bad_update_keeps_the_accepted_record() {
    let mut v = View::new(Check::default());
    assert_eq!(names(&v.admit(StoreEvent::VnicPut(vnic("a", 2)))), ["+a"]);
    let mut bad = vnic("a", 2);
    bad.tenant = "../x".into();
    assert!(v.admit(StoreEvent::VnicPut(bad.clone())).is_empty());
    let snap = v.resync(Snapshot { vnics: vec![bad], ..Default::default() });
    assert_eq!(snap.vnics, vec![vnic("a", 2)]);
}

#[test]
fn addresses_stay_unique_and_a_waiting_record_gets_its_address_later() {
    let mut v = View::new(Check::default());
    v.admit(StoreEvent::VnicPut(vnic("a", 2)));
    assert!(v.admit(StoreEvent::VnicPut(vnic("b", 2))).is_empty());
    assert_eq!(names(&v.admit(StoreEvent::VnicDeleted("a".into()))), ["-a", "+b"]);
    // Moving to a new address frees the old one.
    v.admit(StoreEvent::VnicPut(vnic("c", 3)));
    assert!(v.admit(StoreEvent::VnicPut(vnic("d", 3))).is_empty());
    assert_eq!(names(&v.admit(StoreEvent::VnicPut(vnic("c", 4)))), ["+c", "+d"]);
    // A host may not take a vNIC's address, nor a vNIC a host's.
    assert!(v
        .admit(StoreEvent::HostPut(HostRecord {
            name: "hx".into(),
            transport_addr: SocketAddr::from(([198, 18, 0, 4], 4791)),
            underlay_ip: Ipv4Addr::new(198, 18, 0, 4),
        }))
        .is_empty());
    let underlay = Ipv4Addr::new(198, 19, 5, 11);
    v.admit(StoreEvent::HostPut(HostRecord {
        name: "h8".into(),
        transport_addr: SocketAddr::from((underlay, 4791)),
        underlay_ip: underlay,
    }));
    let mut on_host = vnic("e", 9);
    on_host.ip = underlay;
    assert!(v.admit(StoreEvent::VnicPut(on_host)).is_empty(), "a vNIC on a host's address");
    // Hosts alike.
    v.admit(StoreEvent::HostPut(host("h1", 1)));
    assert!(v.admit(StoreEvent::HostPut(host("h2", 1))).is_empty());
    assert_eq!(names(&v.admit(StoreEvent::HostDeleted("h1".into()))), ["-host h1", "+host h2"]);
}

#[test]
fn resync_keeps_incumbents() {
    let mut v = View::new(Check::default());
    v.admit(StoreEvent::VnicPut(vnic("z", 2)));
    // A record sorting first claims z's address: z keeps it.
    let snap = v.resync(Snapshot { vnics: vec![vnic("a", 2), vnic("z", 2), vnic("/", 5)], revision: 7, ..Default::default() });
    assert_eq!(snap.vnics, vec![vnic("z", 2)]);
    assert_eq!(snap.revision, 7);
    // z goes: a gets the address.
    assert_eq!(names(&v.admit(StoreEvent::VnicDeleted("z".into()))), ["-z", "+a"]);
}

#[test]
fn a_guarded_store_refuses_to_write_and_to_deliver_bad_records() {
    let dir = std::env::temp_dir().join(format!("vrdma-guard-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let inner: Arc<dyn Store> = Arc::new(FileStore::open(&dir).unwrap());
    let g = GuardedStore::new(inner.clone(), Check::default());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let _w = g.watch(0, Box::new(move |e| s2.lock().push(e))).unwrap();
    assert!(matches!(g.create_vnic(&vnic("..", 2)), Err(StoreError::BadRecord { .. })));
    let mut outside = vnic("o", 2);
    outside.ip = Ipv4Addr::new(8, 8, 8, 8);
    assert!(matches!(g.create_vnic(&outside), Err(StoreError::BadRecord { .. })));
    g.create_vnic(&vnic("ok", 2)).unwrap();
    // Written behind the guard's back (as a hostile etcd client would).
    inner.create_vnic(&outside).unwrap();
    assert_eq!(g.list_vnics().unwrap(), vec![vnic("ok", 2)]);
    assert_eq!(g.get_vnic("o").unwrap(), None);
    assert_eq!(g.snapshot().unwrap().vnics, vec![vnic("ok", 2)]);
    assert_eq!(names(&seen.lock()), ["+ok"]);
    assert!(g.refused() >= 3);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn tenant_policies_are_checked_before_use() {
    use crate::store::TenantRecord;
    use vrdma_abi::control::Qos;
    let mut v = View::new(Check::default());
    let good = TenantRecord { name: "t".into(), qos: Qos { weight: 2, ..Qos::default() } };
    assert_eq!(v.admit(StoreEvent::TenantPut(good.clone())), vec![StoreEvent::TenantPut(good.clone())]);
    let bad = TenantRecord { name: "t".into(), qos: Qos { weight: 0, ..Qos::default() } };
    assert!(v.admit(StoreEvent::TenantPut(bad.clone())).is_empty(), "weight 0 is refused");
    assert!(v.admit(StoreEvent::TenantPut(TenantRecord { name: "../x".into(), qos: Qos::default() })).is_empty());
    assert!(v.admit(StoreEvent::TenantDeleted("../x".into())).is_empty());
    let snap = v.resync(Snapshot { tenants: vec![good.clone(), bad], ..Default::default() });
    assert_eq!(snap.tenants, vec![good]);
}
