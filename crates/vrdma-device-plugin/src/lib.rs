//! Kubernetes device plugin for vrdma: advertises the node's vNIC slots to the kubelet as the
//! extended resource `vrdma.io/vnic` (device plugin API v1beta1), binds each allocated slot to
//! a fresh vNIC of vrdmad, and answers `Allocate` with the vNIC's CDI device name and, for
//! kubelets without CDI, the same edits as mounts, environment and device nodes.
//!
//! The device ID of a slot is also the name of its vNIC, so the CNI plugin, handed the device
//! ID by Multus (a NetworkAttachmentDefinition with the `k8s.v1.cni.cncf.io/resourceName`
//! annotation), knows which vNIC's address is the pod's.

pub mod admin;
pub mod api;
pub(crate) mod binding;
pub mod edits;
pub mod kubelet;
pub mod plugin;
pub(crate) mod pods;
pub mod server;
pub mod slots;
pub mod tenant;
