//! What a container with a vNIC gets, as the kubelet's `ContainerAllocateResponse`: the CDI
//! device name, and, for kubelets or runtimes without CDI, the same edits spelled as mounts,
//! environment and device nodes. Both come from the vrdma-cdi crate's definition (the
//! device's edits and the spec-wide ones), the one description of what a container gets.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use vrdma_cdi::{ContainerEdits, DropIn, VnicDevice, DROPIN_FILE};

use crate::api;

/// The CDI kind of vrdma's devices (and the extended resource's name).
pub const CDI_KIND: &str = vrdma_cdi::KIND;

/// Where things are on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerPaths {
    /// vrdmad's run directory (the vNIC directories are under `vnics/`).
    pub run_dir: PathBuf,
    /// The directory holding vrdma's drop-in `libibverbs.so.1`.
    pub lib_dir: PathBuf,
}

/// The CDI name of vNIC `vnic`'s device.
pub fn cdi_name(vnic: &str) -> String {
    format!("{CDI_KIND}={vnic}")
}

/// Everything a container with `vnic` gets: the device's edits and the spec-wide ones, as
/// vrdmad's CDI spec has them (the drop-in only while it is installed, as there).
pub fn container_edits(paths: &ContainerPaths, vnic: &str) -> ContainerEdits {
    let device = VnicDevice { name: vnic.into(), dir: paths.run_dir.join("vnics").join(vnic) };
    let lib = paths.lib_dir.join(DROPIN_FILE);
    let dropin = lib.is_file().then_some(DropIn { path: lib });
    let Some(spec) = vrdma_cdi::spec_for(std::slice::from_ref(&device), dropin.as_ref()) else {
        // A name CDI refuses: still the device's own edits.
        return vrdma_cdi::device_for(&device).container_edits;
    };
    let mut edits = spec.container_edits;
    for d in spec.devices {
        edits.env.extend(d.container_edits.env);
        edits.mounts.extend(d.container_edits.mounts);
        edits.device_nodes.extend(d.container_edits.device_nodes);
    }
    edits
}

/// True when the CDI spec in `cdi_dir` (vrdmad's `--cdi-dir`) has a device for `vnic`: a
/// runtime given its CDI name can resolve it.
pub fn spec_lists(cdi_dir: &Path, vnic: &str) -> bool {
    std::fs::read_to_string(vrdma_cdi::spec_path(cdi_dir))
        .ok()
        .and_then(|text| serde_json::from_str::<vrdma_cdi::Spec>(&text).ok())
        .is_some_and(|spec| spec.devices.iter().any(|d| d.name == vnic))
}

/// Which forms the answer to `Allocate` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EditForms {
    /// CDI device names (`cdi_devices`, Kubernetes ≥ 1.31 with a CDI-enabled runtime).
    pub cdi: bool,
    /// Mounts, environment and device nodes (any kubelet).
    pub mounts: bool,
}

/// `edits` in the kubelet's terms.
fn fallback(edits: ContainerEdits, r: &mut api::ContainerAllocateResponse) {
    r.envs = edits.env.iter().filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect::<HashMap<_, _>>();
    r.mounts = edits
        .mounts
        .into_iter()
        .map(|m| api::Mount { read_only: m.options.iter().any(|o| o == "ro"), container_path: m.container_path, host_path: m.host_path })
        .collect();
    r.devices = edits
        .device_nodes
        .into_iter()
        .map(|d| api::DeviceSpec {
            host_path: d.host_path.unwrap_or_else(|| d.path.clone()),
            container_path: d.path,
            permissions: d.permissions.unwrap_or_else(|| "rw".into()),
        })
        .collect();
}

/// The kubelet's answer for one container with `vnic`.
pub fn container_response(forms: EditForms, paths: &ContainerPaths, vnic: &str) -> api::ContainerAllocateResponse {
    let mut r = api::ContainerAllocateResponse::default();
    if forms.cdi {
        r.cdi_devices.push(api::CdiDevice { name: cdi_name(vnic) });
    }
    if forms.mounts {
        fallback(container_edits(paths, vnic), &mut r);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(lib_dir: &str) -> ContainerPaths {
        ContainerPaths { run_dir: "/run/vrdma".into(), lib_dir: lib_dir.into() }
    }

    #[test]
    fn cdi_only_names_the_device() {
        let r = container_response(EditForms { cdi: true, mounts: false }, &paths("/nonexistent"), "k8s-n-0");
        assert_eq!(r.cdi_devices, vec![api::CdiDevice { name: "vrdma.io/vnic=k8s-n-0".into() }]);
        assert!(r.mounts.is_empty() && r.envs.is_empty() && r.devices.is_empty());
    }

    #[test]
    fn the_fallback_gives_the_vnic_directory_library_and_node() {
        let lib = std::env::temp_dir().join(format!("vrdma-dp-edits-{}", std::process::id()));
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join(DROPIN_FILE), b"").unwrap();
        let r = container_response(EditForms { cdi: false, mounts: true }, &paths(lib.to_str().unwrap()), "k8s-n-0");
        std::fs::remove_dir_all(&lib).unwrap();
        assert!(r.cdi_devices.is_empty());
        assert_eq!(r.envs["LD_LIBRARY_PATH"], vrdma_cdi::CONTAINER_LIB_DIR);
        assert_eq!(r.envs["VRDMA_SOCKET"], "/run/vrdma/control.sock");
        assert_eq!(r.envs["VRDMA_VNIC"], "k8s-n-0");
        let vnic = r.mounts.iter().find(|m| m.container_path == "/run/vrdma").unwrap();
        assert_eq!((vnic.host_path.as_str(), vnic.read_only), ("/run/vrdma/vnics/k8s-n-0", false));
        let dropin = r.mounts.iter().find(|m| m.host_path == lib.join(DROPIN_FILE).to_str().unwrap()).unwrap();
        assert!(dropin.read_only);
        assert_eq!(r.devices.len(), 1);
        assert_eq!(r.devices[0].container_path, "/dev/infiniband/vrdma_k8s-n-0");
        assert_eq!(r.devices[0].host_path, "/dev/null");
    }

    #[test]
    fn a_spec_lists_its_devices_only() {
        let dir = std::env::temp_dir().join(format!("vrdma-dp-spec-{}", std::process::id()));
        assert!(!spec_lists(&dir, "a"), "no spec, no device");
        let vnic = VnicDevice { name: "a".into(), dir: "/run/vrdma/vnics/a".into() };
        vrdma_cdi::write_spec(&dir, vrdma_cdi::spec_for(&[vnic], None).as_ref()).unwrap();
        assert!(spec_lists(&dir, "a"));
        assert!(!spec_lists(&dir, "b"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn without_the_drop_in_nothing_of_it_is_mounted() {
        let r = container_response(EditForms { cdi: false, mounts: true }, &paths("/nonexistent"), "k8s-n-0");
        assert_eq!(r.mounts.len(), 1);
        assert!(!r.envs.contains_key("LD_LIBRARY_PATH"));
    }
}
