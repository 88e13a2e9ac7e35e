//! `vrdma run`: a command in its own network, mount, PID and UTS namespaces with its vNIC,
//! sandboxed (docs/security.md, "Containers (vrdma run)"). What the container gets of vrdma is
//! its vNIC's CDI edits (`vrdma_cdi::edits_for`, what podman & co. apply), its network the CNI
//! plugin's plumbing (`vrdma_netns::attach`).

use anyhow::{anyhow, Context as _};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use crate::admin;

/// Host bridge of the container network.
pub(crate) const BRIDGE: &str = "vrdma0";

/// The sandbox's flags of `vrdma run`; every loosening is explicit.
#[derive(clap::Args, Debug)]
pub(crate) struct SandboxArgs {
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
    /// No user namespace: root inside is root on the host (without capabilities). By
    /// default the command runs in one where the kernel allows it: root inside is an
    /// unprivileged uid (1000000) on the host, and host files show as owned by `nobody`.
    #[arg(long, conflicts_with = "userns")]
    no_userns: bool,
    /// A user namespace (the default; kept for scripts that ask for it).
    #[arg(long, hide = true)]
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
    pub(crate) fn into_sandbox(self) -> anyhow::Result<vrdma_netns::Sandbox> {
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
        let userns = !self.no_userns && !self.privileged && vrdma_netns::sandbox::userns_available();
        if self.userns && !userns {
            return Err(anyhow!("--userns: this kernel offers no user namespaces (user.max_user_namespaces is 0)"));
        }
        if !self.no_userns && !self.privileged && !userns {
            eprintln!("vrdma run: no user namespaces on this kernel: root inside is root on the host (without capabilities)");
        }
        Ok(vrdma_netns::Sandbox {
            enabled: !self.privileged,
            cap_add: self.cap_add,
            writable: self.writable,
            private_tmp: self.private_tmp,
            userns,
            limits: vrdma_netns::Limits { pids: (self.pids_limit > 0).then_some(self.pids_limit), memory, cpu_millis },
        })
    }
}

/// Runs `cmd` in a container with `vnic`; returns its exit code.
pub(crate) fn run(vnic: &str, cmd: Vec<String>, extra_env: Vec<(String, String)>, sandbox: vrdma_netns::Sandbox) -> anyhow::Result<i32> {
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
    let dir: PathBuf = v["dir"].as_str().ok_or_else(|| anyhow!("vNIC has no directory"))?.into();
    let net = admin::call(serde_json::json!({"op": "network"}))?;
    let gateway: Ipv4Addr = net["gateway"].as_str().unwrap_or_default().parse().context("gateway")?;
    vrdma_netns::ensure_bridge(BRIDGE, gateway, prefix_len)?;
    // What the container gets is its CDI device's edits, as podman & co. apply them.
    let device = vrdma_cdi::VnicDevice { name: vnic.to_string(), dir };
    let dropin = vrdma_cdi::find_dropin(std::env::current_exe().ok().as_deref());
    let edits = vrdma_cdi::edits_for(&device, dropin.as_ref());
    let lib_mounted = vrdma_netns::lib_dir_is_mounted(&sandbox);
    let mut applied = apply_edits(&edits, std::env::var("LD_LIBRARY_PATH").ok(), lib_mounted)?;
    // UCX tuning the caller chose otherwise stays the caller's.
    applied.env.retain(|(k, _)| !(vrdma_cdi::UCX_TUNING.iter().any(|(t, _)| t == k) && std::env::var_os(k).is_some()));
    applied.env.extend(extra_env);
    let state_dir = std::env::var("VRDMA_STATE_DIR").unwrap_or_else(|_| "/var/lib/vrdma".into());
    let spec = vrdma_netns::ContainerSpec {
        name: vnic.to_string(),
        vnic_dir: applied.vnic_dir,
        ip,
        prefix_len,
        gateway,
        bridge: BRIDGE.into(),
        command: cmd,
        env: applied.env,
        // vrdmad's state, and its run directory with admin.sock and every vNIC's socket
        // (covered wherever it is: a socket stays connectable on a read-only mount).
        hide_paths: vec![state_dir.into(), vrdmad::admin_client::run_dir()],
        verbs_devices: applied.verbs_devices,
        lib_dir: applied.lib_dir,
        sandbox,
    };
    Ok(vrdma_netns::run_container(&spec)?)
}

/// A CDI device's edits as `vrdma run`'s container takes them.
#[derive(Debug, PartialEq, Eq)]
struct Applied {
    /// The mount at /run/vrdma.
    vnic_dir: PathBuf,
    /// The nodes in /dev/infiniband (the sandbox makes them null devices, as the edits do).
    verbs_devices: Vec<String>,
    /// The edits' environment, in order.
    env: Vec<(String, String)>,
    /// The drop-in's host directory.
    lib_dir: Option<PathBuf>,
}

/// Maps `edits` onto [`vrdma_netns::ContainerSpec`]'s fields; an edit it cannot express is
/// an error, so the CDI spec and `vrdma run` cannot drift apart unnoticed. One difference
/// is deliberate: the container sees the host's tree (read-only), so the drop-in is used
/// where it is on the host, its directory replacing [`vrdma_cdi::CONTAINER_LIB_DIR`] on
/// `LD_LIBRARY_PATH` (or, `lib_mounted`, the sandbox's [`vrdma_netns::CONTAINER_LIB_MOUNT`],
/// where the sandbox binds that directory), and the caller's `LD_LIBRARY_PATH`
/// (`caller_ld_path`) follows it.
fn apply_edits(edits: &vrdma_cdi::ContainerEdits, caller_ld_path: Option<String>, lib_mounted: bool) -> anyhow::Result<Applied> {
    let lib_mount = format!("{}/{}", vrdma_cdi::CONTAINER_LIB_DIR, vrdma_cdi::DROPIN_FILE);
    let (mut vnic_dir, mut lib_dir) = (None, None);
    for m in &edits.mounts {
        if m.container_path == vrdma_cdi::CONTAINER_VNIC_DIR {
            vnic_dir = Some(PathBuf::from(&m.host_path));
        } else if m.container_path == lib_mount {
            let dir = Path::new(&m.host_path).parent().ok_or_else(|| anyhow!("drop-in {} has no directory", m.host_path))?;
            lib_dir = Some(dir.to_path_buf());
        } else {
            return Err(anyhow!("the vNIC's CDI edits mount {} at {}, which vrdma run cannot do", m.host_path, m.container_path));
        }
    }
    let vnic_dir = vnic_dir.ok_or_else(|| anyhow!("the vNIC's CDI edits mount no directory at {}", vrdma_cdi::CONTAINER_VNIC_DIR))?;
    let mut verbs_devices = Vec::new();
    for n in &edits.device_nodes {
        let name = n.path.strip_prefix("/dev/infiniband/");
        let null = n.host_path.as_deref() == Some("/dev/null") && n.major == Some(1) && n.minor == Some(3);
        match name {
            Some(name) if null => verbs_devices.push(name.to_string()),
            _ => return Err(anyhow!("the vNIC's CDI edits make device node {}, which vrdma run cannot", n.path)),
        }
    }
    let mut env = Vec::new();
    for e in &edits.env {
        let (k, v) = e.split_once('=').ok_or_else(|| anyhow!("CDI environment entry {e:?} has no '='"))?;
        let v = if k == "LD_LIBRARY_PATH" {
            let ours = v.split(':').map(|p| match &lib_dir {
                Some(_) if p == vrdma_cdi::CONTAINER_LIB_DIR && lib_mounted => vrdma_netns::CONTAINER_LIB_MOUNT.to_string(),
                Some(d) if p == vrdma_cdi::CONTAINER_LIB_DIR => d.display().to_string(),
                _ => p.to_string(),
            });
            let caller = caller_ld_path.as_deref().filter(|p| !p.is_empty());
            ours.chain(caller.map(str::to_string)).collect::<Vec<_>>().join(":")
        } else {
            v.to_string()
        };
        env.push((k.to_string(), v));
    }
    Ok(Applied { vnic_dir, verbs_devices, env, lib_dir })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(dropin: Option<&str>) -> vrdma_cdi::ContainerEdits {
        let vnic = vrdma_cdi::VnicDevice { name: "va".into(), dir: "/run/vrdma/vnics/va".into() };
        vrdma_cdi::edits_for(&vnic, dropin.map(|p| vrdma_cdi::DropIn { path: p.into() }).as_ref())
    }

    #[test]
    fn the_cdi_edits_give_what_vrdma_run_gave() {
        let a = apply_edits(&device(Some("/usr/local/lib/vrdma/libibverbs.so.1")), Some("/x".into()), false).unwrap();
        assert_eq!(a.vnic_dir, PathBuf::from("/run/vrdma/vnics/va"));
        assert_eq!(a.verbs_devices, vec![vrdma::verbs_device_name("va")]);
        let env = |k: &str| a.env.iter().find(|(ek, _)| ek == k).map(|(_, v)| v.as_str());
        assert_eq!(env("VRDMA_SOCKET"), Some("/run/vrdma/control.sock"));
        assert_eq!(env("VRDMA_VNIC"), Some("va"));
        assert_eq!(env("LD_LIBRARY_PATH"), Some("/usr/local/lib/vrdma:/x"));
        let plain = apply_edits(&device(Some("/l/libibverbs.so.1")), None, false).unwrap();
        assert!(plain.env.contains(&("LD_LIBRARY_PATH".into(), "/l".into())));
        assert_eq!(plain.lib_dir, Some(PathBuf::from("/l")));
        // Where the sandbox binds the drop-in's directory, the path is the mount's.
        let bound = apply_edits(&device(Some("/l/libibverbs.so.1")), Some("/x".into()), true).unwrap();
        assert!(bound.env.contains(&("LD_LIBRARY_PATH".into(), format!("{}:/x", vrdma_netns::CONTAINER_LIB_MOUNT))));
        // No drop-in: the caller's library path is left alone.
        assert!(apply_edits(&device(None), Some("/x".into()), false).unwrap().env.iter().all(|(k, _)| k != "LD_LIBRARY_PATH"));
    }

    #[test]
    fn an_edit_vrdma_run_cannot_make_is_refused() {
        let mut e = device(None);
        e.mounts.push(vrdma_cdi::Mount { host_path: "/etc".into(), container_path: "/etc2".into(), options: vec![] });
        assert!(apply_edits(&e, None, false).is_err());
        let mut e = device(None);
        e.device_nodes[0].host_path = Some("/dev/sda".into());
        assert!(apply_edits(&e, None, false).is_err());
    }
}
