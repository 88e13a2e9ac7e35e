//! The CDI spec document (the fields vrdma uses of CDI's SPEC.md, serialised under their
//! JSON names). Empty optional fields are left out, so the document needs no newer spec
//! version than [`crate::CDI_VERSION`].

use serde::{Deserialize, Serialize};

/// A CDI spec: one vendor kind and its devices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    pub devices: Vec<Device>,
    /// Edits applied when any of the devices is requested.
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

/// A device: `--device <kind>=<name>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Device {
    pub name: String,
    pub container_edits: ContainerEdits,
}

/// Edits to the container's OCI spec.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerEdits {
    /// `NAME=VALUE`, added to (replacing) the container's environment.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
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
    pub host_path: String,
    pub container_path: String,
    /// OCI mount options (`bind`, `ro`, …).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}
