//! vrdma-device-plugin: thin binary over the `vrdma_device_plugin` library.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use vrdma_device_plugin::edits::{ContainerPaths, EditForms};
use vrdma_device_plugin::plugin::{Plugin, PluginConfig};
use vrdma_device_plugin::server::{run, ServerConfig};
use vrdma_device_plugin::slots::{SlotNames, SlotSource};
use vrdma_device_plugin::tenant::{read_map, TenantPolicy, TenantSource};
use vrdma_device_plugin::{api, edits};

/// Kubernetes device plugin advertising vrdma vNICs (`vrdma.io/vnic`).
#[derive(Parser)]
#[command(version, about)]
struct Args {
    /// vNIC slots this node offers.
    #[arg(long, default_value_t = 16, env = "VRDMA_DP_SLOTS")]
    slots: u32,
    /// File holding the number of slots, re-read while running (e.g. a mounted ConfigMap);
    /// --slots while it is missing.
    #[arg(long, env = "VRDMA_DP_SLOTS_FILE")]
    slots_file: Option<PathBuf>,
    /// This node's name (the slots' device IDs and vNIC names are k8s-<node>-<index>).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// The kubelet's device plugin directory.
    #[arg(long, default_value = api::DEVICE_PLUGIN_PATH)]
    plugin_dir: PathBuf,
    /// The kubelet's registration socket (default: kubelet.sock in --plugin-dir).
    #[arg(long)]
    kubelet_socket: Option<PathBuf>,
    /// This plugin's socket name in --plugin-dir.
    #[arg(long, default_value = "vrdma-vnic.sock")]
    endpoint: String,
    /// vrdmad's run directory (its admin socket and the vNIC directories).
    #[arg(long, default_value = "/run/vrdma", env = "VRDMA_RUN_DIR")]
    run_dir: PathBuf,
    /// The directory of vrdma's drop-in libibverbs.so.1 on the host (as vrdmad's
    /// VRDMA_LIB_DIR, so the fallback mounts what its CDI spec mounts).
    #[arg(long, default_value = "/usr/local/lib/vrdma", env = "VRDMA_LIB_DIR")]
    lib_dir: PathBuf,
    /// What Allocate answers with: `cdi` (CDI device names, Kubernetes >= 1.31 with a
    /// CDI-enabled runtime), `mounts` (mounts, environment, device nodes: any kubelet), or both.
    #[arg(long, value_delimiter = ',', default_value = "cdi")]
    edits: Vec<Edits>,
    /// Tenant of the pods' vNICs, where --tenant-from gives none.
    #[arg(long, default_value = "default")]
    tenant: String,
    /// Where a pod's tenant comes from: `default` (--tenant), `namespace`, or `map` (the
    /// JSON object namespace -> tenant in --tenant-map).
    #[arg(long, default_value = "default")]
    tenant_from: TenantFrom,
    /// The namespace -> tenant map for --tenant-from map.
    #[arg(long)]
    tenant_map: Option<PathBuf>,
    /// vrdmad's CDI spec directory (its --cdi-dir): with --edits cdi, Allocate answers once
    /// the spec there lists the vNIC; `none`: no wait.
    #[arg(long, default_value = vrdma_cdi::DEFAULT_SPEC_DIR)]
    cdi_dir: PathBuf,
    /// The kubelet's pod resources socket (which pod holds a device: --tenant-from namespace
    /// and map need it).
    #[arg(long, default_value = api::podresources::SOCKET)]
    pod_resources_socket: PathBuf,
    /// Milliseconds between deletions of the vNICs of ended pods (the slots no pod holds in
    /// the kubelet's pod resources API); 0: never.
    #[arg(long, default_value_t = 30_000)]
    gc_interval_ms: u64,
    /// Milliseconds between looks at vrdmad, the slot count and the kubelet's socket.
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Edits {
    Cdi,
    Mounts,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum TenantFrom {
    Default,
    Namespace,
    Map,
}

fn config(a: &Args) -> anyhow::Result<(PluginConfig, ServerConfig)> {
    let node = match &a.node_name {
        Some(n) => n.clone(),
        None => std::fs::read_to_string("/proc/sys/kernel/hostname").context("this node's name (give --node-name)")?.trim().to_string(),
    };
    let slots = match &a.slots_file {
        Some(path) => SlotSource::File { path: path.clone(), fallback: a.slots },
        None => SlotSource::Fixed(a.slots),
    };
    let source = match a.tenant_from {
        TenantFrom::Default => TenantSource::Default,
        TenantFrom::Namespace => TenantSource::Namespace,
        TenantFrom::Map => {
            let path = a.tenant_map.as_ref().context("--tenant-from map needs --tenant-map FILE")?;
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            TenantSource::NamespaceMap(read_map(&text).with_context(|| format!("{}: not a JSON object of strings", path.display()))?)
        }
    };
    let plugin = PluginConfig {
        resource_name: edits::CDI_KIND.into(),
        slots,
        names: SlotNames::new(&node),
        tenants: TenantPolicy { source, default: a.tenant.clone() },
        // Absolute: the kubelet resolves the fallback's host paths from its own directory.
        paths: ContainerPaths { run_dir: std::path::absolute(&a.run_dir)?, lib_dir: std::path::absolute(&a.lib_dir)? },
        forms: EditForms { cdi: a.edits.contains(&Edits::Cdi), mounts: a.edits.contains(&Edits::Mounts) },
        pod_resources: a.pod_resources_socket.clone(),
        cdi_dir: (a.cdi_dir.as_os_str() != "none").then(|| a.cdi_dir.clone()),
    };
    let server = ServerConfig {
        kubelet_socket: a.kubelet_socket.clone().unwrap_or_else(|| a.plugin_dir.join(api::KUBELET_SOCKET)),
        plugin_dir: a.plugin_dir.clone(),
        endpoint: a.endpoint.clone(),
        interval: Duration::from_millis(a.interval_ms.max(10)),
        gc_interval: (a.gc_interval_ms > 0).then(|| Duration::from_millis(a.gc_interval_ms)),
    };
    Ok((plugin, server))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = Args::parse();
    let (plugin_cfg, server_cfg) = config(&args)?;
    let plugin = Plugin::new(plugin_cfg);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let stop = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    };
    run(plugin, server_cfg, stop).await?;
    Ok(())
}
