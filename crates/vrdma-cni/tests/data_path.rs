//! Two network namespaces attached by the plugin reach each other with their vNICs'
//! addresses: `vrdma check` (SEND/RECV, WRITE, READ, atomics, every byte verified) between
//! them, its out-of-band exchange over the plugin's interfaces. Needs root.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::json;

#[test]
fn two_attached_namespaces_run_vrdma_check() {
    if !prerequisites("two_attached_namespaces_run_vrdma_check") {
        return;
    }
    let d = Daemon::start("data");
    let (server_vnic, client_vnic) = (vnic_name("s"), vnic_name("k"));
    d.create_vnic(&server_vnic, "t5", addr(60));
    d.create_vnic(&client_vnic, "t5", addr(61));
    let (ns_s, ns_c) = (Netns::new("s"), Netns::new("k"));
    let (cs, cc) = (container_id("s"), container_id("k"));
    let conf = d.conf(json!({"vnicArg": "K8S_POD_NAME"}));
    for (cid, ns, vnic) in [(&cs, &ns_s, &server_vnic), (&cc, &ns_c, &client_vnic)] {
        let add = attachment("ADD", cid, Some(ns), "eth0", &format!("IgnoreUnknown=1;K8S_POD_NAME={vnic}"), &conf);
        assert!(add.ok, "ADD {vnic}: {} {}", add.json, add.stderr);
    }
    let socket = |vnic: &str| d.dir.join(format!("run/vnics/{vnic}/control.sock"));
    let vrdma = sibling_binary("vrdma");
    let in_netns = |ns: &Netns, vnic: &str, args: &[String]| {
        let mut c = Command::new("/usr/sbin/ip");
        c.args(["netns", "exec", &ns.name]).arg(&vrdma).args(args).env("VRDMA_SOCKET", socket(vnic));
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    };
    let server = in_netns(&ns_s, &server_vnic, &["check".into()]).spawn().unwrap();
    // The client retries its out-of-band connection until the server listens.
    std::thread::sleep(Duration::from_millis(300));
    let client = in_netns(&ns_c, &client_vnic, &["check".into(), addr(60).to_string()]).spawn().unwrap();
    let c = wait(client, Duration::from_secs(60));
    let s = wait(server, Duration::from_secs(10));
    assert!(c.0 && s.0, "vrdma check failed\nclient: {}\nserver: {}\nvrdmad: {}", c.1, s.1, d.log());
    eprintln!("ok: vrdma check from {} to {}:\n{}", addr(61), addr(60), c.1.trim());

    for (cid, ns) in [(&cs, &ns_s), (&cc, &ns_c)] {
        assert!(attachment("DEL", cid, Some(ns), "eth0", "", &conf).ok);
        assert!(!host_link_exists(&host_veth(cid, "eth0")));
    }
}

fn wait(mut c: std::process::Child, limit: Duration) -> (bool, String) {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if c.try_wait().unwrap().is_some() {
            let o = c.wait_with_output().unwrap();
            return (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)));
        }
        if std::time::Instant::now() > deadline {
            let _ = c.kill();
            let o = c.wait_with_output().unwrap();
            return (false, format!("TIMED OUT\n{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
