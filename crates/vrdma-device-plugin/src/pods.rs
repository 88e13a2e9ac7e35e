//! Which pod holds a device: the kubelet's pod resources API (`List`), which knows a pod's
//! devices from the moment `Allocate` returned. The device plugin API itself names devices
//! only, never pods.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::api::podresources::pod_resources_lister_client::PodResourcesListerClient;
use crate::api::podresources::{ListPodResourcesRequest, PodResources};
use crate::kubelet::unix_channel;

/// What failed asking the kubelet.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PodsError {
    #[error("connecting to the kubelet's pod resources API at {path}: {source}")]
    Connect { path: PathBuf, source: tonic::transport::Error },
    #[error("the kubelet's pod resources API at {path} failed: {status}")]
    List { path: PathBuf, status: tonic::Status },
}

/// A pod, by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PodRef {
    pub(crate) namespace: String,
    pub(crate) name: String,
}

/// Every pod the kubelet knows, with its containers' devices.
async fn list(socket: &Path) -> Result<Vec<PodResources>, PodsError> {
    let channel = unix_channel(socket).await.map_err(|source| PodsError::Connect { path: socket.into(), source })?;
    let list = PodResourcesListerClient::new(channel)
        .list(ListPodResourcesRequest {})
        .await
        .map_err(|status| PodsError::List { path: socket.into(), status })?
        .into_inner();
    Ok(list.pod_resources)
}

/// The device IDs of `resource_name` that pod `p` holds.
fn devices_of<'a>(p: &'a PodResources, resource_name: &'a str) -> impl Iterator<Item = &'a String> + 'a {
    p.containers.iter().flat_map(|c| &c.devices).filter(move |d| d.resource_name == resource_name).flat_map(|d| &d.device_ids)
}

/// The pod one of whose containers holds device `device_id` of `resource_name`.
pub(crate) async fn pod_holding(socket: &Path, resource_name: &str, device_id: &str) -> Result<Option<PodRef>, PodsError> {
    Ok(list(socket)
        .await?
        .into_iter()
        .find(|p| devices_of(p, resource_name).any(|id| id == device_id))
        .map(|p| PodRef { namespace: p.namespace, name: p.name }))
}

/// Every device of `resource_name` some pod holds (until the kubelet forgets the pod, after
/// it ended and was deleted).
pub(crate) async fn held_devices(socket: &Path, resource_name: &str) -> Result<HashSet<String>, PodsError> {
    Ok(list(socket).await?.iter().flat_map(|p| devices_of(p, resource_name).cloned().collect::<Vec<_>>()).collect())
}
