//! The backend against a real etcd on 127.0.0.1 (the Debian package etcd-server): failover,
//! transactions, the watch, leases.

use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use super::super::{HostRecord, RuleRecord, Store, StoreError, StoreEvent, VnicRecord};
use super::EtcdStore;

/// A real etcd on 127.0.0.1 for the duration of a test.
struct TestEtcd {
    child: std::process::Child,
    dir: std::path::PathBuf,
    endpoint: String,
}

impl TestEtcd {
    /// Starts etcd for `test`; None (the test skipped, or failed under CI) when it is not
    /// installed.
    fn start(test: &str) -> Option<TestEtcd> {
        if !vrdma_test_support::require_files(test, &["/usr/bin/etcd"], "the Debian package etcd-server") {
            return None;
        }
        // Free ports: bind port 0 and let go (a race with other tests is unlikely).
        let port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (cp, pp) = (port(), port());
        let dir = std::env::temp_dir().join(format!("vrdma-etcd-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let client = format!("http://127.0.0.1:{cp}");
        let peer = format!("http://127.0.0.1:{pp}");
        let child = std::process::Command::new("/usr/bin/etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("t={peer}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.join("etcd.log")).unwrap())
            .spawn()
            .unwrap();
        let e = TestEtcd { child, dir, endpoint: format!("127.0.0.1:{cp}") };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !EtcdStore::healthy(std::slice::from_ref(&e.endpoint)) {
            assert!(Instant::now() < deadline, "etcd did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(e)
    }
}

impl Drop for TestEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn rec(name: &str, ip: u8, host: &str) -> VnicRecord {
    VnicRecord {
        name: name.into(),
        tenant: "t".into(),
        ip: Ipv4Addr::new(198, 18, 1, ip),
        prefix_len: 15,
        limits: Default::default(),
        node_guid: 7,
        host: host.into(),
        qos: Default::default(),
    }
}

fn next(rx: &std::sync::mpsc::Receiver<StoreEvent>) -> StoreEvent {
    loop {
        match rx.recv_timeout(Duration::from_secs(10)).expect("a watch event") {
            StoreEvent::HostPut(_) | StoreEvent::HostDeleted(_) => continue,
            e => return e,
        }
    }
}

/// A member answering 429 (overloaded, "too many requests") is failed over like one that
/// is down, not taken for a wrong request (or, when authenticating, wrong credentials).
#[test]
fn an_overloaded_member_is_failed_over() {
    let Some(etcd) = TestEtcd::start("an_overloaded_member_is_failed_over") else { return };
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let mut b = [0u8; 4096];
            let _ = s.read(&mut b);
            let body = r#"{"error":"etcdserver: too many requests","code":8}"#;
            let _ = write!(s, "HTTP/1.1 429 Too Many Requests\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        }
    });
    let s = EtcdStore::connect(vec![busy, etcd.endpoint.clone()]).unwrap();
    s.create_vnic(&rec("a", 2, "h1")).unwrap();
    assert_eq!(s.get_vnic("a").unwrap(), Some(rec("a", 2, "h1")));
}

#[test]
fn crud_txn_watch_against_real_etcd() {
    let Some(etcd) = TestEtcd::start("crud_txn_watch_against_real_etcd") else { return };
    // The first endpoint is dead: every call fails over to the second.
    let s = EtcdStore::connect(vec!["127.0.0.1:1".into(), etcd.endpoint.clone()]).unwrap();
    let snap = s.snapshot().unwrap();
    assert!(snap.vnics.is_empty() && snap.revision > 0);
    let (tx, rx) = std::sync::mpsc::channel();
    let _w = s.watch(snap.revision, Box::new(move |e| tx.send(e).unwrap())).unwrap();

    let a = rec("a", 2, "h1");
    s.create_vnic(&a).unwrap();
    assert!(matches!(s.create_vnic(&a), Err(StoreError::NameTaken(_))));
    assert!(matches!(s.create_vnic(&rec("b", 2, "h1")), Err(StoreError::IpTaken(_))));
    assert_eq!(s.get_vnic("a").unwrap(), Some(a.clone()));
    assert_eq!(s.get_vnic("zz").unwrap(), None);
    let mut moved = a.clone();
    moved.host = "h2".into();
    s.update_vnic(&moved).unwrap();
    assert!(matches!(s.update_vnic(&rec("a", 3, "h1")), Err(StoreError::IpChanged(_))));
    assert!(matches!(s.update_vnic(&rec("nope", 9, "h1")), Err(StoreError::NotFound(_))));
    s.put_rule(&RuleRecord::new("red", "blue")).unwrap();
    assert_eq!(s.list_rules().unwrap(), vec![RuleRecord::new("blue", "red")]);
    assert!(s.delete_rule(&RuleRecord::new("blue", "red")).unwrap());
    assert!(!s.delete_rule(&RuleRecord::new("blue", "red")).unwrap());
    assert!(s.delete_vnic("a").unwrap());
    assert!(!s.delete_vnic("a").unwrap());
    s.create_vnic(&rec("b", 2, "h1")).unwrap(); // the address was freed with "a"
    assert_eq!(s.list_vnics().unwrap(), vec![rec("b", 2, "h1")]);

    assert_eq!(next(&rx), StoreEvent::VnicPut(a.clone()));
    assert_eq!(next(&rx), StoreEvent::VnicPut(moved));
    assert_eq!(next(&rx), StoreEvent::RulePut(RuleRecord::new("blue", "red")));
    assert_eq!(next(&rx), StoreEvent::RuleDeleted(RuleRecord::new("blue", "red")));
    assert_eq!(next(&rx), StoreEvent::VnicDeleted("a".into()));
    assert_eq!(next(&rx), StoreEvent::VnicPut(rec("b", 2, "h1")));

    // Hosts live under a lease: revoked when the store is dropped, expired when the
    // daemon dies without dropping it.
    let h = HostRecord {
        name: "h1".into(),
        transport_addr: "198.19.255.11:4791".parse().unwrap(),
        underlay_ip: Ipv4Addr::new(198, 19, 255, 11),
    };
    let s2 = EtcdStore::connect_with_ttl(vec![etcd.endpoint.clone()], 2).unwrap();
    s2.put_host(&h).unwrap();
    assert_eq!(s.list_hosts().unwrap(), vec![h.clone()]);
    std::thread::sleep(Duration::from_secs(4)); // > TTL: kept alive
    assert_eq!(s.list_hosts().unwrap(), vec![h.clone()]);
    s2.stop.store(true, Ordering::SeqCst); // keepalive stops, as if the daemon hung
    let deadline = Instant::now() + Duration::from_secs(10);
    while !s.list_hosts().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "host record did not expire");
        std::thread::sleep(Duration::from_millis(200));
    }
    s2.lease.lock().take();
}

#[test]
fn concurrent_creates_never_share_an_address() {
    let Some(etcd) = TestEtcd::start("concurrent_creates_never_share_an_address") else { return };
    let stores: Vec<_> = (0..2).map(|_| Arc::new(EtcdStore::connect(vec![etcd.endpoint.clone()]).unwrap())).collect();
    let threads: Vec<_> = stores
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let s = s.clone();
            std::thread::spawn(move || {
                let mut mine = Vec::new();
                for n in 0..20 {
                    // Both start from the same address and walk up on IpTaken.
                    let mut ip = 2u8;
                    loop {
                        match s.create_vnic(&rec(&format!("v{i}-{n}"), ip, "h")) {
                            Ok(()) => break,
                            Err(StoreError::IpTaken(_)) => ip += 1,
                            Err(e) => panic!("{e}"),
                        }
                    }
                    mine.push(ip);
                }
                mine
            })
        })
        .collect();
    let mut all: Vec<u8> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 40);
    assert_eq!(stores[0].list_vnics().unwrap().len(), 40);
}

#[test]
fn watch_from_a_compacted_revision_resyncs() {
    let Some(etcd) = TestEtcd::start("watch_from_a_compacted_revision_resyncs") else { return };
    let s = EtcdStore::connect(vec![etcd.endpoint.clone()]).unwrap();
    s.create_vnic(&rec("a", 2, "h")).unwrap();
    s.create_vnic(&rec("b", 3, "h")).unwrap();
    let rev = s.snapshot().unwrap().revision;
    s.client.call("/v3/kv/compaction", &json!({"revision": rev.to_string(), "physical": true})).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let _w = s.watch(1, Box::new(move |e| tx.send(e).unwrap())).unwrap();
    match next(&rx) {
        StoreEvent::Resync(snap) => {
            assert_eq!(snap.vnics, vec![rec("a", 2, "h"), rec("b", 3, "h")]);
            assert!(snap.revision >= rev);
        }
        e => panic!("expected a resync, got {e:?}"),
    }
    s.create_vnic(&rec("c", 4, "h")).unwrap();
    assert_eq!(next(&rx), StoreEvent::VnicPut(rec("c", 4, "h")));
}
