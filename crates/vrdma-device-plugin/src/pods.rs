//! Which pod holds a device: the kubelet's pod resources API (`List`), which knows a pod's
//! devices from the moment `Allocate` returned. The device plugin API itself names devices
//! only, never pods.

use std::path::{Path, PathBuf};

use crate::api::podresources::pod_resources_lister_client::PodResourcesListerClient;
use crate::api::podresources::ListPodResourcesRequest;
use crate::kubelet::unix_channel;

/// What failed asking the kubelet.
#[derive(Debug, thiserror::Error)]
pub enum PodsError {
    #[error("connecting to the kubelet's pod resources API at {path}: {source}")]
    Connect { path: PathBuf, source: tonic::transport::Error },
    #[error("the kubelet's pod resources API at {path} failed: {status}")]
    List { path: PathBuf, status: tonic::Status },
}

/// A pod, by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
}

/// The pod one of whose containers holds device `device_id` of `resource_name`.
pub async fn pod_holding(socket: &Path, resource_name: &str, device_id: &str) -> Result<Option<PodRef>, PodsError> {
    let channel = unix_channel(socket).await.map_err(|source| PodsError::Connect { path: socket.into(), source })?;
    let list = PodResourcesListerClient::new(channel)
        .list(ListPodResourcesRequest {})
        .await
        .map_err(|status| PodsError::List { path: socket.into(), status })?
        .into_inner();
    Ok(list
        .pod_resources
        .into_iter()
        .find(|p| {
            p.containers
                .iter()
                .flat_map(|c| &c.devices)
                .any(|d| d.resource_name == resource_name && d.device_ids.iter().any(|id| id == device_id))
        })
        .map(|p| PodRef { namespace: p.namespace, name: p.name }))
}
