//! What a vNIC device gives a container, as CDI edits.
//!
//! - The vNIC's host directory (`/run/vrdma/vnics/<name>`: its `control.sock`) bind-mounted
//!   at `/run/vrdma`, where the library looks by default: the container sees its own vNIC
//!   and neither the others nor the admin socket, as in `vrdma run`.
//! - `/dev/infiniband/vrdma_<vnic>`: the node `vrdma run` makes, which UCX checks exists
//!   before it uses a verbs device. Nothing opens it (the drop-in talks to the socket), so
//!   it is the null device (1:3) under the verbs device's name, and its host side is
//!   `/dev/null`, which every host has and every runtime's device cgroup already allows.
//! - The environment: `VRDMA_SOCKET` and `VRDMA_VNIC`, as `vrdma run` sets them.
//! - Shared by every vNIC device (the spec-level edits): the drop-in `libibverbs.so.1`
//!   mounted read-only at [`CONTAINER_LIB_DIR`] and `LD_LIBRARY_PATH` naming that directory,
//!   so the loader finds it before the image's own libibverbs (any distribution's path,
//!   and nothing of the image is covered). Its own needs are libc and libgcc_s, which
//!   glibc images have. A command that sets `LD_LIBRARY_PATH` itself must keep
//!   `/opt/vrdma/lib` first in it.
//! - With the drop-in, UCX's tuning for it ([`UCX_TUNING`]).

use std::path::{Path, PathBuf};

use crate::spec::{ContainerEdits, Device, DeviceNode, Mount, Spec};

/// Where the drop-in libibverbs is mounted in the container (first on `LD_LIBRARY_PATH`).
pub const CONTAINER_LIB_DIR: &str = "/opt/vrdma/lib";

/// UCX settings the drop-in needs to run at speed, set in containers that have it (a
/// variable the user set in `vrdma run`'s environment is kept). UCX's registration cache
/// aligns regions to 16 bytes by default, so two buffers side by side on the heap are two
/// regions whose registrations share a page; vrdma cannot hand a peer that page's memfd
/// without the other MR's bytes (docs/security.md), so the second MR is reached through
/// vrdmad's copies, an order of magnitude slower. Page-aligned regions overlap instead, and
/// UCX merges them into one registration.
pub const UCX_TUNING: &[(&str, &str)] = &[("UCX_IB_RCACHE_ADDR_ALIGN", "4096")];

/// The drop-in's file name (the soname programs link against).
pub const DROPIN_FILE: &str = "libibverbs.so.1";

/// Where the vNIC's directory appears in the container (`vrdma_netns::CONTAINER_VNIC_DIR`).
pub const CONTAINER_VNIC_DIR: &str = "/run/vrdma";

/// The host's null device, standing in for the verbs device node.
const NULL_DEVICE: (&str, i64, i64) = ("/dev/null", 1, 3);

/// A vNIC served by this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VnicDevice {
    /// The vNIC's name (the CDI device name).
    pub name: String,
    /// Its host directory (`<run_dir>/vnics/<name>`).
    pub dir: PathBuf,
}

/// The drop-in library on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DropIn {
    /// The file mounted as `CONTAINER_LIB_DIR/libibverbs.so.1`.
    pub path: PathBuf,
}

/// The installed drop-in, found as `vrdma run` finds it: `$VRDMA_LIB_DIR/libibverbs.so.1`,
/// else `<exe's directory>/../lib/vrdma/libibverbs.so.1` (scripts/install-dropin.sh puts it
/// there). None when the file does not exist.
pub fn find_dropin(exe: Option<&Path>) -> Option<DropIn> {
    match std::env::var_os("VRDMA_LIB_DIR") {
        Some(d) => dropin_in(Path::new(&d)),
        None => dropin_in(&exe?.parent()?.parent()?.join("lib").join("vrdma")),
    }
}

/// The drop-in in library directory `dir`, if it is there.
fn dropin_in(dir: &Path) -> Option<DropIn> {
    let path = dir.join(DROPIN_FILE);
    path.is_file().then(|| DropIn { path: std::path::absolute(&path).unwrap_or(path) })
}

/// Whether `name` can be a CDI device name: alphanumerics, `-`, `_` and `.`, beginning and
/// ending with an alphanumeric. (vNIC names allow `-`/`_` at either end; such a vNIC gets
/// no device.)
pub fn is_valid_device_name(name: &str) -> bool {
    let b = name.as_bytes();
    match (b.first(), b.last()) {
        (Some(f), Some(l)) => {
            f.is_ascii_alphanumeric() && l.is_ascii_alphanumeric() && b.iter().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
        }
        _ => false,
    }
}

/// The edits of one vNIC's device.
pub fn device_for(vnic: &VnicDevice) -> Device {
    let node = format!("/dev/infiniband/{}", vrdma::verbs_device_name(&vnic.name));
    let (null_path, major, minor) = NULL_DEVICE;
    Device {
        name: vnic.name.clone(),
        container_edits: ContainerEdits {
            env: vec![format!("VRDMA_SOCKET={CONTAINER_VNIC_DIR}/control.sock"), format!("VRDMA_VNIC={}", vnic.name)],
            device_nodes: vec![DeviceNode {
                path: node,
                host_path: Some(null_path.into()),
                node_type: Some("c".into()),
                major: Some(major),
                minor: Some(minor),
                file_mode: Some(0o666),
                permissions: Some("rw".into()),
            }],
            mounts: vec![Mount {
                host_path: vnic.dir.display().to_string(),
                container_path: CONTAINER_VNIC_DIR.into(),
                options: ["bind", "rw", "nosuid", "nodev", "noexec"].map(String::from).to_vec(),
            }],
        },
    }
}

/// The edits every vNIC device shares: the drop-in library, first on the loader's path.
fn shared_edits(dropin: Option<&DropIn>) -> ContainerEdits {
    let Some(d) = dropin else { return ContainerEdits::default() };
    ContainerEdits {
        env: std::iter::once(format!("LD_LIBRARY_PATH={CONTAINER_LIB_DIR}"))
            .chain(UCX_TUNING.iter().map(|(k, v)| format!("{k}={v}")))
            .collect(),
        device_nodes: vec![],
        mounts: vec![Mount {
            host_path: d.path.display().to_string(),
            container_path: format!("{CONTAINER_LIB_DIR}/{DROPIN_FILE}"),
            // Not noexec: the loader maps the library executable.
            options: ["bind", "ro", "nosuid", "nodev"].map(String::from).to_vec(),
        }],
    }
}

/// Everything a runtime applies for `--device vrdma.io/vnic=<vnic>`: the device's edits,
/// then the spec-level ones (the drop-in). `vrdma run` applies exactly these.
pub fn edits_for(vnic: &VnicDevice, dropin: Option<&DropIn>) -> ContainerEdits {
    let mut edits = device_for(vnic).container_edits;
    let shared = shared_edits(dropin);
    edits.env.extend(shared.env);
    edits.device_nodes.extend(shared.device_nodes);
    edits.mounts.extend(shared.mounts);
    edits
}

/// The spec of `vnics` (sorted by name; those whose names CDI does not allow are left
/// out), or None when no device remains: CDI requires at least one.
pub fn spec_for(vnics: &[VnicDevice], dropin: Option<&DropIn>) -> Option<Spec> {
    let mut devices: Vec<Device> = vnics.iter().filter(|v| is_valid_device_name(&v.name)).map(device_for).collect();
    if devices.is_empty() {
        return None;
    }
    devices.sort_by(|a, b| a.name.cmp(&b.name));
    Some(Spec { cdi_version: crate::CDI_VERSION.into(), kind: crate::KIND.into(), devices, container_edits: shared_edits(dropin) })
}

#[cfg(test)]
mod tests;
