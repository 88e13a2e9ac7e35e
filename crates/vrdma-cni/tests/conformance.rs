//! CNI conformance of the real plugin binary (the spec's ADD/CHECK/DEL/VERSION/STATUS/GC
//! cases), bad input answered with CNI error codes and nothing left behind, and cleanup
//! after an ADD that died. Needs root (network namespaces); see tests/common for names.

mod common;

use common::*;
use serde_json::{json, Value};

/// What "nothing left behind" means for (container, ifname): no host veth, only `lo` in the
/// namespace, no record, and vrdmad's vNICs as before.
fn assert_nothing_left(d: &Daemon, cid: &str, ns: &Netns, vnics_before: &[(String, String)], case: &str) {
    assert!(!host_link_exists(&host_veth(cid, "eth0")), "{case}: host veth left behind");
    assert_eq!(ns.links(), ["lo"], "{case}: interfaces left in the namespace");
    assert!(d.records().is_empty(), "{case}: records left: {:?}", d.records());
    assert_eq!(d.vnics(), vnics_before, "{case}: vNICs changed");
}

#[test]
fn add_check_del_with_a_named_vnic() {
    if !prerequisites("add_check_del_with_a_named_vnic") {
        return;
    }
    let d = Daemon::start("named");
    let (vnic, other) = (vnic_name("a"), vnic_name("b"));
    d.create_vnic(&vnic, "t1", addr(10));
    d.create_vnic(&other, "t1", addr(11));
    let (ns, ns2) = (Netns::new("a"), Netns::new("a2"));
    let (cid, cid2) = (container_id("a"), container_id("a2"));
    let conf = d.conf(json!({"vnic": vnic, "tenant": "t1"}));

    // VERSION.
    let v = invoke(&[("CNI_COMMAND", "VERSION")], &json!({"cniVersion": "1.0.0"}));
    assert!(v.ok);
    assert_eq!(v.json["cniVersion"], "1.0.0");
    assert!(v.json["supportedVersions"].as_array().unwrap().contains(&json!("1.1.0")));

    // ADD: a proper result, and the namespace as it says.
    let add = attachment("ADD", &cid, Some(&ns), "eth0", "", &conf);
    assert!(add.ok, "ADD failed: {} {}\n{}", add.json, add.stderr, d.log());
    let r = &add.json;
    let veth = host_veth(&cid, "eth0");
    let mac = format!("0a:58:c6:13:{:02x}:0a", octet());
    assert_eq!(r["cniVersion"], "1.1.0");
    assert_eq!(r["interfaces"][0]["name"], veth.as_str());
    assert!(r["interfaces"][0]["sandbox"].is_null());
    assert_eq!(
        r["interfaces"][1],
        json!({"name": "eth0", "mac": mac, "sandbox": ns.path(),
        "socketPath": d.dir.join(format!("run/vnics/{vnic}/control.sock"))})
    );
    assert_eq!(r["ips"], json!([{"address": format!("{}/15", addr(10)), "gateway": "198.18.0.1", "interface": 1}]));
    assert_eq!(r["routes"], json!([{"dst": "0.0.0.0/0", "gw": "198.18.0.1"}]));
    assert_eq!(r["dns"], json!({}));
    assert!(ip(&["-o", "link", "show", "dev", &veth]).unwrap().contains("master vrdma0"));
    assert!(ns.ip(&["-o", "-4", "addr", "show", "dev", "eth0"]).unwrap().contains(&format!("inet {}/15", addr(10))));
    assert!(ns.ip(&["-o", "link", "show", "dev", "eth0"]).unwrap().contains(&mac));
    assert!(ns.ip(&["route", "show", "default"]).unwrap().contains("via 198.18.0.1 dev eth0"));

    // CHECK with the result as prevResult.
    let check = attachment("CHECK", &cid, Some(&ns), "eth0", "", &with_prev(&conf, r));
    assert!(check.ok, "CHECK failed: {} {}", check.json, check.stderr);
    assert_eq!(check.json, Value::Null, "CHECK prints nothing on success");

    // A second ADD of the same attachment is an error, and changes nothing.
    let again = attachment("ADD", &cid, Some(&ns), "eth0", "", &conf);
    assert_eq!(again.code(), 105, "{}", again.json);
    assert!(attachment("CHECK", &cid, Some(&ns), "eth0", "", &with_prev(&conf, r)).ok);

    // The vNIC cannot be given to a second container.
    let before = d.vnics();
    let taken = attachment("ADD", &cid2, Some(&ns2), "eth0", "", &conf);
    assert_eq!(taken.code(), 104, "{}", taken.json);
    assert!(!host_link_exists(&host_veth(&cid2, "eth0")));
    assert_eq!(ns2.links(), ["lo"]);
    assert_eq!(d.vnics(), before);

    // CNI_ARGS VRDMA_VNIC picks the vNIC; a chained prevResult is passed through.
    let prev = json!({"cniVersion": "1.1.0", "interfaces": [{"name": "dummy0"}], "ips": [], "routes": [{"dst": "10.99.0.0/16"}], "dns": {"domain": "x"}});
    let conf2 = with_prev(&d.conf(json!({"defaultRoute": false})), &prev);
    let add2 = attachment("ADD", &cid2, Some(&ns2), "net1", &format!("IgnoreUnknown=1;VRDMA_VNIC={other}"), &conf2);
    assert!(add2.ok, "chained ADD: {} {}", add2.json, add2.stderr);
    let r2 = &add2.json;
    assert_eq!(r2["interfaces"].as_array().unwrap().len(), 3);
    assert_eq!(r2["interfaces"][0]["name"], "dummy0");
    assert_eq!(r2["ips"][0]["interface"], 2);
    assert_eq!(r2["routes"], json!([{"dst": "10.99.0.0/16"}, {"dst": "198.18.0.0/15"}]));
    assert_eq!(r2["dns"]["domain"], "x");
    assert!(!ns2.ip(&["route", "show"]).unwrap().contains("default"), "a secondary network adds no default route");
    let check2 = attachment(
        "CHECK",
        &cid2,
        Some(&ns2),
        "net1",
        &format!("VRDMA_VNIC={other}"),
        &with_prev(&d.conf(json!({"defaultRoute": false})), r2),
    );
    assert!(check2.ok, "CHECK of the chained attachment: {} {}", check2.json, check2.stderr);

    // DEL: gone, the named vNICs stay; DEL again and without a namespace succeed.
    let del = attachment("DEL", &cid, Some(&ns), "eth0", "", &with_prev(&conf, r));
    assert!(del.ok, "DEL: {} {}", del.json, del.stderr);
    assert!(!host_link_exists(&veth));
    assert_eq!(ns.links(), ["lo"]);
    assert!(d.vnics().iter().any(|(n, _)| *n == vnic));
    assert!(attachment("DEL", &cid, Some(&ns), "eth0", "", &with_prev(&conf, r)).ok, "second DEL");
    assert!(attachment("DEL", &cid, None, "eth0", "", &conf).ok, "DEL without CNI_NETNS or prevResult");
    let after = attachment("CHECK", &cid, Some(&ns), "eth0", "", &with_prev(&conf, r));
    assert_eq!(after.code(), 107, "CHECK after DEL");

    drop(ns2);
    let del2 = attachment("DEL", &cid2, None, "net1", &format!("VRDMA_VNIC={other}"), &conf2);
    assert!(del2.ok, "DEL after the namespace is gone: {}", del2.json);
    assert!(!host_link_exists(&host_veth(&cid2, "net1")));
    assert!(d.records().is_empty(), "{:?}", d.records());
}

#[test]
fn a_vnic_per_container_is_created_and_deleted() {
    if !prerequisites("a_vnic_per_container_is_created_and_deleted") {
        return;
    }
    let d = Daemon::start("percontainer");
    let ns = Netns::new("p");
    let cid = container_id("p");
    let conf = d.conf(json!({"tenant": "t2", "limits": {"maxQp": 8}, "cniVersion": "1.0.0"}));
    let args = format!("IP={}", addr(20));
    let add = attachment("ADD", &cid, Some(&ns), "eth0", &args, &conf);
    assert!(add.ok, "ADD: {} {}\n{}", add.json, add.stderr, d.log());
    assert_eq!(add.json["cniVersion"], "1.0.0");
    assert!(add.json["interfaces"][1].get("socketPath").is_none(), "socketPath is 1.1.0's");
    assert_eq!(add.json["ips"][0]["address"], format!("{}/15", addr(20)));
    let name = vrdma_cni::names::vnic(&cid, "eth0");
    let listed: Value = serde_json::from_str(&d.ok(&["vnic", "list", "--json"])).unwrap();
    let rec = listed.as_array().unwrap().iter().find(|e| e["vnic"]["name"] == name.as_str()).expect("the vNIC was created");
    assert_eq!((rec["vnic"]["tenant"].as_str(), rec["vnic"]["limits"]["max_qp"].as_u64()), (Some("t2"), Some(8)));
    assert!(attachment("CHECK", &cid, Some(&ns), "eth0", &args, &with_prev(&conf, &add.json)).ok);

    let del = attachment("DEL", &cid, Some(&ns), "eth0", &args, &with_prev(&conf, &add.json));
    assert!(del.ok, "DEL: {} {}", del.json, del.stderr);
    assert!(d.vnics().is_empty(), "the vNIC is deleted with the attachment: {:?}", d.vnics());
    assert_nothing_left(&d, &cid, &ns, &[], "after DEL");

    // A vNIC someone deleted already is no reason for DEL to fail.
    let add = attachment("ADD", &cid, Some(&ns), "eth0", &args, &conf);
    assert!(add.ok, "ADD again: {} {}", add.json, add.stderr);
    d.ok(&["vnic", "delete", &name]);
    let del = attachment("DEL", &cid, Some(&ns), "eth0", &args, &with_prev(&conf, &add.json));
    assert!(del.ok, "DEL of a deleted vNIC: {} {}", del.json, del.stderr);
    assert_nothing_left(&d, &cid, &ns, &[], "after DEL of a deleted vNIC");
}

#[test]
fn bad_input_gets_cni_error_codes_and_leaves_nothing_behind() {
    if !prerequisites("bad_input_gets_cni_error_codes_and_leaves_nothing_behind") {
        return;
    }
    let d = Daemon::start("bad");
    let vnic = vnic_name("c");
    d.create_vnic(&vnic, "t1", addr(30));
    let ns = Netns::new("c");
    let cid = container_id("c");
    let before = d.vnics();
    let named = d.conf(json!({"vnic": vnic}));
    let path = ns.path();
    let full = |cmd: &'static str| {
        vec![("CNI_COMMAND", cmd), ("CNI_CONTAINERID", cid.as_str()), ("CNI_NETNS", path.as_str()), ("CNI_IFNAME", "eth0")]
    };
    let without = |key: &str| full("ADD").into_iter().filter(|(k, _)| *k != key).collect::<Vec<_>>();

    let mut conf_without_name = named.clone();
    conf_without_name.as_object_mut().unwrap().remove("name");
    let mut bad_version = named.clone();
    bad_version["cniVersion"] = json!("0.2.0");
    let mut no_version = named.clone();
    no_version.as_object_mut().unwrap().remove("cniVersion");
    let tenant_bad_ip = d.conf(json!({"tenant": "t2"}));
    let cases: Vec<(&str, Answer, u64)> = vec![
        ("no CNI_COMMAND", invoke(&without("CNI_COMMAND"), &named), 4),
        ("no CNI_CONTAINERID", invoke(&without("CNI_CONTAINERID"), &named), 4),
        ("no CNI_NETNS", invoke(&without("CNI_NETNS"), &named), 4),
        ("no CNI_IFNAME", invoke(&without("CNI_IFNAME"), &named), 4),
        ("bad CNI_IFNAME", attachment("ADD", &cid, Some(&ns), "eth0:1", "", &named), 4),
        ("unknown command", invoke(&full("FROB"), &named), 4),
        ("not JSON", invoke(&full("ADD"), &json!("{")), 6),
        ("no name", invoke(&full("ADD"), &conf_without_name), 7),
        ("cniVersion 0.2.0", invoke(&full("ADD"), &bad_version), 1),
        ("no cniVersion", invoke(&full("ADD"), &no_version), 1),
        ("ipam", invoke(&full("ADD"), &d.conf(json!({"vnic": vnic, "ipam": {"type": "host-local"}}))), 2),
        ("neither vnic nor tenant", invoke(&full("ADD"), &d.conf(json!({}))), 7),
        ("unknown vNIC", invoke(&full("ADD"), &d.conf(json!({"vnic": "cninosuchvnic"}))), 101),
        ("wrong tenant", invoke(&full("ADD"), &d.conf(json!({"vnic": vnic, "tenant": "t9"}))), 102),
        ("address not the vNIC's", attachment("ADD", &cid, Some(&ns), "eth0", &format!("IP={}", addr(31)), &named), 7),
        ("vrdmad not running", invoke(&full("ADD"), &d.conf(json!({"vnic": vnic, "adminSocket": "/nonexistent/admin.sock"}))), 11),
        ("vrdmad refuses the create", attachment("ADD", &cid, Some(&ns), "eth0", "IP=10.1.2.3", &tenant_bad_ip), 100),
        ("a created vNIC, then the bridge fails", invoke(&full("ADD"), &d.conf(json!({"tenant": "t2", "bridge": "lo"}))), 106),
        ("a named vNIC, then the bridge fails", invoke(&full("ADD"), &d.conf(json!({"vnic": vnic, "bridge": "lo"}))), 106),
        ("CHECK without prevResult", invoke(&full("CHECK"), &named), 7),
        (
            "CHECK of nothing",
            invoke(&full("CHECK"), &with_prev(&named, &json!({"interfaces": [{"name": "eth0", "sandbox": path}], "ips": []}))),
            107,
        ),
    ];
    for (case, answer, code) in cases {
        assert_eq!(answer.code(), code, "{case}: {} {}", answer.json, answer.stderr);
        assert_nothing_left(&d, &cid, &ns, &before, case);
    }

    // A namespace that is not there, and an interface that already is.
    let gone = invoke(
        &[("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", &cid), ("CNI_NETNS", "/run/netns/cni-no-such-ns"), ("CNI_IFNAME", "eth0")],
        &named,
    );
    assert_eq!(gone.code(), 3, "{}", gone.json);
    ns.ip(&["link", "add", "eth0", "type", "bridge"]).unwrap();
    let exists = attachment("ADD", &cid, Some(&ns), "eth0", "", &named);
    assert_eq!(exists.code(), 105, "{}", exists.json);
    ns.ip(&["link", "del", "eth0"]).unwrap();
    assert_nothing_left(&d, &cid, &ns, &before, "existing interface");
}

#[test]
fn del_and_add_clean_up_after_an_add_that_died() {
    if !prerequisites("del_and_add_clean_up_after_an_add_that_died") {
        return;
    }
    let d = Daemon::start("crash");
    let ns = Netns::new("d");
    let cid = container_id("d");
    let conf = d.conf(json!({"tenant": "t3"}));
    let args = format!("IP={}", addr(40));
    let record = d.state_dir().join(format!("vrdma-test/{cid}:eth0.json"));

    // Died after creating everything but before recording it: DEL finds veth and vNIC by
    // their derived names.
    assert!(attachment("ADD", &cid, Some(&ns), "eth0", &args, &conf).ok);
    std::fs::remove_file(&record).unwrap();
    let del = attachment("DEL", &cid, Some(&ns), "eth0", &args, &conf);
    assert!(del.ok, "{}", del.json);
    assert_nothing_left(&d, &cid, &ns, &[], "DEL without a record");

    // Died half way (record incomplete): a new ADD clears the remains and succeeds.
    assert!(attachment("ADD", &cid, Some(&ns), "eth0", &args, &conf).ok);
    let mut r: Value = serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    r["complete"] = json!(false);
    std::fs::write(&record, r.to_string()).unwrap();
    ns.ip(&["link", "del", "eth0"]).unwrap(); // as if it died before plumbing
    let add = attachment("ADD", &cid, Some(&ns), "eth0", &args, &conf);
    assert!(add.ok, "ADD after a dead ADD: {} {}", add.json, add.stderr);
    assert!(attachment("CHECK", &cid, Some(&ns), "eth0", &args, &with_prev(&conf, &add.json)).ok);
    assert!(attachment("DEL", &cid, Some(&ns), "eth0", &args, &conf).ok);
    assert_nothing_left(&d, &cid, &ns, &[], "after the retried ADD");
}

#[test]
fn gc_removes_stale_attachments_and_status_reports_the_daemon() {
    if !prerequisites("gc_removes_stale_attachments_and_status_reports_the_daemon") {
        return;
    }
    let d = Daemon::start("gc");
    let (ns1, ns2) = (Netns::new("g1"), Netns::new("g2"));
    let (c1, c2) = (container_id("g1"), container_id("g2"));
    let conf = d.conf(json!({"tenant": "t4"}));
    assert!(attachment("ADD", &c1, Some(&ns1), "eth0", &format!("IP={}", addr(50)), &conf).ok);
    assert!(attachment("ADD", &c2, Some(&ns2), "eth0", &format!("IP={}", addr(51)), &conf).ok);
    assert_eq!(d.vnics().len(), 2);

    assert!(invoke(&[("CNI_COMMAND", "STATUS")], &conf).ok, "STATUS with vrdmad up");
    let down = invoke(&[("CNI_COMMAND", "STATUS")], &d.conf(json!({"adminSocket": "/nonexistent/admin.sock"})));
    assert_eq!(down.code(), 50);

    let mut gc = conf.clone();
    gc["cni.dev/valid-attachments"] = json!([{"containerID": c1, "ifname": "eth0"}]);
    let answer = invoke(&[("CNI_COMMAND", "GC")], &gc);
    assert!(answer.ok, "GC: {} {}", answer.json, answer.stderr);
    assert!(host_link_exists(&host_veth(&c1, "eth0")), "a valid attachment stays");
    assert!(!host_link_exists(&host_veth(&c2, "eth0")), "a stale one goes");
    assert_eq!(d.vnics().into_iter().map(|(n, _)| n).collect::<Vec<_>>(), [vrdma_cni::names::vnic(&c1, "eth0")]);
    assert_eq!(ns2.links(), ["lo"]);
    let mut old = gc.clone();
    old["cniVersion"] = json!("1.0.0");
    assert_eq!(invoke(&[("CNI_COMMAND", "GC")], &old).code(), 1, "GC is 1.1.0's");
    assert!(attachment("DEL", &c1, Some(&ns1), "eth0", "", &conf).ok);
    assert!(d.vnics().is_empty());
}

#[test]
fn concurrent_adds_give_a_vnic_to_one_container() {
    if !prerequisites("concurrent_adds_give_a_vnic_to_one_container") {
        return;
    }
    let d = Daemon::start("race");
    let vnic = vnic_name("r");
    d.create_vnic(&vnic, "t6", addr(90));
    let conf = d.conf(json!({"vnic": vnic}));
    let tags = ["r1", "r2", "r3", "r4"];
    let namespaces: Vec<Netns> = tags.iter().map(|t| Netns::new(t)).collect();
    let answers: Vec<(String, Answer)> = std::thread::scope(|s| {
        let runs: Vec<_> = tags
            .iter()
            .zip(&namespaces)
            .map(|(t, ns)| {
                let conf = &conf;
                s.spawn(move || (container_id(t), attachment("ADD", &container_id(t), Some(ns), "eth0", "", conf)))
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let winners: Vec<&String> = answers.iter().filter(|(_, a)| a.ok).map(|(c, _)| c).collect();
    assert_eq!(winners.len(), 1, "exactly one ADD may have the vNIC: {answers:?}");
    for (cid, a) in &answers {
        if !a.ok {
            assert_eq!(a.code(), 104, "{}", a.json);
            assert!(!host_link_exists(&host_veth(cid, "eth0")));
        }
    }
    assert!(attachment("DEL", winners[0], None, "eth0", "", &conf).ok);
    assert!(d.records().is_empty(), "{:?}", d.records());
}

#[test]
fn a_vnic_whose_container_went_without_del_can_be_attached_again() {
    if !prerequisites("a_vnic_whose_container_went_without_del_can_be_attached_again") {
        return;
    }
    let d = Daemon::start("gone");
    let vnic = vnic_name("w");
    d.create_vnic(&vnic, "t7", addr(95));
    let conf = d.conf(json!({"vnic": vnic}));
    let (c1, c2) = (container_id("w1"), container_id("w2"));
    let ns2 = Netns::new("w2");
    {
        let ns1 = Netns::new("w1");
        assert!(attachment("ADD", &c1, Some(&ns1), "eth0", "", &conf).ok);
        let busy = attachment("ADD", &c2, Some(&ns2), "eth0", "", &conf);
        assert_eq!(busy.code(), 104, "taken while its container lives: {}", busy.json);
        // The container goes, its runtime killed before DEL: only its namespace is gone.
    }
    let add = attachment("ADD", &c2, Some(&ns2), "eth0", "", &conf);
    assert!(add.ok, "the vNIC of a container that went without DEL: {} {}", add.json, add.stderr);
    assert!(add.stderr.contains("network namespace is gone"), "{}", add.stderr);
    assert!(!host_link_exists(&host_veth(&c1, "eth0")));
    assert!(attachment("CHECK", &c2, Some(&ns2), "eth0", "", &with_prev(&conf, &add.json)).ok);
    assert!(attachment("DEL", &c2, Some(&ns2), "eth0", "", &conf).ok);
    assert!(d.records().is_empty(), "{:?}", d.records());
    assert_eq!(ns2.links(), ["lo"]);
}
