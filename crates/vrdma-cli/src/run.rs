//! `vrdma run`: a command in its own network, mount, PID and UTS namespaces with its vNIC,
//! sandboxed (docs/security.md, "Containers (vrdma run)").

use anyhow::{anyhow, Context as _};
use std::net::Ipv4Addr;

use crate::admin;

/// Host bridge of the container network.
pub const BRIDGE: &str = "vrdma0";

/// The sandbox's flags of `vrdma run`; every loosening is explicit.
#[derive(clap::Args, Debug)]
pub struct SandboxArgs {
    /// Keep this capability (e.g. NET_RAW for ping, SYS_PTRACE for a debugger); repeatable.
    /// By default the command has none, even as root.
    #[arg(long = "cap-add", value_name = "CAP")]
    cap_add: Vec<String>,
    /// Leave the host's filesystem writable, and /tmp, /var/tmp and /run the host's (for
    /// trusted use).
    #[arg(long)]
    writable: bool,
    /// /tmp an empty private tmpfs (by default the host's /tmp shows through beneath a
    /// private writable layer: programs built there run, nothing written reaches the host).
    #[arg(long)]
    private_tmp: bool,
    /// Run in a user namespace: root inside is an unprivileged uid (1000000) on the host.
    #[arg(long)]
    userns: bool,
    /// No sandbox at all: every capability, no seccomp, the host's /dev, a writable host
    /// filesystem, no limits (the behaviour before the sandbox; trusted use only).
    #[arg(long)]
    privileged: bool,
    /// Most processes and threads at once (0: unlimited).
    #[arg(long, value_name = "N", default_value_t = vrdma_netns::sandbox::DEFAULT_PIDS_LIMIT)]
    pids_limit: u64,
    /// Most memory (e.g. 512M, 4G; 0: unlimited); swap is off. Default: half the host's RAM.
    #[arg(long, value_name = "BYTES")]
    memory: Option<String>,
    /// CPU time as a number of CPUs (e.g. 1.5). Default: unlimited.
    #[arg(long, value_name = "N")]
    cpus: Option<f64>,
}

impl SandboxArgs {
    pub fn into_sandbox(self) -> anyhow::Result<vrdma_netns::Sandbox> {
        let memory = match self.memory.as_deref() {
            None => vrdma_netns::sandbox::half_of_ram(),
            Some("0") | Some("unlimited") => None,
            Some(m) => Some(vrdma_netns::parse_size(m).ok_or_else(|| anyhow!("--memory {m}: expected a size such as 512M or 4G"))?),
        };
        let cpu_millis = match self.cpus {
            None => None,
            Some(c) if c.is_finite() && c > 0.0 => Some((c * 1000.0).round() as u64),
            Some(c) => return Err(anyhow!("--cpus {c}: expected a positive number")),
        };
        Ok(vrdma_netns::Sandbox {
            enabled: !self.privileged,
            cap_add: self.cap_add,
            writable: self.writable,
            private_tmp: self.private_tmp,
            userns: self.userns,
            limits: vrdma_netns::Limits { pids: (self.pids_limit > 0).then_some(self.pids_limit), memory, cpu_millis },
        })
    }
}

/// Runs `cmd` in a container with `vnic`; returns its exit code.
pub fn run(vnic: &str, cmd: Vec<String>, extra_env: Vec<(String, String)>, sandbox: vrdma_netns::Sandbox) -> anyhow::Result<i32> {
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
        // vrdmad's state, and its run directory with admin.sock and every vNIC's socket
        // (covered wherever it is: a socket stays connectable on a read-only mount).
        hide_paths: vec![state_dir.into(), vrdmad::admin_client::run_dir()],
        verbs_devices: vec![vrdma::verbs_device_name(vnic)],
        sandbox,
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
