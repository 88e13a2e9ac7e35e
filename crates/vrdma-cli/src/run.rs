//! `vrdma run`: a command in its own network, mount, PID and UTS namespaces with its vNIC.

use anyhow::{anyhow, Context as _};
use std::net::Ipv4Addr;

use crate::admin;

/// Host bridge of the container network.
pub const BRIDGE: &str = "vrdma0";

/// Runs `cmd` in a container with `vnic`; returns its exit code.
pub fn run(vnic: &str, cmd: Vec<String>, extra_env: Vec<(String, String)>) -> anyhow::Result<i32> {
    let list = admin::call(serde_json::json!({"op": "list"}))?;
    let v = list["vnics"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["vnic"]["name"] == vnic)
        .ok_or_else(|| anyhow!("no vNIC named {vnic} (see `vrdma vnic list`)"))?;
    if v["local"] == false {
        let host = v["vnic"]["host"].as_str().unwrap_or("?");
        return Err(anyhow!("vNIC {vnic} is served by host {host}: run the container there (or `vrdma vnic move {vnic} --host HOST`)"));
    }
    let ip: Ipv4Addr = v["vnic"]["ip"].as_str().unwrap_or_default().parse().context("vNIC address")?;
    let prefix_len = v["vnic"]["prefix_len"].as_u64().unwrap_or(15) as u8;
    let dir = v["dir"].as_str().ok_or_else(|| anyhow!("vNIC has no directory"))?.into();
    let net = admin::call(serde_json::json!({"op": "network"}))?;
    let gateway: Ipv4Addr = net["gateway"].as_str().unwrap_or_default().parse().context("gateway")?;
    vrdma_netns::ensure_bridge(BRIDGE, gateway, prefix_len)?;
    let mut env = vec![("VRDMA_SOCKET".to_string(), "/run/vrdma/control.sock".to_string()), ("VRDMA_VNIC".to_string(), vnic.to_string())];
    // The drop-in libibverbs lives next to the vrdma binary's lib directory, if installed.
    if let Some(libdir) = drop_in_dir() {
        let old = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        env.push(("LD_LIBRARY_PATH".into(), if old.is_empty() { libdir } else { format!("{libdir}:{old}") }));
    }
    env.extend(extra_env);
    let state_dir = std::env::var("VRDMA_STATE_DIR").unwrap_or_else(|_| "/var/lib/vrdma".into());
    let spec = vrdma_netns::ContainerSpec {
        name: vnic.to_string(),
        vnic_dir: dir,
        ip,
        prefix_len,
        gateway,
        bridge: BRIDGE.into(),
        command: cmd,
        env,
        hide_paths: vec![state_dir.into()],
        verbs_devices: vec![vrdma::verbs_device_name(vnic)],
    };
    Ok(vrdma_netns::run_container(&spec)?)
}

fn drop_in_dir() -> Option<String> {
    if let Ok(d) = std::env::var("VRDMA_LIB_DIR") {
        return Some(d);
    }
    let exe = std::env::current_exe().ok()?;
    let d = exe.parent()?.parent()?.join("lib").join("vrdma");
    d.join("libibverbs.so.1").exists().then(|| d.display().to_string())
}
