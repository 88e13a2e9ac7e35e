//! The CDI spec document (the fields vrdma uses of CDI's SPEC.md, serialised under their
//! JSON names). Empty optional fields are left out, so the document needs no newer spec
//! version than [`crate::CDI_VERSION`].

use serde::{Deserialize, Serialize};

/// A CDI spec: one vendor kind and its devices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    /// The CDI version the document needs (`cdiVersion`).
    pub cdi_version: String,
    /// `vendor/class`: `vrdma.io/vnic`.
    pub kind: String,
    /// One per vNIC of this host.
    pub devices: Vec<Device>,
    /// Edits applied when any of the devices is requested.
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

/// A device: `--device <kind>=<name>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Device {
    /// The device name after `kind=`: the vNIC's name.
    pub name: String,
    /// What requesting this device does to the container.
    pub container_edits: ContainerEdits,
}

/// Edits to the container's OCI spec.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerEdits {
    /// `NAME=VALUE`, added to (replacing) the container's environment.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes made in the container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    /// Bind mounts into the container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

impl ContainerEdits {
    /// No edits at all.
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty() && self.mounts.is_empty()
    }
}

/// A device node made in the container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceNode {
    /// Path in the container.
    pub path: String,
    /// The host's node whose device it is (default: `path`); CDI 0.5.0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// `c` (character) or `b` (block).
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub node_type: Option<String>,
    /// The device's major number (default: the host node's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    /// The device's minor number (default: the host node's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    /// Permission bits of the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_mode: Option<u32>,
    /// The device cgroup's access: some of `r`, `w`, `m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
}

/// A mount in the container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    /// What is mounted, on the host.
    pub host_path: String,
    /// Where it appears in the container.
    pub container_path: String,
    /// OCI mount options (`bind`, `ro`, …).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}
