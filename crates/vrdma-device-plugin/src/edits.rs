//! What a container with a vNIC gets, as the kubelet's `ContainerAllocateResponse`: the CDI
//! device name, and the same edits spelled as mounts, environment and device nodes for
//! kubelets or runtimes without CDI.
//!
//! The fallback is this one function over [`ContainerEdits`], the single description of what
//! a container gets, so that it can come from the CDI spec's own containerEdits.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::api;

/// The CDI kind of vrdma's devices.
pub const CDI_KIND: &str = "vrdma.io/vnic";

/// Where things are on the host and in the container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerPaths {
    /// vrdmad's run directory on the host (the vNIC directories are under `vnics/`).
    pub run_dir: PathBuf,
    /// vrdma's drop-in libraries on the host.
    pub lib_dir: PathBuf,
    /// Where the drop-in libraries appear in the container.
    pub container_lib_dir: PathBuf,
}

/// A bind mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub host_path: PathBuf,
    pub container_path: PathBuf,
    pub read_only: bool,
}

/// A device node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceNode {
    pub host_path: PathBuf,
    pub container_path: PathBuf,
    pub permissions: String,
}

/// Everything a container gets for one vNIC (CDI's containerEdits).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerEdits {
    pub env: Vec<(String, String)>,
    pub mounts: Vec<Mount>,
    pub device_nodes: Vec<DeviceNode>,
}

/// The CDI name of vNIC `vnic`'s device.
pub fn cdi_name(vnic: &str) -> String {
    format!("{CDI_KIND}={vnic}")
}

/// What a container with `vnic` gets: what `vrdma run` gives it. The vNIC's directory at
/// /run/vrdma (and nothing else of vrdma), the drop-in libraries read-only and first on the
/// loader's path, the verbs device node (a /dev/null placeholder: nothing opens it, but UCX
/// checks that it exists), and the library's environment.
pub fn container_edits(paths: &ContainerPaths, vnic: &str) -> ContainerEdits {
    let lib = paths.container_lib_dir.display().to_string();
    ContainerEdits {
        env: vec![
            ("VRDMA_SOCKET".into(), "/run/vrdma/control.sock".into()),
            ("VRDMA_VNIC".into(), vnic.into()),
            ("LD_LIBRARY_PATH".into(), lib),
        ],
        mounts: vec![
            Mount { host_path: paths.run_dir.join("vnics").join(vnic), container_path: "/run/vrdma".into(), read_only: false },
            Mount { host_path: paths.lib_dir.clone(), container_path: paths.container_lib_dir.clone(), read_only: true },
        ],
        device_nodes: vec![DeviceNode {
            host_path: "/dev/null".into(),
            container_path: Path::new("/dev/infiniband").join(verbs_device_name(vnic)),
            permissions: "rw".into(),
        }],
    }
}

/// The verbs device name of a vNIC, as the library reports it (`vrdma::verbs_device_name`).
fn verbs_device_name(vnic: &str) -> String {
    let mut name = format!("vrdma_{vnic}");
    let mut end = name.len().min(63);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    name.truncate(end);
    name
}

/// Which forms the answer to `Allocate` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EditForms {
    /// CDI device names (`cdi_devices`, Kubernetes ≥ 1.31 with a CDI-enabled runtime).
    pub cdi: bool,
    /// Mounts, environment and device nodes (any kubelet).
    pub mounts: bool,
}

/// The kubelet's answer for one container with `vnic`.
pub fn container_response(forms: EditForms, paths: &ContainerPaths, vnic: &str) -> api::ContainerAllocateResponse {
    let mut r = api::ContainerAllocateResponse::default();
    if forms.cdi {
        r.cdi_devices.push(api::CdiDevice { name: cdi_name(vnic) });
    }
    if forms.mounts {
        let edits = container_edits(paths, vnic);
        r.envs = edits.env.into_iter().collect::<HashMap<_, _>>();
        r.mounts = edits
            .mounts
            .into_iter()
            .map(|m| api::Mount {
                container_path: m.container_path.display().to_string(),
                host_path: m.host_path.display().to_string(),
                read_only: m.read_only,
            })
            .collect();
        r.devices = edits
            .device_nodes
            .into_iter()
            .map(|d| api::DeviceSpec {
                container_path: d.container_path.display().to_string(),
                host_path: d.host_path.display().to_string(),
                permissions: d.permissions,
            })
            .collect();
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths() -> ContainerPaths {
        ContainerPaths { run_dir: "/run/vrdma".into(), lib_dir: "/usr/local/lib/vrdma".into(), container_lib_dir: "/usr/lib/vrdma".into() }
    }

    #[test]
    fn cdi_only_names_the_device() {
        let r = container_response(EditForms { cdi: true, mounts: false }, &paths(), "k8s-n-0");
        assert_eq!(r.cdi_devices, vec![api::CdiDevice { name: "vrdma.io/vnic=k8s-n-0".into() }]);
        assert!(r.mounts.is_empty() && r.envs.is_empty() && r.devices.is_empty());
    }

    #[test]
    fn the_fallback_gives_the_vnic_directory_libraries_and_node() {
        let r = container_response(EditForms { cdi: false, mounts: true }, &paths(), "k8s-n-0");
        assert!(r.cdi_devices.is_empty());
        assert_eq!(r.envs["LD_LIBRARY_PATH"], "/usr/lib/vrdma");
        assert_eq!(r.envs["VRDMA_SOCKET"], "/run/vrdma/control.sock");
        assert_eq!(r.mounts[0].host_path, "/run/vrdma/vnics/k8s-n-0");
        assert_eq!(r.mounts[0].container_path, "/run/vrdma");
        assert!(r.mounts[1].read_only);
        assert_eq!(r.devices[0].container_path, "/dev/infiniband/vrdma_k8s-n-0");
    }
}
